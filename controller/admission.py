"""Admission: a pure function from a snapshot to the jobs to start and every refusal.

No database, no clock, no processes: the worker's lease transaction builds a Snapshot
from the ledger, calls ``admit``, and writes what it returns. Tests call ``admit`` with
hand-built snapshots.

Reason codes, in the order they are checked for a candidate job:

- ``other_node`` — the job's stage runs on other nodes (its ``nodes``, or by default its
  lane's node), not this one. The snapshot never offers such a job to a claim; ``explain``
  says it for a node that is asked about a job it does not run.
- ``halted`` — a halt control covers the run, lane or everything.
- ``unknown_outcome`` — the run has an attempt whose outcome is unknown (invariant 3).
- ``paused`` / ``stopped`` — a pause or stop (drain) control covers it.
- ``rate_limit`` — the stage draws from a rate limit (``limits``) that this attempt
  would pass: the attempts started within its window, plus those this claim starts, plus
  one, exceed ``calls``; or the usage reported in the window (and expected of attempts
  still in flight) plus this attempt's expected usage exceeds a key's amount. The window
  is read from the ledger on the database clock, so it holds across machines; the
  detail says when the oldest attempt in it leaves (``frees_in_seconds``).
- ``secret_missing`` — this worker's environment lacks a variable the stage's ``env``
  references or its ``pass_env`` names (a run started with ``--secrets-on-workers``
  leaves them to the workers): it claims none of the stage's jobs, instead of failing
  them; a worker of the node that has them (or this one, restarted with them) does.
- ``max_jobs`` — the node already runs ``max_jobs`` attempts.
- ``slots_full`` — this worker has no free slot.
- ``lane_cap`` — the lane's cap for the stage is reached.
- ``stage_cap`` — the stage's global cap (across lanes) is reached.
- ``gpu_capacity`` — a GPU stage on a node without a GPU, or with fewer devices than
  the stage's ``gpus``.
- ``gpu_busy`` — a ``gpus = N`` stage: fewer than N of the node's devices are free (a
  whole device is given to one attempt only); a ``gpu_mib`` stage: every device is held
  whole. Names each device and what holds it.
- ``gpu_memory`` — a ``gpu_mib`` stage (a share of one device): on no device does it
  fit, per device: another attempt holds it and a measured peak is missing (the first
  runs alone on a device), or ``baseline + k * peak > fraction * total`` of that device
  (invariant 9; see ``_gpu_refusal``), with each device's arithmetic.
- ``memory_floor`` — ``available - unreleased - stage reservation < floor``. Equality
  admits. ``available`` is the node's live free memory (psutil), which already includes
  what running attempts use; ``unreleased`` is, summed over the node's running (and
  unknown) attempts, ``max(0, reservation - current measured RSS of its tree)``: the
  part of each reservation the attempt may still grow into. An attempt not yet sampled
  holds its whole reservation. The stage reservation is the configured ``memory_mib``,
  or, with ``learn_memory``, ``max(memory_mib, measured peak x memory_margin)``.
- ``budget`` — the run's (or the stage's) ``budget`` for a usage key is reached, or
  ``spent + reserved + expected > budget``: ``spent`` is what settled attempts
  reported, ``reserved`` the expected costs held by attempts still running or unknown
  (they may have spent), ``expected`` this attempt's expected cost: the p90 of the
  stage's newest reported values in this run, or its ``expected_usage`` until there
  are any. Equality admits. Checked right after the controls: only more budget (or a
  reconcile that gives a reservation back) lifts it.
- ``needs_pending`` — (lane-level) nothing is ready, but jobs wait on earlier stages
  (unless a halt, unknown outcome, pause or stop covers the lane: that is the reason).

One more code is not admission's own: ``no_worker`` — no live worker serves the node (or
any of the nodes) that runs the job's stage, so nothing claims its jobs at all.
``controller.status_nodes`` and ``controller.report`` derive it from the ``workers`` table;
``describe`` words it like the others.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from laneway.controller import usage as usage_math
from laneway.controller.codes import CONTROL_CODES, RefusalCode
from laneway.controller.refusal_words import describe
from laneway.controller.states import ControlKind

Reason = tuple[RefusalCode, dict[str, Any]]
"""A refusal's code and its numbers (the detail the ledger records and words)."""


