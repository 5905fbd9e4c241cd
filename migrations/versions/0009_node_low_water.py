"""node_low_water: each node's lowest free memory while a run was active

One row per (run, node), created with the run and lowered by heartbeats, beside the
run's memory floor for that node; ``v_node_low_water`` reads it by hand
(docs/ledger.md). Runs already active when the ledger is upgraded get rows for the
nodes of their lanes.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here like 0001's; a later change is a later migration.
VIEWS = {
    "v_node_low_water": """
        SELECT lw.run_id, lw.node, lw.memory_floor_mib, lw.low_free_mib, lw.low_at,
               lw.low_free_mib - lw.memory_floor_mib AS margin_mib
        FROM node_low_water lw
    """,
}


def upgrade() -> None:
    op.create_table(
        "node_low_water",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=64), nullable=False),
        sa.Column("memory_floor_mib", sa.Integer(), nullable=False),
        sa.Column("low_free_mib", sa.Float(), nullable=True),
        sa.Column("low_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["node"], ["nodes.name"], name=op.f("fk_node_low_water_node_nodes")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_node_low_water_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("run_id", "node", name=op.f("pk_node_low_water")),
    )
    op.create_index("ix_node_low_water_node", "node_low_water", ["node", "run_id"], unique=False)
    op.execute(
        """
        INSERT INTO node_low_water (run_id, node, memory_floor_mib)
        SELECT DISTINCT l.run_id, l.node, n.memory_floor_mib
        FROM lanes l
        JOIN runs r ON r.id = l.run_id
        JOIN nodes n ON n.name = l.node
        WHERE r.state = 'active'
        """
    )
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
    op.drop_index("ix_node_low_water_node", table_name="node_low_water")
    op.drop_table("node_low_water")
