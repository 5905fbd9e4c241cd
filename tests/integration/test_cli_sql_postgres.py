"""`laneway sql` on PostgreSQL stays an inspection tool: one statement that returns rows,
in a read-only transaction, as a role that can only read laneway's tables (made by
`laneway sql-role create`, as docs/deploy.md says); a superuser is refused unless the operator says
so, and even then writes, COPY and the server's files stay out of reach. Every refusal
is one line and exit 2, and nothing changes: no row, no table, no file."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from laneway.controller.db import GATE_KEY
from tests.integration.sql_roles import (
    advisory_locks_held,
    connect_as_owner,
    ledger_url,
    readonly_role,
)
from tests.integration.test_cli import assert_clean_error, invoke

__all__ = ["readonly_role"]  # a fixture the tests here use

SUPERUSER_OK = "--i-know-this-is-superuser"


@pytest.fixture(autouse=True)
def _postgres_only(ledger_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if ledger_backend != "postgres":
        pytest.skip("PostgreSQL only: roles, COPY and server files are PostgreSQL's")
    monkeypatch.delenv("LANEWAY_READONLY_DATABASE_URL", raising=False)


@pytest.fixture
def server_dir() -> Iterator[Path]:
    """A directory the database server can write into: shown by a superuser's own COPY,
    so a file missing there afterwards means laneway stopped the write."""
    path = Path(tempfile.mkdtemp(prefix="lw-sql-", dir="/tmp"))
    try:
        path.chmod(0o777)
        control = path / "control"
        with connect_as_owner() as conn:
            conn.execute(f"COPY (SELECT 1) TO '{control}'")
        assert control.exists(), "the database server cannot write here: not the same host?"
        control.unlink()
        yield path
    finally:
        shutil.rmtree(path)


def fingerprint() -> dict[str, object]:
    """Every relation outside the system schemas with its row count, and the large
    objects: what a write, a CREATE or lo_import would change."""
    with connect_as_owner() as conn:
        relations = conn.execute(
            "SELECT n.nspname, c.relname, c.relkind FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') "
            "AND n.nspname NOT LIKE 'pg_toast%' ORDER BY 1, 2"
        ).fetchall()
        shape: dict[str, object] = {}
        for schema, name, kind in relations:
            key = f"{schema}.{name}"
            if kind == "r":
                count = conn.execute(f'SELECT COUNT(*) FROM "{schema}"."{name}"').fetchone()
                shape[key] = count[0] if count else None
            else:
                shape[key] = kind
        objects = conn.execute("SELECT COUNT(*) FROM pg_largeobject_metadata").fetchone()
        shape["large objects"] = objects[0] if objects else None
    return shape


def sql(query: str, runtime: Path, *args: str) -> Any:
    return invoke("sql", query, "--runtime-dir", str(runtime), *args)


def assert_refused(result: Any) -> None:
    """Exit 2, one line on stderr, and no row (nor a file's contents) on stdout."""
    assert_clean_error(result, 2)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout == ""


# Each one writes, creates, reads a server file or runs a program when run unguarded.
ATTEMPTS = {
    "insert": "INSERT INTO nodes (name, memory_floor_mib, max_jobs) VALUES ('z', 0, 1)",
    "insert_returning": (
        "INSERT INTO nodes (name, memory_floor_mib, max_jobs) VALUES ('z', 0, 1) RETURNING name"
    ),
    "update": "UPDATE jobs SET state = 'succeeded'",
    "delete_in_with": "WITH d AS (DELETE FROM events RETURNING 1) SELECT COUNT(*) FROM d",
    "delete": "DELETE FROM events",
    "create_table": "CREATE TABLE lw_evil (a int)",
    "select_into": "SELECT * INTO lw_evil FROM jobs",
    "drop": "DROP TABLE events",
    "copy_to_file": "COPY (SELECT 1) TO '{dir}/x'",
    "copy_to_program": "COPY (SELECT 1) TO PROGRAM 'touch {dir}/x'",
    "copy_to_stdout": "COPY (SELECT 1) TO STDOUT",
    "copy_from_file": "COPY nodes (name) FROM '/etc/hostname'",
    "pg_read_file": "SELECT pg_read_file('/etc/hostname') AS h",
    "pg_ls_dir": "SELECT pg_ls_dir('/etc') AS f",
    "lo_import": "SELECT lo_import('/etc/hostname') AS o",
    "two_statements": "SELECT 1; SELECT 2",
    "a_select_then_a_write": "SELECT 1; CREATE TABLE lw_evil (a int)",
    "a_select_then_copy": "SELECT 1; COPY (SELECT 1) TO '{dir}/x'",
    "set": "SET statement_timeout = 0",
    "do": "DO $$BEGIN CREATE TABLE lw_evil (a int); END$$",
    "nextval": "SELECT nextval(pg_get_serial_sequence('events', 'id')) AS n",
    "commit": "COMMIT",
}


@pytest.mark.parametrize("name", sorted(ATTEMPTS))
def test_readonly_role_refuses_every_write_and_changes_nothing(
    started, readonly_role, server_dir, name
):
    before = fingerprint()
    query = ATTEMPTS[name].format(dir=server_dir)
    result = sql(query, started, "--readonly-url", readonly_role)
    assert_refused(result)
    assert result.stderr.startswith("laneway: query refused: ")
    assert list(server_dir.iterdir()) == []
    assert fingerprint() == before


def test_readonly_role_cannot_read_server_files_and_says_so_in_one_line(started, readonly_role):
    result = sql(
        "SELECT pg_read_file('/etc/hostname') AS h", started, "--readonly-url", readonly_role
    )
    assert_refused(result)
    assert "permission denied for function pg_read_file" in result.stderr


def test_several_statements_are_refused_before_any_runs(started, readonly_role):
    result = sql("SELECT 1; SELECT 2", started, "--readonly-url", readonly_role)
    assert_refused(result)
    assert "more than one statement" in result.stderr


def test_copy_is_refused_unrun(started, readonly_role, server_dir):
    result = sql(f"COPY (SELECT 1) TO '{server_dir}/x'", started, "--readonly-url", readonly_role)
    assert_refused(result)
    assert "COPY" in result.stderr and "not run" in result.stderr


def test_a_write_that_returns_rows_meets_the_read_only_transaction(started, server_dir):
    # As the superuser, with the flag: only the transaction stands in the way.
    before = fingerprint()
    result = sql(ATTEMPTS["insert_returning"], started, SUPERUSER_OK)
    assert_refused(result)
    assert "read-only transaction" in result.stderr
    assert fingerprint() == before


def test_readonly_role_reads(started, readonly_role):
    count = sql(
        "SELECT COUNT(*) AS n FROM v_job_current",
        started,
        "--readonly-url",
        readonly_role,
        "--json",
    )
    assert count.exit_code == 0, count.output
    assert json.loads(count.stdout) == [{"n": 2}]
    # A % in the query is the operator's, not a placeholder.
    percent = sql(
        "SELECT 5 % 2 AS m, 'a%' LIKE 'a%' AS l", started, "--readonly-url", readonly_role, "--json"
    )
    assert json.loads(percent.stdout) == [{"m": 1, "l": True}]
    show = sql(
        "SHOW default_transaction_read_only", started, "--readonly-url", readonly_role, "--json"
    )
    assert json.loads(show.stdout) == [{"default_transaction_read_only": "on"}]


def test_readonly_url_from_the_environment(started, readonly_role, monkeypatch):
    monkeypatch.setenv("LANEWAY_READONLY_DATABASE_URL", readonly_role)
    result = sql("SELECT current_user AS u", started, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"u": make_url(readonly_role).username}]


