"""A claim reads the first ready jobs of each partition, not all of them: the cost of a
claim follows the slots, not the backlog (issue 22). Its candidate statement
(``statements.ready_candidates``) must walk ``ix_jobs_dispatch`` in the index's own order
and stop at its LIMIT.

Checked on the plans of a ledger with many ready jobs, with each planner's defaults:
SQLite's ``EXPLAIN QUERY PLAN`` (the index, no temporary B-tree for the ORDER BY);
PostgreSQL's ``EXPLAIN ANALYZE``, both before the tables have statistics (as right after
`laneway start-pipeline`: without them PostgreSQL took another index) and after
``ANALYZE`` (with them it took a sequential scan): no Sort node, and no node reads more
job rows than the claim asks for. PostgreSQL does not take ``group_name IS NULL`` as
fixing that index column, so before the group led the ORDER BY every ready job of the
partition was read and sorted for the first two (2-5 ms a claim at 3,000 ready jobs).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import text

from laneway.controller.ledger import statements
from tests.support import make_config

READY = 300
LIMIT = 3


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


def _sql(engine: Any, statement: Any) -> str:
    return str(statement.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True}))


@pytest.mark.parametrize("grouped", [False, True], ids=["no-groups", "item-groups"])
def test_a_claim_reads_only_the_first_ready_jobs_of_a_partition(engine, make_run, grouped):
    items = [{"key": f"item{i}", "lane": "a"} for i in range(READY)]
    run_id = make_run(make_config(items=items))
    group = None
    if grouped:  # a run that selects by yield: each item's jobs carry its group
        group = "g1"
        with engine.begin() as connection:
            connection.execute(text("UPDATE jobs SET group_name = :g"), {"g": group})
    partition = (run_id, "a", "only", group)
    if engine.dialect.name == "sqlite":
        sql = _sql(engine, statements.ready_candidates([partition], LIMIT, False))
        with engine.connect() as connection:
            rows = connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}").all()
        found = "\n".join(str(row[3]) for row in rows)
        assert "SEARCH jobs USING INDEX ix_jobs_dispatch" in found, found
        assert "TEMP B-TREE" not in found, found
        return
    sql = _sql(engine, statements.ready_candidates([partition], LIMIT, True))
    for analyzed in (False, True):
        with engine.begin() as connection:
            if analyzed:
                connection.exec_driver_sql("ANALYZE jobs")
                connection.exec_driver_sql("ANALYZE items")
            explained = connection.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            raw = explained.scalar_one()
            connection.rollback()  # EXPLAIN ANALYZE took the row locks: give them back
        plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
        nodes = _nodes(plan)
        shown = json.dumps(plan, indent=1)
        assert not [n for n in nodes if n["Node Type"] == "Sort"], shown
        on_jobs = [n for n in nodes if n.get("Relation Name") == "jobs"]
        assert on_jobs and all(n.get("Index Name") == "ix_jobs_dispatch" for n in on_jobs), shown
        assert all(n["Actual Rows"] * n["Actual Loops"] <= LIMIT for n in on_jobs), shown
        assert plan["Actual Rows"] == LIMIT, shown
