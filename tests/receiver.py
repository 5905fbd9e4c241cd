"""A real local HTTP webhook receiver for the notification tests: it records every
request (path, headers, JSON body) and answers from a script of status codes (then
204), optionally holding each request until ``release`` (a receiver that hangs)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
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

    def release(self) -> None:
        if self.hold is not None:
            self.hold.set()

    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]


@contextmanager
def receiver(
    answers: list[int] | None = None, *, hang: bool = False, reason: str = "Scripted"
) -> Iterator[Receiver]:
    state: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            state.requests.append(Received(self.path, dict(self.headers.items()), body))
            state.arrived.set()
            if state.hold is not None:
                state.hold.wait(60)
            code = state.answers.pop(0) if state.answers else 204
            self.send_response(code, state.reason)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return  # the test reads state.requests, not a log

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    host, port = server.server_address[:2]
    state = Receiver(
        url=f"http://{host}:{port}",
        answers=list(answers or []),
        reason=reason,
        hold=threading.Event() if hang else None,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release()
        server.shutdown()
        server.server_close()
        thread.join(10)
