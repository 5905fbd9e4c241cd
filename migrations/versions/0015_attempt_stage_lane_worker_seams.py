"""An attempt's stage and lane on its own row; the platform seams a worker uses

``attempts.stage`` and ``attempts.lane``: copied from the attempt's job when the intent is
written (they never change), so what ``laneway status`` reports per stage and lane over a
run's attempts is read from the attempts' own index, without joining every attempt to its
job. Existing rows are filled from their jobs.

``workers.seams``: what the worker found its kernel offers and chose for each platform
seam (how it waits on a child, how it names a process, the subreaper, OOM evidence, how
it starts a supervisor), recorded when it registers; ``status`` shows it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("stage", sa.String(64), nullable=True))
        batch.add_column(sa.Column("lane", sa.String(64), nullable=True))
    op.execute(
        "UPDATE attempts SET "
        "stage = (SELECT jobs.stage FROM jobs WHERE jobs.id = attempts.job_id), "
        "lane = (SELECT jobs.lane FROM jobs WHERE jobs.id = attempts.job_id)"
    )
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("seams", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("seams")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("lane")
        batch.drop_column("stage")
