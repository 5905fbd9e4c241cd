"""The run report: per lane, where the hours went (read-only over the ledger).

For each lane: attempts, start intervals, the share of the run's window with nothing of
the lane running, throughput per hour, stage duration percentiles, queue wait (ready to
intent), failures by class, and idle periods with the admission reasons recorded during
them. ``render_html`` draws a self-contained lane-occupancy timeline: one row per slot,
attempts as bars coloured by outcome, idle gaps labelled with their reason.
"""

from __future__ import annotations

import html
import itertools
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller import admission, ledger
from controller.clock import iso
from controller.models import Attempt, Decision, Event, Item, Job, Run

IDLE_MIN_SECONDS = 1.0
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


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": pick(0.5), "p90": pick(0.9), "max": round(ordered[-1], 3)}


def build_report(
    session: Session, run: Run, *, now: datetime, idle_min_seconds: float = IDLE_MIN_SECONDS
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
            select(Event).where(Event.run_id == run.id, Event.kind == "job_ready")
        )
    }
    decisions = list(
        session.scalars(select(Decision).where(Decision.run_id == run.id).order_by(Decision.id))
    )
    lanes: dict[str, dict[str, Any]] = {}
    bars: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for attempt, job, item in rows:
        begun = attempt.started_at or attempt.intent_at
        ended = attempt.settled_at or (now if attempt.state != "unknown" else end)
        state = attempt.outcome or ("running" if attempt.state != "unknown" else "unknown")
        bars[job.lane].append(
            {
                "attempt_id": attempt.id,
                "item": item.key,
                "stage": job.stage,
                "start": _seconds(start, begun),
                "end": _seconds(start, ended),
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
            if b["outcome"] not in ("running", "unknown"):
                durations[b["stage"]].append(b["end"] - b["start"])
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
                {
                    "start": round(a, 3),
                    "end": round(b, 3),
                    "seconds": round(b - a, 3),
                    "reasons": _reasons(decisions, lane.name, start, a, b),
                }
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


def _reasons(
    decisions: list[Decision], lane: str, start: datetime, a: float, b: float
) -> list[str]:
    """The refusal reasons in force during [a, b]: the last one decided before the gap
    and every one decided inside it (per stage), in words."""
    words: list[str] = []
    last_before: dict[str | None, Decision] = {}
    for decision in decisions:
        if decision.lane != lane:
            continue
        at = _seconds(start, decision.decided_at)
        if at <= a:
            last_before[decision.stage] = decision
        elif at <= b and decision.verdict == "refused":
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


def render_html(report: dict[str, Any]) -> str:
    """A self-contained HTML page: summary table and an SVG lane-occupancy timeline."""
    window = max(report["window_seconds"], 1e-9)
    width, left, row_h = 1000, 130, 22
    scale = (width - left - 10) / window
    parts: list[str] = []
    y = 30
    for name, lane in report["lanes"].items():
        slots = _slots(lane["bars"]) or [[]]
        parts.append(f'<text x="4" y="{y + 15}" class="lane">lane {html.escape(name)}</text>')
        for index, row in enumerate(slots):
            top = y + index * row_h
            parts.append(
                f'<text x="70" y="{top + 15}" class="slot">slot {index + 1}</text>'
                f'<line x1="{left}" y1="{top + row_h}" x2="{width}" y2="{top + row_h}" '
                'class="grid"/>'
            )
            for bar in row:
                x = left + bar["start"] * scale
                w = max(1.5, (bar["end"] - bar["start"]) * scale)
                colour = COLOURS.get(bar["outcome"], "#999")
                title = html.escape(
                    f"attempt {bar['attempt_id']} {bar['item']}.{bar['stage']}: "
                    f"{bar['outcome']}, {bar['end'] - bar['start']:.1f} s"
                )
                parts.append(
                    f'<rect class="attempt {bar["outcome"]}" x="{x:.1f}" y="{top + 3}" '
                    f'width="{w:.1f}" height="{row_h - 6}" fill="{colour}">'
                    f"<title>{title}</title></rect>"
                )
        lane_bottom = y + len(slots) * row_h
        for gap in lane["idle_periods"]:
            x = left + gap["start"] * scale
            w = max(1.5, gap["seconds"] * scale)
            label = "; ".join(gap["reasons"]) or "no recorded refusal"
            parts.append(
                f'<rect class="idle" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                f'height="{lane_bottom - y}"><title>{html.escape(label)}</title></rect>'
                f'<text class="idle-label" x="{x + 3:.1f}" y="{lane_bottom - 4}">'
                f"idle {gap['seconds']:.0f} s: {html.escape(label)}</text>"
            )
        y = lane_bottom + 24
    legend = "".join(
        f'<span class="key"><i style="background:{c}"></i>{html.escape(k)}</span>'
        for k, c in COLOURS.items()
    )
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
.lane {{ font-weight: 600; font-size: 13px; }} .slot {{ font-size: 11px; fill: #555; }}
.grid {{ stroke: #eee; }} .idle {{ fill: #fde68a; opacity: .45; }}
.idle-label {{ font-size: 10px; fill: #92400e; }}
.key {{ margin-right: 12px; font-size: 12px; }}
.key i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px; }}
</style></head><body>
<h1>Run {run["id"]} ({html.escape(run["name"])}) — {html.escape(run["state"])}</h1>
<p>{html.escape(str(run["created_at"]))} → {html.escape(str(run["finished_at"]))},
window {report["window_seconds"]:.1f} s</p>
<table><tr><th>lane</th><th>node</th><th>attempts</th><th>per hour</th>
<th>all slots idle</th><th>failures</th></tr>{rows}</table>
<div>{legend}</div>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}"
 class="timeline">{"".join(parts)}</svg>
</body></html>
"""
