"""Planning and starting a pipeline: ``dry-run`` and ``start-pipeline``.

``preflight`` checks everything that can be known before a run exists (paths,
executables, source files, secret references); ``plan`` shows what a run would hold and
the first admission decisions; ``start`` freezes a config into a new run, creating
nothing at all if preflight refuses.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from sqlalchemy import Engine

from laneway.controller import admission, db, ledger, ledger_open, limits, refusal_words, reuse
from laneway.controller import reuse_despite as reuse_despite_module
from laneway.controller.attempt.artifacts import GONE, still_stored
from laneway.controller.clock import Clock, SystemClock
from laneway.controller.config import (
    ENV_REF,
    PipelineConfig,
    StageConfig,
    placeholders,
    printable,
    render,
    render_argv,
    render_values,
)
from laneway.controller.durable import make_private_dir
from laneway.controller.errors import PreflightError, UnfinishedRun, UsageError
from laneway.controller.source_check import hash_file as hash_file
from laneway.controller.source_check import source_drift as source_drift


def taken_items(config: PipelineConfig) -> int:
    return min(len(config.items), config.batch_cap or len(config.items))


def no_items_reason(config: PipelineConfig) -> str:
    """Why a config without items cannot start, naming its items file when it has one
    (that file holds no items: empty, or blank lines only) and what to write there."""
    lane = config.lanes[0].name if config.lanes else "LANE"
    example = json.dumps({"key": "i01", "lane": lane})
    if config.items_file:
        return (
            f"items_file: {config.items_file} holds no items; write one JSON object per "
            f"line, e.g. {example}"
        )
    return (
        "items: the pipeline has no items; add items (each a key and a lane) or an "
        f"items_file of JSON lines, e.g. {example}"
    )


def preflight(
    config: PipelineConfig,
    environ: dict[str, str] | None = None,
    *,
    secrets_on_workers: bool = False,
    described_gpus: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """Every reason the config cannot start now, and the source hashes if it can.

    ``secrets_on_workers``: the ``${NAME}`` references of the stages' ``env`` need not be
    set here (a submit host without the workers' secrets); a worker that lacks one
    refuses the stage's jobs (``secret_missing``) instead of failing them.
    ``described_gpus``: devices a ``--gpu-description`` gives every node (``gpus = N``
    stages need a node they run on with N devices, configured or described)."""
    environ = dict(os.environ) if environ is None else environ
    reasons: list[str] = []
    if not config.items:
        reasons.append(no_items_reason(config))
    items = config.items[: taken_items(config)]
    for stage in config.stages:
        checked: set[tuple[str, str | None]] = set()
        for item in items:
            executable = render(stage.argv[0], item)
            cwd = render(stage.cwd, item) if stage.cwd else None
            if (executable, cwd) in checked:
                continue
            checked.add((executable, cwd))
            if cwd is not None and not _is_kind(cwd, stat.S_ISDIR):
                reasons.append(f"stages.{stage.name}.cwd: {cwd} is not a directory")
            problem = _executable_problem(executable, cwd)
            if problem:
                reasons.append(f"stages.{stage.name}.argv[0]: {problem}")
        for name, value in stage.env.items():
            for reference in ENV_REF.findall(value):
                if reference not in environ and not secrets_on_workers:
                    reasons.append(
                        f"stages.{stage.name}.env.{name}: ${{{reference}}} is not set; export "
                        "it in the environment of laneway and its workers (or pass "
                        "--secrets-on-workers when only the workers have it)"
                    )
    if not secrets_on_workers:
        reasons += notify_preflight(config, environ)
    reasons += _gpu_preflight(config, described_gpus)
    reasons += _argv_size_preflight(config, items)
    reasons += _closeout_preflight(config)
    reasons += artifact_store_preflight(config.artifact_store)
    hashes: dict[str, str] = {}
    for source in config.sources:
        try:
            hashes[source] = hash_file(source)
        except OSError as exc:
            reasons.append(f"sources: cannot read {source}: {exc.strerror or exc}")
    for stage in config.stages:
        for source in stage.sources or []:
            if source not in hashes:
                try:
                    hashes[source] = hash_file(source)
                except OSError as exc:
                    reasons.append(
                        f"stages.{stage.name}.sources: cannot read {source}: {exc.strerror or exc}"
                    )
        named, problems = _named_files(stage)
        hashes.update((path, digest) for path, digest in named.items() if path not in hashes)
        reasons += problems
    # A rendered value (an item's cwd with a newline) must not split a reason's line.
    return printable(reasons), hashes


def notify_preflight(config: PipelineConfig, environ: dict[str, str]) -> list[str]:
    """Each ``${NAME}`` of ``[notify]`` (its webhook and header values) that is not set
    here: the controller and workers this command starts or serves resolve them from
    the same environment, so an unset one would fail the first notification, when the
    run already needs the operator."""
    notify = config.notify
    if notify is None:
        return []
    places = [("webhook", notify.webhook or "")]
    places += [(f"headers.{name}", value) for name, value in notify.headers.items()]
    return [
        f"notify.{where}: ${{{reference}}} is not set; export it in the environment of "
        "laneway's controller and workers, which send the notifications (or pass "
        "--secrets-on-workers when only they have it)"
        for where, value in places
        for reference in dict.fromkeys(ENV_REF.findall(value))
        if reference not in environ
    ]


def _planned_devices(node: Any, described: Sequence[Any]) -> tuple[admission.DeviceView, ...]:
    """A node's devices as configured, else as described (``--gpu-description``)."""
    if node.gpu is not None:
        return tuple(
            admission.DeviceView(i, node.gpu.total_mib, node.gpu.baseline_mib)
            for i in range(node.gpu.devices)
        )
    return tuple(admission.DeviceView(d.index, d.total_mib, d.used_mib, d.uuid) for d in described)


def _gpu_preflight(config: PipelineConfig, described: int) -> list[str]:
    """A ``gpus = N`` stage needs a node it runs on with at least N devices: configured
    (``[nodes.gpu]`` ``devices``) or, for ``dry-run`` only, described
    (``--gpu-description``). The refusal names the config: ``run`` and
    ``start-pipeline`` check the config alone, and a worker that measures no GPU
    gives jobs the configured devices by index."""
    reasons = []
    devices = {
        node.name: max(node.gpu.devices if node.gpu else 0, described) for node in config.nodes
    }
    for stage in config.stages:
        if not stage.gpus:
            continue
        nodes = stage.nodes or sorted({lane.node for lane in config.lanes})
        if max((devices.get(name, 0) for name in nodes), default=0) < stage.gpus:
            reasons.append(
                f"stages.{stage.name}.gpus: {stage.gpus} GPU(s) per attempt, but no node it "
                f"runs on ({', '.join(nodes)}) has that many; give the node its GPUs in the "
                "config: `[nodes.gpu]` with total_mib and devices"
            )
    return reasons


def _named_files(stage: StageConfig) -> tuple[dict[str, str], list[str]]:
    """The files ``stage``'s argv names (``reuse.named_paths``) that exist, with their
    sha256 (frozen with the run: in its key, and a change halts it); and a problem for
    each one that names a script (``reuse.SCRIPT_SUFFIXES``) that is not there, or any
    script named relative to a stage without ``cwd`` (it would be looked for in the
    attempt's empty workspace)."""
    found: dict[str, str] = {}
    problems: list[str] = []
    for index, element, path in reuse.named_paths(stage):
        if _is_kind(path, stat.S_ISREG):
            try:
                found[path] = hash_file(path)
            except OSError as exc:
                problems.append(
                    f"stages.{stage.name}.argv[{index}]: cannot read {path}: {exc.strerror or exc}"
                )
        elif index > 0 and not _is_kind(path, stat.S_ISDIR):
            problems.append(
                f"stages.{stage.name}.argv[{index}]: {element} is not a file in "
                f"{os.path.dirname(path) or '/'}; fix the name, or set the stage's cwd to "
                "the directory that holds it"
            )
    if not stage.cwd:
        for index, element in enumerate(stage.argv[1:], start=1):
            if (
                "{" not in element
                and not os.path.isabs(element)
                and element.lower().endswith(reuse.SCRIPT_SUFFIXES)
            ):
                problems.append(
                    f"stages.{stage.name}.argv[{index}]: {element} is relative, and the stage "
                    "has no cwd, so the job would look for it in its empty workspace; set "
                    'cwd (e.g. cwd = ".", the config\'s directory) or give an absolute path'
                )
    return found, problems


def _argv_size_preflight(config: PipelineConfig, items: list[Any]) -> list[str]:
    """An argv too long to start: the worker hands it to the supervisor inside one
    argument, and Linux passes at most 128 KiB in one (``limits.MAX_ARGV_JSON_BYTES``).
    Said now, naming the stage and the items, rather than as each attempt's spawn
    failure."""
    reasons = []
    for stage in config.stages:
        long: list[tuple[str, int]] = []
        for item in items:
            size = len(json.dumps(render_argv(stage, item, _LONG_INPUTS_ROOT)))
            if size > limits.MAX_ARGV_JSON_BYTES:
                long.append((item.key, size))
        if long:
            shown = ", ".join(key for key, _ in long[:5]) + (" …" if len(long) > 5 else "")
            reasons.append(
                f"stages.{stage.name}.argv: {max(size for _, size in long) >> 10} KiB for "
                f"item(s) {shown}; an attempt's argv must stay under "
                f"{limits.MAX_ARGV_JSON_BYTES >> 10} KiB (Linux passes at most 128 KiB in one "
                "argument): pass large values in a file the job reads instead"
            )
    return reasons


_LONG_INPUTS_ROOT = "/" + "x" * 200 + "/inputs"
"""A stand-in for an attempt's ``inputs/`` directory, at least as long as a real one."""


LEDGER_FILES = {db.LEDGER_FILENAME + suffix for suffix in ("", "-wal", "-shm", "-journal")}


def artifact_store_preflight(url: str | None) -> list[str]:
    """A ``file://`` store must be, or become, a directory of its own: not the ledger's
    file or one inside it (the default ledger's files are refused by name, since a new
    runtime dir has none yet), not under an existing file."""
    if url is None:
        return []
    parts = urlsplit(url)
    if parts.scheme != "file":
        return []
    path = Path(unquote(parts.path))
    ledger_parts = [part for part in path.parts if part in LEDGER_FILES]
    if ledger_parts:
        return [
            f"artifact_store: {url} is inside laneway's ledger file {ledger_parts[0]}; "
            "give the store a directory of its own (file:///srv/laneway-artifacts)"
        ]
    for place in (path, *path.parents):
        try:
            mode = place.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet: the worker creates it, under what exists
        except OSError as exc:
            return [f"artifact_store: cannot reach {place}: {exc.strerror or exc}"]
        if stat.S_ISDIR(mode):
            return []
        what = "is" if place == path else f"is under {place}, which is"
        return [
            f"artifact_store: {url} {what} a file, not a directory; give the store a "
            "directory of its own (file:///srv/laneway-artifacts)"
        ]
    return []


def _closeout_preflight(config: PipelineConfig) -> list[str]:
    """Closeout steps checked like stages: argv[0] exists and is executable, cwd is a
    directory. A part naming ``{run}`` or ``{runtime_dir}`` is known only once the run
    exists, so it is not checked here (a failure then is the step's recorded failure)."""
    reasons = []
    for i, step in enumerate(config.closeout):
        cwd = step.cwd if step.cwd and not placeholders(step.cwd) else None
        if cwd is not None and not _is_kind(cwd, stat.S_ISDIR):
            reasons.append(f"closeout.{i}.cwd: {cwd} is not a directory (step {step.name})")
        if placeholders(step.argv[0]):
            continue
        executable = render_values(step.argv[0], {})
        problem = _executable_problem(executable, cwd)
        if problem:
            reasons.append(f"closeout.{i}.argv.0: {problem} (step {step.name})")
        reasons += _closeout_scripts(i, step, cwd)
    return reasons


def _closeout_scripts(i: int, step: Any, cwd: str | None) -> list[str]:
    """A script a closeout step's argv names (``reuse.SCRIPT_SUFFIXES``) must be there:
    relative to its ``cwd``, or absolute when it has none (it runs in ``runs/<run>/``,
    which holds no scripts)."""
    found = []
    for index, element in enumerate(step.argv[1:], start=1):
        if placeholders(element) or not element.lower().endswith(reuse.SCRIPT_SUFFIXES):
            continue
        if not os.path.isabs(element) and not step.cwd:
            found.append(
                f"closeout.{i}.argv.{index}: {element} is relative, and the step has no cwd, "
                f"so it would be looked for in runs/<run>/ (step {step.name}); set cwd (e.g. "
                'cwd = ".", the config\'s directory) or give an absolute path'
            )
        elif cwd is not None or os.path.isabs(element):
            path = os.path.join(cwd or "/", element)
            if not _is_kind(path, stat.S_ISREG):
                found.append(
                    f"closeout.{i}.argv.{index}: {element} is not a file in "
                    f"{os.path.dirname(path) or '/'} (step {step.name})"
                )
    return found


def _is_kind(path: str | Path, kind: Any) -> bool:
    """Whether ``path`` is there and of ``kind`` (``stat.S_ISDIR``, ...); False for a
    path the system refuses (too long, a loop), where ``Path.is_dir`` raises."""
    try:
        return bool(kind(os.stat(path).st_mode))
    except (OSError, ValueError):
        return False


def _executable_problem(executable: str, cwd: str | None) -> str | None:
    if "/" in executable:
        path = Path(cwd or ".") / executable
        if not _is_kind(path, stat.S_ISREG):
            return f"{executable} does not exist"
        if not os.access(path, os.X_OK):
            return f"{executable} is not executable (chmod +x)"
        return None
    if shutil.which(executable) is None:
        return f"{executable!r} is not on PATH"
    return None


def artifact_plan(config: PipelineConfig) -> dict[str, Any]:
    """Where stage outputs go and which stages hand files to which; a warning for each
    hand-off between different nodes through the default store (each worker's own
    runtime dir: readable across node names on one host, not across machines)."""
    lane_nodes = sorted({lane.node for lane in config.lanes})

    def nodes_of(stage: Any) -> list[str]:
        return sorted(stage.nodes) if stage.nodes else lane_nodes

    handoffs = []
    warnings = []
    for stage in config.stages:
        for need in stage.needs:
            producer = config.stage(need)
            if not producer.outputs:
                continue
            handoffs.append({"from": need, "to": stage.name, "outputs": list(producer.outputs)})
            crossing = sorted(set(nodes_of(stage)) - set(nodes_of(producer)))
            if crossing and config.artifact_store is None:
                warnings.append(
                    f"stage {stage.name} may run on {', '.join(crossing)}, where {need} does "
                    f"not: its inputs from {need} are in the default store, under the "
                    "producing worker's runtime dir; on separate machines set "
                    "artifact_store to a shared store (file:///shared/mount or s3://bucket)"
                )
    return {
        "store": config.artifact_store,
        "handoffs": handoffs,
        "warnings": warnings,
    }


def plan(
    config: PipelineConfig,
    *,
    mem_available_mib: float | None,
    described: Sequence[Any] = (),
) -> dict[str, Any]:
    """What a run of this config would hold, and the first admission decisions.
    ``described``: the devices (``workers.gpu.GpuDevice``) of a ``--gpu-description``,
    given to every node the config gives none."""
    count = taken_items(config)
    items = config.items[:count]
    per_lane = Counter(item.lane for item in items)
    jobs = {
        stage.name: {lane.name: per_lane.get(lane.name, 0) for lane in config.lanes}
        for stage in config.stages
    }
    first: list[dict[str, Any]] = []
    lane_node = {lane.name: lane.node for lane in config.lanes}
    # The nodes are planned one after another, as their first claims would go: a job
    # one node starts is not offered to the next, and the lane and stage caps count it.
    started: set[tuple[int, str]] = set()
    running_lane_stage: Counter[tuple[int, str, str]] = Counter()
    running_stage: Counter[tuple[int, str]] = Counter()
    for node in config.nodes:
        candidates = [
            admission.Candidate(
                job_id=position * len(config.stages) + index,
                run_id=0,
                lane=item.lane,
                stage=stage.name,
                memory_mib=stage.memory_mib,
                gpu_mib=stage.gpu_mib,
                gpus=stage.gpus,
                nodes=admission.runs_on(stage.nodes, lane_node[item.lane]),
            )
            for position, item, index, stage in _claim_order(config, items)
            if not stage.needs
            and node.name in admission.runs_on(stage.nodes, lane_node[item.lane])
            and (position, stage.name) not in started
        ]
        snapshot = admission.Snapshot(
            node=admission.NodeView(
                name=node.name,
                max_jobs=node.max_jobs,
                memory_floor_mib=node.memory_floor_mib,
                mem_available_mib=mem_available_mib,
                reserved_mib=0,
                running=0,
                has_gpu=node.gpu is not None or bool(described),
                gpu_fraction=node.gpu.fraction if node.gpu else 1.0,
                devices=_planned_devices(node, described),
            ),
            free_slots=node.max_jobs,
            candidates=candidates,
            lane_caps={(0, lane.name): dict(lane.caps) for lane in config.lanes},
            stage_caps={(0, stage.name): stage.cap for stage in config.stages},
            running_lane_stage=Counter(running_lane_stage),
            running_stage=Counter(running_stage),
        )
        verdict = admission.admit(snapshot)
        for start in verdict.starts:
            position = start.job_id // len(config.stages)
            started.add((position, start.stage))
            running_lane_stage[(0, start.lane, start.stage)] += 1
            running_stage[(0, start.stage)] += 1
            first.append(
                {
                    "node": node.name,
                    "lane": start.lane,
                    "stage": start.stage,
                    "item": items[position].key,
                    "verdict": "dispatch",
                    **(
                        {"gpus": [d.label() for d in verdict.devices[start.job_id]]}
                        if start.job_id in verdict.devices
                        else {}
                    ),
                }
            )
        for refusal in verdict.refusals:
            first.append(
                {
                    "node": node.name,
                    "lane": refusal.lane,
                    "stage": refusal.stage,
                    "verdict": "refused",
                    "reason": refusal.code,
                    "words": refusal.words(),
                }
            )
    return {
        "pipeline": config.name,
        "config_sha256": config.sha256(),
        "items": {
            "total": len(config.items),
            "taken": count,
            "deferred_by_batch_cap": len(config.items) - count,
            "keys": [item.key for item in items],
        },
        "stages": [
            {
                "name": stage.name,
                "needs": stage.needs,
                "timeout_seconds": stage.timeout_seconds,
                "memory_mib": stage.memory_mib,
                "gpu_mib": stage.gpu_mib,
                "cap": stage.cap,
                "retry": stage.retry.model_dump(),
                # Where it runs: ``nodes`` as configured (None: its lane's node), the
                # nodes that take its jobs, and in words.
                "nodes": list(stage.nodes) if stage.nodes else None,
                "runs_on": sorted(set(stage.nodes) if stage.nodes else set(lane_node.values())),
                "placement": refusal_words.placement_words(stage.nodes),
            }
            for stage in config.stages
        ],
        "artifacts": artifact_plan(config),
        # Run once when the run finishes, or is stopped and drained
        # (controller/closeout.py); argv and cwd as configured ({run} is not known yet).
        "closeout": [
            {
                "name": step.name,
                "argv": list(step.argv),
                "cwd": step.cwd,
                "timeout_seconds": step.timeout_seconds,
            }
            for step in config.closeout
        ],
        "jobs_per_stage_and_lane": jobs,
        "jobs_total": count * len(config.stages),
        "capacity": [
            {
                "node": node.name,
                "max_jobs": node.max_jobs,
                "memory_floor_mib": node.memory_floor_mib,
                "mem_available_mib": None
                if mem_available_mib is None
                else round(mem_available_mib),
                "headroom_mib": (
                    None
                    if mem_available_mib is None
                    else round(mem_available_mib - node.memory_floor_mib)
                ),
            }
            for node in config.nodes
        ],
        "first_decisions": first,
    }


def _claim_order(
    config: PipelineConfig, items: Sequence[Any]
) -> list[tuple[int, Any, int, StageConfig]]:
    """(item position, item, stage index, stage) in the order a claim offers ready jobs
    (``ledger.snapshot``'s sort): highest item priority first, later stages first, then
    item order."""
    pairs = [
        (position, item, index, stage)
        for position, item in enumerate(items)
        for index, stage in enumerate(config.stages)
    ]
    pairs.sort(key=lambda p: (-config.priority(p[1]), -p[2], p[0]))
    return pairs


def start_run(
    config: PipelineConfig,
    *,
    runtime_dir: str | Path,
    actor: str,
    clock: Clock | None = None,
    engine: Engine | None = None,
    new: bool = False,
    rerun: list[str] | None = None,
    secrets_on_workers: bool = False,
    reuse_despite: list[str] | None = None,
    config_path: str | Path | None = None,
) -> tuple[int, Engine]:
    """Preflight, then freeze ``config`` into a new run. Raises PreflightError (having
    created nothing) when preflight refuses. Returns the new run's id and the engine it
    was created through (``engine``, or the one opened here after preflight passed):
    ``laneway run`` goes on with that one engine, so the ledger is opened once per
    process.

    ``rerun``: stage names (or ``all``) whose jobs must run even where an earlier run's
    result could be reused (``ledger.create_run``). ``secrets_on_workers``: as in
    ``preflight``. ``reuse_despite``: stage names whose earlier succeeded results are
    kept although their files changed (``controller.reuse_despite``; recorded in the
    run's events). ``config_path``: the file ``config`` was read from, recorded in the run
    (absolute) so every command printed for it can be run as printed.

    Raises UnfinishedRun (creating nothing) when the ledger holds an unfinished run of
    the same pipeline, unless ``new``: running the same command again after an
    interruption must continue that run (``continue_command``), not start over.

    Never clears a pause or halt: controls are separate rows that only operators lift.
    """
    check_rerun(config, rerun or [])
    reuse_despite_module.check(config, reuse_despite or [], rerun or [])
    reasons, hashes = preflight(config, secrets_on_workers=secrets_on_workers)
    if reasons:
        raise PreflightError(reasons)
    runtime = Path(runtime_dir).resolve()
    engine = engine or ledger_open.open_ledger(runtime)
    clock = clock or SystemClock()
    despite = reuse_despite_module.read(engine, config, hashes, reuse_despite or [])
    distrust = gone_outputs(engine, config, hashes, rerun or (), despite)
    with db.transaction(db.session_factory(engine)) as session:
        unfinished = [] if new else ledger.unfinished_runs(session, config.name)
        if unfinished:
            raise UnfinishedRun(unfinished_reasons(config.name, unfinished, runtime))
        run = ledger.create_run(
            session,
            config,
            runtime_dir=str(runtime),
            source_hashes=hashes,
            actor=actor,
            now=clock.now(),
            rerun=rerun or (),
            distrust=distrust,
            despite=despite,
            config_path=None if config_path is None else str(Path(config_path).resolve()),
        )
        run_id = run.id
    make_private_dir(runtime / "runs" / str(run_id))
    return run_id, engine


def check_rerun(config: PipelineConfig, rerun: Sequence[str]) -> None:
    """UsageError when ``--rerun`` names a stage the config does not have."""
    stage_names = [stage.name for stage in config.stages]
    for name in rerun:
        if name != "all" and name not in stage_names:
            raise UsageError(
                f"--rerun: {name!r} is not a stage of {config.name!r}; "
                f"name one of {', '.join(stage_names)} or all"
            )


def gone_outputs(
    engine: Engine,
    config: PipelineConfig,
    hashes: dict[str, str],
    rerun: Sequence[str],
    despite: reuse.Despite = reuse.NO_DESPITE,
) -> dict[int, str]:
    """Reuse trusts only the store: the earlier attempts a new run of ``config`` would
    take over whose stored outputs are gone or hold other bytes (attempt id -> why; their
    jobs run again). Read, and each object hashed, before the run's write transaction,
    so nothing of it waits under the write lock; a store this machine cannot look at is
    trusted (``attempt.artifacts.still_stored``)."""
    with db.one_read(engine) as session:
        _keys, found = ledger.reuse_candidates(session, config, hashes, rerun, despite)
        outputs = ledger.stored_outputs(session, [f.attempt_id for f in found.values()])
    distrust: dict[int, str] = {}
    for attempt_id, stored in sorted(outputs.items()):
        for name, sha256, location in stored:
            verdict = still_stored(location, sha256)
            if verdict is not None and verdict[0] == GONE:
                distrust[attempt_id] = f"output {name} of attempt {attempt_id}: {verdict[1]}"
                break
    return distrust


def continue_command(run_id: int, runtime_dir: str | Path) -> str:
    """The exact command that continues run ``run_id`` in the foreground."""
    return f"laneway run --continue {run_id} --runtime-dir {shlex.quote(str(runtime_dir))}"


def unfinished_reasons(name: str, run_ids: list[int], runtime_dir: str | Path) -> list[str]:
    """Why a new run of pipeline ``name`` is refused, and the two ways on."""
    listed = ", ".join(str(run_id) for run_id in run_ids)
    return [
        f"pipeline {name!r} has an unfinished run in this ledger (run {listed}); "
        "a new run would execute its succeeded work again",
        f"continue it (nothing is re-created): {continue_command(run_ids[0], runtime_dir)}",
        "or start a new run deliberately: the same command with --new",
    ]
