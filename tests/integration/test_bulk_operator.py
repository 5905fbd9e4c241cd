"""Bulk operator commands: `retry --run RUN [--stage S] [--outcome ...]` retries every
matching failed job in one go, and a job may be named as ITEM.STAGE wherever a job id
is accepted. Real `laneway run`s; every execution is counted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from laneway.controller import db, ledger
from laneway.controller.models import Job
from laneway.controller.states import Outcome
from tests.integration.test_cli import invoke
from tests.support import claim_on_n1, make_config, py_stage, settle_one

JOB = """
import os, sys
item, flags, count = sys.argv[1:4]
open(count, 'a').write(item + chr(10))
path = os.path.join(flags, item)
if os.path.exists(path):
    sys.exit(int(open(path).read()))
"""


def test_bulk_retry_and_item_stage_ids(tmp_path: Path):
    flags, count = tmp_path / "flags", tmp_path / "count.txt"
    flags.mkdir()
    (flags / "x1").write_text("1")
    (flags / "x2").write_text("1")
    (flags / "x3").write_text("3")
    body = {
        "name": "bulk",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "name": "work",
                "argv": [sys.executable, "-c", JOB, "{item}", str(flags), str(count)],
                "exit_codes": {"0": "succeeded", "1": "failed", "3": "infra_failure"},
                "timeout_seconds": 60,
            }
        ],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(1, 5)],
    }
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(body))
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    first = invoke("run", str(config), *rt, "--json")
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["jobs"] == {"work": {"failed": 3, "succeeded": 1}}

    explained = json.loads(invoke("explain", "x4.work", "--run", "1", *rt, "--json").stdout)
    assert (explained["item"], explained["state"]) == ("x4", "succeeded")

    # Bulk: only the jobs that failed as `failed`; infra_failure stays for now.
    bulk = invoke("retry", "--run", "1", "--outcome", "failed", "--reason", "fixed", *rt, "--json")
    assert bulk.exit_code == 0, bulk.output
    retried = json.loads(bulk.stdout)["retried"]
    assert len(retried) == 2
    # One job by ITEM.STAGE.
    one = invoke("retry", "x3.work", "--reason", "outage over", *rt, "--json")
    assert one.exit_code == 0, one.output
    rows = json.loads(
        invoke(
            "sql",
            "SELECT j.id, i.key, j.state FROM jobs j JOIN items i ON i.id = j.item_id "
            "ORDER BY j.id",
            *rt,
            "--json",
        ).stdout
    )
    states = {row["key"]: row["state"] for row in rows}
    assert states == {"x1": "ready", "x2": "ready", "x3": "ready", "x4": "succeeded"}
    assert sorted(retried) == sorted(row["id"] for row in rows if row["key"] in ("x1", "x2"))

    # Nothing left to match: a second bulk retry moves nothing.
    again = invoke("retry", "--run", "1", "--reason", "again", *rt, "--json")
    assert json.loads(again.stdout)["retried"] == []
    for bad in (
        ["retry", "--stage", "work", "--reason", "r"],
        ["retry", "x1", "--reason", "r"],
        ["retry", "x1.work", "--stage", "work", "--reason", "r"],
        ["retry", "--run", "1", "--stage", "nope", "--reason", "r"],
        ["retry", "nope.work", "--reason", "r"],
    ):
        result = invoke(*bad, *rt)
        assert result.exit_code == 2, (bad, result.output)
        assert "Traceback" not in result.output

    # The retried run is continued; only the retried jobs run again.
    for flag in flags.iterdir():
        flag.unlink()
    finished = invoke("run", "--continue", "1", *rt, "--json")
    assert finished.exit_code == 0, finished.output
    assert json.loads(finished.stdout)["totals"] == {"succeeded": 4}
    assert sorted(count.read_text().splitlines()) == ["x1", "x1", "x2", "x2", "x3", "x3", "x4"]


def test_bulk_retry_filters_by_stage_and_outcome(factory, make_run, register_worker, clock):
    """`retry --run RUN --stage S [--outcome O]`: only the failed jobs of that stage (and
    outcome) move back to ready; the others stay as they are."""
    run_id = make_run(
        make_config([py_stage("a", "pass"), py_stage("b", "pass")], items=2, max_jobs=4)
    )
    worker = register_worker()
    claims = claim_on_n1(factory, worker, clock, slots=4)
    outcome_of = {
        ("item0", "a"): Outcome.FAILED,
        ("item1", "a"): Outcome.INFRA_FAILURE,
        ("item0", "b"): Outcome.FAILED,
        ("item1", "b"): Outcome.SUCCEEDED,
    }
    job_of = {}
    for claim in claims:
        settle_one(factory, claim, worker, clock, outcome_of[(claim.item, claim.stage)])
        job_of[(claim.item, claim.stage)] = claim.job_id

    def retry(**filters):
        with db.transaction(factory) as session:
            return ledger.retry_failed(
                session, run_id, reason="fixed", actor="op", now=clock.now(), **filters
            )

    assert retry(stage="a", outcome=Outcome.INFRA_FAILURE) == [job_of[("item1", "a")]]
    assert retry(stage="b") == [job_of[("item0", "b")]]
    assert retry(stage="b") == []  # nothing failed is left in b
    with factory() as session:
        states = {key: session.get(Job, job_id).state for key, job_id in job_of.items()}
    assert states == {
        ("item0", "a"): "failed",  # an ordinary failure of a: not asked for
        ("item1", "a"): "ready",
        ("item0", "b"): "ready",
        ("item1", "b"): "succeeded",
    }
