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

An operator's own ``reconcile ATTEMPT --as …`` is ``reconcile_by_hand``; as succeeded,
for a stage that declares outputs, it hands them over too (``outputs_for_success``):
stored from the attempt's workspace and recorded with the settle, or refused, so that
no job reconciled succeeded leaves the stages that need it without their inputs.

Both write through ``ledger.settle_judged``, the one write of every verdict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import db, evidence, identity, ledger, limits
from laneway.controller.attempt import Delivery, Judged, judge_attempt
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
    exit record says (``ledger.settle_judged``, reconciled as ``evidence``), recorded
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
                job_state = ledger.settle_judged(
                    session,
                    found.attempt_id,
                    Judged(Verdict(found.outcome, found.words), result=found.result, stored=stored),
                    ledger.Reconciled(
                        "evidence",
                        reason=f"{why}; {found.words}",
                        exit_code=found.exit_code,
                        exit_signal=found.exit_signal,
                    ),
                    actor=actor,
                    now=clock.now(),
                    node=row.node,
                )
        settled.append(Settled(found, job_state))
    return settled


def reconcile_by_hand(
    engine: Engine,
    attempt_id: int,
    *,
    as_: str,
    reason: str,
    result: dict[str, Any] | None,
    actor: str,
    patience: float = 30.0,
    clock: Clock | None = None,
) -> JobState:
    """An operator's ``reconcile ATTEMPT --as AS --reason REASON [--result FILE]``: the
    unknown attempt settled as ``as_`` says (``ledger.RECONCILE_AS``), with the exit code
    and signal of its verified exit record when it has one, ``result`` (read by
    ``read_result_file``) and, for a success, its stage's declared outputs
    (``outputs_for_success``), in one write transaction retried on a transient ledger
    failure for up to ``patience`` seconds. Returns the job's new state.

    Raises NotFound for an unknown attempt, UsageError for a ``reason`` that says
    nothing, IllegalTransition when the attempt is not unknown (another reconcile won)
    or a success's outputs cannot be handed over."""
    clock = clock or SystemClock()
    with db.session_factory(engine)() as session:
        found = ledger.get_attempt(session, attempt_id)
        exit_code, exit_signal = evidence.verified_exit(found)
        node = found.node
    if not reason.strip():
        raise UsageError("--reason must say why (it is recorded in the ledger)")
    why = reason.strip()
    # A success hands its declared outputs on, as a worker's settle would.
    stored = outputs_for_success(engine, attempt_id) if as_ == "succeeded" else []
    said = ledger.RECONCILE_AS.get(as_)  # one it does not know: refused by the reconcile
    judged = Judged(Verdict(said[0] if said else None, why), result=result, stored=stored)
    how = ledger.Reconciled(as_, reason=why, exit_code=exit_code, exit_signal=exit_signal)
    for trying in db.retrying(patience=patience):
        with trying, db.transaction(db.session_factory(engine)) as session:
            job_state = ledger.settle_judged(
                session, attempt_id, judged, how, actor=actor, now=clock.now(), node=node
            )
    return job_state


def outputs_for_success(engine: Engine, attempt_id: int) -> list[dict[str, Any]]:
    """What an operator's ``reconcile ATTEMPT --as succeeded`` records: the declared
    outputs of the attempt's stage, found in its workspace, hashed and put in the run's
    artifact store (``judge_attempt`` given the success; call it outside any
    transaction, then hand the result to the settle: ``ledger.settle_judged``).
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
