"""The operator's actions (controller/operator.py) called directly, without the CLI:
each records who, why and when; each refuses with the error the CLI prints, having
written nothing; `retry` asks its confirmation before anything moves; `cancel` checks
every supervisor (through the `Supervisors` it is given) before it records anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db, ledger, ledger_open, operator
from laneway.controller.errors import IllegalTransition, NotFound, UsageError
from laneway.controller.models import Artifact, Control, Event, Job
from laneway.controller.operator import ControlsCleared, ControlSet, Operator
from laneway.controller.states import ControlKind, ControlScope, Outcome
from tests.support import claim_on_n1, claim_one_on_n1, make_config, py_stage, settle_one

runner = CliRunner()


@pytest.fixture
def op(engine, clock) -> Operator:
    return Operator(engine, "alice@box", now=clock.now, patience=5)


def counts(factory) -> tuple[int, int]:
    """(controls, events) in the ledger."""
    with factory() as session:
        controls = session.scalar(select(func.count()).select_from(Control))
        events = session.scalar(select(func.count()).select_from(Event))
    return controls, events


def test_a_pause_records_who_why_and_when(op, factory, make_run, clock):
    run_id = make_run(make_config(lanes=[{"name": "a", "node": "n1"}]))
    done = operator.pause(op, run_id, reason="  disk is filling  ")
    lane = operator.pause(op, run_id, reason="look at lane a", lane="a")
    every = operator.pause(op, None, reason="maintenance")
    assert (done.kind, done.scope, lane.scope, every.scope) == (
        ControlKind.PAUSE,
        ControlScope.RUN,
        ControlScope.LANE,
        ControlScope.GLOBAL,
    )
    with factory() as session:
        row = session.get(Control, done.control_id)
        assert row is not None
        assert (row.kind, row.run_id, row.set_by, row.reason, row.set_at) == (
            ControlKind.PAUSE,
            run_id,
            "alice@box",
            "disk is filling",  # stripped, as the CLI records it
            clock.now(),
        )
        assert session.get(Control, lane.control_id).lane == "a"  # type: ignore[union-attr]
        assert session.get(Control, every.control_id).run_id is None  # type: ignore[union-attr]
    assert done.as_dict() == {"control_id": done.control_id, "kind": "pause", "scope": "run"}


def test_a_pause_of_a_finished_run_is_refused_with_the_cli_s_error(
    op, factory, make_run, register_worker, clock, runtime
):
    run_id = make_run(make_config())
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    with db.transaction(factory) as session:
        assert ledger.close_run_if_done(session, run_id, now=clock.now(), actor="test")
    before = counts(factory)
    for lane in (None, "a"):
        with pytest.raises(IllegalTransition) as refused:
            operator.pause(op, run_id, reason="look", lane=lane)
        printed = runner.invoke(
            app,
            ["pause", str(run_id), "--reason", "look", "--runtime-dir", str(runtime)]
            + (["--lane", lane] if lane else []),
        )
        assert printed.exit_code == refused.value.exit_code == 1
        assert printed.stderr == f"laneway: {refused.value}\n"
        assert "not paused (nothing written)" in str(refused.value)
    assert counts(factory) == before


def test_a_control_names_the_field_that_is_wrong_and_writes_nothing(op, factory, make_run):
    run_id = make_run(make_config())
    before = counts(factory)
    refusals: list[tuple[Any, type[Exception], str]] = [
        (lambda: operator.pause(op, run_id, reason="x", lane="zz"), UsageError, "no lane 'zz'"),
        (lambda: operator.pause(op, None, reason="x", lane="a"), UsageError, "--lane needs a RUN"),
        (lambda: operator.halt(op, run_id, reason="   "), UsageError, "--reason must say why"),
        (lambda: operator.stop(op, 999, reason="x"), NotFound, "run 999 is not in the ledger"),
        (lambda: operator.resume(op, 999, reason="x"), NotFound, "run 999 is not in the ledger"),
    ]
    for act, error, words in refusals:
        with pytest.raises(error, match=words):
            act()
    assert counts(factory) == before


def test_resume_lifts_pauses_and_stops_and_only_clear_halt_lifts_a_halt(op, factory, make_run):
    run_id = make_run(make_config())
    for act in (operator.pause, operator.stop, operator.halt):
        assert isinstance(act(op, run_id, reason="set"), ControlSet)
    resumed = operator.resume(op, run_id, reason="looked")
    assert resumed == ControlsCleared(2, (ControlKind.PAUSE, ControlKind.STOP))
    assert resumed.as_dict() == {"cleared": 2, "kinds": ["pause", "stop"]}
    with factory() as session:
        active = session.scalars(select(Control.kind).where(Control.cleared_at.is_(None))).all()
    assert active == [ControlKind.HALT]
    assert operator.resume(op, run_id, reason="again") == ControlsCleared(
        0, (ControlKind.PAUSE, ControlKind.STOP)
    )
    assert operator.clear_halt(op, run_id, reason="fixed") == ControlsCleared(
        1, (ControlKind.HALT,)
    )
    with factory() as session:
        halt = session.scalars(select(Control).where(Control.kind == ControlKind.HALT)).one()
    assert (halt.cleared_by, halt.clear_reason) == ("alice@box", "fixed")


def failed_jobs(factory, make_run, register_worker, clock) -> tuple[int, dict[str, int]]:
    """A run of two stages over two items: both of stage a failed, b's still waiting."""
    run_id = make_run(
        make_config([py_stage("a", "pass"), py_stage("b", "pass", needs=["a"])], items=2)
    )
    worker = register_worker()
    jobs = {}
    for claim in claim_on_n1(factory, worker, clock, slots=4):
        settle_one(factory, claim, worker, clock, Outcome.FAILED)
        jobs[claim.item] = claim.job_id
    return run_id, jobs


