"""Runs, nodes and workers: creating a run, reading its frozen config, worker liveness.

A run's config is frozen as JSON when the run is created and never changes, so it is
parsed once per process per config hash (``frozen_config``); a claim or settle reads
only the hash.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from laneway.controller import reuse
from laneway.controller.config import PipelineConfig, config_from_frozen
from laneway.controller.errors import IllegalTransition, NotFound, StaleLease
from laneway.controller.ledger import statements
from laneway.controller.ledger.reuse import HandOffs, Reusable, hand_offs, reusable_attempts
from laneway.controller.ledger.tables import items as items_table
from laneway.controller.ledger.tables import jobs as jobs_table
from laneway.controller.ledger.tables import leases, node_low_water, nodes, workers
from laneway.controller.ledger.transitions import append_event, append_events, event_row, rowcount
from laneway.controller.models import Lane, Node, Run, Worker
from laneway.controller.states import EventKind, JobState, RunState, WorkerState

_config_cache: dict[str, PipelineConfig] = {}


def frozen_config(session: Session, run_id: int, config_sha256: str) -> PipelineConfig:
    """The frozen config of a run whose hash the caller has read (parsed on a miss)."""
    cached = _config_cache.get(config_sha256)
    if cached is None:
        text = session.execute(statements.RUN_CONFIG_JSON, {"run_id": run_id}).scalar_one()
        cached = _config_cache[config_sha256] = config_from_frozen(text)
    return cached


def run_config(run: Run) -> PipelineConfig:
    """The frozen config of a run (parsed once per process per config hash)."""
    cached = _config_cache.get(run.config_sha256)
    if cached is None:
        cached = _config_cache[run.config_sha256] = config_from_frozen(run.config_json)
    return cached


def upsert_node(session: Session, node: Any, *, now: datetime) -> None:
    """Create or refresh a node's configured capacity (from a config's NodeConfig)."""
    row = session.get(Node, node.name)
    gpu = node.gpu
    values = {
        "memory_floor_mib": node.memory_floor_mib,
        "max_jobs": node.max_jobs,
        "gpu_total_mib": gpu.total_mib if gpu else None,
        "gpu_fraction": gpu.fraction if gpu else None,
        "gpu_baseline_mib": gpu.baseline_mib if gpu else None,
        "gpu_devices": gpu.devices if gpu else None,
        "updated_at": now,
    }
    if row is None:
        session.add(Node(name=node.name, **values))
    else:
        for key, value in values.items():
            setattr(row, key, value)


def reuse_candidates(
    session: Session,
    config: PipelineConfig,
    source_hashes: dict[str, str],
    rerun: Collection[str] = (),
    despite: reuse.Despite = reuse.NO_DESPITE,
) -> tuple[list[dict[str, str]], dict[str, Reusable]]:
    """The reuse keys of a new run of ``config`` (per item taken on: stage -> key) and
    the earlier succeeded attempts they match, or their ``despite`` alternate keys
    match (``controller.reuse_despite``), for the stages that allow reuse."""
    chosen = frozenset(rerun)
    items = config.items[: config.batch_cap] if config.batch_cap else config.items
    keys = [reuse.item_reuse_keys(config, item, source_hashes) for item in items]
    wanted = {
        item_keys[stage.name]
        for item_keys in keys
        for stage in config.stages
        if reuse.reuse_allowed(stage, chosen)
    } | despite.all_keys()
    return keys, reusable_attempts(session, wanted) if wanted else {}


def takeovers(
    config: PipelineConfig,
    keys: list[dict[str, str]],
    earlier: Mapping[str, Reusable],
    handed: HandOffs,
    rerun: Collection[str],
    despite: reuse.Despite = reuse.NO_DESPITE,
) -> list[dict[str, Reusable]]:
    """Per item taken on (``keys``' order): stage -> the earlier attempt its job takes
    over; a stage absent runs. Taken over when its key matched, its stage allows reuse,
    every job it needs was taken over too, from attempts that wrote exactly what the
    earlier attempt read (``HandOffs.same_inputs``). ``create_run`` and ``laneway
    plan`` decide with this one function. A key without a match may match by its
    ``despite`` alternate key (``--reuse-despite``)."""
    chosen = frozenset(rerun)
    decided: list[dict[str, Reusable]] = []
    for position, item_keys in enumerate(keys):
        reused: dict[str, Reusable] = {}
        for stage in config.stages:
            found = earlier.get(item_keys[stage.name])
            if found is None:
                found = earlier.get(despite.key(position, stage.name) or "")
            if (
                found is not None
                and reuse.reuse_allowed(stage, chosen)
                and all(need in reused for need in stage.needs)
                and handed.same_inputs(
                    found.attempt_id, [reused[n].attempt_id for n in stage.needs]
                )
            ):
                reused[stage.name] = found
        decided.append(reused)
    return decided


def create_run(
    session: Session,
    config: PipelineConfig,
    *,
    runtime_dir: str,
    source_hashes: dict[str, str],
    actor: str,
    now: datetime,
    rerun: Collection[str] = (),
    distrust: Mapping[int, str] = MappingProxyType({}),
    despite: reuse.Despite = reuse.NO_DESPITE,
    config_path: str | None = None,
) -> Run:
    """Freeze ``config`` into a new run with its lanes, items and jobs.

    Only the first ``batch_cap`` items (in config order) are taken on. A job with no
    ``needs`` starts ready; the rest wait until promotion (``controller.ledger.
    promotion``) moves them. Job ids follow item order within each stage: claims rely on
    it (``statements.ready_candidates``).

    Every job carries its reuse key (``controller.reuse``). A job whose key matches a job
    that succeeded earlier is created succeeded, ``reused_from`` that job's succeeded
    attempt, when its stage allows reuse (``reuse``, not named by ``rerun``; ``"all"``:
    no stage) and every job it needs in this run was reused too (so what re-runs
    upstream re-runs downstream) from attempts that wrote exactly the artifacts (by
    sha256) the earlier attempt read (``HandOffs.same_inputs``); a job whose needs were
    all reused starts ready. ``distrust``: earlier attempts whose outputs are no longer in
    the store as they were stored (attempt id -> why; ``pipeline.start_run`` looks before
    this transaction): their jobs run again, the reason on the job. ``despite``:
    ``--reuse-despite``'s alternate keys (``controller.reuse_despite``); a job taken
    over by one says so in its reason and its ``job_reused`` event (``despite``), and the
    ``run_created`` event lists the stages. ``config_path``: the config file it was
    started from (absolute), so the commands printed for the run name it.
    """
    chosen = frozenset(rerun)
    for node in config.nodes:
        upsert_node(session, node, now=now)
    run = Run(
        name=config.name,
        state=RunState.ACTIVE,
        config_json=config.canonical_json(),
        config_sha256=config.sha256(),
        source_hashes=source_hashes,
        runtime_dir=runtime_dir,
        config_path=config_path,
        created_by=actor,
        created_at=now,
    )
    session.add(run)
    session.flush()
    for lane in config.lanes:
        session.add(Lane(run_id=run.id, name=lane.name, node=lane.node, caps=dict(lane.caps)))
    used = {lane.node for lane in config.lanes} | {
        name for stage in config.stages for name in (stage.nodes or ())
    }
    session.execute(
        insert(node_low_water),
        [
            {"run_id": run.id, "node": node.name, "memory_floor_mib": node.memory_floor_mib}
            for node in config.nodes
            if node.name in used
        ],
    )
    items = config.items[: config.batch_cap] if config.batch_cap else config.items
    keys, all_found = reuse_candidates(session, config, source_hashes, chosen, despite)
    earlier = {k: found for k, found in all_found.items() if found.attempt_id not in distrust}
    handed = hand_offs(session, [found.attempt_id for found in earlier.values()])
    decisions = takeovers(config, keys, earlier, handed, chosen, despite)
    forgiven: dict[tuple[int, str], str] = {}
    """(item position, stage) -> what changed, for jobs taken over despite it."""
    # Items, then jobs, each in one executemany (no ORM object and no flush per item:
    # tests/integration/test_kernel_scale.py). Rows go in item order, each item's jobs
    # in stage order, and take their ids in that order, so job ids follow item order
    # within each stage.
    if items:
        session.execute(
            insert(items_table),
            [
                {
                    "run_id": run.id,
                    "key": item_config.key,
                    "lane": item_config.lane,
                    "position": position,
                    "fields": item_config.fields,
                }
                for position, item_config in enumerate(items)
            ],
        )
    item_ids: dict[int, int] = {
        row.position: row.id
        for row in session.execute(
            select(items_table.c.position, items_table.c.id).where(items_table.c.run_id == run.id)
        )
    }
    job_rows: list[dict[str, Any]] = []
    for position, item_config in enumerate(items):
        reused = decisions[position]
        """Stage -> the earlier attempt this item's job of it takes over."""
        rank = -config.priority(item_config)
        group = config.group(item_config)
        for stage_position, stage in enumerate(config.stages):
            key = keys[position][stage.name]
            found = reused.get(stage.name)
            reason: str | None = None
            if found is not None and key not in earlier:
                state = JobState.SUCCEEDED
                forgiven[(position, stage.name)] = despite.changed[position][stage.name]
                reason = (
                    f"reused despite a change (--reuse-despite {', '.join(despite.stages)}): "
                    f"attempt {found.attempt_id} of run {found.run_id}; "
                    f"{forgiven[(position, stage.name)]}"
                )
            elif found is not None:
                state = JobState.SUCCEEDED
                reason = (
                    f"reused: attempt {found.attempt_id} of run {found.run_id} succeeded "
                    "with the same stage definition, item, sources and inputs"
                )
            elif all(need in reused for need in stage.needs):
                state = JobState.READY
            else:
                state = JobState.WAITING
            doubted = distrust.get(getattr(all_found.get(key), "attempt_id", -1))
            if doubted is not None and found is None:
                reason = f"runs again, not reused: {doubted}"
            job_rows.append(
                {
                    "run_id": run.id,
                    "item_id": item_ids[position],
                    "stage": stage.name,
                    "stage_position": stage_position,
                    "lane": item_config.lane,
                    "state": state,
                    "fence": 0,
                    "attempt_count": 0,
                    "state_reason": reason,
                    "created_at": now,
                    "updated_at": now,
                    "finished_at": now if found is not None else None,
                    "reuse_key": key,
                    "reused_from": found.attempt_id if found is not None else None,
                    "priority_rank": rank,
                    "group_name": group,
                }
            )
    if job_rows:
        session.execute(insert(jobs_table), job_rows)
    reused_jobs = (
        session.execute(
            select(
                jobs_table.c.id,
                jobs_table.c.reused_from,
                jobs_table.c.reuse_key,
                jobs_table.c.item_id,
                jobs_table.c.stage,
            )
            .where(jobs_table.c.run_id == run.id, jobs_table.c.reused_from.is_not(None))
            .order_by(jobs_table.c.id)
        ).all()
        if any(row["reused_from"] is not None for row in job_rows)
        else []
    )
    position_of = {item_id: position for position, item_id in item_ids.items()}
    append_events(
        session,
        [
            event_row(
                EventKind.JOB_REUSED,
                actor=actor,
                now=now,
                run_id=run.id,
                job_id=job.id,
                attempt_id=job.reused_from,
                reuse_key=job.reuse_key,
                **_forgiven(forgiven, position_of.get(job.item_id, -1), job.stage),
            )
            for job in reused_jobs
        ],
    )
    session.execute(
        statements.INSERT_STAGE_STATS,
        [{"run_id": run.id, "stage": stage.name, "measured": 0} for stage in config.stages],
    )
    append_event(
        session,
        EventKind.RUN_CREATED,
        actor=actor,
        now=now,
        run_id=run.id,
        config_sha256=run.config_sha256,
        items=len(items),
        deferred_by_batch_cap=len(config.items) - len(items),
        reused=len(reused_jobs),
        rerun=sorted(chosen),
        **_named_despite(despite),
    )
    return run


def _named_despite(despite: reuse.Despite) -> dict[str, Any]:
    """The ``run_created`` event's ``reuse_despite`` (the stages named), when any."""
    return {"reuse_despite": list(despite.stages)} if despite.stages else {}


def _forgiven(forgiven: dict[tuple[int, str], str], position: int, stage: str) -> dict[str, str]:
    """A ``job_reused`` event's ``despite`` (what changed) for a job ``--reuse-despite``
    took over; nothing for one reused with its own key."""
    words = forgiven.get((position, stage))
    return {} if words is None else {"despite": words}


def get_run(session: Session, run_id: int | None = None) -> Run:
    """The run with ``run_id``, or the newest run when None."""
    if run_id is None:
        run = session.scalars(select(Run).order_by(Run.id.desc()).limit(1)).first()
        if run is None:
            raise NotFound("the ledger has no runs yet; start one with `laneway start-pipeline`")
        return run
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} is not in the ledger; `laneway status` lists the newest")
    return run


