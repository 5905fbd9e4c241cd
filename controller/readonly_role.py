"""The read-only role of `laneway sql` on PostgreSQL (`laneway sql-role create|check`).

A read-only transaction and SELECT-only grants stop writes, but not two things a
query can do while it runs: take an advisory lock (laneway's gate is one, so a query
holding it queues every write, heartbeats included) and run SQL built from text while
it runs (``query_to_xml('SELECT pg_' || 'advisory_lock(...)', ...)``), which no check
of the query's text can see. So the database closes both: ``create`` revokes EXECUTE
on every advisory-lock function and on every function that runs SQL text
(``FUNCTIONS``) from PUBLIC and from the role, in the ledger's database only (a
function's privileges live in that database's ``pg_proc``), and grants the advisory
locks back to the ledger's own role (the owner of its tables), which takes them.

``create`` must connect as a superuser (the functions belong to the bootstrap
superuser); ``check`` may connect as any role: it reads privileges with
``has_*_privilege`` and names each one that is not as ``create`` leaves it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from laneway.controller.errors import UsageError
from laneway.controller.sqlguard import MAX_QUERY_TIMEOUT_S, PRIVILEGED_ROLES

SQL_TEXT_FUNCTIONS = (
    "query_to_xml",
    "query_to_xmlschema",
    "query_to_xml_and_xmlschema",
    "cursor_to_xml",
    "cursor_to_xmlschema",
    "ts_stat",
    "ts_rewrite",
)
"""PostgreSQL's own functions that run SQL given as text (every overload); ``dblink*``
in any schema, where the extension is installed, is added to them."""
LEDGER_LOCKS = (
    "pg_advisory_xact_lock(bigint)",  # the gate and the order lock (controller/db.py)
    "pg_advisory_xact_lock(integer,integer)",  # a node's claim lock (controller/db.py)
    "pg_advisory_xact_lock_shared(bigint)",  # the gate, shared by workers
    "pg_try_advisory_lock(bigint)",  # the controller lock (controller/controller_lock.py)
)
"""The advisory-lock functions laneway calls: its own role keeps EXECUTE on them
(``create`` grants back every advisory-lock function)."""
ROLE_SETTINGS = {
    "default_transaction_read_only": "on",
    "statement_timeout": f"{int(MAX_QUERY_TIMEOUT_S)}s",
    "idle_in_transaction_session_timeout": "60s",
}
"""Set on the role (``ALTER ROLE ... SET``), so a ``psql`` session of it is read-only, a
query stops at `laneway sql`'s own bound, and an open transaction left idle ends."""
ELEVATED = (*PRIVILEGED_ROLES, "pg_write_all_data", "pg_signal_backend")
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_FUNCTIONS = (
    "SELECT p.oid::regprocedure::text, p.proname ~ '^pg_(try_)?advisory_', p.oid "
    "FROM pg_proc p "
    "JOIN pg_namespace n ON n.oid = p.pronamespace "
    "WHERE (n.nspname = 'pg_catalog' AND (p.proname ~ '^pg_(try_)?advisory_' "
    "OR p.proname = ANY(%s))) OR p.proname LIKE 'dblink%%' ORDER BY 1"
)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class RoleReport:
    """What ``create`` did (``created``, ``revoked``) and what ``check`` found."""

    role: str
    database: str
    schema: str
    ledger_role: str
    checks: list[Check] = field(default_factory=list)
    created: bool = False
    revoked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def role_name(value: str, what: str) -> str:
    """``value`` if it is a plain PostgreSQL role name, else UsageError naming ``what``."""
    if not _NAME.fullmatch(value) or value.startswith("pg_"):
        raise UsageError(
            f"{what} {value!r} is not a role name sql-role takes: use lower-case letters, "
            "digits and _ (at most 63, not starting with a digit or pg_), e.g. laneway_ro"
        )
    return value


