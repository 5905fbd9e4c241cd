"""Spawn and settle: an attempt's identity is recorded, then its outcome.

A settle is one transaction: the attempt moves to settled (fenced), its job moves on
(``controller.policy`` decides where), lease and reservation are released, the stage's
measured peaks are folded into ``stage_stats``, the item's waiting jobs are promoted,
and the circuit breakers are applied (invariant 11).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from laneway.controller import breakers, db, policy
from laneway.controller import usage as usage_math
from laneway.controller.clock import iso
from laneway.controller.ledger import selection, statements
from laneway.controller.ledger import usage as usage_ledger
from laneway.controller.ledger.controls import pause_run, set_control
from laneway.controller.ledger.promotion import promote_item
from laneway.controller.ledger.runs import frozen_config
from laneway.controller.ledger.tables import attempts, items, jobs
from laneway.controller.ledger.transitions import move_attempt, move_job, rowcount
from laneway.controller.outcome import Verdict as OutcomeVerdict
from laneway.controller.outcome import retry_after as asked_delay
from laneway.controller.states import (
    IN_FLIGHT_ATTEMPT_STATES,
    AttemptState,
    ControlKind,
    ControlScope,
    JobState,
    Outcome,
)


def record_spawn(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    actor: str,
    now: datetime,
    boot_id: str,
    supervisor_pid: int,
    supervisor_start_time: int | None,
    child_pid: int | None,
    child_start_time: int | None,
    started_at: datetime | None = None,
) -> None:
    """Intent -> running: the supervisor (and child) identity is now in the ledger.
    ``started_at``: when the worker read the supervisor's report, if that was before
    ``now`` (the worker records identities with its next write)."""
    move_attempt(
        session,
        attempt_id,
        AttemptState.INTENT,
        AttemptState.RUNNING,
        now=now,
        actor=actor,
        fence=fence,
        values={
            "started_at": now if started_at is None else min(started_at, now),
            "boot_id": boot_id,
            "supervisor_pid": supervisor_pid,
            "supervisor_start_time": supervisor_start_time,
            "child_pid": child_pid,
            "child_start_time": child_start_time,
        },
        event_detail={"supervisor_pid": supervisor_pid, "child_pid": child_pid},
    )


def record_spawn_from_exit(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    actor: str,
    now: datetime,
    exit_record: dict[str, Any] | None,
) -> bool:
    """Intent -> running from the attempt's exit record, for an attempt settled while
    its identity was still waiting for its worker's next write (the worker died first):
    the supervisor wrote who it and the child were, and when the child started. Values
    of the wrong type are left out; no supervisor pid, no write. True if recorded."""
    record = exit_record or {}

    def whole(key: str) -> int | None:
        value = record.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    supervisor_pid = whole("supervisor_pid")
    boot = record.get("boot_id")
    if supervisor_pid is None or supervisor_pid <= 0 or not isinstance(boot, str):
        return False
    started_at = None
    if isinstance(record.get("started_at"), str):
        try:
            started_at = datetime.fromisoformat(record["started_at"]).astimezone(UTC)
        except ValueError:
            started_at = None
        if started_at is not None and now.tzinfo is None:
            started_at = started_at.replace(tzinfo=None)  # the ledger's naive UTC
    record_spawn(
        session,
        attempt_id,
        fence=fence,
        actor=actor,
        now=now,
        boot_id=boot[:64],
        supervisor_pid=supervisor_pid,
        supervisor_start_time=whole("supervisor_start_time"),
        child_pid=whole("child_pid"),
        child_start_time=whole("child_start_time"),
        started_at=started_at,
    )
    return True


def settle_attempt(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    outcome: Outcome,
    actor: str,
    now: datetime,
    reason: str | None = None,
    exit_code: int | None = None,
    exit_signal: int | None = None,
    result: dict[str, Any] | None = None,
    diagnostics: list[str] | None = None,
    revoke: bool = False,
    measured: dict[str, Any] | None = None,
) -> JobState:
    """Settle an attempt into ``outcome``, move its job on, release lease and reservation.

    ``revoke``: settling on the lease holder's behalf (the controller, after the lease
    expired) bumps the fence, so the holder, should it return, gets StaleLease.

    The job's next state comes from ``policy.next_job_state``. Downstream jobs of the
    item are promoted or skipped in the same transaction. Returns the job's new state.
    StaleLease if ``fence`` is no longer current.

    The result's ``usage`` is stored and added to its stage's spend whatever the
    outcome (money spent on a failure is spent); a value that is not a finite,
    non-negative number is left out with a diagnostic and changes nothing else.
    Nothing in ``result`` makes the settle fail: what no backend can store is replaced
    (``usage.stored_result``) and said so in a diagnostic; reason and diagnostics, which
    may quote what the job wrote, are cleaned the same way.
    """
    columns = _measured_columns(measured)
    stored, storage_notes = usage_math.stored_result(result)
    usage, usage_warnings = usage_math.read_usage(result)
    reason = None if reason is None else usage_math.clean_text(reason)
    notes = [usage_math.clean_text(str(d)) for d in diagnostics or []]
    attempt = move_attempt(
        session,
        attempt_id,
        IN_FLIGHT_ATTEMPT_STATES,
        AttemptState.SETTLED,
        now=now,
        actor=actor,
        fence=fence,
        values={
            "outcome": outcome.value,
            "settled_at": now,
            "state_reason": reason,
            "exit_code": exit_code,
            "exit_signal": exit_signal,
            "result": stored,
            "diagnostics": [*notes, *storage_notes, *map(usage_math.clean_text, usage_warnings)],
            **columns,
        },
        event_detail={"outcome": outcome.value, "exit_code": exit_code, "reason": reason},
        job_context=True,  # the job's stage, item, attempts and group, in the same statement
    )
    job_id, job_stage = attempt.job_id, attempt.job_stage
    stored_usage = usage_ledger.record_usage(
        session,
        attempt_id=attempt_id,
        run_id=attempt.run_id,
        job_id=job_id,
        stage=job_stage,
        usage=usage,
        now=now,
    )
    config = frozen_config(session, attempt.run_id, attempt.config_sha256)
    if stored_usage:
        selection.record_group_usage(session, config, attempt.run_id, attempt.group_name, usage)
    stage = config.stage(job_stage)
    new_state = policy.next_job_state(stage, outcome, attempt.attempt_count)
    delay = 0.0
    if new_state is JobState.READY and outcome is Outcome.RATE_LIMITED:
        asked = asked_delay(result if isinstance(result, dict) else None)
        delay = policy.rate_limited_delay(stage.retry, attempt.attempt_count, asked)
    elif new_state is JobState.READY:
        delay = policy.retry_delay(stage.retry, attempt.attempt_count)
    retry_after = now + timedelta(seconds=delay) if delay > 0 else None
    job_reason = (
        None if new_state is JobState.SUCCEEDED else f"attempt {attempt.number}: {outcome.value}"
    )
    if retry_after is not None:
        why = "rate limited" if outcome is Outcome.RATE_LIMITED else "backoff"
        job_reason = f"{job_reason}; retry after {iso(retry_after)} ({why} {delay:g} s)"
    move_job(
        session,
        job_id,
        JobState.RUNNING,
        new_state,
        now=now,
        actor=actor,
        fence=fence,
        bump_fence=revoke,
        reason=job_reason,
    )
    if retry_after is not None:
        # Same transaction as the move: no claim can see the job ready without it.
        session.execute(update(jobs).where(jobs.c.id == job_id).values(retry_after=retry_after))
    release(session, attempt_id, now=now)
    fold_peaks(session, attempt.run_id, job_stage, attempt, columns)
    if any(job_stage in stage.needs for stage in config.stages):
        promote_item(session, attempt.item_id, now=now, actor=actor)
    _trip_breaker(session, attempt, outcome, reason, now=now, actor=actor)
    return new_state


def fold_peaks(
    session: Session, run_id: int, stage: str, attempt: Any, columns: dict[str, Any]
) -> None:
    """Fold a settled attempt's peaks (``columns`` when the settle carried them, else
    what ``record_samples`` stored, returned by the settle's UPDATE) into its stage's
    row, which is what admission reads. Nothing to fold: no statement."""
    source = columns or attempt._mapping
    rss, gpu = source.get("peak_rss_mib"), source.get("peak_gpu_mib")
    if rss is None and gpu is None:
        return
    params = {"b_run_id": run_id, "b_stage": stage, "rss": rss, "gpu": gpu}
    db.shared_write(session, lambda s: s.execute(statements.STAGE_MEASURED, params))


def _trip_infra_breaker(session: Session, run_id: int, *, now: datetime, actor: str) -> None:
    sha = session.execute(statements.RUN_FROZEN, {"run_id": run_id}).one().config_sha256
    limit = frozen_config(session, run_id, sha).infra_breaker
    # Under the order lock: two workers settling the streak's last two failures at once
    # must each see the other's (then the second trips the breaker).
    db.order_lock(session)
    # Newest first, and only back to the last success: the cost follows the streak.
    newest_first: list[tuple[str, Outcome]] = []
    result = session.execute(
        select(items.c.key, attempts.c.outcome)
        .join(jobs, jobs.c.id == attempts.c.job_id)
        .join(items, items.c.id == jobs.c.item_id)
        .where(attempts.c.run_id == run_id, attempts.c.state == AttemptState.SETTLED.value)
        .order_by(attempts.c.settled_at.desc(), attempts.c.id.desc())
        .execution_options(yield_per=64)
    )
    for key, outcome in result:
        newest_first.append((key, Outcome(str(outcome))))
        if outcome == Outcome.SUCCEEDED:
            break
    result.close()
    history = list(reversed(newest_first))
    if not breakers.infra_breaker_trips(history, limit):
        return
    streak = sorted(breakers.infra_streak(history))
    pause_run(
        session,
        run_id,
        reason=(
            f"infrastructure failures of {len(streak)} distinct items in a row "
            f"({', '.join(streak)}); breaker threshold {limit}"
        ),
        actor=actor,
        now=now,
    )


def _trip_breaker(
    session: Session,
    attempt: Any,
    outcome: Outcome,
    reason: str | None,
    *,
    now: datetime,
    actor: str,
) -> None:
    """Invariant 11, in the settle's own transaction: a fatal outcome halts the run, a
    harness failure (laneway's own side broke) pauses it. Ordinary failures never trip."""
    if outcome is Outcome.INFRA_FAILURE:
        _trip_infra_breaker(session, attempt.run_id, now=now, actor=actor)
        return
    kind = {Outcome.FATAL: ControlKind.HALT, Outcome.HARNESS_FAILURE: ControlKind.PAUSE}.get(
        outcome
    )
    if kind is None:
        return
    set_control(
        session,
        kind,
        scope=ControlScope.RUN,
        run_id=attempt.run_id,
        reason=f"attempt {attempt.id} settled {outcome.value}: {reason or 'no reason given'}",
        actor=actor,
        now=now,
    )


def settle_from_verdict(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    verdict: OutcomeVerdict,
    exit_record: dict[str, Any] | None,
    result: dict[str, Any] | None,
    actor: str,
    now: datetime,
    measured: dict[str, Any] | None = None,
    revoke: bool = False,
    reason_suffix: str = "",
) -> JobState:
    """``settle_attempt`` from a classified outcome (``controller.outcome``) and the exit
    record it came from. The verdict must have an outcome (unknown goes to mark_unknown)."""
    assert verdict.outcome is not None
    record = exit_record or {}
    return settle_attempt(
        session,
        attempt_id,
        fence=fence,
        outcome=verdict.outcome,
        actor=actor,
        now=now,
        reason=verdict.reason + reason_suffix,
        exit_code=record.get("exit_code"),
        exit_signal=record.get("signal"),
        result=result,
        diagnostics=verdict.diagnostics,
        measured=measured,
        revoke=revoke,
    )


MEASURED_COLUMNS = (
    "current_rss_mib",
    "peak_rss_mib",
    "peak_rss_at",
    "peak_gpu_mib",
    "peak_gpu_at",
    "gpu_note",
    "sampled_at",
)


def _measured_columns(measured: dict[str, Any] | None) -> dict[str, Any]:
    if not measured or measured.get("sampled_at") is None:
        return {}
    return {column: measured.get(column) for column in MEASURED_COLUMNS}


def record_samples(session: Session, attempt_id: int, *, fence: int, **measured: Any) -> bool:
    """Store an in-flight attempt's latest and peak measurements (fenced; no state change
    and no event: samples are evidence, written often). False if the fence is stale or
    the attempt is no longer in flight."""
    values = _measured_columns(measured)
    if not values:
        return False
    current_fence = statements.of_attempts_job(jobs.c.fence)
    changed = rowcount(
        session.execute(
            update(attempts)
            .where(
                attempts.c.id == attempt_id,
                attempts.c.fence == fence,
                current_fence == fence,
                attempts.c.state.in_([s.value for s in IN_FLIGHT_ATTEMPT_STATES]),
            )
            .values(**values)
        )
    )
    return changed == 1


def mark_unknown(
    session: Session,
    attempt_id: int,
    *,
    reason: str,
    actor: str,
    now: datetime,
    fence: int | None = None,
    result: dict[str, Any] | None = None,
) -> None:
    """The attempt's outcome cannot be established: attempt and job become unknown, the
    lease is revoked (fence bumped), and dispatch for the run halts until reconciled.
    The reservation stays held: the process may still be running (and its expected
    cost stays held against budgets). Usage in ``result``, when one was read, is
    stored: it was spent whatever the outcome turns out to be."""
    # Under the order lock: a worker's claim that commits after this sees the unknown
    # outcome, which stops its run's dispatch (``ledger.claim``).
    db.order_lock(session)
    reason = usage_math.clean_text(reason)
    attempt = move_attempt(
        session,
        attempt_id,
        IN_FLIGHT_ATTEMPT_STATES,
        AttemptState.UNKNOWN,
        now=now,
        actor=actor,
        fence=fence,
        values={"state_reason": reason},
        event_detail={"reason": reason},
    )
    moved = move_job(
        session,
        attempt.job_id,
        JobState.RUNNING,
        JobState.UNKNOWN,
        now=now,
        actor=actor,
        reason=reason,
        bump_fence=True,
    )
    record_result_usage(session, attempt, moved, result, now=now)
    session.execute(statements.RELEASE_LEASE, {"b_attempt_id": attempt_id, "b_now": now})


def record_result_usage(
    session: Session, attempt: Any, job: Any, result: dict[str, Any] | None, *, now: datetime
) -> None:
    """Store the usage ``result`` reports (none when no result was read) and add it to
    its stage's spend (and, in a run that selects by yield, to its group's yield), for an
    attempt moved out of flight other than by ``settle_attempt`` (marked unknown,
    reconciled). ``attempt`` and ``job`` are the rows ``move_attempt`` and ``move_job``
    returned."""
    usage = usage_math.read_usage(result)[0]
    stored = usage_ledger.record_usage(
        session,
        attempt_id=attempt.id,
        run_id=job.run_id,
        job_id=attempt.job_id,
        stage=job.stage,
        usage=usage,
        now=now,
    )
    if stored:
        context = session.execute(statements.JOB_CONTEXT, {"job_id": attempt.job_id}).one()
        if context.group_name is not None:
            config = frozen_config(session, context.run_id, context.config_sha256)
            selection.record_group_usage(session, config, context.run_id, context.group_name, usage)


def release(session: Session, attempt_id: int, *, now: datetime) -> None:
    """An attempt's lease and reservation end (it settled); the expected cost the
    reservation held against budgets is given back."""
    session.execute(statements.RELEASE_LEASE, {"b_attempt_id": attempt_id, "b_now": now})
    held = session.execute(
        usage_ledger.RELEASE_RESERVATION_USAGE, {"b_attempt_id": attempt_id, "b_now": now}
    ).scalar()
    usage_ledger.release_expected(session, attempt_id, held)


def refuse_start(
    session: Session,
    attempt_id: int,
    *,
    run_id: int,
    fence: int,
    reason: str,
    actor: str,
    now: datetime,
) -> None:
    """Its inputs could not be given: a harness failure (nothing was started), and the
    run pauses until an operator has looked at the store (``laneway resume``)."""
    settle_attempt(
        session,
        attempt_id,
        fence=fence,
        outcome=Outcome.HARNESS_FAILURE,
        actor=actor,
        now=now,
        reason=f"not started: {reason}",
    )
    pause_run(session, run_id, reason=f"attempt {attempt_id}: {reason}", actor=actor, now=now)
