"""Reuse: find the earlier results a new run's jobs may take over (controller.reuse).

A reused job is created ``succeeded`` with ``reused_from`` naming the succeeded attempt
whose result it takes over; that attempt's artifacts, usage and result are linked, not
copied. A job of a stage that needs others is taken over only when the earlier attempt
read exactly (by sha256) the artifacts the jobs it needs hand on in the new run
(``same_inputs``): its key names what those jobs were, not what they wrote, and an
upstream job re-run or reused from another run may have written other bytes. Only a
succeeded attempt qualifies, so an attempt an operator reconciled counts
only if it was reconciled ``succeeded``. A job that was itself reused points at the
original attempt, never at another reused job.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from laneway.controller.ledger.tables import artifacts, attempt_inputs, attempts, jobs
from laneway.controller.states import JobState, Outcome

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


Handed = frozenset[tuple[str, str, str]]
"""(producing stage, name, sha256) of artifacts."""


@dataclass(frozen=True)
class HandOffs:
    """What a set of attempts wrote (their artifacts) and read (their recorded inputs)."""

    wrote: dict[int, Handed]
    read: dict[int, Handed]

    def same_inputs(self, attempt_id: int, needed: Collection[int]) -> bool:
        """Whether ``attempt_id`` read exactly what the ``needed`` attempts wrote."""
        expected = frozenset().union(*(self.wrote.get(a, frozenset()) for a in needed))
        return self.read.get(attempt_id, frozenset()) == expected


def hand_offs(session: Session, attempt_ids: Collection[int]) -> HandOffs:
    """The artifacts and recorded inputs of ``attempt_ids`` (two indexed lookups per
    chunk: ``uq_artifacts_attempt_id_name``, ``pk_attempt_inputs``)."""
    wrote: dict[int, set[tuple[str, str, str]]] = {}
    read: dict[int, set[tuple[str, str, str]]] = {}
    ids = sorted(set(attempt_ids))
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        for attempt_id, stage, name, sha in session.execute(
            select(
                artifacts.c.attempt_id, artifacts.c.stage, artifacts.c.name, artifacts.c.sha256
            ).where(artifacts.c.attempt_id.in_(chunk))
        ).all():
            wrote.setdefault(attempt_id, set()).add((stage, name, sha))
        for attempt_id, stage, name, sha in session.execute(
            select(
                attempt_inputs.c.attempt_id,
                attempt_inputs.c.stage,
                attempt_inputs.c.name,
                attempt_inputs.c.sha256,
            ).where(attempt_inputs.c.attempt_id.in_(chunk))
        ).all():
            read.setdefault(attempt_id, set()).add((stage, name, sha))
    return HandOffs(
        {a: frozenset(v) for a, v in wrote.items()}, {a: frozenset(v) for a, v in read.items()}
    )


def stored_outputs(
    session: Session, attempt_ids: Collection[int]
) -> dict[int, list[tuple[str, str, str]]]:
    """Attempt id -> (name, sha256, location) of each artifact it stored."""
    found: dict[int, list[tuple[str, str, str]]] = {}
    ids = sorted(set(attempt_ids))
    for start in range(0, len(ids), CHUNK):
        for attempt_id, name, sha, location in session.execute(
            select(
                artifacts.c.attempt_id, artifacts.c.name, artifacts.c.sha256, artifacts.c.location
            ).where(artifacts.c.attempt_id.in_(ids[start : start + CHUNK]))
        ).all():
            found.setdefault(attempt_id, []).append((name, sha, location))
    return found
