"""Claim: lease admissible jobs and commit their intents (invariant 1).

One write transaction per claim, for all of the worker's free slots at once: build the
admission snapshot (``controller.ledger.snapshot``), ask ``admission.admit``, then move
every job to start to running with a new fence (one statement), insert their attempts
(the intents, each with a fresh idempotency key; one statement), their leases and their
reservations (one each), and record the decisions. The caller commits before anything
is spawned.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from laneway.controller import admission, db, launch, usage
from laneway.controller.config import TemplateError
from laneway.controller.errors import IllegalTransition
from laneway.controller.ledger import artifacts as artifact_ledger
from laneway.controller.ledger import selection, statements
from laneway.controller.ledger import usage as usage_ledger
from laneway.controller.ledger.controls import pause_run, set_control
from laneway.controller.ledger.snapshot import RunInfo, admission_snapshot, stopping
from laneway.controller.ledger.transitions import append_events, event_row, start_jobs
from laneway.controller.states import (
    AttemptState,
    ControlKind,
    ControlScope,
    EventKind,
    Verdict,
)

DEFAULT_LEASE_SECONDS = 60.0


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
    pass_env: list[str] = field(default_factory=list)
    """Worker variables the job gets as they are (redacted like secrets)."""
    render_error: str | None = None
    """Why the command could not be rendered safely: the worker settles the attempt as a
    harness failure without starting anything."""
    inputs: list[dict[str, Any]] = field(default_factory=list)
    """Artifacts of the stages it needs (id, stage, name, sha256, size_bytes, location),
    recorded with the intent: fetched and verified under ``inputs/`` before it starts."""
    input_problems: list[str] = field(default_factory=list)
    """Needed outputs that were never recorded: nothing is started (harness failure)."""
    outputs: list[str] = field(default_factory=list)
    """The stage's declared outputs, stored when an attempt would succeed."""
    artifact_store: str = ""
    """Where its outputs are stored: the run's ``artifact_store`` URL or the worker's
    default store (``launch.artifact_store_url``)."""
    gpu_devices: list[dict[str, Any]] = field(default_factory=list)
    """The GPUs admission gave it (index, uuid, whole): its ``CUDA_VISIBLE_DEVICES``."""


PortPicker = Callable[[int, set[int]], list[int]]


