"""What a run spent and what it yielded, for ``laneway report`` (read-only).

Per lane and per stage: usage totals (any outcome counts: money spent on a failure is
spent), cost per succeeded item, useful output per hour for the keys the user names
(``--yield``), the attempts whose usage is missing, and the run's spend curve (the
cumulative total of each key at each moment usage was recorded).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from laneway.controller.ledger.tables import attempt_usage, attempts, items, jobs
from laneway.controller.states import AttemptState, JobState

MISSING_LISTED = 50
"""Attempts without usage listed by id (all are counted)."""


def spend_report(
    session: Session,
    run_id: int,
    *,
    start: datetime,
    window_seconds: float,
    yield_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The usage part of a run's report. ``yield_keys``: the keys whose output per hour
    is reported (default: every key the run's attempts reported)."""
    rows = session.execute(
        select(
            attempt_usage.c.key,
            attempt_usage.c.value,
            attempt_usage.c.stage,
            attempt_usage.c.recorded_at,
            jobs.c.lane,
        )
        .join(jobs, jobs.c.id == attempt_usage.c.job_id)
        .where(attempt_usage.c.run_id == run_id)
        .order_by(attempt_usage.c.recorded_at, attempt_usage.c.attempt_id)
    ).all()
    by_lane: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_stage: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    run_total: dict[str, float] = defaultdict(float)
    curve: dict[str, list[list[float]]] = defaultdict(list)
    for key, value, stage, recorded_at, lane in rows:
        by_lane[lane][key] += value
        by_stage[stage][key] += value
        run_total[key] += value
        at = round(max(0.0, (recorded_at - start).total_seconds()), 3)
        curve[key].append([at, round(run_total[key], 6)])
    keys = tuple(yield_keys) or tuple(sorted(run_total))
    hours = max(window_seconds, 1e-9) / 3600

    succeeded_jobs: dict[str, int] = defaultdict(int)
    lane_items: dict[str, dict[int, bool]] = defaultdict(dict)
    for lane, stage, item_id, state in session.execute(
        select(jobs.c.lane, jobs.c.stage, jobs.c.item_id, jobs.c.state).where(
            jobs.c.run_id == run_id
        )
    ):
        done = state == JobState.SUCCEEDED.value
        succeeded_jobs[stage] += done
        lane_items[lane][item_id] = lane_items[lane].get(item_id, True) and done
    succeeded_items = {lane: sum(found.values()) for lane, found in lane_items.items()}

    missing = _missing(session, run_id)
    missing_by_lane: dict[str, int] = defaultdict(int)
    missing_by_stage: dict[str, int] = defaultdict(int)
    for row in missing:
        missing_by_lane[row["lane"]] += 1
        missing_by_stage[row["stage"]] += 1

    def section(totals: dict[str, float], succeeded: int, missing_count: int) -> dict[str, Any]:
        return {
            "totals": {k: round(v, 6) for k, v in sorted(totals.items())},
            "succeeded": succeeded,
            "per_succeeded": {
                k: (round(v / succeeded, 6) if succeeded else None)
                for k, v in sorted(totals.items())
            },
            "yield_per_hour": {k: round(totals.get(k, 0.0) / hours, 3) for k in keys},
            "missing_usage": missing_count,
        }

    lanes = sorted(set(lane_items) | set(by_lane))
    stages = sorted(set(succeeded_jobs) | set(by_stage))
    return {
        "totals": {k: round(v, 6) for k, v in sorted(run_total.items())},
        "yield_keys": list(keys),
        "lanes": {
            lane: section(
                by_lane.get(lane, {}), succeeded_items.get(lane, 0), missing_by_lane[lane]
            )
            for lane in lanes
        },
        "stages": {
            stage: section(
                by_stage.get(stage, {}), succeeded_jobs.get(stage, 0), missing_by_stage[stage]
            )
            for stage in stages
        },
        "curve": {k: points for k, points in sorted(curve.items())},
        "missing_usage": {"count": len(missing), "attempts": missing[:MISSING_LISTED]},
    }


