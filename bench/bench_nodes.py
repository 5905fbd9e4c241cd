"""End to end on PostgreSQL: one worker beside two nodes of two workers each, and SQLite's
one worker beside them, with real processes (`laneway controller`, `laneway worker`,
supervisors, jobs).

    .venv/bin/python bench/bench_nodes.py [--jobs 2000] [--reps 2] [--slots 2]
        [--postgres postgresql://postgres@127.0.0.1:5432/postgres] [--project DIR]

Each case starts a run of ``--jobs`` no-op jobs (`true`) with `laneway start-pipeline
--no-controller`, then one `laneway controller` and the case's workers, each with
``--slots`` slots and a runtime dir of its own (a simulated machine), and stops them
(TERM, waited for) once every job has succeeded:

- ``sqlite, 1 worker``: the SQLite file ledger, node n1, one worker;
- ``postgres, 1 worker``: a scratch PostgreSQL database, node n1, one worker;
- ``postgres, 2 nodes x 2 workers``: the same run split over lanes on nodes n1 and n2
  (``max_jobs`` twice ``--slots``), two workers per node, each with ``--slots``.

Per case: jobs/s over the ledger's span (first intent to last settle), the ratio to the
case measured first in the same rep, CPU ms per job of laneway's process tree (this
process is a child subreaper: every worker, controller, launcher, supervisor and job is
reaped into its ``RUSAGE_CHILDREN``; the database server is not a child, so its CPU is
not in it), of which the controller's and the workers' own (each process's user and
system time read before it is stopped; its launcher, supervisors and jobs are not in
it), the database server's apart (the growth of every ``postgres`` process's user and
system time on this machine over the case, read before the workers stop: its backends,
WAL writer and checkpointer; a backend that ended meanwhile is lost, and the SQLite
case shows the idle server's noise), the share of the whole machine's CPU that was
busy during the case (all processes, the server's included: ``/proc/stat``) and the
1-minute load average before it. Duplicates (attempts beyond one per job) and jobs not
succeeded are checked. The cases are interleaved per rep. The server's autovacuum
setting is printed first (with it off, statistics go stale during a case). No
assertions: numbers to compare.

The issue's target for the PostgreSQL rows: two nodes of two workers at 1.6 times one
worker's rate or more, and one worker at 0.8 times SQLite's or more. On a machine whose
cores are all busy with the one-worker case already, more workers can only take turns.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def write_config(directory: Path, jobs: int, nodes: int, slots: int, workers: int) -> Path:
    """``jobs`` items of one no-op stage, dealt round-robin over a lane per node."""
    lines = ['name = "bench-nodes"', ""]
    for n in range(1, nodes + 1):
        lines += ["[[nodes]]", f'name = "n{n}"', "memory_floor_mib = 0"]
        lines += [f"max_jobs = {slots * workers}", ""]
        lines += ["[[lanes]]", f'name = "l{n}"', f'node = "n{n}"', ""]
    lines += ["[[stages]]", 'name = "noop"', 'argv = ["true"]', "timeout_seconds = 60", ""]
    for i in range(jobs):
        lines += ["[[items]]", f'key = "i{i}"', f'lane = "l{i % nodes + 1}"']
    path = directory / "pipeline.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def ledger_counts(url: str) -> tuple[int, int, int, float | None]:
    """(succeeded jobs, attempts, distinct jobs attempted, span seconds)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as connection:
            succeeded = connection.execute(
                text("SELECT COUNT(*) FROM jobs WHERE state = 'succeeded'")
            ).scalar_one()
            attempts, distinct = connection.execute(
                text("SELECT COUNT(*), COUNT(DISTINCT job_id) FROM attempts")
            ).one()
            first, last = connection.execute(
                text("SELECT MIN(intent_at), MAX(settled_at) FROM attempts")
            ).one()
    finally:
        engine.dispose()
    span = None
    if first is not None and last is not None:
        first = datetime.fromisoformat(str(first))
        last = datetime.fromisoformat(str(last))
        span = (last - first).total_seconds()
    return int(succeeded), int(attempts), int(distinct), span


def own_cpu(processes: list[subprocess.Popen[bytes]]) -> float:
    """The user + system seconds the processes have used themselves (not their children)."""
    import psutil

    total = 0.0
    for process in processes:
        try:
            times = psutil.Process(process.pid).cpu_times()
        except psutil.NoSuchProcess:
            return float("nan")
        total += times.user + times.system
    return total


def server_cpu() -> float:
    """The user + system seconds of every PostgreSQL server process on this machine (its
    backends, WAL writer, checkpointer...): what the ledger's server spends, which no
    harness of ours can reap. Processes that ended meanwhile are lost: a case's backends
    are read before its workers stop."""
    import psutil

    total = 0.0
    for process in psutil.process_iter(["name", "cpu_times"]):
        times = process.info["cpu_times"]
        if process.info["name"] in ("postgres", "postmaster") and times is not None:
            total += times.user + times.system
    return total


def server_setting(url: str, name: str) -> str:
    """A setting of the PostgreSQL server (``SHOW``). Autovacuum matters here: with it
    off, no statistics are gathered during a case and the prepared statements keep the
    plans made while the tables were nearly empty (docs/performance.md)."""
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as connection:
        row = connection.execute(f"SHOW {name}").fetchone()
    return "?" if row is None else str(row[0])


