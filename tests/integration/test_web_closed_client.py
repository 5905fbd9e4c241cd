"""A dashboard client that goes away before its answer is not a traceback (issue 47 item
9): the 421 of the Host check (and any answer) written to a socket whose peer has
closed ends that connection quietly; the server goes on serving."""

from __future__ import annotations

import socket

from laneway.controller import web
from tests.integration.test_web import pipeline
from tests.integration.test_web_host import request, serving


def test_a_client_that_closed_before_its_421_leaves_no_traceback(tmp_path, capfd):
    runtime = pipeline(tmp_path)[0]
    dashboard = web.Dashboard(runtime)
    server = web.make_server(dashboard, "127.0.0.1", 0, token=None)
    try:
        ours, theirs = socket.socketpair()
        theirs.sendall(b"GET /api/state HTTP/1.1\r\nHost: evil.example\r\n\r\n")
        theirs.close()  # gone before the answer: writing the 421 raises BrokenPipeError
        server.RequestHandlerClass(ours, ("127.0.0.1", 1), server)  # serves it, here
        ours.close()
    finally:
        server.server_close()
        dashboard.close()
    assert capfd.readouterr().err == ""


def test_the_server_goes_on_after_such_a_client(tmp_path, capfd):
    runtime = pipeline(tmp_path)[0]
    with serving(runtime, "127.0.0.1", None) as port:
        for _ in range(3):
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n")
            client.close()
        status, _headers, _body = request(port, "/api/runs", f"127.0.0.1:{port}")
        assert status == 200
    assert "Traceback" not in capfd.readouterr().err
