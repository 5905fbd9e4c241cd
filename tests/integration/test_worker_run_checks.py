"""A worker's checks of the runs it starts jobs of (``workers.run_checks``), end to end
through ``WorkerService.tick``: invariant 12 (a run whose frozen sources changed
dispatches nothing, and is halted naming the file and both hashes), for a run the
worker's last claim saw (checked before the claim's transaction) and for one it meets
for the first time (checked inside it); and the runs are read once per claim, by the
claim itself."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from laneway.controller import db, pipeline
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Control
from laneway.workers.service import WorkerService
from tests.support import make_config, py_stage, statements, wait_until

PLENTY = (64_000.0, 128_000.0)


def _run_with_source(make_run, source: Path, *, items: int) -> int:
    config = make_config([py_stage("s", "pass")], items=items, max_jobs=1)
    return make_run(config, source_hashes={str(source): pipeline.hash_file(source)})


def _worker(engine) -> WorkerService:
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: PLENTY)
    service.start()
    return service


def _attempts(factory, run_id: int) -> list[Attempt]:
    with factory() as session:
        return list(session.scalars(select(Attempt).where(Attempt.run_id == run_id)))


def _halt(factory, run_id: int) -> Control:
    with factory() as session:
        return session.scalars(select(Control).where(Control.run_id == run_id)).one()


def test_a_source_edited_after_the_workers_first_claim_halts_the_run(
    engine, factory, make_run, tmp_path
):
    source = tmp_path / "experiment.py"
    source.write_text("VERSION = 1\n")
    run_id = _run_with_source(make_run, source, items=3)
    service = _worker(engine)
    controller = Controller(engine)
    assert service.tick().claimed == 1  # unchanged: the first job goes
    source.write_text("VERSION = 2  # edited under a running experiment\n")

    def first_settled() -> bool:
        controller.tick()
        service.tick()
        return any(a.state == "settled" for a in _attempts(factory, run_id))

    wait_until(first_settled)
    for _ in range(5):  # the slot is free again: nothing more of this run starts
        controller.tick()
        service.tick()
    assert len(_attempts(factory, run_id)) == 1
    halt = _halt(factory, run_id)
    assert halt.kind == "halt" and str(source) in halt.reason and "!= frozen" in halt.reason
    service.drain()


def test_a_run_the_worker_meets_first_with_edited_sources_starts_nothing(
    engine, factory, tmp_path, make_run
):
    """The worker's last claim saw another run only, so nothing checked this one before
    the claim's transaction: the claim checks it itself, and halts it."""
    other = make_run(make_config([py_stage("s", "pass")], items=1, max_jobs=1))
    service = _worker(engine)
    assert service.tick().claimed == 1  # a claim that saw the other run only
    source = tmp_path / "experiment.py"
    source.write_text("VERSION = 1\n")
    run_id = _run_with_source(make_run, source, items=2)
    source.write_text("VERSION = 2\n")
    controller = Controller(engine)

    def other_settled() -> bool:
        controller.tick()
        service.tick()
        return all(a.state == "settled" for a in _attempts(factory, other))

    wait_until(other_settled)
    for _ in range(3):
        service.tick()
    assert _attempts(factory, run_id) == []
    halt = _halt(factory, run_id)
    assert halt.kind == "halt" and str(source) in halt.reason and "!= frozen" in halt.reason
    service.drain()


def test_a_claim_reads_the_active_runs_once_in_its_own_snapshot(engine, make_run):
    """Nothing before the claim's transaction reads the runs again: the checks use the
    runs the previous claim saw."""
    run_id = make_run(make_config([py_stage("s", "pass")], items=3, max_jobs=1))
    service = _worker(engine)
    controller = Controller(engine)
    claims = []

    def tick() -> bool:
        controller.tick()
        with statements(engine) as counted:
            claimed = service.tick().claimed
        reads = sum(n for sql, n in counted.items() if sql.startswith("SELECT runs.id AS run_id"))
        assert reads <= 1, counted
        if claimed:
            claims.append(reads)
        return len(_attempts(db.session_factory(engine), run_id)) == 3 and not service.in_flight

    wait_until(tick)
    assert claims == [1, 1, 1]
    service.drain()
