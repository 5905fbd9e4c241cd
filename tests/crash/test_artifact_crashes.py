"""The artifact sequence's crash windows, with real worker processes and SIGKILL
(docs/architecture.md, "Artifacts"): settle with outputs -> store -> verify -> inputs.

- killed after the store write, before the settle: the object is an orphan (harmless,
  content-addressed); the restarted worker settles from exit.json, finds the object,
  verifies it and records it, and the job ran once;
- killed after the settle committed: recorded and present, and the dependent gets it;
- killed while fetching a dependent's inputs: its process never started.
"""

from __future__ import annotations

import hashlib
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.models import Artifact, AttemptInput
from laneway.controller.states import ControlKind
from tests.crash.test_crash_points import SIDE_EFFECT_THEN_WAIT, WRITE_RESULT, Harness
from tests.support import clear_run_control, control_run, make_config, wait_until

PRODUCE = (
    SIDE_EFFECT_THEN_WAIT
    + textwrap.dedent(
        """
        with open("packet.json", "w") as f:
            f.write("packet for " + sys.argv[1])
        """
    )
    + WRITE_RESULT
)

CONSUME = (
    textwrap.dedent(
        """
        import json, os, sys
        packet = open(sys.argv[2]).read()
        with open(sys.argv[3], "a") as f:
            f.write(os.environ["LANEWAY_IDEMPOTENCY_KEY"] + " " + packet + "\\n")
        """
    )
    + WRITE_RESULT
)


class ArtifactHarness(Harness):
    def __init__(self, tmp_path: Path, runtime: Path, engine) -> None:
        super().__init__(tmp_path, runtime, engine)
        self.script.write_text(PRODUCE)
        self.consumer = tmp_path / "consume.py"
        self.consumer.write_text(CONSUME)
        self.consumed = tmp_path / "consumed.log"

    def stages(self) -> list[dict]:
        return [
            {
                **self.stage(),
                "name": "prepare",
                "outputs": ["packet.json"],
            },
            {
                "name": "solve",
                "argv": [
                    sys.executable,
                    str(self.consumer),
                    "{item}",
                    "{inputs.prepare}/packet.json",
                    str(self.consumed),
                ],
                "needs": ["prepare"],
                "timeout_seconds": 120,
            },
        ]

    def artifacts(self) -> list[Artifact]:
        with db.session_factory(self.engine)() as session:
            return list(session.scalars(select(Artifact).order_by(Artifact.id)))

    def objects(self) -> list[Path]:
        return sorted(p for p in (self.runtime / "artifacts").rglob("*") if p.is_file())

    def by_stage(self, stage: str):
        return [a for a in self.attempts() if a.attempt_dir.endswith(f".{stage}/attempt-{1}")]

    def control(self, run_id: int, pause: bool) -> None:
        with db.transaction(db.session_factory(self.engine)) as session:
            now = db.ledger_now(session, SystemClock())
            if pause:
                control_run(
                    session,
                    ControlKind.PAUSE,
                    run_id,
                    reason="test: hold dependents",
                    actor="test",
                    now=now,
                )
            else:
                clear_run_control(
                    session, ControlKind.PAUSE, run_id, reason="test", actor="test", now=now
                )

    def consumed_lines(self) -> list[str]:
        return self.consumed.read_text().splitlines() if self.consumed.exists() else []


@pytest.fixture
def harness(tmp_path, runtime, engine):
    h = ArtifactHarness(tmp_path, runtime, engine)
    yield h
    h.stop_all()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_killed_after_the_store_write_before_the_settle_leaves_a_harmless_orphan(harness, make_run):
    make_run(make_config(harness.stages(), items=1))
    worker = harness.worker("worker_after_store_before_settle")
    wait_until(harness.side_effects)
    harness.release.touch()
    harness.killed(worker)
    # The object is in the store; nothing records it; the attempt is still in flight.
    (orphan,) = harness.objects()
    prepare = harness.by_stage("prepare")[0]
    assert prepare.state in ("intent", "running") and harness.artifacts() == []
    stat_before = orphan.stat()

    harness.worker()
    wait_until(lambda: len(harness.consumed_lines()) == 1)
    wait_until(harness.settled)
    (recorded,) = harness.artifacts()
    # Settled from exit.json by the restarted worker; the same object, verified, not
    # rewritten; the job ran once and its dependent read exactly those bytes.
    assert harness.by_stage("prepare")[0].outcome == "succeeded"
    assert harness.objects() == [orphan] and orphan.stat().st_mtime_ns == stat_before.st_mtime_ns
    assert recorded.sha256 == sha(orphan) == orphan.name
    assert len(harness.side_effects()) == 1
    assert harness.consumed_lines()[0].endswith("packet for item0")


def test_killed_after_the_settle_the_outputs_are_recorded_and_present(harness, make_run):
    run_id = make_run(make_config(harness.stages(), items=1))
    worker = harness.worker("worker_after_outputs_recorded")
    wait_until(harness.side_effects)
    harness.control(run_id, pause=True)  # solve waits until the crash has been looked at
    harness.release.touch()
    harness.killed(worker)
    (recorded,) = harness.artifacts()
    assert harness.by_stage("prepare")[0].outcome == "succeeded"
    (stored,) = harness.objects()
    assert sha(stored) == recorded.sha256 and recorded.location.endswith(recorded.sha256)
    assert harness.by_stage("solve") == []

    harness.control(run_id, pause=False)
    harness.worker()
    wait_until(lambda: len(harness.consumed_lines()) == 1)
    wait_until(lambda: len(harness.attempts()) == 2 and harness.settled())
    (solve,) = harness.by_stage("solve")
    assert solve.outcome == "succeeded"
    with db.session_factory(harness.engine)() as session:
        (given,) = session.scalars(select(AttemptInput).where(AttemptInput.attempt_id == solve.id))
    assert given.sha256 == recorded.sha256 and given.artifact_id == recorded.id


def test_killed_while_fetching_inputs_the_process_never_started(harness, make_run):
    make_run(make_config(harness.stages(), items=1))
    harness.release.touch()
    worker = harness.worker("worker_fetching_inputs")
    harness.killed(worker)
    (solve,) = harness.by_stage("solve")
    assert solve.state == "intent" and solve.supervisor_pid is None
    # Nothing of it ran: no supervisor, no exit record, no input kept, no side effect.
    directory = Path(solve.attempt_dir)
    assert not (directory / "supervisor.log").exists()
    assert not (directory / "exit.json").exists()
    assert not (directory / "inputs" / "prepare" / "packet.json").exists()
    assert harness.consumed_lines() == []

    # The kernel's rule for an intent without a supervisor: unknown, for an operator.
    harness.worker()
    unknown = wait_until(lambda: harness.by_stage("solve")[0].state == "unknown" and solve)
    with db.transaction(db.session_factory(harness.engine)) as session:
        ledger.reconcile_attempt(
            session,
            unknown.id,
            verdict="not-run",
            reason="checked: killed while fetching its inputs",
            actor="test",
            now=db.ledger_now(session, SystemClock()),
        )
    wait_until(lambda: len(harness.consumed_lines()) == 1)
    assert harness.consumed_lines()[0].endswith("packet for item0")
