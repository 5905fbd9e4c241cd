"""Status reads a run's attempts through their own indexes, not by joining them to jobs

Three partial indexes over the columns migration 0015 put on the attempt row:

``ix_attempts_run_stage_outcome`` ``attempts (run_id, stage, outcome) WHERE outcome IS NOT
NULL``: a run's settled attempts per stage and outcome, counted from the index alone, in its
order (``queries.ATTEMPT_OUTCOMES``).

``ix_attempts_run_lane_started`` ``attempts (run_id, lane, started_at) WHERE started_at IS NOT
NULL`` and ``ix_attempts_run_lane_settled`` ``attempts (run_id, lane, settled_at) WHERE
settled_at IS NOT NULL``: each lane's newest start and newest settle, one index seek each
(``queries.LANE_ACTIVITY``).

Partial, so an intent (no start, no settle, no outcome yet) has no entry in any of them:
the claim maintains none. The spawn that records ``started_at`` adds the attempt to the
second; the settle, which sets ``outcome`` and ``settled_at`` together, adds it to the first
and the third (on PostgreSQL an update that cannot be HOT also adds a fresh entry to each
index the row is already in).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_attempts_run_stage_outcome", ["run_id", "stage", "outcome"], "outcome IS NOT NULL"),
    ("ix_attempts_run_lane_started", ["run_id", "lane", "started_at"], "started_at IS NOT NULL"),
    ("ix_attempts_run_lane_settled", ["run_id", "lane", "settled_at"], "settled_at IS NOT NULL"),
)


def upgrade() -> None:
    for name, columns, where in INDEXES:
        op.create_index(
            name,
            "attempts",
            columns,
            unique=False,
            sqlite_where=sa.text(where),
            postgresql_where=sa.text(where),
        )


def downgrade() -> None:
    for name, _columns, _where in reversed(INDEXES):
        op.drop_index(name, table_name="attempts")
