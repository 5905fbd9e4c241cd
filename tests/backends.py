"""The two ledger backends the suite runs on.

Every test that opens a ledger runs on SQLite; when ``LANEWAY_TEST_POSTGRES_URL`` names a
PostgreSQL server (``.ci/run`` sets it), it runs a second time on PostgreSQL, in a
database of its own cloned from one migrated template (a clone costs tens of
milliseconds; migrating each would cost a second).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

POSTGRES_URL = os.environ.get("LANEWAY_TEST_POSTGRES_URL", "")
_counter = itertools.count()
_template: str | None = None


def backends() -> list[str]:
    return ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]


def database_url(name: str) -> str:
    """``LANEWAY_TEST_POSTGRES_URL`` with its database replaced by ``name``."""
    from sqlalchemy.engine import make_url

    url = make_url(POSTGRES_URL).set(database=name)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


@contextmanager
def admin() -> Iterator[Any]:
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(POSTGRES_URL).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as conn:
        yield conn


def template() -> str:
    """The name of this session's template database, migrated to head (made once)."""
    global _template
    if _template is None:
        from laneway.controller import db, ledger_open

        name = f"lw_tpl_{os.getpid()}"
        with admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
            conn.execute(f"DROP ROLE IF EXISTS {reader()}")
            conn.execute(f"CREATE ROLE {reader()} LOGIN")
        engine = db.make_engine(database_url(name))
        ledger_open.upgrade(engine)
        engine.dispose()
        # The read-only role `laneway sql` connects as (docs/deploy.md); a clone of the
        # template carries the grants.
        with admin_on(name) as conn:
            conn.execute(f"GRANT USAGE ON SCHEMA public TO {reader()}")
            conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {reader()}")
        _template = name
    return _template


def reader() -> str:
    return f"lw_reader_{os.getpid()}"


def reader_url(name: str) -> str:
    """The URL of database ``name`` as the read-only role."""
    from sqlalchemy.engine import make_url

    return (
        make_url(database_url(name))
        .set(username=reader(), password=None)
        .render_as_string(hide_password=False)
    )


@contextmanager
def admin_on(name: str) -> Iterator[Any]:
    """A superuser connection to database ``name``."""
    import psycopg

    url = database_url(name).replace("+psycopg", "")
    with psycopg.connect(url, autocommit=True) as conn:
        yield conn


def create_database() -> str:
    """A fresh ledger database at head; returns its name."""
    name = f"lw_t_{os.getpid()}_{next(_counter)}"
    with admin() as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template()}")
    return name


def create_empty_database() -> str:
    """A fresh database with no schema at all (for migration tests)."""
    name = f"lw_e_{os.getpid()}_{next(_counter)}"
    with admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return name


def drop_database(name: str) -> None:
    with admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def drop_template() -> None:
    global _template
    if _template is not None:
        drop_database(_template)
        _template = None
        with admin() as conn:
            conn.execute(f"DROP ROLE IF EXISTS {reader()}")
