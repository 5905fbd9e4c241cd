"""The read-only roles the `laneway sql` tests on PostgreSQL connect as: one made by
`laneway sql-role create` (the documented way), one made by running docs/deploy.md's
SQL as written; and what they share (the ledger's URL, a superuser connection, the
advisory locks held in this test's own database)."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.integration.test_cli import invoke

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
SECTION = "A read-only role for laneway sql\n"


def ledger_url() -> Any:
    return make_url(os.environ["LANEWAY_DATABASE_URL"])


def plain_url(**parts: Any) -> str:
    """The ledger's URL for libpq (psycopg), with ``parts`` replaced."""
    url = ledger_url().set(drivername="postgresql", **parts)
    return url.render_as_string(hide_password=False)


def connect_as_owner() -> psycopg.Connection[Any]:
    """The ledger database, as the role the suite created it with (a superuser)."""
    return psycopg.connect(plain_url(), autocommit=True)


def advisory_locks_held() -> int:
    """Advisory locks held in this test's database: other tests beside it (pytest-xdist)
    hold theirs in their own."""
    with connect_as_owner() as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert row is not None
    return int(row[0])


def documented_script(role: str, database: str, owner: str) -> str:
    """The sql block of docs/deploy.md's read-only role section, for this test's role,
    database and ledger owner."""
    section = DEPLOY.read_text().split(SECTION, 1)[1]
    found = re.search(r"```sql\n(.*?)```", section, re.DOTALL)
    assert found is not None, f"docs/deploy.md: no sql block under {SECTION!r}"
    sql = re.sub(r"--[^\n]*", "", found.group(1))
    sql = re.sub(r"\blaneway_ro\b", role, sql)
    sql = re.sub(r"\bDATABASE laneway\b", f"DATABASE {database}", sql)
    sql = re.sub(r"\bFOR ROLE laneway\b", f"FOR ROLE {owner}", sql)
    sql = re.sub(r"\bTO laneway\b", f"TO {owner}", sql)
    assert not re.search(r"\blaneway\b", sql), sql
    return sql


def unique_role() -> str:
    return f"lw_ro_{os.getpid()}_{uuid.uuid4().hex[:8]}"


@contextmanager
def dropped_at_the_end(role: str) -> Iterator[str]:
    """``role``'s URL; the role, its grants and default privileges dropped afterwards."""
    try:
        yield plain_url(username=role, password=None)
    finally:
        with connect_as_owner() as conn:
            drop_role(conn, role)


def drop_role(conn: psycopg.Connection[Any], role: str) -> None:
    """``role``, its grants and default privileges in ``conn``'s database, if it is there."""
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone():
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


@pytest.fixture
def readonly_role(started: Path) -> Iterator[str]:
    """A role made by `laneway sql-role create` (unique, dropped at the end); its URL."""
    role = unique_role()
    with dropped_at_the_end(role) as url:
        made = invoke("sql-role", "create", role, "--database-url", plain_url())
        assert made.exit_code == 0, made.output
        yield url


@pytest.fixture
def documented_role(started: Path) -> Iterator[str]:
    """A role made by running docs/deploy.md's SQL as written; its URL."""
    role = unique_role()
    with connect_as_owner() as conn:
        owner = conn.execute("SELECT current_user").fetchone()
        assert owner is not None
        script = documented_script(role, ledger_url().database, owner[0])
    with dropped_at_the_end(role) as url:
        with connect_as_owner() as conn:
            conn.execute(script)  # no parameters: run as one simple-query script
        yield url


@pytest.fixture(params=["command", "docs"])
def any_role(request: pytest.FixtureRequest) -> str:
    """Each read-only role in turn: `sql-role create`'s, and the docs' SQL's."""
    name = "readonly_role" if request.param == "command" else "documented_role"
    return str(request.getfixturevalue(name))
