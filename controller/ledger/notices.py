"""Controllers' heartbeats and the notifications told to the operator.

A serving controller registers a ``controllers`` row on its first tick, heartbeats it,
and marks it stopped when it exits cleanly; a row whose heartbeat stopped without a stop
is a lost controller (``status_nodes.worker_liveness`` judges it, as it judges workers).
``notifications`` holds one row per attention state told to the operator, created at
most once per ``key`` (every writer holds the ledger's write lock, so the look and the
insert cannot race); ``notification_deliveries`` records every try of every channel.
The delivery itself, and what makes a notification, is ``controller/notify.py``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.orm import Session

from laneway.controller.ledger.tables import (
    controllers,
    events,
    notification_deliveries,
    notifications,
)
from laneway.controller.ledger.transitions import flush_events
from laneway.controller.states import Attention, NotificationState


def register_controller(
    session: Session, *, host: str, pid: int, boot_id: str, now: datetime
) -> tuple[int, int | None]:
    """Record a serving controller; its id, and where the previous controller's
    notifier stopped reading the event log (None: no controller before it)."""
    previous = session.execute(
        select(controllers.c.notify_cursor).order_by(controllers.c.id.desc()).limit(1)
    ).first()
    controller_id = session.execute(
        insert(controllers)
        .values(host=host, pid=pid, boot_id=boot_id, started_at=now, heartbeat_at=now)
        .returning(controllers.c.id)
    ).scalar_one()
    if previous is None:
        return controller_id, None
    return controller_id, previous.notify_cursor or 0


def controller_heartbeat(
    session: Session,
    controller_id: int,
    *,
    now: datetime,
    notify_cursor: int | None,
    stopped: bool = False,
) -> None:
    """Renew the controller's heartbeat (and its notifier's cursor); ``stopped``: it
    exits cleanly."""
    values: dict[str, Any] = {"heartbeat_at": now}
    if notify_cursor is not None:
        values["notify_cursor"] = notify_cursor
    if stopped:
        values["stopped_at"] = now
    session.execute(update(controllers).where(controllers.c.id == controller_id).values(values))


def latest_controller(session: Session) -> Any:
    """The newest controller's row (id, host, pid, heartbeat_at, stopped_at), or None."""
    return session.execute(
        select(
            controllers.c.id,
            controllers.c.host,
            controllers.c.pid,
            controllers.c.heartbeat_at,
            controllers.c.stopped_at,
        )
        .order_by(controllers.c.id.desc())
        .limit(1)
    ).first()


def attention_events(
    session: Session, kinds: list[str], *, after: int, limit: int
) -> tuple[list[Any], int]:
    """Events of ``kinds`` after the cursor ``after``, oldest first, and the new cursor:
    the newest event looked at (the last one returned, or, when fewer than ``limit``
    matched, the newest event of the ledger), so each poll reads only what is new."""
    flush_events(session)
    newest = session.execute(select(func.max(events.c.id))).scalar() or 0
    rows = list(
        session.execute(
            select(
                events.c.id,
                events.c.at,
                events.c.run_id,
                events.c.attempt_id,
                events.c.kind,
                events.c.actor,
                events.c.detail,
            )
            .where(events.c.id > after, events.c.id <= newest, events.c.kind.in_(kinds))
            .order_by(events.c.id)
            .limit(limit)
        )
    )
    if len(rows) == limit:
        return rows, int(rows[-1].id)
    return rows, max(after, int(newest))


def create_notification(
    session: Session,
    *,
    key: str,
    kind: Attention,
    run_id: int | None,
    payload: dict[str, Any],
    created_by: str,
    now: datetime,
) -> int | None:
    """A new notification's id, or None when one with ``key`` exists (told already)."""
    if session.execute(select(notifications.c.id).where(notifications.c.key == key)).first():
        return None
    created: int = session.execute(
        insert(notifications)
        .values(
            key=key,
            kind=kind.value,
            run_id=run_id,
            created_at=now,
            created_by=created_by,
            payload=payload,
            state=NotificationState.PENDING.value,
        )
        .returning(notifications.c.id)
    ).scalar_one()
    return created


def record_delivery(
    session: Session,
    notification_id: int,
    *,
    channel: str,
    target: str,
    try_number: int,
    ok: bool,
    detail: str,
    now: datetime,
) -> None:
    """One try of one channel, as it ended."""
    session.execute(
        insert(notification_deliveries).values(
            notification_id=notification_id,
            channel=channel,
            target=target,
            try_number=try_number,
            at=now,
            ok=ok,
            detail=detail,
        )
    )


def finish_notification(
    session: Session, notification_id: int, state: NotificationState, *, now: datetime
) -> None:
    """A pending notification is delivered, or failed after its retries."""
    session.execute(
        update(notifications)
        .where(
            notifications.c.id == notification_id,
            notifications.c.state == NotificationState.PENDING.value,
        )
        .values(state=state.value, finished_at=now)
    )


def pending_notifications(session: Session, *, limit: int = 100) -> list[Row[Any]]:
    """Notifications still pending (a notifier that died mid-delivery left them)."""
    return list(
        session.execute(
            select(notifications.c.id, notifications.c.run_id, notifications.c.payload)
            .where(notifications.c.state == NotificationState.PENDING.value)
            .order_by(notifications.c.id)
            .limit(limit)
        )
    )
