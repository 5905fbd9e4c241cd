"""Stage artifacts: the store's throughput beside the floor of a verified copy, the
claim's per-job artifact cost on ledgers of 1k and 20k producer jobs, and (opt-in)
the end-to-end CPU a job pays for handing files on.

    .venv/bin/python bench/bench_artifacts.py
    (options: --sizes 1,16,128 (MiB)  --reps 3  --ledger-sizes 1000,20000  --samples 20
              --postgres postgresql://postgres@127.0.0.1:5432/postgres  --items 20,80
              --no-s3  --no-store  --e2e  --project DIR)

1. Store throughput, MiB/s, median of --reps: per file size (random bytes in $TMPDIR,
   in the page cache), `hash_file` + `ArtifactStore.put` (hash, write, read back and
   hash again; a fresh object each rep) and `artifacts.fetch` (download, hashing as it
   writes, keep only if it matches) on a local `file://` store and on a moto S3 server
   on loopback (`python -m moto.server`, reached through s3fs; skipped with a note if
   moto or s3fs is missing or --no-s3). Beside them the floor any verified copy needs:
   `hashlib.sha256` over the file + `shutil.copyfile` (and the same + fsync, since the
   local store fsyncs its objects).

2. Per-job artifact cost at two backlog sizes: a ledger (SQLite in $TMPDIR; with
   --postgres also a scratch PostgreSQL database, created and dropped; skipped if the
   server cannot be reached) holding N succeeded producer jobs (`produce`, outputs
   a.bin and b.bin: one settled attempt and 2 artifacts each) whose consumers
   (`consume` needs produce) succeeded too, each with its 2 recorded inputs, bulk-filled
   with SQLAlchemy Core executemany after `ledger.create_run`; the config's 4 items
   have their producer succeeded and their consumer ready. PostgreSQL gets ANALYZE
   after the fill (what autovacuum would do); SQLite gets none (laneway never runs it).
   Then, median (min-max) over --samples, each in a transaction rolled back afterwards:
   - `inputs_for` + `record_inputs` for one ready consumer (its intent row inserted
     first, untimed), with its SQL statements (a `before_cursor_execute` listener) and
     the query plan of each SELECT (EXPLAIN; a full scan of a table would be named);
   - `ledger.claim_jobs` for 2 slots of consumers, with its SQL statements.

3. End to end (opt-in, --e2e): in-process `WorkerService` (4 slots) + `Controller`
   ticked until the run finishes, 2-stage pipelines of `sh -c` jobs (producer writes a
   4 KiB file, consumer reads its input) with outputs, beside the same pipeline without
   (producer declares none, consumer reads nothing), at --items items, --reps runs of
   each, interleaved: wall time and CPU per job (os.times: this process and the
   children it waited for).

Part 3 is opt-in (it takes a minute). Each of its runs gets a fresh ledger path:
``db.reader`` keeps one read-only engine per ledger URL for the process's life, so a
ledger deleted and re-created at the same path would be read through the old file. No
assertions: numbers to compare.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

MIB = 1 << 20
CONFIG_ITEMS = 4
CHUNK_ITEMS = 5_000
BULK_WORKER = "bench-bulk-worker"
OUTPUTS = ["a.bin", "b.bin"]
BUCKET = "laneway-bench-artifacts"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "moto-bench-key-id",
    "AWS_SECRET_ACCESS_KEY": "moto-bench-secret-access-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# ------------------------------------------------------------- 1. store throughput


def make_file(path: Path, size: int) -> None:
    with open(path, "wb") as out:
        left = size
        while left:
            chunk = os.urandom(min(left, 8 * MIB))
            out.write(chunk)
            left -= len(chunk)


def baseline_copy(source: Path, target: Path, fsync: bool) -> None:
    """The floor of a verified copy: hash the file once, copy it once."""
    digest = hashlib.sha256()
    with open(source, "rb") as data:
        while chunk := data.read(MIB):
            digest.update(chunk)
    digest.hexdigest()
    shutil.copyfile(source, target)
    if fsync:
        with open(target, "rb") as copy:
            os.fsync(copy.fileno())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def moto_server(root: Path) -> Iterator[str | None]:
    """A moto S3 server on loopback with the bench's bucket; yields its store URL (None,
    with a printed note, when moto or s3fs is missing or it does not come up)."""
    try:
        import moto  # noqa: F401
        import s3fs
    except ImportError as exc:
        print(f"S3 skipped: {exc} (install the s3 extra and moto[server])")
        yield None
        return
    port = free_port()
    log = (root / "moto.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=log,
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    print("S3 skipped: moto server did not start (see moto.log)")
                    yield None
                    return
                time.sleep(0.1)
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
        # No region_name in client_kwargs: s3fs would send it as a location constraint,
        # which moto refuses for us-east-1 (the region comes from the environment).
        s3fs.S3FileSystem(
            key=S3_ENV["AWS_ACCESS_KEY_ID"],
            secret=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": endpoint},
        ).mkdir(BUCKET)
        yield f"s3://{BUCKET}/store"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        server.wait(timeout=30)
        log.close()


def store_round(store_url: str, source: Path, work: Path, rep: int) -> tuple[float, float, float]:
    """(put seconds, put-again seconds (object already there: read back only), fetch
    seconds) for one fresh object."""
    from laneway.controller.attempt import artifacts

    started = time.perf_counter()
    sha256, size = artifacts.hash_file(source)
    store = artifacts.ArtifactStore(store_url)
    location = store.put(artifacts.Output(source.name, source, sha256, size))
    put = time.perf_counter() - started
    started = time.perf_counter()
    artifacts.ArtifactStore(store_url).put(artifacts.Output(source.name, source, sha256, size))
    again = time.perf_counter() - started
    target = work / f"fetched-{rep}" / source.name
    started = time.perf_counter()
    artifacts.fetch(location, sha256, source.name, target)
    fetched = time.perf_counter() - started
    target.unlink()
    store.fs.rm(store._key(sha256))  # the next rep writes it again
    return put, again, fetched


def store_throughput(root: Path, sizes_mib: list[int], reps: int, s3: bool) -> list[list[str]]:
    rows: list[list[str]] = []
    work = root / "store"
    work.mkdir()
    local_url = (work / "objects").resolve().as_uri()

    def rate(size: int, seconds: list[float]) -> str:
        return common.fmt([size / MIB / s for s in seconds], 0)

    with moto_server(root) if s3 else _none() as s3_url:
        for size_mib in sizes_mib:
            size = size_mib * MIB
            # Different random bytes per rep: every put writes a new object.
            sources = []
            for rep in range(reps):
                source = work / f"src-{size_mib}-{rep}" / "data.bin"
                source.parent.mkdir()
                make_file(source, size)
                sources.append(source)
            floor, floor_sync = [], []
            for rep, source in enumerate(sources):
                copy = work / f"copy-{rep}"
                started = time.perf_counter()
                baseline_copy(source, copy, fsync=False)
                floor.append(time.perf_counter() - started)
                copy.unlink()
                started = time.perf_counter()
                baseline_copy(source, copy, fsync=True)
                floor_sync.append(time.perf_counter() - started)
                copy.unlink()
            label = f"{size_mib} MiB"
            rows.append([label, "floor: sha256 + shutil.copyfile", rate(size, floor), "", "", ""])
            rows.append(
                ["", "floor: sha256 + copyfile + fsync", rate(size, floor_sync), "", "", ""]
            )
            stores = [("file://", local_url)] + (
                [("s3 (moto, loopback)", s3_url)] if s3_url else []
            )
            for name, url in stores:
                puts, agains, fetches = [], [], []
                for rep, source in enumerate(sources):
                    put, again, fetched = store_round(url, source, work, rep)
                    puts.append(put)
                    agains.append(again)
                    fetches.append(fetched)
                rows.append(
                    [
                        "",
                        name,
                        "",
                        rate(size, puts),
                        rate(size, agains),
                        rate(size, fetches),
                    ]
                )
            for source in sources:
                shutil.rmtree(source.parent)
            print(f"  store: {size_mib} MiB done", flush=True)
    return rows


@contextmanager
def _none() -> Iterator[None]:
    yield None


# ------------------------------------------------------- 2. per-job cost at N jobs


class Recorder:
    """Counts statements (and keeps them while ``keep``) on every Engine."""

    def __init__(self) -> None:
        self.count = 0
        self.keep = False
        self.kept: list[tuple[str, object]] = []

    def __call__(self, conn, cursor, statement, parameters, context, executemany) -> None:
        self.count += 1
        if self.keep:
            self.kept.append((statement, parameters))


def ledger_config(items: int):
    stages = [
        {"name": "produce", "argv": ["true"], "timeout_seconds": 60, "outputs": OUTPUTS},
        {
            "name": "consume",
            "argv": ["cat", "{inputs.produce}/a.bin"],
            "timeout_seconds": 60,
            "needs": ["produce"],
        },
    ]
    keys = (f"c{n}" for n in range(items))
    return common.one_lane_config("bench-artifacts", stages, keys, max_jobs=4)


def attempt_row(run_id: int, job_id: int, runtime: Path, when, **extra) -> dict:
    return common.settled_attempt_row(run_id, job_id, runtime, BULK_WORKER, when, **extra)


def artifact_rows(run_id: int, job_id: int, attempt_id: int, when) -> list[dict]:
    rows = []
    for name in OUTPUTS:
        sha = hashlib.sha256(f"{run_id}/{job_id}/{name}".encode()).hexdigest()
        rows.append(
            {
                "run_id": run_id,
                "job_id": job_id,
                "attempt_id": attempt_id,
                "stage": "produce",
                "node": "n1",
                "created_at": when,
                "name": name,
                "sha256": sha,
                "size_bytes": 4096,
                "location": f"file:///bench/store/sha256/{sha[:2]}/{sha}",
            }
        )
    return rows


def build(runtime: Path, size: int) -> dict:
    """A ledger of ``size`` succeeded producers (2 artifacts each); returns what the
    measurements need."""
    from sqlalchemy import insert, select, update

    from laneway.controller import db
    from laneway.controller.clock import SystemClock
    from laneway.controller.ledger.tables import (
        artifacts,
        attempt_inputs,
        attempts,
        items,
        jobs,
        workers,
    )

    started = time.perf_counter()
    now = SystemClock().now()
    engine, _, run_id = common.open_with_run(runtime, ledger_config(CONFIG_ITEMS), now)
    earlier = now - timedelta(hours=1)
    with engine.begin() as conn:
        conn.execute(
            insert(workers),
            [common.stopped_worker_row(BULK_WORKER, earlier)],
        )
        # The config's items: producer succeeded (attempt + artifacts), consumer ready.
        config_jobs = conn.execute(
            select(jobs.c.id, jobs.c.stage).where(jobs.c.run_id == run_id)
        ).all()
        producers = [job_id for job_id, stage in config_jobs if stage == "produce"]
        conn.execute(
            update(jobs)
            .where(jobs.c.id.in_(producers))
            .values(
                state="succeeded", fence=1, attempt_count=1, finished_at=earlier, updated_at=earlier
            )
        )
        conn.execute(
            update(jobs)
            .where(jobs.c.run_id == run_id, jobs.c.stage == "consume")
            .values(state="ready", updated_at=earlier)
        )
        conn.execute(
            insert(attempts), [attempt_row(run_id, j, runtime, earlier) for j in producers]
        )
        made = conn.execute(
            select(attempts.c.id, attempts.c.job_id).where(attempts.c.job_id.in_(producers))
        ).all()
        conn.execute(
            insert(artifacts),
            [
                r
                for attempt_id, job_id in made
                for r in artifact_rows(run_id, job_id, attempt_id, earlier)
            ],
        )
        ready = sorted(job_id for job_id, stage in config_jobs if stage == "consume")
        # The bulk: items whose producer and consumer both succeeded.
        extra = max(0, size - CONFIG_ITEMS)
        for first in range(0, extra, CHUNK_ITEMS):
            positions = range(CONFIG_ITEMS + first, CONFIG_ITEMS + min(extra, first + CHUNK_ITEMS))
            conn.execute(insert(items), common.bulk_item_rows(run_id, positions))
            item_ids = (
                conn.execute(
                    select(items.c.id).where(
                        items.c.run_id == run_id,
                        items.c.position >= positions[0],
                        items.c.position <= positions[-1],
                    )
                )
                .scalars()
                .all()
            )
            conn.execute(
                insert(jobs),
                [
                    {
                        "run_id": run_id,
                        "item_id": item_id,
                        "stage": stage,
                        "stage_position": stage_position,
                        "lane": "a",
                        "state": "succeeded",
                        "fence": 1,
                        "attempt_count": 1,
                        "created_at": earlier,
                        "updated_at": earlier,
                        "finished_at": earlier,
                    }
                    for item_id in item_ids
                    for stage_position, stage in enumerate(("produce", "consume"))
                ],
            )
            low, high = min(item_ids), max(item_ids)
            job_rows = conn.execute(
                select(jobs.c.id, jobs.c.item_id, jobs.c.stage).where(
                    jobs.c.run_id == run_id, jobs.c.item_id >= low, jobs.c.item_id <= high
                )
            ).all()
            conn.execute(
                insert(attempts),
                [attempt_row(run_id, job_id, runtime, earlier) for job_id, _, _ in job_rows],
            )
            low_job, high_job = min(r[0] for r in job_rows), max(r[0] for r in job_rows)
            attempt_of = dict(
                conn.execute(
                    select(attempts.c.job_id, attempts.c.id).where(
                        attempts.c.job_id >= low_job, attempts.c.job_id <= high_job
                    )
                ).all()
            )
            produced = {
                item_id: job_id for job_id, item_id, stage in job_rows if stage == "produce"
            }
            conn.execute(
                insert(artifacts),
                [
                    row
                    for job_id in produced.values()
                    for row in artifact_rows(run_id, job_id, attempt_of[job_id], earlier)
                ],
            )
            stored = conn.execute(
                select(
                    artifacts.c.id,
                    artifacts.c.job_id,
                    artifacts.c.name,
                    artifacts.c.sha256,
                    artifacts.c.size_bytes,
                ).where(artifacts.c.job_id >= low_job, artifacts.c.job_id <= high_job)
            ).all()
            by_producer: dict[int, list] = {}
            for row in stored:
                by_producer.setdefault(row.job_id, []).append(row)
            conn.execute(
                insert(attempt_inputs),
                [
                    {
                        "attempt_id": attempt_of[job_id],
                        "artifact_id": art.id,
                        "stage": "produce",
                        "name": art.name,
                        "sha256": art.sha256,
                        "size_bytes": art.size_bytes,
                        "node": "n1",
                        "created_at": earlier,
                    }
                    for job_id, item_id, stage in job_rows
                    if stage == "consume"
                    for art in by_producer[produced[item_id]]
                ],
            )
    if not db.is_sqlite(engine):
        with engine.begin() as conn:  # committed: a rolled-back ANALYZE leaves no stats
            conn.exec_driver_sql("ANALYZE")
    with engine.connect() as conn:
        counts = {
            name: conn.exec_driver_sql(f"SELECT count(*) FROM {name}").scalar_one()
            for name in ("jobs", "attempts", "artifacts", "attempt_inputs")
        }
    return {
        "engine": engine,
        "run_id": run_id,
        "ready": ready,
        "counts": counts,
        "build_s": time.perf_counter() - started,
    }


def intent(session, run_id: int, job_id: int, runtime: Path) -> int:
    from laneway.controller.clock import SystemClock
    from laneway.controller.ledger import statements

    return session.execute(
        statements.INSERT_ATTEMPT,
        attempt_row(
            run_id,
            job_id,
            runtime,
            SystemClock().now(),
            state="intent",
            outcome=None,
            started_at=None,
            settled_at=None,
            exit_code=None,
            idempotency_key=f"lw-bench-{job_id}-{time.perf_counter_ns()}",
        ),
    ).scalar_one()


def measure_lookup(engine, info: dict, runtime: Path, recorder: Recorder, explain: bool) -> tuple:
    """(seconds, statements, inputs given, scans) of inputs_for + record_inputs."""
    from laneway.controller import db
    from laneway.controller.clock import SystemClock
    from laneway.controller.ledger import artifacts as artifact_ledger

    job_id = info["ready"][0]
    session = db.session_factory(engine)()
    try:
        session.begin()
        attempt_id = intent(session, info["run_id"], job_id, runtime)
        recorder.count = 0
        recorder.keep = explain
        recorder.kept = []
        started = time.perf_counter()
        inputs, problems = artifact_ledger.inputs_for(
            session, job_id=job_id, needs_outputs=["produce"]
        )
        artifact_ledger.record_inputs(
            session, attempt_id, inputs, node="n1", now=SystemClock().now()
        )
        elapsed = time.perf_counter() - started
        statements = recorder.count
        recorder.keep = False
        scans = plans(session, recorder.kept, db.is_sqlite(engine)) if explain else []
    finally:
        session.rollback()
        session.close()
    return elapsed, statements, len(inputs) if not problems else -1, scans


def plans(session, kept: list, sqlite: bool) -> list[str]:
    """The tables a SELECT among ``kept`` reads by a full scan (EXPLAIN)."""
    scans: list[str] = []
    conn = session.connection()
    for statement, parameters in kept:
        if not statement.lstrip().upper().startswith("SELECT"):
            continue
        if sqlite:
            lines = [
                row[-1]
                for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            ]
            scans += [line for line in lines if line.startswith("SCAN ")]
        else:
            lines = [row[0] for row in conn.exec_driver_sql("EXPLAIN " + statement, parameters)]
            scans += [
                "Seq Scan on " + line.split("Seq Scan on ", 1)[1].split()[0]
                for line in lines
                if "Seq Scan on " in line
            ]
    return scans


def measure_claim(engine, recorder: Recorder) -> tuple[float, int, int, list[int]]:
    elapsed, statements, claims = common.rolled_back_claim(engine, recorder)
    return elapsed, statements, len(claims), [len(c.inputs) for c in claims]


def measure_ledger(root: Path, backend: str, size: int, samples: int) -> list[list[str]]:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    runtime = root / f"ledger-{backend}-{size}"
    info = build(runtime, size)
    engine = info["engine"]
    recorder = Recorder()
    event.listen(Engine, "before_cursor_execute", recorder)
    try:
        measure_lookup(engine, info, runtime, recorder, explain=False)  # warm-up
        lookups = [measure_lookup(engine, info, runtime, recorder, False) for _ in range(samples)]
        scans = measure_lookup(engine, info, runtime, recorder, explain=True)[3]
        measure_claim(engine, recorder)  # warm-up
        claims = [measure_claim(engine, recorder) for _ in range(samples)]
    finally:
        event.remove(Engine, "before_cursor_execute", recorder)
    engine.dispose()
    counts = info["counts"]
    print(
        f"  {backend} N={size}: built in {info['build_s']:.1f} s ({counts['jobs']} jobs, "
        f"{counts['attempts']} attempts, {counts['artifacts']} artifacts, "
        f"{counts['attempt_inputs']} attempt_inputs)",
        flush=True,
    )
    given = {lookup[2] for lookup in lookups}
    claimed = {(c[2], tuple(c[3])) for c in claims}
    return [
        [
            backend,
            str(size),
            "inputs_for + record_inputs, 1 job",
            common.fmt([lookup[0] * 1000 for lookup in lookups], 3),
            common.fmt([lookup[1] for lookup in lookups], 0),
            f"inputs {'/'.join(map(str, sorted(given)))}; "
            + ("plans: no full scan" if not scans else "FULL SCAN: " + "; ".join(scans)),
        ],
        [
            "",
            "",
            "claim_jobs, 2 slots (rolled back)",
            common.fmt([c[0] * 1000 for c in claims], 2),
            common.fmt([c[1] for c in claims], 0),
            "; ".join(f"claimed {n}, inputs {list(i)}" for n, i in sorted(claimed)),
        ],
    ]


@contextmanager
def scratch_postgres(url: str, label: str) -> Iterator[str | None]:
    """A scratch database on the server ``url`` names (None if it cannot be reached)."""
    import psycopg
    from sqlalchemy.engine import make_url

    server = make_url(url).set(drivername="postgresql")
    name = f"laneway_bench_artifacts_{os.getpid()}_{label}"
    try:
        admin = psycopg.connect(server.render_as_string(hide_password=False), autocommit=True)
    except psycopg.OperationalError as exc:
        print(f"PostgreSQL skipped: {str(exc).strip().splitlines()[0]}")
        yield None
        return
    with admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield (
                server.set(drivername="postgresql+psycopg", database=name).render_as_string(
                    hide_password=False
                )
            )
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def ledger_costs(root: Path, sizes: list[int], samples: int, postgres: str | None) -> list:
    rows = []
    os.environ.pop("LANEWAY_DATABASE_URL", None)
    for size in sizes:
        rows += measure_ledger(root, "sqlite", size, samples)
    if postgres:
        for size in sizes:
            with scratch_postgres(postgres, str(size)) as url:
                if url is None:
                    break
                os.environ["LANEWAY_DATABASE_URL"] = url
                try:
                    rows += measure_ledger(root, "postgresql", size, samples)
                finally:
                    os.environ.pop("LANEWAY_DATABASE_URL", None)
    return rows


# ----------------------------------------------------------------- 3. end to end


def e2e_config(items: int, outputs: bool):

    produce = {
        "name": "produce",
        "argv": ["sh", "-c", "head -c 4096 /dev/urandom > a.bin"],
        "timeout_seconds": 60,
    }
    consume = {"name": "consume", "timeout_seconds": 60, "needs": ["produce"]}
    if outputs:
        produce["outputs"] = ["a.bin"]
        consume["argv"] = ["sh", "-c", 'cat "$1" > /dev/null', "sh", "{inputs.produce}/a.bin"]
    else:
        consume["argv"] = ["sh", "-c", "cat /dev/null > /dev/null", "sh", "none"]
    keys = (f"i{n}" for n in range(items))
    return common.one_lane_config("bench-artifacts-e2e", [produce, consume], keys, max_jobs=4)


def end_to_end(root: Path, items: int, outputs: bool) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, succeeded attempts, artifacts) of one run."""
    from sqlalchemy import func, select

    from laneway.controller.daemon import Controller
    from laneway.controller.ledger.tables import artifacts, attempts, jobs
    from laneway.controller.models import Run
    from laneway.workers.service import WorkerService

    # A fresh path per run: db.reader keeps one read-only engine per ledger URL for the
    # process's life, so a ledger deleted and re-created at the same path would be read
    # through the old file's open connection.
    runtime = root / f"e2e-{items}-{'outputs' if outputs else 'plain'}-{uuid.uuid4().hex[:8]}"
    engine, factory, run_id = common.open_with_run(runtime, e2e_config(items, outputs))
    cpu_before = os.times()
    started = time.perf_counter()
    service = WorkerService(engine, node="n1", slots=4, memory_probe=lambda: (64e3, 128e3))
    service.start()
    controller = Controller(engine, snapshot_seconds=3600)
    deadline = time.monotonic() + 120
    finished = False
    while time.monotonic() < deadline:
        report = service.tick()
        controller.tick()
        with factory() as session:
            if session.get(Run, run_id).state == "finished":
                finished = True
                break
        if not (report.claimed or report.settled):
            time.sleep(0.005)
    if not finished:
        with factory() as session:
            states = session.execute(
                select(jobs.c.state, func.count())
                .where(jobs.c.run_id == run_id)
                .group_by(jobs.c.state)
            ).all()
        print(f"  e2e: run {runtime.name} not finished after 120 s: jobs {dict(states)}; {report}")
    service.stop()
    elapsed = time.perf_counter() - started
    cpu_after = os.times()
    cpu = sum(cpu_after[:4]) - sum(cpu_before[:4])
    with factory() as session:
        succeeded = session.execute(
            select(func.count())
            .select_from(attempts)
            .where(attempts.c.run_id == run_id, attempts.c.outcome == "succeeded")
        ).scalar_one()
        stored = session.execute(
            select(func.count()).select_from(artifacts).where(artifacts.c.run_id == run_id)
        ).scalar_one()
    engine.dispose()
    shutil.rmtree(runtime, ignore_errors=True)
    return elapsed, cpu, succeeded, stored


