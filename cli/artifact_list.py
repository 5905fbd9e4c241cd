"""``laneway artifacts``: a run's artifacts, read from the ledger (``v_artifacts``).

A job a run reused from an earlier run (``jobs.reused_from``) links that run's attempt
and its artifacts rather than copying them: they are listed too, with ``reused_from_run``
naming the run that stored them (``v_reused_jobs``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from laneway.controller import ledger
from laneway.controller.clock import iso
from laneway.controller.errors import UsageError
from laneway.controller.models import Item, Run

REUSED = text(
    "SELECT r.item, r.stage, ar.job_id, ar.attempt_id, ar.name, ar.sha256, ar.size_bytes, "
    "ar.location, ar.node, ar.created_at, r.reused_run_id AS reused_from_run "
    "FROM v_reused_jobs r "
    "JOIN artifacts ar ON ar.attempt_id = r.reused_attempt_id WHERE r.run_id = :run"
)


def listing(
    session: Session, run_id: int | None, *, item: str | None, stage: str | None
) -> dict[str, Any]:
    """The artifacts of run ``run_id`` (default the newest), of ``item`` and ``stage``
    when given, by item, stage and name. Raises NotFound for an unknown run and
    UsageError for an item or stage the run does not have."""
    run = ledger.get_run(session, run_id)
    rows = [row | {"reused_from_run": None} for row in ledger.run_artifacts(session, run.id)]
    rows += [dict(row) for row in session.execute(REUSED, {"run": run.id}).mappings()]
    rows = [
        row
        for row in rows
        if (item is None or row["item"] == item) and (stage is None or row["stage"] == stage)
    ]
    rows.sort(key=lambda row: (row["item"], row["stage"], row["name"]))
    for row in rows:
        row["created_at"] = _iso(row["created_at"])
    return {
        "run": {"id": run.id, "name": run.name, "state": run.state},
        "item": item,
        "stage": stage,
        "count": len(rows),
        "total_bytes": sum(int(row["size_bytes"]) for row in rows),
        "artifacts": rows,
        "why_none": None if rows else _why_none(session, run, item, stage),
    }


def _iso(value: datetime | str) -> str | None:
    """A view's timestamp as ISO UTC: SQLite gives a raw view column back as text."""
    return iso(datetime.fromisoformat(value) if isinstance(value, str) else value)


def _why_none(session: Session, run: Run, item: str | None, stage: str | None) -> str:
    """Why nothing is listed; an item or stage that is not the run's is a UsageError."""
    if item is not None:
        found = session.scalar(select(Item.id).where(Item.run_id == run.id, Item.key == item))
        if found is None:
            raise UsageError(f"--item {item}: run {run.id} has no item with that key")
    stages = ledger.run_config(run).stages
    if stage is not None:
        names = [s.name for s in stages]
        if stage not in names:
            raise UsageError(
                f"--stage {stage}: not a stage of run {run.id} (its stages: {', '.join(names)})"
            )
        stages = [s for s in stages if s.name == stage]
    if stage is not None and not stages[0].outputs:
        return f"stage {stage} declares no outputs"
    if not any(s.outputs for s in stages):
        return "no stage of its pipeline declares outputs"
    return "none stored yet (outputs are stored when their attempt succeeds)"
