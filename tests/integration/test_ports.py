"""Port sets: each attempt gets N free, distinct ports, disjoint from every in-flight
attempt on the node, in its environment and recorded on the attempt."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import event, select

from laneway.controller import db
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt
from laneway.workers.gpu import FakeGpu
from laneway.workers.ports import free_ports
from laneway.workers.service import WorkerService
from tests.integration.test_worker import drive
from tests.support import claim_on_n1, make_config, py_stage, wait_until


def test_free_ports_are_distinct_and_avoid_taken():
    taken = set(free_ports(5, set()))
    picked = free_ports(20, taken)
    assert len(set(picked)) == 20 and not set(picked) & taken


def test_concurrent_attempts_get_disjoint_port_sets(engine, make_run, tmp_path):
    release = tmp_path / "release"
    code = (
        "import json, os, time\n"
        "json.dump({'job_id': os.environ['LANEWAY_JOB_ID'], "
        "'ports': os.environ['LANEWAY_PORTS']}, open(os.environ['LANEWAY_RESULT_PATH'], 'w'))\n"
        f"while not os.path.exists({str(release)!r}): time.sleep(0.01)"
    )
    run_id = make_run(make_config([py_stage("serve", code, ports=3)], items=4, max_jobs=4))
    service = WorkerService(
        engine, node="n1", slots=4, memory_probe=lambda: (64e3, 128e3), gpu=FakeGpu()
    )
    service.start()
    controller = Controller(engine)

    def attempts():
        with db.session_factory(engine)() as session:
            return session.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()

    def all_running():
        controller.tick()
        service.tick()
        rows = attempts()
        return len(rows) == 4 and all(a.state == "running" for a in rows)

    wait_until(all_running)  # all four hold their ports at once
    release.touch()

    drive(engine, [service], run_id, controller=controller)
    rows = attempts()
    every = [port for a in rows for port in a.ports]
    assert all(len(a.ports) == 3 for a in rows)
    assert len(set(every)) == 12  # disjoint across the concurrent attempts
    for attempt in rows:
        seen = json.loads((Path(attempt.attempt_dir) / "result.json").read_text())["ports"]
        assert [int(p) for p in seen.split(",")] == attempt.ports


def test_a_claim_reads_the_ports_in_use_only_for_a_job_that_asks_for_ports(
    engine, factory, make_run, register_worker, clock
):
    """The node's ports in use are one read of its in-flight attempts: a claim makes it
    only when a job it starts has ``ports``, and then avoids them."""
    make_run(make_config([py_stage("plain", "pass"), py_stage("serve", "pass", ports=2)]))
    worker = register_worker()
    given: list[set[int]] = []

    def pick(n: int, taken: set[int]) -> list[int]:
        given.append(set(taken))
        return free_ports(n, taken)

    sent: list[str] = []

    def note(conn, cursor, statement, parameters, context, executemany) -> None:
        sent.append(" ".join(statement.split()))

    event.listen(engine, "before_cursor_execute", note)
    try:
        claimed = []
        for _ in range(2):  # one job of each stage
            sent.clear()
            (claim,) = claim_on_n1(factory, worker, clock, pick_ports=pick)
            reads = [s for s in sent if s.startswith("SELECT attempts.ports")]
            claimed.append((claim.stage, len(reads)))
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert sorted(claimed) == [("plain", 0), ("serve", 1)]
    assert given == [set()]  # nothing else on the node holds ports
