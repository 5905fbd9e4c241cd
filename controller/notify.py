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
that stops gives it a bounded time to finish what it holds (``stop``).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import tenacity
from sqlalchemy import Engine

from laneway.controller import db, ledger, notice_steps, web_links
from laneway.controller.clock import Clock, SystemClock, iso
from laneway.controller.config_models import ENV_REF, NotifyConfig
from laneway.controller.errors import UsageError
from laneway.controller.models import Notification, Run
from laneway.controller.states import Attention, EventKind, NotificationState, WorkerState
from laneway.controller.status_nodes import LOST, worker_liveness
from laneway.controller.usage import BUDGET_SPENT

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
MAX_DETAIL = 300
COMMAND_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")


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


class Undelivered(Exception):
    """A try that failed; ``transient`` ones are tried again."""

    def __init__(self, detail: str, *, transient: bool) -> None:
        super().__init__(detail)
        self.transient = transient


def _redact(text: str, secrets: Iterable[str]) -> str:
    for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, "[REDACTED]")
    return text[:MAX_DETAIL]


def _resolve(value: str, environ: Mapping[str, str], secrets: list[str]) -> str:
    def one(match: Any) -> str:
        name = match.group(1)
        if name not in environ:
            raise Undelivered(
                f"${{{name}}} is not set in the notifying process's environment; set it "
                "where laneway controller / laneway run / laneway worker starts",
                transient=False,
            )
        secrets.append(environ[name])
        return environ[name]

    return ENV_REF.sub(one, value)


def shown_url(url: str) -> str:
    """A webhook URL as recorded: its path and query kept only as ``${NAME}`` templates;
    a literal one (a hook's URL is often its secret, as a chat service's is) becomes
    ``/…``."""
    parts = urlsplit(url)
    rest = parts.path + (f"?{parts.query}" if parts.query else "")
    if rest in ("", "/") or ENV_REF.fullmatch(rest.lstrip("/")):
        return url
    return f"{parts.scheme}://{parts.netloc}/…"


def post_webhook(
    config: NotifyConfig, body: bytes, environ: Mapping[str, str], secrets: list[str]
) -> str:
    """POST ``body``; what answered (``HTTP 204``), or Undelivered."""
    assert config.webhook is not None
    url = _resolve(config.webhook, environ, secrets)
    headers = {"Content-Type": "application/json", "User-Agent": "laneway-notify"}
    headers.update({k: _resolve(v, environ, secrets) for k, v in config.headers.items()})
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=config.timeout_seconds) as answer:
            return f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the answer's socket
        transient = exc.code in (408, 425, 429) or exc.code >= 500
        raise Undelivered(f"HTTP {exc.code} {exc.reason}", transient=transient) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise Undelivered(f"{type(exc).__name__}: {why}", transient=True) from None


