"""Retry with backoff: an automatic retry waits out its stage's backoff (so an
infrastructure failure is not retried straight into the same outage), shows when it
may run again in `status` and `explain`, and is claimed only after the controller
released it. Ledger-level with a fixed clock, then one real `laneway run`."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

from laneway.controller import db, ledger, policy
from laneway.controller.clock import iso
from laneway.controller.config import RetryPolicy
from laneway.controller.rows import SessionRows
from laneway.controller.states import JobState, Outcome
from laneway.controller.status import explain_job, status_report
from tests.integration.test_cli import invoke
from tests.support import claim_on_n1, make_config, py_stage, settle_one


def test_retry_delay_grows_and_is_capped():
    assert policy.retry_delay(RetryPolicy(), 1) == 0
    retry = RetryPolicy(backoff_seconds=10, backoff_multiplier=3, backoff_max_seconds=60)
    assert [policy.retry_delay(retry, n) for n in (1, 2, 3, 4)] == [10, 30, 60, 60]


def test_backoff_holds_the_job_until_the_controller_releases_it(
    factory, make_run, register_worker, clock
):
    retry = {"max_attempts": 3, "on": ["infra_failure"], "backoff_seconds": 30}
    run_id = make_run(make_config([py_stage("call", "pass", retry=retry)]))
    worker = register_worker()
    [claim] = claim_on_n1(factory, worker, clock)
    assert settle_one(factory, claim, worker, clock, Outcome.INFRA_FAILURE) is JobState.READY
    due_at = clock.now() + timedelta(seconds=30)

    with factory() as session:
        status = status_report(SessionRows(session), run_id, now=clock.now()).as_dict()
        explained = explain_job(session, claim.job_id, now=clock.now())
    assert status["retry_backoff"] == [
        {"job_id": claim.job_id, "item": "item0", "stage": "call", "retry_after": iso(due_at)}
    ]
    assert explained["retry_after"] == iso(due_at)
    assert [b["code"] for b in explained["blocked_by"]] == ["retry_backoff"]

    # Not claimable while it backs off, and the controller leaves it alone until then.
    assert claim_on_n1(factory, worker, clock) == []
    with db.transaction(factory) as session:
        assert ledger.next_retry_at(session) == due_at
        assert ledger.release_due_retries(session, now=clock.now(), actor="test") == 0
    clock.advance(30)
    with db.transaction(factory) as session:
        assert ledger.release_due_retries(session, now=clock.now(), actor="test") == 1
        assert ledger.next_retry_at(session) is None
    [again] = claim_on_n1(factory, worker, clock)
    assert (again.job_id, again.number) == (claim.job_id, 2)

    # The second wait is longer (multiplier 2).
    assert settle_one(factory, again, worker, clock, Outcome.INFRA_FAILURE) is JobState.READY
    with factory() as session:
        status = status_report(SessionRows(session), run_id, now=clock.now()).as_dict()
    assert status["retry_backoff"][0]["retry_after"] == iso(clock.now() + timedelta(seconds=60))


JOB = """
import os, sys
flag, count = sys.argv[1:3]
open(count, 'a').write('call' + chr(10))
if not os.path.exists(flag):
    open(flag, 'w').close()
    sys.exit(3)
"""


def test_real_run_retries_after_its_backoff(tmp_path: Path):
    flag, count = tmp_path / "flag", tmp_path / "count.txt"
    body = {
        "name": "backoff",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "name": "call",
                "argv": [sys.executable, "-c", JOB, str(flag), str(count)],
                "exit_codes": {"0": "succeeded", "3": "infra_failure"},
                "retry": {"max_attempts": 2, "on": ["infra_failure"], "backoff_seconds": 0.5},
                "timeout_seconds": 60,
            }
        ],
        "items": [{"key": "x1", "lane": "a"}],
    }
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(body))
    runtime = tmp_path / "rt"
    result = invoke("run", str(config), "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["totals"] == {"succeeded": 1}
    assert count.read_text().splitlines() == ["call", "call"]
    rows = json.loads(
        invoke(
            "sql",
            "SELECT kind, at FROM events WHERE kind IN "
            "('attempt_intent', 'attempt_settled', 'job_retry_due') ORDER BY id",
            "--runtime-dir",
            str(runtime),
            "--json",
        ).stdout
    )
    kinds = [row["kind"] for row in rows]
    assert kinds == [
        "attempt_intent",
        "attempt_settled",
        "job_retry_due",
        "attempt_intent",
        "attempt_settled",
    ]
