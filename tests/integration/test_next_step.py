"""One next step per holding reason (controller/advice.py::next_step): a run held by each
reason, arranged through the ledger as laneway holds it (a real budget pause, a real
halt over changed sources, the real infrastructure breaker, a real unknown attempt, a
real max_jobs refusal), gives the same step and command in ``laneway status --json``,
its text, the web API (``Dashboard.state``, ``/api/state``'s body) and the live display
of ``laneway run`` and ``status --watch`` (cli/live.py, terminal and plain lines). A
budget and changed sources name a new run (``laneway run CONFIG --new``), never
``resume`` or ``clear-halt``; a lane with nothing left to start says done, unless its
run is halted by an unknown outcome. A lost worker beside a live controller, a controller
that is gone while the run has work, and a finished run are held the same way. Beside
each lane's step, the run's one step (``StatusReport.next_step``, ``advice.run_next_step``)
is the same in ``status`` (text and --json), the web API, ``explain``'s job and the
report."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import select

from laneway.cli import live, render
from laneway.controller import db, ledger, pipeline, readonly
from laneway.controller.clock import SystemClock
from laneway.controller.daemon import Controller
from laneway.controller.models import Job
from laneway.controller.outcome import Outcome
from laneway.controller.states import ControlKind
from laneway.controller.status import status_report
from laneway.controller.status_model import StatusReport
from laneway.controller.web import Dashboard
from tests.integration.test_cli import invoke
from tests.support import (
    FixedClock,
    claim_on_n1,
    claim_one_on_n1,
    control_run,
    controller_serving,
    make_config,
    py_stage,
    settle_one,
)


@pytest.fixture
def _controller_serves(runtime):
    """Each reason is arranged with a controller serving the run (``controller_serving``):
    the step is the reason's; without one it would be ``no_controller``, unless the run
    needs a person first (the ``controller_gone`` reason arranges that)."""
    with controller_serving(runtime):
        yield


@pytest.fixture
def clock() -> FixedClock:
    """Now, so the CLI (which reads the wall clock) sees the workers' heartbeats fresh."""
    return FixedClock(SystemClock().now())


class Held:
    """A run arranged to be held by one reason: its id, the lane that holds, the code
    and command its next step must carry, and words it must say. The run's own step
    (``StatusReport.next_step``, what every view leads with) is the lane's when that has
    a command, else none (``run_step`` overrides)."""

    def __init__(
        self,
        run_id: int,
        lane: str,
        code: str,
        command: str | None,
        *words: str,
        run_step: tuple[str, str | None] | bool | None = True,
    ):
        self.run_id, self.lane, self.code, self.command = run_id, lane, code, command
        self.words = words
        if run_step is True:
            run_step = (code, command) if command is not None else None
        self.run_step = run_step


Arrange = Callable[..., Held]


