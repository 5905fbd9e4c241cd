"""The admission snapshot: what ``controller.admission`` sees for one node, now.

Read-only. Every query here is bounded by what is live (the active runs and their lanes,
the node's running and unknown attempts, its live reservations, active controls) or by
the free slots (the ready candidates), never by the number of jobs or events in the
ledger.

Placement: a node's candidates are the jobs of its own lanes' stages that have no
``nodes``, and the jobs of every lane of a stage whose ``nodes`` name it. Lane and
stage caps count running jobs by lane, wherever they run; memory, slots and GPU are
the claiming node's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row
from sqlalchemy.orm import Session

from laneway.controller import admission
from laneway.controller.config import PipelineConfig
from laneway.controller.errors import NotFound
from laneway.controller.ledger import selection, statements
from laneway.controller.ledger import usage as usage_ledger
from laneway.controller.ledger.runs import frozen_config
from laneway.controller.models import Run
from laneway.controller.states import AttemptState


@dataclass(frozen=True)
class RunInfo:
    """What a claim needs of a run: never its whole frozen config text."""

    id: int
    config_sha256: str
    runtime_dir: str
    source_hashes: dict[str, str]
    config: PipelineConfig


def stage_peaks(
    session: Session, run_ids: list[int]
) -> dict[tuple[int, str], tuple[float | None, float | None]]:
    """(run, stage) -> (peak RSS MiB, peak GPU MiB) over the stage's settled attempts
    (kept per stage by each settle: one row per stage, however many attempts)."""
    if not run_ids:
        return {}
    rows = session.execute(statements.STAGE_PEAKS, {"run_ids": run_ids}).all()
    return {(r.run_id, r.stage): (r.peak_rss_mib, r.peak_gpu_mib) for r in rows}


def memory_floor(session: Session, *, node: str) -> int | None:
    """The node's memory floor (MiB), None if the node is not in the ledger."""
    row = session.execute(statements.NODE_ROW, {"node": node}).first()
    return None if row is None else int(row.memory_floor_mib)


def reservation_mib(stage: Any, peak_rss_mib: float | None) -> float:
    """The memory a stage reserves: configured, or with ``learn_memory`` the larger of
    that minimum and the measured peak times the margin."""
    if stage.learn_memory and peak_rss_mib is not None:
        return float(max(stage.memory_mib, peak_rss_mib * stage.memory_margin))
    return float(stage.memory_mib)


def _gpu_capacity(node: Row[Any]) -> dict[str, float]:
    """Total and baseline GPU memory: measured by the node's worker when it can, else as
    configured; the usable fraction is always configured."""
    if node.gpus:
        total = sum(float(d["total_mib"]) for d in node.gpus)
        baseline = sum(float(d["baseline_mib"]) for d in node.gpus)
    else:
        total = float(node.gpu_total_mib or 0)
        baseline = float(node.gpu_baseline_mib or 0)
    return {
        "gpu_total_mib": total,
        "gpu_fraction": float(node.gpu_fraction or 1.0),
        "gpu_baseline_mib": baseline,
    }


def node_devices(
    node: Row[Any], holders: dict[int, list[admission.Holder]]
) -> tuple[admission.DeviceView, ...]:
    """The node's GPUs: as its worker last reported them (measured or described), else
    as configured (``gpu_devices`` devices of ``gpu_total_mib`` each), each with the
    attempts that hold it."""
    if node.gpus:
        return tuple(
            admission.DeviceView(
                int(d.get("index", i)),
                float(d["total_mib"]),
                float(d.get("baseline_mib") or 0.0),
                d.get("uuid"),
                tuple(holders.get(int(d.get("index", i)), ())),
            )
            for i, d in enumerate(node.gpus)
        )
    if node.gpu_total_mib is None:
        return ()
    return tuple(
        admission.DeviceView(
            i,
            float(node.gpu_total_mib),
            float(node.gpu_baseline_mib or 0),
            None,
            tuple(holders.get(i, ())),
        )
        for i in range(node.gpu_devices or 1)
    )


