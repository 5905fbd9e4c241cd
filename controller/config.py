"""Pipeline configuration: pydantic models, loading (TOML or JSON) and argv rendering.

A config is validated whole before anything is written. Every problem becomes one line
``field.path: message`` so ``laneway dry-run`` can list them all at once.

Secret rule (invariant 8): a config never holds a secret value. An env var whose *name*
looks secret (an ``_``-separated part of it is KEY, APIKEY, TOKEN, SECRET, PASS,
PASSWORD, PASSWD, CREDENTIAL(S), AUTH or AUTHORIZATION: ``OPENAI_API_KEY`` and
``GH_TOKEN`` do, ``MONKEY`` does not) must have exactly ``${ENV_NAME}`` as its value,
and no argv or env value may contain a literal that looks like a credential
(``Bearer …``, ``sk-…``, ``ghp_…``, ``AKIA…``, ``xoxb-…``).
``${ENV_NAME}`` references are resolved from the worker's environment at spawn time.

Shell rule: a value substituted into a shell's ``-c`` script (argv[0] ``sh``, ``bash``,
``zsh``, ``dash``, ``ksh``, ``ash`` or ``mksh``, also behind ``env`` or ``busybox``) is
shell-quoted for the place it lands in (``render_argv``), so item data is never run as
code; ``{name:raw}`` inserts it unquoted, as code. Where a script cannot be quoted
(backquotes, here-documents, ...) only plain values are accepted, checked for every
item when the config is loaded. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import string
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from controller import limits
from controller.errors import ConfigError
from controller.states import RETRYABLE_OUTCOMES, Outcome

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
RESERVED_PLACEHOLDERS = ("item", "lane")
INPUTS_PREFIX = "inputs."
"""``{inputs.<stage>}``: the directory an attempt finds a needed stage's outputs in."""
SAMPLE_INPUTS_ROOT = "/attempt/inputs"
PREVIEW_INPUTS_ROOT = "<attempt_dir>/inputs"
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


