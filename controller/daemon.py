"""The controller daemon. ``Controller.tick(now)`` is the loop body; ``serve`` the loop.

Each tick, in one transaction: mark workers whose heartbeat stopped as lost; handle
expired leases (settle the attempt from its exit record, or mark it unknown); for every
active run, promote waiting jobs whose needs succeeded (or skip them when a need did
not) and close the run when every job is terminal. Then write the derived
``runs/<run>/status.json`` snapshot (and ``SUMMARY.json`` at close).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from controller import closeout, db, ledger, pipeline
from controller.clock import Clock, SystemClock
from controller.crashpoints import crash_point
from controller.durable import read_json, write_json
from controller.models import Attempt, Job
from controller.outcome import read_outcome
from controller.status import build_status
from workers import identity

ACTOR = "controller"
PIDFILE = "controller.pid"


@dataclass
class ControllerReport:
    promoted: int = 0
    closed: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    expired: list[int] = field(default_factory=list)


class Controller:
    def __init__(
        self,
        engine: Engine,
        *,
        clock: Clock | None = None,
        snapshot_seconds: float = 1.0,
        lost_after_seconds: float = 30.0,
    ) -> None:
        self.engine = engine
        self.lost_after_seconds = lost_after_seconds
        self.factory = db.session_factory(engine)
        self.clock = clock or SystemClock()
        self.snapshot_seconds = snapshot_seconds
        self._last_snapshot: dict[int, tuple[int, float]] = {}
        self._snapshot_errors: dict[int, str] = {}
        self._closeouts: dict[int, closeout.Closeout] = {}

    def tick(self, now: datetime | None = None) -> ControllerReport:
        now = now or self.clock.now()
        report = ControllerReport()
        with db.transaction(self.factory) as session:
            report.lost = ledger.mark_lost_workers(
                session, now=now, lost_after=self.lost_after_seconds, actor=ACTOR
            )
            report.expired = ledger.expire_leases(
                session, now=now, actor=ACTOR, settle=_settle_from_exit_record
            )
            run_ids = ledger.active_run_ids(session)
            for run_id in run_ids:
                report.promoted += ledger.promote_run(session, run_id, now=now, actor=ACTOR)
                if ledger.close_run_if_done(session, run_id, now=now, actor=ACTOR):
                    report.closed.append(run_id)
                    # Invariant 12 "and at the end": a change during the run is recorded.
                    drift = pipeline.source_drift(ledger.get_run(session, run_id).source_hashes)
                    if drift:
                        ledger.append_event(
                            session,
                            "sources_changed",
                            actor=ACTOR,
                            now=now,
                            run_id=run_id,
                            problems=drift,
                        )
                else:
                    report.active.append(run_id)
            crash_point("controller_mid_tick")  # inside the transaction: rolls back
        for run_id in run_ids:
            self.write_snapshots(run_id, now=now, final=run_id in report.closed)
        self._advance_closeouts(now)
        return report

    def closeout_pending(self, run_id: int) -> bool:
        """Is the run's closeout started and not yet finished, or due?"""
        if run_id in self._closeouts:
            return True
        with db.reader(self.engine)() as session:
            run = ledger.get_run(session, run_id)
            return closeout.needs_closeout(session, run)

    def _advance_closeouts(self, now: datetime) -> None:
        """Start, poll and record closeout steps of finished or stopped runs."""
        with db.transaction(self.factory) as session:
            for run in ledger.closeout_candidates(session):
                if run.id not in self._closeouts:
                    if not closeout.needs_closeout(session, run):
                        continue
                    self._closeouts[run.id] = closeout.load(session, run)
                state = self._closeouts[run.id]
                if closeout.advance(session, state, run, now=now):
                    try:
                        closeout.write_progress(state)
                    except OSError as exc:
                        ledger.append_event(
                            session,
                            "snapshot_failed",
                            actor=ACTOR,
                            now=now,
                            run_id=run.id,
                            error=f"{exc.strerror or exc}",
                            file="closeout_progress.json",
                        )
                if state.done:
                    del self._closeouts[run.id]

    def write_snapshots(self, run_id: int, *, now: datetime, final: bool = False) -> None:
        """Write status.json (and SUMMARY.json when ``final``) if the ledger changed."""
        with db.reader(self.engine)() as session:
            latest = ledger.latest_event_id(session)
            seen, at = self._last_snapshot.get(run_id, (-1, float("-inf")))
            fresh = latest == seen or time.monotonic() - at < self.snapshot_seconds
            if fresh and not final:
                return
            run = ledger.get_run(session, run_id)
            status = build_status(session, run, now=now)
        directory = Path(run.runtime_dir) / "runs" / str(run_id)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_json(directory / "status.json", status)
            if final:
                write_json(directory / "SUMMARY.json", _summary(status))
        except OSError as exc:
            # A derived snapshot failing is its own diagnostic: it never stops the tick
            # and never touches an outcome. Recorded once per distinct error.
            message = f"{exc.strerror or exc}"
            if self._snapshot_errors.get(run_id) != message:
                self._snapshot_errors[run_id] = message
                with db.transaction(self.factory) as session:
                    ledger.append_event(
                        session,
                        "snapshot_failed",
                        actor=ACTOR,
                        now=now,
                        run_id=run_id,
                        error=message,
                        final=final,
                    )
            return
        self._snapshot_errors.pop(run_id, None)
        self._last_snapshot[run_id] = (latest, time.monotonic())

    def serve(self, should_stop: Callable[[], bool], interval: float = 0.25) -> None:
        while not should_stop():
            self.tick()
            time.sleep(interval)