def claim_jobs(
    session: Session,
    *,
    worker_id: str,
    node: str,
    free_slots: int,
    mem_available_mib: float | None,
    now: datetime,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    candidate_limit: int | None = None,
    check_sources: Callable[[RunInfo], list[str]] | None = None,
    source_problems: dict[int, list[str]] | None = None,
    pick_ports: PortPicker | None = None,
    seen: dict[str, Any] | None = None,
    runtime_dir: str | None = None,
    missing_secrets: dict[tuple[int, str], list[str]] | None = None,
    lacking_for: Callable[[RunInfo], dict[str, list[str]]] | None = None,
) -> list[Claim]:
    """Lease admissible jobs for up to ``free_slots`` and write their intents.

    ``missing_secrets`` ((run, stage) -> variables): what this worker's environment lacks
    to start a stage's jobs, found before the transaction; such jobs are refused
    (``secret_missing``), not claimed. ``lacking_for(run)`` (stage -> variables) says
    the same per run, asked here for each run with candidates.

    ``runtime_dir``: where this worker keeps attempt directories (its own machine's
    runtime dir); default: the run's, as recorded when it was created.

    ``pick_ports(n, taken)`` returns ``n`` free ports not in ``taken`` (the ports of the
    node's in-flight attempts); they are recorded on the attempt in this transaction.

    Invariant 12: a run whose frozen source files changed dispatches nothing; the run is
    halted, naming the file and both hashes. ``source_problems`` (run id -> problems) is
    that check done by the caller before the transaction, so no file is hashed under the
    ledger's locks; ``check_sources(run)`` does it here instead, for runs about to dispatch.

    ``seen``, when given, receives ``candidates``: how many ready jobs admission looked
    at (none: only a new event can give this node work, not a change of free memory);
    and ``runs``: run id -> ``RunInfo`` of the runs those jobs belong to (what a worker
    checks before its next claim, ``workers.run_checks``).
    """

    def look() -> tuple[admission.Snapshot, dict[int, tuple[Any, RunInfo]], admission.Admission]:
        snapshot, jobs_by_id = admission_snapshot(
            session,
            node=node,
            free_slots=free_slots,
            mem=mem_available_mib,
            limit=candidate_limit,
            now=now,
        )
        snapshot.missing_secrets = dict(missing_secrets or {})
        if lacking_for is not None:
            for info in {info.id: info for _, info in jobs_by_id.values()}.values():
                for stage, names in lacking_for(info).items():
                    snapshot.missing_secrets[(info.id, stage)] = names
        return snapshot, jobs_by_id, admission.admit(snapshot)

    snapshot, jobs_by_id, verdict = look()
    # In a claim_transaction on PostgreSQL the snapshot was read under the node's lock and
    # the shared gate: a cap that counts other nodes' attempts is decided only from a
    # snapshot read again under the order lock.
    spans = any(_spans_nodes(snapshot, jobs_by_id[c.job_id][1]) for c in verdict.starts)
    if spans and db.order_lock(session):
        snapshot, jobs_by_id, verdict = look()
    decided_in_order = db.holds_order(session)
    if seen is not None:
        seen["candidates"] = len(snapshot.candidates)
        seen["runs"] = {info.id: info for _, info in jobs_by_id.values()}
    if verdict.starts and (check_sources is not None or source_problems):
        drifted = _halt_on_source_drift(
            session,
            {jobs_by_id[c.job_id][1].id: jobs_by_id[c.job_id][1] for c in verdict.starts},
            check_sources,
            source_problems or {},
            now=now,
            actor=worker_id,
        )
        if drifted:
            snapshot.controls += [
                admission.ControlView("halt", "run", run_id, None, "frozen sources changed")
                for run_id in drifted
            ]
            verdict = admission.admit(snapshot)
    claims = []
    # The node's ports in use are read only when a job to start asks for ports.
    wants_ports = any(jobs_by_id[c.job_id][1].config.stage(c.stage).ports for c in verdict.starts)
    taken = _ports_in_use(session, node) if wants_ports else set()
    event_rows: list[dict[str, Any]] = []
    grants = Grants()
    starts = [(candidate, *jobs_by_id[candidate.job_id]) for candidate in verdict.starts]
    # Every job to start moves in one statement, every intent is inserted in one (per
    # row shape), whatever the number of free slots.
    fences = start_jobs(
        session,
        [(job.id, job.attempt_count + 1) for _, job, _ in starts],
        now=now,
        actor=worker_id,
    )
    intents = [
        _intent(
            job,
            run,
            fence=fences[job.id],
            gpu_devices=[
                {"index": d.index, "uuid": d.uuid, "whole": candidate.gpus > 0}
                for d in verdict.devices.get(candidate.job_id, ())
            ],
            pick_ports=pick_ports,
            taken_ports=taken,
            worker_id=worker_id,
            node=node,
            now=now,
            runtime_dir=runtime_dir,
        )
        for candidate, job, run in starts
    ]
    attempt_ids = _insert_intents(session, [intent.row for intent in intents])
    for (candidate, _, _), intent, attempt_id in zip(starts, intents, attempt_ids, strict=True):
        claims.append(
            _grant(
                session,
                intent,
                attempt_id,
                memory_mib=candidate.memory_mib,
                expected_usage=candidate.expected_usage,
                worker_id=worker_id,
                node=node,
                now=now,
                lease_seconds=lease_seconds,
                event_rows=event_rows,
                grants=grants,
                runtime_dir=runtime_dir,
            )
        )
    grants.write(session)
    append_events(session, event_rows)
    # Refusals after dispatches: when a lane dispatched one job and must refuse the next
    # (e.g. its cap is now reached), the refusal is the lane's state from now on.
    dispatched = [
        admission.Refusal(c.run_id, c.lane, c.stage, "", {}, c.job_id)
        for c in verdict.starts
        if c.job_id not in verdict.choices
    ]
    selection.record_choices(
        session,
        [(c, verdict.choices[c.job_id]) for c in verdict.starts if c.job_id in verdict.choices],
        node=node,
        worker_id=worker_id,
        now=now,
    )
    record_decisions(
        session,
        [(r, Verdict.DISPATCHED) for r in dispatched]
        + [(r, Verdict.REFUSED) for r in verdict.refusals],
        node=node,
        worker_id=worker_id,
        now=now,
    )
    _pause_when_nothing_fits(session, snapshot, verdict, now=now, actor=worker_id)
    if verdict.starts and not decided_in_order:
        _still_unstopped(session, snapshot, verdict, jobs_by_id)
    return claims