def create(url: str, role: str, *, ledger_role: str | None = None) -> RoleReport:
    """Make ``role`` (or bring an existing one to these grants) in one transaction, then
    check it. Needs a superuser; the role gets no password (``ALTER ROLE ... PASSWORD``)."""
    import psycopg

    with _connect(url) as conn:
        try:
            with conn.transaction():
                report = _report(conn, role, ledger_role)
                _refuse_unfit(conn, report)
                report.created = _ensure_role(conn, role)
                _grant_reads(conn, report)
                report.revoked = _close_functions(conn, report)
                report.checks = _checks(conn, report)
        except psycopg.Error as exc:
            raise UsageError(
                f"sql-role create: the database refused it ({_first_line(exc)}); "
                "nothing was changed"
            ) from None
    return report


def check(url: str, role: str, *, ledger_role: str | None = None) -> RoleReport:
    """What ``role`` may do in the ledger's database, against what ``create`` leaves."""
    import psycopg

    with _connect(url) as conn:
        try:
            report = _report(conn, role, ledger_role)
            report.checks = _checks(conn, report)
        except psycopg.Error as exc:
            raise UsageError(f"sql-role check: {_first_line(exc)}") from None
    return report


def _connect(url: str) -> Any:
    import psycopg
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UsageError(
            "--database-url does not parse; use postgresql://USER@HOST/DATABASE"
        ) from None
    if parsed.get_backend_name() != "postgresql":
        raise UsageError(
            "--database-url must name the ledger's PostgreSQL database "
            "(postgresql://USER@HOST/DATABASE): a SQLite ledger has no roles"
        )
    where = parsed.render_as_string(hide_password=True)
    try:
        dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
        return psycopg.connect(dsn, autocommit=True)
    except psycopg.Error as exc:
        raise UsageError(f"cannot connect to {where} ({_first_line(exc)})") from None


def _one(conn: Any, sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def _report(conn: Any, role: str, ledger_role: str | None) -> RoleReport:
    database, schema = conn.execute("SELECT current_database(), current_schema()").fetchone()
    owner = _one(
        conn,
        "SELECT tableowner FROM pg_tables WHERE schemaname = %s AND tablename = 'alembic_version'",
        [schema],
    )
    if owner is None:
        raise UsageError(
            f"database {database} holds no laneway ledger in schema {schema} (no "
            "alembic_version table): point --database-url at the ledger's database"
        )
    ledger = role_name(ledger_role, "--ledger-role") if ledger_role else str(owner)
    if ledger_role and _one(conn, "SELECT 1 FROM pg_roles WHERE rolname = %s", [ledger]) is None:
        raise UsageError(f"--ledger-role {ledger}: no such role")
    if role == ledger:
        raise UsageError(
            f"{role} is the ledger's own role (it owns laneway's tables and takes its "
            "locks): name another role for `laneway sql`"
        )
    return RoleReport(role=role, database=database, schema=schema, ledger_role=ledger)


def _refuse_unfit(conn: Any, report: RoleReport) -> None:
    if not _one(conn, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"):
        raise UsageError(
            "sql-role create must connect as a superuser: PostgreSQL's own functions "
            "belong to it, and only it may revoke them (--database-url "
            "postgresql://postgres@HOST/DATABASE); `sql-role check` runs as any role"
        )
    elevated = _elevated(conn, report.role)
    if elevated:
        raise UsageError(
            f"role {report.role} exists and is {elevated}: sql-role create makes a role "
            "that can only read; name another role, or take that away first"
        )


def _elevated(conn: Any, role: str) -> str:
    """What makes an existing ``role`` more than a reader, in words ('' if nothing)."""
    row = conn.execute(
        "SELECT rolsuper, rolcreaterole, rolcreatedb, rolbypassrls, "
        "ARRAY(SELECT g FROM unnest(%s::text[]) AS g WHERE pg_has_role(rolname, g, 'MEMBER')) "
        "FROM pg_roles WHERE rolname = %s",
        [list(ELEVATED), role],
    ).fetchone()
    if row is None:
        return ""
    flags = zip(("SUPERUSER", "CREATEROLE", "CREATEDB", "BYPASSRLS"), row[:4], strict=True)
    found = [word for word, on in flags if on] + [f"a member of {g}" for g in row[4]]
    return ", ".join(found)


def _ensure_role(conn: Any, role: str) -> bool:
    from psycopg import sql

    name = sql.Identifier(role)
    created = _one(conn, "SELECT 1 FROM pg_roles WHERE rolname = %s", [role]) is None
    if created:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(name))
    for setting, value in ROLE_SETTINGS.items():
        conn.execute(
            sql.SQL("ALTER ROLE {} SET {} = {}").format(
                name, sql.Identifier(setting), sql.Literal(value)
            )
        )
    return created


def _grant_reads(conn: Any, report: RoleReport) -> None:
    from psycopg import sql

    role, schema = sql.Identifier(report.role), sql.Identifier(report.schema)
    for statement in (
        "GRANT CONNECT ON DATABASE {database} TO {role}",
        "GRANT USAGE ON SCHEMA {schema} TO {role}",
        "GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}",
        "ALTER DEFAULT PRIVILEGES FOR ROLE {ledger} IN SCHEMA {schema} "
        "GRANT SELECT ON TABLES TO {role}",
    ):
        conn.execute(
            sql.SQL(statement).format(
                database=sql.Identifier(report.database),
                role=role,
                schema=schema,
                ledger=sql.Identifier(report.ledger_role),
            )
        )


def _close_functions(conn: Any, report: RoleReport) -> list[str]:
    from psycopg import sql

    role, ledger = sql.Identifier(report.role), sql.Identifier(report.ledger_role)
    closed = []
    for signature, is_lock, _oid in _functions(conn):
        function = sql.SQL(signature)  # regprocedure's own text: quoted where it must be
        conn.execute(
            sql.SQL("REVOKE EXECUTE ON FUNCTION {} FROM PUBLIC, {}").format(function, role)
        )
        if is_lock:
            conn.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(function, ledger))
        closed.append(signature)
    return closed


