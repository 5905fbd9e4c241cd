"""Shell completion values read from the ledger (typer's own completion for bash, zsh
and fish: ``laneway --install-completion``). Cheap reads only, newest first and bounded;
any problem (no ledger yet, a locked file) completes nothing rather than failing."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import typer

LIMIT = 50


def _rows(ctx: typer.Context, sql: str) -> list[tuple[Any, ...]]:
    from controller import db
    from controller.errors import LanewayError

    runtime = ctx.params.get("runtime_dir") or os.environ.get("LANEWAY_RUNTIME_DIR", ".laneway")
    try:
        with db.ReadOnlyLedger(Path(runtime)) as source:
            return source.rows(sql)
    except (LanewayError, OSError, sqlite3.Error):  # no ledger here (yet): no values
        return []


def _matching(values: list[tuple[Any, ...]], incomplete: str) -> list[tuple[str, str]]:
    return [(str(v[0]), str(v[1])) for v in values if str(v[0]).startswith(incomplete)]


def runs(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    found = _rows(
        ctx, f"SELECT id, name || ' (' || state || ')' FROM runs ORDER BY id DESC LIMIT {LIMIT}"
    )
    return _matching(found, incomplete)


def jobs(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    found = _rows(
        ctx,
        "SELECT j.id, i.key || '.' || j.stage || ' ' || j.state FROM jobs j "
        "JOIN items i ON i.id = j.item_id WHERE j.run_id = (SELECT MAX(id) FROM runs) "
        f"AND j.state NOT IN ('succeeded', 'skipped') ORDER BY j.id DESC LIMIT {LIMIT}",
    )
    return _matching(found, incomplete)


def attempts(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    found = _rows(
        ctx,
        "SELECT a.id, i.key || '.' || j.stage || ' ' || a.state FROM attempts a "
        "JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
        f"ORDER BY a.id DESC LIMIT {LIMIT}",
    )
    return _matching(found, incomplete)


def unknown_attempts(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    found = _rows(
        ctx,
        "SELECT a.id, i.key || '.' || j.stage FROM attempts a "
        "JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
        f"WHERE a.state = 'unknown' ORDER BY a.id DESC LIMIT {LIMIT}",
    )
    return _matching(found, incomplete)


def nodes(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    found = _rows(
        ctx, f"SELECT name, 'max_jobs ' || max_jobs FROM nodes ORDER BY name LIMIT {LIMIT}"
    )
    return _matching(found, incomplete)
