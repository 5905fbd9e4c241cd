"""What holds PostgreSQL's order lock: one worker's claims and settles, timed from the lock.

    .venv/bin/python bench/bench_write_lock.py [--jobs 1500] [--slots 1,4] [--postgres URL]

One worker (this process, no other) loops as a PostgreSQL worker does: it settles what
it holds in a ``db.worker_transaction`` (the shared gate; the order lock at its end),
then claims for its free slots in a ``db.claim_transaction`` (the node's lock and the
shared gate, the snapshot and the writes, the order lock only for its end). Per size
(slots claimed at a time), it prints the medians of how long each transaction held the
order lock per job (what other workers' events wait for), how much
of that lay between its last statement and the commit's return (the WAL's fsync; for
the claim also its deferred event insert), and, for the claim, each statement's time to
the next one from the lock on (the Python between them included). The ledger is a
scratch database on the server, made and dropped here. No assertions; nothing here runs
on SQLite (whose lock is the whole transaction).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


def measure(url: str, jobs: int, slots: int) -> dict[str, Any]:
    from sqlalchemy import event

    from laneway.controller import db, ledger
    from laneway.controller.clock import SystemClock
    from laneway.controller.states import Outcome
    from tests import claim_race
    from tests.support import record_spawn

    claim_race.make_run(url, jobs, 1, slots, 1)
    clock = SystemClock()
    engine = db.make_engine(url)
    factory = db.session_factory(engine)
    worker = common.register_worker(
        factory, clock.now(), slots=slots, host="bench", pid=os.getpid()
    )
    marks: list[tuple[float, str]] = []

    def before(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        marks.append((time.perf_counter(), " ".join(sql.split()[:3])[:40]))

    event.listen(engine, "before_cursor_execute", before)
    settle_hold: list[float] = []
    settle_commit: list[float] = []
    claim_hold: list[float] = []
    claim_commit: list[float] = []
    gaps: dict[str, list[float]] = {}
    claims = 0
    held: list[Any] = []
    try:
        while True:
            if held:
                marks.clear()
                with db.worker_transaction(factory) as session:
                    now = db.ledger_now(session, clock)
                    for claim in held:
                        record_spawn(session, claim, worker, now, ("bench", os.getpid(), 1))
                        ledger.settle_attempt(
                            session,
                            claim.attempt_id,
                            fence=claim.fence,
                            outcome=Outcome.SUCCEEDED,
                            actor=worker,
                            now=now,
                        )
                end = time.perf_counter()
                settle_hold.append((end - session.info[db.LOCKED_AT]) / len(held))
                settle_commit.append(end - marks[-1][0])
            marks.clear()
            with db.claim_transaction(factory, node="n1") as session:
                held = ledger.claim_jobs(
                    session,
                    worker_id=worker,
                    node="n1",
                    free_slots=slots,
                    mem_available_mib=1e9,
                    now=db.ledger_now(session, clock),
                )
                written = time.perf_counter()
            end = time.perf_counter()
            if not held:
                break
            claims += 1
            claim_hold.append((end - session.info[db.LOCKED_AT]) / len(held))
            claim_commit.append(end - written)
            # From the lock statement on, up to the deferred event insert (timed with
            # the commit, above).
            lock = f"pg_advisory_xact_lock({db.ORDER_LOCK_KEY})"
            first = max(i for i, (_, sql) in enumerate(marks) if lock in sql)
            after = [(t, sql) for t, sql in marks[first:] if t <= written]
            for (t, sql), (following, _) in zip(after, [*after[1:], (written, "")], strict=True):
                gaps.setdefault(sql, []).append(following - t)
    finally:
        event.remove(engine, "before_cursor_execute", before)
        engine.dispose()
    median = statistics.median
    return {
        "settle": median(settle_hold) * 1e3,
        "settle_commit": median(settle_commit) * 1e3,
        "claim": median(claim_hold) * 1e3,
        "claim_commit": median(claim_commit) * 1e3,
        "statements": sorted(
            ((sql, len(v) / claims, median(v) * 1e3) for sql, v in gaps.items()),
            key=lambda row: -row[1] * row[2],
        ),
    }


def main() -> None:
    args = common.parser(__doc__ or "")
    args.add_argument("--jobs", type=int, default=1500)
    args.add_argument("--slots", type=common.int_list, default=[1, 4], help="jobs per claim")
    args.add_argument("--postgres", default=PG_DEFAULT, help="a server for scratch databases")
    options = args.parse_args()
    common.use_project_and_say(options.project)
    os.environ["LANEWAY_TEST_POSTGRES_URL"] = options.postgres
    from tests import backends

    for slots in options.slots:
        name = backends.create_database()
        try:
            load = os.getloadavg()[0]
            figures = measure(backends.database_url(name), options.jobs, slots)
        finally:
            backends.drop_database(name)
            backends.drop_template()
        print(
            f"\n{options.jobs} jobs, {slots} per claim (load {load:.1f}): order lock held "
            f"per job {figures['claim']:.2f} ms in the claim "
            f"(last statement to commit: {figures['claim_commit']:.2f} ms per claim), "
            f"{figures['settle']:.2f} ms in the settle "
            f"({figures['settle_commit']:.2f} ms per transaction)"
        )
        rows = [
            [sql, f"{per_claim:.2f}", f"{ms:.3f}"] for sql, per_claim, ms in figures["statements"]
        ]
        print(common.table(["claim statement under the lock", "per claim", "ms to next"], rows))


if __name__ == "__main__":
    main()
