"""Pipeline configuration: the top-level model (``PipelineConfig``), the checks across its
fields, and the names of every config model, re-exported from the modules that hold them.

A config is validated whole before anything is written. Every problem becomes one line
``field.path: message`` so ``laneway dry-run`` can list them all at once (loading and
the problem lines: controller/config.py; the template checks run by
``PipelineConfig``'s validator: controller/templates.py). The parts, each below this
module: controller/config_fields.py (field types, strict numbers, the patterns),
controller/config_nodes.py (nodes, lanes, GPUs), controller/config_stage.py (stages,
items, closeout steps) and controller/config_notify.py (notify, webhook URLs, headers).

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
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from laneway.controller import templates
from laneway.controller.config_fields import (
    AMOUNT_MAX,
    ENV_NAME_PATTERN,
    ENV_REF,
    KEY_PATTERN,
    NAME_PATTERN,
    NAME_RE,
    PATTERN_HELP,
    PRIORITY_MAX,
    SECRET_LITERAL,
    SECRET_NAME,
    USAGE_KEY_PATTERN,
    Amount,
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
    UsageKey,
)
from laneway.controller.config_nodes import GpuCapacity, LaneConfig, NodeConfig
from laneway.controller.config_notify import (
    RESERVED_HEADERS,
    NotifyConfig,
    header_problem,
    webhook_problem,
)
from laneway.controller.config_stage import (
    CaptureConfig,
    CloseoutStep,
    ItemConfig,
    RetryPolicy,
    StageConfig,
)
from laneway.controller.states import Outcome

__all__ = [
    "AMOUNT_MAX",
    "ENV_NAME_PATTERN",
    "ENV_REF",
    "KEY_PATTERN",
    "LIMIT_FIELDS",
    "NAME_PATTERN",
    "NAME_RE",
    "PATTERN_HELP",
    "PRIORITY_MAX",
    "RESERVED_HEADERS",
    "SECRET_LITERAL",
    "SECRET_NAME",
    "STORE_PACKAGES",
    "USAGE_KEY_PATTERN",
    "Amount",
    "Budget",
    "CaptureConfig",
    "CloseoutStep",
    "ExitCode",
    "Finite",
    "GpuCapacity",
    "ItemConfig",
    "Key",
    "LaneConfig",
    "LedgerInt",
    "Mebibytes",
    "Name",
    "NodeConfig",
    "NotifyConfig",
    "OutputName",
    "PipelineConfig",
    "RateLimit",
    "RetryPolicy",
    "Selection",
    "StageConfig",
    "Text",
    "UsageKey",
    "artifact_store_problems",
    "header_problem",
    "webhook_problem",
]


class Selection(Strict):
    """Choose what to run next by the useful output it buys (top-level ``select``): when
    more ready work exists than can be admitted, a free slot goes to the item group
    (``group_field``) with the best measured ``by`` per ``per`` in this run, except that
    a share ``explore`` of admissions goes to the other groups in turn (a group not yet
    measured first). Only the order changes, never what a job is."""

    by: UsageKey = Field(description="The usage key that measures useful output.")
    per: UsageKey = Field(description="The usage key it is divided by (e.g. cost_usd).")
    explore: Finite = Field(0.1, ge=0, le=1, description="The share of admissions explored.")


class RateLimit(Strict):
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


class PipelineConfig(Strict):
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
        problems = _name_problems(self) + _lane_problems(self) + _stage_problems(self)
        problems += _item_problems(self)
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


def _name_problems(config: PipelineConfig) -> list[str]:
    """Names that must be unique within their list."""
    problems = _duplicates("nodes", [n.name for n in config.nodes])
    problems += _duplicates("lanes", [lane.name for lane in config.lanes])
    problems += _duplicates("stages", [s.name for s in config.stages])
    problems += _duplicates("items", [i.key for i in config.items])
    problems += _duplicates("closeout", [step.name for step in config.closeout])
    return problems


def _lane_problems(config: PipelineConfig) -> list[str]:
    """A lane names a known node and caps only known stages."""
    problems = []
    nodes = {n.name for n in config.nodes}
    stage_names = [s.name for s in config.stages]
    for i, lane in enumerate(config.lanes):
        if lane.node not in nodes:
            problems.append(f"lanes.{i}.node: unknown node {lane.node!r}; known: {sorted(nodes)}")
        for capped in lane.caps:
            if capped not in stage_names:
                problems.append(f"lanes.{i}.caps.{capped}: unknown stage")
    return problems


def _stage_problems(config: PipelineConfig) -> list[str]:
    """A stage needs only stages listed before it, maps 0 to success when any code does,
    runs on known nodes and draws from defined rate limits."""
    problems = []
    nodes = {n.name for n in config.nodes}
    stage_names = [s.name for s in config.stages]
    for i, stage_config in enumerate(config.stages):
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
                problems.append(f"stages.{i}.nodes: unknown node {node!r}; known: {sorted(nodes)}")
        if stage_config.nodes is not None and not stage_config.nodes:
            problems.append(
                f"stages.{i}.nodes: empty; name at least one node, or leave it out to "
                "run the stage on its lane's node"
            )
    for i, stage_config in enumerate(config.stages):
        for name in stage_config.limits:
            if name not in config.limits:
                problems.append(
                    f"stages.{i}.limits: unknown limit {name!r}; define it under "
                    f"[limits] (known: {sorted(config.limits)})"
                )
    return problems


def _item_problems(config: PipelineConfig) -> list[str]:
    """An item names a known lane, its group when the config selects by yield, and a
    priority in range."""
    problems = []
    lanes = {lane.name for lane in config.lanes}
    for i, item in enumerate(config.items):
        if item.lane not in lanes:
            problems.append(f"items.{i}.lane: unknown lane {item.lane!r} for item {item.key!r}")
        group = item.fields.get(config.group_field)
        if config.select is not None and not (isinstance(group, str) and 0 < len(group) <= 64):
            problems.append(
                f"items.{i}.{config.group_field}: with select, every item names its group "
                f"(text of 1 to 64 characters); item {item.key!r} has "
                f"{'none' if group is None else type(group).__name__}"
            )
        wanted = item.fields.get(config.priority_field, 0)
        if (
            not isinstance(wanted, int)
            or isinstance(wanted, bool)
            or not -PRIORITY_MAX <= wanted <= PRIORITY_MAX
        ):
            problems.append(
                f"items.{i}.{config.priority_field}: the priority of item {item.key!r} must "
                f"be an integer from {-PRIORITY_MAX} to {PRIORITY_MAX}"
            )
    return problems


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
