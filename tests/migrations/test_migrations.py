"""`alembic upgrade head` on an empty ledger builds exactly the models, and a ledger at
an unknown revision is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from laneway.controller import db, ledger_open
from laneway.controller.errors import LedgerRevisionError
from laneway.controller.models import Base
from tests import backends

REVISIONS = [
    rev.revision
    for rev in reversed(
        list(ScriptDirectory.from_config(ledger_open.alembic_config()).walk_revisions())
    )
]

VIEWS = {
    "v_job_current",
    "v_unknown_attempts",
    "v_lane_occupancy",
    "v_why_idle",
    "v_stage_peaks",
    "v_attempt_usage",
    "v_usage_job",
    "v_usage_stage",
    "v_usage_lane",
    "v_usage_item",
    "v_usage_run",
    "v_reused_jobs",
    "v_artifacts",
    "v_lineage",
    "v_node_low_water",
}


def test_upgrade_head_matches_models(tmp_path):
    engine = ledger_open.open_ledger(tmp_path)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []


def test_check_constraints_match_models(tmp_path):
    engine = ledger_open.open_ledger(tmp_path)
    inspector = inspect(engine)
    for table in Base.metadata.sorted_tables:
        in_db = {c["name"] for c in inspector.get_check_constraints(table.name)}
        in_models = {
            str(c.name) for c in table.constraints if c.__class__.__name__ == "CheckConstraint"
        }
        assert in_db == in_models, table.name


def test_views_exist_and_answer(tmp_path):
    engine = ledger_open.open_ledger(tmp_path)
    assert VIEWS <= set(inspect(engine).get_view_names())
    with engine.connect() as connection:
        for view in VIEWS:
            connection.execute(text(f"SELECT * FROM {view}")).all()


def test_upgrade_is_idempotent_and_records_head(tmp_path):
    ledger_open.open_ledger(tmp_path)
    engine = ledger_open.open_ledger(tmp_path)
    assert ledger_open.current_revision(engine) == ledger_open.head_revision()


def test_unknown_revision_is_refused(tmp_path):
    engine = ledger_open.open_ledger(tmp_path)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'ffff_future'"))
    with pytest.raises(LedgerRevisionError, match="ffff_future"):
        ledger_open.open_ledger(tmp_path)


@pytest.mark.sqlite_only("PRAGMAs are SQLite's; PostgreSQL has none")
def test_sqlite_pragmas(tmp_path):
    engine = ledger_open.open_ledger(tmp_path)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.BUSY_TIMEOUT_MS


@pytest.fixture
def empty_url(ledger_backend: str, tmp_path) -> Iterator[str]:
    """A database with no schema at all, on this test's backend."""
    if ledger_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.sqlite3'}"
        return
    name = backends.create_empty_database()
    try:
        yield backends.database_url(name)
    finally:
        backends.drop_database(name)


def _upgrade_to(engine, revision: str) -> None:
    config = ledger_open.alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


@pytest.mark.parametrize("start", REVISIONS[:-1])
def test_upgrade_from_every_revision_reaches_the_models(empty_url, start):
    """A ledger left at any earlier revision, holding a run, upgrades to head: the schema
    then matches the models exactly and the run is still there."""
    engine = db.make_engine(empty_url)
    try:
        _upgrade_to(engine, start)
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO runs (name, state, config_json, config_sha256, "
                    "source_hashes, runtime_dir, created_by, created_at) VALUES ('p', "
                    "'active', '{}', 'sha', '{}', '/tmp/rt', 'test', '2026-01-01 00:00:00')"
                )
            )
        ledger_open.upgrade(engine)
        assert ledger_open.current_revision(engine) == ledger_open.head_revision()
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
            names = connection.execute(text("SELECT name FROM runs")).scalars().all()
        assert names == ["p"]
    finally:
        engine.dispose()


def test_0011_recomputes_each_reuse_key_as_a_new_run_of_the_same_config_would(empty_url, tmp_path):
    """Keys became stage-scoped (version 2): migration 0011 recomputes every job's key
    from its run's frozen config and source hashes, so what succeeded stays reusable; a
    script the old run did not freeze (``b.py``) is hashed as it is now."""
    from datetime import datetime

    from sqlalchemy import update

    from laneway.controller import ledger, reuse
    from laneway.controller.ledger.tables import jobs
    from laneway.controller.pipeline import preflight
    from tests.support import make_config

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    config = make_config(
        [
            {"name": "a", "argv": ["python3", "a.py", "{item}"], "cwd": str(tmp_path)},
            {"name": "b", "needs": ["a"], "argv": ["python3", "b.py"], "cwd": str(tmp_path)},
        ],
        items=2,
        sources=[str(tmp_path / "a.py")],
    )
    reasons, hashes = preflight(config)
    assert reasons == [] and len(hashes) == 2
    engine = db.make_engine(empty_url)
    try:
        ledger_open.upgrade(engine)
        with db.transaction(db.session_factory(engine)) as session:
            ledger.create_run(
                session,
                config,
                runtime_dir=str(tmp_path),
                source_hashes={str(tmp_path / "a.py"): hashes[str(tmp_path / "a.py")]},
                actor="test",
                now=datetime(2026, 1, 1),
            )
        with engine.begin() as connection:  # as a ledger of version 1 keys left them
            connection.execute(update(jobs).values(reuse_key="version 1"))
        alembic = ledger_open.alembic_config()
        with engine.begin() as connection:
            alembic.attributes["connection"] = connection
            command.stamp(alembic, "0010")
            command.upgrade(alembic, "0011")  # 0011 alone: later revisions are in place
        with engine.connect() as connection:
            got = {
                (item, stage): key
                for item, stage, key in connection.execute(
                    text(
                        "SELECT i.key, j.stage, j.reuse_key FROM jobs j "
                        "JOIN items i ON i.id = j.item_id"
                    )
                )
            }
    finally:
        engine.dispose()
    expected = {
        (item.key, stage): key
        for item in config.items
        for stage, key in reuse.item_reuse_keys(config, item, hashes).items()
    }
    assert got == expected and len(got) == 4
