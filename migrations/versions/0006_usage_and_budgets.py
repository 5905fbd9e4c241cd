"""usage and budgets: per-attempt usage, per-stage spend totals, reserved expected cost

``attempt_usage`` holds what each attempt reported in its result's ``usage`` (one row
per key); ``usage_totals`` keeps, per (run, stage, key), what was spent and what live
attempts hold against budgets, updated by the settle and the claim; a reservation's
``usage`` is the expected cost it holds. The views sum usage per job, stage, lane,
item and run (docs/ledger.md).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PER_ATTEMPT = """
        SELECT u.attempt_id, u.run_id, u.job_id, i.key AS item, j.lane, u.stage, a.node,
               a.number, a.state AS attempt_state, a.outcome, u.key, u.value, u.recorded_at
        FROM attempt_usage u
        JOIN attempts a ON a.id = u.attempt_id
        JOIN jobs j ON j.id = u.job_id
        JOIN items i ON i.id = j.item_id
"""

# Frozen here like 0001's; a later change is a later migration.
VIEWS = {
    "v_attempt_usage": _PER_ATTEMPT,
    "v_usage_job": """
        SELECT u.run_id, u.job_id, i.key AS item, j.lane, u.stage, u.key,
               SUM(u.value) AS total, COUNT(*) AS attempts
        FROM attempt_usage u
        JOIN jobs j ON j.id = u.job_id
        JOIN items i ON i.id = j.item_id
        GROUP BY u.run_id, u.job_id, i.key, j.lane, u.stage, u.key
    """,
    "v_usage_stage": """
        SELECT u.run_id, u.stage, u.key, SUM(u.value) AS total, COUNT(*) AS attempts
        FROM attempt_usage u
        GROUP BY u.run_id, u.stage, u.key
    """,
    "v_usage_lane": """
        SELECT u.run_id, j.lane, u.key, SUM(u.value) AS total, COUNT(*) AS attempts
        FROM attempt_usage u
        JOIN jobs j ON j.id = u.job_id
        GROUP BY u.run_id, j.lane, u.key
    """,
    "v_usage_item": """
        SELECT u.run_id, i.key AS item, u.key, SUM(u.value) AS total, COUNT(*) AS attempts
        FROM attempt_usage u
        JOIN jobs j ON j.id = u.job_id
        JOIN items i ON i.id = j.item_id
        GROUP BY u.run_id, i.key, u.key
    """,
    "v_usage_run": """
        SELECT u.run_id, u.key, SUM(u.value) AS total, COUNT(*) AS attempts
        FROM attempt_usage u
        GROUP BY u.run_id, u.key
    """,
}


def upgrade() -> None:
    op.create_table(
        "attempt_usage",
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_attempt_usage_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_attempt_usage_job_id_jobs")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_attempt_usage_run_id_runs")),
        sa.PrimaryKeyConstraint("attempt_id", "key", name=op.f("pk_attempt_usage")),
    )
    op.create_index(
        "ix_attempt_usage_window",
        "attempt_usage",
        ["run_id", "stage", "key", "attempt_id"],
        unique=False,
    )
    op.create_table(
        "usage_totals",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("spent", sa.Float(), nullable=False),
        sa.Column("reserved", sa.Float(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_usage_totals_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "stage", "key", name=op.f("pk_usage_totals")),
    )
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("usage", sa.JSON(), nullable=True))
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_column("usage")
    op.drop_table("usage_totals")
    op.drop_index("ix_attempt_usage_window", table_name="attempt_usage")
    op.drop_table("attempt_usage")
