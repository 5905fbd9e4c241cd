"""Prometheus metrics from the ledger: scraped, parsed as the exposition format, and
checked against the state that was arranged (jobs, outcomes, unknown attempts, lease
expiries, idle lanes with their reason, node memory, measured peaks)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from controller import db, ledger, metrics
from controller.states import Outcome
from tests.support import claim_on_n1, make_config, py_stage, settle_one


def scrape(runtime: Path, now) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, by (name, sorted labels)."""
    with db.ReadOnlyLedger(runtime) as source:
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
    # The lane has a ready job, runs nothing, and its node's only worker went quiet.
    idle = value(
        samples, "laneway_lane_idle_seconds", lane="a", node="n1", reason="no_worker", **run
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
    assert refusals and sum(refusals.values()) >= 1
    assert (
        value(samples, "laneway_lane_idle_seconds", run="1", lane="a", node="n1", reason="busy")
        == 0
    )
