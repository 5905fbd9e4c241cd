"""Reuse keys: what a job's result depends on, as one sha256.

A new run may take over the result of a job that succeeded in an earlier run instead of
executing it again (paying twice, for a job that calls a paid API), but only when
nothing the result depends on changed. The key hashes exactly that:

- the frozen stage definition: its name, argv template, cwd, env (names and templates,
  never resolved values), pass_env names and declared outputs (a job whose earlier
  result stored other outputs, or none, cannot hand on what its stage now declares);
- the item: its key, lane and fields;
- the sha256 of the frozen files the stage itself depends on (``stage_sources``): the
  files its argv names (``named_paths``: a literal argv element that is a path to a
  file, relative to the stage's ``cwd`` or absolute, hashed and frozen at preflight),
  the ``sources`` the stage declares, and the pipeline's top-level ``sources`` only when
  ``sources_scope = "all"``: editing ``judge.py`` re-runs judge (and what needs it), not
  prepare or solve;
- the reuse keys of the jobs of the same item it needs, so a change upstream changes
  every key downstream of it.

Timeouts, reservations, caps and retry policy are not part of it: they decide how a job
runs, not what it computes. Pure: no ledger access (``controller.ledger.reuse`` looks
keys up).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from laneway.controller.config import ItemConfig, PipelineConfig, StageConfig

KEY_VERSION = 2
"""Bumped when what goes into a key changes: keys of another version never match (a
migration recomputes the keys already in a ledger: migration ``0011`` for version 2)."""

SYSTEM_PREFIXES = ("/usr/", "/bin/", "/sbin/", "/lib", "/etc/", "/proc/", "/sys/", "/dev/")
"""Absolute paths under these are the machine's, not the pipeline's: never a source."""
SCRIPT_SUFFIXES = (".py", ".sh", ".bash", ".r", ".jl", ".js", ".mjs", ".rb", ".pl", ".lua")
"""An argv element ending so names a script the job opens (preflight refuses a missing
one, ``pipeline.preflight``)."""


def named_paths(stage: StageConfig) -> list[tuple[int, str, str]]:
    """(argv index, element, absolute path) of each argv element that names code of the
    pipeline: the program itself when given as a path (``./tool``, ``/opt/x/run``), and
    every literal (no ``{...}``) element that names a script (``SCRIPT_SUFFIXES``:
    ``judge.py``), absolute or relative to a literal, absolute ``cwd`` (a loaded config's
    is); never under the system's
    directories. Data and output files an argv names are not code: a job that appends to
    one would change its own key, and halt its run (list inputs in ``sources``).
    Whether it is a file is preflight's look: only files that exist are hashed."""
    found = []
    cwd = stage.cwd if stage.cwd and "{" not in stage.cwd and os.path.isabs(stage.cwd) else None
    for index, element in enumerate(stage.argv):
        if not element or "{" in element or element.startswith("-") or "\0" in element:
            continue
        program = index == 0 and "/" in element
        if not program and not element.lower().endswith(SCRIPT_SUFFIXES):
            continue
        if os.path.isabs(element):
            path = os.path.normpath(element)
        elif cwd is not None:
            path = os.path.normpath(os.path.join(cwd, element))
        else:
            continue
        if not path.startswith(SYSTEM_PREFIXES):
            found.append((index, element, path))
    return found


def stage_sources(
    stage: StageConfig, config: PipelineConfig, source_hashes: dict[str, str]
) -> list[str]:
    """The frozen files ``stage``'s key covers: the files its argv names that were frozen
    (in ``source_hashes``), its own ``sources``, and every top-level source when the
    config's ``sources_scope`` is ``all``."""
    own = {path for _, _, path in named_paths(stage) if path in source_hashes}
    own.update(stage.sources or ())
    if config.sources_scope == "all":
        own.update(config.sources)
    return sorted(own)


def stage_definition(stage: StageConfig) -> dict[str, Any]:
    definition: dict[str, Any] = {
        "name": stage.name,
        "argv": list(stage.argv),
        "cwd": stage.cwd,
        "env": dict(stage.env),
        "pass_env": sorted(stage.pass_env),
    }
    if stage.outputs:
        # Only when declared: the keys of stages without outputs stay as they were.
        definition["outputs"] = sorted(stage.outputs)
    return definition


