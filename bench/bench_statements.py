"""Statements and commits per attempt of the whole dispatch loop, by statement.

    .venv/bin/python bench/bench_statements.py [--sizes 200,1000] [--slots 2]

An in-process worker service and controller (as `laneway run` drives them) run N no-op
jobs on SQLite; a ``before_cursor_execute`` listener counts every statement the ledger
is sent (claims, spawn records, settles, heartbeats, the controller's safety net and
status snapshots), grouped by its first words, with the wall time from that event to
``after_cursor_execute`` (the round trip and the server's work: what a worker waits for),
and a ``commit`` listener the commits. Prints, per size, the totals per attempt and the
most frequent statements with their time. With
``--postgres URL`` the ledger is a scratch database on that server (made and dropped
here), so PostgreSQL's extra statements (its locks, its clock, its connection checks)
are counted too. No assertions (tests/integration/test_kernel_scale.py asserts what must not grow).
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common


def count(n: int, slots: int) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    from sqlalchemy import event

    from laneway.controller import db, ledger_open
    from laneway.controller.daemon import Controller
    from laneway.controller.models import Run
    from laneway.workers.service import WorkerService

    root = Path(tempfile.mkdtemp(prefix="laneway-bench-statements-"))
    engine = ledger_open.open_ledger(root)
    factory = db.session_factory(engine)
    keys = (f"i{k}" for k in range(n))
    config = common.one_lane_config("bench", [common.NOOP_STAGE], keys, max_jobs=slots)
    run_id = common.create_run(factory, config, root)
    service = WorkerService(engine, node="n1", slots=slots, memory_probe=lambda: (64e3, 128e3))
    service.start()
    controller = Controller(engine, snapshot_seconds=1.0)
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    other: collections.Counter[str] = collections.Counter()
    commits = [0]
    sent: list[tuple[str, float]] = []

    def statement(_c: Any, _cur: Any, sql: str, *_: Any) -> None:
        kind = " ".join(sql.split()[:3])[:60]
        counts[kind] += 1
        sent.append((kind, time.perf_counter()))

    def answered(*_: Any) -> None:
        kind, began = sent.pop()
        seconds[kind] += time.perf_counter() - began

    def commit(_c: Any) -> None:
        commits[0] += 1

    def checkout(*_: Any) -> None:
        other["connection checkouts"] += 1

    def begin(_c: Any) -> None:
        other["transactions begun"] += 1

    # On PostgreSQL ``db.reader`` is the engine itself: the bench looks through its own.
    looks = db.session_factory(db.make_engine(engine.url.render_as_string(hide_password=False)))
    traces = trace_round_trips(engine, root)
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "after_cursor_execute", answered)
    event.listen(engine, "commit", commit)
    event.listen(engine, "begin", begin)
    event.listen(engine.pool, "checkout", checkout)
    while True:
        report = service.tick()
        if controller.due():
            controller.tick()
        with looks() as session:  # the bench's own look: another engine, not counted
            if session.get(Run, run_id).state == "finished":
                break
        if not (report.claimed or report.settled):
            service.wait(0.02)
    event.remove(engine, "before_cursor_execute", statement)
    event.remove(engine, "after_cursor_execute", answered)
    event.remove(engine, "commit", commit)
    event.remove(engine, "begin", begin)
    event.remove(engine.pool, "checkout", checkout)
    engine.dispose()
    looks.kw["bind"].dispose()
    if traces is not None:
        other["round trips"] = traces()
    counts.update({f"({k})": v for k, v in other.items()})
    return counts, seconds, commits[0]


def trace_round_trips(engine: Any, root: Path) -> Any:
    """PostgreSQL: trace every connection ``engine`` opens from now on with libpq's
    protocol trace (a file per connection under ``root``) and return a function that
    counts the round trips in them, one per ReadyForQuery the server sent: what the
    statements above leave out (psycopg's BEGIN, COMMIT and ROLLBACK, the pool's pings)
    is in it. None on SQLite."""
    from sqlalchemy import event

    if engine.dialect.name == "sqlite":
        return None
    from psycopg import pq

    files: list[Any] = []

    def connect(dbapi_connection: Any, _record: Any) -> None:
        out = open(root / f"trace-{len(files)}.txt", "w")  # closed by count()
        files.append(out)
        dbapi_connection.pgconn.trace(out.fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)

    event.listen(engine.pool, "connect", connect)
    engine.dispose()  # the connections opened before are not traced: open them again

    def count() -> int:
        for out in files:
            out.close()
        return sum(
            line.startswith("B\t") and "\tReadyForQuery" in line
            for out in files
            for line in Path(out.name).read_text().splitlines()
        )

    return count


def main() -> None:
    args = common.parser(__doc__ or "")
    args.add_argument("--sizes", type=common.int_list, default=[200, 1000])
    args.add_argument("--slots", type=int, default=2)
    args.add_argument(
        "--postgres",
        default="",
        help="count on a scratch database of this PostgreSQL server instead of SQLite "
        "(e.g. postgresql://postgres@127.0.0.1:5432/postgres)",
    )
    options = args.parse_args()
    common.use_project_and_say(options.project)
    if options.postgres:
        os.environ["LANEWAY_TEST_POSTGRES_URL"] = options.postgres
    for n in options.sizes:
        if options.postgres:
            from tests import backends

            name = backends.create_database()
            os.environ["LANEWAY_DATABASE_URL"] = backends.database_url(name)
            try:
                counts, seconds, commits = count(n, options.slots)
            finally:
                del os.environ["LANEWAY_DATABASE_URL"]
                backends.drop_database(name)
                backends.drop_template()
        else:
            counts, seconds, commits = count(n, options.slots)
        total = sum(v for k, v in counts.items() if not k.startswith("("))
        print(
            f"\nN = {n}, {options.slots} slots: {total / n:.1f} statements and "
            f"{commits / n:.2f} commits per attempt, {sum(seconds.values()) * 1e3 / n:.2f} ms "
            f"per attempt in them (load {os.getloadavg()[0]:.1f})"
        )
        rows = [
            [f"{v / n:.2f}", f"{seconds[k] * 1e3 / n:.3f}", f"{seconds[k] * 1e3 / v:.3f}", k]
            for k, v in counts.most_common(27)
        ]
        print(common.table(["per attempt", "ms/attempt", "ms each", "statement"], rows))


if __name__ == "__main__":
    main()
