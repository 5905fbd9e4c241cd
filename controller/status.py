"""The status report of a run, read from the ledger (no writes).

``status_report`` returns a ``StatusReport`` (controller/status_model.py): ``laneway status
--json`` prints its ``as_dict()``, the controller writes that to ``runs/<run>/status.json``,
and ``cli.render`` turns it into text. Each lane carries its next step
(``advice.next_step``), so every reader of the report says the same one.

The status report is plain, dialect-neutral SQL over a ``Rows`` source
(controller/rows.py): ``laneway status`` reads a SQLite ledger through the stdlib
``sqlite3`` (``readonly.ReadOnlyLedger``), without importing SQLAlchemy, the models or the
config's pydantic models; the controller and ``laneway run`` pass their ORM session
(``build_status``). Its nodes and workers are controller/status_nodes.py's.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from laneway.controller import advice, queries, refusal_words
from laneway.controller.clock import iso
from laneway.controller.codes import CONTROL_CODES, RefusalCode, refusal_code
from laneway.controller.errors import NotFound
from laneway.controller.pidfile import running_controller
from laneway.controller.rows import Rows, SessionRows, _json, _moment
from laneway.controller.states import (
    AttemptState,
    ControlKind,
    ControlScope,
    EventKind,
    JobState,
    RunState,
    StepState,
    Verdict,
    WorkerState,
)
from laneway.controller.status_model import (
    BackingOff,
    Closeout,
    CloseoutStep,
    Control,
    ControllerState,
    Event,
    Lane,
    NoWorker,
    Reason,
    RunInfo,
    RunningAttempt,
    StatusReport,
    Throughput,
    UnknownAttempt,
    Worker,
)
from laneway.controller.status_nodes import (
    LIVE,
    LOST,
    LOST_AFTER_SECONDS,
    STOPPED,
    _last_seen,
    no_worker_reason,
    node_rows,
    node_workers,
    placement,
    worker_command,
    worker_liveness,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from laneway.controller.explain import explain_job as explain_job
    from laneway.controller.explain import stderr_tail as stderr_tail
    from laneway.controller.models import Run


def __getattr__(name: str) -> Any:
    """``explain_job`` and ``stderr_tail``, still importable from here, are
    controller/explain.py's: imported when first asked for, not by ``laneway status``."""
    if name in ("explain_job", "stderr_tail"):
        from laneway.controller import explain

        return getattr(explain, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_status(session: Session, run: Run, *, now: datetime) -> StatusReport:
    """Everything ``laneway status`` shows for one run (through an ORM session)."""
    return status_report(SessionRows(session), run.id, now=now)


def find_run(source: Rows, run_id: int | None) -> dict[str, Any]:
    """The run with ``run_id``, or the newest run when None (as ``ledger.get_run``)."""
    if run_id is None:
        found = source.rows(queries.NEWEST_RUN)
        if not found:
            raise NotFound("the ledger has no runs yet; start one with `laneway start-pipeline`")
    else:
        found = source.rows(queries.RUN_BY_ID, {"run": run_id})
        if not found:
            raise NotFound(f"run {run_id} is not in the ledger; `laneway status` lists the newest")
    row = dict(zip(queries.RUN_COLUMNS, found[0], strict=True))
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
    # One index-only count per (state, lane, stage): the per-stage counts here, the
    # per-lane ones in ``_lanes``.
    counts = source.rows(queries.JOB_COUNTS, rid)
    for state, _lane, stage, count in counts:
        by_state = jobs.setdefault(stage, {})
        by_state[state] = by_state.get(state, 0) + count
    jobs = {stage: dict(sorted(by.items())) for stage, by in jobs.items()}  # states in order
    reused: dict[str, int] = {}
    for stage, count in source.rows(queries.REUSED_BY_STAGE, rid):
        reused[stage] = count
    backing_off = [
        BackingOff(job_id, key, stage, iso(_moment(after)))
        for job_id, key, stage, after in source.rows(queries.RETRY_BACKOFF, rid)
    ]
    totals: dict[str, int] = {}
    for by_state in jobs.values():
        for state, count in by_state.items():
            totals[state] = totals.get(state, 0) + count

    outcomes: dict[str, dict[str, int]] = {name: {} for name in stages}
    activity: dict[str, tuple[datetime | None, datetime | None]] = {}
    lane_nodes: dict[str, str] = {}
    # Each lane's newest start and settle: two index seeks per lane.
    for lane, node, started, settled in source.rows(queries.LANE_ACTIVITY, rid):
        lane_nodes[lane] = node
        activity[lane] = (_moment(started), _moment(settled))
    # Settled attempts per stage and outcome, index-only.
    without_stage = False
    for stage, outcome, count in source.rows(queries.ATTEMPT_OUTCOMES, rid):
        if stage is None:  # written without a stage (the claim never does): see below
            without_stage = True
            continue
        by_outcome = outcomes.setdefault(stage, {})
        by_outcome[str(outcome)] = by_outcome.get(str(outcome), 0) + count
    if without_stage:
        # Their job's stage and lane instead: a join over those attempts only.
        for lane, stage, outcome, count, started, settled in source.rows(
            queries.ATTEMPTS_WITHOUT_STAGE, rid
        ):
            by_outcome = outcomes.setdefault(stage, {})
            by_outcome[str(outcome)] = by_outcome.get(str(outcome), 0) + count
            last_start, last_end = activity.get(lane, (None, None))
            activity[lane] = (
                _latest(last_start, _moment(started)),
                _latest(last_end, _moment(settled)),
            )
    # In key order, whatever order the groups came in (GROUP BY promises none).
    outcomes = {stage: dict(sorted(by.items())) for stage, by in outcomes.items()}

    stage_nodes = {name: list(stage.get("nodes") or []) or None for name, stage in stages.items()}
    # The nodes the run uses: its lanes' nodes and every node a stage's ``nodes`` names.
    nodes = sorted(set(lane_nodes.values()) | {n for ns in stage_nodes.values() for n in ns or []})
    workers = node_workers(source, nodes, now=now)
    by_id = {w.worker_id: w for w in workers}

    running = []
    held = {aid: _json(devices) for aid, devices in source.rows(queries.IN_FLIGHT_DEVICES, rid)}
    for row in source.rows(queries.IN_FLIGHT_ATTEMPTS, rid):
        attempt_id, job_id, item, stage, lane, node, state, pid, begun, rss, worker_id = row
        started = _moment(begun)
        assert started is not None
        because = unverified_because(by_id.get(worker_id), worker_id)
        running.append(
            RunningAttempt(
                attempt_id=attempt_id,
                job_id=job_id,
                item=item,
                stage=stage,
                lane=lane,
                node=node,
                state=AttemptState(state),
                pid=pid,
                elapsed_seconds=round((now - started).total_seconds(), 1),
                timeout_seconds=stages[stage]["timeout_seconds"] if stage in stages else None,
                peak_rss_mib=rss,
                worker_id=worker_id,
                verified=because is None,
                unverified_because=because,
                gpus=held.get(attempt_id) or [],
            )
        )

    unknown_rows = source.rows(queries.UNKNOWN_ATTEMPTS, rid)
    found_on = (  # read only while the run has unknown attempts (few, and they halt it)
        {
            attempt_id: _json(detail)
            for attempt_id, detail in source.rows(queries.EVIDENCE_FOUND, rid)
        }
        if unknown_rows
        else {}
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
            evidence_on=_evidence_on(found_on.get(attempt_id)),
        )
        for attempt_id, job_id, item, stage, reason, evidence in unknown_rows
    ]

    controls = [
        Control(
            control_id,
            ControlKind(kind),
            ControlScope(scope),
            lane,
            reason,
            set_by,
            iso(_moment(set_at)),
        )
        for control_id, kind, scope, lane, reason, set_by, set_at in source.rows(
            queries.CONTROLS_IN_FORCE, rid
        )
    ]

    live = {w.node for w in workers if w.live}
    last_seen = _last_seen(workers)
    node_summary = node_rows(source, nodes, workers)

    settled_count = sum(sum(by.values()) for by in outcomes.values())
    end = run["finished_at"] or now
    hours = max((end - run["created_at"]).total_seconds() / 3600, 1e-9)
    events = [
        Event(event_id, iso(_moment(at)), kind, job_id, attempt_id, actor, _json(detail))
        for event_id, at, kind, job_id, attempt_id, actor, detail in reversed(
            source.rows(queries.RECENT_RUN_EVENTS, rid)
        )
    ]
    report = StatusReport(
        run=RunInfo(
            id=run["id"],
            name=run["name"],
            state=RunState(run["state"]),
            created_at=iso(run["created_at"]),
            finished_at=iso(run["finished_at"]),
            config_sha256=run["config_sha256"],
            runtime_dir=run["runtime_dir"],
            config_path=run["config_path"],
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
            if node not in live and run["state"] != RunState.FINISHED
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
            counts=counts,
            lane_nodes=lane_nodes,
            activity=activity,
        ),
        placement=placement(stage_nodes, lane_nodes, live),
        throughput=Throughput(
            settled_attempts=settled_count, per_hour=round(settled_count / hours, 1)
        ),
        closeout=closeout_state(source, run),
        recent_events=events,
        controller=controller_state(source, run["runtime_dir"], now=now),
    )
    for lane in report.lanes:  # one next step per lane, whoever reads the report
        lane.next_step = advice.next_step(lane, report)
    report.next_step = advice.run_next_step(report)  # and the run's, which views lead with
    return report


