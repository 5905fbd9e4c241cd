"""Crash safety with real processes: SIGKILL at each named crash point, restart, and
assert the exact state and reason. The job appends its idempotency key to a side-effect
file (the ground truth of how often it really ran) and then waits for a test signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger
from laneway.controller.models import Attempt, Decision, Job, Run, Worker
from laneway.controller.states import Outcome
from tests.support import GATE_BOUND, claim_one_on_n1, make_config, wait_for_file, wait_until

SIDE_EFFECT_THEN_WAIT = textwrap.dedent(
    """
    import json, os, sys, time
    side, release = sys.argv[2], sys.argv[3]
    fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, (os.environ["LANEWAY_IDEMPOTENCY_KEY"] + "\\n").encode())
    os.fsync(fd)
    """
) + wait_for_file("release")
"""A job script's opening: append its idempotency key to the side-effect file (argv[2],
fsynced), then wait for the release file (argv[3])."""
WRITE_RESULT = textwrap.dedent(
    """
    with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
        json.dump({"job_id": os.environ["LANEWAY_JOB_ID"]}, f)
    """
)
"""A job script's ending: its result.json names its job (needs ``json`` and ``os``)."""
JOB = SIDE_EFFECT_THEN_WAIT + WRITE_RESULT


class Harness:
    def __init__(self, tmp_path: Path, runtime: Path, engine) -> None:
        self.tmp = tmp_path
        self.runtime = runtime
        self.engine = engine
        self.side = tmp_path / "side-effects.log"
        self.release = tmp_path / "release"
        self.script = tmp_path / "job.py"
        self.script.write_text(JOB)
        self.processes: list[subprocess.Popen[bytes]] = []

    def stage(self) -> dict:
        return {
            "name": "paid",
            "argv": [sys.executable, str(self.script), "{item}", str(self.side), str(self.release)],
            "timeout_seconds": GATE_BOUND,
        }

    def spawn(self, command: str, crash: str | None = None, *extra: str):
        env = {k: v for k, v in os.environ.items() if k != "LANEWAY_CRASH_POINT"}
        if crash:
            env["LANEWAY_CRASH_POINT"] = crash
        log = open(self.tmp / f"{command}-{len(self.processes)}.log", "wb")
        args = [sys.executable, "-m", "laneway", command, "--runtime-dir", str(self.runtime)]
        process = subprocess.Popen([*args, *extra], env=env, stdout=log, stderr=log)
        log.close()
        self.processes.append(process)
        return process

    def worker(self, crash: str | None = None):
        return self.spawn("worker", crash, "--node", "n1", "--slots", "1")

    def attempts(self) -> list[Attempt]:
        with db.session_factory(self.engine)() as session:
            return list(session.scalars(select(Attempt).order_by(Attempt.id)))

    def attempt(self) -> Attempt:
        (attempt,) = self.attempts()
        return attempt

    def side_effects(self) -> list[str]:
        return self.side.read_text().split() if self.side.exists() else []

    def killed(self, process) -> None:
        assert process.wait(timeout=60) == -signal.SIGKILL

    def settled(self) -> bool:
        return all(a.state == "settled" for a in self.attempts()) and bool(self.attempts())

    def stop_all(self) -> None:
        self.release.touch()
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def harness(tmp_path, runtime, engine):
    h = Harness(tmp_path, runtime, engine)
    yield h
    h.stop_all()


def one_job_run(harness, make_run, items=1):
    return make_run(make_config([harness.stage()], items=items))


def test_after_intent_commit_becomes_unknown_halts_then_not_run_reruns(harness, make_run):
    run_id = one_job_run(harness, make_run, items=2)
    harness.killed(harness.worker("worker_after_intent_commit"))
    assert harness.attempt().state == "intent" and harness.side_effects() == []
    harness.worker()
    attempt = wait_until(lambda: harness.attempt().state == "unknown" and harness.attempt())
    assert "intent committed, but no supervisor is running and no exit.json" in (
        attempt.state_reason
    )

    # Dispatch for the run halts: the second item is not started while one is unknown.
    def refused():
        with db.session_factory(harness.engine)() as session:
            return session.scalars(
                select(Decision.reason_code).where(
                    Decision.run_id == run_id, Decision.reason_code == "unknown_outcome"
                )
            ).first()

    wait_until(refused)
    assert len(harness.attempts()) == 1
    # The operator knows it never ran: a new attempt, with a new key, runs each item once.
    with db.transaction(db.session_factory(harness.engine)) as session:
        ledger.reconcile_attempt(
            session,
            attempt.id,
            verdict="not-run",
            reason="checked: no process",
            actor="op",
            now=attempt.intent_at,
        )
    harness.release.touch()
    wait_until(lambda: len(harness.attempts()) == 3 and harness.settled(), timeout=90)
    outcomes = [(a.job_id, a.outcome) for a in harness.attempts()]
    assert sorted(o for _, o in outcomes) == ["not_run", "succeeded", "succeeded"]
    keys = harness.side_effects()
    assert len(keys) == len(set(keys)) == 2


