"""Choosing what to run next by the useful output it buys, with bounded exploration
(issue 'Paid work under control', item 3). Real supervisors and jobs that report usage,
an in-process worker and controller, both backends.

Two groups of items whose jobs report different yields (useful_tokens per cost_usd): once
both are measured, the better group gets at least (1 - explore) of the admissions and the
other still gets its share; every choice is a decision with the figures it used, which
`explain` shows; the report gives each group's allocation beside its yield.
"""

from __future__ import annotations

from sqlalchemy import select

from laneway.cli import render
from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.explain import explain_job
from laneway.controller.ledger.selection import SELECT_CODE
from laneway.controller.models import Decision, Job
from laneway.controller.report import build_report
from tests.integration.test_worker import drive, start_worker
from tests.support import make_config, py_stage

REPORTS_YIELD = """
import json, os, sys
useful = {"P2": 100, "P3": 10}[sys.argv[2]]
json.dump({"job_id": os.environ["LANEWAY_JOB_ID"],
           "usage": {"useful_tokens": useful, "cost_usd": 1.0}},
          open(os.environ["LANEWAY_RESULT_PATH"], "w"))
"""
EXPLORE = 0.2


def test_the_better_group_gets_its_share_and_the_other_is_still_explored(engine, make_run):
    stage = py_stage("ask", REPORTS_YIELD)
    stage["argv"] = [*stage["argv"], "{group}"]
    items = [{"key": f"i{n:02d}", "lane": "a", "group": ("P2", "P3")[n % 2]} for n in range(20)]
    config = make_config(
        [stage],
        items=items,
        max_jobs=1,
        select={"by": "useful_tokens", "per": "cost_usd", "explore": EXPLORE},
    )
    run_id = make_run(config)
    drive(engine, [start_worker(engine, slots=1)], run_id, timeout=120)

    with db.session_factory(engine)() as session:
        choices = session.scalars(
            select(Decision)
            .where(Decision.run_id == run_id, Decision.reason_code == SELECT_CODE)
            .order_by(Decision.id)
        ).all()
        jobs = session.scalars(select(Job).where(Job.run_id == run_id)).all()
        explained = explain_job(session, choices[5].job_id, now=SystemClock().now())
        report = build_report(session, ledger.get_run(session, run_id), now=SystemClock().now())
    assert {j.state.value for j in jobs} == {"succeeded"}
    groups = [c.detail["group"] for c in choices]
    assert len(groups) == 20 and sorted(groups) == ["P2"] * 10 + ["P3"] * 10
    # Nothing measured: the first two explore, one of each group.
    assert sorted(groups[:2]) == ["P2", "P3"]
    assert [c.detail["why"] for c in choices[:2]] == ["explore", "explore"]
    # Both measured, both still have ready jobs (until P2's tenth): P2 leads.
    last_p2 = max(i for i, g in enumerate(groups) if g == "P2")
    measured = groups[2 : last_p2 + 1]
    share = measured.count("P2") / len(measured)
    assert share >= (1 - EXPLORE) - 1 / len(measured), groups
    assert "P3" in measured, groups
    later = choices[5].detail
    assert later["best"] == "P2" and later["yields"] == {"P2": 100.0, "P3": 10.0}
    assert later["by"] == "useful_tokens" and later["per"] == "cost_usd"
    # explain shows the choice with its figures; the report the allocation and yields.
    assert explained["selection"] == later
    allocation = {g["group"]: g for g in report["selection"]["groups"]}
    assert allocation["P2"]["admitted"] == allocation["P3"]["admitted"] == 10
    assert allocation["P2"]["yield"] == 100.0 and allocation["P3"]["yield"] == 10.0
    assert sum(allocation["P3"]["over_time"]) == 10
    text = render.selection_lines(report["selection"])
    assert text[0].startswith("selection by useful_tokens per cost_usd (explore 0.2; ")
    assert text[1].startswith("  P2: 10 admitted, yield 100; per tenth of the window: ")


def test_a_reconciled_attempts_reported_usage_counts_for_its_groups_yield(
    engine, make_run, register_worker, clock
):
    """Usage that reaches the ledger other than through a settle (an unknown attempt an
    operator reconciles with its result) counts for the group's yield too, once."""
    from laneway.controller.models import GroupStats
    from tests.support import claim_one_on_n1, reconcile_one

    config = make_config(
        [py_stage("ask", "pass")],
        items=[{"key": "only", "lane": "a", "group": "P2"}],
        select={"by": "useful_tokens", "per": "cost_usd"},
    )
    make_run(config)
    factory = db.session_factory(engine)
    claimed = claim_one_on_n1(factory, register_worker(), clock, unknown="lease expired")
    result = {"job_id": claimed.job_id, "usage": {"useful_tokens": 50, "cost_usd": 0.5}}
    reconcile_one(factory, claimed, clock, "succeeded", "checked by hand", result=result)
    with factory() as session:
        (row,) = session.scalars(select(GroupStats)).all()
    assert (row.group_name, row.admitted, row.measured) == ("P2", 1, 1)
    assert (row.by_total, row.per_total) == (50.0, 0.5)