def _settle_from_exit_record(session: Session, attempt: Attempt, now: datetime) -> bool:
    """For an attempt whose lease expired: settle it if its exit record establishes the
    outcome (the process finished; only the settle was lost). True if settled."""
    run = ledger.get_run(session, attempt.run_id)
    job = session.get(Job, attempt.job_id)
    assert job is not None
    stage = ledger.run_config(run).stage(job.stage)
    verdict, exit_record, result = read_outcome(
        attempt.attempt_dir,
        job_id=attempt.job_id,
        exit_codes=dict(stage.exit_codes),
        missing_exit="no exit.json",
    )
    if verdict.outcome is None:
        return False
    ledger.settle_from_verdict(
        session,
        attempt.id,
        fence=attempt.fence,
        verdict=verdict,
        exit_record=exit_record,
        result=result,
        actor=ACTOR,
        now=now,
        revoke=True,
        reason_suffix=" (settled by the controller after its lease expired)",
    )
    return True


def running_controller(runtime_dir: Path) -> int | None:
    """The pid of the live controller of this runtime dir, from its pidfile, if any.

    The pidfile holds (boot id, pid, start time): a recycled pid is not mistaken for it.
    """
    try:
        record = read_json(Path(runtime_dir) / PIDFILE)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("boot_id") != identity.boot_id():
        return None
    pid = record.get("pid")
    if isinstance(pid, int) and identity.same_process(pid, record.get("start_time")):
        return pid
    return None


_controller_lock: list[int] = []


def hold_controller_lock(runtime_dir: Path) -> bool:
    """Take the runtime dir's controller lock for the rest of this process's life.
    False if another process holds it (flock: atomic, and freed by the kernel when the
    holder dies, even by SIGKILL)."""
    fd = os.open(Path(runtime_dir) / "controller.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _controller_lock.append(fd)
    return True


def claim_pidfile(runtime_dir: Path) -> None:
    """Record this process as the runtime dir's controller."""
    pid, start_time = identity.current()
    write_json(
        Path(runtime_dir) / PIDFILE,
        {"pid": pid, "start_time": start_time, "boot_id": identity.boot_id()},
    )


def release_pidfile(runtime_dir: Path) -> None:
    """Remove the pidfile if it is still ours."""
    if running_controller(runtime_dir) == os.getpid():
        (Path(runtime_dir) / PIDFILE).unlink(missing_ok=True)


def start_background_controller(runtime_dir: Path) -> int:
    """Start ``laneway controller`` detached (own session), logging to controller.log.

    posix_spawn, not Popen: nothing here waits for it, and it must outlive this process.
    """
    runtime_dir = Path(runtime_dir).resolve()
    log = str(runtime_dir / "controller.log")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    argv = [sys.executable, "-m", "cli.main", "controller", "--runtime-dir", str(runtime_dir)]
    return os.posix_spawn(
        sys.executable,
        argv,
        dict(os.environ),
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, log, flags, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ],
        setsid=True,
    )


def _summary(status: dict[str, object]) -> dict[str, object]:
    keys = ("run", "totals", "jobs", "outcomes", "throughput", "unknown", "controls")
    return {key: status[key] for key in keys}
