"""On PostgreSQL workers' transactions share the gate and write beside each other; the
controller's and the operator's take it alone; the order lock keeps event ids committing
in the order they were drawn and makes the read-then-writes that must see every other
worker's commits (an item's promotion) wait for them (``controller/db.py``).

Each test holds one transaction open in this thread, starts another in a thread, and
reads ``pg_locks`` to see which of them waits for which lock; no test measures time.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import select, text

from laneway.controller import db, ledger
from laneway.controller.models import Job
from laneway.controller.states import JobState, Outcome
from tests.integration.test_claim_late_lock import wait_for_lock_waiter
from tests.support import claim_on_n1, make_config, py_stage, record_spawn, settle_in


@pytest.fixture(autouse=True)
def _postgres_only(on_postgres: bool) -> None:
    if not on_postgres:
        pytest.skip("SQLite has one writer at a time: there is no gate to share")


def _holders(engine: Any, key: int) -> list[tuple[str, bool]]:
    """(mode, granted) of every session's hold on, or wait for, advisory lock ``key`` in
    this test's database (other tests beside it, under pytest-xdist, hold their own)."""
    with engine.connect() as connection:
        return [
            (str(mode), bool(granted))
            for mode, granted in connection.execute(
                text(
                    "SELECT mode, granted FROM pg_locks WHERE locktype = 'advisory' "
                    "AND objid = :key AND database = (SELECT oid FROM pg_database "
                    "WHERE datname = current_database()) ORDER BY granted DESC, mode"
                ),
                {"key": key},
            )
        ]


def _beat(session: Any, worker: str, clock: Any) -> None:
    ledger.heartbeat(
        session,
        worker,
        now=clock.now(),
        lease_seconds=60,
        mem_available_mib=1000,
        mem_total_mib=2000,
    )


def test_workers_write_beside_each_other_and_the_controller_waits_for_both(
    factory, engine, clock, make_run, register_worker
):
    make_run(
        make_config(
            lanes=[{"name": "a", "node": "n1"}, {"name": "b", "node": "n2"}],
            nodes=[{"name": n, "memory_floor_mib": 0, "max_jobs": 1} for n in ("n1", "n2")],
        )
    )
    first, second = register_worker(node="n1"), register_worker(node="n2")
    done = threading.Event()

    def controller_write() -> None:
        with db.transaction(factory) as session:
            ledger.append_event(session, "test_controller_write", actor="c", now=clock.now())
        done.set()

    with db.worker_transaction(factory) as one:
        _beat(one, first, clock)
        with db.worker_transaction(factory) as two:  # would wait forever if not shared
            _beat(two, second, clock)
            assert _holders(engine, db.GATE_KEY) == [("ShareLock", True), ("ShareLock", True)]
            thread = threading.Thread(target=controller_write)
            thread.start()
            wait_for_lock_waiter(engine, db.GATE_KEY)
            assert ("ExclusiveLock", False) in _holders(engine, db.GATE_KEY)
        assert not done.is_set()  # one worker's transaction is still open
    thread.join(timeout=60)
    assert done.is_set()


def test_event_ids_commit_in_the_order_they_were_drawn(
    factory, engine, clock, make_run, register_worker
):
    make_run()
    worker = register_worker()
    written: list[int] = []

    def second_writer() -> None:
        with db.worker_transaction(factory) as session:
            ledger.append_event(session, "second", actor=worker, now=clock.now())
            newest = ledger.flush_events(session)
        assert newest is not None
        written.append(newest)

    with db.worker_transaction(factory) as session:
        ledger.append_event(session, "first", actor=worker, now=clock.now())
        first = ledger.flush_events(session)
        thread = threading.Thread(target=second_writer)
        thread.start()
        wait_for_lock_waiter(engine, db.ORDER_LOCK_KEY)  # its events wait for this commit
        assert not written
    thread.join(timeout=60)
    assert first is not None and written and written[0] > first


def test_two_needs_settled_at_once_promote_their_item(
    factory, engine, clock, make_run, register_worker
):
    """Without the order lock each settle would read the other need as still running
    (uncommitted) and neither would promote the item's third stage."""
    stages = [py_stage("a", "pass"), py_stage("b", "pass"), py_stage("c", "pass", needs=["a", "b"])]
    make_run(make_config(stages, items=1))
    worker = register_worker()
    claimed = {c.stage: c for c in claim_on_n1(factory, worker, clock, slots=2)}
    assert set(claimed) == {"a", "b"}
    with db.worker_transaction(factory) as session:
        for claim in claimed.values():
            record_spawn(session, claim, worker, clock.now(), ("boot", 1, 1))

    def settle(stage: str) -> None:
        with db.worker_transaction(factory) as session:
            settle_in(session, claimed[stage], worker, clock, Outcome.SUCCEEDED)

    with db.worker_transaction(factory) as session:
        settle_in(session, claimed["a"], worker, clock, Outcome.SUCCEEDED)
        thread = threading.Thread(target=settle, args=("b",))
        thread.start()
        wait_for_lock_waiter(engine, db.ORDER_LOCK_KEY)  # b's promotion waits for a's commit
    thread.join(timeout=60)
    with db.session_factory(engine)() as session:
        states = {job.stage: job.state for job in session.scalars(select(Job))}
    assert states == {"a": JobState.SUCCEEDED, "b": JobState.SUCCEEDED, "c": JobState.READY}


