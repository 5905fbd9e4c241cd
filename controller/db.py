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
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from controller import durable
from controller.errors import (
    CommitOutcomeUnknown,
    LedgerRevisionError,
    LedgerUnavailable,
    UsageError,
)

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import URL, Connection, Engine
    from sqlalchemy.orm import Session, sessionmaker

    from controller.clock import Clock

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
        problem = url_problem(override)
        if problem:
            raise UsageError(f"LANEWAY_DATABASE_URL: {problem}")
        return override
    try:
        return f"sqlite:///{Path(runtime_dir).resolve() / LEDGER_FILENAME}"
    except RuntimeError as exc:  # a symlink loop
        raise UsageError(f"--runtime-dir {runtime_dir}: {exc}; pass a directory") from None


def url_problem(url: str) -> str | None:
    """What is wrong with a ledger URL, in words (None: nothing laneway can see without
    connecting). Parsed with the standard library, so a quick read-only command does
    not import SQLAlchemy for it; never echoes the URL (it may hold a password)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (it parses the port, raising on a bad one)
    except ValueError as exc:
        return (
            f"the URL does not parse ({exc}); use postgresql://USER@HOST[:PORT]/DATABASE "
            "or sqlite:///PATH"
        )
    backend = parts.scheme.split("+", 1)[0]
    if backend not in ("postgresql", "sqlite"):
        return (
            f"{backend or 'no scheme'!r} is not a ledger backend; use "
            "postgresql://USER@HOST/DATABASE or sqlite:///PATH"
        )
    return None


def is_sqlite_url(url: str) -> bool:
    return url.startswith("sqlite")


def make_engine(url: str, *, readonly: bool = False) -> Engine:
    """An engine for the ledger. On SQLite: WAL, synchronous=FULL, busy_timeout, foreign
    keys, and every transaction begun with BEGIN IMMEDIATE (read-only engines open the
    file with ``mode=ro`` and begin deferred)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return _postgres_engine(parsed, readonly=readonly)
    if parsed.get_backend_name() != "sqlite":
        raise UsageError(
            f"LANEWAY_DATABASE_URL: {parsed.get_backend_name()!r} is not a ledger backend; "
            "use sqlite:///PATH or postgresql://USER@HOST/DATABASE"
        )
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


WRITE_LOCK_KEY = 0x6C616E65  # "lane": the PostgreSQL advisory lock every write holds
IDLE_IN_TRANSACTION_MS = 60_000


