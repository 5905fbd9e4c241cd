"""``workers.finishing`` alone: verdicts on attempts whose supervisor has exited, and
their settles, on a worker that is not started."""

from __future__ import annotations

import signal
from dataclasses import replace

from laneway.controller import db
from laneway.controller.models import Attempt
from laneway.controller.states import AttemptState, Outcome
from laneway.workers.flight import AdoptedSupervisor, InFlight
from laneway.workers.oom import OomCounter
from tests.integration.worker_parts import claimed, host
from tests.support import make_config, statements

GONE = (999_999, 1)  # a supervisor that has exited: poll() says so, exit.json is the record


def flights(claims, **kwargs):
    return [(c.attempt_id, InFlight(c, AdoptedSupervisor(*GONE), {}, **kwargs)) for c in claims]


def test_a_stale_settle_undoes_none_of_the_others_and_failures_are_kept_for_capture(
    engine, factory, make_run, register_worker, clock
):
    """Three settles in one transaction, one of them a zombie's (its fence is stale): the
    zombie writes nothing, the others stand, and no savepoint is spent on any of them."""
    make_run(make_config(items=4))
    worker = register_worker()
    service = host(engine, worker, clock)
    exits = [{"exit_code": 0}, {"exit_code": 1}, {"exit_code": 0}, {"exit_code": 0}]
    ok, failed, stale, unknown = claimed(
        factory, worker, clock, slots=4, supervisor=GONE, exits=exits
    )
    finished = flights([ok, failed, replace(stale, fence=stale.fence + 7), unknown])
    finished[3][1].marked_unknown = True  # already unknown: only forgotten
    judged = service.finishing.judge_all(finished)
    assert [attempt_id for attempt_id, _, _ in judged] == [
        c.attempt_id for c in (ok, failed, stale)
    ]
    with statements(engine) as counted, db.transaction(factory) as session:
        outcomes, failures = service.finishing.settle(session, clock.now(), judged)
    assert outcomes == ["succeeded", "failed", "stale"]
    assert not [sql for sql in counted if "SAVEPOINT" in sql.upper()]
    assert failures == [finished[1][1]]
    with factory() as session:
        rows = {c.attempt_id: session.get(Attempt, c.attempt_id) for c in (ok, failed, stale)}
    assert rows[ok.attempt_id].outcome == Outcome.SUCCEEDED
    assert rows[failed.attempt_id].outcome == Outcome.FAILED
    assert rows[stale.attempt_id].state == AttemptState.RUNNING  # the zombie wrote nothing


def test_a_sigkill_the_cgroup_counted_is_named_an_oom_kill(
    engine, factory, make_run, register_worker, clock, tmp_path
):
    make_run(make_config(items=2))
    worker = register_worker()
    events = tmp_path / "memory.events"
    events.write_text("oom 1\noom_kill 1\n")
    service = host(engine, worker, clock, oom_counter=OomCounter(events))
    killed = {"exit_code": None, "signal": int(signal.SIGKILL)}
    counted, uncounted = claimed(factory, worker, clock, slots=2, exits=[killed, killed])
    ((_, named),) = flights([counted], oom_kills_at_start=0)
    ((_, plain),) = flights([uncounted], oom_kills_at_start=1)
    verdict = service.finishing.judge(named).verdict
    assert verdict.outcome == Outcome.FAILED
    assert verdict.reason.endswith(
        "from the OOM killer: out of memory (its memory cgroup counted the kill)"
    )
    assert "OOM" not in service.finishing.judge(plain).verdict.reason
