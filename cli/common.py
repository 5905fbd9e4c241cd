"""What every ``laneway`` command shares: the option types, and the helpers that refuse,
render, log lifecycle lines and catch signals.

Light on imports (typer and the small controller modules): every command module
imports this, and `status`, `sql` and `--help` must start fast
(tests/integration/test_cli_imports.py).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from laneway.cli import render
from laneway.controller import db, ledger_open, limits
from laneway.controller.clock import SystemClock, iso
from laneway.controller.errors import ConfigError, LanewayError, UsageError

if TYPE_CHECKING:
    from sqlalchemy import Engine

RETRY_SECONDS = 15.0
"""How long an operator's write retries a ledger that is unreachable or locked."""
MAX_ID = 2**31 - 1  # controller/ids.py: INTEGER id columns on PostgreSQL
DEFAULT_RUNTIME = Path(".laneway")


def _runtime_dir(value: Path) -> Path:
    """``--runtime-dir``: a path that resolves (a symlink loop is refused here, in one
    line, rather than deep inside every command)."""
    try:
        value.resolve()
    except (RuntimeError, OSError) as exc:
        fail(UsageError(f"--runtime-dir {value}: does not resolve ({exc}); pass a directory"))
    return value


def finite(value: float | None) -> float | None:
    """A number option's callback: ``nan`` and ``inf`` refused (a ``min``/``max`` range
    lets ``nan`` through, since every comparison with it is false)."""
    problem = None if value is None else limits.float_problem(value)
    if problem:
        raise typer.BadParameter(f"{problem}; give one in seconds")
    return value


RuntimeDir = Annotated[
    Path,
    typer.Option(
        "--runtime-dir",
        envvar="LANEWAY_RUNTIME_DIR",
        callback=_runtime_dir,
        help="Where the ledger and runs/ live (env LANEWAY_RUNTIME_DIR).",
    ),
]


def _use_database_url(value: str | None) -> str | None:
    """``--database-url`` wins over the environment: it is put where every part of
    laneway (and every service ``laneway run`` starts) reads the URL from."""
    if value:
        problem = db.url_problem(value)
        if problem:
            fail(UsageError(f"--database-url / LANEWAY_DATABASE_URL: {problem}"))
        os.environ["LANEWAY_DATABASE_URL"] = value
    return value


DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="LANEWAY_DATABASE_URL",
        callback=_use_database_url,
        show_default=False,
        help=(
            "The ledger: postgresql://USER@HOST/DB for workers on several machines "
            "(needs pip install 'laneway[postgres]'), or sqlite:///PATH; default: "
            "the SQLite file in --runtime-dir (env LANEWAY_DATABASE_URL). Put a password "
            "in ~/.pgpass or PGPASSWORD, not in the URL."
        ),
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
ConfigPath = Annotated[Path, typer.Argument(help="Pipeline config, .toml or .json.")]


def actor() -> str:
    """Who is acting, as recorded in the ledger: user@host."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{os.uname().nodename}"


def emit(data: Any, as_json: bool, text_form: Callable[[Any], str]) -> None:
    typer.echo(render.as_json(data) if as_json else text_form(data))


def fail(error: LanewayError, as_json: bool = False) -> None:
    """Print ``error``'s lines (or one JSON object) and exit with its code."""
    if isinstance(error, ConfigError):
        lines = error.problems
    elif hasattr(error, "reasons"):
        lines = list(error.reasons)
    else:
        lines = [str(error)]
    if as_json:
        typer.echo(render.as_json({"ok": False, "error": type(error).__name__, "problems": lines}))
    else:
        for line in lines:
            typer.echo(f"laneway: {line}", err=True)
    raise typer.Exit(error.exit_code)


@contextmanager
def refusals(as_json: bool = False) -> Iterator[None]:
    """A ``LanewayError`` raised inside ends the command through ``fail``."""
    try:
        yield
    except LanewayError as error:
        fail(error, as_json)


def writer(runtime_dir: Path) -> Engine:
    """An engine on an existing ledger for an operator's write (controls, cancel,
    reconcile, retry): no ledger is created, and an unknown revision is refused."""
    return ledger_open.open_writer(runtime_dir)


def reader(runtime_dir: Path) -> Engine:
    """A read-only engine on an existing ledger at the head revision (the ORM models
    need its columns), checked without alembic."""
    engine = db.make_engine(ledger_open.existing_ledger_url(runtime_dir), readonly=True)
    ledger_open.check_known_revision(engine, head=True)
    return engine


def job_id(engine: Any, job: str, run: int | None) -> int:
    """A job named by its id, or as ITEM.STAGE in ``run`` (default: the newest run)."""
    from laneway.controller.ids import parse_id
    from laneway.controller.logs import job_by_name
    from laneway.controller.rows import SessionRows

    number = parse_id(job)
    if number is not None:
        return number
    if "." not in job:
        raise UsageError(f"{job!r}: name a job by its id or as ITEM.STAGE")
    with db.session_factory(engine)() as session:
        return job_by_name(SessionRows(session), job, run)


def reason_given(reason: str) -> str:
    """``--reason``, which must say something (it is recorded)."""
    if not reason.strip():
        raise UsageError("--reason must say why (it is recorded in the ledger)")
    return reason.strip()


class Log:
    """Lifecycle lines on stderr: words, or one JSON object per line with --json."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def __call__(self, event: str, words: str, **fields: Any) -> None:
        if self.as_json:
            payload = {"event": event, "at": iso(SystemClock().now()), **fields}
            typer.echo(json.dumps(payload, default=str), err=True)
        else:
            typer.echo(words, err=True)


def interrupt(_signum: int, _frame: Any) -> None:
    """SIGTERM ends a server the way Ctrl-C does."""
    raise KeyboardInterrupt


class Stopper:
    """SIGTERM/SIGINT set a flag; a second signal asks to leave at once."""

    def __init__(self, log: Log | None = None, *, drains: bool = True) -> None:
        self.signals = 0
        self.log = log or Log(False)
        self.drains = drains
        signal.signal(signal.SIGTERM, self._on)
        signal.signal(signal.SIGINT, self._on)

    def _on(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        if self.signals == 1:
            words = (
                "laneway: stopping — no new dispatch; waiting for running attempts "
                "(signal again to leave them running under their supervisors)"
                if self.drains
                else "laneway: stopping"
            )
            self.log("stopping", words, signal=signum)

    def stop(self) -> bool:
        return self.signals > 0

    def abort(self) -> bool:
        return self.signals > 1
