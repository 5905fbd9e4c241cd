"""The ledger: the one module that writes state.

Every change to a run, job, attempt, lease, reservation, control, decision or worker row
happens here, as a compare-and-set (``UPDATE ... WHERE id = :id AND state = :expected
[AND fence = :fence]``) whose row count is checked, with its event appended in the same
transaction. Callers pass an open Session (see ``controller.db.transaction``) and ``now``
from a Clock; this module never commits and never reads the wall clock.

Lease design (invariant 4). A lease is a worker's claim on one job for one attempt. It
is granted in the same transaction that writes the attempt's intent, and it carries the
job's fence token, which only grows: it is bumped on every grant and every revocation.
Every later write about the attempt (spawn identity, settle) names the fence it was
granted, and the compare-and-set includes ``jobs.fence = :fence``: a worker whose lease
was revoked (a zombie coming back late) matches no row and gets ``StaleLease``. The
holder renews the lease with each heartbeat; ``expires_at`` is judged on the database's
clock (on SQLite, the single host's clock read through ``controller.clock``). A holder
must stop trusting its lease when a renewal fails or when it has not renewed it for
``lease_seconds``: from then on it may only write evidence files, never ledger state.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, and_, func, select, update
from sqlalchemy.orm import Session

from controller import admission, breakers
from controller.config import PipelineConfig, config_from_frozen, render
from controller.errors import IllegalTransition, NotFound, StaleLease
from controller.models import (
    Attempt,
    Control,
    Decision,
    Event,
    Item,
    Job,
    Lane,
    Lease,
    Node,
    Reservation,
    Run,
    Worker,
)
from controller.outcome import Verdict as OutcomeVerdict
from controller.states import (
    TERMINAL_JOB_STATES,
    AttemptState,
    ControlKind,
    ControlScope,
    JobState,
    Outcome,
    RunState,
    Verdict,
    WorkerState,
)

DEFAULT_LEASE_SECONDS = 60.0


def _rowcount(result: Any) -> int:
    """Rows matched by an UPDATE: how a compare-and-set learns whether it won."""
    return int(cast(CursorResult[Any], result).rowcount)


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.WAITING: frozenset({JobState.READY, JobState.SKIPPED, JobState.CANCELLED}),
    JobState.READY: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.READY,  # the stage's retry policy allows another attempt
            JobState.UNKNOWN,
        }
    ),
    JobState.UNKNOWN: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.READY, JobState.CANCELLED}
    ),
    JobState.FAILED: frozenset({JobState.READY}),  # only an operator's retry
    JobState.SUCCEEDED: frozenset(),
    JobState.SKIPPED: frozenset({JobState.WAITING}),  # only an operator's retry upstream
    JobState.CANCELLED: frozenset(),
}
"""Every legal job transition; ``move_job`` refuses anything else."""

ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.INTENT: frozenset(
        {AttemptState.RUNNING, AttemptState.SETTLED, AttemptState.UNKNOWN}
    ),
    AttemptState.RUNNING: frozenset({AttemptState.SETTLED, AttemptState.UNKNOWN}),
    AttemptState.UNKNOWN: frozenset({AttemptState.SETTLED}),
    AttemptState.SETTLED: frozenset(),
}


# --------------------------------------------------------------------------- events


def append_event(
    session: Session,
    kind: str,
    *,
    actor: str,
    now: datetime,
    run_id: int | None = None,
    job_id: int | None = None,
    attempt_id: int | None = None,
    **detail: Any,
) -> None:
    """Append one row to the append-only event log (same transaction as the change)."""
    session.add(
        Event(
            at=now,
            kind=kind,
            actor=actor,
            run_id=run_id,
            job_id=job_id,
            attempt_id=attempt_id,
            detail=detail,
        )
    )


def latest_event_id(session: Session) -> int:
    """The newest event id: a cheap "did anything change?" signal for polling loops."""
    return session.scalar(select(func.max(Event.id))) or 0


# --------------------------------------------------------------------- transitions


def move_job(
    session: Session,
    job_id: int,
    expected: JobState,
    new: JobState,
    *,
    now: datetime,
    actor: str,
    fence: int | None = None,
    reason: str | None = None,
    bump_fence: bool = False,
    run_id: int | None = None,
) -> None:
    """Compare-and-set a job from ``expected`` to ``new`` and log ``job_<new>``.

    In-session Job objects are not refreshed (load with ``populate_existing`` to read
    a job after moving it).

    Raises IllegalTransition if the move is not in JOB_TRANSITIONS or the row is not in
    ``expected``; StaleLease if ``fence`` is given and is no longer the job's fence.
    """
    if new not in JOB_TRANSITIONS[expected]:
        raise IllegalTransition(f"job {job_id}: {expected.value} -> {new.value} is not allowed")
    conditions = [Job.id == job_id, Job.state == expected.value]
    if fence is not None:
        conditions.append(Job.fence == fence)
    values: dict[str, Any] = {"state": new.value, "updated_at": now, "state_reason": reason}
    if new in TERMINAL_JOB_STATES:
        values["finished_at"] = now
    elif expected in TERMINAL_JOB_STATES:
        values["finished_at"] = None
    if bump_fence:
        values["fence"] = Job.fence + 1
    statement = update(Job).where(*conditions).values(**values)
    changed = _rowcount(session.execute(statement.execution_options(synchronize_session=False)))
    if changed != 1:
        row = session.get(Job, job_id, populate_existing=True)
        if row is None:
            raise NotFound(f"job {job_id} does not exist")
        if fence is not None and row.fence != fence:
            raise StaleLease(
                f"job {job_id}: fence {fence} is stale (current {row.fence}); "
                "this worker's lease was revoked"
            )
        raise IllegalTransition(
            f"job {job_id} is {row.state}, not {expected.value}; cannot move it to {new.value}"
        )
    if run_id is None:
        run_id = session.scalar(select(Job.run_id).where(Job.id == job_id))
    extra: dict[str, Any] = {"reason": reason} if reason else {}
    append_event(
        session,
        f"job_{new.value}",
        actor=actor,
        now=now,
        run_id=run_id,
        job_id=job_id,
        **extra,
    )


def move_attempt(
    session: Session,
    attempt_id: int,
    expected: AttemptState | tuple[AttemptState, ...],
    new: AttemptState,
    *,
    now: datetime,
    actor: str,
    fence: int | None = None,
    values: dict[str, Any] | None = None,
    event_detail: dict[str, Any] | None = None,
) -> Attempt:
    """Compare-and-set an attempt's state (and ``values``), fenced by its job's fence."""
    expected_states = expected if isinstance(expected, tuple) else (expected,)
    for state in expected_states:
        if new not in ATTEMPT_TRANSITIONS[state]:
            raise IllegalTransition(
                f"attempt {attempt_id}: {state.value} -> {new.value} is not allowed"
            )
    conditions = [
        Attempt.id == attempt_id,
        Attempt.state.in_([s.value for s in expected_states]),
    ]
    if fence is not None:
        current_fence = select(Job.fence).where(Job.id == Attempt.job_id).scalar_subquery()
        conditions += [Attempt.fence == fence, current_fence == fence]
    changes = {"state": new.value, **(values or {})}
    changed = _rowcount(session.execute(update(Attempt).where(*conditions).values(**changes)))
    row = session.get(Attempt, attempt_id, populate_existing=True)
    if row is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    if changed != 1:
        job_fence = session.scalar(select(Job.fence).where(Job.id == row.job_id))
        if fence is not None and (row.fence != fence or job_fence != fence):
            raise StaleLease(
                f"attempt {attempt_id}: fence {fence} is stale (job fence {job_fence}); "
                "this worker's lease was revoked"
            )
        raise IllegalTransition(
            f"attempt {attempt_id} is {row.state}, not "
            f"{'/'.join(s.value for s in expected_states)}; cannot move it to {new.value}"
        )
    append_event(
        session,
        f"attempt_{new.value}",
        actor=actor,
        now=now,
        run_id=row.run_id,
        job_id=row.job_id,
        attempt_id=attempt_id,
        **(event_detail or {}),
    )
    return row


# ----------------------------------------------------------------------------- runs


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
        "updated_at": now,
    }
    if row is None:
        session.add(Node(name=node.name, **values))
    else:
        for key, value in values.items():
            setattr(row, key, value)


def create_run(
    session: Session,
    config: PipelineConfig,
    *,
    runtime_dir: str,
    source_hashes: dict[str, str],
    actor: str,
    now: datetime,
) -> Run:
    """Freeze ``config`` into a new run with its lanes, items and jobs.

    Only the first ``batch_cap`` items (in config order) are taken on. A job with no
    ``needs`` starts ready; the rest wait for the controller.
    """
    for node in config.nodes:
        upsert_node(session, node, now=now)
    run = Run(
        name=config.name,
        state=RunState.ACTIVE.value,
        config_json=config.canonical_json(),
        config_sha256=config.sha256(),
        source_hashes=source_hashes,
        runtime_dir=runtime_dir,
        created_by=actor,
        created_at=now,
    )
    session.add(run)
    session.flush()
    for lane in config.lanes:
        session.add(Lane(run_id=run.id, name=lane.name, node=lane.node, caps=dict(lane.caps)))
    items = config.items[: config.batch_cap] if config.batch_cap else config.items
    for position, item_config in enumerate(items):
        item = Item(
            run_id=run.id,
            key=item_config.key,
            lane=item_config.lane,
            position=position,
            fields=item_config.fields,
        )
        session.add(item)
        session.flush()
        for stage_position, stage in enumerate(config.stages):
            state = JobState.WAITING if stage.needs else JobState.READY
            session.add(
                Job(
                    run_id=run.id,
                    item_id=item.id,
                    stage=stage.name,
                    stage_position=stage_position,
                    lane=item.lane,
                    state=state.value,
                    fence=0,
                    attempt_count=0,
                    created_at=now,
                    updated_at=now,
                )
            )
    session.flush()
    append_event(
        session,
        "run_created",
        actor=actor,
        now=now,
        run_id=run.id,
        config_sha256=run.config_sha256,
        items=len(items),
        deferred_by_batch_cap=len(config.items) - len(items),
    )
    return run


_config_cache: dict[str, PipelineConfig] = {}
_item_index: dict[str, dict[str, Any]] = {}


def _item_config(run: Run, key: str) -> Any:
    """The frozen config's item ``key`` of ``run`` (indexed once per config hash)."""
    index = _item_index.get(run.config_sha256)
    if index is None:
        items = run_config(run).items
        index = _item_index[run.config_sha256] = {item.key: item for item in items}
    return index[key]


