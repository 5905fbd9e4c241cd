"""Opening a ledger: what a database holds, its schema revision, and migrating it.

``open_ledger`` may create a ledger (``migrate``, a run's creation); ``open_existing_ledger``
(services) and ``open_writer`` (an operator's write) need one already. Nothing here writes
to a database that is not a laneway ledger (``ledger_contents``). The revision checks
without alembic (``known_revisions``, ``check_known_revision``) are for read-only opens.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from laneway.controller import durable
from laneway.controller.db import (
    LEDGER_FILENAME,
    _first_line,
    is_sqlite_url,
    is_transient,
    ledger_url,
    make_engine,
    shown_url,
    unreachable,
)
from laneway.controller.errors import LedgerRevisionError, NoLedgerYet, UsageError

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import Engine

# SQLAlchemy and alembic are imported where they are used: a read-only command on a
# SQLite ledger (`laneway status`, `sql`) needs neither, and importing them costs most of
# its run time (tests/integration/test_cli_imports.py).

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


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
    return judge_tables(names, path)


POSTGRES_TABLES = (
    "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
)
"""The tables a PostgreSQL database holds in its current schema (``ledger_contents``)."""


def _postgres_contents(url: str) -> str:
    from sqlalchemy.exc import SQLAlchemyError

    engine = make_engine(url, readonly=True)
    try:
        with engine.connect() as connection:
            names = [str(row[0]) for row in connection.exec_driver_sql(POSTGRES_TABLES)]
    except SQLAlchemyError as exc:
        if is_transient(exc):
            raise unreachable(engine, exc) from None
        raise
    finally:
        engine.dispose()
    return judge_tables(names, shown_url(url))


def judge_tables(names: list[str], where: str) -> str:
    """``LEDGER`` or ``EMPTY`` for a database holding tables ``names``; another
    application's tables: ``LedgerRevisionError`` (``ledger_contents``)."""
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
) -> NoLedgerYet:
    """The one-line refusal for a ledger that does not exist (yet): nothing is there (no
    SQLite file, or a database without tables). A command that waits for one
    (``status --watch``, ``worker``) tells it from another application's database
    (``LedgerRevisionError``) by this type."""
    url = url or ledger_url(runtime_dir or ".")
    if not is_sqlite_url(url):
        return NoLedgerYet(
            f"{shown_url(url)}: the database holds no laneway ledger; `laneway "
            "start-pipeline` or `laneway run` creates one (check --database-url or "
            "LANEWAY_DATABASE_URL)",
            where=shown_url(url),
        )
    path = sqlite_path(url) or Path(runtime_dir or ".") / LEDGER_FILENAME
    if os.environ.get("LANEWAY_DATABASE_URL"):
        return NoLedgerYet(
            f"LANEWAY_DATABASE_URL: no ledger at {path}; `laneway start-pipeline` or "
            "`laneway run` creates one (check the URL)",
            where=str(path),
        )
    return NoLedgerYet(
        f"--runtime-dir {runtime_dir}: no ledger at {path}; `laneway start-pipeline` or "
        "`laneway run` creates one (check the path, or set LANEWAY_RUNTIME_DIR)",
        where=str(path),
    )


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
    ledger must exist already; it is migrated to head like ``open_ledger`` does. No
    ledger yet (nothing there): ``NoLedgerYet``; another application's database:
    ``LedgerRevisionError``."""
    url = existing_ledger_url(runtime_dir)
    engine = make_engine(url)
    revision = _stored_revision(engine)
    if revision is None:
        engine.dispose()
        if not is_sqlite_url(url):
            ledger_contents(url)  # another application's tables are refused, not waited on
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