def runs_on(stage_nodes: Sequence[str] | None, lane_node: str) -> tuple[str, ...]:
    """The nodes that may run a job: its stage's ``nodes``, else its lane's node."""
    return tuple(stage_nodes) if stage_nodes else (lane_node,)


@dataclass(frozen=True)
class Candidate:
    job_id: int
    run_id: int
    lane: str
    stage: str
    memory_mib: float = 0
    """The reservation admission uses: configured, or learned from measured peaks."""
    gpu_mib: int = 0
    gpu_peak_mib: float | None = None
    """The stage's measured GPU peak (settled attempts), if any."""
    expected_usage: dict[str, float] = field(default_factory=dict, compare=False)
    """Usage key -> this attempt's expected cost, for each key a budget covers."""
    expected_from: dict[str, str] = field(default_factory=dict, compare=False)
    """Usage key -> where the expected cost comes from (``p90 of N attempt(s)``, ...)."""
    nodes: tuple[str, ...] = ()
    """The nodes that may run it (``runs_on``); empty: not said, any node."""
    gpus: int = 0
    """Whole devices it asks for (stage ``gpus``); 0: none, or a share (``gpu_mib``)."""
    limits: tuple[str, ...] = ()
    """The rate limits its stage draws from (``StageConfig.limits``)."""
    group: str | None = None
    """Its item's group, in a run that selects by yield."""
    limit_usage: dict[str, float] = field(default_factory=dict, compare=False)
    """Usage key -> this attempt's expected use, for each key one of its limits counts."""


@dataclass(frozen=True)
class GroupView:
    """An item group of a run that selects by yield: admissions so far, and what its
    settled attempts reported of the selection's keys."""

    admitted: int = 0
    measured: int = 0
    by_total: float = 0.0
    per_total: float = 0.0

    def yield_(self) -> float | None:
        """``by`` per ``per`` (None: nothing measured yet; infinite when it spent 0)."""
        if not self.measured:
            return None
        if self.per_total <= 0:
            return math.inf if self.by_total > 0 else 0.0
        return self.by_total / self.per_total


@dataclass(frozen=True)
class SelectionView:
    """A run's ``select``: its keys, its exploration share, and its groups."""

    by: str
    per: str
    explore: float
    groups: dict[str, GroupView] = field(default_factory=dict)


def order_by_yield(
    candidates: list[Candidate], view: SelectionView
) -> list[tuple[Candidate, dict[str, Any]]]:
    """A run's candidates in the order its selection takes them, each with the figures
    of its choice. Slot by slot: the group with the best measured ``by`` per ``per``,
    unless the groups other than that one have had less than ``explore`` of the
    admissions (this one counted), when the other group with a ready job goes next in
    turn: one not measured yet first, then the one admitted least. Before any group is
    measured every slot explores. Within a group, the candidates keep their order."""
    queues: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        queues.setdefault(candidate.group or "", []).append(candidate)
    admitted = {name: g.admitted for name, g in view.groups.items()}
    yields = {name: g.yield_() for name, g in view.groups.items()}
    ordered: list[tuple[Candidate, dict[str, Any]]] = []
    while any(queues.values()):
        ready = sorted(name for name, queue in queues.items() if queue)
        measured = [name for name in ready if yields.get(name) is not None]
        best = max(measured, key=lambda n: (yields[n], -admitted.get(n, 0))) if measured else None
        total = sum(admitted.values()) + 1
        explored = total - 1 - (admitted.get(best, 0) if best is not None else 0)
        others = [name for name in ready if name != best]
        if best is not None and (not others or explored >= view.explore * total):
            chosen, why = best, "best yield"
        else:
            chosen = min(others, key=lambda n: (yields.get(n) is not None, admitted.get(n, 0), n))
            why = "explore" if yields.get(chosen) is None else "explore (in turn)"
        ordered.append(
            (
                queues[chosen].pop(0),
                {
                    "group": chosen,
                    "why": why,
                    "best": best,
                    "explore": view.explore,
                    "yields": {n: (None if y is None else round(y, 6)) for n, y in yields.items()},
                    "admitted": dict(admitted),
                    "by": view.by,
                    "per": view.per,
                },
            )
        )
        admitted[chosen] = admitted.get(chosen, 0) + 1
    return ordered


