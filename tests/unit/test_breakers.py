"""The infrastructure breaker, checked exactly against an independent oracle over random
outcome sequences (hypothesis), plus the ledger applying it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from laneway.controller import breakers
from laneway.controller.models import Control
from laneway.controller.states import Outcome
from tests.support import claim_on_n1, make_config, py_stage, settle_one

OUTCOMES = [
    Outcome.SUCCEEDED,
    Outcome.FAILED,
    Outcome.INFRA_FAILURE,
    Outcome.TIMED_OUT,
    Outcome.HARNESS_FAILURE,
]
events = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.sampled_from(OUTCOMES)),
    max_size=40,
)


def oracle(history, n):
    """Forward: a success empties the streak; each infra failure adds its item; the
    breaker trips on an infra failure once the streak holds n distinct items."""
    streak: set[str] = set()
    trips = []
    for item, outcome in history:
        if outcome is Outcome.SUCCEEDED:
            streak = set()
        if outcome is Outcome.INFRA_FAILURE:
            streak.add(item)
        trips.append(outcome is Outcome.INFRA_FAILURE and len(streak) >= n)
    return trips


@settings(max_examples=400, deadline=None)
@given(events, st.integers(min_value=1, max_value=4))
def test_breaker_matches_the_rule_exactly(history, n):
    expected = oracle(history, n)
    actual = [breakers.infra_breaker_trips(history[: i + 1], n) for i in range(len(history))]
    assert actual == expected


@settings(max_examples=200, deadline=None)
@given(events)
def test_ordinary_failures_never_trip(history):
    only_failed = [(item, Outcome.FAILED) for item, _ in history]
    assert not any(
        breakers.infra_breaker_trips(only_failed[: i + 1], 1) for i in range(len(only_failed))
    )


def test_same_item_twice_counts_once():
    history = [
        ("a", Outcome.INFRA_FAILURE),
        ("a", Outcome.INFRA_FAILURE),
        ("b", Outcome.INFRA_FAILURE),
    ]
    assert not breakers.infra_breaker_trips(history, 3)
    assert breakers.infra_breaker_trips([*history, ("c", Outcome.INFRA_FAILURE)], 3)


def test_ledger_pauses_the_run_on_the_third_distinct_item(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config([py_stage("s", "pass")], items=4, max_jobs=4))
    worker = register_worker()
    claims = claim_on_n1(factory, worker, clock, slots=4)
    for number, claim in enumerate(claims[:3], start=1):
        settle_one(factory, claim, worker, clock, Outcome.INFRA_FAILURE)
        with factory() as session:
            controls = session.scalars(select(Control).where(Control.run_id == run_id)).all()
        assert len(controls) == (1 if number == 3 else 0)
    assert controls[0].kind == "pause"
    assert "3 distinct items in a row" in controls[0].reason
