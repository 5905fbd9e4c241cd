from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import backends


@pytest.fixture(autouse=True)
def _each_backend(ledger_backend: str) -> str:
    """Every test here runs once per ledger backend (tests/conftest.py)."""
    return ledger_backend


@pytest.fixture
def without_ledger(ledger_backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """On PostgreSQL, point LANEWAY_DATABASE_URL at a database with no schema at all (the
    counterpart of a runtime dir with no ledger file); yields its name (None on SQLite)."""
    if ledger_backend == "sqlite":
        yield None
        return
    name = backends.create_empty_database()
    monkeypatch.setenv("LANEWAY_DATABASE_URL", backends.database_url(name))
    monkeypatch.delenv("LANEWAY_READONLY_DATABASE_URL", raising=False)
    try:
        yield name
    finally:
        backends.drop_database(name)


def tables_in(name: str) -> list[str]:
    """The tables of PostgreSQL database ``name`` (to show nothing was created)."""
    import psycopg

    url = backends.database_url(name).replace("+psycopg", "")
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return [row[0] for row in rows]
