"""A wrong runtime dir or URL never alters another application's database: every
command refuses, changing nothing, a database that is not a laneway ledger; only
`migrate` and a run's creation create one, and only in an absent or empty database."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from laneway.controller import db, ledger_open
from tests import backends
from tests.integration.test_cli import invoke
from tests.support import make_config

pytestmark = pytest.mark.no_ledger

CONFIG = make_config().model_dump(mode="json")


def config_file(tmp_path: Path) -> Path:
    import json

    path = tmp_path / "p.json"
    path.write_text(json.dumps(CONFIG))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def foreign_sqlite(runtime: Path) -> Path:
    runtime.mkdir()
    path = runtime / db.LEDGER_FILENAME
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    connection.execute("INSERT INTO invoices VALUES (1, 9.5)")
    connection.commit()
    connection.close()
    return path


WRITES = [
    ["pause", "1", "--reason", "x"],
    ["resume", "1", "--reason", "x"],
    ["halt", "1", "--reason", "x"],
    ["retry", "1", "--reason", "x"],
    ["cancel", "1", "--reason", "x"],
    ["migrate"],
    ["start-pipeline", "CONFIG", "--no-controller"],
    ["run", "CONFIG"],
    ["status"],
    ["sql", "SELECT 1"],
    ["controller"],
    ["worker", "--node", "n1"],
]


@pytest.mark.parametrize("argv", WRITES, ids=lambda a: a[0])
def test_a_foreign_sqlite_database_is_refused_and_left_byte_for_byte(tmp_path, argv):
    runtime = tmp_path / "rt"
    path = foreign_sqlite(runtime)
    before = digest(path)
    files = sorted(p.name for p in runtime.iterdir())
    argv = [str(config_file(tmp_path)) if a == "CONFIG" else a for a in argv]
    result = invoke(*argv, "--runtime-dir", str(runtime))
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert "not a laneway ledger" in result.stderr or "no ledger" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr
    assert digest(path) == before
    assert sorted(p.name for p in runtime.iterdir()) == files  # no -wal, -shm, lock files


@pytest.mark.parametrize("argv", [["pause", "1", "--reason", "x"], ["status"], ["worker"]])
def test_an_empty_file_is_no_ledger_for_a_command_that_does_not_create_one(tmp_path, argv):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    path = runtime / db.LEDGER_FILENAME
    path.touch()
    if argv == ["worker"]:  # without the flag it waits (tests/integration/test_cli_waiting.py)
        argv = ["worker", "--node", "n1", "--exit-if-unknown"]
    result = invoke(*argv, "--runtime-dir", str(runtime))
    assert result.exit_code == 2, result.output
    assert "no ledger at" in result.stderr
    assert path.stat().st_size == 0
    assert sorted(p.name for p in runtime.iterdir()) == [db.LEDGER_FILENAME]


def test_an_empty_file_becomes_a_ledger_through_a_run_s_creation(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    (runtime / db.LEDGER_FILENAME).touch()
    result = invoke(
        "start-pipeline",
        str(config_file(tmp_path)),
        "--runtime-dir",
        str(runtime),
        "--no-controller",
    )
    assert result.exit_code == 0, result.output
    assert ledger_open.ledger_contents(db.ledger_url(runtime)) == ledger_open.LEDGER


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    path = runtime / db.LEDGER_FILENAME
    path.write_bytes(b"not sqlite at all\n" * 100)
    result = invoke("migrate", "--runtime-dir", str(runtime))
    assert result.exit_code in (1, 2) and "not a laneway ledger" in result.stderr, result.output
    assert path.read_bytes() == b"not sqlite at all\n" * 100


@pytest.fixture
def foreign_postgres(monkeypatch):
    if not backends.POSTGRES_URL:
        pytest.skip("needs LANEWAY_TEST_POSTGRES_URL")
    name = backends.create_empty_database()
    url = backends.database_url(name)
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE invoices (id int primary key, total numeric)"))
        connection.execute(text("INSERT INTO invoices VALUES (1, 9.5)"))
    monkeypatch.setenv("LANEWAY_DATABASE_URL", url)
    yield engine
    engine.dispose()
    backends.drop_database(name)


def _tables(engine) -> list[str]:
    with engine.connect() as connection:
        return sorted(
            connection.execute(
                text(
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = current_schema()"
                )
            ).scalars()
        )


@pytest.mark.parametrize(
    "argv",
    [["migrate"], ["start-pipeline", "CONFIG", "--no-controller"], ["pause", "1", "--reason", "x"]],
    ids=lambda a: a[0],
)
def test_a_foreign_postgres_database_gets_no_laneway_tables(tmp_path, foreign_postgres, argv):
    argv = [str(config_file(tmp_path)) if a == "CONFIG" else a for a in argv]
    result = invoke(*argv, "--runtime-dir", str(tmp_path / "rt"))
    assert result.exit_code in (1, 2), result.output
    assert "not a laneway ledger" in result.stderr or "no laneway ledger" in result.stderr
    assert _tables(foreign_postgres) == ["invoices"]
