"""``laneway run`` in the foreground: one process that is the controller (when it holds
the runtime dir's controller lock) and one local worker per node, until the run is
finished, blocked or interrupted.

The loop ticks the controller and the workers, looks at the run's status now and then,
rides out a ledger that stops answering (what runs keeps running under its
supervisors), drains the workers, waits for the run's closeout and says how it ended:
a ``ForegroundResult`` with the exit code and the lines that tell the operator how to go
on. The CLI parses, calls ``ForegroundRun.start`` (or ``resume``) and ``run``, and renders; the live
display is passed in as an ``Observer`` (``cli/live.py``'s ``Progress`` is one), so
nothing here imports ``cli/``.

A front end's loop over the services it drives: the controller daemon, and the local
workers, which the caller makes (``make_worker``: ``workers.service.WorkerService``), so
nothing in ``controller/`` imports ``workers/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laneway.controller import advice, controller_lock, db, ledger, ledger_open, pipeline
from laneway.controller import daemon as daemon_module
from laneway.controller.codes import OPERATOR_LIFTS, RefusalCode, StepCode
from laneway.controller.errors import LedgerUnavailable, UsageError
from laneway.controller.rows import Rows, SessionRows
from laneway.controller.states import RunState
from laneway.controller.status import build_status
from laneway.controller.status_model import StatusReport

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from laneway.controller.config import PipelineConfig

EXIT_BLOCKED = 3
EXIT_INTERRUPTED = 130
PERIODIC_DEFER_SECONDS = 0.5
"""The longest the controller's periodic steps are put off for slots to refill."""
LOOK_SECONDS = 1.0
"""How often the loop builds the run's whole status (progress, blocked reasons)."""
PROBE_SECONDS = 0.1
"""How often, when nothing moved here, the loop reads whether its run finished."""
BLOCKING_CODES = OPERATOR_LIFTS
"""Idle-reason codes (controller/admission.py) only an operator lifts."""


class Ticked(Protocol):
    """What one worker tick did (``workers.service.TickReport``)."""

    @property
    def claimed(self) -> int: ...
    @property
    def settled(self) -> int: ...


class LocalWorker(Protocol):
    """A worker service this process runs (``workers.service.WorkerService``)."""

    @property
    def in_flight(self) -> Mapping[int, object]:
        """The attempts it supervises now, by id."""

    def start(self) -> str:
        """Register, recover what a previous process left; the worker's id."""

    def tick(self) -> Ticked:
        """Settle what finished, claim and spawn what fits."""

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout``, woken early when a supervisor exits."""

    def refill_due(self) -> bool:
        """Has a supervisor exited whose slot is still to be refilled?"""

    def drain(self, poll: float = ..., should_abort: Callable[[], bool] = ...) -> None:
        """Claim nothing more; wait for what runs to settle (or ``should_abort``)."""

    def stop(self) -> None:
        """Record that it stopped."""


MakeWorker = Callable[..., LocalWorker]
"""``make_worker(engine, node=NAME, slots=N)``: a local worker for one node."""


class Observer(Protocol):
    """What the loop reports to while it runs (``cli.live.Progress``)."""

    def show(self, status: StatusReport, source: Rows | None = None) -> None:
        """The run's status, read inside the transaction ``source`` reads in."""

    def note(self, line: str) -> None:
        """One line about the loop itself (the ledger away and back)."""

    def closeout_running(self) -> None:
        """The jobs are done; the run's closeout runs (said once)."""

    def close(self) -> None:
        """The loop is over: the final status is printed next."""


class Ending(StrEnum):
    FINISHED = "finished"
    """Every job is terminal and the closeout (if any) is done."""
    BLOCKED = "blocked"
    """Nothing runs and nothing can start until an operator acts."""
    INTERRUPTED = "interrupted"
    """A signal stopped it before the run finished."""
    UNFINISHED = "unfinished"
    """It ended otherwise with the run not finished (a retry reopened it meanwhile)."""


