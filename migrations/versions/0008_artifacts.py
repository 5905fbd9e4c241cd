"""artifacts: stage outputs hash-bound to the stages that need them

``artifacts`` records each declared output of a succeeded attempt (name, sha256, size,
the stored object's URL, the node that stored it), written by the settle;
``attempt_inputs`` records each artifact an attempt was given, written with its intent.
``v_artifacts`` lists a run's artifacts by item and stage; ``v_lineage`` answers "what
exactly did this attempt read, and who wrote it" (docs/ledger.md).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here like 0001's; a later change is a later migration.
VIEWS = {
    "v_artifacts": """
        SELECT ar.run_id, i.key AS item, ar.stage, ar.job_id, ar.attempt_id, ar.name,
               ar.sha256, ar.size_bytes, ar.location, ar.node, ar.created_at
        FROM artifacts ar
        JOIN jobs j ON j.id = ar.job_id
        JOIN items i ON i.id = j.item_id
    """,
    "v_lineage": """
        SELECT a.run_id, i.key AS item, j.stage, ai.attempt_id, ai.stage AS input_stage,
               ai.name AS input_name, ai.sha256, ai.size_bytes,
               ar.attempt_id AS producing_attempt_id, ar.run_id AS producing_run_id,
               ar.location
        FROM attempt_inputs ai
        JOIN attempts a ON a.id = ai.attempt_id
        JOIN jobs j ON j.id = a.job_id
        JOIN items i ON i.id = j.item_id
        JOIN artifacts ar ON ar.id = ai.artifact_id
    """,
}


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("node", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_artifacts_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_artifacts_job_id_jobs")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_artifacts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifacts")),
        sa.UniqueConstraint("attempt_id", "name", name=op.f("uq_artifacts_attempt_id_name")),
    )
    op.create_index("ix_artifacts_run_stage", "artifacts", ["run_id", "stage"], unique=False)
    op.create_table(
        "attempt_inputs",
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("node", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["artifact_id"], ["artifacts.id"], name=op.f("fk_attempt_inputs_artifact_id_artifacts")
        ),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_attempt_inputs_attempt_id_attempts")
        ),
        sa.PrimaryKeyConstraint("attempt_id", "artifact_id", name=op.f("pk_attempt_inputs")),
    )
    op.create_index(
        op.f("ix_attempt_inputs_artifact_id"), "attempt_inputs", ["artifact_id"], unique=False
    )
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
    op.drop_index(op.f("ix_attempt_inputs_artifact_id"), table_name="attempt_inputs")
    op.drop_table("attempt_inputs")
    op.drop_index("ix_artifacts_run_stage", table_name="artifacts")
    op.drop_table("artifacts")
