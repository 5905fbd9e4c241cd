"""measured peaks: sample columns on attempts, GPU note on nodes

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Only nullable columns added: on SQLite, ADD COLUMN, no table rebuild.
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("peak_rss_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("peak_gpu_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("current_rss_mib", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("gpu_note", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("sampled_at", sa.DateTime(), nullable=True))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_note", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("gpu_note")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        for column in ("sampled_at", "gpu_note", "current_rss_mib", "peak_gpu_at", "peak_rss_at"):
            batch_op.drop_column(column)
