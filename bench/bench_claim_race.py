"""Claims under real concurrency: N worker processes claiming (and settling) from one
run at once, on SQLite and on PostgreSQL, at several backlog sizes.

Each worker process loops as a worker service does (tests/claim_race.py, the same code
tests/integration/test_claim_race.py runs): on SQLite one write transaction settles what
it holds and claims for its free slots; on PostgreSQL the settle commits in a
``db.worker_transaction`` (the gate shared with the other workers) and the claim runs in
a ``db.claim_transaction`` (the node's lock and the shared gate; the order lock only at
its end). ``--nodes each`` puts every worker on a node of its own (a lane per node),
``--nodes one`` all of them on one node. Prints claims per second over the whole run,
the ratio to one worker's rate, the worst time one claim transaction took (waiting for
locks included), duplicates (attempts beyond one per job) and lost jobs (not
succeeded), with the load average when the row was measured. "lock held ms/job": the
median, over workers, of each worker's median time its transactions held the lock that
serialises workers per job claimed (settle included): on SQLite the write lock, on
PostgreSQL the order lock; every other worker's events wait while it is held, so 1000 /
that is the rate no number of machines can pass ("ceiling jobs/s"); on a 2-core machine
the CPU is spent long before it. "machine busy": the share of all the machine's cores
that was busy during the row (``/proc/stat``: the workers, the database server and
anything else running), so a rate that stops growing with workers can be told apart:
the machine full (near 100 %) or a lock (well below).

    .venv/bin/python bench/bench_claim_race.py [--jobs 5000] [--workers 1,2,4,8,16]
        [--nodes each,one] [--postgres postgresql://postgres@127.0.0.1:5432/postgres]
        [--backends sqlite,postgres] [--early-lock]

``--early-lock`` measures the way claims were made before ``claim_transaction`` (settle
and claim in one transaction holding the ledger alone from its first statement), with
the same code otherwise.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from _common import int_list, machine_busy, machine_ticks, parser, table, use_project


def main() -> None:
    args = parser(__doc__ or "")
    args.add_argument("--jobs", type=int_list, default=[5000])
    args.add_argument("--workers", type=int_list, default=[1, 2, 4, 8, 16])
    args.add_argument("--nodes", default="each,one", help="each (a node per worker), one")
    args.add_argument("--backends", default="sqlite,postgres")
    args.add_argument(
        "--early-lock",
        action="store_true",
        help="claim as before claim_transaction: holding the ledger alone from the start",
    )
    args.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a server where scratch databases may be created ('' to skip PostgreSQL)",
    )
    options = args.parse_args()
    use_project(options.project)
    os.environ["LANEWAY_TEST_POSTGRES_URL"] = options.postgres
    if options.early_lock:
        os.environ["LANEWAY_RACE_EARLY_LOCK"] = "1"
    from sqlalchemy import create_engine, text

    from laneway.controller import ledger_open
    from tests import backends
    from tests.claim_race import race

    rows = []
    backend_names = [
        b for b in options.backends.split(",") if b == "sqlite" or (b and options.postgres)
    ]
    for jobs in options.jobs:
        for spread in options.nodes.split(","):
            for backend in backend_names:
                base = None
                for workers in options.workers:
                    nodes = workers if spread == "each" else 1
                    with tempfile.TemporaryDirectory() as scratch:
                        name = None
                        if backend == "sqlite":
                            engine = ledger_open.open_ledger(Path(scratch))
                            url = engine.url.render_as_string(hide_password=False)
                            engine.dispose()
                        else:
                            name = backends.create_database()
                            url = backends.database_url(name)
                        try:
                            load = os.getloadavg()[0]
                            ticks = machine_ticks()
                            found = race(url, jobs=jobs, workers=workers, nodes=nodes)
                            busy = machine_busy(ticks, machine_ticks())
                            counted = create_engine(
                                url.replace("postgresql://", "postgresql+psycopg://")
                            )
                            with counted.connect() as connection:
                                attempts = connection.execute(
                                    text("SELECT COUNT(*), COUNT(DISTINCT job_id) FROM attempts")
                                ).one()
                                lost = connection.execute(
                                    text("SELECT COUNT(*) FROM jobs WHERE state <> 'succeeded'")
                                ).scalar()
                            counted.dispose()
                        finally:
                            if name is not None:
                                backends.drop_database(name)
                    errors = sum(len(r["errors"]) for r in found["reports"])
                    helds = sorted(r["lock_held_s"] for r in found["reports"] if r["lock_held_s"])
                    held_ms = helds[len(helds) // 2] * 1000 if helds else float("nan")
                    worst = max(r["worst_wait_s"] for r in found["reports"])
                    rate = jobs / found["seconds"]
                    base = base or rate
                    rows.append(
                        [
                            backend,
                            str(jobs),
                            str(workers),
                            str(nodes),
                            f"{rate:.0f}",
                            f"{rate / base:.2f}",
                            f"{worst * 1000:.0f}",
                            f"{held_ms:.2f}",
                            f"{1000 / held_ms:.0f}",
                            str(attempts[0] - attempts[1]),
                            str(lost),
                            str(errors),
                            f"{busy * 100:.0f} %",
                            f"{load:.1f}",
                        ]
                    )
                    print(" | ".join(rows[-1]), flush=True)
    if options.postgres:
        backends.drop_template()
    header = ["backend", "jobs", "workers", "nodes", "claims/s", "vs 1 worker", "worst claim ms"]
    header += ["lock held ms/job", "ceiling jobs/s"]
    print(table([*header, "duplicates", "lost", "errors", "machine busy", "load"], rows))


if __name__ == "__main__":
    main()
