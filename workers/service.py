"""The per-node worker service: lease → intent committed → supervised spawn → settle.

One ``WorkerService`` per node. Each ``tick``:

1. reads the report of every supervisor whose report has come in (its child's pid and
   start time) and writes each ``receipt.json``; the identities go into the ledger at
   the start of step 3's transaction, or in one of their own once they have waited
   ``identity_wait_seconds`` with nothing else to write; a supervisor that is still
   starting holds up nothing;
2. heartbeats (renews its leases, reports the node's live memory) when due;
3. in ONE write transaction: settles attempts whose supervisor has exited (from
   ``exit.json`` and the optional ``result.json``, read before it; a stale lease is
   refused before its settle writes anything, so it undoes nothing of the others; an
   attempt that would succeed has its declared outputs hashed and stored first, and
   recorded with its settle), then,
   with free slots and something changed, claims admissible jobs and writes their
   intents with the inputs each will be given (``ledger.claim_jobs``);
4. only after that commit fetches each claimed attempt's inputs, verifying every
   byte against its recorded sha256, and starts one supervisor per attempt
   (``python -I -S``, ``workers.supervisor.launch_argv``).

Between ticks ``serve`` waits on the supervisors' pidfds, so a slot is refilled the
moment its attempt ends. A job starts from a clean environment (``workers.jobenv``).

The service keeps the loop (tick, serve, heartbeat, sample, claim) and composes three
parts, each its own module: ``recovery`` (``workers.recovery``: what a restarted worker
does with the attempts its node's earlier workers left), ``spawning``
(``workers.spawning``: inputs, environment, launcher, receipts, identity) and
``finishing`` (``workers.finishing``: the verdict, OOM naming, the settle, capture).
What it holds per attempt in flight is in ``workers.flight``.

Crash windows are named by ``crash_point`` (``controller.crashpoints``: a test hook,
inert unless the ``LANEWAY_CRASH_POINT`` environment variable names the point).
"""

from __future__ import annotations

import os
import selectors
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from laneway.controller import db, identity, ledger
from laneway.controller.attempt import Judged
from laneway.controller.clock import Clock, SystemClock
from laneway.controller.crashpoints import crash_point
from laneway.controller.errors import CommitOutcomeUnknown, StaleLease
from laneway.controller.watch import ChangeWatch
from laneway.workers import oom as oom_watch
from laneway.workers import seams as platform_seams
from laneway.workers.finishing import Finishing
from laneway.workers.flight import InFlight, StageRules, measurements
from laneway.workers.gpu import GpuProbe, GpuReading, NvmlGpu
from laneway.workers.ports import free_ports
from laneway.workers.recovery import Recovery
from laneway.workers.run_checks import RunChecks
from laneway.workers.sampler import Sampler
from laneway.workers.spawning import (
    IDENTITY_WAIT_SECONDS,
    LAUNCHER_ENV,
    Launcher,
    Spawning,
    close_report_pipes,
)

MIB = 1024 * 1024


def psutil_memory() -> tuple[float, float]:
    """(available MiB, total MiB) of this machine, from psutil."""
    memory = psutil.virtual_memory()
    return memory.available / MIB, memory.total / MIB


@dataclass
class TickReport:
    claimed: int = 0
    settled: int = 0
    in_flight: int = 0
    outcomes: list[str] = field(default_factory=list)


