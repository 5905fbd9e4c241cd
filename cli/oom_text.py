"""The OOM part of ``laneway report``'s text (``controller.report.oom_kills`` builds it)."""

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
