"""Usage reported by jobs: stored per attempt, summed in the views, counted on failure
and on unknown attempts, bad values a recorded warning that changes no outcome."""

from __future__ import annotations

import textwrap

import pytest
from sqlalchemy import select, text

from laneway.controller import db
from laneway.controller.ledger.tables import usage_totals
from laneway.controller.models import Attempt, AttemptUsage, Item, Job
from laneway.controller.states import Outcome
from laneway.controller.usage import p90, read_usage
from tests.integration.test_worker import drive, start_worker
from tests.support import (
    claim_on_n1,
    make_config,
    mark_unknown_one,
    py_stage,
    reconcile_one,
    settle_one,
)

REPORTER = textwrap.dedent(
    """
    import json, os, sys
    item = sys.argv[1]
    usage = {
        "ok1": {"input_tokens": 100, "cost_usd": 0.5, "useful_tokens": 40},
        "ok2": {"input_tokens": 300, "cost_usd": 1.5},
        "fails": {"input_tokens": 50, "cost_usd": 2.0},
        "bad": {"input_tokens": -1, "cost_usd": "NaN", "calls": True, "output_tokens": 7},
        "silent": None,
    }[item]
    result = {"job_id": os.environ["LANEWAY_JOB_ID"]}
    if usage is not None:
        result["usage"] = usage
    with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
        f.write(json.dumps(result).replace('"NaN"', "NaN"))
    sys.exit(1 if item == "fails" else 0)
    """
)


def test_read_usage_keeps_valid_numbers_and_warns_about_the_rest():
    usage, warnings = read_usage(
        {
            "usage": {
                "a": 1,
                "b": 2.5,
                "neg": -3,
                "inf": float("inf"),
                "nan": float("nan"),
                "s": "12",
                "t": True,
                "bad key!": 1,
            }
        }
    )
    assert usage == {"a": 1.0, "b": 2.5}
    assert len(warnings) == 6
    assert any("usage.neg ignored: -3 is negative" in w for w in warnings)
    assert any("usage.inf ignored: inf is not finite" in w for w in warnings)
    assert read_usage({"usage": [1, 2]})[0] == {}
    assert "must be an object" in read_usage({"usage": [1, 2]})[1][0]
    assert read_usage({"job_id": 1}) == ({}, [])
    assert read_usage(None) == ({}, [])


def test_p90_is_nearest_rank():
    assert p90([]) is None
    assert p90([5.0]) == 5.0
    assert p90([float(v) for v in range(1, 11)]) == 9.0
    assert p90([float(v) for v in range(1, 101)]) == 90.0


