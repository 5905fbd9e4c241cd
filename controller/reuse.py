"""Reuse keys: what a job's result depends on, as one sha256.

A new run may take over the result of a job that succeeded in an earlier run instead of
executing it again (paying twice, for a job that calls a paid API), but only when
nothing the result depends on changed. The key hashes exactly that:

- the frozen stage definition: its name, argv template, cwd, env (names and templates,
  never resolved values), pass_env names and declared outputs (a job whose earlier
  result stored other outputs, or none, cannot hand on what its stage now declares);
- the item: its key, lane and fields;
- the sha256 of the frozen source files the stage depends on (``stages.sources``;
  default: all of the pipeline's sources);
- the reuse keys of the jobs of the same item it needs, so a change upstream changes
  every key downstream of it.

Timeouts, reservations, caps and retry policy are not part of it: they decide how a job
runs, not what it computes. Pure: no ledger access (``controller.ledger.reuse`` looks
keys up).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from laneway.controller.config import ItemConfig, PipelineConfig, StageConfig

KEY_VERSION = 1
"""Bumped when what goes into a key changes: keys of another version never match."""


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


def job_reuse_key(
    stage: StageConfig,
    item: ItemConfig,
    source_hashes: dict[str, str],
    needed_keys: dict[str, str],
) -> str:
    """The reuse key of (``item``, ``stage``); ``needed_keys``: stage name -> reuse key of
    the item's jobs that this stage needs."""
    sources = sorted(source_hashes) if stage.sources is None else sorted(stage.sources)
    body = {
        "version": KEY_VERSION,
        "stage": stage_definition(stage),
        "item": {"key": item.key, "lane": item.lane, "fields": item.fields},
        "sources": {path: source_hashes.get(path) for path in sources},
        "needs": {need: needed_keys[need] for need in sorted(stage.needs)},
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def item_reuse_keys(
    config: PipelineConfig, item: ItemConfig, source_hashes: dict[str, str]
) -> dict[str, str]:
    """Stage name -> reuse key, for every stage of ``item`` (needs come first in the
    config, so each key can include those of the stages it needs)."""
    keys: dict[str, str] = {}
    for stage in config.stages:
        keys[stage.name] = job_reuse_key(stage, item, source_hashes, keys)
    return keys


def reuse_allowed(stage: StageConfig, rerun: frozenset[str]) -> bool:
    """May a new run's job of ``stage`` take over an earlier result? Not when the stage
    opts out (``reuse = false``) or the run was started with ``--rerun`` naming it (or
    ``all``)."""
    return stage.reuse and "all" not in rerun and stage.name not in rerun