def _evidence_on(detail: dict[str, Any] | None) -> dict[str, Any] | None:
    """A ``note_evidence`` event's detail as ``UnknownAttempt.evidence_on``."""
    if not detail:
        return None
    return {key: detail.get(key) for key in ("node", "host", "outcome", "words")}


def _latest(one: datetime | None, other: datetime | None) -> datetime | None:
    """The later of two moments, either of which may be missing."""
    if one is None or other is None:
        return one or other
    return max(one, other)


def unverified_because(worker: Worker | None, worker_id: str | None) -> str | None:
    """Why an in-flight attempt is not known to run (None: its worker is ``live``):
    ``worker w-1 stale for 12 s``, ``worker w-1 lost``; a worker the report does not list
    (an older stopped or lost one) is named ``not live``."""
    if worker is None:
        return f"worker {worker_id} not live" if worker_id else "no worker holds it"
    if worker.liveness == LIVE:
        return None
    return f"worker {worker.worker_id} {worker.liveness_words()}"


def controller_state(source: Rows, runtime_dir: str, *, now: datetime) -> ControllerState:
    """Whether a controller serves ``runtime_dir`` (the run's): on SQLite the ledger and
    its controller are on this machine, so the controller's pidfile (``pidfile.py``,
    written by whoever holds the controller lock, ``laneway run`` or ``laneway
    controller``) says it: ``running`` when a live process holds it, else ``gone``. On a
    shared ledger (PostgreSQL) the controller may run on another machine, so its
    heartbeat in the ledger (``controllers``, judged by ``worker_liveness`` as a worker's
    is) says it: ``running`` while live, ``unknown`` while stale, ``gone`` once lost or
    stopped; ``unknown`` when no controller ever served it."""
    pid = running_controller(runtime_dir)
    if pid is not None:
        return ControllerState("running", pid, f"the controller runs (pid {pid})")
    found = source.rows(queries.LATEST_CONTROLLER)
    if _on_sqlite(source) is True:
        last = ""
        if found and found[0][4] is not None:
            controller_id, _host, row_pid, _beat, stopped = found[0]
            return ControllerState(
                "stopped",
                None,
                f"controller {controller_id} (pid {row_pid}) stopped at "
                f"{iso(_moment(stopped))}; none runs for {runtime_dir} now",
            )
        if found:
            controller_id, _host, row_pid, beat, _stopped = found[0]
            last = (
                f"; controller {controller_id} (pid {row_pid}) last heartbeat at "
                f"{iso(_moment(beat))}"
            )
        return ControllerState(
            "gone",
            None,
            f"no controller runs for {runtime_dir} (no live process holds its pidfile){last}",
        )
    if not found:
        return ControllerState(
            "unknown",
            None,
            "unknown: the ledger is shared (PostgreSQL) and no controller has served it yet",
        )
    controller_id, host, row_pid, beat, stopped = found[0]
    heartbeat = _moment(beat)
    assert heartbeat is not None
    age = (now - heartbeat).total_seconds()
    liveness = worker_liveness(
        WorkerState.STOPPED.value if stopped is not None else WorkerState.ACTIVE.value, age
    )
    who = f"controller {controller_id} (pid {row_pid} on {host})"
    if liveness == LIVE:
        return ControllerState("running", row_pid, f"the {who} runs (heartbeat {age:.0f} s ago)")
    if liveness == STOPPED:
        return ControllerState("stopped", None, f"the {who} stopped at {iso(_moment(stopped))}")
    if liveness == LOST:
        return ControllerState(
            "gone", None, f"the {who} is lost: no heartbeat since {iso(heartbeat)}"
        )
    return ControllerState(
        "unknown",
        row_pid,
        f"unknown: the {who} has not heartbeat for {age:.0f} s (lost after "
        f"{LOST_AFTER_SECONDS:.0f} s)",
    )