def admission_snapshot(
    session: Session,
    *,
    node: str,
    free_slots: int,
    mem: float | None,
    limit: int | None = None,
    lock: bool = True,
    job_id: int | None = None,
    now: datetime | None = None,
) -> tuple[admission.Snapshot, dict[int, tuple[Any, RunInfo]]]:
    """What admission sees for ``node`` now. Read-only; ``lock`` takes row locks on
    PostgreSQL (claims), ``job_id`` narrows the candidates to one job (explain).
    ``now`` (the database clock): the moment rate limits' windows end at (None: no rate
    limit is checked).

    Candidates: the first ``free_slots + 1`` ready jobs of each (run, lane, stage) the
    node runs, and of each item group in a run that selects by yield (``limit``
    overrides the per-partition count): its lanes' stages without ``nodes``, and every
    lane's stages whose ``nodes`` name it.
    """
    node_row = session.execute(statements.NODE_ROW_HELD, {"node": node}).first()
    if node_row is None:
        raise NotFound(f"node {node!r} is not in the ledger")
    run_infos, placed = node_run_infos(session, node)
    lane_caps: dict[tuple[int, str], dict[str, int]] = {}
    own_lanes: set[tuple[int, str]] = set()
    lanes_of: dict[int, list[str]] = {}
    for run_id, info in run_infos.items():
        # Every lane of a run whose stages this node may run: its caps count the jobs of
        # the lane wherever they run. From the run's frozen config, parsed once per hash:
        # its ``lanes`` rows are written from it when the run is created and never change.
        for lane in info.config.lanes:
            lane_caps[(run_id, lane.name)] = dict(lane.caps)
            lanes_of.setdefault(run_id, []).append(lane.name)
            if lane.node == node:
                own_lanes.add((run_id, lane.name))
    run_ids = sorted(run_infos)
    stage_caps: dict[tuple[int, str], int | None] = {}
    partitions: list[tuple[int, str, str, str | None]] = []
    placement: dict[tuple[int, str, str], tuple[str, ...]] = {}
    for run_id, info in run_infos.items():
        for stage in info.config.stages:
            stage_caps[(run_id, stage.name)] = stage.cap
    for run_id in run_ids:
        stages = run_infos[run_id].config.stages
        for lane_name in sorted(lanes_of.get(run_id, [])):
            for stage in stages:
                # The lane's node runs the stages without ``nodes``; a stage with
                # ``nodes`` runs on those, whichever node its lane is bound to.
                mine = (
                    stage.name in placed.get(run_id, ())
                    if stage.nodes
                    else ((run_id, lane_name) in own_lanes)
                )
                if mine:
                    partitions += [
                        (run_id, lane_name, stage.name, group)
                        for group in groups_of(run_infos[run_id].config)
                    ]
                    placement[(run_id, lane_name, stage.name)] = admission.runs_on(
                        stage.nodes, node
                    )

    per_partition = limit if limit is not None else free_slots + 1
    ready_rows = _ready_rows(session, partitions, per_partition, job_id=job_id, lock=lock)
    # Peaks matter only to a stage that learns its memory or uses a GPU: no read for
    # the rest (most stages), however many runs are active.
    peaks = stage_peaks(
        session,
        sorted({job.run_id for job in ready_rows if _uses_peaks(run_infos[job.run_id], job.stage)}),
    )
    budgets, spend = budget_state(session, run_infos)
    expected: dict[tuple[int, str], dict[str, tuple[float, str]]] = {}
    limit_costs: dict[tuple[int, str, str], dict[str, tuple[float, str]]] = {}
    candidates = []
    jobs_by_id: dict[int, tuple[Any, RunInfo]] = {}
    for job in ready_rows:
        info = run_infos[job.run_id]
        stage = info.config.stage(job.stage)
        rss_peak, gpu_peak = peaks.get((job.run_id, job.stage), (None, None))
        keys = set(budgets.get((job.run_id, None), {})) | set(
            budgets.get((job.run_id, job.stage), {})
        )
        if keys and (job.run_id, job.stage) not in expected:
            expected[(job.run_id, job.stage)] = usage_ledger.expected_cost(
                session, job.run_id, stage, keys
            )
        costs = expected.get((job.run_id, job.stage), {})
        limit_keys = {key for name in stage.limits for key in info.config.limits[name].usage}
        if limit_keys and (job.run_id, job.stage, "limits") not in limit_costs:
            limit_costs[(job.run_id, job.stage, "limits")] = usage_ledger.expected_cost(
                session, job.run_id, stage, limit_keys
            )
        candidates.append(
            admission.Candidate(
                job_id=job.id,
                run_id=job.run_id,
                lane=job.lane,
                stage=job.stage,
                memory_mib=reservation_mib(stage, rss_peak),
                gpu_mib=stage.gpu_mib,
                gpus=stage.gpus,
                gpu_peak_mib=gpu_peak,
                expected_usage={key: cost for key, (cost, _) in costs.items()},
                expected_from={key: source for key, (_, source) in costs.items()},
                nodes=placement[(job.run_id, job.lane, job.stage)],
                limits=tuple(stage.limits),
                group=job.group_name,
                limit_usage={
                    key: cost
                    for key, (cost, _) in limit_costs.get(
                        (job.run_id, job.stage, "limits"), {}
                    ).items()
                },
            )
        )
        jobs_by_id[job.id] = (job, info)

    running_lane_stage: Counter[tuple[int, str, str]] = Counter()
    running_stage: Counter[tuple[int, str]] = Counter()
    if run_ids:
        for run_id, lane, stage_name, count in session.execute(
            statements.RUNNING_BY_LANE_STAGE, {"run_ids": run_ids}
        ):
            running_lane_stage[(run_id, lane, stage_name)] += count
            running_stage[(run_id, stage_name)] += count

    node_running = node_row.held or 0
    # "Unreleased" (statements.NODE_UNRELEASED), read with the node's row.
    reserved = float(node_row.unreleased or 0.0)
    has_gpu = node_row.gpu_total_mib is not None or bool(node_row.gpus)
    gpu_running_peaks: list[float | None] = []
    holders: dict[int, list[admission.Holder]] = {}
    # Only a node with GPUs holds devices: who holds which is read there alone.
    held_rows = (
        session.execute(statements.NODE_RESERVATIONS, {"node": node}).all() if has_gpu else []
    )
    for gpu_mib, run_id, stage_name, given in held_rows:
        if gpu_mib > 0 or given:
            if (run_id, stage_name) not in peaks:
                peaks.update(stage_peaks(session, [run_id]))
            peak = peaks.get((run_id, stage_name), (None, None))[1]
            gpu_running_peaks.append(peak)
            # An attempt admitted before devices were recorded holds a share of device 0.
            for device in given or [{"index": 0, "whole": False}]:
                holders.setdefault(int(device["index"]), []).append(
                    admission.Holder(bool(device.get("whole")), peak)
                )
    controls, unknown_runs, unknown_everywhere = stopping(session, run_infos)
    waiting: set[tuple[int, str]] = set()
    # Only the node's own lanes: "waiting on earlier stages" is their lane-level reason,
    # recorded by the node the lane is bound to; and only those with no ready candidate
    # (admission gives that reason to no other lane), so a busy lane costs no read here.
    with_candidates = {(job.run_id, job.lane) for job in ready_rows}
    for chunk in statements.chunks(sorted(own_lanes - with_candidates)):
        waiting.update((r.run_id, r.lane) for r in session.execute(statements.waiting_lanes(chunk)))
    snapshot = admission.Snapshot(
        node=admission.NodeView(
            name=node,
            max_jobs=node_row.max_jobs,
            memory_floor_mib=node_row.memory_floor_mib,
            mem_available_mib=mem,
            reserved_mib=reserved,
            running=node_running,
            has_gpu=has_gpu,
            gpu_running_peaks=tuple(gpu_running_peaks),
            devices=node_devices(node_row, holders),
            **_gpu_capacity(node_row),
        ),
        free_slots=free_slots,
        candidates=candidates,
        lane_caps=lane_caps,
        stage_caps=stage_caps,
        running_lane_stage=running_lane_stage,
        running_stage=running_stage,
        controls=controls,
        unknown_runs=unknown_runs,
        unknown_everywhere=unknown_everywhere,
        waiting_lanes=waiting,
        budgets=budgets,
        spend=spend,
        rates={} if now is None else rate_windows(session, run_infos, now),
        selections=selection.selection_views(
            session, {run_id: info.config for run_id, info in run_infos.items()}
        ),
    )
    return snapshot, jobs_by_id


