"""Artifacts: the outputs a succeeded attempt stored, and the inputs an attempt is given.

``record_artifacts`` runs in the settle's transaction (an attempt is ``succeeded`` with
its outputs recorded, or not at all); ``inputs_for`` and ``record_inputs`` run in the
claim's, so the inputs an attempt will be given are committed with its intent, before
anything is fetched or started (``settle.refuse_start`` settles one whose inputs could
not be given).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, insert, select, text
from sqlalchemy.orm import Session

from laneway.controller.ledger.tables import artifacts, attempt_inputs, attempts, jobs
from laneway.controller.states import Outcome


def record_artifacts(
    session: Session,
    attempt_id: int,
    stored: list[dict[str, Any]],
    *,
    node: str,
    now: datetime,
) -> None:
    """Record each stored output (``name``, ``sha256``, ``size_bytes``, ``location``) of
    ``attempt_id``, stored by a worker of ``node``; its run, job and stage are the
    attempt's."""
    if not stored:
        return
    owner = session.execute(
        select(attempts.c.run_id, attempts.c.job_id, jobs.c.stage)
        .join(jobs, jobs.c.id == attempts.c.job_id)
        .where(attempts.c.id == attempt_id)
    ).one()
    session.execute(
        insert(artifacts),
        [
            {
                "run_id": owner.run_id,
                "job_id": owner.job_id,
                "attempt_id": attempt_id,
                "stage": owner.stage,
                "node": node,
                "created_at": now,
                "name": row["name"],
                "sha256": row["sha256"],
                "size_bytes": row["size_bytes"],
                "location": row["location"],
            }
            for row in stored
        ],
    )


def delivering_attempt(session: Session, job_id: int, reused_from: int | None) -> int | None:
    """The attempt whose outputs a succeeded job hands on: the earlier run's attempt it
    reused, else its own newest succeeded one (None when none is recorded)."""
    if reused_from is not None:
        return reused_from
    found: int | None = session.execute(
        select(func.max(attempts.c.id)).where(
            attempts.c.job_id == job_id, attempts.c.outcome == Outcome.SUCCEEDED.value
        )
    ).scalar_one()
    return found


def inputs_for(
    session: Session, *, job_id: int, needs_outputs: list[str]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The artifacts a job of ``job_id``'s item gets from the stages it needs that
    declare outputs: those of each needed job's succeeded attempt (or of the earlier
    run's attempt it reused). Returns them and, for a needed stage that recorded none,
    why (e.g. its attempt was reconciled as succeeded before a reconcile stored
    outputs). A few indexed lookups per claimed job."""
    if not needs_outputs:
        return [], []
    item_id = select(jobs.c.item_id).where(jobs.c.id == job_id).scalar_subquery()
    run_id = select(jobs.c.run_id).where(jobs.c.id == job_id).scalar_subquery()
    producers = session.execute(
        select(jobs.c.id, jobs.c.stage, jobs.c.reused_from).where(
            and_(
                jobs.c.run_id == run_id, jobs.c.item_id == item_id, jobs.c.stage.in_(needs_outputs)
            )
        )
    ).all()
    given: list[dict[str, Any]] = []
    problems: list[str] = []
    for producer in sorted(producers, key=lambda row: needs_outputs.index(row.stage)):
        attempt_id = delivering_attempt(session, producer.id, producer.reused_from)
        rows = (
            session.execute(
                select(
                    artifacts.c.id,
                    artifacts.c.stage,
                    artifacts.c.name,
                    artifacts.c.sha256,
                    artifacts.c.size_bytes,
                    artifacts.c.location,
                    artifacts.c.attempt_id,
                )
                .where(artifacts.c.attempt_id == attempt_id)
                .order_by(artifacts.c.name)
            )
            .mappings()
            .all()
            if attempt_id is not None
            else []
        )
        if not rows:
            problems.append(
                f"stage {producer.stage} (job {producer.id}) recorded no outputs"
                + (f" for attempt {attempt_id}" if attempt_id is not None else "")
                + ": settled without storing them; retry that job"
            )
        given += [dict(row) for row in rows]
    return given, problems


def record_inputs(
    session: Session, attempt_id: int, inputs: list[dict[str, Any]], *, node: str, now: datetime
) -> None:
    """What ``attempt_id`` is given: its lineage (``v_lineage``)."""
    if inputs:
        session.execute(
            insert(attempt_inputs),
            [
                {
                    "attempt_id": attempt_id,
                    "artifact_id": row["id"],
                    "stage": row["stage"],
                    "name": row["name"],
                    "sha256": row["sha256"],
                    "size_bytes": row["size_bytes"],
                    "node": node,
                    "created_at": now,
                }
                for row in inputs
            ],
        )


def run_artifacts(session: Session, run_id: int) -> list[dict[str, Any]]:
    """A run's artifacts by item, stage and name (``laneway artifacts``)."""
    rows = session.execute(
        text(
            "SELECT item, stage, job_id, attempt_id, name, sha256, size_bytes, location, node, "
            "created_at FROM v_artifacts WHERE run_id = :run ORDER BY item, stage, name"
        ),
        {"run": run_id},
    )
    return [dict(row) for row in rows.mappings()]