def run_command(
    config: NotifyConfig,
    body: bytes,
    payload: Mapping[str, Any],
    environ: Mapping[str, str],
    secrets: list[str],
) -> str:
    """Run the command with ``body`` on stdin; ``exit 0``, or Undelivered."""
    assert config.command is not None
    env = {k: environ[k] for k in (*COMMAND_ENV, *config.pass_env) if k in environ}
    secrets.extend(environ[k] for k in config.pass_env if k in environ)
    step = payload.get("next_step") or {}
    env.update(
        LANEWAY_NOTIFY_KIND=str(payload["kind"]),
        LANEWAY_NOTIFY_RUN="" if payload.get("run") is None else str(payload["run"]),
        LANEWAY_NOTIFY_REASON=str(payload.get("reason") or ""),
        LANEWAY_NOTIFY_COMMAND=str(step.get("command") or ""),
        LANEWAY_NOTIFY_LINK=str(payload.get("link") or ""),
    )
    try:
        done = subprocess.run(
            config.command,
            input=body,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=config.timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise Undelivered(f"timed out after {config.timeout_seconds:g} s", transient=True) from None
    except OSError as exc:
        raise Undelivered(f"{config.command[0]}: {exc.strerror or exc}", transient=False) from None
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise Undelivered(f"exit {done.returncode}: {tail[0]}", transient=True)
    return "exit 0"


Recorder = Callable[[str, str, int, bool, str], None]
"""(channel, target, try number, ok, detail): one try, written to the ledger."""


def deliver(
    config: NotifyConfig,
    payload: Mapping[str, Any],
    record: Recorder,
    *,
    environ: Mapping[str, str],
    backoff_seconds: float = 1.0,
    sleep: Callable[[float], None] | None = None,
) -> bool:
    """Every channel of ``config``, each with its bounded retries; True if all took it."""
    body = json.dumps(payload, sort_keys=True).encode()
    channels: list[tuple[str, str, Callable[[list[str]], str]]] = []
    if config.webhook is not None:
        channels.append(
            ("webhook", shown_url(config.webhook), lambda s: post_webhook(config, body, environ, s))
        )
    if config.command is not None:
        channels.append(
            (
                "command",
                json.dumps(config.command),
                lambda s: run_command(config, body, payload, environ, s),
            )
        )
    delivered = True
    for channel, target, send in channels:
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(config.retries + 1),
            wait=tenacity.wait_exponential(multiplier=backoff_seconds, max=60),
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, Undelivered) and e.transient),
            reraise=True,
            sleep=sleep or tenacity.nap.sleep,
        )
        try:
            for attempt in retrying:
                with attempt:
                    number = attempt.retry_state.attempt_number
                    secrets: list[str] = []
                    try:
                        answer = send(secrets)
                    except Undelivered as exc:
                        record(channel, target, number, False, _redact(str(exc), secrets))
                        raise
                    record(channel, target, number, True, _redact(answer, secrets))
        except Undelivered:
            delivered = False
    return delivered


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
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.on_error: Callable[[str], None] | None = None
        """Called with one line when a poll fails (the CLI logs it); the next poll
        starts over from the cursor."""
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
        self._stopping.set()
        self._wake.set()
        self._thread.join(grace)

    def _loop(self) -> None:
        while True:
            stopping = self._stopping.is_set()
            pause = POLL_SECONDS
            try:
                self.poll()
            except Exception as exc:
                # The ledger is away, or a notice could not be made: nothing is lost,
                # the cursor did not move past it, so the next poll looks again (after
                # a longer pause). Told once per distinct error, never swallowed.
                error = f"notifier: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                if error != self.last_error and self.on_error is not None:
                    self.on_error(error)
                self.last_error = error
                pause = 5.0
            if stopping:
                return
            self._wake.wait(pause)
            self._wake.clear()

    def poll(self) -> None:
        """Turn new events into notifications (and a lost controller, for a worker's
        notifier), then deliver every queued one."""
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
                    return
                notification_id = self._queue.pop(0)
            self._deliver(notification_id)

    def _enqueue(self, ids: Iterable[int]) -> None:
        with self._lock:
            self._queue.extend(i for i in ids if i not in self._queue)
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
        configs: list[NotifyConfig] = []
        with self.reader() as session:
            run_ids = [run_id] if run_id is not None else ledger.active_run_ids(session)
            for rid in run_ids:
                run = session.get(Run, rid)
                if run is not None:
                    section = ledger.run_config(run).notify
                    if section is not None:
                        configs.append(section)
        if self.option is not None:
            configs.append(self.option)
        unique: list[NotifyConfig] = []
        for config in configs:
            if config not in unique:
                unique.append(config)
        return unique

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

    def _deliver(self, notification_id: int) -> None:
        with self.reader() as session:
            row = session.get(Notification, notification_id)
            if row is None or row.state != NotificationState.PENDING:
                return
            payload = dict(row.payload)
            kind = row.kind
            run_id = row.run_id
        targets = [c for c in self.targets(run_id) if kind in c.on]

        def record(channel: str, target: str, number: int, ok: bool, detail: str) -> None:
            with db.transaction(self.factory) as session:
                ledger.record_delivery(
                    session,
                    notification_id,
                    channel=channel,
                    target=target,
                    try_number=number,
                    ok=ok,
                    detail=detail,
                    now=db.ledger_now(session, self.clock),
                )

        delivered = all(
            [
                deliver(
                    config,
                    payload,
                    record,
                    environ=self.environ,
                    backoff_seconds=self.backoff_seconds,
                )
                for config in targets
            ]
        )
        with db.transaction(self.factory) as session:
            ledger.finish_notification(
                session,
                notification_id,
                NotificationState.DELIVERED if delivered else NotificationState.FAILED,
                now=db.ledger_now(session, self.clock),
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
