"""Operator commands: reconcile, retry, cancel; and what the daemon reads for them.

Each is a compare-and-set with an event that says who and why, in one transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from laneway.controller import usage as usage_math
from laneway.controller.errors import IllegalTransition, NotFound
from laneway.controller.ledger.promotion import promote_item
from laneway.controller.ledger.rerun import unmet
from laneway.controller.ledger.runs import run_config
from laneway.controller.ledger.settle import fold_peaks, record_result_usage, release
from laneway.controller.ledger.tables import attempts, jobs, runs
from laneway.controller.ledger.transitions import append_event, move_attempt, move_job, rowcount
from laneway.controller.models import Attempt, Control, Job, Run, Worker
from laneway.controller.states import (
    AttemptState,
    ControlKind,
    EventKind,
    JobState,
    Outcome,
    RunState,
)

RECONCILE_AS = {
    "succeeded": (Outcome.SUCCEEDED, JobState.SUCCEEDED),
    "failed": (Outcome.FAILED, JobState.FAILED),
    "not-run": (Outcome.NOT_RUN, JobState.READY),
}
"""What an operator may say of an unknown attempt, and where its job goes: a job whose
attempt did not run becomes ready for a new attempt (with a new idempotency key)."""


EVIDENCE_JOB_STATE = {Outcome.SUCCEEDED: JobState.SUCCEEDED, Outcome.CANCELLED: JobState.CANCELLED}
"""Where a job goes when evidence settles its unknown attempt (any other class: failed)."""


def reconcile_attempt(
    session: Session,
    attempt_id: int,
    *,
    verdict: str,
    reason: str,
    actor: str,
    now: datetime,
    result: dict[str, Any] | None = None,
    exit_code: int | None = None,
    exit_signal: int | None = None,
    outcome: Outcome | None = None,
) -> JobState:
    """Settle an unknown attempt as the operator says (compare-and-set: of two concurrent
    reconciles exactly one wins; the other gets IllegalTransition). Releases its
    reservation. ``exit_code``/``exit_signal``: from a verified exit record, when there
    is one, so a known exit code is never lost. Once a run has no unknown attempt left,
    its dispatch resumes by itself; halts set by operators stay. Returns the job's new
    state.

    ``outcome``: the class a conclusive exit record established (``controller.
    evidence``; ``verdict`` is then ``evidence``): the attempt settles into it and its job
    becomes succeeded, cancelled or failed (never retried by itself: invariant 2)."""
    job_state: JobState
    if outcome is not None:
        job_state = EVIDENCE_JOB_STATE.get(outcome, JobState.FAILED)
    elif verdict not in RECONCILE_AS:
        raise IllegalTransition(
            f"cannot reconcile as {verdict!r}; use one of {', '.join(RECONCILE_AS)}"
        )
    else:
        outcome, job_state = RECONCILE_AS[verdict]
    values: dict[str, Any] = {
        "outcome": outcome.value,
        "settled_at": now,
        "state_reason": f"reconciled by {actor}: {reason}",
    }
    if result is not None:
        values["result"] = usage_math.storable(result)
    if exit_code is not None:
        values["exit_code"] = exit_code
    if exit_signal is not None:
        values["exit_signal"] = exit_signal
    attempt = move_attempt(
        session,
        attempt_id,
        AttemptState.UNKNOWN,
        AttemptState.SETTLED,
        now=now,
        actor=actor,
        values=values,
        event_detail={
            "reconciled_as": verdict,
            "reason": reason,
            "outcome": outcome.value,
            "exit_code": exit_code,
        },
    )
    moved = move_job(
        session,
        attempt.job_id,
        JobState.UNKNOWN,
        job_state,
        now=now,
        actor=actor,
        reason=f"attempt {attempt.number} reconciled as {verdict}: {reason}",
    )
    record_result_usage(session, attempt, moved, result, now=now)
    release(session, attempt_id, now=now)
    fold_peaks(session, moved.run_id, moved.stage, attempt, {})
    promote_item(session, moved.item_id, now=now, actor=actor)
    return job_state


def unknown_attempts(session: Session, run_id: int) -> list[tuple[Attempt, str, str | None]]:
    """The run's unknown attempts, each with its job's stage and the host of the worker
    that claimed it (read-only)."""
    rows = session.execute(
        select(Attempt, Job.stage, Worker.host)
        .join(Job, Job.id == Attempt.job_id)
        .outerjoin(Worker, Worker.id == Attempt.worker_id)
        .where(Attempt.run_id == run_id, Attempt.state == AttemptState.UNKNOWN)
        .order_by(Attempt.id)
    ).all()
    return [(attempt, stage, host) for attempt, stage, host in rows]


def retry_job(session: Session, job_id: int, *, reason: str, actor: str, now: datetime) -> int:
    """An operator's explicit retry of a failed job: it becomes ready for a new attempt
    (new idempotency key), or waiting when a job it needs is no longer succeeded (the
    operator re-runs that producer in the same transaction, ``rerun_producer``).
    Downstream jobs of the item that were skipped because of it wait again, and a
    finished run is reopened. Returns how many jobs moved."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"job {job_id} is not in the ledger")
    run = session.get(Run, job.run_id)
    assert run is not None
    config = run_config(run)
    move_job(
        session,
        job_id,
        JobState.FAILED,
        JobState.WAITING
        if unmet(session, job.item_id, config.stage(job.stage).needs)
        else JobState.READY,
        now=now,
        actor=actor,
        reason=f"retry by {actor}: {reason}",
    )
    moved = 1
    retried = {job.stage}
    for later in session.execute(
        select(jobs.c.id, jobs.c.stage, jobs.c.state)
        .where(jobs.c.item_id == job.item_id, jobs.c.stage_position > job.stage_position)
        .order_by(jobs.c.stage_position)
    ).all():
        if later.state == JobState.SKIPPED and retried & set(config.stage(later.stage).needs):
            move_job(
                session,
                later.id,
                JobState.SKIPPED,
                JobState.WAITING,
                now=now,
                actor=actor,
                reason=f"upstream {job.stage} retried",
            )
            retried.add(later.stage)
            moved += 1
    reopened = rowcount(
        session.execute(
            update(runs)
            .where(runs.c.id == job.run_id, runs.c.state == RunState.FINISHED.value)
            .values(state=RunState.ACTIVE.value, finished_at=None)
        )
    )
    if reopened:
        append_event(
            session,
            EventKind.RUN_REOPENED,
            actor=actor,
            now=now,
            run_id=job.run_id,
            reason=f"retry of job {job_id}",
        )
    append_event(
        session,
        EventKind.JOB_RETRY,
        actor=actor,
        now=now,
        run_id=job.run_id,
        job_id=job_id,
        reason=reason,
    )
    return moved