def _control(kind: ControlKind, reason: str) -> Arrange:
    def arrange(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
        run_id = make_run(make_config(items=2))
        register_worker()
        with db.transaction(factory) as session:
            control_run(session, kind, run_id, reason=reason, actor="ops", now=clock.now())
        verb = "clear-halt" if kind is ControlKind.HALT else "resume"
        command = f"laneway {verb} {run_id} --reason '...' --runtime-dir {runtime}"
        code = {ControlKind.HALT: "halted", ControlKind.PAUSE: "paused"}.get(kind, "stopped")
        return Held(run_id, "a", code, command, "once the cause is fixed")

    return arrange


def budget(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    # Expected 1 fits a budget of 3; the attempt spends 3; the next (3 + p90 3 > 3) is
    # refused with nothing running: the claim pauses the run (usage.BUDGET_SPENT).
    stage = py_stage("only", "pass", expected_usage={"cost_usd": 1})
    run_id = make_run(make_config([stage], items=3, budget={"cost_usd": 3}))
    worker = register_worker()
    (first,) = claim_on_n1(factory, worker, clock)
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED, result={"usage": {"cost_usd": 3}})
    assert claim_on_n1(factory, worker, clock) == []
    command = f"laneway run CONFIG --new --runtime-dir {runtime}"
    return Held(run_id, "a", "budget", command, "raise `budget`", "1 succeeded job(s) are reused")


def sources_changed(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    source = tmp_path / "experiment.py"
    source.write_text("VERSION = 1\n")
    config = make_config(items=2, sources=[str(source)])
    run_id = make_run(config, source_hashes={str(source): pipeline.hash_file(source)})
    worker = register_worker()

    def claim() -> list[Any]:
        drift: Callable[[Any], list[str]] = lambda r: pipeline.source_drift(r.source_hashes)  # noqa: E731
        return claim_on_n1(factory, worker, clock, check_sources=drift)

    (first,) = claim()
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    source.write_text("VERSION = 2  # edited under the run\n")
    assert claim() == []  # the claim halts the run over its changed source
    command = f"laneway run CONFIG --new --runtime-dir {runtime}"
    return Held(run_id, "a", "sources_changed", command, str(source), "`clear-halt` cannot")


def breaker(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    run_id = make_run(make_config(items=3, infra_breaker=2))
    worker = register_worker()
    for claimed in claim_on_n1(factory, worker, clock, slots=2):
        settle_one(factory, claimed, worker, clock, Outcome.INFRA_FAILURE, reason="no disk")
    command = f"laneway resume {run_id} --reason '...' --runtime-dir {runtime}"
    return Held(run_id, "a", "breaker", command, "infrastructure breaker")


def unknown(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    run_id = make_run(make_config(items=2))
    worker = register_worker()
    claimed = claim_one_on_n1(factory, worker, clock, unknown="lease expired")
    command = (
        f"laneway reconcile {claimed.attempt_id} --as succeeded|failed|not-run "
        f"--reason '...' --runtime-dir {runtime}"
    )
    return Held(run_id, "a", "unknown_outcome", command, "reconcile the unknown attempt")


def no_worker(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    run_id = make_run(make_config(items=1))
    command = f"laneway worker --node n1 --runtime-dir {runtime}"
    return Held(run_id, "a", "no_worker", command, "start a worker")


def max_jobs(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    lanes = [{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}]
    items = [{"key": "x", "lane": "a"}, {"key": "y", "lane": "b"}]
    run_id = make_run(make_config(items=items, lanes=lanes, max_jobs=1))
    worker = register_worker()
    (claimed,) = claim_on_n1(factory, worker, clock, slots=2)
    held = "b" if claimed.lane == "a" else "a"
    return Held(run_id, held, "max_jobs", None, "nothing to do")


def done(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    run_id = make_run(make_config(items=1))
    worker = register_worker()
    (claimed,) = claim_on_n1(factory, worker, clock)
    settle_one(factory, claimed, worker, clock, Outcome.SUCCEEDED)
    return Held(run_id, "a", "done", None, "done")


def unknown_nothing_pending(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    # The lane's one job is unknown, nothing else is pending: not "done" while it halts.
    run_id = make_run(make_config(items=1))
    worker = register_worker()
    claimed = claim_one_on_n1(factory, worker, clock, unknown="lease expired")
    command = (
        f"laneway reconcile {claimed.attempt_id} --as succeeded|failed|not-run "
        f"--reason '...' --runtime-dir {runtime}"
    )
    return Held(run_id, "a", "unknown_outcome", command, "reconcile the unknown attempt")


def worker_lost(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    # The controller lives; the worker that runs the lane's attempt was judged lost.
    run_id = make_run(make_config(items=2))
    worker = register_worker()
    claim_one_on_n1(factory, worker, clock)
    with db.transaction(factory) as session:
        ledger.mark_worker_lost(session, worker, now=clock.now(), actor="c", reason="gone quiet")
    command = f"laneway worker --node n1 --runtime-dir {runtime}"
    return Held(run_id, "a", "no_worker", command, "nobody can say its 1 attempt(s) still run")


def controller_gone(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    # No controller serves a run with work it could do: the last one stopped cleanly
    # (arranged without the lock, so on SQLite no live process holds its pidfile).
    run_id = make_run(make_config(items=2))
    register_worker()
    with db.transaction(factory) as session:
        now = db.ledger_now(session, clock)
        served, _ = ledger.register_controller(session, host="h", pid=1, boot_id="b", now=now)
        ledger.controller_heartbeat(session, served, now=now, notify_cursor=None, stopped=True)
    command = f"laneway run --continue {run_id} --runtime-dir {runtime}"
    # Its worker lives: dispatching goes on, and the words say so (not "nothing is
    # dispatched").
    return Held(run_id, "a", "no_controller", command, "workers go on dispatching")


def finished(factory, make_run, register_worker, clock, runtime, tmp_path) -> Held:
    run_id = make_run(make_config(items=1))
    worker = register_worker()
    (claimed,) = claim_on_n1(factory, worker, clock)
    settle_one(factory, claimed, worker, clock, Outcome.SUCCEEDED)
    Controller(engine_of(factory), clock=clock).tick()  # closes the run
    return Held(run_id, "a", "done", None, "done")


def engine_of(factory) -> Any:
    with factory() as session:
        return session.get_bind()


REASONS: dict[str, Arrange] = {
    "halt": _control(ControlKind.HALT, "disk full"),
    "pause": _control(ControlKind.PAUSE, "maintenance"),
    "stop": _control(ControlKind.STOP, "enough for today"),
    "budget": budget,
    "sources_changed": sources_changed,
    "breaker": breaker,
    "unknown": unknown,
    "no_worker": no_worker,
    "max_jobs": max_jobs,
    "done": done,
    "unknown_nothing_pending": unknown_nothing_pending,
    "worker_lost": worker_lost,
    "controller_gone": controller_gone,
    "finished": finished,
}


def live_text(report: StatusReport) -> str:
    console = Console(file=io.StringIO(), width=2000, color_system=None)
    console.print(live.renderable(report, None, {}))
    return console.file.getvalue()  # type: ignore[attr-defined]


def plain_lines(report: StatusReport) -> list[str]:
    out = io.StringIO()
    live.Progress(report.run.id, stream=out, live=False).show(report)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("reason", list(REASONS))
def test_every_reader_gives_the_same_next_step(
    reason, factory, make_run, register_worker, clock, runtime, tmp_path
):
    held = REASONS[reason](factory, make_run, register_worker, clock, runtime, tmp_path)
    with contextlib.ExitStack() as stack:
        if reason != "controller_gone":
            stack.enter_context(controller_serving(runtime))
        every_view_says(held, factory, clock, runtime)


def every_view_says(held: Held, factory, clock, runtime) -> None:
    """Each view gives the lane's step and the run's one step."""

    # The web API: the page's "what to do" (``action``) and the typed step.
    dashboard = Dashboard(runtime, now=clock.now)
    try:
        web = dashboard.state(held.run_id)
    finally:
        dashboard.close()
    web_lane = next(lane for lane in web["lanes"] if lane["lane"] == held.lane)
    action = web_lane["action"]
    if held.command is not None:
        assert action is not None and action.endswith(f": {held.command}"), action
    if held.code in ("budget", "sources_changed"):
        assert "laneway resume" not in action and "laneway clear-halt" not in action, action

    # `laneway status --json`, as the CLI prints it.
    result = invoke("status", str(held.run_id), "--json", "--runtime-dir", str(runtime))
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    cli_lane = next(lane for lane in body["lanes"] if lane["lane"] == held.lane)
    step = cli_lane["next_step"]
    assert (step["code"], step["command"]) == (held.code, held.command), step
    for words in held.words:
        assert words in step["words"], step
    assert web_lane["next_step"] == step
    said = step["words"] if step["command"] is None else f"{step['words']}: {step['command']}"
    assert action == (None if held.code == "done" else said)

    # The live display (`laneway run`, `status --watch`) and `status`'s text, from the
    # report the read side builds.
    with readonly.ReadOnlyLedger(runtime) as source, source.snapshot():
        report = status_report(source, held.run_id, now=clock.now())
    [typed] = [lane for lane in report.lanes if lane.lane == held.lane]
    assert typed.next_step is not None and typed.next_step.as_dict() == step
    drawn = live_text(report)
    [row] = [text for text in drawn.splitlines() if text.startswith(f"{held.lane} ")]
    [plain] = [text for text in plain_lines(report) if f": lane {held.lane}: " in text]
    [text_row] = [
        text
        for text in render.status_text(report).splitlines()
        if text.startswith(f"{held.lane} ") and " n1 " in text
    ]
    if held.code == "done":
        assert "done" in row and "idle" not in row
        assert plain.endswith(f"lane {held.lane}: done")
        assert "done" in text_row and "idle" not in text_row
    else:
        assert row.rstrip().endswith(said), row
        assert held.command is None or held.command in plain, plain
        if held.code != "no_worker":  # no_worker's reason names its command already
            assert plain.endswith(f"; next: {said}"), plain
        assert text_row.rstrip().endswith(said), text_row

    # The run's one step: what `status` (text and --json), explain, the report and the
    # web API lead with.
    run_step = body["next_step"]
    expected = held.run_step
    assert (None if run_step is None else (run_step["code"], run_step["command"])) == expected
    assert web["next_step"] == run_step
    assert (report.next_step and report.next_step.as_dict()) == run_step
    text = render.status_text(report)
    if run_step is None:
        assert "next step:" not in text.split("\n\n")[0], text
    else:
        assert f"next step: {run_step['words']}: {run_step['command']}" in text
    html = ["--html", str(runtime / f"report-{held.run_id}.html")]
    reported = invoke("report", str(held.run_id), "--json", *html, "--runtime-dir", str(runtime))
    assert reported.exit_code == 0, reported.output
    assert json.loads(reported.stdout)["next_step"] == run_step
    with factory() as session:
        job_id = session.scalars(
            select(Job.id).where(Job.run_id == held.run_id, Job.lane == held.lane).limit(1)
        ).one()
    explained = invoke("explain", str(job_id), "--json", "--runtime-dir", str(runtime))
    assert explained.exit_code == 0, explained.output
    assert json.loads(explained.stdout)["next_step"] == step  # the job's lane's step
