"""Engines, sessions and schema revision checks.

This module is the one marked seam for dialect-specific SQL: SQLite needs PRAGMAs and
``BEGIN IMMEDIATE`` so that a write transaction takes the write lock up front instead of
failing half-way with "database is locked" when it upgrades from a read. Everything
else in laneway speaks dialect-neutral SQLAlchemy.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import Session, sessionmaker

from controller.errors import LedgerRevisionError, UsageError

LEDGER_FILENAME = "ledger.sqlite3"
BUSY_TIMEOUT_MS = 30_000
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def ledger_url(runtime_dir: str | os.PathLike[str]) -> str:
    """``LANEWAY_DATABASE_URL`` if set, else the SQLite file in the runtime dir."""
    override = os.environ.get("LANEWAY_DATABASE_URL")
    if override:
        return override
    return f"sqlite:///{Path(runtime_dir).resolve() / LEDGER_FILENAME}"


def make_engine(url: str, *, readonly: bool = False) -> Engine:
    """An engine for the ledger. On SQLite: WAL, synchronous=FULL, busy_timeout, foreign
    keys, and every transaction begun with BEGIN IMMEDIATE (read-only engines open the
    file with ``mode=ro`` and begin deferred)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    database = parsed.database or ""
    if readonly:
        engine = create_engine(
            f"sqlite:///file:{database}?mode=ro&uri=true",
            connect_args={"timeout": BUSY_TIMEOUT_MS / 1000},
        )
    else:
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
    _install_sqlite_seam(engine, readonly=readonly)
    return engine


def _install_sqlite_seam(engine: Engine, *, readonly: bool) -> None:
    # SQLAlchemy's documented recipe: stop pysqlite from issuing its own BEGIN, then
    # emit ours, so the lock mode is explicit.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


_readers: dict[str, sessionmaker[Session]] = {}


def reader(engine: Engine) -> sessionmaker[Session]:
    """Sessions for reads that must not take SQLite's write lock (polling, snapshots).

    On SQLite every transaction of ``engine`` begins IMMEDIATE; frequent polls through it
    would queue behind, and block, real writers. This opens the same file read-only.
    """
    if not is_sqlite(engine):
        return session_factory(engine)
    url = engine.url.render_as_string(hide_password=False)
    factory = _readers.get(url)
    if factory is None:
        factory = _readers[url] = session_factory(make_engine(url, readonly=True))
    return factory


@contextmanager
def transaction(factory: sessionmaker[Session], *, fair: bool = True) -> Iterator[Session]:
    """One write transaction: commit on success, roll back on any error.

    On SQLite, writers first queue on an flock of ``<ledger>.writelock`` (``fair``):
    SQLite's own busy handler sleeps and retries, so under contention a writer can lose
    the race again and again and wait for seconds; blocked in flock, waiters are woken
    the moment the lock is free (bench/bench_contention.py measures both).
    """
    with _write_lock(factory.kw.get("bind") if fair else None):
        with factory() as session, session.begin():
            yield session


_lock_fds: dict[tuple[int, str], int] = {}


@contextmanager
def _write_lock(engine: Engine | None) -> Iterator[None]:
    if engine is None or not is_sqlite(engine) or not engine.url.database:
        yield
        return
    path = engine.url.database + ".writelock"
    key = (os.getpid(), path)  # flock belongs to an open file: never share one across fork
    fd = _lock_fds.get(key)
    if fd is None:
        fd = _lock_fds[key] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def alembic_config() -> Config:
    config = Config(str(MIGRATIONS_DIR.parent / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/ has no revisions"
    return head


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    except DatabaseError as exc:
        raise LedgerRevisionError(
            f"{engine.url.database or engine.url} is not a laneway ledger "
            f"({str(exc.orig or exc).splitlines()[0]})"
        ) from None


def check_revision(engine: Engine) -> None:
    """Refuse a ledger whose revision this build does not know (it is newer than us)."""
    revision = current_revision(engine)
    if revision is None:
        return
    script = ScriptDirectory.from_config(alembic_config())
    known = {rev.revision for rev in script.walk_revisions()}
    if revision not in known:
        raise LedgerRevisionError(
            f"ledger is at schema revision {revision!r}, which this laneway does not know "
            f"(it knows up to {script.get_current_head()!r}); upgrade laneway to open it"
        )


def upgrade(engine: Engine) -> None:
    """``alembic upgrade head`` inside one write transaction (so two processes starting
    at once serialise on it), after refusing an unknown revision."""
    check_revision(engine)
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def open_ledger(runtime_dir: str | os.PathLike[str], *, migrate: bool = True) -> Engine:
    """The engine every laneway process uses: create the runtime dir, migrate to head."""
    try:
        Path(runtime_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"--runtime-dir {runtime_dir}: cannot create it ({exc.strerror or exc}); "
            "pass a directory laneway can write"
        ) from None
    engine = make_engine(ledger_url(runtime_dir))
    if migrate:
        upgrade(engine)
    else:
        check_revision(engine)
    return engine
