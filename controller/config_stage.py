"""What runs: a stage (its command, environment, resources, outputs, exit codes, retry
and reuse), an item (one unit of work, whose extra keys are argv placeholders), and a
closeout step. controller/templates.py renders these; PipelineConfig
(controller/config_models.py) checks them against each other.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from laneway.controller import limits
from laneway.controller.config_fields import (
    ENV_NAME_PATTERN,
    ENV_REF,
    SECRET_LITERAL,
    SECRET_NAME,
    Budget,
    ExitCode,
    Finite,
    Key,
    LedgerInt,
    Mebibytes,
    Name,
    OutputName,
    Strict,
    Text,
)
from laneway.controller.states import Outcome


class CaptureConfig(Strict):
    """Bounded capture of a failed attempt's workspace (archive + sha256 manifest)."""

    max_mib: Mebibytes = Field(256, gt=0, description="Most input bytes archived, MiB.")
    max_seconds: Finite = Field(60, gt=0, description="Stop adding files after this long.")


class RetryPolicy(Strict):
    """Automatic retry; the default is never (invariant 2)."""

    max_attempts: LedgerInt = Field(1, ge=1, le=20)
    on: list[Literal["failed", "infra_failure", "timed_out"]] = Field(default_factory=list)
    backoff_seconds: Finite = Field(
        0,
        ge=0,
        le=604800,
        description="Wait this long before the first automatic retry, so a failure of "
        "the infrastructure is not retried straight into the same outage (0: at once).",
    )
    backoff_multiplier: Finite = Field(
        2.0, ge=1, le=100, description="Each further retry waits this many times longer."
    )
    backoff_max_seconds: Finite = Field(
        3600, gt=0, le=604800, description="The longest wait between two attempts."
    )


def _default_exit_codes() -> dict[int, Outcome]:
    return {0: Outcome.SUCCEEDED}