@dataclass(frozen=True)
class RateWindow:
    """A rate limit of a run as the ledger says it stands now: its caps and what the
    attempts started within its window took."""

    name: str
    per_seconds: float
    calls: int | None
    started: int
    """Attempts started within the window."""
    usage: dict[str, float] = field(default_factory=dict)
    """Usage key -> the most the window may take."""
    used: dict[str, float] = field(default_factory=dict)
    """Usage key -> reported by attempts started in the window, plus the expected use of
    those still in flight."""
    frees_in_seconds: float | None = None
    """When the oldest attempt in the window leaves it (None: the window is empty)."""


@dataclass(frozen=True)
class Holder:
    """An attempt holding (part of) a device: whole, or a share with its stage's
    measured GPU peak (None: not measured yet)."""

    whole: bool
    peak_mib: float | None = None


@dataclass(frozen=True)
class DeviceView:
    """One GPU of a node (a MIG instance counts as one): its memory and who holds it."""

    index: int
    total_mib: float
    baseline_mib: float = 0
    """Memory used by processes that are not ours (measured, else configured)."""
    uuid: str | None = None
    holders: tuple[Holder, ...] = ()

    def label(self) -> str:
        return f"GPU {self.index}"


@dataclass(frozen=True)
class ControlView:
    kind: str  # pause | stop | halt
    scope: str  # run | lane | global
    run_id: int | None
    lane: str | None
    reason: str

    def covers(self, run_id: int, lane: str) -> bool:
        if self.scope == "global":
            return True
        if self.run_id != run_id:
            return False
        return self.scope == "run" or self.lane == lane


@dataclass(frozen=True)
class NodeView:
    name: str
    max_jobs: int
    memory_floor_mib: int
    mem_available_mib: float | None
    reserved_mib: float
    running: int
    has_gpu: bool = False
    gpu_running_peaks: tuple[float | None, ...] = ()
    """One entry per GPU attempt running on this node: its stage's measured GPU peak."""
    gpu_total_mib: float = 0
    gpu_fraction: float = 1.0
    gpu_baseline_mib: float = 0
    """GPU memory used by processes that are not ours (measured, else configured)."""
    devices: tuple[DeviceView, ...] = ()
    """The node's GPUs, each with its holders. Empty on a node with ``has_gpu``: one
    device of ``gpu_total_mib`` held by ``gpu_running_peaks`` (``node_devices``)."""


def node_devices(node: NodeView) -> tuple[DeviceView, ...]:
    """The node's devices (``NodeView.devices``, or the single device its pool
    describes)."""
    if node.devices or not node.has_gpu:
        return node.devices
    holders = tuple(Holder(False, peak) for peak in node.gpu_running_peaks)
    return (DeviceView(0, node.gpu_total_mib, node.gpu_baseline_mib, None, holders),)