def _functions(conn: Any) -> list[tuple[str, bool, int]]:
    """(signature, is an advisory lock, oid) of every function in ``FUNCTIONS``."""
    return [tuple(row) for row in conn.execute(_FUNCTIONS, [list(SQL_TEXT_FUNCTIONS)])]


def _checks(conn: Any, report: RoleReport) -> list[Check]:
    login = _one(conn, "SELECT rolcanlogin FROM pg_roles WHERE rolname = %s", [report.role])
    if login is None:
        fix = f"run `laneway sql-role create {report.role}` as a superuser"
        return [Check("login", False, f"there is no role {report.role}: {fix}")]
    found = [Check("login", bool(login), "may log in" if login else "has NOLOGIN")]
    for step in (_plain, _reads, _writes_nothing, _no_locks_or_sql_text, _read_only, _later):
        found.append(step(conn, report))
    found.append(_ledger_locks(conn, report))
    return found


def _plain(conn: Any, report: RoleReport) -> Check:
    elevated = _elevated(conn, report.role)
    return Check(
        "plain",
        not elevated,
        f"is {elevated}" if elevated else f"no superuser, role attribute or {', '.join(ELEVATED)}",
    )


_RELATIONS = (
    "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = %s AND c.relkind = ANY(%s) AND {test} ORDER BY 1"
)


def _relations(conn: Any, report: RoleReport, kinds: str, test: str = "true") -> list[str]:
    """The relations of the ledger's schema of ``kinds`` (pg_class.relkind) for which
    ``test`` (of the role, ``%s``) holds."""
    params = [report.schema, list(kinds), *([report.role] if "%s" in test else [])]
    return [row[0] for row in conn.execute(_RELATIONS.format(test=test), params)]


