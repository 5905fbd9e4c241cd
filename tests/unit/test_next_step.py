"""The one mapping from a lane's holding reason to its next step
(controller/advice.py::next_step): its words and at most one command, per reason; the
run's one step (``run_next_step``) and ``laneway run``'s exit message built from it
(controller/foreground.py::ForegroundResult.notices)."""

from __future__ import annotations

from typing import Any

import pytest

from laneway.controller import advice, usage
from laneway.controller.foreground import Ending, ForegroundResult
from laneway.controller.status_model import NextStep, StatusReport
from tests.status_bodies import typed

RT = "/rt"
NEW_RUN = f"laneway run CONFIG --new --runtime-dir {RT}"
RECONCILE = f"laneway reconcile 9 --as succeeded|failed|not-run --reason '...' --runtime-dir {RT}"
SPENT = f"{usage.BUDGET_SPENT}: budget (run) — cost_usd: spent 3 + reserved 0 = 3 reaches 3"
DRIFT = (
    "frozen sources changed: /src/a.py: sha256 1111… != frozen 2222…; "
    "/src/b.sh: unreadable (No such file or directory); frozen 3333"
)
BREAKER = "infrastructure failures of 2 distinct items in a row (i0, i1); breaker threshold 2"


def held(code: str, reason: str = "", **lane: Any) -> dict[str, Any]:
    """A lane with one ready job, held by ``code`` (a control's ``reason``)."""
    detail: dict[str, Any] = {"scope": "run", "reason": reason} if reason else {}
    if code == "no_worker":
        detail = {"start": f"laneway worker --node n1 --runtime-dir {RT}"}
    return {"ready": 1, "reason": {"code": code, "words": code, "detail": detail}, **lane}


def report(*lanes: dict[str, Any], **body: Any) -> StatusReport:
    run = {"id": 7, "name": "t", "state": "active", "runtime_dir": RT}
    return typed({"run": run, "lanes": list(lanes), **body})


def step(lane: dict[str, Any], **body: Any) -> NextStep:
    status = report(lane, **body)
    return advice.next_step(status.lanes[0], status)


@pytest.mark.parametrize(
    ("lane", "code", "command"),
    [
        (
            held("halted", "disk full"),
            "halted",
            f"laneway clear-halt 7 --reason '...' --runtime-dir {RT}",
        ),
        (
            held("paused", "maintenance"),
            "paused",
            f"laneway resume 7 --reason '...' --runtime-dir {RT}",
        ),
        (
            held("stopped", "enough"),
            "stopped",
            f"laneway resume 7 --reason '...' --runtime-dir {RT}",
        ),
        (held("paused", BREAKER), "breaker", f"laneway resume 7 --reason '...' --runtime-dir {RT}"),
        (held("paused", SPENT), "budget", NEW_RUN),
        (held("budget"), "budget", NEW_RUN),
        (held("halted", DRIFT), "sources_changed", NEW_RUN),
        (held("no_worker"), "no_worker", f"laneway worker --node n1 --runtime-dir {RT}"),
        (held("max_jobs"), "max_jobs", None),
        (held("slots_full"), "slots_full", None),
        (held("lane_cap"), "lane_cap", None),
        (held("needs_pending"), "needs_pending", None),
        (held("memory_floor"), "memory_floor", None),
        ({"ready": 0, "done": 3}, "done", None),
        ({"running": 1, "ready": 1}, "running", None),
        ({"ready": 1}, "unrecorded", None),
    ],
)
def test_each_reason_has_one_step(lane, code, command):
    got = step(lane)
    assert (got.code, got.command) == (code, command)
    assert got.line() == (got.words if command is None else f"{got.words}: {command}")


def test_capacity_refusals_say_they_clear_by_themselves():
    for code in ("max_jobs", "slots_full", "lane_cap", "stage_cap", "needs_pending", "batch_cap"):
        assert step(held(code)).words.startswith("nothing to do"), code


def test_a_budget_pause_is_never_resumed_and_counts_what_is_reused():
    got = step(held("paused", SPENT), totals={"succeeded": 4, "ready": 1})
    assert got.command == NEW_RUN
    assert "raise `budget`" in got.words and "4 succeeded job(s) are reused" in got.words
    assert "laneway resume" not in got.line()


def test_changed_sources_name_every_file_and_a_new_run():
    got = step(held("halted", DRIFT))
    assert "(/src/a.py, /src/b.sh)" in got.words
    assert "`clear-halt` cannot" in got.words and "laneway clear-halt" not in got.line()


def test_unknown_attempts_come_before_any_control_or_refusal():
    unknown = [{"attempt_id": 9, "reconcile": RECONCILE}]
    for lane in (held("halted", DRIFT), held("paused", SPENT), held("max_jobs")):
        got = step(lane, unknown=unknown)
        assert (got.code, got.command) == ("unknown_outcome", RECONCILE)


