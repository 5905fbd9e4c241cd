"""Shell completion values read from the ledger (typer's own completion for bash, zsh
and fish: ``laneway --install-completion``). Cheap reads only, newest first and bounded;
any problem (no ledger yet, a locked file) completes nothing rather than failing."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

LIMIT = 50


def _rows(ctx: typer.Context, sql: str) -> list[tuple[Any, ...]]:
    from laneway.controller import readonly
    from laneway.controller.errors import LanewayError

    runtime = ctx.params.get("runtime_dir") or os.environ.get("LANEWAY_RUNTIME_DIR", ".laneway")
    try:
        with readonly.ReadOnlyLedger(Path(runtime)) as source:
            return source.rows(sql)
    except (LanewayError, OSError, sqlite3.Error):  # no ledger here (yet): no values
        return []


Completer = Callable[[typer.Context, str], list[tuple[str, str]]]


def _completer(sql: str) -> Completer:
    """Completion from ``sql``'s rows: (value, description) pairs whose value starts with
    what is typed so far."""

    def complete(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
        found = _rows(ctx, sql)
        return [(str(v[0]), str(v[1])) for v in found if str(v[0]).startswith(incomplete)]

    return complete


runs = _completer(
    f"SELECT id, name || ' (' || state || ')' FROM runs ORDER BY id DESC LIMIT {LIMIT}"
)
jobs = _completer(
    "SELECT j.id, i.key || '.' || j.stage || ' ' || j.state FROM jobs j "
    "JOIN items i ON i.id = j.item_id WHERE j.run_id = (SELECT MAX(id) FROM runs) "
    f"AND j.state NOT IN ('succeeded', 'skipped') ORDER BY j.id DESC LIMIT {LIMIT}"
)
attempts = _completer(
    "SELECT a.id, i.key || '.' || j.stage || ' ' || a.state FROM attempts a "
    "JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
    f"ORDER BY a.id DESC LIMIT {LIMIT}"
)
unknown_attempts = _completer(
    "SELECT a.id, i.key || '.' || j.stage FROM attempts a "
    "JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
    f"WHERE a.state = 'unknown' ORDER BY a.id DESC LIMIT {LIMIT}"
)
nodes = _completer(f"SELECT name, 'max_jobs ' || max_jobs FROM nodes ORDER BY name LIMIT {LIMIT}")
