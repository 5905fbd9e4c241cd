"""Claims under real concurrency: N worker processes claiming (and settling) from one
run at once, on SQLite and on PostgreSQL, at two backlog sizes.

Each worker process loops as a worker service does: one write transaction settles what
it holds and claims for its free slots (tests/claim_race.py, the same code the test
tests/integration/test_claim_race.py runs). Prints claims per second over the whole
run and the worst time one claim transaction took (waiting for the write lock included).

    .venv/bin/python bench/bench_claim_race.py [--jobs 500,2000] [--workers 4,16]
        [--postgres postgresql://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from _common import int_list, parser, table, use_project


def main() -> None:
    args = parser(__doc__ or "")
    args.add_argument("--jobs", type=int_list, default=[500, 2000])
    args.add_argument("--workers", type=int_list, default=[4, 16])
    args.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a server where scratch databases may be created ('' to skip PostgreSQL)",
    )
    options = args.parse_args()
    use_project(options.project)
    os.environ["LANEWAY_TEST_POSTGRES_URL"] = options.postgres
    from laneway.controller import ledger_open
    from tests import backends
    from tests.claim_race import race

    rows = []
    for jobs in options.jobs:
        for workers in options.workers:
            for backend in ["sqlite", "postgres"] if options.postgres else ["sqlite"]:
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
                        found = race(url, jobs=jobs, workers=workers)
                    finally:
                        if name is not None:
                            backends.drop_database(name)
                errors = sum(len(r["errors"]) for r in found["reports"])
                worst = max(r["worst_wait_s"] for r in found["reports"])
                rows.append(
                    [
                        backend,
                        str(jobs),
                        str(workers),
                        f"{jobs / found['seconds']:.0f}",
                        f"{worst * 1000:.0f}",
                        str(errors),
                    ]
                )
    if options.postgres:
        backends.drop_template()
    print(table(["backend", "jobs", "workers", "claims/s", "worst claim ms", "errors"], rows))


if __name__ == "__main__":
    main()
