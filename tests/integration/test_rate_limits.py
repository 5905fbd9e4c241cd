"""Paid work under control (issue 'Paid work under control'): rate limits that hold across
nodes, a rate-limited result retried after its delay without tripping the breaker, and
priorities. Real supervisors and jobs, in-process workers and controller, both backends.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from laneway.cli import render
from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.explain import explain_job
from laneway.controller.models import Attempt, Control, Decision, Item, Job
from tests.integration.test_worker import drive, start_worker
from tests.support import make_config, py_stage

TWO_NODES = [
    {"name": "n1", "memory_floor_mib": 0, "max_jobs": 4},
    {"name": "n2", "memory_floor_mib": 0, "max_jobs": 4},
]


def started_at(engine, run_id: int) -> list:
    with db.session_factory(engine)() as session:
        return sorted(
            session.scalars(select(Attempt.intent_at).where(Attempt.run_id == run_id)).all()
        )


def test_five_calls_per_two_seconds_never_a_sixth_in_any_window_across_two_nodes(engine, make_run):
    stage = py_stage("call", "import time; time.sleep(0.05)", nodes=["n1", "n2"], limits=["prov"])
    config = make_config(
        [stage],
        items=12,
        nodes=TWO_NODES,
        limits={"prov": {"calls": 5, "per_seconds": 2}},
    )
    run_id = make_run(config)
    workers = [start_worker(engine, node="n1", slots=4), start_worker(engine, node="n2", slots=4)]
    drive(engine, workers, run_id, timeout=60)

    starts = started_at(engine, run_id)
    assert len(starts) == 12
    window = timedelta(seconds=2)
    # The admission rule: at the claim, the attempts started at or after now - 2 s, plus
    # this one, are at most 5. So no 2 s window (both ends closed) holds a sixth.
    for moment in starts:
        inside = [s for s in starts if moment - window <= s <= moment]
        assert len(inside) <= 5, (moment, inside)
    # Both nodes took some (the limit is the run's, not a node's).
    with db.session_factory(engine)() as session:
        nodes = set(session.scalars(select(Attempt.node).where(Attempt.run_id == run_id)))
        refusals = session.scalars(
            select(Decision).where(Decision.run_id == run_id, Decision.reason_code == "rate_limit")
        ).all()
    assert nodes == {"n1", "n2"}
    assert refusals
    detail = refusals[0].detail
    assert (detail["limit"], detail["key"], detail["cap"], detail["this"]) == (
        "prov",
        "calls",
        5,
        1,
    )
    assert detail["in_window"] == 5 and 0 <= detail["frees_in_seconds"] <= 2
    assert refusals[0].detail == detail


RATE_LIMITED_ONCE = """
import json, os, sys
flag = os.path.join(sys.argv[2], sys.argv[1])
if not os.path.exists(flag):
    open(flag, "w").close()
    json.dump({"job_id": os.environ["LANEWAY_JOB_ID"], "rate_limited": True,
               "retry_after_seconds": 1}, open(os.environ["LANEWAY_RESULT_PATH"], "w"))
    sys.exit(1)
"""


def test_a_rate_limited_result_retries_after_its_delay_and_never_trips_the_breaker(
    engine, make_run, tmp_path
):
    flags = tmp_path / "flags"
    flags.mkdir()
    stage = py_stage("call", RATE_LIMITED_ONCE, retry={"max_attempts": 3})
    stage["argv"] = [*stage["argv"], str(flags)]
    run_id = make_run(make_config([stage], items=3, infra_breaker=1))
    drive(engine, [start_worker(engine)], run_id, timeout=60)

    with db.session_factory(engine)() as session:
        attempts = session.scalars(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.id)
        ).all()
        jobs = session.scalars(select(Job).where(Job.run_id == run_id)).all()
        controls = session.scalars(select(Control).where(Control.run_id == run_id)).all()
    assert sorted(a.outcome.value for a in attempts) == ["rate_limited"] * 3 + ["succeeded"] * 3
    assert {j.state.value for j in jobs} == {"succeeded"}
    assert controls == []  # the breaker (threshold 1) never counted them
    by_job: dict[int, list[Attempt]] = {}
    for attempt in attempts:
        by_job.setdefault(attempt.job_id, []).append(attempt)
    for first, second in by_job.values():
        assert first.state_reason == "result.json reports rate_limited (retry after 1 s)"
        # The retry waited the second the job asked for (both times on the ledger's clock).
        assert second.intent_at - first.settled_at >= timedelta(seconds=1)


def test_ready_jobs_go_highest_priority_first_fifo_among_equals(engine, make_run):
    items = [
        {"key": "low-a", "lane": "a"},
        {"key": "high-a", "lane": "a", "prio": 5},
        {"key": "low-b", "lane": "a"},
        {"key": "mid", "lane": "a", "prio": 2},
        {"key": "high-b", "lane": "a", "prio": 5},
    ]
    config = make_config([py_stage("s", "pass")], items=items, max_jobs=1, priority_field="prio")
    run_id = make_run(config)
    with db.session_factory(engine)() as session:
        low_b = session.scalars(
            select(Job.id).join(Item, Item.id == Job.item_id).where(Item.key == "low-b")
        ).one()
        waiting = explain_job(session, low_b, now=SystemClock().now())
    assert waiting["waits_behind"]["count"] == 3
    assert [j["job"] for j in waiting["waits_behind"]["jobs"]] == ["high-a.s", "high-b.s", "mid.s"]
    assert "waits behind 3 ready job(s) of higher priority: high-a.s (priority 5)" in (
        render.explain_text(waiting)
    )
    drive(engine, [start_worker(engine, slots=1)], run_id, timeout=60)
    with db.session_factory(engine)() as session:
        order = [
            ledger.get_attempt(session, a).attempt_dir.rsplit("/", 2)[-2].split(".")[0]
            for a in session.scalars(
                select(Attempt.id).where(Attempt.run_id == run_id).order_by(Attempt.intent_at)
            )
        ]
    assert order == ["high-a", "high-b", "mid", "low-a", "low-b"]
