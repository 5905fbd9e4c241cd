"""Usage a job reports, validated; the budget arithmetic admission and dry-run share.

Pure Python, no database. A job's result JSON may carry ``usage``: numbers keyed by
name (``input_tokens``, ``cost_usd``, ...). ``read_usage`` keeps the finite,
non-negative numbers and turns everything else into a warning: usage is evidence, so
a bad value never crashes a settle and never changes an outcome.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

USAGE_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
BUDGET_SPENT = "nothing more fits the budget"
"""How the reason of the pause a budget sets begins (``ledger.claim``)."""
"""What a usage key may look like (it is stored in a String(64) column)."""

P90_WINDOW = 100
"""How many of a stage's newest reported values the expected cost is measured over."""


def read_usage(result: Any) -> tuple[dict[str, float], list[str]]:
    """The valid usage of a parsed result (key -> value) and one warning per value kept
    out. No ``usage``: nothing, and no warning (``report`` lists such attempts)."""
    if not isinstance(result, dict) or "usage" not in result:
        return {}, []
    raw = result["usage"]
    if not isinstance(raw, dict):
        return {}, [f"usage ignored: must be an object of numbers, not {type(raw).__name__}"]
    usage: dict[str, float] = {}
    warnings: list[str] = []
    for key, value in raw.items():
        problem = _problem(key, value)
        if problem is not None:
            warnings.append(f"usage.{str(key)[:64]} ignored: {problem}")
            continue
        usage[key] = float(value)
    return usage, warnings


def _problem(key: Any, value: Any) -> str | None:
    if not isinstance(key, str) or not USAGE_KEY.match(key):
        return "a key is a name of letters, digits, '_', '.', '-' (at most 64)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{_shown(value)} is not a number"
    if not math.isfinite(value):
        return f"{value} is not finite"
    if value < 0:
        return f"{value} is negative"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def storable(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, Infinity: Python's JSON reader accepts
    them, PostgreSQL's json type does not) replaced by its text, so a result carrying
    one is stored on every backend instead of failing its settle."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    return value


def p90(values: Iterable[float]) -> float | None:
    """The 90th percentile (nearest rank) of ``values``; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = math.ceil(0.9 * len(ordered))
    return ordered[max(rank, 1) - 1]


def over_budget(committed: float, expected: float, budget: float) -> bool:
    """Refuse when the budget is already reached, or when this attempt's expected cost
    would take the committed total (spent + reserved) past it. Equality admits."""
    return committed >= budget or committed + expected > budget


def budget_plan(config: Any, jobs_per_stage: dict[str, int]) -> list[dict[str, Any]]:
    """Dry-run arithmetic for every budget of ``config``: per key, each stage's jobs x
    expected cost (its ``expected_usage``: a new run has no measurements), their sum,
    and whether it fits. First attempts only: retries add to it."""
    plans: list[dict[str, Any]] = []
    scopes: list[tuple[str | None, dict[str, float]]] = [(None, dict(config.budget or {}))]
    scopes += [(stage.name, dict(stage.budget)) for stage in config.stages if stage.budget]
    for scope, budget in scopes:
        for key, limit in sorted(budget.items()):
            stages = [s for s in config.stages if scope is None or s.name == scope]
            parts = [
                {
                    "stage": s.name,
                    "jobs": jobs_per_stage.get(s.name, 0),
                    "expected": s.expected_usage.get(key),
                }
                for s in stages
            ]
            total = sum(p["jobs"] * (p["expected"] or 0.0) for p in parts)
            plans.append(
                {
                    "scope": "run" if scope is None else f"stage {scope}",
                    "key": key,
                    "budget": limit,
                    "stages": parts,
                    "projected": total,
                    "fits": total <= limit,
                    "unestimated": [p["stage"] for p in parts if p["expected"] is None],
                }
            )
    return plans


def budget_plan_lines(plans: list[dict[str, Any]]) -> list[str]:
    """``budget_plan`` in words, one line per budget."""
    lines = []
    for plan in plans:
        terms = " + ".join(
            f"{p['stage']} {p['jobs']} x {p['expected']:g}"
            for p in plan["stages"]
            if p["expected"] is not None
        )
        verdict = (
            "fits"
            if plan["fits"]
            else "passes it: admission will refuse (budget) the attempt that would pass it"
        )
        line = (
            f"budget ({plan['scope']}) {plan['key']}: {terms or 'nothing estimated'} = "
            f"{plan['projected']:g} of {plan['budget']:g} — {verdict}"
        )
        if plan["unestimated"]:
            line += (
                f"; no expected_usage for {', '.join(plan['unestimated'])} (counted as 0 "
                "until its attempts report usage)"
            )
        lines.append(line)
    return lines
