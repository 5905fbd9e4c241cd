"""One notification's way to its receivers: the webhook's POST, each channel's bounded
tries, and the lanes that keep one slow receiver from holding up any other.

- **A try ends.** Each try has a wall-clock deadline (``timeout_seconds``), not a
  per-read one: a receiver that drips one byte a second is given up on at the deadline
  like one that never answers (``post_webhook`` runs the exchange in a thread of its own
  and shuts its socket at the deadline).
- **Where it was sent.** A redirect is not followed (the token would go to the
  redirect's host): a 3xx is a failed try. The URL is checked again once its references
  are resolved (``config_models.webhook_problem``: no whitespace, control character or
  ``user:password@``), and so is each header value (``header_problem``: no CR/LF).
- **Every try recorded.** Whatever a try raises is a failed try, recorded; its detail
  (``clean_detail``) is redacted (the resolved secrets and their encoded forms,
  ``Authorization``/``Bearer`` tokens: ``controller.redact``), free of NUL and control
  characters (PostgreSQL's text cannot hold a NUL) and at most ``MAX_DETAIL`` characters.
- **Lanes.** ``Lanes`` runs one thread per receiver (a webhook URL, a command's argv),
  delivering that receiver's notifications in order; a lane's thread ends when its
  queue is empty. What submits a delivery never waits for it.

The command channel (a process group of its own) is ``notify_command.run_command``;
``notify.channels`` names a config's channels.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import tenacity

from laneway.controller import redact
from laneway.controller.config_models import (
    ENV_REF,
    NotifyConfig,
    header_problem,
    webhook_problem,
)

MAX_DETAIL = 300
"""Characters of a try's recorded detail, at most."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class Undelivered(Exception):
    """A try that failed; ``transient`` ones are tried again."""

    def __init__(self, detail: str, *, transient: bool) -> None:
        super().__init__(detail)
        self.transient = transient


def _plain(text: str) -> str:
    """``text`` with each lone surrogate made U+FFFD (the same for a secret and the text
    it is looked for in, so a match survives)."""
    return _SURROGATE.sub("\ufffd", text)


def clean_detail(text: str, secrets: Iterable[str]) -> str:
    """What a try records, or a log line shows: redacted first (the whole text, so a
    secret is caught before anything is cut), then one line with no control character,
    at most ``MAX_DETAIL`` characters."""
    redactor = redact.Redactor([_plain(s) for s in secrets])
    text = redactor.redact_text(_plain(text))
    text = " ".join(_CONTROL.sub(" ", text).split())
    return text[:MAX_DETAIL]


def describe(exc: BaseException) -> str:
    """One line naming an exception: its type and its first line of words."""
    words = (str(exc).splitlines() or [""])[0] or "(no message)"
    return f"{type(exc).__name__}: {words}"


def resolve(value: str, environ: Mapping[str, str], secrets: list[str]) -> str:
    """``value`` with its ``${NAME}`` references resolved; each value joins ``secrets``."""

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
    """A webhook URL as recorded: never a ``user:password@`` of its netloc; its path and
    query kept only as ``${NAME}`` templates; a literal one (a hook's URL is often its
    secret, as a chat service's is) becomes ``/…``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a webhook URL that does not parse)"
    netloc = parts.netloc.rpartition("@")[2]
    rest = parts.path + (f"?{parts.query}" if parts.query else "")
    if rest in ("", "/") or ENV_REF.fullmatch(rest.lstrip("/")):
        return f"{parts.scheme}://{netloc}{rest}"
    return f"{parts.scheme}://{netloc}/…"


def _referenced(template: str) -> str:
    names = ", ".join(f"${{{name}}}" for name in ENV_REF.findall(template))
    return f" (check the value of {names})" if names else ""


def resolved_request(
    config: NotifyConfig, environ: Mapping[str, str], secrets: list[str]
) -> tuple[str, dict[str, str]]:
    """The URL and headers to send, resolved and checked again; Undelivered (never
    retried, naming the field and what it references, never the value) if not fit."""
    assert config.webhook is not None
    url = resolve(config.webhook, environ, secrets)
    problem = webhook_problem(url)
    if problem:
        why = f"webhook, its references resolved: {problem}{_referenced(config.webhook)}"
        raise Undelivered(why, transient=False)
    headers = {"Content-Type": "application/json", "User-Agent": "laneway-notify"}
    for name, template in config.headers.items():
        value = resolve(template, environ, secrets)
        problem = header_problem(value)
        if problem:
            why = f"headers.{name}, its references resolved: {problem}{_referenced(template)}"
            raise Undelivered(why, transient=False)
        headers[name] = value
    return url, headers


class _Exchange:
    """One POST and its answer's status line and headers (its body is never read), in a
    thread of its own, so the caller can give up at a wall-clock deadline."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else None
        self.connection = (kind or http.client.HTTPConnection)(parts.netloc, timeout=timeout)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.body = body
        self.headers = headers
        self.answer: tuple[int, str] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="laneway-notify-post", daemon=True)

    def _run(self) -> None:
        try:
            self.connection.request("POST", self.target, body=self.body, headers=self.headers)
            response = self.connection.getresponse()
            self.answer = (response.status, response.reason)
        except BaseException as exc:  # handed to the caller, which records it
            self.error = exc
        finally:
            self.connection.close()

    def abandon(self) -> None:
        """Wake the thread from a blocked read: shut its socket down."""
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile: the thread is ending anyway

    def within(self, deadline: float) -> tuple[int, str]:
        self.thread.start()
        self.thread.join(deadline)
        if self.thread.is_alive():
            self.abandon()
            raise Undelivered(f"no answer within {deadline:g} s", transient=True)
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


