"""The run report as HTML (read nothing: it renders ``controller.report.build_report``'s
dict): a self-contained page with its window in words (``report_window.window_text``:
``created → finished``, ``created → end (paused)``, ``created → now (active)``), the
per-lane summary, the memory, OOM, artifact and usage parts, and the SVG lane-occupancy
timeline (``timeline_svg``, which ``laneway web`` shows alone): one row per slot,
attempts as bars coloured by outcome, a time axis, idle gaps labelled with their reason
where the label fits (every gap has it as a tooltip).
"""

from __future__ import annotations

import html
from typing import Any

from laneway.controller import spend
from laneway.controller.report_window import window_text
from laneway.controller.units import byte_size

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
    "unverified": "#c026d3",
}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "-"


def _mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value:,.0f} MiB"


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
<p>{html.escape(window_text(report))}, window {report["window_seconds"]:.1f} s</p>
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
