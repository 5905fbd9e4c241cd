"""The one verdict on what an attempt left on disk (``judge_attempt``).

Four callers ask it, and before this module each had its own copy: the worker's settle
(and its restart recovery), the controller settling an attempt whose lease expired,
the evidence judged for an unknown attempt (``laneway status``, ``reconcile
--from-evidence``) and an operator's ``reconcile ATTEMPT --as succeeded``. The steps:

1. the outcome: read from ``exit.json`` and the optional ``result.json`` and classified
   with the stage's exit codes and result rule (``controller.outcome.read_outcome``),
   then every secret redacted from the result, the reason and the diagnostics before
   they reach the ledger (``classify``); or given, when an operator or the evidence
   has decided it already (nothing is read then);
2. an optional amendment of that verdict by the caller (the worker names an OOM kill);
3. a success hands over its stage's declared outputs (``artifacts.deliver``): hashed,
   stored in the run's artifact store and returned for the settle to record, or the
   verdict that says why they could not be. Without a ``Delivery`` nothing is written:
   the read side judges only.

File reads and the artifact store only: call it outside any transaction; the caller
settles what it decides to.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from laneway.controller.attempt import artifacts
from laneway.controller.environment import stage_secrets
from laneway.controller.outcome import Verdict, read_outcome
from laneway.controller.redact import Redactor, redact_json
from laneway.controller.states import Outcome

if TYPE_CHECKING:
    from laneway.controller.config import StageConfig

Amend = Callable[[Verdict, "dict[str, Any] | None"], Verdict]
"""Rewords a classified verdict given its exit record, before outputs are delivered."""


@dataclass(frozen=True)
class ExitRules:
    """How one attempt's exit record is read: the stage's exit codes and result rule,
    the secrets to redact, and the reason when there is no exit record."""

    job_id: int
    exit_codes: Mapping[int, Outcome]
    result_requirement: Literal["optional", "required"]
    secrets: Sequence[str]
    missing_exit: str
    stage: str | None = None
    timeout_seconds: int | None = None
    """The stage's limit: a timeout's reason names it and its field."""

    @classmethod
    def of_stage(
        cls,
        stage: StageConfig,
        *,
        job_id: int,
        missing_exit: str,
        environ: Mapping[str, str] | None = None,
    ) -> ExitRules:
        """The rules ``stage`` sets, its secrets resolved from ``environ`` (default:
        this process's environment; on another machine it may not know them all)."""
        return cls(
            job_id=job_id,
            exit_codes=dict(stage.exit_codes),
            result_requirement=stage.result,
            secrets=stage_secrets(stage, dict(os.environ if environ is None else environ)),
            missing_exit=missing_exit,
            stage=stage.name,
            timeout_seconds=stage.timeout_seconds,
        )


@dataclass(frozen=True)
class Delivery:
    """Where a success's declared outputs go, and how (``artifacts.deliver``)."""

    outputs: Sequence[str]
    store_url: str
    max_bytes: int = artifacts.DEFAULT_OUTPUT_MAX_MIB * artifacts.MIB
    """Each output's bound (the stage's ``output_max_mib``)."""
    between: artifacts.Between = None
    """Run between chunks and files (the worker renews its leases there)."""

    @classmethod
    def of_stage(cls, stage: StageConfig, store_url: str) -> Delivery:
        """A stage's declared outputs into ``store_url``, each bounded by the stage's
        ``output_max_mib``: what every actor that stores a success's outputs uses."""
        return cls(stage.outputs, store_url, max_bytes=stage.output_max_mib * artifacts.MIB)


@dataclass(frozen=True)
class Judged:
    """What an attempt left on disk, judged: the verdict (outcome None: not established),
    the exit record and result as read (None when the outcome was given), and the
    outputs stored for the settle to record (``ledger.settle_judged``)."""

    verdict: Verdict
    exit_record: dict[str, Any] | None = None
    result: Any = None
    stored: list[dict[str, Any]] = field(default_factory=list)


def judge_attempt(
    attempt_dir: str,
    reading: ExitRules | Verdict,
    delivery: Delivery | None = None,
    *,
    amend: Amend | None = None,
) -> Judged:
    """The verdict on what the attempt in ``attempt_dir`` left: classified from its
    exit record by ``reading`` (``ExitRules``), or ``reading`` itself when the outcome
    was decided elsewhere (a ``Verdict``); then ``amend`` (classified verdicts only);
    then, with ``delivery``, a success's declared outputs stored (module docstring)."""
    if isinstance(reading, Verdict):
        judged = Judged(reading)
    else:
        verdict, exit_record, result = classify(
            attempt_dir,
            job_id=reading.job_id,
            exit_codes=dict(reading.exit_codes),
            result_requirement=reading.result_requirement,
            secrets=list(reading.secrets),
            missing_exit=reading.missing_exit,
            stage=reading.stage,
            timeout_seconds=reading.timeout_seconds,
        )
        if amend is not None:
            verdict = amend(verdict, exit_record)
        judged = Judged(verdict, exit_record, result)
    if delivery is None:
        return judged
    verdict, stored = artifacts.deliver(
        judged.verdict,
        attempt_dir,
        list(delivery.outputs),
        delivery.store_url,
        delivery.between,
        max_bytes=delivery.max_bytes,
    )
    return replace(judged, verdict=verdict, stored=stored)


def classify(
    attempt_dir: str,
    *,
    job_id: int,
    exit_codes: dict[int, Outcome],
    result_requirement: Literal["optional", "required"],
    secrets: list[str],
    missing_exit: str,
    stage: str | None = None,
    timeout_seconds: int | None = None,
) -> tuple[Verdict, dict[str, Any] | None, Any]:
    """``read_outcome``, then the secrets redacted from everything that reaches the
    ledger: the result (keys, strings, numbers), the reason and the diagnostics."""
    verdict, exit_record, result = read_outcome(
        attempt_dir,
        job_id=job_id,
        exit_codes=exit_codes,
        missing_exit=missing_exit,
        result_requirement=result_requirement,
        stage=stage,
        timeout_seconds=timeout_seconds,
    )
    if secrets:
        redactor = Redactor(secrets)
        if result is not None:
            result = redact_json(result, secrets)
        verdict = replace(
            verdict,
            reason=redactor.redact_text(verdict.reason),
            diagnostics=[redactor.redact_text(d) for d in verdict.diagnostics],
        )
    return verdict, exit_record, result
