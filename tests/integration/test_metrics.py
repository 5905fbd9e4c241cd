"""Prometheus metrics from the ledger: scraped, parsed as the exposition format, and
checked against the state that was arranged (jobs, outcomes, unknown attempts, lease
expiries, idle lanes with their reason, node memory, measured peaks)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from laneway.controller import db, ledger, metrics, readonly
from laneway.controller.states import Outcome
from tests.support import claim_on_n1, heartbeat, make_config, py_stage, settle_one


def scrape(runtime: Path, now) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, by (name, sorted labels)."""
    with readonly.ReadOnlyLedger(runtime) as source:
        text = metrics.exposition(source.snapshot, lambda: now).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, metric: str, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def test_a_scrape_reports_the_ledger(runtime, factory, make_run, register_worker, clock):
    config = make_config(
        [py_stage("only", "pass", memory_mib=16)],
        items=3,
        nodes=[{"name": "n1", "memory_floor_mib": 512, "max_jobs": 4}],
    )
    make_run(config)
    worker = register_worker()
    first, second = claim_on_n1(factory, worker, clock, slots=2)
    settle_one(
        factory,
        first,
        worker,
        clock,
        Outcome.SUCCEEDED,
        measured={"peak_rss_mib": 42.5, "sampled_at": clock.now()},
    )
    clock.advance(600)  # the worker stopped renewing: its lease on `second` expired
    with db.transaction(factory) as session:
        assert ledger.expire_leases(session, now=clock.now(), actor="controller") == [
            second.attempt_id
        ]
    samples = scrape(runtime, clock.now())
    run = {"run": "1"}
    assert value(samples, "laneway_run_info", name="t", state="active", **run) == 1
    assert value(samples, "laneway_jobs", stage="only", state="succeeded", **run) == 1
    assert value(samples, "laneway_jobs", stage="only", state="unknown", **run) == 1
    assert value(samples, "laneway_jobs", stage="only", state="ready", **run) == 1
    assert (
        value(samples, "laneway_attempts_settled_total", stage="only", outcome="succeeded", **run)
        == 1
    )
    assert value(samples, "laneway_unknown_attempts", **run) == 1
    assert value(samples, "laneway_lease_expiries_total", **run) == 1
    assert value(samples, "laneway_leases_expired") == 0  # the controller acted on it
    # The lane has a ready job and runs nothing; its node's only worker went quiet, but
    # what holds it is the unknown attempt: nothing is dispatched until it is reconciled.
    idle = value(
        samples, "laneway_lane_idle_seconds", lane="a", node="n1", reason="unknown_outcome", **run
    )
    assert idle >= 600
    assert value(samples, "laneway_lane_pending_jobs", lane="a", **run) == 1
    assert value(samples, "laneway_node_memory_floor_mib", node="n1") == 512
    assert value(samples, "laneway_node_live_workers", node="n1") == 0
    assert value(samples, "laneway_stage_peak_rss_mib", stage="only", **run) == 42.5
    assert value(samples, "laneway_stage_measured_attempts", stage="only", **run) == 1


def test_an_unhandled_expired_lease_and_refusals_are_counted(
    runtime, factory, make_run, register_worker, clock
):
    make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    claim_on_n1(factory, worker, clock, slots=1)
    # The second job finds the node full: a refusal is recorded with its reason.
    assert claim_on_n1(factory, worker, clock, slots=0) == []
    clock.advance(600)
    samples = scrape(runtime, clock.now())
    assert value(samples, "laneway_leases_expired") == 1
    refusals = {
        labels: count
        for (name, labels), count in samples.items()
        if name == "laneway_refusals_total"
    }
    # One refusal, labelled with the reason the claim recorded: the node ran its max_jobs.
    assert refusals == {(("reason", "max_jobs"), ("run", "1")): 1}
    assert (
        value(samples, "laneway_lane_idle_seconds", run="1", lane="a", node="n1", reason="busy")
        == 0
    )


def node_series(samples, node: str) -> dict[str, float]:
    """The node's samples by metric name (only those labelled with ``node`` alone)."""
    return {name: count for (name, labels), count in samples.items() if labels == (("node", node),)}


def test_node_memory_is_the_last_heartbeats_sample_under_its_node(
    runtime, factory, make_run, register_worker, clock
):
    config = make_config(
        items=[{"key": "x", "lane": "a"}, {"key": "y", "lane": "b"}],
        nodes=[
            {"name": "n1", "memory_floor_mib": 512, "max_jobs": 4},
            {"name": "n2", "memory_floor_mib": 256, "max_jobs": 4},
        ],
        lanes=[{"name": "a", "node": "n1"}, {"name": "b", "node": "n2"}],
    )
    make_run(config)
    worker = register_worker("n1")

    # No sample yet: the floors only; no free memory is made up.
    before = scrape(runtime, clock.now())
    assert node_series(before, "n1") == {
        "laneway_node_memory_floor_mib": 512,
        "laneway_node_live_workers": 1,
    }
    heartbeat(factory, worker, clock, 1234.5)
    clock.advance(5)
    samples = scrape(runtime, clock.now())
    assert node_series(samples, "n1") == {
        "laneway_node_free_memory_mib": 1234.5,
        "laneway_node_memory_floor_mib": 512,
        "laneway_node_memory_total_mib": 64_000,
        "laneway_node_sample_age_seconds": 5,
        "laneway_node_live_workers": 1,
    }
    # n2's worker never reported: its floor, no sample, no live worker.
    assert node_series(samples, "n2") == {
        "laneway_node_memory_floor_mib": 256,
        "laneway_node_live_workers": 0,
    }
    # The next heartbeat's sample replaces it at the next scrape.
    heartbeat(factory, worker, clock, 900.0)
    assert value(scrape(runtime, clock.now()), "laneway_node_free_memory_mib", node="n1") == 900