def unfinished_runs(session: Session, name: str | None = None) -> list[int]:
    """Ids of the active (unfinished) runs, newest first; of pipeline ``name`` only when
    given. A new run of a pipeline with one of these is refused unless asked for
    deliberately: continuing it never repeats work that succeeded."""
    query = select(Run.id).where(Run.state == RunState.ACTIVE).order_by(Run.id.desc())
    if name is not None:
        query = query.where(Run.name == name)
    return list(session.scalars(query))


def pipeline_runs(session: Session, name: str) -> list[tuple[int, RunState]]:
    """Every run of pipeline ``name`` (id, state), newest first: none means a new run
    of it is its first (nothing it would run ran before)."""
    query = select(Run.id, Run.state).where(Run.name == name).order_by(Run.id.desc())
    return [(run_id, RunState(state)) for run_id, state in session.execute(query)]


def active_run_ids(session: Session) -> list[int]:
    return list(session.scalars(select(Run.id).where(Run.state == RunState.ACTIVE)))


# -------------------------------------------------------------------------- workers


def register_worker(
    session: Session,
    *,
    node: str,
    host: str,
    pid: int,
    boot_id: str,
    process_start_time: int | None,
    slots: int,
    now: datetime,
    seams: dict[str, Any] | None = None,
) -> str:
    """Record a starting worker and return its id. ``seams``: what it chose for each
    platform seam (``workers.seams``), shown by ``laneway status``."""
    if session.get(Node, node) is None:
        raise NotFound(f"node {node!r} is not in the ledger; start a pipeline that names it first")
    worker_id = f"{node}-{pid}-{uuid.uuid4().hex[:8]}"
    session.add(
        Worker(
            id=worker_id,
            node=node,
            host=host,
            pid=pid,
            boot_id=boot_id,
            process_start_time=process_start_time,
            slots=slots,
            state=WorkerState.ACTIVE,
            started_at=now,
            heartbeat_at=now,
            seams=seams,
        )
    )
    append_event(session, EventKind.WORKER_STARTED, actor=worker_id, now=now, node=node, pid=pid)
    return worker_id


