"""``laneway explain``: everything that blocks one job now, with the capacity arithmetic;
for a failed, cancelled or skipped job its last attempt's evidence (read-only).

Through an ORM session (SQLAlchemy is imported inside the functions, so importing this
module stays cheap); the node and worker looks are ``controller/status_nodes.py``'s.
"""

from __future__ import annotations

import os
import shlex
import signal
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import admission, refusal_words
from laneway.controller.clock import iso
from laneway.controller.codes import RefusalCode
from laneway.controller.errors import NotFound
from laneway.controller.states import AttemptState, JobState

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from laneway.controller.status_model import NextStep


def explain_job(session: Session, job_id: int, *, now: datetime) -> dict[str, Any]:
    """Everything that blocks one job now, with the capacity arithmetic (read-only)."""
    from sqlalchemy import select

    from laneway.controller import ledger
    from laneway.controller.ledger.selection import SELECT_CODE
    from laneway.controller.models import Attempt, Decision, Item, Job, Node
    from laneway.controller.rows import SessionRows
    from laneway.controller.status_nodes import node_has_live_worker, worker_command

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
            entry["why_not"] = [_blocker(RefusalCode.OTHER_NODE, detail)]
        elif name not in live_nodes:
            entry["start"] = worker_command(name, run.runtime_dir)
            if pending:
                entry["why_not"] = [
                    _blocker(RefusalCode.NO_WORKER, _no_worker_detail(entry, job, stage))
                ]
        where.append(entry)
    report["placement"] = {
        "nodes": list(stage.nodes) if stage.nodes else None,
        "lane_node": lane_node,
        "runs_on": runs_on,
        "words": refusal_words.placement_words(stage.nodes),
        "explained_node": node_name,
        "per_node": where,
    }
    if job.group_name is not None:
        # The choice a selection by yield made of it, with the figures it used.
        report["selection"] = session.execute(
            select(Decision.detail)
            .where(Decision.job_id == job.id, Decision.reason_code == SELECT_CODE)
            .order_by(Decision.id.desc())
            .limit(1)
        ).scalar()
    if job.state == JobState.WAITING.value:
        states = dict(
            session.execute(select(Job.stage, Job.state).where(Job.item_id == job.item_id)).all()
        )
        report["blocked_by"] = [
            {
                "code": RefusalCode.NEEDS_PENDING,
                "words": f"needs {need}, which is {states[need]}",
            }
            for need in stage.needs
            if states.get(need) != JobState.SUCCEEDED.value
        ]
    elif job.state == JobState.READY.value and job.retry_after is not None:
        report["blocked_by"] = [
            {
                "code": RefusalCode.RETRY_BACKOFF,
                "words": f"waiting out its stage's retry backoff until {iso(job.retry_after)}; "
                "the controller makes it claimable then",
            }
        ]
    elif job.state == JobState.READY.value:
        report["waits_behind"] = _higher_priority(session, job)
        for entry in where:
            asked = entry["live"] or entry["node"] == node_name
            if not entry["runs_it"] or not asked or session.get(Node, entry["node"]) is None:
                continue
            blocked, arithmetic = _explain_on(session, job, stage, entry["node"], now)
            if entry["live"]:
                entry["why_not"] = blocked
            if entry["node"] == node_name:
                report["blocked_by"] = blocked
                report["arithmetic"] = arithmetic
    elif job.state in (JobState.FAILED.value, JobState.CANCELLED.value, JobState.SKIPPED.value):
        report.update(_settled_evidence(session, job, run))
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
                "gpus": attempt.gpu_devices or [],  # the devices its job was given
            }
    step, concern = _next_step(session, run, job.lane, now=now)
    report["next_step"] = None if step is None else step.as_dict()
    report["run_concern"] = None if concern is None else concern.code
    if concern is None and not live and pending:
        # Said first: until a worker runs on a node that runs it, nothing else matters.
        detail = _no_worker_detail(where[0], job, stage)
        report["blocked_by"].insert(0, _blocker(RefusalCode.NO_WORKER, detail))
    return report


