"""``laneway web``: a read-only dashboard over the ledger, and the HTTP side of the
Prometheus metrics (``/metrics``, also served alone by ``laneway controller
--metrics-bind``).

Standard library only (``http.server``): one self-contained page (``web_page.py``, no
build step, no CDN) that polls small JSON endpoints. The page is served at ``/`` and at
each address ``web_links.route`` knows (``/runs/3``, ``/runs/3/jobs/i07.solve``,
``/attempts/42``, ``/runs/3/explain/i07.solve``), under the same token and Host checks.
Every read goes through one ``readonly.ReadOnlyLedger`` (as ``laneway status`` reads
it), under a lock (one connection); ``explain`` opens a read-only engine as ``laneway
explain`` does. A poll costs one ``status_report`` (and, while the run has unknown
attempts, judging their evidence on this machine: ``controller.evidence``); the timeline
(``report.build_report``, which reads every attempt of the run, so it ends where
``laneway report``'s window does: ``report_window.report_window``) is rebuilt at most
every ``TIMELINE_SECONDS`` and only when the run's newest event changed. Nothing here
writes.

Bound to loopback, no token is needed, and a request is answered only when its ``Host``
names this server (``host_allowed``): a page on another name that resolves to 127.0.0.1
(DNS rebinding) gets 421, not the ledger. Bound elsewhere, every request must carry the
token from ``--token-file`` (``Authorization: Bearer TOKEN``, or ``?token=TOKEN`` once,
which sets an HttpOnly cookie), compared in constant time (``hmac.compare_digest``). The
cookie holds ``cookie_value(token)``, set only when the query's token matched: nothing a
request sends is written into a response header.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from laneway.controller import advice, db, ids, ledger_open, queries, readonly, web_links
from laneway.controller import logs as logs_module
from laneway.controller.clock import SystemClock, iso
from laneway.controller.errors import LanewayError, NotFound, UsageError
from laneway.controller.rows import _moment
from laneway.controller.status import status_report
from laneway.controller.status_model import Advice, OnDisk

DEFAULT_BIND = "127.0.0.1:8470"
TIMELINE_SECONDS = 10.0
TIMELINE_IDLE_SECONDS = 60.0
LOG_TAIL_LINES = 100
RECENT_RUNS = 50
COOKIE = "laneway_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
"""Names a loopback dashboard answers to with its port, besides the address it is bound
to (with or without the port)."""
_HOST = re.compile(r"\A(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9.-]+))(?::([0-9]{1,5}))?\Z")
EVIDENCE_FILES = (
    "receipt.json",
    "exit.json",
    "result.json",
    "stdout.log",
    "stderr.log",
    "supervisor.log",
)


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port)."""
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--bind {bind!r}: give HOST:PORT, e.g. {DEFAULT_BIND}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _address(name: str) -> str:
    """A host name as compared: lowercase, an IP address in its canonical form."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.lower()


def host_allowed(header: str | None, bound: str, port: int) -> bool:
    """Does a request's ``Host`` name this server: the bound address, with or without
    its port, or ``localhost`` / ``127.0.0.1`` / ``[::1]`` with the bound port? A missing
    or malformed Host is not this server's name either."""
    match = _HOST.match(header.strip()) if header else None
    if match is None:
        return False
    name = _address(match[1] or match[2])
    given = int(match[3]) if match[3] else None
    if name == _address(bound):
        return given in (None, port)
    return name in LOOPBACK_NAMES and given == port


def cookie_value(token: str) -> str:
    """What the token cookie holds: a keyed hash of the token (hex, nothing to quote),
    never the token itself nor anything a request sent."""
    return hmac.new(token.encode(), b"laneway web cookie", hashlib.sha256).hexdigest()


def _matches(offered: str | None, expected: str) -> bool:
    """Constant-time comparison of an offered secret with the expected one."""
    return offered is not None and hmac.compare_digest(offered.encode(), expected.encode())


