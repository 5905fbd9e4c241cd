"""Pipeline configuration: the pydantic models and the checks each field gets.

A config is validated whole before anything is written. Every problem becomes one line
``field.path: message`` so ``laneway dry-run`` can list them all at once (loading and
the problem lines: controller/config.py; the template checks run by
``PipelineConfig``'s validator: controller/templates.py).

Secret rule (invariant 8): a config never holds a secret value. An env var whose *name*
looks secret (an ``_``-separated part of it is KEY, APIKEY, TOKEN, SECRET, PASS,
PASSWORD, PASSWD, CREDENTIAL(S), AUTH or AUTHORIZATION: ``OPENAI_API_KEY`` and
``GH_TOKEN`` do, ``MONKEY`` does not) must have exactly ``${ENV_NAME}`` as its value,
and no argv or env value may contain a literal that looks like a credential
(``Bearer …``, ``sk-…``, ``ghp_…``, ``AKIA…``, ``xoxb-…``).
``${ENV_NAME}`` references are resolved from the worker's environment at spawn time.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from laneway.controller import limits
from laneway.controller.states import Attention, Outcome

KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""Item keys become directory names: no slash, no leading dot, so never ``..``."""
NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,62}$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SECRET_NAME = re.compile(
    r"(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASS|PASSWORD|PASSWD|CREDENTIALS?|AUTH|AUTHORIZATION)(_|$)",
    re.IGNORECASE,
)
SECRET_LITERAL = re.compile(
    r"(?i:bearer\s+[A-Za-z0-9._~+/-]{8,})|\bsk-[A-Za-z0-9_-]{16,}|\bghp_[A-Za-z0-9]{20,}"
    r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abp]-[A-Za-z0-9-]{10,}"
)
PATTERN_HELP = {
    KEY_PATTERN: "use letters, digits, '_', '.', '-' (at most 128), starting with a letter or "
    "digit; no slashes",
    NAME_PATTERN: "use lowercase letters, digits, '_', '-' (at most 63), starting with a letter",
    ENV_NAME_PATTERN: "use letters, digits and '_', not starting with a digit",
}


def _ledger_int(value: int) -> int:
    problem = limits.int_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _mebibytes(value: float) -> float:
    if value >= limits.MAX_MIB:
        raise ValueError(f"{value:g} MiB is too large: a size is below 2**43 MiB (2**63 bytes)")
    return value


def _text(value: str) -> str:
    problem = limits.text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _whole_number(value: Any) -> Any:
    """A number where an integer is meant, never text or a boolean (``"60"`` and
    ``true`` are refused, not read as 60 and 1); a float only when it is whole and fits
    the ledger (``1e308`` is named as the number it is)."""
    _no_text_or_boolean(value, "a whole number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number; give a whole number")
        if not value.is_integer():
            raise ValueError(f"{value:g} is not a whole number; give one without a fraction")
        if not limits.LEDGER_INT_MIN <= value <= limits.LEDGER_INT_MAX:
            raise ValueError(
                f"{value:g} does not fit the ledger, which stores integers from "
                f"{limits.LEDGER_INT_MIN} to {limits.LEDGER_INT_MAX}"
            )
        return int(value)
    return value


def _real_number(value: Any) -> Any:
    """A number where a number is meant, never text or a boolean (``cost_usd = true``
    is refused, not read as a budget of 1)."""
    _no_text_or_boolean(value, "a number")
    if isinstance(value, int) and not -(10**308) <= value <= 10**308:
        raise ValueError(f"a {value.bit_length()}-bit integer is not a usable number")
    return value


def _no_text_or_boolean(value: Any, wanted: str) -> None:
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not {wanted}; give {wanted}")
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ValueError(f"{shown!r} is text, not {wanted}; write {wanted} without quotes")
    if not isinstance(value, int | float):
        raise ValueError(f"give {wanted}, not {_kind_of(value)}")


def _kind_of(value: Any) -> str:
    kinds: list[tuple[type, str]] = [(list, "a list"), (dict, "a table"), (type(None), "nothing")]
    return next((words for kind, words in kinds if isinstance(value, kind)), "that")


