"""The status report of a run, read from the ledger (no writes).

``status_report`` returns a ``StatusReport`` (controller/status_model.py): ``laneway status
--json`` prints its ``as_dict()``, the controller writes that to ``runs/<run>/status.json``,
and ``cli.render`` turns it into text.

The status report is plain, dialect-neutral SQL over a ``Rows`` source (anything with
``rows(sql, params)``): ``laneway status`` reads a SQLite ledger through the stdlib
``sqlite3`` (``db.ReadOnlyLedger``), without importing SQLAlchemy, the models or the
config's pydantic models; the controller and ``laneway run`` pass their ORM session
(``build_status``). Timestamps come back as text on SQLite and as datetimes elsewhere,
JSON columns as text or as objects: ``_moment`` and ``_json`` take either.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from controller import admission
from controller.clock import iso
from controller.errors import NotFound
from controller.states import AttemptState, EventKind, JobState, Verdict, WorkerState
from controller.status_model import (
    BackingOff,
    Closeout,
    CloseoutStep,
    Control,
    Event,
    Lane,
    NodeSummary,
    NoWorker,
    Placement,
    Reason,
    RunInfo,
    RunningAttempt,
    StatusReport,
    Throughput,
    UnknownAttempt,
    Worker,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sqlalchemy.orm import Session

    from controller.models import Run

RECENT_EVENTS = 12
LOST_AFTER_SECONDS = 30.0
"""A worker is live while its row is ``active`` and its heartbeat is at most this old;
the controller's default ``lost_after_seconds`` (controller/daemon.py) is the same 30 s,
after which it marks such a worker lost."""
RECENT_STOPPED_WORKERS = 3
"""How many stopped or lost workers ``status`` shows per node (besides the active ones)."""
CLOSEOUT_EVENTS = (
    EventKind.CLOSEOUT_STEP_STARTED.value,
    EventKind.CLOSEOUT_STEP_FINISHED.value,
    EventKind.CLOSEOUT_FINISHED.value,
)


class Rows(Protocol):
    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]: ...


class SessionRows:
    """``Rows`` over an ORM session (the controller's and ``laneway run``'s)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        from sqlalchemy import text

        return [tuple(row) for row in self.session.execute(text(sql), dict(params or {}))]