@dataclass(frozen=True)
class Notice:
    """One line on how the run ended: ``event`` and ``fields`` for a JSON line, ``words``
    for a person."""

    event: str
    words: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunView:
    """What the loop decides on, read from one status (``read_view``)."""

    finished: bool
    unknown: int
    """Attempts whose outcome is unknown."""
    holds: tuple[tuple[str, str] | None, ...]
    """(code, words) of each lane that still has jobs to start; None: no reason recorded."""
    closeout_underway: bool
    """Its closeout is running, or about to (the run finished, the closeout pending)."""
    budget_spent: bool
    """The run's next step (``advice.run_next_step``) is its budget's: nothing more fits."""

    def blocked_reason(self) -> str | None:
        """Why a run with nothing in flight cannot progress without an operator, if so."""
        if self.unknown:
            return f"{self.unknown} unknown attempt(s) await `laneway reconcile`"
        if self.holds and all(h is not None and h[0] in BLOCKING_CODES for h in self.holds):
            return "; ".join(sorted({h[1] for h in self.holds if h}))
        return None


def read_view(status: StatusReport) -> RunView:
    """The loop's decisions from ``status``: whether the run finished, what holds its
    lanes, its closeout and its budget."""
    finished = status.run.state == RunState.FINISHED
    closeout = status.closeout.state
    return RunView(
        finished=finished,
        unknown=len(status.unknown),
        holds=tuple(
            None if lane.reason is None else (lane.reason.code, lane.reason.words)
            for lane in status.lanes
            if lane.pending
        ),
        closeout_underway=closeout == "running" or (closeout == "pending" and finished),
        budget_spent=_step_code(status) == RefusalCode.BUDGET,
    )


def _step_code(status: StatusReport) -> StepCode | RefusalCode | str | None:
    step = advice.run_next_step(status)
    return None if step is None else step.code


@dataclass(frozen=True)
class ForegroundResult:
    """How a foreground run ended."""

    run_id: int
    ending: Ending
    blocked: str | None
    """Why it is blocked (``Ending.BLOCKED``)."""
    continue_command: str
    """The command that continues the run."""
    final: StatusReport
    """The run's status at the end, as ``laneway status`` shows it."""

    @property
    def finished(self) -> bool:
        return read_view(self.final).finished

    @property
    def exit_code(self) -> int:
        """0 finished, 3 blocked, 130 interrupted, 1 otherwise (cli/main.py's codes)."""
        if self.ending is Ending.BLOCKED:
            return EXIT_BLOCKED
        if self.finished:
            return 0
        return EXIT_INTERRUPTED if self.ending is Ending.INTERRUPTED else 1

    def notices(self) -> list[Notice]:
        """How it ended and how to go on; nothing when the run finished."""
        if self.finished:
            return []
        run_id = self.run_id
        said = []
        # The same next step `laneway status`, the live display and the web page show.
        step = advice.run_next_step(self.final)
        new_run = step is not None and step.code in advice.NEW_RUN_CODES
        if self.blocked:
            words = f"laneway: run {run_id} is blocked: {self.blocked}"
            fields: dict[str, Any] = {"run_id": run_id, "reason": self.blocked}
            if step is not None:
                fields["next_step"] = step.as_dict()
                if not new_run:  # a new run's step is said on its own line below
                    words += f"; next: {step.line()}"
            said.append(Notice("run_blocked", words, fields))
        if step is not None and step.code == RefusalCode.BUDGET:
            # Continuing would pause it again: only more budget lets it go on.
            reused = self.final.totals.get("succeeded", 0)
            words = (
                f"laneway: run {run_id} stopped at its budget; to go on, raise `budget` in "
                f"the config and start a new run with `{step.command}`: every job that "
                f"succeeded ({reused}) is reused, not run or paid for again"
            )
            fields = {"run_id": run_id, "command": step.command}
            said.append(Notice("run_budget_spent", words, fields))
        elif step is not None and step.code == StepCode.SOURCES_CHANGED:
            words = f"laneway: run {run_id} cannot go on: {step.line()}"
            fields = {"run_id": run_id, "command": step.command}
            said.append(Notice("run_sources_changed", words, fields))
        else:
            when = "once it is unblocked, " if self.blocked else ""
            command = self.continue_command
            words = f"laneway: run {run_id} is not finished; {when}continue it with: {command}"
            said.append(Notice("run_not_finished", words, {"run_id": run_id, "command": command}))
        return [Notice(n.event, n.words, {**n.fields, "message": n.words}) for n in said]