def never(reruns: Any) -> bool:
    raise AssertionError(f"asked to confirm {reruns}: nothing needed re-running")


def test_retry_of_one_job_and_of_a_run_records_the_reason_and_who(
    op, factory, make_run, register_worker, clock
):
    run_id, jobs = failed_jobs(factory, make_run, register_worker, clock)
    one = operator.retry(op, job=jobs["item0"], reason=" fixed the input ", confirm=never)
    assert (one.job_id, one.run_id, one.retried, one.reruns) == (
        jobs["item0"],
        None,
        [jobs["item0"]],
        [],
    )
    assert one.moved >= 1
    with pytest.raises(IllegalTransition):  # no longer failed
        operator.retry(op, job=jobs["item0"], reason="again", confirm=never)
    bulk = operator.retry(op, run=run_id, stage="a", reason="the rest", confirm=never)
    assert (bulk.job_id, bulk.run_id, bulk.retried) == (None, run_id, [jobs["item1"]])
    with factory() as session:
        states = [session.get(Job, job_id).state for job_id in jobs.values()]  # type: ignore[union-attr]
        retried = session.scalars(
            select(Event).where(Event.kind == "job_retry").order_by(Event.id)
        ).all()
    assert states == ["ready", "ready"]
    assert [(e.job_id, e.actor) for e in retried] == [
        (jobs["item0"], "alice@box"),
        (jobs["item1"], "alice@box"),
    ]
    assert "fixed the input" in json.dumps(retried[0].detail)


def test_retry_refuses_what_it_cannot_do_before_anything_moves(
    op, factory, make_run, register_worker, clock
):
    run_id, jobs = failed_jobs(factory, make_run, register_worker, clock)
    before = counts(factory)
    refusals: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"run": run_id, "stage": "zz"}, UsageError, "--stage: 'zz' is not a stage of run"),
        ({"run": 999}, NotFound, "run 999 is not in the ledger"),
        ({"job": jobs["item0"], "stage": "a"}, UsageError, "omit JOB"),
        ({}, UsageError, "name a JOB"),
        ({"job": jobs["item0"], "reason": ""}, UsageError, "--reason must say why"),
    ]
    for chosen, error, words in refusals:
        with pytest.raises(error, match=words):
            operator.retry(op, **{"reason": "r", **chosen}, confirm=never)
    assert counts(factory) == before


CHAIN = """
import os, sys
stage, gate = sys.argv[1:3]
given = sys.argv[3] if len(sys.argv) > 3 else None
data = open(os.path.join(given, 'out.txt')).read() if given else stage
open('out.txt', 'w').write(data + '>' + stage)
sys.exit(1 if os.path.exists(gate) and stage == 'judge' else 0)
"""


