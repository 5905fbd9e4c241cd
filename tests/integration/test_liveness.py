"""Liveness is a fact in every view: after ``kill -9`` of ``laneway run`` (its controller
and its worker gone, in one process) ``laneway status --json`` names the controller
``gone`` (on SQLite; on PostgreSQL, whose controller may run elsewhere, its heartbeat in
the ledger says ``unknown`` while stale and ``gone`` once lost), the
worker ``stale`` and then ``lost``, its attempts ``unverified`` (never running), and the
lanes' next step ``no_controller`` with the ``laneway run --continue`` command; the web
API (``Dashboard.state``) and the live display (``cli/live.py``) say the same step and
the same worker state.

A worker of this machine whose process is gone is ``lost`` at once; one on another
machine (the row moved there) goes ``stale`` and then ``lost`` by its heartbeat.

Real processes. Waits are bounded polls; the ages past the kill are set with ``now=``
(the heartbeat's time plus so many seconds), never waited out on the clock.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from laneway.cli.live import Progress, renderable
from laneway.cli.render import status_text
from laneway.controller.readonly import ReadOnlyLedger
from laneway.controller.status import status_report
from laneway.controller.status_model import StatusReport
from laneway.controller.status_nodes import LOST_AFTER_SECONDS, STALE_AFTER_SECONDS
from laneway.controller.web import Dashboard
from tests.integration.test_cli_services import BOUND, LANEWAY, ROOT, config_file, finish, spawn
from tests.integration.test_metrics import scrape, value
from tests.integration.test_web import (
    browser_or_skip,
    browser_page,
    get_json,
    serving_url,
)
from tests.support import GATE_BOUND, wait_for_file, wait_until

NAP = wait_for_file("sys.argv[1]")
"""A job that naps until its gate file exists (the test opens it at the end)."""


def status_json(runtime: Path, *, yet: bool = True) -> dict[str, Any]:
    """``laneway status --json``; ``yet=False``: nothing running while there is no
    ledger (or no run) yet."""
    done = subprocess.run(
        [*LANEWAY, "status", "--json", "--runtime-dir", str(runtime)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    not_yet = "no ledger" in done.stdout or "no runs yet" in done.stdout
    if not yet and done.returncode == 2 and not_yet:
        return {"running": []}
    assert done.returncode == 0, done.stderr + done.stdout
    body: dict[str, Any] = json.loads(done.stdout)
    return body


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=None)


def report_at(runtime: Path, run_id: int, now: datetime) -> StatusReport:
    source = ReadOnlyLedger(runtime)
    try:
        with source.snapshot():
            return status_report(source, run_id, now=now)
    finally:
        source.close()


def as_if_elsewhere(runtime: Path) -> None:
    """Test-only arrangement once a run's processes are dead: its worker's row on
    another machine (so only its heartbeat judges it), and the newest controller's
    heartbeat set to the worker's."""
    from sqlalchemy import text

    from laneway.controller import ledger_open

    engine = ledger_open.open_existing_ledger(runtime)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE workers SET host = 'elsewhere'"))
            connection.execute(
                text(
                    "UPDATE controllers SET heartbeat_at = "
                    "(SELECT max(heartbeat_at) FROM workers) "
                    "WHERE id = (SELECT max(id) FROM controllers)"
                )
            )
    finally:
        engine.dispose()


def rendered(report: StatusReport) -> tuple[str, str]:
    """The live display's terminal text and its plain lines, of one report."""
    from rich.console import Console

    screen = io.StringIO()
    Console(file=screen, width=2000, color_system=None).print(renderable(report, None, {}))
    plain = io.StringIO()
    Progress(report.run.id, stream=plain, live=False).show(report)
    return screen.getvalue(), plain.getvalue()