def run_config(run: Run) -> PipelineConfig:
    """The frozen config of a run (parsed once per process per config hash)."""
    cached = _config_cache.get(run.config_sha256)
    if cached is None:
        cached = _config_cache[run.config_sha256] = config_from_frozen(run.config_json)
    return cached


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
) -> str:
    """Record a starting worker and return its id."""
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
            state=WorkerState.ACTIVE.value,
            started_at=now,
            heartbeat_at=now,
        )
    )
    append_event(session, "worker_started", actor=worker_id, now=now, node=node, pid=pid)
    return worker_id


def heartbeat(
    session: Session,
    worker_id: str,
    *,
    now: datetime,
    lease_seconds: float,
    mem_available_mib: float | None,
    mem_total_mib: float | None,
    gpus: list[dict[str, float]] | None = None,
    gpu_note: str | None = None,
) -> int:
    """Renew the worker's heartbeat, its live leases, and its node's memory sample.

    Returns how many leases were renewed. Raises StaleLease if the worker is no longer
    active (the controller declared it lost).
    """
    changed = _rowcount(
        session.execute(
            update(Worker)
            .where(Worker.id == worker_id, Worker.state == WorkerState.ACTIVE.value)
            .values(heartbeat_at=now)
        )
    )
    if changed != 1:
        raise StaleLease(f"worker {worker_id} is no longer active; it must stop writing")
    renewed = _rowcount(
        session.execute(
            update(Lease)
            .where(
                Lease.worker_id == worker_id,
                Lease.released_at.is_(None),
                Lease.expires_at > now,
            )
            .values(expires_at=now + timedelta(seconds=lease_seconds))
        )
    )
    node = session.scalar(select(Worker.node).where(Worker.id == worker_id))
    session.execute(
        update(Node)
        .where(Node.name == node)
        .values(
            mem_available_mib=mem_available_mib,
            mem_total_mib=mem_total_mib,
            gpus=gpus,
            gpu_note=gpu_note,
            sampled_at=now,
            updated_at=now,
        )
    )
    return renewed


def stop_worker(session: Session, worker_id: str, *, now: datetime) -> None:
    """A worker's clean exit."""
    changed = _rowcount(
        session.execute(
            update(Worker)
            .where(Worker.id == worker_id, Worker.state == WorkerState.ACTIVE.value)
            .values(state=WorkerState.STOPPED.value, stopped_at=now)
        )
    )
    if changed != 1:
        raise IllegalTransition(f"worker {worker_id} is not active")
    append_event(session, "worker_stopped", actor=worker_id, now=now)


# --------------------------------------------------------------------- claim / intent


@dataclass(frozen=True)
class Claim:
    """Everything a worker needs to spawn one attempt whose intent is committed."""

    run_id: int
    job_id: int
    attempt_id: int
    number: int
    fence: int
    idempotency_key: str
    item: str
    stage: str
    lane: str
    argv: list[str]
    env: dict[str, str]
    """Templates rendered; ``${NAME}`` secret references still unresolved."""
    cwd: str | None
    timeout_seconds: int
    grace_seconds: float
    attempt_dir: str
    log_cap_bytes: int = 1 << 30
    ports: list[int] = field(default_factory=list)


def attempt_dir(runtime_dir: str, run_id: int, item: str, stage: str, number: int) -> str:
    return str(
        Path(runtime_dir) / "runs" / str(run_id) / "jobs" / f"{item}.{stage}" / f"attempt-{number}"
    )


def argv_hash(argv: list[str], cwd: str | None) -> str:
    return hashlib.sha256(json.dumps([argv, cwd]).encode()).hexdigest()


