"""Node low-water marks: heartbeats keep each node's lowest free memory per active run,
and ``laneway report`` shows it beside the node's floor with what was running then."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, text

from laneway.cli import render
from laneway.controller import db, ledger
from laneway.controller.models import Node, NodeLowWater
from laneway.controller.outcome import Outcome
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html
from laneway.workers.service import WorkerService
from tests.support import (
    claim_on_n1,
    heartbeat,
    make_config,
    py_stage,
    settle_one,
    wait_until,
)


def beat(factory, worker, clock, free, *, runs, low=None, low_at=None):
    """A heartbeat of a worker with attempts running for ``runs``."""
    heartbeat(factory, worker, clock, free, mem_low_mib=low, mem_low_at=low_at, running_runs=runs)


def marks(factory, run_id):
    with factory() as session:
        return {
            row.node: (row.memory_floor_mib, row.low_free_mib, row.low_at)
            for row in session.scalars(select(NodeLowWater).where(NodeLowWater.run_id == run_id))
        }


def two_node_config(**extra):
    return make_config(
        extra.pop("stages", None),
        items=[{"key": "i0", "lane": "a"}],
        lanes=[{"name": "a", "node": "n1"}],
        nodes=[
            {"name": "n1", "memory_floor_mib": 1024, "max_jobs": 2},
            {"name": "n2", "memory_floor_mib": 512, "max_jobs": 2},
            {"name": "n3", "memory_floor_mib": 0, "max_jobs": 2},
        ],
        **extra,
    )


def test_a_heartbeat_lowers_only_its_nodes_mark_and_only_when_lower(
    factory, make_run, register_worker, clock
):
    # n2 serves no lane but runs stage "only" by its nodes; n3 serves nothing: no row.
    run_id = make_run(two_node_config(stages=[py_stage("only", "pass", nodes=["n1", "n2"])]))
    assert marks(factory, run_id) == {"n1": (1024, None, None), "n2": (512, None, None)}
    w1, w2 = register_worker("n1"), register_worker("n2")

    beat(factory, w1, clock, 1000, runs=())  # nothing running for the run: no mark
    assert marks(factory, run_id)["n1"] == (1024, None, None)
    beat(factory, w1, clock, 5000, runs=(run_id,))
    first = clock.now()
    clock.advance(2)
    beat(factory, w1, clock, 6000, runs=(run_id,))  # higher: nothing changes
    assert marks(factory, run_id)["n1"] == (1024, 5000, first)
    assert marks(factory, run_id)["n2"] == (512, None, None)  # another node's

    # The worker's lowest probe since its last heartbeat, with the moment it was taken.
    clock.advance(2)
    dipped = clock.now() - timedelta(seconds=1)
    beat(factory, w1, clock, 4800, low=2947, low_at=dipped, runs=(run_id,))
    beat(factory, w2, clock, 9000, runs=(run_id,))
    assert marks(factory, run_id) == {"n1": (1024, 2947, dipped), "n2": (512, 9000, clock.now())}


def test_only_the_runs_with_work_running_on_the_node_move(
    factory, make_run, register_worker, clock
):
    """A run keeps its mark once nothing of it runs on the node (here: it finished)."""
    first_run = make_run(two_node_config())
    worker = register_worker("n1")
    beat(factory, worker, clock, 3000, runs=(first_run,))
    (claim,) = claim_on_n1(factory, worker, clock, slots=1)
    clock.advance(5)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    with db.transaction(factory) as session:
        assert ledger.close_run_if_done(session, first_run, now=clock.now(), actor="test")
    with factory() as session:
        assert ledger.get_run(session, first_run).state == "finished"

    second_run = make_run(two_node_config())
    clock.advance(5)
    beat(factory, worker, clock, 2000, runs=(second_run,))  # lower, for the second only
    assert marks(factory, first_run)["n1"][1] == 3000
    assert marks(factory, second_run)["n1"][1] == 2000


def test_the_report_shows_each_nodes_low_water_beside_its_floor(
    factory, make_run, register_worker, clock
):
    run_id = make_run(two_node_config())
    worker = register_worker("n1")
    beat(factory, worker, clock, 8000, runs=(run_id,))
    (claim,) = claim_on_n1(factory, worker, clock, slots=1)
    clock.advance(3)
    beat(factory, worker, clock, 2947, runs=(run_id,))  # while item i0's stage "only" runs
    clock.advance(3)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    clock.advance(3)
    beat(factory, worker, clock, 9000, runs=(run_id,))

    with db.session_factory(factory.kw["bind"])() as session:
        report = build_report(session, ledger.get_run(session, run_id), now=clock.now())
    n1 = report["node_memory"]["n1"]
    assert n1["low_free_mib"] == 2947 and n1["memory_floor_mib"] == 1024
    assert n1["margin_mib"] == 2947 - 1024
    assert n1["running"] == {"only": 1}
    assert set(report["node_memory"]) == {"n1"}

    report["html"] = "report.html"
    line = next(x for x in render.report_text(report).splitlines() if x.startswith("node n1"))
    assert line.startswith("node n1: lowest free memory 2,947 MiB, floor 1,024 MiB")
    assert "(margin 1,923 MiB)" in line and line.endswith("while only 1 ran")
    page = render_html(report)
    assert '<table class="low-water">' in page and "<td>2,947 MiB</td>" in page

    with factory() as session:
        view = session.execute(
            text("SELECT margin_mib FROM v_node_low_water WHERE run_id = :r AND node = 'n1'"),
            {"r": run_id},
        ).scalar_one()
    assert view == 2947 - 1024


def test_a_worker_reports_its_lowest_probe_since_its_last_heartbeat(engine, make_run, factory):
    """The free memory a worker measures before a claim, between two heartbeats, is the
    one the next heartbeat brings when it is the lowest: a dip is not lost for falling
    between heartbeats."""
    run_id = make_run(two_node_config())
    probes = iter([8000.0, 2500.0, 7000.0])
    last = [7000.0]

    def probe() -> tuple[float, float]:
        last[0] = next(probes, last[0])
        return last[0], 64_000.0

    service = WorkerService(engine, node="n1", slots=1, memory_probe=probe, heartbeat_seconds=0)
    service.start()
    try:
        service.tick()  # heartbeat (8000, nothing running yet), the claim's probe (2500)
        assert marks(factory, run_id)["n1"][1] is None
        service.tick()  # heartbeat (7000) brings the 2500 measured before the claim
        with factory() as session:
            node = session.get(Node, "n1")
            assert node is not None and node.mem_available_mib == 7000
        assert marks(factory, run_id)["n1"][1] == 2500
    finally:
        wait_until(lambda: service.tick().in_flight == 0)
        service.stop()
