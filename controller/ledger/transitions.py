"""Transitions and events: the compare-and-set every state write goes through.

``move_job`` and ``move_attempt`` are the only functions that change a job's or an
attempt's state. Each is one ``UPDATE ... WHERE id = :id AND state = :expected [AND
fence = :fence] RETURNING ...``: no returned row means it lost, and only then is the
row read again to say why (``StaleLease`` or ``IllegalTransition``). Its event is
appended in the same transaction (all of a transaction's events are written at its end
in one statement: ``append_events``); the event kind comes from the tables in
``controller.states``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Row, bindparam, select, update
from sqlalchemy.orm import Session

from laneway.controller import db
from laneway.controller.errors import IllegalTransition, NotFound, PartialWrite, StaleLease
from laneway.controller.ledger import statements
from laneway.controller.ledger.tables import attempts, jobs
from laneway.controller.states import (
    ATTEMPT_EVENT,
    ATTEMPT_TRANSITIONS,
    JOB_EVENT,
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATES,
    AttemptState,
    EventKind,
    JobState,
)

PENDING_EVENTS = "laneway_pending_events"
"""``session.info`` key: the events appended in this write transaction, not written yet."""
WRITTEN_EVENTS = "laneway_events_written"
"""``session.info`` key: the ids of the events this write transaction has written."""
APPENDED = "laneway_events_appended"
"""``session.info`` key: how many events this session has appended, written or not.
Every state write appends its event right after its compare-and-set, so a count that
moved means something was written (``refused_before_writing``)."""


def rowcount(result: Any) -> int:
    """Rows matched by an UPDATE: how a compare-and-set learns whether it won."""
    return int(cast(CursorResult[Any], result).rowcount)


def event_row(
    kind: EventKind,
    *,
    actor: str,
    now: datetime,
    run_id: int | None = None,
    job_id: int | None = None,
    attempt_id: int | None = None,
    **detail: Any,
) -> dict[str, Any]:
    """One ``events`` row, for ``append_events``."""
    return {
        "at": now,
        "kind": kind.value if isinstance(kind, EventKind) else str(kind),
        "actor": actor,
        "run_id": run_id,
        "job_id": job_id,
        "attempt_id": attempt_id,
        "detail": detail,
    }


def append_events(session: Session, rows: list[dict[str, Any]]) -> None:
    """Append rows built by ``event_row`` to the transaction's events. In a
    ``db.transaction`` they are written at its end, every event of the transaction in
    one statement (``flush_events``), in the order they were appended; elsewhere now."""
    if not rows:
        return
    session.info[APPENDED] = session.info.get(APPENDED, 0) + len(rows)
    pending = session.info.get(PENDING_EVENTS)
    if pending is None:
        if not db.defer(session, flush_events):
            session.execute(statements.INSERT_EVENT, rows)
            return
        pending = session.info[PENDING_EVENTS] = []
    pending.extend(rows)


def flush_events(session: Session) -> int | None:
    """Write the events appended so far in this transaction, in one statement; returns
    the newest id written (None: nothing was pending). Whatever reads the event log
    inside a write transaction calls it first."""
    pending = session.info.pop(PENDING_EVENTS, None)
    if not pending:
        return None
    db.order_lock(session)  # event ids commit in the order they are drawn
    ids = [int(i) for i in session.execute(statements.INSERT_EVENTS, pending).scalars()]
    session.info.setdefault(WRITTEN_EVENTS, []).extend(ids)
    return max(ids)


def written_events(session: Session) -> list[int]:
    """The ids of the events this write transaction has written so far."""
    return list(session.info.get(WRITTEN_EVENTS, []))


@contextmanager
def refused_before_writing(session: Session) -> Iterator[None]:
    """For a write whose one survivable refusal, ``StaleLease``, comes from its first
    compare-and-set, before anything is written (``settle_attempt`` and ``mark_unknown``
    both begin with ``move_attempt``): the caller catches it and the transaction goes on
    with nothing of this write in it, without a savepoint (which costs a SAVEPOINT and a
    RELEASE statement per settle). A StaleLease raised after this block wrote something
    (an event was appended) would leave half a write behind if caught: it propagates as
    ``PartialWrite`` instead, and the whole transaction rolls back."""
    mark = session.info.get(APPENDED, 0)
    try:
        yield
    except StaleLease as exc:
        if session.info.get(APPENDED, 0) != mark:
            raise PartialWrite(f"refused after writing: {exc}") from exc
        raise


def append_event(
    session: Session,
    kind: EventKind,
    *,
    actor: str,
    now: datetime,
    run_id: int | None = None,
    job_id: int | None = None,
    attempt_id: int | None = None,
    **detail: Any,
) -> None:
    """Append one row to the append-only event log (same transaction as the change)."""
    append_events(
        session,
        [
            event_row(
                kind,
                actor=actor,
                now=now,
                run_id=run_id,
                job_id=job_id,
                attempt_id=attempt_id,
                **detail,
            )
        ],
    )


def latest_event_id(session: Session) -> int:
    """The newest event id: a cheap "did anything change?" signal for polling loops (in a
    write transaction, counting the events it appended)."""
    flush_events(session)
    return session.execute(statements.LATEST_EVENT_ID).scalar() or 0


def events_since(session: Session, seen: int, own: list[int]) -> tuple[int | None, int | None]:
    """After event ``seen``: the newest event id, and the newest that is not in
    ``own`` (events the asker wrote itself, which tell it nothing new); None for none."""
    row = session.execute(statements.EVENTS_SINCE, {"seen": seen, "own": own}).one()
    return row[0], row[1]


def move_job(
    session: Session,
    job_id: int,
    expected: JobState,
    new: JobState,
    *,
    now: datetime,
    actor: str,
    fence: int | None = None,
    reason: str | None = None,
    bump_fence: bool = False,
    attempt_count: int | None = None,
) -> Row[Any]:
    """Compare-and-set a job from ``expected`` to ``new`` and log its event.

    Returns the job's (run_id, item_id, stage, fence, attempt_count) after the move.
    In-session Job objects are not refreshed.

    Raises IllegalTransition if the move is not in JOB_TRANSITIONS or the row is not in
    ``expected``; StaleLease if ``fence`` is given and is no longer the job's fence.
    """
    if new not in JOB_TRANSITIONS[expected]:
        raise IllegalTransition(f"job {job_id}: {expected.value} -> {new.value} is not allowed")
    finish = (
        "set"
        if new in TERMINAL_JOB_STATES
        else ("clear" if expected in TERMINAL_JOB_STATES else None)
    )
    statement = _job_move(fence is not None, bump_fence, finish, attempt_count is not None)
    params: dict[str, Any] = {
        "b_id": job_id,
        "b_expected": expected.value,
        "b_new": new.value,
        "b_now": now,
        "b_reason": reason,
        "b_fence": fence,
        "b_count": attempt_count,
    }
    row = session.execute(statement, params).first()
    if row is None:
        current = session.execute(
            select(jobs.c.state, jobs.c.fence).where(jobs.c.id == job_id)
        ).first()
        if current is None:
            raise NotFound(f"job {job_id} does not exist")
        if fence is not None and current.fence != fence:
            raise StaleLease(
                f"job {job_id}: fence {fence} is stale (current {current.fence}); "
                "this worker's lease was revoked"
            )
        raise IllegalTransition(
            f"job {job_id} is {current.state}, not {expected.value}; cannot move it to {new.value}"
        )
    extra: dict[str, Any] = {"reason": reason} if reason else {}
    append_event(
        session,
        JOB_EVENT[new],
        actor=actor,
        now=now,
        run_id=row.run_id,
        job_id=job_id,
        **extra,
    )
    return row


def start_jobs(
    session: Session, wanted: list[tuple[int, int]], *, now: datetime, actor: str
) -> dict[int, int]:
    """Move a claim's jobs ``ready -> running`` in one statement and log their events:
    ``wanted`` is each (job id, the number of the attempt it starts). Returns each job's
    new fence. Raises IllegalTransition when one of them was no longer ready, or had
    started another attempt meanwhile (the claim read them under its locks: a bug)."""
    if not wanted:
        return {}
    rows = {
        row.id: row
        for row in session.execute(
            statements.START_JOBS, {"b_ids": [job_id for job_id, _ in wanted], "b_now": now}
        )
    }
    for job_id, number in wanted:
        row = rows.get(job_id)
        if row is None or row.attempt_count != number:
            raise IllegalTransition(
                f"job {job_id} is no longer ready for its attempt {number}; cannot start it"
            )
    append_events(
        session,
        [
            event_row(
                JOB_EVENT[JobState.RUNNING],
                actor=actor,
                now=now,
                run_id=rows[job_id].run_id,
                job_id=job_id,
            )
            for job_id, _ in wanted
        ],
    )
    return {job_id: int(rows[job_id].fence) for job_id, _ in wanted}


def move_attempt(
    session: Session,
    attempt_id: int,
    expected: AttemptState | tuple[AttemptState, ...],
    new: AttemptState,
    *,
    now: datetime,
    actor: str,
    fence: int | None = None,
    values: dict[str, Any] | None = None,
    event_detail: dict[str, Any] | None = None,
    job_context: bool = False,
) -> Row[Any]:
    """Compare-and-set an attempt's state (and ``values``), fenced by its job's fence.

    Returns the attempt's (id, job_id, run_id, number, fence, worker_id, peaks) and,
    with ``job_context``, its job's (job_stage, item_id, attempt_count, group_name) and
    its run's config_sha256, read by the same statement."""
    expected_states = expected if isinstance(expected, tuple) else (expected,)
    for state in expected_states:
        if new not in ATTEMPT_TRANSITIONS[state]:
            raise IllegalTransition(
                f"attempt {attempt_id}: {state.value} -> {new.value} is not allowed"
            )
    changes = {"state": new.value, **(values or {})}
    statement = _attempt_move(
        len(expected_states), fence is not None, tuple(sorted(changes)), job_context
    )
    params = {f"v_{key}": value for key, value in changes.items()}
    params.update(
        {f"b_expected{i}": state.value for i, state in enumerate(expected_states)},
        b_id=attempt_id,
        b_fence=fence,
    )
    row = session.execute(statement, params).first()
    if row is None:
        _explain_attempt_miss(session, attempt_id, expected_states, new, fence)
    assert row is not None
    append_event(
        session,
        ATTEMPT_EVENT[new],
        actor=actor,
        now=now,
        run_id=row.run_id,
        job_id=row.job_id,
        attempt_id=attempt_id,
        **(event_detail or {}),
    )
    return row


