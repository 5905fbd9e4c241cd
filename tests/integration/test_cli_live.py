"""`laneway status --watch` and `laneway run` off a terminal: plain lines, one per change
(JSON lines with --json), until interrupted; and the new read-only commands stay light
(no rich, SQLAlchemy or service imports where a plain read is enough)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.integration.test_cli import invoke
from tests.integration.test_cli_imports import FAST, NEVER, heavy, imported
from tests.integration.test_cli_services import LANEWAY, ROOT, config_file, finish


def watch(runtime, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*LANEWAY, "status", "--watch", "--runtime-dir", str(runtime), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def started(tmp_path):
    runtime = tmp_path / "rt"
    result = invoke(
        "start-pipeline",
        str(config_file(tmp_path, items=2)),
        "--runtime-dir",
        str(runtime),
        "--no-controller",
    )
    assert result.exit_code == 0, result.output
    return runtime


def test_watch_off_a_terminal_prints_plain_lines_until_interrupted(tmp_path):
    runtime = started(tmp_path)
    process = watch(runtime)
    assert process.stdout is not None
    try:
        first = [process.stdout.readline().rstrip("\n") for _ in range(3)]
    finally:
        process.send_signal(signal.SIGINT)
    where = runtime.resolve()
    idle = (
        "run 1: lane a: idle: no_worker — no live worker on node n1; start one: laneway "
        f"worker --node n1 --runtime-dir {where}"
    )
    # `start-pipeline --no-controller`: no controller runs, and the lines say so (on a
    # shared ledger no controller has heartbeat in it yet, so none is claimed gone).
    if os.environ.get("LANEWAY_DATABASE_URL"):
        assert first == [
            "run 1: 0/2 jobs terminal · ready 2",
            "run 1: controller: unknown: the ledger is shared (PostgreSQL) and no "
            "controller has served it yet",
            idle,
        ]
    else:
        assert first == [
            "run 1: 0/2 jobs terminal · ready 2",
            f"run 1: controller: GONE — no controller runs for {where} (no live process "
            "holds its pidfile)",
            f"{idle}; next: no controller serves the run, so nothing is dispatched, settled "
            "or closed; continue the run in the foreground (or start `laneway controller "
            f"--runtime-dir {where}`): laneway run --continue 1 --runtime-dir {where}",
        ]
    code, rest, err = finish(process)
    assert code == 130, err
    assert rest == ""  # nothing changed, nothing more was printed
    assert "Traceback" not in err


def test_watch_json_prints_one_json_line_per_change(tmp_path):
    runtime = started(tmp_path)
    process = watch(runtime, "--json")
    assert process.stdout is not None
    try:
        body = json.loads(process.stdout.readline())
    finally:
        process.send_signal(signal.SIGINT)
    code, rest, _ = finish(process)
    assert body["totals"] == {"ready": 2} and "eta_seconds" in body
    assert code == 130 and rest == ""


def run_three(tmp_path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`laneway run` of a three-item pipeline, off a terminal."""
    config = config_file(tmp_path, items=3)
    return subprocess.run(
        [*LANEWAY, "run", str(config), "--runtime-dir", str(tmp_path / "rt"), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_run_off_a_terminal_reports_progress_in_lines(tmp_path):
    done = run_three(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "run 1: 3/3 jobs terminal · succeeded 3" in lines
    assert "run 1: lane a: done" in lines
    assert len(lines) == len(set(lines))  # one line per change, never a repeat
    assert "\x1b" not in done.stderr


def test_run_json_reports_progress_as_json_lines_on_stderr(tmp_path):
    """stdout stays one JSON document (the final status); the progress goes to stderr
    as one JSON status per change."""
    done = run_three(tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    final = json.loads(done.stdout)
    assert final["run"]["state"] == "finished" and final["totals"] == {"succeeded": 3}
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert lines and all("eta_seconds" in line and "totals" in line for line in lines)
    assert lines[-1]["totals"] == {"succeeded": 3}
    seen = [json.dumps(line["totals"], sort_keys=True) for line in lines]
    assert len(lines) >= 2 and seen[0] != seen[-1]  # it moved while running


@pytest.mark.sqlite_only(
    "the quick read-only path is the standard library's sqlite3; on PostgreSQL a read-only "
    "command needs SQLAlchemy and the driver"
)
def test_logs_and_web_help_stay_light(tmp_path):
    runtime = started(tmp_path)
    names, done = imported("logs", "1", "--job", "--runtime-dir", str(runtime))
    assert done.returncode == 2 and "no attempt yet" in done.stderr  # a clean refusal
    assert heavy(names, FAST) == set()
    names, done = imported("web", "--help")
    assert done.returncode == 0
    assert heavy(names, FAST | {"prometheus_client"}) == set()
    names, done = imported("status", "--watch", "--help")
    assert heavy(names, NEVER) == set()
