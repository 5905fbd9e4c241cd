"""Engines, sessions and schema revision checks.

This module is the one marked seam for dialect-specific SQL: SQLite needs PRAGMAs and
``BEGIN IMMEDIATE`` so that a write transaction takes the write lock up front instead of
failing half-way with "database is locked" when it upgrades from a read. Everything
else in laneway speaks dialect-neutral SQLAlchemy.
"""

from __future__ import annotations

import fcntl
import os
import re
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller import durable
from controller.errors import LedgerRevisionError, UsageError

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import Connection, Engine
    from sqlalchemy.orm import Session, sessionmaker

# SQLAlchemy and alembic are imported where they are used: a read-only command on a
# SQLite ledger (`laneway status`, `sql`) needs neither, and importing them costs most of
# its run time (tests/integration/test_cli_imports.py).

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
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

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
    from sqlalchemy import event

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
    from sqlalchemy.orm import sessionmaker

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
        fd = _lock_fds[key] = os.open(path, os.O_RDWR | os.O_CREAT, durable.modes()[0])
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def alembic_config() -> Config:
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR.parent / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/ has no revisions"
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy.exc import DatabaseError

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
    from alembic.script import ScriptDirectory

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
    from alembic import command

    check_revision(engine)
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def open_ledger(runtime_dir: str | os.PathLike[str], *, migrate: bool = True) -> Engine:
    """The engine every laneway process uses: create the runtime dir, migrate to head."""
    url = ledger_url(runtime_dir)
    try:
        # Owner-only unless LANEWAY_GROUP_READABLE (docs/security.md): the runtime dir
        # and the ledger file (SQLite gives its -wal and -shm files the ledger's mode).
        durable.make_private_dir(runtime_dir)
        if url == f"sqlite:///{Path(runtime_dir).resolve() / LEDGER_FILENAME}":
            durable.open_private(Path(runtime_dir).resolve() / LEDGER_FILENAME, "ab").close()
    except OSError as exc:
        raise UsageError(
            f"--runtime-dir {runtime_dir}: cannot create it ({exc.strerror or exc}); "
            "pass a directory laneway can write"
        ) from None
    engine = make_engine(url)
    if migrate:
        upgrade(engine)
    else:
        check_revision(engine)
    return engine


# ----------------------------------------------------------------- existing ledgers

