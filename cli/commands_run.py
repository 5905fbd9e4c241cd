"""Commands that start work: `run`, `start-pipeline`, `dry-run`, `migrate`, `schema`.

Each parses, calls one function below the CLI and renders; `run`'s loop is
controller/foreground.py. Registered in order by cli/main.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from laneway.cli import common, render
from laneway.cli.common import DEFAULT_RUNTIME, ConfigPath, DatabaseUrl, JsonFlag, RuntimeDir
from laneway.cli.paid_rerun import confirm_plan as _confirm_plan
from laneway.cli.paid_rerun import reuse_plan as _reuse_plan
from laneway.controller import db, ledger_open
from laneway.controller.errors import UsageError

RerunOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rerun",
        help="Run this stage's jobs even where an earlier run's result could be reused "
        "(repeatable; `all`: every stage).",
        show_default=False,
    ),
]
ReuseDespiteOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--reuse-despite",
        help="Keep this stage's earlier succeeded results although the files it depends on "
        "changed (a deliberate edit that changes nothing it computes, e.g. a comment in a "
        "paid script); recorded in the run (repeatable). Its definition, the item and what "
        "it needs must be unchanged; the stages downstream of it are kept with it.",
        metavar="STAGE",
        show_default=False,
    ),
]
YesOpt = Annotated[
    bool,
    typer.Option(
        "--yes",
        help="Start without asking, even when the plan runs (and pays for) paid stages' "
        "work that ran before again (with or without --new); without it, that is asked "
        "on a terminal and refused (exit 2, nothing created) off one or with --json.",
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


def schema(
    as_json: Annotated[bool, typer.Option("--json", help="Accepted; the schema is JSON.")] = True,
) -> None:
    """Print the JSON Schema of a pipeline config."""
    from laneway.controller import config as config_module

    typer.echo(render.as_json(config_module.json_schema()))


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
    with common.refusals(as_json):
        engine = ledger_open.open_ledger(runtime_dir)
        revision = ledger_open.current_revision(engine)
        shown = db.shown_url(engine.url.render_as_string(hide_password=False))
        engine.dispose()
    body = {"ok": True, "ledger": shown, "revision": revision, "head": ledger_open.head_revision()}
    common.emit(
        body, as_json, lambda b: f"ledger {b['ledger']} is at revision {b['revision']} (head)"
    )


PlanRuntimeDir = Annotated[
    Path | None,
    typer.Option(
        "--runtime-dir",
        help="Also say, against this runtime dir's ledger, which jobs a new run would "
        "reuse, which it would run and why, and what it would spend (as `laneway plan`).",
        show_default=False,
    ),
]


def plan_run(
    config: ConfigPath,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    rerun: RerunOpt = None,
    reuse_despite: ReuseDespiteOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """What a new run of CONFIG would do, before anything is created: per stage, how
    many jobs would be reused (from which run; with --reuse-despite, how many of them
    although a file changed) and how many would run, and why (which file, field,
    definition or input changed; what it needs runs again; new), what a paid stage's
    jobs cost (measured from earlier attempts' usage, else expected_usage), then the
    expected spend against each budget. Reads the ledger only. Exit 1 if preflight
    refuses, 2 if the config is invalid.
    """
    reasons, found = _reuse_plan(config, runtime_dir, rerun, reuse_despite)
    if as_json:
        typer.echo(
            render.as_json(
                {**found.as_dict(), "preflight": {"ok": not reasons, "reasons": reasons}}
            )
        )
    else:
        from laneway.cli.plan_text import reuse_plan_lines

        for line in reuse_plan_lines(found):
            typer.echo(line)
        for reason in reasons:
            typer.echo(f"preflight: {reason}")
    if reasons:
        raise typer.Exit(1)


SecretsOnWorkers = Annotated[
    bool,
    typer.Option(
        "--secrets-on-workers",
        help="The secrets the stages' env references are set on the workers, not here: "
        "do not refuse a reference unset here (a worker that lacks one refuses the "
        "stage's jobs as secret_missing, naming the variable and its node).",
    ),
]


def dry_run(
    config: ConfigPath,
    runtime_dir: PlanRuntimeDir = None,
    secrets_on_workers: SecretsOnWorkers = False,
    gpu_description: Annotated[
        Path | None,
        typer.Option(
            "--gpu-description",
            help="Plan as if every node the config gives no GPUs had the GPUs this JSON "
            "file describes (as `laneway worker --gpu-description`).",
            show_default=False,
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Validate a config and print its plan; writes nothing.

    The plan: items, jobs per stage and lane, each stage's retry policy, the closeout
    steps, capacity arithmetic, and the first admission decisions with their reasons;
    with --runtime-dir, what a new run would reuse and run there (`laneway plan`).
    Exit 1 if preflight refuses, 2 if the config is invalid.
    """
    from laneway.controller import config as config_module
    from laneway.controller import pipeline, usage
    from laneway.workers.gpu import DescriptionError, load_description
    from laneway.workers.service import psutil_memory

    with common.refusals(as_json):
        parsed = config_module.load_config(config)
        try:
            described = [] if gpu_description is None else load_description(gpu_description)[0]
        except DescriptionError as exc:
            raise UsageError(str(exc)) from None
        reasons, _ = pipeline.preflight(
            parsed, secrets_on_workers=secrets_on_workers, described_gpus=len(described)
        )
    plan = pipeline.plan(parsed, mem_available_mib=psutil_memory()[0], described=described)
    plan["preflight"] = {"ok": not reasons, "reasons": reasons}
    # What would run: each stage's argv for the first item, as a worker renders it
    # (values in a shell's -c script quoted), so a user sees it before anything runs.
    plan["argv_preview"] = config_module.preview_argv(parsed)
    per_stage = {
        stage: sum(lanes.values()) for stage, lanes in plan["jobs_per_stage_and_lane"].items()
    }
    plan["budgets"] = usage.budget_plan(parsed, per_stage)
    plan["limits"] = usage.limit_plan(parsed, per_stage)
    against = None
    if runtime_dir is not None:
        against = _reuse_plan(config, runtime_dir, [])[1]
        plan["reuse_plan"] = against.as_dict()
    if as_json:
        typer.echo(render.as_json(plan))
    else:
        from laneway.cli import plan_text

        typer.echo(plan_text.plan_text(plan))
        for line in usage.budget_plan_lines(plan["budgets"]) + usage.limit_plan_lines(
            plan["limits"]
        ):
            typer.echo(line)
        if against is not None:
            typer.echo("")
            for line in plan_text.reuse_plan_lines(against):
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
    reuse_despite: ReuseDespiteOpt = None,
    yes: YesOpt = False,
    secrets_on_workers: SecretsOnWorkers = False,
    as_json: JsonFlag = False,
) -> None:
    """Preflight a config and freeze it into a new run.

    Checks the config, paths, executables, source files and secret references; on any
    refusal exits 1 with the reasons and creates nothing. Otherwise creates the run's
    items and jobs (respecting batch_cap) and makes sure a controller runs. Never clears
    a pause or halt. With `--new` it first prints the plan (`laneway plan`) on stderr.
    With or without `--new`, a plan that runs paid stages' work again (work an earlier
    run did) is asked about on a terminal and refused off one or with --json (exit 2,
    nothing created) unless `--yes`.
    """
    from laneway.controller import config as config_module
    from laneway.controller import controller_lock, pipeline

    _confirm_plan(
        config, runtime_dir, rerun, reuse_despite, new=new, yes=yes, as_json=as_json, quiet=False
    )
    with common.refusals(as_json):
        parsed = config_module.load_config(config)
        run_id, engine = pipeline.start_run(
            parsed,
            runtime_dir=runtime_dir,
            actor=common.actor(),
            new=new,
            rerun=rerun,
            secrets_on_workers=secrets_on_workers,
            reuse_despite=reuse_despite,
            config_path=config,
        )
        backend = engine.dialect.name
        ledger_shown = db.shown_url(engine.url.render_as_string(hide_password=False))
        engine.dispose()
    runtime = runtime_dir.resolve()
    controller_pid = controller_lock.running_controller(runtime)
    started = False
    if controller and controller_pid is None:
        controller_pid = controller_lock.start_background_controller(runtime)
        started = True
    shared = backend != "sqlite"
    # On SQLite every worker opens the ledger in this runtime dir; on a shared ledger
    # each worker runs on its node's machine with a runtime dir of its own there.
    where = "DIR" if shared else shlex.quote(str(runtime))
    result = {
        "ok": True,
        "run_id": run_id,
        "runtime_dir": str(runtime),
        "ledger": ledger_shown,
        "backend": backend,
        "controller_pid": controller_pid,
        "controller_started": started,
        "nodes": [node.name for node in parsed.nodes],
        "worker_commands": [
            f"laneway worker --node {shlex.quote(node.name)} --runtime-dir {where}"
            for node in parsed.nodes
        ],
    }
    common.emit(result, as_json, _started_text)


