"""The ledger cycle without processes, at 1, 2, 4 and 8 writer processes, beside a raw
sqlite3 loop and huey's SqliteHuey, with duplicates and losses counted.

    .venv/bin/python bench/bench_kernel.py
    (options: --jobs 500,2000  --writers 1,2,4,8  --reps 3  --commits 1000  --project DIR)

(huey: `bash bench/setup_peers.sh` first; it runs under bench/.venv-peers/bin/python in a
subprocess, so laneway's venv never gets it. Ledgers go to $TMPDIR, default /tmp.)

For each job count N and writer count W, in one invocation:

- laneway kernel: a run of N one-stage jobs created with `ledger.create_run` (node
  max_jobs = W), then W processes (multiprocessing, each its own engine from
  `ledger_open.open_ledger` and its own worker from `ledger.register_worker`), started together,
  each looping `ledger.claim_jobs` (1 free slot) -> `ledger.record_spawn` ->
  `ledger.settle_attempt`, one `db.transaction` each, as bench/bench_dispatch.py's
  kernel() does, until a claim comes back empty;
- raw sqlite3: the same three durable commits per job with plain SQL (WAL,
  synchronous=FULL, BEGIN IMMEDIATE, busy timeout 30 s): pick a ready job + fence bump +
  lease + attempt intent in one transaction, the spawn record in a second, the
  completion (attempt settled, job succeeded, lease released) in a third;
- huey SqliteHuey (fsync=True, i.e. synchronous=FULL; WAL; timeout 30 s): N no-op tasks
  enqueued (one commit each, timed separately), then W processes each looping
  `huey.dequeue()` -> `huey.execute(task)` (the consumer worker's loop body: one commit
  to take the task, one to store its result).

Per row: jobs/s (median (min-max) over reps) of the W-process phase, and duplicates (a
job executed or settled more than once) and losses (a job never finished) read from the
ledger/tables at the end (laneway: attempts per job from `attempts`, and every job must
be `succeeded`). Errors (e.g. "database is locked") are counted, never hidden.

Also measured: the raw durable commit rate of this disk (one-row INSERT transactions,
WAL, synchronous=FULL), and laneway's jobs/s as a % of (commit rate / its commits per
job). No assertions: numbers to compare.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

LANEWAY_COMMITS_PER_JOB = 3
"""Durable commits laneway spends per job in this cycle: claim (lease + intent, one
transaction), record_spawn, settle_attempt. Update it if the ledger's cycle changes."""
RAW_COMMITS_PER_JOB = 3
HUEY_COMMITS_PER_JOB = 2  # dequeue + result (the enqueue commit is timed separately)
MAX_ERRORS = 50


# --------------------------------------------------------------------- laneway


def laneway_config(jobs: int, max_jobs: int):
    keys = (f"i{n}" for n in range(jobs))
    return common.one_lane_config("bench-kernel", [common.NOOP_STAGE], keys, max_jobs=max_jobs)


def laneway_setup(runtime: Path, jobs: int, writers: int) -> None:
    engine, _, _ = common.open_with_run(runtime, laneway_config(jobs, writers))
    engine.dispose()


def laneway_writer(runtime: str, barrier, queue) -> None:
    from laneway.controller import db, ledger_open
    from laneway.controller.clock import SystemClock

    errors: list[str] = []
    done = 0
    try:
        engine = ledger_open.open_ledger(runtime)
        factory = db.session_factory(engine)
        clock = SystemClock()
        worker = common.register_worker(
            factory, clock.now(), slots=1, host="bench", pid=os.getpid()
        )
    except Exception as exc:  # reported, never hidden
        barrier.wait()
        queue.put({"done": 0, "errors": [f"setup: {exc!r}"[:200]], "end": time.monotonic()})
        return
    barrier.wait()
    while len(errors) < MAX_ERRORS:
        try:
            claimed = common.kernel_round(factory, worker, clock, 1)
            if not claimed:
                break
            done += claimed
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
    queue.put({"done": done, "errors": errors, "end": time.monotonic()})


