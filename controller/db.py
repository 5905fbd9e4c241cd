"""Engines, sessions, the write lock and the ledger's transient failures.

This module is the one marked seam for dialect-specific SQL: SQLite needs PRAGMAs and
``BEGIN IMMEDIATE`` so that a write transaction takes the write lock up front instead of
failing half-way with "database is locked" when it upgrades from a read. Everything
else in laneway speaks dialect-neutral SQLAlchemy. What a ledger holds, its schema
revision and opening one are in ``controller.ledger_open``; the read-only connection of
``status`` and ``sql`` is ``controller.readonly``.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from laneway.controller import durable
from laneway.controller.errors import CommitOutcomeUnknown, LedgerUnavailable, UsageError

if TYPE_CHECKING:
    from sqlalchemy import URL, Engine
    from sqlalchemy.orm import Session, sessionmaker

    from laneway.controller.clock import Clock

# SQLAlchemy and tenacity are imported where they are used: a read-only command on a
# SQLite ledger (`laneway status`, `sql`) needs neither, and importing them costs most of
# its run time (tests/integration/test_cli_imports.py).

LEDGER_FILENAME = "ledger.sqlite3"
BUSY_TIMEOUT_MS = 30_000


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


GATE_KEY = 0x6C616E67
""""lang": the PostgreSQL advisory lock every write transaction holds, to its commit. The
controller's and the operator's writes (``transaction``) hold it alone, so what they read
no other writer changes before they commit; workers' writes (``worker_transaction``,
``claim_transaction``) share it, so the machines' claims and settles run beside each
other."""
ORDER_LOCK_KEY = 0x6C616E65
""""lane": the lock a worker's transaction holds from its first event, or its first
read-then-write that must see every other worker's commits (``order_lock``), to its
commit. Event ids therefore commit in the order they were drawn (the controller's event
cursor never skips one), and the rows every worker adds to (a stage's peaks, a budget's
spend, a selection's counts) are written only under it."""
IDLE_IN_TRANSACTION_MS = 60_000


def _postgres_engine(url: URL, *, readonly: bool) -> Engine:
    """PostgreSQL through psycopg 3 (``postgresql://`` means psycopg, not psycopg2).
    Sessions run in UTC (ledger timestamps are naive UTC), and a session left idle inside
    a transaction (a worker stopped with SIGSTOP while it held the write lock) is ended
    by the server after ``IDLE_IN_TRANSACTION_MS``, so it cannot block every writer.

    Only read-only engines (the dashboard, ``status``) ping a pooled connection before
    using it. The engine that writes does not: a ping is a round trip per transaction,
    and the processes that write through it (worker, controller, ``laneway run``) ride
    out a connection that failed on its first statement like any transient failure
    (``is_transient``: nothing was written, the tick is tried again, and SQLAlchemy has
    dropped every connection of the pool it found dead)."""
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
        pool_pre_ping=readonly,
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
    On PostgreSQL it is the engine in autocommit (``_autocommit``): a read there sees a
    snapshot per statement in any case (READ COMMITTED), and needs no BEGIN and ROLLBACK
    round trips around it.
    """
    if not is_sqlite(engine):
        return session_factory(_autocommit(engine))
    url = engine.url.render_as_string(hide_password=False)
    factory = _readers.get(url)
    if factory is None:
        factory = _readers[url] = session_factory(make_engine(url, readonly=True))
    return factory


def forget_readers() -> None:
    """Dispose every cached ``reader`` engine and forget them: for a process that opens
    many ledgers one after another (the test suite), so their files do not stay open."""
    for factory in _readers.values():
        bind = factory.kw.get("bind")
        if bind is not None:
            bind.dispose()
    _readers.clear()


@contextmanager
def one_read(engine: Engine) -> Iterator[Session]:
    """A read-only session for one look (a command's, before it writes), not a polling
    loop's: on SQLite through a read-only engine of its own, disposed after, so no
    connection stays open (``reader`` keeps one per ledger for the loops that poll)."""
    if not is_sqlite(engine):
        with session_factory(_autocommit(engine))() as session:
            yield session
        return
    own = make_engine(engine.url.render_as_string(hide_password=False), readonly=True)
    try:
        with session_factory(own)() as session:
            yield session
    finally:
        own.dispose()


@contextmanager
def transaction(factory: sessionmaker[Session], *, fair: bool = True) -> Iterator[Session]:
    """One write transaction: commit on success, roll back on any error.

    On SQLite, writers first queue on an flock of ``<ledger>.writelock`` (``fair``):
    SQLite's own busy handler sleeps and retries, so under contention a writer can lose
    the race again and again and wait for seconds; blocked in flock, waiters are woken
    the moment the lock is free (bench/bench_contention.py measures both).

    On PostgreSQL it first takes the gate (``GATE_KEY``) alone and holds it to its
    commit: no worker's transaction is open beside it, so every read-then-write (a
    retry, a reconcile, a run's completion) sees a ledger no other writer changes under
    it, and its events commit in order. The controller, the operator's commands and a
    worker's recovery, registration and exit write this way; a worker's claims, settles,
    identities, samples and heartbeats share the gate (``worker_transaction``,
    ``claim_transaction``). Reads take no lock. docs/deploy.md says what this costs.
    """
    engine = factory.kw.get("bind")
    postgres = engine is not None and not is_sqlite(engine)
    asked = time.monotonic()
    with (
        _write_lock(engine if fair else None),
        factory(
            **({"bind": _autocommit(engine)} if engine is not None and postgres else {})
        ) as session,
    ):
        session.begin()
        try:
            if postgres:
                # One round trip: BEGIN, the gate, then the server's clock once it is held.
                session.info[LEDGER_NOW] = _begin_with(session, _GATE_THEN_NOW)[0]
            session.info[WRITE_LOCKED] = True
            session.info[LOCKED_AT] = time.monotonic()
            session.info[LOCK_WAIT] = session.info[LOCKED_AT] - asked
            session.info[DEFERRED] = []
            yield session
            _run_deferred(session)
        except BaseException:
            session.rollback()
            raise
        _commit(session)


@contextmanager
def worker_transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A worker's settle, identities, samples or heartbeat: on SQLite exactly
    ``transaction``. On PostgreSQL it shares the gate (``GATE_KEY``) with the other
    workers' transactions, so the machines write beside each other, and takes the order
    lock (``order_lock``) only for what needs it: its events, the rows every worker adds
    to (``shared_write``), and a read-then-write that must see the others' commits (an
    item's promotion, the infrastructure breaker's streak, a control)."""
    engine = factory.kw.get("bind")
    if engine is None or is_sqlite(engine):
        with transaction(factory) as session:
            yield session
        return
    with _shared_gate(factory, _SHARED_GATE_THEN_NOW) as session:
        yield session


@contextmanager
def claim_transaction(factory: sessionmaker[Session], *, node: str) -> Iterator[Session]:
    """A worker's claim: on SQLite exactly ``transaction``. On PostgreSQL it begins with
    the node's own advisory lock (``NODE_LOCK_CLASS``, the node's name hashed), so the
    claims of one node's workers are serialised (its slots, memory, GPUs and ports are
    decided from a snapshot no other claim of that node changes), then shares the gate
    like ``worker_transaction``: claims on different nodes run beside each other. What
    only the order lock keeps true (caps counted over several nodes, a control or an
    unknown outcome set by another worker) is decided under it (``ledger.claim``)."""
    engine = factory.kw.get("bind")
    if engine is None or is_sqlite(engine):
        with transaction(factory) as session:
            yield session
        return
    with _shared_gate(factory, _NODE_LOCK_THEN_NOW.format(node=node_lock_key(node))) as session:
        yield session


@contextmanager
def _shared_gate(factory: sessionmaker[Session], locks_then_now: str) -> Iterator[Session]:
    asked = time.monotonic()
    with factory(bind=_autocommit(factory.kw["bind"])) as session:
        session.begin()
        try:
            first = _begin_with(session, locks_then_now)
            session.info[LEDGER_NOW] = first[0]
            if len(first) > 1:  # a claim's: the newest event when it began
                session.info[EVENTS_BEFORE] = int(first[1] or 0)
            session.info[LOCK_WAIT] = time.monotonic() - asked
            session.info[WRITE_LOCKED] = False
            session.info[DEFERRED] = []
            session.info[SHARED_WRITES] = []
            yield session
            _run_deferred(session)
        except BaseException:
            session.rollback()
            raise
        _commit(session)


def _autocommit(engine: Engine) -> Engine:
    """``engine`` (the same pool) with its PostgreSQL connections in psycopg's autocommit
    mode while a session holds them (SQLAlchemy puts them back as they were when they
    return to the pool). psycopg sends no BEGIN of its own then: a read is one round
    trip, and a write transaction begins with its first statement (``_begin_with``).
    Kept on the engine itself, so it goes when the engine goes."""
    found: Engine | None = getattr(engine, "_laneway_autocommit", None)
    if found is None:
        found = engine.execution_options(isolation_level="AUTOCOMMIT")
        setattr(engine, "_laneway_autocommit", found)  # noqa: B010 (not a declared attribute)
    return found


def _begin_with(session: Session, first: str) -> tuple[Any, ...]:
    """Run ``first``, a query without parameters whose first column is the server's
    clock, as the first statement of ``session``'s transaction (on ``_autocommit``'s
    engine), and begin the transaction, in one round trip. psycopg sends a query without
    parameters as one simple-protocol message; there a ``BEGIN`` after a statement turns
    the implicit transaction that statement ran in into the transaction block, so what
    ``first`` locked stays locked to the commit. psycopg, seeing the server inside a
    transaction, then sends COMMIT or ROLLBACK when SQLAlchemy asks. Returns the row."""
    from sqlalchemy import text

    found = tuple(session.execute(text(f"{first}; BEGIN")).one())
    assert isinstance(found[0], datetime)
    return found


def events_before(session: Session) -> int | None:
    """In a PostgreSQL ``claim_transaction``: the newest event id committed when its
    first statement began. Every event up to it is visible to the claim's reads (ids
    commit in the order they are drawn: ``order_lock``), so a worker that claimed from
    them has seen them all; an event after it may have been committed after the claim
    read (``WorkerService._worth_claiming``). None elsewhere."""
    found = session.info.get(EVENTS_BEFORE)
    return None if found is None else int(found)


def order_lock(session: Session) -> bool:
    """Take the order lock (``ORDER_LOCK_KEY``) in a worker's transaction that has not
    taken it yet; True when it was taken now (what other workers committed since the
    transaction began is visible to the statements after it, and what they commit from
    now on commits after this transaction). False on SQLite and in ``transaction``,
    which hold the gate alone from their first statement.

    Lock order, which keeps workers' transactions free of deadlocks: the node's lock,
    the gate, the worker's own rows (its jobs, attempts, leases), then this lock, and
    only then rows other workers write too (``shared_write``)."""
    if session.info.get(WRITE_LOCKED, True):
        return False
    from sqlalchemy import text

    asked = time.monotonic()
    session.execute(text(f"SELECT pg_advisory_xact_lock({ORDER_LOCK_KEY})"))
    session.info[WRITE_LOCKED] = True
    session.info[LOCKED_AT] = time.monotonic()
    session.info[LOCK_WAIT] = session.info.get(LOCK_WAIT, 0.0) + session.info[LOCKED_AT] - asked
    for step in session.info.pop(SHARED_WRITES, ()):
        step(session)
    return True


def shared_write(session: Session, step: Callable[[Session], object]) -> None:
    """Write a row that every worker adds to (a stage's measured peaks, a budget's spend,
    a selection's counts): now where the transaction holds the ledger alone or the
    order lock, else at its end under the order lock. A worker's transaction that wrote
    such a row before waiting for the order lock could hold up one that holds it."""
    waiting = session.info.get(SHARED_WRITES)
    if waiting is None or session.info.get(WRITE_LOCKED, True):
        step(session)
        return
    waiting.append(step)


def holds_order(session: Session) -> bool:
    """Does this transaction decide with every other writer's commits in view: it holds
    the order lock, the gate alone, or SQLite's write lock?"""
    return bool(session.info.get(WRITE_LOCKED, True))


def defer(session: Session, step: Callable[[Session], object]) -> bool:
    """Keep ``step`` to the end of this write transaction (run in order just before its
    commit, under the order lock: ``ledger.append_events`` writes a transaction's events
    in one statement that way). False outside a write transaction, where the caller
    must write now."""
    deferred = session.info.get(DEFERRED)
    if deferred is None:
        return False
    deferred.append(step)
    return True


def _run_deferred(session: Session) -> None:
    if session.info.get(DEFERRED) or session.info.get(SHARED_WRITES):
        order_lock(session)
    for step in session.info.pop(DEFERRED, ()):
        step(session)


def _commit(session: Session) -> None:
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


def unreachable(engine: Engine, error: BaseException) -> LedgerUnavailable:
    """The one line for a ledger that cannot be reached (its URL shown without password)."""
    where = shown_url(engine.url.render_as_string(hide_password=False))
    return LedgerUnavailable(
        f"cannot reach the ledger at {where} ({describe(error)}); check that the database "
        "server runs and the URL (--database-url / LANEWAY_DATABASE_URL)"
    )


def shown_url(url: str) -> str:
    """A ledger URL as laneway prints it: never with its password."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)


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
EVENTS_BEFORE = "laneway_events_before"
"""The newest event id when a PostgreSQL claim began (``events_before``)."""
LOCK_WAIT = "laneway_lock_wait"
WRITE_LOCKED = "laneway_write_locked"
"""False while a worker's transaction on PostgreSQL has not taken the order lock."""
LOCKED_AT = "laneway_locked_at"
"""``time.monotonic()`` when the transaction took the gate alone or the order lock (the
time it holds it, to its commit, is what other writers may wait for:
bench_claim_race.py); absent while it holds neither."""
SHARED_WRITES = "laneway_shared_writes"
"""The ``shared_write`` steps a worker's transaction keeps for the order lock."""
DEFERRED = "laneway_deferred"
"""The steps ``defer`` keeps to the end of a write transaction."""


def lock_wait(session: Session) -> float:
    """Seconds the write transaction ``session`` waited for the ledger's write lock
    (0 outside ``transaction``). A long wait means every other writer, a worker's
    heartbeat among them, was held up as long: the controller judges no heartbeat
    against that time (``controller.daemon``)."""
    return float(session.info.get(LOCK_WAIT, 0.0))


_GATE_THEN_NOW = (
    "SELECT timezone('UTC', clock_timestamp()) "
    f"FROM (SELECT pg_advisory_xact_lock({GATE_KEY})) AS locked"
)
_SHARED_GATE_THEN_NOW = (
    "SELECT timezone('UTC', clock_timestamp()) "
    f"FROM (SELECT pg_advisory_xact_lock_shared({GATE_KEY})) AS locked"
)


NODE_LOCK_CLASS = 0x6C616E6E  # "lann": the first key of every node's advisory lock


def node_lock_key(node: str) -> int:
    """The second key of ``node``'s advisory lock: its name's CRC-32 as a signed 32-bit
    integer (computed here, so the claim's first statement needs no parameter)."""
    return zlib.crc32(node.encode()) - 2**31


# The node's lock, then the gate shared, then the clock, in one round trip: CASE
# evaluates its condition first and each sub-select (an InitPlan) on first use, so the
# gate is asked for only once the node's lock is held (``order_lock`` says why). The
# second column is the newest event id in the statement's snapshot, taken when it began
# (``events_before``): the claim's later reads see at least that much.
_NODE_LOCK_THEN_NOW = (
    "SELECT CASE WHEN (SELECT true FROM (SELECT pg_advisory_xact_lock("
    f"{NODE_LOCK_CLASS}, {{node}})) AS node) THEN (SELECT timezone('UTC', "
    f"clock_timestamp()) FROM (SELECT pg_advisory_xact_lock_shared({GATE_KEY})) AS gate) END, "
    "(SELECT max(id) FROM events)"
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


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]
