"""Budgets at admission, with real workers and real jobs: refusal reason ``budget``,
expected cost from the configured figure then the measured p90, reservations of
running and unknown attempts counted, and the run paused once nothing more fits."""

from __future__ import annotations

import textwrap

import pytest
from sqlalchemy import select

from laneway.controller import db
from laneway.controller.errors import ConfigError
from laneway.controller.ledger.tables import usage_totals
from laneway.controller.models import Attempt, Control, Decision, Job, Reservation
from laneway.controller.status import explain_job
from tests.integration.test_worker import start_worker
from tests.support import (
    claim_on_n1,
    make_config,
    mark_unknown_one,
    py_stage,
    reconcile_one,
    wait_until,
)

SPENDER = textwrap.dedent(
    """
    import json, os
    with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
        json.dump({"job_id": os.environ["LANEWAY_JOB_ID"], "usage": {"cost_usd": 2}}, f)
    """
)


def test_run_budget_refuses_then_pauses_with_the_arithmetic(engine, make_run, clock):
    stage = py_stage("s", SPENDER, expected_usage={"cost_usd": 1})
    run_id = make_run(make_config([stage], items=6, budget={"cost_usd": 5}))
    worker = start_worker(engine, slots=1)
    factory = db.session_factory(engine)

    def paused():
        worker.tick()
        with factory() as session:
            return session.scalars(
                select(Control).where(Control.run_id == run_id, Control.kind == "pause")
            ).first()

    control = wait_until(paused, timeout=60)
    with factory() as session:
        spent = session.execute(
            select(usage_totals.c.spent, usage_totals.c.reserved).where(
                usage_totals.c.run_id == run_id
            )
        ).one()
        ran = session.scalars(select(Attempt.outcome).where(Attempt.run_id == run_id)).all()
        refusal = session.scalars(
            select(Decision)
            .where(Decision.run_id == run_id, Decision.reason_code == "budget")
            .order_by(Decision.id)
        ).first()
        ready = session.scalars(
            select(Job.id).where(Job.run_id == run_id, Job.state == "ready").order_by(Job.id)
        ).first()
        explained = explain_job(session, ready, now=clock.now())
    # First attempt: 0 + expected 1 (configured) fits; it spent 2. Second: 2 + p90 2 =
    # 4 fits. Third: 4 + 2 = 6 > 5: refused, nothing running, so the run pauses.
    assert list(ran) == ["succeeded", "succeeded"]
    assert tuple(spent) == (pytest.approx(4.0), pytest.approx(0.0))
    # The refusal began while the second attempt ran: its expected cost was held.
    assert refusal.detail["expected_from"] == "p90 of 1 attempt(s)"
    assert [refusal.detail[k] for k in ("spent", "reserved", "expected")] == [2.0, 2.0, 2.0]
    words = "budget (run) — cost_usd: spent 4 + reserved 0 + expected 2 (p90 of 2 attempt(s))"
    assert control.reason.startswith(f"nothing more fits the budget: {words}")
    assert "= 6 > budget 5" in control.reason
    blocked = {reason["code"]: reason["words"] for reason in explained["blocked_by"]}
    assert blocked["budget"].startswith(words)
    assert "paused" in blocked


def test_unknown_attempt_holds_its_expected_cost_until_reconciled(
    factory, make_run, register_worker, clock
):
    stage = py_stage("s", "pass", expected_usage={"cost_usd": 3}, budget={"cost_usd": 5})
    run_id = make_run(make_config([stage], items=3))
    worker = register_worker()
    (first,) = claim_on_n1(factory, worker, clock, slots=2)  # 3 + 3 > 5: one only
    with factory() as session:
        held = session.scalars(
            select(Reservation.usage).where(Reservation.attempt_id == first.attempt_id)
        ).one()
        last = session.scalars(select(Decision).order_by(Decision.id.desc())).first()
    assert held == {"cost_usd": 3.0}
    assert (last.reason_code, last.detail["scope"], last.detail["reserved"]) == (
        "budget",
        "stage",
        3.0,
    )
    mark_unknown_one(factory, first, clock, "test: lost", actor="t")
    assert _reserved(factory, run_id) == pytest.approx(3.0)
    reconcile_one(factory, first, clock, "not-run", "never ran")
    assert _reserved(factory, run_id) == pytest.approx(0.0)
    assert len(claim_on_n1(factory, worker, clock, slots=1)) == 1


def _reserved(factory, run_id):
    with factory() as session:
        return session.execute(
            select(usage_totals.c.reserved).where(usage_totals.c.run_id == run_id)
        ).scalar_one()


@pytest.mark.parametrize(
    ("extra", "stage_extra", "line"),
    [
        ({"budget": {"cost_usd": -1}}, {}, "budget.cost_usd: Input should be greater than"),
        ({"budget": {"cost_usd": "lots"}}, {}, "budget.cost_usd: 'lots' is text, not a number"),
        ({}, {"expected_usage": {"cost_usd": float("inf")}}, "expected_usage.cost_usd"),
        ({}, {"budget": {"bad key": 1}}, "stages.0.budget"),
    ],
)
def test_a_bad_budget_is_a_config_error_naming_the_field(extra, stage_extra, line):
    with pytest.raises(ConfigError) as error:
        make_config([py_stage("s", "pass", **stage_extra)], **extra)
    assert any(line in problem for problem in error.value.problems), error.value.problems
