"""Templates: the ``{name}`` placeholders of a stage's argv, env and cwd and of a
closeout step, and how they are rendered.

``{item}``, ``{lane}``, an item's fields and ``{inputs.<stage>}`` expand; ``{{`` is a
literal brace; ``${NAME}`` is a secret reference the worker resolves at spawn time, never
a placeholder. A value substituted into a shell's ``-c`` script is quoted for the place
it lands in (``render_shell_script``, with controller/shell_quoting.py); ``{name:raw}``
inserts it unquoted. The checks a config gets when it is loaded (``placeholder_problems``,
``closeout_problems``, ``render_problems``) render every template as attempts will, so a
value that cannot be inserted is refused before a run starts. The models live in
controller/config_stage.py, below this module; ``PipelineConfig``'s validator
(controller/config_models.py, above it) calls these checks.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any, Protocol

from laneway.controller.config_fields import ENV_REF, NAME_RE
from laneway.controller.config_stage import CloseoutStep, ItemConfig, StageConfig
from laneway.controller.shell_quoting import (
    PLAIN_NUMBER,
    PLAIN_VALUE,
    ShellScanner,
    quote_for,
    shell_script_index,
)

RESERVED_PLACEHOLDERS = ("item", "lane")
INPUTS_PREFIX = "inputs."
"""``{inputs.<stage>}``: the directory an attempt finds a needed stage's outputs in."""
SAMPLE_INPUTS_ROOT = "/attempt/inputs"
PREVIEW_INPUTS_ROOT = "<attempt_dir>/inputs"


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


def placeholder_problems(stages: list[StageConfig], items: list[ItemConfig]) -> list[str]:
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


def item_values(item: ItemConfig, inputs_root: str | None = None) -> dict[str, Any]:
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


def closeout_problems(steps: list[CloseoutStep]) -> list[str]:
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


def render_problems(stages: list[StageConfig], items: list[ItemConfig]) -> list[str]:
    """Render every stage's templates for every item, as attempts will be rendered, so
    that a value that cannot be inserted (a format spec that does not fit it, or shell
    metacharacters where a script cannot quote them) is refused before a run starts."""
    failures: dict[str, tuple[str, list[str]]] = {}
    for i, stage in enumerate(stages):
        for item in items:
            values = item_values(item, SAMPLE_INPUTS_ROOT)
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
    return render_values(template, item_values(item, inputs_root))


def render_values(template: str, values: dict[str, Any]) -> str:
    out = []
    for literal, name, spec, conversion in _template_parts(template):
        out.append(literal)
        if name is not None:
            out.append(_field_text(values, name, spec, conversion))
    return "".join(out)


def render_shell_script(template: str, values: dict[str, Any]) -> str:
    """Render a script a shell will parse (``sh -c SCRIPT``): each value is quoted for
    where it lands, so it reaches the command verbatim and is never run as code;
    ``{name:raw}`` inserts it unquoted. Raises TemplateError when a value that is not
    plain lands where it cannot be quoted (see ``ShellScanner``)."""
    scanner = ShellScanner()
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
            inserted = quote_for(context, text)
            scanner.after_word()
        out.append(inserted)
    return "".join(out)


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
    return render_command(stage.argv, item_values(item, inputs_root))


def closeout_values(run_id: int | str, runtime_dir: str) -> dict[str, Any]:
    return {"run": str(run_id), "runtime_dir": str(runtime_dir)}


def render_closeout(
    step: CloseoutStep, *, run_id: int | str, runtime_dir: str
) -> tuple[list[str], str | None]:
    """A closeout step's argv and cwd for one run (``{run}``, ``{runtime_dir}``)."""
    values = closeout_values(run_id, runtime_dir)
    cwd = render_values(step.cwd, values) if step.cwd else None
    return render_command(step.argv, values), cwd


class Previewed(Protocol):
    """What ``preview_argv`` reads of a config (a ``PipelineConfig``, which sits above
    this module and is therefore not named here)."""

    @property
    def stages(self) -> list[StageConfig]: ...

    @property
    def items(self) -> list[ItemConfig]: ...


def preview_argv(config: Previewed) -> dict[str, list[str]]:
    """Each stage's argv rendered for the first item, as a run would start it (for
    ``dry-run``); empty when the config has no items."""
    if not config.items:
        return {}
    first = config.items[0]
    return {stage.name: render_argv(stage, first, PREVIEW_INPUTS_ROOT) for stage in config.stages}
