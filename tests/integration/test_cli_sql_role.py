"""`laneway sql-role create|check`: the read-only role of `laneway sql` cannot take an
advisory lock (laneway's gate is one) nor run SQL given as text, in a `psql`-like
session of its own as through `laneway sql`, because the database refuses it those
functions; it still reads every table and view; laneway's own role keeps its locks and
laneway still writes; and the revokes stay in the ledger's database."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from laneway.controller.controller_lock import CONTROLLER_LOCK_KEY
from laneway.controller.db import GATE_KEY, NODE_LOCK_CLASS
from laneway.controller.readonly_role import LEDGER_LOCKS
from tests import backends
from tests.integration.sql_roles import (
    advisory_locks_held,
    any_role,
    connect_as_owner,
    documented_role,
    drop_role,
    ledger_url,
    plain_url,
    readonly_role,
    unique_role,
)
from tests.integration.test_cli import assert_clean_error, invoke
from tests.integration.test_cli_sql_postgres import BUILT_LOCK

__all__ = ["any_role", "documented_role", "readonly_role"]  # fixtures the tests use
CHECKS = {
    "login",
    "plain",
    "reads",
    "writes_nothing",
    "no_locks",
    "read_only",
    "later_tables",
    "ledger_locks",
}


@pytest.fixture
def postgres(ledger_backend: str) -> None:
    if ledger_backend != "postgres":
        pytest.skip("PostgreSQL only: roles and function privileges are PostgreSQL's")


def role_of(url: str) -> str:
    return str(make_url(url).username)


def check(role: str, url: str, *args: str) -> Any:
    return invoke("sql-role", "check", role, "--database-url", url, *args)


def assert_one_line_error(result: Any) -> None:
    assert_clean_error(result, 2)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout == ""


@pytest.mark.usefixtures("postgres")
def test_create_makes_a_role_check_finds_as_it_should_be(readonly_role):
    role = role_of(readonly_role)
    # As the role itself: check needs no superuser.
    result = check(role, readonly_role, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["role"] == role
    assert {c["name"] for c in report["checks"]} == CHECKS
    assert all(c["ok"] for c in report["checks"]), report
    text = check(role, readonly_role)
    assert text.exit_code == 0, text.output
    assert text.stdout.rstrip().endswith("can only read")
    # Run again on the role it made: the same grants, nothing new created.
    again = invoke("sql-role", "create", role, "--database-url", plain_url(), "--json")
    assert again.exit_code == 0, again.output
    made = json.loads(again.stdout)
    assert made["ok"] is True and made["created"] is False
    assert "pg_advisory_xact_lock(bigint)" in made["revoked"]
    assert "query_to_xml(text,boolean,boolean,text)" in made["revoked"]


@pytest.mark.usefixtures("postgres")
def test_the_docs_sql_makes_the_role_the_command_makes(documented_role):
    result = check(role_of(documented_role), plain_url(), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"] is True


@pytest.mark.usefixtures("postgres")
def test_check_names_what_a_role_may_do_and_exits_1(readonly_role):
    role = role_of(readonly_role)
    with connect_as_owner() as conn:
        conn.execute(f"GRANT EXECUTE ON FUNCTION pg_advisory_lock(bigint) TO {role}")
        conn.execute(f"ALTER ROLE {role} SET default_transaction_read_only = off")
    result = check(role, plain_url())
    assert result.exit_code == 1, result.output
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 2, result.stdout
    assert "no_locks" in failed[0] and "pg_advisory_lock(bigint)" in failed[0]
    assert "read_only" in failed[1] and "= off" in failed[1]
    as_json = json.loads(check(role, plain_url(), "--json").stdout)
    assert as_json["ok"] is False
    assert {c["name"] for c in as_json["checks"] if not c["ok"]} == {"no_locks", "read_only"}


@pytest.mark.usefixtures("postgres")
def test_check_of_a_role_with_the_old_grants_only_fails(started):
    """The suite's reader has the grants docs/deploy.md gave before (USAGE, SELECT): it
    may still take advisory locks and run SQL text, and check says so."""
    result = check(backends.reader(), plain_url(), "--json")
    assert result.exit_code == 1, result.output
    failed = {c["name"] for c in json.loads(result.stdout)["checks"] if not c["ok"]}
    assert {"no_locks", "read_only", "later_tables"} <= failed
    assert "reads" not in failed


@pytest.mark.usefixtures("postgres")
def test_check_says_when_the_ledger_role_lost_its_locks(readonly_role):
    # A role other than the owner, as if laneway wrote as it: create revoked PUBLIC's
    # EXECUTE, and nothing granted it back.
    result = check(role_of(readonly_role), plain_url(), "--ledger-role", backends.reader())
    assert result.exit_code == 1, result.output
    line = next(line for line in result.stdout.splitlines() if "ledger_locks" in line)
    assert line.startswith("FAIL") and LEDGER_LOCKS[0] in line


# A session of the role (psql's, say) trying each way to a lock. Each list runs in one
# transaction; its last statement must fail for want of a privilege.
ATTACKS = {
    "built_lock_in_query_to_xml": [BUILT_LOCK],
    "session_lock_on_the_gate": [f"SELECT pg_advisory_lock({GATE_KEY})"],
    "try_lock": [f"SELECT pg_try_advisory_lock({GATE_KEY})"],
    "shared_gate": [f"SELECT pg_advisory_xact_lock_shared({GATE_KEY})"],
    "node_lock": [f"SELECT pg_advisory_xact_lock({NODE_LOCK_CLASS}, 1)"],
    "ts_stat": ["SELECT * FROM ts_stat('SELECT pg_' || 'advisory_lock(1)::text::tsvector')"],
    "cursor_to_xml": [
        "DECLARE c CURSOR FOR SELECT 1",
        "SELECT cursor_to_xml('c', 1, true, false, '')",
    ],
    "temporary_function": [
        "SET TRANSACTION READ WRITE",
        "CREATE FUNCTION pg_temp.lw_lock() RETURNS void LANGUAGE sql "
        f"AS 'SELECT pg_advisory_lock({GATE_KEY})'",
        "SELECT pg_temp.lw_lock()",
    ],
}


@pytest.mark.usefixtures("postgres")
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_session_of_the_role_cannot_take_a_lock(any_role, name):
    *before, last = ATTACKS[name]
    with psycopg.connect(any_role) as conn:  # one transaction, still open after the error
        for statement in before:
            conn.execute(statement)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
            conn.execute(last)
        # A lock taken before the error would be held until the rollback.
        assert advisory_locks_held() == 0
        conn.rollback()
    assert advisory_locks_held() == 0


@pytest.mark.usefixtures("postgres")
def test_laneway_sql_refuses_the_built_lock_and_holds_none(started, any_role):
    result = invoke("sql", BUILT_LOCK, "--runtime-dir", str(started), "--readonly-url", any_role)
    assert_one_line_error(result)
    assert "query_to_xml" in result.stderr and "nothing was run" in result.stderr
    assert advisory_locks_held() == 0


@pytest.mark.usefixtures("postgres")
def test_the_role_still_reads_every_table_and_view(started, any_role):
    with connect_as_owner() as conn:
        names = [
            row[0]
            for row in conn.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = "
                "c.relnamespace WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v')"
            )
        ]
    assert "jobs" in names and "v_job_current" in names
    with psycopg.connect(any_role, autocommit=True) as conn:
        for name in names:
            conn.execute(f'SELECT count(*) FROM "{name}"')
        jobs = conn.execute("SELECT count(*) FROM v_job_current").fetchone()
    assert jobs == (2,)
    result = invoke(
        "sql",
        "SELECT COUNT(*) AS n FROM jobs",
        "--runtime-dir",
        str(started),
        "--readonly-url",
        any_role,
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"n": 2}]


@pytest.mark.usefixtures("postgres")
def test_the_revokes_stay_in_the_ledger_database(readonly_role):
    role = role_of(readonly_role)
    asked = "SELECT has_function_privilege(%s, 'pg_advisory_lock(bigint)', 'EXECUTE')"
    with connect_as_owner() as conn:
        assert conn.execute(asked, ["public"]).fetchone() == (False,)
        assert conn.execute(asked, [role]).fetchone() == (False,)
    # Another database of the same cluster (and the template this test's was cloned
    # from): PUBLIC, and so the same role, may still run it there.
    for other in (backends.admin, lambda: backends.admin_on(backends.template())):
        with other() as conn:
            assert conn.execute("SELECT current_database()").fetchone() != (ledger_url().database,)
            assert conn.execute(asked, ["public"]).fetchone() == (True,)
            assert conn.execute(asked, [role]).fetchone() == (True,)


@pytest.fixture
def owned_ledger(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A ledger in a database of its own, migrated by a role that is no superuser (as
    docs/deploy.md section 1 makes it); (its URL as that role, as the superuser)."""
    suffix = uuid.uuid4().hex[:8]
    owner, database = f"lw_own_{suffix}", f"lw_own_{suffix}"
    with backends.admin() as conn:
        conn.execute(f"CREATE ROLE {owner} LOGIN")
        conn.execute(f"CREATE DATABASE {database} OWNER {owner}")
    as_owner = plain_url(username=owner, password=None, database=database)
    as_superuser = plain_url(database=database)
    try:
        migrated = invoke("migrate", "--database-url", as_owner)
        assert migrated.exit_code == 0, migrated.output
        monkeypatch.setenv("LANEWAY_DATABASE_URL", as_owner)
        yield as_owner, as_superuser
    finally:
        backends.drop_database(database)
        with backends.admin() as conn:
            conn.execute(f"DROP ROLE IF EXISTS {owner}")