def _postgres_engine(url: URL, *, readonly: bool) -> Engine:
    """PostgreSQL through psycopg 3 (``postgresql://`` means psycopg, not psycopg2).
    Sessions run in UTC (ledger timestamps are naive UTC), and a session left idle inside
    a transaction (a worker stopped with SIGSTOP while it held the write lock) is ended
    by the server after ``IDLE_IN_TRANSACTION_MS``, so it cannot block every writer."""
    from sqlalchemy import create_engine

    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise UsageError(
            "LANEWAY_DATABASE_URL names PostgreSQL, but its driver is not installed; "
            "install it with: pip install 'laneway[postgres]'"
        ) from None
    options = f"-c timezone=UTC -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}"
    return create_engine(
        url,
        pool_pre_ping=True,
        connect_args={
            "application_name": "laneway-readonly" if readonly else "laneway",
            "options": options,
            "connect_timeout": 10,
        },
    )


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

    On PostgreSQL every write transaction first takes one transaction-scoped advisory
    lock (``WRITE_LOCK_KEY``), so writers are serialised exactly as SQLite's one write
    lock serialises them: admission decides caps that span nodes (a lane on two
    machines) from a snapshot no other claim can change under it, and event ids commit
    in the order they were drawn, so the controller's event cursor never skips one.
    Reads take no lock. docs/deploy.md says what this costs (claims/s).
    """
    engine = factory.kw.get("bind")
    asked = time.monotonic()
    with _write_lock(engine if fair else None), factory() as session:
        session.begin()
        try:
            if engine is not None and not is_sqlite(engine):
                # One round trip: the lock, then the server's clock read once it is held.
                from sqlalchemy import text

                session.info[LEDGER_NOW] = session.execute(text(_LOCK_THEN_NOW)).scalar_one()
            session.info[LOCK_WAIT] = time.monotonic() - asked
            yield session
        except BaseException:
            session.rollback()
            raise
        try:
            session.commit()
        except Exception as exc:
            if is_transient(exc):
                raise CommitOutcomeUnknown(
                    f"the ledger connection failed while a transaction was committing "
                    f"({_first_line(getattr(exc, 'orig', None) or exc)}); it may or may not "
                    "have been recorded: look with `laneway status` before repeating it"
                ) from exc
            raise


# PostgreSQL SQLSTATE classes after which the transaction is known to be rolled back and
# a new connection may succeed: 08 connection exception, 40 transaction rollback
# (serialization failure, deadlock), 57 operator intervention (admin shutdown,
# "cannot connect now" while the server starts), and 25006 (read-only transaction: a
# failover left us on a standby).
_TRANSIENT_SQLSTATE_CLASSES = ("08", "40", "57")
_TRANSIENT_SQLSTATES = ("25006",)
_SQLITE_BUSY = ("database is locked", "database is busy", "database table is locked")


def is_transient(error: BaseException) -> bool:
    """Did the ledger fail in a way a later try may not (a dropped connection, a server
    restarting or failing over, SQLite busy past its timeout)? Such a failure rolled the
    transaction back; a failure during COMMIT is ``CommitOutcomeUnknown`` instead, and is
    never transient."""
    from sqlalchemy.exc import DBAPIError

    if isinstance(error, CommitOutcomeUnknown):
        return False
    if not isinstance(error, DBAPIError):
        return False
    if error.connection_invalidated:
        return True
    origin = error.orig
    sqlstate = getattr(origin, "sqlstate", None)
    if sqlstate:
        return sqlstate[:2] in _TRANSIENT_SQLSTATE_CLASSES or sqlstate in _TRANSIENT_SQLSTATES
    if isinstance(origin, sqlite3.OperationalError):
        return any(phrase in str(origin) for phrase in _SQLITE_BUSY)
    # psycopg raises OperationalError without a SQLSTATE when it cannot connect at all.
    return type(origin).__name__ == "OperationalError" and type(origin).__module__.startswith(
        "psycopg"
    )


def describe(error: BaseException) -> str:
    """One line for a ledger error (no SQL text, no parameters, no password)."""
    return _first_line(getattr(error, "orig", None) or error)


def retrying(*, patience: float = 30.0) -> Any:
    """tenacity's retry loop for one-shot commands: a transient failure (``is_transient``)
    is retried with exponential backoff and jitter for up to ``patience`` seconds, then
    becomes ``LedgerUnavailable``; any other error propagates at once. Use as::

        for attempt in db.retrying():
            with attempt, db.transaction(factory) as session:
                ...
    """
    from tenacity import Retrying, retry_if_exception, stop_after_delay

    def give_up(state: Any) -> None:
        error = state.outcome.exception()
        raise LedgerUnavailable(
            f"the ledger stayed unreachable for {patience:.0f} s ({describe(error)}); "
            "nothing was written: check the database (and --database-url), then repeat"
        ) from error

    return Retrying(
        retry=retry_if_exception(is_transient),
        wait=_backoff(most=2.0),
        stop=stop_after_delay(patience),
        retry_error_callback=give_up,
    )


def backoff_wait() -> Callable[[int], float]:
    """Seconds to wait before try ``n`` (1, 2, ...) of a service loop whose ledger is
    failing: tenacity's exponential backoff with jitter, at most 5 s."""
    from tenacity import RetryCallState

    wait = _backoff(most=5.0)

    def seconds(attempt_number: int) -> float:
        return float(wait(cast("RetryCallState", _RetryState(attempt_number))))

    return seconds


