"""notifications: controllers with a heartbeat, and what was told to the operator

``controllers``: one row per serving controller, heartbeat and clean stop, so every
view (and a worker on another machine) can tell a live controller from a lost one;
``notify_cursor`` is where its notifier stopped reading the event log. ``notifications``:
one row per attention state told to the operator (unique ``key`` per occurrence), and
``notification_deliveries``: every try of every channel, failed ones too
(controller/notify.py, docs/operations.md).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here: a later change to the sets is a later migration.
ATTENTION = (
    "halt",
    "unknown_outcome",
    "budget_stop",
    "breaker_pause",
    "worker_lost",
    "controller_lost",
    "run_finished",
)
NOTIFICATION_STATES = ("pending", "delivered", "failed")


def _one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.create_table(
        "controllers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("boot_id", sa.String(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
        sa.Column("notify_cursor", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_controllers")),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "notifications",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint(_one_of("kind", ATTENTION), name=op.f("ck_notifications_kind")),
        sa.CheckConstraint(
            _one_of("state", NOTIFICATION_STATES), name=op.f("ck_notifications_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notifications")),
        sa.UniqueConstraint("key", name=op.f("uq_notifications_key")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_notifications_state", "notifications", ["state", "id"], unique=False)
    op.create_table(
        "notification_deliveries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("notification_id", sa.Integer(), nullable=False),
        sa.Column("channel", sa.String(length=16), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["notification_id"],
            ["notifications.id"],
            name=op.f("fk_notification_deliveries_notification_id_notifications"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification_deliveries")),
        sqlite_autoincrement=True,
    )
    op.create_index(
        op.f("ix_notification_deliveries_notification_id"),
        "notification_deliveries",
        ["notification_id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_notification_deliveries_notification_id"), table_name="notification_deliveries"
    )
    op.drop_table("notification_deliveries")
    op.drop_index("ix_notifications_state", table_name="notifications")
    op.drop_table("notifications")
    op.drop_table("controllers")