def test_retry_asks_once_before_producers_re_run_and_a_no_moves_nothing(tmp_path, runtime):
    """judge failed and the output solve stored has since left the store: a retry of
    judge must re-run solve first. The confirmation is asked once with that re-run,
    before anything is written: no refuses it (RetryDeclined, nothing moved), yes re-runs
    solve and retries judge in one transaction."""
    gate = tmp_path / "fail-judge"
    gate.touch()

    def stage(name: str, need: str | None) -> dict[str, Any]:
        argv = [sys.executable, "-c", CHAIN, name, str(gate)]
        return {
            "name": name,
            "argv": argv + ([f"{{inputs.{need}}}"] if need else []),
            "outputs": ["out.txt"],
            "needs": [need] if need else [],
        }

    body = {
        "name": "chain",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [stage("solve", None), stage("judge", "solve")],
        "items": [{"key": "x1", "lane": "a"}],
    }
    config = tmp_path / "chain.json"
    config.write_text(json.dumps(body))
    ran = runner.invoke(app, ["run", str(config), "--runtime-dir", str(runtime), "--quiet"])
    assert ran.exit_code == 0, ran.output
    engine = ledger_open.open_writer(runtime)
    factory = db.session_factory(engine)
    with factory() as session:
        job_of = {job.stage: job.id for job in session.scalars(select(Job))}
        (location,) = session.scalars(select(Artifact.location)).all()
    Path(location.removeprefix("file://")).unlink()
    op = Operator(engine, "bob@box", patience=5)
    asked: list[list[int]] = []

    def answer(yes: bool):
        def confirm(reruns: Any) -> bool:
            asked.append([rerun.job_id for rerun in reruns])
            return yes

        return confirm

    before = counts(factory)
    with pytest.raises(operator.RetryDeclined) as declined:
        operator.retry(op, job=job_of["judge"], reason="store pruned", confirm=answer(False))
    assert str(declined.value) == "not retried: nothing was changed (--yes re-runs without asking)"
    assert declined.value.exit_code == 1
    assert asked == [[job_of["solve"]]] and counts(factory) == before
    done = operator.retry(op, job=job_of["judge"], reason="store pruned", confirm=answer(True))
    assert asked == [[job_of["solve"]]] * 2
    assert [(r.job_id, r.for_job) for r in done.reruns] == [(job_of["solve"], job_of["judge"])]
    with factory() as session:
        states = {job.stage: job.state for job in session.scalars(select(Job))}
    assert states == {"solve": "ready", "judge": "waiting"}
    engine.dispose()


class Here:
    """A fake machine's supervisors: those in ``local`` run here; ``terminate`` records
    each TERM instead of sending it."""

    def __init__(self, local: set[int]) -> None:
        self.local = local
        self.terminated: list[int] = []

    def check_local_supervisor(self, attempt: Any) -> None:
        if attempt.supervisor_pid not in self.local:
            raise UsageError(f"attempt {attempt.id}: not running on this machine")

    def terminate_supervisor(self, attempt: Any) -> int:
        self.terminated.append(attempt.supervisor_pid)
        return int(attempt.supervisor_pid)


def test_cancel_records_before_it_signals_and_refuses_a_supervisor_elsewhere(
    op, factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=3))
    worker = register_worker()
    claim = claim_one_on_n1(factory, worker, clock, spawn=("boot", 4242, 7))
    before = counts(factory)
    elsewhere = Here(local=set())
    with pytest.raises(UsageError, match="not running on this machine"):
        operator.cancel(op, run=run_id, reason="abandon", here=elsewhere)
    assert counts(factory) == before and elsewhere.terminated == []
    for neither_or_both in ({}, {"attempt": claim.attempt_id, "run": run_id}):
        with pytest.raises(UsageError, match="not both"):
            operator.cancel(op, reason="r", here=elsewhere, **neither_or_both)
    here = Here(local={4242})
    done = operator.cancel(op, run=run_id, reason=" abandon batch ", here=here)
    assert done == operator.Cancelled(jobs_cancelled=2, attempts_signalled=[4242])
    assert here.terminated == [4242]
    with factory() as session:
        control = session.scalars(select(Control)).one()
        requested = session.scalars(select(Event).where(Event.kind == "cancel_requested")).all()
    assert (control.kind, control.set_by, control.reason, control.set_at) == (
        ControlKind.STOP,
        "alice@box",
        "abandon batch",
        clock.now(),
    )
    assert [(e.attempt_id, e.actor) for e in requested] == [(claim.attempt_id, "alice@box")]