def read_token(path: Path | None, host: str) -> str | None:
    """The token from ``path``; required (UsageError) when ``host`` is not loopback."""
    if path is None:
        if not is_loopback(host):
            raise UsageError(
                f"binding to {host} exposes the ledger beyond this machine: pass "
                "--token-file FILE (a file holding a long random token), or bind 127.0.0.1"
            )
        return None
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"--token-file {path}: cannot read it ({exc.strerror or exc})") from None
    if len(token) < 16:
        raise UsageError(f"--token-file {path}: the token must be at least 16 characters")
    return token


class Dashboard:
    """The read side of the page: each method returns JSON-able data (or text)."""

    def __init__(self, runtime_dir: Path, *, now: Callable[[], datetime] | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.source = readonly.ReadOnlyLedger(runtime_dir)
        self.now = now or SystemClock().now
        self.lock = threading.Lock()
        self._engine: Any = None
        self._timelines: dict[int, tuple[Any, float, str]] = {}

    def close(self) -> None:
        self.source.close()
        if self._engine is not None:
            self._engine.dispose()

    def runs(self) -> list[dict[str, Any]]:
        with self.lock, self.source.snapshot():
            rows = self.source.rows(queries.RECENT_RUNS, {"limit": RECENT_RUNS})
        return [
            {
                "id": r[0],
                "name": r[1],
                "state": r[2],
                "created_at": _when(r[3]),
                "finished_at": _when(r[4]),
            }
            for r in rows
        ]

    def state(self, run_id: int | None) -> dict[str, Any]:
        """``status_report`` with, per lane, the operator's next step, and per unknown
        attempt the evidence files found in its directory and, once its evidence is
        conclusive (judged on this machine, as ``laneway status`` judges it:
        ``evidence.mark_conclusive``), ``conclusive`` with the command that settles it."""
        with self.lock, self.source.snapshot():
            status = status_report(self.source, run_id, now=self.now())
            if status.unknown:
                from laneway.controller import evidence

                evidence.mark_conclusive(self.source, status)
            pids = {
                attempt_id: (supervisor, child)
                for attempt_id, supervisor, child in self.source.rows(
                    queries.UNKNOWN_PIDS, {"run": status.run.id}
                )
            }
        for lane in status.lanes:
            lane.action = Advice(advice.action_words(advice.lane_step(lane, status)))
        for unknown in status.unknown:
            directory = Path(unknown.evidence) if unknown.evidence else None
            files = [name for name in EVIDENCE_FILES if directory and (directory / name).exists()]
            supervisor, child = pids.get(unknown.attempt_id, (None, None))
            unknown.on_disk = OnDisk(files, supervisor, child)
        return status.as_dict()

    def timeline(self, run_id: int | None) -> str:
        """The run's lane timeline (SVG), rebuilt only when the run changed, and at most
        every ``TIMELINE_SECONDS``."""
        from laneway.controller import ledger, report_html
        from laneway.controller import report as report_module

        with self.lock, self.source.snapshot():
            from laneway.controller.status import find_run

            run = find_run(self.source, run_id)
            newest = self.source.rows(queries.NEWEST_RUN_EVENT, {"run": run["id"]})[0][0]
        cached = self._timelines.get(run["id"])
        if cached is not None:
            age = time.monotonic() - cached[1]
            # Running bars grow with time alone: an unchanged run is redrawn now and then.
            if age < TIMELINE_SECONDS or (cached[0] == newest and age < TIMELINE_IDLE_SECONDS):
                return cached[2]
        with db.session_factory(self._orm())() as session:
            run_row = ledger.get_run(session, run["id"])
            body = report_module.build_report(session, run_row, now=self.now())
        svg = report_html.timeline_svg(body)
        self._timelines[run["id"]] = (newest, time.monotonic(), svg)
        return svg

    def explain(self, job: str, run_id: int | None = None) -> dict[str, Any]:
        """``laneway explain`` for a job given by its id or as ``ITEM.STAGE`` (in run
        ``run_id``, default the newest), as the command takes it."""
        from laneway.controller.explain import explain_job

        job_id = ids.parse_id(job)
        if job_id is None and "." in job:
            with self.lock, self.source.snapshot():
                job_id = logs_module.job_by_name(self.source, job, run_id)
        elif job_id is None:
            raise UsageError("job: give a job id or ITEM.STAGE")
        with db.session_factory(self._orm())() as session:
            return explain_job(session, job_id, now=self.now())

    def attempt(self, attempt_id: int) -> dict[str, Any]:
        """The attempt, its measured peaks, and the tail of each log (if its files are
        on this machine; else where they are)."""
        with self.lock, self.source.snapshot():
            found = logs_module.get_attempt(self.source, attempt_id)
            extra = self.source.rows(queries.ATTEMPT_TIMES, {"id": attempt_id})[0]
        body = found.as_dict()
        body.update(
            zip(
                (
                    "exit_code",
                    "exit_signal",
                    "reason",
                    "intent_at",
                    "started_at",
                    "settled_at",
                    "current_rss_mib",
                ),
                (*extra[:3], *(_when(v) for v in extra[3:6]), extra[6]),
                strict=True,
            )
        )
        body["logs"] = {}
        for stream in logs_module.STREAMS:
            try:
                path = logs_module.check_here(found, stream)
            except LanewayError as error:
                body["logs"][stream] = {"text": None, "unavailable": str(error)}
                continue
            data, size = logs_module.tail_bytes(path, LOG_TAIL_LINES)
            body["logs"][stream] = {
                "text": data.decode("utf-8", errors="replace"),
                "bytes": size,
                "path": str(path),
            }
        return body

    def metrics(self) -> bytes:
        from laneway.controller import metrics

        with self.lock:
            return metrics.exposition(self.source.snapshot, self.now)

    def _orm(self) -> Any:
        if self._engine is None:
            engine = db.make_engine(
                ledger_open.existing_ledger_url(self.runtime_dir), readonly=True
            )
            ledger_open.check_known_revision(engine, head=True)
            self._engine = engine
        return self._engine


def make_server(
    dashboard: Dashboard, host: str, port: int, *, token: str | None, metrics_only: bool = False
) -> ThreadingHTTPServer:
    """An HTTP server for ``dashboard`` (call ``serve_forever``); ``metrics_only``: just
    ``/metrics`` (the controller's)."""
    from laneway.controller import web_page

    check_host = is_loopback(host)

    class Handler(BaseHTTPRequestHandler):
        server_version = "laneway"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            return  # requests are not logged; errors are (``_error``)

        def handle(self) -> None:
            """Serve the connection's requests; a client that went away before its answer
            (a 421 or a 401 written to a closed socket) ends the connection quietly, not
            with a traceback on stderr for each one."""
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def parse_request(self) -> bool:
            """The request line and headers; then, bound to loopback, the Host check
            before any method is dispatched (421, one line, connection closed)."""
            if not super().parse_request():
                return False
            if not check_host:
                return True
            hosts = self.headers.get_all("Host") or []
            if len(hosts) == 1 and host_allowed(hosts[0], host, port):
                return True
            self.close_connection = True
            shown = f"[{host}]" if ":" in host else host
            self._send(
                HTTPStatus.MISDIRECTED_REQUEST,
                json.dumps(
                    {"error": f"unexpected Host header: open http://{shown}:{port}/"}
                ).encode(),
                "application/json",
            )
            return False

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if not self._authorised(query):
                self._send(
                    HTTPStatus.UNAUTHORIZED, b'{"error": "token required"}', "application/json"
                )
                return
            try:
                self._route(url.path, query)
            except LanewayError as error:
                status = (
                    HTTPStatus.NOT_FOUND if isinstance(error, NotFound) else HTTPStatus.BAD_REQUEST
                )
                self._json({"error": str(error)}, status)
            except (BrokenPipeError, ConnectionResetError):
                return
            except Exception as error:  # one request fails, the server goes on
                print(f"laneway web: {self.path}: {type(error).__name__}: {error}", file=sys.stderr)
                self._json(
                    {"error": f"{type(error).__name__}: {error}"}, HTTPStatus.INTERNAL_SERVER_ERROR
                )

        def _refuse(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b'{"error": "read-only"}', "application/json")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        def _route(self, path: str, query: dict[str, str]) -> None:
            if path == "/metrics":
                from laneway.controller.metrics import CONTENT_TYPE

                self._send(HTTPStatus.OK, dashboard.metrics(), CONTENT_TYPE)
            elif metrics_only:
                self._json({"error": "not found"}, HTTPStatus.NOT_FOUND)
            elif path == "/" or web_links.route(path) is not None:
                # The page, at its root and at every run, job, attempt and explain
                # address (``web_links``): its script reads ``location.pathname``.
                extra = {}
                if token and _matches(query.get("token"), token):
                    extra["Set-Cookie"] = (
                        f"{COOKIE}={cookie_value(token)}; HttpOnly; SameSite=Strict; Path=/"
                    )
                self._send(HTTPStatus.OK, web_page.PAGE.encode(), "text/html; charset=utf-8", extra)
            elif path == "/app.js":
                self._send(
                    HTTPStatus.OK, web_page.SCRIPT.encode(), "text/javascript; charset=utf-8"
                )
            elif path == "/api/runs":
                self._json(dashboard.runs())
            elif path == "/api/state":
                self._json(dashboard.state(_id(query, "run", optional=True)))
            elif path == "/api/timeline":
                svg = dashboard.timeline(_id(query, "run", optional=True))
                self._send(HTTPStatus.OK, svg.encode(), "image/svg+xml; charset=utf-8")
            elif path == "/api/explain":
                self._json(
                    dashboard.explain(query.get("job", ""), _id(query, "run", optional=True))
                )
            elif path == "/api/attempt":
                self._json(dashboard.attempt(_id(query, "id")))
            else:
                self._json({"error": "not found"}, HTTPStatus.NOT_FOUND)

        def _authorised(self, query: dict[str, str]) -> bool:
            if token is None:
                return True
            header = self.headers.get("Authorization", "")
            bearer = (
                header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else None
            )
            cookie = SimpleCookie(self.headers.get("Cookie", ""))
            kept = cookie[COOKIE].value if COOKIE in cookie else None
            # Each compared, none short-circuiting the others.
            checks = [
                _matches(bearer, token),
                _matches(kept, cookie_value(token)),
                _matches(query.get("token"), token),
            ]
            return any(checks)

        def _json(self, body: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
            self._send(status, json.dumps(body, default=str).encode(), "application/json")

        def _send(
            self,
            status: HTTPStatus,
            body: bytes,
            content_type: str,
            extra: dict[str, str] | None = None,
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header(
                "Content-Security-Policy",
                "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                "frame-ancestors 'none'",
            )
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    port = server.server_port  # the one bound (port 0 asks for any): the Host check's
    return server


def _when(value: Any) -> str | None:
    """A ledger timestamp (text on SQLite, a datetime elsewhere) as ISO text."""
    return iso(_moment(value))


def _id(query: dict[str, str], name: str, *, optional: bool = False) -> Any:
    value = query.get(name, "")
    if not value and optional:
        return None
    number = ids.parse_id(value)
    if number is None:
        raise UsageError(f"{name}: give an id (a positive number)")
    return number


def serve_metrics_in_background(
    runtime_dir: Path, bind: str, token_file: Path | None
) -> tuple[ThreadingHTTPServer, str]:
    """``/metrics`` on ``bind`` from a thread (``laneway controller --metrics-bind``);
    returns the server and its URL."""
    host, port = parse_bind(bind)
    token = read_token(token_file, host)
    server = make_server(Dashboard(runtime_dir), host, port, token=token, metrics_only=True)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, url_of(server)


def url_of(server: ThreadingHTTPServer) -> str:
    address, port = server.server_address[:2]
    host = address.decode() if isinstance(address, bytes) else str(address)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"
