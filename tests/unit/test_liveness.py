"""A worker's liveness is derived in one place (``status_nodes.worker_liveness``), at each
boundary: ``live`` up to ``STALE_AFTER_SECONDS`` inclusive, ``stale`` up to
``LOST_AFTER_SECONDS`` inclusive, ``lost`` after; a row that says lost or stopped wins
over any age. The lanes' next step is ``no_controller`` only while the run is active and
the controller is ``gone``, and never in place of an unknown outcome or another step a
person must take first."""

from __future__ import annotations

import pytest

from laneway.controller import advice
from laneway.controller.status_model import ControllerState
from laneway.controller.status_nodes import (
    LOST_AFTER_SECONDS,
    STALE_AFTER_SECONDS,
    worker_liveness,
)
from tests.status_bodies import typed


@pytest.mark.parametrize(
    ("state", "age", "liveness"),
    [
        ("active", -1.0, "live"),  # a heartbeat "ahead" of the reader's clock
        ("active", 0.0, "live"),
        ("active", STALE_AFTER_SECONDS, "live"),
        ("active", STALE_AFTER_SECONDS + 0.01, "stale"),
        ("active", LOST_AFTER_SECONDS, "stale"),
        ("active", LOST_AFTER_SECONDS + 0.01, "lost"),
        ("lost", 0.0, "lost"),
        ("stopped", 0.0, "stopped"),
        ("stopped", LOST_AFTER_SECONDS * 10, "stopped"),
    ],
)
def test_worker_liveness_at_each_boundary(state, age, liveness):
    assert worker_liveness(state, age) == liveness


def test_stale_is_a_few_heartbeats_and_well_before_lost():
    # The worker heartbeats every at most 2 s (cli/commands_services.py): three missed.
    assert 3 * 2.0 <= STALE_AFTER_SECONDS < LOST_AFTER_SECONDS


def report(*, state="active", controller="gone", unknown=False, lane=None):
    body = {
        "run": {"id": 4, "state": state, "runtime_dir": "/rt dir"},
        "lanes": [lane or {"lane": "a", "running": 1}],
        "unknown": [{"attempt_id": 9, "reconcile": "laneway reconcile 9"}] if unknown else [],
    }
    status = typed(body)
    status.controller = ControllerState(controller, None, "words")
    return status


def test_no_controller_only_while_the_run_is_active_and_the_controller_gone():
    status = report()
    step = advice.next_step(status.lanes[0], status)
    assert step.code == "no_controller"
    assert step.command == "laneway run --continue 4 --runtime-dir '/rt dir'"
    assert "laneway controller --runtime-dir '/rt dir'" in step.words
    assert advice.run_next_step(status_with(status, step)) == step
    for other in (report(controller="running"), report(controller="unknown")):
        assert advice.next_step(other.lanes[0], other).code == "running"
    finished = report(state="finished", lane={"lane": "a", "done": 2})
    assert advice.next_step(finished.lanes[0], finished).code == "done"


def status_with(status, step):
    status.lanes[0].next_step = step
    return status


def test_no_controller_never_hides_what_a_person_must_do_first():
    unknown = report(unknown=True, lane={"lane": "a", "ready": 1})
    assert advice.next_step(unknown.lanes[0], unknown).code == "unknown_outcome"
    halted = report(
        lane={"lane": "a", "ready": 1, "reason": {"code": "halted", "detail": {"reason": "x"}}}
    )
    assert advice.next_step(halted.lanes[0], halted).code == "halted"
    idle = report(lane={"lane": "a", "ready": 1, "reason": {"code": "slots_full"}})
    assert advice.next_step(idle.lanes[0], idle).code == "no_controller"


def test_the_runs_step_is_what_a_person_must_lift_before_no_controller():
    status = report(
        lane={"lane": "a", "ready": 1, "reason": {"code": "budget", "detail": {}}},
    )
    done = typed({"run": {"id": 4, "state": "active"}, "lanes": [{"lane": "b", "done": 3}]}).lanes[
        0
    ]
    status.lanes.append(done)
    for lane in status.lanes:
        lane.next_step = advice.next_step(lane, status)
    # A done lane is done: only a run with work it could do needs its controller.
    assert [lane.next_step.code for lane in status.lanes] == ["budget", "done"]
    step = advice.run_next_step(status)
    assert step is not None and step.code == "budget"
