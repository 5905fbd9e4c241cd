"""The portable paths for real (issue 25): a worker started with every Linux-only facility
switched off (``LANEWAY_PORTABLE=1``: no pidfd, no ``/proc`` boot id or start ticks, no
subreaper, no cgroup OOM counter, no forking launcher) runs a stage beside a normal
Linux worker on one ledger (SQLite, and PostgreSQL when ``LANEWAY_TEST_POSTGRES_URL`` is
set). It survives ``kill -9`` of itself (its restart adopts the live supervisors by the
portable identity) and of one of its supervisors (the attempt becomes unknown, never
run again), and nothing runs twice. Each worker's row says which seams it uses."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db, identity, status_model, status_nodes
from laneway.controller.models import Worker
from laneway.controller.rows import SessionRows
from tests.integration.test_two_nodes import Cluster
from tests.support import GATE_BOUND, escape, wait_for_file, wait_until

pytestmark = pytest.mark.slow


# A review-style stage: read the item, leave one line of side effect, hold until
# released (so workers and supervisors can be killed while it runs), write a result.
JOB = (
    """
import json, os, pathlib, sys, time
side, release = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
with side.open("a") as f:
    f.write(sys.argv[1] + "\\n")
"""
    + wait_for_file("str(release)")
    + """
pathlib.Path(os.environ["LANEWAY_RESULT_PATH"]).write_text(
    json.dumps({"job_id": int(os.environ["LANEWAY_JOB_ID"]), "verdict": "approve"})
)
"""
)


def config(tmp: Path) -> Path:
    items = [f'{{ key = "a{n}", lane = "a" }}' for n in range(2)]
    items += [f'{{ key = "b{n}", lane = "b" }}' for n in range(2)]
    argv = json.dumps([sys.executable, "-c", escape(JOB), "{item}"])[:-1]
    path = tmp / "pipeline.toml"
    path.write_text(
        f"""
name = "portable-seams"
nodes = [
  {{ name = "linux", memory_floor_mib = 0, max_jobs = 2 }},
  {{ name = "portable", memory_floor_mib = 0, max_jobs = 2 }},
]
lanes = [{{ name = "a", node = "linux" }}, {{ name = "b", node = "portable" }}]
items = [{", ".join(items)}]

[[stages]]
name = "review"
argv = {argv}, "{tmp / "side.log"}", "{tmp / "release"}"]
timeout_seconds = {GATE_BOUND}
"""
    )
    return path


class Nodes(Cluster):
    """A controller and two workers, each in a runtime dir of its own, sharing the
    ledger's URL (``test_two_nodes.Cluster``); the ``portable`` worker runs with
    ``LANEWAY_PORTABLE=1``."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, nodes=("linux", "portable"))
        self.env.pop(identity.PORTABLE_ENV, None)

    def start(self, name: str, *args: str, where: str, portable: bool = False) -> None:
        if not portable:
            super().start(name, *args, where=where)
            return
        plain = self.env
        self.env = {**plain, identity.PORTABLE_ENV: "1"}
        try:
            super().start(name, *args, where=where)
        finally:
            self.env = plain

    def worker(self, node: str, *, portable: bool = False) -> None:
        self.start(
            node,
            *("worker", "--node", node, "--lease-seconds", "5"),
            where=node,
            portable=portable,
        )

    def workers(self, node: str) -> list[Worker]:
        with db.session_factory(self.engine)() as session:
            return list(
                session.scalars(select(Worker).where(Worker.node == node).order_by(Worker.id))
            )


@pytest.fixture
def nodes(tmp_path, ledger_backend):
    made = Nodes(tmp_path)
    yield made
    made.stop()