def test_two_infrastructure_failures_settled_at_once_trip_the_breaker(
    factory, engine, clock, make_run, register_worker
):
    """The breaker reads the run's streak under the order lock: the second of two
    failures settled at once sees the first, and the run pauses."""
    run_id = make_run(make_config(items=2, infra_breaker=2))
    worker = register_worker()
    claimed = claim_on_n1(factory, worker, clock, slots=2)
    assert len(claimed) == 2
    with db.worker_transaction(factory) as session:
        for claim in claimed:
            record_spawn(session, claim, worker, clock.now(), ("boot", 1, 1))

    def settle() -> None:
        with db.worker_transaction(factory) as session:
            settle_in(session, claimed[1], worker, clock, Outcome.INFRA_FAILURE)

    with db.worker_transaction(factory) as session:
        settle_in(session, claimed[0], worker, clock, Outcome.INFRA_FAILURE)
        thread = threading.Thread(target=settle)
        thread.start()
        wait_for_lock_waiter(engine, db.ORDER_LOCK_KEY)
    thread.join(timeout=60)
    with db.session_factory(engine)() as session:
        assert ledger.run_paused(session, run_id)


def test_a_budget_total_first_written_by_two_workers_at_once_counts_both(
    factory, engine, clock, make_run
):
    """A budget's totals row is written at the end of a worker's transaction, under the
    order lock (``db.shared_write``): the second of two first writes finds the row the
    first inserted, instead of inserting it again."""
    from laneway.controller.ledger import usage as usage_ledger
    from laneway.controller.ledger.tables import usage_totals

    run_id = make_run()
    done = threading.Event()

    def hold() -> None:
        with db.worker_transaction(factory) as session:
            usage_ledger.hold_expected(session, run_id, "only", {"usd": 1.0})
        done.set()

    with db.worker_transaction(factory) as session:
        usage_ledger.hold_expected(session, run_id, "only", {"usd": 1.0})
        thread = threading.Thread(target=hold)
        thread.start()
        thread.join(timeout=60)
        assert done.is_set()  # it committed while this transaction is open
    with db.session_factory(engine)() as session:
        assert session.execute(select(usage_totals.c.reserved)).scalars().all() == [2.0]


def test_a_worker_holds_no_row_every_worker_adds_to_before_its_end(
    factory, engine, clock, make_run
):
    """A stage's peaks are folded at the end of a worker's transaction, under the order
    lock (``db.shared_write``). Were they folded at once, this transaction would hold
    stage b's row while the other, holding the order lock (as a promotion takes it,
    mid-transaction), waits for it; and had this one then waited for the order lock,
    neither could go on."""
    from laneway.controller.ledger.tables import stage_stats

    run_id = make_run(make_config([py_stage("a", "pass"), py_stage("b", "pass")]))
    peak = {"peak_rss_mib": 10.0}
    done = threading.Event()

    def other() -> None:
        with db.worker_transaction(factory) as session:
            ledger.fold_peaks(session, run_id, "a", None, peak)
            db.order_lock(session)
            ledger.fold_peaks(session, run_id, "b", None, peak)
        done.set()

    with db.worker_transaction(factory) as session:
        ledger.fold_peaks(session, run_id, "b", None, peak)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=60)
        assert done.is_set()  # it committed while this transaction is open
    with db.session_factory(engine)() as session:
        rows = session.execute(
            select(stage_stats.c.stage, stage_stats.c.measured).order_by(stage_stats.c.stage)
        ).all()
    assert [tuple(row) for row in rows] == [("a", 1), ("b", 2)]


class _Undone(Exception):
    pass


@pytest.mark.parametrize("kind", ["transaction", "worker_transaction", "claim_transaction"])
def test_a_write_transaction_begun_with_its_first_statement_rolls_back_whole(
    factory, engine, clock, make_run, register_worker, kind
):
    """A write transaction's BEGIN goes to the server with its first statement (the
    locks and the clock, in one message): every statement after it is still inside the
    transaction, so a failure undoes them all, and the locks are released with it."""
    make_run(make_config())
    worker = register_worker(node="n1")
    opened = {
        "transaction": lambda: db.transaction(factory),
        "worker_transaction": lambda: db.worker_transaction(factory),
        "claim_transaction": lambda: db.claim_transaction(factory, node="n1"),
    }[kind]
    with db.one_read(engine) as session:
        before = session.execute(text("SELECT max(id) FROM events")).scalar()
    with pytest.raises(_Undone), opened() as session:
        _beat(session, worker, clock)
        ledger.append_event(session, "test_undone", actor="t", now=clock.now())
        db.order_lock(session)
        assert _holders(engine, db.GATE_KEY)  # held, to the end of the transaction
        raise _Undone
    with db.one_read(engine) as session:
        assert session.execute(text("SELECT max(id) FROM events")).scalar() == before
        kinds = session.execute(text("SELECT count(*) FROM events WHERE kind = 'test_undone'"))
        assert kinds.scalar() == 0
    assert _holders(engine, db.GATE_KEY) == []
    assert _holders(engine, db.ORDER_LOCK_KEY) == []


def test_a_read_holds_no_transaction_open(engine):
    """``db.reader`` and ``db.one_read`` read in autocommit on PostgreSQL: between
    statements their connection is idle, not idle in a transaction (no BEGIN and
    ROLLBACK round trips, and no snapshot held while the caller works)."""
    for opened in (lambda: db.reader(engine)(), lambda: db.one_read(engine)):
        with opened() as session:
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
            session.execute(text("SELECT count(*) FROM events")).scalar()
            with engine.connect() as other:
                state = other.execute(
                    text("SELECT state FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
                ).scalar()
            assert state == "idle"
