"""`laneway logs`: an attempt's redacted output by attempt, job id or ITEM.STAGE, its
tail, following it until the attempt settles, and where the files are when they are on
another machine. Real processes, bounded waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from laneway.controller import db, ledger_open
from tests.integration.test_cli import assert_clean_error, invoke
from tests.integration.test_cli_services import LANEWAY, ROOT, finish, spawn
from tests.support import GATE_BOUND, escape, wait_for_file, wait_until

SECRET = "sk-logs-test-5c1f0e"
PRINTS = (
    "import sys\n"
    "for i in range(30): print(f'line {i}')\n"
    "print('Authorization: Bearer ' + __import__('os').environ['API_KEY'], file=sys.stderr)\n"
)


def write_config(tmp_path: Path, code: str, *, items: int = 1, secret: bool = True) -> Path:
    body: dict[str, Any] = {
        "name": "logs",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "name": "only",
                "argv": [sys.executable, "-c", escape(code)],
                "timeout_seconds": GATE_BOUND,
                "env": {"API_KEY": "${API_KEY}"} if secret else {},
            }
        ],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(items)],
    }
    path = tmp_path / "logs.json"
    path.write_text(json.dumps(body))
    return path


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("API_KEY", SECRET)
    runtime = tmp_path / "rt"
    result = invoke("run", str(write_config(tmp_path, PRINTS)), "--runtime-dir", str(runtime))
    assert result.exit_code == 0, result.output
    return runtime


def test_logs_by_attempt_job_and_name_with_tail(finished_run: Path):
    rt = ["--runtime-dir", str(finished_run)]
    everything = invoke("logs", "1", *rt)
    assert everything.exit_code == 0, everything.output
    assert everything.stdout.splitlines() == [f"line {i}" for i in range(30)]
    assert invoke("logs", "1", "--job", *rt).stdout == everything.stdout
    tail = invoke("logs", "x0.only", "--tail", "3", *rt)
    assert tail.stdout.splitlines() == ["line 27", "line 28", "line 29"]
    body = json.loads(invoke("logs", "1", "--tail", "1", "--json", *rt).stdout)
    assert body["text"] == "line 29\n" and body["attempt"]["item"] == "x0"
    assert body["path"].endswith("attempt-1/stdout.log")


def test_job_names_item_stage_as_the_positional_form_does(finished_run: Path):
    rt = ["--runtime-dir", str(finished_run)]
    named = invoke("logs", "x0.only", "--job", "--tail", "2", *rt)
    assert named.exit_code == 0, named.output
    assert named.stdout.splitlines() == ["line 28", "line 29"]
    assert (
        invoke("logs", "x0.only", "--job", "--run", "1", *rt).stdout
        == invoke("logs", "1", *rt).stdout
    )
    assert_clean_error(invoke("logs", "nodot", "--job", *rt), 2)


def test_a_reused_job_shows_the_attempt_that_produced_its_result(
    finished_run: Path, tmp_path: Path
):
    rt = ["--runtime-dir", str(finished_run)]
    again = invoke("run", str(tmp_path / "logs.json"), *rt)
    assert again.exit_code == 0, again.output
    # Run 2's job 2 was reused from run 1's attempt 1: it has no attempt of its own.
    for asked in (["x0.only"], ["2", "--job"], ["x0.only", "--job", "--run", "2"]):
        shown = invoke("logs", *asked, *rt)
        assert shown.exit_code == 0, shown.output
        assert shown.stderr == "laneway: x0.only was reused from run 1, attempt 1:\n"
        assert shown.stdout.splitlines() == [f"line {i}" for i in range(30)]
    body = json.loads(invoke("logs", "2", "--job", "--json", *rt).stdout)
    assert body["attempt"]["reused_by_job"] == 2
    assert (body["attempt"]["run_id"], body["attempt"]["attempt_id"]) == (1, 1)
    own = invoke("logs", "1", "--job", *rt)  # run 1's own job: no note
    assert own.exit_code == 0 and own.stderr == ""


def test_stderr_is_shown_redacted(finished_run: Path):
    shown = invoke("logs", "x0.only", "--stderr", "--runtime-dir", str(finished_run))
    assert shown.exit_code == 0, shown.output
    assert "Authorization: Bearer [REDACTED]" in shown.stdout
    assert SECRET not in shown.stdout


def test_unknown_ids_and_names_are_one_line_errors(finished_run: Path):
    rt = ["--runtime-dir", str(finished_run)]
    assert_clean_error(invoke("logs", "99", *rt), 2)
    assert_clean_error(invoke("logs", "99", "--job", *rt), 2)
    assert_clean_error(invoke("logs", "x9.only", *rt), 2)
    assert_clean_error(invoke("logs", "nodot", *rt), 2)
    nowhere = finished_run.parent / "no"  # no ledger (on PostgreSQL: a missing file's URL)
    missing = f"sqlite:///{nowhere / 'ledger.sqlite3'}"
    assert_clean_error(
        invoke("logs", "1", "--runtime-dir", str(nowhere), "--database-url", missing), 2
    )


def test_a_job_without_an_attempt_says_its_state(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("API_KEY", SECRET)
    runtime = tmp_path / "rt"
    config = write_config(tmp_path, "pass")
    started = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert started.exit_code == 0, started.output
    result = invoke("logs", "1", "--job", "--runtime-dir", str(runtime))
    assert_clean_error(result, 2)
    assert "no attempt yet: it is ready" in result.stderr


def test_files_on_another_machine_name_their_node_and_host(finished_run: Path):
    engine = ledger_open.open_ledger(finished_run)
    with db.transaction(db.session_factory(engine)) as session:
        session.execute(text("UPDATE workers SET host = 'far-away'"))
        session.execute(text("UPDATE attempts SET attempt_dir = '/nonexistent/attempt-1'"))
    engine.dispose()
    result = invoke("logs", "1", "--runtime-dir", str(finished_run))
    assert_clean_error(result, 1)
    assert "on node n1 (host far-away)" in result.stderr


def test_follow_streams_until_the_attempt_settles(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("API_KEY", SECRET)
    runtime = tmp_path / "rt"
    gate = tmp_path / "gate"
    code = (
        "print('first', flush=True)\n"
        + wait_for_file(repr(str(gate)))
        + "print('second', flush=True)\n"
    )
    # No secret: the redactor holds back up to the longest secret's length less one
    # byte of a stream until more output (or the end) shows it is not one.
    config = write_config(tmp_path, code, secret=False)
    started = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert started.exit_code == 0, started.output
    worker = spawn("worker", "--node", "n1", "--runtime-dir", str(runtime))
    # The attempt exists (its intent is committed) before anyone can ask for its logs.
    wait_until(lambda: invoke("logs", "1", "--runtime-dir", str(runtime)).exit_code == 0, 60)
    out = tmp_path / "follow.out"
    try:
        with out.open("w") as sink:
            follower = subprocess.Popen(
                [*LANEWAY, "logs", "x0.only", "--follow", "--runtime-dir", str(runtime)],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.PIPE,
                text=True,
            )
            # It waits for the attempt's first line while the job runs...
            wait_until(lambda: "first" in out.read_text() or follower.poll() is not None, 60)
            assert follower.poll() is None, finish(follower)
            gate.touch()
            # ...and ends by itself once the attempt settles, with every line printed.
            code_, _, err = finish(follower)
        assert code_ == 0, err
        assert out.read_text() == "first\nsecond\n"
        assert "attempt 1 is settled" in err
    finally:
        worker.terminate()
        finish(worker)
