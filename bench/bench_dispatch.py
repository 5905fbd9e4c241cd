"""Dispatch throughput against the ledger's durable commit rate, side by side.

    .venv/bin/python bench/bench_dispatch.py [--attempts N] [--slots S]

Prints three numbers measured in one run on the same disk:

1. raw durable commits/s: one-row INSERT transactions on a ledger (WAL, synchronous=FULL);
2. kernel attempts/s without processes: claim+intent, record_spawn, settle through the
   ledger (3 commits per attempt) — the ceiling the ledger allows;
3. end-to-end attempts/s of no-op jobs (`true`) through WorkerService: real supervisors,
   exit records and settles.

No assertions: numbers to compare, not a test.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import select

from laneway.controller import db, ledger, ledger_open
from laneway.controller.clock import SystemClock
from laneway.controller.daemon import Controller
from laneway.controller.models import Event, Run
from laneway.workers.service import WorkerService

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common


def config(attempts: int, slots: int):
    keys = (f"i{n}" for n in range(attempts))
    return common.one_lane_config("bench", [common.NOOP_STAGE], keys, max_jobs=slots)


def fresh(root: Path, name: str):
    directory = root / name
    directory.mkdir()
    return directory, ledger_open.open_ledger(directory)


def raw_commits(root: Path, count: int) -> float:
    _, engine = fresh(root, "raw")
    factory = db.session_factory(engine)
    clock = SystemClock()
    started = time.perf_counter()
    for _ in range(count):
        with db.transaction(factory) as session:
            ledger.append_event(session, "bench", actor="bench", now=clock.now())
    elapsed = time.perf_counter() - started
    with factory() as session:
        assert len(session.scalars(select(Event.id)).all()) == count
    return count / elapsed


def kernel(root: Path, attempts: int, slots: int) -> float:
    directory, engine = fresh(root, "kernel")
    factory = db.session_factory(engine)
    clock = SystemClock()
    common.create_run(factory, config(attempts, slots), directory, clock.now())
    worker = common.register_worker(factory, clock.now(), slots=slots)
    done = 0
    started = time.perf_counter()
    while done < attempts:
        done += common.kernel_round(factory, worker, clock, slots)
    return attempts / (time.perf_counter() - started)


def end_to_end(root: Path, attempts: int, slots: int) -> tuple[float, float]:
    directory, engine = fresh(root, "e2e")
    factory = db.session_factory(engine)
    run_id = common.create_run(factory, config(attempts, slots), directory)
    service = WorkerService(engine, node="n1", slots=slots, memory_probe=lambda: (64e3, 128e3))
    service.start()
    controller = Controller(engine, snapshot_seconds=3600)
    first_start: float | None = None
    started = time.perf_counter()
    latencies = []
    while True:
        before = time.perf_counter()
        report = service.tick()
        if report.claimed and first_start is None:
            first_start = time.perf_counter() - before
        latencies.append(time.perf_counter() - before)
        controller.tick()
        with factory() as session:
            if session.get(Run, run_id).state == "finished":
                break
        if not (report.claimed or report.settled):
            time.sleep(0.005)
    elapsed = time.perf_counter() - started
    return attempts / elapsed, (first_start or 0.0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=200)
    parser.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="laneway-bench-"))
    try:
        raw = raw_commits(root, args.attempts * 3)
        ceiling = kernel(root, args.attempts, args.slots)
        e2e, first_ms = end_to_end(root, args.attempts, args.slots)
    finally:
        shutil.rmtree(root)
    print(f"{'measure':<44}{'value':>12}")
    print(f"{'raw durable commits/s (1-row txn)':<44}{raw:>12.1f}")
    print(f"{'  -> attempts/s if 3 commits per attempt':<44}{raw / 3:>12.1f}")
    print(f"{'kernel attempts/s, no processes':<44}{ceiling:>12.1f}")
    print(f"{'end-to-end attempts/s, no-op jobs':<44}{e2e:>12.1f}")
    print(f"{'first claim+spawn tick, ms':<44}{first_ms:>12.1f}")
    print(f"(attempts={args.attempts}, slots={args.slots})")


if __name__ == "__main__":
    main()