def stopping(
    session: Session, run_infos: dict[int, RunInfo]
) -> tuple[list[admission.ControlView], dict[int, int], int]:
    """``stoppers`` as admission reads them: the active controls, the unknown attempts
    of each of ``run_infos``, and those of runs whose ``unknown_scope`` is "everything"
    (they stop every run's dispatch)."""
    controls, unknown = stoppers(session)
    unknown_runs: dict[int, int] = {}
    unknown_everywhere = 0
    for run_id, count in unknown.items():
        if run_id in run_infos:
            unknown_runs[run_id] = count
            scope = run_infos[run_id].config.unknown_scope
        else:
            owner = session.get(Run, run_id)
            sha = owner.config_sha256 if owner is not None else None
            scope = frozen_config(session, run_id, sha).unknown_scope if sha else "run"
        if scope == "everything":
            unknown_everywhere += count
    return controls, unknown_runs, unknown_everywhere


def stoppers(session: Session) -> tuple[list[admission.ControlView], dict[int, int]]:
    """What stops dispatch whatever the candidates, in one statement: the active
    controls, and per run the number of attempts awaiting reconciliation."""
    controls: list[admission.ControlView] = []
    unknown: dict[int, int] = {}
    for row in session.execute(statements.STOPPERS):
        if row.unknown is None:
            controls.append(
                admission.ControlView(row.kind, row.scope, row.run_id, row.lane, row.reason)
            )
        else:
            unknown[int(row.run_id)] = int(row.unknown)
    return controls, unknown


