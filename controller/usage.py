"""Usage a job reports, validated; the budget arithmetic admission and dry-run share.

Pure Python, no database. A job's result JSON may carry ``usage``: numbers keyed by
name (``input_tokens``, ``cost_usd``, ...). ``read_usage`` keeps the finite,
non-negative numbers up to ``USAGE_MAX`` and turns everything else into a warning:
usage is evidence, so a bad value never crashes a settle and never changes an outcome.
``stored_result`` makes the rest of a result storable on every backend, saying what it
had to change.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

USAGE_KEY = re.compile(r"\A[A-Za-z][A-Za-z0-9_.-]{0,63}\Z")
"""What a usage key may look like (it is stored in a String(64) column). ``\\Z``, not
``$``: ``$`` also matches before a trailing newline, and ``cost_usd\\n`` would be a key of
its own that no budget names."""
BUDGET_SPENT = "nothing more fits the budget"
"""How the reason of the pause a budget sets begins (``ledger.claim``)."""

USAGE_MAX = 1e15
"""The largest usage value kept. Past any real count of tokens, calls or dollars, and
small enough that the sums the ledger keeps (``usage_totals``, the ``v_usage_*`` views)
can never overflow a double: PostgreSQL refuses an overflowing sum, which would fail
the settle that adds it."""
USAGE_MAX_KEYS = 100
"""At most this many usage keys of one result are kept (each is a row of the settle)."""
USAGE_MAX_WARNINGS = 20
"""At most this many usage warnings are recorded one by one; the rest are counted."""

RESULT_MAX_DEPTH = 64
"""How deeply a result's arrays and objects may nest (``controller.outcome`` refuses a
deeper result.json; ``stored_result`` replaces what lies deeper by text)."""
_INT_MAX_BITS = 13_000
"""An integer longer than this (about 3900 digits) is stored as text: Python refuses to
write an integer of more than 4300 digits as JSON text."""
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
"""NUL (PostgreSQL text and jsonb cannot hold it) and unpaired surrogates (no UTF-8
encoding exists: the driver raises). A pair is one character by the time JSON is read."""
REPLACEMENT = "\ufffd"

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
    ignored = 0
    for key, value in raw.items():
        problem = _problem(key, value)
        if problem is None and len(usage) >= USAGE_MAX_KEYS:
            problem = f"more than {USAGE_MAX_KEYS} usage keys"
        if problem is not None:
            ignored += 1
            if len(warnings) < USAGE_MAX_WARNINGS:
                warnings.append(f"usage.{_shown_key(key)} ignored: {problem}")
            continue
        usage[key] = float(value)
    if ignored > len(warnings):
        warnings.append(f"usage: {ignored - len(warnings)} more values ignored")
    return usage, warnings


def _problem(key: Any, value: Any) -> str | None:
    if not isinstance(key, str) or not USAGE_KEY.match(key):
        return "a key is a name of letters, digits, '_', '.', '-' (at most 64)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{_shown(value)} is not a number"
    # Compared as they are: float() of an integer past 1e308 raises OverflowError.
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not finite"
    if value < 0:
        return f"{_shown(value)} is negative"
    if value > USAGE_MAX:
        return f"{_shown(value)} is more than {USAGE_MAX:g}"
    return None


def _shown_key(key: Any) -> str:
    if isinstance(key, str) and key.isprintable() and len(key) <= 64:
        return key
    return _shown(key)


def _shown(value: Any) -> str:
    """A value in a warning: scalars by their repr (cut at 40 characters), containers
    and integers too long to write only by kind and size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"(an integer of {_digits(value)} digits)"
    if isinstance(value, dict):
        return f"(an object of {len(value)} keys)"
    if isinstance(value, list | tuple):
        return f"(a list of {len(value)} items)"
    text = repr(value[:41] if isinstance(value, str) else value)
    return text if len(text) <= 40 else text[:37] + "..."


def _digits(value: int) -> str:
    """How many decimal digits ``value`` has, without writing it out (``str`` refuses
    integers past 4300 digits); approximate past a few hundred."""
    bits = abs(value).bit_length()
    return f"about {int(bits * math.log10(2)) + 1}" if bits > 1000 else str(len(str(abs(value))))


def storable(value: Any) -> Any:
    """``value`` as every backend can store it (``stored_result`` without its notes)."""
    return stored_result(value)[0]