@dataclass
class Snapshot:
    node: NodeView
    free_slots: int
    candidates: list[Candidate]
    lane_caps: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)
    stage_caps: dict[tuple[int, str], int | None] = field(default_factory=dict)
    running_lane_stage: Counter[tuple[int, str, str]] = field(default_factory=Counter)
    running_stage: Counter[tuple[int, str]] = field(default_factory=Counter)
    controls: list[ControlView] = field(default_factory=list)
    unknown_runs: dict[int, int] = field(default_factory=dict)
    """run id -> number of attempts awaiting reconciliation."""
    unknown_everywhere: int = 0
    """Unknown attempts of runs whose ``unknown_scope`` is "everything": they stop every
    run's dispatch, not only their own."""
    waiting_lanes: set[tuple[int, str]] = field(default_factory=set)
    """(run, lane) pairs with jobs waiting on `needs` (the ledger's snapshot looks only
    at lanes with no candidate: the only ones ``admit`` reads it for)."""
    budgets: dict[tuple[int, str | None], dict[str, float]] = field(default_factory=dict)
    """(run, stage or None for the run) -> usage key -> budget."""
    spend: dict[tuple[int, str | None, str], tuple[float, float]] = field(default_factory=dict)
    """(run, stage or None, usage key) -> (spent, reserved by live attempts)."""
    missing_secrets: dict[tuple[int, str], list[str]] = field(default_factory=dict)
    """(run, stage) -> the variables this worker lacks to start the stage's jobs."""
    rates: dict[tuple[int, str], RateWindow] = field(default_factory=dict)
    """(run, limit name) -> that rate limit's window now."""
    selections: dict[int, SelectionView] = field(default_factory=dict)
    """Run id -> its selection by yield (runs whose config has ``select``)."""


@dataclass(frozen=True)
class Refusal:
    run_id: int
    lane: str
    stage: str | None
    code: RefusalCode | Literal[""]
    """Why it waits; ``""`` only where the ledger records a dispatch in a refusal's shape
    (``controller/ledger/claim.py``)."""
    detail: dict[str, Any]
    job_id: int | None = None

    def words(self) -> str:
        return describe(self.code, self.detail)