def _uses_peaks(info: RunInfo, stage_name: str) -> bool:
    """Does admission read a stage's measured peaks (``reservation_mib``, GPU shares)?"""
    stage = info.config.stage(stage_name)
    return bool(stage.learn_memory or stage.gpu_mib or stage.gpus)


def rate_windows(
    session: Session, run_infos: dict[int, RunInfo], now: datetime
) -> dict[tuple[int, str], admission.RateWindow]:
    """(run, limit) -> the limit's window ending ``now``: the attempts of the stages that
    draw from it started since ``now - per_seconds`` (one index range per limit:
    ``ix_attempts_run_intent``, so the cost follows the window), what they reported of
    its usage keys, and the expected use of those still in flight."""
    windows: dict[tuple[int, str], admission.RateWindow] = {}
    for run_id, info in run_infos.items():
        for name, limit in info.config.limits.items():
            stages = [s.name for s in info.config.stages if name in s.limits]
            if not stages:
                continue
            since = now - timedelta(seconds=limit.per_seconds)
            rows = session.execute(
                statements.WINDOW_ATTEMPTS,
                {"b_run_id": run_id, "b_since": since, "b_stages": stages},
            ).all()
            used: dict[str, float] = dict.fromkeys(limit.usage, 0.0)
            if rows and limit.usage:
                reported: dict[tuple[int, str], float] = {
                    (r.attempt_id, r.key): float(r.value)
                    for r in session.execute(
                        statements.WINDOW_USAGE,
                        {"b_ids": [r.id for r in rows], "b_keys": sorted(limit.usage)},
                    )
                }
                flight: dict[str, dict[str, tuple[float, str]]] = {}
                for row in rows:
                    live = row.state != AttemptState.SETTLED.value
                    for key in limit.usage:
                        if (row.id, key) in reported:
                            used[key] += reported[(row.id, key)]
                        elif live:
                            if row.stage not in flight:
                                flight[row.stage] = usage_ledger.expected_cost(
                                    session, run_id, info.config.stage(row.stage), limit.usage
                                )
                            used[key] += flight[row.stage][key][0]
            oldest = min((_moment(r.intent_at) for r in rows), default=None)
            windows[(run_id, name)] = admission.RateWindow(
                name=name,
                per_seconds=limit.per_seconds,
                calls=limit.calls,
                started=len(rows),
                usage=dict(limit.usage),
                used=used,
                frees_in_seconds=None
                if oldest is None
                else round(max(0.0, (oldest - since).total_seconds()), 3),
            )
    return windows


