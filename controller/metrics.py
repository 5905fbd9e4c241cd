"""Prometheus metrics read from the ledger at scrape time (``laneway controller
--metrics-bind``, and ``/metrics`` on ``laneway web``).

Nothing is counted in a process's memory: every value is read from the ledger when
Prometheus scrapes, through the same read-only ``Rows`` source and ``status_report`` as
``laneway status``, so any process that can read the ledger exports the same numbers and
a restart loses nothing. A scrape costs what ``laneway status`` costs for each run it
covers (the active runs, and the newest run when none is active), plus a few grouped
counts over the run's decisions and leases; it never reads the event log.

Series (``run`` is the run id; every gauge is the ledger's state at the scrape):

- ``laneway_run_info{run,name,state}`` 1 per run covered
- ``laneway_jobs{run,stage,state}``: jobs by state
- ``laneway_attempts_settled_total{run,stage,outcome}``: settled attempts by outcome
- ``laneway_attempts_in_flight{run,stage,state}``: attempts in intent / running, and
  ``unverified`` ones: in flight on a worker that is not live (``RunningAttempt.shown_state``)
- ``laneway_run_next_step{run,code}``: 1, ``code`` the run's one next step
  (``advice.run_next_step``: ``budget``, ``unknown_outcome``, ``no_controller``, ...;
  ``none`` when nothing needs a person)
- ``laneway_run_controller{run,state}``: 1, ``state`` the report's controller
  (``running``, ``stopped``, ``gone``, ``unknown``)
- ``laneway_unknown_attempts{run}``: attempts awaiting ``laneway reconcile``
- ``laneway_refusals_total{run,reason}``: recorded refusals by reason code (the
  ``decisions`` table records changes of reason, so this counts changes, not polls)
- ``laneway_lane_idle_seconds{run,lane,node,reason}``: how long a lane with pending work
  has run nothing, and why (``reason``: the lane's current refusal code, ``no_worker``,
  or ``unrecorded``); 0 with ``reason="busy"`` while it runs something, ``"done"`` when it
  has nothing left
- ``laneway_lane_pending_jobs{run,lane}`` / ``laneway_lane_running_jobs{run,lane}``
- ``laneway_controls_active{run,kind,scope}``: pauses, stops and halts in force
- ``laneway_node_free_memory_mib{node}``, ``laneway_node_memory_floor_mib{node}``,
  ``laneway_node_memory_total_mib{node}``, ``laneway_node_sample_age_seconds{node}``,
  ``laneway_node_live_workers{node}`` (live workers only),
  ``laneway_node_workers{node,liveness}``: the node's workers by liveness (``live``,
  ``stale``, ``lost``, ``stopped``: ``status_nodes.worker_liveness``)
- ``laneway_gpu_total_mib{node,device,uuid,described}``, ``laneway_gpu_used_mib{…}``,
  ``laneway_gpu_ours_mib{…}``: each GPU as its node's worker last reported it
  (``described="true"``: from ``--gpu-description``, not measured)
- ``laneway_stage_peak_rss_mib{run,stage}``, ``laneway_stage_peak_gpu_mib{run,stage}``,
  ``laneway_stage_measured_attempts{run,stage}``: measured peaks (``stage_stats``)
- ``laneway_lease_expiries_total{run}``: leases released after they had expired (their
  holder stopped renewing them; the attempt was settled from its exit record or marked
  unknown)
- ``laneway_leases_expired{}``: live leases past their expiry that the controller has
  not acted on yet (it should, within a second: one that stays says no controller runs)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from datetime import datetime

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from laneway.controller import advice, queries
from laneway.controller.rows import Rows, _moment
from laneway.controller.status import status_report
from laneway.controller.status_model import StatusReport
from laneway.controller.status_nodes import LIVE, node_workers

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_RUNS = 20
"""At most this many active runs are exported (the newest)."""


SourceOpener = Callable[[], AbstractContextManager[Rows]]
"""Opens one read transaction on the ledger (``ReadOnlyLedger.snapshot``)."""


class LedgerCollector:
    """A prometheus_client collector whose every value is read from the ledger."""

    def __init__(self, snapshot: SourceOpener, now: Callable[[], datetime]) -> None:
        self.snapshot = snapshot
        self.now = now

    def collect(self) -> Iterator[Metric]:
        with self.snapshot() as source:
            yield from collect(source, now=self.now())


def registry(snapshot: SourceOpener, now: Callable[[], datetime]) -> CollectorRegistry:
    """A registry holding only laneway's ledger collector."""
    found = CollectorRegistry(auto_describe=False)
    found.register(LedgerCollector(snapshot, now))
    return found