def run_case(
    project: Path, root: Path, url: str, *, jobs: int, nodes: int, workers: int, slots: int
) -> dict[str, Any]:
    prefix, env, cwd = common.laneway_cli(project)
    env = {**env, "LANEWAY_DATABASE_URL": url}
    config = write_config(root, jobs, nodes, slots, workers)
    runtime = root / "runtime"
    subprocess.run(
        [*prefix, "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"],
        env=env,
        cwd=cwd,
        check=True,
        capture_output=True,
    )
    load = os.getloadavg()[0]
    ticks = common.machine_ticks()
    cpu0 = children_cpu()
    server0 = server_cpu()
    started = time.monotonic()
    log = open(root / "processes.log", "ab")  # closed in the finally below
    processes = [
        subprocess.Popen(
            [*prefix, "controller", "--runtime-dir", str(runtime)],
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=log,
        )
    ]
    for n in range(1, nodes + 1):
        for w in range(workers):
            machine = root / f"n{n}-w{w}"  # a runtime dir per simulated machine
            processes.append(
                subprocess.Popen(
                    [
                        *prefix,
                        "worker",
                        "--node",
                        f"n{n}",
                        *("--slots", str(slots)),
                        *("--runtime-dir", str(machine)),
                    ],
                    env=env,
                    cwd=cwd,
                    stdout=log,
                    stderr=log,
                )
            )
    own = {"controller": float("nan"), "workers": float("nan"), "server": float("nan")}
    try:
        while ledger_counts(url)[0] < jobs:
            if any(p.poll() is not None for p in processes):
                break
            time.sleep(0.5)
        # Each service's own CPU (its launcher, supervisors and jobs are not in it; the
        # tree's total is), read before the stop: where a backend's cost per job goes.
        own = {
            "controller": own_cpu(processes[:1]),
            "workers": own_cpu(processes[1:]),
            "server": server_cpu() - server0,
        }
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
        common.reap_orphans()
    wall = time.monotonic() - started
    succeeded, attempts, distinct, span = ledger_counts(url)
    return {
        "ok": succeeded == jobs and attempts == jobs,
        "check": f"{succeeded} ok, {attempts - distinct} dup",
        "rate": jobs / span if span else float("nan"),
        "cpu": (children_cpu() - cpu0) / jobs,
        "controller_cpu": own["controller"] / jobs,
        "workers_cpu": own["workers"] / jobs,
        "server_cpu": own["server"] / jobs,
        "busy": common.machine_busy(ticks, common.machine_ticks()),
        "load": load,
        "wall": wall,
    }


def main() -> None:
    parser = common.parser(__doc__ or "")
    parser.set_defaults(reps=2)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--slots", type=int, default=2, help="per worker (default 2)")
    parser.add_argument("--postgres", default=PG_DEFAULT, help="a server for scratch databases")
    args = parser.parse_args()
    project = common.use_project_and_say(args.project)
    common.become_subreaper()
    os.environ["LANEWAY_TEST_POSTGRES_URL"] = args.postgres
    from tests import backends

    print(f"PostgreSQL: autovacuum {server_setting(args.postgres, 'autovacuum')}", flush=True)
    cases = [
        ("sqlite, 1 worker", "sqlite", 1, 1),
        ("postgres, 1 worker", "postgres", 1, 1),
        ("postgres, 2 nodes x 2 workers", "postgres", 2, 2),
    ]
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in cases}
    for _ in range(args.reps):
        for label, backend, nodes, workers in cases:
            with tempfile.TemporaryDirectory(prefix="laneway-bench-nodes-") as scratch:
                root = Path(scratch)
                name = None
                if backend == "sqlite":
                    url = f"sqlite:///{root / 'runtime' / 'ledger.sqlite3'}"
                else:
                    name = backends.create_database()
                    url = backends.database_url(name)
                try:
                    found = run_case(
                        project,
                        root,
                        url,
                        jobs=args.jobs,
                        nodes=nodes,
                        workers=workers,
                        slots=args.slots,
                    )
                finally:
                    if name is not None:
                        backends.drop_database(name)
            samples[label].append(found)
            print(
                f"  {label}: {found['rate']:.1f} jobs/s, {found['cpu'] * 1000:.2f} CPU ms/job "
                f"(controller {found['controller_cpu'] * 1000:.2f}, "
                f"workers {found['workers_cpu'] * 1000:.2f}; "
                f"database server {found['server_cpu'] * 1000:.2f}), "
                f"machine {found['busy'] * 100:.0f} % busy, {found['check']}",
                flush=True,
            )
    backends.drop_template()
    base = [s["rate"] for s in samples[cases[1][0]]]  # PostgreSQL, one worker
    sqlite = [s["rate"] for s in samples[cases[0][0]]]
    rows = []
    for label, *_ in cases:
        got = samples[label]
        rates = [s["rate"] for s in got]
        rows.append(
            [
                label,
                common.fmt(rates, 1),
                common.fmt([r / b for r, b in zip(rates, base, strict=True)], 2),
                common.fmt([r / s for r, s in zip(rates, sqlite, strict=True)], 2),
                common.fmt([s["cpu"] * 1000 for s in got], 2),
                common.fmt([s["controller_cpu"] * 1000 for s in got], 2),
                common.fmt([s["workers_cpu"] * 1000 for s in got], 2),
                common.fmt([s["server_cpu"] * 1000 for s in got], 2),
                common.fmt([s["busy"] * 100 for s in got], 0),
                ", ".join(f"{s['load']:.1f}" for s in got),
                "; ".join(s["check"] for s in got),
            ]
        )
    print(
        f"\n{args.jobs} no-op jobs, {args.slots} slots per worker; median (min-max) over "
        f"{args.reps} reps"
    )
    header = ["case", "jobs/s", "vs postgres 1 worker", "vs sqlite", "CPU ms/job"]
    header += ["controller ms/job", "workers ms/job", "server ms/job"]
    print(common.table([*header, "machine busy %", "load", "check"], rows))


if __name__ == "__main__":
    main()
