"""Two nodes for real: a controller and one worker per node, as separate processes with
separate runtime dirs that share nothing but the ledger's URL. Both nodes make progress
on their own lanes; when one node's worker and supervisors are SIGKILLed its attempts
become unknown and the run's dispatch halts; after the operator reconciles them the other
node carries on. ``status`` shows each node's heartbeat, free memory and running work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db
from laneway.controller.models import Attempt, Decision
from tests.support import GATE_BOUND, escape, wait_for_file, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LANEWAY = [sys.executable, "-m", "laneway"]

JOB = (
    """
import os, pathlib, sys, time
side, release = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
with side.open("a") as f:
    f.write(sys.argv[1] + "\\n")
"""
    + wait_for_file("str(release)")
    + """
"""
)


def config(tmp: Path) -> Path:
    items = [f'{{ key = "a{n}", lane = "a" }}' for n in range(4)]
    items += [f'{{ key = "b{n}", lane = "b" }}' for n in range(4)]
    argv = json.dumps([sys.executable, "-c", escape(JOB), "{item}"])[:-1]
    path = tmp / "pipeline.toml"
    path.write_text(
        f"""
name = "two-nodes"
nodes = [
  {{ name = "n1", memory_floor_mib = 0, max_jobs = 2 }},
  {{ name = "n2", memory_floor_mib = 0, max_jobs = 2 }},
]
lanes = [{{ name = "a", node = "n1" }}, {{ name = "b", node = "n2" }}]
items = [{", ".join(items)}]

[[stages]]
name = "work"
argv = {argv}, "{tmp / "side.log"}", "{tmp / "release"}"]
timeout_seconds = {GATE_BOUND}
"""
    )
    return path


class Cluster:
    """A controller's runtime dir and one per node, sharing only the ledger's URL (and
    whatever ``extra_env`` gives every process); logs appended under ``tmp``."""

    def __init__(
        self,
        tmp: Path,
        nodes: tuple[str, ...] = ("n1", "n2"),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.tmp = tmp
        self.dirs = {name: tmp / name for name in ("control", *nodes)}
        url = db.ledger_url(self.dirs["control"])
        self.env = {**os.environ, "LANEWAY_DATABASE_URL": url, **(extra_env or {})}
        self.engine = db.make_engine(url)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def cli(self, *args: str, where: str = "control") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LANEWAY, *args, "--runtime-dir", str(self.dirs[where])],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def start(self, name: str, *args: str, where: str) -> None:
        log = (self.tmp / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [*LANEWAY, *args, "--runtime-dir", str(self.dirs[where])],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()

    def attempts(self, node: str | None = None) -> list[Attempt]:
        query = select(Attempt).order_by(Attempt.id)
        if node is not None:
            query = query.where(Attempt.node == node)
        with db.session_factory(self.engine)() as session:
            return list(session.scalars(query))

    def side_effects(self) -> list[str]:
        path = self.tmp / "side.log"
        return path.read_text().split() if path.exists() else []

    def stop(self) -> None:
        (self.tmp / "release").touch()
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.engine.dispose()


@pytest.fixture
def cluster(tmp_path, ledger_backend):
    made = Cluster(tmp_path)
    yield made
    made.stop()


def test_two_nodes_progress_and_one_dying_halts_until_reconciled(cluster, tmp_path):
    (tmp_path / "control").mkdir()
    started = cluster.cli("start-pipeline", str(config(tmp_path)), "--no-controller")
    assert started.returncode == 0, started.stderr
    cluster.start("controller", "controller", "--lost-after", "2", where="control")
    for node in ("n1", "n2"):
        cluster.start(node, "worker", "--node", node, "--lease-seconds", "3", where=node)

    # Both nodes make progress on their own lanes, each in its own runtime dir.
    def both_running() -> bool:
        running = [a for a in cluster.attempts() if a.state == "running"]
        if {a.node for a in running} != {"n1", "n2"} or len(running) != 4:
            return False
        return len(cluster.side_effects()) == 4

    wait_until(both_running)
    assert sorted(cluster.side_effects()) == ["a0", "a1", "b0", "b1"]
    for attempt in cluster.attempts():
        assert attempt.attempt_dir.startswith(str(cluster.dirs[attempt.node]))
    status = json.loads(cluster.cli("status", "--json").stdout)
    nodes = {n["node"]: n for n in status["nodes"]}
    for node in ("n1", "n2"):
        assert nodes[node]["live_workers"] == 1 and nodes[node]["running"] == 2
        assert nodes[node]["last_heartbeat_at"] and nodes[node]["mem_available_mib"] > 0

    # Node n2 dies: its worker and its supervisors (and their jobs), all SIGKILLed.
    doomed = cluster.attempts("n2")
    os.killpg(cluster.processes["n2"].pid, signal.SIGKILL)
    for attempt in doomed:
        for pid in (attempt.supervisor_pid, attempt.child_pid):
            if pid:
                os.kill(pid, signal.SIGKILL)
    wait_until(lambda: all(a.state == "unknown" for a in cluster.attempts("n2")))

    # The run's dispatch halts: n1 finishes what it runs and starts nothing new.
    (tmp_path / "release").touch()
    wait_until(lambda: all(a.state == "settled" for a in cluster.attempts("n1")))
    with db.session_factory(cluster.engine)() as session:

        def halted() -> bool:
            found = session.scalars(
                select(Decision).where(Decision.reason_code == "unknown_outcome")
            ).first()
            session.rollback()
            return found is not None

        wait_until(halted)
    assert len(cluster.attempts("n1")) == 2
    status = json.loads(cluster.cli("status", "--json").stdout)
    assert {u["attempt_id"] for u in status["unknown"]} == {a.id for a in doomed}

    # The operator reconciles (nothing ran to completion on n2); n1 carries on.
    for attempt in doomed:
        done = cluster.cli("reconcile", str(attempt.id), "--as", "not-run", "--reason", "n2 died")
        assert done.returncode == 0, done.stderr
    wait_until(
        lambda: (
            len(n1 := cluster.attempts("n1")) == 4
            and all(a.state == "settled" and a.outcome == "succeeded" for a in n1)
        )
    )
    effects = cluster.side_effects()
    assert sorted(e for e in effects if e.startswith("a")) == ["a0", "a1", "a2", "a3"]
    # No b item ran again: n2 has no live worker, and status says so.
    assert sorted(e for e in effects if e.startswith("b")) == ["b0", "b1"]
    status = json.loads(cluster.cli("status", "--json").stdout)
    assert [n["node"] for n in status["no_worker"]] == ["n2"]
