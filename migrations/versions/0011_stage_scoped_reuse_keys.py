"""stage-scoped reuse keys: every job's reuse key recomputed as version 2

A stage's key used to cover every top-level ``sources`` file unless the stage narrowed
them, so a comment in ``judge.py`` re-ran (and re-paid) every stage. From version 2 a
stage's key covers the files its argv names, its own ``sources``, and the top-level ones
only with ``sources_scope = "all"`` (controller/reuse.py). This recomputes the key of
every job already in the ledger, from its run's frozen config and frozen source hashes,
so that nothing that succeeded becomes unreusable by the change alone: a new run of an
unchanged config finds the same keys. A file the argv names that the old run did not
freeze is hashed as it is now, where it can be read (its old content is not known; the
old key did not cover it either). A run whose frozen config no longer parses keeps its
old key, which matches nothing: its jobs run again once. No schema change.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from pydantic import ValidationError

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The key is the application's, so that migrated keys equal the ones a new run
    # computes (tests/migrations/test_migrations.py proves it).
    from laneway.controller import reuse
    from laneway.controller.config import ItemConfig, config_from_frozen
    from laneway.controller.pipeline import hash_file

    bind = op.get_bind()
    runs = bind.execute(sa.text("SELECT id, config_json, source_hashes FROM runs ORDER BY id"))
    current: dict[str, str | None] = {}

    def now_hash(path: str) -> str | None:
        if path not in current:
            try:
                current[path] = hash_file(path)
            except (OSError, ValueError):
                current[path] = None
        return current[path]

    for run_id, config_json, frozen in runs.all():
        try:
            config = config_from_frozen(config_json)
        except (ValidationError, ValueError):
            continue
        hashes = dict(_json(frozen) or {})
        for stage in config.stages:
            wanted = [path for _, _, path in reuse.named_paths(stage)] + list(stage.sources or [])
            for path in wanted:
                if path not in hashes:
                    digest = now_hash(path)
                    if digest is not None:
                        hashes[path] = digest
        items = bind.execute(
            sa.text("SELECT id, key, lane, fields FROM items WHERE run_id = :run"), {"run": run_id}
        ).all()
        jobs = bind.execute(
            sa.text("SELECT id, item_id, stage FROM jobs WHERE run_id = :run"), {"run": run_id}
        ).all()
        keys_of: dict[int, dict[str, str]] = {}
        for item_id, key, lane, fields in items:
            try:
                item = ItemConfig.model_validate(
                    {**(_json(fields) or {}), "key": key, "lane": lane}
                )
                keys_of[item_id] = reuse.item_reuse_keys(config, item, hashes)
            except (ValidationError, ValueError, KeyError):
                continue
        updates = [
            {"id": job_id, "key": keys_of[item_id][stage]}
            for job_id, item_id, stage in jobs
            if item_id in keys_of and stage in keys_of[item_id]
        ]
        if updates:
            bind.execute(sa.text("UPDATE jobs SET reuse_key = :key WHERE id = :id"), updates)


def _json(value: object) -> dict[str, object] | None:
    """A JSON column as read back by a plain text query (a str on SQLite)."""
    if value is None or isinstance(value, dict):
        return value
    import json

    loaded = json.loads(str(value))
    return loaded if isinstance(loaded, dict) else None


def downgrade() -> None:
    # Version 1 keys cannot be told from the frozen config alone for every ledger; a
    # downgraded ledger's jobs keep version 2 keys, which version 1 never matches.
    pass