@pytest.mark.usefixtures("postgres")
def test_laneways_own_role_keeps_its_locks_and_laneway_still_writes(
    owned_ledger, good_config, tmp_path
):
    as_owner, as_superuser = owned_ledger
    role = unique_role()
    try:
        made = invoke("sql-role", "create", role, "--database-url", as_superuser, "--json")
        assert made.exit_code == 0, made.output
        assert json.loads(made.stdout)["ledger_role"] == role_of(as_owner)
        runtime = str(tmp_path / "rt")
        started = invoke(
            "start-pipeline", str(good_config), "--runtime-dir", runtime, "--no-controller"
        )
        assert started.exit_code == 0, started.output
        paused = invoke("pause", "1", "--reason", "lock check", "--runtime-dir", runtime)
        assert paused.exit_code == 0, paused.output
        with psycopg.connect(as_owner) as conn:  # every lock laneway takes
            conn.execute(f"SELECT pg_advisory_xact_lock({GATE_KEY})")
            conn.execute(f"SELECT pg_advisory_xact_lock_shared({GATE_KEY})")
            conn.execute(f"SELECT pg_advisory_xact_lock({NODE_LOCK_CLASS}, 1)")
            assert conn.execute(
                f"SELECT pg_try_advisory_lock({CONTROLLER_LOCK_KEY})"
            ).fetchone() == (True,)
        reader = plain_url(username=role, password=None, database=make_url(as_owner).database)
        with psycopg.connect(reader) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT pg_try_advisory_lock({CONTROLLER_LOCK_KEY})")
    finally:
        with psycopg.connect(as_superuser, autocommit=True) as conn:
            drop_role(conn, role)