LedgerInt = Annotated[int, BeforeValidator(_whole_number), AfterValidator(_ledger_int)]
"""Every integer a config gives: a number (never text or a boolean) that every ledger
column stores (controller/limits.py). A validator, not ``Field(ge=..., le=...)``: a
field's own ``Field(ge=0)`` would replace a bound of the same kind given here."""
ExitCode = Annotated[int, AfterValidator(_ledger_int)]
"""An exit code, a key of ``exit_codes``: a key is text in TOML and JSON (``"3"``)."""
Finite = Annotated[float, BeforeValidator(_real_number), Field(allow_inf_nan=False)]
"""Every float a config gives: a number (never text or a boolean); nan and inf are
refused (they pass any range check)."""
Mebibytes = Annotated[
    float,
    BeforeValidator(_real_number),
    Field(allow_inf_nan=False),
    AfterValidator(_mebibytes),
]
"""A size in MiB whose byte count fits the ledger (``log_cap_mib``, ``capture.max_mib``)."""
Text = Annotated[str, AfterValidator(_text)]
"""Free text that reaches an argv, a path or an environment: no NUL, no lone surrogate."""
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
NAME_RE = re.compile(NAME_PATTERN)
Key = Annotated[str, Field(pattern=KEY_PATTERN)]


def _output_name(value: str) -> str:
    """A declared output: a file name or glob relative to the workspace, inside it."""
    if not value or "\0" in value or len(value) > 1024:
        raise ValueError("an output is a non-empty file name or glob of at most 1024 characters")
    if value.startswith("/") or ".." in value.split("/") or "\\" in value:
        raise ValueError(
            f"{value!r} must be relative to the attempt's workspace, without '..' or "
            "backslashes (e.g. answer.json or shards/*.jsonl)"
        )
    return value


OutputName = Annotated[str, AfterValidator(_output_name)]
USAGE_KEY_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
PATTERN_HELP[USAGE_KEY_PATTERN] = (
    "a usage key uses letters, digits, '_', '.', '-' (at most 64), starting with a letter"
)
UsageKey = Annotated[str, Field(pattern=USAGE_KEY_PATTERN)]
AMOUNT_MAX = 1e15
"""The largest budget or expected usage, so that sums over many attempts stay finite."""
Amount = Annotated[
    float, BeforeValidator(_real_number), Field(ge=0, le=AMOUNT_MAX, allow_inf_nan=False)
]
PRIORITY_MAX = 1_000_000_000
"""An item's priority is an integer in [-PRIORITY_MAX, PRIORITY_MAX]."""
Budget = dict[UsageKey, Amount]
"""Usage key -> most the run (or stage) may spend, e.g. ``budget = { cost_usd = 50 }``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Selection(_Strict):
    """Choose what to run next by the useful output it buys (top-level ``select``): when
    more ready work exists than can be admitted, a free slot goes to the item group
    (``group_field``) with the best measured ``by`` per ``per`` in this run, except that
    a share ``explore`` of admissions goes to the other groups in turn (a group not yet
    measured first). Only the order changes, never what a job is."""

    by: UsageKey = Field(description="The usage key that measures useful output.")
    per: UsageKey = Field(description="The usage key it is divided by (e.g. cost_usd).")
    explore: Finite = Field(0.1, ge=0, le=1, description="The share of admissions explored.")


class RateLimit(_Strict):
    """A rate limit stages draw from (``limits.NAME``): at most ``calls`` attempts
    started, and at most each usage key's amount reported (plus what attempts in flight
    are expected to use), within any ``per_seconds``, across lanes and nodes. Written
    flat: ``{ calls = 60, per_seconds = 60 }``, ``{ output_tokens = 200000, per_seconds
    = 60 }``; any key but ``calls`` and ``per_seconds`` is a usage key."""

    per_seconds: Finite = Field(gt=0, le=86400, description="The window, seconds.")
    calls: LedgerInt | None = Field(None, ge=1, description="Most attempts started in a window.")
    usage: Budget = Field(
        default_factory=dict, description="Usage key -> most reported in a window."
    )

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        if isinstance(value, dict) and "usage" not in value:
            known = {"per_seconds", "calls"}
            usage = {k: v for k, v in value.items() if k not in known}
            value = {k: v for k, v in value.items() if k in known} | {"usage": usage}
        return value

    @model_validator(mode="after")
    def _something(self) -> RateLimit:
        if self.calls is None and not self.usage:
            raise ValueError("limit nothing: give calls, a usage key, or both")
        return self


class GpuCapacity(_Strict):
    """A node's GPU budget for the concurrency rule of invariant 9."""

    total_mib: LedgerInt = Field(gt=0, description="GPU memory of each of the node's devices, MiB.")
    devices: LedgerInt = Field(1, ge=1, le=64, description="How many such devices the node has.")
    fraction: Finite = Field(0.9, gt=0, le=1, description="Usable share of total_mib.")
    baseline_mib: LedgerInt = Field(0, ge=0, description="Memory used by processes not ours, MiB.")

    @model_validator(mode="after")
    def _baseline_fits(self) -> GpuCapacity:
        # As a GPU description's devices are checked (workers/gpu.py::devices_problem).
        if self.baseline_mib > self.total_mib:
            raise ValueError(
                f"baseline_mib {self.baseline_mib} is more than total_mib {self.total_mib}; "
                "give the memory others use of each device, at most its total"
            )
        return self


