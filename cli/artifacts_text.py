"""The text of ``laneway artifacts`` and the artifacts part of ``laneway report``'s."""

from __future__ import annotations

from typing import Any

from laneway.cli import render
from laneway.controller.units import byte_size

SHORT_SHA = 12
"""How many hex digits of an artifact's sha256 the text shows (the JSON has all 64)."""


def _scope(listing: dict[str, Any]) -> str:
    parts = []
    if listing["item"] is not None:
        parts.append(f"item {listing['item']}")
    if listing["stage"] is not None:
        parts.append(f"stage {listing['stage']}")
    return f" of {' '.join(parts)}" if parts else ""


def _attempt(row: dict[str, Any]) -> str:
    reused = row.get("reused_from_run")
    return f"{row['attempt_id']}" + (f" (reused, run {reused})" if reused is not None else "")


def artifacts_text(listing: dict[str, Any]) -> str:
    """A run's artifacts as a table after one summary line; one clear line when none."""
    run = listing["run"]
    head = f"run {run['id']} ({run['name']}) — {run['state']}"
    rows = listing["artifacts"]
    if not rows:
        return render.clean(f"{head}: no artifacts{_scope(listing)}; {listing['why_none']}")
    out = [
        render.clean(
            f"{head}: {listing['count']} artifact{'s' if listing['count'] != 1 else ''}"
            f"{_scope(listing)}, {byte_size(listing['total_bytes'])}"
        ),
        render.table(
            ["item", "stage", "attempt", "name", "size", "sha256", "node", "location"],
            [
                [
                    row["item"],
                    row["stage"],
                    _attempt(row),
                    row["name"],
                    byte_size(row["size_bytes"]),
                    row["sha256"][:SHORT_SHA],
                    row["node"],
                    row["location"],
                ]
                for row in rows
            ],
        ),
    ]
    return "\n".join(out)


def traffic_lines(traffic: dict[str, Any] | None) -> list[str]:
    """Per node: artifacts stored (bytes up) and inputs fetched (bytes down); nothing
    when the run moved no artifacts."""
    if not traffic or not (traffic["stored"] or traffic["fetched"]):
        return []
    return [
        f"artifacts: {traffic['stored']} stored ({byte_size(traffic['stored_bytes'])} up), "
        f"{traffic['fetched']} inputs fetched ({byte_size(traffic['fetched_bytes'])} down)",
        render.table(
            ["  node", "stored", "bytes up", "fetched", "bytes down"],
            [
                [
                    f"  {node}",
                    entry["stored"],
                    byte_size(entry["stored_bytes"]),
                    entry["fetched"],
                    byte_size(entry["fetched_bytes"]),
                ]
                for node, entry in traffic["by_node"].items()
            ],
        ),
    ]