class Outage:
    """A service loop's record of the ledger not answering: the worker's, the
    controller's and ``laneway run``'s loops share it. ``failed(exc)`` says whether a
    failure is one to ride out (``is_transient``, a commit whose outcome is unknown, or
    ``LedgerUnavailable``: the server could not be reached)
    and how long to wait before the next try (tenacity's backoff with jitter), calling
    ``on_error`` with the first one's words; ``back()`` calls ``on_back`` with the
    number of failed tries once the ledger answers again."""

    def __init__(self) -> None:
        self.failures = 0
        self.last_error: str | None = None
        self._wait = backoff_wait()

    def failed(
        self, error: BaseException, on_error: Callable[[str], None] | None = None
    ) -> float | None:
        """Seconds to wait before trying again, or None: not a failure to ride out."""
        if not (
            is_transient(error) or isinstance(error, (CommitOutcomeUnknown, LedgerUnavailable))
        ):
            return None
        self.failures += 1
        self.last_error = describe(error)
        if self.failures == 1 and on_error is not None:
            on_error(self.last_error)
        return self._wait(self.failures)

    def back(self, on_back: Callable[[int], None] | None = None) -> None:
        if self.failures and on_back is not None:
            on_back(self.failures)
        self.failures = 0


def _backoff(*, most: float) -> Any:
    """0.05 s, doubling up to ``most``, plus up to 50 ms of jitter (so workers that lost
    the ledger together do not all come back in the same millisecond)."""
    from tenacity import wait_exponential, wait_random

    return wait_exponential(multiplier=0.05, max=most) + wait_random(0, 0.05)


class _RetryState:
    """The one field tenacity's wait strategies read from a retry state."""

    def __init__(self, attempt_number: int) -> None:
        self.attempt_number = attempt_number


LEDGER_NOW = "laneway_ledger_now"
LOCK_WAIT = "laneway_lock_wait"


def lock_wait(session: Session) -> float:
    """Seconds the write transaction ``session`` waited for the ledger's write lock
    (0 outside ``transaction``). A long wait means every other writer, a worker's
    heartbeat among them, was held up as long: the controller judges no heartbeat
    against that time (``controller.daemon``)."""
    return float(session.info.get(LOCK_WAIT, 0.0))


_LOCK_THEN_NOW = (
    "SELECT timezone('UTC', clock_timestamp()) "
    f"FROM (SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})) AS locked"
)


def ledger_now(session: Session, clock: Clock) -> datetime:
    """The time for lease expiries, heartbeats and "worker lost" judgements.

    On SQLite it is ``clock``'s (every writer runs on the one host that holds the file).
    On PostgreSQL it is the server's clock, read inside the transaction (a write
    transaction reads it with its lock, so this costs no round trip), so a node whose
    clock is minutes off neither expires a lease early nor keeps a zombie one alive.
    """
    bind = session.get_bind()
    if bind.dialect.name == "sqlite":
        return clock.now()
    found = session.info.get(LEDGER_NOW)
    if found is None:
        from sqlalchemy import text

        found = session.execute(text("SELECT timezone('UTC', clock_timestamp())")).scalar_one()
        session.info[LEDGER_NOW] = found
    assert isinstance(found, datetime)
    return found


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
        try:
            fd = _lock_fds[key] = os.open(path, os.O_RDWR | os.O_CREAT, durable.modes()[0])
        except OSError as exc:
            raise UsageError(
                f"{path}: cannot open the ledger's write lock ({exc.strerror or exc}); "
                "a command that writes needs a runtime dir it can write (read-only "
                "commands such as status and sql do not)"
            ) from None
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
        if is_transient(exc):
            raise unreachable(engine, exc) from None
        raise LedgerRevisionError(
            f"{engine.url.database or engine.url} is not a laneway ledger "
            f"({str(exc.orig or exc).splitlines()[0]})"
        ) from None


