from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture
def good_config(tmp_path: Path) -> Path:
    """test_cli.py's GOOD pipeline (two items on one lane) as tmp_path/good.toml."""
    from tests.integration.test_cli import GOOD

    path = tmp_path / "good.toml"
    path.write_text(GOOD)
    return path


@pytest.fixture
def started(good_config: Path, tmp_path: Path) -> Path:
    """tmp_path/rt holding one run of ``good_config``, started with `start-pipeline
    --no-controller` (so nothing runs it)."""
    from tests.integration.test_cli import invoke

    runtime = tmp_path / "rt"
    result = invoke(
        "start-pipeline", str(good_config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert result.exit_code == 0, result.output
    return runtime


def tables_in(name: str) -> list[str]:
    """The tables of PostgreSQL database ``name`` (to show nothing was created)."""
    import psycopg

    url = backends.database_url(name).replace("+psycopg", "")
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return [row[0] for row in rows]