def e2e_rows(root: Path, item_counts: list[int], reps: int) -> list[list[str]]:
    os.environ.pop("LANEWAY_DATABASE_URL", None)
    rows = []
    for items in item_counts:
        runs: dict[bool, list[tuple[float, float, int, int]]] = {False: [], True: []}
        for _ in range(reps):  # interleaved, so a change of load hits both alike
            for outputs in (False, True):
                runs[outputs].append(end_to_end(root, items, outputs))
        jobs = 2 * items
        for outputs in (False, True):
            done = runs[outputs]
            rows.append(
                [
                    str(items) if not outputs else "",
                    "with outputs (1 file, 4 KiB)" if outputs else "no outputs (baseline)",
                    common.fmt([r[0] for r in done], 2),
                    common.fmt([r[1] / jobs * 1000 for r in done], 1),
                    f"{min(r[2] for r in done)}/{jobs} succeeded, "
                    f"{min(r[3] for r in done)} artifacts",
                ]
            )
        print(f"  e2e: {items} items done", flush=True)
    return rows


# ------------------------------------------------------------------------- main


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--sizes", type=common.int_list, default=[1, 16, 128], help="file sizes in MiB"
    )
    parser.add_argument(
        "--ledger-sizes",
        type=common.int_list,
        default=[1000, 20_000],
        help="succeeded producer jobs in the ledger (default 1000,20000)",
    )
    parser.add_argument(
        "--samples", type=int, default=20, help="samples of each ledger measurement"
    )
    parser.add_argument(
        "--postgres",
        default=None,
        help="a PostgreSQL server URL to measure it too (a scratch database is made)",
    )
    parser.add_argument("--items", type=common.int_list, default=[20, 80])
    parser.add_argument("--no-s3", action="store_true", help="skip the moto S3 store")
    parser.add_argument("--no-store", action="store_true", help="skip part 1")
    parser.add_argument("--e2e", action="store_true", help="run part 3 (opt-in)")
    args = parser.parse_args()
    common.use_project_and_say(args.project)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    root = Path(tempfile.mkdtemp(prefix="laneway-bench-artifacts-"))
    try:
        if not args.no_store:
            store = store_throughput(root, args.sizes, args.reps, not args.no_s3)
            print()
            print(f"store throughput, MiB/s: median (min-max) of {args.reps} reps")
            print(
                common.table(
                    ["size", "store", "floor", "put", "put, already stored", "fetch"],
                    store,
                    left=2,
                )
            )
        rows = ledger_costs(root, args.ledger_sizes, args.samples, args.postgres)
        print()
        print(f"per-job artifact cost by ledger size: median (min-max) of {args.samples}")
        print(
            common.table(
                ["backend", "producers", "operation", "ms", "SQL statements", "note"],
                rows,
                left=3,
            )
        )
        if args.e2e:
            e2e = e2e_rows(root, args.items, args.reps)
            print()
            print(
                f"end to end, in-process WorkerService (4 slots) + Controller, 2 jobs per "
                f"item: median (min-max) of {args.reps} runs"
            )
            print(common.table(["items", "pipeline", "wall s", "CPU ms/job", "note"], e2e, left=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