def laneway_check(runtime: Path, jobs: int) -> tuple[int, int]:
    with sqlite3.connect(f"file:{runtime / 'ledger.sqlite3'}?mode=ro", uri=True) as conn:
        succeeded = conn.execute("select count(*) from jobs where state = 'succeeded'").fetchone()[
            0
        ]
        extra = conn.execute(
            "select coalesce(sum(n - 1), 0) from "
            "(select count(*) n from attempts group by job_id having count(*) > 1)"
        ).fetchone()[0]
        settled_twice = conn.execute(
            "select count(*) from (select job_id from attempts where state = 'settled' "
            "group by job_id having count(*) > 1)"
        ).fetchone()[0]
    return max(extra, settled_twice), jobs - succeeded


def run_processes(target, args: tuple, writers: int) -> tuple[float, list[dict]]:
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(writers + 1)
    queue = context.Queue()
    procs = [context.Process(target=target, args=(*args, barrier, queue)) for _ in range(writers)]
    for proc in procs:
        proc.start()
    barrier.wait()
    started = time.monotonic()
    reports = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    return max(r["end"] for r in reports) - started, reports


def measure_laneway(root: Path, jobs: int, writers: int) -> dict:
    runtime = root / "laneway"
    laneway_setup(runtime, jobs, writers)
    elapsed, reports = run_processes(laneway_writer, (str(runtime),), writers)
    dup, lost = laneway_check(runtime, jobs)
    errors = [e for r in reports for e in r["errors"]]
    return {"rate": jobs / elapsed, "dup": dup, "lost": lost, "errors": errors}


# ------------------------------------------------------------------ raw sqlite3


RAW_SCHEMA = """
create table jobs (id integer primary key, state text not null, fence integer not null,
    updated_at real, finished_at real);
create index jobs_state on jobs (state, id);
create table attempts (id integer primary key, job_id integer not null, state text not null,
    fence integer not null, worker text not null, intent_at real not null, started_at real,
    child_pid integer, outcome text, settled_at real);
create table leases (id integer primary key, job_id integer not null, attempt_id integer,
    worker text not null, fence integer not null, granted_at real, expires_at real,
    released_at real);
"""


def raw_connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    conn.execute("pragma journal_mode = wal")
    conn.execute("pragma synchronous = full")
    return conn


def raw_setup(path: Path, jobs: int) -> None:
    conn = raw_connect(str(path))
    conn.executescript(RAW_SCHEMA)
    conn.execute("begin")
    conn.executemany("insert into jobs (state, fence) values ('ready', 0)", [()] * jobs)
    conn.execute("commit")
    conn.close()


def raw_writer(path: str, barrier, queue) -> None:
    conn = raw_connect(path)
    me = f"w{os.getpid()}"
    errors: list[str] = []
    done = 0
    barrier.wait()
    while len(errors) < MAX_ERRORS:
        try:
            now = time.time()
            conn.execute("begin immediate")
            row = conn.execute(
                "select id, fence from jobs where state = 'ready' order by id limit 1"
            ).fetchone()
            if row is None:
                conn.execute("commit")
                break
            job, fence = row[0], row[1] + 1
            conn.execute(
                "update jobs set state = 'running', fence = ?, updated_at = ? "
                "where id = ? and state = 'ready'",
                (fence, now, job),
            )
            attempt = conn.execute(
                "insert into attempts (job_id, state, fence, worker, intent_at) "
                "values (?, 'intent', ?, ?, ?)",
                (job, fence, me, now),
            ).lastrowid
            conn.execute(
                "insert into leases (job_id, attempt_id, worker, fence, granted_at, expires_at) "
                "values (?, ?, ?, ?, ?, ?)",
                (job, attempt, me, fence, now, now + 60),
            )
            conn.execute("commit")
            conn.execute("begin immediate")
            conn.execute(
                "update attempts set state = 'running', started_at = ?, child_pid = 2 "
                "where id = ? and fence = ?",
                (time.time(), attempt, fence),
            )
            conn.execute("commit")
            now = time.time()
            conn.execute("begin immediate")
            conn.execute(
                "update attempts set state = 'settled', outcome = 'succeeded', settled_at = ? "
                "where id = ? and fence = ?",
                (now, attempt, fence),
            )
            conn.execute(
                "update jobs set state = 'succeeded', finished_at = ?, updated_at = ? "
                "where id = ? and fence = ?",
                (now, now, job, fence),
            )
            conn.execute("update leases set released_at = ? where attempt_id = ?", (now, attempt))
            conn.execute("commit")
            done += 1
        except sqlite3.Error as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if conn.in_transaction:
                conn.execute("rollback")
    queue.put({"done": done, "errors": errors, "end": time.monotonic()})


