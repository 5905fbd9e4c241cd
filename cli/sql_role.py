"""`laneway sql-role create|check NAME`: the read-only role of `laneway sql` on
PostgreSQL, made or checked by ``controller.readonly_role``. Registered by cli/main.py.

Exit codes: 0 the role is as it should be (made so, for `create`); 1 `check` found
something that is not (each named on its own line); 2 bad input (a name, a URL that is
not PostgreSQL, a database without a ledger, `create` not run as a superuser).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from laneway.cli import common, render
from laneway.cli.common import JsonFlag
from laneway.controller.errors import UsageError


class RoleAction(StrEnum):
    create = "create"
    check = "check"


def sql_role(
    action: Annotated[
        RoleAction,
        typer.Argument(
            help="create: make the role (or bring an existing one to these grants), then "
            "check it; check: say what the role may do that it should not.",
            show_default=False,
        ),
    ],
    name: Annotated[str, typer.Argument(help="The role's name, e.g. laneway_ro.")],
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            envvar="LANEWAY_DATABASE_URL",
            show_default=False,
            help="The ledger's PostgreSQL database (postgresql://USER@HOST/DB; env "
            "LANEWAY_DATABASE_URL). create connects as a superuser; check as any role.",
        ),
    ] = None,
    ledger_role: Annotated[
        str | None,
        typer.Option(
            "--ledger-role",
            show_default=False,
            help="laneway's own role, which keeps the advisory locks and whose later "
            "tables the role may read (default: the owner of the ledger's tables).",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Make or check the read-only PostgreSQL role for `laneway sql` and psql.

    create (as a superuser) makes the role LOGIN with default_transaction_read_only,
    a statement timeout and an idle-in-transaction timeout; grants it CONNECT, USAGE on
    the ledger's schema and SELECT on its tables and views, now and later; and, in the
    ledger's database only, revokes EXECUTE on every advisory-lock function and on
    every function that runs SQL text (query_to_xml*, cursor_to_xml*, ts_stat,
    ts_rewrite, dblink*) from PUBLIC and the role, granting the advisory locks back to
    laneway's own role. check names each thing the role may do that create takes away,
    and exits 1 if there is one. docs/deploy.md, section 8.
    """
    from laneway.controller import readonly_role

    with common.refusals(as_json):
        readonly_role.role_name(name, "NAME")
        if ledger_role:
            readonly_role.role_name(ledger_role, "--ledger-role")
        if not database_url:
            raise UsageError(
                "sql-role needs the ledger's database: --database-url "
                "postgresql://USER@HOST/DB (or LANEWAY_DATABASE_URL)"
            )
        run = readonly_role.create if action is RoleAction.create else readonly_role.check
        report = run(database_url, name, ledger_role=ledger_role)
    common.emit(report.as_dict(), as_json, _text)
    if not report.ok:
        raise typer.Exit(1)


def _text(data: dict[str, object]) -> str:
    lines = []
    if data["revoked"]:
        revoked = data["revoked"]
        assert isinstance(revoked, list)
        lines.append(
            f"{'created' if data['created'] else 'updated'} role {data['role']} in "
            f"{data['database']}; EXECUTE revoked from PUBLIC and {data['role']} on "
            f"{len(revoked)} functions, the advisory locks granted back to "
            f"{data['ledger_role']}"
        )
    checks = data["checks"]
    assert isinstance(checks, list)
    rows = [["ok" if c["ok"] else "FAIL", c["name"], c["detail"]] for c in checks]
    lines.append(render.table(["", "check", "detail"], rows))
    verdict = "can only read" if data["ok"] else "can do more than read: see FAIL above"
    lines.append(f"role {data['role']} on {data['database']} {verdict}")
    return "\n".join(lines)
