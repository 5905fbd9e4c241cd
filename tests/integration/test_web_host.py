"""`laneway web` answers only to its own names, and writes nothing a request sent into a
response header: bound to loopback, a request whose Host is another name (a page on a
DNS-rebinding domain, read from the operator's browser) is refused with 421 before any
endpoint runs; in token mode the cookie is set only from a token that matched, and holds
a hash of the server's token, never the query's value (CR/LF cannot split a response)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from laneway.controller import web
from tests.integration.test_web import pipeline

TOKEN = "t0k3n-" + "z" * 32


@contextmanager
def serving(runtime: Path, host: str, token: str | None) -> Iterator[int]:
    """The dashboard of ``runtime`` on ``host``, any port, from a thread; yields the port."""
    dashboard = web.Dashboard(runtime)
    server = web.make_server(dashboard, host, 0, token=token)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        dashboard.close()


def request(
    port: int, path: str, host: str | None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, list[str]], bytes]:
    """GET ``path`` with exactly this Host header (none when None)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            connection.putheader("Host", host)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        found: dict[str, list[str]] = {}
        for name, value in response.getheaders():
            found.setdefault(name.lower(), []).append(value)
        return response.status, found, response.read()
    finally:
        connection.close()


@pytest.fixture
def started(tmp_path: Path) -> Path:
    """A runtime dir with a started run (its first job ready)."""
    return pipeline(tmp_path)[0]


def test_a_loopback_dashboard_answers_only_to_its_own_names(started: Path):
    with serving(started, "127.0.0.1", None) as port:
        for path in ("/api/state", "/api/attempt?id=1", "/metrics", "/", "/api/runs"):
            for host in (
                f"evil.example:{port}",
                "evil.example",
                f"127.0.0.1.evil.example:{port}",
                f"localhost.:{port}",
                "localhost",  # the bound port is not 80
                f"localhost:{port + 1}",
                f"127.0.0.1:{port + 1}",
                f"[::2]:{port}",
                f"127.0.0.1:{port}:{port}",
                "",
                None,
            ):
                status, _headers, body = request(port, path, host)
                assert status == 421, (path, host, body)
                assert body.count(b"\n") == 0 and json.loads(body)["error"], body
        for host in (
            f"127.0.0.1:{port}",
            "127.0.0.1",
            f"localhost:{port}",
            f"LOCALHOST:{port}",
            f"[::1]:{port}",
        ):
            status, _headers, body = request(port, "/api/state", host)
            assert status == 200, (host, body)
            assert json.loads(body)["run"]["id"] == 1
        assert request(port, "/metrics", f"localhost:{port}")[0] == 200
        # Two Host headers: refused, whatever the first says.
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.putrequest("GET", "/api/state", skip_host=True)
        connection.putheader("Host", f"127.0.0.1:{port}")
        connection.putheader("Host", f"evil.example:{port}")
        connection.endheaders()
        assert connection.getresponse().status == 421
        connection.close()


def test_the_host_check_knows_its_names():
    assert web.host_allowed("127.0.0.1:8470", "127.0.0.1", 8470)
    assert web.host_allowed("127.0.0.1", "127.0.0.1", 8470)
    assert web.host_allowed("[::1]", "::1", 8470)
    assert web.host_allowed("[0:0:0:0:0:0:0:1]:8470", "::1", 8470)
    assert web.host_allowed("localhost:8470", "127.0.0.1", 8470)
    assert web.host_allowed("127.0.0.1:8470", "localhost", 8470)
    assert not web.host_allowed("localhost", "127.0.0.1", 8470)
    assert not web.host_allowed("127.0.0.2:8470", "127.0.0.1", 8470)
    assert not web.host_allowed("127.0.0.1:08470x", "127.0.0.1", 8470)
    assert not web.host_allowed("127.0.0.1:\u0668\u0664\u0667\u0660", "127.0.0.1", 8470)
    assert not web.host_allowed(None, "127.0.0.1", 8470)


def test_the_cookie_is_set_only_from_a_matching_token_and_never_echoes_it(started: Path):
    with serving(started, "127.0.0.1", TOKEN) as port:
        host = f"127.0.0.1:{port}"
        bearer = {"Authorization": "Bearer " + TOKEN}
        # Authorised by the header; the query's token is wrong and carries CR/LF.
        status, headers, _ = request(port, "/?token=wrong%0d%0aX-Injected:%20yes", host, bearer)
        assert status == 200
        assert "x-injected" not in headers and "set-cookie" not in headers, headers
        status, headers, _ = request(port, f"/?token={TOKEN}%0d%0aX-Injected:%20yes", host)
        assert status == 401 and "x-injected" not in headers and "set-cookie" not in headers
        # The token itself: a cookie, holding a hash of it, that lets the page poll.
        status, headers, _ = request(port, f"/?token={TOKEN}", host)
        assert status == 200
        (cookie,) = headers["set-cookie"]
        assert TOKEN not in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        pair = cookie.split(";")[0]
        assert pair == f"{web.COOKIE}={web.cookie_value(TOKEN)}"
        assert request(port, "/api/state", host, {"Cookie": pair})[0] == 200
        assert request(port, "/api/state", host, {"Cookie": f"{web.COOKIE}={TOKEN}"})[0] == 401
        assert request(port, "/api/state", host)[0] == 401


def test_beyond_loopback_the_token_decides_whatever_the_host(started: Path):
    with serving(started, "0.0.0.0", TOKEN) as port:
        bearer = {"Authorization": "Bearer " + TOKEN}
        assert request(port, "/api/state", f"dashboard.example:{port}", bearer)[0] == 200
        assert request(port, "/api/state", f"dashboard.example:{port}")[0] == 401
