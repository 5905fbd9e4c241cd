"""The ``laneway`` command: the typer app, its commands in the order `--help` lists
them, and ``main``. Each command parses, calls one function below the CLI and renders;
they live by group in cli/commands_run.py, cli/commands_read.py,
cli/commands_services.py and cli/commands_operator.py, their shared options and helpers
in cli/common.py.

Exit codes: 0 done; 1 refused or failed (preflight refused, a run could not finish);
2 bad input (config, arguments, ids, a runtime dir with no ledger, a query `sql` refuses);
3 a run is blocked and needs an operator (halt, pause, unknown outcome); 130 interrupted.

Imports are kept to what each command needs: the heavy modules (SQLAlchemy's ORM, the
pydantic config, alembic, the controller daemon, the worker service and psutil) are
imported inside the commands that use them, so `status`, `sql` and `--help` start fast
(tests/integration/test_cli_imports.py checks which modules each one loads).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from laneway.cli import commands_operator, commands_read, commands_run, commands_services
from laneway.controller import db
from laneway.controller.errors import LanewayError, LedgerUnavailable

app = typer.Typer(
    name="laneway",
    help=(
        "A persistent pipeline controller for long-running, expensive work: nothing runs "
        "twice without an operator saying so, no evidence is lost, and every idle lane "
        "has a recorded reason."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # typer's own completion (bash, zsh, fish); values from the ledger: cli/complete.py.
    add_completion=True,
    # Plain click help: rich's renderer costs more to import than a read-only command
    # takes to run.
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    """``--version``: the installed distribution's version (importlib.metadata is
    imported only then: `--help` and every command start as fast as before)."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        typer.echo(f"laneway {version('laneway')}")
    except PackageNotFoundError:
        typer.echo("laneway (version unknown: not installed as a distribution)")
    raise typer.Exit(0)


@app.callback()
def _options(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print laneway's version and exit.",
        ),
    ] = False,
) -> None:
    """The options of `laneway` itself, before a command."""


app.command("schema")(commands_run.schema)
app.command("migrate")(commands_run.migrate)
app.command("dry-run")(commands_run.dry_run)
app.command("plan")(commands_run.plan_run)
app.command("start-pipeline")(commands_run.start_pipeline)
app.command("status")(commands_read.status)
app.command("runs")(commands_read.runs)
app.command("explain")(commands_read.explain)
app.command("report")(commands_read.report)
app.command("artifacts")(commands_read.artifacts)
app.command("logs")(commands_read.logs)
app.command("web")(commands_services.web)
app.command("worker")(commands_services.worker)
app.command("controller")(commands_services.controller)
app.command("run")(commands_run.run_pipeline)
app.command("pause")(commands_operator.pause)
app.command("stop")(commands_operator.stop)
app.command("resume")(commands_operator.resume)
app.command("halt")(commands_operator.halt)
app.command("clear-halt")(commands_operator.clear_halt)
app.command("cancel")(commands_operator.cancel)
app.command("reconcile")(commands_operator.reconcile)
app.command("retry")(commands_operator.retry)
app.command("sql", context_settings=commands_read.SQL_SETTINGS)(commands_read.sql)


def main(prog_name: str | None = None) -> None:
    try:
        app(prog_name=prog_name)
    except LanewayError as error:  # errors raised outside a command's own handling
        typer.echo(f"laneway: {error}", err=True)
        sys.exit(error.exit_code)
    except Exception as error:
        # The ledger failed in a way no command handles (a connection lost mid-way):
        # one line, never a traceback; anything else is a bug and propagates.
        from sqlalchemy.exc import DBAPIError

        if not isinstance(error, DBAPIError):
            raise
        typer.echo(f"laneway: the ledger failed: {db.describe(error)}", err=True)
        sys.exit(LedgerUnavailable.exit_code)


if __name__ == "__main__":
    main()