def test_after_spawn_before_identity_is_adopted_not_rerun(harness, make_run):
    one_job_run(harness, make_run)
    harness.killed(harness.worker("worker_after_spawn_before_identity"))
    wait_until(lambda: harness.side_effects())
    attempt = harness.attempt()
    assert attempt.state == "intent" and attempt.supervisor_pid is None
    harness.worker()
    adopted = wait_until(lambda: harness.attempt().state == "running" and harness.attempt())
    assert adopted.supervisor_pid is not None and adopted.fence == attempt.fence + 1
    harness.release.touch()
    wait_until(harness.settled)
    assert harness.attempt().outcome == "succeeded"
    assert harness.side_effects() == [attempt.idempotency_key]


def test_after_receipt_before_identity_is_adopted_not_rerun(harness, make_run):
    """The worker read the supervisor's report and wrote its receipt; the identity was
    waiting for its next write (``identity_wait_seconds``) when it was killed. The
    ledger still says intent; the restarted worker finds the supervisor by its attempt
    directory, adopts it, and the job runs once."""
    one_job_run(harness, make_run)
    harness.killed(harness.worker("worker_after_receipt_before_identity"))
    attempt = harness.attempt()
    assert attempt.state == "intent" and attempt.supervisor_pid is None
    receipt = json.loads((Path(attempt.attempt_dir) / "receipt.json").read_text())
    assert receipt["attempt_id"] == attempt.id and receipt["supervisor_pid"] > 0
    harness.worker()
    adopted = wait_until(lambda: harness.attempt().state == "running" and harness.attempt())
    assert adopted.supervisor_pid == receipt["supervisor_pid"]
    assert adopted.fence == attempt.fence + 1
    harness.release.touch()
    wait_until(harness.settled)
    assert harness.attempt().outcome == "succeeded"
    assert harness.side_effects() == [attempt.idempotency_key]


def test_worker_killed_while_child_runs_is_adopted(harness, make_run):
    one_job_run(harness, make_run)
    first = harness.worker()
    running = wait_until(
        lambda: harness.attempts() and harness.attempt().state == "running" and harness.attempt()
    )
    first.kill()
    harness.killed(first)
    harness.worker()
    wait_until(lambda: harness.attempt().worker_id != running.worker_id)
    harness.release.touch()
    wait_until(harness.settled)
    final = harness.attempt()
    assert final.outcome == "succeeded" and final.supervisor_pid == running.supervisor_pid
    assert harness.side_effects() == [running.idempotency_key]
    with db.session_factory(harness.engine)() as session:
        old = session.get(Worker, running.worker_id)
    assert old.state == "lost"


@pytest.mark.parametrize("point", ["supervisor_after_spawn", "supervisor_before_exit_record"])
def test_supervisor_killed_leaves_unknown(harness, make_run, point):
    one_job_run(harness, make_run)
    if point == "supervisor_before_exit_record":
        harness.release.touch()
    harness.worker(point)
    attempt = wait_until(
        lambda: harness.attempts() and harness.attempt().state == "unknown" and harness.attempt()
    )
    assert "exited with status -9 and left no exit.json" in attempt.state_reason
    assert not (Path(attempt.attempt_dir) / "exit.json").exists()
    with db.session_factory(harness.engine)() as session:
        assert session.get(Job, attempt.job_id).state == "unknown"
    harness.release.touch()


@pytest.mark.parametrize("point", ["worker_before_settle", "worker_mid_settle"])
def test_worker_killed_after_exit_record_settles_from_it(harness, make_run, point):
    one_job_run(harness, make_run)
    harness.release.touch()
    harness.killed(harness.worker(point))
    attempt = harness.attempt()
    # In flight: its identity went with the settle (intent), or had waited long enough
    # to be recorded before it (running).
    assert attempt.state in ("intent", "running")
    exit_record = json.loads((Path(attempt.attempt_dir) / "exit.json").read_text())
    harness.worker()
    wait_until(harness.settled)
    final = harness.attempt()
    assert final.outcome == Outcome.SUCCEEDED.value and final.state_reason == "exit code 0"
    assert harness.side_effects() == [attempt.idempotency_key]
    # The identity is in the ledger either way (from the exit record if not before).
    assert final.supervisor_pid == exit_record["supervisor_pid"]
    assert final.child_pid == exit_record["child_pid"] and final.started_at is not None


def test_controller_killed_mid_tick_rolls_back_and_next_tick_completes(
    harness, make_run, register_worker, clock
):
    run_id = one_job_run(harness, make_run)
    worker = register_worker()
    factory = db.session_factory(harness.engine)
    claim_one_on_n1(factory, worker, clock, settle=Outcome.SUCCEEDED)
    harness.killed(harness.spawn("controller", "controller_mid_tick"))
    with factory() as session:
        assert session.get(Run, run_id).state == "active"  # the tick's close rolled back
    harness.spawn("controller")
    wait_until(lambda: (harness.runtime / "runs" / str(run_id) / "SUMMARY.json").exists())
    with factory() as session:
        assert session.get(Run, run_id).state == "finished"
