"""Closeout: a run's configured steps (aggregate, report, ...) run once when the run
finishes, or when it is stopped and drained.

The controller drives it without blocking its tick: each tick polls the running step,
enforces its timeout (TERM then KILL to its process group), records the result, and
starts the next step. Every step is attempted even if an earlier one failed. Progress is
in the ledger (``closeout_step_started`` / ``closeout_step_finished`` /
``closeout_finished`` events) and in ``runs/<run>/closeout_progress.json``, written
atomically after every change. A step that was running when the controller died is
recorded as ``interrupted`` and not run again (nothing runs twice without an operator).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller import ledger
from controller.clock import iso
from controller.config import CloseoutStep, render_closeout
from controller.durable import make_private_dir, open_private, write_json
from controller.models import Attempt, Control, Event, Run
from controller.states import AttemptState, ControlKind, EventKind, RunState, StepState

ACTOR = "controller"
GRACE_SECONDS = 5.0


@dataclass
class _Running:
    name: str
    process: subprocess.Popen[bytes]
    deadline: float
    killed_at: float | None = None
    signal_error: str | None = None


@dataclass
class Closeout:
    """The closeout of one run, rebuilt from the ledger's events when needed."""

    run_id: int
    directory: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    running: _Running | None = None
    done: bool = False


def needs_closeout(session: Session, run: Run) -> bool:
    """Finished, or stopped and drained, with closeout steps not yet finished."""
    if not ledger.run_config(run).closeout:
        return False
    if run.closeout_finished_at is not None:
        return False
    if run.state == RunState.FINISHED.value:
        return True
    stopped = session.scalar(
        select(Control.id).where(
            Control.run_id == run.id,
            Control.kind == ControlKind.STOP.value,
            Control.cleared_at.is_(None),
        )
    )
    in_flight = session.scalar(
        select(Attempt.id).where(
            Attempt.run_id == run.id,
            Attempt.state.in_([AttemptState.INTENT.value, AttemptState.RUNNING.value]),
        )
    )
    return stopped is not None and in_flight is None


def load(session: Session, run: Run) -> Closeout:
    """Rebuild a run's closeout state from its events (a restarted controller resumes)."""
    directory = Path(run.runtime_dir) / "runs" / str(run.id)
    steps = [
        {
            "name": step.name,
            "state": StepState.PENDING.value,
            "exit_code": None,
            "started_at": None,
            "ended_at": None,
            "log": str(directory / "closeout" / f"{step.name}.log"),
        }
        for step in ledger.run_config(run).closeout
    ]
    by_name = {step["name"]: step for step in steps}
    for event in session.scalars(
        select(Event)
        .where(
            Event.run_id == run.id,
            Event.kind.in_([EventKind.CLOSEOUT_STEP_STARTED, EventKind.CLOSEOUT_STEP_FINISHED]),
        )
        .order_by(Event.id)
    ):
        step = by_name.get(event.detail.get("step"))
        if step is None:
            continue
        if event.kind == EventKind.CLOSEOUT_STEP_STARTED:
            # Started but never finished: the controller died while it ran.
            step.update(state=StepState.INTERRUPTED.value, started_at=iso(event.at))
        else:
            step.update(
                state=event.detail["state"],
                exit_code=event.detail.get("exit_code"),
                ended_at=iso(event.at),
            )
    return Closeout(run.id, directory, steps)


Record = Callable[[list[dict[str, Any]]], None]
"""Writes event rows (``ledger.event_row``) in one short write transaction."""