def post_webhook(
    config: NotifyConfig, body: bytes, environ: Mapping[str, str], secrets: list[str]
) -> str:
    """POST ``body``; what answered (``HTTP 204``), or Undelivered."""
    url, headers = resolved_request(config, environ, secrets)
    try:
        status, reason = _Exchange(url, body, headers, config.timeout_seconds).within(
            config.timeout_seconds
        )
    except (OSError, http.client.HTTPException) as exc:
        raise Undelivered(describe(exc), transient=True) from None
    if 200 <= status < 300:
        return f"HTTP {status}"
    if 300 <= status < 400:
        raise Undelivered(
            f"HTTP {status} {reason}: a redirect, not followed (its host would get the "
            "notification and its headers); give the URL it points to",
            transient=False,
        )
    transient = status in (408, 425, 429) or status >= 500
    raise Undelivered(f"HTTP {status} {reason}", transient=transient)


Recorder = Callable[[str, str, int, bool, str], None]
"""(channel, target, try number, ok, detail): one try, written to the ledger."""


@dataclass(frozen=True)
class Channel:
    """One way a notification goes: ``lane`` names its receiver (its lane's key)."""

    name: str
    target: str
    """As recorded: ``shown_url``, or the command's argv as JSON."""
    lane: str
    send: Callable[[list[str]], str]


def _one_try(channel: Channel, record: Recorder, number: int) -> None:
    secrets: list[str] = []
    try:
        answer = channel.send(secrets)
    except Undelivered as exc:
        failure = exc
    except Exception as exc:
        # Whatever else a try raises (http.client's InvalidURL, a codec error…) is a
        # failed try like any other: recorded, redacted, not tried again.
        failure = Undelivered(describe(exc), transient=False)
    else:
        record(channel.name, channel.target, number, True, clean_detail(answer, secrets))
        return
    record(channel.name, channel.target, number, False, clean_detail(str(failure), secrets))
    raise failure


def deliver_channel(
    channel: Channel,
    record: Recorder,
    *,
    retries: int,
    backoff_seconds: float = 1.0,
    sleep: Callable[[float], None] | None = None,
) -> bool:
    """``1 + retries`` tries at most, with exponential backoff; True once one took it.
    Each try is recorded; what ``record`` raises (the ledger is away) is raised."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=tenacity.wait_exponential(multiplier=backoff_seconds, max=60),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, Undelivered) and e.transient),
        reraise=True,
        sleep=sleep or tenacity.nap.sleep,
    )
    try:
        for attempt in retrying:
            with attempt:
                _one_try(channel, record, attempt.retry_state.attempt_number)
    except Undelivered:
        return False
    return True


class Lanes:
    """One delivery thread per receiver: jobs submitted under one key run in order, in
    that key's thread; keys never wait for each other; ``submit`` never waits."""

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self.on_error = on_error
        """Told what a job raised (the job records its own tries; this is the rest)."""
        self._queues: dict[str, deque[Callable[[], None]]] = {}
        self._changed = threading.Condition()

    def submit(self, key: str, job: Callable[[], None]) -> None:
        with self._changed:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
                name = f"laneway-notify-{len(self._queues)}"
                threading.Thread(target=self._run, args=(key,), name=name, daemon=True).start()
            queue.append(job)

    def _run(self, key: str) -> None:
        while True:
            with self._changed:
                queue = self._queues[key]
                if not queue:
                    del self._queues[key]  # the lane is idle: its thread ends
                    self._changed.notify_all()
                    return
                job = queue.popleft()
            try:
                job()
            except Exception as exc:
                self.on_error(exc)

    def busy(self) -> int:
        """How many lanes have work (running or queued)."""
        with self._changed:
            return len(self._queues)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until every lane is idle (True), or ``timeout`` seconds passed (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queues, timeout)
