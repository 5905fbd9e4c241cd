"""event notify: on PostgreSQL, a commit that appends events notifies channel "laneway"

A statement-level trigger on ``events`` calls ``pg_notify('laneway', '')``. PostgreSQL
delivers a notification only when its transaction commits and folds identical ones of
one transaction into one, so each commit that appended events wakes every listener
(controller.watch.ChangeWatch) once, with no extra round trip in the writer's
transaction. Every event is a wake-up: the transitions that make work ready or free
capacity (a run created or reopened, a job ready, an attempt settled, a control
cleared) all append one, and the controller's own loop follows every event. SQLite has
no notifications: its watch stats the ledger files; this migration does nothing there.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION laneway_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN PERFORM pg_notify('laneway', ''); RETURN NULL; END $$"
    )
    op.execute(
        "CREATE TRIGGER events_notify AFTER INSERT ON events "
        "FOR EACH STATEMENT EXECUTE FUNCTION laneway_notify_events()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER events_notify ON events")
    op.execute("DROP FUNCTION laneway_notify_events()")
