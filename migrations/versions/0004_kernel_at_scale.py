"""kernel at scale: per-stage measured peaks, closeout completion column, hot-path indexes

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stage_stats",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=64), nullable=False),
        sa.Column("measured", sa.Integer(), nullable=False),
        sa.Column("peak_rss_mib", sa.Float(), nullable=True),
        sa.Column("peak_gpu_mib", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_stage_stats_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "stage", name=op.f("pk_stage_stats")),
    )
    # Every (run, stage) gets its row, with what its settled attempts measured so far.
    op.execute(
        "INSERT INTO stage_stats (run_id, stage, measured, peak_rss_mib, peak_gpu_mib) "
        "SELECT j.run_id, j.stage, COUNT(COALESCE(a.peak_rss_mib, a.peak_gpu_mib)), "
        "MAX(a.peak_rss_mib), MAX(a.peak_gpu_mib) "
        "FROM jobs j LEFT JOIN attempts a ON a.job_id = j.id AND a.state = 'settled' "
        "GROUP BY j.run_id, j.stage"
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("closeout_finished_at", sa.DateTime(), nullable=True))
    op.execute(
        "UPDATE runs SET closeout_finished_at = (SELECT MIN(e.at) FROM events e "
        "WHERE e.run_id = runs.id AND e.kind = 'closeout_finished')"
    )
    op.create_index(
        "ix_jobs_dispatch", "jobs", ["run_id", "state", "lane", "stage", "id"], unique=False
    )
    op.create_index(
        "ix_attempts_run_settled", "attempts", ["run_id", "settled_at", "id"], unique=False
    )
    op.create_index("ix_leases_attempt", "leases", ["attempt_id"], unique=False)
    op.create_index("ix_leases_open", "leases", ["released_at", "expires_at"], unique=False)
    op.create_index("ix_workers_state", "workers", ["state", "node"], unique=False)
    op.create_index(
        "ix_decisions_key", "decisions", ["run_id", "lane", "stage", "id"], unique=False
    )
    op.create_index("ix_events_run_kind", "events", ["run_id", "kind", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_events_run_kind", table_name="events")
    op.drop_index("ix_decisions_key", table_name="decisions")
    op.drop_index("ix_workers_state", table_name="workers")
    op.drop_index("ix_leases_open", table_name="leases")
    op.drop_index("ix_leases_attempt", table_name="leases")
    op.drop_index("ix_jobs_dispatch", table_name="jobs")
    op.drop_index("ix_attempts_run_settled", table_name="attempts")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("closeout_finished_at")
    op.drop_table("stage_stats")
