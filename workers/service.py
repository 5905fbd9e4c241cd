"""The per-node worker service: lease → intent committed → supervised spawn → settle.

One ``WorkerService`` per node. Each ``tick``:

1. records the identity of every supervisor whose report has come in (its child's pid
   and start time), all in one transaction, and writes each ``receipt.json``; a
   supervisor that is still starting holds up nothing;
2. heartbeats (renews its leases, reports the node's live memory) when due;
3. in ONE write transaction: settles attempts whose supervisor has exited (from
   ``exit.json`` and the optional ``result.json``, read before it, each settle in a
   savepoint so a stale lease undoes only its own; an attempt that would succeed has
   its declared outputs hashed and stored first, and recorded with its settle), then,
   with free slots and something changed, claims admissible jobs and writes their
   intents with the inputs each will be given (``ledger.claim_jobs``);
4. only after that commit fetches each claimed attempt's inputs, verifying every
   byte against its recorded sha256, and starts one supervisor per attempt
   (``python -I -S``, ``workers.supervisor.launch_argv``).

Between ticks ``serve`` waits on the supervisors' pidfds, so a slot is refilled the
moment its attempt ends. A job starts from a clean environment (``workers.jobenv``).

Crash windows are named by ``crash_point`` (``controller.crashpoints``: a test hook,
inert unless the ``LANEWAY_CRASH_POINT`` environment variable names the point).
"""

from __future__ import annotations

import json
import os
import select
import selectors
import socket
import subprocess
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import psutil
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from controller import db, durable, identity, ledger, oom, pipeline
from controller.attempt import Amend, Delivery, ExitRules, Judged, artifacts, judge_attempt
from controller.clock import Clock, SystemClock, iso
from controller.config import CaptureConfig
from controller.crashpoints import crash_point
from controller.durable import write_json
from controller.errors import CommitOutcomeUnknown, IllegalTransition, StaleLease
from controller.ledger import snapshot as ledger_snapshot
from controller.models import Job
from controller.outcome import Verdict
from controller.states import Outcome
from controller.watch import ChangeWatch
from workers import launcher as launcher_module
from workers import oom as oom_watch
from workers import supervisor as supervisor_module
from workers.capture import capture_workspace
from workers.gpu import GpuProbe, GpuReading, NvmlGpu
from workers.jobenv import SecretMissing, job_environment, secret_values, stage_secrets
from workers.ports import free_ports
from workers.sampler import Peaks, Sampler

MIB = 1024 * 1024
LAUNCHER_ENV = "LANEWAY_SUPERVISOR_LAUNCHER"
"""Set to 0 to start every supervisor by exec instead of forking it from the launcher."""


def psutil_memory() -> tuple[float, float]:
    """(available MiB, total MiB) of this machine, from psutil."""
    memory = psutil.virtual_memory()
    return memory.available / MIB, memory.total / MIB


@dataclass
class InFlight:
    claim: ledger.Claim
    supervisor: subprocess.Popen[bytes] | AdoptedSupervisor | LaunchedSupervisor
    exit_codes: dict[int, Outcome]
    marked_unknown: bool = False
    """Already unknown in the ledger (e.g. its receipt could not be saved): watched only
    to reap its supervisor; an operator reconciles it from the evidence."""
    peaks: Peaks = field(default_factory=Peaks)
    exited: bool = False
    """Its supervisor has exited (seen this tick): it is settled next, not sampled."""
    awaiting_report: bool = False
    """Started; its supervisor has not yet reported the child's identity."""
    secrets: list[str] = field(default_factory=list)
    """Values redacted from its result before the result reaches the ledger."""
    result_requirement: Literal["optional", "required"] = "optional"
    unrecorded_report: dict[str, Any] | None = None
    """Its supervisor's report, read but not yet in the ledger (the write failed)."""
    oom_kills_at_start: int | None = None
    """The worker cgroup's OOM kill count as it started (None: unknown; ``workers.oom``)."""
    free_before_exit: float | None = None
    """The node's free memory (MiB) at the worker's last probe before it saw the exit."""


