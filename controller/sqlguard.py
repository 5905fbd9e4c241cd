"""The guard around an operator's query on a PostgreSQL ledger (``laneway sql``).

SQLite has an authorizer that sees every action a statement takes; PostgreSQL has
none, so the guard is made of what the server itself enforces, checked before the query
runs, in the read-only transaction ``ReadOnlyLedger.snapshot`` opens:

- a ``statement_timeout`` for the transaction (``SET LOCAL``), so a runaway query stops;
- the role: a superuser (or a member of ``pg_read_server_files``,
  ``pg_write_server_files`` or ``pg_execute_server_program``) can read and write the
  server's files and run programs there whatever the transaction says, so it is refused
  unless the operator says they know (``allow_privileged``); docs/deploy.md gives the
  grants of a role that can only read laneway's tables;
- the query is parsed by the server as one prepared statement (PostgreSQL refuses to
  prepare several statements at once), and described before it runs: a statement that
  returns no rows (``COPY``, ``SET``, ``DO``, transaction control, DDL) is refused
  without running, so ``COPY ... TO 'file'`` and ``COPY ... TO PROGRAM`` never start;
- for every role, the advisory-lock functions (``_LOCK_FUNCTIONS``): no read-only
  transaction stops them, and laneway's writers queue on one; and the functions that
  run SQL given as text (``_SQL_TEXT_FUNCTIONS``: ``query_to_xml``, ``ts_stat``,
  ``dblink``, ...), since SQL built while the query runs is out of the text's sight;
- for a privileged role, the functions in ``_SERVER_FUNCTIONS`` (server files,
  programs, signals to other sessions) are refused by name.

These checks read the query's text, so they are a seat belt, not a sandbox: the role
``laneway sql-role create`` makes (``controller.readonly_role``) is the protection, as
the database itself refuses it every one of those functions.

Writes fail in the read-only transaction, and the transaction is always rolled back.
Every refusal is a ``UsageError`` with one line.
"""

from __future__ import annotations

import re
from typing import Any

from laneway.controller.errors import UsageError

PRIVILEGED_ROLES = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program")
MAX_QUERY_TIMEOUT_S = 600.0
"""The most `laneway sql --timeout` takes: a query that runs longer holds its snapshot,
and with it the cleanup of the ledger's updated rows (VACUUM), all that time."""
_SERVER_FUNCTIONS = re.compile(
    r"\b(pg_read_file|pg_read_binary_file|pg_stat_file|pg_ls_\w*|pg_file_\w+|pg_logdir_ls"
    r"|lo_import|lo_export|lo_from_bytea"
    r"|pg_terminate_backend|pg_cancel_backend|pg_reload_conf|pg_rotate_logfile\w*"
    r"|pg_promote|pg_switch_wal|pg_create_restore_point)\b",
    re.IGNORECASE,
)
_LOCK_FUNCTIONS = re.compile(r"\b(pg_(try_)?advisory\w*)\b", re.IGNORECASE)
"""Advisory locks are not refused by a read-only transaction or a read-only role, and
laneway's writers all take one (``db.GATE_KEY``): a query holding it would queue
every write, heartbeats included, behind it. Refused for every role."""
_SQL_TEXT_FUNCTIONS = re.compile(
    r"\b(query_to_xml\w*|cursor_to_xml\w*|ts_stat|ts_rewrite|dblink\w*)\b", re.IGNORECASE
)
"""Functions that run SQL given as text, which can be built while the query runs
(``'pg_' || 'advisory_lock(...)'``), out of sight of any check of the query's text.
Refused for every role."""
_QUERY_CANCELED = "57014"


