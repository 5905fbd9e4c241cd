"""A PostgreSQL claim reads its admission snapshot and writes its rows under its node's
lock and the gate it shares with other workers (``db.claim_transaction``), and takes the
order lock only at its end; what only that lock keeps true is decided under it.

Tests commit a change from another transaction at the moment between the claim's read
and its order lock (the lock call is wrapped), and check that the claim honours it. On
SQLite the claim holds the write lock from its first statement: nothing can commit
between its read and its writes, so there the change is made before the claim begins.
"""

from __future__ import annotations

from typing import Any

import pytest

from laneway.controller import admission, db, ledger
from laneway.controller.ledger import claim as claim_module
from laneway.controller.ledger.controls import pause_run
from laneway.controller.ledger.snapshot import RunInfo
from laneway.controller.states import ControlKind
from tests.support import control_run, make_config


def claim(factory: Any, worker: str, clock: Any, slots: int = 2) -> list[Any]:
    with db.claim_transaction(factory, node="n1") as session:
        return ledger.claim_jobs(
            session,
            worker_id=worker,
            node="n1",
            free_slots=slots,
            mem_available_mib=64_000,
            now=clock.now(),
        )


def between_read_and_lock(monkeypatch: Any, change: Any) -> list[int]:
    """Run ``change()`` in its own committed transaction just before the claim takes
    the order lock; returns a list that counts the claim's admission snapshots."""
    looks: list[int] = []
    real_lock = db.order_lock
    real_snapshot = claim_module.admission_snapshot
    armed = [True]

    def lock(session: Any) -> bool:
        if armed[0] and not session.info.get(db.WRITE_LOCKED, True):
            armed[0] = False  # change() takes the order lock in its own transaction
            change()  # the claim has read (and written); it has not taken the lock yet
        return real_lock(session)

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        looks.append(1)
        return real_snapshot(*args, **kwargs)

    monkeypatch.setattr(db, "order_lock", lock)
    monkeypatch.setattr(claim_module, "admission_snapshot", snapshot)
    return looks


def race_the_next_claim(monkeypatch: Any, *, job: int) -> list[bool]:
    """The worker's next claim runs, then raises ``ClaimRaced`` as if another worker
    had stopped the run of ``job`` before its order lock; later claims run as they are.
    Returns a flag list that says whether it has raced."""
    real_claim = ledger.claim_jobs
    raced = [False]

    def claim_once_raced(session: Any, **kwargs: Any) -> Any:
        claims = real_claim(session, **kwargs)
        if not raced[0]:
            raced[0] = True
            raise ledger.ClaimRaced(
                f"job {job} was claimed as its run became paused: claimed again"
            )
        return claims

    monkeypatch.setattr(ledger, "claim_jobs", claim_once_raced)
    return raced


def test_a_pause_another_worker_commits_while_a_claim_reads_is_honoured(
    factory, clock, make_run, register_worker, monkeypatch, engine
):
    """A worker's breaker pauses the run while another worker's claim is between its
    snapshot and its order lock: the claim rolls back whole (``ClaimRaced``) and the
    next one is refused ``paused``. On SQLite the claim holds the write lock from its
    first statement, so there the pause commits before it begins."""
    from sqlalchemy import func, select

    from laneway.controller.models import Attempt

    run_id = make_run(make_config(items=3))
    worker = register_worker()

    def pause() -> None:
        with db.worker_transaction(factory) as session:
            pause_run(session, run_id, reason="breaker", actor="w2", now=clock.now())

    if db.is_sqlite(engine):
        pause()
    else:
        between_read_and_lock(monkeypatch, pause)
        with pytest.raises(ledger.ClaimRaced, match="paused"):
            claim(factory, worker, clock)
        with db.session_factory(engine)() as session:
            assert session.scalar(select(func.count()).select_from(Attempt)) == 0
    assert claim(factory, worker, clock) == []
    with db.session_factory(engine)() as session:
        decision = session.execute(
            ledger.statements.last_decisions([(run_id, "a", "only")])
        ).first()
    assert decision is not None and decision.reason_code == "paused"


def test_an_operator_pause_waits_for_an_open_claim(
    factory, clock, make_run, register_worker, engine, on_postgres
):
    """The operator's writes take the gate alone: a pause asked while a claim is open
    commits after it, and the claim after the pause is refused."""
    import threading

    if not on_postgres:
        pytest.skip("SQLite's writers queue on one lock: no claim is open beside a pause")

    run_id = make_run(make_config(items=4))
    worker = register_worker()
    done = threading.Event()

    def pause() -> None:
        with db.transaction(factory) as session:
            control_run(
                session, ControlKind.PAUSE, run_id, reason="operator", actor="op", now=clock.now()
            )
        done.set()

    with db.claim_transaction(factory, node="n1") as session:
        thread = threading.Thread(target=pause)
        thread.start()
        wait_for_lock_waiter(engine, db.GATE_KEY)
        claimed = ledger.claim_jobs(
            session,
            worker_id=worker,
            node="n1",
            free_slots=1,
            mem_available_mib=64_000,
            now=clock.now(),
        )
        assert not done.is_set()
    thread.join(timeout=60)
    assert done.is_set() and len(claimed) == 1
    assert claim(factory, worker, clock) == []


