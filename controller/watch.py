"""A cheap "did the ledger change?" probe for polling loops, and a wait that wakes on it.

SQLite: every commit writes the WAL file (or, after a checkpoint, the database file), so
a ``stat`` of both tells whether anything was committed since the last look: a few
microseconds and no database connection, which lets an idle loop poll often and still
cost nothing. (``PRAGMA data_version`` on a kept connection costs about the same,
bench/bench_wakeup.py measures both, but holds a connection open per watch and wakes
nobody sooner.) A waiting loop sleeps its poll interval, so it notices a commit within
that interval.

PostgreSQL: every transaction that appends to ``events`` sends one notification on the
``laneway`` channel (a trigger, migration 0005), so a commit needs no extra round trip.
The watch LISTENs on one dedicated autocommit connection of its own: ``changed()`` only
reads what already arrived on that socket (no query), and ``wait()`` sleeps on the
socket too, so a waiting loop wakes as soon as the notification arrives rather than at
its next poll.

A LISTEN connection can drop (server restart, ``pg_terminate_backend``, a network cut).
A closed one makes its socket readable and the next read fails; one that dies silently
is found by TCP keepalives (``KEEPALIVES``: within 11 seconds). The watch then
reconnects at once and says "changed" once, because notifications sent while it was
away are lost. While it cannot reconnect it says "changed" on every call (its caller
falls back to polling the ledger) and retries the connection every ``RETRY_SECONDS``.
"""

from __future__ import annotations

import os
import selectors
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from laneway.controller import db

if TYPE_CHECKING:
    import psycopg

CHANNEL = "laneway"
"""The channel migration 0005's trigger notifies on each commit that appends events."""
APPLICATION_NAME = "laneway-watch"
"""How a watch's LISTEN connection shows in ``pg_stat_activity``."""
RETRY_SECONDS = 1.0
"""How often a watch whose LISTEN connection is gone tries to open a new one."""
CONNECT_TIMEOUT_SECONDS = 5
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
"""libpq's TCP keepalive settings for the LISTEN connection: an idle connection whose
peer vanished without a word (a cable, a firewall, a frozen host) fails after
5 + 3 * 2 = 11 seconds, instead of waiting forever for a notification."""


class ChangeWatch:
    """``changed()`` is True when something may have been committed since the last call
    (and on the first call). It may say True when nothing changed (a heartbeat, a
    checkpoint, a reconnect); it never misses a commit. On SQLite a commit shows at
    once; on PostgreSQL once its notification has arrived, a moment after the writer's
    COMMIT returned: a loop that must see a commit waits for it (``wait``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.listens = not db.is_sqlite(engine)
        """PostgreSQL: LISTEN; SQLite: stat the ledger's files."""
        database = engine.url.database if db.is_sqlite(engine) else None
        self.paths = [database, database + "-wal"] if database else []
        self._seen: object = None
        self._listener: psycopg.Connection[Any] | None = None
        self._pending = True
        """A notification (or a reconnect) arrived that ``changed()`` has not reported."""
        self._retry_at = float("-inf")
        self._selector: selectors.BaseSelector | None = None
        self.lost = 0
        """How many LISTEN connections this watch lost (each is replaced)."""

    # -- the probe -------------------------------------------------------------

    def changed(self) -> bool:
        if not self.listens:
            if not self.paths:
                return True  # an SQLite ledger with no file: nothing to stat
            signature = self._stat()
            if signature == self._seen:
                return False
            self._seen = signature
            return True
        listener = self._listening()
        if listener is None:
            self._pending = True  # no LISTEN connection: the caller has to look
        else:
            self._drain(listener)
        pending, self._pending = self._pending, False
        return pending

    def _stat(self) -> object:
        signature: list[tuple[int, int, int] | None] = []
        for path in self.paths:
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                signature.append(None)
                continue
            signature.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        return tuple(signature)

    # -- waiting ---------------------------------------------------------------

    def wait(self, timeout: float, selector: selectors.BaseSelector | None = None) -> None:
        """Sleep until ``timeout`` passes, a file registered in ``selector`` is ready (a
        worker's supervisors), or, on PostgreSQL, a notification arrives; the next
        ``changed()`` reports it."""
        listener = self._listening() if self.listens else None
        if selector is None:
            selector = self._selector = self._selector or selectors.DefaultSelector()
        if listener is None:
            if selector.get_map():
                selector.select(timeout)
            else:
                time.sleep(timeout)
            return
        # Registered for this wait only: the socket changes when the watch reconnects.
        fd = listener.pgconn.socket
        selector.register(fd, selectors.EVENT_READ, self)
        try:
            ready = selector.select(timeout)
        finally:
            selector.unregister(fd)
        if any(key.data is self for key, _ in ready):
            self._drain(listener)

    # -- the LISTEN connection -------------------------------------------------

    def _listening(self) -> psycopg.Connection[Any] | None:
        """The LISTEN connection; if there is none, a new one (at most one try each
        ``RETRY_SECONDS``), which sets ``_pending``: what was sent before it is lost."""
        if self._listener is not None:
            return self._listener
        if time.monotonic() < self._retry_at:
            return None
        self._retry_at = time.monotonic() + RETRY_SECONDS
        import psycopg

        _, params = self.engine.dialect.create_connect_args(self.engine.url)
        params.pop("context", None)
        try:
            listener = psycopg.connect(
                **params,
                autocommit=True,
                application_name=APPLICATION_NAME,
                connect_timeout=CONNECT_TIMEOUT_SECONDS,
                **KEEPALIVES,
            )
        except psycopg.OperationalError:
            return None  # the ledger is unreachable: say "changed" and retry later
        try:
            listener.execute(f"LISTEN {CHANNEL}")
        except psycopg.OperationalError:
            listener.close()
            return None
        self._listener = listener
        self._pending = True
        return listener

    def _drain(self, listener: psycopg.Connection[Any]) -> None:
        """Read what arrived on the LISTEN socket, without blocking."""
        import psycopg

        pgconn = listener.pgconn
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            self.lost += 1
            self.close()
            self._pending = True
            self._retry_at = float("-inf")
            self._listening()  # at once: the next notification must not be missed too
            return
        while pgconn.notifies() is not None:
            self._pending = True

    def listener_pid(self) -> int | None:
        """The server process of the LISTEN connection, if there is one (diagnostics)."""
        return None if self._listener is None else self._listener.info.backend_pid

    def close(self) -> None:
        """Close the LISTEN connection (a later call opens a new one)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
