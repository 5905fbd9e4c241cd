"""The ``laneway`` command. Parses arguments, calls the controller/worker, renders.

Exit codes: 0 done; 1 refused or failed (preflight refused, a run could not finish);
2 bad input (config, arguments, ids, a runtime dir with no ledger, a query `sql` refuses);
3 a run is blocked and needs an operator (halt, pause, unknown outcome); 130 interrupted.

Imports are kept to what each command needs: the heavy modules (SQLAlchemy's ORM, the
pydantic config, alembic, the controller daemon, the worker service and psutil) are
imported inside the commands that use them, so `status`, `sql` and `--help` start fast
(tests/integration/test_cli_imports.py checks which modules each one loads).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import complete, render
from controller import db, limits
from controller.clock import SystemClock, iso
from controller.errors import (
    ConfigError,
    LanewayError,
    LedgerUnavailable,
    UsageError,
)
from controller.states import ControlKind, ControlScope

if TYPE_CHECKING:
    from sqlalchemy import Engine

EXIT_BLOCKED = 3
RETRY_SECONDS = 15.0
"""How long an operator's write retries a ledger that is unreachable or locked."""
MAX_ID = 2**31 - 1  # controller/ids.py: INTEGER id columns on PostgreSQL
BLOCKING_REASONS = {"halted", "unknown_outcome", "paused", "stopped"}

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


def _runtime_dir(value: Path) -> Path:
    """``--runtime-dir``: a path that resolves (a symlink loop is refused here, in one
    line, rather than deep inside every command)."""
    try:
        value.resolve()
    except (RuntimeError, OSError) as exc:
        raise typer.BadParameter(f"{value} does not resolve ({exc}); pass a directory") from None
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
            raise typer.BadParameter(problem)
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
DEFAULT_RUNTIME = Path(".laneway")


def _actor() -> str:
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{os.uname().nodename}"


def _emit(data: Any, as_json: bool, text_form: Callable[[Any], str]) -> None:
    typer.echo(render.as_json(data) if as_json else text_form(data))


def _fail(error: LanewayError, as_json: bool = False) -> None:
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


def _writer(runtime_dir: Path) -> Engine:
    """An engine on an existing ledger for an operator's write (controls, cancel,
    reconcile, retry): no ledger is created, and an unknown revision is refused."""
    return db.open_writer(runtime_dir)


def _reader(runtime_dir: Path) -> Engine:
    """A read-only engine on an existing ledger at the head revision (the ORM models
    need its columns), checked without alembic."""
    engine = db.make_engine(db.existing_ledger_url(runtime_dir), readonly=True)
    db.check_known_revision(engine, head=True)
    return engine


@app.command()
def schema(
    as_json: Annotated[bool, typer.Option("--json", help="Accepted; the schema is JSON.")] = True,
) -> None:
    """Print the JSON Schema of a pipeline config."""
    from controller import config as config_module

    typer.echo(render.as_json(config_module.json_schema()))


