"""Closeout: a run's configured steps (aggregate, report, ...) run once when the run
finishes, or when it is stopped and drained.

The controller drives it without blocking its tick: each tick polls the running step,
enforces its timeout (TERM then KILL to its process group), records the result, and
starts the next step. Every step is attempted even if an earlier one failed. Progress is
in the ledger (``closeout_step_started`` / ``closeout_step_finished`` /
``closeout_finished`` events) and in ``runs/<run>/closeout_progress.json``, written
atomically after every change. A step that was running when the controller died is
recorded as ``interrupted`` and not run again (nothing runs twice without an operator).

A step is started and watched by the rules a job's supervisor follows
(``workers/supervisor.py``), here in the controller (which does not import ``workers``):

- its environment is built as a job's (``controller.environment``): ``BASE_ENV`` and
  ``LC_*`` of the controller's, plus ``LANEWAY_RUN_ID`` and ``LANEWAY_RUN_DIR``; none of
  the controller's other variables (its ledger URL with a password, cloud keys);
- its stdout and stderr go through the redactor (``controller.redact``) into its log:
  the secrets of the run's stages, as the controller's environment resolves them, and
  the passwords in the controller's ``LANEWAY_*`` URLs, are masked;
- its process group is its own: past its timeout it gets TERM, then KILL after
  ``GRACE_SECONDS``; when its first process exits, what is left of its group is stopped
  the same way; the step is recorded only once its group is gone and its output read.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from laneway.controller import environment, ledger
from laneway.controller.clock import iso
from laneway.controller.config import CloseoutStep, PipelineConfig, render_closeout
from laneway.controller.durable import make_private_dir, open_private, write_json
from laneway.controller.models import Attempt, Control, Event, Run
from laneway.controller.process_group import group_alive
from laneway.controller.redact import Redactor
from laneway.controller.states import AttemptState, ControlKind, EventKind, RunState, StepState

ACTOR = "controller"
GRACE_SECONDS = 5.0
"""From TERM to KILL of a step's process group."""
DRAIN_SECONDS = 2.0
"""After the group is gone, how long to keep reading output held open by an escapee."""
READ_SIZE = 65536
STOP_READS = 16
"""Reads of output still arriving after the pump was told to stop, at most."""