def _missing(session: Session, run_id: int) -> list[dict[str, Any]]:
    """Settled and unknown attempts of the run that reported no usage."""
    reported = select(attempt_usage.c.attempt_id).where(attempt_usage.c.run_id == run_id)
    return [
        {
            "attempt_id": attempt_id,
            "item": item,
            "lane": lane,
            "stage": stage,
            "outcome": outcome or state,
        }
        for attempt_id, item, lane, stage, outcome, state in session.execute(
            select(
                attempts.c.id,
                items.c.key,
                jobs.c.lane,
                jobs.c.stage,
                attempts.c.outcome,
                attempts.c.state,
            )
            .join(jobs, jobs.c.id == attempts.c.job_id)
            .join(items, items.c.id == jobs.c.item_id)
            .where(
                attempts.c.run_id == run_id,
                attempts.c.state.in_([AttemptState.SETTLED.value, AttemptState.UNKNOWN.value]),
                attempts.c.id.not_in(reported),
            )
            .order_by(attempts.c.id)
        )
    ]


def spend_svg(usage: dict[str, Any], window_seconds: float, *, width: int = 480) -> str:
    """The spend-over-time chart: one step line per usage key (cumulative total over the
    run, each scaled to its own maximum), for ``render_html`` beside the timeline."""
    curve: dict[str, list[list[float]]] = usage.get("curve") or {}
    height, pad = 160, 28
    colours = ("#2563eb", "#d97706", "#059669", "#7c3aed", "#dc2626", "#0891b2")
    window = max(window_seconds, 1e-9)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="spend" width="{width}" '
        f'height="{height + 20 * max(1, len(curve))}" role="img" '
        'aria-label="spend over time">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - 8}" y2="{height - pad}" '
        'stroke="#9ca3af"/>',
        f'<text x="{pad}" y="14" font-size="11">spend over time (each key scaled to its '
        "total)</text>",
    ]
    if not curve:
        parts.append(
            f'<text x="{pad}" y="{height / 2}" font-size="11">no usage reported</text></svg>'
        )
        return "".join(parts)
    span_x = width - 8 - pad
    span_y = height - 2 * pad
    for index, (key, points) in enumerate(curve.items()):
        top = max(points[-1][1], 1e-12)
        path = [f"M{pad},{height - pad}"]
        last_y = float(height - pad)
        for at, total in points:
            x = pad + span_x * min(at / window, 1.0)
            y = height - pad - span_y * (total / top)
            path.append(f"L{x:.1f},{last_y:.1f}L{x:.1f},{y:.1f}")
            last_y = y
        path.append(f"L{width - 8},{last_y:.1f}")
        colour = colours[index % len(colours)]
        parts.append(
            f'<path d="{"".join(path)}" fill="none" stroke="{colour}" stroke-width="1.5">'
            f"<title>{_escape(key)}: {points[-1][1]:g}</title></path>"
        )
        parts.append(
            f'<text x="{pad}" y="{height + 14 + 20 * index}" font-size="11" fill="{colour}">'
            f"{_escape(key)}: {points[-1][1]:g} in total</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def usage_table_html(usage: dict[str, Any]) -> str:
    """Per lane and per stage: totals, cost per succeeded item, yield per hour, missing."""
    if not usage:
        return ""
    rows = []
    for scope in ("lanes", "stages"):
        for name, part in (usage.get(scope) or {}).items():
            rows.append(
                f"<tr><td>{scope[:-1]} {_escape(name)}</td>"
                f"<td>{_escape(_pairs(part['totals']))}</td>"
                f"<td>{part['succeeded']}</td>"
                f"<td>{_escape(_pairs(part['per_succeeded']))}</td>"
                f"<td>{_escape(_pairs(part['yield_per_hour']))}</td>"
                f"<td>{part['missing_usage']}</td></tr>"
            )
    return (
        "<table><tr><th>where</th><th>usage</th><th>succeeded</th><th>per succeeded</th>"
        "<th>per hour</th><th>attempts without usage</th></tr>" + "".join(rows) + "</table>"
    )


def _pairs(values: dict[str, Any]) -> str:
    shown = [f"{k} {v:g}" for k, v in values.items() if v is not None]
    return ", ".join(shown) or "-"