def _started_text(r: dict[str, Any]) -> str:
    shared = r["backend"] != "sqlite"
    if shared:
        lines = [f"run {r['run_id']} created in the ledger {r['ledger']}"]
    else:
        lines = [f"run {r['run_id']} created in {r['runtime_dir']}"]
    if r["controller_pid"] is None:
        lines.append(
            "no controller runs from this runtime dir: if none runs on another machine, "
            "start `laneway controller` on one (with LANEWAY_DATABASE_URL set)"
            if shared
            else "no controller runs for it: start "
            f"`laneway controller --runtime-dir {shlex.quote(r['runtime_dir'])}`"
        )
    else:
        verb = "started" if r["controller_started"] else "already running"
        lines.append(
            f"controller {verb} on this machine (pid {r['controller_pid']}, log "
            f"{r['runtime_dir']}/controller.log)"
            if shared
            else f"controller {verb} (pid {r['controller_pid']})"
        )
    if shared:
        lines.append(
            "next: a worker for each node, on that node's machine, with "
            "LANEWAY_DATABASE_URL set to this ledger and DIR a runtime dir of that machine:"
        )
    else:
        lines.append("next: a worker for each node, on this machine:")
    lines += [f"  {command}" for command in r["worker_commands"]]
    return "\n".join(lines)


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
    reuse_despite: ReuseDespiteOpt = None,
    yes: YesOpt = False,
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
    `--continue` carries that run on, `--new` starts another deliberately. With `--new`
    it first prints the plan (`laneway plan`). With or without `--new`, a plan that
    would run paid stages' work again (work an earlier run did) is asked about on a
    terminal and refused off one (cron, CI, nohup, systemd) or with --json (exit 2,
    nothing created) unless `--yes`. `--reuse-despite STAGE` keeps a stage's earlier
    results although its files changed.
    """
    from laneway.cli import live
    from laneway.controller import config as config_module
    from laneway.controller.foreground import ForegroundRun
    from laneway.workers.service import WorkerService

    with common.refusals(as_json):
        if resume:
            if new or rerun or reuse_despite:
                raise UsageError(
                    "--continue takes neither --new, --rerun nor --reuse-despite: choose one"
                )
            foreground = ForegroundRun.resume(runtime_dir, config, make_worker=WorkerService)
        else:
            if config is None:
                raise UsageError("name a pipeline CONFIG (or pass --continue)")
            _confirm_plan(
                Path(config),
                runtime_dir,
                rerun,
                reuse_despite,
                new=new,
                yes=yes,
                as_json=as_json,
                quiet=quiet,
            )
            parsed = config_module.load_config(Path(config))
            foreground = ForegroundRun.start(
                parsed,
                runtime_dir,
                make_worker=WorkerService,
                actor=common.actor(),
                new=new,
                rerun=rerun,
                reuse_despite=reuse_despite,
                config_path=Path(config),
            )
    stopper = common.Stopper()
    ended = foreground.run(
        live.Progress(foreground.run_id, quiet=quiet, as_json=as_json),
        should_stop=stopper.stop,
        should_abort=stopper.abort,
    )
    common.emit(ended.final, as_json, render.status_text)
    # How it ended and how to go on: words, or one JSON object per line with --json
    # (stderr then holds JSON lines only).
    say = common.Log(as_json)
    for notice in ended.notices():
        say(notice.event, notice.words, **notice.fields)
    if ended.exit_code:
        raise typer.Exit(ended.exit_code)
