"""Sixteen worker processes claim from one run of 2,000 jobs at once, on each backend:
every job runs exactly once, no attempt is written twice, and no "database is locked",
serialization failure or deadlock reaches a worker."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from laneway.controller import db
from tests.claim_race import race

pytestmark = pytest.mark.slow

JOBS = 2000
WORKERS = 16


def test_sixteen_workers_claim_each_job_exactly_once(runtime, engine):
    found = race(db.ledger_url(runtime), jobs=JOBS, workers=WORKERS)
    reports = found["reports"]
    assert [r["errors"] for r in reports] == [[]] * WORKERS, reports
    for err in found["stderr"]:
        for word in ("database is locked", "could not serialize", "deadlock", "Traceback"):
            assert word not in err, err[-2000:]
    assert sum(r["claims"] for r in reports) == JOBS
    assert sum(r["settles"] for r in reports) == JOBS
    with engine.connect() as connection:

        def one(sql: str) -> object:
            return connection.execute(text(sql)).scalar()

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
    claims_per_s = JOBS / found["seconds"]
    worst = max(r["worst_wait_s"] for r in reports)
    print(
        f"\n{WORKERS} workers, {JOBS} jobs: {claims_per_s:.0f} claims/s, "
        f"worst claim wait {worst:.3f} s"
    )