def _next_step(
    session: Session, run: Any, lane: str, *, now: datetime
) -> tuple[NextStep | None, NextStep | None]:
    """The job's next step (its lane's, ``advice.next_step``, the one ``status`` gives
    that lane) and what the run itself needs first (``advice.run_concern``), if anything."""
    from laneway.controller import advice
    from laneway.controller.status import build_status

    status = build_status(session, run, now=now)
    concern = advice.run_concern(status)
    found = next((entry for entry in status.lanes if entry.lane == lane), None)
    step = advice.lane_step(found, status) if found is not None else status.next_step
    return step, concern


def _blocker(code: RefusalCode, detail: dict[str, Any]) -> dict[str, Any]:
    return {"code": code, "detail": detail, "words": refusal_words.describe(code, detail)}


def _no_worker_detail(entry: dict[str, Any], job: Any, stage: Any) -> dict[str, Any]:
    """``no_worker`` for one node; naming the stage's ``nodes`` when it has them."""
    detail: dict[str, Any] = {"node": entry["node"], "start": entry["start"]}
    if stage.nodes:
        detail.update(stage=job.stage, nodes=list(stage.nodes))
    return detail


WAITS_BEHIND_SHOWN = 5


def _higher_priority(session: Session, job: Any) -> dict[str, Any]:
    """The ready jobs of the job's run, lane and stage that a claim takes before it
    because their items' priority is higher (``priority_rank`` lower): how many, and the
    first few as ``ITEM.STAGE`` (one ``ix_jobs_dispatch`` range)."""
    from sqlalchemy import func, select

    from laneway.controller.models import Item, Job

    ahead = (
        Job.run_id == job.run_id,
        Job.state == JobState.READY.value,
        Job.lane == job.lane,
        Job.stage == job.stage,
        Job.priority_rank < job.priority_rank,
    )
    count = session.scalar(select(func.count()).select_from(Job).where(*ahead)) or 0
    first = session.execute(
        select(Item.key, Job.priority_rank)
        .join(Item, Item.id == Job.item_id)
        .where(*ahead)
        .order_by(Job.priority_rank, Job.id)
        .limit(WAITS_BEHIND_SHOWN)
    ).all()
    return {
        "priority": -job.priority_rank,
        "count": count,
        "jobs": [{"job": f"{key}.{job.stage}", "priority": -rank} for key, rank in first],
    }


def _explain_on(
    session: Session, job: Any, stage: Any, node_name: str, now: datetime
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """What blocks a ready ``job`` on ``node_name`` (a node that runs its stage), from the
    snapshot a claim there would build, and the capacity arithmetic."""
    from sqlalchemy import func, select

    from laneway.controller import ledger
    from laneway.controller.models import Attempt, Decision, Node

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
        now=now,
    )
    if not snapshot.candidates:
        return [], None
    candidate = snapshot.candidates[0]
    blocked = [_blocker(code, detail) for code, detail in admission.explain(snapshot, candidate)]
    # What only the node's worker knows (its environment): its newest recorded refusal.
    newest = session.execute(
        select(Decision.reason_code, Decision.detail)
        .where(
            Decision.run_id == job.run_id,
            Decision.lane == job.lane,
            Decision.stage == job.stage,
            Decision.node == node_name,
        )
        .order_by(Decision.id.desc())
        .limit(1)
    ).first()
    if newest is not None and newest.reason_code == RefusalCode.SECRET_MISSING:
        blocked.insert(0, _blocker(RefusalCode.SECRET_MISSING, dict(newest.detail)))
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


def _settled_evidence(session: Session, job: Any, run: Any) -> dict[str, Any]:
    """For a failed, cancelled or skipped job: its last attempt's outcome, exit code or
    signal, directory and the end of its stderr, and the ``laneway retry`` command (for a
    skipped job, the retry of the failed job it needs); when the run's frozen sources
    changed (``source_check.changed_sources``), a retry would halt at its first claim:
    then the new run's command instead, naming the files (``retry["sources_changed"]``)."""
    from sqlalchemy import select

    from laneway.controller import advice
    from laneway.controller.models import Attempt, Job
    from laneway.controller.source_check import changed_sources

    runtime_dir = run.runtime_dir

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
        changes = changed_sources(run.source_hashes or {})
        if changes:
            # Said before anything moves: `laneway retry` refuses the same way.
            body["retry"] = {
                "job_id": target,
                "sources_changed": [change.path for change in changes],
                "command": advice.new_run_command(runtime_dir, run.config_path),
            }
    return body
