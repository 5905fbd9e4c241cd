"""A run records the path of the config file it was started from

``runs.config_path``: the config file's absolute path when the run was started from one
(``laneway run CONFIG``, ``laneway start-pipeline CONFIG``), so every command laneway prints
for the run (``laneway run <config> --new`` after a budget stop or changed sources) can be
run as printed. NULL for a run started from a config built in code, and for every run made
before this migration: their commands say ``CONFIG``.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("config_path", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("config_path")