def _moment(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def _states(*states: str) -> str:
    """An SQL list of state literals (laneway's own constants, never user input)."""
    return ", ".join(f"'{state}'" for state in states)


IN_FLIGHT = _states(AttemptState.INTENT.value, AttemptState.RUNNING.value)


def build_status(session: Session, run: Run, *, now: datetime) -> StatusReport:
    """Everything ``laneway status`` shows for one run (through an ORM session)."""
    return status_report(SessionRows(session), run.id, now=now)


def find_run(source: Rows, run_id: int | None) -> dict[str, Any]:
    """The run with ``run_id``, or the newest run when None (as ``ledger.get_run``)."""
    columns = "id, name, state, config_json, config_sha256, runtime_dir, created_at, finished_at"
    if run_id is None:
        found = source.rows(f"SELECT {columns} FROM runs ORDER BY id DESC LIMIT 1")
        if not found:
            raise NotFound("the ledger has no runs yet; start one with `laneway start-pipeline`")
    else:
        found = source.rows(f"SELECT {columns} FROM runs WHERE id = :run", {"run": run_id})
        if not found:
            raise NotFound(f"run {run_id} is not in the ledger; `laneway status` lists the newest")
    row = dict(zip(columns.split(", "), found[0], strict=True))
    row["created_at"] = _moment(row["created_at"])
    row["finished_at"] = _moment(row["finished_at"])
    row["config"] = _json(row.pop("config_json"))
    return row


def status_report(source: Rows, run_id: int | None, *, now: datetime) -> StatusReport:
    """Everything ``laneway status`` shows for one run (the newest when ``run_id`` is None).

    ``source`` should be inside one read transaction, so every part sees one state."""
    run = find_run(source, run_id)
    rid = {"run": run["id"]}
    config = run["config"]
    stages = {stage["name"]: stage for stage in config["stages"]}
    jobs: dict[str, dict[str, int]] = {name: {} for name in stages}
    for stage, state, count in source.rows(
        "SELECT stage, state, COUNT(*) FROM jobs WHERE run_id = :run GROUP BY stage, state",
        rid,
    ):
        jobs.setdefault(stage, {})[state] = count
    reused: dict[str, int] = {}
    for stage, count in source.rows(
        "SELECT stage, COUNT(*) FROM jobs WHERE run_id = :run AND reused_from IS NOT NULL "
        "GROUP BY stage",
        rid,
    ):
        reused[stage] = count
    backing_off = [
        BackingOff(job_id, key, stage, iso(_moment(after)))
        for job_id, key, stage, after in source.rows(
            "SELECT j.id, i.key, j.stage, j.retry_after FROM jobs j "
            "JOIN items i ON i.id = j.item_id "
            "WHERE j.run_id = :run AND j.retry_after IS NOT NULL "
            "ORDER BY j.retry_after, j.id LIMIT 20",
            rid,
        )
    ]
    totals: dict[str, int] = {}
    for by_state in jobs.values():
        for state, count in by_state.items():
            totals[state] = totals.get(state, 0) + count

    outcomes: dict[str, dict[str, int]] = {name: {} for name in stages}
    for stage, outcome, count in source.rows(
        "SELECT j.stage, a.outcome, COUNT(*) FROM attempts a JOIN jobs j ON j.id = a.job_id "
        f"WHERE a.run_id = :run AND a.state = '{AttemptState.SETTLED.value}' "
        "GROUP BY j.stage, a.outcome",
        rid,
    ):
        outcomes.setdefault(stage, {})[str(outcome)] = count

    running = []
    for attempt_id, job_id, item, stage, lane, node, state, pid, begun, rss in source.rows(
        "SELECT a.id, j.id, i.key, j.stage, j.lane, a.node, a.state, a.child_pid, "
        "COALESCE(a.started_at, a.intent_at), a.peak_rss_mib "
        "FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
        f"WHERE a.run_id = :run AND a.state IN ({IN_FLIGHT}) ORDER BY a.id",
        rid,
    ):
        started = _moment(begun)
        assert started is not None
        running.append(
            RunningAttempt(
                attempt_id=attempt_id,
                job_id=job_id,
                item=item,
                stage=stage,
                lane=lane,
                node=node,
                state=state,
                pid=pid,
                elapsed_seconds=round((now - started).total_seconds(), 1),
                timeout_seconds=stages[stage]["timeout_seconds"] if stage in stages else None,
                peak_rss_mib=rss,
            )
        )

    unknown = [
        UnknownAttempt(
            attempt_id=attempt_id,
            job_id=job_id,
            item=item,
            stage=stage,
            reason=reason,
            evidence=evidence,
            reconcile=(
                f"laneway reconcile {attempt_id} --as succeeded|failed|not-run --reason '...'"
                f" --runtime-dir {run['runtime_dir']}"
            ),
        )
        for attempt_id, job_id, item, stage, reason, evidence in source.rows(
            "SELECT a.id, j.id, i.key, j.stage, a.state_reason, a.attempt_dir "
            "FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
            f"WHERE a.run_id = :run AND a.state = '{AttemptState.UNKNOWN.value}' ORDER BY a.id",
            rid,
        )
    ]

    controls = [
        Control(control_id, kind, scope, lane, reason, set_by, iso(_moment(set_at)))
        for control_id, kind, scope, lane, reason, set_by, set_at in source.rows(
            "SELECT id, kind, scope, lane, reason, set_by, set_at FROM controls "
            "WHERE cleared_at IS NULL AND (run_id = :run OR run_id IS NULL) ORDER BY id",
            rid,
        )
    ]

    lane_nodes = dict(
        source.rows("SELECT name, node FROM lanes WHERE run_id = :run ORDER BY name", rid)
    )
    stage_nodes = {name: list(stage.get("nodes") or []) or None for name, stage in stages.items()}
    # The nodes the run uses: its lanes' nodes and every node a stage's ``nodes`` names.
    nodes = sorted(set(lane_nodes.values()) | {n for ns in stage_nodes.values() for n in ns or []})
    workers = node_workers(source, nodes, now=now)
    live = {w.node for w in workers if w.live}
    last_seen = _last_seen(workers)
    node_summary = node_rows(source, nodes, workers)

    settled_count = sum(sum(by.values()) for by in outcomes.values())
    end = run["finished_at"] or now
    hours = max((end - run["created_at"]).total_seconds() / 3600, 1e-9)
    events = [
        Event(event_id, iso(_moment(at)), kind, job_id, attempt_id, actor, _json(detail))
        for event_id, at, kind, job_id, attempt_id, actor, detail in reversed(
            source.rows(
                "SELECT id, at, kind, job_id, attempt_id, actor, detail FROM events "
                f"WHERE run_id = :run ORDER BY id DESC LIMIT {RECENT_EVENTS}",
                rid,
            )
        )
    ]
    return StatusReport(
        run=RunInfo(
            id=run["id"],
            name=run["name"],
            state=run["state"],
            created_at=iso(run["created_at"]),
            finished_at=iso(run["finished_at"]),
            config_sha256=run["config_sha256"],
            runtime_dir=run["runtime_dir"],
        ),
        generated_at=iso(now),
        controls=controls,
        unknown=unknown,
        jobs=jobs,
        totals=totals,
        reused=reused,
        retry_backoff=backing_off,
        outcomes=outcomes,
        running=running,
        workers=workers,
        nodes=node_summary,
        no_worker=[
            NoWorker(node, worker_command(node, run["runtime_dir"]))
            for node in nodes
            if node not in live and run["state"] != "finished"
        ],
        lanes=_lanes(
            source,
            run,
            now=now,
            live=live,
            last_seen=last_seen,
            stage_nodes=stage_nodes,
            controls=controls,
            unknown=len(unknown),
        ),
        placement=placement(stage_nodes, lane_nodes, live),
        throughput=Throughput(
            settled_attempts=settled_count, per_hour=round(settled_count / hours, 1)
        ),
        closeout=closeout_state(source, run),
        recent_events=events,
    )


def worker_command(node: str, runtime_dir: str) -> str:
    """The command that starts a worker for ``node`` on the run's runtime dir."""
    return f"laneway worker --node {shlex.quote(node)} --runtime-dir {shlex.quote(runtime_dir)}"


WORKER_COLUMNS = "id, node, host, pid, slots, state, started_at, heartbeat_at, stopped_at"


def node_workers(source: Rows, nodes: list[str], *, now: datetime) -> list[Worker]:
    """The workers of ``nodes``: every active one, then the last few stopped or lost ones
    of each node (``RECENT_STOPPED_WORKERS``), newest first. ``live``: active with a
    heartbeat at most ``LOST_AFTER_SECONDS`` old at ``now`` (the ledger's clock)."""
    found: list[tuple[Any, ...]] = []
    ended = _states(WorkerState.STOPPED.value, WorkerState.LOST.value)
    for node in nodes:
        params = {"node": node}
        found += source.rows(
            f"SELECT {WORKER_COLUMNS} FROM workers "
            f"WHERE state = '{WorkerState.ACTIVE.value}' AND node = :node "
            "ORDER BY started_at DESC, id",
            params,
        )
        found += source.rows(
            f"SELECT {WORKER_COLUMNS} FROM workers WHERE state IN ({ended}) AND node = :node "
            f"ORDER BY stopped_at DESC, id LIMIT {RECENT_STOPPED_WORKERS}",
            params,
        )
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
        memory = source.rows(
            "SELECT mem_available_mib, mem_total_mib, memory_floor_mib, max_jobs "
            "FROM nodes WHERE name = :node",
            params,
        )
        in_flight = source.rows(
            f"SELECT COUNT(*) FROM attempts WHERE node = :node AND state IN ({IN_FLIGHT})",
            params,
        )[0][0]
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


def _lanes(
    source: Rows,
    run: dict[str, Any],
    *,
    now: datetime,
    live: set[str],
    last_seen: dict[str, str],
    stage_nodes: dict[str, list[str] | None],
    controls: list[Control],
    unknown: int,
) -> list[Lane]:
    counts: dict[str, dict[str, int]] = {}
    ready_stages: dict[str, set[str]] = {}
    for lane, stage, state, count in source.rows(
        "SELECT lane, stage, state, COUNT(*) FROM jobs WHERE run_id = :run "
        "GROUP BY lane, stage, state",
        {"run": run["id"]},
    ):
        by_state = counts.setdefault(lane, {})
        by_state[state] = by_state.get(state, 0) + count
        if state == JobState.READY.value:
            ready_stages.setdefault(lane, set()).add(stage)
    times = {
        lane: (_moment(last_start), _moment(last_end))
        for lane, last_start, last_end in source.rows(
            "SELECT j.lane, MAX(a.started_at), MAX(a.settled_at) FROM attempts a "
            "JOIN jobs j ON j.id = a.job_id WHERE a.run_id = :run GROUP BY j.lane",
            {"run": run["id"]},
        )
    }
    order = {stage: i for i, stage in enumerate(stage_nodes)}  # the config's stage order
    lanes = []
    for name, node in source.rows(
        "SELECT name, node FROM lanes WHERE run_id = :run ORDER BY name", {"run": run["id"]}
    ):
        by_state = counts.get(name, {})
        last_start, last_end = times.get(name, (None, None))
        running = by_state.get(JobState.RUNNING.value, 0)
        pending = by_state.get(JobState.READY.value, 0) + by_state.get(JobState.WAITING.value, 0)
        reason = None
        if running == 0 and pending and run["state"] != "finished":
            # The nodes that would take the lane's ready jobs: each stage's ``nodes``, or
            # the lane's node (only waiting jobs: the lane's node records why).
            serving = {
                stage: stage_nodes.get(stage) or [node]
                for stage in sorted(ready_stages.get(name, ()), key=lambda s: order.get(s, 0))
            }
            unserved = [
                (stage, nodes)
                for stage, nodes in serving.items()
                if not any(n in live for n in nodes)
            ]
            created = iso(run["created_at"])
            held = held_by_control(controls, name, unknown=unknown)
            if held is not None:
                # What an operator must lift comes first: a worker would not run it.
                reason = held
            elif serving and len(unserved) == len(serving):
                # Whatever was recorded last is stale: no node that runs the lane's ready
                # jobs has a live worker, so nothing claims them.
                stage, nodes = unserved[0]
                since = max(filter(None, (*(last_seen.get(n) for n in nodes), created)))
                placed = stage_nodes.get(stage)
                reason = no_worker_reason(
                    nodes[0],
                    run["runtime_dir"],
                    since,
                    stage=stage if placed else None,
                    nodes=placed,
                )
            elif not serving and node not in live:
                since = max(filter(None, (last_seen.get(node), created)))
                reason = no_worker_reason(node, run["runtime_dir"], since)
            else:
                reason = _current_refusal(source, run["id"], name)
        idle_since = None
        if running == 0 and pending:
            idle_since = last_end or run["created_at"]
        lanes.append(
            Lane(
                lane=name,
                node=node,
                running=running,
                ready=by_state.get(JobState.READY.value, 0),
                waiting=by_state.get(JobState.WAITING.value, 0),
                done=sum(
                    count
                    for state, count in by_state.items()
                    if state
                    not in (
                        JobState.RUNNING.value,
                        JobState.READY.value,
                        JobState.WAITING.value,
                        JobState.UNKNOWN.value,
                    )
                ),
                last_start=iso(last_start),
                idle_since=iso(idle_since),
                idle_seconds=(round((now - idle_since).total_seconds(), 1) if idle_since else None),
                reason=reason,
            )
        )
    return lanes


def held_by_control(controls: list[Control], lane: str, *, unknown: int = 0) -> Reason | None:
    """The lane's reason when what an operator must lift holds it, in admission's order:
    a halt, the run's ``unknown`` attempts, a pause, a stop (global, run or this lane's
    controls); else None."""

    def control_of(kind: str) -> Control | None:
        return next((c for c in controls if c.kind == kind and c.lane in (None, lane)), None)

    def held(code: str, detail: dict[str, Any], since: str | None) -> Reason:
        words = admission.describe(code, detail)
        return Reason(code=code, stage=None, since=since, detail=detail, words=words)

    halt = control_of("halt")
    if halt is not None:
        return held("halted", {"scope": halt.scope, "reason": halt.reason}, halt.set_at)
    if unknown:
        return held("unknown_outcome", {"unknown_attempts": unknown}, None)
    for kind, code in (("pause", "paused"), ("stop", "stopped")):
        control = control_of(kind)
        if control is not None:
            detail = {"scope": control.scope, "reason": control.reason}
            return held(code, detail, control.set_at)
    return None


def _current_refusal(source: Rows, run_id: int, lane: str) -> Reason | None:
    """The newest recorded refusal for the lane, if no dispatch came after it."""
    found = source.rows(
        "SELECT verdict, reason_code, stage, decided_at, detail, node FROM decisions "
        "WHERE run_id = :run AND lane = :lane ORDER BY id DESC LIMIT 1",
        {"run": run_id, "lane": lane},
    )
    if not found or found[0][0] != Verdict.REFUSED.value:
        return None
    _verdict, reason_code, stage, decided_at, detail, node = found[0]
    code = reason_code or "refused"
    detail = _json(detail) or {}
    return Reason(
        code=code,
        stage=stage,
        node=node,
        since=iso(_moment(decided_at)),
        detail=detail,
        words=admission.describe(code, detail),
        recorded=True,
    )


def node_max_jobs(source: Rows, node: str) -> int:
    """The node's ``max_jobs`` (``laneway worker``'s default ``--slots``)."""
    found = source.rows("SELECT max_jobs FROM nodes WHERE name = :node", {"node": node})
    if not found:
        names = [row[0] for row in source.rows("SELECT name FROM nodes ORDER BY name")]
        known = ", ".join(repr(name) for name in names) or "none yet"
        raise NotFound(
            f"--node: node {node!r} is not in the ledger (known: {known}); start a pipeline "
            "that names it first"
        )
    return int(found[0][0])


def closeout_state(source: Rows, run: dict[str, Any]) -> Closeout:
    """The run's closeout, from its ``closeout_*`` events (controller/closeout.py).

    ``state``: ``none`` (no closeout steps), ``pending`` (not begun: it runs when the run
    finishes, or is stopped and drained), ``running`` (``step`` k of ``step_count``, named
    in ``current``), ``finished`` (every step succeeded) or ``failed`` (it ended and
    ``failed_steps`` did not succeed: failed, timed out, or interrupted by a controller
    that died while they ran).
    """
    names = [step["name"] for step in run["config"].get("closeout") or []]
    steps = [CloseoutStep(name, "pending", None) for name in names]
    body = Closeout(
        state="none", step=None, step_count=len(steps), current=None, failed_steps=[], steps=steps
    )
    if not steps:
        return body
    by_name = {step.name: step for step in steps}
    finished = None
    kinds = _states(*CLOSEOUT_EVENTS)
    for kind, detail in source.rows(
        f"SELECT kind, detail FROM events WHERE run_id = :run AND kind IN ({kinds}) ORDER BY id",
        {"run": run["id"]},
    ):
        detail = _json(detail) or {}
        if kind == EventKind.CLOSEOUT_FINISHED:
            finished = detail
            continue
        named = detail.get("step")
        step = by_name.get(named) if isinstance(named, str) else None
        if step is None:
            continue
        if kind == EventKind.CLOSEOUT_STEP_STARTED:
            step.state = "running"
        else:
            step.state, step.exit_code = detail.get("state"), detail.get("exit_code")
    if finished is not None:
        for name, state in (finished.get("steps") or {}).items():
            if name in by_name:
                by_name[name].state = state
        failed = [s.name for s in steps if s.state != "succeeded"]
        body.state, body.failed_steps = ("failed" if failed else "finished"), failed
        return body
    not_failed = ("succeeded", "running", "pending")
    body.failed_steps = [s.name for s in steps if s.state not in not_failed]
    current = next((s for s in steps if s.state == "running"), None)
    if current is None and all(s.state == "pending" for s in steps):
        body.state = "pending"
        return body
    if current is None:  # between two steps: the next pending one starts on the next tick
        current = next((s for s in steps if s.state == "pending"), steps[-1])
    number = next(i for i, s in enumerate(steps) if s is current) + 1
    body.state, body.step, body.current = "running", number, current.name
    return body


def explain_job(session: Session, job_id: int, *, now: datetime) -> dict[str, Any]:
    """Everything that blocks one job now, with the capacity arithmetic (read-only)."""
    from sqlalchemy import select

    from controller import ledger
    from controller.models import Attempt, Item, Job, Node

    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} is not in the ledger; `laneway sql` lists jobs")
    run = ledger.get_run(session, job.run_id)
    item = session.get(Item, job.item_id)
    assert item is not None
    config = ledger.run_config(run)
    stage = config.stage(job.stage)
    report: dict[str, Any] = {
        "job_id": job.id,
        "run_id": run.id,
        "item": item.key,
        "stage": job.stage,
        "lane": job.lane,
        "state": job.state,
        "state_reason": job.state_reason,
        "retry_after": iso(job.retry_after),
        "blocked_by": [],
        "arithmetic": None,
    }
    lane_node = config.lane(job.lane).node
    runs_on = list(admission.runs_on(stage.nodes, lane_node))
    rows = SessionRows(session)
    live_nodes = [n for n in runs_on if node_has_live_worker(rows, n, now=now)]
    # The node explained: the first of those that run the stage with a live worker.
    node_name = live_nodes[0] if live_nodes else runs_on[0]
    live = bool(live_nodes)
    report["worker"] = {
        "node": node_name,
        "live": live,
        "start": None if live else worker_command(node_name, run.runtime_dir),
    }
    pending = job.state in (JobState.WAITING.value, JobState.READY.value)
    where: list[dict[str, Any]] = []
    for name in [*runs_on, *([] if lane_node in runs_on else [lane_node])]:
        entry: dict[str, Any] = {
            "node": name,
            "runs_it": name in runs_on,
            "live": name in live_nodes
            or (name not in runs_on and node_has_live_worker(rows, name, now=now)),
            "start": None,
            "why_not": [],
        }
        if name not in runs_on:
            detail = {"node": name, "nodes": runs_on}
            entry["why_not"] = [_blocker("other_node", detail)]
        elif name not in live_nodes:
            entry["start"] = worker_command(name, run.runtime_dir)
            if pending:
                entry["why_not"] = [_blocker("no_worker", _no_worker_detail(entry, job, stage))]
        where.append(entry)
    report["placement"] = {
        "nodes": list(stage.nodes) if stage.nodes else None,
        "lane_node": lane_node,
        "runs_on": runs_on,
        "words": admission.placement_words(stage.nodes),
        "explained_node": node_name,
        "per_node": where,
    }
    if job.state == JobState.WAITING.value:
        states = dict(
            session.execute(select(Job.stage, Job.state).where(Job.item_id == job.item_id)).all()
        )
        report["blocked_by"] = [
            {"code": "needs_pending", "words": f"needs {need}, which is {states[need]}"}
            for need in stage.needs
            if states.get(need) != JobState.SUCCEEDED.value
        ]
    elif job.state == JobState.READY.value and job.retry_after is not None:
        report["blocked_by"] = [
            {
                "code": "retry_backoff",
                "words": f"waiting out its stage's retry backoff until {iso(job.retry_after)}; "
                "the controller makes it claimable then",
            }
        ]
    elif job.state == JobState.READY.value:
        for entry in where:
            asked = entry["live"] or entry["node"] == node_name
            if not entry["runs_it"] or not asked or session.get(Node, entry["node"]) is None:
                continue
            blocked, arithmetic = _explain_on(session, job, stage, entry["node"])
            if entry["live"]:
                entry["why_not"] = blocked
            if entry["node"] == node_name:
                report["blocked_by"] = blocked
                report["arithmetic"] = arithmetic
    elif job.state in (JobState.FAILED.value, JobState.CANCELLED.value, JobState.SKIPPED.value):
        report.update(_settled_evidence(session, job, run.runtime_dir))
    elif job.state in (JobState.RUNNING.value, JobState.UNKNOWN.value):
        attempt = session.scalars(
            select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.id.desc())
        ).first()
        if attempt is not None:
            report["attempt"] = {
                "attempt_id": attempt.id,
                "state": attempt.state,
                "pid": attempt.child_pid,
                "reason": attempt.state_reason,
                "peak_rss_mib": attempt.peak_rss_mib,
            }
    if not live and pending:
        # Said first: until a worker runs on a node that runs it, nothing else matters.
        detail = _no_worker_detail(where[0], job, stage)
        report["blocked_by"].insert(0, _blocker("no_worker", detail))
    return report


