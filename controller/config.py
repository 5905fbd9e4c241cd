"""Pipeline configuration: loading a config (TOML or JSON), and the one import for it.

A config is validated whole before anything is written. Every problem becomes one line
``field.path: message`` so ``laneway dry-run`` can list them all at once. The parts:

- controller/config_models.py: the pydantic models, each field's bounds, the secret
  rule (invariant 8) and the cross-checks;
- controller/templates.py: placeholders and rendering (``render_argv``,
  ``render_closeout``, ``preview_argv``) and the template checks run at load time;
- controller/shell_quoting.py: the shell rule: what a shell makes of a ``-c`` script,
  so that each value inserted into one is quoted for where it lands;
- this module: reading a file, resolving its relative paths, the problem lines.

Every public name of the parts is importable from here (``from laneway.controller.config import
StageConfig, render_argv, load_config``).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from laneway.controller import limits
from laneway.controller.config_models import (
    AMOUNT_MAX,
    ENV_NAME_PATTERN,
    ENV_REF,
    KEY_PATTERN,
    NAME_PATTERN,
    NAME_RE,
    PATTERN_HELP,
    SECRET_LITERAL,
    SECRET_NAME,
    STORE_PACKAGES,
    USAGE_KEY_PATTERN,
    Amount,
    Budget,
    CaptureConfig,
    CloseoutStep,
    Finite,
    GpuCapacity,
    ItemConfig,
    Key,
    LaneConfig,
    LedgerInt,
    Mebibytes,
    Name,
    NodeConfig,
    OutputName,
    PipelineConfig,
    RetryPolicy,
    StageConfig,
    Text,
    UsageKey,
    artifact_store_problems,
)
from laneway.controller.errors import ConfigError
from laneway.controller.shell_quoting import PLAIN_NUMBER, PLAIN_VALUE, SHELLS, shell_script_index
from laneway.controller.states import RETRYABLE_OUTCOMES, Outcome
from laneway.controller.templates import (
    CLOSEOUT_PLACEHOLDERS,
    INPUTS_PREFIX,
    PREVIEW_INPUTS_ROOT,
    RAW_SPEC,
    RESERVED_PLACEHOLDERS,
    SAMPLE_INPUTS_ROOT,
    InputValues,
    TemplateError,
    closeout_values,
    item_values,
    placeholders,
    preview_argv,
    render,
    render_argv,
    render_closeout,
    render_command,
    render_shell_script,
    render_values,
)

__all__ = [
    "AMOUNT_MAX",
    "CLOSEOUT_PLACEHOLDERS",
    "ENV_NAME_PATTERN",
    "ENV_REF",
    "INPUTS_PREFIX",
    "KEY_PATTERN",
    "NAME_PATTERN",
    "NAME_RE",
    "PATTERN_HELP",
    "PLAIN_NUMBER",
    "PLAIN_VALUE",
    "PREVIEW_INPUTS_ROOT",
    "RAW_SPEC",
    "RESERVED_PLACEHOLDERS",
    "SAMPLE_INPUTS_ROOT",
    "SECRET_LITERAL",
    "SECRET_NAME",
    "SHELLS",
    "STORE_PACKAGES",
    "USAGE_KEY_PATTERN",
    "Amount",
    "Budget",
    "CaptureConfig",
    "CloseoutStep",
    "Finite",
    "GpuCapacity",
    "InputValues",
    "ItemConfig",
    "Key",
    "LaneConfig",
    "LedgerInt",
    "Mebibytes",
    "Name",
    "NodeConfig",
    "OutputName",
    "PipelineConfig",
    "RetryPolicy",
    "StageConfig",
    "TemplateError",
    "Text",
    "UsageKey",
    "artifact_store_problems",
    "closeout_values",
    "config_from_frozen",
    "json_schema",
    "load_config",
    "parse_config",
    "placeholders",
    "preview_argv",
    "printable",
    "render",
    "render_argv",
    "render_closeout",
    "render_command",
    "render_shell_script",
    "render_values",
    "retryable",
    "shell_script_index",
]


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for error in exc.errors():
        parts = [str(part) for part in error["loc"] if part != "[key]"]
        if len(parts) > 3 and parts[0] == "limits" and parts[2] == "usage":
            del parts[2]  # a limit is written flat: limits.NAME.KEY, not limits.NAME.usage.KEY
        loc = ".".join(parts)
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
    priority_field = raw.get("priority_field", "priority")
    try:
        config = PipelineConfig.model_validate(raw, context={"priority_field": priority_field})
    except ValidationError as exc:
        raise ConfigError(printable(problems + _format_validation_error(exc))) from None
    except RecursionError:
        raise ConfigError([*problems, "CONFIG: nested too deeply to check"]) from None
    problems += _joined_cwd_problems(config, relative_cwds)
    if problems:
        raise ConfigError(printable(problems))
    return config


def _short(exc: BaseException) -> str:
    return str(exc).split(";")[0][:120] or type(exc).__name__


def printable(lines: list[str]) -> list[str]:
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
        rendered = [(item.key, _try_render(template, item_values(item))) for item in config.items]
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
        raise ConfigError(printable([f"CONFIG: {path} must end in .toml or .json"]))
    try:
        data = limits.read_regular_file(path, limits.CONFIG_MAX_BYTES)
    except OSError as exc:
        raise ConfigError(
            printable([f"CONFIG: cannot read {path}: {exc.strerror or exc}"])
        ) from None
    try:
        raw = tomllib.loads(data.decode()) if suffix == ".toml" else json.loads(data)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            printable([f"CONFIG: {path} is not valid {suffix[1:].upper()}: {exc}"])
        ) from None
    except (ValueError, RecursionError) as exc:
        # An integer past Python's 4300 digits, or nesting past the recursion limit.
        raise ConfigError(
            printable([f"CONFIG: {path} is not usable {suffix[1:].upper()}: {_short(exc)}"])
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(printable([f"CONFIG: {path} must hold a table/object at the top level"]))
    return parse_config(raw, path.parent.resolve())


def config_from_frozen(frozen: str) -> PipelineConfig:
    """Rebuild the config a run froze (paths in it are already absolute)."""
    return PipelineConfig.model_validate_json(frozen, context={"frozen": True})


def json_schema() -> dict[str, Any]:
    return PipelineConfig.model_json_schema()


def retryable(stage: StageConfig, outcome: Outcome) -> bool:
    return outcome in RETRYABLE_OUTCOMES and outcome.value in stage.retry.on
