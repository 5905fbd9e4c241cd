"""Admission decisions in the ledger: one row per change of reason, readable by view."""

from __future__ import annotations

import json

from sqlalchemy import select, text

from laneway.controller import db, ledger
from laneway.controller.models import Decision
from laneway.controller.states import Outcome
from tests.support import claim_in, claim_on_n1, make_config, py_stage, settle_one


def decisions(factory):
    with factory() as session:
        return [
            (d.lane, d.stage, d.verdict, d.reason_code)
            for d in session.scalars(select(Decision).order_by(Decision.id))
        ]


def test_refusals_are_recorded_once_per_change(factory, make_run, register_worker, clock):
    config = make_config(
        [py_stage("prep", "pass")],
        items=3,
        lanes=[{"name": "a", "node": "n1", "caps": {"prep": 1}}],
    )
    make_run(config)
    worker = register_worker()
    (first,) = claim_on_n1(factory, worker, clock, slots=4)
    assert decisions(factory) == [
        ("a", "prep", "dispatched", None),
        ("a", "prep", "refused", "lane_cap"),
    ]
    for _ in range(3):  # nothing changed: no new rows
        assert claim_on_n1(factory, worker, clock, slots=4) == []
    assert len(decisions(factory)) == 2
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    assert len(claim_on_n1(factory, worker, clock, slots=4)) == 1
    assert decisions(factory)[2:] == [
        ("a", "prep", "dispatched", None),
        ("a", "prep", "refused", "lane_cap"),
    ]
    with factory() as session:
        why = session.execute(
            text("SELECT lane, stage, verdict, reason_code, detail FROM v_why_idle")
        ).one()
    assert why[:4] == ("a", "prep", "refused", "lane_cap")
    detail = why[4] if isinstance(why[4], dict) else json.loads(why[4])  # PostgreSQL: json
    assert detail["cap"] == 1


def test_memory_floor_refusal_carries_the_arithmetic(factory, make_run, register_worker, clock):
    config = make_config([py_stage("big", "pass", memory_mib=2048)])
    run_id = make_run(config)
    worker = register_worker()
    with db.transaction(factory) as session:
        ledger.upsert_node(
            session, config.nodes[0].model_copy(update={"memory_floor_mib": 1024}), now=clock.now()
        )
        claims = claim_in(session, worker, clock, slots=1, mem=900)
    assert claims == []
    with factory() as session:
        decision = session.scalars(select(Decision).where(Decision.run_id == run_id)).one()
    assert decision.reason_code == "memory_floor"
    assert decision.detail == {
        "available_mib": 900,
        "reserved_mib": 0,
        "stage_mib": 2048,
        "floor_mib": 1024,
    }
