"""The controller's lock and pidfile: one controller per runtime dir (and per ledger).

``hold_controller_lock`` takes the runtime dir's ``flock`` (and, on PostgreSQL, the
ledger's advisory lock) and, whenever it takes it, records this process in the runtime
dir's pidfile (``controller/pidfile.py``: ``claim_pidfile``, ``running_controller``, by
boot id, pid and start time), so ``laneway status`` can tell a running controller from
a gone one; ``start_background_controller`` starts one detached.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import db
from laneway.controller.durable import modes
from laneway.controller.errors import UsageError
from laneway.controller.pidfile import PIDFILE as PIDFILE
from laneway.controller.pidfile import claim_pidfile as claim_pidfile
from laneway.controller.pidfile import release_pidfile as release_pidfile
from laneway.controller.pidfile import running_controller as running_controller

if TYPE_CHECKING:
    from sqlalchemy import Engine


_controller_locks: dict[str, int] = {}


CONTROLLER_LOCK_KEY = 0x6C616E66  # the PostgreSQL advisory lock of the one controller
_ledger_locks: dict[str, Any] = {}


def hold_controller_lock(runtime_dir: Path, engine: Engine | None = None) -> bool:
    """Take the runtime dir's controller lock until ``release_controller_lock`` (or the
    end of this process). False if another process holds it (flock: atomic, and freed by
    the kernel when the holder dies, even by SIGKILL). True again if this process holds
    it already.

    With a PostgreSQL ``engine`` the ledger is shared by machines, so the lock is the
    ledger's too: a session-level advisory lock on a connection of its own, freed by the
    server when this process or its connection dies (``holds_ledger_lock`` re-checks)."""
    key = str(Path(runtime_dir).resolve())
    if key in _controller_locks:
        return engine is None or holds_ledger_lock(engine)
    if engine is not None and not holds_ledger_lock(engine):
        return False
    try:
        fd = os.open(Path(key) / "controller.lock", os.O_RDWR | os.O_CREAT, modes()[0])
    except OSError as exc:
        raise UsageError(
            f"{Path(key) / 'controller.lock'}: cannot open the controller lock "
            f"({exc.strerror or exc}); the controller needs a runtime dir it can write"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _controller_locks[key] = fd
    try:
        # ``laneway run`` and ``laneway controller`` alike: whoever holds the lock is the
        # controller that ``laneway status`` names (``status._controller_state``).
        claim_pidfile(key)
    except OSError as exc:
        release_controller_lock(Path(key), engine)
        raise UsageError(
            f"{Path(key) / PIDFILE}: cannot record the controller ({exc.strerror or exc}); "
            "the controller needs a runtime dir it can write"
        ) from None
    return True


def release_controller_lock(runtime_dir: Path, engine: Engine | None = None) -> None:
    """Give the runtime dir's controller lock back (``laneway run`` when its run ended),
    so another controller, or another run in this process, can take it."""
    key = str(Path(runtime_dir).resolve())
    fd = _controller_locks.pop(key, None)
    if fd is not None:
        release_pidfile(key)
        os.close(fd)  # closing the last descriptor of the open file releases the flock
    if engine is not None:
        connection = _ledger_locks.pop(_lock_key(engine), None)
        if connection is not None:
            connection.close()  # the server frees a session's advisory locks


def _lock_key(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def holds_ledger_lock(engine: Engine) -> bool:
    """On PostgreSQL: does this process hold the ledger's controller lock (taking it if
    it is free, also again after its connection was lost)? Raises LedgerUnavailable when
    the server cannot be reached (that says nothing about the lock). Always True on
    SQLite, where the runtime dir's flock is the ledger's lock (one host)."""
    if db.is_sqlite(engine):
        return True
    import psycopg

    key = _lock_key(engine)
    connection = _ledger_locks.get(key)
    if connection is not None:
        try:
            connection.execute("SELECT 1")
            return True
        except psycopg.Error:
            connection.close()
            del _ledger_locks[key]
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        connection = psycopg.connect(
            url, autocommit=True, application_name="laneway-controller", connect_timeout=10
        )
        row = connection.execute(
            "SELECT pg_try_advisory_lock(%s)", (CONTROLLER_LOCK_KEY,)
        ).fetchone()
    except psycopg.OperationalError as exc:
        # Not an answer: nobody can say who holds the lock while the server is away.
        raise db.unreachable(engine, exc) from None
    if not (row and row[0]):
        connection.close()
        return False
    _ledger_locks[key] = connection
    return True


def start_background_controller(runtime_dir: Path) -> int:
    """Start ``laneway controller`` detached (own session), logging to controller.log.

    posix_spawn, not Popen: nothing here waits for it, and it must outlive this process.
    """
    runtime_dir = Path(runtime_dir).resolve()
    log = str(runtime_dir / "controller.log")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    argv = [sys.executable, "-m", "laneway", "controller", "--runtime-dir", str(runtime_dir)]
    return os.posix_spawn(
        sys.executable,
        argv,
        dict(os.environ),
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, log, flags, modes()[0]),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ],
        setsid=True,
    )
