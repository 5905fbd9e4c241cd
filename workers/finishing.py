"""Finishing: what the worker does with an attempt whose supervisor has exited. The one
verdict (``controller.attempt.judge_attempt``) reads its exit record and result, classifies
and redacts them and stores a success's declared outputs; a SIGKILL laneway did not send
is named an OOM kill when the evidence says so (``workers.oom``); the settle is written
in the worker's tick transaction (a stale one refused before it writes); a failure's
workspace is captured after the commit (``workers.capture``).

``Finishing`` is one part of ``workers.service.WorkerService``: it reads the worker's
identity, clock, ledger and stage rules from it. ``deliver`` is also how
``workers.recovery`` settles an orphan from its exit record.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from laneway.controller import db, ledger, oom
from laneway.controller.attempt import Amend, Delivery, ExitRules, Judged, artifacts, judge_attempt
from laneway.controller.crashpoints import crash_point
from laneway.controller.errors import StaleLease
from laneway.controller.ledger import snapshot as ledger_snapshot
from laneway.controller.outcome import Verdict
from laneway.controller.states import Outcome
from laneway.workers import oom as oom_watch
from laneway.workers.capture import capture_workspace
from laneway.workers.flight import InFlight, measurements

if TYPE_CHECKING:
    from laneway.workers.service import WorkerService


class Finishing:
    """Judge what finished (``finished``, ``judge_all``), write the settles (``settle``),
    capture the failures (``capture``)."""

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker

    def finished(self) -> list[tuple[int, InFlight]]:
        """In-flight attempts whose supervisor has exited (its exit record is written)."""
        self.worker.spawning.read_reports()
        finished = []
        for attempt_id, flight in list(self.worker.in_flight.items()):
            if flight.awaiting_report:
                continue  # its identity is recorded first (next tick: its pipe is ready)
            if flight.supervisor.poll() is not None:
                flight.exited = True
                flight.free_before_exit = self.worker._last_available
                finished.append((attempt_id, flight))
        return finished

    def judge(self, flight: InFlight) -> Judged:
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
            stage=flight.claim.stage,
            timeout_seconds=flight.claim.timeout_seconds,
        )
        return self.deliver(
            flight.claim,
            rules,
            lambda verdict, exit_record: self.name_oom(flight, verdict, exit_record),
        )

    def name_oom(
        self, flight: InFlight, verdict: Verdict, exit_record: dict[str, Any] | None
    ) -> Verdict:
        """The verdict of an attempt killed by a SIGKILL laneway did not send, with the
        ``oom_killed`` evidence when the OOM killer did it (``workers.oom``). The outcome
        is kept: this is evidence; the settle folds the attempt's peak into its stage's
        learned reservation like any other. Anything else passes through."""
        if verdict.outcome is None or not oom_watch.unexplained_sigkill(exit_record):
            return verdict
        with db.reader(self.worker.engine)() as session:
            floor = ledger_snapshot.memory_floor(session, node=self.worker.node)
        found = oom_watch.name_oom(
            exit_record,
            kills_at_start=flight.oom_kills_at_start,
            kills_now=self.worker.oom_counter.read(),
            mem_available_mib=flight.free_before_exit,
            memory_floor_mib=floor,
            peak_rss_mib=flight.peaks.peak_rss_mib,
        )
        if found is None:
            return verdict
        why = (
            "its memory cgroup counted the kill"
            if not oom.inferred(found)
            else "inferred: no memory cgroup counts kills here, and the node's free memory "
            "was under its floor"
        )
        return replace(
            verdict,
            reason=f"{verdict.reason} from the OOM killer: out of memory ({why})",
            diagnostics=[*verdict.diagnostics, oom.diagnostic(found)],
        )

    def deliver(
        self,
        claim: ledger.Claim,
        rules: ExitRules,
        amend: Amend | None = None,
    ) -> Judged:
        """``judge_attempt`` for a finished attempt (outside any transaction): its exit
        record classified, and a success's declared outputs stored, or the verdict that
        says why they were not."""
        cap = self.worker.stages.output_caps.get(
            (claim.run_id, claim.stage), artifacts.DEFAULT_OUTPUT_MAX_MIB
        )
        judged = judge_attempt(
            claim.attempt_dir,
            rules,
            Delivery(
                claim.outputs,
                claim.artifact_store,
                max_bytes=cap * artifacts.MIB,
                # A long upload or walk must not let leases lapse.
                between=self.worker._heartbeat_if_due,
            ),
            amend=amend,
        )
        if judged.stored:
            crash_point("worker_after_store_before_settle")
        return judged

    def capture(self, flight: InFlight) -> None:
        """The optional bounded capture of a failed attempt's workspace; its result or
        its failure (ENOSPC, EIO, ...) is an event of its own."""
        config = self.worker.stages.captures.get((flight.claim.run_id, flight.claim.stage))
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
        with db.worker_transaction(self.worker.factory) as session:
            ledger.record_capture(
                session,
                flight.claim.attempt_id,
                info=info,
                error=error,
                actor=self.worker.worker_id,
                now=db.ledger_now(session, self.worker.clock),
            )

    def judge_all(self, finished: list[tuple[int, InFlight]]) -> list[tuple[int, InFlight, Judged]]:
        """The verdict on each finished attempt, read before the settle's transaction
        begins; one already unknown in the ledger, or marked so with its identity (its
        receipt could not be saved), is only forgotten."""
        return [
            (attempt_id, flight, self.judge(flight))
            for attempt_id, flight in finished
            if not flight.marked_unknown and flight.receipt_error is None
        ]

    def settle(
        self, session: Session, now: datetime, judged: list[tuple[int, InFlight, Judged]]
    ) -> tuple[list[str], list[InFlight]]:
        """Write each verdict (settled, or unknown). A stale lease (a zombie's) is refused
        by the settle's first compare-and-set, before it writes anything, so it leaves
        the others in the transaction as they are, without a savepoint around each
        (``ledger.refused_before_writing``). Returns each outcome's name (``stale`` for a
        zombie's) and the flights that settled as failures (to capture after the commit)."""
        outcomes: list[str] = []
        settled_failures: list[InFlight] = []
        for attempt_id, flight, verdict_of in judged:
            verdict = verdict_of.verdict
            try:
                with ledger.refused_before_writing(session):
                    ledger.settle_judged(
                        session,
                        attempt_id,
                        verdict_of,
                        ledger.Fenced(flight.claim.fence, measured=measurements(flight.peaks)),
                        actor=self.worker.worker_id,
                        now=now,
                        node=self.worker.node,
                    )
                outcomes.append(verdict.outcome.value if verdict.outcome else "unknown")
                if verdict.outcome not in (None, Outcome.SUCCEEDED):
                    settled_failures.append(flight)
            except StaleLease:
                # A zombie: our lease was revoked while we were away. The evidence
                # files stay on disk; the ledger belongs to whoever revoked us.
                outcomes.append("stale")
        return outcomes, settled_failures
