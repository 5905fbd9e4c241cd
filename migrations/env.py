"""Alembic environment. laneway passes its own connection (config.attributes) so the
upgrade runs inside its write transaction; by hand, pass ``-x url=...``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from laneway.controller.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        transactional_ddl=True,
        compare_type=True,
    )


connection = config.attributes.get("connection")
if connection is not None:
    _configure(connection)
    context.run_migrations()
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("pass the ledger URL: alembic -x url=sqlite:///path/ledger.sqlite3 ...")
    engine = create_engine(url)
    with engine.begin() as conn:
        _configure(conn)
        context.run_migrations()