def run_query(
    connection: Any, query: str, *, timeout_s: float, allow_privileged: bool
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one operator's query on ``connection`` (a psycopg 3 connection inside a
    ``READ ONLY`` transaction the caller rolls back): headers and rows, or UsageError."""
    import psycopg

    _refuse_for_every_role(query)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL statement_timeout = {max(1, round(timeout_s * 1000))}")
            _refuse_privileged(cursor, query, allow_privileged=allow_privileged)
            _check_one_query_with_rows(connection, query)
            # Parsed once more, as a prepared statement again: the same text in the same
            # transaction, so still one statement that returns rows.
            cursor.execute(query, prepare=True)
            if cursor.description is None:  # not reached: described above
                raise UsageError("the query returned no rows; `laneway sql` is for SELECTs")
            headers = [column.name for column in cursor.description]
            return headers, [tuple(row) for row in cursor.fetchall()]
    except psycopg.Error as exc:
        if exc.sqlstate == _QUERY_CANCELED:
            raise UsageError(
                f"query stopped: it ran past --timeout {timeout_s:g} s ({_first_line(str(exc))})"
            ) from None
        raise UsageError(f"query refused: {_first_line(str(exc))}") from None


def _refuse_for_every_role(query: str) -> None:
    """The advisory locks and the functions that run SQL text, refused by name wherever
    the name appears (a string or a comment too), before anything is sent."""
    # Quoted names ("pg_advisory_lock") are the same function; U&"..." spells one in
    # escapes, which is refused whole.
    unquoted = query.replace('"', "")
    found = _LOCK_FUNCTIONS.search(unquoted) or re.search(r'\bu&"', query, re.I)
    if found is not None:
        raise UsageError(
            f"query refused: {found.group(0)} is not allowed: advisory locks would hold up "
            "laneway's own writes (its write lock is one); nothing was run"
        )
    found = _SQL_TEXT_FUNCTIONS.search(unquoted)
    if found is not None:
        raise UsageError(
            f"query refused: {found.group(0)} is not allowed: it runs SQL given as text, "
            "which `laneway sql` cannot see before it runs; nothing was run"
        )


def _refuse_privileged(cursor: Any, query: str, *, allow_privileged: bool) -> None:
    cursor.execute(
        "SELECT current_user, rolsuper, "
        "ARRAY(SELECT g FROM unnest(%s::text[]) AS g "
        "      WHERE pg_has_role(current_user, g, 'MEMBER')) "
        "FROM pg_roles WHERE rolname = current_user",
        [list(PRIVILEGED_ROLES)],
    )
    row = cursor.fetchone()
    if row is None:  # current_user always has a pg_roles row
        raise UsageError("query refused: the role it connects as is not in pg_roles")
    role, superuser, memberships = row
    if not superuser and not memberships:
        return
    what = "a superuser" if superuser else f"a member of {', '.join(memberships)}"
    if not allow_privileged:
        raise UsageError(
            f"refusing to run the query as {role}, {what}, which can read and write the "
            "database server's files: connect with a role that can only read laneway's "
            "tables (--readonly-url or LANEWAY_READONLY_DATABASE_URL; docs/deploy.md "
            "gives its grants), or pass --i-know-this-is-superuser"
        )
    # Quoted names ("pg_read_file") are the same function; U&"..." spells one in escapes.
    found = _SERVER_FUNCTIONS.search(query.replace('"', "")) or re.search(r'\bu&"', query, re.I)
    if found is not None:
        raise UsageError(
            f"query refused: {found.group(0)} is not run as {role} ({what}), even with "
            "--i-know-this-is-superuser; use a read-only role (docs/deploy.md)"
        )


def _check_one_query_with_rows(connection: Any, query: str) -> None:
    """Let the server parse the query as one unnamed prepared statement and describe it,
    without running it."""
    from psycopg import pq

    pgconn = connection.pgconn
    prepared = pgconn.prepare(b"", query.encode(connection.info.encoding))
    if prepared.status != pq.ExecStatus.COMMAND_OK:
        message = _first_line(prepared.error_message.decode(errors="replace"))
        if "cannot insert multiple commands" in message:
            raise UsageError(
                "query refused: it holds more than one statement; `laneway sql` runs one "
                "query (nothing was run)"
            )
        raise UsageError(f"query refused: {message}")
    described = pgconn.describe_prepared(b"")
    if described.status != pq.ExecStatus.COMMAND_OK:
        raise UsageError(
            f"query refused: {_first_line(described.error_message.decode(errors='replace'))}"
        )
    if described.nfields == 0:
        raise UsageError(
            "query refused: it is not a query that returns rows, so it was not run (COPY, "
            "SET, DO, DDL, transaction control and writes are refused); `laneway sql` runs "
            "one read-only query (SELECT, WITH, VALUES, TABLE, SHOW, EXPLAIN)"
        )


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else "unknown error"
    return first.removeprefix("ERROR:").strip()