class ForegroundRun:
    """One run driven here: ``workers`` are this process's local workers (started), the
    controller's work is done here whenever this process holds the controller lock."""

    def __init__(
        self, engine: Engine, run_id: int, runtime_dir: Path, workers: Sequence[LocalWorker]
    ) -> None:
        self.engine = engine
        self.run_id = run_id
        self.runtime = runtime_dir.resolve()
        self.workers = list(workers)
        self.daemon = daemon_module.Controller(engine)

    @classmethod
    def start(
        cls,
        config: PipelineConfig,
        runtime_dir: Path,
        *,
        make_worker: MakeWorker,
        actor: str,
        new: bool = False,
        rerun: list[str] | None = None,
        reuse_despite: list[str] | None = None,
        config_path: Path | None = None,
    ) -> ForegroundRun:
        """Preflight ``config`` and freeze it into a new run (a refusal creates nothing),
        then start one local worker per node. Raises ``LanewayError``."""
        # The engine start_run opens after preflight is this process's one engine.
        run_id, engine = pipeline.start_run(
            config,
            runtime_dir=runtime_dir,
            actor=actor,
            new=new,
            rerun=rerun,
            reuse_despite=reuse_despite,
            config_path=config_path,
        )
        return cls._with_workers(engine, run_id, runtime_dir, config, make_worker)

    @classmethod
    def resume(
        cls, runtime_dir: Path, target: str | None, *, make_worker: MakeWorker
    ) -> ForegroundRun:
        """Continue the unfinished run ``target`` names (``run_to_continue``) with one
        local worker per node of its frozen config. Raises ``LanewayError``."""
        engine = ledger_open.open_existing_ledger(runtime_dir)
        run_id, frozen = run_to_continue(engine, target)
        return cls._with_workers(engine, run_id, runtime_dir, frozen, make_worker)

    @classmethod
    def _with_workers(
        cls,
        engine: Engine,
        run_id: int,
        runtime_dir: Path,
        config: PipelineConfig,
        make_worker: MakeWorker,
    ) -> ForegroundRun:
        workers = [make_worker(engine, node=n.name, slots=n.max_jobs) for n in config.nodes]
        for worker in workers:
            worker.start()
        return cls(engine, run_id, runtime_dir, workers)

    def run(
        self,
        observer: Observer,
        *,
        should_stop: Callable[[], bool],
        should_abort: Callable[[], bool],
    ) -> ForegroundResult:
        """Until the run finishes, is blocked or ``should_stop``; then drain the workers
        (``should_abort``: leave what runs under its supervisors), wait out the closeout
        and read the final status."""
        blocked = self._serve(observer, should_stop)
        for worker in self.workers:
            worker.drain(should_abort=should_abort)
            if not worker.in_flight:
                worker.stop()
        self._wait_for_closeout(observer, should_abort)
        # The notifier tells what this run ended in (finished, a budget stop) before
        # the process goes: a bounded wait, then the row says the controller stopped.
        try:
            self.daemon.close()
        except Exception as exc:
            # The ledger did not take the stop: the row then reads lost once its
            # heartbeat ages, which is what a stopped controller is to the workers.
            if not (db.is_transient(exc) or isinstance(exc, LedgerUnavailable)):
                raise
            observer.note(f"the ledger did not record the controller's stop ({exc})")
        controller_lock.release_controller_lock(self.runtime, self.engine)
        observer.close()
        final = self._status(db.session_factory(self.engine))
        if blocked:
            ending = Ending.BLOCKED
        elif read_view(final).finished:
            ending = Ending.FINISHED
        else:
            ending = Ending.INTERRUPTED if should_stop() else Ending.UNFINISHED
        return ForegroundResult(
            run_id=self.run_id,
            ending=ending,
            blocked=blocked,
            continue_command=pipeline.continue_command(self.run_id, self.runtime),
            final=final,
        )

    def _serve(self, observer: Observer, should_stop: Callable[[], bool]) -> str | None:
        """Tick until the run finishes (None), is blocked (why) or ``should_stop`` (None)."""
        # One controller per runtime dir: if another holds the lock, it closes the run and
        # runs its closeout; this loop only watches the ledger (and takes over if it can).
        try:
            own = controller_lock.hold_controller_lock(self.runtime, self.engine)
        except LedgerUnavailable:
            own = False  # looked at again in the loop, once the server answers
        blocked: str | None = None
        last_look = last_probe = float("-inf")
        last_periodic = time.monotonic()
        outage = db.Outage()
        while True:
            try:
                busy = False
                if own and self.daemon.controller_id is None:
                    self.daemon.beat()  # registered before the first claim
                # Slots first. The controller's steps, its heartbeat and the status look
                # are periodic: while a supervisor that exited meanwhile waits for its
                # slot to be refilled they are put off (PERIODIC_DEFER_SECONDS at most,
                # so a stream of short jobs cannot starve them).
                for worker in self.workers:
                    tick = worker.tick()
                    busy = busy or bool(tick.claimed or tick.settled)
                refill = any(worker.refill_due() for worker in self.workers)
                if not refill or time.monotonic() - last_periodic >= PERIODIC_DEFER_SECONDS:
                    last_periodic = time.monotonic()
                    if own:
                        self.daemon.beat()
                    if own and self.daemon.due():
                        report = self.daemon.tick()
                        busy = busy or bool(report.promoted or report.closed)
                    # The whole status (its cost grows with the run) at most every
                    # LOOK_SECONDS; in between, the run's own row says when it finished,
                    # whoever closed it.
                    probe = not busy and time.monotonic() - last_probe >= PROBE_SECONDS
                    if probe:
                        last_probe = time.monotonic()
                    if time.monotonic() - last_look > LOOK_SECONDS or (probe and self._finished()):
                        last_look = time.monotonic()
                        own = controller_lock.hold_controller_lock(self.runtime, self.engine)
                        with db.reader(self.engine)() as session:
                            snapshot = build_status(
                                session,
                                ledger.get_run(session, self.run_id),
                                now=self.daemon.clock.now(),
                            )
                            observer.show(snapshot, SessionRows(session))
                        view = read_view(snapshot)
                        if view.finished:
                            return None
                        in_flight = sum(len(w.in_flight) for w in self.workers)
                        blocked = view.blocked_reason() if in_flight == 0 else None
                if blocked or should_stop():
                    return blocked
                if not busy and not refill:
                    # A local supervisor's exit wakes this at once (its pidfd); new work
                    # from elsewhere is seen within the timeout.
                    if len(self.workers) == 1:
                        self.workers[0].wait(0.02)
                    else:
                        time.sleep(0.02)
            except Exception as exc:
                # The ledger is unreachable, locked past its timeout or refusing writes:
                # what runs keeps running under its supervisors; try again with backoff.
                pause = outage.failed(
                    exc,
                    lambda words: observer.note(f"the ledger is not answering ({words}); retrying"),
                )
                if pause is None:
                    raise
                self.daemon.ledger_away()  # no heartbeat is judged against the time away
                time.sleep(pause)
                continue
            outage.back(
                lambda tries: observer.note(f"the ledger answers again (after {tries} tries)")
            )

    def _wait_for_closeout(self, observer: Observer, should_abort: Callable[[], bool]) -> None:
        """Run the closeout here (holding the lock), or wait while another controller
        runs it; ``should_abort`` leaves at once."""
        noted = False
        while True:
            if controller_lock.hold_controller_lock(self.runtime, self.engine):
                self.daemon.tick()
                if not self.daemon.closeout_pending(self.run_id):
                    return
            elif not read_view(self._status(db.reader(self.engine))).closeout_underway:
                return
            if should_abort():
                return
            if not noted:
                observer.closeout_running()
                noted = True
            time.sleep(0.05)

    def _status(self, sessions: Callable[[], Session]) -> StatusReport:
        with sessions() as session:
            run = ledger.get_run(session, self.run_id)
            return build_status(session, run, now=self.daemon.clock.now())

    def _finished(self) -> bool:
        """One row: is the run finished in the ledger?"""
        with db.reader(self.engine)() as session:
            return ledger.get_run(session, self.run_id).state == RunState.FINISHED


def run_to_continue(engine: Engine, target: str | None) -> tuple[int, PipelineConfig]:
    """The unfinished run ``laneway run --continue [TARGET]`` means, and its frozen
    config: TARGET is a run id, or a config naming a pipeline with an unfinished run;
    none: the newest unfinished run."""
    from laneway.controller import config as config_module
    from laneway.controller.ids import parse_id

    with db.reader(engine)() as session:
        run_id = None if target is None else parse_id(target)
        if run_id is not None:
            run = ledger.get_run(session, run_id)
            if run.state != RunState.ACTIVE:
                raise UsageError(f"run {run.id} is finished; there is nothing to continue")
            return run.id, ledger.run_config(run)
        name = None
        if target is not None:
            name = config_module.load_config(Path(target)).name
        unfinished = ledger.unfinished_runs(session, name)
        if not unfinished:
            which = f"of pipeline {name!r} " if name else ""
            raise UsageError(
                f"the ledger holds no unfinished run {which}to continue; "
                "start one with `laneway run CONFIG`"
            )
        run = ledger.get_run(session, unfinished[0])
        return run.id, ledger.run_config(run)
