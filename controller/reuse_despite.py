"""``--reuse-despite STAGE``: keep a stage's earlier results although the files it
depends on changed (a deliberate cosmetic edit: a comment in a paid script), recorded in
the run.

A job's reuse key covers the sha256 of its stage's files (``reuse.stage_sources``), so
any edit of them makes every key new and every job of the stage run (and pay) again.
For a stage named here, a new run also matches each job by an *alternate* key: its key
with the stage's own files as they were for the newest earlier succeeded job of the same
pipeline, item and stage (that run's frozen hashes); the stage's definition, the item
and what it needs must be unchanged. The jobs downstream of it whose only difference is
that chain are matched the same way (``reuse.despite_keys``). A job taken over so keeps
its real key (the files as they are now): the next run reuses it without the flag.

Recorded: the run's ``run_created`` event lists the stages (``reuse_despite``); each such
job's ``job_reused`` event carries ``despite`` (what changed) and its ``state_reason``
says so. Reads only; ``ledger.create_run`` and ``laneway plan`` decide with the same
keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from laneway.controller import db, reuse
from laneway.controller.config import PipelineConfig
from laneway.controller.errors import UsageError
from laneway.controller.states import JobState

CHUNK = 500


def check(config: PipelineConfig, names: Sequence[str], rerun: Sequence[str]) -> None:
    """UsageError when ``--reuse-despite`` names a stage the config does not have, one
    that never reuses (``reuse = false``), or one ``--rerun`` names too."""
    stage_names = [stage.name for stage in config.stages]
    for name in names:
        if name not in stage_names:
            raise UsageError(
                f"--reuse-despite: {name!r} is not a stage of {config.name!r}; "
                f"name one of {', '.join(stage_names)}"
            )
        if not config.stage(name).reuse:
            raise UsageError(
                f"--reuse-despite: stage {name!r} has reuse = false, so it never keeps an "
                "earlier result; drop the flag or set reuse = true"
            )
        if name in rerun or "all" in rerun:
            raise UsageError(
                f"--reuse-despite {name} and --rerun {'all' if 'all' in rerun else name} "
                "contradict each other: choose one"
            )


def read(
    engine: Engine | None, config: PipelineConfig, hashes: dict[str, str], names: Sequence[str]
) -> reuse.Despite:
    """The ``reuse.Despite`` of a new run of ``config`` (``hashes``: its preflight's)
    on ``engine``'s ledger (None: none yet, so nothing to keep)."""
    if not names or engine is None:
        return reuse.Despite(tuple(sorted(set(names))))
    with db.one_read(engine) as session:
        return alternates(session, config, hashes, names)


def alternates(
    session: Session, config: PipelineConfig, hashes: dict[str, str], names: Sequence[str]
) -> reuse.Despite:
    items = config.items[: config.batch_cap] if config.batch_cap else config.items
    earlier = _earlier_hashes(session, config, [item.key for item in items], sorted(set(names)))
    keys: list[dict[str, str]] = []
    changed: list[dict[str, str]] = []
    for item in items:
        found = {
            stage: by_item[item.key] for stage, by_item in earlier.items() if item.key in by_item
        }
        alt, words = reuse.despite_keys(config, item, hashes, found) if found else ({}, {})
        keys.append(alt)
        changed.append(words)
    return reuse.Despite(tuple(sorted(set(names))), tuple(keys), tuple(changed))


def _earlier_hashes(
    session: Session, config: PipelineConfig, item_keys: list[str], stages: list[str]
) -> dict[str, dict[str, dict[str, str]]]:
    """Stage -> item key -> the source hashes of the run of the newest earlier
    succeeded job of that pipeline, item and stage."""
    newest: dict[tuple[str, str], int] = {}
    stage_names = ", ".join(f":s{i}" for i in range(len(stages)))
    for start in range(0, len(item_keys), CHUNK):
        chunk = item_keys[start : start + CHUNK]
        names = ", ".join(f":k{i}" for i in range(len(chunk)))
        rows = session.execute(
            text(
                "SELECT j.stage, i.key, j.run_id FROM jobs j "
                "JOIN items i ON i.id = j.item_id JOIN runs r ON r.id = j.run_id "
                f"WHERE r.name = :name AND j.state = :succeeded AND j.stage IN ({stage_names}) "
                f"AND i.key IN ({names}) ORDER BY j.id DESC"
            ),
            {
                "name": config.name,
                "succeeded": JobState.SUCCEEDED.value,
                **{f"s{i}": s for i, s in enumerate(stages)},
                **{f"k{i}": k for i, k in enumerate(chunk)},
            },
        ).all()
        for stage, item_key, run_id in rows:
            newest.setdefault((stage, item_key), run_id)
    runs: dict[int, dict[str, str]] = {}
    for run_id in sorted(set(newest.values())):
        value = session.execute(
            text("SELECT source_hashes FROM runs WHERE id = :id"), {"id": run_id}
        ).scalar_one()
        runs[run_id] = _json(value)
    found: dict[str, dict[str, dict[str, str]]] = {}
    for (stage, item_key), run_id in newest.items():
        found.setdefault(stage, {})[item_key] = runs[run_id]
    return found


def _json(value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        return value
    import json

    loaded = json.loads(value) if value else {}
    return loaded if isinstance(loaded, dict) else {}