def exposition(snapshot: SourceOpener, now: Callable[[], datetime]) -> bytes:
    """The metrics in Prometheus' text exposition format."""
    return generate_latest(registry(snapshot, now))


def covered_runs(source: Rows) -> list[int]:
    """The active runs (newest ``MAX_RUNS``), or the newest run when none is active."""
    found = source.rows(queries.NEWEST_ACTIVE_RUN_IDS, {"limit": MAX_RUNS})
    if not found:
        found = source.rows(queries.NEWEST_RUN_ID)
    return sorted(int(row[0]) for row in found)


def collect(source: Rows, *, now: datetime) -> list[Metric]:
    """Every metric family, read in one read transaction of ``source``."""
    f = _Families()
    nodes: set[str] = set()
    for run_id in covered_runs(source):
        status = status_report(source, run_id, now=now)
        run = str(run_id)
        info = status.run
        f.gauge("run_info", "The runs covered (1 each).", ["run", "name", "state"]).add_metric(
            [run, info.name, info.state], 1
        )
        _run_metrics(f, source, run_id, status)
        nodes |= {lane.node for lane in status.lanes}
        nodes |= {node.node for node in status.nodes}  # stages' nodes too
    _node_metrics(f, source, sorted(nodes), now=now)
    _expired_leases(f, source, now=now)
    return f.all()


def _run_metrics(f: _Families, source: Rows, run_id: int, status: StatusReport) -> None:
    run = str(run_id)
    jobs = f.gauge("jobs", "Jobs by stage and state.", ["run", "stage", "state"])
    for stage, by_state in status.jobs.items():
        for state, count in by_state.items():
            jobs.add_metric([run, stage, state], count)
    settled = f.counter(
        "attempts_settled", "Settled attempts by outcome.", ["run", "stage", "outcome"]
    )
    for stage, by_outcome in status.outcomes.items():
        for outcome, count in by_outcome.items():
            settled.add_metric([run, stage, outcome], count)
    f.counted(
        "attempts_in_flight",
        "Attempts in intent or running.",
        ["run", "stage", "state"],
        run,
        ((attempt.stage, attempt.shown_state) for attempt in status.running),
    )
    if status.controller is not None:
        f.gauge(
            "run_controller", "Whether a controller serves the run (1, by state).", ["run", "state"]
        ).add_metric([run, status.controller.state], 1)
    step = advice.report_step(status)
    f.gauge(
        "run_next_step",
        "The run's one next step (1, by its code; the step `laneway status` leads with).",
        ["run", "code"],
    ).add_metric([run, "none" if step is None else step.code], 1)
    f.gauge(
        "unknown_attempts", "Attempts whose outcome is unknown (dispatch halted).", ["run"]
    ).add_metric([run], len(status.unknown))
    refusals = f.counter(
        "refusals",
        "Recorded admission refusals by reason (one per change of reason).",
        ["run", "reason"],
    )
    for reason, count in source.rows(queries.REFUSALS_BY_REASON, {"run": run_id}):
        refusals.add_metric([run, str(reason or "refused")], count)
    idle = f.gauge(
        "lane_idle_seconds",
        "Seconds a lane with pending work has run nothing, and why (0 while busy).",
        ["run", "lane", "node", "reason"],
    )
    pending = f.gauge("lane_pending_jobs", "A lane's ready and waiting jobs.", ["run", "lane"])
    running = f.gauge("lane_running_jobs", "A lane's running jobs.", ["run", "lane"])
    for lane in status.lanes:
        left = lane.ready + lane.waiting
        if lane.running:
            reason, seconds = "busy", 0.0
        elif not left:
            reason, seconds = "done", 0.0
        else:
            reason = lane.reason.code if lane.reason else "unrecorded"
            seconds = lane.idle_seconds or 0.0
        idle.add_metric([run, lane.lane, lane.node, reason], seconds)
        pending.add_metric([run, lane.lane], left)
        running.add_metric([run, lane.lane], lane.running)
    f.counted(
        "controls_active",
        "Pauses, stops and halts in force.",
        ["run", "kind", "scope"],
        run,
        ((control.kind, control.scope) for control in status.controls),
    )
    rss = f.gauge("stage_peak_rss_mib", "Highest measured RSS of a stage.", ["run", "stage"])
    gpu = f.gauge("stage_peak_gpu_mib", "Highest measured GPU memory.", ["run", "stage"])
    measured = f.gauge(
        "stage_measured_attempts", "Settled attempts with a measurement.", ["run", "stage"]
    )
    for stage, count, peak_rss, peak_gpu in source.rows(queries.STAGE_PEAKS, {"run": run_id}):
        measured.add_metric([run, stage], count)
        if peak_rss is not None:
            rss.add_metric([run, stage], peak_rss)
        if peak_gpu is not None:
            gpu.add_metric([run, stage], peak_gpu)
    expiries = source.rows(queries.LEASES_RELEASED_EXPIRED, {"run": run_id})
    f.counter("lease_expiries", "Leases released after they had expired.", ["run"]).add_metric(
        [run], expiries[0][0] if expiries else 0
    )


