"""Controls: pause, stop and halt, each set and cleared with who, why and when."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, select, update
from sqlalchemy.orm import Session

from laneway.controller import db
from laneway.controller.clock import iso
from laneway.controller.errors import IllegalTransition, NotFound
from laneway.controller.ledger.tables import controls
from laneway.controller.ledger.transitions import append_event, rowcount
from laneway.controller.models import Control, Run
from laneway.controller.states import (
    CONTROL_CLEARED_EVENT,
    CONTROL_SET_EVENT,
    ControlKind,
    ControlScope,
    RunState,
)


def set_control(
    session: Session,
    kind: ControlKind,
    *,
    scope: ControlScope,
    reason: str,
    actor: str,
    now: datetime,
    run_id: int | None = None,
    lane: str | None = None,
) -> int:
    """Set a pause, stop or halt; it stays until cleared (``clear_controls``). Under the
    order lock: a worker's claim that commits after it sees it (``ledger.claim``)."""
    db.order_lock(session)
    control = Control(
        kind=kind,
        scope=scope,
        run_id=run_id,
        lane=lane,
        reason=reason,
        set_by=actor,
        set_at=now,
    )
    session.add(control)
    session.flush()
    append_event(
        session,
        CONTROL_SET_EVENT[kind],
        actor=actor,
        now=now,
        run_id=run_id,
        scope=scope.value,
        lane=lane,
        reason=reason,
        control_id=control.id,
    )
    return control.id


def check_pausable(session: Session, run_id: int, *, lane: str | None = None) -> None:
    """Refuse an operator's pause of a finished run (IllegalTransition, nothing written):
    none of its jobs is dispatched any more, so a pause would hold nothing, and it would
    stay in force, unseen, over the jobs a later ``laneway retry`` reopens. NotFound
    for an unknown run."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} is not in the ledger; `laneway status` lists the newest")
    if run.state != RunState.FINISHED:
        return
    what = f"run {run_id}" + (f" lane {lane}" if lane else "")
    when = f" at {iso(run.finished_at)}" if run.finished_at is not None else ""
    raise IllegalTransition(
        f"run {run_id} finished{when}: nothing of it is dispatched any more, so {what} is "
        f"not paused (nothing written); `laneway retry JOB --run {run_id} --reason '...'` "
        "reopens a job of it"
    )


def run_paused(session: Session, run_id: int) -> bool:
    """Does the run carry an active pause?"""
    return (
        session.execute(
            select(controls.c.id).where(
                controls.c.run_id == run_id,
                controls.c.kind == ControlKind.PAUSE.value,
                controls.c.cleared_at.is_(None),
            )
        ).first()
        is not None
    )


def pause_run(session: Session, run_id: int, *, reason: str, actor: str, now: datetime) -> bool:
    """Pause a run (``set_control``) unless it carries an active pause already (then no
    second pause is set). True if this call paused it."""
    db.order_lock(session)  # two workers' settles must not both find it unpaused
    if run_paused(session, run_id):
        return False
    set_control(
        session,
        ControlKind.PAUSE,
        scope=ControlScope.RUN,
        run_id=run_id,
        reason=reason,
        actor=actor,
        now=now,
    )
    return True


def clear_controls(
    session: Session,
    kinds: tuple[ControlKind, ...],
    *,
    reason: str,
    actor: str,
    now: datetime,
    run_id: int | None = None,
) -> int:
    """Clear active controls of ``kinds`` on a run (or global ones when run_id is None).
    Returns how many were cleared; each clear is an event with who and why."""
    scope_match = Control.run_id.is_(None) if run_id is None else Control.run_id == run_id
    rows = session.execute(
        select(Control.id, Control.kind, Control.run_id).where(
            Control.cleared_at.is_(None),
            Control.kind.in_([k.value for k in kinds]),
            scope_match,
        )
    ).all()
    for control in rows:
        changed = rowcount(
            session.execute(
                update(controls)
                .where(and_(controls.c.id == control.id, controls.c.cleared_at.is_(None)))
                .values(cleared_at=now, cleared_by=actor, clear_reason=reason)
            )
        )
        if changed == 1:
            append_event(
                session,
                CONTROL_CLEARED_EVENT[ControlKind(control.kind)],
                actor=actor,
                now=now,
                run_id=control.run_id,
                control_id=control.id,
                reason=reason,
            )
    return len(rows)