def claim_jobs(
    session: Session,
    *,
    worker_id: str,
    node: str,
    free_slots: int,
    mem_available_mib: float | None,
    now: datetime,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    candidate_limit: int = 500,
    check_sources: Callable[[Run], list[str]] | None = None,
    pick_ports: Callable[[int, set[int]], list[int]] | None = None,
) -> list[Claim]:
    """Lease admissible jobs for up to ``free_slots`` and commit their intents.

    In one write transaction: build the admission snapshot for ``node``, ask
    ``admission.admit``, then for each job to start bump its fence, write the attempt
    (the intent, with a fresh idempotency key), the lease and the reservation, and
    record the decisions. The caller commits before spawning anything (invariant 1).

    ``pick_ports(n, taken)`` returns ``n`` free ports not in ``taken`` (the ports of the
    node's in-flight attempts); they are recorded on the attempt in this transaction.

    ``check_sources(run)`` re-checks the run's frozen source files before anything of
    that run is dispatched (invariant 12): any drift halts the run, naming the file and
    both hashes, and nothing of it starts.
    """
    snapshot, jobs_by_id = admission_snapshot(
        session, node=node, free_slots=free_slots, mem=mem_available_mib, limit=candidate_limit
    )
    verdict = admission.admit(snapshot)
    if check_sources is not None and verdict.starts:
        drifted = _halt_on_source_drift(
            session, verdict, jobs_by_id, check_sources, now=now, actor=worker_id
        )
        if drifted:
            snapshot.controls += [
                admission.ControlView("halt", "run", run_id, None, "frozen sources changed")
                for run_id in drifted
            ]
            verdict = admission.admit(snapshot)
    claims = []
    taken = _ports_in_use(session, node) if verdict.starts else set()
    for candidate in verdict.starts:
        job, run = jobs_by_id[candidate.job_id]
        claims.append(
            _grant(
                session,
                job,
                run,
                run_config(run),
                memory_mib=candidate.memory_mib,
                pick_ports=pick_ports,
                taken_ports=taken,
                worker_id=worker_id,
                node=node,
                now=now,
                lease_seconds=lease_seconds,
            )
        )
        _record_decision(
            session,
            admission.Refusal(run.id, job.lane, job.stage, "", {}, job.id),
            verdict=Verdict.DISPATCHED,
            node=node,
            worker_id=worker_id,
            now=now,
        )
    # Refusals after dispatches: when a lane dispatched one job and must refuse the next
    # (e.g. its cap is now reached), the refusal is the lane's state from now on.
    _record_refusals(session, verdict.refusals, node=node, worker_id=worker_id, now=now)
    return claims


def _ports_in_use(session: Session, node: str) -> set[int]:
    """Ports held by the node's in-flight (and unknown) attempts."""
    used: set[int] = set()
    for (ports,) in session.execute(
        select(Attempt.ports).where(
            Attempt.node == node,
            Attempt.ports.is_not(None),
            Attempt.state.in_(
                [AttemptState.INTENT.value, AttemptState.RUNNING.value, AttemptState.UNKNOWN.value]
            ),
        )
    ).all():
        used.update(int(port) for port in ports or [])
    return used


def _halt_on_source_drift(
    session: Session,
    verdict: admission.Admission,
    jobs_by_id: dict[int, tuple[Any, Run]],
    check_sources: Callable[[Run], list[str]],
    *,
    now: datetime,
    actor: str,
) -> set[int]:
    """Halt every run about to dispatch whose frozen sources changed; their ids."""
    drifted: set[int] = set()
    runs = {jobs_by_id[c.job_id][1].id: jobs_by_id[c.job_id][1] for c in verdict.starts}
    for run_id, run in runs.items():
        problems = check_sources(run)
        if problems:
            set_control(
                session,
                ControlKind.HALT,
                scope=ControlScope.RUN,
                run_id=run_id,
                reason="frozen sources changed: " + "; ".join(problems),
                actor=actor,
                now=now,
            )
            drifted.add(run_id)
    return drifted


def _grant(
    session: Session,
    job: Any,
    run: Run,
    config: PipelineConfig,
    *,
    memory_mib: float,
    pick_ports: Callable[[int, set[int]], list[int]] | None = None,
    taken_ports: set[int] | None = None,
    worker_id: str,
    node: str,
    now: datetime,
    lease_seconds: float,
) -> Claim:
    stage = config.stage(job.stage)
    item_config = _item_config(run, job.item_key)
    number = job.attempt_count + 1
    fence = job.fence + 1  # read in this write transaction: nobody else can move it
    move_job(
        session,
        job.id,
        JobState.READY,
        JobState.RUNNING,
        now=now,
        actor=worker_id,
        bump_fence=True,
        run_id=run.id,
    )
    session.execute(
        update(Job)
        .where(Job.id == job.id)
        .values(attempt_count=number)
        .execution_options(synchronize_session=False)
    )
    argv = [render(part, item_config) for part in stage.argv]
    env = {name: render(value, item_config) for name, value in stage.env.items()}
    cwd = render(stage.cwd, item_config) if stage.cwd else None
    directory = attempt_dir(run.runtime_dir, run.id, job.item_key, job.stage, number)
    key = f"lw-{run.id}-{job.id}-{number}-{uuid.uuid4().hex[:12]}"
    ports: list[int] | None = None
    if stage.ports:
        if pick_ports is None:
            raise IllegalTransition(f"stage {stage.name} asks for ports; no port picker given")
        taken = taken_ports if taken_ports is not None else set()
        ports = pick_ports(stage.ports, taken)
        taken.update(ports)
    attempt = Attempt(
        ports=ports,
        job_id=job.id,
        run_id=run.id,
        number=number,
        idempotency_key=key,
        state=AttemptState.INTENT.value,
        fence=fence,
        worker_id=worker_id,
        node=node,
        argv_hash=argv_hash(argv, cwd),
        attempt_dir=directory,
        intent_at=now,
        diagnostics=[],
    )
    session.add(attempt)
    session.flush()
    session.add(
        Lease(
            job_id=job.id,
            attempt_id=attempt.id,
            worker_id=worker_id,
            fence=fence,
            granted_at=now,
            expires_at=now + timedelta(seconds=lease_seconds),
        )
    )
    session.add(
        Reservation(
            attempt_id=attempt.id,
            node=node,
            memory_mib=math.ceil(memory_mib),
            gpu_mib=stage.gpu_mib,
            created_at=now,
        )
    )
    append_event(
        session,
        "attempt_intent",
        actor=worker_id,
        now=now,
        run_id=run.id,
        job_id=job.id,
        attempt_id=attempt.id,
        number=number,
        fence=fence,
        idempotency_key=key,
    )
    return Claim(
        run_id=run.id,
        job_id=job.id,
        attempt_id=attempt.id,
        number=number,
        fence=fence,
        idempotency_key=key,
        item=job.item_key,
        stage=job.stage,
        lane=job.lane,
        argv=argv,
        env=env,
        cwd=cwd,
        timeout_seconds=stage.timeout_seconds,
        grace_seconds=stage.grace_seconds,
        attempt_dir=directory,
        log_cap_bytes=int(stage.log_cap_mib * 1024 * 1024),
        ports=list(ports or []),
    )