def test_default_privileges_cover_tables_created_later(started, readonly_role):
    with connect_as_owner() as conn:
        conn.execute("CREATE TABLE lw_later AS SELECT 7 AS seven")
    result = sql("SELECT seven FROM lw_later", started, "--readonly-url", readonly_role, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"seven": 7}]


def test_superuser_is_refused_without_the_flag(started, server_dir):
    before = fingerprint()
    for query in ("SELECT 1 AS one", f"COPY (SELECT 1) TO '{server_dir}/x'"):
        result = sql(query, started)
        assert_refused(result)
        assert "superuser" in result.stderr
        assert "--readonly-url" in result.stderr and SUPERUSER_OK in result.stderr
    assert list(server_dir.iterdir()) == []
    assert fingerprint() == before


def test_superuser_with_the_flag_reads(started):
    result = sql("SELECT COUNT(*) AS n FROM v_job_current", started, SUPERUSER_OK, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"n": 2}]


SUPERUSER_ATTEMPTS = {
    **ATTEMPTS,
    "quoted_pg_read_file": "SELECT \"pg_read_file\"('/etc/hostname') AS h",
    "qualified_pg_read_file": "SELECT pg_catalog.pg_read_file('/etc/hostname') AS h",
    "query_to_xml": (
        "SELECT query_to_xml('SELECT pg_read_file(''/etc/hostname'')', true, false, '') AS x"
    ),
    "unicode_escaped_name": "SELECT U&\"pg\\005fread\\005ffile\"('/etc/hostname') AS h",
    "read_write_again": "SELECT set_config('transaction_read_only', 'off', true) AS s",
}