class WorkerService:
    """The worker of one node. ``tick()`` is the loop body; ``serve()`` the loop."""

    def __init__(
        self,
        engine: Engine,
        *,
        node: str,
        slots: int,
        clock: Clock | None = None,
        lease_seconds: float = ledger.DEFAULT_LEASE_SECONDS,
        heartbeat_seconds: float = 2.0,
        rescan_seconds: float = 1.0,
        memory_probe: Callable[[], tuple[float, float]] = psutil_memory,
        gpu: GpuProbe | None = None,
        launch: bool = True,
        sample_seconds: float = 1.0,
        sample_flush_seconds: float = 5.0,
        runtime_dir: str | os.PathLike[str] | None = None,
        oom_counter: oom_watch.OomCounter | None = None,
        identity_wait_seconds: float = IDENTITY_WAIT_SECONDS,
    ) -> None:
        self.engine = engine
        self.runtime_dir = None if runtime_dir is None else str(Path(runtime_dir).resolve())
        """Where this worker keeps attempt directories (None: each run's own, as recorded
        when it was created); with workers on several machines, each machine's own."""
        self.factory = db.session_factory(engine)
        self.node = node
        self.slots = slots
        self.clock = clock or SystemClock()
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.rescan_seconds = rescan_seconds
        self.identity_wait_seconds = identity_wait_seconds
        """How long a supervisor's report may wait for the next settle or claim to carry
        its identity into the ledger before it is recorded in a transaction of its own."""
        self.memory_probe = memory_probe
        self._last_available: float | None = None
        """Free memory (MiB) at the last probe: evidence when an attempt is OOM-killed."""
        self._lowest: tuple[float, float] | None = None
        """(free MiB, monotonic time) of the lowest probe since the last heartbeat that
        reached the ledger: the heartbeat lowers the node's low-water mark with it."""
        self.oom_counter = oom_counter or oom_watch.OomCounter.of_this_process()
        """The OOM kill count of this worker's memory cgroup (tests point it elsewhere)."""
        self.sampler = Sampler(gpu or NvmlGpu())
        self.sample_seconds = sample_seconds
        self.sample_flush_seconds = sample_flush_seconds
        self._last_sample = float("-inf")
        self._last_flush = float("-inf")
        self._gpu_reading: GpuReading | None = None
        self._our_pids: set[int] = set()
        """The processes of our attempts' trees at the last sample (their GPU use is not
        the node's baseline)."""
        self.in_flight: dict[int, InFlight] = {}
        self.worker_id = ""
        self._last_heartbeat = float("-inf")
        self._last_claim = float("-inf")
        self._seen_event = -1
        """The newest event this worker's last claim read from (-1: none yet)."""
        self._own_events: list[int] = []
        """The events that claim wrote itself, after ``_seen_event``."""
        self._waiting_on_capacity = True
        """Ready work was refused at the last claim: look again each ``rescan_seconds``."""
        self.watch = ChangeWatch(engine)
        self._selector = selectors.DefaultSelector()
        # A worker dropped without ``stop`` (a test, an embedding program) still closes
        # the report pipes it never read, as ``stop`` does (``Spawning.close_reports``).
        weakref.finalize(self, close_report_pipes, self.in_flight)
        self._pidfds: dict[int, int] = {}
        self.launcher: Launcher | None = (
            Launcher() if launch and os.environ.get(LAUNCHER_ENV, "1") != "0" else None
        )
        """Forks supervisors (``workers.launcher``); None: each is started by exec."""
        self.launcher_error: str | None = None
        """Why the launcher was given up on, if it was (exec from then on)."""
        self.stages = StageRules()
        """Each stage's exit codes, capture, result rule and output cap, read once."""
        self.run_checks = RunChecks()
        """Each run's frozen sources and the variables its stages lack here, checked
        before a claim from the runs the previous claim saw (``workers.run_checks``)."""
        self.recovered: list[str] = []
        self.heartbeat_failures = 0
        self.last_sample_error: str | None = None
        self.last_heartbeat_error: str | None = None
        self.last_claim_race: str | None = None
        """Why the latest claim was rolled back (``ledger.ClaimRaced``); None: none was."""
        self.revoked: str | None = None
        """Why the ledger no longer accepts this worker (it was declared lost), if so."""
        self.outage = db.Outage()
        """The ledger not answering: ticks in a row that failed, the last error."""
        self.on_ledger_error: Callable[[str], None] | None = None
        """Called with one line when the ledger stops answering (the CLI logs it)."""
        self.on_ledger_back: Callable[[int], None] | None = None
        """Called with the number of failed tries when it answers again."""
        self.recovery = Recovery(self)
        """Restart recovery: adopt, settle from exit records, or mark unknown."""
        self.spawning = Spawning(self)
        """Inputs, environment, launcher, receipts and identity of claimed attempts."""
        self.finishing = Finishing(self)
        """The verdict on what finished, OOM naming, the settle, capture."""

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> str:
        """Register this worker in the ledger and reconcile what earlier workers of this
        node left behind (``recover``; its lines land in ``self.recovered``). Returns the
        worker's id."""
        pid, start_time = identity.current()
        self.seams = platform_seams.current()
        seams = self.seams.as_dict()
        if self.launcher is None:
            seams["spawn"] = "exec"  # the launcher is switched off for this worker
        with db.transaction(self.factory) as session:
            self.worker_id = ledger.register_worker(
                session,
                node=self.node,
                host=identity.host(),
                pid=pid,
                boot_id=identity.boot_id(),
                process_start_time=start_time,
                slots=self.slots,
                now=db.ledger_now(session, self.clock),
                seams=seams,
            )
        # Reconcile before admitting: nothing is leased until what was left is settled.
        self.recovered = self.recover()
        return self.worker_id

    def recover(self) -> list[str]:
        """Reconcile what earlier workers of this node left behind, before leasing
        (``workers.recovery``): one line per attempt for the log."""
        return self.recovery.recover()

    def stop(self) -> None:
        """Record a clean exit (call after ``drain``) and let the launcher go. Identities
        read and not yet recorded go with it (a worker that leaves its attempts running
        leaves them recorded)."""
        self.spawning.read_reports()
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            identities = self.spawning.write_identities(session, now)
            ledger.stop_worker(session, self.worker_id, now=now)
        self.spawning.identities_recorded(identities)
        self.spawning.close_reports()
        self.watch.close()
        if self.launcher is not None:
            self.launcher.close()

    def drain(self, poll: float = 0.05, should_abort: Callable[[], bool] = lambda: False) -> None:
        """Settle every in-flight attempt, claiming nothing new."""
        while self.in_flight and not should_abort():
            try:
                self._settle_finished()
            except Exception as exc:
                if not self._ledger_failed(exc):
                    raise
                continue
            self._ledger_back()
            self._heartbeat_if_due()
            if self.in_flight:
                self.wait(poll)

    # -- the loop body -------------------------------------------------------

    def tick(self) -> TickReport:
        """Settle what finished and claim for the free slots; then start the claimed
        attempts' supervisors. Sampling and the heartbeat come after that when
        something finished (before it otherwise)."""
        report = TickReport()
        finished = self.finishing.finished()
        if not finished:
            self._periodic()
        free = self.slots - len(self.in_flight) + len(finished)
        claiming = (
            free > 0 and self.trusts_its_leases() and (bool(finished) or self._worth_claiming())
        )
        if finished or claiming:
            report.settled, report.outcomes, claims = self._settle_and_claim(
                finished, free if claiming else 0
            )
            report.claimed = len(claims)
            if claims:
                self.spawning.spawn_all(claims)
        else:
            self.spawning.record_due()
        if finished:
            self._periodic()  # after the refill: a freed slot never waits for it
        report.in_flight = len(self.in_flight)
        return report

    def _periodic(self) -> None:
        """Sampling and the heartbeat, each when due. A tick that has finished attempts
        runs them after it has settled and refilled their slots."""
        self._sample_if_due()
        self._heartbeat_if_due()

    def refill_due(self) -> bool:
        """Has a supervisor exited whose slot is still to be refilled? (A non-blocking
        poll of each in-flight supervisor; nothing is read from the ledger.) The
        foreground loop asks it between its periodic steps, so none of them lands
        between a child's exit and the next child's start."""
        return any(
            not flight.awaiting_report and flight.supervisor.poll() is not None
            for flight in self.in_flight.values()
        )

    def trusts_its_leases(self) -> bool:
        """False once no heartbeat has succeeded for ``lease_seconds``: the leases may
        have expired, so this worker must not take on new work until one succeeds."""
        if self.revoked is not None:
            return False
        return time.monotonic() - self._last_heartbeat < self.lease_seconds

    def _worth_claiming(self) -> bool:
        """Claim when an event was appended since the last claim, or every rescan period
        while ready work was refused (free memory changes without an event). The ledger
        is only asked when it changed (``ChangeWatch``: a stat, or a notification on
        PostgreSQL), so an idle worker costs almost nothing."""
        if self._waiting_on_capacity and time.monotonic() - self._last_claim >= self.rescan_seconds:
            return True
        if not self.watch.changed():
            return False
        if self._seen_event < 0:
            return True
        with db.reader(self.engine)() as session:
            latest, news = ledger.events_since(session, self._seen_event, self._own_events)
        if news is not None:
            return True
        if latest is not None:  # only the last claim's own events: nothing to claim from
            self._seen_event, self._own_events = latest, []
        return False

    def _sample_if_due(self) -> None:
        """Sample every in-flight attempt's tree each ``sample_seconds`` (and at once for
        one never sampled); write peaks to the ledger when they move or every
        ``sample_flush_seconds``, in one transaction for all attempts. An attempt's first
        sample is written with its second (or the flush): a short job has ended by then
        and its peaks go with its settle, so starting it costs no transaction."""
        # A flight whose supervisor has exited is about to be settled: sampling it would
        # only fall back to scanning every process on the machine for its markers (a
        # short job's supervisor has often exited since ``finished`` last polled it).
        flights = [
            f
            for f in self.in_flight.values()
            if not f.marked_unknown and not f.exited and f.supervisor.poll() is None
        ]
        now_mono = time.monotonic()
        first = {f.claim.attempt_id for f in flights if f.peaks.sampled_at is None}
        if not flights:
            self._our_pids = set()  # nothing of ours runs: all GPU use is the baseline
            return
        if now_mono - self._last_sample < self.sample_seconds and not first:
            return
        self._last_sample = now_mono
        reading = self._gpu_reading = self.sampler.read_gpu()
        samples = self.sampler.sample(
            [(f.claim.attempt_id, f.supervisor.pid, f.claim.attempt_dir) for f in flights],
            reading,
        )
        now = self.clock.now()
        self._our_pids = {pid for sample in samples.values() for pid in sample.pids}
        for flight in flights:
            sample = samples[flight.claim.attempt_id]
            flight.peaks.add(sample.rss_mib, sample.gpu_mib, sample.gpu_note, now)
        due = now_mono - self._last_flush >= self.sample_flush_seconds
        changed = [
            f for f in flights if due or (f.peaks.changed and f.claim.attempt_id not in first)
        ]
        if not changed:
            return
        try:
            with db.worker_transaction(self.factory) as session:
                for flight in changed:
                    ledger.record_samples(
                        session,
                        flight.claim.attempt_id,
                        fence=flight.claim.fence,
                        **measurements(flight.peaks),
                    )
        except DBAPIError as exc:
            if not db.is_transient(exc):
                raise
            # Samples are evidence, not state: keep them in memory and write them with the
            # next flush (or the settle).
            self.last_sample_error = db.describe(exc)
            return
        for flight in changed:
            flight.peaks.changed = False
        self._last_flush = now_mono

    def _gpu_for_heartbeat(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        """Per device: index, uuid, total, used, ours (our attempts' processes on it, as
        last sampled) and the baseline used by processes that are not ours; and
        ``described`` (the file) when the devices are described, not measured."""
        reading = self._gpu_reading or self.sampler.read_gpu()
        self._gpu_reading = None
        if not reading.available:
            return None, reading.note
        ours_total = sum(f.peaks.current_gpu_mib or 0.0 for f in self.in_flight.values())
        used_total = sum(d.used_mib for d in reading.devices)
        found = []
        for d in reading.devices:
            if d.process_mib:
                ours = sum(mib for pid, mib in d.process_mib.items() if pid in self._our_pids)
            else:
                # No per-device figures: our use spread over devices as their use is.
                ours = ours_total * d.used_mib / used_total if used_total else 0.0
            entry: dict[str, Any] = {
                "index": d.index,
                "uuid": d.uuid,
                "total_mib": round(d.total_mib, 1),
                "used_mib": round(d.used_mib, 1),
                "ours_mib": round(ours, 1),
                "baseline_mib": round(max(0.0, d.used_mib - ours), 1),
            }
            if reading.described:
                entry["described"] = reading.described
            found.append(entry)
        return found, None

    def _heartbeat_if_due(self) -> None:
        if time.monotonic() - self._last_heartbeat < self.heartbeat_seconds:
            return
        available, total = self.memory_probe()
        self._probed(available)
        gpus, gpu_note = self._gpu_for_heartbeat()
        lowest = self._lowest
        try:
            with db.worker_transaction(self.factory) as session:
                now = db.ledger_now(session, self.clock)
                ledger.heartbeat(
                    session,
                    self.worker_id,
                    now=now,
                    lease_seconds=self.lease_seconds,
                    mem_available_mib=available,
                    mem_total_mib=total,
                    gpus=gpus,
                    gpu_note=gpu_note,
                    mem_low_mib=lowest[0] if lowest else None,
                    mem_low_at=(
                        now - timedelta(seconds=time.monotonic() - lowest[1]) if lowest else None
                    ),
                    running_runs={f.claim.run_id for f in self.in_flight.values()},
                )
        except (DBAPIError, CommitOutcomeUnknown) as exc:
            if not (db.is_transient(exc) or isinstance(exc, CommitOutcomeUnknown)):
                raise
            # The ledger is unreachable or locked for now: keep supervising, retry on the
            # next tick; past lease_seconds, trusts_its_leases() stops new claims.
            self.heartbeat_failures += 1
            self.last_heartbeat_error = db.describe(exc)
            return
        except StaleLease as exc:
            # The controller declared this worker lost: it may write nothing more.
            self.revoked = str(exc)
            return
        self._last_heartbeat = time.monotonic()
        self._lowest = None

    def _probed(self, available: float) -> None:
        """Keep a free-memory probe: the latest for OOM evidence, the lowest since the
        last heartbeat for the node's low-water mark."""
        self._last_available = available
        if self._lowest is None or available < self._lowest[0]:
            self._lowest = (available, time.monotonic())

    # -- claim and spawn -----------------------------------------------------

    def _settle_and_claim(
        self, finished: list[tuple[int, InFlight]], free: int
    ) -> tuple[int, list[str], list[ledger.Claim]]:
        """Settle every finished attempt (a stale one is refused before it writes, and the
        others stand: ``ledger.refused_before_writing``), then lease work for ``free``
        slots and write its intents. Exit records and source files are read before the
        transaction begins.

        On SQLite both happen in one transaction. On PostgreSQL the settle commits first
        in a ``db.worker_transaction`` and the claim follows in a
        ``db.claim_transaction`` (the node's lock, the gate shared with other workers,
        the order lock only at its end), so the machines' claims and settles run beside
        each other (docs/deploy.md)."""
        settling = len(finished)
        classified = self.finishing.judge_all(finished)
        sources = self.run_checks.before_claim() if free > 0 else {}
        available = self.memory_probe()[0] if free > 0 else None
        if available is not None:
            self._probed(available)
        if finished:
            crash_point("worker_before_settle")
        late = free > 0 and not db.is_sqlite(self.engine)
        outcomes: list[str] = []
        settled_failures: list[InFlight] = []
        identities: list[InFlight] = []
        if late and finished:
            with db.worker_transaction(self.factory) as session:
                identities = self.spawning.write_identities(
                    session, db.ledger_now(session, self.clock)
                )
                outcomes, settled_failures = self._settle(session, classified)
            self.spawning.identities_recorded(identities)
            self._settled(finished, classified, settled_failures)
            finished = []
        elif late:
            # Identities go in their own transaction when due, or with the next settle.
            self.spawning.record_due()
        claims: list[ledger.Claim] = []
        looked: tuple[int, list[int]] | None = None
        writing = (
            db.claim_transaction(self.factory, node=self.node)
            if late
            else db.worker_transaction(self.factory)
        )
        try:
            with writing as session:
                if not late:
                    identities = self.spawning.write_identities(
                        session, db.ledger_now(session, self.clock)
                    )
                if finished:
                    outcomes, settled_failures = self._settle(session, classified)
                if free > 0:
                    now = db.ledger_now(session, self.clock)
                    seen: dict[str, Any] = {}
                    claims = ledger.claim_jobs(
                        session,
                        worker_id=self.worker_id,
                        node=self.node,
                        free_slots=free,
                        mem_available_mib=available,
                        now=now,
                        lease_seconds=self.lease_seconds,
                        source_problems=sources,
                        check_sources=self.run_checks.check_sources,
                        pick_ports=free_ports,
                        seen=seen,
                        runtime_dir=self.runtime_dir,
                        lacking_for=self.run_checks.lacking_for,
                    )
                    self.run_checks.saw(seen.get("runs", {}))
                    self._waiting_on_capacity = seen.get("candidates", 0) > len(claims)
                    for claim in claims:
                        self.stages.remember(session, claim)
                    # What this claim has seen: on SQLite, whose write lock it holds, the
                    # ledger's newest event. On PostgreSQL another worker may commit an
                    # event after the claim read (a job it made ready), so: the newest
                    # when the claim began, and the events it wrote itself.
                    written = ledger.flush_events(session)
                    before = db.events_before(session)
                    looked = (
                        (before, ledger.written_events(session))
                        if before is not None
                        else (
                            written if written is not None else ledger.latest_event_id(session),
                            [],
                        )
                    )
        except ledger.ClaimRaced as exc:
            # PostgreSQL only: another worker stopped a run this claim started a job of
            # before the claim's order lock (ledger.claim); nothing of it was written
            # (the settle committed apart), and the next tick claims again.
            if not late:
                raise
            self.last_claim_race = str(exc)
            claims = []
        if looked is not None:  # committed: what it was claimed from has been seen
            self._seen_event, self._own_events = looked
        if not late:
            self.spawning.identities_recorded(identities)
        if finished:
            self._settled(finished, classified, settled_failures)
        if free > 0:
            self._last_claim = time.monotonic()
            crash_point("worker_after_intent_commit")
        return settling, outcomes, claims

    def _settle(
        self, session: Session, classified: list[tuple[int, InFlight, Judged]]
    ) -> tuple[list[str], list[InFlight]]:
        now = db.ledger_now(session, self.clock)
        outcomes, settled_failures = self.finishing.settle(session, now, classified)
        if classified:
            crash_point("worker_mid_settle")  # inside the transaction: rolls back
        return outcomes, settled_failures

    def _settled(
        self,
        finished: list[tuple[int, InFlight]],
        classified: list[tuple[int, InFlight, Judged]],
        settled_failures: list[InFlight],
    ) -> None:
        """After the settle's commit: stop watching, capture failures' workspaces."""
        if any(judged.stored for _, _, judged in classified):
            crash_point("worker_after_outputs_recorded")
        for attempt_id, _ in finished:
            self._forget(attempt_id)
        for flight in settled_failures:
            self.finishing.capture(flight)  # after the commit: it cannot touch the outcome

    # -- settle --------------------------------------------------------------

    def _settle_finished(self) -> tuple[int, list[str]]:
        """Settle what finished, claiming nothing (draining)."""
        finished = self.finishing.finished()
        if not finished:
            self.spawning.record_due()
            return 0, []
        settled, outcomes, _ = self._settle_and_claim(finished, 0)
        return settled, outcomes

    def _track(self, attempt_id: int, flight: InFlight) -> None:
        """Watch a supervisor: its pidfd (or kqueue, the ``wait`` seam of
        ``workers.seams``) wakes ``wait`` the moment it exits. With neither (``poll``)
        the callers' bounded wait (``poll_seconds``) finds it."""
        self.in_flight[attempt_id] = flight
        how = platform_seams.current().wait
        try:
            if how == "pidfd":
                fd = os.pidfd_open(flight.supervisor.pid)
            elif how == "kqueue":
                fd = platform_seams.kqueue_exit_fd(flight.supervisor.pid)
            else:
                return
        except OSError:
            return  # already gone (poll() will see it): the poll interval
        if flight.supervisor.poll() is not None:
            os.close(fd)
            return
        self._pidfds[attempt_id] = fd
        self._selector.register(fd, selectors.EVENT_READ, attempt_id)

    def _forget(self, attempt_id: int) -> None:
        self.in_flight.pop(attempt_id, None)
        fd = self._pidfds.pop(attempt_id, None)
        if fd is not None:
            self._selector.unregister(fd)
            os.close(fd)

    def wait(self, timeout: float) -> None:
        """Sleep until a supervisor exits, the ledger notifies a commit (PostgreSQL) or
        ``timeout`` passes (a slot is refilled the moment its attempt ends, and new work
        is seen the moment it is committed, not at the next poll). Where the ``wait``
        seam is ``poll`` nothing wakes it on an exit: ``serve`` and ``drain`` pass a
        short ``timeout`` (``poll_seconds``), the bound on how late an exit is seen."""
        self.watch.wait(timeout, self._selector)

    # -- the loop ------------------------------------------------------------

    def serve(self, should_stop: Callable[[], bool], poll_seconds: float = 0.05) -> None:
        """Tick until ``should_stop()``. Between ticks it waits on its supervisors'
        pidfds and the ledger's notifications, at most ``poll_seconds`` (``wait``). The
        caller drains (``drain``) or leaves."""
        while not should_stop() and self.revoked is None:
            try:
                report = self.tick()
            except Exception as exc:
                if not self._ledger_failed(exc):
                    raise
                continue
            self._ledger_back()
            if not report.claimed and not report.settled:
                self.wait(poll_seconds)

    def _ledger_failed(self, error: Exception) -> bool:
        """A tick failed: if the ledger is unreachable, locked past its timeout or
        refusing writes (``db.is_transient``; or a commit whose outcome is unknown), note
        it, back off (tenacity's exponential backoff with jitter) and return True so the
        loop tries again. Running attempts stay under their supervisors; what finished is
        settled when the ledger answers, and no new work is claimed once no heartbeat
        has succeeded for a lease period (``trusts_its_leases``). Any other error: False.

        Retrying is safe: a transient failure rolled its transaction back, and after a
        commit that may have landed, every settle is a compare-and-set on the attempt's
        state and fence, so it cannot be recorded twice; a claim that did land but was
        never spawned keeps its intent, expires, and becomes unknown (never run twice).
        """
        pause = self.outage.failed(error, self.on_ledger_error)
        if pause is None:
            return False
        self.wait(pause)
        return True

    def _ledger_back(self) -> None:
        self.outage.back(self.on_ledger_back)

    @property
    def ledger_failures(self) -> int:
        """Consecutive ticks that failed because the ledger did not answer."""
        return self.outage.failures