class ClaimRaced(Exception):
    """Between a claim's snapshot and its order lock another worker committed a control
    or an unknown outcome that stops a run the claim started a job of: the claim's
    transaction rolls back, and the worker's next claim looks again."""


def _still_unstopped(
    session: Session,
    snapshot: admission.Snapshot,
    verdict: admission.Admission,
    jobs_by_id: dict[int, tuple[Any, RunInfo]],
) -> None:
    """Raise ClaimRaced unless the controls and unknown outcomes read now, under the
    order lock, still let every job this claim started go. The snapshot was read under
    the node's lock and the shared gate only (``db.claim_transaction``): its own slots,
    memory, GPUs and ports, and the ready jobs it locked (SKIP LOCKED), are still as
    read, and the operator's controls cannot change beside it (they take the gate
    alone). Other workers' controls (a breaker, a spent budget) and unknown outcomes
    can: they are written under the order lock, so one committed before this claim took
    it is read here, and one committed later comes after this claim."""
    db.order_lock(session)
    runs = {info.id: info for _, info in jobs_by_id.values()}
    controls, unknown_runs, everywhere = stopping(session, runs)
    now_seen = replace(
        snapshot, controls=controls, unknown_runs=unknown_runs, unknown_everywhere=everywhere
    )
    for candidate in verdict.starts:
        code = admission.stopped(now_seen, candidate)
        if code is not None:
            raise ClaimRaced(
                f"job {candidate.job_id} was claimed as its run became {code}: claimed again"
            )


def _spans_nodes(snapshot: admission.Snapshot, run: RunInfo) -> bool:
    """Does one of the run's caps count attempts that other nodes start?"""
    config = run.config
    if config.limits or any(r == run.id for r, _ in snapshot.budgets):
        return True
    if any(stage.cap is not None for stage in config.stages):
        return True
    placed = any(stage.nodes for stage in config.stages)
    return placed and any(caps for (r, _), caps in snapshot.lane_caps.items() if r == run.id)


def _pause_when_nothing_fits(
    session: Session,
    snapshot: admission.Snapshot,
    verdict: admission.Admission,
    *,
    now: datetime,
    actor: str,
) -> None:
    """Pause a run, with the arithmetic as its reason, once its budget leaves nothing
    more to start: this claim refused all of its candidates for ``budget``, started
    none and none of its attempts is running (those are never interrupted; their
    settles give back what they held and may leave room)."""
    started = {c.run_id for c in verdict.starts}
    by_run: dict[int, list[admission.Refusal]] = {}
    for refusal in verdict.refusals:
        by_run.setdefault(refusal.run_id, []).append(refusal)
    for run_id, refusals in sorted(by_run.items()):
        if run_id in started or any(r.code != "budget" for r in refusals):
            continue
        if any(n for (r, _), n in snapshot.running_stage.items() if r == run_id):
            continue
        pause_run(
            session,
            run_id,
            reason=f"{usage.BUDGET_SPENT}: {refusals[0].words()}",
            actor=actor,
            now=now,
        )


def _ports_in_use(session: Session, node: str) -> set[int]:
    """Ports held by the node's in-flight (and unknown) attempts."""
    used: set[int] = set()
    for ports in session.execute(statements.NODE_PORTS, {"node": node}).scalars():
        used.update(int(port) for port in ports or [])
    return used


def _halt_on_source_drift(
    session: Session,
    runs: dict[int, RunInfo],
    check_sources: Callable[[RunInfo], list[str]] | None,
    known: dict[int, list[str]],
    *,
    now: datetime,
    actor: str,
) -> set[int]:
    """Halt every run about to dispatch whose frozen sources changed; their ids."""
    drifted: set[int] = set()
    for _, run in sorted(runs.items()):
        problems = known.get(run.id) or (check_sources(run) if check_sources else [])
        if problems:
            set_control(
                session,
                ControlKind.HALT,
                scope=ControlScope.RUN,
                run_id=run.id,
                reason="frozen sources changed: " + "; ".join(problems),
                actor=actor,
                now=now,
            )
            drifted.add(run.id)
    return drifted


