"""Spawning: what the worker does with the attempts it just claimed, after the claim's
commit. Each attempt's directory is made and its inputs fetched (every byte verified
against its recorded sha256), its environment built (``workers.jobenv``), and its
supervisor started: forked by the warm launcher (``workers.launcher``), or by exec when
the launcher cannot be reached or the ``spawn`` seam says ``exec`` (``workers.seams``:
macOS, or the portable paths forced on Linux). Each supervisor reports its child's identity on its
stdout; ``read_reports`` reads those reports and writes each ``receipt.json``, and the
identities go into the ledger with the worker's next write transaction (its settle or
claim: ``write_identities``), or in one of their own once they have waited
``identity_wait_seconds`` (``record_due``). An attempt that cannot start is settled
without a spawn.

``Spawning`` is one part of ``workers.service.WorkerService``: it reads the worker's
identity, clock, ledger, launcher and stage rules from it, and hands each started
attempt to ``WorkerService._track``.
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
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import db, durable, identity, ledger
from laneway.controller.attempt import artifacts
from laneway.controller.clock import iso
from laneway.controller.crashpoints import crash_point
from laneway.controller.durable import write_json
from laneway.controller.errors import StaleLease
from laneway.controller.states import Outcome
from laneway.workers import launcher as launcher_module
from laneway.workers import seams
from laneway.workers import supervisor as supervisor_module
from laneway.workers.flight import InFlight, LaunchedSupervisor
from laneway.workers.jobenv import SecretMissing, job_environment, secret_values

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from laneway.workers.service import WorkerService

IDENTITY_WAIT_SECONDS = 0.25
"""How long an identity read from a supervisor's report may wait for the worker's next
settle or claim to carry it (``WorkerService.identity_wait_seconds``): a short attempt's
identity, settle and the claim of its successor then share one commit. Recovery finds a
supervisor whose identity is not yet recorded by its attempt directory
(``workers.recovery.find_supervisor``), as after a crash right after the spawn."""

LAUNCHER_ENV = seams.LAUNCHER_ENV
"""Set to 0 to start every supervisor by exec instead of forking it from the launcher."""


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


def close_report_pipes(
    in_flight: dict[int, InFlight], before_close: Callable[[Any], object] = lambda _: None
) -> None:
    """Close our end of the report pipe of every flight still waiting for its report
    (``before_close`` first: the worker's selector lets it go)."""
    for flight in in_flight.values():
        stream = getattr(flight.supervisor, "stdout", None)
        if flight.awaiting_report and stream is not None and not stream.closed:
            before_close(stream)
            stream.close()


def visible_devices(given: list[dict[str, Any]]) -> dict[str, str]:
    """What a job given ``given`` GPUs sees: exactly those devices, by UUID where the
    worker knows it (CUDA and the NVIDIA container runtime accept ``GPU-…`` and
    ``MIG-…`` names), else by index; ``LANEWAY_GPUS`` holds the indices."""
    names = ",".join(str(d.get("uuid") or d["index"]) for d in given)
    return {
        "CUDA_VISIBLE_DEVICES": names,
        "NVIDIA_VISIBLE_DEVICES": names,
        "LANEWAY_GPUS": ",".join(str(d["index"]) for d in given),
    }


class Spawning:
    """Start the supervisors of claimed attempts (``spawn_all``) and record who they are
    (``read_reports``, ``write_identities``)."""

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker

    def spawn_all(self, claims: list[ledger.Claim]) -> None:
        """Start every claimed attempt's supervisor. Each reports its child's identity
        on its stdout when the child has started; ``read_reports`` reads what is in
        without waiting for slow ones, so a starting supervisor never holds up a slot
        that is free, and the identities are recorded with the worker's next write."""
        for claim in claims:
            if claim.render_error is not None:
                self.settle_without_spawn(claim, claim.render_error)
                continue
            refused = self.make_attempt_dir(claim) or self.give_inputs(claim)
            if refused is not None:
                self.settle_without_spawn(claim, refused, pause_run=True)
                continue
            kills = self.worker.oom_counter.read()
            try:
                supervisor, secrets = self.start_supervisor(claim)
            except SecretMissing as exc:
                self.settle_without_spawn(claim, str(exc))
                continue
            except OSError as exc:
                # Nothing started for this claim (workspace, log or fork failed): a harness
                # failure of its own; supervisors already started are still recorded.
                self.settle_without_spawn(claim, f"could not start the supervisor: {exc}")
                continue
            flight = InFlight(
                claim,
                supervisor,
                self.worker.stages.exit_codes[claim.run_id][claim.stage],
                awaiting_report=True,
                secrets=secrets,
                result_requirement=self.worker.stages.results[(claim.run_id, claim.stage)],
                oom_kills_at_start=kills,
            )
            self.worker._track(claim.attempt_id, flight)
            assert supervisor.stdout is not None
            self.worker._selector.register(
                supervisor.stdout, selectors.EVENT_READ, claim.attempt_id
            )
        crash_point("worker_after_spawn_before_identity")
        self.read_reports()

    def read_reports(self) -> None:
        """Read every supervisor report that has arrived (or the end of a supervisor that
        exited without one) and write its ``receipt.json`` at once; the ledger write waits
        for the worker's next transaction (``write_identities``). Never blocks on a slow
        supervisor."""
        waiting = {
            flight.supervisor.stdout: flight
            for flight in self.worker.in_flight.values()
            if flight.awaiting_report
            and isinstance(flight.supervisor, (subprocess.Popen, LaunchedSupervisor))
            and flight.supervisor.stdout is not None
        }
        ready, _, _ = select.select(list(waiting), [], [], 0) if waiting else ([], [], [])
        if not ready:
            return
        boot = identity.boot_id()
        for stream in ready:
            flight = waiting[stream]
            line = stream.readline()  # one write of one line: never a partial read
            self.worker._selector.unregister(stream)
            stream.close()
            flight.awaiting_report = False
            try:
                reported = json.loads(line) if line else {}
            except json.JSONDecodeError:
                reported = {}
            flight.unrecorded_report = reported if isinstance(reported, dict) else {}
            flight.reported_at = time.monotonic()
            # Read now, while it lives: by the write that records it, it may have ended.
            flight.supervisor_start_time = getattr(
                flight.supervisor, "start_time", None
            ) or identity.process_start_time(flight.supervisor.pid)
            flight.receipt_error = self.write_receipt(flight, boot)
        crash_point("worker_after_receipt_before_identity")

    def close_reports(self) -> None:
        """Close our end of every report pipe still waiting (a stopping worker): those
        attempts run on, and their supervisor's report fails quietly (``EPIPE``, as
        when a worker dies); the next worker on this node adopts them (``recover``)."""
        close_report_pipes(self.worker.in_flight, self.worker._selector.unregister)

    def identities_due(self) -> bool:
        """Must the reports read so far be recorded now, in a transaction of their own?
        Yes for one that has waited ``worker.identity_wait_seconds`` for the worker's
        next write to carry it, and for one whose receipt could not be saved (that
        attempt is unknown at once)."""
        oldest = time.monotonic() - self.worker.identity_wait_seconds
        return any(
            flight.unrecorded_report is not None
            and (flight.receipt_error is not None or flight.reported_at <= oldest)
            for flight in self.worker.in_flight.values()
        )

    def write_identities(self, session: Session, now: datetime) -> list[InFlight]:
        """Record every identity read and not yet in the ledger, in the caller's
        transaction and before anything else it writes of those attempts (an attempt is
        never settled before its identity is recorded): ``intent -> running`` with the
        time the report was read as ``started_at``. One whose receipt could not be saved
        is then marked unknown (fail closed: without its claim evidence on disk an
        operator reconciles it from exit.json). One whose lease was revoked meanwhile
        is refused before it writes and leaves the rest of the transaction as it is.
        Returns the flights written; ``identities_recorded`` after the commit."""
        pending = [f for f in self.worker.in_flight.values() if f.unrecorded_report is not None]
        if not pending:
            return []
        boot = identity.boot_id()
        at = time.monotonic()
        for flight in pending:
            reported = flight.unrecorded_report or {}
            try:
                with ledger.refused_before_writing(session):
                    ledger.record_spawn(
                        session,
                        flight.claim.attempt_id,
                        fence=flight.claim.fence,
                        actor=self.worker.worker_id,
                        now=now,
                        started_at=now - timedelta(seconds=max(0.0, at - flight.reported_at)),
                        boot_id=boot,
                        supervisor_pid=flight.supervisor.pid,
                        supervisor_start_time=flight.supervisor_start_time,
                        child_pid=reported.get("child_pid"),
                        child_start_time=reported.get("child_start_time"),
                    )
            except StaleLease:
                # Revoked while it started (its lease expired): not ours to record; its
                # settle will be refused the same way when its supervisor exits.
                continue
            if flight.receipt_error is not None:
                ledger.mark_unknown(
                    session,
                    flight.claim.attempt_id,
                    reason=flight.receipt_error,
                    actor=self.worker.worker_id,
                    now=now,
                    fence=flight.claim.fence,
                )
        return pending

    def identities_recorded(self, written: list[InFlight]) -> None:
        """After the commit that carried ``write_identities``."""
        for flight in written:
            flight.unrecorded_report = None
            if flight.receipt_error is not None:
                flight.marked_unknown = True

    def record_reports(self) -> int:
        """Read the reports that are in and record every identity read, now, in one
        transaction of its own. Returns how many were recorded."""
        self.read_reports()
        return self._record_read()

    def record_due(self) -> int:
        """Read the reports that are in; record them now if ``identities_due``. Returns
        how many were recorded."""
        self.read_reports()
        return self._record_read() if self.identities_due() else 0

    def _record_read(self) -> int:
        if not any(f.unrecorded_report is not None for f in self.worker.in_flight.values()):
            return 0
        with db.worker_transaction(self.worker.factory) as session:
            written = self.write_identities(session, db.ledger_now(session, self.worker.clock))
        self.identities_recorded(written)
        return len(written)

    def start_supervisor(
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
        if claim.gpu_devices:
            env.update(visible_devices(claim.gpu_devices))
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
        if identity.portable():
            spec["portable"] = True  # the supervisor runs with the job's environment
        secrets = secret_values(env, secret_names)
        with (
            durable.AttemptDir(directory) as attempt,
            attempt.append("supervisor.log") as supervisor_log,
        ):
            if self.worker.launcher is not None and seams.current().spawn == "fork":
                read_end, write_end = os.pipe2(os.O_CLOEXEC)
                try:
                    pid, start_time = self.worker.launcher.spawn(
                        {"spec": spec, "env": env}, write_end, supervisor_log.fileno()
                    )
                except OSError as exc:
                    os.close(read_end)
                    self.worker.launcher_error = f"{exc.strerror or exc}"
                    self.worker.launcher = None  # exec from now on
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

    def write_receipt(self, flight: InFlight, boot: str) -> str | None:
        """Write the attempt's ``receipt.json`` (claim evidence: who started what, as the
        supervisor reported it), before its identity reaches the ledger. Returns None, or
        why it could not be saved: the attempt is then marked unknown with its identity
        (fail closed; the supervisor runs on and its exit.json is there to reconcile
        from)."""
        claim, reported = flight.claim, flight.unrecorded_report or {}
        receipt = {
            "schema": 1,
            "run_id": claim.run_id,
            "job_id": claim.job_id,
            "attempt_id": claim.attempt_id,
            "attempt": claim.number,
            "item": claim.item,
            "stage": claim.stage,
            "worker_id": self.worker.worker_id,
            "node": self.worker.node,
            "host": identity.host(),
            "boot_id": boot,
            "fence": claim.fence,
            "idempotency_key": claim.idempotency_key,
            "argv_hash": ledger.argv_hash(claim.argv, claim.cwd),
            "supervisor_pid": flight.supervisor.pid,
            "supervisor_start_time": flight.supervisor_start_time,
            "child_pid": reported.get("child_pid"),
            "child_start_time": reported.get("child_start_time"),
            "spawn_error": reported.get("error"),
            "recorded_at": iso(self.worker.clock.now()),
        }
        try:
            write_json(Path(claim.attempt_dir) / "receipt.json", receipt)
        except OSError as exc:
            return (
                f"receipt.json could not be saved ({exc.strerror or exc}); the command runs "
                "on under its supervisor: reconcile it from exit.json when it ends"
            )
        return None

    def make_attempt_dir(self, claim: ledger.Claim) -> str | None:
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

    def give_inputs(self, claim: ledger.Claim) -> str | None:
        """Fetch the attempt's inputs into ``inputs/<stage>/<name>``, each verified
        against the sha256 its producer recorded. Returns why it cannot start (an input
        missing, unreadable or not the recorded bytes: both hashes), else None."""
        if claim.input_problems:
            return "; ".join(claim.input_problems)
        root = Path(ledger.inputs_dir(claim.attempt_dir))
        for given in claim.inputs:
            crash_point("worker_fetching_inputs")
            self.worker._heartbeat_if_due()  # a long download must not let leases lapse
            try:
                artifacts.fetch(
                    given["location"],
                    given["sha256"],
                    f"{given['stage']}/{given['name']}",
                    root / given["stage"] / given["name"],
                    between=self.worker._heartbeat_if_due,  # within one large file too
                    root=Path(claim.attempt_dir),  # no link below it is followed
                )
            except (artifacts.InputMismatch, artifacts.StoreError) as exc:
                return str(exc)
            except OSError as exc:
                return f"input {given['stage']}/{given['name']}: {exc.strerror or exc}"
        return None

    def settle_without_spawn(
        self, claim: ledger.Claim, reason: str, *, pause_run: bool = False
    ) -> None:
        """Nothing was started (e.g. a secret reference is unset): a harness failure.
        ``pause_run``: its inputs could not be given, and the run pauses too
        (``ledger.refuse_start``)."""
        with db.worker_transaction(self.worker.factory) as session:
            now = db.ledger_now(session, self.worker.clock)
            if pause_run:
                ledger.refuse_start(
                    session,
                    claim.attempt_id,
                    run_id=claim.run_id,
                    fence=claim.fence,
                    reason=reason,
                    actor=self.worker.worker_id,
                    now=now,
                )
                return
            ledger.settle_attempt(
                session,
                claim.attempt_id,
                fence=claim.fence,
                outcome=Outcome.HARNESS_FAILURE,
                actor=self.worker.worker_id,
                now=now,
                reason=f"not started: {reason}",
            )
