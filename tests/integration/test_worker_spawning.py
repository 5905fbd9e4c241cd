"""``workers.spawning`` alone: claimed attempts started (or settled without a spawn) on
a worker that is not started, its supervisors started by exec."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from laneway.controller import db
from laneway.controller.models import Attempt
from laneway.controller.states import AttemptState, Outcome
from tests.integration.worker_parts import host
from tests.support import claim_on_n1, make_config


def test_a_started_supervisor_has_its_identity_recorded_and_its_receipt_written(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config())
    worker = register_worker()
    service = host(engine, worker, clock)
    (claim,) = claim_on_n1(factory, worker, clock)
    with db.transaction(factory) as session:
        service.stages.remember(session, claim)
    service.spawning.spawn_all([claim])
    flight = service.in_flight[claim.attempt_id]
    deadline = time.monotonic() + 30
    while flight.awaiting_report and time.monotonic() < deadline:
        service.spawning.record_reports()  # never blocks on a slow supervisor
        time.sleep(0.01)
    assert not flight.awaiting_report
    receipt = json.loads((Path(claim.attempt_dir) / "receipt.json").read_text())
    assert receipt["worker_id"] == worker and receipt["fence"] == claim.fence
    assert receipt["supervisor_pid"] == flight.supervisor.pid
    with factory() as session:
        row = session.get(Attempt, claim.attempt_id)
        assert row.state == AttemptState.RUNNING and row.supervisor_pid == flight.supervisor.pid
    service.drain()
    with factory() as session:
        assert session.get(Attempt, claim.attempt_id).outcome == Outcome.SUCCEEDED


def test_an_attempt_that_cannot_start_is_settled_without_a_spawn(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config(items=2))
    worker = register_worker()
    service = host(engine, worker, clock)
    unrendered, no_inputs = claim_on_n1(factory, worker, clock, slots=2)
    assert service.spawning.give_inputs(replace(no_inputs, input_problems=["a", "b"])) == "a; b"
    service.spawning.spawn_all([replace(unrendered, render_error="no such placeholder")])
    assert service.in_flight == {}
    with factory() as session:
        row = session.get(Attempt, unrendered.attempt_id)
        assert row.outcome == Outcome.HARNESS_FAILURE
        assert row.state_reason == "not started: no such placeholder"