def _log(nodes: Nodes, name: str) -> str:
    path = nodes.tmp / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_portable_worker_beside_a_linux_one_survives_kill_9_and_runs_nothing_twice(
    nodes, tmp_path
):
    (tmp_path / "control").mkdir()
    started = nodes.cli("start-pipeline", str(config(tmp_path)), "--no-controller")
    assert started.returncode == 0, started.stderr
    nodes.start("controller", "controller", "--lost-after", "3", where="control")
    nodes.worker("linux")
    nodes.worker("portable", portable=True)

    def all_running() -> bool:
        running = [a for a in nodes.attempts() if a.state == "running"]
        return len(running) == 4 and len(nodes.side_effects()) == 4

    wait_until(all_running, timeout=90)

    # Each worker's row says which seams it uses; the portable one, only portable ones.
    (linux,) = nodes.workers("linux")
    (portable,) = nodes.workers("portable")
    assert portable.seams == {
        "wait": "poll",
        "identity": "boot time + start time",
        "subreaper": "process group",
        "oom": "inferred",
        "spawn": "exec",
        "portable": True,
    }
    assert linux.seams is not None and "portable" not in linux.seams
    assert linux.seams["identity"] == "boot_id + start time"
    # ... in the portable identity's form: a boot time, start times in epoch milliseconds.
    assert portable.boot_id.startswith("boot time ")
    assert portable.process_start_time >= identity.EPOCH_MS_FLOOR
    doomed = nodes.attempts("portable")
    for attempt in doomed:
        assert attempt.boot_id.startswith("boot time ")
        assert attempt.supervisor_start_time >= identity.EPOCH_MS_FLOOR
        assert attempt.child_start_time >= identity.EPOCH_MS_FLOOR
        assert identity.same_process(attempt.supervisor_pid, attempt.supervisor_start_time)
    for attempt in nodes.attempts("linux"):
        assert attempt.child_start_time < identity.EPOCH_MS_FLOOR  # clock ticks (/proc)
    with db.session_factory(nodes.engine)() as session:
        seams = status_nodes.worker_seams(SessionRows(session), ["linux", "portable"])
    assert status_model.seams_words(seams[portable.id]) == (
        "wait poll, identity boot time + start time, subreaper process group, oom inferred, "
        "spawn exec (portable paths forced)"
    )
    assert status_model.seams_words(seams[linux.id]).startswith("wait pidfd, identity boot_id")

    # kill -9 of the portable worker alone: its supervisors (own sessions) run on.
    os.kill(nodes.processes["portable"].pid, signal.SIGKILL)
    nodes.processes["portable"].wait()
    for attempt in doomed:
        assert identity.same_process(attempt.supervisor_pid, attempt.supervisor_start_time)
    # Restarted, it adopts both live supervisors by the portable identity.
    nodes.worker("portable", portable=True)

    def adopted() -> bool:
        workers = nodes.workers("portable")
        current = [w for w in workers if w.state == "active"]
        if len(current) != 1 or current[0].id == portable.id:
            return False
        now = nodes.attempts("portable")
        return all(a.state == "running" and a.worker_id == current[0].id for a in now)

    wait_until(adopted, timeout=90)
    # Its log line follows the adoption's commit: wait for it rather than race it.
    wait_until(lambda: "adopted live supervisor" in _log(nodes, "portable"), timeout=90)

    # kill -9 of one supervisor: no exit record, so its attempt is unknown, never re-run.
    victim = doomed[0]
    os.kill(victim.supervisor_pid, signal.SIGKILL)
    wait_until(
        lambda: next(a for a in nodes.attempts() if a.id == victim.id).state == "unknown",
        timeout=90,
    )

    # Released: everything else finishes; the unknown one halts the run's dispatch.
    (tmp_path / "release").touch()

    def others_settled() -> bool:
        return all(
            a.state == "settled" and a.outcome == "succeeded"
            for a in nodes.attempts()
            if a.id != victim.id
        )

    try:
        wait_until(others_settled, timeout=90)
    except AssertionError:
        states = [(a.id, a.node, a.state, a.outcome, a.state_reason) for a in nodes.attempts()]
        raise AssertionError(f"{states}\n{_log(nodes, 'portable')}") from None
    attempts = nodes.attempts()
    assert len(attempts) == 4  # one attempt per item: nothing claimed twice
    assert sorted(nodes.side_effects()) == ["a0", "a1", "b0", "b1"]  # nothing ran twice
    assert next(a for a in attempts if a.id == victim.id).state == "unknown"
    # The job of the killed supervisor, orphaned without a subreaper, ran to its end
    # once (released above); no second copy was started.
    status = json.loads(nodes.cli("status", "--json").stdout)
    assert {u["attempt_id"] for u in status["unknown"]} == {victim.id}
    workers = {w["worker_id"]: w for w in status["workers"]}
    if "seams" in next(iter(workers.values())):  # once status_model's Worker carries them
        assert any(w["seams"] and w["seams"].get("portable") for w in workers.values())
