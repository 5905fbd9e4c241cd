"""Promotion: waiting jobs move on when their needs end, and finished runs close.

Promotion happens in the transaction that made it possible: a settle, a reconcile or a
retry promotes the item it touched (``promote_item``). The controller's safety net
(``changes_after``, driven by the daemon) follows the event log from a cursor, so its
cost follows what changed since its last look, never the size of the backlog.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from laneway.controller import db
from laneway.controller.ledger import statements
from laneway.controller.ledger.runs import frozen_config
from laneway.controller.ledger.tables import jobs, runs
from laneway.controller.ledger.transitions import (
    append_event,
    append_events,
    event_row,
    flush_events,
    move_job,
    rowcount,
)
from laneway.controller.states import (
    CONTROL_CLEARED_EVENT,
    CONTROL_SET_EVENT,
    TERMINAL_JOB_EVENTS,
    TERMINAL_JOB_STATES,
    EventKind,
    JobState,
    RunState,
)


def promote_item(session: Session, item_id: int, *, now: datetime, actor: str) -> int:
    """Move the item's waiting jobs to ready when every need succeeded, or to skipped
    (with the reason) when a need ended without success. Returns how many moved.

    Under the order lock: two workers settling an item's two needs at once must not
    both read the other's job as still running (then neither would promote)."""
    db.order_lock(session)
    rows = session.execute(statements.ITEM_JOBS, {"item_id": item_id}).all()
    if not any(row.state == JobState.WAITING for row in rows):
        return 0
    states = {row.stage: JobState(row.state) for row in rows}
    run_id = rows[0].run_id
    sha = session.execute(select(runs.c.config_sha256).where(runs.c.id == run_id)).scalar_one()
    config = frozen_config(session, run_id, sha)
    moved = 0
    for row in rows:
        if states[row.stage] is not JobState.WAITING:
            continue
        needs = {need: states[need] for need in config.stage(row.stage).needs}
        blocked = [
            f"{need} {state.value}"
            for need, state in needs.items()
            if state in TERMINAL_JOB_STATES and state is not JobState.SUCCEEDED
        ]
        if blocked:
            target = JobState.SKIPPED
            reason: str | None = "needed stage did not succeed: " + ", ".join(blocked)
        elif all(state is JobState.SUCCEEDED for state in needs.values()):
            target, reason = JobState.READY, None
        else:
            continue
        move_job(session, row.id, JobState.WAITING, target, now=now, actor=actor, reason=reason)
        states[row.stage] = target  # a skip cascades to later stages in this pass
        moved += 1
    return moved


def next_retry_at(session: Session) -> datetime | None:
    """When the first job waiting out a retry backoff may run again (None: no job
    waits). One index probe (``ix_jobs_retry_after``)."""
    moment = session.execute(statements.NEXT_RETRY_AT).scalar()
    if isinstance(moment, str):  # SQLite hands an aggregate back as text
        moment = datetime.fromisoformat(moment)
    return moment


def release_due_retries(session: Session, *, now: datetime, actor: str, batch: int = 1000) -> int:
    """Ready jobs whose retry backoff has passed become claimable again: ``retry_after``
    is cleared, with a ``job_retry_due`` event each (which wakes idle workers). Only jobs
    still backing off hold a ``retry_after``, so the cost follows them, not the run."""
    due = select(jobs.c.id).where(jobs.c.retry_after <= now).limit(batch)
    rows = session.execute(
        update(jobs)
        .where(jobs.c.id.in_(due.scalar_subquery()))
        .values(retry_after=None)
        .returning(jobs.c.id, jobs.c.run_id)
    ).all()
    append_events(
        session,
        [
            event_row(EventKind.JOB_RETRY_DUE, actor=actor, now=now, run_id=run_id, job_id=job_id)
            for job_id, run_id in rows
        ],
    )
    return len(rows)