def wait_for_lock_waiter(engine: Any, key: int) -> None:
    """Return once a session waits for the advisory lock ``key`` in this test's database
    (pg_locks; other tests beside it, under pytest-xdist, take their own)."""
    import time

    from sqlalchemy import text

    with engine.connect() as connection:
        for _ in range(6000):
            waiting = connection.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND NOT granted AND objid = :key AND database = (SELECT oid "
                    "FROM pg_database WHERE datname = current_database())"
                ),
                {"key": key},
            ).scalar()
            if waiting:
                return
            connection.rollback()
            time.sleep(0.01)
    raise AssertionError(f"no session waited for advisory lock {key:#x}")


def test_a_run_whose_caps_span_nodes_is_admitted_from_a_look_under_the_lock(
    factory, clock, make_run, register_worker, monkeypatch, engine
):
    make_run(make_config([{"name": "only", "argv": ["true"], "cap": 1}], items=3))
    worker = register_worker()
    looks = between_read_and_lock(monkeypatch, lambda: None)
    claims = claim(factory, worker, clock)
    assert len(claims) == 1  # the stage's cap
    # PostgreSQL read once without the order lock and once under it; SQLite holds its
    # write lock from the start, so once is enough.
    assert len(looks) == (1 if db.is_sqlite(engine) else 2)


def test_a_run_without_caps_across_nodes_is_read_once(
    factory, clock, make_run, register_worker, monkeypatch
):
    make_run(make_config(items=3))
    worker = register_worker()
    looks = between_read_and_lock(monkeypatch, lambda: None)
    assert len(claim(factory, worker, clock)) == 2
    assert len(looks) == 1


def test_which_caps_span_nodes():
    def spans(raw_stage: dict[str, Any], **extra: Any) -> bool:
        config = make_config([{"name": "only", "argv": ["true"], **raw_stage}], **extra)
        snapshot = admission.Snapshot(
            node=admission.NodeView("n1", 2, 0, None, 0.0, 0),
            free_slots=1,
            candidates=[],
            lane_caps={(1, "a"): dict(config.lanes[0].caps)},
        )
        return claim_module._spans_nodes(snapshot, RunInfo(1, "sha", "/tmp", {}, config))

    assert not spans({})
    assert spans({"cap": 2})
    assert spans({"limits": ["api"]}, limits={"api": {"calls": 10, "per_seconds": 60}})
    # A lane's cap counts one node's attempts unless a stage runs on named nodes.
    assert not spans({}, lanes=[{"name": "a", "node": "n1", "caps": {"only": 1}}])


def test_a_claim_takes_the_order_lock_after_its_rows_and_before_its_events(
    factory, clock, make_run, register_worker, engine
):
    """A PostgreSQL claim begins with its node's lock and the shared gate in one
    statement (its transaction's BEGIN after them, in the same message), reads its
    snapshot and writes its jobs, intents and leases beside other
    nodes' claims, and takes the order lock only for its events (ids commit in the
    order they were drawn) and the stopper check."""
    from sqlalchemy import event

    make_run(make_config(items=3))
    worker = register_worker()
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(" ".join(statement.split()).upper())

    event.listen(engine, "before_cursor_execute", record)
    try:
        claims = claim(factory, worker, clock)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert len(claims) == 2
    writes = [i for i, s in enumerate(sent) if s.startswith(("INSERT", "UPDATE", "DELETE"))]
    assert writes
    if db.is_sqlite(engine):
        return  # the write lock is SQLite's own, from BEGIN IMMEDIATE on
    assert f"PG_ADVISORY_XACT_LOCK({db.NODE_LOCK_CLASS}, " in sent[0], sent[0]
    assert f"PG_ADVISORY_XACT_LOCK_SHARED({db.GATE_KEY})" in sent[0] and sent[0].endswith("; BEGIN")
    order = [i for i, s in enumerate(sent) if f"PG_ADVISORY_XACT_LOCK({db.ORDER_LOCK_KEY})" in s]
    events = [i for i, s in enumerate(sent) if s.startswith("INSERT INTO EVENTS")]
    assert len(order) == 1 and events, sent
    assert writes[0] < order[0] < events[0], sent
    # The candidates are locked as they are read (SKIP LOCKED under each LIMIT), not by
    # a statement of their own after the read.
    reads = [s for s in sent if "FROM JOBS JOIN ITEMS" in s]
    assert len(reads) == 1 and "FOR NO KEY UPDATE OF JOBS SKIP LOCKED" in reads[0], sent
    assert not any(s.startswith("SELECT JOBS.ID FROM JOBS") for s in sent), sent