def heartbeat(
    session: Session,
    worker_id: str,
    *,
    now: datetime,
    lease_seconds: float,
    mem_available_mib: float | None,
    mem_total_mib: float | None,
    gpus: list[dict[str, Any]] | None = None,
    gpu_note: str | None = None,
    mem_low_mib: float | None = None,
    mem_low_at: datetime | None = None,
    running_runs: Collection[int] = (),
) -> int:
    """Renew the worker's heartbeat, its live leases, and its node's memory sample.

    ``mem_low_mib`` is the lowest free memory the worker measured since its last
    heartbeat (at ``mem_low_at``; ``now`` when not given), else ``mem_available_mib``: it
    lowers the node's low-water mark (``node_low_water``) in each of ``running_runs``,
    the runs the worker has attempts running for.

    Returns how many leases were renewed. Raises StaleLease if the worker is no longer
    active (the controller declared it lost).
    """
    node = session.execute(
        update(workers)
        .where(workers.c.id == worker_id, workers.c.state == WorkerState.ACTIVE.value)
        .values(heartbeat_at=now)
        .returning(workers.c.node)
    ).scalar()
    if node is None:
        raise StaleLease(f"worker {worker_id} is no longer active; it must stop writing")
    renewed = rowcount(
        session.execute(
            update(leases)
            .where(
                leases.c.worker_id == worker_id,
                leases.c.released_at.is_(None),
                leases.c.expires_at > now,
            )
            .values(expires_at=now + timedelta(seconds=lease_seconds))
        )
    )
    session.execute(
        update(nodes)
        .where(nodes.c.name == node)
        .values(
            mem_available_mib=mem_available_mib,
            mem_total_mib=mem_total_mib,
            gpus=gpus,
            gpu_note=gpu_note,
            sampled_at=now,
            updated_at=now,
        )
    )
    low = mem_low_mib if mem_low_mib is not None else mem_available_mib
    if low is not None and running_runs:
        session.execute(
            statements.LOWER_LOW_WATER,
            {
                "low_node": node,
                "run_ids": sorted(running_runs),
                "low": low,
                "at": mem_low_at or now,
            },
        )
    return renewed