def unreachable(engine: Engine, error: BaseException) -> LedgerUnavailable:
    """The one line for a ledger that cannot be reached (its URL shown without password)."""
    where = shown_url(engine.url.render_as_string(hide_password=False))
    return LedgerUnavailable(
        f"cannot reach the ledger at {where} ({describe(error)}); check that the database "
        "server runs and the URL (--database-url / LANEWAY_DATABASE_URL)"
    )


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
    """The engine for a command that may create the ledger (``migrate``, a run's
    creation): create the runtime dir and, in an absent or empty database only, the
    ledger; migrate to head. A database that holds another application's tables is
    refused, unchanged (``ledger_contents``)."""
    url = ledger_url(runtime_dir)
    try:
        # Owner-only unless LANEWAY_GROUP_READABLE (docs/security.md): the runtime dir
        # and the ledger file (SQLite gives its -wal and -shm files the ledger's mode).
        durable.make_private_dir(runtime_dir)
    except OSError as exc:
        raise UsageError(
            f"--runtime-dir {runtime_dir}: cannot create it ({exc.strerror or exc}); "
            "pass a directory laneway can write"
        ) from None
    if ledger_contents(url) == ABSENT:
        _create_ledger_file(sqlite_path(url), runtime_dir)
    engine = make_engine(url)
    if migrate:
        upgrade(engine)
    else:
        check_revision(engine)
    return engine


# ----------------------------------------------------------------- existing ledgers

ABSENT, EMPTY, LEDGER = "absent", "empty", "ledger"


def ledger_contents(url: str) -> str:
    """What the database at ``url`` holds, looked at without changing it: ``ABSENT`` (no
    SQLite file), ``EMPTY`` (a file or database without tables) or ``LEDGER`` (it has
    laneway's ``alembic_version``). Anything else is another application's database:
    ``LedgerRevisionError``, and nothing is written to it (a write engine would already
    switch a SQLite file to WAL).

    A SQLite file is only ever opened through SQLite, here read-only: opening and
    closing any descriptor of it by name in a process that holds a connection to it
    would drop that connection's POSIX locks (they belong to the process and the
    file), and another process closing its last connection would then delete the WAL
    with this one's commits in it (``tests/integration/test_ledger_processes.py``)."""
    from urllib.parse import quote

    if not is_sqlite_url(url):
        return _postgres_contents(url)
    path = sqlite_path(url)
    if not path or not os.path.lexists(path):
        return ABSENT
    if not Path(path).is_file():
        raise LedgerRevisionError(
            f"{path} is not a laneway ledger (not a regular file); pass the runtime dir "
            "of a laneway ledger"
        )
    try:
        connection = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True)
        try:
            names = [row[0] for row in connection.execute("SELECT name FROM sqlite_master")]
        finally:
            connection.close()
    except sqlite3.Error as exc:
        if isinstance(exc, sqlite3.OperationalError) and "unable to open" in str(exc):
            # A WAL ledger needs its -shm index, created beside it on first open.
            writable = os.access(os.path.dirname(path) or ".", os.W_OK)
            raise UsageError(
                f"{path}: cannot open it ({_first_line(exc)})"
                + ("" if writable else "; its directory is not writable (read-only?)")
                + ": laneway needs a runtime dir it can write"
            ) from None
        raise LedgerRevisionError(
            f"{path} is not a laneway ledger ({_first_line(exc)}); nothing was changed"
        ) from None
    return _judge_tables(names, path)


def _postgres_contents(url: str) -> str:
    from sqlalchemy.exc import SQLAlchemyError

    engine = make_engine(url, readonly=True)
    try:
        with engine.connect() as connection:
            names = [
                str(row[0])
                for row in connection.exec_driver_sql(
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = current_schema()"
                )
            ]
    except SQLAlchemyError as exc:
        if is_transient(exc):
            raise unreachable(engine, exc) from None
        raise
    finally:
        engine.dispose()
    return _judge_tables(names, shown_url(url))


def _judge_tables(names: list[str], where: str) -> str:
    if "alembic_version" in names:
        return LEDGER
    if not names:
        return EMPTY
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    raise LedgerRevisionError(
        f"{where} is not a laneway ledger: it holds another application's tables "
        f"({shown}); nothing was changed. Pass the runtime dir (or --database-url) of a "
        "laneway ledger, or an empty one"
    )