def test_a_global_control_is_lifted_with_all():
    control = {"kind": "pause", "scope": "global", "reason": "x"}
    got = step(held("paused", "x"), controls=[control])
    assert got.command == f"laneway resume --all --reason '...' --runtime-dir {RT}"


def test_the_runs_step_is_the_one_that_must_come_first():
    lanes = [
        held("max_jobs", lane="a"),
        held("no_worker", lane="b"),
        held("paused", "maintenance", lane="c"),
        held("halted", DRIFT, lane="d"),
        {"lane": "e", "done": 2},
    ]
    got = advice.run_next_step(report(*lanes))
    assert got is not None and got.code == "sources_changed"
    assert advice.run_next_step(report(held("max_jobs"), {"lane": "b", "done": 1})) is None


def test_the_action_cell_is_empty_for_running_and_done_lanes():
    assert advice.action_words(step({"running": 1})) is None
    assert advice.action_words(step({"done": 1})) is None
    assert advice.action_words(step(held("max_jobs"))) == advice.WAITS["max_jobs"]


def test_a_report_read_back_keeps_its_steps():
    status = report(held("paused", SPENT), {"lane": "b", "done": 1})
    for lane in status.lanes:
        lane.next_step = advice.next_step(lane, status)
    body = status.as_dict()
    assert body["lanes"][0]["next_step"]["command"] == NEW_RUN
    assert body["lanes"][1]["next_step"] == {
        "code": "done",
        "words": body["lanes"][1]["next_step"]["words"],
        "command": None,
    }
    again = StatusReport.from_dict(body)
    assert again.as_dict() == body
    assert advice.lane_step(again.lanes[0], again) == status.lanes[0].next_step


def ended(final: StatusReport, blocked: str = "halted: x") -> ForegroundResult:
    return ForegroundResult(7, Ending.BLOCKED, blocked, "laneway run --continue 7", final)


def test_the_exit_message_of_changed_sources_names_the_new_run_not_continue():
    notices = ended(report(held("halted", DRIFT))).notices()
    assert [n.event for n in notices] == ["run_blocked", "run_sources_changed"]
    assert notices[1].fields["command"] == NEW_RUN and NEW_RUN in notices[1].words
    assert "--continue" not in " ".join(n.words for n in notices)
    assert notices[0].fields["next_step"]["code"] == "sources_changed"


def test_the_exit_message_of_a_halt_names_its_clear_halt_then_continue():
    notices = ended(report(held("halted", "disk full"))).notices()
    assert [n.event for n in notices] == ["run_blocked", "run_not_finished"]
    clear = f"laneway clear-halt 7 --reason '...' --runtime-dir {RT}"
    assert notices[0].words.endswith(f"; next: once the cause is fixed: {clear}")
    assert notices[1].fields["command"] == "laneway run --continue 7"


def test_the_exit_message_of_a_budget_says_how_many_are_reused():
    final = report(held("paused", SPENT), totals={"succeeded": 5, "ready": 1})
    notices = ended(final, "paused: " + SPENT).notices()
    assert [n.event for n in notices] == ["run_blocked", "run_budget_spent"]
    assert f"`{NEW_RUN}`" in notices[1].words and "(5) is reused" in notices[1].words
    assert "laneway resume" not in " ".join(n.words for n in notices)


def test_a_lane_whose_attempts_are_all_unverified_says_start_a_worker_which_adopts_them():
    start = f"laneway worker --node n1 --runtime-dir {RT}"
    lane = {"running": 2, "ready": 1}
    running = [
        {
            "attempt_id": n,
            "lane": "a",
            "node": "n1",
            "item": f"i{n}",
            "stage": "s",
            "state": "running",
            "elapsed_seconds": 9.0,
            "worker_id": "w-1",
        }
        for n in (1, 2)
    ]
    unverified = [
        {**r, "verified": False, "unverified_because": "worker w-1 stale for 12 s"} for r in running
    ]
    no_worker = [{"node": "n1", "start": start}]
    got = step(lane, running=unverified, no_worker=no_worker)
    assert (got.code, got.command) == ("no_worker", start)
    assert "worker w-1 stale for 12 s" in got.words and "adopts" in got.words
    # One attempt its worker vouches for: the lane runs, nothing to do.
    mixed = [unverified[0], running[1]]
    assert step(lane, running=mixed, no_worker=no_worker).code == "running"
    # The controller is gone as well: continuing the run comes first.
    gone = {"state": "gone", "pid": None, "words": "no controller runs"}
    assert step(lane, running=unverified, no_worker=no_worker, controller=gone).code == (
        "no_controller"
    )