def advance(closeout: Closeout, run: Run, *, now: datetime, record: Record) -> bool:
    """One step of progress. Returns True if anything changed.

    Nothing here holds the ledger's write lock: each change is written through
    ``record`` (its own short transaction), and a step's start is recorded *before* its
    process is spawned, so a controller that dies in between leaves it ``interrupted``
    (never run twice), not running unrecorded."""
    config = ledger.run_config(run)
    changed = False
    current = closeout.running
    if current is not None:
        code = current.process.poll()
        if code is None and time.monotonic() >= current.deadline:
            if current.killed_at is None:
                current.signal_error = _signal(current.process, signal.SIGTERM)
                current.killed_at = time.monotonic()
            elif time.monotonic() - current.killed_at > GRACE_SECONDS:
                current.signal_error = _signal(current.process, signal.SIGKILL)
            return False
        if code is None:
            return False
        state = (
            StepState.TIMED_OUT
            if current.killed_at is not None
            else (StepState.SUCCEEDED if code == 0 else StepState.FAILED)
        )
        record([_finish(closeout, current.name, state, code, now=now, error=current.signal_error)])
        closeout.running = None
        changed = True
    pending = [step for step in closeout.steps if step["state"] == StepState.PENDING]
    if pending:
        step = pending[0]
        spec = next(s for s in config.closeout if s.name == step["name"])
        record(
            [
                ledger.event_row(
                    EventKind.CLOSEOUT_STEP_STARTED,
                    actor=ACTOR,
                    now=now,
                    run_id=run.id,
                    step=step["name"],
                )
            ]
        )
        step.update(state=StepState.RUNNING.value, started_at=iso(now))
        try:
            process = _spawn(spec, Path(step["log"]), run, closeout.directory)
        except Exception as exc:
            # Recorded as the step's failure, and the next step is still attempted: a
            # bad step must never stop the controller's tick.
            record(
                [_finish(closeout, step["name"], StepState.FAILED, None, now=now, error=_why(exc))]
            )
            return True
        closeout.running = _Running(step["name"], process, time.monotonic() + spec.timeout_seconds)
        return True
    if closeout.running is None and not closeout.done:
        closeout.done = True
        record(
            [
                ledger.event_row(
                    EventKind.CLOSEOUT_FINISHED,
                    actor=ACTOR,
                    now=now,
                    run_id=run.id,
                    steps={s["name"]: s["state"] for s in closeout.steps},
                )
            ]
        )
        return True
    return changed


def _spawn(
    spec: CloseoutStep, log_path: Path, run: Run, directory: Path
) -> subprocess.Popen[bytes]:
    """Render and start one step (argv[0] and cwd were made absolute against the
    config file when it was loaded; the default cwd is ``runs/<run>/``)."""
    argv, cwd = render_closeout(spec, run_id=run.id, runtime_dir=run.runtime_dir)
    make_private_dir(log_path.parent)
    with open_private(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            cwd=cwd or str(directory),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={
                **os.environ,
                "LANEWAY_RUN_ID": str(run.id),
                "LANEWAY_RUN_DIR": str(directory),
            },
        )


def _why(exc: BaseException) -> str:
    """One line saying why a step could not start."""
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"could not start: {exc.strerror or exc}{where}"
    if isinstance(exc, (ValueError, KeyError, IndexError)):
        return f"could not render its argv: {type(exc).__name__}: {exc}"
    return f"could not start: {type(exc).__name__}: {exc}"


def write_progress(closeout: Closeout) -> None:
    """``closeout_progress.json``, atomically (a failure propagates to the caller)."""
    make_private_dir(closeout.directory)
    write_json(
        closeout.directory / "closeout_progress.json",
        {"run_id": closeout.run_id, "done": closeout.done, "steps": closeout.steps},
    )


def _finish(
    closeout: Closeout,
    name: str,
    state: StepState,
    code: int | None,
    *,
    now: datetime,
    error: str | None = None,
) -> dict[str, Any]:
    """Mark a step ended in ``closeout`` and return its event row."""
    for step in closeout.steps:
        if step["name"] == name:
            step.update(state=state.value, exit_code=code, ended_at=iso(now))
            if error:
                step["error"] = error
    extra: dict[str, Any] = {"error": error} if error else {}
    return ledger.event_row(
        EventKind.CLOSEOUT_STEP_FINISHED,
        actor=ACTOR,
        now=now,
        run_id=closeout.run_id,
        step=name,
        state=state.value,
        exit_code=code,
        **extra,
    )


def _signal(process: subprocess.Popen[bytes], signum: int) -> str | None:
    """Signal the step's process group; None if sent or the group is gone. On any other
    error (EPERM) the step's own process is signalled instead; what still fails is
    returned, for the step's record, and the next tick tries again."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return None
    except OSError as exc:
        try:
            process.send_signal(signum)
        except OSError as again:
            return f"could not signal its process group ({exc}) or process ({again})"
        return f"could not signal its process group ({exc}); signalled the process only"
    return None
