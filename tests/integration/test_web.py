"""`laneway web`: a read-only dashboard over a running pipeline. The JSON endpoints and
/metrics over HTTP; loopback by default, a token (constant-time compare) beyond it; no
write method; and, in a real browser (Playwright driving Debian's Chromium), an unknown
attempt appearing with its reconcile command while the page is open."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from laneway.controller import db, ledger, ledger_open
from laneway.controller.clock import SystemClock
from tests.integration.test_cli import assert_clean_error, invoke
from tests.integration.test_cli_services import LANEWAY, ROOT, finish, spawn
from tests.support import GATE_BOUND, controller_serving, escape, wait_for_file, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def pipeline(tmp_path: Path) -> tuple[Path, Path]:
    """A started run whose first item's job waits for a gate file; a worker runs it."""
    gate = tmp_path / "gate"
    code = "print('working', flush=True)\n" + wait_for_file(repr(str(gate)))
    body = {
        "name": "web",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "name": "only",
                "argv": [sys.executable, "-c", escape(code)],
                "timeout_seconds": GATE_BOUND,
            }
        ],
        "items": [{"key": "x0", "lane": "a"}, {"key": "x1", "lane": "a"}],
    }
    config = tmp_path / "web.json"
    config.write_text(json.dumps(body))
    runtime = tmp_path / "rt"
    started = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert started.exit_code == 0, started.output
    return runtime, gate


def serving_url(web: subprocess.Popen[str]) -> str:
    """The URL a just-spawned `laneway web` says it serves on (its first line); fails,
    with its stderr when it exited, unless that line says it serves on loopback."""
    assert web.stdout is not None
    line = web.stdout.readline()
    assert "serving http://127.0.0.1:" in line, line + (web.stderr.read() if web.poll() else "")
    return line.split("serving ", 1)[1].split()[0]