class StageConfig(Strict):
    name: Name
    argv: list[Text] = Field(
        min_length=1,
        description="{item}, {lane}, {<item field>} expand; inside a shell's -c script "
        "each value is shell-quoted, {name:raw} inserts it unquoted.",
    )
    cwd: Text | None = Field(None, description="Defaults to the attempt's workspace/.")
    env: dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN)], Text] = Field(default_factory=dict)
    pass_env: list[Annotated[str, Field(pattern=ENV_NAME_PATTERN)]] = Field(
        default_factory=list,
        description="Variables of the worker's environment the job gets as they are "
        "(a job starts from a clean environment; see docs/security.md). Their values are "
        "redacted like referenced secrets; one that is not set is a harness failure.",
    )
    timeout_seconds: LedgerInt = Field(3600, ge=1, le=172800)
    grace_seconds: Finite = Field(10.0, ge=0, le=3600)
    memory_mib: LedgerInt = Field(0, ge=0, description="Memory reserved while an attempt runs.")
    capture: CaptureConfig | None = Field(
        None, description="Archive the workspace of attempts that do not succeed."
    )
    ports: LedgerInt = Field(
        0, ge=0, le=64, description="Free TCP ports to allocate per attempt (LANEWAY_PORTS)."
    )
    log_cap_mib: Mebibytes = Field(
        1024, gt=0, description="Most bytes kept per stream per attempt, MiB; then a marker."
    )
    learn_memory: bool = Field(
        False,
        description="Reserve max(memory_mib, measured peak x memory_margin) once attempts "
        "of this stage have settled with a measured peak.",
    )
    memory_margin: Finite = Field(1.25, ge=1, le=10)
    gpu_mib: LedgerInt = Field(
        0,
        ge=0,
        description="A share of one GPU: the job gets one device (CUDA_VISIBLE_DEVICES), "
        "shared with others only while measured peaks say they fit.",
    )
    gpus: LedgerInt = Field(
        0,
        ge=0,
        le=64,
        description="Whole GPUs per attempt: the job gets that many devices of its own "
        "(CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES).",
    )
    needs: list[Name] = Field(default_factory=list)
    outputs: list[OutputName] = Field(
        default_factory=list,
        description="Files (names or globs relative to the workspace) this stage "
        "delivers: when an attempt would succeed each is hashed (sha256) and stored in the "
        "run's artifact store; one missing makes the attempt failed. Stages that need "
        "this one get them under inputs/<stage>/ ({inputs.<stage>}).",
    )
    output_max_mib: LedgerInt = Field(
        1024,
        ge=1,
        le=1 << 30,
        description="Most bytes one declared output may have, MiB; a larger one is not "
        "stored and the attempt settles harness_failure saying so.",
    )
    nodes: list[Name] | None = Field(
        None,
        description="The nodes that may run this stage (default: its lane's node); its "
        "lane's caps still count it.",
    )
    cap: LedgerInt | None = Field(None, ge=0, description="Most running at once across all lanes.")
    exit_codes: dict[ExitCode, Outcome] = Field(default_factory=_default_exit_codes)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    budget: Budget | None = Field(
        None,
        description="Usage key -> most this stage's attempts may spend in the run; "
        "admission refuses (reason budget) an attempt whose expected cost would pass it.",
    )
    expected_usage: Budget = Field(
        default_factory=dict,
        description="Usage key -> expected cost of one attempt, used until attempts of "
        "this stage have reported usage (then their p90 is).",
    )
    limits: list[Name] = Field(
        default_factory=list,
        description="The rate limits (top-level limits) this stage's attempts draw from; "
        "admission refuses (reason rate_limit) an attempt that would pass one.",
    )
    reuse: bool = Field(
        True,
        description="A new run may take over the result of this stage's job from an "
        "earlier run when nothing it depends on changed; false: always run it.",
    )
    sources: list[Text] | None = Field(
        None,
        description="Files this stage's result depends on besides those its argv names "
        "(a shared module it imports, a model card): hashed, frozen and part of its reuse "
        "key. The files its argv names count without being listed.",
    )
    result: Literal["optional", "required"] = Field(
        "optional",
        description='"required": an attempt settles succeeded only with a result.json '
        "carrying job_id, infrastructure_failure and fatal_failure (booleans); without "
        "one, an exit that maps to success is a harness_failure naming what is missing.",
    )

    @model_validator(mode="after")
    def _check(self) -> StageConfig:
        problems = []
        if self.gpus and self.gpu_mib:
            problems.append(
                "gpus: a stage asks for whole GPUs (gpus) or a share of one (gpu_mib), "
                "not both; drop one"
            )
        for code, outcome in self.exit_codes.items():
            if outcome in (Outcome.NOT_RUN, Outcome.CANCELLED, Outcome.TIMED_OUT):
                problems.append(
                    f"exit_codes.{code}: {outcome.value!r} is decided by laneway, not by an "
                    "exit code; use succeeded, failed, infra_failure, harness_failure or fatal"
                )
        for name, value in self.env.items():
            if SECRET_NAME.search(name) and not re.fullmatch(ENV_REF, value):
                problems.append(
                    f"env.{name}: looks like a secret, so its value must be a reference "
                    f"like ${{{name}}} resolved from the worker's environment, not a literal"
                )
        for i, value in enumerate(self.argv):
            if ENV_REF.search(value):
                problems.append(
                    f"argv.{i}: ${{...}} references are resolved only in env (argv is visible "
                    "to every user in the process list); pass the value through env"
                )
        places = [(f"argv.{i}", v) for i, v in enumerate(self.argv)]
        places += [(f"env.{name}", v) for name, v in self.env.items()]
        for where, value in places:
            if SECRET_LITERAL.search(value):
                problems.append(
                    f"{where}: holds a literal credential; put it in the worker's "
                    "environment and reference it as ${ENV_NAME}"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self


class ItemConfig(BaseModel):
    """One unit of work. Extra keys are item fields usable as argv placeholders."""

    model_config = ConfigDict(extra="allow", frozen=True)
    key: Key
    lane: Name

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _check_fields(self, info: ValidationInfo) -> ItemConfig:
        """An item's fields reach argv, env, paths and the ledger: refused here, naming
        the item and the field, rather than when an attempt starts (a NUL made the
        supervisor fail to spawn) or is recorded (a lone surrogate, a TOML date)."""
        context = info.context if isinstance(info.context, dict) else {}
        priority_field = context.get("priority_field", "priority")
        for name, value in (self.model_extra or {}).items():
            if name == priority_field and isinstance(value, int) and not isinstance(value, bool):
                continue  # bounded by PipelineConfig, whose message gives the real bound
            problem = limits.text_problem(name) or limits.value_problem(value)
            if problem:
                raise ValueError(f"field {name!a} of item {self.key!r} {problem}")
        return self


class CloseoutStep(Strict):
    """A command run once when the run finishes or is stopped (e.g. aggregate, report).

    ``{run}`` and ``{runtime_dir}`` expand in argv and cwd, shell-quoted inside a
    shell's ``-c`` script like a stage's values (``{runtime_dir:raw}`` opts out). A
    relative ``cwd`` and an ``argv[0]`` with a ``/`` are relative to the config file,
    like a stage's (a cwd starting with ``{runtime_dir}`` is left as it is); the
    default cwd is ``runs/<run>/``. Templates are checked when the config is loaded."""

    name: Name
    argv: list[Text] = Field(min_length=1)
    cwd: Text | None = None
    timeout_seconds: LedgerInt = Field(600, ge=1, le=86400)
