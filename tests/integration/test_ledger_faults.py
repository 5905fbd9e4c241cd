"""The ledger's clock and its transient failures, with real workers, supervisors and a
real PostgreSQL server: a node whose clock is ten minutes off changes nothing; a
connection killed in the middle of a transaction, a server that restarts, a server
that refuses writes (as after a failover) and SQLite busy past its timeout are retried
with backoff; a worker cut off from the ledger for longer than its lease stops claiming,
keeps its attempt under its supervisor, and is revoked when it comes back. Nothing runs
twice (each job appends one line to a side-effect file per real run)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, select

from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Event, Lease, Run
from laneway.workers.service import WorkerService
from tests import backends
from tests.integration.test_worker import PLENTY
from tests.support import GATE_BOUND, PY, escape, make_config, wait_for_file, wait_until
from tests.tcp_proxy import Proxy

pytestmark = pytest.mark.slow

JOB = """
import os, pathlib, sys, time
side, release = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
with side.open("a") as f:
    f.write(os.environ["LANEWAY_IDEMPOTENCY_KEY"] + "\\n")
""" + wait_for_file("str(release)")


def postgres_only(backend: str, why: str) -> None:
    if backend != "postgres":
        pytest.skip(f"PostgreSQL only: {why}")


class SkewedClock:
    """The host clock, ``offset`` seconds off (a node whose NTP broke)."""

    def __init__(self, offset: float) -> None:
        self.offset = timedelta(seconds=offset)

    def now(self) -> datetime:
        return SystemClock().now() + self.offset


class Rig:
    """A run of ``items`` jobs that each log one side effect and wait for a release
    file, and workers serving node n1 in threads (their supervisors are real processes)."""

    def __init__(self, tmp_path: Path, runtime: Path, engine, items: int = 1) -> None:
        self.tmp = tmp_path
        self.runtime = runtime
        self.engine = engine
        self.factory = db.session_factory(engine)
        self.side = tmp_path / "side-effects.log"
        self.release = tmp_path / "release"
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        self.errors: list[str] = []
        config = make_config(
            [
                {
                    "name": "paid",
                    "argv": [PY, "-c", escape(JOB), "{item}", str(self.side), str(self.release)],
                    "timeout_seconds": GATE_BOUND,
                }
            ],
            items=items,
        )
        with db.transaction(self.factory) as session:
            self.run_id = ledger.create_run(
                session,
                config,
                runtime_dir=str(runtime),
                source_hashes={},
                actor="test",
                now=SystemClock().now(),
            ).id

    def worker(self, engine=None, **options) -> WorkerService:
        service = WorkerService(
            engine or self.engine, node="n1", slots=4, memory_probe=lambda: PLENTY, **options
        )
        service.on_ledger_error = self.errors.append
        service.start()
        return service

    def serve(self, service: WorkerService) -> threading.Event:
        stop = threading.Event()
        thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
        thread.start()
        self.threads.append((thread, stop))
        return stop

    def attempts(self) -> list[Attempt]:
        with self.factory() as session:
            return list(session.scalars(select(Attempt).order_by(Attempt.id)))

    def side_effects(self) -> list[str]:
        return self.side.read_text().split() if self.side.exists() else []

    def running(self, count: int = 1, tick: Callable[[], object] | None = None) -> list[Attempt]:
        """Wait until ``count`` side effects happened and an attempt is running (calling
        ``tick`` each look, for a worker that is not served by a thread)."""

        def look() -> list[Attempt]:
            if tick is not None:
                tick()
            if len(self.side_effects()) != count:
                return []
            return [a for a in self.attempts() if a.state == "running"]

        return wait_until(look)

    def settled(self) -> list[Attempt]:
        return wait_until(
            lambda: (
                (found := self.attempts()) and all(a.state == "settled" for a in found) and found
            )
        )

    def stop(self) -> None:
        self.release.touch()
        for thread, stop in self.threads:
            stop.set()
            thread.join(timeout=60)


@pytest.fixture
def rig(tmp_path, runtime, engine) -> Iterator[Rig]:
    made = Rig(tmp_path, runtime, engine)
    yield made
    made.stop()


# -- the ledger's clock ----------------------------------------------------------------


@pytest.mark.parametrize("skew", [600, -600], ids=["ahead", "behind"])
def test_a_worker_whose_clock_is_ten_minutes_off_changes_nothing(rig, ledger_backend, skew):
    postgres_only(
        ledger_backend, "on SQLite every process runs on the one host whose clock is the ledger's"
    )
    worker = rig.worker(clock=SkewedClock(skew), lease_seconds=30)
    controller = Controller(rig.engine, clock=SkewedClock(-skew), lost_after_seconds=30)
    (attempt,) = rig.running(tick=worker.tick)
    with rig.factory() as session:
        server_now = db.ledger_now(session, SystemClock())
        lease = session.scalars(select(Lease).where(Lease.attempt_id == attempt.id)).one()
        beat = ledger.active_workers(session, node="n1")[0].heartbeat_at
    # The lease and the heartbeat carry the server's time, not the worker's.
    assert timedelta(0) < lease.expires_at - server_now <= timedelta(seconds=30)
    assert abs(beat - server_now) < timedelta(seconds=30)
    # A controller whose clock is off the other way expires nothing and loses no one.
    report = controller.tick()
    assert report.expired == [] and report.lost == []
    rig.release.touch()
    wait_until(lambda: (worker.tick(), controller.tick()) and rig.attempts()[0].state == "settled")
    (done,) = rig.attempts()
    assert done.outcome == "succeeded" and len(rig.side_effects()) == 1
    with rig.factory() as session:
        kinds = set(session.scalars(select(Event.kind)))
    assert not kinds & {"lease_expired", "worker_lost", "attempt_unknown"}


# -- transient failures ------------------------------------------------------------------


def _kill_own_backend_once(engine, when: Callable[[str], bool]) -> list[str]:
    """Terminate, from another connection, the server session of ``engine``'s connection
    that is about to run the first statement for which ``when(statement)`` holds: the
    statement then meets a dead connection, in the middle of its transaction."""
    killed: list[str] = []

    def before(conn, _cursor, statement, _params, _context, _many) -> None:
        if killed or not when(statement):
            return
        pid = conn.connection.dbapi_connection.info.backend_pid
        with backends.admin() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        killed.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    return killed


def test_a_connection_killed_mid_claim_is_retried_and_runs_the_job_once(rig, ledger_backend):
    postgres_only(ledger_backend, "SQLite has no server session to terminate")
    engine = db.make_engine(db.ledger_url(rig.runtime))
    killed = _kill_own_backend_once(engine, lambda sql: sql.startswith("INSERT INTO attempts"))
    worker = rig.worker(engine)
    rig.serve(worker)
    (attempt,) = rig.running()
    assert killed and rig.errors  # the claim's transaction died half-way, and was retried
    rig.release.touch()
    (done,) = rig.settled()
    assert done.id == attempt.id and done.outcome == "succeeded" and done.number == 1
    assert len(rig.side_effects()) == 1
    engine.dispose()


def test_a_connection_killed_mid_settle_is_retried_and_settles_once(rig, ledger_backend):
    postgres_only(ledger_backend, "SQLite has no server session to terminate")
    engine = db.make_engine(db.ledger_url(rig.runtime))
    worker = rig.worker(engine)
    rig.serve(worker)
    rig.running()
    killed = _kill_own_backend_once(
        engine, lambda sql: sql.startswith("UPDATE attempts") and "outcome" in sql
    )
    rig.release.touch()
    (done,) = rig.settled()
    assert killed and rig.errors
    assert done.outcome == "succeeded" and len(rig.side_effects()) == 1
    engine.dispose()


def test_a_server_refusing_writes_as_after_a_failover_is_waited_out(rig, ledger_backend):
    postgres_only(ledger_backend, "read-only transactions after a failover are PostgreSQL's")
    name = db.make_engine(db.ledger_url(rig.runtime)).url.database
    worker = rig.worker()
    with backends.admin() as admin:
        # New sessions now start read-only, like a standby a failover pointed us at.
        admin.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
    rig.serve(worker)
    wait_until(lambda: worker.heartbeat_failures > 1)  # it keeps trying, with backoff
    assert "read-only transaction" in (worker.last_heartbeat_error or "")
    assert rig.side_effects() == []  # nothing was claimed, so nothing started
    with backends.admin() as admin:
        admin.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
    rig.running()
    rig.release.touch()
    (done,) = rig.settled()
    assert done.outcome == "succeeded" and len(rig.side_effects()) == 1


def _restart_command() -> list[str] | None:
    """How to restart the local PostgreSQL cluster the tests use, if this machine can."""
    tool = shutil.which("pg_ctlcluster")
    clusters = sorted(Path("/etc/postgresql").glob("*/main"))
    if tool is None or not clusters or os.geteuid() != 0:
        return None
    if "127.0.0.1" not in backends.POSTGRES_URL and "localhost" not in backends.POSTGRES_URL:
        return None
    version = clusters[-1].parent.name
    return [tool, "--skip-systemctl-redirect", version, "main", "restart"]


def _server_started() -> datetime | None:
    import psycopg

    try:
        with backends.admin() as admin:
            return admin.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
    except psycopg.OperationalError:
        return None  # still starting


@pytest.mark.serial  # the server goes away for every test beside it
def test_a_postgres_restart_while_a_job_runs_is_ridden_out(rig, ledger_backend):
    postgres_only(ledger_backend, "restarts a PostgreSQL server")
    command = _restart_command()
    if command is None:
        pytest.skip("needs the local Debian cluster and the rights to restart it (pg_ctlcluster)")
    worker = rig.worker(lease_seconds=60)
    rig.serve(worker)
    (attempt,) = rig.running()
    started = _server_started()
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    assert wait_until(_server_started) != started  # the server really restarted
    rig.release.touch()
    (done,) = rig.settled()
    assert done.id == attempt.id and done.outcome == "succeeded"
    assert len(rig.side_effects()) == 1 and worker.revoked is None


def test_sqlite_busy_past_its_timeout_is_retried(rig, ledger_backend, monkeypatch):
    if ledger_backend != "sqlite":
        pytest.skip("SQLite only: SQLITE_BUSY is SQLite's")
    monkeypatch.setattr(db, "BUSY_TIMEOUT_MS", 100)
    engine = db.make_engine(db.ledger_url(rig.runtime))  # its busy timeout: 100 ms
    worker = rig.worker(engine)
    # Another program (not laneway: no write-lock file) holds SQLite's write lock.
    holder = sqlite3.connect(rig.runtime / db.LEDGER_FILENAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    rig.serve(worker)
    wait_until(lambda: worker.heartbeat_failures > 1)  # it keeps trying, with backoff
    assert "database is locked" in (worker.last_heartbeat_error or "")
    assert rig.side_effects() == []
    holder.execute("ROLLBACK")
    holder.close()
    rig.running()
    rig.release.touch()
    (done,) = rig.settled()
    assert done.outcome == "succeeded" and len(rig.side_effects()) == 1
    engine.dispose()


# -- cut off from the ledger -------------------------------------------------------------


@pytest.fixture
def proxy(ledger_backend) -> Iterator[Proxy]:
    postgres_only(ledger_backend, "cuts a network path to the database server")
    found = Proxy("127.0.0.1", 5432)
    yield found
    found.close()


def _through(proxy: Proxy, runtime: Path):
    url = db.make_engine(db.ledger_url(runtime)).url.set(host="127.0.0.1", port=proxy.port)
    return db.make_engine(url.render_as_string(hide_password=False))


def test_a_short_outage_keeps_the_lease_and_settles_normally(rig, proxy):
    worker = rig.worker(_through(proxy, rig.runtime), lease_seconds=60, heartbeat_seconds=0.2)
    rig.serve(worker)
    (attempt,) = rig.running()
    proxy.cut()
    wait_until(lambda: worker.heartbeat_failures > 0)
    rig.release.touch()
    wait_until(lambda: worker.ledger_failures > 0)  # the settle cannot reach the ledger
    proxy.restore()
    (done,) = rig.settled()
    assert done.id == attempt.id and done.outcome == "succeeded"
    assert worker.revoked is None and len(rig.side_effects()) == 1


def test_an_outage_longer_than_the_lease_stops_claims_and_revokes_without_a_rerun(
    tmp_path, runtime, engine, proxy
):
    rig = Rig(tmp_path, runtime, engine, items=2)
    try:
        worker = rig.worker(_through(proxy, runtime), lease_seconds=2, heartbeat_seconds=0.2)
        worker.slots = 1  # the second item waits for this worker's only slot
        rig.serve(worker)
        (attempt,) = rig.running()
        proxy.cut()
        wait_until(lambda: not worker.trusts_its_leases())  # a lease period without a beat
        controller = Controller(engine, lost_after_seconds=2)
        wait_until(lambda: controller.tick() and rig.attempts()[0].state == "unknown")
        # The worker's supervisor still runs the attempt: nothing killed it.
        assert len(rig.side_effects()) == 1
        proxy.restore()
        wait_until(lambda: worker.revoked is not None)
        thread, _ = rig.threads[0]
        thread.join(timeout=60)
        assert not thread.is_alive()  # revoked: its serve loop ended
        rig.release.touch()
        with rig.factory() as session:
            run = session.get(Run, rig.run_id)
            assert run is not None
        attempts = rig.attempts()
        # Nothing ran twice: one attempt, unknown until an operator reconciles it, and the
        # second item was never claimed (the run halted on the unknown outcome).
        assert [a.id for a in attempts] == [attempt.id] and attempts[0].state == "unknown"
        assert len(rig.side_effects()) == 1
    finally:
        rig.stop()
