"""The status report of a run, read from the ledger (no writes).

``build_status`` returns plain JSON-able data: ``laneway status --json`` prints it, the
controller writes it to ``runs/<run>/status.json``, and ``cli.render`` turns it into text.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller import admission, ledger
from controller.clock import iso
from controller.errors import NotFound
from controller.models import Attempt, Control, Decision, Event, Item, Job, Lane, Node, Run
from controller.states import AttemptState, JobState, Verdict

RECENT_EVENTS = 12


def build_status(session: Session, run: Run, *, now: datetime) -> dict[str, Any]:
    """Everything ``laneway status`` shows for one run."""
    config = ledger.run_config(run)
    stage_order = [stage.name for stage in config.stages]
    jobs: dict[str, dict[str, int]] = {name: {} for name in stage_order}
    for stage, state, count in session.execute(
        select(Job.stage, Job.state, func.count())
        .where(Job.run_id == run.id)
        .group_by(Job.stage, Job.state)
    ):
        jobs.setdefault(stage, {})[state] = count
    totals: dict[str, int] = {}
    for by_state in jobs.values():
        for state, count in by_state.items():
            totals[state] = totals.get(state, 0) + count

    outcomes: dict[str, dict[str, int]] = {name: {} for name in stage_order}
    for stage, outcome, count in session.execute(
        select(Job.stage, Attempt.outcome, func.count())
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.run_id == run.id, Attempt.state == AttemptState.SETTLED.value)
        .group_by(Job.stage, Attempt.outcome)
    ):
        outcomes.setdefault(stage, {})[str(outcome)] = count

    running = []
    for attempt, job, item in session.execute(
        select(Attempt, Job, Item)
        .join(Job, Job.id == Attempt.job_id)
        .join(Item, Item.id == Job.item_id)
        .where(
            Attempt.run_id == run.id,
            Attempt.state.in_([AttemptState.INTENT.value, AttemptState.RUNNING.value]),
        )
        .order_by(Attempt.id)
    ):
        begun = attempt.started_at or attempt.intent_at
        running.append(
            {
                "attempt_id": attempt.id,
                "job_id": job.id,
                "item": item.key,
                "stage": job.stage,
                "lane": job.lane,
                "node": attempt.node,
                "state": attempt.state,
                "pid": attempt.child_pid,
                "elapsed_seconds": round((now - begun).total_seconds(), 1),
                "timeout_seconds": config.stage(job.stage).timeout_seconds,
                "peak_rss_mib": attempt.peak_rss_mib,
            }
        )

    unknown = [
        {
            "attempt_id": attempt.id,
            "job_id": job.id,
            "item": item.key,
            "stage": job.stage,
            "reason": attempt.state_reason,
            "evidence": attempt.attempt_dir,
            "reconcile": (
                f"laneway reconcile {attempt.id} --as succeeded|failed|not-run --reason '...'"
                f" --runtime-dir {run.runtime_dir}"
            ),
        }
        for attempt, job, item in session.execute(
            select(Attempt, Job, Item)
            .join(Job, Job.id == Attempt.job_id)
            .join(Item, Item.id == Job.item_id)
            .where(Attempt.run_id == run.id, Attempt.state == AttemptState.UNKNOWN.value)
            .order_by(Attempt.id)
        )
    ]

    controls = [
        {
            "id": control.id,
            "kind": control.kind,
            "scope": control.scope,
            "lane": control.lane,
            "reason": control.reason,
            "set_by": control.set_by,
            "set_at": iso(control.set_at),
        }
        for control in session.scalars(
            select(Control)
            .where(
                Control.cleared_at.is_(None),
                (Control.run_id == run.id) | Control.run_id.is_(None),
            )
            .order_by(Control.id)
        )
    ]

    settled_count = sum(sum(by.values()) for by in outcomes.values())
    end = run.finished_at or now
    hours = max((end - run.created_at).total_seconds() / 3600, 1e-9)
    events = [
        {
            "id": event.id,
            "at": iso(event.at),
            "kind": event.kind,
            "job_id": event.job_id,
            "attempt_id": event.attempt_id,
            "actor": event.actor,
            "detail": event.detail,
        }
        for event in reversed(
            session.scalars(
                select(Event)
                .where(Event.run_id == run.id)
                .order_by(Event.id.desc())
                .limit(RECENT_EVENTS)
            ).all()
        )
    ]
    return {
        "run": {
            "id": run.id,
            "name": run.name,
            "state": run.state,
            "created_at": iso(run.created_at),
            "finished_at": iso(run.finished_at),
            "config_sha256": run.config_sha256,
            "runtime_dir": run.runtime_dir,
        },
        "generated_at": iso(now),
        "controls": controls,
        "unknown": unknown,
        "jobs": jobs,
        "totals": totals,
        "outcomes": outcomes,
        "running": running,
        "lanes": _lanes(session, run, now=now),
        "throughput": {
            "settled_attempts": settled_count,
            "per_hour": round(settled_count / hours, 1),
        },
        "recent_events": events,
    }


def _lanes(session: Session, run: Run, *, now: datetime) -> list[dict[str, Any]]:
    lanes = []
    for lane in session.scalars(select(Lane).where(Lane.run_id == run.id).order_by(Lane.name)):
        counts = dict(
            session.execute(
                select(Job.state, func.count())
                .where(Job.run_id == run.id, Job.lane == lane.name)
                .group_by(Job.state)
            ).all()
        )
        last_start = session.scalar(
            select(func.max(Attempt.started_at))
            .join(Job, Job.id == Attempt.job_id)
            .where(Job.run_id == run.id, Job.lane == lane.name)
        )
        last_end = session.scalar(
            select(func.max(Attempt.settled_at))
            .join(Job, Job.id == Attempt.job_id)
            .where(Job.run_id == run.id, Job.lane == lane.name)
        )
        running = counts.get(JobState.RUNNING.value, 0)
        pending = counts.get(JobState.READY.value, 0) + counts.get(JobState.WAITING.value, 0)
        reason = None
        if running == 0 and pending and run.state != "finished":
            reason = _current_refusal(session, run.id, lane.name)
        idle_since = None
        if running == 0 and pending:
            idle_since = last_end or run.created_at
        lanes.append(
            {
                "lane": lane.name,
                "node": lane.node,
                "running": running,
                "ready": counts.get(JobState.READY.value, 0),
                "waiting": counts.get(JobState.WAITING.value, 0),
                "done": sum(
                    count
                    for state, count in counts.items()
                    if state
                    not in (
                        JobState.RUNNING.value,
                        JobState.READY.value,
                        JobState.WAITING.value,
                        JobState.UNKNOWN.value,
                    )
                ),
                "last_start": iso(last_start),
                "idle_since": iso(idle_since),
                "idle_seconds": (
                    round((now - idle_since).total_seconds(), 1) if idle_since else None
                ),
                "reason": reason,
            }
        )
    return lanes


def _current_refusal(session: Session, run_id: int, lane: str) -> dict[str, Any] | None:
    """The newest recorded refusal for the lane, if no dispatch came after it."""
    decision = session.scalars(
        select(Decision)
        .where(Decision.run_id == run_id, Decision.lane == lane)
        .order_by(Decision.id.desc())
        .limit(1)
    ).first()
    if decision is None or decision.verdict != Verdict.REFUSED.value:
        return None
    code = decision.reason_code or "refused"
    return {
        "code": code,
        "stage": decision.stage,
        "since": iso(decision.decided_at),
        "detail": decision.detail,
        "words": admission.describe(code, decision.detail),
    }


def explain_job(session: Session, job_id: int, *, now: datetime) -> dict[str, Any]:
    """Everything that blocks one job now, with the capacity arithmetic (read-only)."""
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
        "blocked_by": [],
        "arithmetic": None,
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
    elif job.state == JobState.READY.value:
        lane = config.lane(job.lane)
        node = session.get(Node, lane.node)
        assert node is not None
        running = (
            session.scalar(
                select(func.count())
                .select_from(Attempt)
                .where(
                    Attempt.node == lane.node,
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
            node=lane.node,
            free_slots=max(0, node.max_jobs - running),
            mem=node.mem_available_mib,
            limit=1,
            lock=False,
            job_id=job.id,
        )
        if snapshot.candidates:
            candidate = snapshot.candidates[0]
            report["blocked_by"] = [
                {"code": code, "detail": detail, "words": admission.describe(code, detail)}
                for code, detail in admission.explain(snapshot, candidate)
            ]
            peak = ledger.stage_peaks(session, [run.id]).get((run.id, job.stage), (None, None))
            free = node.mem_available_mib
            report["arithmetic"] = {
                "node": lane.node,
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
                        free
                        - snapshot.node.reserved_mib
                        - candidate.memory_mib
                        - node.memory_floor_mib
                    )
                ),
                "gpu_peak_mib": candidate.gpu_peak_mib,
                "running_on_node": running,
                "max_jobs": node.max_jobs,
            }
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
    return report