def test_a_worker_whose_claim_raced_claims_again_on_its_next_tick(
    engine, make_run, monkeypatch, on_postgres
):
    """``ClaimRaced`` rolls the claim back; the worker service records why, starts
    nothing, and claims on its next tick."""
    from sqlalchemy import func, select

    from laneway.controller.models import Attempt
    from laneway.workers.service import WorkerService

    if not on_postgres:
        pytest.skip("SQLite's claim decides under its write lock: it cannot race")
    make_run(make_config(items=1))
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: (64_000.0, 128_000.0))
    service.start()
    raced = race_the_next_claim(monkeypatch, job=1)
    service.tick()
    assert raced[0] and service.last_claim_race is not None and not service.in_flight
    with db.session_factory(engine)() as session:
        assert session.scalar(select(func.count()).select_from(Attempt)) == 0
    service.tick()
    assert len(service.in_flight) == 1
    service.drain()
    service.stop()


def test_a_tick_whose_claim_raced_still_settles_what_finished(
    engine, make_run, monkeypatch, on_postgres
):
    """A tick that settles what finished and claims for the freed slot, whose claim races
    another worker's stop (``ClaimRaced``): the claim rolls back, but the settle must
    stand, the attempt settled once, and the next tick claims the job the raced claim
    did not start. (The settle commits before the claim on PostgreSQL; a change that put
    them in one transaction would have to commit the settle again on its own.)"""
    from sqlalchemy import select

    from laneway.controller.models import Attempt
    from laneway.workers.service import WorkerService
    from tests.support import wait_until

    if not on_postgres:
        pytest.skip("SQLite's claim decides under its write lock: it cannot race")
    make_run(make_config(items=2))
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: (64_000.0, 128_000.0))
    service.start()
    service.tick()
    (first,) = [f.claim.attempt_id for f in service.in_flight.values()]

    def exited() -> bool:  # its report read (not recorded) and its supervisor gone
        service.spawning.read_reports()
        return service.refill_due()

    wait_until(exited)  # the next tick records its identity and settles it
    raced = race_the_next_claim(monkeypatch, job=2)
    report = service.tick()
    assert raced[0] and service.last_claim_race is not None
    assert report.settled == 1 and report.outcomes == ["succeeded"] and report.claimed == 0
    with db.session_factory(engine)() as session:
        rows = session.execute(select(Attempt.id, Attempt.state, Attempt.outcome)).all()
    assert [(r.id, str(r.state), str(r.outcome)) for r in rows] == [(first, "settled", "succeeded")]
    assert not service.in_flight
    service.tick()
    assert len(service.in_flight) == 1
    service.drain()
    service.stop()


def test_an_event_committed_while_a_claim_reads_wakes_the_worker_again(
    engine, factory, clock, make_run, monkeypatch, on_postgres
):
    """Another worker lifts a pause between a claim's read and its order lock: the claim
    did not see the run's job, so the worker must not count that event as seen. It
    looks again when the ledger next changes and claims the job (a worker that marked
    the event seen would leave the job ready until something else happened)."""
    from laneway.controller.states import ControlKind
    from laneway.workers.service import WorkerService
    from tests.support import clear_run_control

    if not on_postgres:
        pytest.skip("SQLite's claim reads under its write lock: nothing commits meanwhile")
    first = make_run(make_config(items=1))
    second = make_run(make_config(items=1))
    with db.transaction(factory) as session:
        control_run(session, ControlKind.PAUSE, second, reason="t", actor="op", now=clock.now())
    service = WorkerService(engine, node="n1", slots=2, memory_probe=lambda: (64_000.0, 128_000.0))
    service.start()

    def lift() -> None:
        with db.worker_transaction(factory) as session:
            clear_run_control(
                session, ControlKind.PAUSE, second, reason="t", actor="w2", now=clock.now()
            )

    between_read_and_lock(monkeypatch, lift)
    service.tick()
    assert [f.claim.run_id for f in service.in_flight.values()] == [first]
    monkeypatch.setattr(service.watch, "changed", lambda: True)
    assert service._worth_claiming()
    service.tick()
    assert sorted(f.claim.run_id for f in service.in_flight.values()) == [first, second]
    service.drain()
    service.stop()


def test_a_claims_own_events_do_not_wake_its_worker(engine, factory, clock, make_run, monkeypatch):
    """After a claim, the events it wrote itself are no news to its worker; an event
    another writer commits is."""
    from laneway.controller.states import ControlKind
    from laneway.workers.service import WorkerService

    make_run(make_config(items=3))
    other = make_run(make_config(items=1))
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: (64_000.0, 128_000.0))
    service.start()
    service.tick()
    assert len(service.in_flight) == 1
    monkeypatch.setattr(service.watch, "changed", lambda: True)
    assert not service._worth_claiming()
    with db.transaction(factory) as session:
        control_run(session, ControlKind.PAUSE, other, reason="t", actor="op", now=clock.now())
    assert service._worth_claiming()
    service.drain()
    service.stop()
