"""Re-running a producer whose stored outputs are gone: what an operator's ``retry`` of a
consumer reads first (``delivered_inputs``) and writes (``rerun_producer``).

A consumer is given the artifacts of the succeeded attempt of each job it needs (or of
the earlier run's attempt that job reused, ``inputs_for``). When such an artifact has
since left the store, retrying the consumer alone fails the same way; the operator's
retry then re-runs the producer too (``controller.retry_plan`` decides which, after one
confirmation). That is the one way out of ``succeeded``: only an operator's word re-runs
work that succeeded.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from laneway.controller.config import PipelineConfig
from laneway.controller.errors import NotFound
from laneway.controller.ledger.artifacts import delivering_attempt
from laneway.controller.ledger.runs import get_run, run_config
from laneway.controller.ledger.tables import artifacts, attempt_usage, items, jobs
from laneway.controller.ledger.transitions import append_event, move_job
from laneway.controller.states import EventKind, JobState


@dataclass(frozen=True)
class Delivered:
    """What one succeeded job a consumer needs delivered to it."""

    consumer: int
    producer: int
    label: str
    """The producer as ``ITEM.STAGE``."""
    attempt_id: int | None
    """The attempt whose outputs the consumer is given (the job's own, or the one it
    reused); None when no succeeded attempt is recorded."""
    outputs: tuple[tuple[str, str, str], ...]
    """(name, sha256, location) of each artifact that attempt stored."""
    paid: bool
    """That attempt reported usage: running the producer again may cost money."""


def delivered_inputs(session: Session, job_ids: Collection[int]) -> list[Delivered]:
    """For each job of ``job_ids``, the succeeded jobs of its item that it needs and what
    their delivering attempt stored (read-only; a few indexed lookups per job)."""
    found: list[Delivered] = []
    configs: dict[int, PipelineConfig] = {}
    for job_id in sorted(set(job_ids)):
        job = session.execute(
            select(jobs.c.run_id, jobs.c.item_id, jobs.c.stage).where(jobs.c.id == job_id)
        ).first()
        if job is None:
            raise NotFound(f"job {job_id} is not in the ledger")
        if job.run_id not in configs:
            configs[job.run_id] = run_config(get_run(session, job.run_id))
        needs = configs[job.run_id].stage(job.stage).needs
        if not needs:
            continue
        key = session.execute(select(items.c.key).where(items.c.id == job.item_id)).scalar_one()
        for producer in session.execute(
            select(jobs.c.id, jobs.c.stage, jobs.c.reused_from)
            .where(
                jobs.c.item_id == job.item_id,
                jobs.c.stage.in_(needs),
                jobs.c.state == JobState.SUCCEEDED.value,
            )
            .order_by(jobs.c.stage_position)
        ).all():
            attempt_id = delivering_attempt(session, producer.id, producer.reused_from)
            outputs = session.execute(
                select(artifacts.c.name, artifacts.c.sha256, artifacts.c.location)
                .where(artifacts.c.attempt_id == attempt_id)
                .order_by(artifacts.c.name)
            ).all()
            paid = (
                attempt_id is not None
                and session.execute(
                    select(attempt_usage.c.attempt_id)
                    .where(attempt_usage.c.attempt_id == attempt_id)
                    .limit(1)
                ).first()
                is not None
            )
            found.append(
                Delivered(
                    consumer=job_id,
                    producer=producer.id,
                    label=f"{key}.{producer.stage}",
                    attempt_id=attempt_id,
                    outputs=tuple((o.name, o.sha256, o.location) for o in outputs),
                    paid=paid,
                )
            )
    return found


def rerun_producer(
    session: Session, job_id: int, *, why: str, reason: str, actor: str, now: datetime
) -> None:
    """An operator's re-run of a succeeded job whose stored outputs are gone (``why``):
    it becomes ready for a new attempt (new idempotency key), or waiting while a job it
    needs is re-run too (re-run the deepest producer first), and no longer points at a
    reused attempt, so its consumers are given what the new attempt stores. Raises
    IllegalTransition when the job is no longer succeeded."""
    job = session.execute(
        select(jobs.c.run_id, jobs.c.item_id, jobs.c.stage).where(jobs.c.id == job_id)
    ).one()
    needs = run_config(get_run(session, job.run_id)).stage(job.stage).needs
    move_job(
        session,
        job_id,
        JobState.SUCCEEDED,
        JobState.WAITING if unmet(session, job.item_id, needs) else JobState.READY,
        now=now,
        actor=actor,
        reason=f"re-run by {actor}: {why}",
    )
    session.execute(update(jobs).where(jobs.c.id == job_id).values(reused_from=None))
    append_event(
        session,
        EventKind.JOB_RETRY,
        actor=actor,
        now=now,
        run_id=job.run_id,
        job_id=job_id,
        reason=f"{reason} (its output is gone: {why})",
    )


def unmet(session: Session, item_id: int, needs: Collection[str]) -> bool:
    """Whether a job of ``item_id`` that needs ``needs`` must wait: one of them is not
    succeeded (one indexed lookup, ``uq_jobs_item_id_stage``)."""
    return bool(needs) and any(
        state != JobState.SUCCEEDED.value
        for state in session.scalars(
            select(jobs.c.state).where(jobs.c.item_id == item_id, jobs.c.stage.in_(needs))
        )
    )
