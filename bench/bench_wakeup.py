"""Ready-to-spawn latency of an idle worker, and what an idle worker costs the ledger.

    .venv/bin/python bench/bench_wakeup.py [--samples N] [--postgres URL] [--idle-seconds S]

One worker process (``WorkerService.serve``, one slot, poll interval 50 ms) waits idle;
this process commits a new run of one ready `true` job at a random moment and reads,
from the ledger, when the worker wrote the attempt's intent (ready -> claim) and when it
recorded the spawned supervisor (ready -> spawn, ``attempts.started_at``), counted from
the moment the run's commit returned. p50 and p99 over ``--samples`` runs, for:

- SQLite, whose watch stats the ledger files at each poll;
- PostgreSQL, whose watch LISTENs (migration 0005's trigger notifies each commit);
- PostgreSQL with the watch as it was before: the newest event id queried at each poll.

PostgreSQL runs in a scratch database made for the bench and dropped after it (skipped
if ``--postgres`` cannot be reached). Then, per watch: the statements an idle worker
sends per second (SQLAlchemy's ``before_cursor_execute``; a LISTEN connection's one
``LISTEN`` is not counted), and the cost of one ``changed()`` call (beside ``PRAGMA
data_version`` on a kept SQLite connection, the alternative to the stat).

No assertions: numbers to compare, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import _common as common
from sqlalchemy import Engine, event, select
from sqlalchemy.engine import make_url

from laneway.controller import db, ledger, ledger_open
from laneway.controller.models import Attempt
from laneway.controller.watch import ChangeWatch
from laneway.workers.service import WorkerService

POLL_SECONDS = 0.05
PLENTY = (64_000.0, 128_000.0)


class PollingWatch(ChangeWatch):
    """The PostgreSQL watch before migration 0005: the newest event id, queried at every
    call; a waiting loop sleeps its whole poll interval."""

    def changed(self) -> bool:
        with db.reader(self.engine)() as session:
            latest = ledger.latest_event_id(session)
        if latest == self._seen:
            return False
        self._seen = latest
        return True

    def wait(self, timeout: float, selector: Any = None) -> None:
        if selector is not None and selector.get_map():
            selector.select(timeout)
        else:
            time.sleep(timeout)


def config(name: str) -> Any:
    return common.one_lane_config(name, [common.NOOP_STAGE], ["i"], max_jobs=1)


def create_run(engine: Engine, runtime: Path, name: str) -> tuple[int, datetime]:
    """A run of one ready job; returns its id and when its commit returned (naive UTC)."""
    now = datetime.now(UTC).replace(tzinfo=None)
    run_id = common.create_run(db.session_factory(engine), config(name), runtime, now)
    return run_id, datetime.now(UTC).replace(tzinfo=None)


def attempt_of(engine: Engine, run_id: int) -> Any:
    with db.reader(engine)() as session:
        return session.execute(
            select(Attempt.intent_at, Attempt.started_at, Attempt.state).where(
                Attempt.run_id == run_id
            )
        ).first()


def wait_for(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.002)
    raise SystemExit(f"timed out after {timeout} s waiting for {predicate}")


# ------------------------------------------------------------------ the worker


@contextmanager
def counting(engine: Engine) -> Iterator[list[int]]:
    """Count the statements SQLAlchemy sends on ``engine`` and its read-only twin."""
    counted = [0]
    engines = {engine, db.reader(engine).kw["bind"]}

    def count(*_args: Any) -> None:
        counted[0] += 1

    for each in engines:
        event.listen(each, "before_cursor_execute", count)
    try:
        yield counted
    finally:
        for each in engines:
            event.remove(each, "before_cursor_execute", count)


def serve_worker(runtime: Path, watch: str, idle_seconds: float, out: Path) -> None:
    """The worker process: serve until SIGTERM. With ``idle_seconds``, count the
    statements sent in that long a window after a second's settling, write them to
    ``out`` and exit."""
    engine = ledger_open.open_ledger(runtime)
    service = WorkerService(engine, node="n1", slots=1, memory_probe=lambda: PLENTY)
    if watch == "poll":
        service.watch = PollingWatch(engine)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    service.start()
    if idle_seconds:
        settle = time.monotonic() + 1.0
        service.serve(lambda: time.monotonic() > settle, poll_seconds=POLL_SECONDS)
        with counting(engine) as counted:
            end = time.monotonic() + idle_seconds
            service.serve(lambda: time.monotonic() > end, poll_seconds=POLL_SECONDS)
        out.write_text(json.dumps({"statements": counted[0]}))
    else:
        out.write_text("ready")
        service.serve(lambda: bool(stopping), poll_seconds=POLL_SECONDS)
    service.drain()
    service.stop()


def start_worker(runtime: Path, env: dict[str, str], watch: str, idle: float, out: Path) -> Any:
    argv = [sys.executable, __file__, "--serve-worker", str(runtime), "--watch", watch]
    argv += ["--idle-seconds", str(idle), "--out", str(out)]
    return subprocess.Popen(argv, env=env)


# -------------------------------------------------------------------- measures


def latencies(runtime: Path, env: dict[str, str], watch: str, samples: int) -> dict[str, Any]:
    engine = ledger_open.open_ledger(runtime)
    create_run(engine, runtime, "warm-up")  # puts node n1 in the ledger
    ready = runtime / f"worker-{watch}.ready"
    worker = start_worker(runtime, env, watch, 0, ready)
    try:
        wait_for(ready.exists)
        claim: list[float] = []
        spawn: list[float] = []
        for n in range(samples):
            time.sleep(random.uniform(0.05, 0.15))  # idle, at a random point of its poll
            run_id, committed = create_run(engine, runtime, f"s{n}")
            row = wait_for(lambda run_id=run_id: (a := attempt_of(engine, run_id)) and a[1] and a)
            claim.append((row.intent_at - committed).total_seconds() * 1000)
            spawn.append((row.started_at - committed).total_seconds() * 1000)
            wait_for(lambda run_id=run_id: attempt_of(engine, run_id).state == "settled")
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        engine.dispose()
    claim.sort()
    spawn.sort()
    return {
        "claim": (common.percentile(claim, 50), common.percentile(claim, 99)),
        "spawn": (common.percentile(spawn, 50), common.percentile(spawn, 99)),
    }


def idle_rate(runtime: Path, env: dict[str, str], watch: str, seconds: float) -> float:
    out = runtime / f"idle-{watch}.json"
    start_worker(runtime, env, watch, seconds, out).wait(timeout=seconds + 60)
    return float(json.loads(out.read_text())["statements"]) / seconds


def probe_cost(runtime: Path, watch: str, calls: int = 2000) -> float:
    """Microseconds per ``changed()`` of an idle watch."""
    engine = ledger_open.open_ledger(runtime)
    probe = PollingWatch(engine) if watch == "poll" else ChangeWatch(engine)
    probe.changed()
    started = time.perf_counter()
    for _ in range(calls):
        probe.changed()
    elapsed = time.perf_counter() - started
    probe.close()
    engine.dispose()
    return elapsed / calls * 1e6


def data_version_cost(runtime: Path, calls: int = 2000) -> float:
    """Microseconds per ``PRAGMA data_version`` on a kept SQLite connection."""
    connection = sqlite3.connect(runtime / db.LEDGER_FILENAME)
    started = time.perf_counter()
    for _ in range(calls):
        connection.execute("PRAGMA data_version").fetchone()
    elapsed = time.perf_counter() - started
    connection.close()
    return elapsed / calls * 1e6


# ------------------------------------------------------------------- backends


@contextmanager
def scratch_postgres(url: str) -> Iterator[str | None]:
    """A scratch database on the server ``url`` names (None if it cannot be reached)."""
    import psycopg

    server = make_url(url).set(drivername="postgresql")
    name = f"laneway_bench_wakeup_{os.getpid()}"
    try:
        admin = psycopg.connect(server.render_as_string(hide_password=False), autocommit=True)
    except psycopg.OperationalError as exc:
        print(f"PostgreSQL skipped: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        yield None
        return
    with admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield server.set(database=name).render_as_string(hide_password=False)
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def measure(root: Path, label: str, url: str | None, watch: str, args: Any) -> dict[str, Any]:
    runtime = root / label
    runtime.mkdir()
    env = dict(os.environ)
    env.pop("LANEWAY_DATABASE_URL", None)
    if url:
        env["LANEWAY_DATABASE_URL"] = os.environ["LANEWAY_DATABASE_URL"] = url
    else:
        os.environ.pop("LANEWAY_DATABASE_URL", None)
    result = latencies(runtime, env, watch, args.samples)
    result["idle"] = idle_rate(runtime, env, watch, args.idle_seconds)
    result["probe"] = probe_cost(runtime, watch)
    if not url:
        result["data_version"] = data_version_cost(runtime)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument(
        "--postgres",
        default=os.environ.get(
            "LANEWAY_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1/postgres"
        ),
        help="a PostgreSQL server to make a scratch database on (default %(default)s)",
    )
    parser.add_argument("--serve-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--watch", default="listen", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_worker:
        serve_worker(args.serve_worker, args.watch, args.idle_seconds, args.out)
        return
    root = Path(tempfile.mkdtemp(prefix="laneway-bench-wakeup-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        results["sqlite: stat each poll"] = measure(root, "sqlite", None, "stat", args)
        with scratch_postgres(args.postgres) as url:
            if url:
                results["postgresql: LISTEN"] = measure(root, "pg-listen", url, "listen", args)
        with scratch_postgres(args.postgres) as url:
            if url:
                results["postgresql: query each poll (before)"] = measure(
                    root, "pg-poll", url, "poll", args
                )
    finally:
        shutil.rmtree(root)
    rows = []
    for label, r in results.items():
        rows.append(
            [
                label,
                f"{r['claim'][0]:.1f}",
                f"{r['claim'][1]:.1f}",
                f"{r['spawn'][0]:.1f}",
                f"{r['spawn'][1]:.1f}",
                f"{r['idle']:.1f}",
                f"{r['probe']:.1f}",
            ]
        )
    headers = ["watch", "claim p50", "p99", "spawn p50", "p99", "idle stmts/s", "changed() us"]
    print(common.table(headers, rows))
    sqlite = results["sqlite: stat each poll"]
    print(f"SQLite PRAGMA data_version on a kept connection: {sqlite['data_version']:.1f} us/call")
    print(
        f"(ms from the commit of a ready job; samples={args.samples}, worker poll "
        f"{POLL_SECONDS * 1000:.0f} ms, idle window {args.idle_seconds:.0f} s)"
    )


if __name__ == "__main__":
    main()
