"""`alembic upgrade head` on an empty ledger builds exactly the models, and a ledger at
an unknown revision is refused."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from controller import db
from controller.errors import LedgerRevisionError
from controller.models import Base

VIEWS = {"v_job_current", "v_unknown_attempts", "v_lane_occupancy", "v_why_idle", "v_stage_peaks"}


def test_upgrade_head_matches_models(tmp_path):
    engine = db.open_ledger(tmp_path)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []


def test_check_constraints_match_models(tmp_path):
    engine = db.open_ledger(tmp_path)
    inspector = inspect(engine)
    for table in Base.metadata.sorted_tables:
        in_db = {c["name"] for c in inspector.get_check_constraints(table.name)}
        in_models = {
            str(c.name) for c in table.constraints if c.__class__.__name__ == "CheckConstraint"
        }
        assert in_db == in_models, table.name


def test_views_exist_and_answer(tmp_path):
    engine = db.open_ledger(tmp_path)
    assert VIEWS <= set(inspect(engine).get_view_names())
    with engine.connect() as connection:
        for view in VIEWS:
            connection.execute(text(f"SELECT * FROM {view}")).all()


def test_upgrade_is_idempotent_and_records_head(tmp_path):
    db.open_ledger(tmp_path)
    engine = db.open_ledger(tmp_path)
    assert db.current_revision(engine) == db.head_revision()


def test_unknown_revision_is_refused(tmp_path):
    engine = db.open_ledger(tmp_path)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'ffff_future'"))
    with pytest.raises(LedgerRevisionError, match="ffff_future"):
        db.open_ledger(tmp_path)


def test_sqlite_pragmas(tmp_path):
    engine = db.open_ledger(tmp_path)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.BUSY_TIMEOUT_MS
