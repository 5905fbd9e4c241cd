"""``ReadOnlyLedger``: the read-only connection of the commands that only read.

``status``, ``sql``, ``logs``, the dashboard and completion read an existing ledger
through it: on SQLite the standard library's ``sqlite3`` behind an authorizer that
allows reads only (no SQLAlchemy import), on PostgreSQL a read-only transaction.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import db
from laneway.controller.db import _first_line, make_engine
from laneway.controller.errors import LedgerRevisionError, NoLedgerYet, UsageError
from laneway.controller.ledger_open import (
    POSTGRES_TABLES,
    _no_version_table,
    existing_ledger_url,
    judge_tables,
    missing_ledger,
    refuse_unknown_revision,
    sqlite_path,
)

if TYPE_CHECKING:
    from sqlalchemy import Connection

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

    Where nothing is there yet (no SQLite file, a database without tables) it raises
    ``NoLedgerYet``, which ``status --watch`` waits on; another application's database
    is ``LedgerRevisionError``.
    """

    def __init__(self, runtime_dir: str | os.PathLike[str], *, url: str | None = None) -> None:
        self._runtime_dir = runtime_dir
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
            try:
                with self.snapshot():
                    revision = self._revision()
            except NoLedgerYet:
                if not self.is_sqlite:
                    # No alembic_version: an empty database, or another application's.
                    with self.snapshot():
                        names = [str(row[0]) for row in self.rows(POSTGRES_TABLES)]
                    judge_tables(names, self.where)
                raise
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
            nothing = not self._any_table() if self.is_sqlite else _no_version_table(exc)
            if nothing:  # no ledger yet, rather than another application's database
                raise missing_ledger(self._runtime_dir, self.url) from None
            raise LedgerRevisionError(
                f"{self.where} is not a laneway ledger ({_first_line(exc)})"
            ) from None
        return str(rows[0][0]) if rows else None

    def _any_table(self) -> bool:
        """SQLite: the file holds a table (or cannot be read); False: nothing there yet."""
        try:
            return bool(self.rows("SELECT 1 FROM sqlite_master LIMIT 1"))
        except sqlite3.Error:
            return True

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
            from laneway.controller.clock import SystemClock

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
            from laneway.controller import sqlguard

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
        timeout=db.BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,
        check_same_thread=False,
    )
    connection.execute("PRAGMA query_only = ON")
    return connection
