"""The long-running services: `worker`, `controller`, `web`.

Each parses, builds the service (workers/service.py, controller/daemon.py,
controller/web.py), logs its lifecycle lines and serves until a signal. Registered in
order by cli/main.py. A worker whose ledger or node is not there yet waits for it
(``WORKER_WAIT_SECONDS``), reading the ledger read-only until then; so does a
controller for its ledger.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from laneway.cli import common, complete
from laneway.cli import runtime_dir as runtime_dir_module
from laneway.cli.common import DEFAULT_RUNTIME, DatabaseUrl, RuntimeDir
from laneway.controller import db, ledger_open, limits
from laneway.controller.errors import LanewayError, NoLedgerYet, NotFound, UsageError

LogJsonFlag = Annotated[bool, typer.Option("--json", help="Log lifecycle lines as JSON on stderr.")]

NotifyUrl = Annotated[
    str | None,
    typer.Option(
        "--notify-url",
        help="Also POST every attention state (halt, unknown outcome, budget stop, lost "
        "worker or controller, breaker pause, run finished) to this webhook, as a run's "
        "[notify] webhook would; ${NAME} is read from this process's environment.",
        show_default=False,
    ),
]
NotifyCommand = Annotated[
    str | None,
    typer.Option(
        "--notify-command",
        help="Also run this command (split like a shell line, run without one) for every "
        "attention state, the notification as JSON on stdin.",
        show_default=False,
    ),
]


def _notify_option(url: str | None, command: str | None) -> Any:
    """The process's own ``NotifyConfig`` from --notify-url/--notify-command (None when
    neither is given); a bad value exits 2 with one line naming the option."""
    if url is None and command is None:
        return None
    import shlex

    from pydantic import ValidationError

    from laneway.controller.config_models import NotifyConfig

    try:
        argv = None if command is None else shlex.split(command)
    except ValueError as exc:
        common.fail(UsageError(f"--notify-command: {exc}; quote it as a shell line"))
    try:
        return NotifyConfig(webhook=url, command=argv or None)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "--notify-url" if "webhook" in map(str, first["loc"]) else "--notify-command"
        common.fail(UsageError(f"{where}: {first['msg']}"))


WORKER_WAIT_SECONDS = 3.0
"""How often a worker looks again for a ledger not created yet, or for a pipeline that
names its node (`laneway worker` without --exit-if-unknown)."""


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
    from laneway.controller import web as web_module

    with common.refusals():
        host, port = web_module.parse_bind(bind)
        token = web_module.read_token(token_file, host)
        dashboard = web_module.Dashboard(runtime_dir)
        try:
            server = web_module.make_server(dashboard, host, port, token=token)
        except OSError as exc:
            dashboard.close()
            raise UsageError(f"--bind {bind}: cannot listen ({exc.strerror or exc})") from None
    typer.echo(f"laneway web: serving {web_module.url_of(server)} (read-only; Ctrl-C stops it)")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, common.interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        dashboard.close()


GpuDescription = Annotated[
    Path | None,
    typer.Option(
        "--gpu-description",
        help="Describe this machine's GPUs from a JSON file instead of measuring them "
        "through NVML (a machine without GPUs: CI, a laptop; configs/gpu-node-4x80g.json "
        "is an example); status marks them described.",
        show_default=False,
    ),
]


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
            callback=common.finite,
            help="How long a claim stays this worker's without a heartbeat renewing it; "
            "past it the controller settles the attempt from its exit record or marks it "
            "unknown.",
        ),
    ] = 60.0,
    exit_if_unknown: Annotated[
        bool,
        typer.Option(
            "--exit-if-unknown",
            help="Exit 2 at once when the runtime dir has no ledger yet or no pipeline "
            "names --node, instead of waiting for them.",
        ),
    ] = False,
    notify_url: NotifyUrl = None,
    notify_command: NotifyCommand = None,
    gpu_description: GpuDescription = None,
    as_json: LogJsonFlag = False,
) -> None:
    """Run the worker service of one node: lease, supervise, settle, heartbeat.

    TERM/INT drains: no new dispatch, running attempts finish and settle. A second
    signal leaves them running under their supervisors. Until a ledger exists (`run` or
    `start-pipeline` creates it) and a pipeline names --node, it waits, logging
    `worker_waiting` once and writing nothing (TERM exits 0, Ctrl-C 130);
    --exit-if-unknown exits 2 instead. It tells the operator (the runs' [notify]
    sections, --notify-url/--notify-command) when the controller stops heartbeating.
    """
    from laneway.controller.notify import Notifier
    from laneway.controller.rows import SessionRows
    from laneway.controller.status_nodes import node_max_jobs
    from laneway.workers.service import WorkerService

    log = common.Log(as_json)
    option = _notify_option(notify_url, notify_command)
    gpu = None
    if gpu_description is not None:
        from laneway.workers.gpu import DescribedGpu, DescriptionError

        try:
            gpu = DescribedGpu(gpu_description)
        except DescriptionError as exc:
            common.fail(UsageError(str(exc)))
    if not exit_if_unknown:
        _wait_until_named(runtime_dir, node, log)
    with common.refusals():
        engine = ledger_open.open_existing_ledger(runtime_dir)
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
            gpu=gpu,
        )
        worker_id = service.start()
    # The handler before the line that says it started: a TERM right after that line
    # stops the worker cleanly (the wait for its node restored the default action).
    stopper = common.Stopper(log)
    log(
        "worker_started",
        f"laneway worker {worker_id}: node {node}, {slots} slots",
        worker_id=worker_id,
        node=node,
        slots=slots,
    )
    for line in service.recovered:
        log("recovered", f"laneway worker {worker_id}: recovered {line}", line=line)
    _log_outages(
        service,
        log,
        f"laneway worker {worker_id}",
        ", running attempts stay under their supervisors",
    )
    notifier = Notifier(engine, actor=worker_id, option=option, watch_controller=True)
    notifier.on_error = lambda line: log(
        "notify_error", f"laneway worker {worker_id}: {line}", reason=line
    )
    notifier.start()
    try:
        service.serve(stopper.stop)
    finally:
        notifier.stop()
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


class _StopWaiting(Exception):
    """SIGTERM while a worker waits (not a LanewayError: no refusal catches it)."""


def _stop_waiting(_signum: int, _frame: Any) -> None:
    raise _StopWaiting


def _wait_until_named(runtime_dir: Path, node: str | None, log: common.Log) -> None:
    """Return once the runtime dir's ledger exists and, for a worker, names ``node``
    (None: the controller, which waits for the ledger only), looking every
    ``WORKER_WAIT_SECONDS``, read-only (nothing is created or written meanwhile); what
    it waits for is logged once (``worker_waiting``, ``controller_waiting``). TERM
    exits 0, Ctrl-C 130. A runtime dir that is a file, where no ledger can ever
    appear, is refused at once (exit 2).

    Anything else that stops the service is left to the start that follows: on the
    first look it returns, and the start reports it as it always has (a foreign
    database, an unreachable server, an unknown revision); after a wait, it ends the
    command."""
    who = "worker" if node is not None else "controller"
    fields: dict[str, Any] = {} if node is None else {"node": node}
    said: str | None = None
    previous = signal.signal(signal.SIGTERM, _stop_waiting)
    try:
        while True:
            try:
                missing = _not_there_yet(runtime_dir, node)
            except LanewayError as error:
                if said is None:
                    return
                common.fail(error)
            if missing is None:
                return
            what, words, found = missing
            if what != said:
                said = what  # first: a TERM right after the line must know what it stops
                log(f"{who}_waiting", words, **fields, waiting_for=what, **found)
            time.sleep(WORKER_WAIT_SECONDS)
    except (_StopWaiting, KeyboardInterrupt) as stopped:
        log(
            f"{who}_stopped",
            f"laneway {who}: stopped while waiting for {'a ' if said == 'ledger' else ''}"
            f"{said or 'the ledger'}; nothing was written",
            **fields,
            **({} if node is None else {"registered": False}),
        )
        raise typer.Exit(0 if isinstance(stopped, _StopWaiting) else 130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _not_there_yet(runtime_dir: Path, node: str | None) -> tuple[str, str, dict[str, Any]] | None:
    """What a worker for ``node`` (or, with None, the controller) still waits for:
    ``("ledger", words, fields)``, ``("node", ...)``, or None when the ledger is there
    (and names the node). Raises UsageError for a ledger that can never appear."""
    from laneway.controller import queries, readonly
    from laneway.controller.status_nodes import node_max_jobs

    every = f"checking every {WORKER_WAIT_SECONDS:g} s"
    who = "worker" if node is not None else "controller"
    try:
        with readonly.ReadOnlyLedger(runtime_dir) as source, source.snapshot():
            if node is None:
                return None
            try:
                node_max_jobs(source, node)
            except NotFound:
                known = [str(row[0]) for row in source.rows(queries.NODE_NAMES)]
            else:
                return None
    except NoLedgerYet as error:
        refusal = runtime_dir_module.never_there(error)
        if refusal is not None:
            common.fail(refusal)
        return (
            "ledger",
            f"laneway {who}: no ledger at {error.where} yet; waiting for `laneway run` or "
            f"`laneway start-pipeline` to create it ({every})",
            {"ledger": error.where},
        )
    shown = ", ".join(repr(name) for name in known) or "none yet"
    return (
        "node",
        f"laneway worker: no pipeline names node {node!r} yet (known: {shown}); waiting "
        f"for one ({every})",
        {"known": known},
    )


def controller(
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    interval: Annotated[
        float,
        typer.Option(
            min=0.001,
            max=3600.0,
            callback=common.finite,
            help="Seconds between looks at the ledger files (on PostgreSQL a notification "
            "wakes it sooner), and the least time from one tick's start to the next: a tick "
            "runs only when something changed or a periodic step (lease expiry, lost "
            "workers) is due.",
        ),
    ] = 0.05,
    lost_after: Annotated[
        float,
        typer.Option(
            "--lost-after",
            min=1.0,
            max=limits.MAX_SECONDS,
            callback=common.finite,
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
    notify_url: NotifyUrl = None,
    notify_command: NotifyCommand = None,
    exit_if_missing: Annotated[
        bool,
        typer.Option(
            "--exit-if-missing",
            help="Exit 2 at once when the runtime dir has no ledger yet, instead of "
            "waiting for one.",
        ),
    ] = False,
    as_json: LogJsonFlag = False,
) -> None:
    """Run the controller daemon: leases, lost workers, promotion, closing, snapshots.

    Each tick marks workers whose heartbeat stopped as lost, settles or marks unknown the
    attempts whose leases expired, promotes jobs whose needs succeeded (skips those whose
    needs did not), closes runs whose jobs are all terminal, and writes
    runs/RUN/status.json and SUMMARY.json. One controller per runtime dir. Until a
    ledger exists (`start-pipeline` or `run` creates it) it waits, logging
    `controller_waiting` once and writing nothing (TERM exits 0, Ctrl-C 130);
    --exit-if-missing exits 2 instead. It tells the operator of every attention state
    (the runs' [notify] sections and --notify-url/--notify-command), each delivery
    recorded in the ledger.
    """
    from laneway.controller import controller_lock
    from laneway.controller import daemon as daemon_module

    option = _notify_option(notify_url, notify_command)
    log = common.Log(as_json)
    if not exit_if_missing:
        _wait_until_named(runtime_dir, None, log)
    with common.refusals():
        engine = ledger_open.open_existing_ledger(runtime_dir)
    runtime = runtime_dir.resolve()
    with common.refusals():  # the server cannot be reached, or the dir written
        held = controller_lock.hold_controller_lock(runtime, engine)
    if not held:
        if not db.is_sqlite(engine):
            common.fail(
                UsageError(
                    f"another controller already serves the ledger at "
                    f"{db.shown_url(db.ledger_url(runtime_dir))} (one per ledger; "
                    "`laneway status` lists its workers)"
                )
            )
        other = controller_lock.running_controller(runtime)
        common.fail(UsageError(f"another controller already runs for {runtime} (pid {other})"))
    metrics_url = None
    if metrics_bind:
        from laneway.controller import web as web_module

        try:
            _server, metrics_url = web_module.serve_metrics_in_background(
                runtime_dir, metrics_bind, token_file
            )
        except OSError as exc:
            common.fail(
                UsageError(f"--metrics-bind {metrics_bind}: cannot listen ({exc.strerror})")
            )
        except LanewayError as error:
            common.fail(error)
    controller_lock.claim_pidfile(runtime)
    # The handler before the line that says it started: a TERM right after that line
    # stops it cleanly (the wait for the ledger restored the default action).
    stopper = common.Stopper(log, drains=False)
    log("controller_started", f"laneway controller: {runtime}", runtime_dir=str(runtime))
    if metrics_url:
        log("metrics", f"laneway controller: metrics at {metrics_url}metrics", url=metrics_url)
    try:
        serving = daemon_module.Controller(engine, lost_after_seconds=lost_after, notify=option)
        _log_outages(serving, log, "laneway controller")
        serving.notifier.on_error = lambda line: log(
            "notify_error", f"laneway controller: {line}", reason=line
        )
        serving.serve(
            stopper.stop,
            interval=interval,
            keep_lock=lambda: controller_lock.hold_controller_lock(runtime, engine),
        )
        if not serving.lost_lock:
            serving.close()
    finally:
        controller_lock.release_pidfile(runtime)
    if serving.lost_lock:
        log(
            "controller_lost_lock", "laneway controller: lost the ledger's controller lock; exiting"
        )
        raise typer.Exit(1)
    log("controller_stopped", "laneway controller: stopped")


def _log_outages(service: Any, log: common.Log, who: str, meanwhile: str = "") -> None:
    """Log when ``service``'s ledger stops answering and when it answers again."""
    service.on_ledger_error = lambda line: log(
        "ledger_unreachable",
        f"{who}: the ledger is not answering ({line}); retrying with backoff{meanwhile}",
        error=line,
    )
    service.on_ledger_back = lambda tries: log(
        "ledger_back", f"{who}: the ledger answers again", tries=tries
    )
