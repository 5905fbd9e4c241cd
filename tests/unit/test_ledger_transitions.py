"""Every legal and illegal state transition of jobs and attempts, through the ledger."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.exc import IntegrityError, StatementError

from laneway.controller import db, ledger
from laneway.controller.errors import IllegalTransition, PartialWrite, StaleLease
from laneway.controller.models import Attempt, Decision, Event, Job, Lease, Reservation
from laneway.controller.states import AttemptState, JobState, Outcome
from tests.conftest import force_job_state
from tests.support import (
    FixedClock,
    claim_on_n1,
    claim_one_on_n1,
    make_config,
    mark_unknown_one,
    py_stage,
    settle_one,
)

ALL_JOB_PAIRS = list(itertools.product(JobState, JobState))

# Written out by hand (not read from ledger.JOB_TRANSITIONS) so that an edge added to the
# table by mistake fails here.
EXPECTED_JOB_EDGES = {
    ("waiting", "ready"),
    ("waiting", "skipped"),
    ("waiting", "cancelled"),
    ("ready", "running"),
    ("ready", "cancelled"),
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "cancelled"),
    ("running", "ready"),
    ("running", "unknown"),
    ("unknown", "succeeded"),
    ("unknown", "failed"),
    ("unknown", "ready"),
    ("unknown", "cancelled"),
    ("failed", "ready"),
    ("failed", "waiting"),
    ("succeeded", "ready"),
    ("succeeded", "waiting"),
    ("skipped", "waiting"),
}
EXPECTED_ATTEMPT_EDGES = {
    ("intent", "running"),
    ("intent", "settled"),
    ("intent", "unknown"),
    ("running", "settled"),
    ("running", "unknown"),
    ("unknown", "settled"),
}


def test_transition_tables_are_exactly_the_designed_ones():
    jobs = {(a.value, b.value) for a, targets in ledger.JOB_TRANSITIONS.items() for b in targets}
    attempts = {
        (a.value, b.value) for a, targets in ledger.ATTEMPT_TRANSITIONS.items() for b in targets
    }
    assert jobs == EXPECTED_JOB_EDGES
    assert attempts == EXPECTED_ATTEMPT_EDGES


ALL_ATTEMPT_PAIRS = list(itertools.product(AttemptState, AttemptState))


def _job_id(factory, run_id):
    with factory() as session:
        return session.scalars(select(Job.id).where(Job.run_id == run_id)).first()


@pytest.mark.parametrize(("start", "end"), ALL_JOB_PAIRS, ids=lambda s: s.value)
def test_job_transition_table(factory, make_run, clock, start, end):
    run_id = make_run()
    job_id = _job_id(factory, run_id)
    with db.transaction(factory) as session:
        force_job_state(session, job_id, start.value)
    legal = end in ledger.JOB_TRANSITIONS[start]
    with factory() as session, session.begin():
        if legal:
            ledger.move_job(session, job_id, start, end, now=clock.now(), actor="t")
        else:
            with pytest.raises(IllegalTransition):
                ledger.move_job(session, job_id, start, end, now=clock.now(), actor="t")
    with factory() as session:
        job = session.get(Job, job_id)
        events = session.scalars(select(Event.kind).where(Event.job_id == job_id)).all()
    assert job.state == (end if legal else start).value
    assert (f"job_{end.value}" in events) == legal
    if legal and end.value in ("succeeded", "failed", "skipped", "cancelled"):
        assert job.finished_at is not None


def test_move_job_from_wrong_state_names_the_actual_state(factory, make_run, clock):
    job_id = _job_id(factory, make_run())  # ready
    with factory() as session, session.begin():
        with pytest.raises(IllegalTransition, match="is ready, not waiting"):
            ledger.move_job(
                session, job_id, JobState.WAITING, JobState.READY, now=clock.now(), actor="t"
            )


def _claimed_attempt(factory, make_run, register_worker, clock):
    run_id = make_run()
    worker = register_worker()
    claims = claim_on_n1(factory, worker, clock, mem=10_000)
    assert len(claims) == 1
    return run_id, worker, claims[0]


def _force_attempt_state(factory, attempt_id, state):
    values = {"state": state.value, "outcome": None, "settled_at": None}
    if state is AttemptState.SETTLED:
        values.update(outcome="failed", settled_at=ledger_now())
    if state is AttemptState.RUNNING:
        values["started_at"] = ledger_now()
    with db.transaction(factory) as session:
        session.execute(update(Attempt).where(Attempt.id == attempt_id).values(**values))


def ledger_now():
    return FixedClock().now()


@pytest.mark.parametrize(("start", "end"), ALL_ATTEMPT_PAIRS, ids=lambda s: s.value)
def test_attempt_transition_table(factory, make_run, register_worker, clock, start, end):
    _, worker, claim = _claimed_attempt(factory, make_run, register_worker, clock)
    _force_attempt_state(factory, claim.attempt_id, start)
    legal = end in ledger.ATTEMPT_TRANSITIONS[start]
    values = {}
    if end is AttemptState.SETTLED:
        values = {"outcome": "succeeded", "settled_at": clock.now()}
    if end is AttemptState.RUNNING:
        values = {"started_at": clock.now()}
    with factory() as session, session.begin():
        refused = contextlib.nullcontext() if legal else pytest.raises(IllegalTransition)
        with refused:
            ledger.move_attempt(
                session,
                claim.attempt_id,
                start,
                end,
                now=clock.now(),
                actor=worker,
                fence=claim.fence,
                values=values,
            )
    with factory() as session:
        assert session.get(Attempt, claim.attempt_id).state == (end if legal else start).value


def test_claim_writes_intent_lease_reservation_in_one_go(factory, make_run, register_worker, clock):
    _run_id, _worker, claim = _claimed_attempt(factory, make_run, register_worker, clock)
    with factory() as session:
        attempt = session.get(Attempt, claim.attempt_id)
        job = session.get(Job, claim.job_id)
        kinds = session.scalars(select(Event.kind).order_by(Event.id)).all()
    assert attempt.state == "intent"
    assert attempt.idempotency_key == claim.idempotency_key
    assert attempt.fence == job.fence == claim.fence == 1
    assert job.state == "running" and job.attempt_count == 1
    assert kinds[-2:] == ["job_running", "attempt_intent"]


def test_stale_fence_is_rejected_and_changes_nothing(factory, make_run, register_worker, clock):
    _, worker, claim = _claimed_attempt(factory, make_run, register_worker, clock)
    with db.transaction(factory) as session:  # someone revoked the lease: fence moved on
        session.execute(update(Job).where(Job.id == claim.job_id).values(fence=Job.fence + 1))
    with pytest.raises(StaleLease):
        settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    with factory() as session:
        assert session.get(Attempt, claim.attempt_id).state == "intent"
        assert session.get(Job, claim.job_id).state == "running"


def test_settle_releases_lease_and_reservation_and_promotes(
    factory, make_run, register_worker, clock
):
    config = make_config([py_stage("one", "pass"), py_stage("two", "pass", needs=["one"])])
    run_id = make_run(config)
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=4, mem=10_000)
    with db.transaction(factory) as session:
        state = ledger.settle_attempt(
            session,
            claim.attempt_id,
            fence=claim.fence,
            outcome=Outcome.SUCCEEDED,
            actor=worker,
            now=clock.now(),
            exit_code=0,
        )
    assert state is JobState.SUCCEEDED
    with factory() as session:
        states = dict(
            session.execute(select(Job.stage, Job.state).where(Job.run_id == run_id)).all()
        )
        lease = session.scalars(select(Lease)).one()
        reservation = session.scalars(select(Reservation)).one()
    assert states == {"one": "succeeded", "two": "ready"}
    assert lease.released_at is not None and reservation.released_at is not None


@pytest.mark.parametrize(
    ("outcome", "retry", "expected"),
    [
        (Outcome.FAILED, {}, JobState.FAILED),
        (Outcome.INFRA_FAILURE, {"max_attempts": 2, "on": ["infra_failure"]}, JobState.READY),
        (Outcome.INFRA_FAILURE, {"max_attempts": 1, "on": ["infra_failure"]}, JobState.FAILED),
        (Outcome.HARNESS_FAILURE, {"max_attempts": 3, "on": ["failed"]}, JobState.FAILED),
        (Outcome.CANCELLED, {"max_attempts": 3, "on": ["failed"]}, JobState.CANCELLED),
        (Outcome.FATAL, {"max_attempts": 3, "on": ["failed", "infra_failure"]}, JobState.FAILED),
    ],
)
def test_retry_only_by_policy(factory, make_run, register_worker, clock, outcome, retry, expected):
    make_run(make_config([py_stage("s", "pass", retry=retry)]))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, mem=10_000)
    state = settle_one(factory, claim, worker, clock, outcome)
    assert state is expected
    if expected is JobState.READY:  # a retry is a new attempt with a new key
        (again,) = claim_on_n1(factory, worker, clock, mem=10_000)
        assert again.number == 2 and again.idempotency_key != claim.idempotency_key
        assert again.fence == claim.fence + 1


def test_needed_stage_failure_skips_downstream_with_reason(
    factory, make_run, register_worker, clock
):
    config = make_config([py_stage("one", "pass"), py_stage("two", "pass", needs=["one"])])
    make_run(config)
    worker = register_worker()
    claim_one_on_n1(factory, worker, clock, slots=4, mem=10_000, settle=Outcome.INFRA_FAILURE)
    with factory() as session:
        two = session.scalars(select(Job).where(Job.stage == "two")).one()
    assert two.state == "skipped"
    assert two.state_reason == "needed stage did not succeed: one failed"


def test_mark_unknown_revokes_fence_and_keeps_reservation(
    factory, make_run, register_worker, clock
):
    _, worker, claim = _claimed_attempt(factory, make_run, register_worker, clock)
    mark_unknown_one(factory, claim, clock, "no exit record", actor="t", fence=claim.fence)
    with factory() as session:
        job = session.get(Job, claim.job_id)
        assert job.state == "unknown" and job.fence == claim.fence + 1
        assert session.scalars(select(Reservation)).one().released_at is None
    with pytest.raises(StaleLease):  # the old holder can no longer settle it
        settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)


def test_unknown_attempt_halts_dispatch_for_the_run(factory, make_run, register_worker, clock):
    run_id = make_run(make_config(items=2))
    worker = register_worker()
    claim_one_on_n1(factory, worker, clock, mem=10_000, unknown="lost")
    claims = claim_on_n1(factory, worker, clock, slots=4, mem=10_000)
    assert claims == []
    with factory() as session:
        codes = session.scalars(select(Decision.reason_code).where(Decision.run_id == run_id)).all()
    assert "unknown_outcome" in codes


@pytest.mark.parametrize(
    ("column", "value"),
    [("state", "bogus"), ("finished_at", None)],
)
def test_check_constraints_refuse_impossible_rows(factory, make_run, column, value):
    job_id = _job_id(factory, make_run())
    with db.transaction(factory) as session:
        force_job_state(session, job_id, "succeeded")
    # Raw SQL: the model's enum type would refuse "bogus" before the database sees it;
    # this proves the CHECK constraint itself (a hand-written UPDATE meets only that).
    with pytest.raises(IntegrityError), db.transaction(factory) as session:
        session.execute(
            text(f"UPDATE jobs SET {column} = :value WHERE id = :id"),
            {"value": value, "id": job_id},
        )


def test_state_columns_refuse_values_outside_their_enum(factory, make_run):
    job_id = _job_id(factory, make_run())
    with pytest.raises(StatementError, match="not a valid JobState"):
        with db.transaction(factory) as session:
            session.execute(update(Job).where(Job.id == job_id).values(state="bogus"))


def test_events_are_append_only_in_increasing_order(factory, make_run, register_worker, clock):
    _claimed_attempt(factory, make_run, register_worker, clock)
    with factory() as session:
        ids = session.scalars(select(Event.id).order_by(Event.at, Event.id)).all()
    assert ids == sorted(ids) and len(set(ids)) == len(ids) >= 3


def _note(session, kind, clock, run_id):
    """Append one event of ``kind`` to the run, by actor "t"."""
    ledger.append_event(session, kind, actor="t", now=clock.now(), run_id=run_id)


def _newest_event(factory):
    with factory() as session:
        return ledger.latest_event_id(session)


def _statements_into_events(engine):
    """A listener that counts the INSERTs into ``events`` sent to the ledger."""
    from sqlalchemy import event

    sent = []

    def count(_conn, _cursor, sql, *_):
        if sql.lstrip().upper().startswith("INSERT INTO EVENTS"):
            sent.append(sql)

    event.listen(engine, "before_cursor_execute", count)
    return sent, lambda: event.remove(engine, "before_cursor_execute", count)


def test_a_transactions_events_are_written_at_its_end_in_one_statement_in_order(
    engine, factory, make_run, clock
):
    run_id = make_run()
    job_id = _job_id(factory, run_id)
    before = _newest_event(factory)
    sent, stop = _statements_into_events(engine)
    try:
        with db.transaction(factory) as session:
            _note(session, "sources_changed", clock, run_id)
            ledger.move_job(
                session, job_id, JobState.READY, JobState.CANCELLED, now=clock.now(), actor="t"
            )
            _note(session, "snapshot_failed", clock, run_id)
            assert sent == []  # nothing written yet
    finally:
        stop()
    assert len(sent) == 1
    with factory() as session:
        kinds = session.scalars(select(Event.kind).where(Event.id > before).order_by(Event.id))
        assert list(kinds) == ["sources_changed", "job_cancelled", "snapshot_failed"]


def test_reading_the_event_log_inside_a_write_counts_its_own_events(factory, make_run, clock):
    run_id = make_run()
    before = _newest_event(factory)
    with db.transaction(factory) as session:
        _note(session, "sources_changed", clock, run_id)
        assert ledger.latest_event_id(session) == before + 1
        _note(session, "snapshot_failed", clock, run_id)
        assert ledger.changes_after(session, before).cursor == before + 2
    with factory() as session:
        assert ledger.latest_event_id(session) == before + 2


def test_a_refusal_before_writing_leaves_the_transaction_and_a_failed_one_takes_its_events(
    factory, make_run, clock
):
    run_id = make_run()
    before = _newest_event(factory)
    with db.transaction(factory) as session:
        _note(session, "sources_changed", clock, run_id)
        with contextlib.suppress(StaleLease), ledger.refused_before_writing(session):
            raise StaleLease("revoked while we were away")  # refused before writing
        _note(session, "run_reopened", clock, run_id)
    with contextlib.suppress(RuntimeError), db.transaction(factory) as session:
        _note(session, "snapshot_failed", clock, run_id)
        raise RuntimeError("the transaction fails")
    with db.transaction(factory) as session:
        pass  # a transaction after the failed one carries nothing of it
    with factory() as session:
        kinds = session.scalars(select(Event.kind).where(Event.id > before).order_by(Event.id))
        assert list(kinds) == ["sources_changed", "run_reopened"]


def test_a_refusal_after_writing_is_not_caught_as_stale_and_rolls_everything_back(
    factory, make_run, clock
):
    """Catching StaleLease without a savepoint is safe only while nothing was written:
    one raised after a write (an event appended) propagates as PartialWrite, which no
    caller catches as stale, and the whole transaction rolls back."""
    run_id = make_run()
    before = _newest_event(factory)
    with pytest.raises(PartialWrite), db.transaction(factory) as session:
        _note(session, "sources_changed", clock, run_id)
        with contextlib.suppress(StaleLease), ledger.refused_before_writing(session):
            _note(session, "snapshot_failed", clock, run_id)
            raise StaleLease("refused after a write")
    with factory() as session:
        assert _newest_event(factory) == before
        assert list(session.scalars(select(Event.kind).where(Event.id > before))) == []


def test_statements_built_per_claim_are_built_once_per_shape():
    """A claim that asks for the same lanes again gets the same statement object (it is
    not rebuilt, nor keyed again for SQLAlchemy's compiled cache); other lanes or sizes
    get their own, and the keys are data, whatever sequence they come in."""
    from laneway.controller.ledger import statements

    lanes = [(1, "a", "s", None), (1, "b", "s", None)]
    first = statements.ready_candidates(lanes, 3)
    assert statements.ready_candidates(tuple(lanes), 3) is first
    assert statements.ready_candidates(lanes, 4) is not first
    assert statements.ready_candidates(lanes[:1], 3) is not first
    keys = [(1, "a", "s")]
    assert statements.last_decisions(keys) is statements.last_decisions(list(keys))
    assert statements.waiting_lanes([(1, "a")]) is statements.waiting_lanes([(1, "a")])
    assert statements.waiting_lanes([(1, "a")]) is not statements.waiting_lanes([(2, "a")])
