"""GPUs as devices: the devices an attempt was given, and a node's configured count

``attempts.gpu_devices``: the GPUs admission gave the attempt (``[{"index": 0, "uuid":
"GPU-…", "whole": true}]``), null for an attempt that asked for none, or that was
admitted before this revision. ``nodes.gpu_devices``: how many devices of
``gpu_total_mib`` each the config says the node has (null: one, as before).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_devices", sa.JSON(), nullable=True))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_devices", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("gpu_devices")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("gpu_devices")