_REVISION_LINE = re.compile(
    r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(?:['\"]([^'\"]+)['\"]|None)", re.MULTILINE
)


def known_revisions() -> tuple[list[str], str | None]:
    """Every revision id in ``migrations/versions`` and the head, read from the files'
    ``revision = "..."`` lines without importing alembic (the test checks it agrees with
    alembic's ScriptDirectory)."""
    down: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        found = dict((m.group(1), m.group(2)) for m in _REVISION_LINE.finditer(path.read_text()))
        if found.get("revision"):
            down[found["revision"]] = found.get("down_revision")
    parents = {parent for parent in down.values() if parent}
    heads = [revision for revision in down if revision not in parents]
    return list(down), (heads[0] if len(heads) == 1 else None)


def refuse_unknown_revision(revision: str | None, where: str) -> None:
    """A read-only open's revision check: the ledger must carry a revision this build
    knows (an unknown one is newer than us)."""
    if revision is None:
        raise LedgerRevisionError(f"{where} is not a laneway ledger (it has no schema revision)")
    known, head = known_revisions()
    if revision not in known:
        raise LedgerRevisionError(
            f"ledger is at schema revision {revision!r}, which this laneway does not know "
            f"(it knows up to {head!r}); upgrade laneway to open it"
        )


def check_known_revision(engine: Engine, *, head: bool = False) -> None:
    """``check_revision`` for read-only engines, without alembic: the ledger's
    ``alembic_version`` must name a revision in ``known_revisions()`` (with ``head``: the
    newest, as the ORM models need; a read-only open cannot migrate)."""
    from sqlalchemy.exc import SQLAlchemyError

    where = engine.url.database or engine.url.render_as_string(hide_password=True)
    where = where.removeprefix("file:")  # a read-only SQLite engine opens a file: URI
    try:
        with engine.connect() as connection:
            found = connection.exec_driver_sql("SELECT version_num FROM alembic_version").all()
    except SQLAlchemyError as exc:
        raise LedgerRevisionError(
            f"{where} is not a laneway ledger ({_first_line(getattr(exc, 'orig', None) or exc)})"
        ) from None
    revision = str(found[0][0]) if found else None
    refuse_unknown_revision(revision, where)
    newest = known_revisions()[1]
    if head and revision != newest:
        raise LedgerRevisionError(
            f"{where} is at schema revision {revision!r}, older than this laneway's "
            f"{newest!r}; a command that writes (`laneway controller`, `worker`, `run`, "
            "`start-pipeline`) migrates it, or read it with `laneway status` or `sql`"
        )


def missing_ledger(runtime_dir: str | os.PathLike[str]) -> UsageError:
    path = Path(runtime_dir) / LEDGER_FILENAME
    return UsageError(
        f"--runtime-dir {runtime_dir}: no ledger at {path}; `laneway start-pipeline` or "
        "`laneway run` creates one (check the path, or set LANEWAY_RUNTIME_DIR)"
    )


def existing_ledger_url(runtime_dir: str | os.PathLike[str]) -> str:
    """The ledger URL of ``runtime_dir``, refusing a SQLite runtime dir with no ledger
    (only ``start-pipeline`` and ``run`` create one)."""
    url = ledger_url(runtime_dir)
    if url.startswith("sqlite") and not (Path(runtime_dir) / LEDGER_FILENAME).is_file():
        raise missing_ledger(runtime_dir)
    return url


def open_existing_ledger(runtime_dir: str | os.PathLike[str]) -> Engine:
    """``open_ledger`` for services (controller, worker) and commands that write: the
    ledger must exist already; it is migrated to head like ``open_ledger`` does."""
    url = existing_ledger_url(runtime_dir)
    engine = make_engine(url)
    revision = _stored_revision(engine)
    if revision is None:
        engine.dispose()
        raise missing_ledger(runtime_dir)
    if revision != known_revisions()[1]:
        # Alembic only when there is something to migrate (or refuse): a service on a
        # ledger at head never imports it (it costs start time and about 10 MiB).
        upgrade(engine)
    return engine


def _stored_revision(engine: Engine) -> str | None:
    """The ledger's ``alembic_version``, read with one plain query (None: no ledger)."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with engine.connect() as connection:
            found = connection.exec_driver_sql("SELECT version_num FROM alembic_version").all()
    except SQLAlchemyError:
        return current_revision(engine)  # alembic's check says precisely what is wrong
    return str(found[0][0]) if found else None


_READ_PRAGMAS = frozenset(
    {
        "table_info",
        "table_xinfo",
        "table_list",
        "index_list",
        "index_info",
        "index_xinfo",
        "foreign_key_list",
        "database_list",
        "collation_list",
        "function_list",
        "pragma_list",
        "compile_options",
    }
)
_REFUSED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})
_ACTION_WORDS = {
    sqlite3.SQLITE_ATTACH: "ATTACH (and VACUUM, which attaches its target)",
    sqlite3.SQLITE_DETACH: "DETACH",
    sqlite3.SQLITE_INSERT: "INSERT",
    sqlite3.SQLITE_UPDATE: "UPDATE",
    sqlite3.SQLITE_DELETE: "DELETE",
}


class ReadOnlyLedger:
    """A read-only connection to an existing ledger, for commands that only read.

    On SQLite it is the stdlib ``sqlite3`` (no SQLAlchemy import): the file opened with
    ``mode=ro``, ``PRAGMA query_only = ON``, and an authorizer that allows reads only
    (SELECT, reading columns, functions other than ``load_extension``, the read-only
    PRAGMAs in ``_READ_PRAGMAS``); ATTACH, DETACH, VACUUM (INTO), writing PRAGMAs and
    every write are refused before they run, so nothing is created anywhere. Elsewhere
    (PostgreSQL) every transaction is ``SET TRANSACTION READ ONLY``.
    """

    def __init__(self, runtime_dir: str | os.PathLike[str]) -> None:
        self.url = existing_ledger_url(runtime_dir)
        self.refused: str | None = None
        self._sqlite: sqlite3.Connection | None = None
        self._connection: Connection | None = None
        self._errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        if self.url.startswith("sqlite"):
            self.where = str(Path(runtime_dir).resolve() / LEDGER_FILENAME)
            self._sqlite = _open_sqlite_readonly(self.where)
            self._sqlite.set_authorizer(self._authorize)
        else:
            from sqlalchemy.engine import make_url
            from sqlalchemy.exc import SQLAlchemyError

            self._errors = (SQLAlchemyError,)
            self.where = make_url(self.url).render_as_string(hide_password=True)
            self._connection = make_engine(self.url).connect()
        try:
            with self.snapshot():
                revision = self._revision()
            refuse_unknown_revision(revision, self.where)
        except BaseException:
            self.close()
            raise

    @property
    def is_sqlite(self) -> bool:
        return self._sqlite is not None

    def _authorize(
        self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None
    ) -> int:
        allowed = (
            action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE)
            or action in (sqlite3.SQLITE_TRANSACTION, sqlite3.SQLITE_SAVEPOINT)
            or (action == sqlite3.SQLITE_FUNCTION and (arg2 or "") not in _REFUSED_FUNCTIONS)
            or (action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS)
        )
        if allowed:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            self.refused = f"PRAGMA {arg1}" + ("" if arg2 is None else f" = {arg2}")
        elif action == sqlite3.SQLITE_FUNCTION:
            self.refused = f"the function {arg2}()"
        elif action == sqlite3.SQLITE_UPDATE and (arg1 or "").startswith("sqlite_"):
            # SQLite asks this when a pragma_*() table-valued function is prepared.
            self.refused = (
                f"UPDATE of {arg1} (which pragma_*() table functions ask for: use "
                "PRAGMA table_info(...) and the like instead)"
            )
        else:
            self.refused = _ACTION_WORDS.get(action, "a statement that is not a read")
        return sqlite3.SQLITE_DENY

    def _revision(self) -> str | None:
        try:
            rows = self.rows("SELECT version_num FROM alembic_version")
        except self._errors as exc:
            raise LedgerRevisionError(
                f"{self.where} is not a laneway ledger ({_first_line(exc)})"
            ) from None
        return str(rows[0][0]) if rows else None

    @contextmanager
    def snapshot(self) -> Iterator[ReadOnlyLedger]:
        """One read transaction, so the queries inside it see one state of the ledger."""
        if self._connection is not None:
            with self._connection.begin() as transaction:
                self._connection.exec_driver_sql("SET TRANSACTION READ ONLY")
                try:
                    yield self
                finally:
                    transaction.rollback()
            return
        try:
            self.execute("BEGIN")
        except sqlite3.Error as exc:
            raise LedgerRevisionError(
                f"{self.where} is not a laneway ledger ({_first_line(exc)})"
            ) from None
        try:
            yield self
        finally:
            self.execute("ROLLBACK")

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> Any:
        if self._sqlite is not None:
            return self._sqlite.execute(sql, dict(params or {}))
        from sqlalchemy import text

        assert self._connection is not None
        if params is None:
            return self._connection.exec_driver_sql(sql)
        return self._connection.execute(text(sql), dict(params))

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Rows of a query laneway wrote (named ``:parameters``)."""
        return [tuple(row) for row in self.execute(sql, params or {}).fetchall()]

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """An operator's query (``laneway sql``): headers and rows; a refused or failing
        query raises UsageError with one line."""
        self.refused = None
        try:
            if self._sqlite is not None:
                cursor = self._sqlite.execute(sql)
                if cursor.description is None:
                    raise UsageError("the query returned no rows; `laneway sql` is for SELECTs")
                return [d[0] for d in cursor.description], [tuple(r) for r in cursor.fetchall()]
            with self.snapshot():
                result = self.execute(sql)
                if not result.returns_rows:
                    raise UsageError("the query returned no rows; `laneway sql` is for SELECTs")
                return list(result.keys()), [tuple(r) for r in result]
        except self._errors as exc:
            if self.refused is not None:
                raise UsageError(
                    f"query refused: {self.refused} is not allowed; `laneway sql` is "
                    "read-only (SELECT, and PRAGMAs that only read)"
                ) from None
            origin = getattr(exc, "orig", None) or exc
            raise UsageError(f"query refused: {_first_line(origin)}") from None

    def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
        if self._connection is not None:
            engine = self._connection.engine
            self._connection.close()
            engine.dispose()

    def __enter__(self) -> ReadOnlyLedger:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _open_sqlite_readonly(path: str) -> sqlite3.Connection:
    from urllib.parse import quote

    connection = sqlite3.connect(
        f"file:{quote(path)}?mode=ro",
        uri=True,
        timeout=BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,
        check_same_thread=False,
    )
    connection.execute("PRAGMA query_only = ON")
    return connection


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
