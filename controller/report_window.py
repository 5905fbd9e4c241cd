"""Where a run's report window ends, and why there: one pure decision
(``report_window`` over ``WindowFacts``), the few aggregate queries that gather its facts
(``run_window``), and the window in words (``window_text``). ``controller/report.py``
builds the report over this window."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from laneway.controller.models import Attempt, Control, Job, Run
from laneway.controller.states import (
    TERMINAL_JOB_STATES,
    AttemptState,
    ControlKind,
    ControlScope,
    JobState,
)

ENDS_AT = ("finished", "now", "last_settle", "last_control", "created")
"""Why a report's window ends where it does (``report_window``): the run finished; it
is still under way (``now``); its last settle or its last control, whichever is later;
its creation, for a run that stands without either."""
HELD_WORDS = {ControlKind.HALT: "halted", ControlKind.STOP: "stopped", ControlKind.PAUSE: "paused"}
"""A control covering a run, as the report's header says it (the first in force, in this
order, names why a run stands)."""


@dataclass(frozen=True)
class WindowFacts:
    """What decides where a run's report window ends (``report_window``)."""

    created_at: datetime
    finished_at: datetime | None
    in_flight: bool
    """An attempt of the run is in intent or running."""
    unknown: bool
    """An attempt of the run has an unknown outcome: it may still run, and only an
    operator's reconcile ends it."""
    runnable: bool
    """The run has ready or waiting jobs that no control (pause, stop, halt) of the run,
    of their lane or of everything holds: work it could still run."""
    last_settle: datetime | None
    last_control: datetime | None
    """The newest set or clear of a control of the run (run or lane scope), or the set
    of a global control in force."""


def report_window(facts: WindowFacts, now: datetime) -> tuple[datetime, str]:
    """Where the report window of a run ends and why there (one of ``ENDS_AT``): a
    finished run at its end; an active run with work in flight (or of unknown outcome)
    or work it could run at ``now``; any other (stopped, paused, halted) at its last
    settle or control, whichever is later (a settle on a tie), never before it was
    created nor after ``now``."""
    if facts.finished_at is not None:
        return max(facts.created_at, facts.finished_at), "finished"
    if facts.in_flight or facts.unknown or facts.runnable:
        return max(facts.created_at, now), "now"
    marks = [
        (moment, why)
        for moment, why in (
            (facts.last_settle, "last_settle"),
            (facts.last_control, "last_control"),
        )
        if moment is not None and moment > facts.created_at
    ]
    if not marks:
        return facts.created_at, "created"
    moment, why = max(marks, key=lambda mark: mark[0])
    return min(moment, max(facts.created_at, now)), why


def window_text(report: dict[str, Any]) -> str:
    """The report's window in words: ``created → finished`` for a finished run,
    ``created → end (paused)`` for one that stands (stopped, paused, halted, ...),
    ``created → now (active)`` for one still under way."""
    window = report["window"]
    if window["ends_at"] == "finished":
        return f"{window['start']} → {window['end']}"
    if window["ends_at"] == "now":
        return f"{window['start']} → now (active)"
    return f"{window['start']} → {window['end']} ({window['held']})"


def run_window(
    session: Session, run: Run, lanes: list[str], *, now: datetime
) -> tuple[datetime, str, str, dict[str, datetime | None]]:
    """The run's window end, why it ends there, the word for what holds the run (for a
    window that ends before ``now``), and per lane when its last job ended (None for a
    lane with jobs left to end; the run's creation for a lane without jobs). A handful
    of aggregate queries."""
    attempt_states = dict(
        session.execute(
            select(Attempt.state, func.count())
            .where(Attempt.run_id == run.id)
            .group_by(Attempt.state)
        ).all()
    )
    unknown = attempt_states.get(AttemptState.UNKNOWN, 0) > 0
    in_flight = any(attempt_states.get(s, 0) for s in (AttemptState.INTENT, AttemptState.RUNNING))
    last_settle = session.scalar(
        select(func.max(Attempt.settled_at)).where(Attempt.run_id == run.id)
    )
    controls = list(
        session.scalars(
            select(Control).where(
                (Control.run_id == run.id)
                | ((Control.scope == ControlScope.GLOBAL) & Control.cleared_at.is_(None))
            )
        )
    )
    moments = [m for c in controls for m in (c.set_at, c.cleared_at) if m is not None]
    in_force = [c for c in controls if c.cleared_at is None]
    whole_run = {c.kind for c in in_force if c.scope != ControlScope.LANE}
    held_lanes = {c.lane for c in in_force if c.scope == ControlScope.LANE}
    left: set[str] = set()
    """Lanes with a job left to end."""
    ended: dict[str, datetime] = {}
    """Per lane, when its last job that ended did."""
    waiting_lanes: set[str] = set()
    for lane, state, last in session.execute(
        select(Job.lane, Job.state, func.max(Job.finished_at))
        .where(Job.run_id == run.id)
        .group_by(Job.lane, Job.state)
    ):
        if state not in TERMINAL_JOB_STATES:
            left.add(lane)
        elif last is not None:
            ended[lane] = max(last, ended.get(lane, last))
        if state in (JobState.READY, JobState.WAITING):
            waiting_lanes.add(lane)
    runnable = not whole_run and bool(waiting_lanes - held_lanes)
    facts = WindowFacts(
        created_at=run.created_at,
        finished_at=run.finished_at,
        in_flight=in_flight,
        unknown=unknown,
        runnable=runnable,
        last_settle=last_settle,
        last_control=max(moments) if moments else None,
    )
    end, ends_at = report_window(facts, now)
    kinds = whole_run or {c.kind for c in in_force}
    held = next((word for kind, word in HELD_WORDS.items() if kind in kinds), "nothing to run")
    done = {lane: None if lane in left else ended.get(lane, run.created_at) for lane in lanes}
    return end, ends_at, held, done