class _LogPump:
    """Copies a step's output (one pipe for stdout and stderr) into its log through the
    redactor, on a thread of its own: the controller's tick never blocks on a step, and a
    step writing faster than ticks never blocks on a full pipe."""

    def __init__(self, pipe: int, log: int, secrets: list[str]) -> None:
        self.pipe = pipe
        self.log = log
        self.redactor = Redactor(secrets)
        self.last_output = time.monotonic()
        self.error: str | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="closeout-log", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop reading (what is already in the pipe is still read), flush and close."""
        self._stop.set()
        self.thread.join()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.pipe, selectors.EVENT_READ)
        after_stop = 0
        try:
            while after_stop < STOP_READS:
                ready = selector.select(timeout=0.1)
                try:
                    data = os.read(self.pipe, READ_SIZE) if ready else b""
                except OSError as exc:
                    self.error = f"could not read its output: {exc.strerror or exc}"
                    break
                if ready and not data:
                    break  # end of output: every writer closed the pipe
                if self._stop.is_set():
                    # An escapee still writing must not hold the controller's tick.
                    after_stop += 1 if data else STOP_READS
                if data:
                    self.last_output = time.monotonic()
                    self._write(self.redactor.feed(data))
            self._write(self.redactor.flush())
        finally:
            selector.close()
            os.close(self.pipe)
            os.close(self.log)

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.log, view) :]
        except OSError as exc:
            # Keep draining the pipe (the step must not block), but say so in the record.
            self.error = f"could not write its log: {exc.strerror or exc}"


@dataclass
class _Running:
    name: str
    process: subprocess.Popen[bytes]
    pump: _LogPump
    deadline: float
    timed_out: bool = False
    leftovers: bool = False
    kill_at: float | None = None
    group_gone_at: float | None = None
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
    ledger.flush_events(session)
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
        code = _watch(current)
        if code is None:
            return False
        state = (
            StepState.TIMED_OUT
            if current.timed_out
            else (StepState.SUCCEEDED if code == 0 else StepState.FAILED)
        )
        errors = [e for e in (current.signal_error, current.pump.error) if e]
        if current.leftovers:
            errors.append("processes of its group outlived it and were stopped")
        record([_finish(closeout, current.name, state, code, now=now, error="; ".join(errors))])
        closeout.running = None
        changed = True
    pending = [step for step in closeout.steps if step["state"] == StepState.PENDING]
    if pending:
        step = pending[0]
        spec = next(s for s in config.closeout if s.name == step["name"])
        record([_event(EventKind.CLOSEOUT_STEP_STARTED, run_id=run.id, now=now, step=step["name"])])
        step.update(state=StepState.RUNNING.value, started_at=iso(now))
        try:
            process, pump = _spawn(spec, Path(step["log"]), run, closeout.directory, config)
        except Exception as exc:
            # Recorded as the step's failure, and the next step is still attempted: a
            # bad step must never stop the controller's tick.
            record(
                [_finish(closeout, step["name"], StepState.FAILED, None, now=now, error=_why(exc))]
            )
            return True
        closeout.running = _Running(
            step["name"], process, pump, time.monotonic() + spec.timeout_seconds
        )
        return True
    if closeout.running is None and not closeout.done:
        closeout.done = True
        steps = {s["name"]: s["state"] for s in closeout.steps}
        record([_event(EventKind.CLOSEOUT_FINISHED, run_id=run.id, now=now, steps=steps)])
        return True
    return changed


def _watch(current: _Running) -> int | None:
    """One look at a running step, as a supervisor watches a job: TERM to its group past
    the deadline, or to what is left of the group once its first process exited; KILL
    after the grace. Returns the step's exit code once its group is gone and its output
    read (or given up on after ``DRAIN_SECONDS`` of silence), else None."""
    now = time.monotonic()
    code = current.process.poll()
    alive = code is None or group_alive(current.process.pid, zombies_count=False)
    if current.kill_at is None and alive:
        if code is None and now >= current.deadline:
            current.timed_out = True
        elif code is not None:
            current.leftovers = True
        if current.timed_out or current.leftovers:
            current.signal_error = _signal(current.process, signal.SIGTERM)
            current.kill_at = now + GRACE_SECONDS
    elif current.kill_at is not None and now >= current.kill_at and alive:
        current.signal_error = _signal(current.process, signal.SIGKILL)
    if code is None or alive:
        return None
    if current.pump.thread.is_alive():
        if current.group_gone_at is None:
            current.group_gone_at = now
        if now - max(current.group_gone_at, current.pump.last_output) <= DRAIN_SECONDS:
            return None
    current.pump.stop()
    return code


def step_environment(run: Run, directory: Path, environ: dict[str, str]) -> dict[str, str]:
    """What a step starts with: a job's clean base (``environment.inherited``) and the
    run's id and directory; nothing else of the controller's environment."""
    return {
        **environment.inherited(environ),
        "LANEWAY_RUN_ID": str(run.id),
        "LANEWAY_RUN_DIR": str(directory),
    }


def step_secrets(config: PipelineConfig, environ: dict[str, str]) -> list[str]:
    """What is redacted from a step's log: the secrets of every stage of the run (a step
    aggregates what the jobs left, and may find them there), and the passwords in the
    controller's ``LANEWAY_*`` URLs."""
    secrets = environment.credentials(environ)
    for stage in config.stages:
        secrets += environment.stage_secrets(stage, environ)
    return secrets


def _spawn(
    spec: CloseoutStep, log_path: Path, run: Run, directory: Path, config: PipelineConfig
) -> tuple[subprocess.Popen[bytes], _LogPump]:
    """Render and start one step (argv[0] and cwd were made absolute against the
    config file when it was loaded; the default cwd is ``runs/<run>/``), with the pump
    that writes its redacted output to its log."""
    argv, cwd = render_closeout(spec, run_id=run.id, runtime_dir=run.runtime_dir)
    environ = dict(os.environ)
    make_private_dir(log_path.parent)
    log = open_private(log_path, "ab")
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd or str(directory),
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=write_end,
            start_new_session=True,
            env=step_environment(run, directory, environ),
        )
    except BaseException:
        os.close(read_end)
        log.close()
        raise
    finally:
        os.close(write_end)
    # The pump owns both descriptors from here (it closes them when the output ends).
    pump = _LogPump(read_end, os.dup(log.fileno()), step_secrets(config, environ))
    log.close()
    return process, pump


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
    return _event(
        EventKind.CLOSEOUT_STEP_FINISHED,
        run_id=closeout.run_id,
        now=now,
        step=name,
        state=state.value,
        exit_code=code,
        **extra,
    )


def _event(kind: EventKind, *, run_id: int, now: datetime, **detail: Any) -> dict[str, Any]:
    """One closeout event row (``ledger.event_row``): the closeout writes as ``ACTOR``."""
    return ledger.event_row(kind, actor=ACTOR, now=now, run_id=run_id, **detail)


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