class NodeConfig(_Strict):
    name: Name
    memory_floor_mib: LedgerInt = Field(ge=0, description="Free memory never to go below, MiB.")
    max_jobs: LedgerInt = Field(
        ge=1, le=limits.MAX_SLOTS, description="Most attempts running at once on the node."
    )
    gpu: GpuCapacity | None = None


class LaneConfig(_Strict):
    name: Name
    node: Name
    caps: dict[Name, Annotated[LedgerInt, Field(ge=0)]] = Field(
        default_factory=dict, description="stage name -> most running at once in this lane"
    )


class CaptureConfig(_Strict):
    """Bounded capture of a failed attempt's workspace (archive + sha256 manifest)."""

    max_mib: Mebibytes = Field(256, gt=0, description="Most input bytes archived, MiB.")
    max_seconds: Finite = Field(60, gt=0, description="Stop adding files after this long.")


class RetryPolicy(_Strict):
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


class StageConfig(_Strict):
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


class CloseoutStep(_Strict):
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


RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Headers laneway sets itself on a webhook's POST: a config cannot replace them."""


def webhook_problem(url: str) -> str | None:
    """What is wrong with a webhook URL as it is sent (its references resolved), None
    if nothing: an http(s) URL of printable ASCII (no whitespace or control character),
    with a host, a numeric port if any, and no ``user:password@`` (credentials go in a
    header, ``Authorization = "Bearer ${TOKEN}"``, where they are redacted)."""
    if not all("!" <= c <= "~" for c in url):
        return (
            "holds whitespace, a control or a non-ASCII character; percent-encode it "
            "(a space is %20)"
        )
    match = re.match(r"\A([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)", url)
    if match is None or match.group(1).lower() not in ("http", "https"):
        return "give an http:// or https:// URL"
    netloc = match.group(2)
    try:
        urlsplit(url)
    except ValueError:
        return "its host does not parse: give a name, an IPv4 address or [an IPv6 address]"
    if "@" in netloc:
        return (
            "holds credentials (user:password@host); send them in a header instead, "
            'e.g. headers.Authorization = "Bearer ${HOOK_TOKEN}"'
        )
    host, port = netloc, ""
    if ":" in netloc and not netloc.endswith("]"):
        host, _, port = netloc.rpartition(":")
    if not host:
        return "give a host after http(s)://"
    if port and not ENV_REF.search(netloc) and not (port.isdigit() and 0 < int(port) < 65536):
        return "its port: give a number from 1 to 65535"
    return None


def header_problem(value: str) -> str | None:
    """What is wrong with a header value as it is sent, None if nothing: no line break or
    other control character (a CR/LF would start a header of its own), Latin-1 text."""
    if any((c < " " and c != "\t") or c == "\x7f" for c in value):
        return "holds a line break or a control character; remove it"
    if any(c > "\xff" for c in value):
        return "holds a character outside Latin-1, which a header cannot carry"
    return None


def _webhook(value: str) -> str:
    """An http(s) URL (``webhook_problem``); ``${NAME}`` references (a token in the
    path) are resolved by the notifying process from its environment, and checked again
    once resolved (controller/notify_delivery.py)."""
    _text(value)
    problem = webhook_problem(ENV_REF.sub("x", value))  # a reference stands for a word
    if problem:
        raise ValueError(problem)
    if SECRET_LITERAL.search(value):
        raise ValueError("holds a literal credential; reference it as ${ENV_NAME}")
    return value


