"""Reuse: find the earlier results a new run's jobs may take over (controller.reuse).

A reused job is created ``succeeded`` with ``reused_from`` naming the succeeded attempt
whose result it takes over; that attempt's artifacts, usage and result are linked, not
copied. Only a succeeded attempt qualifies, so an attempt an operator reconciled counts
only if it was reconciled ``succeeded``. A job that was itself reused points at the
original attempt, never at another reused job.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.ledger.tables import attempts, jobs
from controller.states import JobState, Outcome

CHUNK = 500
"""Keys per lookup statement (bind parameters stay well under every backend's limit)."""


@dataclass(frozen=True)
class Reusable:
    attempt_id: int
    run_id: int


def reusable_attempts(session: Session, keys: Collection[str]) -> dict[str, Reusable]:
    """Reuse key -> the succeeded attempt of the newest succeeded job with that key."""
    succeeded_attempt = (
        select(func.max(attempts.c.id))
        .where(attempts.c.job_id == jobs.c.id, attempts.c.outcome == Outcome.SUCCEEDED.value)
        .scalar_subquery()
    )
    found: dict[str, int] = {}
    ordered = sorted(set(keys))
    for start in range(0, len(ordered), CHUNK):
        rows = session.execute(
            select(
                jobs.c.reuse_key, func.coalesce(jobs.c.reused_from, succeeded_attempt).label("a")
            )
            .where(
                jobs.c.reuse_key.in_(ordered[start : start + CHUNK]),
                jobs.c.state == JobState.SUCCEEDED.value,
            )
            .order_by(jobs.c.id.desc())
        ).all()
        for key, attempt_id in rows:
            if attempt_id is not None and key not in found:
                found[key] = attempt_id
    if not found:
        return {}
    runs_of: dict[int, int] = {}
    ids = sorted(set(found.values()))
    for start in range(0, len(ids), CHUNK):
        for attempt_id, run_id in session.execute(
            select(attempts.c.id, attempts.c.run_id).where(
                attempts.c.id.in_(ids[start : start + CHUNK])
            )
        ).all():
            runs_of[attempt_id] = run_id
    return {key: Reusable(attempt_id, runs_of[attempt_id]) for key, attempt_id in found.items()}