def _moment(value: Any) -> datetime:
    """A timestamp column as a datetime (SQLite hands aggregates back as text)."""
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def node_run_infos(session: Session, node: str) -> tuple[dict[int, RunInfo], dict[int, set[str]]]:
    """The active runs ``node`` may run jobs of: those with a lane bound to it and those
    with a stage whose ``nodes`` name it; and, per run, the names of those stages. One
    row per active run (configs parsed once per hash), never a look at the jobs."""
    infos: dict[int, RunInfo] = {}
    placed: dict[int, set[str]] = {}
    for row in session.execute(statements.ACTIVE_RUNS).all():
        config = frozen_config(session, row.run_id, row.config_sha256)
        named = {stage.name for stage in config.stages if stage.nodes and node in stage.nodes}
        if not named and not any(lane.node == node for lane in config.lanes):
            continue
        if named:
            placed[row.run_id] = named
        infos[row.run_id] = RunInfo(
            row.run_id,
            row.config_sha256,
            row.runtime_dir,
            dict(row.source_hashes or {}),
            config,
        )
    return infos, placed


def budget_state(
    session: Session, run_infos: dict[int, RunInfo]
) -> tuple[
    dict[tuple[int, str | None], dict[str, float]],
    dict[tuple[int, str | None, str], tuple[float, float]],
]:
    """The budgets of these runs (run-wide: stage None) and, for runs that have one,
    what was spent and is held per (run, stage or None, key), from ``usage_totals``."""
    budgets: dict[tuple[int, str | None], dict[str, float]] = {}
    for run_id, info in run_infos.items():
        if info.config.budget:
            budgets[(run_id, None)] = dict(info.config.budget)
        for stage in info.config.stages:
            if stage.budget:
                budgets[(run_id, stage.name)] = dict(stage.budget)
    spend: dict[tuple[int, str | None, str], tuple[float, float]] = {}
    totals = usage_ledger.run_spend(session, {run_id for run_id, _ in budgets})
    for run_id, figures in totals.items():
        for key, total in figures.run.items():
            spend[(run_id, None, key)] = (total.spent, total.reserved)
        for (stage_name, key), total in figures.stages.items():
            spend[(run_id, stage_name, key)] = (total.spent, total.reserved)
    return budgets, spend


def groups_of(config: PipelineConfig) -> list[str | None]:
    """The item groups a run's claims take candidates from: each group, in a run that
    selects by yield; else [None] (one queue)."""
    if config.select is None:
        return [None]
    return [*sorted({str(item.fields[config.group_field]) for item in config.items})]


def _ready_rows(
    session: Session,
    partitions: list[tuple[int, str, str, str | None]],
    per_partition: int,
    *,
    job_id: int | None,
    lock: bool,
) -> list[Any]:
    """The candidates, in dispatch order: highest priority first, then run, later
    stages first, then item order."""
    if not partitions or per_partition <= 0:
        return []
    rows: list[Any] = []
    if job_id is not None:
        wanted = set(partitions)
        rows = [
            row
            for row in session.execute(statements.READY_JOB, {"job_id": job_id}).all()
            if (row.run_id, row.lane, row.stage, row.group_name) in wanted
        ]
    else:
        # A claim on PostgreSQL locks the candidates as it reads them, skipping those
        # racing workers' claims hold (SQLite's BEGIN IMMEDIATE already serialises claims).
        locked = lock and session.get_bind().dialect.name != "sqlite"
        for chunk in statements.chunks(partitions):
            rows += session.execute(statements.ready_candidates(chunk, per_partition, locked)).all()
    # Highest priority first (across runs too), then run, later stages, item order.
    rows.sort(key=lambda r: (r.priority_rank, r.run_id, -r.stage_position, r.item_position))
    return rows
