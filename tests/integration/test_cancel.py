"""Controlled stop (invariant 7) through `laneway cancel`: TERM to the supervisor, which
stops the job's whole group and verifies it is gone before the attempt settles cancelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db
from laneway.controller.daemon import Controller
from laneway.controller.errors import UsageError
from laneway.controller.models import Attempt, Control, Event, Job, Run
from laneway.workers import stopping
from laneway.workers.gpu import FakeGpu
from laneway.workers.identity import process_start_time
from laneway.workers.service import WorkerService
from tests.support import claim_one_on_n1, make_config, py_stage, wait_until

runner = CliRunner()
FOREVER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
)


def setup(engine, make_run, items):
    run_id = make_run(
        make_config([py_stage("long", FOREVER, grace_seconds=1)], items=items, max_jobs=1)
    )
    service = WorkerService(
        engine, node="n1", slots=1, memory_probe=lambda: (64e3, 128e3), gpu=FakeGpu()
    )
    service.start()
    controller = Controller(engine)

    def attempts():
        with db.session_factory(engine)() as session:
            return session.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()

    def tick():
        controller.tick()
        service.tick()

    def running():
        tick()
        rows = attempts()
        return rows and rows[0].state == "running" and rows[0]

    return run_id, tick, attempts, wait_until(running)


def test_cancel_attempt_stops_the_group_and_settles_cancelled(engine, runtime, make_run):
    run_id, tick, attempts, attempt = setup(engine, make_run, items=1)
    result = runner.invoke(
        app,
        [
            "cancel",
            str(attempt.id),
            "--reason",
            "wrong model",
            "--runtime-dir",
            str(runtime),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["attempts_signalled"] == [attempt.supervisor_pid]

    def settled():
        tick()
        return attempts()[0].state == "settled"

    wait_until(settled)
    final = attempts()[0]
    assert final.outcome == "cancelled"
    record = json.loads((Path(final.attempt_dir) / "exit.json").read_text())
    assert record["stopped"] is True and record["group_empty"] is True
    assert process_start_time(final.child_pid) is None

    def closed():
        tick()
        with db.session_factory(engine)() as session:
            return session.get(Run, run_id).state == "finished"

    wait_until(closed)
    with db.session_factory(engine)() as session:
        assert session.scalars(select(Job.state)).one() == "cancelled"


def test_cancel_run_drains_and_cancels_pending_jobs(engine, runtime, make_run):
    run_id, tick, attempts, _ = setup(engine, make_run, items=3)
    result = runner.invoke(
        app,
        [
            "cancel",
            "--run",
            str(run_id),
            "--reason",
            "abandon batch",
            "--runtime-dir",
            str(runtime),
        ],
    )
    assert result.exit_code == 0, result.output

    def finished():
        tick()
        with db.session_factory(engine)() as session:
            return session.get(Run, run_id).state == "finished"

    wait_until(finished)
    assert [a.outcome for a in attempts()] == ["cancelled"]  # nothing else ever started
    with db.session_factory(engine)() as session:
        assert set(session.scalars(select(Job.state))) == {"cancelled"}
        control = session.scalars(select(Control)).one()
    assert control.kind == "stop" and control.reason == "abandon batch"


def test_cancel_refuses_what_is_not_running(engine, runtime, make_run):
    make_run(make_config())
    result = runner.invoke(app, ["cancel", "1", "--reason", "x", "--runtime-dir", str(runtime)])
    assert result.exit_code == 2 and "not in the ledger" in result.stderr
    both = runner.invoke(
        app, ["cancel", "1", "--run", "1", "--reason", "x", "--runtime-dir", str(runtime)]
    )
    assert both.exit_code == 2 and "not both" in both.stderr


def test_cancel_of_a_settled_attempt_exits_1_as_the_readme_says(
    engine, runtime, make_run, register_worker, clock
):
    """A row in another state is exit 1 (README: "Only a `running` attempt can be
    cancelled (otherwise exit 1)"), not a usage error."""
    from laneway.controller.states import Outcome

    make_run(make_config())
    claim = claim_one_on_n1(
        db.session_factory(engine), register_worker(), clock, settle=Outcome.SUCCEEDED
    )
    result = runner.invoke(
        app, ["cancel", str(claim.attempt_id), "--reason", "x", "--runtime-dir", str(runtime)]
    )
    assert result.exit_code == 1
    assert (
        f"attempt {claim.attempt_id} is settled; only a running attempt can be cancelled"
        in result.stderr
    )


def spawned_elsewhere(factory, worker, clock):
    """One claimed attempt whose supervisor was recorded on another machine (boot id)."""
    return claim_one_on_n1(factory, worker, clock, spawn=("another-machine", 1, 1))


def test_cancel_of_a_supervisor_elsewhere_is_refused_and_records_nothing(
    engine, runtime, make_run, register_worker, clock
):
    make_run(make_config())
    worker = register_worker()
    factory = db.session_factory(engine)
    claim = spawned_elsewhere(factory, worker, clock)
    result = runner.invoke(
        app, ["cancel", str(claim.attempt_id), "--reason", "x", "--runtime-dir", str(runtime)]
    )
    assert result.exit_code == 2 and "not running on this machine" in result.stderr
    with factory() as session:
        kinds = session.scalars(select(Event.kind)).all()
    assert "cancel_requested" not in kinds


def test_cancel_is_callable_without_the_cli(engine, runtime, make_run, clock):
    """`workers.stopping.cancel`, the workflow `laneway cancel` calls: a run's pending
    jobs cancelled and its one running attempt's supervisor signalled, in one call."""
    run_id, tick, attempts, attempt = setup(engine, make_run, items=3)
    for neither_or_both in ({}, {"attempt": attempt.id, "run": run_id}):
        with pytest.raises(UsageError, match="not both"):
            stopping.cancel(engine, reason="r", actor="t", now=clock.now(), **neither_or_both)
    done = stopping.cancel(
        engine, run=run_id, reason="abandon batch", actor="tester", now=clock.now(), patience=5
    )
    assert done == stopping.Cancelled(jobs_cancelled=2, attempts_signalled=[attempt.supervisor_pid])
    with db.session_factory(engine)() as session:
        control = session.scalars(select(Control)).one()
        requested = session.scalars(select(Event).where(Event.kind == "cancel_requested")).all()
    assert (control.kind, control.set_by, control.reason) == ("stop", "tester", "abandon batch")
    assert [(e.attempt_id, e.actor) for e in requested] == [(attempt.id, "tester")]

    def settled():
        tick()
        return attempts()[0].state == "settled"

    wait_until(settled)
    assert attempts()[0].outcome == "cancelled"


def test_cancel_of_a_run_with_a_supervisor_elsewhere_records_nothing(
    engine, make_run, register_worker, clock
):
    """Every target is checked before anything is recorded: a refused run cancel sets
    no stop control and cancels none of its pending jobs."""
    run_id = make_run(make_config(items=2))
    worker = register_worker()
    factory = db.session_factory(engine)
    spawned_elsewhere(factory, worker, clock)
    with pytest.raises(UsageError, match="not running on this machine"):
        stopping.cancel(engine, run=run_id, reason="x", actor="t", now=clock.now())
    with factory() as session:
        assert session.scalars(select(Control)).all() == []
        assert "cancel_requested" not in session.scalars(select(Event.kind)).all()
        assert "cancelled" not in session.scalars(select(Job.state)).all()
