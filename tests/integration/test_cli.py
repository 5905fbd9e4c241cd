"""The command line: one-line errors with meaningful exit codes, never a traceback;
refusals create nothing; read-only commands write nothing."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import controller_lock, db, ledger, ledger_open
from laneway.controller.clock import SystemClock
from laneway.controller.states import ControlKind, ControlScope
from tests.support import escape, wait_until

runner = CliRunner()

GOOD = f"""
name = "cli"
[[nodes]]
name = "n1"
memory_floor_mib = 0
max_jobs = 2
[[lanes]]
name = "a"
node = "n1"
[[stages]]
name = "only"
argv = ["{sys.executable}", "-c", "{escape("print('hi')")}", "{{item}}"]
timeout_seconds = 30
[[items]]
key = "x1"
lane = "a"
[[items]]
key = "x2"
lane = "a"
"""


def invoke(*args: str):
    """The CLI in this process. ``--database-url`` sets ``LANEWAY_DATABASE_URL`` for the
    processes a command starts; it is put back afterwards, so no test's URL leaks into
    the next test."""
    before = os.environ.get("LANEWAY_DATABASE_URL")
    try:
        return runner.invoke(app, list(args), catch_exceptions=False)
    finally:
        if before is None:
            os.environ.pop("LANEWAY_DATABASE_URL", None)
        else:
            os.environ["LANEWAY_DATABASE_URL"] = before


def assert_clean_error(result, code: int) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line]
    assert lines and all(line.startswith("laneway: ") for line in lines)


def test_bad_config_lists_every_problem_and_exits_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        GOOD.replace('key = "x2"', 'key = "../x"').replace("max_jobs = 2", "max_jobs = 0")
    )
    result = invoke("dry-run", str(path))
    assert_clean_error(result, 2)
    assert "nodes.0.max_jobs" in result.stderr and "items.1.key" in result.stderr


def test_bad_config_json_output(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    result = invoke("dry-run", str(path), "--json")
    assert result.exit_code == 2
    body = json.loads(result.stdout)
    assert body["ok"] is False and "not valid JSON" in body["problems"][0]


def test_dry_run_writes_nothing(good_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.rglob("*"))
    result = invoke("dry-run", str(good_config), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["jobs_total"] == 2 and plan["preflight"]["ok"] is True
    assert plan["first_decisions"][0]["verdict"] == "dispatch"
    assert set(tmp_path.rglob("*")) == before


def test_start_pipeline_refusal_creates_nothing(tmp_path):
    path = tmp_path / "refused.toml"
    path.write_text(GOOD.replace(sys.executable, "/no/such/python"))
    runtime = tmp_path / "rt"
    result = invoke("start-pipeline", str(path), "--runtime-dir", str(runtime))
    assert_clean_error(result, 1)
    assert "/no/such/python does not exist" in result.stderr
    assert not runtime.exists()


def test_start_pipeline_then_status_and_sql(good_config, tmp_path):
    runtime = tmp_path / "rt"
    result = invoke(
        "start-pipeline",
        str(good_config),
        "--runtime-dir",
        str(runtime),
        "--json",
        "--no-controller",
    )
    assert result.exit_code == 0, result.output
    run_id = json.loads(result.stdout)["run_id"]
    status = json.loads(
        invoke("status", str(run_id), "--runtime-dir", str(runtime), "--json").stdout
    )
    assert status["jobs"] == {"only": {"ready": 2}} and status["run"]["state"] == "active"
    rows = json.loads(
        invoke(
            "sql",
            "SELECT state, COUNT(*) AS n FROM jobs GROUP BY state",
            "--runtime-dir",
            str(runtime),
            "--json",
        ).stdout
    )
    assert rows == [{"state": "ready", "n": 2}]


def test_sql_refuses_writes_and_changes_nothing(started):
    result = invoke("sql", "UPDATE jobs SET state = 'succeeded'", "--runtime-dir", str(started))
    assert_clean_error(result, 2)
    assert "readonly" in result.stderr or "read-only" in result.stderr
    engine = db.make_engine(db.ledger_url(started), readonly=True)
    with engine.connect() as connection:
        states = connection.exec_driver_sql("SELECT DISTINCT state FROM jobs").scalars().all()
    assert states == ["ready"]


def test_sql_bad_query_is_one_line(started):
    assert_clean_error(invoke("sql", "SELEC nonsense", "--runtime-dir", str(started)), 2)


@pytest.mark.parametrize("args", [["status"], ["status", "99"], ["sql", "SELECT 1"]])
def test_missing_ledger_or_run_is_a_clean_error(tmp_path, good_config, args, without_ledger):
    runtime = tmp_path / "rt"
    if args[1:] == ["99"]:
        invoke("start-pipeline", str(good_config), "--runtime-dir", str(runtime), "--no-controller")
    result = invoke(*args, "--runtime-dir", str(runtime))
    assert_clean_error(result, 2)


def test_run_in_foreground_finishes_and_exits_0(good_config, tmp_path):
    runtime = tmp_path / "rt"
    result = invoke("run", str(good_config), "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["run"]["state"] == "finished" and status["totals"] == {"succeeded": 2}


def test_schema_is_json_schema():
    schema = json.loads(invoke("schema").stdout)
    assert {"nodes", "lanes", "stages", "items"} <= set(schema["properties"])


def test_worker_for_unknown_node_is_a_clean_error(started):
    result = invoke("worker", "--node", "nope", "--runtime-dir", str(started), "--exit-if-unknown")
    assert_clean_error(result, 2)
    assert "node 'nope'" in result.stderr


def test_run_never_clears_a_halt_and_exits_3_naming_it(good_config, tmp_path):
    runtime = tmp_path / "rt"
    engine = ledger_open.open_ledger(runtime)
    with db.transaction(db.session_factory(engine)) as session:
        ledger.set_control(
            session,
            ControlKind.HALT,
            scope=ControlScope.GLOBAL,
            reason="disk replaced, checking evidence",
            actor="op",
            now=SystemClock().now(),
        )
    result = invoke("run", str(good_config), "--runtime-dir", str(runtime))
    assert result.exit_code == 3, result.output
    assert "halted (global) — disk replaced, checking evidence" in result.stderr
    assert f"continue it with: laneway run --continue 1 --runtime-dir {runtime}" in result.stderr
    with engine.connect() as connection:
        active = connection.exec_driver_sql(
            "SELECT COUNT(*) FROM controls WHERE cleared_at IS NULL"
        ).scalar()
        started = connection.exec_driver_sql("SELECT COUNT(*) FROM attempts").scalar()
    assert active == 1 and started == 0


def test_start_pipeline_ensures_one_controller(good_config, tmp_path):
    runtime = tmp_path / "rt"
    first = json.loads(
        invoke("start-pipeline", str(good_config), "--runtime-dir", str(runtime), "--json").stdout
    )
    pid = first["controller_pid"]
    assert first["controller_started"] is True and pid
    try:
        wait_until(lambda: controller_lock.running_controller(runtime.resolve()) == pid)
        second = json.loads(
            invoke(
                "start-pipeline", str(good_config), "--runtime-dir", str(runtime), "--json", "--new"
            ).stdout
        )
        assert second["controller_pid"] == pid and second["controller_started"] is False
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)  # it is our child here (posix_spawn); reap it
    wait_until(lambda: not (runtime / controller_lock.PIDFILE).exists())
    assert controller_lock.running_controller(runtime.resolve()) is None


def test_config_rejects_secret_reference_in_argv(tmp_path):
    path = tmp_path / "argv.toml"
    path.write_text(GOOD.replace('"{item}"]', '"{item}", "--key=${API_KEY}"]'))
    result = invoke("dry-run", str(path))
    assert_clean_error(result, 2)
    assert "stages.0: argv.4: ${...} references are resolved only in env" in result.stderr


@pytest.mark.sqlite_only(
    "a ledger is a file only on SQLite (an empty PostgreSQL database: test_cli_services.py)"
)
def test_a_file_that_is_not_a_ledger_is_a_clean_error(tmp_path):
    (tmp_path / "ledger.sqlite3").write_text("not a database at all")
    for args in (["status"], ["sql", "SELECT 1"]):
        result = invoke(*args, "--runtime-dir", str(tmp_path))
        assert_clean_error(result, 1)
        assert "is not a laneway ledger" in result.stderr


def test_runtime_dir_that_cannot_be_created_is_a_clean_error(good_config, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = invoke("start-pipeline", str(good_config), "--runtime-dir", str(blocker / "rt"))
    assert_clean_error(result, 2)
    assert "--runtime-dir" in result.stderr


def test_sql_with_a_bind_marker_and_huge_ids_are_clean_errors(started):
    assert_clean_error(invoke("sql", "SELECT :x", "--runtime-dir", str(started)), 2)
    literal = invoke("sql", "SELECT 'a :b' AS v", "--runtime-dir", str(started), "--json")
    assert json.loads(literal.stdout) == [{"v": "a :b"}]
    huge = invoke("status", "99999999999999999999", "--runtime-dir", str(started))
    assert huge.exit_code == 2 and "Traceback" not in huge.output
