"""ENOSPC and EIO injected on every durable write path, at call k, once and persistently:
no partial file is trusted, a known exit code is never overwritten, a failed outcome
record means unknown, and report/log failures are their own recorded diagnostics."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db, faults
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Control, Event, Run
from laneway.workers.service import WorkerService
from tests.support import make_config, py_stage, wait_until

JOB = (
    "import json, os, sys; print('out', flush=True); print('err', file=sys.stderr, flush=True); "
    "json.dump({'job_id': os.environ['LANEWAY_JOB_ID']}, "
    "open(os.environ['LANEWAY_RESULT_PATH'], 'w'))"
)
SITES = ["receipt", "exit_record", "log_write", "result_read", "status_snapshot"]
CASES = [
    pytest.param(site, k, code, mode, id=f"{site}-{k}-{code}-{mode}")
    for site in SITES
    for k in (1, 2)
    for code, mode in (("ENOSPC", "once"), ("EIO", "persist"))
]


def run_with_fault(engine, make_run, monkeypatch, rule):
    monkeypatch.setenv(faults.ENV, rule)
    faults.reset()
    run_id = make_run(make_config([py_stage("s", JOB)], items=2, max_jobs=1))
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: (64e3, 128e3))
    service.start()
    controller = Controller(engine, snapshot_seconds=0)

    def settled_or_blocked():
        controller.tick()
        service.tick()
        with db.session_factory(engine)() as session:
            run = session.get(Run, run_id)
            blocked = session.scalars(select(Control).where(Control.run_id == run_id)).first()
            unknown = session.scalars(select(Attempt).where(Attempt.state == "unknown")).first()
        return run.state == "finished" or (not service.in_flight and (blocked or unknown))

    wait_until(settled_or_blocked, timeout=60)
    faults.reset()
    with db.session_factory(engine)() as session:
        attempts = list(session.scalars(select(Attempt).order_by(Attempt.id)))
        events = [e.kind for e in session.scalars(select(Event).where(Event.run_id == run_id))]
        state = session.get(Run, run_id).state
    return run_id, attempts, events, state


@pytest.mark.parametrize(("site", "k", "code", "mode"), CASES)
def test_fault_on_every_durable_path(engine, runtime, make_run, monkeypatch, site, k, code, mode):
    rule = f"{site}:{k}:{code}" + (":persist" if mode == "persist" else "")
    _, attempts, events, state = run_with_fault(engine, make_run, monkeypatch, rule)

    # Never a partial file left to be mistaken for evidence.
    assert not list(runtime.rglob("*.partial"))
    for attempt in attempts:
        exit_path = Path(attempt.attempt_dir) / "exit.json"
        if attempt.outcome == "succeeded":  # success only with a whole exit record
            assert json.loads(exit_path.read_text())["exit_code"] == 0
        if attempt.exit_code is not None and exit_path.exists():  # known code kept
            assert json.loads(exit_path.read_text())["exit_code"] == attempt.exit_code

    outcomes = [a.outcome or a.state for a in attempts]
    per_process_first = site in ("exit_record", "log_write")  # each supervisor counts anew
    hit = 0 if (per_process_first and k == 1) or (not per_process_first and k == 1) else 1
    if site == "receipt":
        assert outcomes[hit] == "unknown"
        assert "receipt.json could not be saved" in attempts[hit].state_reason
        assert outcomes[:hit] == ["succeeded"] * hit and len(attempts) == hit + 1
    elif site == "exit_record":
        if k == 1:
            assert outcomes == ["unknown"] and "left no exit.json" in attempts[0].state_reason
            log = (Path(attempts[0].attempt_dir) / "supervisor.log").read_text()
            assert "could not save exit.json" in log and "exit_code=0" in log
        else:  # each supervisor writes exit.json once: call 2 never comes
            assert outcomes == ["succeeded", "succeeded"]
    elif site == "log_write":
        assert outcomes == ["harness_failure"]
        assert attempts[0].exit_code == 0 and "log write failed" in attempts[0].state_reason
        assert "control_pause" in events
    elif site == "result_read":
        assert outcomes == ["succeeded"] * hit + ["harness_failure"]
        assert attempts[hit].exit_code == 0 and "could not be read" in attempts[hit].state_reason
        assert "control_pause" in events
    else:  # status_snapshot: derived files only; outcomes untouched
        assert outcomes == ["succeeded", "succeeded"] and state == "finished"
        assert "snapshot_failed" in events


def test_reconciling_after_a_receipt_failure_keeps_the_known_exit_code(
    engine, runtime, make_run, monkeypatch
):
    """The receipt could not be saved, so the attempt is rightly unknown; its exit.json
    holds the exit code. A reconcile records that code (from the verified record)."""
    from typer.testing import CliRunner

    from laneway.cli.main import app

    code_job = JOB + "; raise SystemExit(7)"
    monkeypatch.setenv(faults.ENV, "receipt:1:ENOSPC")
    faults.reset()
    run_id = make_run(make_config([py_stage("s", code_job)], items=1, max_jobs=1))
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: (64e3, 128e3))
    service.start()

    def reaped():
        service.tick()
        with db.session_factory(engine)() as session:
            unknown = session.scalars(select(Attempt).where(Attempt.state == "unknown")).first()
        return unknown is not None and not service.in_flight and unknown

    attempt = wait_until(reaped)
    faults.reset()
    assert attempt.exit_code is None
    assert json.loads((Path(attempt.attempt_dir) / "exit.json").read_text())["exit_code"] == 7
    shown = CliRunner().invoke(
        app,
        [
            "reconcile",
            str(attempt.id),
            "--as",
            "failed",
            "--reason",
            "read exit.json",
            "--runtime-dir",
            str(runtime),
        ],
    )
    assert shown.exit_code == 0, shown.output
    with db.session_factory(engine)() as session:
        settled = session.get(Attempt, attempt.id)
        assert (settled.state, settled.outcome, settled.exit_code) == ("settled", "failed", 7)
        assert session.get(Run, run_id) is not None


PRODUCER = (
    "import json, os; open('out.txt', 'w').write('bytes handed on'); "
    "json.dump({'job_id': os.environ['LANEWAY_JOB_ID']}, "
    "open(os.environ['LANEWAY_RESULT_PATH'], 'w'))"
)
CONSUMER = "import os, sys; open(sys.argv[1] + '.ran', 'w').write(open(sys.argv[2]).read())"


@pytest.mark.parametrize("code", ["ENOSPC", "EIO"])
@pytest.mark.parametrize("site", ["store_write", "input_fetch"])
def test_a_fault_in_the_artifact_store_is_a_harness_failure_that_pauses(
    engine, runtime, make_run, monkeypatch, tmp_path, site, code
):
    """Storing an output or fetching an input fails: the attempt is a harness failure
    (the producer's exit code kept; the consumer never started), nothing half-written is
    left in the store or the attempt directory, and the run pauses."""
    monkeypatch.setenv(faults.ENV, f"{site}:1:{code}")
    faults.reset()
    marker = tmp_path / "consumer"
    stages = [
        py_stage("p", PRODUCER, outputs=["out.txt"]),
        {
            **py_stage("c", CONSUMER, needs=["p"]),
            "argv": [sys.executable, "-c", CONSUMER, str(marker), "{inputs.p}/out.txt"],
        },
    ]
    run_id = make_run(make_config(stages, items=1))
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: (64e3, 128e3))
    service.start()

    def failed():
        service.tick()
        with db.session_factory(engine)() as session:
            return session.scalars(
                select(Attempt).where(Attempt.outcome == "harness_failure")
            ).first()

    attempt = wait_until(failed, timeout=60)
    wait_until(lambda: service.tick().in_flight == 0)
    faults.reset()
    assert f"injected at {site} call 1" in attempt.state_reason
    assert os.strerror(getattr(errno, code)) in attempt.state_reason
    if site == "store_write":
        assert attempt.attempt_dir.endswith(".p/attempt-1")
        assert attempt.exit_code == 0  # the command's own exit is kept
        stored = (
            list((runtime / "artifacts").rglob("*")) if (runtime / "artifacts").exists() else []
        )
        assert [p for p in stored if p.is_file()] == []  # no object, no temporary
    else:
        assert attempt.state_reason.startswith("not started:")
        assert attempt.child_pid is None and not Path(f"{marker}.ran").exists()
        inputs = Path(attempt.attempt_dir) / "inputs"
        assert not inputs.exists() or [p for p in inputs.rglob("*") if p.is_file()] == []
    with db.session_factory(engine)() as session:
        pauses = session.scalars(
            select(Control).where(Control.run_id == run_id, Control.kind == "pause")
        ).all()
    assert len(pauses) == 1
