"""Recovery paths in-process: lease expiry judged on the ledger's clock, zombie writes
rejected, reboot detection, torn exit records, reconcile and retry."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from laneway.controller import db, ledger, pipeline
from laneway.controller.daemon import Controller
from laneway.controller.errors import IllegalTransition, StaleLease
from laneway.controller.models import Attempt, Control, Decision, Job, Run, Worker
from laneway.controller.outcome import read_outcome
from laneway.controller.states import ControlKind, Outcome
from laneway.workers.recovery import Recovery
from laneway.workers.service import WorkerService
from tests.support import (
    claim_on_n1,
    claim_one_on_n1,
    clear_run_control,
    control_run,
    make_config,
    mark_unknown_one,
    py_stage,
    reconcile_one,
    settle_one,
)

PLENTY = (64_000.0, 128_000.0)
OLD_BOOT_SUPERVISOR = ("old-boot", 999_999, 1)  # boot id, supervisor pid, its start time


def claim_one(factory, worker, clock, spawn=True):
    """One attempt claimed on n1 with a 60 s lease and its directory made; ``spawn``: its
    supervisor recorded as spawned on a boot that is not this one."""
    claim = claim_one_on_n1(
        factory, worker, clock, lease_seconds=60, spawn=OLD_BOOT_SUPERVISOR if spawn else None
    )
    Path(claim.attempt_dir).mkdir(parents=True, exist_ok=True)
    return claim


def attempt_row(factory, attempt_id) -> Attempt:
    with factory() as session:
        return session.get(Attempt, attempt_id)


def test_expired_lease_makes_unknown_on_the_ledger_clock_and_rejects_the_zombie(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config(items=2))
    worker = register_worker()
    claim = claim_one(factory, worker, clock)
    controller = Controller(engine, clock=clock, lost_after_seconds=3600)
    clock.advance(59)
    controller.tick(clock.now())
    assert attempt_row(factory, claim.attempt_id).state == "running"  # not yet expired
    clock.advance(2)
    report = controller.tick(clock.now())
    assert report.expired == [claim.attempt_id]
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.state == "unknown" and "lease expired" in attempt.state_reason
    # The worker comes back late (a zombie): it can write nothing about the job.
    with pytest.raises(StaleLease):
        settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    # The run is halted by its unknown attempt.
    assert claim_on_n1(factory, worker, clock, slots=4) == []


def test_lost_workers_and_leases_are_judged_on_their_schedule_not_at_every_tick(
    engine, factory, make_run, register_worker, clock
):
    """A busy ledger ticks the controller at every change; heartbeats and leases are
    judged once per ``recovery_seconds`` (of this process's clock or the ledger's), not at
    each of those ticks."""
    run_id = make_run(make_config(items=2))
    worker = register_worker()
    controller = Controller(engine, clock=clock, lost_after_seconds=30, recovery_seconds=60)
    assert controller.tick(clock.now()).lost == []  # the first tick judges
    with db.transaction(factory) as session:  # the worker's heartbeat is long gone
        session.execute(
            update(Worker)
            .where(Worker.id == worker)
            .values(heartbeat_at=clock.now() - timedelta(seconds=3600))
        )
    with db.transaction(factory) as session:  # a change: the next tick is not idle
        control_run(
            session, ControlKind.PAUSE, run_id, reason="look", actor="test", now=clock.now()
        )
    assert controller.tick(clock.now()).lost == []  # judged 0 s ago on both clocks
    clock.advance(59)
    assert controller.tick(clock.now()).lost == []
    clock.advance(1)  # recovery_seconds of the ledger's clock since the last look
    assert controller.tick(clock.now()).lost == [worker]


def test_expired_lease_with_exit_record_is_settled_not_unknown(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config())
    worker = register_worker()
    claim = claim_one(factory, worker, clock)
    (Path(claim.attempt_dir) / "exit.json").write_text(json.dumps({"exit_code": 0}))
    clock.advance(120)
    Controller(engine, clock=clock, lost_after_seconds=3600).tick(clock.now())
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.outcome == "succeeded" and "settled by the controller" in attempt.state_reason


def test_an_intent_settled_from_its_exit_record_gets_its_identity_from_it(
    engine, factory, make_run, register_worker, clock
):
    """Its worker died with the identity still waiting for the settle it never wrote:
    the exit record names the supervisor and the child, and when the child started."""
    make_run(make_config())
    worker = register_worker()
    claim = claim_one(factory, worker, clock, spawn=False)  # intent
    record = {
        "exit_code": 0,
        "supervisor_pid": 4321,
        "supervisor_start_time": 99,
        "boot_id": "boot-x",
        "child_pid": 4322,
        "child_start_time": 100,
        "started_at": "2026-01-01T00:00:01.500Z",
    }
    (Path(claim.attempt_dir) / "exit.json").write_text(json.dumps(record))
    clock.advance(120)
    Controller(engine, clock=clock, lost_after_seconds=3600).tick(clock.now())
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.outcome == "succeeded" and attempt.boot_id == "boot-x"
    assert (attempt.supervisor_pid, attempt.supervisor_start_time) == (4321, 99)
    assert (attempt.child_pid, attempt.child_start_time) == (4322, 100)
    assert attempt.started_at.replace(tzinfo=None) == datetime(2026, 1, 1, 0, 0, 1, 500000)


@pytest.mark.parametrize(
    ("identity", "recorded_pid"),
    [
        ({}, None),
        ({"supervisor_pid": "4321", "boot_id": "b"}, None),
        ({"supervisor_pid": True, "boot_id": "b"}, None),
        ({"supervisor_pid": 4321, "boot_id": 7}, None),
        ({"supervisor_pid": -1, "boot_id": "b"}, None),
        ({"supervisor_pid": 4321, "boot_id": "b", "child_pid": "x", "started_at": "soon"}, 4321),
    ],
)
def test_an_exit_records_odd_identity_is_left_out_and_the_settle_stands(
    engine, factory, make_run, register_worker, clock, identity, recorded_pid
):
    make_run(make_config())
    worker = register_worker()
    claim = claim_one(factory, worker, clock, spawn=False)  # intent
    (Path(claim.attempt_dir) / "exit.json").write_text(json.dumps({"exit_code": 0, **identity}))
    clock.advance(120)
    Controller(engine, clock=clock, lost_after_seconds=3600).tick(clock.now())
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.outcome == "succeeded"
    assert attempt.supervisor_pid == recorded_pid and attempt.child_pid is None
    assert (attempt.started_at is None) == (recorded_pid is None)


@pytest.mark.parametrize("content", ["", '{"exit_code": 0', "[1, 2]", "\x00\x01"])
def test_torn_or_unreadable_exit_record_is_never_trusted(tmp_path, content):
    (tmp_path / "exit.json").write_text(content)
    verdict, record, _ = read_outcome(tmp_path, job_id=1, exit_codes={}, missing_exit="none")
    assert verdict.outcome is None and record is None


def test_restart_after_reboot_marks_unknown(engine, factory, make_run, register_worker, clock):
    make_run(make_config())
    dead = register_worker()  # boot "boot", pid 1: not this boot
    claim = claim_one(factory, dead, clock)
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: PLENTY)
    service.start()
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.state == "unknown" and "machine rebooted" in attempt.state_reason
    assert service.recovered == [f"attempt {claim.attempt_id}: unknown (machine rebooted)"]


def test_recorded_pid_owned_by_another_process_is_never_adopted(
    engine, factory, make_run, register_worker, clock
):
    """Same boot, but the recorded start time differs: a recycled pid, not our supervisor."""
    from laneway.workers import identity

    make_run(make_config())
    dead = register_worker()
    recycled = (identity.boot_id(), identity.current()[0], 12345)  # this boot, our pid
    claim = claim_one_on_n1(factory, dead, clock, spawn=recycled)
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: PLENTY)
    service.start()
    assert service.in_flight == {}
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.state == "unknown" and "left no exit.json" in attempt.state_reason


def test_reconcile_then_retry(factory, make_run, register_worker, clock):
    config = make_config([py_stage("one", "pass"), py_stage("two", "pass", needs=["one"])])
    run_id = make_run(config)
    worker = register_worker()
    claim = claim_one(factory, worker, clock)
    mark_unknown_one(factory, claim, clock, "lost", actor="t")
    state = reconcile_one(factory, claim, clock, "failed", "provider says it failed")
    assert state.value == "failed"
    with factory() as session, session.begin(), pytest.raises(IllegalTransition):
        ledger.reconcile_attempt(
            session,
            claim.attempt_id,
            verdict="succeeded",
            reason="again",
            actor="op2",
            now=clock.now(),
        )
    Controller(factory.kw["bind"], clock=clock, lost_after_seconds=3600).tick(clock.now())
    with factory() as session:
        states = dict(session.execute(select(Job.stage, Job.state)).all())
        assert states == {"one": "failed", "two": "skipped"}
        assert session.get(Run, run_id).state == "finished"
    with db.transaction(factory) as session:
        moved = ledger.retry_job(
            session, claim.job_id, reason="fixed the key", actor="op", now=clock.now()
        )
    assert moved == 2
    with factory() as session:
        states = dict(session.execute(select(Job.stage, Job.state)).all())
        assert states == {"one": "ready", "two": "waiting"}
        assert session.get(Run, run_id).state == "active"
    again = claim_one(factory, worker, clock, spawn=False)
    assert again.number == 2 and again.idempotency_key != claim.idempotency_key


RECONCILER = (
    "import sys; from laneway.cli.main import main; "
    "sys.argv = ['laneway', 'reconcile', sys.argv[1], "
    "'--as', sys.argv[2], '--reason', 'race', '--runtime-dir', sys.argv[3]]; main()"
)


def test_two_concurrent_reconciles_exactly_one_wins(
    runtime, factory, make_run, register_worker, clock
):
    make_run(make_config())
    worker = register_worker()
    claim = claim_one(factory, worker, clock)
    mark_unknown_one(factory, claim, clock, "lost", actor="t")
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RECONCILER, str(claim.attempt_id), verdict, str(runtime)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for verdict in ("succeeded", "failed")
    ]
    results = [(r.wait(timeout=120), r.communicate()) for r in racers]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    loser = next(err for code, (_, err) in results if code == 1)
    assert loser.startswith("laneway: attempt") and "is settled, not unknown" in loser
    attempt = attempt_row(factory, claim.attempt_id)
    assert attempt.state == "settled" and attempt.outcome in ("succeeded", "failed")


def _unknown_in_new_run(factory, make_run, register_worker, clock, **config):
    make_run(make_config(items=1, **config))
    worker = register_worker()
    claim = claim_one_on_n1(factory, worker, clock, unknown="lost")
    return claim, worker


def _claims(factory, worker, clock):
    return claim_on_n1(factory, worker, clock, slots=4)


@pytest.mark.parametrize(("scope", "other_run_blocked"), [("run", False), ("everything", True)])
def test_unknown_scope_run_or_everything(
    factory, make_run, register_worker, clock, scope, other_run_blocked
):
    _, worker = _unknown_in_new_run(factory, make_run, register_worker, clock, unknown_scope=scope)
    other = make_run(make_config(items=1))
    claims = _claims(factory, worker, clock)
    assert (claims == []) is other_run_blocked
    if other_run_blocked:
        with factory() as session:
            decision = session.scalars(select(Decision).where(Decision.run_id == other)).one()
        assert decision.reason_code == "unknown_outcome"
        assert decision.detail["scope"] == "everything"


def test_reconciling_the_last_unknown_resumes_but_never_lifts_an_operator_halt(
    factory, make_run, register_worker, clock
):
    claim, worker = _unknown_in_new_run(factory, make_run, register_worker, clock)
    run_id = claim.run_id
    with db.transaction(factory) as session:
        control_run(
            session,
            ControlKind.HALT,
            run_id,
            reason="operator checks the provider",
            actor="op",
            now=clock.now(),
        )
        ledger.reconcile_attempt(
            session,
            claim.attempt_id,
            verdict="not-run",
            reason="no process found",
            actor="op",
            now=clock.now(),
        )
    assert _claims(factory, worker, clock) == []  # the operator's halt still holds
    with factory() as session:
        last = session.scalars(
            select(Decision).where(Decision.run_id == run_id).order_by(Decision.id.desc())
        ).first()
    assert last.reason_code == "halted"
    with db.transaction(factory) as session:
        clear_run_control(
            session, ControlKind.HALT, run_id, reason="provider ok", actor="op", now=clock.now()
        )
    (again,) = _claims(factory, worker, clock)  # without the halt, dispatch resumes
    assert again.job_id == claim.job_id and again.number == 2


def test_changed_source_halts_dispatch_naming_file_and_hashes(
    factory, make_run, register_worker, clock, tmp_path
):
    source = tmp_path / "experiment.py"
    source.write_text("VERSION = 1\n")
    config = make_config(items=2, sources=[str(source)])
    run_id = make_run(config, source_hashes={str(source): pipeline.hash_file(source)})
    worker = register_worker()

    def claim():
        return claim_on_n1(
            factory, worker, clock, check_sources=lambda r: pipeline.source_drift(r.source_hashes)
        )

    assert len(claim()) == 1  # unchanged: dispatch goes on
    source.write_text("VERSION = 2  # edited under a running experiment\n")
    assert claim() == []
    with factory() as session:
        control = session.scalars(select(Control).where(Control.run_id == run_id)).one()
        decision = session.scalars(
            select(Decision).where(Decision.run_id == run_id).order_by(Decision.id.desc())
        ).first()
    assert control.kind == "halt" and str(source) in control.reason
    assert "!= frozen" in control.reason
    assert decision.reason_code == "halted"


def test_a_restarted_worker_goes_on_when_the_controller_expires_an_orphan_first(
    engine, factory, make_run, register_worker, clock, monkeypatch
):
    """Regression: the controller expiring an orphan's lease between the restarted
    worker's listing and its adoption used to crash the worker with StaleLease."""
    make_run(make_config([py_stage("only", "pass")]))
    old = register_worker()
    claim = claim_one(factory, old, clock, spawn=False)  # intent: it goes to adoption
    with db.transaction(factory) as session:
        ledger.mark_worker_lost(session, old, now=clock.now(), actor="test", reason="gone")
    clock.advance(120)  # its lease has expired
    recover_one = Recovery.recover_one

    def race_then_recover(self, attempt, boot):
        # Listed as an orphan; before this worker adopts it, the controller expires it.
        with db.transaction(factory) as other:
            assert ledger.expire_leases(other, now=clock.now(), actor="controller")
        return recover_one(self, attempt, boot)

    monkeypatch.setattr(Recovery, "recover_one", race_then_recover)
    service = WorkerService(engine, node="n1", slots=1, clock=clock, memory_probe=lambda: PLENTY)
    service.start()  # must not raise
    assert any(
        f"attempt {claim.attempt_id}: already handled elsewhere" in line
        for line in service.recovered
    ), service.recovered
    assert attempt_row(factory, claim.attempt_id).state == "unknown"
    assert service.in_flight == {}