def _blocker(code: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {"code": code, "detail": detail, "words": admission.describe(code, detail)}


def _no_worker_detail(entry: dict[str, Any], job: Any, stage: Any) -> dict[str, Any]:
    """``no_worker`` for one node; naming the stage's ``nodes`` when it has them."""
    detail: dict[str, Any] = {"node": entry["node"], "start": entry["start"]}
    if stage.nodes:
        detail.update(stage=job.stage, nodes=list(stage.nodes))
    return detail


def _explain_on(
    session: Session, job: Any, stage: Any, node_name: str
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """What blocks a ready ``job`` on ``node_name`` (a node that runs its stage), from the
    snapshot a claim there would build, and the capacity arithmetic."""
    from sqlalchemy import func, select

    from controller import ledger
    from controller.models import Attempt, Node

    node = session.get(Node, node_name)
    assert node is not None
    running = (
        session.scalar(
            select(func.count())
            .select_from(Attempt)
            .where(
                Attempt.node == node_name,
                Attempt.state.in_(
                    [
                        AttemptState.INTENT.value,
                        AttemptState.RUNNING.value,
                        AttemptState.UNKNOWN.value,
                    ]
                ),
            )
        )
        or 0
    )
    snapshot, _ = ledger.admission_snapshot(
        session,
        node=node_name,
        free_slots=max(0, node.max_jobs - running),
        mem=node.mem_available_mib,
        limit=1,
        lock=False,
        job_id=job.id,
    )
    if not snapshot.candidates:
        return [], None
    candidate = snapshot.candidates[0]
    blocked = [_blocker(code, detail) for code, detail in admission.explain(snapshot, candidate)]
    peak = ledger.stage_peaks(session, [job.run_id]).get((job.run_id, job.stage), (None, None))
    free = node.mem_available_mib
    arithmetic = {
        "node": node_name,
        "free_mib": None if free is None else round(free),
        "free_sampled_at": iso(node.sampled_at),
        "unreleased_mib": round(snapshot.node.reserved_mib),
        "reservation_mib": round(candidate.memory_mib),
        "configured_mib": stage.memory_mib,
        "learn_memory": stage.learn_memory,
        "measured_peak_mib": None if peak[0] is None else round(peak[0], 1),
        "memory_margin": stage.memory_margin,
        "floor_mib": node.memory_floor_mib,
        "headroom_after_mib": (
            None
            if free is None
            else round(
                free - snapshot.node.reserved_mib - candidate.memory_mib - node.memory_floor_mib
            )
        ),
        "gpu_peak_mib": candidate.gpu_peak_mib,
        "running_on_node": running,
        "max_jobs": node.max_jobs,
    }
    return blocked, arithmetic


STDERR_TAIL_LINES = 10
STDERR_TAIL_BYTES = 64 * 1024
"""At most this much of the end of ``stderr.log`` is read for its last lines."""
TAIL_LINE_CHARS = 500


def stderr_tail(
    attempt_dir: str | None, lines: int = STDERR_TAIL_LINES
) -> tuple[list[str] | None, str | None]:
    """The last ``lines`` lines of the attempt's ``stderr.log`` (redacted on disk by the
    supervisor), each cut to ``TAIL_LINE_CHARS``; or None and why it could not be read
    (the attempt directory may be on another machine)."""
    if not attempt_dir:
        return None, "the attempt has no directory"
    path = Path(attempt_dir) / "stderr.log"
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - STDERR_TAIL_BYTES))
            data = log.read(STDERR_TAIL_BYTES)
    except OSError as exc:
        return None, f"{path}: cannot read it here ({exc.strerror or exc})"
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > STDERR_TAIL_BYTES and text:
        text = text[1:]  # the first line read is probably cut
    return [line[:TAIL_LINE_CHARS] for line in text[-lines:]], None