@pytest.mark.parametrize("name", sorted(SUPERUSER_ATTEMPTS))
def test_superuser_with_the_flag_still_cannot_write_copy_or_read_files(started, server_dir, name):
    before = fingerprint()
    result = sql(SUPERUSER_ATTEMPTS[name].format(dir=server_dir), started, SUPERUSER_OK)
    assert_refused(result)
    assert result.stderr.startswith("laneway: query refused: ")
    assert list(server_dir.iterdir()) == []
    assert fingerprint() == before


def test_a_password_in_the_url_is_never_shown(started, readonly_role):
    secret = "s3cr3t-pw"
    with_password = make_url(readonly_role).set(password=secret)
    refused = sql(
        "SELECT 1; SELECT 2",
        started,
        "--readonly-url",
        with_password.render_as_string(hide_password=False),
    )
    assert_refused(refused)
    unreachable = with_password.set(host="127.0.0.1", port=1)
    failed = sql(
        "SELECT 1", started, "--readonly-url", unreachable.render_as_string(hide_password=False)
    )
    assert_refused(failed)
    assert "cannot connect to" in failed.stderr and "***" in failed.stderr
    superuser = ledger_url().set(password=secret).render_as_string(hide_password=False)
    as_superuser = sql("SELECT 1", started, "--readonly-url", superuser)
    assert_refused(as_superuser)
    for result in (refused, failed, as_superuser):
        assert secret not in result.output


LOCKS = {
    "xact_lock": "SELECT pg_advisory_xact_lock(1818324581), pg_sleep(1)",
    "session_lock": "SELECT pg_advisory_lock(1818324581)",
    "try_lock": "SELECT pg_try_advisory_xact_lock(1818324581)",
    "shared": "SELECT pg_advisory_lock_shared(1)",
    "quoted": 'SELECT "pg_advisory_xact_lock"(1)',
    "upper": "SELECT PG_ADVISORY_XACT_LOCK(1)",
    "unicode_escape": 'SELECT U&"pg_advisory_xact_lock"(1)',
}


@pytest.mark.parametrize("name", sorted(LOCKS))
@pytest.mark.parametrize("role", ["readonly", "superuser"])
def test_advisory_lock_functions_are_refused_for_every_role(started, readonly_role, name, role):
    """laneway's write lock is an advisory lock, and neither a read-only transaction nor
    a read-only role stops a query taking it: it would hold up every write (heartbeats
    too) for as long as it ran."""
    extra = (
        ["--readonly-url", readonly_role] if role == "readonly" else ["--i-know-this-is-superuser"]
    )
    result = sql(LOCKS[name], started, *extra)
    assert_refused(result)
    assert "advisory" in result.stderr.lower() or "u&" in result.stderr.lower(), result.stderr
    assert advisory_locks_held() == 0


# The query: the lock function's name is built while the query runs, out of
# the text's sight (its pg_sleep kept short).
BUILT_LOCK = (
    f"SELECT query_to_xml('SELECT pg_' || 'advisory_xact_lock({GATE_KEY})::text, "
    "pg_sleep(1)::text', true, false, '')"
)
SQL_TEXT = {
    "query_to_xml": BUILT_LOCK,
    "query_to_xmlschema": "SELECT query_to_xmlschema('SELECT 1', true, false, '')",
    "query_to_xml_and_xmlschema": (
        "SELECT query_to_xml_and_xmlschema('SELECT 1', true, false, '')"
    ),
    "cursor_to_xml": "SELECT cursor_to_xml('c', 1, true, false, '')",
    "ts_stat": "SELECT * FROM ts_stat('SELECT pg_' || 'advisory_lock(1)::text::tsvector')",
    "ts_rewrite": "SELECT ts_rewrite('a'::tsquery, 'SELECT ''a''::tsquery, ''b''::tsquery')",
    "dblink": "SELECT * FROM dblink('dbname=x', 'SELECT 1') AS t(a int)",
    "quoted_qualified": "SELECT pg_catalog.\"query_to_xml\"('SELECT 1', true, false, '')",
    "upper": "SELECT QUERY_TO_XML('SELECT 1', true, false, '')",
}


@pytest.mark.parametrize("name", sorted(SQL_TEXT))
@pytest.mark.parametrize("role", ["readonly", "superuser"])
def test_functions_that_run_sql_text_are_refused_for_every_role(started, readonly_role, name, role):
    """SQL built while the query runs is out of any text check's sight: the functions
    that run it are refused by name, unrun, whoever the role is."""
    extra = ["--readonly-url", readonly_role] if role == "readonly" else [SUPERUSER_OK]
    result = sql(SQL_TEXT[name], started, *extra)
    assert_refused(result)
    assert "runs SQL given as text" in result.stderr and "nothing was run" in result.stderr
    assert advisory_locks_held() == 0
