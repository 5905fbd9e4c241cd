"""The run report: per lane, where the hours went (read-only over the ledger).

For each lane: attempts, start intervals, the share of the run's window with nothing of
the lane running, throughput per hour, stage duration percentiles, queue wait (ready to
intent), failures by class, and idle periods with the admission reasons recorded during
them, or ``no_worker`` for the stretches when no live worker served the lane's node
(from the ``workers`` table: before the node's first worker started, after its last one
stopped or was lost). ``controller/report_html.py`` renders the report as a page with a
lane-occupancy timeline.

An attempt's duration is its command's: from the supervisor's exit record
(``exit.json``: ``started_at`` when the command was spawned, ``ended_at`` when it and its
process group were done), not from when the attempt was settled, which can be much later
(a restarted worker, the controller after a lease expired). An attempt without an exit
record (nothing started, unknown, reconciled without one) has no duration and is left out
of the percentiles, as are not-run attempts.

The report's window starts when the run was created and ends where the run did
(``report_window.report_window``): a finished run at ``runs.finished_at``; a run with an attempt in
flight, an attempt whose outcome is unknown (it may still run; only a reconcile ends it),
or ready or waiting jobs that no pause, stop or halt holds, at ``now``; any other run
(stopped, paused or halted with nothing in flight) at its last settle or control,
whichever is later, so a report read an hour after a run stopped is the same report.
Within the window, a lane with no job left to end (every one succeeded, failed, skipped,
cancelled or reused) is not idle after its last job ended.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from laneway.controller import advice, ledger, oom, refusal_words, spend
from laneway.controller.clock import iso
from laneway.controller.codes import RefusalCode
from laneway.controller.evidence import read_exit_record
from laneway.controller.ledger.selection import SELECT_CODE
from laneway.controller.models import (
    Artifact,
    Attempt,
    AttemptInput,
    Decision,
    Event,
    Item,
    Job,
    NodeLowWater,
    Run,
    Worker,
)
from laneway.controller.report_window import run_window
from laneway.controller.states import (
    AttemptState,
    EventKind,
    Verdict,
    WorkerState,
)
from laneway.controller.status import build_status
from laneway.controller.status_nodes import LOST_AFTER_SECONDS

IDLE_MIN_SECONDS = 1.0
NO_WORKER_MIN_SECONDS = 1.0
"""A stretch without a live worker shorter than this (a worker starting just after its
run) is not named in an idle period's reasons."""
UNVERIFIED = "unverified"
"""A bar's outcome while its attempt is in flight on a worker that is not live."""
NO_DURATION = ("running", UNVERIFIED, "unknown", "not_run")


def queue_wait(readies: list[datetime], intent: datetime) -> dict[str, Any]:
    """An attempt's queue wait: ``{"wait": seconds}`` from its job's becoming ready to the
    attempt's intent, plus ``"wait_clamped": True`` when that was negative.

    ``readies``: when the job became ready, in order (``job_ready`` events, after its
    creation for a job created ready: ``_readies``). The ready is the latest at or
    before the intent: a retried job is ready again after each attempt, and taking its
    latest ready overall, a later attempt's, made an earlier attempt's wait negative. A
    ready stamped after the intent all the same comes from another machine's clock (the
    controller, each worker and the submit host each stamp their own writes): the wait
    counts as 0, flagged so the report can say how many (``queue_wait_clamped``)."""
    before = [at for at in readies if at <= intent]
    wait = _seconds(before[-1] if before else readies[0], intent)
    if wait < 0:
        return {"wait": 0.0, "wait_clamped": True}
    return {"wait": wait}


def _readies(job: Job, events: list[datetime], needs: bool) -> list[datetime]:
    """When ``job`` became ready: its ``job_ready`` events, after its creation when it was
    created ready (a stage without needs; those have no event for it)."""
    return events if needs and events else [job.created_at, *events]


