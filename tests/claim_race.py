"""Many worker processes claiming from one run at once (the test and the benchmark).

``race(url, jobs=, workers=)`` creates a run of ``jobs`` one-stage jobs in the ledger at
``url`` (which must be migrated and empty), starts ``workers`` processes that each loop
like a worker service does (one transaction that settles what it holds and claims for
its free slots, through the real ledger functions and ``db.transaction``), and returns
what they saw. A child process is ``python -m tests.claim_race URL INDEX SLOTS``; it
prints one JSON line: its claims, settles, worst claim wait and any errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def make_run(url: str, jobs: int, workers: int, slots: int, nodes: int = 1, stages: int = 1) -> int:
    """One run of ``jobs`` jobs over ``nodes`` nodes (lane ``a<k>`` on node ``n<k>``,
    items dealt round-robin), each node with room for all its workers' slots. With
    ``stages=2`` each of ``jobs // 2`` items has a second stage that needs the first:
    a settle promotes it."""
    from laneway.controller import db, ledger
    from laneway.controller.clock import SystemClock
    from tests.support import make_config, py_stage

    per_node = -(-workers // nodes) * slots
    config = make_config(
        [py_stage("only", "pass")]
        if stages == 1
        else [py_stage("only", "pass"), py_stage("then", "pass", needs=["only"])],
        items=[{"key": f"i{n}", "lane": f"a{n % nodes + 1}"} for n in range(jobs // stages)],
        lanes=[{"name": f"a{k}", "node": f"n{k}"} for k in range(1, nodes + 1)],
        nodes=[
            {"name": f"n{k}", "memory_floor_mib": 0, "max_jobs": per_node}
            for k in range(1, nodes + 1)
        ],
    )
    engine = db.make_engine(url)
    with db.transaction(db.session_factory(engine)) as session:
        run_id = ledger.create_run(
            session,
            config,
            runtime_dir="/nonexistent/claim-race",
            source_hashes={},
            actor="race",
            now=SystemClock().now(),
        ).id
    engine.dispose()
    return run_id


def race(
    url: str, *, jobs: int, workers: int, slots: int = 4, nodes: int = 1, stages: int = 1
) -> dict[str, Any]:
    """Run the race (worker ``i`` on node ``n<i % nodes + 1>``); returns the children's
    reports and the wall time. With ``stages=2`` each settle also carries a measured
    peak (the worker's index), folded into its stage's row, which every worker writes."""
    make_run(url, jobs, workers, slots, nodes, stages)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.claim_race",
                url,
                str(index),
                str(slots),
                f"n{index % nodes + 1}",
                str(stages),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(workers)
    ]
    reports, stderr = [], []
    for child in children:
        out, err = child.communicate(timeout=600)
        stderr.append(err)
        lines = out.strip().splitlines()
        reports.append(json.loads(lines[-1]) if lines else {"errors": [f"exit {child.returncode}"]})
    return {"reports": reports, "stderr": stderr, "seconds": time.monotonic() - started}


def _child(url: str, index: int, slots: int, node: str, stages: int) -> dict[str, Any]:
    """Loop as ``WorkerService._settle_and_claim`` does: on SQLite settle and claim in
    one transaction; on PostgreSQL settle in a ``worker_transaction``, then claim in a
    ``claim_transaction`` (the node's lock and the shared gate; the order lock only for
    its end)."""
    from sqlalchemy import func, select

    from laneway.controller import db, ledger
    from laneway.controller.clock import SystemClock
    from laneway.controller.models import Job
    from laneway.controller.states import JobState, Outcome
    from tests.support import record_spawn

    clock = SystemClock()
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    with db.transaction(factory) as session:
        worker = ledger.register_worker(
            session,
            node=node,
            host="race",
            pid=os.getpid(),
            boot_id="race",
            process_start_time=index,
            slots=slots,
            now=db.ledger_now(session, clock),
        )
    held: list[Any] = []
    claims = settles = 0
    lock_held: list[float] = []  # per claimed job: seconds the order lock was held
    # LANEWAY_RACE_EARLY_LOCK=1 (bench_claim_race.py --early-lock): the way before
    # claim_transaction, settle and claim in one transaction holding the ledger alone.
    early = os.environ.get("LANEWAY_RACE_EARLY_LOCK") == "1"
    claim_transaction = db.claim_transaction
    if early:
        claim_transaction = lambda factory, node: db.transaction(factory)  # noqa: E731

    def peak(now: Any) -> dict[str, Any]:
        return {"sampled_at": now, "peak_rss_mib": float(index), "peak_rss_at": now}

    def settle(session: Any, claims: list[Any]) -> None:
        nonlocal settles
        now = db.ledger_now(session, clock)
        for claim in claims:
            record_spawn(session, claim, worker, now, ("race", os.getpid(), index))
            ledger.settle_attempt(
                session,
                claim.attempt_id,
                fence=claim.fence,
                outcome=Outcome.SUCCEEDED,
                actor=worker,
                now=now,
                measured=peak(now) if stages > 1 else None,
            )
        settles += len(claims)

    worst = 0.0
    errors: list[str] = []
    idle_looks = 0
    while idle_looks < 3:
        began = time.monotonic()
        try:
            holding = 0.0
            if held and not db.is_sqlite(engine) and not early:
                with db.worker_transaction(factory) as session:
                    settle(session, held)
                holding += time.monotonic() - session.info.get(db.LOCKED_AT, time.monotonic())
                held = []
            with claim_transaction(factory, node=node) as session:
                settle(session, held)
                held = ledger.claim_jobs(
                    session,
                    worker_id=worker,
                    node=node,
                    free_slots=slots,
                    mem_available_mib=1e9,
                    now=db.ledger_now(session, clock),
                )
            holding += time.monotonic() - session.info.get(db.LOCKED_AT, time.monotonic())
            if held:
                lock_held.append(holding / len(held))
        except Exception as exc:  # reported to the parent, which fails the test on it
            errors.append(f"{type(exc).__name__}: {db.describe(exc)}")
            held = []
            continue
        worst = max(worst, time.monotonic() - began)
        claims += len(held)
        if held:
            idle_looks = 0
            continue
        with factory() as session:
            ready = session.scalar(
                select(func.count()).select_from(Job).where(Job.state == JobState.READY)
            )
        idle_looks = idle_looks + 1 if not ready else 0
    engine.dispose()
    lock_held.sort()
    return {
        "claims": claims,
        "settles": settles,
        "worst_wait_s": worst,
        "lock_held_s": lock_held[len(lock_held) // 2] if lock_held else None,
        "errors": errors,
    }


if __name__ == "__main__":
    url, index, slots, node, stages = sys.argv[1:6]
    print(json.dumps(_child(url, int(index), int(slots), node, int(stages))))
