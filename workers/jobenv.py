"""What a job is started with, and what is redacted from what it leaves behind.

A job starts from a clean environment (``controller.environment``: ``BASE_ENV``,
``LC_*``), plus its stage's ``env`` (``${NAME}`` references resolved from the worker's
environment) and the ``pass_env`` variables, plus the ``LANEWAY_*`` variables the worker
sets for it (``workers.service``); no other ``LANEWAY_*`` variable of the worker. Every
resolved, referenced or passed value is a secret: the supervisor redacts it from the
logs, and ``classify`` from the result, reason and diagnostics before they reach the
ledger.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from controller.environment import (
    BASE_ENV,
    ENV_REF,
    SUPERVISOR_ENV,
    SecretMissing,
    job_environment,
    resolve_env,
    secret_values,
    stage_secrets,
)
from controller.outcome import read_outcome
from controller.redact import Redactor, redact_json
from controller.states import Outcome

__all__ = [
    "BASE_ENV",
    "ENV_REF",
    "SUPERVISOR_ENV",
    "SecretMissing",
    "classify",
    "job_environment",
    "resolve_env",
    "secret_values",
    "stage_secrets",
]


def classify(
    attempt_dir: str,
    *,
    job_id: int,
    exit_codes: dict[int, Outcome],
    result_requirement: Literal["optional", "required"],
    secrets: list[str],
    missing_exit: str,
) -> tuple[Any, dict[str, Any] | None, Any]:
    """``read_outcome``, then the secrets redacted from everything that reaches the
    ledger: the result (keys, strings, numbers), the reason and the diagnostics."""
    verdict, exit_record, result = read_outcome(
        attempt_dir,
        job_id=job_id,
        exit_codes=exit_codes,
        missing_exit=missing_exit,
        result_requirement=result_requirement,
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
