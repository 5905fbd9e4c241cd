"""The memory parts of ``laneway report``'s text: each node's low-water mark beside its
floor (``controller.report.low_water``) and the OOM kills (``controller.report.oom_kills``)."""

from __future__ import annotations

from typing import Any


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "-"


def oom_lines(kills: dict[str, Any] | None) -> list[str]:
    """OOM kills per node and per stage, then one line per killed attempt with its
    evidence; nothing when there were none."""
    if not kills or not kills["total"]:
        return []
    out = [
        f"OOM kills: {kills['total']}; per node: {_counts(kills['by_node'])}; "
        f"per stage: {_counts(kills['by_stage'])}"
    ]
    for k in kills["attempts"]:
        free = "?" if k["mem_available_mib"] is None else f"{k['mem_available_mib']:g}"
        floor = "?" if k["memory_floor_mib"] is None else f"{k['memory_floor_mib']:g}"
        peak = "?" if k["peak_rss_mib"] is None else f"{k['peak_rss_mib']:g}"
        out.append(
            f"  attempt {k['attempt_id']} ({k['item']}.{k['stage']} on {k['node']}, "
            f"{k['source']}): free {free} MiB, floor {floor} MiB, last peak {peak} MiB"
        )
    return out


def _mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value:,.0f} MiB"


def low_water_lines(nodes: dict[str, Any] | None) -> list[str]:
    """One line per node: its lowest free memory while the run was active, its floor,
    the margin, when, and what was running on it then."""
    out = []
    for node, entry in (nodes or {}).items():
        line = (
            f"node {node}: lowest free memory {_mib(entry['low_free_mib'])}, "
            f"floor {entry['memory_floor_mib']:,} MiB"
        )
        if entry["low_free_mib"] is not None:
            line += f" (margin {_mib(entry['margin_mib'])}) at {entry['low_at']}"
            if entry["running"]:
                line += f", while {_counts(entry['running'])} ran"
        out.append(line)
    return out
