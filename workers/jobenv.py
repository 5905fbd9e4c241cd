"""What a job is started with.

A job starts from a clean environment (``controller.environment``: ``BASE_ENV``,
``LC_*``), plus its stage's ``env`` (``${NAME}`` references resolved from the worker's
environment) and the ``pass_env`` variables, plus the ``LANEWAY_*`` variables the worker
sets for it (``workers.service``); no other ``LANEWAY_*`` variable of the worker. Every
resolved, referenced or passed value is a secret: the supervisor redacts it from the
logs, and ``controller.attempt.classify`` from the result, reason and diagnostics before
they reach the ledger (that half lives on the floor below the services, with the one
verdict, ``controller.attempt.judge_attempt``).
"""

from __future__ import annotations

from laneway.controller.environment import (
    BASE_ENV,
    ENV_REF,
    SUPERVISOR_ENV,
    SecretMissing,
    job_environment,
    missing_variables,
    resolve_env,
    secret_values,
    stage_secrets,
)

__all__ = [
    "BASE_ENV",
    "ENV_REF",
    "SUPERVISOR_ENV",
    "SecretMissing",
    "job_environment",
    "missing_variables",
    "resolve_env",
    "secret_values",
    "stage_secrets",
]