def _seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def _utc(value: Any) -> datetime | None:
    """An exit record's ISO timestamp (``...Z``) as naive UTC, like the ledger's."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment


def exit_times(attempt_dir: str | None) -> tuple[datetime | None, datetime | None]:
    """(started_at, ended_at) of the command, from the attempt's ``exit.json``, read as the
    settle reads it (``evidence.read_exit_record``: no link followed, a FIFO never waited
    on); None for what it does not say (no record, unreadable, or the command never
    started)."""
    if not attempt_dir:
        return None, None
    try:
        record = read_exit_record(attempt_dir)
    except (OSError, ValueError, RecursionError):
        return None, None
    if not isinstance(record, dict):
        return None, None
    return _utc(record.get("started_at")), _utc(record.get("ended_at"))


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": pick(0.5), "p90": pick(0.9), "max": round(ordered[-1], 3)}


def build_report(
    session: Session,
    run: Run,
    *,
    now: datetime,
    idle_min_seconds: float = IDLE_MIN_SECONDS,
    yield_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    config = ledger.run_config(run)
    status = build_status(session, run, now=now)
    step = advice.report_step(status)
    # In flight on a worker that is not live: nobody can say it runs (drawn as such).
    unverified = {r.attempt_id for r in status.running if not r.verified}
    start = run.created_at
    end, ends_at, held, lanes_done = run_window(
        session, run, [lane.name for lane in config.lanes], now=now
    )
    window = max(_seconds(start, end), 1e-9)
    rows = session.execute(
        select(Attempt, Job, Item)
        .join(Job, Job.id == Attempt.job_id)
        .join(Item, Item.id == Job.item_id)
        .where(Attempt.run_id == run.id)
        .order_by(Attempt.id)
    ).all()
    ready_at: dict[int, list[datetime]] = defaultdict(list)
    for event in session.scalars(
        select(Event)
        .where(Event.run_id == run.id, Event.kind == EventKind.JOB_READY)
        .order_by(Event.id)
    ):
        if event.job_id is not None:
            ready_at[event.job_id].append(event.at)
    decisions = list(
        session.scalars(select(Decision).where(Decision.run_id == run.id).order_by(Decision.id))
    )
    served = _served(session, [lane.node for lane in config.lanes], start, end, now=now)
    needs = {stage.name: stage.needs for stage in config.stages}
    lanes: dict[str, dict[str, Any]] = {}
    bars: dict[str, list[dict[str, Any]]] = defaultdict(list)
    intents: dict[str, dict[float, float]] = defaultdict(dict)
    """Per lane, bar start -> the earliest intent of the attempts drawn from it: when the
    lane stopped being idle in the ledger (the command starts a little later)."""
    oom_killed: list[dict[str, Any]] = []
    for attempt, job, item in rows:
        found = oom.from_diagnostics(attempt.diagnostics)
        if found is not None:
            oom_killed.append(
                {"attempt_id": attempt.id, "item": item.key, "stage": job.stage}
                | {"node": attempt.node, **found}
            )
        state = str(
            attempt.outcome or ("running" if attempt.state != AttemptState.UNKNOWN else "unknown")
        )
        if state == "running" and attempt.id in unverified:
            state = UNVERIFIED
        command_start, command_end = (
            exit_times(attempt.attempt_dir)
            if attempt.state == AttemptState.SETTLED
            else (None, None)
        )
        begun = command_start or attempt.started_at or attempt.intent_at
        # An attempt without a settle lasts to the window's end, which is ``now`` while
        # one is in flight or of unknown outcome (report_window).
        ended = command_end or attempt.settled_at or end
        duration = None
        if state not in NO_DURATION and command_end is not None:
            started = command_start or attempt.started_at
            if started is not None:
                duration = max(0.0, _seconds(started, command_end))
        bar_start = _seconds(start, begun)
        intent = _seconds(start, attempt.intent_at)
        intents[job.lane][bar_start] = min(intent, intents[job.lane].get(bar_start, intent))
        bars[job.lane].append(
            {
                "attempt_id": attempt.id,
                "item": item.key,
                "stage": job.stage,
                "start": _seconds(start, begun),
                "end": max(_seconds(start, begun), _seconds(start, ended)),
                "duration": duration,
                "outcome": state,
                **queue_wait(
                    _readies(job, ready_at.get(job.id, []), bool(needs[job.stage])),
                    attempt.intent_at,
                ),
            }
        )
    for lane in config.lanes:
        lane_bars = sorted(bars.get(lane.name, []), key=lambda b: b["start"])
        starts = [b["start"] for b in lane_bars]
        intervals = [b - a for a, b in itertools.pairwise(starts)]
        busy = _union([(b["start"], b["end"]) for b in lane_bars])
        done = lanes_done.get(lane.name)
        lane_end = _lane_end(done, lane_bars, start, window)
        idle = _gaps(busy, 0.0, lane_end)
        durations: dict[str, list[float]] = defaultdict(list)
        for b in lane_bars:
            if b["duration"] is not None:
                durations[b["stage"]].append(b["duration"])
        settled = sum(
            1 for b in lane_bars if b["outcome"] not in ("running", UNVERIFIED, "unknown")
        )
        lanes[lane.name] = {
            "node": lane.node,
            "attempts": len(lane_bars),
            "done_at_seconds": None if done is None else round(lane_end, 3),
            "start_interval_seconds": _percentiles(intervals),
            "all_idle_share": round(sum(b - a for a, b in idle) / window, 4),
            "throughput_per_hour": round(settled / (window / 3600), 2),
            "stage_duration_seconds": {s: _percentiles(v) for s, v in sorted(durations.items())},
            "queue_wait_seconds": _percentiles([b["wait"] for b in lane_bars]),
            # Waits whose ready came after the intent: another clock's (queue_wait).
            "queue_wait_clamped": sum(1 for b in lane_bars if b.get("wait_clamped")),
            "failures_by_class": dict(
                Counter(b["outcome"] for b in lane_bars if b["outcome"] != "succeeded")
            ),
            "idle_periods": [
                _idle_period(
                    decisions,
                    lane.name,
                    lane.node,
                    served.get(lane.node, []),
                    start,
                    a,
                    b,
                    intents[lane.name].get(b),
                )
                for a, b in idle
                if b - a >= idle_min_seconds
            ],
            "bars": lane_bars,
        }
    return {
        "run": {
            "id": run.id,
            "name": run.name,
            "state": run.state,
            "created_at": iso(run.created_at),
            "finished_at": iso(run.finished_at),
        },
        "next_step": None if step is None else step.as_dict(),
        "window": {
            "start": iso(start),
            "end": iso(end),
            "ends_at": ends_at,
            "held": None if ends_at in ("finished", "now") else held,
        },
        "window_seconds": round(window, 3),
        "generated_at": iso(now),
        "lanes": lanes,
        "usage": spend.spend_report(
            session, run.id, start=start, window_seconds=window, yield_keys=yield_keys
        ),
        "oom_kills": oom_kills(oom_killed),
        "artifacts": artifact_traffic(session, run.id),
        "node_memory": low_water(session, run, [(a, j) for a, j, _ in rows], now=now),
        "reused": reused_jobs(session, run.id),
        "selection": selection_report(config, decisions, start, window),
    }


SELECTION_BUCKETS = 10
"""Time slices of a run's window in which the report counts each group's admissions."""


def selection_report(
    config: Any, decisions: list[Decision], start: datetime, window: float
) -> dict[str, Any] | None:
    """A run that selects by yield: per group, its admissions (in all and per tenth of
    the window) and, from the newest choice's figures, its yield (``by`` per ``per``);
    how many admissions explored. None for a run without ``select``."""
    if config.select is None:
        return None
    chosen = [d for d in decisions if d.reason_code == SELECT_CODE]
    latest = chosen[-1].detail if chosen else {}
    groups = sorted({str(i.fields[config.group_field]) for i in config.items})
    over_time: dict[str, list[int]] = {g: [0] * SELECTION_BUCKETS for g in groups}
    admitted: Counter[str] = Counter()
    for decision in chosen:
        group = decision.detail["group"]
        admitted[group] += 1
        at = _seconds(start, decision.decided_at) / window
        slot = min(SELECTION_BUCKETS - 1, max(0, int(at * SELECTION_BUCKETS)))
        over_time.setdefault(group, [0] * SELECTION_BUCKETS)[slot] += 1
    yields = dict(latest.get("yields", {}))
    return {
        "by": config.select.by,
        "per": config.select.per,
        "explore": config.select.explore,
        "explored": sum(1 for d in chosen if d.detail["why"] != "best yield"),
        "groups": [
            {
                "group": group,
                "admitted": admitted[group],
                "yield": yields.get(group),
                "over_time": over_time[group],
            }
            for group in sorted(over_time)
        ],
    }


def _lane_end(
    done: datetime | None, bars: list[dict[str, Any]], start: datetime, window: float
) -> float:
    """Where a lane's idle time can end (seconds since ``start``): the window's end
    while the lane has jobs left to end (``done`` None); else when its last job ended
    or its last attempt's bar did, whichever is later, within the window."""
    if done is None:
        return window
    last = max([_seconds(start, done), *(float(b["end"]) for b in bars)])
    return min(window, max(0.0, last))


