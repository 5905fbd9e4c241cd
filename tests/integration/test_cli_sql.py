"""`laneway sql` is read-only for real: nothing it is given creates a file anywhere or
changes the ledger; a refused query is one line and exit 2."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from laneway.controller import db
from laneway.controller.sqlguard import MAX_QUERY_TIMEOUT_S
from tests.integration.test_cli import assert_clean_error, invoke


def dump(runtime: Path) -> list[str]:
    connection = sqlite3.connect(f"file:{runtime / db.LEDGER_FILENAME}?mode=ro", uri=True)
    try:
        return [*connection.iterdump(), str(connection.execute("PRAGMA user_version").fetchall())]
    finally:
        connection.close()


def files(root: Path) -> set[Path]:
    # The -shm index is SQLite's shared-memory file: readers may map it.
    return {p for p in root.rglob("*") if not p.name.endswith("-shm")}


ATTEMPTS = {
    "attach_path": "ATTACH DATABASE '{target}' AS x",
    "attach_uri": "ATTACH DATABASE 'file:{target}?mode=rwc' AS x",
    "vacuum_into": "VACUUM INTO '{target}'",
    "vacuum": "VACUUM",
    "pragma_user_version": "PRAGMA user_version = 7",
    "pragma_journal_mode": "PRAGMA journal_mode = DELETE",
    "pragma_query_only_off": "PRAGMA query_only = OFF",
    "pragma_writable_schema": "PRAGMA writable_schema = ON",
    "insert": "INSERT INTO nodes (name, memory_floor_mib, max_jobs) VALUES ('z', 0, 1)",
    "update": "UPDATE jobs SET state = 'succeeded'",
    "delete": "DELETE FROM events",
    "drop": "DROP TABLE events",
    "create_temp": "CREATE TEMP TABLE t AS SELECT * FROM jobs",
    "load_extension": "SELECT load_extension('{target}')",
    "detach": "DETACH DATABASE main",
}


@pytest.mark.sqlite_only("SQLite statements; test_cli_sql_postgres.py has PostgreSQL's")
@pytest.mark.parametrize("name", sorted(ATTEMPTS))
def test_sql_refuses_every_write_and_creates_nothing(started, tmp_path, name):
    target = tmp_path / "elsewhere" / "x.db"
    target.parent.mkdir()
    ledger_before = dump(started)  # a read-only open leaves SQLite's -wal file
    before = files(tmp_path)
    result = invoke("sql", ATTEMPTS[name].format(target=target), "--runtime-dir", str(started))
    assert_clean_error(result, 2)
    assert result.stderr.startswith("laneway: query refused: ")
    assert len(result.stderr.splitlines()) == 1
    assert "read-only" in result.stderr or "readonly" in result.stderr
    assert not target.exists()
    assert files(tmp_path) == before
    assert dump(started) == ledger_before


@pytest.mark.sqlite_only("the authorizer's words; test_cli_sql_postgres.py has PostgreSQL's")
def test_sql_names_what_it_refused(started, tmp_path):
    attach = invoke("sql", f"ATTACH '{tmp_path / 'a.db'}' AS a", "--runtime-dir", str(started))
    assert "ATTACH" in attach.stderr
    pragma = invoke("sql", "PRAGMA user_version = 7", "--runtime-dir", str(started))
    assert "PRAGMA user_version = 7 is not allowed" in pragma.stderr
    load = invoke("sql", "SELECT load_extension('x')", "--runtime-dir", str(started))
    assert "load_extension" in load.stderr
    table_function = invoke(
        "sql", "SELECT name FROM pragma_table_info('jobs')", "--runtime-dir", str(started)
    )
    assert_clean_error(table_function, 2)
    assert "use PRAGMA table_info(...)" in table_function.stderr


@pytest.mark.sqlite_only("PRAGMAs are SQLite's; test_cli_sql_postgres.py reads PostgreSQL")
def test_sql_still_reads_and_reading_pragmas_work(started):
    rows = json.loads(
        invoke(
            "sql",
            "SELECT COUNT(*) AS n FROM v_job_current",
            "--runtime-dir",
            str(started),
            "--json",
        ).stdout
    )
    assert rows == [{"n": 2}]
    info = invoke("sql", "PRAGMA table_info(jobs)", "--runtime-dir", str(started), "--json")
    assert info.exit_code == 0, info.output
    assert "state" in {column["name"] for column in json.loads(info.stdout)}
    recursive = invoke(
        "sql",
        "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r WHERE x < 3) "
        "SELECT SUM(x) AS s FROM r",
        "--runtime-dir",
        str(started),
        "--json",
    )
    assert json.loads(recursive.stdout) == [{"s": 6}]


@pytest.mark.sqlite_only("edits the ledger file with sqlite3")
def test_unknown_revision_is_still_refused_by_read_only_commands(started):
    path = started / db.LEDGER_FILENAME
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'ffff_future'")
    connection.close()
    for args in (["status"], ["sql", "SELECT 1"], ["explain", "1"]):
        result = invoke(*args, "--runtime-dir", str(started))
        assert_clean_error(result, 1)
        assert "'ffff_future', which this laneway does not know" in result.stderr


def test_a_runaway_query_stops_at_the_timeout(started, ledger_backend):
    # Bounded, so that without the timeout it ends (in tens of seconds) and the test fails.
    endless = (
        "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r WHERE x < 100000000) "
        "SELECT COUNT(*) AS n FROM r"
    )
    # On PostgreSQL the suite's role is a superuser: the flag lets the query run at all.
    flag = ["--i-know-this-is-superuser"] if ledger_backend == "postgres" else []
    result = invoke("sql", endless, "--runtime-dir", str(started), "--timeout", "0.2", *flag)
    assert_clean_error(result, 2)
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("laneway: query stopped: it ran past --timeout 0.2 s")
    again = invoke(
        "sql", "SELECT COUNT(*) AS n FROM jobs", "--runtime-dir", str(started), "--json", *flag
    )
    assert json.loads(again.stdout) == [{"n": 2}]


def test_readonly_url_must_name_postgresql(started, tmp_path):
    url = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    result = invoke("sql", "SELECT 1", "--runtime-dir", str(started), "--readonly-url", url)
    assert_clean_error(result, 2)
    assert "--readonly-url must name a PostgreSQL database" in result.stderr
    assert not (tmp_path / "other.sqlite3").exists()


def test_the_timeout_has_an_upper_bound(started, ledger_backend):
    """A query that runs for hours holds back the cleanup of the ledger's rows: --timeout
    takes at most MAX_QUERY_TIMEOUT_S, and says so in one line naming the flag."""
    flag = ["--i-know-this-is-superuser"] if ledger_backend == "postgres" else []
    bound = f"{MAX_QUERY_TIMEOUT_S:g}"
    over = invoke("sql", "SELECT 1 AS one", "--runtime-dir", str(started), "--timeout", "600.5")
    assert over.exit_code == 2, over.output
    assert "Traceback" not in over.output
    error = [line for line in over.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "'--timeout'" in error[0] and f"at most {bound} s" in error[0]
    at = invoke(
        "sql", "SELECT 1 AS one", "--runtime-dir", str(started), "--timeout", bound, "--json", *flag
    )
    assert at.exit_code == 0, at.output
    assert json.loads(at.stdout) == [{"one": 1}]


@pytest.mark.no_ledger
def test_the_docs_give_the_timeouts_bound():
    deploy = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    assert f"at most {MAX_QUERY_TIMEOUT_S:g} s" in " ".join(deploy.split())