def _create_ledger_file(path: str, runtime_dir: str | os.PathLike[str]) -> None:
    """Create an absent SQLite ledger file, owner-only (or group-readable, per
    ``durable.modes``). ``O_EXCL``: an existing file is never opened by name here (see
    ``ledger_contents``); one another process created meanwhile is left as it is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, durable.modes()[0])
    except FileExistsError:
        return
    except OSError as exc:
        raise UsageError(
            f"--runtime-dir {runtime_dir}: cannot create the ledger there "
            f"({exc.strerror or exc}); pass a directory laneway can write"
        ) from None
    os.close(fd)  # a new file: no connection of this process can hold a lock on it


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
        if is_transient(exc):
            raise unreachable(engine, exc) from None
        if _no_version_table(exc):
            raise missing_ledger(None, engine.url.render_as_string(hide_password=False)) from None
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


def missing_ledger(
    runtime_dir: str | os.PathLike[str] | None, url: str | None = None
) -> UsageError:
    """The one-line refusal for a ledger that does not exist (yet)."""
    url = url or ledger_url(runtime_dir or ".")
    if not is_sqlite_url(url):
        return UsageError(
            f"{shown_url(url)}: the database holds no laneway ledger; `laneway "
            "start-pipeline` or `laneway run` creates one (check --database-url or "
            "LANEWAY_DATABASE_URL)"
        )
    path = sqlite_path(url) or Path(runtime_dir or ".") / LEDGER_FILENAME
    if os.environ.get("LANEWAY_DATABASE_URL"):
        return UsageError(
            f"LANEWAY_DATABASE_URL: no ledger at {path}; `laneway start-pipeline` or "
            "`laneway run` creates one (check the URL)"
        )
    return UsageError(
        f"--runtime-dir {runtime_dir}: no ledger at {path}; `laneway start-pipeline` or "
        "`laneway run` creates one (check the path, or set LANEWAY_RUNTIME_DIR)"
    )


def shown_url(url: str) -> str:
    """A ledger URL as laneway prints it: never with its password."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)


def _no_version_table(error: BaseException) -> bool:
    """PostgreSQL said there is no ``alembic_version``: an empty database, not a ledger."""
    origin = getattr(error, "orig", None) or error
    return type(origin).__name__ == "UndefinedTable" and "alembic_version" in str(origin)


def open_writer(runtime_dir: str | os.PathLike[str]) -> Engine:
    """An engine for an operator's write (controls, cancel, reconcile, retry) on an
    existing ledger: nothing is created or migrated, an unknown revision is refused,
    and a database that is not a laneway ledger is refused before anything connects to
    it for writing."""
    url = existing_ledger_url(runtime_dir)
    engine = make_engine(url)
    if _stored_revision(engine) is None:
        engine.dispose()
        raise missing_ledger(runtime_dir)
    check_revision(engine)
    return engine


def existing_ledger_url(runtime_dir: str | os.PathLike[str]) -> str:
    """The ledger URL of ``runtime_dir``, refusing a SQLite runtime dir with no ledger
    (only ``start-pipeline`` and ``run`` create one)."""
    url = ledger_url(runtime_dir)
    # On PostgreSQL the caller's revision check says "no ledger" (one connection less).
    if is_sqlite_url(url) and ledger_contents(url) != LEDGER:
        raise missing_ledger(runtime_dir)
    return url


def sqlite_path(url: str) -> str:
    """The file a ``sqlite:///PATH`` URL names."""
    return url.split("///", 1)[1].split("?", 1)[0] if "///" in url else ""


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


QUERY_TIMEOUT_S = 30.0  # `laneway sql --timeout`: a runaway query stops after this


