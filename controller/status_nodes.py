"""The nodes and workers of the status report: which workers serve a node and each one's
liveness (``worker_liveness``: ``live``, ``stale``, ``lost`` or ``stopped``, the one place
it is derived), each node's summary, where each stage runs, and the ``no_worker`` reason
with the command that starts a worker.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
from datetime import datetime
from typing import Any

from laneway.controller import identity, queries, refusal_words
from laneway.controller.clock import iso
from laneway.controller.codes import RefusalCode
from laneway.controller.errors import NotFound
from laneway.controller.rows import Rows, _moment
from laneway.controller.states import WorkerState
from laneway.controller.status_model import NodeSummary, Placement, Reason, Worker

LOST_AFTER_SECONDS = 30.0
"""An active worker whose heartbeat is older than this is ``lost``: the controller's
default ``lost_after_seconds`` (controller/daemon.py) is the same 30 s, after which it
marks such a worker lost in the ledger and settles or marks unknown its attempts."""

STALE_AFTER_SECONDS = 6.0
"""An active worker whose heartbeat is older than this (and at most
``LOST_AFTER_SECONDS`` old) is ``stale``: a worker heartbeats every
``heartbeat_seconds`` (at most 2 s, cli/commands_services.py), so three missed beats
mean nobody can say it is alive; its attempts are shown ``unverified``."""

LIVE = "live"
STALE = "stale"
LOST = "lost"
STOPPED = "stopped"


def worker_liveness(state: str, heartbeat_age_seconds: float, *, gone: bool = False) -> str:
    """A worker's liveness from its row's ``state`` and its heartbeat's age (seconds, at
    the ledger's ``now``): ``stopped`` or ``lost`` when its row says so; an active one is
    ``live`` while its heartbeat is at most ``STALE_AFTER_SECONDS`` old, ``stale`` up to
    ``LOST_AFTER_SECONDS``, ``lost`` after that (the controller marks it so then), and
    ``lost`` at once when its process is known ``gone`` (``process_gone``: it ran on this
    machine, and its pid no longer exists). Every view (status text and JSON, the live
    display, the web page, metrics) reads this."""
    if state == WorkerState.STOPPED.value:
        return STOPPED
    if state != WorkerState.ACTIVE.value or heartbeat_age_seconds > LOST_AFTER_SECONDS or gone:
        return LOST
    return LIVE if heartbeat_age_seconds <= STALE_AFTER_SECONDS else STALE


def process_gone(host: str, boot_id: str, pid: int) -> bool:
    """Is the process ``pid`` that ran on ``host`` in boot ``boot_id`` known to be gone?
    Only said for this machine (the same hostname and kernel boot), where no process
    with that pid exists; a pid that exists may be another process, so it proves
    nothing and the heartbeat decides."""
    if host != socket.gethostname() or not identity.same_boot(boot_id):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, another user's: not known gone
        return False
    return False


WORKER_SEAMS = "SELECT id, seams FROM workers WHERE node = :node"
"""Each worker's platform seams (``workers.seams``; NULL for a worker that did not say)."""


def worker_seams(source: Rows, nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Worker id -> the seams it recorded as it registered (``workers.seams``), for the
    workers of ``nodes`` that recorded them."""
    found: dict[str, dict[str, Any]] = {}
    for node in nodes:
        for worker_id, seams in source.rows(WORKER_SEAMS, {"node": node}):
            if isinstance(seams, str):  # a raw read of a JSON column (the read-only ledger)
                seams = json.loads(seams)
            if isinstance(seams, dict):
                found[worker_id] = seams
    return found


def worker_command(node: str, runtime_dir: str) -> str:
    """The command that starts a worker for ``node`` on the run's runtime dir."""
    return f"laneway worker --node {shlex.quote(node)} --runtime-dir {shlex.quote(runtime_dir)}"


def node_workers(source: Rows, nodes: list[str], *, now: datetime) -> list[Worker]:
    """The workers of ``nodes``: every active one, then the last few stopped or lost ones
    of each node (``queries.RECENT_STOPPED_WORKERS``), newest first, each with its
    ``liveness`` (``worker_liveness`` at ``now``, the ledger's clock); ``live`` is
    ``liveness == "live"``."""
    found: list[tuple[Any, ...]] = []
    for node in nodes:
        params = {"node": node}
        found += source.rows(queries.ACTIVE_WORKERS, params)
        found += source.rows(queries.ENDED_WORKERS, params)
    seams = worker_seams(source, nodes)
    workers = []
    for worker_id, node, host, pid, boot_id, slots, state, started, beat, stopped in found:
        heartbeat = _moment(beat)
        assert heartbeat is not None
        age = (now - heartbeat).total_seconds()
        gone = state == WorkerState.ACTIVE.value and process_gone(host, boot_id, pid)
        liveness = worker_liveness(state, age, gone=gone)
        workers.append(
            Worker(
                seams=seams.get(worker_id),
                worker_id=worker_id,
                node=node,
                host=host,
                pid=pid,
                slots=slots,
                state=WorkerState(state),
                live=liveness == LIVE,
                started_at=iso(_moment(started)),
                heartbeat_at=iso(heartbeat),
                heartbeat_age_seconds=round(age, 1),
                stopped_at=iso(_moment(stopped)),
                liveness=liveness,
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
        available, total, floor, max_jobs, gpus, gpu_note = memory[0] if memory else (None,) * 6
        if isinstance(gpus, str):  # a raw read of a JSON column (the read-only ledger)
            gpus = json.loads(gpus)
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
                gpus=list(gpus) if gpus else [],
                gpu_note=gpu_note,
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
                words=refusal_words.placement_words(nodes),
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
        code=RefusalCode.NO_WORKER,
        stage=stage,
        since=since,
        detail=detail,
        words=refusal_words.describe(RefusalCode.NO_WORKER, detail),
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
