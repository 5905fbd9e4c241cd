"""What an attempt is launched with: its directory, its rendered command, its hash.

Pure functions over a stage and an item (no ledger access): the claim calls them while
it writes the intent, the worker and the CLI's dry-run can call them anywhere.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from laneway.controller.config import ItemConfig, StageConfig, render, render_argv


def attempt_dir(runtime_dir: str, run_id: int, item: str, stage: str, number: int) -> str:
    """``<runtime>/runs/<run>/jobs/<item>.<stage>/attempt-<n>``."""
    return str(
        Path(runtime_dir) / "runs" / str(run_id) / "jobs" / f"{item}.{stage}" / f"attempt-{number}"
    )


def inputs_dir(attempt_dir: str) -> str:
    """Where an attempt finds the outputs of the stages it needs: ``inputs/<stage>/``."""
    return str(Path(attempt_dir) / "inputs")


ARTIFACTS_DIR = "artifacts"


def artifact_store_url(configured: str | None, runtime_dir: str) -> str:
    """A run's artifact store: its ``artifact_store`` URL, else the content-addressed
    store under the worker's runtime dir (``artifacts/``, this machine only)."""
    if configured:
        return configured.rstrip("/")
    if not Path(runtime_dir).is_absolute():  # depends on the working directory
        return (Path(runtime_dir) / ARTIFACTS_DIR).resolve().as_uri()
    return _default_store(runtime_dir)


@functools.lru_cache(maxsize=64)
def _default_store(runtime_dir: str) -> str:
    """The default store's URL for an absolute runtime dir, resolved once (a claim asks
    for it for each job it grants; resolving the path is a few system calls)."""
    return (Path(runtime_dir) / ARTIFACTS_DIR).resolve().as_uri()


def argv_hash(argv: list[str], cwd: str | None) -> str:
    """The sha256 of what runs (recorded on the intent and in the receipt)."""
    return hashlib.sha256(json.dumps([argv, cwd]).encode()).hexdigest()


def item_config(key: str, lane: str, fields: dict[str, Any] | None) -> ItemConfig:
    """An item as the config knew it, rebuilt from its ledger row."""
    return ItemConfig.model_validate({**(fields or {}), "key": key, "lane": lane})


def render_command(
    stage: StageConfig, item: ItemConfig, inputs_root: str | None = None
) -> tuple[list[str], dict[str, str], str | None]:
    """The stage's argv, env and cwd for one item (``inputs_root``: the attempt's
    ``inputs/``, for ``{inputs.<stage>}``); ``${NAME}`` references are left for the
    worker to resolve at spawn time (secrets are never in the ledger). Values that land
    in a shell's ``-c`` script are shell-quoted (``config.render_argv``); raises
    ``config.TemplateError`` where that cannot be done safely."""
    argv = render_argv(stage, item, inputs_root)
    env = {name: render(value, item, inputs_root) for name, value in stage.env.items()}
    cwd = render(stage.cwd, item, inputs_root) if stage.cwd else None
    return argv, env, cwd