@dataclass
class Admission:
    starts: list[Candidate] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    devices: dict[int, tuple[DeviceView, ...]] = field(default_factory=dict)
    """Job id -> the devices given to it (a GPU job that starts)."""
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Job id -> the figures its run's selection by yield chose it with (a job that
    starts, in such a run)."""


def admit(snapshot: Snapshot) -> Admission:
    """Choose the jobs to start, in candidate order, and say why every other waits.

    At most one refusal per (run, lane, stage): the first candidate's reason.
    """
    result = Admission()
    running = snapshot.node.running
    free = snapshot.free_slots
    reserved = snapshot.node.reserved_mib
    devices = list(node_devices(snapshot.node))
    lane_stage = Counter(snapshot.running_lane_stage)
    stage = Counter(snapshot.running_stage)
    held: dict[tuple[int, str | None, str], float] = {}
    rated: dict[tuple[int, str, str], float] = {}
    """(run, limit, "calls" or a usage key) -> what this admission already started."""
    refused: set[tuple[int, str, str | None]] = set()
    blocked_lanes: set[tuple[int, str]] = set()

    candidates = list(snapshot.candidates)
    figures: dict[int, dict[str, Any]] = {}
    for run_id, view in snapshot.selections.items():
        mine = [c for c in candidates if c.run_id == run_id]
        if not mine:
            continue
        ordered = order_by_yield(mine, view)
        figures.update((c.job_id, why) for c, why in ordered)
        # The run's candidates take the places they held, in the selection's order.
        slots = iter(c for c, _ in ordered)
        candidates = [next(slots) if c.run_id == run_id else c for c in candidates]
    for job in candidates:
        reason = next(
            _refusals(
                snapshot, job, running, free, reserved, devices, lane_stage, stage, held, rated
            ),
            None,
        )
        if reason is None:
            result.starts.append(job)
            if job.job_id in figures:
                result.choices[job.job_id] = figures[job.job_id]
            running += 1
            if job.gpus > 0 or job.gpu_mib > 0:
                given = pick_devices(devices, job, snapshot.node.gpu_fraction)
                assert given is not None  # _refusals said it fits
                result.devices[job.job_id] = given
                holder = Holder(job.gpus > 0, job.gpu_peak_mib)
                devices = [
                    replace(d, holders=(*d.holders, holder)) if d in given else d for d in devices
                ]
            free -= 1
            reserved += job.memory_mib
            lane_stage[(job.run_id, job.lane, job.stage)] += 1
            stage[(job.run_id, job.stage)] += 1
            for usage_key, amount in job.expected_usage.items():
                for scope in (None, job.stage):
                    where = (job.run_id, scope, usage_key)
                    held[where] = held.get(where, 0.0) + amount
            for name in job.limits:
                for what, amount in [("calls", 1.0), *job.limit_usage.items()]:
                    where_rated = (job.run_id, name, what)
                    rated[where_rated] = rated.get(where_rated, 0.0) + amount
            continue
        blocked_lanes.add((job.run_id, job.lane))
        key = (job.run_id, job.lane, job.stage)
        if key not in refused:
            refused.add(key)
            code, detail = reason
            result.refusals.append(
                Refusal(job.run_id, job.lane, job.stage, code, detail, job.job_id)
            )

    has_candidates = {(job.run_id, job.lane) for job in snapshot.candidates}
    for run_id, lane in sorted(snapshot.waiting_lanes - has_candidates):
        # A halt, unknown outcome, pause or stop is the truer reason for an idle lane.
        blocked = _control_refusal(snapshot, Candidate(0, run_id, lane, ""))
        code, detail = blocked or (RefusalCode.NEEDS_PENDING, {})
        result.refusals.append(Refusal(run_id, lane, None, code, detail))
    return result


def explain(snap: Snapshot, job: Candidate) -> list[Reason]:
    """Every reason that blocks ``job`` now (not only the first), with its numbers."""
    node = snap.node
    return list(
        _refusals(
            snap,
            job,
            node.running,
            snap.free_slots,
            node.reserved_mib,
            list(node_devices(node)),
            Counter(snap.running_lane_stage),
            Counter(snap.running_stage),
            {},
            {},
        )
    )


def _refusals(
    snap: Snapshot,
    job: Candidate,
    running: int,
    free: int,
    reserved: float,
    devices: list[DeviceView],
    lane_stage: Counter[tuple[int, str, str]],
    stage: Counter[tuple[int, str]],
    held: dict[tuple[int, str | None, str], float],
    rated: dict[tuple[int, str, str], float],
) -> Iterator[Reason]:
    if job.nodes and snap.node.name not in job.nodes:
        yield RefusalCode.OTHER_NODE, {"node": snap.node.name, "nodes": list(job.nodes)}
    blocked = _control_refusal(snap, job)
    if blocked is not None:
        yield blocked
    over = _budget_refusal(snap, job, held)
    if over is not None:
        yield over
    limited = _rate_refusal(snap, job, rated)
    if limited is not None:
        yield limited
    node = snap.node
    lacking = snap.missing_secrets.get((job.run_id, job.stage))
    if lacking:
        yield RefusalCode.SECRET_MISSING, {"node": node.name, "variables": lacking}
    if running >= node.max_jobs:
        yield RefusalCode.MAX_JOBS, {"running": running, "max_jobs": node.max_jobs}
    if free <= 0:
        yield RefusalCode.SLOTS_FULL, {"slots": snap.free_slots}
    cap = snap.lane_caps.get((job.run_id, job.lane), {}).get(job.stage)
    in_lane = lane_stage[(job.run_id, job.lane, job.stage)]
    if cap is not None and in_lane >= cap:
        yield RefusalCode.LANE_CAP, {"running": in_lane, "cap": cap}
    global_cap = snap.stage_caps.get((job.run_id, job.stage))
    in_stage = stage[(job.run_id, job.stage)]
    if global_cap is not None and in_stage >= global_cap:
        yield RefusalCode.STAGE_CAP, {"running": in_stage, "cap": global_cap}
    if job.gpus > 0 or job.gpu_mib > 0:
        gpu = _gpu_refusal(node, job, devices)
        if gpu is not None:
            yield gpu
    if node.mem_available_mib is None:
        yield RefusalCode.MEMORY_FLOOR, {"why": "no memory sample from this node yet"}
    elif node.mem_available_mib - reserved - job.memory_mib < node.memory_floor_mib:
        yield (
            RefusalCode.MEMORY_FLOOR,
            {
                "available_mib": round(node.mem_available_mib),
                "reserved_mib": round(reserved),
                "stage_mib": round(job.memory_mib),
                "floor_mib": node.memory_floor_mib,
            },
        )


def _rate_refusal(
    snap: Snapshot, job: Candidate, rated: dict[tuple[int, str, str], float]
) -> Reason | None:
    """The first of the job's rate limits (in the order its stage lists them) that one
    more attempt would pass: its calls, then its usage keys in name order."""
    for name in job.limits:
        window = snap.rates.get((job.run_id, name))
        if window is None:
            continue
        base = {
            "limit": name,
            "per_seconds": window.per_seconds,
            "frees_in_seconds": window.frees_in_seconds,
        }
        if window.calls is not None:
            started = window.started + rated.get((job.run_id, name, "calls"), 0.0)
            if started + 1 > window.calls:
                return RefusalCode.RATE_LIMIT, base | {
                    "key": "calls",
                    "in_window": started,
                    "this": 1,
                    "cap": window.calls,
                }
        for key, cap in sorted(window.usage.items()):
            used = window.used.get(key, 0.0) + rated.get((job.run_id, name, key), 0.0)
            expected = job.limit_usage.get(key, 0.0)
            if usage_math.over_budget(used, expected, cap):
                return RefusalCode.RATE_LIMIT, base | {
                    "key": key,
                    "in_window": round(used, 6),
                    "this": round(expected, 6),
                    "cap": cap,
                }
    return None


def _budget_refusal(
    snap: Snapshot, job: Candidate, held: dict[tuple[int, str | None, str], float]
) -> Reason | None:
    """The first budget (the run's, then the stage's; keys in name order) that this
    attempt's expected cost would pass. ``held``: what this admission already started."""
    for scope in (None, job.stage):
        for key, budget in sorted(snap.budgets.get((job.run_id, scope), {}).items()):
            spent, reserved = snap.spend.get((job.run_id, scope, key), (0.0, 0.0))
            reserved += held.get((job.run_id, scope, key), 0.0)
            expected = job.expected_usage.get(key, 0.0)
            if usage_math.over_budget(spent + reserved, expected, budget):
                return RefusalCode.BUDGET, {
                    "scope": "run" if scope is None else "stage",
                    "stage": job.stage,
                    "key": key,
                    "spent": round(spent, 6),
                    "reserved": round(reserved, 6),
                    "expected": round(expected, 6),
                    "expected_from": job.expected_from.get(key, "no measurement"),
                    "budget": budget,
                }
    return None


