"""reuse and backoff: a job's reuse key, the earlier attempt whose result it took
over, and when a retried job may be claimed again

``jobs.reuse_key`` is the sha256 of everything a job's result depends on (frozen stage
definition, item, source hashes, the reuse keys of the jobs it needs: controller/
reuse.py); ``jobs.reused_from`` names the succeeded attempt of an earlier run whose
result a reused job took over; ``jobs.retry_after`` holds a retried job back until its
stage's backoff has passed. ``v_reused_jobs`` lists reused jobs with where their
result came from (docs/ledger.md). Only nullable columns and an index: on SQLite,
ADD COLUMN, no table rebuild.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here like 0001's; a later change is a later migration.
VIEWS = {
    "v_reused_jobs": """
        SELECT j.id AS job_id, j.run_id, i.key AS item, j.lane, j.stage, j.state,
               j.reuse_key, j.reused_from AS reused_attempt_id,
               a.run_id AS reused_run_id, a.job_id AS reused_job_id,
               a.settled_at AS reused_settled_at, a.attempt_dir AS reused_attempt_dir
        FROM jobs j
        JOIN items i ON i.id = j.item_id
        LEFT JOIN attempts a ON a.id = j.reused_from
        WHERE j.reused_from IS NOT NULL
    """,
}


def upgrade() -> None:
    op.add_column("jobs", sa.Column("reuse_key", sa.String(length=64), nullable=True))
    op.add_column("jobs", sa.Column("reused_from", sa.Integer(), nullable=True))
    op.create_index(op.f("ix_jobs_reuse_key"), "jobs", ["reuse_key"], unique=False)
    op.add_column("jobs", sa.Column("retry_after", sa.DateTime(), nullable=True))
    op.create_index(op.f("ix_jobs_retry_after"), "jobs", ["retry_after"], unique=False)
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
    op.drop_index(op.f("ix_jobs_retry_after"), table_name="jobs")
    op.drop_index(op.f("ix_jobs_reuse_key"), table_name="jobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("retry_after")
        batch_op.drop_column("reused_from")
        batch_op.drop_column("reuse_key")
