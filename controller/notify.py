"""Tell the operator: one notification per new attention state, delivered off the
dispatch path with bounded retries, every try recorded in the ledger.

What is an attention state (``states.Attention``) comes from the event log, which a
controller's notifier follows from a cursor (so each poll reads only what is new):

- a halt or pause that laneway set by itself (``notices_from``): a halt, a budget stop
  (a pause whose reason begins with ``usage.BUDGET_SPENT``), a breaker pause (any other
  pause laneway set). What an operator set (actor ``user@host``, ``cli/common.actor``)
  is not news to them;
- attempts that became unknown: one notification per run and poll, naming them all;
- a worker the controller judged lost, and a run that finished.

A lost controller cannot tell anyone: a worker notices its heartbeat stopped
(``controller_lost``). Each notification's ``key`` names its occurrence, so it is created
once, whoever notices it and however often (``ledger.create_notification``).

Where it goes: the run's ``notify`` config section and the process's own
(``laneway controller --notify-url/--notify-command``, the same on ``laneway worker``);
a notice about no one run (a lost worker or controller) goes to every active run's
section. Each channel (the webhook: a JSON POST, 2xx; the command: argv without a shell,
the JSON on stdin, exit 0) is tried ``1 + retries`` times with exponential backoff
(tenacity); each try is a ``notification_deliveries`` row, with the resolved secrets
redacted. The payload: ``kind``, ``run``, ``reason``, ``next_step`` (always with its
command: ``notice_steps.place``, the step every view shows for the run, or the lost
worker's or controller's), ``link`` (the page of the run, attempt or workers section, when
the dashboard's address is known: ``LANEWAY_WEB_URL``).

The ``Notifier`` runs in a thread of its own; dispatch never waits for it, and a process
that stops gives it a bounded time to finish what it holds (``stop``). It hands each
channel of a notification to that receiver's lane (``notify_delivery.Lanes``: one thread
per webhook URL or command), so one slow receiver delays only its own notifications;
each try ends at a wall-clock deadline, a redirect is a failed try, and whatever a try
raises is recorded, redacted (controller/notify_delivery.py, controller/notify_command.py).
A notifier with no one to tell (no option, no active run with a section) reports no error.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from laneway.controller import (
    db,
    environment,
    ledger,
    notice_steps,
    notify_command,
    notify_delivery,
    web_links,
)
from laneway.controller.clock import Clock, SystemClock, iso
from laneway.controller.config_models import ENV_REF, NotifyConfig
from laneway.controller.errors import UsageError
from laneway.controller.models import Notification, Run
from laneway.controller.notify_delivery import Channel, Recorder, Undelivered, shown_url
from laneway.controller.states import Attention, EventKind, NotificationState, WorkerState
from laneway.controller.status_nodes import LOST, worker_liveness
from laneway.controller.usage import BUDGET_SPENT

__all__ = ["Notifier", "Undelivered", "channels", "deliver", "notices_from", "shown_url"]

FOLLOWED = [
    EventKind.CONTROL_HALT.value,
    EventKind.CONTROL_PAUSE.value,
    EventKind.ATTEMPT_UNKNOWN.value,
    EventKind.WORKER_LOST.value,
    EventKind.RUN_FINISHED.value,
]
"""The event kinds an attention state begins with."""
POLL_SECONDS = 2.0
"""How often a notifier looks at the event log (and a worker's at the controller's
heartbeat): notifications are for people, so seconds are soon enough, and an idle
controller or worker pays two small reads per look."""
BATCH = 500
STOP_GRACE_SECONDS = 15.0
"""How long a stopping process lets its notifier finish what it holds."""


@dataclass(frozen=True)
class Notice:
    """One attention state to tell: ``key`` names its occurrence."""

    key: str
    kind: Attention
    run_id: int | None
    reason: str
    attempt_id: int | None = None
    worker_id: str | None = None
    """The lost worker (``worker_lost``)."""


def is_operator(actor: str) -> bool:
    """An operator's command records ``user@host`` (``cli/common.actor``); laneway's own
    processes record ``controller`` or a worker id, which have no ``@``."""
    return "@" in actor


def notices_from(rows: Iterable[Any]) -> list[Notice]:
    """The attention states a batch of events (oldest first) begins."""
    notices: list[Notice] = []
    unknown: dict[int | None, list[Any]] = {}
    for row in rows:
        detail = row.detail or {}
        reason = str(detail.get("reason") or "")
        if row.kind in (EventKind.CONTROL_HALT, EventKind.CONTROL_PAUSE):
            if is_operator(row.actor):
                continue
            if row.kind == EventKind.CONTROL_HALT:
                kind = Attention.HALT
            elif reason.startswith(BUDGET_SPENT):
                kind = Attention.BUDGET_STOP
            else:
                kind = Attention.BREAKER_PAUSE
            notices.append(Notice(f"{kind.value}:event:{row.id}", kind, row.run_id, reason))
        elif row.kind == EventKind.ATTEMPT_UNKNOWN:
            unknown.setdefault(row.run_id, []).append(row)
        elif row.kind == EventKind.WORKER_LOST:
            worker = detail.get("worker", "?")
            notices.append(
                Notice(
                    f"worker_lost:event:{row.id}",
                    Attention.WORKER_LOST,
                    None,
                    f"worker {worker} lost: {reason or 'its heartbeat stopped'}",
                    worker_id=None if worker == "?" else str(worker),
                )
            )
        elif row.kind == EventKind.RUN_FINISHED:
            notices.append(
                Notice(
                    f"run_finished:event:{row.id}",
                    Attention.RUN_FINISHED,
                    row.run_id,
                    f"run {row.run_id} finished",
                )
            )
    for run_id, rows_of_run in unknown.items():
        first = rows_of_run[0]
        ids = ", ".join(str(r.attempt_id) for r in rows_of_run)
        reason = (first.detail or {}).get("reason") or "its outcome could not be established"
        notices.append(
            Notice(
                f"unknown_outcome:event:{first.id}",
                Attention.UNKNOWN_OUTCOME,
                run_id,
                f"outcome unknown of attempt{'s' if len(rows_of_run) > 1 else ''} {ids}: {reason}",
                attempt_id=first.attempt_id,
            )
        )
    return notices


def channels(
    config: NotifyConfig, payload: Mapping[str, Any], environ: Mapping[str, str]
) -> list[Channel]:
    """The channels of ``config`` for ``payload``: the webhook, then the command; each
    names its lane (its receiver)."""
    body = json.dumps(payload, sort_keys=True).encode()
    found: list[Channel] = []
    if config.webhook is not None:
        webhook = config.webhook
        found.append(
            Channel(
                "webhook",
                shown_url(webhook),
                f"webhook {webhook}",
                lambda s: notify_delivery.post_webhook(config, body, environ, s),
            )
        )
    if config.command is not None:
        argv = json.dumps(config.command)
        found.append(
            Channel(
                "command",
                argv,
                f"command {argv}",
                lambda s: notify_command.run_command(config, body, payload, environ, s),
            )
        )
    return found


def deliver(
    config: NotifyConfig,
    payload: Mapping[str, Any],
    record: Recorder,
    *,
    environ: Mapping[str, str],
    backoff_seconds: float = 1.0,
    sleep: Callable[[float], None] | None = None,
) -> bool:
    """Every channel of ``config``, one after the other, each with its bounded retries;
    True if all took it (a ``Notifier`` runs each channel in its own lane instead)."""
    results = [
        notify_delivery.deliver_channel(
            channel, record, retries=config.retries, backoff_seconds=backoff_seconds, sleep=sleep
        )
        for channel in channels(config, payload, environ)
    ]
    return all(results)


@dataclass
class _Delivering:
    """A notification whose channels are in their lanes: the last to end finishes it."""

    notification_id: int
    left: int
    delivered: bool = True
    broken: bool = False
    """A try could not be recorded (the ledger is away): the row stays pending."""


class Notifier:
    """One process's notifier: a thread that follows the event log (a controller's,
    after ``follow``) and delivers what this process created (``notify`` adds one)."""

    def __init__(
        self,
        engine: Engine,
        *,
        actor: str,
        option: NotifyConfig | None = None,
        clock: Clock | None = None,
        environ: Mapping[str, str] | None = None,
        backoff_seconds: float = 1.0,
        watch_controller: bool = False,
    ) -> None:
        self.engine = engine
        self.watch_controller = watch_controller
        """A worker's notifier: each poll looks whether the controller is lost."""
        self._told_lost: set[int] = set()
        self.actor = actor
        self.option = option
        self.clock = clock or SystemClock()
        self.environ = os.environ if environ is None else environ
        self.backoff_seconds = backoff_seconds
        self.factory = db.session_factory(engine)
        self.reader = db.reader(engine)
        self.cursor: int | None = None
        """The newest event turned into notifications (None: not following)."""
        self._queue: list[int] = []
        self._delivering: set[int] = set()
        """Notifications in their lanes (not queued again meanwhile)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.lanes = notify_delivery.Lanes(self._report)
        self._sections: dict[int, NotifyConfig | None] = {}
        """Each run's ``notify`` section, read once (a run's config is frozen)."""
        self.configured = option is not None
        """Is anyone to be told: this process's option, or an active run's section at
        the last look. A notifier with no one to tell reports no error (the ledger's
        outage is the service's own line)."""
        self.last_error: str | None = None
        self.on_error: Callable[[str], None] | None = None
        """Called with one redacted line, naming its reason, when a poll or a delivery
        fails and someone is to be told (the CLI logs it); a poll starts over from the
        cursor next time."""
        try:
            self.dashboard = web_links.base_url(self.environ)
        except UsageError as exc:
            self.dashboard = None
            self.last_error = str(exc)

    # ------------------------------------------------------------------ the thread

    def follow(self, cursor: int, *, pending: bool = True) -> None:
        """Follow the event log after ``cursor``; ``pending``: also deliver what an
        earlier notifier left pending (it died mid-delivery)."""
        if pending:
            with self.reader() as session:
                self._enqueue(row.id for row in ledger.pending_notifications(session))
        self.cursor = cursor
        self._wake.set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="laneway-notify", daemon=True)
            self._thread.start()

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """One last look at the event log, then what is held is delivered within
        ``grace`` seconds; a notification still pending then is delivered by the next
        controller."""
        if self._thread is None:
            return
        until = time.monotonic() + grace
        self._stopping.set()
        self._wake.set()
        self._thread.join(grace)
        self.lanes.wait_idle(max(0.0, until - time.monotonic()))

    def _loop(self) -> None:
        while True:
            stopping = self._stopping.is_set()
            pause = POLL_SECONDS
            try:
                self.poll(wait=False)
            except Exception as exc:
                # The ledger is away, or a notice could not be made: nothing is lost,
                # the cursor did not move past it, so the next poll looks again (after
                # a longer pause). Told once per distinct error, never swallowed.
                self._report(exc)
                pause = 5.0
            if stopping:
                return
            self._wake.wait(pause)
            self._wake.clear()

    def _report(self, exc: BaseException) -> None:
        """Tell ``on_error`` once per distinct error, redacted, when anyone is to be
        told; ``last_error`` keeps it either way."""
        error = notify_delivery.clean_detail(
            f"notifier: {notify_delivery.describe(exc)}", self._secrets()
        )
        if error != self.last_error and self.configured and self.on_error is not None:
            self.on_error(error)
        self.last_error = error

    def _secrets(self) -> list[str]:
        """Every value a known section references or passes, and the passwords of the
        process's ``LANEWAY_*`` URLs: none of them reaches a log line."""
        found = environment.credentials(self.environ)
        sections = [c for c in (self.option, *self._sections.values()) if c is not None]
        for config in sections:
            texts = [config.webhook or "", *config.headers.values()]
            names = [n for text in texts for n in ENV_REF.findall(text)] + config.pass_env
            found += [self.environ[n] for n in names if n in self.environ]
        return found

    def poll(self, *, wait: bool = True) -> None:
        """Turn new events into notifications (and a lost controller, for a worker's
        notifier), then hand every queued one to its channels' lanes; ``wait``: until
        they delivered it (a one-off look; the notifier's own thread never waits)."""
        with self.reader() as session:
            self._look_at_sections(session)
        if self.watch_controller:
            self.look_at_controller()
        if self.cursor is not None:
            while True:
                with self.reader() as session:
                    rows, cursor = ledger.attention_events(
                        session, FOLLOWED, after=self.cursor, limit=BATCH
                    )
                for notice in notices_from(rows):
                    self.notify(notice)
                self.cursor = cursor
                if len(rows) < BATCH:
                    break
        while True:
            with self._lock:
                if not self._queue:
                    break
                notification_id = self._queue.pop(0)
            self._dispatch(notification_id)
        if wait:
            self.lanes.wait_idle()

    def _enqueue(self, ids: Iterable[int]) -> None:
        with self._lock:
            held = {*self._queue, *self._delivering}
            self._queue.extend(i for i in dict.fromkeys(ids) if i not in held)
        self._wake.set()

    def look_at_controller(self) -> int | None:
        """Notify once when the newest controller is lost (its heartbeat older than
        ``LOST_AFTER_SECONDS``, not stopped); the notification's id, else None."""
        with self.reader() as session:
            row = ledger.latest_controller(session)
            now = db.ledger_now(session, self.clock)
        if row is None or row.stopped_at is not None or row.id in self._told_lost:
            return None
        age = (now - row.heartbeat_at).total_seconds()
        if worker_liveness(WorkerState.ACTIVE.value, age) != LOST:
            return None
        self._told_lost.add(row.id)
        return self.notify(controller_lost_notice(row, age_seconds=age))

    # ------------------------------------------------------------------ one notice

    def targets(self, run_id: int | None) -> list[NotifyConfig]:
        """Where a notice goes: the run's section (or every active run's, for a notice
        about no one run) and this process's option, each once."""
        with self.reader() as session:
            run_ids = [run_id] if run_id is not None else ledger.active_run_ids(session)
            sections = [self._section(session, rid) for rid in run_ids]
        configs = [section for section in sections if section is not None]
        if self.option is not None:
            configs.append(self.option)
        unique: list[NotifyConfig] = []
        for config in configs:
            if config not in unique:
                unique.append(config)
        return unique

    def _section(self, session: Any, run_id: int) -> NotifyConfig | None:
        if run_id not in self._sections:
            run = session.get(Run, run_id)
            if run is None:
                return None
            self._sections[run_id] = ledger.run_config(run).notify
        return self._sections[run_id]

    def _look_at_sections(self, session: Any) -> None:
        """Is anyone to be told (``configured``)?"""
        sections = [self._section(session, rid) for rid in ledger.active_run_ids(session)]
        self.configured = self.option is not None or any(s is not None for s in sections)

    def notify(self, notice: Notice) -> int | None:
        """Record ``notice`` (once per key) when someone is to be told, and queue its
        delivery; its id, or None (nobody to tell, or told already)."""
        targets = [c for c in self.targets(notice.run_id) if notice.kind in c.on]
        if not targets:
            return None
        payload = self._payload(notice)
        with db.transaction(self.factory) as session:
            notification_id = ledger.create_notification(
                session,
                key=notice.key,
                kind=notice.kind,
                run_id=notice.run_id,
                payload=payload,
                created_by=self.actor,
                now=db.ledger_now(session, self.clock),
            )
        if notification_id is not None:
            self._enqueue([notification_id])
        return notification_id

    def _payload(self, notice: Notice) -> dict[str, Any]:
        """The JSON told: the notice, with its next step and link (``notice_steps``)."""
        with self.reader() as session:
            placed = notice_steps.place(
                session,
                kind=notice.kind,
                run_id=notice.run_id,
                attempt_id=notice.attempt_id,
                worker_id=notice.worker_id,
                now=db.ledger_now(session, self.clock),
            )
        return {
            "laneway": "notification",
            "key": notice.key,
            "kind": notice.kind.value,
            "run": notice.run_id,
            "reason": placed.reason or notice.reason,
            **notice_steps.as_payload(placed, self.dashboard),
            "at": iso(self.clock.now()),
        }

    def _dispatch(self, notification_id: int) -> None:
        """Hand a pending notification's channels to their lanes (never waits); the
        last channel to end finishes the notification (``_channel_done``)."""
        with self.reader() as session:
            row = session.get(Notification, notification_id)
            if row is None or row.state != NotificationState.PENDING:
                return
            payload = dict(row.payload)
            kind = row.kind
            run_id = row.run_id
        ways = [
            way
            for config in self.targets(run_id)
            if kind in config.on
            for way in [(config, c) for c in channels(config, payload, self.environ)]
        ]
        delivering = _Delivering(notification_id, left=len(ways))
        if not ways:
            self._finish(delivering)
            return
        with self._lock:
            self._delivering.add(notification_id)
        for config, channel in ways:
            self.lanes.submit(
                channel.lane, functools.partial(self._send, delivering, config, channel)
            )

    def _send(self, delivering: _Delivering, config: NotifyConfig, channel: Channel) -> None:
        """One channel of a notification, in its lane: its tries, each recorded."""

        def record(channel_name: str, target: str, number: int, ok: bool, detail: str) -> None:
            with db.transaction(self.factory) as session:
                ledger.record_delivery(
                    session,
                    delivering.notification_id,
                    channel=channel_name,
                    target=target,
                    try_number=number,
                    ok=ok,
                    detail=detail,
                    now=db.ledger_now(session, self.clock),
                )

        ok = False
        try:
            ok = notify_delivery.deliver_channel(
                channel, record, retries=config.retries, backoff_seconds=self.backoff_seconds
            )
        except Exception:
            delivering.broken = True
            raise  # the lane reports it (``_report``)
        finally:
            self._channel_done(delivering, ok)

    def _channel_done(self, delivering: _Delivering, ok: bool) -> None:
        with self._lock:
            delivering.left -= 1
            delivering.delivered = delivering.delivered and ok
            last = delivering.left == 0
        if last:
            try:
                if not delivering.broken:
                    self._finish(delivering)
            finally:
                with self._lock:
                    self._delivering.discard(delivering.notification_id)

    def _finish(self, delivering: _Delivering) -> None:
        state = NotificationState.DELIVERED if delivering.delivered else NotificationState.FAILED
        with db.transaction(self.factory) as session:
            ledger.finish_notification(
                session, delivering.notification_id, state, now=db.ledger_now(session, self.clock)
            )


def controller_lost_notice(row: Any, *, age_seconds: float) -> Notice:
    """The notice a worker makes of a controller whose heartbeat stopped."""
    return Notice(
        f"controller_lost:{row.id}",
        Attention.CONTROLLER_LOST,
        None,
        f"controller {row.id} (pid {row.pid} on {row.host}) lost: no heartbeat for "
        f"{age_seconds:.0f} s since {iso(row.heartbeat_at)}",
    )
