"""Circuit breakers (invariant 11, docs/invariants.md), as pure policy over a run's
settled outcomes.

- Infrastructure failures of ``n`` distinct items in a row pause the run. "In a row"
  means since the last success: a success resets the count; ordinary failures (the job
  ran and said no) neither count nor reset, and neither do other classes.
- A harness failure pauses the run; a fatal outcome halts it (``controller.ledger``
  applies these two directly when it settles).
"""

from __future__ import annotations

from collections.abc import Sequence

from laneway.controller.states import Outcome


def infra_streak(history: Sequence[tuple[str, Outcome]]) -> set[str]:
    """The distinct items with an infrastructure failure since the last success.
    ``history`` is (item key, outcome) in settle order, oldest first."""
    items: set[str] = set()
    for item, outcome in reversed(history):
        if outcome is Outcome.SUCCEEDED:
            break
        if outcome is Outcome.INFRA_FAILURE:
            items.add(item)
    return items


def infra_breaker_trips(history: Sequence[tuple[str, Outcome]], n: int) -> bool:
    """Does the newest settle (the last of ``history``) trip the infrastructure breaker?"""
    if not history or history[-1][1] is not Outcome.INFRA_FAILURE:
        return False
    return len(infra_streak(history)) >= n