def _explain_attempt_miss(
    session: Session,
    attempt_id: int,
    expected: tuple[AttemptState, ...],
    new: AttemptState,
    fence: int | None,
) -> None:
    """Why a compare-and-set on an attempt matched nothing (always raises)."""
    current = session.execute(
        select(attempts.c.state, attempts.c.fence, jobs.c.fence.label("job_fence"))
        .join(jobs, jobs.c.id == attempts.c.job_id)
        .where(attempts.c.id == attempt_id)
    ).first()
    if current is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    if fence is not None and (current.fence != fence or current.job_fence != fence):
        raise StaleLease(
            f"attempt {attempt_id}: fence {fence} is stale (job fence {current.job_fence}); "
            "this worker's lease was revoked"
        )
    raise IllegalTransition(
        f"attempt {attempt_id} is {current.state}, not "
        f"{'/'.join(s.value for s in expected)}; cannot move it to {new.value}"
    )


_JOB_MOVES: dict[tuple[bool, bool, str | None, bool], Any] = {}
_ATTEMPT_MOVES: dict[tuple[int, bool, tuple[str, ...], bool], Any] = {}


def _job_move(fenced: bool, bump: bool, finish: str | None, count: bool) -> Any:
    """job_move: the compare-and-set UPDATE of one job, built once per shape (which
    optional parts it has), with every value a bind parameter."""
    key = (fenced, bump, finish, count)
    statement = _JOB_MOVES.get(key)
    if statement is None:
        conditions = [jobs.c.id == bindparam("b_id"), jobs.c.state == bindparam("b_expected")]
        if fenced:
            conditions.append(jobs.c.fence == bindparam("b_fence"))
        values: dict[str, Any] = {
            "state": bindparam("b_new"),
            "updated_at": bindparam("b_now"),
            "state_reason": bindparam("b_reason"),
        }
        if finish == "set":
            values["finished_at"] = bindparam("b_now")
        elif finish == "clear":
            values["finished_at"] = None
        if bump:
            values["fence"] = jobs.c.fence + 1
        if count:
            values["attempt_count"] = bindparam("b_count")
        statement = _JOB_MOVES[key] = (
            update(jobs)
            .where(*conditions)
            .values(**values)
            .returning(*statements.JOB_MOVE_RETURNING)
        )
    return statement


def _attempt_move(
    expected: int, fenced: bool, columns: tuple[str, ...], context: bool = False
) -> Any:
    """attempt_move: the compare-and-set UPDATE of one attempt (fenced by its job's
    fence too), built once per shape: how many expected states, which columns, and
    whether it returns its job's context too (``statements.ATTEMPT_JOB_CONTEXT``)."""
    key = (expected, fenced, columns, context)
    statement = _ATTEMPT_MOVES.get(key)
    if statement is None:
        conditions = [
            attempts.c.id == bindparam("b_id"),
            attempts.c.state.in_([bindparam(f"b_expected{i}") for i in range(expected)]),
        ]
        if fenced:
            current_fence = statements.of_attempts_job(jobs.c.fence)
            conditions += [
                attempts.c.fence == bindparam("b_fence"),
                current_fence == bindparam("b_fence"),
            ]
        statement = _ATTEMPT_MOVES[key] = (
            update(attempts)
            .where(*conditions)
            .values({column: bindparam(f"v_{column}") for column in columns})
            .returning(
                *statements.ATTEMPT_MOVE_RETURNING,
                *(statements.ATTEMPT_JOB_CONTEXT if context else ()),
            )
        )
    return statement