@pytest.fixture
def running(tmp_path: Path):
    """(runtime, gate, url): a pipeline with one attempt running, and `laneway web` on it;
    this process holds the controller lock, as a controller would (``controller_serving``)."""
    runtime, gate = pipeline(tmp_path)
    worker = spawn("worker", "--node", "n1", "--runtime-dir", str(runtime))
    web = spawn("web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime))
    try:
        url = serving_url(web)
        wait_until(lambda: get_json(url + "api/state")["running"], 60)
        with controller_serving(runtime):
            yield runtime, gate, url
    finally:
        gate.touch()
        web.send_signal(signal.SIGTERM)
        finish(web)
        worker.send_signal(signal.SIGTERM)
        finish(worker)


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def get_json(url: str) -> Any:
    status, body = get(url)
    assert status == 200, body
    return json.loads(body)


def make_unknown(runtime: Path) -> int:
    """What a lease expiry does to the running attempt (the process may still run).
    Once the attempt is running: a view may show a claimed attempt before its worker has
    recorded its identity (``IDENTITY_WAIT_SECONDS`` later at most, or longer under load)."""
    engine = ledger_open.open_ledger(runtime)
    try:

        def running() -> bool:
            with db.session_factory(engine)() as session:
                return len(ledger.running_attempts(session, 1)) == 1

        wait_until(running)
        with db.transaction(db.session_factory(engine)) as session:
            (attempt,) = ledger.running_attempts(session, 1)
            ledger.mark_unknown(
                session,
                attempt.id,
                reason="lease expired: test stand-in for a worker that stopped renewing",
                actor="controller",
                now=SystemClock().now(),
            )
            return int(attempt.id)
    finally:
        engine.dispose()


def test_endpoints_show_the_running_pipeline_and_refuse_writes(running):
    _runtime, _gate, url = running
    state = get_json(url + "api/state")
    assert state["run"]["id"] == 1 and state["running"][0]["item"] == "x0"
    lane = state["lanes"][0]
    assert lane["running"] == 1 and lane["action"] is None
    assert [r["id"] for r in get_json(url + "api/runs")] == [1]
    # The job may print before its worker records the spawn (intent -> running).
    attempt = wait_until(
        lambda: (
            (found := get_json(url + "api/attempt?id=1"))["logs"]["stdout"]["text"]
            and found["state"] == "running"
            and found
        )
    )
    assert attempt["logs"]["stdout"]["text"] == "working\n"
    assert get_json(url + "api/explain?job=2")["state"] == "ready"
    by_name = get_json(url + "api/explain?job=x1.only&run=1")  # ITEM.STAGE, as the CLI
    assert (by_name["job_id"], by_name["item"], by_name["stage"]) == (2, "x1", "only")
    assert get(url + "api/explain?job=x9.only")[0] == 404
    assert get(url + "api/explain?job=nope")[0] == 400
    status, svg = get(url + "api/timeline")
    assert status == 200 and svg.startswith(b"<svg")
    status, page = get(url)
    assert status == 200 and b'<script src="/app.js">' in page
    assert get(url + "api/attempt?id=99")[0] == 404
    assert get(url + "api/attempt?id=x")[0] == 400
    for method in ("POST", "PUT", "DELETE"):
        assert get(url + "api/state", method=method)[0] == 405
    status, text = get(url + "metrics")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    flying = {
        tuple(sorted(s.labels.items())): s.value
        for s in families["laneway_attempts_in_flight"].samples
    }
    assert flying == {(("run", "1"), ("stage", "only"), ("state", "running")): 1}


def test_binding_beyond_loopback_needs_a_token(tmp_path: Path):
    runtime, _gate = pipeline(tmp_path)
    refused = invoke("web", "--bind", "0.0.0.0:0", "--runtime-dir", str(runtime))
    assert_clean_error(refused, 2)
    assert "--token-file" in refused.stderr
    short = tmp_path / "short"
    short.write_text("abc")
    assert_clean_error(
        invoke(
            "web", "--bind", "0.0.0.0:0", "--token-file", str(short), "--runtime-dir", str(runtime)
        ),
        2,
    )
    assert_clean_error(invoke("web", "--bind", "nonsense", "--runtime-dir", str(runtime)), 2)
    # No ledger there (on PostgreSQL the URL names one: point it at a missing file).
    missing = f"sqlite:///{tmp_path / 'none' / 'ledger.sqlite3'}"
    assert_clean_error(
        invoke("web", "--runtime-dir", str(tmp_path / "none"), "--database-url", missing), 2
    )


def test_a_token_is_required_and_compared(tmp_path: Path):
    runtime, _gate = pipeline(tmp_path)
    token = "t0k3n-" + "x" * 32
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    web = spawn(
        "web",
        "--bind",
        "127.0.0.1:0",
        "--token-file",
        str(token_file),
        "--runtime-dir",
        str(runtime),
    )
    try:
        assert web.stdout is not None
        url = web.stdout.readline().split("serving ", 1)[1].split()[0]
        assert get(url + "api/state")[0] == 401
        assert get(url + "metrics")[0] == 401
        assert get(url + "api/state", {"Authorization": "Bearer " + token[:-1] + "y"})[0] == 401
        assert get(url + "api/state", {"Authorization": "Bearer " + token})[0] == 200
        assert get(url + "metrics", {"Authorization": "Bearer " + token})[0] == 200
        # The browser's way in: ?token= once sets an HttpOnly cookie for the page's polls.
        request = urllib.request.Request(url + "?token=" + token)
        with urllib.request.urlopen(request, timeout=30) as response:
            cookie = response.headers["Set-Cookie"]
        assert "HttpOnly" in cookie
        assert get(url + "api/state", {"Cookie": cookie.split(";")[0]})[0] == 200
    finally:
        web.send_signal(signal.SIGTERM)
        finish(web)


def test_controller_serves_metrics(tmp_path: Path):
    runtime, _gate = pipeline(tmp_path)
    controller = subprocess.Popen(
        [*LANEWAY, "controller", "--runtime-dir", str(runtime), "--metrics-bind", "127.0.0.1:0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert controller.stderr is not None
        # Its lifecycle lines, up to the one with the URL (EOF if it exited: fails below).
        line = next((text for text in controller.stderr if "metrics at" in text), "")
        assert "metrics at" in line, finish(controller)
        url = line.split("metrics at ", 1)[1].strip()
        status, text = get(url)
        assert status == 200
        names = {f.name for f in text_string_to_metric_families(text.decode())}
        assert {"laneway_jobs", "laneway_lane_idle_seconds", "laneway_unknown_attempts"} <= names
        assert get(url.removesuffix("metrics") + "api/state")[0] == 404  # metrics only
    finally:
        controller.send_signal(signal.SIGTERM)
        finish(controller)


def browser_or_skip() -> Any:
    """Playwright's sync API when Chromium is there; else a skip, or a failure where
    ``LANEWAY_REQUIRE_BROWSER`` is set (``.ci/run`` installs Chromium and sets it, so CI
    cannot pass without the browser test having run)."""
    missing = None
    if not os.path.exists(CHROMIUM):
        missing = f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    else:
        try:
            import playwright.sync_api as api
        except ImportError:
            missing = "no playwright (pip install playwright)"
        else:
            return api
    if os.environ.get("LANEWAY_REQUIRE_BROWSER"):
        pytest.fail(f"{missing}, and LANEWAY_REQUIRE_BROWSER is set")
    pytest.skip(f"{missing} for the browser test")


@contextmanager
def browser_page(playwright_api: Any, url: str) -> Iterator[tuple[Any, list[str]]]:
    """Chromium on ``url``: the page, and the page errors it raised (a test asserts none)."""
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()


def test_browser_shows_an_unknown_attempt_with_its_reconcile_command(running, tmp_path: Path):
    playwright_api = browser_or_skip()
    runtime, _gate, url = running
    with browser_page(playwright_api, url) as (page, errors):
        page.wait_for_selector("#lanes td >> text=1 running", timeout=30_000)
        assert page.locator("#unknown").is_hidden()
        attempt = make_unknown(runtime)
        # The open page shows it by itself (it polls), with the exact command.
        command = page.wait_for_selector("#unknown .reconcile", timeout=30_000)
        assert command is not None
        text = command.text_content() or ""
        assert text.startswith(f"laneway reconcile {attempt} --as succeeded|failed|not-run")
        assert f"--runtime-dir {runtime}" in text
        assert page.locator("#unknown").is_visible()
        page.wait_for_selector("#timeline svg", timeout=30_000)
        page.click(f"#running a, #unknown a >> text={attempt}")
        page.wait_for_selector("#attempt pre.log", timeout=30_000)
        shot = Path(os.environ.get("LANEWAY_WEB_SCREENSHOT", tmp_path / "dashboard.png"))
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 0
        assert errors == []


def test_state_marks_an_unknown_attempt_whose_evidence_is_conclusive(
    factory, make_run, runtime: Path, clock
):
    """/api/state judges each unknown attempt's evidence as `laneway status` does (one
    shared judgement: ``evidence.mark_conclusive``): a verified exit record with its
    supervisor gone is marked conclusive with the `reconcile --run RUN --from-evidence`
    command; one whose supervisor still runs is not. The page's script shows it."""
    import shlex

    from tests.integration.test_reconcile_evidence import gone_and_alive
    from tests.support import make_config, py_stage

    stage = py_stage("call", "pass", exit_codes={"0": "succeeded", "3": "infra_failure"})
    run_id = make_run(make_config([stage], items=2))
    gone, alive = gone_and_alive(factory, clock, exit_code=3)
    web = spawn("web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime))
    try:
        url = serving_url(web)
        for _poll in range(2):  # judged on every poll (and the next poll still reads)
            state = get_json(url + f"api/state?run={run_id}")
            marked = {u["attempt_id"]: u.get("conclusive") for u in state["unknown"]}
            assert set(marked) == {gone, alive}
            assert marked[alive] is None
            conclusive = marked[gone]
            assert conclusive is not None
            assert (conclusive["outcome"], conclusive["exit_code"]) == ("infra_failure", 3)
            assert conclusive["settle"] == (
                f"laneway reconcile --run {run_id} --from-evidence "
                f"--runtime-dir {shlex.quote(str(runtime))}"
            )
        status = invoke("status", str(run_id), "--runtime-dir", str(runtime), "--json")
        assert status.exit_code == 0, status.output
        by_status = {
            u["attempt_id"]: u.get("conclusive") for u in json.loads(status.stdout)["unknown"]
        }
        assert by_status == marked
        script = get(url + "app.js")[1].decode()
        assert "u.conclusive.settle" in script and "'conclusive: '" in script
    finally:
        web.send_signal(signal.SIGTERM)
        finish(web)
