"""Sixteen worker processes on four nodes claim from one run of 2,000 jobs at once, on
each backend: every job runs exactly once, no attempt is written twice, no "database is
locked", serialization failure or deadlock reaches a worker, and a reader that follows
the event log by id (as the controller and the notifier do) misses no event although
claims on different nodes overlap on PostgreSQL (``db.claim_transaction``)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from laneway.controller import db
from tests.claim_race import race

pytestmark = pytest.mark.slow

JOBS = 2000
WORKERS = 16
NODES = 4


def _scalar(connection):
    """``one(sql)``: the first column of the first row ``sql`` returns."""
    return lambda sql: connection.execute(text(sql)).scalar()


def follow_events(engine, seen: set[int], stop: threading.Event) -> None:
    """Walk the event log as a cursor reader does: ids after the last one seen."""
    cursor = 0
    while True:
        done = stop.is_set()
        with engine.connect() as connection:
            ids = connection.execute(
                text("SELECT id FROM events WHERE id > :c ORDER BY id"), {"c": cursor}
            ).scalars()
            for event_id in ids:
                seen.add(event_id)
                cursor = event_id
        if done:
            return
        stop.wait(0.005)


def test_sixteen_workers_claim_each_job_exactly_once(runtime, engine):
    seen: set[int] = set()
    stop = threading.Event()
    reader = threading.Thread(target=follow_events, args=(engine, seen, stop))
    reader.start()
    try:
        found = race(db.ledger_url(runtime), jobs=JOBS, workers=WORKERS, nodes=NODES)
    finally:
        stop.set()
        reader.join()
    reports = found["reports"]
    assert [r["errors"] for r in reports] == [[]] * WORKERS, reports
    for err in found["stderr"]:
        for word in ("database is locked", "could not serialize", "deadlock", "Traceback"):
            assert word not in err, err[-2000:]
    assert sum(r["claims"] for r in reports) == JOBS
    assert sum(r["settles"] for r in reports) == JOBS
    with engine.connect() as connection:
        one = _scalar(connection)

        assert one("SELECT COUNT(*) FROM attempts") == JOBS
        # Exactly one attempt per (job, fence), and one per job.
        assert (
            one(
                "SELECT COUNT(*) FROM (SELECT job_id, fence FROM attempts "
                "GROUP BY job_id, fence HAVING COUNT(*) > 1) AS twice"
            )
            == 0
        )
        assert one("SELECT COUNT(DISTINCT job_id) FROM attempts") == JOBS
        # No attempt with two intents.
        assert (
            one(
                "SELECT COUNT(*) FROM (SELECT attempt_id FROM events WHERE kind = "
                "'attempt_intent' GROUP BY attempt_id HAVING COUNT(*) > 1) AS twice"
            )
            == 0
        )
        assert one("SELECT COUNT(*) FROM events WHERE kind = 'attempt_intent'") == JOBS
        assert one("SELECT COUNT(*) FROM jobs WHERE state <> 'succeeded'") == 0
        # Every event the cursor reader could have seen, it saw: none committed
        # behind an id it had already passed.
        every = set(connection.execute(text("SELECT id FROM events")).scalars())
        assert every - seen == set()
        # Each node's attempts ran on that node's workers only.
        assert (
            one(
                "SELECT COUNT(*) FROM attempts a JOIN workers w ON w.id = a.worker_id "
                "JOIN jobs j ON j.id = a.job_id WHERE 'a' || substr(w.node, 2) <> j.lane"
            )
            == 0
        )
    claims_per_s = JOBS / found["seconds"]
    worst = max(r["worst_wait_s"] for r in reports)
    print(
        f"\n{WORKERS} workers, {JOBS} jobs: {claims_per_s:.0f} claims/s, "
        f"worst claim wait {worst:.3f} s"
    )


def test_two_stage_items_under_sixteen_workers_promote_and_fold_without_deadlock(runtime, engine):
    """Every settle promotes its item's second stage (the order lock, mid-transaction on
    PostgreSQL) and folds a peak into its stage's row (a row every worker writes, under
    the order lock at the transaction's end): no deadlock, no lost promotion, and the
    stage's peak is the largest settled."""
    items = 400
    found = race(db.ledger_url(runtime), jobs=2 * items, workers=WORKERS, nodes=NODES, stages=2)
    reports = found["reports"]
    assert [r["errors"] for r in reports] == [[]] * WORKERS, reports
    for err in found["stderr"]:
        for word in ("database is locked", "could not serialize", "deadlock", "Traceback"):
            assert word not in err, err[-2000:]
    assert sum(r["settles"] for r in reports) == 2 * items
    with engine.connect() as connection:
        one = _scalar(connection)

        assert one("SELECT COUNT(*) FROM jobs WHERE state <> 'succeeded'") == 0
        assert one("SELECT COUNT(*) FROM attempts") == 2 * items
        folded = connection.execute(
            text("SELECT stage, measured, peak_rss_mib FROM stage_stats ORDER BY stage")
        ).all()
        # The peak each stage's settling workers reported is their index, which they
        # registered as their process start time.
        largest = dict(
            connection.execute(
                text(
                    "SELECT j.stage, MAX(w.process_start_time) FROM attempts a "
                    "JOIN jobs j ON j.id = a.job_id JOIN workers w ON w.id = a.worker_id "
                    "GROUP BY j.stage"
                )
            ).all()
        )
    assert [(stage, measured) for stage, measured, _ in folded] == [
        ("only", items),
        ("then", items),
    ]
    assert {stage: peak for stage, _, peak in folded} == {
        stage: float(index) for stage, index in largest.items()
    }
