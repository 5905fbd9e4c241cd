"""Statements and commits per attempt of the whole dispatch loop, by statement.

    .venv/bin/python bench/bench_statements.py [--sizes 200,1000] [--slots 2]

An in-process worker service and controller (as `laneway run` drives them) run N no-op
jobs on SQLite; a ``before_cursor_execute`` listener counts every statement the ledger
is sent (claims, spawn records, settles, heartbeats, the controller's safety net and
status snapshots), grouped by its first words, and a ``commit`` listener the commits.
Prints, per size, the totals per attempt and the most frequent statements. With
``--postgres URL`` the ledger is a scratch database on that server (made and dropped
here), so PostgreSQL's extra statements (its locks, its clock, its connection checks)
are counted too. No assertions (tests/integration/test_kernel_scale.py asserts what must not grow).
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common


def count(n: int, slots: int) -> tuple[collections.Counter[str], int]:
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
    commits = [0]

    def statement(_c: Any, _cur: Any, sql: str, *_: Any) -> None:
        counts[" ".join(sql.split()[:3])[:60]] += 1

    def commit(_c: Any) -> None:
        commits[0] += 1

    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)
    while True:
        report = service.tick()
        if controller.due():
            controller.tick()
        with db.reader(engine)() as session:  # read-only, not counted: the bench's own look
            if session.get(Run, run_id).state == "finished":
                break
        if not (report.claimed or report.settled):
            service.wait(0.02)
    event.remove(engine, "before_cursor_execute", statement)
    event.remove(engine, "commit", commit)
    engine.dispose()
    return counts, commits[0]


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
                counts, commits = count(n, options.slots)
            finally:
                del os.environ["LANEWAY_DATABASE_URL"]
                backends.drop_database(name)
                backends.drop_template()
        else:
            counts, commits = count(n, options.slots)
        total = sum(counts.values())
        print(
            f"\nN = {n}, {options.slots} slots: {total / n:.1f} statements and "
            f"{commits / n:.2f} commits per attempt"
        )
        rows = [[f"{v / n:.2f}", k] for k, v in counts.most_common(25)]
        print(common.table(["per attempt", "statement"], rows))


if __name__ == "__main__":
    main()