class NotifyConfig(_Strict):
    """Tell the operator when the run needs them (controller/notify.py): a webhook and/or a
    command, called once per new attention state with the reason, the next step and a
    dashboard link. Secrets only as ``${NAME}`` references in ``webhook`` and ``headers``,
    resolved from the notifying process's environment and redacted wherever recorded."""

    webhook: Annotated[str, AfterValidator(_webhook)] | None = Field(
        None, description="POSTed one JSON object per notification (2xx = delivered)."
    )
    headers: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")], Text] = Field(
        default_factory=dict,
        description='Extra request headers, e.g. Authorization = "Bearer ${HOOK_TOKEN}".',
    )
    command: list[Text] | None = Field(
        None,
        min_length=1,
        description="argv run without a shell, the notification as JSON on stdin and in "
        "LANEWAY_NOTIFY_* variables (exit 0 = delivered).",
    )
    pass_env: list[Annotated[str, Field(pattern=ENV_NAME_PATTERN)]] = Field(
        default_factory=list,
        description="Variables the command gets from the notifier's environment.",
    )
    on: list[Attention] = Field(
        default_factory=lambda: list(Attention), description="Which attention states to tell."
    )
    retries: LedgerInt = Field(4, ge=0, le=10, description="Tries after the first, with backoff.")
    timeout_seconds: Finite = Field(10.0, gt=0, le=120, description="Per try.")

    @model_validator(mode="after")
    def _check(self) -> NotifyConfig:
        problems = []
        if self.webhook is None and self.command is None:
            problems.append("give a webhook URL, a command, or both")
        for name, value in self.headers.items():
            if name.lower() in RESERVED_HEADERS:
                problems.append(f"headers.{name}: laneway sets it itself; remove it")
            problem = header_problem(value)
            if problem:
                problems.append(f"headers.{name}: {problem}")
            if SECRET_NAME.search(name.replace("-", "_")) or SECRET_LITERAL.search(value):
                if not ENV_REF.search(value) or SECRET_LITERAL.search(value):
                    problems.append(
                        f"headers.{name}: looks like a credential; reference it as "
                        "${ENV_NAME} from the notifying process's environment"
                    )
        for i, value in enumerate(self.command or []):
            if ENV_REF.search(value) or SECRET_LITERAL.search(value):
                problems.append(
                    f"command.{i}: no secrets or ${{...}} in argv (visible in the process "
                    "list); pass them with pass_env"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self


class PipelineConfig(_Strict):
    name: Name
    nodes: list[NodeConfig] = Field(min_length=1)
    lanes: list[LaneConfig] = Field(min_length=1)
    stages: list[StageConfig] = Field(min_length=1)
    items: list[ItemConfig] = Field(default_factory=list)
    items_file: Text | None = Field(None, description="JSONL file of items, one per line.")
    batch_cap: LedgerInt | None = Field(None, ge=1, description="Most items a run takes on.")
    infra_breaker: LedgerInt = Field(
        3,
        ge=1,
        description="Pause the run after infrastructure failures of this many distinct "
        "items in a row (a success resets the count).",
    )
    unknown_scope: Literal["run", "everything"] = Field(
        "run",
        description="What an attempt with an unknown outcome stops until it is reconciled: "
        "its own run's dispatch, or every run's.",
    )
    budget: Budget | None = Field(
        None,
        description="Usage key -> most the run may spend (e.g. { cost_usd = 50 }); "
        "admission refuses (reason budget) an attempt whose expected cost would pass it.",
    )
    limits: dict[Name, RateLimit] = Field(
        default_factory=dict,
        description="Rate limits by name (e.g. provider-a = { calls = 60, per_seconds = 60 "
        "}), drawn from by the stages that list them, across lanes and nodes.",
    )
    select: Selection | None = Field(
        None,
        description="Choose among item groups by measured yield, exploring a share "
        '(e.g. { by = "useful_tokens", per = "cost_usd", explore = 0.1 }).',
    )
    group_field: Name = Field(
        "group", description="The item field that names its group, for select."
    )
    priority_field: Name = Field(
        "priority",
        description="The item field that holds its priority (an integer; default 0): "
        "ready jobs are admitted highest first, FIFO among equals.",
    )
    sources: list[Text] = Field(
        default_factory=list,
        description="Files hashed and frozen (a change halts the run); in the reuse key of "
        'the stages that list them, or of every stage with sources_scope = "all".',
    )
    sources_scope: Literal["listed", "all"] = Field(
        "listed",
        description='Which stages the top-level sources count for in reuse keys: "listed" '
        '(the stages that list them in their own sources) or "all".',
    )
    artifact_store: Text | None = Field(
        None,
        description="Where stage outputs are stored, as an fsspec URL: file:///a/shared/mount "
        "or s3://bucket/prefix (S3 or any S3-compatible server; credentials and endpoint "
        "only from the worker's environment). Default: content-addressed under each "
        "worker's runtime dir (artifacts/), which only that machine can read.",
    )
    notify: NotifyConfig | None = Field(
        None, description="Tell the operator when the run needs them (docs/operations.md)."
    )
    closeout: list[CloseoutStep] = Field(
        default_factory=list,
        description="Steps run in order when the run finishes or is stopped; each is "
        "attempted even if an earlier one failed.",
    )

    @model_validator(mode="after")
    def _cross_check(self, info: ValidationInfo) -> PipelineConfig:
        # controller/templates.py renders these models, so it imports this module.
        from laneway.controller import templates

        problems: list[str] = []
        problems += _duplicates("nodes", [n.name for n in self.nodes])
        problems += _duplicates("lanes", [lane.name for lane in self.lanes])
        problems += _duplicates("stages", [s.name for s in self.stages])
        problems += _duplicates("items", [i.key for i in self.items])
        problems += _duplicates("closeout", [step.name for step in self.closeout])
        nodes = {n.name for n in self.nodes}
        stage_names = [s.name for s in self.stages]
        for i, lane in enumerate(self.lanes):
            if lane.node not in nodes:
                problems.append(
                    f"lanes.{i}.node: unknown node {lane.node!r}; known: {sorted(nodes)}"
                )
            for capped in lane.caps:
                if capped not in stage_names:
                    problems.append(f"lanes.{i}.caps.{capped}: unknown stage")
        for i, stage_config in enumerate(self.stages):
            earlier = stage_names[:i]
            for need in stage_config.needs:
                if need not in earlier:
                    problems.append(
                        f"stages.{i}.needs: {need!r} must name a stage listed before "
                        f"{stage_config.name!r}"
                    )
            for code, outcome in stage_config.exit_codes.items():
                if outcome is Outcome.SUCCEEDED and code != 0 and 0 not in stage_config.exit_codes:
                    problems.append(f"stages.{i}.exit_codes.{code}: 0 must map to succeeded too")
            for node in stage_config.nodes or []:
                if node not in nodes:
                    problems.append(
                        f"stages.{i}.nodes: unknown node {node!r}; known: {sorted(nodes)}"
                    )
            if stage_config.nodes is not None and not stage_config.nodes:
                problems.append(
                    f"stages.{i}.nodes: empty; name at least one node, or leave it out to "
                    "run the stage on its lane's node"
                )
        for i, stage_config in enumerate(self.stages):
            for name in stage_config.limits:
                if name not in self.limits:
                    problems.append(
                        f"stages.{i}.limits: unknown limit {name!r}; define it under "
                        f"[limits] (known: {sorted(self.limits)})"
                    )
        lanes = {lane.name for lane in self.lanes}
        for i, item in enumerate(self.items):
            if item.lane not in lanes:
                problems.append(f"items.{i}.lane: unknown lane {item.lane!r} for item {item.key!r}")
            group = item.fields.get(self.group_field)
            if self.select is not None and not (isinstance(group, str) and 0 < len(group) <= 64):
                problems.append(
                    f"items.{i}.{self.group_field}: with select, every item names its group "
                    f"(text of 1 to 64 characters); item {item.key!r} has "
                    f"{'none' if group is None else type(group).__name__}"
                )
            wanted = item.fields.get(self.priority_field, 0)
            if (
                not isinstance(wanted, int)
                or isinstance(wanted, bool)
                or not -PRIORITY_MAX <= wanted <= PRIORITY_MAX
            ):
                problems.append(
                    f"items.{i}.{self.priority_field}: the priority of item {item.key!r} must "
                    f"be an integer from {-PRIORITY_MAX} to {PRIORITY_MAX}"
                )
        problems += templates.placeholder_problems(self.stages, self.items)
        if self.artifact_store is not None:
            problems += artifact_store_problems(self.artifact_store)
        frozen = isinstance(info.context, dict) and info.context.get("frozen")
        if not frozen:
            # Load-time only: a run frozen before these checks existed must still load.
            problems += _limit_key_problems(self)
            problems += templates.closeout_problems(self.closeout)
            if not problems:
                problems += templates.render_problems(self.stages, self.items)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def group(self, item: ItemConfig) -> str | None:
        """The item's group when the config selects by yield (else None: one queue)."""
        return None if self.select is None else str(item.fields[self.group_field])

    def priority(self, item: ItemConfig) -> int:
        """The item's priority (its ``priority_field``; 0 when it has none)."""
        return int(item.fields.get(self.priority_field, 0))

    def stage(self, name: str) -> StageConfig:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def canonical_json(self) -> str:
        """The frozen form stored with a run; its sha256 identifies the config."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


STORE_PACKAGES = {"s3": "laneway[s3]", "s3a": "laneway[s3]", "gs": "gcsfs", "gcs": "gcsfs"}


def artifact_store_problems(url: str) -> list[str]:
    """Why ``artifact_store`` cannot be used: not a URL fsspec can open here, or one
    that carries credentials (they come only from the worker's environment)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.scheme or len(parts.scheme) < 2:
        return [
            f"artifact_store: {url!r} is not a URL; write file:///a/shared/mount or "
            "s3://bucket/prefix"
        ]
    if "@" in parts.netloc or parts.password or parts.query:
        return [
            "artifact_store: holds credentials or options; give the bare URL (e.g. "
            "s3://bucket/prefix) and put credentials and the endpoint in the worker's "
            "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)"
        ]
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path):
        return [f"artifact_store: {url!r} must name an absolute path (file:///srv/artifacts)"]
    if parts.scheme == "memory":
        return ["artifact_store: memory:// lives in one process; use file:// or s3://"]
    import fsspec

    try:
        fsspec.get_filesystem_class(parts.scheme)
    except ImportError:
        package = STORE_PACKAGES.get(parts.scheme, f"the fsspec backend for {parts.scheme}://")
        return [f"artifact_store: {parts.scheme}:// needs {package}; pip install '{package}'"]
    except ValueError:
        return [f"artifact_store: fsspec knows no {parts.scheme}:// store; use file:// or s3://"]
    return []


LIMIT_FIELDS = ("calls", "per_seconds")


def _limit_key_problems(config: PipelineConfig) -> list[str]:
    """A rate limit's key other than ``calls`` and ``per_seconds`` limits a usage key: one
    that looks like a misspelt field (``cals``), one no stage drawing from the limit
    expects (``burst``: ``expected_usage`` says what an attempt will use, so the limit
    binds before attempts report it), and an amount of 0 (admits nothing) are refused
    rather than kept as a limit that never binds."""
    problems = []
    for name, limit in sorted(config.limits.items()):
        drawing = [s for s in config.stages if name in s.limits]
        for key, amount in sorted(limit.usage.items()):
            where = f"limits.{name}.{key}"
            close = difflib.get_close_matches(key.lower(), LIMIT_FIELDS, n=1, cutoff=0.8)
            if close:
                problems.append(
                    f"{where}: not a field of a rate limit; did you mean {close[0]}? (its "
                    "fields are calls and per_seconds; any other key limits a usage key)"
                )
            elif drawing and not any(key in s.expected_usage for s in drawing):
                stages = ", ".join(s.name for s in drawing)
                problems.append(
                    f"{where}: a rate limit's fields are calls and per_seconds, so {key!r} "
                    f"limits a usage key, but no stage that draws from {name} ({stages}) "
                    f"gives expected_usage.{key}; give it (e.g. expected_usage = {{ {key} = "
                    f"... }}) or remove {key}"
                )
            elif amount == 0:
                problems.append(
                    f"{where}: a limit of 0 admits nothing; give a positive amount, or remove {key}"
                )
    return problems


def _duplicates(field: str, names: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen:
            out.append(f"{field}: {name!r} appears more than once")
        seen.add(name)
    return out
