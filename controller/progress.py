"""Progress of a run for the live display: per stage done / running / ready / waiting /
failed, and an ETA from measured attempt durations (read-only).

``recent_durations`` reads at most ``queries.RECENT_ATTEMPTS`` of the run's newest settled
attempts (an index range on ``ix_attempts_run_settled``), so a refresh costs the same at
a thousand jobs and at a million; ``stage_progress`` and ``eta_seconds`` only reshape a
``status_report``.
"""

from __future__ import annotations

from dataclasses import dataclass

from laneway.controller import queries
from laneway.controller.rows import Rows, _moment
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


def eta_seconds(status: StatusReport, durations: dict[str, float]) -> float | None:
    """Seconds until every job is terminal, if the work left runs at the measured mean
    durations on the live workers' slots (at least one). None until every stage with
    work left has a measured duration, or when nothing is left."""
    work = 0.0
    left = False
    for row in stage_progress(status):
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
    return work / max(1, slots)
