"""What a job is started with, and what is redacted from what it leaves behind.

A job starts from a clean environment (``BASE_ENV``, ``LC_*``, ``LANEWAY_*``), plus its
stage's ``env`` (``${NAME}`` references resolved from the worker's environment) and the
``pass_env`` variables. Every resolved, referenced or passed value is a secret: the
supervisor redacts it from the logs, and ``classify`` from the result, reason and
diagnostics before they reach the ledger.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Literal

from controller.outcome import read_outcome
from controller.states import Outcome
from workers.redact import Redactor, redact_json

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class SecretMissing(Exception):
    pass


def resolve_env(
    templates: dict[str, str], environ: dict[str, str]
) -> tuple[dict[str, str], list[str]]:
    """Resolve ``${NAME}`` references from the worker's environment.

    Returns the resolved env and the names of variables whose values are secret: each
    resolved variable and each referenced one (the supervisor redacts their values).
    Raises SecretMissing naming the variable when one is not set.
    """
    resolved: dict[str, str] = {}
    secret_names: list[str] = []
    for name, template in templates.items():
        references = ENV_REF.findall(template)
        for reference in references:
            if reference not in environ:
                raise SecretMissing(
                    f"env {name}: ${{{reference}}} is not set in the worker's environment"
                )
        resolved[name] = ENV_REF.sub(lambda m: environ[m.group(1)], template)
        if references:
            # Redact both the resolved value and each referenced secret on its own (a
            # job can print any part of the resolved value, the secret alone included).
            secret_names.append(name)
            secret_names += [r for r in references if r not in secret_names]
    return resolved, secret_names


BASE_ENV = ("PATH", "HOME", "LANG", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")
"""What a job gets of the worker's environment besides ``LC_*`` and ``LANEWAY_*``
(docs/security.md): everything else must be named by its stage (``env``, ``pass_env``)."""
NEVER_PASSED = frozenset({"LANEWAY_DATABASE_URL"})
"""Worker variables no job gets, even under the ``LANEWAY_`` prefix (a URL may hold a
password)."""


def job_environment(
    environ: dict[str, str], templates: dict[str, str], pass_env: list[str]
) -> tuple[dict[str, str], list[str], list[str]]:
    """The environment a supervisor starts with: the small base above, the stage's
    resolved ``env``, and the ``pass_env`` variables. Returns (env, names whose values
    are redacted, names the supervisor removes before starting the job: secrets that
    were only referenced inside another variable, present for redaction alone).

    Raises SecretMissing naming the variable when a reference or a ``pass_env``
    variable is not set."""
    env = {
        key: value
        for key, value in environ.items()
        if (key in BASE_ENV or key.startswith(("LC_", "LANEWAY_"))) and key not in NEVER_PASSED
    }
    resolved, secret_names = resolve_env(templates, environ)
    for name in pass_env:
        if name not in environ:
            raise SecretMissing(f"pass_env {name}: not set in the worker's environment")
        env[name] = environ[name]
        if name not in secret_names:
            secret_names.append(name)
    env.update(resolved)
    strip = [name for name in secret_names if name not in env]
    for name in strip:
        env[name] = environ[name]
    return env, secret_names, strip


def secret_values(env: dict[str, str], names: list[str]) -> list[str]:
    return [env[name] for name in names if env.get(name)]


def stage_secrets(stage: Any, environ: dict[str, str]) -> list[str]:
    """The secret values of a stage's attempts, as a worker with ``environ`` resolves
    them (for attempts this worker did not start: recovered or adopted)."""
    try:
        env, names, _ = job_environment(environ, dict(stage.env), list(stage.pass_env))
    except SecretMissing:
        return [environ[n] for n in stage.pass_env if environ.get(n)]
    return secret_values(env, names)


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