def reused_jobs(session: Session, run_id: int) -> dict[str, Any]:
    """The run's jobs that took over an earlier run's result instead of running
    (``jobs.reused_from``; ``v_reused_jobs``), counted per stage, per lane and per run
    they came from. One GROUP BY query."""
    rows = session.execute(
        select(Job.stage, Job.lane, Attempt.run_id, func.count())
        .join(Attempt, Attempt.id == Job.reused_from)
        .where(Job.run_id == run_id, Job.reused_from.is_not(None))
        .group_by(Job.stage, Job.lane, Attempt.run_id)
    ).all()
    by_stage: Counter[str] = Counter()
    by_lane: Counter[str] = Counter()
    from_runs: Counter[str] = Counter()
    for stage, lane, source_run, count in rows:
        by_stage[stage] += count
        by_lane[lane] += count
        from_runs[str(source_run)] += count
    return {
        "total": sum(by_stage.values()),
        "by_stage": dict(sorted(by_stage.items())),
        "by_lane": dict(sorted(by_lane.items())),
        "from_runs": dict(sorted(from_runs.items(), key=lambda kv: int(kv[0]))),
    }


def low_water(
    session: Session, run: Run, attempts: list[tuple[Attempt, Job]], *, now: datetime
) -> dict[str, dict[str, Any]]:
    """Per node of the run: the lowest free memory its workers measured while the run
    was active (``node_low_water``, lowered by heartbeats), the run's floor for it, the
    margin between them, and the stages of the attempts that were running on the node
    at that moment (what the memory went to)."""
    found: dict[str, dict[str, Any]] = {}
    for row in session.scalars(
        select(NodeLowWater).where(NodeLowWater.run_id == run.id).order_by(NodeLowWater.node)
    ):
        running: Counter[str] = Counter()
        if row.low_at is not None:
            for attempt, job in attempts:
                begun = attempt.started_at or attempt.intent_at
                ended = attempt.settled_at or now
                if attempt.node == row.node and begun <= row.low_at <= ended:
                    running[job.stage] += 1
        found[row.node] = {
            "memory_floor_mib": row.memory_floor_mib,
            "low_free_mib": row.low_free_mib,
            "low_at": iso(row.low_at),
            "margin_mib": (
                None if row.low_free_mib is None else row.low_free_mib - row.memory_floor_mib
            ),
            "running": dict(sorted(running.items())),
        }
    return found