@app.command()
def migrate(
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Create the ledger, or upgrade it to this laneway's schema, and print its revision.

    Every command that writes (`start-pipeline`, `run`, `controller`, `worker`) does this
    too when it starts, in one transaction (two starting at once take turns); run it on
    its own to upgrade a PostgreSQL ledger before restarting the services of several
    machines (docs/deploy.md). A ledger newer than this laneway is refused.
    """
    try:
        engine = db.open_ledger(runtime_dir)
        revision = db.current_revision(engine)
        shown = db.shown_url(engine.url.render_as_string(hide_password=False))
        engine.dispose()
    except LanewayError as error:
        _fail(error, as_json)
        return
    body = {"ok": True, "ledger": shown, "revision": revision, "head": db.head_revision()}
    _emit(body, as_json, lambda b: f"ledger {b['ledger']} is at revision {b['revision']} (head)")


@app.command("dry-run")
def dry_run(config: ConfigPath, as_json: JsonFlag = False) -> None:
    """Validate a config and print its plan; writes nothing.

    The plan: items, jobs per stage and lane, capacity arithmetic, and the first
    admission decisions with their reasons. Exit 1 if preflight refuses, 2 if the
    config is invalid.
    """
    from controller import config as config_module
    from controller import pipeline, usage
    from workers.service import psutil_memory

    try:
        parsed = config_module.load_config(config)
        reasons, _ = pipeline.preflight(parsed)
    except LanewayError as error:
        _fail(error, as_json)
        return
    plan = pipeline.plan(parsed, mem_available_mib=psutil_memory()[0])
    plan["preflight"] = {"ok": not reasons, "reasons": reasons}
    # What would run: each stage's argv for the first item, as a worker renders it
    # (values in a shell's -c script quoted), so a user sees it before anything runs.
    plan["argv_preview"] = config_module.preview_argv(parsed)
    plan["budgets"] = usage.budget_plan(
        parsed,
        {stage: sum(lanes.values()) for stage, lanes in plan["jobs_per_stage_and_lane"].items()},
    )
    if as_json:
        typer.echo(render.as_json(plan))
    else:
        typer.echo(render.plan_text(plan))
        for line in usage.budget_plan_lines(plan["budgets"]):
            typer.echo(line)
        if plan["argv_preview"]:
            typer.echo("")
            typer.echo(f"argv of the first item ({parsed.items[0].key}) per stage:")
            for stage_name, argv in plan["argv_preview"].items():
                typer.echo(f"  {stage_name}: {shlex.join(argv)}")
        typer.echo("")
        typer.echo("preflight: ok" if not reasons else "preflight: REFUSED")
        for reason in reasons:
            typer.echo(f"  {reason}")
    if reasons:
        raise typer.Exit(1)


RerunOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rerun",
        help="Run this stage's jobs even where an earlier run's result could be reused "
        "(repeatable; `all`: every stage).",
        show_default=False,
    ),
]
NewOpt = Annotated[
    bool,
    typer.Option(
        "--new",
        help="Start a new run even though the ledger holds an unfinished run of this "
        "pipeline (without it, that is refused: continue it with `laneway run --continue`).",
    ),
]


@app.command("start-pipeline")
def start_pipeline(
    config: ConfigPath,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    controller: Annotated[
        bool,
        typer.Option(
            "--controller/--no-controller",
            help="Start `laneway controller` in the background if none runs for this "
            "runtime dir (log: RUNTIME_DIR/controller.log).",
        ),
    ] = True,
    new: NewOpt = False,
    rerun: RerunOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Preflight a config and freeze it into a new run.

    Checks the config, paths, executables, source files and secret references; on any
    refusal exits 1 with the reasons and creates nothing. Otherwise creates the run's
    items and jobs (respecting batch_cap) and makes sure a controller runs. Never clears
    a pause or halt.
    """
    from controller import config as config_module
    from controller import daemon as daemon_module
    from controller import pipeline

    try:
        parsed = config_module.load_config(config)
        run_id, engine = pipeline.start_run(
            parsed, runtime_dir=runtime_dir, actor=_actor(), new=new, rerun=rerun
        )
        engine.dispose()
    except LanewayError as error:
        _fail(error, as_json)
        return
    runtime = runtime_dir.resolve()
    controller_pid = daemon_module.running_controller(runtime)
    started = False
    if controller and controller_pid is None:
        controller_pid = daemon_module.start_background_controller(runtime)
        started = True
    result = {
        "ok": True,
        "run_id": run_id,
        "runtime_dir": str(runtime),
        "controller_pid": controller_pid,
        "controller_started": started,
    }

    def text_form(r: dict[str, Any]) -> str:
        lines = [f"run {r['run_id']} created in {r['runtime_dir']}"]
        if r["controller_pid"] is None:
            lines.append("no controller runs for it: start `laneway controller`")
        else:
            verb = "started" if r["controller_started"] else "already running"
            lines.append(f"controller {verb} (pid {r['controller_pid']})")
        lines.append(
            f"next: laneway worker --node NODE --runtime-dir {r['runtime_dir']} (one per node)"
        )
        return "\n".join(lines)

    _emit(result, as_json, text_form)


@app.command()
def status(
    run: Annotated[
        int | None,
        typer.Argument(
            help="Run id (default: the newest).",
            min=1,
            max=MAX_ID,
            autocompletion=complete.runs,
        ),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Refresh every 2 s: a live display on a terminal; elsewhere (or with "
            "--json) one line per change.",
        ),
    ] = False,
) -> None:
    """Show a run: controls, unknowns, jobs, running attempts, workers, lanes and why they idle.

    A lane whose node no live worker serves says `no_worker`, with the `laneway worker`
    command that starts one. Reads the ledger only (SQLite opened read-only).
    """
    from controller.status import status_report

    progress = None
    try:
        with db.ReadOnlyLedger(runtime_dir) as source:
            if watch:
                from cli import live

                progress = live.Progress(run, as_json=as_json, stream=sys.stdout)
            while True:
                with source.snapshot():
                    report = status_report(source, run, now=source.now())
                    if progress is not None:
                        progress.show(report, source)
                if progress is None:
                    if report["unknown"]:
                        from controller import evidence

                        evidence.mark_conclusive(source, report)
                    _emit(report, as_json, render.status_text)
                    return
                time.sleep(2)
    except LanewayError as error:
        _fail(error, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        if progress is not None:
            progress.close()


class _Log:
    """Lifecycle lines on stderr: words, or one JSON object per line with --json."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def __call__(self, event: str, words: str, **fields: Any) -> None:
        if self.as_json:
            payload = {"event": event, "at": iso(SystemClock().now()), **fields}
            typer.echo(json.dumps(payload, default=str), err=True)
        else:
            typer.echo(words, err=True)


@app.command()
def explain(
    job: Annotated[
        str,
        typer.Argument(
            help="The job: its id (see `status`/`sql`), or ITEM.STAGE (in --run, default "
            "the newest run).",
            autocompletion=complete.jobs,
        ),
    ],
    run: Annotated[
        int | None,
        typer.Option("--run", min=1, max=MAX_ID, help="The run an ITEM.STAGE is in."),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """List everything that blocks one job now, with the capacity arithmetic.

    First, if no live worker serves the job's node, that, with the command that starts
    one. For a failed, cancelled or skipped job: its last attempt's outcome, exit code or
    signal, directory, the last lines of its stderr.log, and the `laneway retry` command.
    """
    from controller.status import explain_job

    try:
        engine = _reader(runtime_dir)
        job_id = _job_id(engine, job, run)
        with db.session_factory(engine)() as session:
            report = explain_job(session, job_id, now=db.ledger_now(session, SystemClock()))
    except LanewayError as error:
        _fail(error, as_json)
        return
    _emit(report, as_json, render.explain_text)


@app.command()
def report(
    run: Annotated[
        int | None, typer.Argument(help="Run id (default: the newest).", min=1, max=MAX_ID)
    ] = None,
    html_path: Annotated[
        Path | None,
        typer.Option("--html", help="Where to write the HTML (default runs/RUN/report.html)."),
    ] = None,
    idle_min_seconds: Annotated[
        float, typer.Option("--idle-min-seconds", min=0, help="Shortest idle period listed.")
    ] = 1.0,
    yield_keys: Annotated[
        list[str] | None,
        typer.Option(
            "--yield",
            help="A usage key whose output per hour is reported (repeatable; default: all).",
            show_default=False,
        ),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Where a run's hours went, per lane, with an HTML lane-occupancy timeline.

    Start intervals, share of time with every slot idle, throughput, stage duration
    percentiles, queue wait, failures by class, idle periods with their recorded reasons.
    Writes the HTML atomically; reads the ledger only.
    """
    from controller import durable, ledger
    from controller import report as report_module

    try:
        engine = _reader(runtime_dir)
        with db.session_factory(engine)() as session:
            run_row = ledger.get_run(session, run)
            body = report_module.build_report(
                session,
                run_row,
                now=db.ledger_now(session, SystemClock()),
                idle_min_seconds=idle_min_seconds,
                yield_keys=tuple(yield_keys or ()),
            )
        target = html_path or Path(run_row.runtime_dir) / "runs" / str(run_row.id) / "report.html"
        try:
            durable.write_bytes(target, report_module.render_html(body).encode())
        except OSError as exc:
            raise UsageError(f"--html {target}: cannot write it ({exc.strerror or exc})") from None
        body["html"] = str(target)
    except LanewayError as error:
        _fail(error, as_json)
        return
    _emit(body, as_json, render.report_text)


@app.command()
def artifacts(
    run: Annotated[
        int | None,
        typer.Argument(
            help="Run id (default: the newest).", min=1, max=MAX_ID, autocompletion=complete.runs
        ),
    ] = None,
    item: Annotated[
        str | None,
        typer.Option(
            "--item", metavar="KEY", help="Only the item with this key.", show_default=False
        ),
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option("--stage", metavar="NAME", help="Only this stage.", show_default=False),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """List a run's artifacts: the outputs its succeeded attempts stored.

    Per artifact: item, stage, attempt, name, size, sha256 (the first 12 hex digits;
    --json has all 64), the node that stored it and where it is (its URL in the run's
    artifact store). A job reused from an earlier run lists that run's artifacts, marked
    as reused. Reads the ledger only.
    """
    from cli import artifact_list, artifacts_text

    try:
        engine = _reader(runtime_dir)
        with db.session_factory(engine)() as session:
            listing = artifact_list.listing(session, run, item=item, stage=stage)
    except LanewayError as error:
        _fail(error, as_json)
        return
    _emit(listing, as_json, artifacts_text.artifacts_text)


@app.command()
def logs(
    target: Annotated[
        str,
        typer.Argument(
            help="An attempt id; or a job: its id with --job, or ITEM.STAGE (newest attempt).",
            show_default=False,
            autocompletion=complete.attempts,
        ),
    ],
    job: Annotated[
        bool, typer.Option("--job", help="TARGET is a job id: show its newest attempt.")
    ] = False,
    run: Annotated[
        int | None,
        typer.Option(
            "--run", help="For ITEM.STAGE: the run (default: the newest).", min=1, max=MAX_ID
        ),
    ] = None,
    stderr: Annotated[
        bool, typer.Option("--stderr", help="stderr.log instead of stdout.log.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the attempt settles.")
    ] = False,
    tail: Annotated[
        int | None, typer.Option("--tail", "-n", min=0, help="Only the last N lines first.")
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="One JSON object (with --follow: one per chunk, a line each)."),
    ] = False,
) -> None:
    """Print an attempt's output (redacted as it was written), or follow it.

    Reads the ledger read-only and the attempt's stdout.log / stderr.log under its
    directory. When that directory is on another machine (workers on several machines,
    PostgreSQL), says on which node and host it is. With --follow, prints what the
    attempt appends until it settles (or becomes unknown).
    """
    from cli import logs as logs_cli

    try:
        logs_cli.show(
            target,
            runtime_dir=runtime_dir,
            job=job,
            run=run,
            stream="stderr" if stderr else "stdout",
            follow=follow,
            tail=tail,
            as_json=as_json,
        )
    except LanewayError as error:
        _fail(error, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command()
def web(
    bind: Annotated[
        str,
        typer.Option(
            "--bind",
            help="HOST:PORT to listen on (port 0: any free port). Beyond loopback, "
            "--token-file is required.",
        ),
    ] = "127.0.0.1:8470",
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="A file holding the token every request must carry (Authorization: Bearer "
            "TOKEN, or ?token=TOKEN once in the browser).",
            show_default=False,
        ),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
) -> None:
    """Serve a read-only dashboard of the ledger, and Prometheus metrics at /metrics.

    The page shows the runs; per lane what runs and why it is idle, with the step to
    take; unknown attempts with their evidence and the exact reconcile command; controls
    with who and why; a live lane timeline; explain for any job; an attempt's log tails
    and measured peaks. It polls; nothing on it writes. Stop it with Ctrl-C.
    """
    from controller import web as web_module

    try:
        host, port = web_module.parse_bind(bind)
        token = web_module.read_token(token_file, host)
        dashboard = web_module.Dashboard(runtime_dir)
        try:
            server = web_module.make_server(dashboard, host, port, token=token)
        except OSError as exc:
            dashboard.close()
            raise UsageError(f"--bind {bind}: cannot listen ({exc.strerror or exc})") from None
    except LanewayError as error:
        _fail(error)
        return
    typer.echo(f"laneway web: serving {web_module.url_of(server)} (read-only; Ctrl-C stops it)")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        dashboard.close()


def _interrupt(_signum: int, _frame: Any) -> None:
    """SIGTERM ends a server the way Ctrl-C does."""
    raise KeyboardInterrupt


class _Stopper:
    """SIGTERM/SIGINT set a flag; a second signal asks to leave at once."""

    def __init__(self, log: _Log | None = None, *, drains: bool = True) -> None:
        self.signals = 0
        self.log = log or _Log(False)
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


@app.command()
def worker(
    node: Annotated[
        str,
        typer.Option("--node", help="The node this machine is.", autocompletion=complete.nodes),
    ],
    slots: Annotated[
        int | None,
        typer.Option(
            "--slots",
            min=1,
            max=limits.MAX_SLOTS,
            help="Attempts at once (default: the node's max_jobs from the ledger).",
            show_default=False,
        ),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    lease_seconds: Annotated[
        float,
        typer.Option(
            "--lease-seconds",
            min=1.0,
            max=limits.MAX_SECONDS,
            help="How long a claim stays this worker's without a heartbeat renewing it; "
            "past it the controller settles the attempt from its exit record or marks it "
            "unknown.",
        ),
    ] = 60.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Log lifecycle lines as JSON on stderr.")
    ] = False,
) -> None:
    """Run the worker service of one node: lease, supervise, settle, heartbeat.

    TERM/INT drains: no new dispatch, running attempts finish and settle. A second
    signal leaves them running under their supervisors. The runtime dir must hold a
    ledger already (`start-pipeline` or `run` creates it).
    """
    from controller.status import SessionRows, node_max_jobs
    from workers.service import WorkerService

    try:
        engine = db.open_existing_ledger(runtime_dir)
        if slots is None:
            with db.session_factory(engine)() as session:
                slots = node_max_jobs(SessionRows(session), node)
        service = WorkerService(
            engine,
            node=node,
            slots=slots,
            runtime_dir=runtime_dir,
            lease_seconds=lease_seconds,
            heartbeat_seconds=min(2.0, lease_seconds / 4),
        )
        worker_id = service.start()
    except LanewayError as error:
        _fail(error)
        return
    log = _Log(as_json)
    log(
        "worker_started",
        f"laneway worker {worker_id}: node {node}, {slots} slots",
        worker_id=worker_id,
        node=node,
        slots=slots,
    )
    for line in service.recovered:
        log("recovered", f"laneway worker {worker_id}: recovered {line}", line=line)
    service.on_ledger_error = lambda line: log(
        "ledger_unreachable",
        f"laneway worker {worker_id}: the ledger is not answering ({line}); retrying with "
        "backoff, running attempts stay under their supervisors",
        error=line,
    )
    service.on_ledger_back = lambda tries: log(
        "ledger_back", f"laneway worker {worker_id}: the ledger answers again", tries=tries
    )
    stopper = _Stopper(log)
    service.serve(stopper.stop)
    if service.revoked is not None:
        log(
            "worker_revoked",
            f"laneway worker {worker_id}: {service.revoked}; exiting "
            "without further ledger writes (evidence files stay)",
            reason=service.revoked,
        )
        raise typer.Exit(1)
    service.drain(should_abort=stopper.abort)
    if service.in_flight:
        log(
            "worker_left",
            f"left {len(service.in_flight)} attempt(s) running under their supervisors",
            in_flight=sorted(service.in_flight),
        )
    else:
        service.stop()
        log("worker_stopped", f"laneway worker {worker_id}: stopped", worker_id=worker_id)


@app.command()
def controller(
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    interval: Annotated[
        float,
        typer.Option(
            min=0.001,
            max=3600.0,
            help="Seconds between looks at the ledger files; a tick runs only when something "
            "changed or a periodic step (lease expiry, lost workers) is due.",
        ),
    ] = 0.05,
    lost_after: Annotated[
        float,
        typer.Option(
            "--lost-after",
            min=1.0,
            max=limits.MAX_SECONDS,
            help="Seconds without a heartbeat after which a worker is declared lost.",
        ),
    ] = 30.0,
    metrics_bind: Annotated[
        str | None,
        typer.Option(
            "--metrics-bind",
            help="Serve Prometheus metrics read from the ledger at http://HOST:PORT/metrics "
            "(e.g. 127.0.0.1:9470; beyond loopback, --token-file is required).",
            show_default=False,
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="With --metrics-bind: the bearer token scrapes must carry.",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Log lifecycle lines as JSON on stderr.")
    ] = False,
) -> None:
    """Run the controller daemon: leases, lost workers, promotion, closing, snapshots.

    Each tick marks workers whose heartbeat stopped as lost, settles or marks unknown the
    attempts whose leases expired, promotes jobs whose needs succeeded (skips those whose
    needs did not), closes runs whose jobs are all terminal, and writes
    runs/RUN/status.json and SUMMARY.json. One controller per runtime dir; the runtime
    dir must hold a ledger already (`start-pipeline` or `run` creates it).
    """
    from controller import daemon as daemon_module

    try:
        engine = db.open_existing_ledger(runtime_dir)
    except LanewayError as error:
        _fail(error)
        return
    log = _Log(as_json)
    runtime = runtime_dir.resolve()
    try:
        held = daemon_module.hold_controller_lock(runtime, engine)
    except LanewayError as error:  # the server cannot be reached, or the dir written
        _fail(error)
    if not held:
        if not db.is_sqlite(engine):
            _fail(
                UsageError(
                    f"another controller already serves the ledger at "
                    f"{db.shown_url(db.ledger_url(runtime_dir))} (one per ledger; "
                    "`laneway status` lists its workers)"
                )
            )
        other = daemon_module.running_controller(runtime)
        _fail(UsageError(f"another controller already runs for {runtime} (pid {other})"))
    metrics_url = None
    if metrics_bind:
        from controller import web as web_module

        try:
            _server, metrics_url = web_module.serve_metrics_in_background(
                runtime_dir, metrics_bind, token_file
            )
        except OSError as exc:
            _fail(UsageError(f"--metrics-bind {metrics_bind}: cannot listen ({exc.strerror})"))
        except LanewayError as error:
            _fail(error)
    daemon_module.claim_pidfile(runtime)
    log("controller_started", f"laneway controller: {runtime}", runtime_dir=str(runtime))
    if metrics_url:
        log("metrics", f"laneway controller: metrics at {metrics_url}metrics", url=metrics_url)
    stopper = _Stopper(log, drains=False)
    try:
        serving = daemon_module.Controller(engine, lost_after_seconds=lost_after)
        serving.on_ledger_error = lambda line: log(
            "ledger_unreachable",
            f"laneway controller: the ledger is not answering ({line}); retrying with backoff",
            error=line,
        )
        serving.on_ledger_back = lambda tries: log(
            "ledger_back", "laneway controller: the ledger answers again", tries=tries
        )
        serving.serve(
            stopper.stop,
            interval=interval,
            keep_lock=lambda: daemon_module.hold_controller_lock(runtime, engine),
        )
    finally:
        daemon_module.release_pidfile(runtime)
    if serving.lost_lock:
        log(
            "controller_lost_lock", "laneway controller: lost the ledger's controller lock; exiting"
        )
        raise typer.Exit(1)
    log("controller_stopped", "laneway controller: stopped")


@app.command("run")
def run_pipeline(
    config: Annotated[
        str | None,
        typer.Argument(
            help="Pipeline config, .toml or .json; with --continue: a run id, or a config "
            "whose unfinished run to continue (omitted: the newest unfinished run).",
            show_default=False,
        ),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--continue",
            help="Continue an unfinished run: start the controller and the workers for "
            "it; nothing is re-created and nothing that succeeded runs again.",
        ),
    ] = False,
    new: NewOpt = False,
    rerun: RerunOpt = None,
    as_json: JsonFlag = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            help="No progress on stderr (with --json: none of its JSON lines either).",
        ),
    ] = False,
) -> None:
    """Start a pipeline and run it here, in the foreground, until it finishes.

    Starts the run, then the controller and one local worker per node, with live
    progress. If another controller already serves the runtime dir (`laneway controller`,
    or another `laneway run`), that one does the controller's work and this command
    takes over only if it goes away. It ends when the run is finished in the ledger,
    whoever closed it, and its closeout (if any) is done. A config that preflight refuses
    creates nothing. Exit 0 when every job is terminal, 3 when the run is blocked and
    needs an operator (halt, pause, unknown outcome), 130 when interrupted; each of
    these prints the command that continues the run.

    When the ledger holds an unfinished run of the same pipeline it refuses (exit 1):
    `--continue` carries that run on, `--new` starts another deliberately.
    """
    from controller import config as config_module
    from controller import daemon as daemon_module
    from controller import ledger, pipeline, usage
    from controller.status import SessionRows, build_status
    from workers.service import WorkerService

    try:
        if resume:
            if new or rerun:
                raise UsageError("--continue takes neither --new nor --rerun: choose one")
            engine = db.open_existing_ledger(runtime_dir)
            run_id, frozen = _run_to_continue(engine, config)
            nodes = frozen.nodes
        else:
            if config is None:
                raise UsageError("name a pipeline CONFIG (or pass --continue)")
            parsed = config_module.load_config(Path(config))
            # Preflight first (start_run refuses before it opens anything); the engine it
            # opened is this process's one engine on the ledger.
            run_id, engine = pipeline.start_run(
                parsed, runtime_dir=runtime_dir, actor=_actor(), new=new, rerun=rerun
            )
            nodes = parsed.nodes
        services = [WorkerService(engine, node=node.name, slots=node.max_jobs) for node in nodes]
        for service in services:
            service.start()
    except LanewayError as error:
        _fail(error, as_json)
        return
    runtime = runtime_dir.resolve()
    daemon = daemon_module.Controller(engine)
    # One controller per runtime dir: if another holds the lock, it closes the run and
    # runs its closeout; this loop only watches the ledger (and takes over if it can).
    try:
        own = daemon_module.hold_controller_lock(runtime, engine)
    except LedgerUnavailable:
        own = False  # looked at again in the loop, once the server answers
    from cli import live

    stopper = _Stopper()
    progress = live.Progress(run_id, quiet=quiet, as_json=as_json)
    blocked: str | None = None
    last_look = last_probe = float("-inf")
    outage = db.Outage()
    while True:
        try:
            busy = False
            if own and daemon.due():
                report = daemon.tick()
                busy = bool(report.promoted or report.closed)
            for service in services:
                tick = service.tick()
                busy = busy or bool(tick.claimed or tick.settled)
            # The whole status (its cost grows with the run) at most every LOOK_SECONDS; in
            # between, the run's own row says when it finished, whoever closed it.
            probe = not busy and time.monotonic() - last_probe >= PROBE_SECONDS
            if probe:
                last_probe = time.monotonic()
            if time.monotonic() - last_look > LOOK_SECONDS or (
                probe and _run_finished(engine, run_id)
            ):
                last_look = time.monotonic()
                own = daemon_module.hold_controller_lock(runtime, engine)
                with db.reader(engine)() as session:
                    snapshot = build_status(
                        session, ledger.get_run(session, run_id), now=daemon.clock.now()
                    )
                    progress.show(snapshot, SessionRows(session))
                if snapshot["run"]["state"] == "finished":
                    break
                in_flight = sum(len(s.in_flight) for s in services)
                blocked = _blocked_reason(snapshot) if in_flight == 0 else None
            if blocked or stopper.stop():
                break
            if not busy:
                # A local supervisor's exit wakes this at once (its pidfd); new work from
                # elsewhere is seen within the timeout.
                if len(services) == 1:
                    services[0].wait(0.02)
                else:
                    time.sleep(0.02)
        except Exception as exc:
            # The ledger is unreachable, locked past its timeout or refusing writes: what
            # runs keeps running under its supervisors; try again with backoff.
            pause = outage.failed(
                exc, lambda words: progress.note(f"the ledger is not answering ({words}); retrying")
            )
            if pause is None:
                raise
            daemon.ledger_away()  # no heartbeat is judged against the time it was away
            time.sleep(pause)
            continue
        outage.back(lambda tries: progress.note(f"the ledger answers again (after {tries} tries)"))

    for service in services:
        service.drain(should_abort=stopper.abort)
        if not service.in_flight:
            service.stop()
    noted = False
    while True:
        own = daemon_module.hold_controller_lock(runtime, engine)
        if own:
            daemon.tick()
            if not daemon.closeout_pending(run_id):
                break
        else:
            with db.reader(engine)() as session:
                snapshot = build_status(
                    session, ledger.get_run(session, run_id), now=daemon.clock.now()
                )
            if not _closeout_underway(snapshot):
                break
        if stopper.abort():
            break
        if not noted and not quiet and not as_json:
            progress.note("closeout running ...")
            noted = True
        time.sleep(0.05)
    daemon_module.release_controller_lock(runtime, engine)
    progress.close()
    with db.session_factory(engine)() as session:
        final = build_status(session, ledger.get_run(session, run_id), now=daemon.clock.now())
    _emit(final, as_json, render.status_text)
    if final["run"]["state"] != "finished":
        # How it ended and how to go on: words, or one JSON object per line with --json
        # (stderr then holds JSON lines only).
        say = _Log(as_json)
        if blocked:
            words = f"laneway: run {run_id} is blocked: {blocked}"
            say("run_blocked", words, run_id=run_id, reason=blocked, message=words)
        spent = any(c["reason"].startswith(usage.BUDGET_SPENT) for c in final["controls"])
        if spent:
            # Resuming would pause it again: only more budget lets it go on.
            words = (
                f"laneway: run {run_id} stopped at its budget; to go on, raise `budget` in "
                "the config and start a new run with `laneway run CONFIG --new`: every job "
                "that succeeded is reused, not run or paid for again"
            )
            say("run_budget_spent", words, run_id=run_id, message=words)
        else:
            when = "once it is unblocked, " if blocked else ""
            command = pipeline.continue_command(run_id, runtime)
            words = f"laneway: run {run_id} is not finished; {when}continue it with: {command}"
            say("run_not_finished", words, run_id=run_id, command=command, message=words)
    if blocked:
        raise typer.Exit(EXIT_BLOCKED)
    if final["run"]["state"] != "finished":
        raise typer.Exit(130 if stopper.stop() else 1)


def _run_to_continue(engine: Any, target: str | None) -> tuple[int, Any]:
    """The unfinished run ``laneway run --continue [TARGET]`` means, and its frozen
    config: TARGET is a run id, or a config naming a pipeline with an unfinished run;
    none: the newest unfinished run."""
    from controller import config as config_module
    from controller import ledger
    from controller.ids import parse_id

    with db.reader(engine)() as session:
        run_id = None if target is None else parse_id(target)
        if run_id is not None:
            run = ledger.get_run(session, run_id)
            if run.state != "active":
                raise UsageError(f"run {run.id} is finished; there is nothing to continue")
            return run.id, ledger.run_config(run)
        name = None
        if target is not None:
            name = config_module.load_config(Path(target)).name
        unfinished = ledger.unfinished_runs(session, name)
        if not unfinished:
            which = f"of pipeline {name!r} " if name else ""
            raise UsageError(
                f"the ledger holds no unfinished run {which}to continue; "
                "start one with `laneway run CONFIG`"
            )
        run = ledger.get_run(session, unfinished[0])
        return run.id, ledger.run_config(run)


LOOK_SECONDS = 1.0
"""How often `laneway run` builds the run's whole status (progress, blocked reasons)."""
PROBE_SECONDS = 0.1
"""How often, when nothing moved here, `laneway run` reads whether its run finished."""


def _run_finished(engine: Any, run_id: int) -> bool:
    """One row: is the run finished in the ledger?"""
    from controller import ledger

    with db.reader(engine)() as session:
        return ledger.get_run(session, run_id).state == "finished"


def _closeout_underway(snapshot: dict[str, Any]) -> bool:
    """Is another controller running the run's closeout, or about to (the run finished)?"""
    state: str = snapshot["closeout"]["state"]
    finished: bool = snapshot["run"]["state"] == "finished"
    return state == "running" or (state == "pending" and finished)


def _blocked_reason(snapshot: dict[str, Any]) -> str | None:
    """Why a run with nothing in flight cannot progress without an operator, if so."""
    if snapshot["unknown"]:
        return f"{len(snapshot['unknown'])} unknown attempt(s) await `laneway reconcile`"
    reasons = [lane["reason"] for lane in snapshot["lanes"] if lane["ready"] or lane["waiting"]]
    if reasons and all(r is not None and r["code"] in BLOCKING_REASONS for r in reasons):
        return "; ".join(sorted({r["words"] for r in reasons if r}))
    return None


RunArg = Annotated[
    int | None,
    typer.Argument(
        help="Run id (omit with --all).",
        min=1,
        max=MAX_ID,
        show_default=False,
        autocompletion=complete.runs,
    ),
]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why (recorded with who and when).")]
AllOpt = Annotated[bool, typer.Option("--all", help="Every run (a global control).")]
LaneOpt = Annotated[str | None, typer.Option("--lane", help="Only this lane of the run.")]


def _control(
    kind: ControlKind,
    run: int | None,
    everything: bool,
    reason: str,
    runtime_dir: Path,
    as_json: bool,
    *,
    lane: str | None = None,
    clear: tuple[ControlKind, ...] = (),
) -> None:
    from controller import ledger

    try:
        if (run is None) == (not everything):
            raise UsageError("name a RUN, or pass --all for every run (not both)")
        if lane is not None and run is None:
            raise UsageError("--lane needs a RUN")
        engine = _writer(runtime_dir)
        now = SystemClock().now()
        for trying in db.retrying(patience=RETRY_SECONDS):
            with trying, db.transaction(db.session_factory(engine)) as session:
                if run is not None:
                    run_row = ledger.get_run(session, run)
                    if lane is not None and lane not in {
                        lane_config.name for lane_config in ledger.run_config(run_row).lanes
                    }:
                        raise UsageError(f"run {run} has no lane {lane!r}")
                if clear:
                    count = ledger.clear_controls(
                        session, clear, reason=_reason(reason), actor=_actor(), now=now, run_id=run
                    )
                    body = {"ok": True, "cleared": count, "kinds": [k.value for k in clear]}
                else:
                    scope = (
                        ControlScope.GLOBAL
                        if run is None
                        else ControlScope.LANE
                        if lane
                        else ControlScope.RUN
                    )
                    control_id = ledger.set_control(
                        session,
                        kind,
                        scope=scope,
                        run_id=run,
                        lane=lane,
                        reason=_reason(reason),
                        actor=_actor(),
                        now=now,
                    )
                    body = {
                        "ok": True,
                        "control_id": control_id,
                        "kind": kind.value,
                        "scope": scope.value,
                    }
    except LanewayError as error:
        _fail(error, as_json)
        return
    target = "every run" if run is None else f"run {run}" + (f" lane {lane}" if lane else "")
    if clear:
        _emit(body, as_json, lambda b: f"cleared {b['cleared']} control(s) on {target}")
    else:
        _emit(body, as_json, lambda b: f"{kind.value} set on {target} (control {b['control_id']})")


@app.command()
def pause(
    reason: ReasonOpt,
    run: RunArg = None,
    lane: LaneOpt = None,
    everything: AllOpt = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Pause dispatch (resumable): running attempts go on; nothing new starts."""
    _control(ControlKind.PAUSE, run, everything, reason, runtime_dir, as_json, lane=lane)


@app.command()
def stop(
    reason: ReasonOpt,
    run: RunArg = None,
    everything: AllOpt = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Drain: no new dispatch; running attempts finish and settle. `resume` lifts it."""
    _control(ControlKind.STOP, run, everything, reason, runtime_dir, as_json)


@app.command()
def resume(
    reason: ReasonOpt,
    run: RunArg = None,
    everything: AllOpt = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Lift pauses and stops (not halts: those need `clear-halt`)."""
    _control(
        ControlKind.PAUSE,
        run,
        everything,
        reason,
        runtime_dir,
        as_json,
        clear=(ControlKind.PAUSE, ControlKind.STOP),
    )


@app.command()
def halt(
    reason: ReasonOpt,
    run: RunArg = None,
    everything: AllOpt = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Halt dispatch (fatal): only `clear-halt` with a reason lifts it."""
    _control(ControlKind.HALT, run, everything, reason, runtime_dir, as_json)


@app.command("clear-halt")
def clear_halt(
    reason: ReasonOpt,
    run: RunArg = None,
    everything: AllOpt = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Lift halts, with a recorded reason."""
    _control(
        ControlKind.HALT, run, everything, reason, runtime_dir, as_json, clear=(ControlKind.HALT,)
    )


@app.command()
def cancel(
    reason: ReasonOpt,
    attempt: Annotated[
        int | None,
        typer.Argument(
            help="A running attempt's id.",
            min=1,
            max=MAX_ID,
            show_default=False,
            autocompletion=complete.attempts,
        ),
    ] = None,
    run: Annotated[
        int | None, typer.Option("--run", help="Cancel a whole run instead.", min=1, max=MAX_ID)
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Cancel a running attempt, or a whole run (--run): TERM, grace, KILL, verified.

    The attempt's supervisor gets TERM; it forwards it to the job's process group, waits
    the stage's grace budget, KILLs the group, verifies no process of it is left, and
    reports; the worker settles the attempt as cancelled. --run also stops the run's
    dispatch and cancels its waiting and ready jobs. Run it on the attempt's machine.
    """
    from workers import stopping

    try:
        if (attempt is None) == (run is None):
            raise UsageError("name one ATTEMPT, or pass --run RUN (not both)")
        engine = _writer(runtime_dir)
        now = SystemClock().now()
        done = stopping.cancel(
            engine,
            attempt=attempt,
            run=run,
            reason=_reason(reason),
            actor=_actor(),
            now=now,
            patience=RETRY_SECONDS,
        )
    except LanewayError as error:
        _fail(error, as_json)
        return
    signalled = done.attempts_signalled
    body = {"ok": True, "jobs_cancelled": done.jobs_cancelled, "attempts_signalled": signalled}
    _emit(
        body,
        as_json,
        lambda b: (
            f"{b['jobs_cancelled']} pending job(s) cancelled; TERM sent to "
            f"{len(signalled)} supervisor(s): {', '.join(str(p) for p in signalled) or 'none'}"
        ),
    )


class ReconcileAs(StrEnum):
    succeeded = "succeeded"
    failed = "failed"
    not_run = "not-run"


@app.command()
def reconcile(
    attempt: Annotated[
        int | None,
        typer.Argument(
            help="The unknown attempt's id (see `status`); omit with --run --from-evidence.",
            min=1,
            max=MAX_ID,
            autocompletion=complete.unknown_attempts,
            show_default=False,
        ),
    ] = None,
    as_: Annotated[
        ReconcileAs | None,
        typer.Option("--as", help="What really happened to the attempt.", show_default=False),
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Why you know (recorded).")] = "",
    result: Annotated[
        Path | None, typer.Option("--result", help="A result JSON file to record with it.")
    ] = None,
    run: Annotated[
        int | None,
        typer.Option("--run", min=1, max=MAX_ID, help="With --from-evidence: the run."),
    ] = None,
    from_evidence: Annotated[
        bool,
        typer.Option(
            "--from-evidence",
            help="Settle every unknown attempt of --run whose evidence has become "
            "conclusive (a verified exit record, supervisor and child gone) as it says.",
        ),
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", help="With --from-evidence: do not ask for confirmation.")
    ] = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Settle an unknown attempt as succeeded, failed or not-run, with a reason.

    Recorded with who and when. not-run makes the job ready for a new attempt (a new
    idempotency key). When a run has no unknown attempt left, its dispatch resumes;
    halts set by operators stay.

    `reconcile --run RUN --from-evidence` shows, for each unknown attempt of the run,
    what its evidence says, and settles those whose evidence is conclusive into the
    outcome their exit record establishes, after one confirmation (--yes for scripts).
    """
    from controller import evidence, ledger
    from controller.reconcile import outputs_for_success, read_result_file

    if from_evidence:
        _reconcile_from_evidence(run, attempt, as_, result, reason, yes, runtime_dir, as_json)
        return
    try:
        if attempt is None or as_ is None:
            raise UsageError(
                "name the unknown ATTEMPT with --as and --reason, or use --run RUN --from-evidence"
            )
        if run is not None or yes:
            raise UsageError("--run and --yes go with --from-evidence")
        recorded = read_result_file(result) if result else None
        engine = _writer(runtime_dir)
        with db.session_factory(engine)() as session:
            found = ledger.get_attempt(session, attempt)
            exit_code, exit_signal = evidence.verified_exit(found)
            node = found.node
        why = _reason(reason)
        # A success hands its declared outputs on, as a worker's settle would.
        stored = outputs_for_success(engine, attempt) if as_.value == "succeeded" else []
        for trying in db.retrying(patience=RETRY_SECONDS):
            with trying, db.transaction(db.session_factory(engine)) as session:
                now = SystemClock().now()
                job_state = ledger.reconcile_attempt(
                    session,
                    attempt,
                    verdict=as_.value,
                    reason=why,
                    actor=_actor(),
                    now=now,
                    result=recorded,
                    exit_code=exit_code,
                    exit_signal=exit_signal,
                )
                ledger.record_artifacts(session, attempt, stored, node=node, now=now)
    except LanewayError as error:
        _fail(error, as_json)
        return
    body = {"ok": True, "attempt_id": attempt, "as": as_.value, "job_state": job_state.value}
    _emit(
        body,
        as_json,
        lambda b: f"attempt {attempt} reconciled as {b['as']}; job is now {b['job_state']}",
    )


def _reconcile_from_evidence(
    run: int | None,
    attempt: int | None,
    as_: Any,
    result: Path | None,
    reason: str,
    yes: bool,
    runtime_dir: Path,
    as_json: bool,
) -> None:
    """``reconcile --run RUN --from-evidence``: judge, show, confirm once, settle
    (``controller.reconcile``)."""
    from controller import reconcile

    try:
        if run is None:
            raise UsageError("--from-evidence needs --run RUN")
        if attempt is not None or as_ is not None or result is not None:
            raise UsageError(
                "--from-evidence settles as the evidence says: no ATTEMPT, --as or --result"
            )
        engine = _writer(runtime_dir)
        review = reconcile.review_evidence(engine, run)
    except LanewayError as error:
        _fail(error, as_json)
        return
    conclusive = review.conclusive
    if not as_json:
        for found in review.judged:
            verdict = f"settle as {found.outcome}" if found.conclusive else "left unknown"
            typer.echo(f"attempt {found.attempt_id}: {verdict} — {render.clean(found.words)}")
    if conclusive and not yes:
        if as_json:
            _fail(UsageError("--from-evidence with --json asks no question: pass --yes"), True)
        if not typer.confirm(f"settle {len(conclusive)} attempt(s) as their evidence says?"):
            raise typer.Exit(1)
    try:
        settled = reconcile.settle_from_evidence(
            engine, review, actor=_actor(), reason=reason, patience=RETRY_SECONDS
        )
    except LanewayError as error:
        _fail(error, as_json)
        return
    body = {
        "ok": True,
        "run_id": run,
        "settled": [done.as_dict() for done in settled],
        "left_unknown": [e.as_dict() for e in review.left_unknown],
    }
    _emit(
        body,
        as_json,
        lambda b: (
            f"{len(settled)} attempt(s) settled from evidence; "
            f"{len(b['left_unknown'])} left unknown"
        ),
    )


class RetryOutcome(StrEnum):
    failed = "failed"
    infra_failure = "infra_failure"
    timed_out = "timed_out"


@app.command()
def retry(
    job: Annotated[
        str | None,
        typer.Argument(
            help="The failed job: its id, or ITEM.STAGE (in --run, default the newest run); "
            "omit with --run to retry every failed job of the run that matches.",
            autocompletion=complete.jobs,
            show_default=False,
        ),
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Why it is safe to run again.")] = "",
    run: Annotated[
        int | None,
        typer.Option("--run", min=1, max=MAX_ID, help="The run (bulk: every failed job of it)."),
    ] = None,
    stage: Annotated[
        str | None, typer.Option("--stage", help="Bulk: only this stage's failed jobs.")
    ] = None,
    outcome: Annotated[
        RetryOutcome | None,
        typer.Option("--outcome", help="Bulk: only jobs whose last attempt settled so."),
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Make failed jobs ready for a new attempt (new idempotency key), with a reason.

    One job (`retry JOB` or `retry ITEM.STAGE`), or every failed job of a run that
    matches (`retry --run RUN [--stage S] [--outcome failed|infra_failure|timed_out]`),
    in one transaction. Jobs of the same item skipped because of them wait again; a
    finished run reopens.
    """
    from controller import ledger
    from controller.states import Outcome

    try:
        why = _reason(reason)
        if job is not None and (stage is not None or outcome is not None):
            raise UsageError("--stage and --outcome choose jobs for a bulk retry: omit JOB")
        if job is None and run is None:
            raise UsageError("name a JOB (id or ITEM.STAGE), or --run RUN for a bulk retry")
        engine = _writer(runtime_dir)
        job_id = None if job is None else _job_id(engine, job, run)
        if run is not None and stage is not None:
            with db.session_factory(engine)() as session:
                stages = [s.name for s in ledger.run_config(ledger.get_run(session, run)).stages]
            if stage not in stages:
                raise UsageError(f"--stage: {stage!r} is not a stage of run {run}")
        for trying in db.retrying(patience=RETRY_SECONDS):
            with trying, db.transaction(db.session_factory(engine)) as session:
                now = SystemClock().now()
                if job_id is not None:
                    moved = ledger.retry_job(session, job_id, reason=why, actor=_actor(), now=now)
                    retried = [job_id]
                else:
                    assert run is not None
                    ledger.get_run(session, run)
                    retried = ledger.retry_failed(
                        session,
                        run,
                        reason=why,
                        actor=_actor(),
                        now=now,
                        stage=stage,
                        outcome=None if outcome is None else Outcome(outcome.value),
                    )
                    moved = len(retried)
    except LanewayError as error:
        _fail(error, as_json)
        return
    if job_id is not None:
        _emit(
            {"ok": True, "job_id": job_id, "jobs_moved": moved},
            as_json,
            lambda b: f"job {job_id} is ready for a new attempt ({moved} job(s) moved)",
        )
        return
    _emit(
        {"ok": True, "run_id": run, "retried": retried},
        as_json,
        lambda b: (
            f"{len(retried)} failed job(s) of run {run} are ready for a new attempt"
            + (f": {', '.join(map(str, retried))}" if retried else " (none matched)")
        ),
    )


def _job_id(engine: Any, job: str, run: int | None) -> int:
    """A job named by its id, or as ITEM.STAGE in ``run`` (default: the newest run)."""
    from controller.ids import parse_id
    from controller.logs import job_by_name
    from controller.status import SessionRows

    number = parse_id(job)
    if number is not None:
        return number
    if "." not in job:
        raise UsageError(f"{job!r}: name a job by its id or as ITEM.STAGE")
    with db.session_factory(engine)() as session:
        return job_by_name(SessionRows(session), job, run)


def _reason(reason: str) -> str:
    if not reason.strip():
        raise UsageError("--reason must say why (it is recorded in the ledger)")
    return reason.strip()


@app.command(
    # A query may start with "--" (an SQL comment): an argument that is no option of
    # sql's is the query, not an error (``laneway sql -- QUERY`` works too).
    context_settings={"ignore_unknown_options": True},
)
def sql(
    query: Annotated[str, typer.Argument(help="A read-only SQL query.")],
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    readonly_url: Annotated[
        str | None,
        typer.Option(
            "--readonly-url",
            envvar="LANEWAY_READONLY_DATABASE_URL",
            show_default=False,
            help=(
                "PostgreSQL: connect as a role that can only read laneway's tables "
                "(postgresql://ROLE@HOST/DB; docs/deploy.md gives its grants) instead of "
                "the ledger's own URL (env LANEWAY_READONLY_DATABASE_URL)."
            ),
        ),
    ] = None,
    superuser_ok: Annotated[
        bool,
        typer.Option(
            "--i-know-this-is-superuser",
            help=(
                "PostgreSQL: run even when the role is a superuser (or may read or write "
                "the server's files). Still read-only, one statement, no COPY."
            ),
        ),
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.001,
            max=limits.MAX_SECONDS,
            help="Stop the query after this many seconds.",
        ),
    ] = db.QUERY_TIMEOUT_S,
    as_json: JsonFlag = False,
) -> None:
    """Run one read-only SQL query against the ledger.

    SQLite is opened read-only, with PRAGMA query_only and an authorizer that allows
    reads only: writes, ATTACH/DETACH, VACUUM (INTO), PRAGMAs that write and
    load_extension are refused before they run, and nothing is created. On PostgreSQL
    the query runs in a READ ONLY transaction with a statement timeout, as one statement
    that returns rows (COPY, SET, DO and several statements are refused unrun), and as a
    role that is not a superuser (--readonly-url; --i-know-this-is-superuser overrides).
    A refused, invalid or timed-out query exits 2 with one line. Tables and views are
    documented in docs/ledger.md. A query starting with -- (a comment) is taken as it
    is; `laneway sql [OPTIONS] -- QUERY` also works.
    """
    try:
        if readonly_url and not readonly_url.startswith("postgresql"):
            raise UsageError(
                "--readonly-url must name a PostgreSQL database (postgresql://ROLE@HOST/DB); "
                "a SQLite ledger is read from --runtime-dir, opened read-only"
            )
        with db.ReadOnlyLedger(runtime_dir, url=readonly_url or None) as source:
            headers, rows = source.query(query, timeout_s=timeout, allow_privileged=superuser_ok)
    except LanewayError as error:
        _fail(error, as_json)
        return
    if as_json:
        typer.echo(render.as_json([dict(zip(headers, row, strict=True)) for row in rows]))
    else:
        typer.echo(render.table(headers, [list(row) for row in rows]))


def main() -> None:
    try:
        app()
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