def failed_jobs(
    session: Session, run_id: int, *, stage: str | None = None, outcome: Outcome | None = None
) -> list[int]:
    """Ids of the run's failed jobs (of ``stage`` only, and whose newest attempt settled
    as ``outcome`` only, when given), in id order (read-only)."""
    query = select(jobs.c.id).where(jobs.c.run_id == run_id, jobs.c.state == JobState.FAILED.value)
    if stage is not None:
        query = query.where(jobs.c.stage == stage)
    if outcome is not None:
        newest = (
            select(attempts.c.outcome)
            .where(attempts.c.job_id == jobs.c.id, attempts.c.number == jobs.c.attempt_count)
            .scalar_subquery()
        )
        query = query.where(newest == outcome.value)
    return list(session.scalars(query.order_by(jobs.c.id)))


def retry_failed(
    session: Session,
    run_id: int,
    *,
    reason: str,
    actor: str,
    now: datetime,
    stage: str | None = None,
    outcome: Outcome | None = None,
) -> list[int]:
    """An operator's retry of every failed job of a run that matches (``failed_jobs``),
    each as ``retry_job`` does, in one transaction. Returns the retried job ids."""
    chosen = failed_jobs(session, run_id, stage=stage, outcome=outcome)
    for job_id in chosen:
        retry_job(session, job_id, reason=reason, actor=actor, now=now)
    return chosen