LedgerInt = Annotated[int, AfterValidator(_ledger_int)]
"""Every integer a config gives: what every ledger column stores (controller/limits.py).
A validator, not ``Field(ge=..., le=...)``: a field's own ``Field(ge=0)`` would replace
a bound of the same kind given here."""
Finite = Annotated[float, Field(allow_inf_nan=False)]
"""Every float a config gives: nan and inf are refused (they pass any range check)."""
Mebibytes = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_mebibytes)]
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
Amount = Annotated[float, Field(ge=0, le=AMOUNT_MAX, allow_inf_nan=False)]
Budget = dict[UsageKey, Amount]
"""Usage key -> most the run (or stage) may spend, e.g. ``budget = { cost_usd = 50 }``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuCapacity(_Strict):
    """A node's GPU budget for the concurrency rule of invariant 9."""

    total_mib: LedgerInt = Field(gt=0, description="GPU memory of the node's device, MiB.")
    fraction: Finite = Field(0.9, gt=0, le=1, description="Usable share of total_mib.")
    baseline_mib: LedgerInt = Field(0, ge=0, description="Memory used by processes not ours, MiB.")


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
    gpu_mib: LedgerInt = Field(0, ge=0, description="GPU memory reserved while an attempt runs.")
    needs: list[Name] = Field(default_factory=list)
    outputs: list[OutputName] = Field(
        default_factory=list,
        description="Files (names or globs relative to the workspace) this stage "
        "delivers: when an attempt would succeed each is hashed (sha256) and stored in the "
        "run's artifact store; one missing makes the attempt failed. Stages that need "
        "this one get them under inputs/<stage>/ ({inputs.<stage>}).",
    )
    output_max_mib: int = Field(
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
    exit_codes: dict[LedgerInt, Outcome] = Field(default_factory=_default_exit_codes)
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
    reuse: bool = Field(
        True,
        description="A new run may take over the result of this stage's job from an "
        "earlier run when nothing it depends on changed; false: always run it.",
    )
    sources: list[Text] | None = Field(
        None,
        description="The pipeline sources this stage's result depends on (for reuse); "
        "default: all of them.",
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
    def _check_fields(self) -> ItemConfig:
        """An item's fields reach argv, env, paths and the ledger: refused here, naming
        the item and the field, rather than when an attempt starts (a NUL made the
        supervisor fail to spawn) or is recorded (a lone surrogate, a TOML date)."""
        for name, value in (self.model_extra or {}).items():
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
    sources: list[Text] = Field(default_factory=list, description="Files hashed and frozen.")
    artifact_store: Text | None = Field(
        None,
        description="Where stage outputs are stored, as an fsspec URL: file:///a/shared/mount "
        "or s3://bucket/prefix (S3 or any S3-compatible server; credentials and endpoint "
        "only from the worker's environment). Default: content-addressed under each "
        "worker's runtime dir (artifacts/), which only that machine can read.",
    )
    closeout: list[CloseoutStep] = Field(
        default_factory=list,
        description="Steps run in order when the run finishes or is stopped; each is "
        "attempted even if an earlier one failed.",
    )

    @model_validator(mode="after")
    def _cross_check(self, info: ValidationInfo) -> PipelineConfig:
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
            for source in stage_config.sources or []:
                if source not in self.sources:
                    problems.append(
                        f"stages.{i}.sources: {source} is not one of the pipeline's sources"
                    )
        lanes = {lane.name for lane in self.lanes}
        for i, item in enumerate(self.items):
            if item.lane not in lanes:
                problems.append(f"items.{i}.lane: unknown lane {item.lane!r} for item {item.key!r}")
        problems += _placeholder_problems(self.stages, self.items)
        if self.artifact_store is not None:
            problems += artifact_store_problems(self.artifact_store)
        frozen = isinstance(info.context, dict) and info.context.get("frozen")
        if not frozen:
            # Load-time only: a run frozen before these checks existed must still load.
            problems += _closeout_problems(self.closeout)
            if not problems:
                problems += _render_problems(self.stages, self.items)
        if problems:
            raise ValueError("\n".join(problems))
        return self

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


def _duplicates(field: str, names: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen:
            out.append(f"{field}: {name!r} appears more than once")
        seen.add(name)
    return out


def _plain_segments(template: str) -> list[tuple[bool, str]]:
    """Split a template into (is_secret_reference, text) parts: ``${NAME}`` references
    are resolved by the worker at spawn time, never by template rendering."""
    parts: list[tuple[bool, str]] = []
    last = 0
    for match in ENV_REF.finditer(template):
        parts.append((False, template[last : match.start()]))
        parts.append((True, match.group(0)))
        last = match.end()
    parts.append((False, template[last:]))
    return parts


def placeholders(template: str) -> list[str]:
    """The ``{name}`` fields of a template (``{{`` is a literal brace; ``${NAME}`` is a
    secret reference, not a field). Raises ValueError for a malformed template."""
    names = []
    for is_ref, text in _plain_segments(template):
        if not is_ref:
            names += [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    return names


def _placeholder_problems(stages: list[StageConfig], items: list[ItemConfig]) -> list[str]:
    problems = []
    outputs_of = {stage.name: stage.outputs for stage in stages}
    for stage in stages:
        templates = [*stage.argv, *stage.env.values(), *([stage.cwd] if stage.cwd else [])]
        names: set[str] = set()
        for template in templates:
            try:
                names.update(placeholders(template))
            except ValueError as exc:
                problems.append(f"stages.{stage.name}: bad template {template!r}: {exc}")
        for name in sorted(names):
            if name.startswith(INPUTS_PREFIX):
                producer = name[len(INPUTS_PREFIX) :]
                if producer not in stage.needs or not outputs_of.get(producer):
                    problems.append(
                        f"stages.{stage.name}: placeholder {{{name}}} names no stage with "
                        f"outputs that {stage.name!r} needs; add {producer!r} to its needs "
                        f"and declare outputs on {producer!r}"
                    )
                continue
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                problems.append(
                    f"stages.{stage.name}: placeholder {{{name}}} must be a plain field name"
                )
                continue
            if name in RESERVED_PLACEHOLDERS:
                continue
            missing = [item.key for item in items if name not in item.fields]
            if missing:
                shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
                problems.append(
                    f"stages.{stage.name}: placeholder {{{name}}} is not a field of "
                    f"{len(missing)} item(s) ({shown}); add it to those items or remove it"
                )
    return problems


RAW_SPEC = "raw"
"""``{name:raw}`` inserts a value into a shell script unquoted (see ``render_argv``)."""
SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "ash", "mksh"})
"""argv[0] basenames whose ``-c`` argument is a script that the shell parses."""
PLAIN_VALUE = re.compile(r"[A-Za-z0-9_@%+=:,./-]*")
"""Characters with no meaning to a shell in any context: such a value is inserted as
it is where laneway cannot quote (a here-document, backquotes, ``${...}``, ...)."""
PLAIN_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")


class TemplateError(ValueError):
    """A template that cannot be rendered safely for one item."""


def _template_parts(template: str) -> list[tuple[str, str | None, str, str | None]]:
    """``string.Formatter().parse`` over a template, with ``${NAME}`` references kept as
    literal text. Raises ValueError for a malformed template."""
    parts: list[tuple[str, str | None, str, str | None]] = []
    for is_ref, text in _plain_segments(template):
        if is_ref:
            parts.append((text, None, "", None))
        else:
            parts += [
                (literal, name, spec or "", conversion)
                for literal, name, spec, conversion in string.Formatter().parse(text)
            ]
    return parts


def _field_text(values: dict[str, Any], name: str, spec: str, conversion: str | None) -> str:
    value = values[name]
    if conversion is not None:
        converters: dict[str, Callable[[Any], str]] = {"r": repr, "s": str, "a": ascii}
        if conversion not in converters:
            raise ValueError(f"unknown conversion !{conversion} (use !r, !s or !a)")
        value = converters[conversion](value)
    return str(value) if spec == RAW_SPEC else format(value, spec)


def _item_values(item: ItemConfig, inputs_root: str | None = None) -> dict[str, Any]:
    """An item's placeholder values; with ``inputs_root`` (an attempt's ``inputs/``
    directory) also ``{inputs.<stage>}`` for every stage it could need."""
    values: dict[str, Any] = {**item.fields, "item": item.key, "lane": item.lane}
    if inputs_root is not None:
        values = InputValues(values, inputs_root)
    return values


class InputValues(dict[str, Any]):
    """Placeholder values where ``inputs.<stage>`` is ``<inputs_root>/<stage>`` (which
    stages a template may name is checked when the config is loaded)."""

    def __init__(self, values: dict[str, Any], inputs_root: str) -> None:
        super().__init__(values)
        self.inputs_root = inputs_root

    def __missing__(self, name: str) -> str:
        if name.startswith(INPUTS_PREFIX) and NAME_RE.fullmatch(name[len(INPUTS_PREFIX) :]):
            return f"{self.inputs_root}/{name[len(INPUTS_PREFIX) :]}"
        raise KeyError(name)


CLOSEOUT_PLACEHOLDERS = ("run", "runtime_dir")
_SAMPLE_CLOSEOUT = {"run": "1", "runtime_dir": "/runtime"}


def _closeout_problems(steps: list[CloseoutStep]) -> list[str]:
    """Closeout templates checked like a stage's: well-formed, known placeholders."""
    problems = []
    for i, step in enumerate(steps):
        places = [(f"closeout.{i}.argv.{j}", t) for j, t in enumerate(step.argv)]
        places += [(f"closeout.{i}.cwd", step.cwd)] if step.cwd else []
        for where, template in places:
            try:
                names = placeholders(template)
                for name in names:
                    if name not in CLOSEOUT_PLACEHOLDERS:
                        raise ValueError(
                            f"unknown placeholder {{{name}}}; closeout steps have {{run}} and "
                            "{runtime_dir}"
                        )
                render_values(template, _SAMPLE_CLOSEOUT)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                problems.append(
                    f"{where}: bad template {template!r}: {_error_text(exc)}; write {{{{ and }}}} "
                    "for a literal brace"
                )
    return problems


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"unknown placeholder {{{exc.args[0]}}}"
    return str(exc)


def _render_problems(stages: list[StageConfig], items: list[ItemConfig]) -> list[str]:
    """Render every stage's templates for every item, as attempts will be rendered, so
    that a value that cannot be inserted (a format spec that does not fit it, or shell
    metacharacters where a script cannot quote them) is refused before a run starts."""
    failures: dict[str, tuple[str, list[str]]] = {}
    for i, stage in enumerate(stages):
        for item in items:
            values = _item_values(item, SAMPLE_INPUTS_ROOT)
            places = [(f"argv.{j}", t) for j, t in enumerate(stage.argv)]
            places += [(f"env.{name}", t) for name, t in stage.env.items()]
            places += [("cwd", stage.cwd)] if stage.cwd else []
            argv: list[str] = []
            for where, template in places:
                try:
                    rendered = render_values(template, values)
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    failures.setdefault(f"stages.{i}.{where}", (_error_text(exc), []))[1].append(
                        item.key
                    )
                    continue
                if where.startswith("argv."):
                    argv.append(rendered)
            script = shell_script_index(argv) if len(argv) == len(stage.argv) else None
            if script is None:
                continue
            try:
                render_shell_script(stage.argv[script], values)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                failures.setdefault(f"stages.{i}.argv.{script}", (_error_text(exc), []))[1].append(
                    item.key
                )
    problems = []
    for where, (message, keys) in failures.items():
        shown = ", ".join(keys[:5]) + (" …" if len(keys) > 5 else "")
        problems.append(f"{where}: for item(s) {shown}: {message}")
    return problems


def render(template: str, item: ItemConfig, inputs_root: str | None = None) -> str:
    """Expand ``{item}``, ``{lane}``, item fields and ``{inputs.<stage>}`` in one env/cwd
    template (never quoted; ``{name:raw}`` is the same as ``{name}`` here), leaving
    ``${NAME}`` references for the worker to resolve. For argv use ``render_argv``."""
    return render_values(template, _item_values(item, inputs_root))


def render_values(template: str, values: dict[str, Any]) -> str:
    out = []
    for literal, name, spec, conversion in _template_parts(template):
        out.append(literal)
        if name is not None:
            out.append(_field_text(values, name, spec, conversion))
    return "".join(out)


class _ShellScanner:
    """Follows the quoting context of a POSIX shell script as it is written out, so
    that each value inserted into it can be quoted for the place it lands in.

    Contexts it quotes in: unquoted words (also inside ``$(...)``), ``"..."`` and
    ``'...'``, and comments. Anywhere else (after a backslash or a ``$``, inside
    backquotes, ``${...}``, ``$((...))``, ``$'...'``, after a here-document starts, or
    after a ``case`` inside ``$(...)``, whose ``)`` it cannot follow) it reports the
    context as unknown, and only a plain value may go there."""

    def __init__(self) -> None:
        self.stack: list[str] = ["code"]
        self.depth: list[int] = [0]
        self.escape = False
        self.dollar = False
        self.subst_opened = False
        self.arith_closing = False
        self.word_start = True
        self.word = ""
        self.less = 0
        self.heredoc_pending = False
        self.unknown: str | None = None

    def context(self) -> tuple[str, str]:
        """(``code`` | ``dq`` | ``sq`` | ``comment`` | ``unknown``, why unknown)."""
        if self.unknown:
            return "unknown", self.unknown
        if self.escape:
            return "unknown", "right after a backslash"
        if self.dollar:
            return "unknown", "right after a $"
        top = self.stack[-1]
        if top in ("code", "subst"):
            return "code", ""
        if top in ("dq", "sq", "comment"):
            return top, ""
        where = {
            "backtick": "inside `...` (use $(...) instead)",
            "param": "inside ${...}",
            "arith": "inside $((...))",
            "ansi": "inside $'...'",
        }
        return "unknown", where[top]

    def feed(self, text: str) -> None:
        for char in text:
            self._char(char)

    def after_word(self) -> None:
        """A quoted value was written: it continues the current word."""
        self.word_start = False
        self.word += "x"
        self.less = 0

    def _push(self, frame: str) -> None:
        self.stack.append(frame)
        self.depth.append(0)

    def _pop(self) -> None:
        if len(self.stack) > 1:
            self.stack.pop()
            self.depth.pop()

    def _end_word(self) -> None:
        if self.word == "case" and "subst" in self.stack:
            self.unknown = "after a case statement inside $(...)"
        self.word = ""

    def _char(self, char: str) -> None:
        if char == "\n" and self.heredoc_pending:
            self.unknown = "inside or after a here-document"
        top = self.stack[-1]
        if top == "comment":
            if char == "\n":
                self._pop()
                self.word_start = True
            return
        if self.escape:
            self.escape = False
            self.word_start = False
            return
        if top == "sq":
            if char == "'":
                self._pop()
            return
        if top in ("ansi", "backtick"):
            if char == "\\":
                self.escape = True
            elif char == ("'" if top == "ansi" else "`"):
                self._pop()
            return
        if self.dollar:
            self.dollar = False
            opened = {"(": "subst", "{": "param", "'": "ansi", '"': "dq"}.get(char)
            if opened and not (top == "dq" and char in "'\""):
                self._push(opened)
                self.subst_opened = opened == "subst"
                self.word = ""
                return
        if self.subst_opened:
            self.subst_opened = False
            if char == "(":
                self.stack[-1] = "arith"
                return
            top = self.stack[-1]
        if top == "param":
            if char in "'\"`\\$":
                self.unknown = "after a quote or $ inside ${...}"
            elif char == "{":
                self.depth[-1] += 1
            elif char == "}":
                if self.depth[-1] == 0:
                    self._pop()
                else:
                    self.depth[-1] -= 1
            return
        if top == "arith":
            if self.arith_closing:
                self.arith_closing = False
                if char == ")":
                    self._pop()
                else:
                    self.unknown = "after an ambiguous $(( ... )"
                return
            if char in "'\"`\\":
                self.unknown = "after a quote inside $((...))"
            elif char == "$":
                self.dollar = True
            elif char == "(":
                self.depth[-1] += 1
            elif char == ")":
                if self.depth[-1] == 0:
                    self.arith_closing = True
                else:
                    self.depth[-1] -= 1
            return
        if top == "dq":
            if char == "\\":
                self.escape = True
            elif char == '"':
                self._pop()
            elif char == "`":
                self._push("backtick")
            elif char == "$":
                self.dollar = True
            return
        # Unquoted shell code: the top level, or inside $(...).
        self.less = self.less + 1 if char == "<" else 0
        if self.less == 2:
            self.heredoc_pending = True
        elif self.less == 3:
            self.heredoc_pending = False  # <<< is a here-string: one word, no body
        if char == "#" and self.word_start:
            self._push("comment")
            return
        separator = char in " \t\n;&|()<>"
        if separator:
            self._end_word()
        else:
            self.word += char
        if char == "\\":
            self.escape = True
        elif char == "'":
            self._push("sq")
        elif char == '"':
            self._push("dq")
        elif char == "`":
            self._push("backtick")
        elif char == "$":
            self.dollar = True
        elif char == "(":
            self.depth[-1] += 1
        elif char == ")":
            if top == "subst" and self.depth[-1] == 0:
                self._pop()
            else:
                self.depth[-1] = max(0, self.depth[-1] - 1)
        self.word_start = separator


def _quote_for(context: str, value: str) -> str:
    """``value`` as one literal word in ``context``: closing and reopening the quotes
    around a single-quoted word keeps it verbatim inside ``"..."`` and ``'...'``."""
    if context == "dq":
        return '"' + shlex.quote(value) + '"'
    if context == "sq":
        return "'" + shlex.quote(value) + "'"
    if context == "comment":
        return shlex.quote(value.replace("\n", " ").replace("\r", " "))
    return shlex.quote(value)


def render_shell_script(template: str, values: dict[str, Any]) -> str:
    """Render a script a shell will parse (``sh -c SCRIPT``): each value is quoted for
    where it lands, so it reaches the command verbatim and is never run as code;
    ``{name:raw}`` inserts it unquoted. Raises TemplateError when a value that is not
    plain lands where it cannot be quoted (see ``_ShellScanner``)."""
    scanner = _ShellScanner()
    out = []
    for literal, name, spec, conversion in _template_parts(template):
        out.append(literal)
        scanner.feed(literal)
        if name is None:
            continue
        text = _field_text(values, name, spec, conversion)
        context, why = scanner.context()
        if spec == RAW_SPEC:
            inserted = text
            scanner.feed(text)
        elif context == "unknown":
            plain = PLAIN_NUMBER if why.startswith("inside $((") else PLAIN_VALUE
            if not plain.fullmatch(text):
                raise TemplateError(
                    f"{{{name}}} sits {why}, where laneway cannot quote it, and its value "
                    f"{text[:40]!r} has characters a shell would interpret; pass it as a "
                    f"positional parameter (sh -c '... \"$1\"' sh {{{name}}}), or write "
                    f"{{{name}:raw}} if it is meant to be shell code"
                )
            inserted = text
            scanner.feed(text)
        else:
            inserted = _quote_for(context, text)
            scanner.after_word()
        out.append(inserted)
    return "".join(out)


def _skip_env(argv: list[str], index: int) -> int | None:
    """The index of the command an ``env`` at ``index`` runs (past its options and
    NAME=value assignments), or None when that cannot be told (``env -S``)."""
    index += 1
    takes_value = {"-u", "--unset", "-C", "--chdir", "-P"}
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return index + 1
        if word in takes_value:
            index += 2
        elif word.startswith(("-S", "--split-string")):
            return None
        elif word.startswith("-") or ("=" in word and not word.startswith("=")):
            index += 1
        else:
            return index
    return None


def shell_script_index(argv: list[str]) -> int | None:
    """Which element of a (rendered) argv a shell parses as a script: the argument of
    ``-c`` when argv[0] is a shell (sh, bash, zsh, dash, ksh, ash, mksh), also behind
    ``env [OPTION] [NAME=value ...]`` or ``busybox``; else None."""
    index = 0
    while index < len(argv):
        base = os.path.basename(argv[index])
        if base == "env":
            found = _skip_env(argv, index)
            if found is None:
                return None
            index = found
            continue
        if base == "busybox":
            index += 1
            continue
        if base not in SHELLS:
            return None
        break
    else:
        return None
    index += 1
    dash_c = False
    while index < len(argv):
        word = argv[index]
        if word == "--":
            index += 1
            break
        if word in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file"):
            index += 2
            continue
        if word.startswith("--"):
            index += 1
            continue
        if len(word) > 1 and word[0] in "-+":
            if word[0] == "-" and "c" in word[1:]:
                dash_c = True
            index += 1
            continue
        break
    return index if dash_c and index < len(argv) else None


def render_command(templates: list[str], values: dict[str, Any]) -> list[str]:
    """Render a whole argv: every element expanded; the script of a shell's ``-c``
    (see ``shell_script_index``) rendered by ``render_shell_script``. Which element
    that is is decided on the rendered argv, so a placeholder in argv[0] or in the
    shell's options cannot move a script out of reach of quoting."""
    argv = [render_values(template, values) for template in templates]
    script = shell_script_index(argv)
    if script is not None:
        argv[script] = render_shell_script(templates[script], values)
    return argv


def render_argv(stage: StageConfig, item: ItemConfig, inputs_root: str | None = None) -> list[str]:
    """The argv one attempt of ``stage`` runs for ``item`` (``inputs_root``: its
    attempt's ``inputs/`` directory). Values substituted into a shell's ``-c`` script
    are shell-quoted for where they land (``{name:raw}`` opts out); elsewhere they are
    passed as they are (no shell parses them)."""
    return render_command(stage.argv, _item_values(item, inputs_root))


def closeout_values(run_id: int | str, runtime_dir: str) -> dict[str, Any]:
    return {"run": str(run_id), "runtime_dir": str(runtime_dir)}


def render_closeout(
    step: CloseoutStep, *, run_id: int | str, runtime_dir: str
) -> tuple[list[str], str | None]:
    """A closeout step's argv and cwd for one run (``{run}``, ``{runtime_dir}``)."""
    values = closeout_values(run_id, runtime_dir)
    cwd = render_values(step.cwd, values) if step.cwd else None
    return render_command(step.argv, values), cwd


def preview_argv(config: PipelineConfig) -> dict[str, list[str]]:
    """Each stage's argv rendered for the first item, as a run would start it (for
    ``dry-run``); empty when the config has no items."""
    if not config.items:
        return {}
    first = config.items[0]
    return {stage.name: render_argv(stage, first, PREVIEW_INPUTS_ROOT) for stage in config.stages}


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for error in exc.errors():
        loc = ".".join(str(part) for part in error["loc"] if part != "[key]")
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "string_pattern_mismatch":
            message = f"{error['input']!r} is not allowed: " + PATTERN_HELP.get(
                error["ctx"]["pattern"], f"must match {error['ctx']['pattern']}"
            )
        for line in message.splitlines():
            lines.append(f"{loc}: {line}" if loc else line)
    return lines


def _read_items_file(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The items of a JSONL file. A device or FIFO is refused, not read (``/dev/zero``
    would fill memory, a FIFO hang), and so is a file past ``ITEMS_FILE_MAX_BYTES``."""
    items: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        data = limits.read_regular_file(path, limits.ITEMS_FILE_MAX_BYTES)
    except OSError as exc:
        return [], [f"items_file: cannot read {path}: {exc.strerror or exc}"]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [f"items_file: {path} is not UTF-8 text (byte {exc.start})"]
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"items_file line {number}: not JSON ({exc.msg}); one object per line")
            continue
        except (ValueError, RecursionError) as exc:
            # An integer past Python's 4300 digits, or nesting past the recursion limit.
            problems.append(f"items_file line {number}: not usable JSON ({_short(exc)})")
            continue
        if not isinstance(row, dict):
            problems.append(f"items_file line {number}: must be a JSON object with key and lane")
            continue
        items.append(row)
    return items, problems


def parse_config(raw: dict[str, Any], base_dir: Path) -> PipelineConfig:
    """Validate a raw config mapping; paths are resolved against ``base_dir``.

    Raises ConfigError with one line per problem.
    """
    raw = dict(raw)
    problems: list[str] = []
    if isinstance(raw.get("items_file"), str) and not limits.text_problem(raw["items_file"]):
        items_path = (base_dir / raw["items_file"]).resolve()
        extra, problems = _read_items_file(items_path)
        inline = raw.get("items") or []
        raw["items"] = [*inline, *extra] if isinstance(inline, list) else inline
        raw["items_file"] = str(items_path)
    if isinstance(raw.get("sources"), list):
        raw["sources"] = [_resolved(base_dir, s) for s in raw["sources"]]
    relative_cwds = _relative_cwd_templates(raw)
    if isinstance(raw.get("stages"), list):
        raw["stages"] = [
            _absolute_sources(_absolute_cwd(stage, base_dir), base_dir) for stage in raw["stages"]
        ]
    if isinstance(raw.get("closeout"), list):
        raw["closeout"] = [
            _absolute_cwd(step, base_dir, absolute_prefix="{runtime_dir}")
            for step in raw["closeout"]
        ]
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_printable(problems + _format_validation_error(exc))) from None
    except RecursionError:
        raise ConfigError([*problems, "CONFIG: nested too deeply to check"]) from None
    problems += _joined_cwd_problems(config, relative_cwds)
    if problems:
        raise ConfigError(_printable(problems))
    return config


def _short(exc: BaseException) -> str:
    return str(exc).split(";")[0][:120] or type(exc).__name__


def _printable(lines: list[str]) -> list[str]:
    """Problem lines as one printable line each: a lone surrogate or a control character
    from the config is escaped (printing it raw would fail, or break the line)."""
    out = []
    for line in lines:
        line = line.encode("utf-8", "backslashreplace").decode("utf-8")
        out.append(_CONTROL.sub(lambda match: ascii(match.group())[1:-1], line))
    return out


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""What breaks a line or a terminal: C0 and C1 controls and the Unicode line separators."""


def _relative_cwd_templates(raw: dict[str, Any]) -> dict[int, str]:
    """Each stage's ``cwd`` that is relative in the config and starts with a
    placeholder: joined under the config's directory, it must not render to an absolute
    path (``_joined_cwd_problems``). (A closeout step's cwd can start only with
    ``{runtime_dir}``, left as it is, or ``{run}``, never absolute.)"""
    stages = raw.get("stages")
    found = {}
    for i, stage in enumerate(stages if isinstance(stages, list) else []):
        cwd = stage.get("cwd") if isinstance(stage, dict) else None
        if isinstance(cwd, str) and cwd.startswith("{") and not cwd.startswith("{{"):
            found[i] = cwd
    return found


def _joined_cwd_problems(config: PipelineConfig, templates: dict[int, str]) -> list[str]:
    """A relative cwd is joined under the config's directory; one whose placeholder
    brings an absolute path would silently run under the config's directory instead
    (``/cfg//srv/x``): refused, naming the field and the items."""
    problems = []
    for i, template in templates.items():
        rendered = [(item.key, _try_render(template, _item_values(item))) for item in config.items]
        absolute = [(key, value) for key, value in rendered if value and os.path.isabs(value)]
        if not absolute:
            continue
        keys = ", ".join(key for key, _ in absolute[:5]) + (" …" if len(absolute) > 5 else "")
        problems.append(
            f"stages.{i}.cwd: {template!r} is relative to the config file, but renders to an "
            f"absolute path for item(s) {keys} ({absolute[0][1]!r}); write an absolute cwd, "
            "or make the value a path relative to the config file's directory"
        )
    return problems


def _try_render(template: str, values: dict[str, Any]) -> str | None:
    try:
        return render_values(template, values)
    except (ValueError, KeyError, IndexError, TypeError):
        return None  # reported by the template checks


def _absolute_cwd(stage: Any, base_dir: Path, *, absolute_prefix: str | None = None) -> Any:
    """Relative paths in a stage or closeout step are relative to the config file, never
    to wherever laneway runs: ``cwd``, and an ``argv[0]`` such as ``./tool.sh`` or
    ``bin/tool``. A cwd starting with ``absolute_prefix`` (a closeout step's
    ``{runtime_dir}``, always absolute) is left as it is."""
    if not isinstance(stage, dict):
        return stage
    cwd = stage.get("cwd")
    if isinstance(cwd, str) and cwd and not (absolute_prefix and cwd.startswith(absolute_prefix)):
        stage = {**stage, "cwd": os.path.normpath(base_dir / stage["cwd"])}
    argv = stage.get("argv")
    if isinstance(argv, list) and argv and isinstance(argv[0], str):
        program = argv[0]
        if "/" in program and not program.startswith(("/", "{")):
            stage = {**stage, "argv": [os.path.normpath(base_dir / program), *argv[1:]]}
    return stage


def _absolute_sources(stage: Any, base_dir: Path) -> Any:
    """A stage's ``sources`` resolve like the pipeline's, so they compare equal."""
    if not isinstance(stage, dict) or not isinstance(stage.get("sources"), list):
        return stage
    return {**stage, "sources": [_resolved(base_dir, path) for path in stage["sources"]]}


def _resolved(base_dir: Path, path: Any) -> Any:
    """A source path resolved against the config's directory; a value that is not a
    usable path is left as it is, for validation to name."""
    if not isinstance(path, str) or limits.text_problem(path):
        return path
    return str((base_dir / path).resolve())


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a config file (``.toml`` or ``.json``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(_printable([f"CONFIG: {path} must end in .toml or .json"]))
    try:
        data = limits.read_regular_file(path, limits.CONFIG_MAX_BYTES)
    except OSError as exc:
        raise ConfigError(
            _printable([f"CONFIG: cannot read {path}: {exc.strerror or exc}"])
        ) from None
    try:
        raw = tomllib.loads(data.decode()) if suffix == ".toml" else json.loads(data)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            _printable([f"CONFIG: {path} is not valid {suffix[1:].upper()}: {exc}"])
        ) from None
    except (ValueError, RecursionError) as exc:
        # An integer past Python's 4300 digits, or nesting past the recursion limit.
        raise ConfigError(
            _printable([f"CONFIG: {path} is not usable {suffix[1:].upper()}: {_short(exc)}"])
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(_printable([f"CONFIG: {path} must hold a table/object at the top level"]))
    return parse_config(raw, path.parent.resolve())


def config_from_frozen(frozen: str) -> PipelineConfig:
    """Rebuild the config a run froze (paths in it are already absolute)."""
    return PipelineConfig.model_validate_json(frozen, context={"frozen": True})


def json_schema() -> dict[str, Any]:
    return PipelineConfig.model_json_schema()


def retryable(stage: StageConfig, outcome: Outcome) -> bool:
    return outcome in RETRYABLE_OUTCOMES and outcome.value in stage.retry.on
