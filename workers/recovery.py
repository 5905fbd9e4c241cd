"""Recovery: what a restarted worker does with the attempts its node's earlier workers
left behind, before it leases anything.

Dead workers of the node are marked lost. Each of their in-flight attempts is then, in
order of preference: adopted when its supervisor still lives (same boot, pid and start
time: never a second copy), settled from its exit record when the supervisor is gone
(the one verdict, ``controller.attempt.judge_attempt``, through ``Finishing.deliver``),
or marked unknown with the reason. The boot and the start times are compared in the
form they were recorded in (``identity.same_boot``, ``identity.same_process``), so a
worker restarted with the portable paths (``workers.seams``) judges them the same way.

``Recovery`` is one part of ``workers.service.WorkerService``: it reads the worker's
identity, clock and ledger from it and hands an adopted attempt to ``WorkerService.track``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil

from laneway.controller import db, identity, ledger
from laneway.controller.attempt import ExitRules
from laneway.controller.errors import IllegalTransition, StaleLease
from laneway.controller.models import Attempt, Job
from laneway.controller.states import AttemptState
from laneway.workers.flight import AdoptedSupervisor, InFlight
from laneway.workers.jobenv import stage_secrets
from laneway.workers.sampler import Peaks
from laneway.workers.supervisor import MARK

if TYPE_CHECKING:
    from laneway.workers.service import WorkerService


def find_supervisor(attempt_id: int, attempt_dir: str) -> tuple[int, int | None] | None:
    """A live supervisor of ``attempt_id`` found by its environment markers — for an
    attempt whose supervisor was started but whose identity never reached the ledger.
    Both the attempt id and its directory must match: ids repeat across ledgers."""
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if MARK not in cmdline:
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


class Recovery:
    """Reconcile what earlier workers of this node left behind (``recover``)."""

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker

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
        with db.transaction(self.worker.factory) as session:
            now = db.ledger_now(session, self.worker.clock)
            for worker in ledger.active_workers(session, node=self.worker.node):
                if worker.id == self.worker.worker_id:
                    continue
                alive = identity.same_boot(worker.boot_id) and identity.same_process(
                    worker.pid, worker.process_start_time
                )
                if not alive:
                    ledger.mark_worker_lost(
                        session,
                        worker.id,
                        now=now,
                        actor=self.worker.worker_id,
                        reason="its process is gone (found by a restarted worker)",
                    )
            orphans = ledger.orphaned_attempts(
                session, node=self.worker.node, worker_id=self.worker.worker_id
            )
        for attempt in orphans:
            try:
                lines.append(self.recover_one(attempt, boot))
            except (StaleLease, IllegalTransition) as exc:
                # Another actor (the controller expiring its lease, an operator) settled
                # or took it between our listing and our write: normal, not ours now.
                lines.append(f"attempt {attempt.id}: already handled elsewhere ({exc})")
        lines += self.note_evidence()
        return lines

    def note_evidence(self) -> list[str]:
        """Unknown attempts of this node (the controller expired their lease while no
        worker ran here) whose exit record this worker can read: each one's conclusive
        evidence is recorded (``ledger.note_evidence``), so the run's next step names
        this node and the command that settles it from its evidence here. Nothing is
        settled: only an operator reconciles an unknown attempt."""
        from laneway.controller import evidence

        with db.reader(self.worker.engine)() as session:
            found = []
            for attempt in ledger.unknown_attempts_on_node(session, node=self.worker.node):
                job = session.get(Job, attempt.job_id)
                run = ledger.get_run(session, attempt.run_id)
                assert job is not None
                stage = ledger.run_config(run).stage(job.stage)
                judged = evidence.judge(attempt, stage, worker_host=None)
                if judged.conclusive and judged.outcome is not None:
                    found.append((attempt, judged.outcome.value, judged.words))
            session.expunge_all()
        lines = []
        for attempt, outcome, words in found:
            with db.transaction(self.worker.factory) as session:
                noted = ledger.note_evidence(
                    session,
                    attempt,
                    actor=self.worker.worker_id,
                    host=identity.host(),
                    outcome=outcome,
                    words=words,
                    now=db.ledger_now(session, self.worker.clock),
                )
            if noted:
                lines.append(
                    f"attempt {attempt.id}: unknown; its evidence here is conclusive "
                    f"({outcome}): `laneway reconcile --from-evidence` settles it"
                )
        return lines

    def recover_one(self, attempt: Attempt, boot: str) -> str:
        label = f"attempt {attempt.id}"
        if attempt.boot_id is not None and not identity.same_boot(attempt.boot_id):
            with db.transaction(self.worker.factory) as session:
                now = db.ledger_now(session, self.worker.clock)
                ledger.mark_unknown(
                    session,
                    attempt.id,
                    actor=self.worker.worker_id,
                    now=now,
                    reason=f"machine rebooted (boot {attempt.boot_id} -> {boot}) while it ran; "
                    "its outcome is unknown",
                )
            return f"{label}: unknown (machine rebooted)"
        found: tuple[int, int | None] | None = None
        if attempt.supervisor_pid is not None:
            if identity.same_process(attempt.supervisor_pid, attempt.supervisor_start_time):
                found = (attempt.supervisor_pid, attempt.supervisor_start_time)
        elif attempt.state == AttemptState.INTENT:
            found = find_supervisor(attempt.id, attempt.attempt_dir)
        with db.transaction(self.worker.factory) as session:
            now = db.ledger_now(session, self.worker.clock)
            fence = ledger.adopt_attempt(
                session,
                attempt.id,
                old_fence=attempt.fence,
                worker_id=self.worker.worker_id,
                now=now,
                lease_seconds=self.worker.lease_seconds,
            )
            run = ledger.get_run(session, attempt.run_id)
            job = session.get(Job, attempt.job_id)
            assert job is not None
            config = ledger.run_config(run)
            stage = config.stage(job.stage)
            store_url = ledger.artifact_store_url(
                config.artifact_store, self.worker.runtime_dir or run.runtime_dir
            )
            self.worker.stages.output_caps[(attempt.run_id, job.stage)] = stage.output_max_mib
            if found is not None and attempt.state == AttemptState.INTENT:
                ledger.record_spawn(
                    session,
                    attempt.id,
                    fence=fence,
                    actor=self.worker.worker_id,
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
            self.worker._track(
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
        judged = self.worker.finishing.deliver(
            claim,
            ExitRules.of_stage(
                stage,
                job_id=attempt.job_id,
                missing_exit=(
                    "intent committed, but no supervisor is running and no exit.json exists: "
                    "the command may have started and died, or never started"
                    if attempt.state == AttemptState.INTENT
                    else "its worker and supervisor are gone and left no exit.json"
                ),
            ),
        )
        verdict = judged.verdict
        with db.transaction(self.worker.factory) as session:
            now = db.ledger_now(session, self.worker.clock)
            ledger.settle_judged(
                session,
                attempt.id,
                judged,
                ledger.Fenced(
                    fence,
                    # Its identity was waiting for the settle its worker never wrote.
                    identity_from_exit=attempt.state == AttemptState.INTENT,
                ),
                actor=self.worker.worker_id,
                now=now,
                node=self.worker.node,
            )
        if verdict.outcome is None:
            return f"{label}: unknown ({verdict.reason})"
        return f"{label}: settled {verdict.outcome.value} from its exit record"
