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

import importlib
import sys
from collections.abc import Iterator, MutableMapping
from typing import Annotated, Any

import typer
import typer.core
import typer.main

from laneway.controller.errors import LanewayError, LedgerUnavailable

COMMANDS: dict[str, tuple[str, str, str]] = {
    "schema": ("commands_run", "schema", "Print the JSON Schema of a pipeline config."),
    "migrate": (
        "commands_run",
        "migrate",
        "Create the ledger, or upgrade it to this laneway's schema, and print its revision.",
    ),
    "dry-run": (
        "commands_run",
        "dry_run",
        "Validate a config and print its plan; writes nothing.",
    ),
    "plan": (
        "commands_run",
        "plan_run",
        "What a new run of CONFIG would do, before anything is created: per stage, how "
        "many jobs would be reused (from which run; with --reuse-despite, how many of them "
        "although a file changed) and how many would run, and why (which file, field, "
        "definition or input changed; what it needs runs again; new), what a paid stage's "
        "jobs cost (measured from earlier attempts' usage, else expected_usage), then the "
        "expected spend against each budget. Reads the ledger only. Exit 1 if preflight "
        "refuses, 2 if the config is invalid.",
    ),
    "start-pipeline": (
        "commands_run",
        "start_pipeline",
        "Preflight a config and freeze it into a new run.",
    ),
    "status": (
        "commands_read",
        "status",
        "Show a run: controls, unknowns, jobs, running attempts, workers, lanes and why they idle.",
    ),
    "runs": (
        "commands_read",
        "runs",
        "List the runs, newest first: state, times, jobs by state, and what holds each.",
    ),
    "explain": (
        "commands_read",
        "explain",
        "List everything that blocks one job now, with the capacity arithmetic.",
    ),
    "report": (
        "commands_read",
        "report",
        "Where a run's hours went, per lane, with an HTML lane-occupancy timeline.",
    ),
    "artifacts": (
        "commands_read",
        "artifacts",
        "List a run's artifacts: the outputs its succeeded attempts stored.",
    ),
    "logs": (
        "commands_read",
        "logs",
        "Print an attempt's output (redacted as it was written), or follow it.",
    ),
    "web": (
        "commands_services",
        "web",
        "Serve a read-only dashboard of the ledger, and Prometheus metrics at /metrics.",
    ),
    "worker": (
        "commands_services",
        "worker",
        "Run the worker service of one node: lease, supervise, settle, heartbeat.",
    ),
    "controller": (
        "commands_services",
        "controller",
        "Run the controller daemon: leases, lost workers, promotion, closing, snapshots.",
    ),
    "run": (
        "commands_run",
        "run_pipeline",
        "Start a pipeline and run it here, in the foreground, until it finishes.",
    ),
    "pause": (
        "commands_operator",
        "pause",
        "Pause dispatch (resumable): running attempts go on; nothing new starts.",
    ),
    "stop": (
        "commands_operator",
        "stop",
        "Drain: no new dispatch; running attempts finish and settle. `resume` lifts it.",
    ),
    "resume": (
        "commands_operator",
        "resume",
        "Lift pauses and stops (not halts: those need `clear-halt`).",
    ),
    "halt": (
        "commands_operator",
        "halt",
        "Halt dispatch (fatal): only `clear-halt` with a reason lifts it.",
    ),
    "clear-halt": ("commands_operator", "clear_halt", "Lift halts, with a recorded reason."),
    "cancel": (
        "commands_operator",
        "cancel",
        "Cancel a running attempt, or a whole run (--run): TERM, grace, KILL, verified.",
    ),
    "reconcile": (
        "commands_operator",
        "reconcile",
        "Settle an unknown attempt as succeeded, failed or not-run, with a reason.",
    ),
    "retry": (
        "commands_operator",
        "retry",
        "Make failed jobs ready for a new attempt (new idempotency key), with a reason.",
    ),
    "sql": ("commands_read", "sql", "Run one read-only SQL query against the ledger."),
    "sql-role": (
        "sql_role",
        "sql_role",
        "Make or check the read-only PostgreSQL role for `laneway sql` and psql.",
    ),
}
"""The commands in the order `--help` lists them: name → (module of cli/, function, the
first paragraph of the function's docstring, which `--help` shortens into its line).
A command's module is imported, and its click command built, only when it is run (or
its own `--help` shown); tests/integration/test_quick_reads_cli.py checks the summaries
against the docstrings and `--help` against the eagerly built group."""

CONTEXT_SETTINGS = {"sql": "SQL_SETTINGS"}
"""The commands registered with context settings: the name of the module's constant."""


def build_command(name: str) -> typer.core.TyperCommand:
    """Command ``name``'s click command: its module imported, its parameters read from
    its function's signature (typer's own conversion)."""
    module_name, function, _summary = COMMANDS[name]
    module = importlib.import_module(f"laneway.cli.{module_name}")
    settings = CONTEXT_SETTINGS.get(name)
    info = typer.models.CommandInfo(
        name=name,
        callback=getattr(module, function),
        context_settings=getattr(module, settings) if settings else None,
    )
    command = typer.main.get_command_from_info(
        info, pretty_exceptions_short=app.pretty_exceptions_short, rich_markup_mode=None
    )
    assert isinstance(command, typer.core.TyperCommand)
    return command


class _Commands(MutableMapping[str, Any]):
    """The group's commands by name, in ``COMMANDS`` order; each built on first use."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}
        self._names = list(COMMANDS)

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in COMMANDS:
                raise KeyError(name)
            self._built[name] = build_command(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command
        if name not in self._names:
            self._names.append(name)

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)
        self._built.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def built(self, name: str) -> bool:
        return name in self._built


class LazyGroup(typer.core.TyperGroup):
    """`laneway`'s group: every command listed, none imported until it is run. `--help`
    lists them from ``COMMANDS``' summaries (what their docstrings say, checked by a
    test) without importing any."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _Commands()

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """As typer's, from each command's summary (a built command's own help)."""
        commands = self.commands
        assert isinstance(commands, _Commands)
        rows = []
        limit = formatter.width - 6 - max(len(name) for name in commands)
        for name in commands:
            if commands.built(name) or name not in COMMANDS:
                command = commands[name]
                if command.hidden:
                    continue
            else:
                command = typer.core.TyperCommand(name=name, help=COMMANDS[name][2])
            rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


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
    cls=LazyGroup,
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

        from laneway.controller import db

        if not isinstance(error, DBAPIError):
            raise
        typer.echo(f"laneway: the ledger failed: {db.describe(error)}", err=True)
        sys.exit(LedgerUnavailable.exit_code)


if __name__ == "__main__":
    main()