@contextmanager
def killable_run(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes], dict[str, Any]]]:
    """A `laneway run` (its own process group) whose two attempts nap until the test
    ends: (runtime, its process, its status once both run)."""
    gate = tmp_path / "gate"
    config = config_file(
        tmp_path,
        items=2,
        max_jobs=2,
        stages=[
            {
                "name": "nap",
                "argv": [sys.executable, "-c", NAP, str(gate)],
                "timeout_seconds": GATE_BOUND,
            }
        ],
    )
    runtime = tmp_path / "rt"
    run = subprocess.Popen(
        [*LANEWAY, "run", str(config), "--runtime-dir", str(runtime), "--quiet"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        alive = wait_until(
            lambda: (
                (body := status_json(runtime, yet=False))["running"]
                and all(r["state"] == "running" for r in body["running"])
                and len(body["running"]) == 2
                and body
            ),
            BOUND,
        )
        yield runtime, run, alive
    finally:
        gate.touch()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def test_a_killed_laneway_run_is_gone_stale_then_lost_in_every_view(tmp_path):
    on_sqlite = not os.environ.get("LANEWAY_DATABASE_URL")
    with killable_run(tmp_path) as (runtime, run, alive):
        # While it runs: the controller is `laneway run` itself, its worker live, its
        # attempts verified.
        assert alive["controller"]["state"] == "running"
        assert alive["controller"]["pid"] == run.pid
        [worker] = alive["workers"]
        assert worker["liveness"] == "live" and worker["live"] is True
        assert all(r["verified"] is True for r in alive["running"])
        assert all(r["unverified_because"] is None for r in alive["running"])
        assert [lane["next_step"]["code"] for lane in alive["lanes"]] == ["running"]

        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=BOUND)
        # This machine's worker whose process is gone is lost at once, in every view.
        at_once = status_json(runtime)
        [local] = at_once["workers"]
        assert local["liveness"] == "lost" and local["heartbeat_age_seconds"] < LOST_AFTER_SECONDS
        because = f"worker {local['worker_id']} lost"
        assert [r["unverified_because"] for r in at_once["running"]] == [because, because]

        # A worker on another machine is judged by its heartbeat alone: the same
        # process, its row moved there (and, on PostgreSQL, its controller's heartbeat,
        # which beats on its own 2 s, lined up with the worker's, so one age judges both).
        as_if_elsewhere(runtime)

        # `laneway status`, polled until the heartbeat ages past STALE_AFTER_SECONDS.
        after = wait_until(
            lambda: (body := status_json(runtime))["workers"][0]["liveness"] != "live" and body,
            BOUND,
            interval=0.5,
        )
        [worker] = after["workers"]
        age = worker["heartbeat_age_seconds"]
        assert age >= STALE_AFTER_SECONDS  # the age is shown rounded to 0.1 s
        expected = "stale" if age <= LOST_AFTER_SECONDS else "lost"
        assert worker["liveness"] == expected and worker["live"] is False
        run_id = after["run"]["id"]
        runtime_dir = after["run"]["runtime_dir"]
        assert after["run"]["state"] == "active"
        for attempt in after["running"]:
            assert attempt["state"] == "running"  # the row's state is kept
            assert attempt["verified"] is False
            assert attempt["worker_id"] == worker["worker_id"]
            assert attempt["unverified_because"].startswith(f"worker {worker['worker_id']} ")
        [node] = after["nodes"]
        assert node["live_workers"] == 0
        continue_command = (
            f"laneway run --continue {run_id} --runtime-dir {shlex.quote(runtime_dir)}"
        )
        [lane] = after["lanes"]
        if on_sqlite:
            assert after["controller"] == {
                "state": "gone",
                "pid": None,
                "words": after["controller"]["words"],
            }
            assert "no controller runs" in after["controller"]["words"]
            # When it died: its last heartbeat in the ledger.
            assert "last heartbeat at 20" in after["controller"]["words"]
            assert lane["next_step"]["code"] == "no_controller"
            assert lane["next_step"]["command"] == continue_command
            assert "laneway controller" in lane["next_step"]["words"]
        else:
            # A shared ledger's controller may run on another machine: its heartbeat in
            # the ledger says it; stale is not yet claimed gone.
            assert after["controller"]["state"] == "unknown"
            assert "has not heartbeat for" in after["controller"]["words"]
            # Its attempts unverified, the way on is a worker, which adopts them.
            assert lane["next_step"]["code"] == "no_worker"
            assert lane["next_step"]["command"].startswith("laneway worker --node n1 ")

        # The same facts at fixed ages past the last heartbeat (``now=``), in every view.
        beat = moment(worker["heartbeat_at"])
        for seconds, liveness, because in (
            (STALE_AFTER_SECONDS + 6, "stale", f"stale for {STALE_AFTER_SECONDS + 6:.0f} s"),
            (LOST_AFTER_SECONDS + 1, "lost", "lost"),
        ):
            now = beat + timedelta(seconds=seconds)
            # PostgreSQL: the controller's heartbeat says gone once it is lost.
            gone_here = on_sqlite or seconds > LOST_AFTER_SECONDS
            report = report_at(runtime, run_id, now)
            body = report.as_dict()
            assert [w["liveness"] for w in body["workers"]] == [liveness]
            why = f"worker {worker['worker_id']} {because}"
            assert [r["unverified_because"] for r in body["running"]] == [why, why]
            step = body["lanes"][0]["next_step"]
            assert step["code"] == ("no_controller" if gone_here else "no_worker")

            dashboard = Dashboard(runtime, now=lambda now=now: now)
            try:
                api = dashboard.state(run_id)
            finally:
                dashboard.close()
            assert api["lanes"][0]["next_step"] == step
            assert [w["liveness"] for w in api["workers"]] == [liveness]
            assert [r["verified"] for r in api["running"]] == [False, False]
            assert api["controller"]["state"] == body["controller"]["state"]
            if gone_here:
                assert api["lanes"][0]["action"] == f"{step['words']}: {continue_command}"

            # Metrics read the same fields.
            samples = scrape(runtime, now)
            assert value(samples, "laneway_node_workers", node="n1", liveness=liveness) == 1
            assert value(samples, "laneway_node_live_workers", node="n1") == 0
            unverified = {"run": str(run_id), "stage": "nap", "state": "unverified"}
            assert value(samples, "laneway_attempts_in_flight", **unverified) == 2
            gone = "gone" if gone_here else "unknown"
            assert value(samples, "laneway_run_controller", run=str(run_id), state=gone) == 1

            screen, plain = rendered(report)
            assert "UNVERIFIED x0.nap" in screen or "UNVERIFIED x1.nap" in screen
            assert why in screen
            assert f"worker {worker['worker_id']} (node n1): {liveness}" in plain
            text = status_text(report)
            assert f"unverified: {why}" in text
            assert " running\n" not in screen  # never shown as plainly running
            if gone_here:
                for shown in (screen, plain, text):
                    assert continue_command in shown
                    assert "controller: GONE" in shown


def test_the_page_names_the_gone_controller_and_never_shows_unverified_as_running(tmp_path):
    playwright_api = browser_or_skip()
    with killable_run(tmp_path) as (runtime, run, _alive):
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=BOUND)
        as_if_elsewhere(runtime)
        web = spawn("web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime))
        try:
            url = serving_url(web)
            state = wait_until(
                lambda: (
                    (body := get_json(url + "api/state"))["running"]
                    and all(r["verified"] is False for r in body["running"])
                    and body["controller"]["state"] != "running"
                    and body
                ),
                BOUND,
                interval=0.5,
            )
            with browser_page(playwright_api, url) as (page, errors):
                page.wait_for_selector("#lanes .unverified", timeout=30_000)
                now = page.locator("#lanes .unverified").first.inner_text()
                assert now.startswith("2 UNVERIFIED: worker "), now
                assert page.locator("#lanes .ok").count() == 0  # not the running green
                assert page.locator("#running .unverified").count() == 2
                assert page.locator("#workers .unverified").count() == 1
                # The banner is the run's one next step, the one `status` leads with.
                step = state["next_step"]
                assert page.locator("#next").is_visible()
                shown = page.locator("#next-words").inner_text()
                assert re.sub(r"\d+", "N", shown) == re.sub(r"\d+", "N", step["words"])
                assert page.locator("#next-step").inner_text() == step["command"]
                fact = page.locator("#controller").inner_text()
                if state["controller"]["state"] == "gone":
                    assert step["code"] == "no_controller", step
                    assert step["command"].startswith("laneway run --continue ")
                    assert page.locator("#next").get_attribute("class") == "alarm"
                    assert fact.startswith("controller: no controller runs for "), fact
                else:  # PostgreSQL: said honestly, and no step claims it gone
                    assert fact.startswith("controller: unknown"), fact
                    assert step["code"] == "no_worker", step
                    assert step["command"].startswith("laneway worker --node ")
                # The lane waits for a person: it is in "Needs you", with the same step.
                assert page.locator("#needs").is_visible()
                # The timeline draws them as unverified, never as growing "running" bars.
                page.wait_for_selector(
                    "#timeline rect.attempt.unverified", state="attached", timeout=30_000
                )
                assert page.locator("#timeline rect.attempt.unverified").count() == 2
                assert page.locator("#timeline rect.attempt.running").count() == 0
                page.screenshot(path=str(tmp_path / "controller-gone.png"), full_page=True)
                assert errors == []
        finally:
            web.send_signal(signal.SIGTERM)
            finish(web)