@dataclass
class Grants:
    """The leases and reservations of one claim's grants, written together after them
    (in the same transaction as their intents): one statement per table for the whole
    claim, not one per grant."""

    leases: list[dict[str, Any]] = field(default_factory=list)
    reservations: list[dict[str, Any]] = field(default_factory=list)

    def write(self, session: Session) -> None:
        if self.leases:
            session.execute(statements.INSERT_LEASE, self.leases)
        # A reservation no budget covers leaves ``usage`` out (SQL NULL, not JSON null),
        # and one statement takes rows of one shape: at most two statements.
        budgeted = [row for row in self.reservations if "usage" in row]
        unbudgeted = [row for row in self.reservations if "usage" not in row]
        for rows in (budgeted, unbudgeted):
            if rows:
                session.execute(statements.INSERT_RESERVATION, rows)


@dataclass(frozen=True)
class _Intent:
    """One job to start, rendered before its intent row is inserted."""

    job: Any
    run: RunInfo
    stage: Any
    number: int
    fence: int
    directory: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    render_error: str | None
    key: str
    ports: list[int] | None
    gpu_devices: list[dict[str, Any]]
    row: dict[str, Any]


def _intent(
    job: Any,
    run: RunInfo,
    *,
    fence: int,
    gpu_devices: list[dict[str, Any]],
    pick_ports: PortPicker | None,
    taken_ports: set[int],
    worker_id: str,
    node: str,
    now: datetime,
    runtime_dir: str | None,
) -> _Intent:
    """Render a job's command and build its intent row (its attempt, number
    ``attempt_count + 1``, under the fence the job's move just gave it)."""
    stage = run.config.stage(job.stage)
    number = job.attempt_count + 1
    directory = launch.attempt_dir(
        runtime_dir or run.runtime_dir, run.id, job.item_key, job.stage, number
    )
    render_error: str | None = None
    try:
        argv, env, cwd = launch.render_command(
            stage,
            launch.item_config(job.item_key, job.item_lane, job.item_fields),
            inputs_root=launch.inputs_dir(directory),
        )
    except TemplateError as exc:
        # Only a run frozen before shell quoting existed can get here (configs are
        # checked when loaded): its intent is written, nothing is started.
        argv, env, cwd = [], {}, None
        render_error = f"its command cannot be rendered safely: {exc}"
    key = f"lw-{run.id}-{job.id}-{number}-{uuid.uuid4().hex[:12]}"
    ports: list[int] | None = None
    if stage.ports:
        if pick_ports is None:
            raise IllegalTransition(f"stage {stage.name} asks for ports; no port picker given")
        ports = pick_ports(stage.ports, taken_ports)
        taken_ports.update(ports)
    devices = {"gpu_devices": gpu_devices} if gpu_devices else {}  # else SQL NULL
    row = {
        **devices,
        "ports": ports,
        "job_id": job.id,
        "run_id": run.id,
        "number": number,
        "idempotency_key": key,
        "state": AttemptState.INTENT,
        "fence": fence,
        "worker_id": worker_id,
        "node": node,
        "stage": job.stage,
        "lane": job.lane,
        "argv_hash": launch.argv_hash(argv, cwd),
        "attempt_dir": directory,
        "intent_at": now,
        "diagnostics": [],
    }
    return _Intent(
        job,
        run,
        stage,
        number,
        fence,
        directory,
        argv,
        env,
        cwd,
        render_error,
        key,
        ports,
        gpu_devices,
        row,
    )


def _insert_intents(session: Session, rows: list[dict[str, Any]]) -> list[int]:
    """Insert the intent rows, one statement per row shape (a row without GPU devices
    leaves the column out: SQL NULL, not JSON null); their ids, in the rows' order."""
    shapes: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        shapes.setdefault(tuple(sorted(row)), []).append(row)
    ids: dict[str, int] = {}
    for shape in shapes.values():
        for attempt_id, key in session.execute(statements.INSERT_ATTEMPT, shape):
            ids[key] = int(attempt_id)
    return [ids[row["idempotency_key"]] for row in rows]


