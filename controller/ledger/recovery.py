"""Crash recovery: expired leases, lost workers, and what a restarted worker adopts.

Lease design (invariant 4, docs/invariants.md). A lease is a worker's claim on one job
for one attempt. It is granted in the same transaction that writes the attempt's intent,
and it carries the job's fence token, which only grows: it is bumped on every grant and
every revocation. Every later write about the attempt (spawn identity, settle) names the
fence it was granted, and the compare-and-set includes ``jobs.fence = :fence``: a worker
whose lease was revoked (a zombie coming back late) matches no row and gets
``StaleLease``. The holder renews the lease with each heartbeat; ``expires_at`` is
judged on the database's clock (on SQLite, the single host's clock read through
``controller.clock``). A holder must stop trusting its lease when a renewal fails or
when it has not renewed it for ``lease_seconds``: from then on it may only write
evidence files, never ledger state.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from laneway.controller.errors import NotFound, StaleLease
from laneway.controller.ledger import statements
from laneway.controller.ledger.claim import DEFAULT_LEASE_SECONDS
from laneway.controller.ledger.settle import mark_unknown
from laneway.controller.ledger.tables import attempts, jobs
from laneway.controller.ledger.transitions import append_event, rowcount
from laneway.controller.models import Attempt, Event, Worker
from laneway.controller.states import (
    IN_FLIGHT_ATTEMPT_STATES,
    AttemptState,
    EventKind,
    JobState,
    WorkerState,
)

SettleFromRecord = Callable[[Session, Attempt, datetime], bool]


def expired_leases(session: Session, *, now: datetime) -> list[Any]:
    """Live leases past ``expires_at`` whose attempt is in flight (read-only; an index
    range over live leases only)."""
    return list(session.execute(statements.EXPIRED_LEASES, {"now": now}).all())


def expire_leases(
    session: Session,
    *,
    now: datetime,
    actor: str,
    settle: SettleFromRecord | None = None,
    only: set[int] | None = None,
) -> list[int]:
    """Leases past ``expires_at`` (on the ledger's clock): their holder stopped renewing
    them. Each attempt is settled from its exit record when ``settle(session, attempt,
    now)`` can establish the outcome (returns True), else marked unknown: the process may
    still be running. ``only`` limits it to these attempt ids. Returns the ids handled."""
    handled = []
    for row in expired_leases(session, now=now):
        if only is not None and row.attempt_id not in only:
            continue
        attempt = session.get(Attempt, row.attempt_id, populate_existing=True)
        assert attempt is not None
        if settle is not None and settle(session, attempt, now):
            handled.append(row.attempt_id)
            continue
        mark_unknown(
            session,
            row.attempt_id,
            reason=(
                f"lease expired at {row.expires_at:%Y-%m-%d %H:%M:%S} UTC: worker "
                f"{row.worker_id} stopped renewing it and no exit record settles the "
                "attempt; the process may still be running"
            ),
            actor=actor,
            now=now,
            fence=row.fence,
        )
        handled.append(row.attempt_id)
    return handled


def orphaned_attempts(session: Session, *, node: str, worker_id: str) -> list[Attempt]:
    """In-flight attempts on ``node`` held by another worker that is not active: what a
    (re)starting worker must reconcile before it leases anything."""
    return list(
        session.scalars(
            select(Attempt)
            .join(Worker, Worker.id == Attempt.worker_id)
            .where(
                Attempt.node == node,
                Attempt.worker_id != worker_id,
                Attempt.state.in_([s.value for s in IN_FLIGHT_ATTEMPT_STATES]),
                Worker.state != WorkerState.ACTIVE,
            )
            .order_by(Attempt.id)
        )
    )


def unknown_attempts_on_node(session: Session, *, node: str) -> list[Attempt]:
    """Unknown attempts that ran on ``node`` and carry no evidence note yet
    (``note_evidence``): what a restarting worker of the node looks at, since only it can
    read their exit records there. A range of the unknown attempts (``ix_attempts_state``):
    there are few, each halts its run until reconciled."""
    noted = select(Event.attempt_id).where(
        Event.run_id == Attempt.run_id,
        Event.kind == EventKind.ATTEMPT_EVIDENCE_FOUND.value,
        Event.attempt_id == Attempt.id,
    )
    return list(
        session.scalars(
            select(Attempt)
            .where(
                Attempt.state == AttemptState.UNKNOWN.value,
                Attempt.node == node,
                ~noted.exists(),
            )
            .order_by(Attempt.id)
        )
    )


def note_evidence(
    session: Session,
    attempt: Attempt,
    *,
    actor: str,
    host: str,
    outcome: str,
    words: str,
    now: datetime,
) -> bool:
    """Record that conclusive evidence of unknown ``attempt`` lies on its node, read there
    by ``actor`` (a worker on ``host``): it settles nothing (only an operator reconciles an
    unknown attempt), it tells them where ``laneway reconcile --from-evidence`` settles it
    (the run's next step, ``advice.run_concern``). False when the attempt is no longer
    unknown."""
    still = session.scalar(
        select(Attempt.id).where(
            Attempt.id == attempt.id, Attempt.state == AttemptState.UNKNOWN.value
        )
    )
    if still is None:
        return False
    append_event(
        session,
        EventKind.ATTEMPT_EVIDENCE_FOUND,
        actor=actor,
        now=now,
        run_id=attempt.run_id,
        job_id=attempt.job_id,
        attempt_id=attempt.id,
        node=attempt.node,
        host=host,
        outcome=outcome,
        words=words,
    )
    return True


def adopt_attempt(
    session: Session,
    attempt_id: int,
    *,
    old_fence: int,
    worker_id: str,
    now: datetime,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
) -> int:
    """A restarted worker takes over an in-flight attempt whose supervisor still lives.

    The job's fence is bumped (the old holder, should it return, is now stale), the old
    lease released and a new one granted to ``worker_id``. Returns the new fence.
    """
    attempt = session.execute(
        select(attempts.c.job_id, attempts.c.run_id, attempts.c.worker_id).where(
            attempts.c.id == attempt_id
        )
    ).first()
    if attempt is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    new_fence = old_fence + 1
    changed = rowcount(
        session.execute(
            update(jobs)
            .where(
                jobs.c.id == attempt.job_id,
                jobs.c.fence == old_fence,
                jobs.c.state == JobState.RUNNING.value,
            )
            .values(fence=new_fence, updated_at=now)
        )
    )
    if changed != 1:
        raise StaleLease(f"attempt {attempt_id}: fence {old_fence} is stale; cannot adopt it")
    moved = rowcount(
        session.execute(
            update(attempts)
            .where(
                attempts.c.id == attempt_id,
                attempts.c.fence == old_fence,
                attempts.c.state.in_([s.value for s in IN_FLIGHT_ATTEMPT_STATES]),
            )
            .values(fence=new_fence, worker_id=worker_id)
        )
    )
    if moved != 1:
        raise StaleLease(f"attempt {attempt_id}: no longer in flight at fence {old_fence}")
    session.execute(statements.RELEASE_LEASE, {"b_attempt_id": attempt_id, "b_now": now})
    session.execute(
        statements.INSERT_LEASE,
        {
            "job_id": attempt.job_id,
            "attempt_id": attempt_id,
            "worker_id": worker_id,
            "fence": new_fence,
            "granted_at": now,
            "expires_at": now + timedelta(seconds=lease_seconds),
        },
    )
    append_event(
        session,
        EventKind.ATTEMPT_ADOPTED,
        actor=worker_id,
        now=now,
        run_id=attempt.run_id,
        job_id=attempt.job_id,
        attempt_id=attempt_id,
        previous_worker=attempt.worker_id,
        fence=new_fence,
    )
    return new_fence