def admission_snapshot(
    session: Session,
    *,
    node: str,
    free_slots: int,
    mem: float | None,
    limit: int,
    lock: bool = True,
    job_id: int | None = None,
) -> tuple[admission.Snapshot, dict[int, tuple[Any, Run]]]:
    """What admission sees for ``node`` now. Read-only; ``lock`` takes row locks on
    PostgreSQL (claims), ``job_id`` narrows the candidates to one job (explain)."""
    node_row = session.get(Node, node)
    if node_row is None:
        raise NotFound(f"node {node!r} is not in the ledger")
    lanes = session.execute(
        select(Lane, Run)
        .join(Run, Run.id == Lane.run_id)
        .where(Lane.node == node, Run.state == RunState.ACTIVE.value)
    ).all()
    lane_keys = {(lane.run_id, lane.name) for lane, _ in lanes}
    runs = {run.id: run for _, run in lanes}
    run_ids = list(runs)
    lane_caps = {(lane.run_id, lane.name): dict(lane.caps) for lane, _ in lanes}
    stage_caps: dict[tuple[int, str], int | None] = {}
    for run in runs.values():
        for stage in run_config(run).stages:
            stage_caps[(run.id, stage.name)] = stage.cap

    # Plain columns, not ORM entities: this runs on every claim over many ready rows.
    candidate_query = (
        select(
            Job.id,
            Job.run_id,
            Job.lane,
            Job.stage,
            Job.fence,
            Job.attempt_count,
            Item.key.label("item_key"),
        )
        .join(Item, Item.id == Job.item_id)
        .join(Lane, (Lane.run_id == Job.run_id) & (Lane.name == Job.lane))
        .where(Job.run_id.in_(run_ids), Job.state == JobState.READY.value, Lane.node == node)
        .order_by(Job.run_id, Job.stage_position.desc(), Item.position)
        .limit(limit)
    )
    if job_id is not None:
        candidate_query = candidate_query.where(Job.id == job_id)
    if lock:
        # PostgreSQL: racing workers skip rows another claim holds (SQLite ignores this;
        # its BEGIN IMMEDIATE already serialises claims).
        candidate_query = candidate_query.with_for_update(skip_locked=True, of=Job)
    ready_rows = session.execute(candidate_query).all()
    peaks = stage_peaks(session, run_ids)
    candidates = []
    jobs_by_id: dict[int, tuple[Any, Run]] = {}
    for job in ready_rows:
        if (job.run_id, job.lane) not in lane_keys:
            continue
        stage = run_config(runs[job.run_id]).stage(job.stage)
        rss_peak, gpu_peak = peaks.get((job.run_id, job.stage), (None, None))
        candidates.append(
            admission.Candidate(
                job_id=job.id,
                run_id=job.run_id,
                lane=job.lane,
                stage=job.stage,
                memory_mib=reservation_mib(stage, rss_peak),
                gpu_mib=stage.gpu_mib,
                gpu_peak_mib=gpu_peak,
            )
        )
        jobs_by_id[job.id] = (job, runs[job.run_id])

    running_lane_stage: Counter[tuple[int, str, str]] = Counter()
    running_stage: Counter[tuple[int, str]] = Counter()
    for run_id, lane, stage_name, count in session.execute(
        select(Job.run_id, Job.lane, Job.stage, func.count())
        .where(Job.run_id.in_(run_ids), Job.state == JobState.RUNNING.value)
        .group_by(Job.run_id, Job.lane, Job.stage)
    ):
        running_lane_stage[(run_id, lane, stage_name)] += count
        running_stage[(run_id, stage_name)] += count

    node_running = (
        session.scalar(
            select(func.count())
            .select_from(Attempt)
            .where(
                Attempt.node == node,
                # Unknown attempts count: their processes may still be running.
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
    # "Unreleased": the part of each live reservation its attempt has not yet grown into
    # (free memory already shows what it uses). Never sampled: the whole reservation.
    reserved = 0.0
    gpu_running_peaks: list[float | None] = []
    for memory_mib, gpu_mib, current_rss, run_id, stage_name in session.execute(
        select(
            Reservation.memory_mib,
            Reservation.gpu_mib,
            Attempt.current_rss_mib,
            Attempt.run_id,
            Job.stage,
        )
        .join(Attempt, Attempt.id == Reservation.attempt_id)
        .join(Job, Job.id == Attempt.job_id)
        .where(Reservation.node == node, Reservation.released_at.is_(None))
    ).all():
        reserved += max(0.0, memory_mib - (current_rss or 0.0))
        if gpu_mib > 0:
            if (run_id, stage_name) not in peaks:
                peaks.update(stage_peaks(session, [run_id]))
            gpu_running_peaks.append(peaks.get((run_id, stage_name), (None, None))[1])
    controls = [
        admission.ControlView(c.kind, c.scope, c.run_id, c.lane, c.reason)
        for c in session.scalars(select(Control).where(Control.cleared_at.is_(None)))
    ]
    unknown_runs: dict[int, int] = {}
    unknown_everywhere = 0
    for run_id, count in session.execute(
        select(Attempt.run_id, func.count())
        .where(Attempt.state == AttemptState.UNKNOWN.value)
        .group_by(Attempt.run_id)
    ).all():
        if run_id in runs:
            unknown_runs[run_id] = count
        # A run configured with unknown_scope = "everything" halts every run's dispatch.
        owner = runs.get(run_id) or session.get(Run, run_id)
        if owner is not None and run_config(owner).unknown_scope == "everything":
            unknown_everywhere += count
    waiting_lanes = {
        (run_id, lane)
        for run_id, lane in session.execute(
            select(Job.run_id, Job.lane)
            .where(Job.run_id.in_(run_ids), Job.state == JobState.WAITING.value)
            .distinct()
        )
        if (run_id, lane) in lane_keys
    }
    snapshot = admission.Snapshot(
        node=admission.NodeView(
            name=node,
            max_jobs=node_row.max_jobs,
            memory_floor_mib=node_row.memory_floor_mib,
            mem_available_mib=mem,
            reserved_mib=reserved,
            running=node_running,
            has_gpu=node_row.gpu_total_mib is not None or bool(node_row.gpus),
            gpu_running_peaks=tuple(gpu_running_peaks),
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
        waiting_lanes=waiting_lanes,
    )
    return snapshot, jobs_by_id


def stage_peaks(
    session: Session, run_ids: list[int]
) -> dict[tuple[int, str], tuple[float | None, float | None]]:
    """(run, stage) -> (peak RSS MiB, peak GPU MiB) over the stage's settled attempts."""
    rows = session.execute(
        select(
            Attempt.run_id,
            Job.stage,
            func.max(Attempt.peak_rss_mib),
            func.max(Attempt.peak_gpu_mib),
        )
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.run_id.in_(run_ids), Attempt.state == AttemptState.SETTLED.value)
        .group_by(Attempt.run_id, Job.stage)
    ).all()
    return {(run_id, stage): (rss, gpu) for run_id, stage, rss, gpu in rows}


def reservation_mib(stage: Any, peak_rss_mib: float | None) -> float:
    """The memory a stage reserves: configured, or with ``learn_memory`` the larger of
    that minimum and the measured peak times the margin."""
    if stage.learn_memory and peak_rss_mib is not None:
        return float(max(stage.memory_mib, peak_rss_mib * stage.memory_margin))
    return float(stage.memory_mib)


def _gpu_capacity(node: Node) -> dict[str, float]:
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


def _record_refusals(
    session: Session,
    refusals: list[admission.Refusal],
    *,
    node: str,
    worker_id: str,
    now: datetime,
) -> None:
    for refusal in refusals:
        _record_decision(
            session, refusal, verdict=Verdict.REFUSED, node=node, worker_id=worker_id, now=now
        )


def _record_decision(
    session: Session,
    refusal: admission.Refusal,
    *,
    verdict: Verdict,
    node: str,
    worker_id: str,
    now: datetime,
) -> None:
    """Insert a decision only when the verdict or reason for (run, lane, stage) changed."""
    stage_match = (
        Decision.stage.is_(None) if refusal.stage is None else Decision.stage == refusal.stage
    )
    last = session.execute(
        select(Decision.verdict, Decision.reason_code, Decision.detail)
        .where(Decision.run_id == refusal.run_id, Decision.lane == refusal.lane, stage_match)
        .order_by(Decision.id.desc())
        .limit(1)
    ).first()
    code = refusal.code or None
    if last is not None and last.verdict == verdict.value and last.reason_code == code:
        return
    session.add(
        Decision(
            run_id=refusal.run_id,
            lane=refusal.lane,
            stage=refusal.stage,
            node=node,
            worker_id=worker_id,
            verdict=verdict.value,
            reason_code=code,
            detail=refusal.detail,
            job_id=refusal.job_id,
            decided_at=now,
        )
    )


# --------------------------------------------------------------------------- spawn


def record_spawn(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    actor: str,
    now: datetime,
    boot_id: str,
    supervisor_pid: int,
    supervisor_start_time: int | None,
    child_pid: int | None,
    child_start_time: int | None,
) -> None:
    """Intent -> running: the supervisor (and child) identity is now in the ledger."""
    move_attempt(
        session,
        attempt_id,
        AttemptState.INTENT,
        AttemptState.RUNNING,
        now=now,
        actor=actor,
        fence=fence,
        values={
            "started_at": now,
            "boot_id": boot_id,
            "supervisor_pid": supervisor_pid,
            "supervisor_start_time": supervisor_start_time,
            "child_pid": child_pid,
            "child_start_time": child_start_time,
        },
        event_detail={"supervisor_pid": supervisor_pid, "child_pid": child_pid},
    )


# -------------------------------------------------------------------------- settle


def settle_attempt(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    outcome: Outcome,
    actor: str,
    now: datetime,
    reason: str | None = None,
    exit_code: int | None = None,
    exit_signal: int | None = None,
    result: dict[str, Any] | None = None,
    diagnostics: list[str] | None = None,
    revoke: bool = False,
    measured: dict[str, Any] | None = None,
) -> JobState:
    """Settle an attempt into ``outcome``, move its job on, release lease and reservation.

    ``revoke``: settling on the lease holder's behalf (the controller, after the lease
    expired) bumps the fence, so the holder, should it return, gets StaleLease.

    The job becomes ready again only if its stage's retry policy names the outcome and
    attempts remain; otherwise it becomes succeeded, failed or cancelled. Downstream jobs
    of the item are promoted or skipped in the same transaction. Returns the job's new
    state. StaleLease if ``fence`` is no longer current.
    """
    attempt = move_attempt(
        session,
        attempt_id,
        (AttemptState.INTENT, AttemptState.RUNNING),
        AttemptState.SETTLED,
        now=now,
        actor=actor,
        fence=fence,
        values={
            "outcome": outcome.value,
            "settled_at": now,
            "state_reason": reason,
            "exit_code": exit_code,
            "exit_signal": exit_signal,
            "result": result,
            "diagnostics": diagnostics or [],
            **_measured_columns(measured),
        },
        event_detail={"outcome": outcome.value, "exit_code": exit_code, "reason": reason},
    )
    job = session.get(Job, attempt.job_id, populate_existing=True)
    assert job is not None
    run = session.get(Run, job.run_id)
    assert run is not None
    stage = run_config(run).stage(job.stage)
    if outcome is Outcome.SUCCEEDED:
        new_state = JobState.SUCCEEDED
    elif outcome is Outcome.CANCELLED:
        new_state = JobState.CANCELLED
    elif outcome.value in stage.retry.on and job.attempt_count < stage.retry.max_attempts:
        new_state = JobState.READY
    else:
        new_state = JobState.FAILED
    move_job(
        session,
        job.id,
        JobState.RUNNING,
        new_state,
        now=now,
        actor=actor,
        fence=fence,
        bump_fence=revoke,
        reason=None
        if new_state is JobState.SUCCEEDED
        else f"attempt {attempt.number}: {outcome.value}",
    )
    _release(session, attempt_id, now=now)
    promote_item(session, job.item_id, now=now, actor=actor)
    _trip_breaker(session, attempt, outcome, reason, now=now, actor=actor)
    return new_state


def _trip_infra_breaker(session: Session, attempt: Attempt, *, now: datetime, actor: str) -> None:
    run = session.get(Run, attempt.run_id)
    assert run is not None
    limit = run_config(run).infra_breaker
    history = [
        (item, Outcome(str(outcome)))
        for item, outcome in session.execute(
            select(Item.key, Attempt.outcome)
            .join(Job, Job.id == Attempt.job_id)
            .join(Item, Item.id == Job.item_id)
            .where(Attempt.run_id == run.id, Attempt.state == AttemptState.SETTLED.value)
            .order_by(Attempt.settled_at, Attempt.id)
        ).all()
    ]
    if not breakers.infra_breaker_trips(history, limit):
        return
    paused = session.scalar(
        select(func.count())
        .select_from(Control)
        .where(
            Control.run_id == run.id,
            Control.kind == ControlKind.PAUSE.value,
            Control.cleared_at.is_(None),
        )
    )
    if paused:
        return
    items = sorted(breakers.infra_streak(history))
    set_control(
        session,
        ControlKind.PAUSE,
        scope=ControlScope.RUN,
        run_id=run.id,
        reason=(
            f"infrastructure failures of {len(items)} distinct items in a row "
            f"({', '.join(items)}); breaker threshold {limit}"
        ),
        actor=actor,
        now=now,
    )


def _trip_breaker(
    session: Session,
    attempt: Attempt,
    outcome: Outcome,
    reason: str | None,
    *,
    now: datetime,
    actor: str,
) -> None:
    """Invariant 11, in the settle's own transaction: a fatal outcome halts the run, a
    harness failure (laneway's own side broke) pauses it. Ordinary failures never trip."""
    if outcome is Outcome.INFRA_FAILURE:
        _trip_infra_breaker(session, attempt, now=now, actor=actor)
        return
    kind = {Outcome.FATAL: ControlKind.HALT, Outcome.HARNESS_FAILURE: ControlKind.PAUSE}.get(
        outcome
    )
    if kind is None:
        return
    set_control(
        session,
        kind,
        scope=ControlScope.RUN,
        run_id=attempt.run_id,
        reason=f"attempt {attempt.id} settled {outcome.value}: {reason or 'no reason given'}",
        actor=actor,
        now=now,
    )


def settle_from_verdict(
    session: Session,
    attempt_id: int,
    *,
    fence: int,
    verdict: OutcomeVerdict,
    exit_record: dict[str, Any] | None,
    result: dict[str, Any] | None,
    actor: str,
    now: datetime,
    measured: dict[str, Any] | None = None,
    revoke: bool = False,
    reason_suffix: str = "",
) -> JobState:
    """``settle_attempt`` from a classified outcome (``controller.outcome``) and the exit
    record it came from. The verdict must have an outcome (unknown goes to mark_unknown)."""
    assert verdict.outcome is not None
    record = exit_record or {}
    return settle_attempt(
        session,
        attempt_id,
        fence=fence,
        outcome=verdict.outcome,
        actor=actor,
        now=now,
        reason=verdict.reason + reason_suffix,
        exit_code=record.get("exit_code"),
        exit_signal=record.get("signal"),
        result=result,
        diagnostics=verdict.diagnostics,
        measured=measured,
        revoke=revoke,
    )


MEASURED_COLUMNS = (
    "current_rss_mib",
    "peak_rss_mib",
    "peak_rss_at",
    "peak_gpu_mib",
    "peak_gpu_at",
    "gpu_note",
    "sampled_at",
)


def _measured_columns(measured: dict[str, Any] | None) -> dict[str, Any]:
    if not measured or measured.get("sampled_at") is None:
        return {}
    return {column: measured.get(column) for column in MEASURED_COLUMNS}


def record_samples(session: Session, attempt_id: int, *, fence: int, **measured: Any) -> bool:
    """Store an in-flight attempt's latest and peak measurements (fenced; no state change
    and no event: samples are evidence, written often). False if the fence is stale or
    the attempt is no longer in flight."""
    values = _measured_columns(measured)
    if not values:
        return False
    current_fence = select(Job.fence).where(Job.id == Attempt.job_id).scalar_subquery()
    changed = _rowcount(
        session.execute(
            update(Attempt)
            .where(
                Attempt.id == attempt_id,
                Attempt.fence == fence,
                current_fence == fence,
                Attempt.state.in_([AttemptState.INTENT.value, AttemptState.RUNNING.value]),
            )
            .values(**values)
            .execution_options(synchronize_session=False)
        )
    )
    return changed == 1


def mark_unknown(
    session: Session,
    attempt_id: int,
    *,
    reason: str,
    actor: str,
    now: datetime,
    fence: int | None = None,
) -> None:
    """The attempt's outcome cannot be established: attempt and job become unknown, the
    lease is revoked (fence bumped), and dispatch for the run halts until reconciled.
    The reservation stays held: the process may still be running."""
    attempt = move_attempt(
        session,
        attempt_id,
        (AttemptState.INTENT, AttemptState.RUNNING),
        AttemptState.UNKNOWN,
        now=now,
        actor=actor,
        fence=fence,
        values={"state_reason": reason},
        event_detail={"reason": reason},
    )
    move_job(
        session,
        attempt.job_id,
        JobState.RUNNING,
        JobState.UNKNOWN,
        now=now,
        actor=actor,
        reason=reason,
        bump_fence=True,
    )
    session.execute(
        update(Lease)
        .where(Lease.attempt_id == attempt_id, Lease.released_at.is_(None))
        .values(released_at=now)
    )


def _release(session: Session, attempt_id: int, *, now: datetime) -> None:
    session.execute(
        update(Lease)
        .where(Lease.attempt_id == attempt_id, Lease.released_at.is_(None))
        .values(released_at=now)
    )
    session.execute(
        update(Reservation)
        .where(Reservation.attempt_id == attempt_id, Reservation.released_at.is_(None))
        .values(released_at=now)
    )


# ---------------------------------------------------------------------- controller


def promote_item(session: Session, item_id: int, *, now: datetime, actor: str) -> int:
    """Move the item's waiting jobs to ready when every need succeeded, or to skipped
    (with the reason) when a need ended without success. Returns how many moved."""
    jobs = session.scalars(
        select(Job).where(Job.item_id == item_id).execution_options(populate_existing=True)
    ).all()
    if not any(job.state == JobState.WAITING.value for job in jobs):
        return 0
    states = {job.stage: JobState(job.state) for job in jobs}
    run = session.get(Run, jobs[0].run_id)
    assert run is not None
    config = run_config(run)
    moved = 0
    for job in sorted(jobs, key=lambda j: j.stage_position):
        if states[job.stage] is not JobState.WAITING:
            continue
        needs = {need: states[need] for need in config.stage(job.stage).needs}
        blocked = [
            f"{need} {state.value}"
            for need, state in needs.items()
            if state in TERMINAL_JOB_STATES and state is not JobState.SUCCEEDED
        ]
        if blocked:
            target = JobState.SKIPPED
            reason: str | None = "needed stage did not succeed: " + ", ".join(blocked)
        elif all(state is JobState.SUCCEEDED for state in needs.values()):
            target, reason = JobState.READY, None
        else:
            continue
        move_job(
            session,
            job.id,
            JobState.WAITING,
            target,
            now=now,
            actor=actor,
            reason=reason,
            run_id=run.id,
        )
        states[job.stage] = target  # a skip cascades to later stages in this pass
        moved += 1
    return moved


def promote_run(session: Session, run_id: int, *, now: datetime, actor: str) -> int:
    """``promote_item`` for every item of the run that still has waiting jobs."""
    item_ids = session.scalars(
        select(Job.item_id)
        .where(Job.run_id == run_id, Job.state == JobState.WAITING.value)
        .distinct()
    ).all()
    return sum(promote_item(session, item_id, now=now, actor=actor) for item_id in item_ids)


def close_run_if_done(session: Session, run_id: int, *, now: datetime, actor: str) -> bool:
    """Active -> finished when every job of the run is terminal. Returns True if closed."""
    open_jobs = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.run_id == run_id, Job.state.not_in([s.value for s in TERMINAL_JOB_STATES]))
    )
    if open_jobs:
        return False
    changed = _rowcount(
        session.execute(
            update(Run)
            .where(Run.id == run_id, Run.state == RunState.ACTIVE.value)
            .values(state=RunState.FINISHED.value, finished_at=now)
        )
    )
    if changed != 1:
        return False
    counts = dict(
        session.execute(
            select(Job.state, func.count()).where(Job.run_id == run_id).group_by(Job.state)
        ).all()
    )
    append_event(session, "run_finished", actor=actor, now=now, run_id=run_id, jobs=counts)
    return True


def active_run_ids(session: Session) -> list[int]:
    return list(session.scalars(select(Run.id).where(Run.state == RunState.ACTIVE.value)))


# ------------------------------------------------------------------------ controls


def set_control(
    session: Session,
    kind: ControlKind,
    *,
    scope: ControlScope,
    reason: str,
    actor: str,
    now: datetime,
    run_id: int | None = None,
    lane: str | None = None,
) -> int:
    """Set a pause, stop or halt; it stays until cleared (``clear_controls``)."""
    control = Control(
        kind=kind.value,
        scope=scope.value,
        run_id=run_id,
        lane=lane,
        reason=reason,
        set_by=actor,
        set_at=now,
    )
    session.add(control)
    session.flush()
    append_event(
        session,
        f"control_{kind.value}",
        actor=actor,
        now=now,
        run_id=run_id,
        scope=scope.value,
        lane=lane,
        reason=reason,
        control_id=control.id,
    )
    return control.id


def clear_controls(
    session: Session,
    kinds: tuple[ControlKind, ...],
    *,
    reason: str,
    actor: str,
    now: datetime,
    run_id: int | None = None,
) -> int:
    """Clear active controls of ``kinds`` on a run (or global ones when run_id is None).
    Returns how many were cleared; each clear is an event with who and why."""
    scope_match = Control.run_id.is_(None) if run_id is None else Control.run_id == run_id
    rows = session.scalars(
        select(Control).where(
            Control.cleared_at.is_(None),
            Control.kind.in_([k.value for k in kinds]),
            scope_match,
        )
    ).all()
    for control in rows:
        changed = _rowcount(
            session.execute(
                update(Control)
                .where(and_(Control.id == control.id, Control.cleared_at.is_(None)))
                .values(cleared_at=now, cleared_by=actor, clear_reason=reason)
            )
        )
        if changed == 1:
            append_event(
                session,
                f"control_{control.kind}_cleared",
                actor=actor,
                now=now,
                run_id=control.run_id,
                control_id=control.id,
                reason=reason,
            )
    return len(rows)


# ------------------------------------------------------------- crash recovery


def expire_leases(session: Session, *, now: datetime, actor: str, settle: Any = None) -> list[int]:
    """Leases past ``expires_at`` (on the ledger's clock): their holder stopped renewing
    them. Each attempt is settled from its exit record when ``settle(session, attempt,
    now)`` can
    establish the outcome (returns True), else marked unknown: the process may still be
    running. Returns the attempt ids handled."""
    rows = session.execute(
        select(Lease.id, Lease.attempt_id, Lease.worker_id, Lease.expires_at, Lease.fence)
        .join(Attempt, Attempt.id == Lease.attempt_id)
        .where(
            Lease.released_at.is_(None),
            Lease.expires_at < now,
            Attempt.state.in_([AttemptState.INTENT.value, AttemptState.RUNNING.value]),
        )
        .order_by(Lease.id)
    ).all()
    handled = []
    for row in rows:
        attempt = session.get(Attempt, row.attempt_id, populate_existing=True)
        assert attempt is not None
        if settle is not None and settle(session, attempt, now):
            handled.append(row.attempt_id)
            continue
        mark_unknown(
            session,
            row.attempt_id,
            reason=(
                f"lease expired at {row.expires_at:%Y-%m-%d %H:%M:%S} UTC: worker "
                f"{row.worker_id} stopped renewing it and no exit record settles the "
                "attempt; the process may still be running"
            ),
            actor=actor,
            now=now,
            fence=row.fence,
        )
        handled.append(row.attempt_id)
    return handled


def mark_lost_workers(
    session: Session, *, now: datetime, lost_after: float, actor: str
) -> list[str]:
    """Active workers whose heartbeat is older than ``lost_after`` seconds become lost.
    Their leases are left to expire (``expire_leases``) rather than revoked here."""
    cutoff = now - timedelta(seconds=lost_after)
    lost = list(
        session.scalars(
            select(Worker.id).where(
                Worker.state == WorkerState.ACTIVE.value, Worker.heartbeat_at < cutoff
            )
        )
    )
    for worker_id in lost:
        mark_worker_lost(session, worker_id, now=now, actor=actor, reason="heartbeat stopped")
    return lost


def mark_worker_lost(
    session: Session, worker_id: str, *, now: datetime, actor: str, reason: str
) -> bool:
    """Active -> lost (compare-and-set). Returns False if it was no longer active."""
    changed = _rowcount(
        session.execute(
            update(Worker)
            .where(Worker.id == worker_id, Worker.state == WorkerState.ACTIVE.value)
            .values(state=WorkerState.LOST.value, stopped_at=now)
        )
    )
    if changed:
        append_event(session, "worker_lost", actor=actor, now=now, worker=worker_id, reason=reason)
    return bool(changed)


def active_workers(session: Session, *, node: str) -> list[Worker]:
    return list(
        session.scalars(
            select(Worker).where(Worker.node == node, Worker.state == WorkerState.ACTIVE.value)
        )
    )


def orphaned_attempts(session: Session, *, node: str, worker_id: str) -> list[Attempt]:
    """In-flight attempts on ``node`` held by another worker that is not active: what a
    (re)starting worker must reconcile before it leases anything."""
    return list(
        session.scalars(
            select(Attempt)
            .join(Worker, Worker.id == Attempt.worker_id)
            .where(
                Attempt.node == node,
                Attempt.worker_id != worker_id,
                Attempt.state.in_([AttemptState.INTENT.value, AttemptState.RUNNING.value]),
                Worker.state != WorkerState.ACTIVE.value,
            )
            .order_by(Attempt.id)
        )
    )


def adopt_attempt(
    session: Session,
    attempt_id: int,
    *,
    old_fence: int,
    worker_id: str,
    now: datetime,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
) -> int:
    """A restarted worker takes over an in-flight attempt whose supervisor still lives.

    The job's fence is bumped (the old holder, should it return, is now stale), the old
    lease released and a new one granted to ``worker_id``. Returns the new fence.
    """
    attempt = session.get(Attempt, attempt_id, populate_existing=True)
    if attempt is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    new_fence = old_fence + 1
    changed = _rowcount(
        session.execute(
            update(Job)
            .where(
                Job.id == attempt.job_id,
                Job.fence == old_fence,
                Job.state == JobState.RUNNING.value,
            )
            .values(fence=new_fence, updated_at=now)
            .execution_options(synchronize_session=False)
        )
    )
    if changed != 1:
        raise StaleLease(f"attempt {attempt_id}: fence {old_fence} is stale; cannot adopt it")
    moved = _rowcount(
        session.execute(
            update(Attempt)
            .where(
                Attempt.id == attempt_id,
                Attempt.fence == old_fence,
                Attempt.state.in_([AttemptState.INTENT.value, AttemptState.RUNNING.value]),
            )
            .values(fence=new_fence, worker_id=worker_id)
            .execution_options(synchronize_session=False)
        )
    )
    if moved != 1:
        raise StaleLease(f"attempt {attempt_id}: no longer in flight at fence {old_fence}")
    session.execute(
        update(Lease)
        .where(Lease.attempt_id == attempt_id, Lease.released_at.is_(None))
        .values(released_at=now)
    )
    session.add(
        Lease(
            job_id=attempt.job_id,
            attempt_id=attempt_id,
            worker_id=worker_id,
            fence=new_fence,
            granted_at=now,
            expires_at=now + timedelta(seconds=lease_seconds),
        )
    )
    append_event(
        session,
        "attempt_adopted",
        actor=worker_id,
        now=now,
        run_id=attempt.run_id,
        job_id=attempt.job_id,
        attempt_id=attempt_id,
        previous_worker=attempt.worker_id,
        fence=new_fence,
    )
    return new_fence


# ------------------------------------------------------------ operator commands

RECONCILE_AS = {
    "succeeded": (Outcome.SUCCEEDED, JobState.SUCCEEDED),
    "failed": (Outcome.FAILED, JobState.FAILED),
    "not-run": (Outcome.NOT_RUN, JobState.READY),
}
"""What an operator may say of an unknown attempt, and where its job goes: a job whose
attempt did not run becomes ready for a new attempt (with a new idempotency key)."""


def reconcile_attempt(
    session: Session,
    attempt_id: int,
    *,
    verdict: str,
    reason: str,
    actor: str,
    now: datetime,
    result: dict[str, Any] | None = None,
) -> JobState:
    """Settle an unknown attempt as the operator says (compare-and-set: of two concurrent
    reconciles exactly one wins; the other gets IllegalTransition). Releases its
    reservation. Once a run has no unknown attempt left, its dispatch resumes by itself;
    halts set by operators stay. Returns the job's new state."""
    if verdict not in RECONCILE_AS:
        raise IllegalTransition(
            f"cannot reconcile as {verdict!r}; use one of {', '.join(RECONCILE_AS)}"
        )
    outcome, job_state = RECONCILE_AS[verdict]
    attempt = move_attempt(
        session,
        attempt_id,
        AttemptState.UNKNOWN,
        AttemptState.SETTLED,
        now=now,
        actor=actor,
        values={
            "outcome": outcome.value,
            "settled_at": now,
            "state_reason": f"reconciled by {actor}: {reason}",
            **({"result": result} if result is not None else {}),
        },
        event_detail={"reconciled_as": verdict, "reason": reason, "outcome": outcome.value},
    )
    move_job(
        session,
        attempt.job_id,
        JobState.UNKNOWN,
        job_state,
        now=now,
        actor=actor,
        reason=f"attempt {attempt.number} reconciled as {verdict}: {reason}",
        run_id=attempt.run_id,
    )
    _release(session, attempt_id, now=now)
    job = session.get(Job, attempt.job_id, populate_existing=True)
    assert job is not None
    promote_item(session, job.item_id, now=now, actor=actor)
    return job_state


def retry_job(session: Session, job_id: int, *, reason: str, actor: str, now: datetime) -> int:
    """An operator's explicit retry of a failed job: it becomes ready for a new attempt
    (new idempotency key). Downstream jobs of the item that were skipped because of it
    wait again, and a finished run is reopened. Returns how many jobs moved."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"job {job_id} is not in the ledger")
    move_job(
        session,
        job_id,
        JobState.FAILED,
        JobState.READY,
        now=now,
        actor=actor,
        reason=f"retry by {actor}: {reason}",
        run_id=job.run_id,
    )
    moved = 1
    run = session.get(Run, job.run_id)
    assert run is not None
    config = run_config(run)
    retried = {job.stage}
    for later in session.scalars(
        select(Job)
        .where(Job.item_id == job.item_id, Job.stage_position > job.stage_position)
        .order_by(Job.stage_position)
        .execution_options(populate_existing=True)
    ):
        if later.state == JobState.SKIPPED.value and retried & set(config.stage(later.stage).needs):
            move_job(
                session,
                later.id,
                JobState.SKIPPED,
                JobState.WAITING,
                now=now,
                actor=actor,
                reason=f"upstream {job.stage} retried",
                run_id=job.run_id,
            )
            retried.add(later.stage)
            moved += 1
    reopened = _rowcount(
        session.execute(
            update(Run)
            .where(Run.id == job.run_id, Run.state == RunState.FINISHED.value)
            .values(state=RunState.ACTIVE.value, finished_at=None)
        )
    )
    if reopened:
        append_event(
            session,
            "run_reopened",
            actor=actor,
            now=now,
            run_id=job.run_id,
            reason=f"retry of job {job_id}",
        )
    append_event(
        session, "job_retry", actor=actor, now=now, run_id=job.run_id, job_id=job_id, reason=reason
    )
    return moved


def get_attempt(session: Session, attempt_id: int) -> Attempt:
    attempt = session.get(Attempt, attempt_id)
    if attempt is None:
        raise NotFound(f"attempt {attempt_id} is not in the ledger; `laneway status` lists them")
    return attempt


def request_cancel(
    session: Session, attempt_id: int, *, reason: str, actor: str, now: datetime
) -> Attempt:
    """Record an operator's cancel of a running attempt (the caller then sends TERM to its
    supervisor, which stops the group and reports ``stopped``; its settle says
    ``cancelled``). Raises IllegalTransition unless the attempt is running."""
    attempt = get_attempt(session, attempt_id)
    if attempt.state != AttemptState.RUNNING.value:
        raise IllegalTransition(
            f"attempt {attempt_id} is {attempt.state}; only a running attempt can be cancelled"
        )
    append_event(
        session,
        "cancel_requested",
        actor=actor,
        now=now,
        run_id=attempt.run_id,
        job_id=attempt.job_id,
        attempt_id=attempt_id,
        reason=reason,
    )
    return attempt


def cancel_pending(session: Session, run_id: int, *, reason: str, actor: str, now: datetime) -> int:
    """Cancel every waiting or ready job of a run (nothing of them has started)."""
    moved = 0
    for job_id, state in session.execute(
        select(Job.id, Job.state).where(
            Job.run_id == run_id, Job.state.in_([JobState.WAITING.value, JobState.READY.value])
        )
    ).all():
        move_job(
            session,
            job_id,
            JobState(state),
            JobState.CANCELLED,
            now=now,
            actor=actor,
            reason=f"cancelled by {actor}: {reason}",
            run_id=run_id,
        )
        moved += 1
    return moved


def running_attempts(session: Session, run_id: int) -> list[Attempt]:
    return list(
        session.scalars(
            select(Attempt).where(
                Attempt.run_id == run_id, Attempt.state == AttemptState.RUNNING.value
            )
        )
    )


def record_capture(
    session: Session,
    attempt_id: int,
    *,
    info: dict[str, Any] | None,
    error: str | None,
    actor: str,
    now: datetime,
) -> None:
    """Record a failure capture (archive path, sha256, sizes) or why it failed, as an
    event of the settled attempt. It never changes the attempt's outcome."""
    attempt = get_attempt(session, attempt_id)
    if error is None:
        append_event(
            session,
            "capture_recorded",
            actor=actor,
            now=now,
            run_id=attempt.run_id,
            job_id=attempt.job_id,
            attempt_id=attempt_id,
            **(info or {}),
        )
    else:
        append_event(
            session,
            "capture_failed",
            actor=actor,
            now=now,
            run_id=attempt.run_id,
            job_id=attempt.job_id,
            attempt_id=attempt_id,
            error=error,
        )


def closeout_candidates(session: Session) -> list[Run]:
    """Runs whose closeout may be due: those with steps, not yet marked finished."""
    done = select(Event.run_id).where(Event.kind == "closeout_finished")
    stopped = select(Control.run_id).where(
        Control.kind == ControlKind.STOP.value, Control.cleared_at.is_(None)
    )
    query = (
        select(Run)
        .where(Run.id.not_in(done))
        .where((Run.state == RunState.FINISHED.value) | Run.id.in_(stopped))
        .order_by(Run.id)
    )
    return [run for run in session.scalars(query) if run_config(run).closeout]
