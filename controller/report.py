"""The run report: per lane, where the hours went (read-only over the ledger).

For each lane: attempts, start intervals, the share of the run's window with nothing of
the lane running, throughput per hour, stage duration percentiles, queue wait (ready to
intent), failures by class, and idle periods with the admission reasons recorded during
them, or ``no_worker`` for the stretches when no live worker served the lane's node
(from the ``workers`` table: before the node's first worker started, after its last one
stopped or was lost). ``render_html`` draws a self-contained lane-occupancy timeline:
one row per slot, attempts as bars coloured by outcome, a time axis, idle gaps labelled
with their reason where the label fits (every gap has it as a tooltip).

An attempt's duration is its command's: from the supervisor's exit record
(``exit.json``: ``started_at`` when the command was spawned, ``ended_at`` when it and its
process group were done), not from when the attempt was settled, which can be much later
(a restarted worker, the controller after a lease expired). An attempt without an exit
record (nothing started, unknown, reconciled without one) has no duration and is left out
of the percentiles, as are not-run attempts.
"""

from __future__ import annotations

import html
import itertools
import json
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller import admission, ledger, oom, spend
from controller.clock import iso
from controller.models import (
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
from controller.states import EventKind, WorkerState
from controller.status import LOST_AFTER_SECONDS
from controller.units import byte_size

IDLE_MIN_SECONDS = 1.0
NO_WORKER_MIN_SECONDS = 1.0
"""A stretch without a live worker shorter than this (a worker starting just after its
run) is not named in an idle period's reasons."""
EXIT_RECORD = "exit.json"
"""The supervisor's exit record in an attempt's directory (workers/supervisor.py)."""
NO_DURATION = ("running", "unknown", "not_run")
COLOURS = {
    "succeeded": "#3a9d5d",
    "failed": "#d9822b",
    "infra_failure": "#8e6ac8",
    "harness_failure": "#c23b7a",
    "fatal": "#b91c1c",
    "timed_out": "#a16207",
    "cancelled": "#6b7280",
    "not_run": "#9ca3af",
    "unknown": "#111827",
    "running": "#60a5fa",
}


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
    """(started_at, ended_at) of the command, from the attempt's ``exit.json``; None for
    what it does not say (no record, unreadable, or the command never started)."""
    if not attempt_dir:
        return None, None
    try:
        record = json.loads((Path(attempt_dir) / EXIT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
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
    start = run.created_at
    end = run.finished_at or now
    window = max(_seconds(start, end), 1e-9)
    rows = session.execute(
        select(Attempt, Job, Item)
        .join(Job, Job.id == Attempt.job_id)
        .join(Item, Item.id == Job.item_id)
        .where(Attempt.run_id == run.id)
        .order_by(Attempt.id)
    ).all()
    ready_at = {
        event.job_id: event.at
        for event in session.scalars(
            select(Event).where(Event.run_id == run.id, Event.kind == EventKind.JOB_READY)
        )
    }
    decisions = list(
        session.scalars(select(Decision).where(Decision.run_id == run.id).order_by(Decision.id))
    )
    served = _served(session, [lane.node for lane in config.lanes], start, end, now=now)
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
        state = str(attempt.outcome or ("running" if attempt.state != "unknown" else "unknown"))
        command_start, command_end = (
            exit_times(attempt.attempt_dir) if attempt.state == "settled" else (None, None)
        )
        begun = command_start or attempt.started_at or attempt.intent_at
        ended = command_end or attempt.settled_at or (now if state == "running" else end)
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
                "wait": _seconds(ready_at.get(job.id, job.created_at), attempt.intent_at),
            }
        )
    for lane in config.lanes:
        lane_bars = sorted(bars.get(lane.name, []), key=lambda b: b["start"])
        starts = [b["start"] for b in lane_bars]
        intervals = [b - a for a, b in itertools.pairwise(starts)]
        busy = _union([(b["start"], b["end"]) for b in lane_bars])
        idle = _gaps(busy, 0.0, window)
        durations: dict[str, list[float]] = defaultdict(list)
        for b in lane_bars:
            if b["duration"] is not None:
                durations[b["stage"]].append(b["duration"])
        settled = sum(1 for b in lane_bars if b["outcome"] not in ("running", "unknown"))
        lanes[lane.name] = {
            "node": lane.node,
            "attempts": len(lane_bars),
            "start_interval_seconds": _percentiles(intervals),
            "all_idle_share": round(sum(b - a for a, b in idle) / window, 4),
            "throughput_per_hour": round(settled / (window / 3600), 2),
            "stage_duration_seconds": {s: _percentiles(v) for s, v in sorted(durations.items())},
            "queue_wait_seconds": _percentiles([b["wait"] for b in lane_bars]),
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
    }


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


def reused_html(reused: dict[str, Any]) -> str:
    """The reused jobs as a paragraph (nothing when the run reused none)."""
    if not reused or not reused["total"]:
        return ""
    runs = ", ".join(f"run {r}: {n}" for r, n in reused["from_runs"].items())
    return (
        f'<p class="reused">Reused from earlier runs (linked, not run): {reused["total"]} '
        f"jobs — per stage: {html.escape(_counts(reused['by_stage']))}; from: "
        f"{html.escape(runs)}</p>"
    )


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


def low_water_html(nodes: dict[str, dict[str, Any]]) -> str:
    """Each node's low-water mark beside its floor as a table (nothing without rows)."""
    if not nodes:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(node)}</td><td>{_mib(entry['low_free_mib'])}</td>"
        f"<td>{entry['memory_floor_mib']:,} MiB</td><td>{_mib(entry['margin_mib'])}</td>"
        f"<td>{html.escape(str(entry['low_at'] or '-'))}</td>"
        f"<td>{html.escape(_counts(entry['running']))}</td></tr>"
        for node, entry in nodes.items()
    )
    return (
        '<table class="low-water"><tr><th>node</th><th>lowest free memory</th>'
        "<th>floor</th><th>margin</th><th>at</th><th>running then</th></tr>"
        f"{rows}</table>"
    )


