"""The nodes and workers of the status report: which workers serve a node and whether one
is live (``LOST_AFTER_SECONDS``), each node's summary, where each stage runs, and the
``no_worker`` reason with the command that starts a worker.
"""

from __future__ import annotations

import shlex
from datetime import datetime
from typing import Any

from laneway.controller import admission, queries
from laneway.controller.clock import iso
from laneway.controller.errors import NotFound
from laneway.controller.rows import Rows, _moment
from laneway.controller.states import WorkerState
from laneway.controller.status_model import NodeSummary, Placement, Reason, Worker

LOST_AFTER_SECONDS = 30.0
"""A worker is live while its row is ``active`` and its heartbeat is at most this old;
the controller's default ``lost_after_seconds`` (controller/daemon.py) is the same 30 s,
after which it marks such a worker lost."""


def worker_command(node: str, runtime_dir: str) -> str:
    """The command that starts a worker for ``node`` on the run's runtime dir."""
    return f"laneway worker --node {shlex.quote(node)} --runtime-dir {shlex.quote(runtime_dir)}"


def node_workers(source: Rows, nodes: list[str], *, now: datetime) -> list[Worker]:
    """The workers of ``nodes``: every active one, then the last few stopped or lost ones
    of each node (``queries.RECENT_STOPPED_WORKERS``), newest first. ``live``: active with a
    heartbeat at most ``LOST_AFTER_SECONDS`` old at ``now`` (the ledger's clock)."""
    found: list[tuple[Any, ...]] = []
    for node in nodes:
        params = {"node": node}
        found += source.rows(queries.ACTIVE_WORKERS, params)
        found += source.rows(queries.ENDED_WORKERS, params)
    workers = []
    for worker_id, node, host, pid, slots, state, started, beat, stopped in found:
        heartbeat = _moment(beat)
        assert heartbeat is not None
        age = (now - heartbeat).total_seconds()
        workers.append(
            Worker(
                worker_id=worker_id,
                node=node,
                host=host,
                pid=pid,
                slots=slots,
                state=state,
                live=state == WorkerState.ACTIVE.value and age <= LOST_AFTER_SECONDS,
                started_at=iso(_moment(started)),
                heartbeat_at=iso(heartbeat),
                heartbeat_age_seconds=round(age, 1),
                stopped_at=iso(_moment(stopped)),
            )
        )
    return workers


def node_rows(source: Rows, nodes: list[str], workers: list[Worker]) -> list[NodeSummary]:
    """Per node of the run: its live workers, its newest heartbeat, the free memory its
    last heartbeat reported against its floor, and its in-flight attempts (of every run:
    they all share the node's memory). One indexed look per node."""
    found = []
    for node in nodes:
        params = {"node": node}
        memory = source.rows(queries.NODE_MEMORY, params)
        in_flight = source.rows(queries.NODE_IN_FLIGHT, params)[0][0]
        mine = [w for w in workers if w.node == node]
        # The newest heartbeat of any of its workers, a stopped or lost one's too: a node
        # whose workers have all stopped was last heard from then, not "never".
        beats = [w.heartbeat_at for w in mine if w.heartbeat_at is not None]
        available, total, floor, max_jobs = memory[0] if memory else (None, None, None, None)
        found.append(
            NodeSummary(
                node=node,
                live_workers=sum(1 for w in mine if w.live),
                last_heartbeat_at=max(beats) if beats else None,
                heartbeat_age_seconds=min((w.heartbeat_age_seconds for w in mine), default=None),
                mem_available_mib=None if available is None else round(available, 1),
                mem_total_mib=None if total is None else round(total, 1),
                memory_floor_mib=floor,
                running=in_flight,
                max_jobs=max_jobs,
            )
        )
    return found


def _last_seen(workers: list[Worker]) -> dict[str, str]:
    """Per node, when its last worker was last known to work: a stopped one's stop, else
    the last heartbeat (ISO text, which sorts as time)."""
    seen: dict[str, str] = {}
    for worker in workers:
        at = worker.stopped_at if worker.state == "stopped" else worker.heartbeat_at
        if at is not None and at > seen.get(worker.node, ""):
            seen[worker.node] = at
    return seen


def node_has_live_worker(source: Rows, node: str, *, now: datetime) -> bool:
    return any(w.live for w in node_workers(source, [node], now=now))


def placement(
    stage_nodes: dict[str, list[str] | None], lane_nodes: dict[str, str], live: set[str]
) -> list[Placement]:
    """Where each stage runs: ``nodes`` as configured (None: on its lane's node),
    ``runs_on`` the nodes that take its jobs, ``words`` (``b, c`` or ``lane's node``) and
    ``no_live_worker``: those of ``runs_on`` that no live worker serves now."""
    found = []
    for stage, nodes in stage_nodes.items():
        runs_on = list(nodes) if nodes else sorted(set(lane_nodes.values()))
        found.append(
            Placement(
                stage=stage,
                nodes=nodes,
                runs_on=runs_on,
                words=admission.placement_words(nodes),
                no_live_worker=[node for node in runs_on if node not in live],
            )
        )
    return found


def no_worker_reason(
    node: str,
    runtime_dir: str,
    since: str | None,
    *,
    stage: str | None = None,
    nodes: list[str] | None = None,
) -> Reason:
    """A lane's reason when no live worker serves the node that runs its jobs: its own
    node, or (``stage`` with ``nodes``) the nodes of the stage whose jobs are ready."""
    detail: dict[str, Any] = {"node": node, "start": worker_command(node, runtime_dir)}
    if stage is not None and nodes:
        detail.update(stage=stage, nodes=list(nodes))
    return Reason(
        code="no_worker",
        stage=stage,
        since=since,
        detail=detail,
        words=admission.describe("no_worker", detail),
    )


def node_max_jobs(source: Rows, node: str) -> int:
    """The node's ``max_jobs`` (``laneway worker``'s default ``--slots``)."""
    found = source.rows(queries.NODE_MAX_JOBS, {"node": node})
    if not found:
        names = [row[0] for row in source.rows(queries.NODE_NAMES)]
        known = ", ".join(repr(name) for name in names) or "none yet"
        raise NotFound(
            f"--node: node {node!r} is not in the ledger (known: {known}); start a pipeline "
            "that names it first"
        )
    return int(found[0][0])