def key_body(
    stage: StageConfig,
    item: ItemConfig,
    source_hashes: dict[str, str],
    needed_keys: dict[str, str],
    sources: list[str],
) -> dict[str, Any]:
    """What the reuse key of (``item``, ``stage``) hashes; ``needed_keys``: stage name ->
    reuse key of the item's jobs that this stage needs; ``sources``: ``stage_sources``.
    ``laneway plan`` compares two bodies to say what changed."""
    return {
        "version": KEY_VERSION,
        "stage": stage_definition(stage),
        "item": {"key": item.key, "lane": item.lane, "fields": item.fields},
        "sources": {path: source_hashes.get(path) for path in sources},
        "needs": {need: needed_keys[need] for need in sorted(stage.needs)},
    }


def job_reuse_key(body: dict[str, Any]) -> str:
    """The reuse key: the sha256 of a ``key_body``."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def item_key_bodies(
    config: PipelineConfig, item: ItemConfig, source_hashes: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Stage name -> ``key_body``, for every stage of ``item``."""
    keys: dict[str, str] = {}
    bodies: dict[str, dict[str, Any]] = {}
    for stage in config.stages:
        sources = stage_sources(stage, config, source_hashes)
        bodies[stage.name] = key_body(stage, item, source_hashes, keys, sources)
        keys[stage.name] = job_reuse_key(bodies[stage.name])
    return bodies


def item_reuse_keys(
    config: PipelineConfig, item: ItemConfig, source_hashes: dict[str, str]
) -> dict[str, str]:
    """Stage name -> reuse key, for every stage of ``item`` (needs come first in the
    config, so each key can include those of the stages it needs)."""
    bodies = item_key_bodies(config, item, source_hashes)
    return {stage: job_reuse_key(body) for stage, body in bodies.items()}


def reuse_allowed(stage: StageConfig, rerun: frozenset[str]) -> bool:
    """May a new run's job of ``stage`` take over an earlier result? Not when the stage
    opts out (``reuse = false``) or the run was started with ``--rerun`` naming it (or
    ``all``)."""
    return stage.reuse and "all" not in rerun and stage.name not in rerun


@dataclass(frozen=True)
class Despite:
    """``--reuse-despite``: the stages named, and per item taken on (the config's order)
    the *alternate* reuse keys (stage -> key) a job may also be matched by: its key with
    the named stages' own files as the newest earlier succeeded job of that stage and
    item had them (``despite_keys``), only where that differs from its key; ``changed``:
    per item, stage -> what the alternate key forgives, in words."""

    stages: tuple[str, ...] = ()
    keys: tuple[dict[str, str], ...] = ()
    changed: tuple[dict[str, str], ...] = ()

    def key(self, position: int, stage: str) -> str | None:
        return self.keys[position].get(stage) if self.keys else None

    def all_keys(self) -> set[str]:
        return {key for per_item in self.keys for key in per_item.values()}


NO_DESPITE = Despite()


def despite_keys(
    config: PipelineConfig,
    item: ItemConfig,
    source_hashes: dict[str, str],
    earlier: dict[str, dict[str, str]],
) -> tuple[dict[str, str], dict[str, str]]:
    """The alternate keys of ``item``'s jobs (stage -> key, where it differs from the
    real one) and what each forgives (stage -> words). ``earlier``: each stage named by
    ``--reuse-despite`` that has an earlier succeeded job of this item -> the source
    hashes of that job's run. A named stage's key is computed with its own files
    (``stage_sources``) as they were then; every other part (definition, item, needs)
    as now, so only an edit of those files is forgiven; a stage downstream takes the
    alternate keys of what it needs."""
    real = item_reuse_keys(config, item, source_hashes)
    keys: dict[str, str] = {}
    changed: dict[str, str] = {}
    for stage in config.stages:
        sources = stage_sources(stage, config, source_hashes)
        hashes: dict[str, Any] = source_hashes
        old = earlier.get(stage.name)
        if old is not None:
            hashes = {**source_hashes, **{path: old.get(path) for path in sources}}
        needed = {need: keys.get(need, real[need]) for need in stage.needs}
        key = job_reuse_key(key_body(stage, item, hashes, needed, sources))
        if key == real[stage.name]:
            continue
        keys[stage.name] = key
        if old is not None:
            files = [os.path.basename(p) for p in sources if old.get(p) != source_hashes.get(p)]
            changed[stage.name] = f"{', '.join(files)} changed"
        else:
            upstream = sorted(need for need in stage.needs if need in keys)
            changed[stage.name] = f"{', '.join(upstream)} reused despite its changes"
    return keys, changed
