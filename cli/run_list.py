"""``laneway runs``: the newest runs, each with its jobs by state and what holds it.

Read through the status report (``controller/status.py::status_report``) on a read-only
ledger, as ``laneway status`` reads one run: standard library only on SQLite (no
SQLAlchemy; tests/integration/test_cli_imports.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from laneway.cli import render
from laneway.controller import queries
from laneway.controller.codes import RefusalCode, StepCode
from laneway.controller.rows import Rows
from laneway.controller.status import status_report
from laneway.controller.status_model import StatusReport


def listing(source: Rows, *, limit: int, now: datetime) -> list[dict[str, Any]]:
    """The ``limit`` newest runs, newest first (one read transaction: call it inside
    ``ReadOnlyLedger.snapshot``)."""
    ids = [int(row[0]) for row in source.rows(queries.RECENT_RUNS, {"limit": limit})]
    later = superseded(source, min(ids)) if ids else {}
    return [summary(status_report(source, run_id, now=now), later.get(run_id)) for run_id in ids]


def superseded(source: Rows, oldest: int) -> dict[int, int]:
    """Unfinished run id -> the first later run of the same pipeline, for the runs from
    ``oldest`` on (``queries.SUCCESSORS``): a run left behind by ``laneway run CONFIG
    --new`` stays ``active`` in the ledger, but nothing will carry it on."""
    rows = source.rows(queries.SUCCESSORS, {"oldest": oldest})
    return {int(run_id): int(by) for run_id, by in rows}


def summary(report: StatusReport, superseded_by: int | None = None) -> dict[str, Any]:
    """One run's line: its row, the later run that superseded it (``superseded_by``:
    None when none did, or it is finished), its jobs per state and what holds it
    (``holding``)."""
    run = report.run
    code, lane, words = holding(report)
    return {
        "id": run.id,
        "name": run.name,
        "state": run.state,
        "superseded_by": superseded_by,
        "created_at": run.created_at,
        "finished_at": run.finished_at,
        "jobs": dict(report.totals),
        "holding": code,
        "holding_lane": lane,
        "holding_words": words,
    }


def holding(report: StatusReport) -> tuple[str | None, str | None, str | None]:
    """What keeps the run from progressing, as (code, lane, words): ``finished``; else
    the first lane's reason that has one (``paused``, ``halted``, ``stopped``,
    ``unknown_outcome``, ``no_worker``, admission's codes such as ``budget``); else
    ``unknown_outcome`` (unknown attempts and nothing else to start), ``running``, or
    ``done`` (every job terminal, the run not closed yet). None: jobs wait with nothing
    recorded against them (yet)."""
    if report.run.finished:
        return "finished", None, "the run is finished"
    for lane in report.lanes:
        if lane.reason is not None:
            return lane.reason.code, lane.lane, lane.reason.words
    if report.unknown:
        count = len(report.unknown)
        return RefusalCode.UNKNOWN_OUTCOME, None, f"{count} attempt(s) with an unknown outcome"
    if report.running or any(lane.running for lane in report.lanes):
        return StepCode.RUNNING, None, None
    if not any(lane.pending for lane in report.lanes):
        return StepCode.DONE, None, "every job is terminal; the controller closes the run"
    return None, None, None


def _jobs(counts: dict[str, int]) -> str:
    return " · ".join(f"{state} {n}" for state, n in sorted(counts.items()) if n) or "-"


def shown_state(run: dict[str, Any]) -> str:
    """The STATE column: the run's state, or ``superseded (by run N)``."""
    by = run.get("superseded_by")
    return str(run["state"]) if by is None else f"superseded (by run {by})"


def runs_text(listed: list[dict[str, Any]]) -> str:
    if not listed:
        return "no runs yet; start one with `laneway start-pipeline` or `laneway run`"
    headers = ["RUN", "NAME", "STATE", "CREATED", "FINISHED", "JOBS", "HOLDING"]
    rows = [
        [
            run["id"],
            run["name"],
            shown_state(run),
            run["created_at"] or "-",
            run["finished_at"] or "-",
            _jobs(run["jobs"]),
            (run["holding"] or "-")
            + (f" (lane {run['holding_lane']})" if run["holding_lane"] else ""),
        ]
        for run in listed
    ]
    return render.table(headers, rows)