def _on_sqlite(source: Rows) -> bool | None:
    """Whether ``source`` reads a SQLite ledger (None: it cannot say): a
    ``ReadOnlyLedger`` says so, a ``SessionRows`` by its session's dialect."""
    is_sqlite = getattr(source, "is_sqlite", None)
    if isinstance(is_sqlite, bool):
        return is_sqlite
    session = getattr(source, "session", None)
    if session is not None:
        return bool(session.get_bind().dialect.name == "sqlite")
    return None


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
    counts: list[tuple[Any, ...]],
    lane_nodes: dict[str, str],
    activity: dict[str, tuple[datetime | None, datetime | None]],
) -> list[Lane]:
    """The run's lanes (``lane_nodes``: name to node, in name order), from ``counts``
    (``queries.JOB_COUNTS``'s rows) and ``activity`` (per lane, its newest attempt start
    and settle)."""
    by_lane: dict[str, dict[str, int]] = {}
    ready_stages: dict[str, set[str]] = {}
    for state, lane, stage, count in counts:
        by_state = by_lane.setdefault(lane, {})
        by_state[state] = by_state.get(state, 0) + count
        if state == JobState.READY.value:
            ready_stages.setdefault(lane, set()).add(stage)
    order = {stage: i for i, stage in enumerate(stage_nodes)}  # the config's stage order
    lanes = []
    for name, node in lane_nodes.items():
        by_state = by_lane.get(name, {})
        last_start, last_end = activity.get(name, (None, None))
        running = by_state.get(JobState.RUNNING.value, 0)
        pending = by_state.get(JobState.READY.value, 0) + by_state.get(JobState.WAITING.value, 0)
        reason = None
        if running == 0 and pending and run["state"] != RunState.FINISHED:
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

    def control_of(kind: ControlKind) -> Control | None:
        return next((c for c in controls if c.kind == kind and c.lane in (None, lane)), None)

    def held(code: RefusalCode, detail: dict[str, Any], since: str | None) -> Reason:
        words = refusal_words.describe(code, detail)
        return Reason(code=code, stage=None, since=since, detail=detail, words=words)

    halt = control_of(ControlKind.HALT)
    if halt is not None:
        detail = {"scope": halt.scope, "reason": halt.reason}
        return held(RefusalCode.HALTED, detail, halt.set_at)
    if unknown:
        return held(RefusalCode.UNKNOWN_OUTCOME, {"unknown_attempts": unknown}, None)
    for kind in (ControlKind.PAUSE, ControlKind.STOP):
        control = control_of(kind)
        if control is not None:
            detail = {"scope": control.scope, "reason": control.reason}
            return held(CONTROL_CODES[kind], detail, control.set_at)
    return None