def promote_run(session: Session, run_id: int, *, now: datetime, actor: str) -> int:
    """``promote_item`` for every item of the run that still has waiting jobs: a full
    pass, for the controller's start only (``changes_after`` follows changes)."""
    item_ids = session.scalars(
        select(jobs.c.item_id)
        .where(jobs.c.run_id == run_id, jobs.c.state == JobState.WAITING.value)
        .distinct()
    ).all()
    return sum(promote_item(session, item_id, now=now, actor=actor) for item_id in item_ids)


RUN_LEVEL_EVENTS = frozenset(
    {
        EventKind.RUN_CREATED,
        EventKind.RUN_FINISHED,
        EventKind.RUN_REOPENED,
        *CONTROL_SET_EVENT.values(),
        *CONTROL_CLEARED_EVENT.values(),
    }
)
"""Events after which the runs that may owe a closeout are read again."""


@dataclass
class Changes:
    """What the events after a cursor touched."""

    cursor: int
    items: set[int] = field(default_factory=set)
    """Items with a job that reached a terminal state: their waiting jobs may move."""
    item_runs: dict[int, int] = field(default_factory=dict)
    """The run of each of ``items``."""
    runs: set[int] = field(default_factory=set)
    """Runs whose jobs changed, or that were created or reopened: they may be done."""
    backoffs: bool = False
    """A job became ready: it may be waiting out a retry backoff (only a settle starts
    one, and it makes the job ready)."""
    run_level: bool = False
    """A run was created, finished or reopened, or a control was set or cleared: which
    runs may owe a closeout may have changed."""
    more: bool = False
    """The page was full: call again."""


def changes_after(session: Session, cursor: int, *, batch: int = 1000) -> Changes:
    """Read (no writes) one page of events after ``cursor``: an index range on the
    primary key, as long as what happened since, not as long as the log."""
    flush_events(session)
    rows = session.execute(statements.EVENTS_AFTER, {"cursor": cursor, "batch": batch}).all()
    changes = Changes(cursor=rows[-1].id if rows else cursor, more=len(rows) == batch)
    for row in rows:
        if row.kind in TERMINAL_JOB_EVENTS and row.item_id is not None:
            changes.items.add(row.item_id)
            changes.item_runs[row.item_id] = row.run_id
            changes.runs.add(row.run_id)
        elif row.kind in (EventKind.RUN_CREATED, EventKind.RUN_REOPENED, EventKind.JOB_RETRY):
            changes.runs.add(row.run_id)
        if row.kind == EventKind.JOB_READY:
            changes.backoffs = True
        elif row.kind in RUN_LEVEL_EVENTS:
            changes.run_level = True
    return changes


def items_with_waiting(session: Session, item_ids: set[int]) -> list[int]:
    """Which of these items still have a waiting job (read-only)."""
    if not item_ids:
        return []
    return list(session.execute(statements.ITEMS_WAITING, {"item_ids": sorted(item_ids)}).scalars())


def run_has_open_jobs(session: Session, run_id: int) -> bool:
    """One index probe: is any job of the run not terminal?"""
    return bool(session.execute(statements.RUN_OPEN_JOB, {"run_id": run_id}).scalar())


def close_run_if_done(session: Session, run_id: int, *, now: datetime, actor: str) -> bool:
    """Active -> finished when every job of the run is terminal. Returns True if closed."""
    if run_has_open_jobs(session, run_id):
        return False
    changed = rowcount(
        session.execute(
            update(runs)
            .where(runs.c.id == run_id, runs.c.state == RunState.ACTIVE.value)
            .values(state=RunState.FINISHED.value, finished_at=now)
        )
    )
    if changed != 1:
        return False
    counts = {
        str(state): count
        for state, count in session.execute(
            select(jobs.c.state, func.count()).where(jobs.c.run_id == run_id).group_by(jobs.c.state)
        ).all()
    }
    append_event(session, EventKind.RUN_FINISHED, actor=actor, now=now, run_id=run_id, jobs=counts)
    return True
