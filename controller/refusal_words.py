"""Admission's refusals and placements in words, e.g. ``lane_cap — 2 running, cap 2``:
what `status`, `explain` and the report print beside each reason code
(controller/admission.py decides; this only words). Apart from admission so that a
read-only command (`laneway status`) need not import it: its dataclasses cost about 10 ms
of each start."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from laneway.controller.codes import RefusalCode

LANE_NODE = "lane's node"
"""How a stage without ``nodes`` is placed: on the node of the job's lane."""


def placement_words(stage_nodes: Sequence[str] | None) -> str:
    """Where a stage runs, in words: ``b, c`` or ``lane's node``."""
    return ", ".join(stage_nodes) if stage_nodes else LANE_NODE


def describe(code: str, detail: dict[str, Any]) -> str:
    """A refusal in words, e.g. ``memory_floor — free 900 MiB - unreleased 0 - stage 2048 <
    floor 1024``. ``code``: a ``RefusalCode``, or a code read back from a ledger that this
    version does not know (worded as its code, or its ``why``)."""
    if code == RefusalCode.MEMORY_FLOOR and "available_mib" in detail:
        return (
            f"memory_floor — free {detail['available_mib']} MiB - unreleased "
            f"{detail['reserved_mib']} - stage {detail['stage_mib']} < floor {detail['floor_mib']}"
        )
    if code == RefusalCode.BUDGET and "key" in detail:
        return budget_words(detail)
    if code in (RefusalCode.LANE_CAP, RefusalCode.STAGE_CAP):
        return f"{code} — {detail['running']} running, cap {detail['cap']}"
    if code == RefusalCode.MAX_JOBS:
        return f"max_jobs — {detail['running']} running, node max_jobs {detail['max_jobs']}"
    if code in (RefusalCode.HALTED, RefusalCode.PAUSED, RefusalCode.STOPPED):
        return f"{code} ({detail['scope']}) — {detail['reason']}"
    if code == RefusalCode.UNKNOWN_OUTCOME:
        return (
            f"unknown_outcome — {detail['unknown_attempts']} attempt(s) await `laneway reconcile`"
        )
    if code == RefusalCode.OTHER_NODE:
        return (
            f"other_node — node {detail['node']} does not run this stage; it runs on "
            f"{', '.join(detail['nodes'])}"
        )
    if code == RefusalCode.RATE_LIMIT and "limit" in detail:
        return rate_words(detail)
    if code == RefusalCode.SECRET_MISSING:
        return (
            f"secret_missing — {', '.join(detail['variables'])} not set in the environment "
            f"of the worker on node {detail['node']}"
        )
    if code == RefusalCode.NEEDS_PENDING:
        return "needs_pending — waiting for earlier stages to finish"
    if code == RefusalCode.NO_WORKER:
        words = f"no_worker — no live worker on node {detail.get('node')}"
        if detail.get("stage") and detail.get("nodes"):
            words += f" (stage {detail['stage']} runs on {', '.join(detail['nodes'])})"
        spans = detail.get("spans")
        if spans:
            words += " (" + ", ".join(f"+{a:.0f} s to +{b:.0f} s" for a, b in spans) + ")"
        if detail.get("start"):
            words += f"; start one: {detail['start']}"
        return words
    if "why" in detail:
        return f"{code} — {detail['why']}"
    return code


def rate_words(detail: dict[str, Any]) -> str:
    """A rate-limit refusal's arithmetic, e.g. ``rate_limit — provider-a: 5 calls in the
    last 2 s + 1 > 5; the window frees in 0.8 s``."""
    what = "calls" if detail["key"] == "calls" else detail["key"]
    words = (
        f"rate_limit — {detail['limit']}: {detail['in_window']:g} {what} in the last "
        f"{detail['per_seconds']:g} s + {detail['this']:g} > {detail['cap']:g}"
    )
    frees = detail.get("frees_in_seconds")
    if frees is not None:
        words += f"; the window frees in {frees:.1f} s"
    return words


def budget_words(detail: dict[str, Any]) -> str:
    """A budget refusal's arithmetic, e.g. ``budget (run) — cost_usd: spent 45 + reserved
    3 + expected 4 (p90 of 12 attempt(s)) = 52 > budget 50``."""
    scope = "run" if detail["scope"] == "run" else f"stage {detail['stage']}"
    committed = detail["spent"] + detail["reserved"]
    total = committed + detail["expected"]
    head = (
        f"budget ({scope}) — {detail['key']}: spent {detail['spent']:g} + reserved "
        f"{detail['reserved']:g}"
    )
    if committed >= detail["budget"]:
        return f"{head} = {committed:g} reaches budget {detail['budget']:g}"
    return (
        f"{head} + expected {detail['expected']:g} ({detail['expected_from']}) = "
        f"{total:g} > budget {detail['budget']:g}"
    )