def measure_raw(root: Path, jobs: int, writers: int) -> dict:
    path = root / "raw.sqlite3"
    raw_setup(path, jobs)
    elapsed, reports = run_processes(raw_writer, (str(path),), writers)
    with sqlite3.connect(str(path)) as conn:
        succeeded = conn.execute("select count(*) from jobs where state = 'succeeded'").fetchone()[
            0
        ]
        dup = conn.execute(
            "select coalesce(sum(n - 1), 0) from "
            "(select count(*) n from attempts group by job_id having count(*) > 1)"
        ).fetchone()[0]
    errors = [e for r in reports for e in r["errors"]]
    return {"rate": jobs / elapsed, "dup": dup, "lost": jobs - succeeded, "errors": errors}


# ------------------------------------------------------------------------- huey


HUEY_SCRIPT = r"""
import json, multiprocessing, sys, time
from collections import Counter
from huey import SqliteHuey

cfg = json.loads(sys.argv[1])

def make():
    huey = SqliteHuey("bench", filename=cfg["db"], fsync=True, timeout=30, results=True)
    @huey.task()
    def noop(i):
        return i
    return huey, noop

def worker(barrier, queue):
    huey, _ = make()
    barrier.wait()
    done, errors = [], []
    while len(errors) < 50:
        try:
            task = huey.dequeue()
            if task is None:
                break
            huey.execute(task)
            done.append(task.args[0])
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
    queue.put({"done": done, "errors": errors, "end": time.monotonic()})

if __name__ == "__main__":
    n, k = cfg["jobs"], cfg["writers"]
    huey, noop = make()
    started = time.monotonic()
    for i in range(n):
        noop(i)
    enqueue = time.monotonic() - started
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(k + 1)
    queue = context.Queue()
    procs = [context.Process(target=worker, args=(barrier, queue)) for _ in range(k)]
    for p in procs:
        p.start()
    barrier.wait()
    started = time.monotonic()
    reports = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    elapsed = max(r["end"] for r in reports) - started
    counts = Counter(i for r in reports for i in r["done"])
    import sqlite3
    with sqlite3.connect(cfg["db"]) as conn:
        results = conn.execute("select count(*) from kv").fetchone()[0]
        left = conn.execute("select count(*) from task").fetchone()[0]
    print(json.dumps({
        "rate": n / elapsed,
        "enqueue_rate": n / enqueue,
        "dup": sum(c - 1 for c in counts.values() if c > 1),
        "lost": n - len(counts),
        "results": results,
        "left": left,
        "errors": [e for r in reports for e in r["errors"]],
    }))
"""


def measure_huey(root: Path, jobs: int, writers: int) -> dict:
    python = common.peers_python()
    if python is None:
        return {"missing": True}
    cfg = json.dumps({"db": str(root / "huey.db"), "jobs": jobs, "writers": writers})
    proc = subprocess.run(
        [python, "-c", HUEY_SCRIPT, cfg], capture_output=True, text=True, cwd=str(root)
    )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": f"exit {proc.returncode}: {last[-120:]}"}


# ------------------------------------------------------------------ commit rate


def commit_rate(root: Path, count: int) -> float:
    path = root / "commits.sqlite3"
    conn = raw_connect(str(path))
    conn.execute("create table t (id integer primary key, at real, payload text)")
    started = time.perf_counter()
    for _ in range(count):
        conn.execute("begin immediate")
        conn.execute("insert into t (at, payload) values (?, 'x')", (time.time(),))
        conn.execute("commit")
    elapsed = time.perf_counter() - started
    conn.close()
    return count / elapsed