def _signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _settled_evidence(session: Session, job: Any, runtime_dir: str) -> dict[str, Any]:
    """For a failed, cancelled or skipped job: its last attempt's outcome, exit code or
    signal, directory and the end of its stderr, and the ``laneway retry`` command (for a
    skipped job, the retry of the failed job it needs)."""
    from sqlalchemy import select

    from controller.models import Attempt, Job

    body: dict[str, Any] = {"last_attempt": None, "retry": None}
    attempt = session.scalars(
        select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.id.desc())
    ).first()
    if attempt is not None:
        tail, why = stderr_tail(attempt.attempt_dir)
        body["last_attempt"] = {
            "attempt_id": attempt.id,
            "number": attempt.number,
            "state": attempt.state,
            "outcome": attempt.outcome,
            "reason": attempt.state_reason,
            "exit_code": attempt.exit_code,
            "exit_signal": attempt.exit_signal,
            "signal_name": _signal_name(attempt.exit_signal),
            "attempt_dir": attempt.attempt_dir,
            "stderr_tail": tail,
            "stderr_unreadable": why,
        }
    target = None
    if job.state == JobState.FAILED.value:
        target = job.id
    elif job.state == JobState.SKIPPED.value:
        target = session.scalars(
            select(Job.id)
            .where(
                Job.item_id == job.item_id,
                Job.stage_position < job.stage_position,
                Job.state == JobState.FAILED.value,
            )
            .order_by(Job.stage_position)
        ).first()
    if target is not None:
        body["retry"] = {
            "job_id": target,
            "command": (
                f"laneway retry {target} --reason '...' --runtime-dir {shlex.quote(runtime_dir)}"
            ),
        }
    return body
