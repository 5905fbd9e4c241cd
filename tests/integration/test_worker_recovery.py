"""``workers.recovery`` alone: what a restarted worker does with one orphaned attempt
(``Recovery.recover_one``), driven on a worker that is not started. The paths through
``WorkerService.start`` (reboot, a recycled pid, a race with the controller) are in
tests/integration/test_recovery.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from laneway.controller import db, identity, ledger
from laneway.controller.attempt import artifacts
from laneway.controller.models import Attempt
from laneway.controller.states import AttemptState
from laneway.workers.flight import AdoptedSupervisor
from tests.integration.worker_parts import claimed, host
from tests.support import make_config


def orphan(factory, old: str, new: str, clock) -> Attempt:
    """``old`` is declared lost; its one attempt, as a worker ``new`` lists it."""
    with db.transaction(factory) as session:
        ledger.mark_worker_lost(session, old, now=clock.now(), actor="test", reason="gone")
    with factory() as session:
        (attempt,) = ledger.orphaned_attempts(session, node="n1", worker_id=new)
        return attempt


def test_an_orphan_whose_supervisor_lives_is_adopted_with_its_peaks(
    engine, factory, make_run, register_worker, clock
):
    run_id = make_run(make_config())
    old, new = register_worker(), register_worker()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = (sleeper.pid, identity.process_start_time(sleeper.pid))
        (claim,) = claimed(factory, old, clock, supervisor=alive)
        with db.transaction(factory) as session:
            assert ledger.record_samples(
                session,
                claim.attempt_id,
                fence=claim.fence,
                peak_rss_mib=42.0,
                sampled_at=clock.now(),
            )
        attempt = orphan(factory, old, new, clock)
        assert attempt.state == AttemptState.RUNNING
        service = host(engine, new, clock)
        line = service.recovery.recover_one(attempt, identity.boot_id())
        assert line == f"attempt {claim.attempt_id}: adopted live supervisor pid {sleeper.pid}"
        flight = service.in_flight[claim.attempt_id]
        assert isinstance(flight.supervisor, AdoptedSupervisor)
        assert flight.supervisor.poll() is None  # watched by identity, not waited for
        assert flight.peaks.peak_rss_mib == 42.0  # the previous worker's peaks carry over
        assert flight.claim.fence > claim.fence
        assert service.stages.output_caps[(run_id, "only")] == artifacts.DEFAULT_OUTPUT_MAX_MIB
        with factory() as session:
            row = session.get(Attempt, claim.attempt_id)
            assert row.worker_id == new and row.state == AttemptState.RUNNING
        service._forget(claim.attempt_id)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_intent_that_left_an_exit_record_is_settled_from_it(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config())
    old, new = register_worker(), register_worker()
    (claim,) = claimed(factory, old, clock, exits=[{"exit_code": 0}])
    attempt = orphan(factory, old, new, clock)
    assert attempt.state == AttemptState.INTENT  # no supervisor recorded: looked for by marker
    service = host(engine, new, clock)
    line = service.recovery.recover_one(attempt, identity.boot_id())
    assert line == f"attempt {claim.attempt_id}: settled succeeded from its exit record"
    assert service.in_flight == {}
    with factory() as session:
        row = session.get(Attempt, claim.attempt_id)
        assert row.state == AttemptState.SETTLED and row.outcome == "succeeded"


def test_an_orphan_whose_supervisor_is_gone_without_a_record_is_unknown(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config())
    old, new = register_worker(), register_worker()
    (claim,) = claimed(factory, old, clock, supervisor=(999_999, 1))
    attempt = orphan(factory, old, new, clock)
    line = host(engine, new, clock).recovery.recover_one(attempt, identity.boot_id())
    reason = "its worker and supervisor are gone and left no exit.json"
    assert line == f"attempt {claim.attempt_id}: unknown ({reason})"
    with factory() as session:
        row = session.get(Attempt, claim.attempt_id)
        assert row.state == AttemptState.UNKNOWN and reason in row.state_reason


def test_an_unknown_attempt_whose_exit_record_is_here_is_noted_not_settled(
    engine, factory, make_run, register_worker, clock, runtime
):
    """A worker killed as its job ended comes back after the controller expired the
    lease (the attempt is unknown): it holds the exit record, so it says so in the
    ledger, once, and the run's next step names its node and the command that settles
    the attempt from that evidence there. Only an operator settles it."""
    from laneway.controller import advice
    from laneway.controller.rows import SessionRows
    from laneway.controller.status import status_report

    run_id = make_run(make_config())
    old, new = register_worker(), register_worker()
    (claim,) = claimed(factory, old, clock)
    record = {"attempt_id": claim.attempt_id, "exit_code": 0, "signal": None}
    (Path(claim.attempt_dir) / "exit.json").write_text(json.dumps(record))
    with db.transaction(factory) as session:
        ledger.mark_worker_lost(session, old, now=clock.now(), actor="test", reason="gone")
        ledger.mark_unknown(
            session, claim.attempt_id, reason="lease expired", actor="controller", now=clock.now()
        )
    service = host(engine, new, clock)
    assert service.recovery.note_evidence() == [
        f"attempt {claim.attempt_id}: unknown; its evidence here is conclusive (succeeded): "
        "`laneway reconcile --from-evidence` settles it"
    ]
    assert service.recovery.note_evidence() == []  # noted once
    with factory() as session:
        assert session.get(Attempt, claim.attempt_id).state == AttemptState.UNKNOWN
        report = status_report(SessionRows(session), run_id, now=clock.now())
    step = advice.run_next_step(report)
    assert step is not None and step.code == "unknown_outcome"
    assert (
        step.command == f"laneway reconcile --run {run_id} --from-evidence --runtime-dir {runtime}"
    )
    assert f"is on node n1 (host {identity.host()}: it settles as succeeded)" in step.words
    (unknown,) = report.unknown
    assert unknown.evidence_on is not None and unknown.evidence_on["outcome"] == "succeeded"
