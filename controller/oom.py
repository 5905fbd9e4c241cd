"""Out-of-memory evidence: how an attempt killed by the kernel's OOM killer is named.

The worker (``workers.oom``) decides at settle time whether an attempt's SIGKILL came
from the OOM killer; it then adds one line to the attempt's ``diagnostics``:
``oom_killed {"source": ..., "mem_available_mib": ..., "memory_floor_mib": ...,
"peak_rss_mib": ...}``. The outcome stays what the exit rules give (``failed``): this
is evidence, not a class. The report reads the line back with ``from_diagnostics``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

PREFIX = "oom_killed "
Source = Literal["cgroup", "free_memory"]
"""``cgroup``: the oom_kill counter of the worker's memory cgroup went up while the
attempt ran; ``free_memory``: no such counter, but the node's free memory was under its
floor at the worker's last probe. ``free_memory`` is inferred evidence (``inferred``):
the only kind where no cgroup counts kills (the worker's ``oom`` seam ``inferred``,
``workers/seams.py``: macOS, or Linux with the portable paths forced)."""

INFERRED: frozenset[str] = frozenset({"free_memory"})
"""The sources that infer the OOM kill rather than read the kernel's count of it."""


def inferred(found: dict[str, Any] | None) -> bool:
    """Is this OOM evidence inferred (no kernel counter named the kill)?"""
    return found is not None and found.get("source") in INFERRED


def evidence(
    source: Source,
    *,
    mem_available_mib: float | None,
    memory_floor_mib: int | None,
    peak_rss_mib: float | None,
) -> dict[str, Any]:
    """The structured evidence of one OOM kill."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(float(value), 1)

    return {
        "source": source,
        "mem_available_mib": rounded(mem_available_mib),
        "memory_floor_mib": memory_floor_mib,
        "peak_rss_mib": rounded(peak_rss_mib),
    }


def diagnostic(found: dict[str, Any]) -> str:
    """The diagnostics line that carries ``found``."""
    return PREFIX + json.dumps(found, sort_keys=True)


def from_diagnostics(diagnostics: list[Any] | None) -> dict[str, Any] | None:
    """The OOM evidence among an attempt's diagnostics, or None."""
    for line in diagnostics or []:
        if isinstance(line, str) and line.startswith(PREFIX):
            try:
                found = json.loads(line[len(PREFIX) :])
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return None