def _end_worker(session: Session, worker_id: str, state: WorkerState, *, now: datetime) -> bool:
    """Active -> ``state`` (stopped or lost), a compare-and-set. False if it was no
    longer active."""
    changed = rowcount(
        session.execute(
            update(workers)
            .where(workers.c.id == worker_id, workers.c.state == WorkerState.ACTIVE.value)
            .values(state=state.value, stopped_at=now)
        )
    )
    return changed == 1


def stop_worker(session: Session, worker_id: str, *, now: datetime) -> None:
    """A worker's clean exit."""
    if not _end_worker(session, worker_id, WorkerState.STOPPED, now=now):
        raise IllegalTransition(f"worker {worker_id} is not active")
    append_event(session, EventKind.WORKER_STOPPED, actor=worker_id, now=now)


def mark_worker_lost(
    session: Session, worker_id: str, *, now: datetime, actor: str, reason: str
) -> bool:
    """Active -> lost (compare-and-set). Returns False if it was no longer active."""
    lost = _end_worker(session, worker_id, WorkerState.LOST, now=now)
    if lost:
        append_event(
            session, EventKind.WORKER_LOST, actor=actor, now=now, worker=worker_id, reason=reason
        )
    return lost


def stale_workers(session: Session, *, now: datetime, lost_after: float) -> list[str]:
    """Active workers whose heartbeat is older than ``lost_after`` seconds (read-only)."""
    cutoff = now - timedelta(seconds=lost_after)
    return list(session.execute(statements.STALE_WORKERS, {"cutoff": cutoff}).scalars())


def mark_lost_workers(
    session: Session, *, now: datetime, lost_after: float, actor: str
) -> list[str]:
    """Active workers whose heartbeat is older than ``lost_after`` seconds become lost.
    Their leases are left to expire (``expire_leases``) rather than revoked here."""
    lost = stale_workers(session, now=now, lost_after=lost_after)
    for worker_id in lost:
        mark_worker_lost(session, worker_id, now=now, actor=actor, reason="heartbeat stopped")
    return lost


def active_workers(session: Session, *, node: str) -> list[Worker]:
    return list(
        session.scalars(
            select(Worker).where(Worker.node == node, Worker.state == WorkerState.ACTIVE)
        )
    )