def _current_refusal(source: Rows, run_id: int, lane: str) -> Reason | None:
    """The newest recorded refusal for the lane, if no dispatch came after it."""
    found = source.rows(queries.LANE_LAST_DECISION, {"run": run_id, "lane": lane})
    if not found or found[0][0] != Verdict.REFUSED.value:
        return None
    _verdict, reason_code, stage, decided_at, detail, node = found[0]
    code = refusal_code(reason_code) if reason_code else "refused"
    detail = _json(detail) or {}
    return Reason(
        code=code,
        stage=stage,
        node=node,
        since=iso(_moment(decided_at)),
        detail=detail,
        words=refusal_words.describe(code, detail),
        recorded=True,
    )


def closeout_state(source: Rows, run: dict[str, Any]) -> Closeout:
    """The run's closeout, from its ``closeout_*`` events (controller/closeout.py).

    ``state``: ``none`` (no closeout steps), ``pending`` (not begun: it runs when the run
    finishes, or is stopped and drained), ``running`` (``step`` k of ``step_count``, named
    in ``current``), ``finished`` (every step succeeded) or ``failed`` (it ended and
    ``failed_steps`` did not succeed: failed, timed out, or interrupted by a controller
    that died while they ran).
    """
    names = [step["name"] for step in run["config"].get("closeout") or []]
    steps = [CloseoutStep(name, StepState.PENDING, None) for name in names]
    body = Closeout(
        state="none", step=None, step_count=len(steps), current=None, failed_steps=[], steps=steps
    )
    if not steps:
        return body
    by_name = {step.name: step for step in steps}
    finished = None
    for kind, detail in source.rows(queries.CLOSEOUT_EVENTS, {"run": run["id"]}):
        detail = _json(detail) or {}
        if kind == EventKind.CLOSEOUT_FINISHED:
            finished = detail
            continue
        named = detail.get("step")
        step = by_name.get(named) if isinstance(named, str) else None
        if step is None:
            continue
        if kind == EventKind.CLOSEOUT_STEP_STARTED:
            step.state = StepState.RUNNING
        else:
            step.state, step.exit_code = _step_state(detail.get("state")), detail.get("exit_code")
    if finished is not None:
        for name, state in (finished.get("steps") or {}).items():
            if name in by_name:
                by_name[name].state = _step_state(state)
        failed = [s.name for s in steps if s.state != StepState.SUCCEEDED]
        body.state, body.failed_steps = ("failed" if failed else "finished"), failed
        return body
    not_failed = (StepState.SUCCEEDED, StepState.RUNNING, StepState.PENDING)
    body.failed_steps = [s.name for s in steps if s.state not in not_failed]
    current = next((s for s in steps if s.state == StepState.RUNNING), None)
    if current is None and all(s.state == StepState.PENDING for s in steps):
        body.state = "pending"
        return body
    if current is None:  # between two steps: the next pending one starts on the next tick
        current = next((s for s in steps if s.state == StepState.PENDING), steps[-1])
    number = next(i for i, s in enumerate(steps) if s is current) + 1
    body.state, body.step, body.current = "running", number, current.name
    return body


def _step_state(value: Any) -> StepState | None:
    """A closeout step's state as its event recorded it (None, or text this version does
    not know, stays as it is)."""
    try:
        return StepState(value)
    except ValueError:
        return value  # type: ignore[no-any-return]
