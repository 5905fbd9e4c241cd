"""A real local HTTP webhook receiver for the notification tests: it records every
request (path, headers, JSON body) and answers from a script of status codes (then
204), optionally holding each request until ``release`` (a receiver that hangs).

Hostile receivers too: one that drips its answer a byte at a time for ever (``drip``),
one that redirects (``location``), one whose answer's body never ends (``huge_body``),
one that writes raw bytes instead of an answer (``raw``: a garbage status line, a NUL
in the reason). ``on_arrival`` callbacks run as a request arrives, so a test can see
what another receiver was doing at that moment (a handshake, not a clock)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Receiver:
    url: str
    answers: list[int] = field(default_factory=list)
    """Status codes to answer with, in order; 204 once they are used up."""
    reason: str = "Scripted"
    requests: list[Received] = field(default_factory=list)
    hold: threading.Event | None = None
    """Set: each request waits for it (``release``) before it is answered."""
    arrived: threading.Event = field(default_factory=threading.Event)
    on_arrival: list[Callable[[], None]] = field(default_factory=list)
    drip: float | None = None
    """Seconds between the bytes of an answer that never ends (its headers go on)."""
    dripping: threading.Event = field(default_factory=threading.Event)
    """Set while an answer is being dripped (cleared once its client left)."""
    dripped: int = 0
    """Bytes dripped so far."""
    location: str | None = None
    huge_body: bool = False
    raw: bytes | None = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set on shutdown: a dripping or streaming answer stops."""

    def release(self) -> None:
        if self.hold is not None:
            self.hold.set()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        if self.raw is not None:
            handler.wfile.write(self.raw)
            return
        if self.drip is not None:
            self._drip(handler)
            return
        code = self.answers.pop(0) if self.answers else 204
        handler.send_response(code, self.reason)
        if self.location is not None:
            handler.send_header("Location", self.location)
        if self.huge_body:
            handler.send_header("Content-Length", str(1 << 40))
            handler.end_headers()
            try:
                while not self.done.is_set():  # until the client hangs up
                    handler.wfile.write(b"\0" * 65536)
            except OSError:
                return
            return
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _drip(self, handler: BaseHTTPRequestHandler) -> None:
        assert self.drip is not None
        answer = b"HTTP/1.1 204 No Content\r\nX-Drip: "
        self.dripping.set()
        try:
            while not self.done.is_set():
                byte = answer[self.dripped : self.dripped + 1] or b"d"
                handler.wfile.write(byte)
                handler.wfile.flush()
                self.dripped += 1
                self.done.wait(self.drip)
        except OSError:
            pass  # the client gave up: what the test waits for
        finally:
            self.dripping.clear()

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]


@contextmanager
def receiver(
    answers: list[int] | None = None,
    *,
    hang: bool = False,
    reason: str = "Scripted",
    host: str = "127.0.0.1",
    **hostile: Any,
) -> Iterator[Receiver]:
    state: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            state.requests.append(Received(self.path, dict(self.headers.items()), body))
            for callback in state.on_arrival:
                callback()
            state.arrived.set()
            if state.hold is not None:
                state.hold.wait(60)
            state._answer(self)

        def do_GET(self) -> None:  # a followed redirect would arrive as a GET
            state.requests.append(Received(self.path, dict(self.headers.items()), {}))
            state.arrived.set()
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return  # the test reads state.requests, not a log

    server = ThreadingHTTPServer((host, 0), Handler)
    bound, port = server.server_address[:2]
    state = Receiver(
        url=f"http://{bound}:{port}",
        answers=list(answers or []),
        reason=reason,
        hold=threading.Event() if hang else None,
        **hostile,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.done.set()
        state.release()
        server.shutdown()
        server.server_close()
        thread.join(10)