def artifact_traffic(session: Session, run_id: int) -> dict[str, Any]:
    """Bytes moved per node for ``run_id``'s artifacts: ``stored`` / ``stored_bytes``
    (up: outputs its workers put in the artifact store) and ``fetched`` /
    ``fetched_bytes`` (down: inputs its attempts were given, recorded at their claim),
    per node (sorted) and in total. One GROUP BY query each."""
    up = session.execute(
        select(Artifact.node, func.count(), func.coalesce(func.sum(Artifact.size_bytes), 0))
        .where(Artifact.run_id == run_id)
        .group_by(Artifact.node)
    ).all()
    down = session.execute(
        select(AttemptInput.node, func.count(), func.coalesce(func.sum(AttemptInput.size_bytes), 0))
        .join(Attempt, Attempt.id == AttemptInput.attempt_id)
        .where(Attempt.run_id == run_id)
        .group_by(AttemptInput.node)
    ).all()
    zero = {"stored": 0, "stored_bytes": 0, "fetched": 0, "fetched_bytes": 0}
    by_node: dict[str, dict[str, int]] = {}
    for direction, rows in (("stored", up), ("fetched", down)):
        for node, count, size in rows:
            entry = by_node.setdefault(node, dict(zero))
            entry[direction] = int(count)
            entry[f"{direction}_bytes"] = int(size)
    totals = {key: sum(entry[key] for entry in by_node.values()) for key in zero}
    return {**totals, "by_node": dict(sorted(by_node.items()))}


