"""`laneway status` follows the work, not the backlog (issue 22 item 5, "Quick reads"):
its counts are index-only queries and its lists are index ranges, checked on the query
plans (a plan does not depend on the ledger's size, so a small ledger shows it). On
SQLite ``EXPLAIN QUERY PLAN``; on PostgreSQL ``EXPLAIN`` with sequential scans off (on a
small table the planner would rightly prefer one) must name the index."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from laneway.controller import queries

PARAMS = {"run": 1, "lane": "a", "node": "n1"}

INDEX_ONLY = {
    "JOB_COUNTS": "ix_jobs_dispatch",
    "REUSED_BY_STAGE": "ix_jobs_reused",
}
"""Counts answered from an index alone (SQLite: ``USING COVERING INDEX``, no sort)."""

RANGES = {
    "RETRY_BACKOFF": "ix_jobs_retry_after",
    "IN_FLIGHT_ATTEMPTS": "ix_attempts_state",
    "UNKNOWN_ATTEMPTS": "ix_attempts_state",
    "RECENT_RUN_EVENTS": "ix_events_run",
    "LANE_LAST_DECISION": "ix_decisions_run_lane",
}
"""Lists read through an index range of what is in flight, backing off or newest (never
the run's jobs or attempts by ``run_id``)."""


def plan(engine: Any, sql: str) -> str:
    with engine.connect() as connection:
        if engine.dialect.name == "sqlite":
            rows = connection.execute(text(f"EXPLAIN QUERY PLAN {sql}"), PARAMS).all()
            return "\n".join(str(row[3]) for row in rows)
        connection.exec_driver_sql("SET enable_seqscan = off")
        rows = connection.execute(text(f"EXPLAIN {sql}"), PARAMS).all()
        return "\n".join(str(row[0]) for row in rows)


@pytest.mark.parametrize("name", sorted(INDEX_ONLY))
def test_status_counts_are_index_only(engine, name):
    found = plan(engine, getattr(queries, name))
    index = INDEX_ONLY[name]
    if engine.dialect.name == "sqlite":
        assert f"USING COVERING INDEX {index}" in found, found
        assert "TEMP B-TREE" not in found, found  # grouped in the index's order
    else:
        assert f"Index Only Scan using {index}" in found, found


@pytest.mark.parametrize("name", sorted(RANGES))
def test_status_lists_read_index_ranges(engine, name):
    found = plan(engine, getattr(queries, name))
    index = RANGES[name]
    assert index in found, found
    if engine.dialect.name == "sqlite":
        assert "SCAN" not in found.replace("SCAN TABLE", "").split("SEARCH")[0], found


def test_the_run_jobs_are_never_read_by_run_id_alone(engine):
    """No status query takes the run's jobs row by row: each one on ``jobs`` is
    index-only or a range of what is backing off."""
    names = [n for n in dir(queries) if n.isupper() and isinstance(getattr(queries, n), str)]
    for name in names:
        sql = getattr(queries, name)
        if " jobs " not in f" {sql} " or name in {"ATTEMPTS_BY_LANE_STAGE"}:
            continue
        if engine.dialect.name != "sqlite" or ":" in sql.replace(":run", "").replace(
            ":lane", ""
        ).replace(":node", ""):
            continue
        found = plan(engine, sql)
        assert "SEARCH jobs USING INDEX ix_jobs_run_state" not in found, (name, found)
        assert "SEARCH j USING INDEX ix_jobs_run_state" not in found, (name, found)