def _grant(
    session: Session,
    intent: _Intent,
    attempt_id: int,
    *,
    memory_mib: float,
    expected_usage: dict[str, float],
    worker_id: str,
    node: str,
    now: datetime,
    lease_seconds: float,
    event_rows: list[dict[str, Any]],
    grants: Grants,
    runtime_dir: str | None = None,
) -> Claim:
    """What goes with an inserted intent: its inputs, lease, reservation, expected
    usage and event; the claim the worker spawns from."""
    job, run, stage, number, fence = (
        intent.job,
        intent.run,
        intent.stage,
        intent.number,
        intent.fence,
    )
    key, ports = intent.key, intent.ports
    needs_outputs = [need for need in stage.needs if run.config.stage(need).outputs]
    inputs, input_problems = artifact_ledger.inputs_for(
        session, job_id=job.id, needs_outputs=needs_outputs
    )
    artifact_ledger.record_inputs(session, attempt_id, inputs, node=node, now=now)
    grants.leases.append(
        {
            "job_id": job.id,
            "attempt_id": attempt_id,
            "worker_id": worker_id,
            "fence": fence,
            "granted_at": now,
            "expires_at": now + timedelta(seconds=lease_seconds),
        }
    )
    reservation: dict[str, Any] = {
        "attempt_id": attempt_id,
        "node": node,
        "memory_mib": math.ceil(memory_mib),
        "gpu_mib": stage.gpu_mib,
        "created_at": now,
    }
    if expected_usage:
        # Left out otherwise: SQL NULL, not JSON null, for a stage no budget covers.
        reservation["usage"] = expected_usage
    grants.reservations.append(reservation)
    usage_ledger.hold_expected(session, run.id, job.stage, expected_usage)
    event_rows.append(
        event_row(
            EventKind.ATTEMPT_INTENT,
            actor=worker_id,
            now=now,
            run_id=run.id,
            job_id=job.id,
            attempt_id=attempt_id,
            number=number,
            fence=fence,
            idempotency_key=key,
        )
    )
    return Claim(
        run_id=run.id,
        job_id=job.id,
        attempt_id=attempt_id,
        number=number,
        fence=fence,
        idempotency_key=key,
        item=job.item_key,
        stage=job.stage,
        lane=job.lane,
        argv=intent.argv,
        env=intent.env,
        cwd=intent.cwd,
        timeout_seconds=stage.timeout_seconds,
        grace_seconds=stage.grace_seconds,
        attempt_dir=intent.directory,
        log_cap_bytes=int(stage.log_cap_mib * 1024 * 1024),
        ports=list(ports or []),
        pass_env=list(stage.pass_env),
        render_error=intent.render_error,
        inputs=inputs,
        input_problems=input_problems,
        outputs=list(stage.outputs),
        artifact_store=launch.artifact_store_url(
            run.config.artifact_store, runtime_dir or run.runtime_dir
        ),
        gpu_devices=intent.gpu_devices,
    )


def record_decisions(
    session: Session,
    verdicts: list[tuple[admission.Refusal, Verdict]],
    *,
    node: str,
    worker_id: str | None,
    now: datetime,
) -> int:
    """Insert a decision for each (run, lane, stage) whose verdict or reason changed
    since its newest decision (invariant 10: one row per change). Returns rows added."""
    if not verdicts:
        return 0
    keys = sorted({(r.run_id, r.lane, r.stage) for r, _ in verdicts}, key=str)
    last: dict[tuple[int, str, str | None], tuple[str, str | None]] = {}
    for chunk in statements.chunks(keys):
        for row in session.execute(statements.last_decisions(chunk)):
            last[(row.k_run, row.k_lane, row.k_stage)] = (str(row.verdict), row.reason_code)
    rows = []
    for refusal, verdict in verdicts:
        key = (refusal.run_id, refusal.lane, refusal.stage)
        code = refusal.code or None
        if last.get(key) == (verdict.value, code):
            continue
        last[key] = (verdict.value, code)
        rows.append(
            {
                "run_id": refusal.run_id,
                "lane": refusal.lane,
                "stage": refusal.stage,
                "node": node,
                "worker_id": worker_id,
                "verdict": verdict,
                "reason_code": code,
                "detail": refusal.detail,
                "job_id": refusal.job_id,
                "decided_at": now,
            }
        )
    if rows:
        session.execute(statements.INSERT_DECISION, rows)
    return len(rows)
