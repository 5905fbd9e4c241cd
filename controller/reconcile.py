"""Settling a run's unknown attempts from conclusive evidence (``laneway reconcile --run
RUN --from-evidence``), in two steps so a caller can show what it found and ask before
anything is written:

- ``review_evidence``: read the run's unknown attempts and judge each
  (``controller.evidence.judge``): nothing is written;
- ``settle_from_evidence``: settle those whose evidence is conclusive into the outcome
  their exit record establishes, a success with its declared outputs stored as a
  worker's settle would store them (``evidence.with_outputs``), one write transaction
  per attempt.

The judgement alone (``laneway status``, the dashboard) is ``evidence.mark_conclusive``.

An operator's own ``reconcile ATTEMPT --as succeeded`` of a stage that declares outputs
hands them over too (``outputs_for_success``): stored from the attempt's workspace and
recorded with the settle, or refused, so that no job reconciled succeeded leaves the
stages that need it without their inputs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import db, evidence, identity, ledger, limits
from laneway.controller.attempt import Delivery, judge_attempt
from laneway.controller.clock import Clock, SystemClock
from laneway.controller.config import StageConfig
from laneway.controller.errors import IllegalTransition, UsageError
from laneway.controller.evidence import Evidence
from laneway.controller.models import Job, Worker
from laneway.controller.outcome import Verdict
from laneway.controller.states import AttemptState, JobState, Outcome

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from laneway.controller.models import Attempt

EVIDENCE_REASON = "conclusive evidence: verified exit record, supervisor and child gone"
"""What a settle from evidence records as its reason when the operator gives none."""


@dataclass(frozen=True)
class Review:
    """What the evidence says for each unknown attempt of a run (``review_evidence``)."""

    run_id: int
    judged: tuple[Evidence, ...]
    """One judgement per unknown attempt, in attempt order."""
    store_url: str
    """The run's artifact store (where a success's declared outputs go)."""
    attempts: Mapping[int, tuple[Attempt, StageConfig]]
    """Each judged attempt's row and its stage's config, by attempt id."""

    @property
    def conclusive(self) -> list[Evidence]:
        """The judgements ``settle_from_evidence`` settles."""
        return [found for found in self.judged if found.conclusive]

    @property
    def left_unknown(self) -> list[Evidence]:
        """The judgements that settle nothing (what is missing, or what still runs)."""
        return [found for found in self.judged if not found.conclusive]


@dataclass(frozen=True)
class Settled:
    """One attempt settled from its evidence, and where its job went."""

    evidence: Evidence
    job_state: JobState

    def as_dict(self) -> dict[str, Any]:
        return {**self.evidence.as_dict(), "job_state": self.job_state.value}


def read_result_file(path: Path) -> dict[str, Any]:
    """The JSON object of a result file an operator records with a reconcile
    (``reconcile ATTEMPT --result FILE``). Raises UsageError, naming the file and what
    is wrong, for one that is not a regular file (``/dev/zero`` would fill memory, a FIFO
    hang), is past ``limits.RESULT_MAX_BYTES``, is not JSON, or holds what the ledger
    cannot store (NaN, an integer past 64 bits, NUL, a lone surrogate, deep nesting)."""
    try:
        data = limits.read_regular_file(path, limits.RESULT_MAX_BYTES)
    except OSError as exc:
        raise UsageError(f"--result: cannot read {path}: {exc.strerror or exc}") from None
    try:
        parsed = json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise UsageError(f"--result: {path} nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, 4300-digit integers
        raise UsageError(f"--result: {path} is not JSON ({str(exc)[:200]})") from None
    if not isinstance(parsed, dict):
        raise UsageError(f"--result: {path} must hold a JSON object")
    problem = limits.value_problem(parsed)
    if problem:
        raise UsageError(f"--result: {path}: the value at {problem}")
    return parsed


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def review_evidence(engine: Engine, run_id: int) -> Review:
    """Judge every unknown attempt of run ``run_id`` on this machine (its exit record,
    /proc; an attempt of another host is never conclusive here). Read-only. Raises
    NotFound for an unknown run."""
    with db.session_factory(engine)() as session:
        run = ledger.get_run(session, run_id)
        config = ledger.run_config(run)
        store_url = ledger.artifact_store_url(config.artifact_store, run.runtime_dir)
        unknown = list(ledger.unknown_attempts(session, run_id))
        judged = tuple(
            evidence.judge(row, config.stage(stage), worker_host=host, runtime_dir=run.runtime_dir)
            for row, stage, host in unknown
        )
    attempts = {row.id: (row, config.stage(stage)) for row, stage, _ in unknown}
    return Review(run_id=run_id, judged=judged, store_url=store_url, attempts=attempts)


def settle_from_evidence(
    engine: Engine,
    review: Review,
    *,
    actor: str,
    reason: str = "",
    patience: float = 30.0,
    clock: Clock | None = None,
) -> list[Settled]:
    """Settle each attempt whose evidence ``review`` found conclusive, in order, as its
    exit record says (``ledger.reconcile_attempt`` with verdict ``evidence``), recorded
    by ``actor`` with ``reason`` (default ``EVIDENCE_REASON``) and what was found.

    A success hands over its stage's declared outputs as a worker's settle would: stored
    now and recorded with the settle, or settled as the outcome that says why they could
    not be. Each attempt is its own write transaction, retried on a transient ledger
    failure for up to ``patience`` seconds; an error stops at that attempt (those before
    it stay settled) and propagates (IllegalTransition when another reconcile won)."""
    clock = clock or SystemClock()
    why = reason.strip() or EVIDENCE_REASON
    settled: list[Settled] = []
    for found in review.conclusive:
        row, stage = review.attempts[found.attempt_id]
        found, stored = evidence.with_outputs(found, row.attempt_dir, stage, review.store_url)
        for trying in db.retrying(patience=patience):
            with trying, db.transaction(db.session_factory(engine)) as session:
                job_state = ledger.reconcile_attempt(
                    session,
                    found.attempt_id,
                    verdict="evidence",
                    reason=f"{why}; {found.words}",
                    actor=actor,
                    now=clock.now(),
                    result=found.result,
                    exit_code=found.exit_code,
                    exit_signal=found.exit_signal,
                    outcome=found.outcome,
                )
                ledger.record_artifacts(session, row.id, stored, node=row.node, now=clock.now())
        settled.append(Settled(found, job_state))
    return settled


def outputs_for_success(engine: Engine, attempt_id: int) -> list[dict[str, Any]]:
    """What an operator's ``reconcile ATTEMPT --as succeeded`` records: the declared
    outputs of the attempt's stage, found in its workspace, hashed and put in the run's
    artifact store (``judge_attempt`` given the success; call it outside any
    transaction, then record the result with the settle: ``ledger.record_artifacts``).
    Nothing for a stage without outputs, or an attempt that is not unknown (the
    reconcile refuses it itself).

    Raises IllegalTransition (nothing stored, nothing recorded) when the attempt ran on
    another host (its workspace is there), or when an output is missing or cannot be
    stored: the stages that need it would have no inputs."""
    with db.session_factory(engine)() as session:
        attempt = ledger.get_attempt(session, attempt_id)
        run = ledger.get_run(session, attempt.run_id)
        config = ledger.run_config(run)
        job = session.get(Job, attempt.job_id)
        assert job is not None
        stage = config.stage(job.stage)
        worker = session.get(Worker, attempt.worker_id) if attempt.worker_id else None
        host = worker.host if worker is not None else None
        store_url = ledger.artifact_store_url(config.artifact_store, run.runtime_dir)
    if not stage.outputs or attempt.state != AttemptState.UNKNOWN:
        return []
    named = ", ".join(stage.outputs)
    if host is not None and host != identity.host():
        raise IllegalTransition(
            f"attempt {attempt_id} ran on host {host}: its declared outputs ({named}) are in "
            "its workspace there; reconcile it as succeeded on that machine, or --as failed "
            "or --as not-run"
        )
    judged = judge_attempt(
        attempt.attempt_dir,
        Verdict(Outcome.SUCCEEDED, "reconciled by an operator"),
        Delivery.of_stage(stage, store_url),
    )
    verdict = judged.verdict
    if verdict.outcome is not Outcome.SUCCEEDED:
        raise IllegalTransition(
            f"attempt {attempt_id} cannot be reconciled as succeeded: {verdict.reason}; the "
            f"stages that need {job.stage} would have no inputs: reconcile it --as failed or "
            "--as not-run"
        )
    return judged.stored
