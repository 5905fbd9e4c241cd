"""`laneway status` follows the work, not the backlog (issue 22 item 5, "Quick reads"):
its counts are index-only queries and its lists are index ranges, checked on the query
plans (a plan does not depend on the ledger's size, so a small ledger shows it). On
SQLite ``EXPLAIN QUERY PLAN``; on PostgreSQL ``EXPLAIN`` with sequential scans off (on a
small table the planner would rightly prefer one) must name the index. What it reads of
a run's attempts (outcomes per stage, each lane's newest start and settle) comes from the
attempts' own indexes (migration 0016), never by joining every attempt to its job."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, text, update

from laneway.controller import db, queries
from laneway.controller.clock import iso
from laneway.controller.models import Attempt
from laneway.controller.rows import SessionRows, _moment
from laneway.controller.states import Outcome
from laneway.controller.status import status_report
from tests.support import claim_on_n1, make_config, py_stage, record_spawn, settle_in

PARAMS = {"run": 1, "lane": "a", "node": "n1"}

INDEX_ONLY = {
    "JOB_COUNTS": "ix_jobs_dispatch",
    "REUSED_BY_STAGE": "ix_jobs_reused",
    "ATTEMPT_OUTCOMES": "ix_attempts_run_stage_outcome",
}
"""Counts answered from an index alone (SQLite: ``USING COVERING INDEX``, no sort)."""

RANGES = {
    "RETRY_BACKOFF": "ix_jobs_retry_after",
    "IN_FLIGHT_ATTEMPTS": "ix_attempts_state",
    "UNKNOWN_ATTEMPTS": "ix_attempts_state",
    "UNKNOWN_PIDS": "ix_attempts_state",
    "RECENT_RUN_EVENTS": "ix_events_run",
    "LANE_LAST_DECISION": "ix_decisions_run_lane",
    "CLOSEOUT_EVENTS": "ix_events_run_kind",
    "ATTEMPTS_WITHOUT_STAGE": "ix_attempts_run_stage_outcome",
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
        if " jobs " not in f" {sql} ":
            continue
        if engine.dialect.name != "sqlite" or ":" in sql.replace(":run", "").replace(
            ":lane", ""
        ).replace(":node", ""):
            continue
        found = plan(engine, sql)
        assert "SEARCH jobs USING INDEX ix_jobs_run_state" not in found, (name, found)
        assert "SEARCH j USING INDEX ix_jobs_run_state" not in found, (name, found)


LANE_SEEKS = ("ix_attempts_run_lane_started", "ix_attempts_run_lane_settled")


def test_each_lane_newest_start_and_settle_is_one_seek(engine):
    """``LANE_ACTIVITY``: per lane the end of its range in each partial lane index (no
    range of the run's attempts, no sort, no job)."""
    found = plan(engine, queries.LANE_ACTIVITY)
    for index in LANE_SEEKS:
        if engine.dialect.name == "sqlite":
            assert f"USING COVERING INDEX {index} (run_id=? AND lane=?" in found, found
        else:
            assert f"Index Only Scan Backward using {index}" in found, found
    assert "jobs" not in found and "TEMP B-TREE" not in found, found


def _attempt_plans(engine: Any, names: list[str]) -> dict[str, str]:
    return {
        name: plan(engine, getattr(queries, name))
        for name in names
        if " attempts " in f" {getattr(queries, name)} "
    }


def test_status_reads_no_attempt_with_its_job_by_run_id(engine, make_run, clock):
    """Every query ``status_report`` runs that reads attempts does so through an index
    of what is in flight or unknown (``ix_attempts_state``) or through migration 0016's
    indexes; none walks the run's attempts (``ix_attempts_run_intent`` or
    ``ix_attempts_run_settled`` by ``run_id``) or scans them."""
    run_id = make_run()
    ran: list[str] = []

    class Recording(SessionRows):
        def rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
            ran.append(sql)
            return super().rows(sql, params)

    with db.session_factory(engine)() as session:
        status_report(Recording(session), run_id, now=clock.now())
    by_sql = {getattr(queries, n): n for n in dir(queries) if n.isupper()}
    names = sorted({by_sql[sql] for sql in ran if sql in by_sql})
    assert "LANE_ACTIVITY" in names and "ATTEMPT_OUTCOMES" in names, names
    allowed = ("ix_attempts_state", "ix_attempts_run_stage_outcome", *LANE_SEEKS)
    for name, found in _attempt_plans(engine, names).items():
        if engine.dialect.name == "sqlite":
            lines = [
                line for line in found.splitlines() if " a " in f" {line} " or "attempts" in line
            ]
            for line in lines:
                assert line.startswith("SEARCH"), (name, found)
                assert any(f"INDEX {index} " in line for index in allowed), (name, found)
        else:
            assert "Seq Scan on attempts" not in found, (name, found)
            assert "ix_attempts_run_intent" not in found, (name, found)
            assert "ix_attempts_run_settled" not in found, (name, found)


def _two_lanes(make_run: Any) -> int:
    config = make_config(
        [py_stage("s1", "pass"), py_stage("s2", "pass", needs=["s1"])],
        [{"key": "a1", "lane": "a"}, {"key": "a2", "lane": "a"}, {"key": "b1", "lane": "b"}],
        lanes=[{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}],
    )
    return make_run(config)


def test_status_outcomes_and_lane_activity_from_the_attempts(
    engine, factory, make_run, register_worker, clock
):
    """Settled attempts per stage and outcome and each lane's newest start, as the
    attempts say, through the new queries; an attempt row without a stage or lane (none
    the claim writes) is counted through its job and does not break the report."""
    run_id = _two_lanes(make_run)
    worker = register_worker()
    outcomes = [Outcome.SUCCEEDED, Outcome.FAILED, Outcome.SUCCEEDED]
    claims = claim_on_n1(factory, worker, clock, slots=3)
    assert sorted(c.lane for c in claims) == ["a", "a", "b"]
    for claim, outcome in zip(claims, outcomes, strict=True):
        clock.advance(7)
        with db.transaction(factory) as session:
            record_spawn(session, claim, worker, clock.now(), ("boot", 100 + claim.attempt_id, 1))
        clock.advance(3)
        with db.transaction(factory) as session:
            settle_in(session, claim, worker, clock, outcome)

    def expected() -> tuple[dict[str, dict[str, int]], dict[str, tuple[Any, Any]]]:
        with db.session_factory(engine)() as session:
            rows = session.execute(
                select(Attempt.job_id, Attempt.outcome, Attempt.started_at, Attempt.settled_at)
            ).all()
        by_job = {c.job_id: c for c in claims}
        counts: dict[str, dict[str, int]] = {}
        activity: dict[str, tuple[Any, Any]] = {}
        for job_id, outcome, started, settled in rows:
            claim = by_job[job_id]
            by = counts.setdefault(claim.stage, {})
            by[str(outcome)] = by.get(str(outcome), 0) + 1
            start, end = activity.get(claim.lane, (None, None))
            activity[claim.lane] = (
                max(filter(None, (start, started))),
                max(filter(None, (end, settled))),
            )
        return counts, activity

    def report_and_rows() -> tuple[Any, dict[str, tuple[Any, ...]]]:
        with db.session_factory(engine)() as session:
            source = SessionRows(session)
            report = status_report(source, run_id, now=clock.now())
            lanes = {row[0]: row for row in source.rows(queries.LANE_ACTIVITY, {"run": run_id})}
        return report, lanes

    counts, activity = expected()
    assert counts == {"s1": {"failed": 1, "succeeded": 2}}
    report, lanes = report_and_rows()
    assert report.outcomes == {"s1": {"failed": 1, "succeeded": 2}, "s2": {}}
    assert report.throughput.settled_attempts == 3
    for lane in report.lanes:
        assert lane.last_start == iso(activity[lane.lane][0]), lane
    for name, (start, end) in activity.items():
        _name, node, started, settled = lanes[name]
        assert node == "n1"
        assert iso(_moment(started)) == iso(start) and iso(_moment(settled)) == iso(end)

    # A row written without its stage and lane (as before migration 0015 filled them):
    # the same report, through its job.
    newest = claims[-1]
    with db.transaction(factory) as session:
        session.execute(
            update(Attempt).where(Attempt.id == newest.attempt_id).values(stage=None, lane=None)
        )
    again, _lanes = report_and_rows()
    assert again.outcomes == report.outcomes
    assert [(lane.lane, lane.last_start) for lane in again.lanes] == [
        (lane.lane, lane.last_start) for lane in report.lanes
    ]