def stored_result(value: Any) -> tuple[Any, list[str]]:
    """A copy of a parsed result that every backend stores, and one note per kind of
    change it needed. Non-finite floats (NaN, Infinity: Python's JSON reader accepts
    them, PostgreSQL's json type does not) become their text without a note; NUL and
    unpaired surrogates in strings and keys become U+FFFD; integers too long to write,
    arrays and objects nested past ``RESULT_MAX_DEPTH`` and values of no JSON type
    become a text saying what they were. Iterative: no depth makes it raise."""
    changed: Counter[str] = Counter()

    def scalar(item: Any) -> Any:
        if isinstance(item, str):
            clean = _UNSTORABLE.sub(REPLACEMENT, item)
            if clean != item:
                changed["strings"] += 1
            return clean
        if item is None or isinstance(item, bool):
            return item
        if isinstance(item, float):
            return item if math.isfinite(item) else str(item)
        if isinstance(item, int):
            if item.bit_length() > _INT_MAX_BITS:
                changed["integers"] += 1
                return f"(an integer of {_digits(item)} digits)"
            return item
        changed["other"] += 1
        return f"(a {type(item).__name__})"

    def child(item: Any, depth: int, pending: list[tuple[Any, Any, int]]) -> Any:
        if not isinstance(item, dict | list | tuple):
            return scalar(item)
        if depth > RESULT_MAX_DEPTH:
            changed["deep"] += 1
            return f"(nested deeper than {RESULT_MAX_DEPTH} levels)"
        copy: Any = {} if isinstance(item, dict) else []
        pending.append((item, copy, depth))
        return copy

    pending: list[tuple[Any, Any, int]] = []
    root = child(value, 0, pending)
    while pending:
        source, target, depth = pending.pop()
        if isinstance(target, list):
            target.extend(child(item, depth + 1, pending) for item in source)
            continue
        for key, item in source.items():
            name = scalar(key if isinstance(key, str) else str(key))
            if name in target:  # two keys that became equal: keep both
                changed["keys"] += 1
                number = 2
                while f"{name} #{number}" in target:
                    number += 1
                name = f"{name} #{number}"
            target[name] = child(item, depth + 1, pending)
    notes = {
        "strings": "strings held a NUL or an unpaired surrogate (each replaced by U+FFFD)",
        "keys": "keys became equal to another once cleaned (' #2' appended)",
        "integers": "integers were too long to store (replaced by their size)",
        "deep": f"values were nested deeper than {RESULT_MAX_DEPTH} levels (replaced by text)",
        "other": "values were of no JSON type (replaced by their type)",
    }
    return root, [
        f"result: {changed[kind]} {text} to be storable"
        for kind, text in notes.items()
        if changed[kind]
    ]


def clean_text(text: str) -> str:
    """``text`` with NUL and unpaired surrogates replaced by U+FFFD, for a text column
    (a reason, a diagnostic) that may quote what a job wrote."""
    return _UNSTORABLE.sub(REPLACEMENT, text)


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


def limit_plan(config: Any, jobs_per_stage: dict[str, int]) -> list[dict[str, Any]]:
    """Dry-run arithmetic for every rate limit of ``config``: per counted thing (calls, or
    a usage key), the jobs of the stages that draw from it times one call or their
    ``expected_usage``, and the least time the run needs under the limit (that total /
    the limit's amount x its window). First attempts only: retries add to it."""
    plans: list[dict[str, Any]] = []
    for name, limit in sorted(config.limits.items()):
        stages = [s for s in config.stages if name in s.limits]
        counted: list[tuple[str, float]] = []
        if limit.calls is not None:
            counted.append(("calls", float(limit.calls)))
        counted += sorted(limit.usage.items())
        for key, amount in counted:
            parts = [
                {
                    "stage": s.name,
                    "jobs": jobs_per_stage.get(s.name, 0),
                    "each": 1.0 if key == "calls" else s.expected_usage.get(key),
                }
                for s in stages
            ]
            total = sum(p["jobs"] * (p["each"] or 0.0) for p in parts)
            plans.append(
                {
                    "limit": name,
                    "key": key,
                    "amount": amount,
                    "per_seconds": limit.per_seconds,
                    "stages": parts,
                    "total": total,
                    "least_seconds": total / amount * limit.per_seconds if amount else None,
                    "unestimated": [p["stage"] for p in parts if p["each"] is None],
                }
            )
    return plans


def limit_plan_lines(plans: list[dict[str, Any]]) -> list[str]:
    """``limit_plan`` in words, one line per limit and counted thing."""
    lines = []
    for plan in plans:
        terms = " + ".join(
            f"{p['stage']} {p['jobs']} x {p['each']:g}"
            for p in plan["stages"]
            if p["each"] is not None
        )
        least = plan["least_seconds"]
        # A limit of 0 (a run frozen before load refused it) lets nothing through.
        bound = f"at least {least:.0f} s" if least is not None else "never: the limit is 0"
        line = (
            f"rate limit {plan['limit']} {plan['key']}: {terms or 'nothing estimated'} = "
            f"{plan['total']:g} at {plan['amount']:g} per {plan['per_seconds']:g} s — {bound}"
        )
        if plan["unestimated"]:
            line += f"; no expected_usage for {', '.join(plan['unestimated'])}"
        lines.append(line)
    return lines