def test_real_jobs_report_usage_summed_per_job_stage_lane_item_and_run(engine, make_run):
    stages = [py_stage("s", REPORTER)]
    keys = ["ok1", "ok2", "fails", "bad", "silent"]
    lanes = [{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}]
    items = [{"key": k, "lane": "b" if k == "ok2" else "a"} for k in keys]
    run_id = make_run(make_config(stages, items=items, lanes=lanes))
    drive(engine, [start_worker(engine)], run_id)
    with db.session_factory(engine)() as session:
        by_item = {
            row.item: (row.outcome, row.diagnostics)
            for row in session.execute(
                select(Item.key.label("item"), Attempt.outcome, Attempt.diagnostics)
                .join(Job, Job.id == Attempt.job_id)
                .join(Item, Item.id == Job.item_id)
            )
        }
        rows = session.execute(
            select(AttemptUsage.key, AttemptUsage.value, AttemptUsage.stage)
        ).all()
        views = {
            view: session.execute(text(f"SELECT * FROM {view} WHERE run_id = :r"), {"r": run_id})
            .mappings()
            .all()
            for view in ("v_usage_run", "v_usage_stage", "v_usage_lane", "v_usage_item")
        }
        per_job = session.execute(text("SELECT * FROM v_usage_job")).mappings().all()
        per_attempt = session.execute(text("SELECT * FROM v_attempt_usage")).mappings().all()
        totals = {
            (r.stage, r.key): (r.spent, r.attempts)
            for r in session.execute(select(usage_totals)).all()
        }
    # A bad value is a warning; the outcome is the exit's (0: succeeded).
    assert by_item["bad"][0] == "succeeded"
    bad_warnings = " | ".join(by_item["bad"][1])
    assert "usage.input_tokens ignored: -1 is negative" in bad_warnings
    assert "usage.cost_usd ignored: nan is not finite" in bad_warnings
    assert "usage.calls ignored: True is not a number" in bad_warnings
    assert by_item["fails"][0] == "failed"
    # The failed attempt's spend counts; the bad attempt's valid key is kept.
    run = {r["key"]: (r["total"], r["attempts"]) for r in views["v_usage_run"]}
    assert run["cost_usd"] == (pytest.approx(4.0), 3)
    assert run["input_tokens"] == (pytest.approx(450.0), 3)
    assert run["output_tokens"] == (pytest.approx(7.0), 1)
    assert run["useful_tokens"] == (pytest.approx(40.0), 1)
    assert "calls" not in run
    lane = {(r["lane"], r["key"]): r["total"] for r in views["v_usage_lane"]}
    assert lane[("a", "cost_usd")] == pytest.approx(2.5)
    assert lane[("b", "cost_usd")] == pytest.approx(1.5)
    item = {(r["item"], r["key"]): r["total"] for r in views["v_usage_item"]}
    assert item[("fails", "cost_usd")] == pytest.approx(2.0)
    assert ("silent", "cost_usd") not in item
    stage = {(r["stage"], r["key"]): r["total"] for r in views["v_usage_stage"]}
    assert stage[("s", "cost_usd")] == pytest.approx(4.0)
    assert {r["item"] for r in per_job} == {"ok1", "ok2", "fails", "bad"}
    assert {r["outcome"] for r in per_attempt} == {"succeeded", "failed"}
    assert len(rows) == 3 + 2 + 2 + 1
    # The running totals the budget reads agree with the sums.
    assert totals[("s", "cost_usd")] == (pytest.approx(4.0), 3)
    assert totals[("s", "input_tokens")] == (pytest.approx(450.0), 3)


def test_unknown_attempt_counts_its_usage_once_through_reconcile(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=2))
    worker = register_worker()
    first, second = claim_on_n1(factory, worker, clock, slots=2)
    usage = {"job_id": first.job_id, "usage": {"cost_usd": 3.0}}
    mark_unknown_one(factory, first, clock, "test: lost", fence=first.fence, result=usage)
    reconcile_one(factory, first, clock, "failed", "it ran", result=usage)
    settle_one(
        factory,
        second,
        worker,
        clock,
        Outcome.FAILED,
        result={"job_id": second.job_id, "usage": {"cost_usd": 1.25}},
    )
    with factory() as session:
        spent = session.execute(
            select(usage_totals.c.spent, usage_totals.c.attempts).where(
                usage_totals.c.run_id == run_id, usage_totals.c.key == "cost_usd"
            )
        ).one()
        states = session.scalars(select(Attempt.state).order_by(Attempt.id)).all()
    assert tuple(spent) == (pytest.approx(4.25), 2)
    assert list(states) == ["settled", "settled"]


def test_a_result_with_nan_is_stored_on_every_backend(factory, make_run, register_worker, clock):
    make_run()
    worker = register_worker()
    (claimed,) = claim_on_n1(factory, worker, clock)
    result = {"job_id": claimed.job_id, "score": float("nan"), "usage": {"x": float("inf")}}
    settle_one(factory, claimed, worker, clock, Outcome.SUCCEEDED, result=result)
    with factory() as session:
        attempt = session.get(Attempt, claimed.attempt_id)
        assert attempt.outcome == "succeeded"
        assert attempt.result == {"job_id": claimed.job_id, "score": "nan", "usage": {"x": "inf"}}
        assert attempt.diagnostics == ["usage.x ignored: inf is not finite"]