@pytest.mark.usefixtures("postgres")
@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("not_superuser", "must connect as a superuser"),
        ("ledger_role", "is the ledger's own role"),
        ("elevated", "exists and is CREATEDB"),
        ("no_ledger", "holds no laneway ledger"),
        ("unreachable", "cannot connect to"),
        ("no_such_ledger_role", "--ledger-role lw_nobody_here: no such role"),
    ],
)
def test_create_refuses_in_one_line(started, case, words):
    role, url, extra = unique_role(), plain_url(), []
    if case == "not_superuser":
        url = plain_url(username=backends.reader(), password=None)
    elif case == "ledger_role":
        role = role_of(plain_url())
    elif case == "no_ledger":
        url = backends.POSTGRES_URL
    elif case == "unreachable":
        url = plain_url(host="127.0.0.1", port=1, password="s3cr3t")
    elif case == "no_such_ledger_role":
        extra = ["--ledger-role", "lw_nobody_here"]
    asked = "SELECT rolcreatedb FROM pg_roles WHERE rolname = %s"
    with connect_as_owner() as conn:
        if case == "elevated":
            conn.execute(f"CREATE ROLE {role} LOGIN CREATEDB")
        before = conn.execute(asked, [role]).fetchone()
        try:
            result = invoke("sql-role", "create", role, "--database-url", url, *extra)
            assert_one_line_error(result)
            assert words in result.stderr, result.stderr
            assert "s3cr3t" not in result.output
            # Nothing made or changed: no new role, an existing one as it was.
            assert conn.execute(asked, [role]).fetchone() == before
            assert conn.execute(
                "SELECT has_function_privilege('public', 'query_to_xml(text,boolean,boolean,"
                "text)', 'EXECUTE')"
            ).fetchone() == (True,)
        finally:
            if case == "elevated":
                conn.execute(f"DROP ROLE {role}")


@pytest.mark.no_ledger
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["create", "Robert'; DROP TABLE jobs"], 'NAME "Robert\'; DROP TABLE jobs" is not'),
        (["create", "pg_monitor2"], "not starting with a digit or pg_"),
        (["check", "laneway_ro", "--database-url", "sqlite:///x.db"], "a SQLite ledger"),
        (
            [
                "check",
                "laneway_ro",
                "--ledger-role",
                "Bad-Name",
                "--database-url",
                "postgresql://nobody@127.0.0.1:1/x",
            ],
            "--ledger-role 'Bad-Name'",
        ),
        (["check", "laneway_ro"], "--database-url"),
        (["remove", "laneway_ro"], "'remove' is not one of"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words, monkeypatch):
    monkeypatch.delenv("LANEWAY_DATABASE_URL", raising=False)
    result = invoke("sql-role", *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert words in result.output, result.output
