"""What a process laneway starts is given: a job (through its supervisor) or a closeout
step. Pure functions over an environment mapping; no process handling here.

A started process gets a clean environment: ``BASE_ENV`` and ``LC_*`` of the starting
service's environment, plus what its stage names (``env``, with ``${NAME}`` references
resolved from that environment, and ``pass_env``), plus the ``LANEWAY_*`` variables the
starter sets itself (a job's ids and paths, a closeout step's run id and directory). No
other ``LANEWAY_*`` variable of the service reaches it: they hold ledger URLs (with
passwords), test hooks and settings of laneway's own processes (docs/security.md).

Every resolved, referenced or passed value is a secret, redacted from what the process
leaves behind (``controller.redact``).

Stdlib and stdlib-only helpers only: ``workers.jobenv`` and ``controller.closeout`` use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from laneway.controller import crashpoints, durable, faults

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

BASE_ENV = ("PATH", "HOME", "LANG", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")
"""What a started process gets of the service's environment besides ``LC_*``
(docs/security.md): everything else must be named by its stage (``env``, ``pass_env``)."""
SUPERVISOR_ENV = (crashpoints.ENV, faults.ENV, durable.GROUP_READABLE_ENV)
"""``LANEWAY_*`` variables a job's supervisor reads itself (its crash points and fault
hooks, the mode of the files it writes): the supervisor is given them and removes them
before it starts the job, like a secret that was only referenced."""


class SecretMissing(Exception):
    pass


def resolve_env(
    templates: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """Resolve ``${NAME}`` references from the service's environment.

    Returns the resolved env and the names of variables whose values are secret: each
    resolved variable and each referenced one (their values are redacted).
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


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """What a started process keeps of the service's environment: ``BASE_ENV`` and
    ``LC_*``, nothing else (no ``LANEWAY_*`` variable: the starter sets its own)."""
    return {
        key: value for key, value in environ.items() if key in BASE_ENV or key.startswith("LC_")
    }


def job_environment(
    environ: Mapping[str, str], templates: Mapping[str, str], pass_env: Iterable[str]
) -> tuple[dict[str, str], list[str], list[str]]:
    """The environment a supervisor starts with: ``inherited``, the stage's resolved
    ``env``, the ``pass_env`` variables and the ``SUPERVISOR_ENV`` variables that are
    set. Returns (env, names whose values are redacted, names the supervisor removes
    before starting the job: secrets that were only referenced inside another variable,
    present for redaction alone, and ``SUPERVISOR_ENV``). The caller adds the
    ``LANEWAY_*`` variables it sets for the job.

    Raises SecretMissing naming the variable when a reference or a ``pass_env``
    variable is not set."""
    env = inherited(environ)
    resolved, secret_names = resolve_env(templates, environ)
    for name in pass_env:
        if name not in environ:
            raise SecretMissing(f"pass_env {name}: not set in the worker's environment")
        env[name] = environ[name]
        if name not in secret_names:
            secret_names.append(name)
    env.update(resolved)
    strip = [name for name in secret_names if name not in env]
    strip += [name for name in SUPERVISOR_ENV if name in environ and name not in env]
    for name in strip:
        env[name] = environ[name]
    return env, secret_names, strip


def missing_variables(
    templates: Mapping[str, str], pass_env: Iterable[str], environ: Mapping[str, str]
) -> list[str]:
    """The variables a stage's ``env`` references or its ``pass_env`` names that are not
    set in ``environ`` (in the order the stage names them; each once): a service
    without them cannot start the stage's jobs (``job_environment`` would refuse)."""
    wanted = [ref for template in templates.values() for ref in ENV_REF.findall(template)]
    wanted += list(pass_env)
    return list(dict.fromkeys(name for name in wanted if name not in environ))


def secret_values(env: Mapping[str, str], names: Iterable[str]) -> list[str]:
    return [env[name] for name in names if env.get(name)]


def stage_secrets(stage: Any, environ: Mapping[str, str]) -> list[str]:
    """The secret values of a stage's attempts, as a service with ``environ`` resolves
    them (for attempts it did not start: recovered or adopted; for closeout steps)."""
    try:
        env, names, _ = job_environment(environ, dict(stage.env), list(stage.pass_env))
    except SecretMissing:
        return [environ[n] for n in stage.pass_env if environ.get(n)]
    return secret_values(env, names)


def credentials(environ: Mapping[str, str]) -> list[str]:
    """The passwords in the service's ``LANEWAY_*`` URLs (the ledger's, the read-only
    role's), and each such URL whole: never given to a started process, redacted from
    what one prints should it find them anyway."""
    found = []
    for name, value in environ.items():
        if not name.startswith("LANEWAY_"):
            continue
        try:
            password = urlsplit(value).password
        except ValueError:  # not a URL (or a malformed one): it holds no password to hide
            continue
        if password:
            found += [password, value]
    return found