def _share_fits(device: DeviceView, job: Candidate, fraction: float) -> str | None:
    """None when a share of ``device`` fits ``job`` (invariant 9, per device), else why
    not in words. The first attempt on a device runs alone, measured or not. Another
    shares it only when every holder's stage and this job's stage have a measured peak
    and ``baseline + sum(peaks) + peak <= fraction * total`` of that device — for k
    attempts of one stage, ``baseline + k * peak <= fraction * total``. Never inferred
    from success rates."""
    if not device.holders:
        return None
    if any(holder.whole for holder in device.holders):
        return "held whole by another attempt"
    peaks = [holder.peak_mib for holder in device.holders]
    if job.gpu_peak_mib is None or any(peak is None for peak in peaks):
        return (
            f"{len(peaks)} attempt(s) on it and no measured GPU peak yet: "
            "a GPU attempt runs alone on its device until measured"
        )
    running = sum(p for p in peaks if p is not None)
    need = device.baseline_mib + running + job.gpu_peak_mib
    limit = fraction * device.total_mib
    if need > limit:
        return (
            f"baseline {device.baseline_mib:.0f} + running peaks {running:.0f} + peak "
            f"{job.gpu_peak_mib:.0f} = {need:.0f} MiB > {fraction:g} x "
            f"{device.total_mib:.0f} = {limit:.0f} MiB"
        )
    return None


