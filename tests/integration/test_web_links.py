"""The dashboard's links: `laneway web` serves its page at every run, job, attempt and
explain address (controller/web_links.py), under the same token and Host checks as `/`;
`laneway status`, `explain` and `logs` print the address of what they name (`link: URL`,
`"link"` in --json) only when LANEWAY_WEB_URL is set, and that address opens the page;
and, in a real browser, every job is a link that shows the job and pushes its address,
Back goes back, a pasted job address opens on it, and a lane that needs a person comes
first, with its action, above the running one."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from laneway.controller import web_links
from tests.integration.test_cli import assert_clean_error, invoke
from tests.integration.test_cli_services import finish, spawn
from tests.integration.test_web import (
    browser_or_skip,
    browser_page,
    get,
    get_json,
    pipeline,
    running,  # noqa: F401 - the fixture
)
from tests.integration.test_web_host import TOKEN, request, serving
from tests.support import GATE_BOUND, controller_serving, escape, wait_for_file, wait_until

PAGE_MARK = b'<script src="/app.js">'


def test_every_address_serves_the_page_and_others_are_not_found(running):  # noqa: F811
    _runtime, _gate, url = running
    base = url.rstrip("/")
    for path in (
        web_links.run_path(1),
        web_links.job_path(1, "x0", "only"),
        web_links.job_path(1, "no such item", "only"),  # the page says so, from the API
        "/runs/1/jobs/2",
        web_links.explain_path(1, "x1", "only"),
        web_links.attempt_path(1),
    ):
        status, body = get(base + path)
        assert status == 200 and PAGE_MARK in body, (path, body[:200])
    for path in ("/runs/1/jobs/nodot", "/runs/x", "/attempts/1/2", "/runs/1/other/x0.only"):
        status, body = get(base + path)
        assert status == 404 and json.loads(body)["error"], path
    for method in ("POST", "PUT", "DELETE"):
        assert get(base + "/runs/1", method=method)[0] == 405


def test_the_addresses_keep_the_token_and_host_checks(tmp_path: Path):
    runtime = pipeline(tmp_path)[0]
    path = web_links.job_path(1, "x0", "only")
    with serving(runtime, "127.0.0.1", None) as port:
        assert request(port, path, f"evil.example:{port}")[0] == 421
        assert request(port, path, f"127.0.0.1:{port}")[0] == 200
    with serving(runtime, "127.0.0.1", TOKEN) as port:
        host = f"127.0.0.1:{port}"
        assert request(port, path, host)[0] == 401
        assert request(port, path + "?token=wrong", host)[0] == 401
        status, headers, body = request(port, f"{path}?token={TOKEN}", host)
        assert status == 200 and PAGE_MARK in body
        pair = headers["set-cookie"][0].split(";")[0]
        assert request(port, web_links.attempt_path(1), host, {"Cookie": pair})[0] == 200


def test_the_cli_prints_a_link_only_when_the_dashboard_is_named(
    running,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    runtime, _gate, url = running
    rt = ("--runtime-dir", str(runtime))
    wait_until(lambda: get_json(url + "api/attempt?id=1")["logs"]["stdout"]["text"])
    commands = {
        ("status",): web_links.run_path(1),
        ("explain", "x1.only"): web_links.explain_path(1, "x1", "only"),
        ("logs", "1"): web_links.attempt_path(1),
    }
    monkeypatch.delenv(web_links.ENV, raising=False)
    for args in commands:
        for as_json in ((), ("--json",)):
            result = invoke(*args, *rt, *as_json)
            assert result.exit_code == 0, result.output
            assert "link:" not in result.output
            if as_json:
                assert "link" not in json.loads(result.stdout)
    monkeypatch.setenv(web_links.ENV, url)  # with its trailing slash
    for args, path in commands.items():
        expected = url.rstrip("/") + path
        text = invoke(*args, *rt)
        assert text.exit_code == 0, text.output
        if args[0] == "logs":  # stdout stays the attempt's bytes; the link is on stderr
            assert text.stdout == "working\n"
            assert text.stderr.splitlines() == [f"link: {expected}"]
        else:
            assert text.stdout.rstrip("\n").splitlines()[-1] == f"link: {expected}"
            assert text.stdout.count("link: ") == 1
        body = invoke(*args, *rt, "--json")
        assert body.exit_code == 0, body.output
        assert json.loads(body.stdout)["link"] == expected
        status, page = get(expected)  # the link opens the dashboard's page
        assert status == 200 and PAGE_MARK in page
    monkeypatch.setenv(web_links.ENV, "host:8470")
    for args in commands:
        refused = invoke(*args, *rt)
        assert_clean_error(refused, 2)
        assert web_links.ENV in refused.stderr and "Traceback" not in refused.output


def two_lanes(tmp_path: Path) -> tuple[Path, Path]:
    """A started run: lane `a` on node n1 (whose job waits for a gate file) and lane
    `b` on node n2, which no worker serves."""
    gate = tmp_path / "gate"
    code = wait_for_file(repr(str(gate)))
    body = {
        "name": "links",
        "nodes": [
            {"name": "n1", "memory_floor_mib": 0, "max_jobs": 1},
            {"name": "n2", "memory_floor_mib": 0, "max_jobs": 1},
        ],
        "lanes": [{"name": "a", "node": "n1"}, {"name": "b", "node": "n2"}],
        "stages": [
            {
                "name": "only",
                "argv": [sys.executable, "-c", escape(code)],
                "timeout_seconds": GATE_BOUND,
            }
        ],
        "items": [
            {"key": "x0", "lane": "a"},
            {"key": "x1", "lane": "a"},
            {"key": "y0", "lane": "b"},
        ],
    }
    config = tmp_path / "links.json"
    config.write_text(json.dumps(body))
    runtime = tmp_path / "rt"
    started = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert started.exit_code == 0, started.output
    return runtime, gate


def test_browser_follows_links_and_shows_what_needs_you_first(tmp_path: Path):
    playwright_api = browser_or_skip()
    runtime, gate = two_lanes(tmp_path)
    # As if a controller served the run (this process holds its lock and pidfile): the
    # lanes' steps are theirs, not no_controller's (tests/integration/test_liveness.py).
    with controller_serving(runtime):
        worker = spawn("worker", "--node", "n1", "--runtime-dir", str(runtime))
        web = spawn("web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime))
        try:
            assert web.stdout is not None
            line = web.stdout.readline()
            assert "serving http://127.0.0.1:" in line, line + (
                web.stderr.read() if web.poll() else ""
            )
            url = line.split("serving ", 1)[1].split()[0]
            base = url.rstrip("/")
            wait_until(lambda: get_json(url + "api/state")["running"], 60)
            with browser_page(playwright_api, url) as (page, errors):
                page.wait_for_selector("#running a >> text=x0.only", timeout=30_000)
                # Lane b needs a person (no worker): first, with its action, above a.
                assert page.locator("#needs").is_visible()
                needs = page.locator("#needs-list tr").all_inner_texts()
                assert len(needs) == 2 and needs[1].startswith("b\tn2"), needs
                assert "start a worker" in needs[1] and "--node n2" in needs[1]
                lanes = page.locator("#lanes tr td:first-child").all_inner_texts()
                assert lanes == ["b", "a"], lanes
                page.screenshot(path=str(tmp_path / "needs-you.png"), full_page=True)
                # Every run, job and attempt shown is a link to its address.
                job = page.locator("#running a >> text=x0.only")
                assert job.get_attribute("href") == web_links.job_path(1, "x0", "only")
                attempt = page.locator("#running a").first
                assert attempt.get_attribute("href") == web_links.attempt_path(1)
                assert page.locator("#summary a").get_attribute("href") == web_links.run_path(1)
                page.wait_for_selector("#runs a >> text=run 1", timeout=30_000)
                job.click()
                page.wait_for_selector("#explain p >> text=running", timeout=30_000)
                assert page.url == base + web_links.job_path(1, "x0", "only")
                page.click(f'#explain a[href="{web_links.attempt_path(1)}"]')  # its attempt
                page.wait_for_selector("#attempt p >> text=x0.only", timeout=30_000)
                assert page.url == base + web_links.attempt_path(1)
                page.go_back()
                page.wait_for_function(
                    "location.pathname === " + json.dumps(web_links.job_path(1, "x0", "only"))
                )
                # A pasted address opens the page on what it names.
                fresh = page.context.browser.new_page()
                fresh.on("pageerror", lambda error: errors.append(str(error)))
                fresh.goto(base + web_links.job_path(1, "x1", "only"))
                fresh.wait_for_selector("#explain b >> text=ready", timeout=30_000)
                assert "x1.only" in (fresh.locator("#explain p").first.text_content() or "")
                fresh.goto(base + "/runs/1/jobs/3")  # by id: the address takes its name
                fresh.wait_for_selector("#explain p >> text=y0.only", timeout=30_000)
                fresh.wait_for_function(
                    "location.pathname === " + json.dumps(web_links.job_path(1, "y0", "only"))
                )
                fresh.goto(base + web_links.attempt_path(1))
                fresh.wait_for_selector("#attempt p >> text=x0.only", timeout=30_000)
                assert errors == []
        finally:
            gate.touch()
            web.send_signal(signal.SIGTERM)
            finish(web)
            worker.send_signal(signal.SIGTERM)
            finish(worker)
