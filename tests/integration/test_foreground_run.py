"""`laneway run`'s loop below the CLI (controller/foreground.py): with a real worker
service in this process (its supervisors are real processes) and the controller's work
done here, a run ends finished (exit 0, nothing to say), blocked by a halt (exit 3, the
reason and the command that continues it once unblocked) or interrupted (exit 130, the
command that continues it); the observer sees the statuses and is closed before the
final status is read. The exit-code table and the blocked decision are also checked on
hand-made statuses."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from laneway.controller import db
from laneway.controller.clock import SystemClock
from laneway.controller.foreground import (
    Ending,
    ForegroundResult,
    ForegroundRun,
    RunView,
    read_view,
)
from laneway.controller.states import ControlKind
from laneway.controller.status_model import StatusReport
from laneway.workers.service import WorkerService
from tests.integration.test_worker import PLENTY
from tests.status_bodies import typed
from tests.support import GATE_BOUND, control_run, make_config, py_stage, wait_for_file

pytestmark = pytest.mark.slow

WAIT_FOR = "import pathlib, sys\npathlib.Path(sys.argv[2]).touch()\n" + wait_for_file("sys.argv[3]")


class Recorder:
    """An observer that keeps what it was told."""

    def __init__(self) -> None:
        self.shown: list[StatusReport] = []
        self.notes: list[str] = []
        self.closeouts = 0
        self.closed = False

    def show(self, status: StatusReport, source: Any = None) -> None:
        assert not self.closed
        self.shown.append(status)

    def note(self, line: str) -> None:
        self.notes.append(line)

    def closeout_running(self) -> None:
        self.closeouts += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def foreground(engine, runtime, make_run):
    """A run of a config with one started worker service for node n1."""

    def _make(config, *, slots: int = 4) -> ForegroundRun:
        run_id = make_run(config)
        worker = WorkerService(
            engine, node="n1", slots=slots, memory_probe=lambda: PLENTY, runtime_dir=runtime
        )
        worker.start()
        return ForegroundRun(engine, run_id, runtime, [worker])

    return _make


def never() -> bool:
    return False


def test_a_run_whose_jobs_succeed_ends_finished(foreground, engine):
    config = make_config(
        [py_stage("first", "pass"), py_stage("second", "pass", needs=["first"])], 3
    )
    run = foreground(config)
    seen = Recorder()

    ended = run.run(seen, should_stop=never, should_abort=never)

    assert ended.ending is Ending.FINISHED
    assert (ended.exit_code, ended.blocked, ended.notices()) == (0, None, [])
    assert ended.final.run.state == "finished"
    assert ended.final.totals == {"succeeded": 6}
    assert seen.closed and seen.shown and seen.notes == []
    assert ended.continue_command.startswith(f"laneway run --continue {run.run_id} ")
    assert run.workers[0].in_flight == {}


def test_a_halted_run_ends_blocked_with_the_reason_and_how_to_go_on(foreground, engine):
    run = foreground(make_config(items=2))
    with db.transaction(db.session_factory(engine)) as session:
        control_run(
            session,
            ControlKind.HALT,
            run.run_id,
            reason="disk full",
            actor="ops",
            now=SystemClock().now(),
        )
    seen = Recorder()

    ended = run.run(seen, should_stop=never, should_abort=never)

    assert ended.ending is Ending.BLOCKED
    assert ended.exit_code == 3
    assert ended.blocked is not None and "disk full" in ended.blocked
    assert ended.final.totals == {"ready": 2}  # nothing was claimed
    events = [(n.event, n.fields["run_id"]) for n in ended.notices()]
    assert events == [("run_blocked", run.run_id), ("run_not_finished", run.run_id)]
    going_on = ended.notices()[1]
    assert going_on.fields["command"] == ended.continue_command
    assert "once it is unblocked, continue it with: laneway run --continue" in going_on.words
    assert all(n.fields["message"] == n.words for n in ended.notices())
    assert seen.closed


def test_a_signal_interrupts_the_run_after_draining_what_runs(foreground, tmp_path):
    started, release = tmp_path / "started", tmp_path / "release"
    stage = py_stage("wait", WAIT_FOR, timeout_seconds=GATE_BOUND)
    stage["argv"] += [str(started), str(release)]
    run = foreground(make_config([stage], 3), slots=1)
    signalled = threading.Event()

    def should_stop() -> bool:
        # The first attempt runs: the "signal" comes, and the job may end (drained).
        if started.exists() and not signalled.is_set():
            signalled.set()
            release.touch()
        return signalled.is_set()

    ended = run.run(Recorder(), should_stop=should_stop, should_abort=never)

    assert ended.ending is Ending.INTERRUPTED
    assert ended.exit_code == 130
    assert ended.blocked is None
    # The attempt that ran was drained and settled; nothing new was claimed after.
    assert ended.final.totals == {"succeeded": 1, "ready": 2}
    assert run.workers[0].in_flight == {}
    [notice] = ended.notices()
    assert notice.event == "run_not_finished"
    assert notice.words == (
        f"laneway: run {run.run_id} is not finished; continue it with: {ended.continue_command}"
    )


def status(
    state: str = "active",
    *,
    unknown: int = 0,
    lanes: list[dict[str, Any]] | None = None,
    closeout: str = "none",
    controls: list[dict[str, Any]] | None = None,
) -> StatusReport:
    """A status with the parts the loop reads (controller/status.py's shape)."""
    return typed(
        {
            "run": {"state": state},
            "unknown": [{"attempt_id": n} for n in range(unknown)],
            "lanes": lanes or [],
            "closeout": {"state": closeout},
            "controls": controls or [],
        }
    )


def lane(code: str | None, words: str = "", ready: int = 1) -> dict[str, Any]:
    reason = None if code is None else {"code": code, "words": words}
    return {"ready": ready, "waiting": 0, "reason": reason}


@pytest.mark.no_ledger
def test_blocked_only_when_every_lane_with_work_waits_for_an_operator():
    assert read_view(status(unknown=2)).blocked_reason() == (
        "2 unknown attempt(s) await `laneway reconcile`"
    )
    held = status(lanes=[lane("halted", "halted: x"), lane("paused", "paused: y")])
    assert read_view(held).blocked_reason() == "halted: x; paused: y"
    # One lane could still move (no capacity now, a worker may come): not blocked.
    assert (
        read_view(status(lanes=[lane("halted", "h"), lane("no_capacity")])).blocked_reason() is None
    )
    assert read_view(status(lanes=[lane(None)])).blocked_reason() is None
    # A lane with nothing left to start does not count.
    assert (
        read_view(status(lanes=[lane("halted", "h"), lane(None, ready=0)])).blocked_reason() == "h"
    )
    assert read_view(status()).blocked_reason() is None


@pytest.mark.no_ledger
def test_closeout_underway_and_finished_are_read_from_the_status():
    assert read_view(status(closeout="running")).closeout_underway
    assert not read_view(status(closeout="pending")).closeout_underway
    assert read_view(status("finished", closeout="pending")).closeout_underway
    assert not read_view(status("finished", closeout="finished")).closeout_underway
    view = read_view(status("finished"))
    assert view == RunView(
        finished=True, unknown=0, holds=(), closeout_underway=False, budget_spent=False
    )


@pytest.mark.no_ledger
@pytest.mark.parametrize(
    ("ending", "state", "code", "said"),
    [
        (Ending.FINISHED, "finished", 0, []),
        (Ending.BLOCKED, "active", 3, ["run_blocked", "run_not_finished"]),
        (Ending.BLOCKED, "finished", 3, []),  # finished meanwhile: nothing to say
        (Ending.INTERRUPTED, "active", 130, ["run_not_finished"]),
        (Ending.INTERRUPTED, "finished", 0, []),  # it finished while draining
        (Ending.UNFINISHED, "active", 1, ["run_not_finished"]),
    ],
)
def test_exit_code_and_notices_follow_the_ending_and_the_final_state(ending, state, code, said):
    ended = ForegroundResult(
        run_id=7,
        ending=ending,
        blocked="halted: x" if ending is Ending.BLOCKED else None,
        continue_command="laneway run --continue 7 --runtime-dir /rt",
        final=status(state),
    )
    assert ended.exit_code == code
    assert [n.event for n in ended.notices()] == said


@pytest.mark.no_ledger
def test_a_spent_budget_says_to_raise_it_not_to_continue():
    spent = "nothing more fits the budget: usd 10 of 10"
    held = lane("paused", f"paused: {spent}")
    held["reason"]["detail"] = {"scope": "run", "reason": spent}
    final = status(controls=[{"reason": spent}], lanes=[held])
    ended = ForegroundResult(7, Ending.BLOCKED, "paused", "laneway run --continue 7", final)
    assert [n.event for n in ended.notices()] == ["run_blocked", "run_budget_spent"]
    assert "laneway run CONFIG --new" in ended.notices()[1].words
    assert "resume" not in " ".join(n.words for n in ended.notices())


class RefillingWorker:
    """A local worker whose supervisors keep exiting for ``busy_passes`` passes: each
    tick refills, and after it another slot is already due (short jobs on every slot)."""

    def __init__(self, busy_passes: int, log: list[str]) -> None:
        self.busy_passes = busy_passes
        self.log = log
        self.passes = 0
        self.in_flight: dict[int, object] = {}

    def tick(self) -> Any:
        self.passes += 1
        self.log.append("refill")
        return type("Tick", (), {"claimed": 1, "settled": 1})()

    def refill_due(self) -> bool:
        return self.passes <= self.busy_passes

    def wait(self, timeout: float) -> None:
        return None


@pytest.mark.parametrize("defer", [1e9, 0.0])
def test_periodic_work_waits_while_slots_refill(engine, runtime, make_run, monkeypatch, defer):
    """While a freed slot waits to be refilled, the controller's steps and the status
    look are put off (for PERIODIC_DEFER_SECONDS at most); with no deferral allowed they
    run on every pass."""
    from laneway.controller import foreground as foreground_module

    log: list[str] = []
    worker = RefillingWorker(busy_passes=5, log=log)
    run = ForegroundRun(engine, make_run(make_config(items=1)), runtime, [worker])
    monkeypatch.setattr(foreground_module, "PERIODIC_DEFER_SECONDS", defer)
    monkeypatch.setattr(run.daemon, "beat", lambda: log.append("beat"))
    monkeypatch.setattr(run.daemon, "due", lambda: True)
    monkeypatch.setattr(run.daemon, "tick", lambda: log.append("tick") or _NoReport())
    run.daemon.controller_id = 1  # registered: only the periodic beat remains
    passes = iter(range(8))

    run._serve(Recorder(), should_stop=lambda: next(passes) >= 7)

    refills = [i for i, what in enumerate(log) if what == "refill"]
    assert len(refills) == 8
    periodic_after = [log[i + 1 : i + 2] == ["beat"] for i in refills]
    if defer:
        # Passes 1-5 end with a slot due: nothing periodic runs after their refill.
        assert periodic_after == [False] * 5 + [True] * 3
    else:
        assert periodic_after == [True] * 8
    assert log.count("tick") == periodic_after.count(True)


class _NoReport:
    promoted = ()
    closed = ()
