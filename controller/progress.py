"""Progress of a run for the live display: per stage done / running / ready / waiting /
failed, and an ETA from measured attempt durations and the run's rate limits (read-only).

``recent_durations`` reads at most ``queries.RECENT_ATTEMPTS`` of the run's newest settled
attempts (an index range on ``ix_attempts_run_settled``), so a refresh costs the same at
a thousand jobs and at a million; ``rate_windows`` reads the run's frozen config (one
row); ``stage_progress`` and ``eta_seconds`` only reshape a ``status_report``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from laneway.controller import queries
from laneway.controller.rows import Rows, _json, _moment
from laneway.controller.states import JobState
from laneway.controller.status_model import StatusReport

TERMINAL = (
    JobState.SUCCEEDED.value,
    JobState.FAILED.value,
    JobState.SKIPPED.value,
    JobState.CANCELLED.value,
)


def recent_durations(source: Rows, run_id: int) -> dict[str, float]:
    """Per stage, the mean seconds from start to settle of its newest settled attempts
    (those that started)."""
    totals: dict[str, list[float]] = {}
    for stage, started, settled in source.rows(queries.RECENT_SETTLED_DURATIONS, {"run": run_id}):
        begun, ended = _moment(started), _moment(settled)
        if begun is None or ended is None:
            continue
        totals.setdefault(stage, []).append(max(0.0, (ended - begun).total_seconds()))
    return {stage: sum(values) / len(values) for stage, values in totals.items()}


@dataclass(frozen=True)
class StageProgress:
    """One stage's jobs: total, done (terminal), running, ready, waiting, failed, unknown."""

    stage: str
    total: int
    done: int
    running: int
    ready: int
    waiting: int
    failed: int
    unknown: int


def stage_progress(status: StatusReport) -> list[StageProgress]:
    """Per stage: total, done (terminal), running, ready, waiting, failed, unknown."""
    return [
        StageProgress(
            stage=stage,
            total=sum(by_state.values()),
            done=sum(by_state.get(state, 0) for state in TERMINAL),
            running=by_state.get(JobState.RUNNING.value, 0),
            ready=by_state.get(JobState.READY.value, 0),
            waiting=by_state.get(JobState.WAITING.value, 0),
            failed=by_state.get(JobState.FAILED.value, 0),
            unknown=by_state.get(JobState.UNKNOWN.value, 0),
        )
        for stage, by_state in status.jobs.items()
    ]


@dataclass(frozen=True)
class RateWindow:
    """One thing a rate limit counts (``calls``, or a usage key): at most ``amount``
    within any ``per_seconds``; ``each``: per stage that draws from it, what one attempt
    takes (1 call, or the stage's ``expected_usage`` of the key)."""

    limit: str
    key: str
    amount: float
    per_seconds: float
    each: dict[str, float] = field(default_factory=dict)


def rate_windows(config: dict[str, Any]) -> list[RateWindow]:
    """The rate windows of a frozen config (its JSON form, as ``runs.config_json``
    holds it): per limit, its calls and each usage key some stage expects."""
    stages = config.get("stages") or []
    windows = []
    for name, limit in sorted((config.get("limits") or {}).items()):
        drawing = [s for s in stages if name in (s.get("limits") or [])]
        counted = [("calls", limit["calls"])] if limit.get("calls") is not None else []
        counted += sorted((limit.get("usage") or {}).items())
        for key, amount in counted:
            each = {
                s["name"]: 1.0 if key == "calls" else float(s["expected_usage"][key])
                for s in drawing
                if key == "calls" or key in (s.get("expected_usage") or {})
            }
            if each:
                windows.append(RateWindow(name, key, float(amount), limit["per_seconds"], each))
    return windows


def run_rate_windows(source: Rows, run_id: int) -> list[RateWindow]:
    """``rate_windows`` of run ``run_id``'s frozen config (none when it is not there)."""
    found = source.rows(queries.RUN_BY_ID, {"run": run_id})
    if not found:
        return []
    row = dict(zip(queries.RUN_COLUMNS, found[0], strict=True))
    return rate_windows(_json(row["config_json"]))


def eta_seconds(
    status: StatusReport,
    durations: dict[str, float],
    windows: Sequence[RateWindow] = (),
) -> float | None:
    """Seconds until every job is terminal, if the work left runs at the measured mean
    durations on the live workers' slots (at least one), and never sooner than the
    run's rate limits let its jobs not started yet start (``rate_floor_seconds``). None
    until every stage with work left has a measured duration, when nothing is left, or
    when a limit of 0 lets a job left never start."""
    work = 0.0
    left = False
    rows = stage_progress(status)
    for row in rows:
        remaining = row.total - row.done - row.unknown
        if remaining <= 0:
            continue
        left = True
        if row.stage not in durations:
            return None
        work += remaining * durations[row.stage]
    if not left:
        return None
    slots = sum(int(w.slots) for w in status.workers if w.live)
    floors = [rate_floor_seconds(window, rows, durations) for window in windows]
    if any(floor is None for floor in floors):
        return None
    return max([work / max(1, slots), *(f for f in floors if f is not None)])


def rate_floor_seconds(
    window: RateWindow, rows: Sequence[StageProgress], durations: dict[str, float]
) -> float | None:
    """The least time the jobs not started yet (ready or waiting) of the stages drawing
    from ``window`` need under it: what they take in all, at most ``amount`` per window,
    fills ``ceil(total / amount)`` windows, so the last one starts no sooner than that
    many windows less one from now and then runs its stage's measured duration. 0 when
    none is left; None when the limit is 0 and some is."""
    pending = {r.stage: r.ready + r.waiting for r in rows if r.stage in window.each}
    total = sum(count * window.each[stage] for stage, count in pending.items())
    if total <= 0:
        return 0.0
    if window.amount <= 0:
        return None
    last = max(durations.get(stage, 0.0) for stage, count in pending.items() if count)
    return (math.ceil(total / window.amount - 1e-9) - 1) * window.per_seconds + last
