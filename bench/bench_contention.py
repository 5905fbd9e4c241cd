"""SQLite write contention: 8 processes writing the ledger at once, side by side with
and without laneway's fair write lock.

    .venv/bin/python bench/bench_contention.py [--procs 8] [--txns 150]

Each process runs write transactions shaped like laneway's (BEGIN IMMEDIATE, a few
reads, an update, an event insert, a durable commit) and records how long each waited
to get the write lock. Prints, per mode, worst and p99 wait, throughput, and how many
transactions failed with "database is locked". No assertions: numbers to compare.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from laneway.controller import db, ledger, ledger_open
from laneway.controller.clock import SystemClock
from laneway.controller.models import Node


def writer(runtime: str, fair: bool, txns: int, queue: multiprocessing.Queue) -> None:
    engine = db.make_engine(db.ledger_url(runtime))
    factory = db.session_factory(engine)
    clock = SystemClock()
    waits: list[float] = []
    locked = 0
    for _ in range(txns):
        asked = time.perf_counter()
        try:
            with db.transaction(factory, fair=fair) as session:
                # The first statement emits BEGIN IMMEDIATE: the write lock is ours after it.
                session.scalar(select(Node.mem_available_mib).where(Node.name == "n1"))
                waits.append(time.perf_counter() - asked)
                session.execute(
                    update(Node).where(Node.name == "n1").values(updated_at=clock.now())
                )
                ledger.append_event(session, "bench", actor="bench", now=clock.now())
        except OperationalError as exc:  # counted and reported, never hidden
            if "locked" not in str(exc):
                raise
            locked += 1
    queue.put((waits, locked))


def measure(root: Path, fair: bool, procs: int, txns: int) -> dict[str, float]:
    runtime = root / ("fair" if fair else "busy-handler")
    engine = ledger_open.open_ledger(runtime)
    with db.transaction(db.session_factory(engine)) as session:
        session.add(Node(name="n1", memory_floor_mib=0, max_jobs=1, updated_at=SystemClock().now()))
    engine.dispose()
    queue: multiprocessing.Queue = multiprocessing.Queue()
    workers = [
        multiprocessing.Process(target=writer, args=(str(runtime), fair, txns, queue))
        for _ in range(procs)
    ]
    started = time.perf_counter()
    for process in workers:
        process.start()
    results = [queue.get() for _ in workers]
    for process in workers:
        process.join()
    elapsed = time.perf_counter() - started
    waits = sorted(w for ws, _ in results for w in ws)
    return {
        "worst_wait_ms": waits[-1] * 1000,
        "p99_wait_ms": waits[int(len(waits) * 0.99) - 1] * 1000,
        "median_wait_ms": statistics.median(waits) * 1000,
        "txn_per_s": len(waits) / elapsed,
        "locked_errors": sum(locked for _, locked in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--txns", type=int, default=150)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laneway-contention-") as tmp:
        rows = {
            "busy handler only": measure(Path(tmp), False, args.procs, args.txns),
            "fair write lock": measure(Path(tmp), True, args.procs, args.txns),
        }
    keys = ["worst_wait_ms", "p99_wait_ms", "median_wait_ms", "txn_per_s", "locked_errors"]
    print(f"{'mode':<20}" + "".join(f"{k:>16}" for k in keys))
    for mode, row in rows.items():
        print(f"{mode:<20}" + "".join(f"{row[k]:>16.1f}" for k in keys))
    print(f"({args.procs} processes x {args.txns} write transactions each)")


if __name__ == "__main__":
    main()