# ------------------------------------------------------------------------- main


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--jobs", type=common.int_list, default=[500, 2000])
    parser.add_argument("--writers", type=common.int_list, default=[1, 2, 4, 8])
    parser.add_argument(
        "--commits", type=int, default=1000, help="one-row commits for the disk's rate"
    )
    args = parser.parse_args()
    common.use_project_and_say(args.project)
    print(f"reps: {args.reps}; huey: {common.peers_python() or common.NOT_INSTALLED}")
    root = Path(tempfile.mkdtemp(prefix="laneway-bench-kernel-"))
    try:
        rates = []
        for rep in range(args.reps):
            (root / f"c{rep}").mkdir()
            rates.append(commit_rate(root / f"c{rep}", args.commits))
        ceiling = common.stats(rates)[0] / LANEWAY_COMMITS_PER_JOB
        print(
            f"raw durable commits/s (1-row INSERT txn, WAL, synchronous=FULL): {common.fmt(rates)}"
        )
        print(f"laneway ceiling at {LANEWAY_COMMITS_PER_JOB} commits/job: {ceiling:.1f} jobs/s")
        for jobs in args.jobs:
            rows = []
            for writers in args.writers:
                samples: dict[str, list[dict]] = {"laneway": [], "raw sqlite3": [], "huey": []}
                for rep in range(args.reps):
                    work = root / f"j{jobs}-w{writers}-r{rep}"
                    work.mkdir()
                    for name, measure in (
                        ("laneway", measure_laneway),
                        ("raw sqlite3", measure_raw),
                        ("huey", measure_huey),
                    ):
                        (work / name[:3]).mkdir()
                        samples[name].append(measure(work / name[:3], jobs, writers))
                    shutil.rmtree(work, ignore_errors=True)
                rows += rows_for(writers, samples, ceiling)
            print()
            print(f"N = {jobs} jobs; jobs/s: median (min-max) over {args.reps} rep(s)")
            print(
                common.table(
                    ["writers", "system", "jobs/s", "% of ceiling", "dup", "lost", "errors"],
                    rows,
                    left=2,
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def rows_for(writers: int, samples: dict[str, list[dict]], ceiling: float) -> list[list[str]]:
    rows = []
    for name, runs in samples.items():
        label = {
            "laneway": f"laneway ({LANEWAY_COMMITS_PER_JOB} commits/job)",
            "raw sqlite3": f"raw sqlite3 ({RAW_COMMITS_PER_JOB} commits/job)",
            "huey": f"huey SqliteHuey ({HUEY_COMMITS_PER_JOB}+1 commits/job)",
        }[name]
        if any(r.get("missing") for r in runs):
            rows.append([str(writers), label, common.NOT_INSTALLED, "", "", "", ""])
            continue
        failed = [r["failed"] for r in runs if "failed" in r]
        good = [r for r in runs if "failed" not in r]
        if not good:
            rows.append([str(writers), label, "FAILED", "", "", "", failed[0]])
            continue
        rate = [r["rate"] for r in good]
        errors = [e for r in good for e in r["errors"]]
        error_text = str(len(errors)) + (f" e.g. {errors[0][:60]}" if errors else "")
        if failed:
            error_text += f"; {len(failed)} rep(s) FAILED: {failed[0]}"
        rows.append(
            [
                str(writers),
                label,
                common.fmt(rate),
                f"{common.stats(rate)[0] / ceiling * 100:.0f}%" if name == "laneway" else "",
                str(sum(r["dup"] for r in good)),
                str(sum(r["lost"] for r in good)),
                error_text,
            ]
        )
        if name == "huey":
            rows.append(
                [
                    "",
                    "  huey enqueue, 1 process",
                    common.fmt([r["enqueue_rate"] for r in good]),
                    "",
                    "",
                    "",
                    "",
                ]
            )
    return rows


if __name__ == "__main__":
    main()