def _mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value:,.0f} MiB"


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


def artifacts_html(traffic: dict[str, Any]) -> str:
    """The bytes moved per node as a table (nothing when the run moved no artifacts)."""
    if not traffic or not (traffic["stored"] or traffic["fetched"]):
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(node)}</td><td>{entry['stored']}</td>"
        f"<td>{byte_size(entry['stored_bytes'])}</td><td>{entry['fetched']}</td>"
        f"<td>{byte_size(entry['fetched_bytes'])}</td></tr>"
        for node, entry in traffic["by_node"].items()
    )
    return (
        '<table class="artifacts"><tr><th>node</th><th>artifacts stored</th><th>bytes up</th>'
        f"<th>inputs fetched</th><th>bytes down</th></tr>{rows}</table>"
    )


def oom_kills(killed: list[dict[str, Any]]) -> dict[str, Any]:
    """Attempts the kernel's OOM killer ended (``controller.oom``), counted per node and
    per stage, each with its evidence."""
    return {
        "total": len(killed),
        "by_node": dict(sorted(Counter(k["node"] for k in killed).items())),
        "by_stage": dict(sorted(Counter(k["stage"] for k in killed).items())),
        "attempts": killed,
    }


def oom_html(kills: dict[str, Any]) -> str:
    """The OOM kills per node and stage as a paragraph (nothing when there were none)."""
    if not kills or not kills["total"]:
        return ""
    nodes = _counts(kills["by_node"])
    stages = _counts(kills["by_stage"])
    return (
        f'<p class="oom">OOM kills: {kills["total"]} — per node: {html.escape(nodes)}; '
        f"per stage: {html.escape(stages)}</p>"
    )


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
        words = admission.describe("no_worker", {"node": node, "spans": unserved})
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
        if inside and decision.verdict == "refused":
            if not any(x <= at < y for x, y in unserved):
                words.append(admission.describe(decision.reason_code or "", decision.detail))
    for decision in last_before.values():
        if decision.verdict == "refused":
            words.insert(0, admission.describe(decision.reason_code or "", decision.detail))
    return list(dict.fromkeys(words))


