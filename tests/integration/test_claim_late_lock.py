"""A PostgreSQL claim reads its admission snapshot before it takes the write lock
(``db.claim_transaction``); what only that lock keeps true is looked at again under it.

Each test commits a change from another transaction at the moment between the claim's
read and its write lock (the lock call is wrapped), and checks that the claim honours it.
On SQLite the claim holds the write lock from its first statement: nothing can commit
between its read and its writes, so there the change is made before the claim begins.
"""

from __future__ import annotations

from typing import Any

from laneway.controller import admission, db, ledger
from laneway.controller.ledger import claim as claim_module
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
    the write lock; returns a list that counts the claim's admission snapshots."""
    looks: list[int] = []
    real_lock = db.write_lock
    real_snapshot = claim_module.admission_snapshot

    def lock(session: Any) -> bool:
        if not session.info.get(db.WRITE_LOCKED, True):
            change()  # the claim has read; it has not taken the write lock yet
        return real_lock(session)

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        looks.append(1)
        return real_snapshot(*args, **kwargs)

    monkeypatch.setattr(db, "write_lock", lock)
    monkeypatch.setattr(claim_module, "admission_snapshot", snapshot)
    return looks


def test_a_pause_committed_while_a_claim_reads_is_honoured(
    factory, clock, make_run, register_worker, monkeypatch
):
    run_id = make_run(make_config(items=3))
    worker = register_worker()

    def pause() -> None:
        with db.transaction(factory) as session:
            control_run(
                session, ControlKind.PAUSE, run_id, reason="operator", actor="op", now=clock.now()
            )

    if db.is_sqlite(factory.kw["bind"]):
        pause()
    else:
        between_read_and_lock(monkeypatch, pause)
    assert claim(factory, worker, clock) == []
    with db.session_factory(factory.kw["bind"])() as session:
        decision = session.execute(
            ledger.statements.last_decisions([(run_id, "a", "only")])
        ).first()
    assert decision is not None and decision.reason_code == "paused"


def test_a_run_whose_caps_span_nodes_is_admitted_from_a_look_under_the_lock(
    factory, clock, make_run, register_worker, monkeypatch, engine
):
    make_run(make_config([{"name": "only", "argv": ["true"], "cap": 1}], items=3))
    worker = register_worker()
    looks = between_read_and_lock(monkeypatch, lambda: None)
    claims = claim(factory, worker, clock)
    assert len(claims) == 1  # the stage's cap
    # PostgreSQL read once without the write lock and once under it; SQLite holds it
    # from the start, so once is enough.
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


def test_a_claim_writes_nothing_before_it_holds_the_write_lock(
    factory, clock, make_run, register_worker, engine
):
    """Event ids commit in the order they were drawn only if every write happens under
    the write lock: in a claim_transaction nothing is inserted, updated or deleted
    before it is taken (the node's lock and the reads come first)."""
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
    lock = f"PG_ADVISORY_XACT_LOCK({db.WRITE_LOCK_KEY})"
    locked = [i for i, s in enumerate(sent) if lock in s and "HASHTEXT" not in s]
    assert locked and locked[0] < writes[0], sent[: writes[0] + 1]
    # The snapshot was read before it: the node's lock, then the reads.
    assert "HASHTEXT" in sent[0] and locked[0] > 3