def pick_devices(
    devices: Sequence[DeviceView], job: Candidate, fraction: float
) -> tuple[DeviceView, ...] | None:
    """The devices ``job`` gets, or None when it does not fit now: ``gpus = N``, the
    first N free devices (no holder) in index order; a share (``gpu_mib``), the device
    with the fewest holders whose share rule admits it (so attempts spread before they
    share), lowest index first among equals."""
    if job.gpus > 0:
        free = [d for d in devices if not d.holders]
        return tuple(free[: job.gpus]) if len(free) >= job.gpus else None
    for device in sorted(devices, key=lambda d: (len(d.holders), d.index)):
        if _share_fits(device, job, fraction) is None:
            return (device,)
    return None


def _gpu_refusal(node: NodeView, job: Candidate, devices: list[DeviceView]) -> Reason | None:
    """Why ``job`` gets no device on ``node`` now (None: ``pick_devices`` finds some):
    ``gpu_capacity`` (no GPU, or fewer devices than asked), ``gpu_busy`` (whole devices
    held), ``gpu_memory`` (a share fits on no device; each device's arithmetic)."""
    if not devices:
        return RefusalCode.GPU_CAPACITY, {"why": "node has no GPU configured"}
    if job.gpus > len(devices):
        return RefusalCode.GPU_CAPACITY, {
            "why": f"the stage asks for {job.gpus} GPU(s); node has {len(devices)}"
        }
    if pick_devices(devices, job, node.gpu_fraction) is not None:
        return None
    held = {d.label(): f"held by {len(d.holders)} attempt(s)" for d in devices if d.holders}
    if job.gpus > 0:
        free = len(devices) - len(held)
        return RefusalCode.GPU_BUSY, {
            "why": f"the stage asks for {job.gpus} whole GPU(s); {free} of "
            f"{len(devices)} free ({'; '.join(f'{k} {v}' for k, v in held.items())})",
            "devices": held,
        }
    if all(any(h.whole for h in d.holders) for d in devices):
        return RefusalCode.GPU_BUSY, {
            "why": "every GPU of the node is held whole by another attempt",
            "devices": held,
        }
    per_device = {
        d.label(): why
        for d in devices
        if (why := _share_fits(d, job, node.gpu_fraction)) is not None
    }
    return RefusalCode.GPU_MEMORY, {
        "why": "; ".join(f"{label}: {why}" for label, why in per_device.items()),
        "devices": per_device,
        "gpu_running": sum(len(d.holders) for d in devices),
    }


def stopped(snap: Snapshot, job: Candidate) -> RefusalCode | None:
    """The reason code when a halt, an unknown outcome, a pause or a stop in ``snap``
    covers ``job``; None when none does."""
    refusal = _control_refusal(snap, job)
    return refusal[0] if refusal is not None else None


def _control_refusal(snap: Snapshot, job: Candidate) -> Reason | None:
    """Halt, then unknown outcome, then pause, then stop: what an operator must lift."""
    halt = _control(snap, job, ControlKind.HALT)
    if halt is not None:
        return RefusalCode.HALTED, {"scope": halt.scope, "reason": halt.reason}
    if snap.unknown_runs.get(job.run_id):
        return RefusalCode.UNKNOWN_OUTCOME, {"unknown_attempts": snap.unknown_runs[job.run_id]}
    if snap.unknown_everywhere:
        return RefusalCode.UNKNOWN_OUTCOME, {
            "unknown_attempts": snap.unknown_everywhere,
            "scope": "everything",
        }
    for kind in (ControlKind.PAUSE, ControlKind.STOP):
        control = _control(snap, job, kind)
        if control is not None:
            return CONTROL_CODES[kind], {"scope": control.scope, "reason": control.reason}
    return None


def _control(snap: Snapshot, job: Candidate, kind: str) -> ControlView | None:
    for control in snap.controls:
        if control.kind == kind and control.covers(job.run_id, job.lane):
            return control
    return None