def oom_kills(killed: list[dict[str, Any]]) -> dict[str, Any]:
    """Attempts the kernel's OOM killer ended (``controller.oom``), counted per node and
    per stage, each with its evidence."""
    return {
        "total": len(killed),
        "by_node": dict(sorted(Counter(k["node"] for k in killed).items())),
        "by_stage": dict(sorted(Counter(k["stage"] for k in killed).items())),
        "attempts": killed,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _gaps(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    gaps, cursor = [], lo
    for a, b in busy:
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    if hi > cursor:
        gaps.append((cursor, hi))
    return gaps


def _served(
    session: Session, nodes: list[str], start: datetime, end: datetime, *, now: datetime
) -> dict[str, list[tuple[float, float]]]:
    """Per node, when a live worker served it during the run (seconds since ``start``,
    merged): each worker from its start until it stopped; a lost one, or an active one
    whose heartbeat is older than ``LOST_AFTER_SECONDS`` at ``now``, until its last
    heartbeat; a live one until ``now``. Only workers whose span meets the run's window
    are read."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    rows = session.execute(
        select(
            Worker.node, Worker.state, Worker.started_at, Worker.heartbeat_at, Worker.stopped_at
        ).where(
            Worker.node.in_(sorted(set(nodes))),
            Worker.started_at <= end,
            (Worker.stopped_at.is_(None)) | (Worker.stopped_at >= start),
        )
    ).all()
    for node, state, started, heartbeat, stopped in rows:
        if state == WorkerState.STOPPED and stopped is not None:
            until = stopped
        elif state == WorkerState.ACTIVE and _seconds(heartbeat, now) <= LOST_AFTER_SECONDS:
            until = now
        else:
            until = heartbeat
        a, b = max(0.0, _seconds(start, started)), min(_seconds(start, until), _seconds(start, end))
        if b > a:
            spans[node].append((a, b))
    return {node: _union(node_spans) for node, node_spans in spans.items()}


def _idle_period(
    decisions: list[Decision],
    lane: str,
    node: str,
    served: list[tuple[float, float]],
    start: datetime,
    a: float,
    b: float,
    dispatched: float | None,
) -> dict[str, Any]:
    """One idle period [a, b] with its reasons.

    ``no_worker`` (with its stretches) for the time no live worker served the node, first
    when that is at least half the period. The recorded refusals only if a worker served
    the node for some of it: the last one decided before the period and those decided
    inside it while a worker served the node, but not one decided with or after the
    dispatch that ends the period (``dispatched``: that attempt's intent, when the period
    ends at an attempt), which explains no idle time before it."""
    unserved = [(x, y) for x, y in _gaps(served, a, b) if y - x >= NO_WORKER_MIN_SECONDS]
    missing = sum(y - x for x, y in unserved)
    until = b if dispatched is None else max(a, min(b, dispatched))
    worked = any(y > x for x, y in _gaps(unserved, a, until))
    reasons = _reasons(decisions, lane, start, a, b, unserved, dispatched) if worked else []
    if unserved:
        words = refusal_words.describe(RefusalCode.NO_WORKER, {"node": node, "spans": unserved})
        if missing * 2 >= b - a:
            reasons.insert(0, words)
        else:
            reasons.append(words)
    return {
        "start": round(a, 3),
        "end": round(b, 3),
        "seconds": round(b - a, 3),
        "reasons": reasons,
        "no_worker_seconds": round(missing, 3),
    }


def _reasons(
    decisions: list[Decision],
    lane: str,
    start: datetime,
    a: float,
    b: float,
    unserved: list[tuple[float, float]],
    dispatched: float | None,
) -> list[str]:
    """The refusal reasons in force during [a, b]: the last one decided before the gap
    and every one decided inside it (per stage) before ``dispatched`` and outside the
    ``unserved`` stretches, in words."""
    words: list[str] = []
    last_before: dict[str | None, Decision] = {}
    for decision in decisions:
        if decision.lane != lane:
            continue
        at = _seconds(start, decision.decided_at)
        if at <= a:
            last_before[decision.stage] = decision
            continue
        inside = at <= b if dispatched is None else at < dispatched
        if inside and decision.verdict == Verdict.REFUSED:
            if not any(x <= at < y for x, y in unserved):
                words.append(refusal_words.describe(decision.reason_code or "", decision.detail))
    for decision in last_before.values():
        if decision.verdict == Verdict.REFUSED:
            words.insert(0, refusal_words.describe(decision.reason_code or "", decision.detail))
    return list(dict.fromkeys(words))