def _slots(bars: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Pack bars into rows (slots): each bar goes to the first row free at its start."""
    rows: list[list[dict[str, Any]]] = []
    for bar in sorted(bars, key=lambda b: b["start"]):
        for row in rows:
            if row[-1]["end"] <= bar["start"]:
                row.append(bar)
                break
        else:
            rows.append([bar])
    return rows


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "-"


CHAR_WIDTH = 0.62
"""Width of one character of the timeline's monospace text, in font sizes (DejaVu Sans
Mono and most monospace fonts: 0.6), rounded up: labels are placed by it."""
TICK_STEPS = (
    [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30]
    + [60 * m for m in (1, 2, 5, 10, 15, 30)]
    + [3600 * h for h in (1, 2, 3, 6, 12, 24, 48)]
)


def text_width(text: str, font_size: float) -> float:
    """The width the timeline allows for ``text`` (monospace)."""
    return len(text) * CHAR_WIDTH * font_size


def _tick_label(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:g} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h" + (f" {minutes:02d} m" if minutes else "")
    return f"{minutes} m" + (f" {secs:02d} s" if secs else "")


def _ticks(window: float, scale: float, font_size: float) -> list[tuple[float, str]]:
    """Axis ticks: the finest step whose labels stay at least 12 px apart."""
    for step in TICK_STEPS:
        if step * scale < 48:
            continue
        count = int(window / step + 1e-9) + 1
        ticks = [(step * k, _tick_label(round(step * k, 3))) for k in range(count)]
        widest = max(text_width(label, font_size) for _, label in ticks)
        if step * scale >= widest + 12:
            return ticks
    # A window beyond the table's steps: its start and end only.
    return [(0.0, _tick_label(0)), (window, _tick_label(round(window)))]


def _gap_label(gap: dict[str, Any], room: float, font_size: float) -> str | None:
    """The longest of the gap's labels that fits in ``room`` px, if any."""
    seconds = f"idle {gap['seconds']:.0f} s"
    reasons = gap["reasons"]
    choices = [f"{seconds}: " + ("; ".join(reasons) or "no recorded refusal")]
    if reasons:
        choices.append(f"{seconds}: {reasons[0].split(' — ')[0]}")
    choices.append(seconds)
    return next((c for c in choices if text_width(c, font_size) <= room), None)


def timeline_svg(report: dict[str, Any]) -> str:
    """The SVG lane-occupancy timeline (``render_html`` embeds it; ``laneway web`` shows
    it alone). Styled by the classes the page's stylesheet sets, with fills inline.

    Every ``<text>`` carries its font size and is monospace, so its box is known
    (``text_width``): tick labels are spaced to fit, an idle gap is labelled only when
    its label fits inside the gap (gaps never overlap one another or a bar), and every
    gap, labelled or not, has its reasons as a tooltip (``<title>``).
    """
    window = max(report["window_seconds"], 1e-9)
    width, left, right, row_h, lane_head = 1000, 130, 10, 22, 18
    tick_size, label_size, slot_size, lane_size = 10, 10, 11, 12
    scale = (width - left - right) / window
    parts: list[str] = []
    axis_y = 26
    ticks = [
        (left + t * scale, label)
        for t, label in _ticks(window, scale, tick_size)
        if left + t * scale + text_width(label, tick_size) / 2 <= width
    ]
    parts.append(
        f'<line class="axis" x1="{left}" y1="{axis_y}" x2="{width - right}" y2="{axis_y}"/>'
    )
    for x, label in ticks:
        parts.append(
            f'<line class="tick" x1="{x:.1f}" y1="{axis_y - 5}" x2="{x:.1f}" y2="{axis_y}"/>'
            f'<text class="tick-label" x="{x:.1f}" y="{axis_y - 8}" font-size="{tick_size}" '
            f'text-anchor="middle">{html.escape(label)}</text>'
        )
    parts.append(
        f'<text class="axis-title" x="4" y="{axis_y - 8}" font-size="{tick_size}">'
        "since start</text>"
    )
    y = axis_y + 10
    for name, lane in report["lanes"].items():
        slots = _slots(lane["bars"]) or [[]]
        parts.append(
            f'<text x="4" y="{y + 13}" class="lane" font-size="{lane_size}">'
            f"lane {html.escape(name)} (node {html.escape(lane['node'])})</text>"
        )
        slots_top = y + lane_head
        for index, row in enumerate(slots):
            top = slots_top + index * row_h
            parts.append(
                f'<text x="4" y="{top + 15}" class="slot" font-size="{slot_size}">'
                f"slot {index + 1}</text>"
                f'<line x1="{left}" y1="{top + row_h}" x2="{width - right}" y2="{top + row_h}" '
                'class="grid"/>'
            )
            for bar in row:
                x = left + bar["start"] * scale
                w = max(1.5, (bar["end"] - bar["start"]) * scale)
                colour = COLOURS.get(bar["outcome"], "#999")
                took = bar.get("duration")
                title = html.escape(
                    f"attempt {bar['attempt_id']} {bar['item']}.{bar['stage']}: "
                    f"{bar['outcome']}, "
                    + (f"{took:.1f} s" if took is not None else "duration unknown")
                )
                parts.append(
                    f'<rect class="attempt {bar["outcome"]}" x="{x:.1f}" y="{top + 3}" '
                    f'width="{w:.1f}" height="{row_h - 6}" fill="{colour}">'
                    f"<title>{title}</title></rect>"
                )
        lane_bottom = slots_top + len(slots) * row_h
        for x, _label in ticks:
            parts.append(
                f'<line class="vgrid" x1="{x:.1f}" y1="{slots_top}" x2="{x:.1f}" '
                f'y2="{lane_bottom}"/>'
            )
        for gap in lane["idle_periods"]:
            x = left + gap["start"] * scale
            w = max(1.5, gap["seconds"] * scale)
            reasons = "; ".join(gap["reasons"]) or "no recorded refusal"
            tooltip = html.escape(f"idle {gap['seconds']:.1f} s: {reasons}")
            parts.append(
                f'<rect class="idle" x="{x:.1f}" y="{slots_top}" width="{w:.1f}" '
                f'height="{lane_bottom - slots_top}"><title>{tooltip}</title></rect>'
            )
            gap_text = _gap_label(gap, w - 6, label_size)
            if gap_text is not None:
                parts.append(
                    f'<text class="idle-label" x="{x + 3:.1f}" y="{lane_bottom - 4}" '
                    f'font-size="{label_size}">{html.escape(gap_text)}<title>{tooltip}</title>'
                    "</text>"
                )
        y = lane_bottom + 16
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" '
        f'class="timeline">{"".join(parts)}</svg>'
    )


