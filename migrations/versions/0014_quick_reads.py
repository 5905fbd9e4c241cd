"""Quick reads: a partial index for the reused jobs ``laneway status`` counts

``ix_jobs_reused`` ``jobs (run_id, stage, reused_from) WHERE reused_from IS NOT NULL``: a run's jobs that
took an earlier run's result, per stage, counted from the index alone. Only reused jobs have
an entry, and no job transition changes its columns, so the hot path does not maintain it.
(The status counts per state, lane and stage need no new index: ``ix_jobs_dispatch`` covers
them.)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REUSED = "reused_from IS NOT NULL"


def upgrade() -> None:
    op.create_index(
        "ix_jobs_reused",
        "jobs",
        ["run_id", "stage", "reused_from"],
        unique=False,
        sqlite_where=sa.text(REUSED),
        postgresql_where=sa.text(REUSED),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_reused", table_name="jobs")
