"""The two ledger backends the suite runs on.

Every test that opens a ledger runs on SQLite; when ``LANEWAY_TEST_POSTGRES_URL`` names a
PostgreSQL server (``.ci/run`` sets it), it runs a second time on PostgreSQL, in a
database of its own cloned from one migrated template (migrating each would cost more).
A clone still costs the server about 0.4 s (PostgreSQL 15 copies the template through
its WAL; 0.43 to 0.55 s with ``STRATEGY FILE_COPY``), and most tests wait on processes
meanwhile: so the next test's database is cloned in a thread of its own while this test
runs (``create_database``; ``tests/unit -k postgres`` 52 to 58 s → 30 to 36 s).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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


_cloner: ThreadPoolExecutor | None = None
_next: Future[str] | None = None
"""The database the next ``create_database`` hands out, being cloned meanwhile."""


def _clone() -> str:
    name = f"lw_t_{os.getpid()}_{next(_counter)}"
    with admin() as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template()}")
    return name


def create_database() -> str:
    """A fresh ledger database at head; returns its name. The one cloned ahead when it
    was made (a clone that failed, as while a test stopped the server, is made again
    here, where its error is the test's), and the next one is started."""
    global _cloner, _next
    name: str | None = None
    if _next is not None:
        ahead, _next = _next, None
        if ahead.exception() is None:
            name = ahead.result()
    if name is None:
        name = _clone()
    if _cloner is None:
        _cloner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clone-ahead")
    _next = _cloner.submit(_clone)
    return name


def _drop_ahead() -> None:
    """Drop the database cloned ahead and unused, and stop the cloning thread."""
    global _cloner, _next
    if _next is not None:
        ahead, _next = _next, None
        if ahead.exception() is None:
            drop_database(ahead.result())
    if _cloner is not None:
        _cloner.shutdown()
        _cloner = None


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
    _drop_ahead()
    if _template is not None:
        drop_database(_template)
        _template = None
        with admin() as conn:
            conn.execute(f"DROP ROLE IF EXISTS {reader()}")