def legend_html() -> str:
    """The outcome colours as HTML keys."""
    return "".join(
        f'<span class="key"><i style="background:{c}"></i>{html.escape(k)}</span>'
        for k, c in COLOURS.items()
    )


def render_html(report: dict[str, Any]) -> str:
    """A self-contained HTML page: summary table and the SVG lane-occupancy timeline."""
    legend = legend_html()
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{html.escape(lane['node'])}</td>"
        f"<td>{lane['attempts']}</td><td>{lane['throughput_per_hour']}</td>"
        f"<td>{lane['all_idle_share']:.1%}</td>"
        f"<td>{html.escape(_counts(lane['failures_by_class']))}</td></tr>"
        for name, lane in report["lanes"].items()
    )
    run = report["run"]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>laneway run {run["id"]} report</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 24px; color: #111; }}
table {{ border-collapse: collapse; margin-bottom: 16px; }}
td, th {{ border: 1px solid #ddd; padding: 4px 8px; text-align: left; }}
.lane {{ font-weight: 600; }} .slot {{ fill: #555; }}
.timeline text {{ font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; }}
.grid {{ stroke: #eee; }} .vgrid {{ stroke: #f1f1f1; }}
.axis, .tick {{ stroke: #888; }} .tick-label, .axis-title {{ fill: #555; }}
.idle {{ fill: #fde68a; opacity: .45; }} .idle-label {{ fill: #92400e; }}
.key {{ margin-right: 12px; font-size: 12px; }}
.key i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px; }}
</style></head><body>
<h1>Run {run["id"]} ({html.escape(run["name"])}) — {html.escape(run["state"])}</h1>
<p>{html.escape(str(run["created_at"]))} → {html.escape(str(run["finished_at"]))},
window {report["window_seconds"]:.1f} s</p>
<table><tr><th>lane</th><th>node</th><th>attempts</th><th>per hour</th>
<th>all slots idle</th><th>failures</th></tr>{rows}</table>
{reused_html(report.get("reused") or {})}
{low_water_html(report.get("node_memory") or {})}
{oom_html(report.get("oom_kills") or {})}
{artifacts_html(report.get("artifacts") or {})}
{spend.usage_table_html(report.get("usage") or {})}
<div>{legend}</div>
<div style="display: flex; gap: 24px; align-items: flex-start">
<div>{timeline_svg(report)}</div>
<div>{spend.spend_svg(report.get("usage") or {}, report["window_seconds"])}</div>
</div>
</body></html>
"""