def _reads(conn: Any, report: RoleReport) -> Check:
    can_connect = _one(
        conn, "SELECT has_database_privilege(%s, current_database(), 'CONNECT')", [report.role]
    )
    if not can_connect:
        return Check("reads", False, f"has no CONNECT on database {report.database}")
    every = _relations(conn, report, "rvmp")
    missing = _relations(conn, report, "rvmp", "NOT has_table_privilege(%s, c.oid, 'SELECT')")
    if missing:
        return Check("reads", False, f"cannot SELECT {_some(missing)} (of {len(every)})")
    return Check("reads", True, f"SELECT on all {len(every)} tables and views of {report.schema}")


def _writes_nothing(conn: Any, report: RoleReport) -> Check:
    writes = _relations(
        conn, report, "rvmp", "has_table_privilege(%s, c.oid, 'INSERT,UPDATE,DELETE,TRUNCATE')"
    ) + _relations(conn, report, "S", "has_sequence_privilege(%s, c.oid, 'USAGE,UPDATE')")
    creates = _one(
        conn, "SELECT has_schema_privilege(%s, %s, 'CREATE')", [report.role, report.schema]
    )
    if creates:
        writes.append(f"CREATE on schema {report.schema}")
    if writes:
        return Check("writes_nothing", False, f"may write: {_some(writes)}")
    return Check("writes_nothing", True, "no INSERT, UPDATE, DELETE, TRUNCATE or CREATE")


def _no_locks_or_sql_text(conn: Any, report: RoleReport) -> Check:
    open_ = [
        str(row[0])
        for row in conn.execute(
            f"SELECT f.signature FROM ({_FUNCTIONS}) AS f (signature, is_lock, oid) "
            "WHERE has_function_privilege(%s, f.oid, 'EXECUTE')",
            [list(SQL_TEXT_FUNCTIONS), report.role],
        )
    ]
    if open_:
        fix = f"run `laneway sql-role create {report.role}` as a superuser"
        return Check("no_locks", False, f"may run {_some(open_)}: {fix}")
    return Check("no_locks", True, "no advisory-lock function and no function that runs SQL text")


def _read_only(conn: Any, report: RoleReport) -> Check:
    settings = dict(
        str(item).split("=", 1)
        for (item,) in conn.execute(
            "SELECT unnest(setconfig) FROM pg_db_role_setting s "
            "JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = %s AND s.setdatabase IN "
            "(0, (SELECT oid FROM pg_database WHERE datname = current_database())) "
            "ORDER BY s.setdatabase",  # this database's settings win over the role's own
            [report.role],
        )
    )
    value = settings.get("default_transaction_read_only", "off")
    ok = value.lower() in ("on", "true", "yes", "1")
    return Check("read_only", ok, f"default_transaction_read_only = {value}")


def _later(conn: Any, report: RoleReport) -> Check:
    granted = _one(
        conn,
        "SELECT true FROM pg_default_acl d, aclexplode(d.defaclacl) a "
        "WHERE d.defaclrole = (SELECT oid FROM pg_roles WHERE rolname = %s) "
        "AND d.defaclnamespace = (SELECT oid FROM pg_namespace WHERE nspname = %s) "
        "AND d.defaclobjtype = 'r' AND a.privilege_type = 'SELECT' "
        "AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = %s)",
        [report.ledger_role, report.schema, report.role],
    )
    what = f"tables {report.ledger_role} creates later (an upgrade's migrations)"
    return Check("later_tables", bool(granted), ("reads " if granted else "cannot read ") + what)


def _ledger_locks(conn: Any, report: RoleReport) -> Check:
    missing = [
        signature
        for signature in LEDGER_LOCKS
        if not _one(
            conn,
            "SELECT has_function_privilege(%s, %s::regprocedure, 'EXECUTE')",
            [report.ledger_role, signature],
        )
    ]
    if missing:
        return Check(
            "ledger_locks",
            False,
            f"laneway's own role {report.ledger_role} cannot run {_some(missing)}, so its "
            "writes fail: `laneway sql-role create` grants them back",
        )
    return Check("ledger_locks", True, f"{report.ledger_role} keeps laneway's advisory locks")


def _some(names: list[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