class AdoptedSupervisor:
    """A supervisor this worker did not start: it outlived the worker that did. It is
    not our child, so it is watched by identity (pid + start time), not waited for."""

    def __init__(self, pid: int, start_time: int | None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while the supervisor lives; afterwards 0. Its exit status is not ours to
        know (``returncode`` stays None): exit.json is the record."""
        if identity.same_process(self.pid, self.start_time):
            return None
        return 0


class LaunchedSupervisor:
    """A supervisor forked by this worker's launcher (``workers.launcher``): not our
    child either, so watched by its pidfd; ``stdout`` is our end of its report pipe."""

    def __init__(self, pid: int, start_time: int | None, stdout: Any, attempt_dir: str) -> None:
        self.pid = pid
        self.start_time = start_time
        self.stdout = stdout
        self.returncode: int | None = None
        self._status = Path(attempt_dir) / launcher_module.STATUS_FILE
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None  # already gone (reaped): poll() reads its status
        if self._pidfd is not None and identity.process_start_time(pid) != start_time:
            os.close(self._pidfd)  # reaped, and the pid taken by another process since
            self._pidfd = None

    def poll(self) -> int | None:
        """None while it runs (one ``select`` on its pidfd: a long attempt costs no file
        reads); once it exited, the wait status the launcher recorded (written before it
        reaps, so the process stays visible until then); 0, with ``returncode`` None,
        when it is gone without one (the launcher died)."""
        if self.returncode is not None:
            return self.returncode
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], 0)
            if not ready:
                return None
        if self._recorded() or identity.same_process(self.pid, self.start_time):
            return self.returncode
        # Gone. The launcher writes the status before it reaps, so if it wrote one it is
        # there now (it may have landed between the two looks above).
        self._recorded()
        self._close()
        return 0 if self.returncode is None else self.returncode

    def _recorded(self) -> bool:
        """Read the status the launcher recorded, if it did (sets ``returncode``)."""
        try:
            self.returncode = int(json.loads(self._status.read_text())["returncode"])
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError):
            self.returncode = None  # unreadable: exited, status unknown
            return False
        self._close()
        return True

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Launcher:
    """This worker's supervisor launcher, started on first use and again if it died."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                launcher_module.launcher_argv(theirs.fileno()),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=[theirs.fileno()],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        finally:
            theirs.close()
        self.sock = ours
        # A worker dropped without ``stop`` (a test, an embedding program) still lets its
        # launcher go: closing our end makes it exit.
        self._finalizer = weakref.finalize(self, _release_launcher, ours, self.process)
        return ours

    def spawn(
        self, request: dict[str, Any], stdout_fd: int, stderr_fd: int
    ) -> tuple[int, int | None]:
        """Fork a supervisor for ``request``; its (pid, start time). OSError when the
        launcher cannot be reached (the caller falls back to exec)."""
        for attempt in (1, 2):
            sock = self.sock
            if sock is None or self.process is None or self.process.poll() is not None:
                sock = self._start()
            try:
                socket.send_fds(sock, [json.dumps(request).encode()], [stdout_fd, stderr_fd])
                reply = sock.recv(4096)
            except OSError:
                if attempt == 2:
                    raise
                self.close()
                continue
            if not reply:
                self.close()
                if attempt == 2:
                    raise ConnectionError("the supervisor launcher exited")
                continue
            answer = json.loads(reply)
            return int(answer["pid"]), answer.get("start_time")
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Let the launcher go (its supervisors run on)."""
        if self.sock is not None and self.process is not None:
            self._finalizer()
        self.sock = None
        self.process = None


def _release_launcher(sock: socket.socket, process: subprocess.Popen[bytes]) -> None:
    """Close our end of the launcher's socket (it exits on that) and reap it."""
    sock.close()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def find_supervisor(attempt_id: int, attempt_dir: str) -> tuple[int, int | None] | None:
    """A live supervisor of ``attempt_id`` found by its environment markers — for an
    attempt whose supervisor was started but whose identity never reached the ledger.
    Both the attempt id and its directory must match: ids repeat across ledgers."""
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if "workers.supervisor" not in cmdline:
            continue
        try:
            environ = process.environ()
            # A supervisor forked by a launcher carries the launcher's environment in
            # /proc, but it works in its attempt's directory (workers.launcher).
            forked = process.cwd() == attempt_dir
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if forked or (
            environ.get("LANEWAY_ATTEMPT_ID") == str(attempt_id)
            and environ.get("LANEWAY_ATTEMPT_DIR") == attempt_dir
        ):
            pid = int(process.info["pid"])
            return pid, identity.process_start_time(pid)
    return None


def measurements(peaks: Peaks) -> dict[str, Any]:
    """The attempt columns a Peaks fills."""
    return {
        "current_rss_mib": peaks.current_rss_mib,
        "peak_rss_mib": peaks.peak_rss_mib,
        "peak_rss_at": peaks.peak_rss_at,
        "peak_gpu_mib": peaks.peak_gpu_mib,
        "peak_gpu_at": peaks.peak_gpu_at,
        "gpu_note": peaks.gpu_note,
        "sampled_at": peaks.sampled_at,
    }


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
        self.in_flight: dict[int, InFlight] = {}
        self.worker_id = ""
        self._last_heartbeat = float("-inf")
        self._last_claim = float("-inf")
        self._seen_event = -1
        self._waiting_on_capacity = True
        """Ready work was refused at the last claim: look again each ``rescan_seconds``."""
        self.watch = ChangeWatch(engine)
        self._selector = selectors.DefaultSelector()
        self._pidfds: dict[int, int] = {}
        self.launcher: Launcher | None = (
            Launcher() if launch and os.environ.get(LAUNCHER_ENV, "1") != "0" else None
        )
        """Forks supervisors (``workers.launcher``); None: each is started by exec."""
        self.launcher_error: str | None = None
        """Why the launcher was given up on, if it was (exec from then on)."""
        self._exit_codes: dict[int, dict[str, dict[int, Outcome]]] = {}
        self._captures: dict[tuple[int, str], CaptureConfig | None] = {}
        self._results: dict[tuple[int, str], Literal["optional", "required"]] = {}
        self._output_caps: dict[tuple[int, str], int] = {}
        self.recovered: list[str] = []
        self.heartbeat_failures = 0
        self.last_sample_error: str | None = None
        self.last_heartbeat_error: str | None = None
        self.revoked: str | None = None
        """Why the ledger no longer accepts this worker (it was declared lost), if so."""
        self.outage = db.Outage()
        """The ledger not answering: ticks in a row that failed, the last error."""
        self.on_ledger_error: Callable[[str], None] | None = None
        """Called with one line when the ledger stops answering (the CLI logs it)."""
        self.on_ledger_back: Callable[[int], None] | None = None
        """Called with the number of failed tries when it answers again."""

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> str:
        """Register this worker in the ledger and reconcile what earlier workers of this
        node left behind (``recover``; its lines land in ``self.recovered``). Returns the
        worker's id."""
        pid, start_time = identity.current()
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
            )
        # Reconcile before admitting: nothing is leased until what was left is settled.
        self.recovered = self.recover()
        return self.worker_id

    def recover(self) -> list[str]:
        """Reconcile what earlier workers of this node left behind, before leasing.

        Dead workers of this node (another boot, or their pid is gone or recycled) are
        marked lost. Each of their in-flight attempts is then, in order of preference:
        adopted when its supervisor still lives (same boot, pid and start time — never a
        second copy); settled from its exit record when the supervisor is gone; or marked
        unknown with the reason. Returns one line per attempt for the log.
        """
        lines: list[str] = []
        boot = identity.boot_id()
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            for worker in ledger.active_workers(session, node=self.node):
                if worker.id == self.worker_id:
                    continue
                alive = worker.boot_id == boot and identity.same_process(
                    worker.pid, worker.process_start_time
                )
                if not alive:
                    ledger.mark_worker_lost(
                        session,
                        worker.id,
                        now=now,
                        actor=self.worker_id,
                        reason="its process is gone (found by a restarted worker)",
                    )
            orphans = ledger.orphaned_attempts(session, node=self.node, worker_id=self.worker_id)
        for attempt in orphans:
            try:
                lines.append(self._recover_one(attempt, boot))
            except (StaleLease, IllegalTransition) as exc:
                # Another actor (the controller expiring its lease, an operator) settled
                # or took it between our listing and our write: normal, not ours now.
                lines.append(f"attempt {attempt.id}: already handled elsewhere ({exc})")
        return lines

    def _recover_one(self, attempt: Any, boot: str) -> str:
        label = f"attempt {attempt.id}"
        if attempt.boot_id is not None and attempt.boot_id != boot:
            with db.transaction(self.factory) as session:
                now = db.ledger_now(session, self.clock)
                ledger.mark_unknown(
                    session,
                    attempt.id,
                    actor=self.worker_id,
                    now=now,
                    reason=f"machine rebooted (boot {attempt.boot_id} -> {boot}) while it ran; "
                    "its outcome is unknown",
                )
            return f"{label}: unknown (machine rebooted)"
        found: tuple[int, int | None] | None = None
        if attempt.supervisor_pid is not None:
            if identity.same_process(attempt.supervisor_pid, attempt.supervisor_start_time):
                found = (attempt.supervisor_pid, attempt.supervisor_start_time)
        elif attempt.state == "intent":
            found = find_supervisor(attempt.id, attempt.attempt_dir)
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            fence = ledger.adopt_attempt(
                session,
                attempt.id,
                old_fence=attempt.fence,
                worker_id=self.worker_id,
                now=now,
                lease_seconds=self.lease_seconds,
            )
            run = ledger.get_run(session, attempt.run_id)
            job = session.get(Job, attempt.job_id)
            assert job is not None
            config = ledger.run_config(run)
            stage = config.stage(job.stage)
            store_url = ledger.artifact_store_url(
                config.artifact_store, self.runtime_dir or run.runtime_dir
            )
            self._output_caps[(attempt.run_id, job.stage)] = stage.output_max_mib
            if found is not None and attempt.state == "intent":
                ledger.record_spawn(
                    session,
                    attempt.id,
                    fence=fence,
                    actor=self.worker_id,
                    now=now,
                    boot_id=boot,
                    supervisor_pid=found[0],
                    supervisor_start_time=found[1],
                    child_pid=None,
                    child_start_time=None,
                )
        claim = ledger.Claim(
            run_id=attempt.run_id,
            job_id=attempt.job_id,
            attempt_id=attempt.id,
            number=attempt.number,
            fence=fence,
            idempotency_key=attempt.idempotency_key,
            item="",
            stage=job.stage,
            lane=job.lane,
            argv=[],
            env={},
            cwd=None,
            timeout_seconds=stage.timeout_seconds,
            grace_seconds=stage.grace_seconds,
            attempt_dir=attempt.attempt_dir,
            outputs=list(stage.outputs),
            artifact_store=store_url,
        )
        if found is not None:
            self._track(
                attempt.id,
                InFlight(
                    claim,
                    AdoptedSupervisor(*found),
                    dict(stage.exit_codes),
                    secrets=stage_secrets(stage, dict(os.environ)),
                    result_requirement=stage.result,
                    # Peaks measured by the previous worker carry over; they only grow.
                    peaks=Peaks(
                        current_rss_mib=attempt.current_rss_mib,
                        peak_rss_mib=attempt.peak_rss_mib,
                        peak_rss_at=attempt.peak_rss_at,
                        peak_gpu_mib=attempt.peak_gpu_mib,
                        peak_gpu_at=attempt.peak_gpu_at,
                    ),
                ),
            )
            return f"{label}: adopted live supervisor pid {found[0]}"
        judged = self._deliver(
            claim,
            ExitRules.of_stage(
                stage,
                job_id=attempt.job_id,
                missing_exit=(
                    "intent committed, but no supervisor is running and no exit.json exists: "
                    "the command may have started and died, or never started"
                    if attempt.state == "intent"
                    else "its worker and supervisor are gone and left no exit.json"
                ),
            ),
        )
        verdict = judged.verdict
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            if verdict.outcome is None:
                ledger.mark_unknown(
                    session,
                    attempt.id,
                    reason=verdict.reason,
                    actor=self.worker_id,
                    now=now,
                    fence=fence,
                    result=judged.result,
                )
                return f"{label}: unknown ({verdict.reason})"
            ledger.settle_from_verdict(
                session,
                attempt.id,
                fence=fence,
                verdict=verdict,
                exit_record=judged.exit_record,
                result=judged.result,
                actor=self.worker_id,
                now=now,
            )
            ledger.record_artifacts(
                session, claim.attempt_id, judged.stored, node=self.node, now=now
            )
        return f"{label}: settled {verdict.outcome.value} from its exit record"

    def stop(self) -> None:
        """Record a clean exit (call after ``drain``) and let the launcher go."""
        with db.transaction(self.factory) as session:
            ledger.stop_worker(session, self.worker_id, now=db.ledger_now(session, self.clock))
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
        """Settle what finished and claim for the free slots, in one transaction; then
        start the claimed attempts' supervisors."""
        report = TickReport()
        finished = self._finished()
        self._sample_if_due()
        self._heartbeat_if_due()
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
                self._spawn_all(claims)
        report.in_flight = len(self.in_flight)
        return report

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
        with db.reader(self.engine)() as session:
            latest = ledger.latest_event_id(session)
        return latest != self._seen_event

    def _sample_if_due(self) -> None:
        """Sample every in-flight attempt's tree each ``sample_seconds`` (and at once for
        one never sampled); write peaks to the ledger when they move or every
        ``sample_flush_seconds``, in one transaction for all attempts."""
        # A flight whose supervisor has exited is about to be settled: sampling it would
        # only fall back to scanning every process on the machine for its markers.
        flights = [f for f in self.in_flight.values() if not f.marked_unknown and not f.exited]
        now_mono = time.monotonic()
        fresh = any(f.peaks.sampled_at is None for f in flights)
        if not flights or (now_mono - self._last_sample < self.sample_seconds and not fresh):
            return
        self._last_sample = now_mono
        reading = self._gpu_reading = self.sampler.read_gpu()
        samples = self.sampler.sample(
            [(f.claim.attempt_id, f.supervisor.pid, f.claim.attempt_dir) for f in flights],
            reading,
        )
        now = self.clock.now()
        for flight in flights:
            sample = samples[flight.claim.attempt_id]
            flight.peaks.add(sample.rss_mib, sample.gpu_mib, sample.gpu_note, now)
        due = now_mono - self._last_flush >= self.sample_flush_seconds
        changed = [f for f in flights if f.peaks.changed or due]
        if not changed:
            return
        try:
            with db.transaction(self.factory) as session:
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

    def _gpu_for_heartbeat(self) -> tuple[list[dict[str, float]] | None, str | None]:
        """Per device: total, used, and the baseline used by processes that are not ours."""
        reading = self._gpu_reading or self.sampler.read_gpu()
        self._gpu_reading = None
        if not reading.available:
            return None, reading.note
        ours = sum(f.peaks.current_gpu_mib or 0.0 for f in self.in_flight.values())
        used = sum(d.used_mib for d in reading.devices)
        return [
            {
                "index": d.index,
                "total_mib": round(d.total_mib, 1),
                "used_mib": round(d.used_mib, 1),
                # Our attempts' use is spread over devices as NVML reports it; the node's
                # baseline is what is left when ours is taken away.
                "baseline_mib": round(max(0.0, d.used_mib - ours * d.used_mib / used), 1)
                if used
                else 0.0,
            }
            for d in reading.devices
        ], None

    def _heartbeat_if_due(self) -> None:
        if time.monotonic() - self._last_heartbeat < self.heartbeat_seconds:
            return
        available, total = self.memory_probe()
        self._probed(available)
        gpus, gpu_note = self._gpu_for_heartbeat()
        lowest = self._lowest
        try:
            with db.transaction(self.factory) as session:
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

    def _source_problems(self) -> dict[int, list[str]]:
        """Invariant 12, checked before the claim's transaction (hashing files is not
        work for the write lock): run id -> what changed in its frozen sources."""
        problems: dict[int, list[str]] = {}
        with db.reader(self.engine)() as session:
            runs = ledger.node_runs(session, node=self.node)
        for run_id, hashes in runs:
            drift = pipeline.source_drift(hashes) if hashes else []
            if drift:
                problems[run_id] = drift
        return problems

    def _settle_and_claim(
        self, finished: list[tuple[int, InFlight]], free: int
    ) -> tuple[int, list[str], list[ledger.Claim]]:
        """One write transaction: settle every finished attempt (each in a savepoint, so
        a stale one does not undo the others), then lease work for ``free`` slots and
        write its intents. Exit records and source files are read before it begins."""
        outcomes: list[str] = []
        settled_failures: list[InFlight] = []
        classified = [
            (attempt_id, flight, self._judge_finished(flight))
            for attempt_id, flight in finished
            if not flight.marked_unknown
        ]
        sources = self._source_problems() if free > 0 else {}
        available = self.memory_probe()[0] if free > 0 else None
        if available is not None:
            self._probed(available)
        if finished:
            crash_point("worker_before_settle")
        claims: list[ledger.Claim] = []
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            for attempt_id, flight, judged in classified:
                verdict = judged.verdict
                try:
                    with session.begin_nested():
                        if verdict.outcome is None:
                            ledger.mark_unknown(
                                session,
                                attempt_id,
                                reason=verdict.reason,
                                actor=self.worker_id,
                                now=now,
                                fence=flight.claim.fence,
                                result=judged.result,
                            )
                        else:
                            ledger.settle_from_verdict(
                                session,
                                attempt_id,
                                fence=flight.claim.fence,
                                verdict=verdict,
                                exit_record=judged.exit_record,
                                result=judged.result,
                                actor=self.worker_id,
                                now=now,
                                measured=measurements(flight.peaks),
                            )
                            ledger.record_artifacts(
                                session, attempt_id, judged.stored, node=self.node, now=now
                            )
                    outcomes.append(verdict.outcome.value if verdict.outcome else "unknown")
                    if verdict.outcome not in (None, Outcome.SUCCEEDED):
                        settled_failures.append(flight)
                except StaleLease:
                    # A zombie: our lease was revoked while we were away. The evidence
                    # files stay on disk; the ledger belongs to whoever revoked us.
                    outcomes.append("stale")
            if classified:
                crash_point("worker_mid_settle")  # inside the transaction: rolls back
            if free > 0:
                seen: dict[str, int] = {}
                claims = ledger.claim_jobs(
                    session,
                    worker_id=self.worker_id,
                    node=self.node,
                    free_slots=free,
                    mem_available_mib=available,
                    now=now,
                    lease_seconds=self.lease_seconds,
                    source_problems=sources,
                    pick_ports=free_ports,
                    seen=seen,
                    runtime_dir=self.runtime_dir,
                )
                self._waiting_on_capacity = seen.get("candidates", 0) > len(claims)
                for claim in claims:
                    self._remember_stage(session, claim)
                self._seen_event = ledger.latest_event_id(session)
        if any(judged.stored for _, _, judged in classified):
            crash_point("worker_after_outputs_recorded")
        for attempt_id, _ in finished:
            self._forget(attempt_id)
        for flight in settled_failures:
            self._capture(flight)  # after the commit: it cannot touch the outcome
        if free > 0:
            self._last_claim = time.monotonic()
            crash_point("worker_after_intent_commit")
        return len(finished), outcomes, claims

    def _remember_stage(self, session: Any, claim: ledger.Claim) -> None:
        """Cache a stage's exit-code map and capture settings (frozen with the run)."""
        by_stage = self._exit_codes.setdefault(claim.run_id, {})
        if claim.stage not in by_stage:
            run = ledger.get_run(session, claim.run_id)
            stage = ledger.run_config(run).stage(claim.stage)
            by_stage[claim.stage] = dict(stage.exit_codes)
            self._captures[(claim.run_id, claim.stage)] = stage.capture
            self._results[(claim.run_id, claim.stage)] = stage.result
            self._output_caps[(claim.run_id, claim.stage)] = stage.output_max_mib

    def _spawn_all(self, claims: list[ledger.Claim]) -> None:
        """Start every claimed attempt's supervisor. Each reports its child's identity
        on its stdout when the child has started; ``_record_reports`` records the
        identities (one transaction for all that are in) without waiting for slow ones,
        so a starting supervisor never holds up a slot that is free."""
        for claim in claims:
            if claim.render_error is not None:
                self._settle_without_spawn(claim, claim.render_error)
                continue
            refused = self._make_attempt_dir(claim) or self._give_inputs(claim)
            if refused is not None:
                self._settle_without_spawn(claim, refused, pause_run=True)
                continue
            kills = self.oom_counter.read()
            try:
                supervisor, secrets = self._start_supervisor(claim)
            except SecretMissing as exc:
                self._settle_without_spawn(claim, str(exc))
                continue
            except OSError as exc:
                # Nothing started for this claim (workspace, log or fork failed): a harness
                # failure of its own; supervisors already started are still recorded.
                self._settle_without_spawn(claim, f"could not start the supervisor: {exc}")
                continue
            flight = InFlight(
                claim,
                supervisor,
                self._exit_codes[claim.run_id][claim.stage],
                awaiting_report=True,
                secrets=secrets,
                result_requirement=self._results[(claim.run_id, claim.stage)],
                oom_kills_at_start=kills,
            )
            self._track(claim.attempt_id, flight)
            assert supervisor.stdout is not None
            self._selector.register(supervisor.stdout, selectors.EVENT_READ, claim.attempt_id)
        crash_point("worker_after_spawn_before_identity")
        self._record_reports()

    def _record_reports(self) -> int:
        """Record the identity of every supervisor whose report is in (or that exited
        without one), then write their receipts. Never blocks on a slow supervisor."""
        waiting = {
            flight.supervisor.stdout: flight
            for flight in self.in_flight.values()
            if flight.awaiting_report
            and isinstance(flight.supervisor, (subprocess.Popen, LaunchedSupervisor))
            and flight.supervisor.stdout is not None
        }
        ready, _, _ = select.select(list(waiting), [], [], 0) if waiting else ([], [], [])
        for stream in ready:
            flight = waiting[stream]
            line = stream.readline()  # one write of one line: never a partial read
            self._selector.unregister(stream)
            stream.close()
            flight.awaiting_report = False
            try:
                flight.unrecorded_report = json.loads(line) if line else {}
            except json.JSONDecodeError:
                flight.unrecorded_report = {}
        # Reports read earlier whose write failed (the ledger was unreachable) go too.
        identities = [
            (flight, flight.unrecorded_report)
            for flight in self.in_flight.values()
            if flight.unrecorded_report is not None
        ]
        if not identities:
            return 0
        boot = identity.boot_id()
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            for flight, reported in identities:
                ledger.record_spawn(
                    session,
                    flight.claim.attempt_id,
                    fence=flight.claim.fence,
                    actor=self.worker_id,
                    now=now,
                    boot_id=boot,
                    supervisor_pid=flight.supervisor.pid,
                    supervisor_start_time=getattr(flight.supervisor, "start_time", None)
                    or identity.process_start_time(flight.supervisor.pid),
                    child_pid=reported.get("child_pid"),
                    child_start_time=reported.get("child_start_time"),
                )
        for flight, reported in identities:
            flight.unrecorded_report = None
            self._write_receipt(flight.claim, flight.supervisor.pid, reported, boot, now)
        return len(identities)

    def _start_supervisor(
        self, claim: ledger.Claim
    ) -> tuple[subprocess.Popen[bytes] | LaunchedSupervisor, list[str]]:
        """Start the attempt's supervisor; returns it and the secret values it redacts."""
        directory = Path(claim.attempt_dir)
        workspace = directory / "workspace"
        with durable.AttemptDir(directory) as attempt:  # made by _make_attempt_dir
            attempt.make_dir("workspace", exclusive=True)
        env, secret_names, strip = job_environment(dict(os.environ), claim.env, claim.pass_env)
        env.update(
            {
                "LANEWAY_IDEMPOTENCY_KEY": claim.idempotency_key,
                "LANEWAY_JOB_ID": str(claim.job_id),
                "LANEWAY_ATTEMPT_ID": str(claim.attempt_id),
                "LANEWAY_ATTEMPT": str(claim.number),
                "LANEWAY_RUN_ID": str(claim.run_id),
                "LANEWAY_ITEM": claim.item,
                "LANEWAY_STAGE": claim.stage,
                "LANEWAY_LANE": claim.lane,
                "LANEWAY_ATTEMPT_DIR": str(directory),
                "LANEWAY_WORKSPACE": str(workspace),
                "LANEWAY_RESULT_PATH": str(directory / "result.json"),
                "LANEWAY_PORTS": ",".join(str(port) for port in claim.ports),
            }
        )
        if claim.inputs:
            env["LANEWAY_INPUTS_DIR"] = ledger.inputs_dir(str(directory))
        spec = {
            "attempt_id": claim.attempt_id,
            "attempt_dir": str(directory),
            "argv": claim.argv,
            "cwd": claim.cwd or str(workspace),
            "timeout_seconds": claim.timeout_seconds,
            "grace_seconds": claim.grace_seconds,
            "log_cap_bytes": claim.log_cap_bytes,
            "secret_env": secret_names,
            "strip_env": strip,
        }
        secrets = secret_values(env, secret_names)
        with (
            durable.AttemptDir(directory) as attempt,
            attempt.append("supervisor.log") as supervisor_log,
        ):
            if self.launcher is not None:
                read_end, write_end = os.pipe2(os.O_CLOEXEC)
                try:
                    pid, start_time = self.launcher.spawn(
                        {"spec": spec, "env": env}, write_end, supervisor_log.fileno()
                    )
                except OSError as exc:
                    os.close(read_end)
                    self.launcher_error = f"{exc.strerror or exc}"
                    self.launcher = None  # exec from now on
                else:
                    launched = LaunchedSupervisor(
                        pid, start_time, os.fdopen(read_end, "rb"), str(directory)
                    )
                    return launched, secrets
                finally:
                    os.close(write_end)
            process = subprocess.Popen(
                supervisor_module.launch_argv(json.dumps(spec)),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=supervisor_log,
                start_new_session=True,
                env=env,
                close_fds=True,
            )
        return process, secrets

    def _write_receipt(
        self,
        claim: ledger.Claim,
        supervisor_pid: int,
        reported: dict[str, Any],
        boot: str,
        now: datetime,
    ) -> None:
        receipt = {
            "schema": 1,
            "run_id": claim.run_id,
            "job_id": claim.job_id,
            "attempt_id": claim.attempt_id,
            "attempt": claim.number,
            "item": claim.item,
            "stage": claim.stage,
            "worker_id": self.worker_id,
            "node": self.node,
            "host": identity.host(),
            "boot_id": boot,
            "fence": claim.fence,
            "idempotency_key": claim.idempotency_key,
            "argv_hash": ledger.argv_hash(claim.argv, claim.cwd),
            "supervisor_pid": supervisor_pid,
            "supervisor_start_time": identity.process_start_time(supervisor_pid),
            "child_pid": reported.get("child_pid"),
            "child_start_time": reported.get("child_start_time"),
            "spawn_error": reported.get("error"),
            "recorded_at": iso(now),
        }
        try:
            write_json(Path(claim.attempt_dir) / "receipt.json", receipt)
        except OSError as exc:
            # Fail closed: without its claim evidence on disk the attempt is unknown and the
            # run stops dispatching until an operator reconciles it. The supervisor runs on
            # and its exit.json will be there to reconcile from.
            reason = (
                f"receipt.json could not be saved ({exc.strerror or exc}); the command runs "
                "on under its supervisor: reconcile it from exit.json when it ends"
            )
            with db.transaction(self.factory) as session:
                ledger.mark_unknown(
                    session,
                    claim.attempt_id,
                    reason=reason,
                    actor=self.worker_id,
                    now=now,
                    fence=claim.fence,
                )
            self.in_flight[claim.attempt_id].marked_unknown = True

    def _make_attempt_dir(self, claim: ledger.Claim) -> str | None:
        """Create the attempt's directory, which must not exist yet: the job of another
        attempt can write the runtime dir, and one it planted (a link, or a directory
        holding links) is refused, never used. The directories from the run's down
        are entered without following a link. Returns why it cannot start, else None."""
        run_dir = Path(claim.attempt_dir).parents[2]  # <runtime>/runs/<run> (launch.attempt_dir)
        try:
            durable.AttemptDir.make(claim.attempt_dir, base=run_dir).close()
        except OSError as exc:
            return f"attempt directory {claim.attempt_dir}: {exc.strerror or exc}"
        return None

    def _give_inputs(self, claim: ledger.Claim) -> str | None:
        """Fetch the attempt's inputs into ``inputs/<stage>/<name>``, each verified
        against the sha256 its producer recorded. Returns why it cannot start (an input
        missing, unreadable or not the recorded bytes: both hashes), else None."""
        if claim.input_problems:
            return "; ".join(claim.input_problems)
        root = Path(ledger.inputs_dir(claim.attempt_dir))
        for given in claim.inputs:
            crash_point("worker_fetching_inputs")
            self._heartbeat_if_due()  # a long download must not let leases lapse
            try:
                artifacts.fetch(
                    given["location"],
                    given["sha256"],
                    f"{given['stage']}/{given['name']}",
                    root / given["stage"] / given["name"],
                    between=self._heartbeat_if_due,  # within one large file too
                    root=Path(claim.attempt_dir),  # no link below it is followed
                )
            except (artifacts.InputMismatch, artifacts.StoreError) as exc:
                return str(exc)
            except OSError as exc:
                return f"input {given['stage']}/{given['name']}: {exc.strerror or exc}"
        return None

    def _deliver(
        self,
        claim: ledger.Claim,
        rules: ExitRules,
        amend: Amend | None = None,
    ) -> Judged:
        """``judge_attempt`` for a finished attempt (outside any transaction): its exit
        record classified, and a success's declared outputs stored, or the verdict that
        says why they were not."""
        cap = self._output_caps.get((claim.run_id, claim.stage), artifacts.DEFAULT_OUTPUT_MAX_MIB)
        judged = judge_attempt(
            claim.attempt_dir,
            rules,
            Delivery(
                claim.outputs,
                claim.artifact_store,
                max_bytes=cap * artifacts.MIB,
                between=self._heartbeat_if_due,  # a long upload or walk must not let leases lapse
            ),
            amend=amend,
        )
        if judged.stored:
            crash_point("worker_after_store_before_settle")
        return judged

    def _settle_without_spawn(
        self, claim: ledger.Claim, reason: str, *, pause_run: bool = False
    ) -> None:
        """Nothing was started (e.g. a secret reference is unset): a harness failure.
        ``pause_run``: its inputs could not be given, and the run pauses too
        (``ledger.refuse_start``)."""
        with db.transaction(self.factory) as session:
            now = db.ledger_now(session, self.clock)
            if pause_run:
                ledger.refuse_start(
                    session,
                    claim.attempt_id,
                    run_id=claim.run_id,
                    fence=claim.fence,
                    reason=reason,
                    actor=self.worker_id,
                    now=now,
                )
                return
            ledger.settle_attempt(
                session,
                claim.attempt_id,
                fence=claim.fence,
                outcome=Outcome.HARNESS_FAILURE,
                actor=self.worker_id,
                now=now,
                reason=f"not started: {reason}",
            )

    # -- settle --------------------------------------------------------------

    def _finished(self) -> list[tuple[int, InFlight]]:
        """In-flight attempts whose supervisor has exited (its exit record is written)."""
        self._record_reports()
        finished = []
        for attempt_id, flight in list(self.in_flight.items()):
            if flight.awaiting_report:
                continue  # its identity is recorded first (next tick: its pipe is ready)
            if flight.supervisor.poll() is not None:
                flight.exited = True
                flight.free_before_exit = self._last_available
                finished.append((attempt_id, flight))
        return finished

    def _settle_finished(self) -> tuple[int, list[str]]:
        """Settle what finished, claiming nothing (draining)."""
        finished = self._finished()
        if not finished:
            return 0, []
        settled, outcomes, _ = self._settle_and_claim(finished, 0)
        return settled, outcomes

    def _track(self, attempt_id: int, flight: InFlight) -> None:
        """Watch a supervisor: its pidfd wakes ``wait`` the moment it exits."""
        self.in_flight[attempt_id] = flight
        try:
            fd = os.pidfd_open(flight.supervisor.pid)
        except OSError:
            return  # already gone (poll() will see it) or no pidfd: the poll interval
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
        is seen the moment it is committed, not at the next poll)."""
        self.watch.wait(timeout, self._selector)

    def _capture(self, flight: InFlight) -> None:
        """The optional bounded capture of a failed attempt's workspace; its result or
        its failure (ENOSPC, EIO, ...) is an event of its own."""
        config = self._captures.get((flight.claim.run_id, flight.claim.stage))
        if config is None:
            return
        try:
            info: dict[str, Any] | None = capture_workspace(
                flight.claim.attempt_dir,
                max_bytes=int(config.max_mib * 1024 * 1024),
                max_seconds=config.max_seconds,
            )
            error = None
        except OSError as exc:
            info, error = None, f"{exc.strerror or exc}"
        with db.transaction(self.factory) as session:
            ledger.record_capture(
                session,
                flight.claim.attempt_id,
                info=info,
                error=error,
                actor=self.worker_id,
                now=db.ledger_now(session, self.clock),
            )

    def _judge_finished(self, flight: InFlight) -> Judged:
        """The verdict on an attempt whose supervisor exited, an OOM kill named."""
        returncode = flight.supervisor.returncode
        rules = ExitRules(
            job_id=flight.claim.job_id,
            exit_codes=flight.exit_codes,
            result_requirement=flight.result_requirement,
            secrets=flight.secrets,
            missing_exit=(
                f"supervisor (pid {flight.supervisor.pid}) exited"
                + (f" with status {returncode}" if returncode is not None else "")
                + " and left no exit.json"
            ),
        )
        return self._deliver(
            flight.claim,
            rules,
            lambda verdict, exit_record: self._name_oom(flight, verdict, exit_record),
        )

    def _name_oom(
        self, flight: InFlight, verdict: Verdict, exit_record: dict[str, Any] | None
    ) -> Verdict:
        """The verdict of an attempt killed by a SIGKILL laneway did not send, with the
        ``oom_killed`` evidence when the OOM killer did it (``workers.oom``). The outcome
        is kept: this is evidence; the settle folds the attempt's peak into its stage's
        learned reservation like any other. Anything else passes through."""
        if verdict.outcome is None or not oom_watch.unexplained_sigkill(exit_record):
            return verdict
        with db.reader(self.engine)() as session:
            floor = ledger_snapshot.memory_floor(session, node=self.node)
        found = oom_watch.name_oom(
            exit_record,
            kills_at_start=flight.oom_kills_at_start,
            kills_now=self.oom_counter.read(),
            mem_available_mib=flight.free_before_exit,
            memory_floor_mib=floor,
            peak_rss_mib=flight.peaks.peak_rss_mib,
        )
        if found is None:
            return verdict
        why = (
            "its memory cgroup counted the kill"
            if found["source"] == "cgroup"
            else "the node's free memory was under its floor"
        )
        return replace(
            verdict,
            reason=f"{verdict.reason} from the OOM killer: out of memory ({why})",
            diagnostics=[*verdict.diagnostics, oom.diagnostic(found)],
        )

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