def get_attempt(session: Session, attempt_id: int) -> Attempt:
    attempt = session.get(Attempt, attempt_id)
    if attempt is None:
        raise NotFound(f"attempt {attempt_id} is not in the ledger; `laneway status` lists them")
    return attempt


def request_cancel(
    session: Session, attempt_id: int, *, reason: str, actor: str, now: datetime
) -> Attempt:
    """Record an operator's cancel of a running attempt (the caller then sends TERM to its
    supervisor, which stops the group and reports ``stopped``; its settle says
    ``cancelled``). Raises IllegalTransition unless the attempt is running."""
    attempt = get_attempt(session, attempt_id)
    if attempt.state != AttemptState.RUNNING:
        raise IllegalTransition(
            f"attempt {attempt_id} is {attempt.state}; only a running attempt can be cancelled"
        )
    append_event(
        session,
        EventKind.CANCEL_REQUESTED,
        actor=actor,
        now=now,
        run_id=attempt.run_id,
        job_id=attempt.job_id,
        attempt_id=attempt_id,
        reason=reason,
    )
    return attempt


def cancel_pending(session: Session, run_id: int, *, reason: str, actor: str, now: datetime) -> int:
    """Cancel every waiting or ready job of a run (nothing of them has started)."""
    moved = 0
    for job_id, state in session.execute(
        select(jobs.c.id, jobs.c.state).where(
            jobs.c.run_id == run_id,
            jobs.c.state.in_([JobState.WAITING.value, JobState.READY.value]),
        )
    ).all():
        move_job(
            session,
            job_id,
            JobState(state),
            JobState.CANCELLED,
            now=now,
            actor=actor,
            reason=f"cancelled by {actor}: {reason}",
        )
        moved += 1
    return moved


def running_attempts(session: Session, run_id: int) -> list[Attempt]:
    return list(
        session.scalars(
            select(Attempt).where(Attempt.run_id == run_id, Attempt.state == AttemptState.RUNNING)
        )
    )


def record_capture(
    session: Session,
    attempt_id: int,
    *,
    info: dict[str, Any] | None,
    error: str | None,
    actor: str,
    now: datetime,
) -> None:
    """Record a failure capture (archive path, sha256, sizes) or why it failed, as an
    event of the settled attempt. It never changes the attempt's outcome."""
    attempt = get_attempt(session, attempt_id)
    kind, detail = (
        (EventKind.CAPTURE_RECORDED, info or {})
        if error is None
        else (EventKind.CAPTURE_FAILED, {"error": error})
    )
    append_event(
        session,
        kind,
        actor=actor,
        now=now,
        run_id=attempt.run_id,
        job_id=attempt.job_id,
        attempt_id=attempt_id,
        **detail,
    )


_CLOSEOUT_CANDIDATES = (
    select(Run)
    .where(Run.closeout_finished_at.is_(None))
    .where(
        (Run.state == RunState.FINISHED)
        | Run.id.in_(
            select(Control.run_id).where(
                Control.kind == ControlKind.STOP, Control.cleared_at.is_(None)
            )
        )
    )
    .order_by(Run.id)
)
"""Built once: the controller asks after every tick that saw a change."""


def closeout_candidates(session: Session) -> list[Run]:
    """Runs whose closeout may be due: those with steps whose closeout has not finished
    (a column, not a search of the event log), finished or carrying a stop."""
    return [run for run in session.scalars(_CLOSEOUT_CANDIDATES) if run_config(run).closeout]


def mark_closeout_finished(session: Session, run_id: int, *, now: datetime) -> bool:
    """Record that the run's closeout steps all ended (once)."""
    return bool(
        rowcount(
            session.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.closeout_finished_at.is_(None))
                .values(closeout_finished_at=now)
            )
        )
    )