def _gpu_metrics(f: _Families, source: Rows, nodes: list[str]) -> None:
    """Per device of each node, as its worker last reported: total, used, ours."""
    labels = ["node", "device", "uuid", "described"]
    total = f.gauge("gpu_total_mib", "A GPU's memory.", labels)
    used = f.gauge("gpu_used_mib", "A GPU's memory in use, by anyone.", labels)
    ours = f.gauge("gpu_ours_mib", "A GPU's memory our attempts use.", labels)
    for name in nodes:
        for row in source.rows(queries.NODE_MEMORY, {"node": name}):
            devices = json.loads(row[4]) if isinstance(row[4], str) else row[4]
            for d in devices or []:
                key = [
                    name,
                    str(d.get("index")),
                    str(d.get("uuid") or ""),
                    str(bool(d.get("described"))).lower(),
                ]
                total.add_metric(key, float(d.get("total_mib") or 0))
                used.add_metric(key, float(d.get("used_mib") or 0))
                ours.add_metric(key, float(d.get("ours_mib") or 0))


def _node_metrics(f: _Families, source: Rows, nodes: list[str], *, now: datetime) -> None:
    free = f.gauge("node_free_memory_mib", "A node's free memory, last sampled.", ["node"])
    floor = f.gauge("node_memory_floor_mib", "A node's memory floor.", ["node"])
    total = f.gauge("node_memory_total_mib", "A node's total memory.", ["node"])
    age = f.gauge("node_sample_age_seconds", "Age of a node's last memory sample.", ["node"])
    live = f.gauge("node_live_workers", "Workers heartbeating for a node.", ["node"])
    wanted = set(nodes)
    for name, available, mem_total, memory_floor, sampled_at in source.rows(queries.NODES_MEMORY):
        if name not in wanted:
            continue
        floor.add_metric([name], memory_floor)
        if available is not None:
            free.add_metric([name], available)
        if mem_total is not None:
            total.add_metric([name], mem_total)
        sampled = _moment(sampled_at)
        if sampled is not None:
            age.add_metric([name], max(0.0, (now - sampled).total_seconds()))
    _gpu_metrics(f, source, nodes)
    counts: dict[str, int] = dict.fromkeys(nodes, 0)
    found = node_workers(source, nodes, now=now)
    for worker in found:
        counts[worker.node] += int(worker.liveness == LIVE)
    for name, count in counts.items():
        live.add_metric([name], count)
    f.counted_plain(
        "node_workers",
        "A node's workers by liveness (live, stale, lost, stopped).",
        ["node", "liveness"],
        ((worker.node, worker.liveness) for worker in found),
    )


def _expired_leases(f: _Families, source: Rows, *, now: datetime) -> None:
    """Live leases (an index range: ``ix_leases_open``) past their expiry."""
    rows = source.rows(queries.OPEN_LEASE_EXPIRIES)
    late = sum(1 for (expires,) in rows if (_moment(expires) or now) < now)
    f.gauge(
        "leases_expired", "Live leases past expiry the controller has not acted on yet."
    ).add_metric([], late)


class _Families:
    """Metric families by name, created on first use, in the order first used."""

    def __init__(self) -> None:
        self._found: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
        family = self._found.setdefault(
            name, GaugeMetricFamily(f"laneway_{name}", doc, labels=labels or [])
        )
        assert isinstance(family, GaugeMetricFamily)
        return family

    def counter(self, name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        family = self._found.setdefault(
            name, CounterMetricFamily(f"laneway_{name}", doc, labels=labels)
        )
        assert isinstance(family, CounterMetricFamily)
        return family

    def counted(
        self, name: str, doc: str, labels: list[str], run: str, keys: Iterable[tuple[str, str]]
    ) -> None:
        """A gauge of how many of ``keys`` there are: one series per key, in key order,
        labelled ``run`` and the key."""
        counts = Counter(keys)
        gauge = self.gauge(name, doc, labels)
        for key, count in sorted(counts.items()):
            gauge.add_metric([run, *key], count)

    def counted_plain(
        self, name: str, doc: str, labels: list[str], keys: Iterable[tuple[str, ...]]
    ) -> None:
        """A gauge of how many of ``keys`` there are, one series per key in key order."""
        gauge = self.gauge(name, doc, labels)
        for key, count in sorted(Counter(keys).items()):
            gauge.add_metric(list(key), count)

    def all(self) -> list[Metric]:
        return list(self._found.values())
