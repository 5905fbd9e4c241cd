"""Rate limits and priorities: a job's dispatch rank, and attempts by start time

``jobs.priority_rank``: minus its item's priority (0 for every job so far), so a claim
takes the ready jobs of a (run, lane, stage) highest priority first, FIFO among equals,
along one ascending index range. ``jobs.group_name``: its item's group in a run that
selects by yield (NULL otherwise); ``ix_jobs_dispatch`` becomes (run_id, state, lane,
stage, group_name, priority_rank, id), one range per (run, lane, stage, group).
``group_stats``: per run and group, the admissions and the measured ``by`` and ``per``
usage that the selection reads (kept by the claim and the settle).
``ix_attempts_run_intent``: the attempts of a run started within a rate limit's window
(``statements.WINDOW_ATTEMPTS``), so the count follows the window, not the run.
``ck_attempts_outcome`` admits the outcome class ``rate_limited``. On SQLite a CHECK
constraint cannot be altered in place, and copying ``attempts`` (which other tables
reference) would take as long as the ledger is large: its stored table definition is
rewritten instead, the procedure SQLite documents for a change that leaves the stored
rows as they are (https://www.sqlite.org/lang_altertable.html, "otheralter").

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


OUTCOMES = (
    "'succeeded', 'failed', 'infra_failure', 'harness_failure', 'fatal', 'timed_out', "
    "'cancelled', 'not_run'"
)
WITH_RATE_LIMITED = OUTCOMES + ", 'rate_limited'"


def _outcome_check(before: str, after: str) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        op.drop_constraint(op.f("ck_attempts_outcome"), "attempts", type_="check")
        op.create_check_constraint(
            op.f("ck_attempts_outcome"), "attempts", f"outcome IS NULL OR outcome IN ({after})"
        )
        return
    table_sql = bind.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'attempts'"
    ).scalar_one()
    old = f"outcome IN ({before})"
    if table_sql.count(old) != 1:
        raise RuntimeError(f"attempts: expected one CHECK with {old!r} in {table_sql!r}")
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar_one()
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    bind.exec_driver_sql(
        "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'attempts'",
        (table_sql.replace(old, f"outcome IN ({after})"),),
    )
    bind.exec_driver_sql(f"PRAGMA schema_version = {int(version) + 1}")
    bind.exec_driver_sql("PRAGMA writable_schema = OFF")


def upgrade() -> None:
    _outcome_check(OUTCOMES, WITH_RATE_LIMITED)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("priority_rank", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("group_name", sa.String(length=64), nullable=True))
    op.drop_index("ix_jobs_dispatch", table_name="jobs")
    op.create_index(
        "ix_jobs_dispatch",
        "jobs",
        ["run_id", "state", "lane", "stage", "group_name", "priority_rank", "id"],
        unique=False,
    )
    op.create_table(
        "group_stats",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(length=64), nullable=False),
        sa.Column("admitted", sa.Integer(), nullable=False),
        sa.Column("measured", sa.Integer(), nullable=False),
        sa.Column("by_total", sa.Float(), nullable=False),
        sa.Column("per_total", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_group_stats_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "group_name", name=op.f("pk_group_stats")),
    )
    op.create_index("ix_attempts_run_intent", "attempts", ["run_id", "intent_at"], unique=False)


def downgrade() -> None:
    op.drop_table("group_stats")
    op.drop_index("ix_attempts_run_intent", table_name="attempts")
    op.drop_index("ix_jobs_dispatch", table_name="jobs")
    op.create_index(
        "ix_jobs_dispatch", "jobs", ["run_id", "state", "lane", "stage", "id"], unique=False
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("group_name")
        batch_op.drop_column("priority_rank")
    _outcome_check(WITH_RATE_LIMITED, OUTCOMES)