class ReadOnlyLedger:
    """A read-only connection to an existing ledger, for commands that only read.

    On SQLite it is the stdlib ``sqlite3`` (no SQLAlchemy import): the file opened with
    ``mode=ro``, ``PRAGMA query_only = ON``, and an authorizer that allows reads only
    (SELECT, reading columns, functions other than ``load_extension``, the read-only
    PRAGMAs in ``_READ_PRAGMAS``); ATTACH, DETACH, VACUUM (INTO), writing PRAGMAs and
    every write are refused before they run, so nothing is created anywhere. Elsewhere
    (PostgreSQL) every transaction is ``SET TRANSACTION READ ONLY``, and an operator's
    query goes through ``controller.sqlguard`` (role check, one statement, no COPY, a
    statement timeout). ``url`` reads another database than the runtime dir's ledger
    (``laneway sql --readonly-url``: the same ledger through a read-only role).
    """

    def __init__(self, runtime_dir: str | os.PathLike[str], *, url: str | None = None) -> None:
        self.url = url or existing_ledger_url(runtime_dir)
        self.refused: str | None = None
        self._sqlite: sqlite3.Connection | None = None
        self._connection: Connection | None = None
        self._errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        if self.url.startswith("sqlite"):
            self.where = str(Path(sqlite_path(self.url)).resolve())
            self._sqlite = _open_sqlite_readonly(self.where)
            self._sqlite.set_authorizer(self._authorize)
        else:
            from sqlalchemy.engine import make_url
            from sqlalchemy.exc import ArgumentError, SQLAlchemyError

            self._errors = (SQLAlchemyError,)
            try:
                self.where = make_url(self.url).render_as_string(hide_password=True)
            except ArgumentError:
                raise UsageError(
                    "the database URL is not one laneway reads; use postgresql://ROLE@HOST/DATABASE"
                ) from None
            engine = make_engine(self.url, readonly=True)
            try:
                self._connection = engine.connect()
            except SQLAlchemyError as exc:
                engine.dispose()
                origin = getattr(exc, "orig", None) or exc
                raise UsageError(
                    f"cannot connect to {self.where} ({_first_line(origin)})"
                ) from None
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
            if not self.is_sqlite and _no_version_table(exc):
                raise missing_ledger(None, self.url) from None
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

    def now(self) -> datetime:
        """The ledger's clock (``ledger_now``): this host's on SQLite, the server's on
        PostgreSQL (heartbeat ages judged on a host whose clock is off stay right)."""
        if self.is_sqlite:
            from controller.clock import SystemClock

            return SystemClock().now()
        found = self.rows("SELECT timezone('UTC', clock_timestamp())")[0][0]
        assert isinstance(found, datetime)
        return found

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Rows of a query laneway wrote (named ``:parameters``)."""
        return [tuple(row) for row in self.execute(sql, params or {}).fetchall()]

    def query(
        self,
        sql: str,
        *,
        timeout_s: float = QUERY_TIMEOUT_S,
        allow_privileged: bool = False,
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """An operator's query (``laneway sql``): headers and rows; a refused, failing or
        timed-out query (``timeout_s``) raises UsageError with one line. On PostgreSQL a
        superuser is refused unless ``allow_privileged`` (``controller.sqlguard``)."""
        from time import monotonic

        self.refused = None
        deadline = monotonic() + timeout_s
        try:
            if self._sqlite is not None:
                # Called every 1000 VM steps: a nonzero answer interrupts the statement.
                self._sqlite.set_progress_handler(lambda: int(monotonic() > deadline), 1000)
                try:
                    cursor = self._sqlite.execute(sql)
                    if cursor.description is None:
                        raise UsageError("the query returned no rows; `laneway sql` is for SELECTs")
                    headers = [d[0] for d in cursor.description]
                    return headers, [tuple(r) for r in cursor.fetchall()]
                finally:
                    self._sqlite.set_progress_handler(None, 0)
            from controller import sqlguard

            assert self._connection is not None
            with self.snapshot():
                return sqlguard.run_query(
                    self._connection.connection.driver_connection,
                    sql,
                    timeout_s=timeout_s,
                    allow_privileged=allow_privileged,
                )
        except self._errors as exc:
            if isinstance(exc, sqlite3.OperationalError) and monotonic() > deadline:
                raise UsageError(
                    f"query stopped: it ran past --timeout {timeout_s:g} s ({exc})"
                ) from None
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
