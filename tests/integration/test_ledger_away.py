"""Time the ledger could not be written never counts against a live worker, and a
controller rides out a database that goes away.

- A query (not laneway's: `laneway sql` refuses lock functions now) holds the ledger's
  write lock for longer than ``lost_after``: the controller, queued behind it, must not
  declare the worker whose heartbeat was queued behind it too lost.
- The PostgreSQL server stops for longer than the lease and starts again: `laneway
  controller` (a real process) waits, logs ``ledger_unreachable`` and ``ledger_back``,
  and does not exit; the live worker is not judged lost; the worker killed during the
  outage is; the attempts whose leases expired meanwhile (no exit record yet) become
  unknown, and the operator reconciles them. Nothing runs twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import select

from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Worker
from laneway.workers.service import WorkerService
from tests import backends
from tests.integration.test_cli_services import BOUND, LANEWAY, ROOT
from tests.integration.test_ledger_faults import JOB, _restart_command, _server_started
from tests.integration.test_worker import PLENTY
from tests.support import PY, escape, make_config, wait_until

pytestmark = pytest.mark.slow


def _postgres(ledger_backend: str) -> None:
    if ledger_backend != "postgres":
        pytest.skip("PostgreSQL only: the write lock is an advisory lock a session can hold")


def _make_run(engine, runtime: Path, tmp_path: Path, items: int = 1, max_jobs: int = 1) -> int:
    config = make_config(
        [
            {
                "name": "paid",
                "argv": [
                    PY,
                    "-c",
                    escape(JOB),
                    "{item}",
                    str(tmp_path / "side-effects.log"),
                    str(tmp_path / "release"),
                ],
                "timeout_seconds": 120,
            }
        ],
        items=items,
        max_jobs=max_jobs,
    )
    with db.transaction(db.session_factory(engine)) as session:
        return ledger.create_run(
            session,
            config,
            runtime_dir=str(runtime),
            source_hashes={},
            actor="test",
            now=SystemClock().now(),
        ).id


def _waiting_on_the_lock(name: str) -> int:
    with backends.admin() as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
            "AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            (name,),
        ).fetchone()
    return int(row[0])


def test_a_heartbeat_held_up_behind_the_write_lock_never_makes_a_worker_lost(
    tmp_path, runtime, engine, ledger_backend
):
    _postgres(ledger_backend)
    _make_run(engine, runtime, tmp_path)
    worker = WorkerService(
        engine,
        node="n1",
        slots=1,
        memory_probe=lambda: PLENTY,
        heartbeat_seconds=0.2,
        sample_seconds=3600,
    )
    worker.start()
    wait_until(lambda: worker.tick() and worker.in_flight)
    controller = Controller(engine, lost_after_seconds=2)
    controller.tick()
    name = engine.url.database
    assert name

    # Another session takes laneway's gate alone (as an operator's write does) and keeps
    # it past lost_after.
    blocker = psycopg.connect(backends.database_url(name).replace("+psycopg", ""))
    blocker.execute("SELECT pg_advisory_xact_lock(%s)", (db.GATE_KEY,))
    held = time.monotonic()
    wait_until(lambda: time.monotonic() - held > 2.5)  # the last heartbeat is stale now
    reports: list[object] = []
    judge = threading.Thread(target=lambda: reports.append(controller.tick()))
    judge.start()
    wait_until(lambda: _waiting_on_the_lock(name) == 1)  # the controller queued first
    queued = time.monotonic()
    beat = threading.Thread(target=worker.tick)
    beat.start()
    wait_until(lambda: _waiting_on_the_lock(name) == 2)  # the heartbeat queued behind it
    wait_until(lambda: time.monotonic() - queued > 1.5)
    blocker.rollback()
    blocker.close()
    judge.join(timeout=60)
    beat.join(timeout=60)

    (report,) = reports
    assert report.lost == []  # type: ignore[attr-defined]
    # The worker goes on beating; the controller goes on judging: nobody becomes lost.
    released = time.monotonic()

    def both_tick_past_the_grace() -> bool:
        worker.tick()
        assert controller.tick().lost == []
        return time.monotonic() - released > 4  # past lost_after (2 s) and its grace

    wait_until(both_tick_past_the_grace, interval=0.05)
    (tmp_path / "release").touch()
    wait_until(lambda: worker.tick() is not None and not worker.in_flight)
    with db.session_factory(engine)() as session:
        (row,) = session.scalars(select(Worker))
        (attempt,) = session.scalars(select(Attempt))
        assert row.state == "active" and worker.revoked is None
        assert attempt.state == "settled" and attempt.outcome == "succeeded"
    assert len((tmp_path / "side-effects.log").read_text().split()) == 1
    worker.stop()


def _stop_start_commands() -> tuple[list[str], list[str]] | None:
    restart = _restart_command()
    if restart is None:
        return None
    return [*restart[:-1], "stop"], [*restart[:-1], "start"]


def _events(path: Path) -> list[str]:
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line).get("event", ""))
        except ValueError:
            continue
    return found


@pytest.mark.serial  # the server goes away for every test beside it
def test_a_server_stopped_longer_than_the_lease_is_waited_out_and_recovery_runs(
    tmp_path, runtime, engine, ledger_backend
):
    _postgres(ledger_backend)
    commands = _stop_start_commands()
    if commands is None:
        pytest.skip("needs the local Debian cluster and the rights to stop it (pg_ctlcluster)")
    stop, start = commands
    run_id = _make_run(engine, runtime, tmp_path, items=2, max_jobs=2)
    env = dict(os.environ)
    logs = {name: tmp_path / f"{name}.err" for name in ("controller", "live", "killed")}
    processes: dict[str, subprocess.Popen[str]] = {}

    def spawn(name: str, *argv: str) -> None:
        with logs[name].open("w") as err:
            processes[name] = subprocess.Popen(
                [*LANEWAY, *argv, "--runtime-dir", str(runtime), "--json"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
            )

    side = tmp_path / "side-effects.log"
    try:
        spawn("controller", "controller", "--lost-after", "2")
        spawn("live", "worker", "--node", "n1", "--slots", "1", "--lease-seconds", "3")
        wait_until(lambda: side.exists() and len(side.read_text().split()) == 1, BOUND)
        spawn("killed", "worker", "--node", "n1", "--slots", "1", "--lease-seconds", "3")
        wait_until(lambda: len(side.read_text().split()) == 2, BOUND)
        engine.dispose()

        started = _server_started()
        subprocess.run(stop, check=True, capture_output=True, timeout=120)
        processes["killed"].send_signal(signal.SIGKILL)  # a worker lost in the outage
        processes["killed"].wait(timeout=BOUND)
        outage = time.monotonic()
        wait_until(lambda: "ledger_unreachable" in _events(logs["controller"]), BOUND)
        wait_until(lambda: time.monotonic() - outage > 8)  # longer than the 3 s lease
        assert processes["controller"].poll() is None, logs["controller"].read_text()
        # pg_ctlcluster's start may report failure on a cluster that did start: the
        # server answering is what counts.
        subprocess.run(start, capture_output=True, timeout=120)
        assert wait_until(_server_started, BOUND) != started
        wait_until(lambda: "ledger_back" in _events(logs["controller"]), BOUND)

        def attempts() -> list[Attempt]:
            with db.session_factory(engine)() as session:
                return list(session.scalars(select(Attempt).order_by(Attempt.id)))

        def workers() -> dict[int, str]:
            with db.session_factory(engine)() as session:
                return {w.pid: w.state for w in session.scalars(select(Worker))}

        # The documented path: the worker that died is judged lost; every attempt whose
        # lease expired in the outage (both: 8 s > the 3 s lease) becomes unknown, its
        # supervisor still running it; the live worker is not judged lost.
        killed_pid = processes["killed"].pid
        wait_until(lambda: workers().get(killed_pid) == "lost", BOUND)
        wait_until(lambda: [a.state for a in attempts()] == ["unknown", "unknown"], BOUND)
        assert processes["controller"].poll() is None, logs["controller"].read_text()
        assert processes["live"].poll() is None, logs["live"].read_text()
        assert workers()[processes["live"].pid] == "active"  # the outage did not count

        (tmp_path / "release").touch()
        for attempt in attempts():
            reconciled = subprocess.run(
                [
                    *LANEWAY,
                    "reconcile",
                    str(attempt.id),
                    "--as",
                    "succeeded",
                    "--reason",
                    "its supervisor finished it after the outage",
                    "--runtime-dir",
                    str(runtime),
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=BOUND,
            )
            assert reconciled.returncode == 0, reconciled.stderr
        assert [(a.state, a.outcome) for a in attempts()] == [("settled", "succeeded")] * 2
        with db.session_factory(engine)() as session:
            assert ledger.get_run(session, run_id) is not None
        assert len(side.read_text().split()) == 2  # nothing ran twice
    finally:
        (tmp_path / "release").touch()
        if _server_started() is None:
            subprocess.run(start, capture_output=True, timeout=120)
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
