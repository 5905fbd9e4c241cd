"""Evidence for an unknown attempt: has it become conclusive?

An attempt is marked unknown when its outcome could not be established at the time
(worker lost, lease expired while the process may still run). Later its supervisor may
finish and write its exit record. The evidence is conclusive only when all of this holds,
read on this machine:

- the attempt's ``exit.json`` is whole, names this attempt, and classifies into an
  outcome with the stage's exit codes and result rules (as the worker's settle would);
- neither its supervisor nor its child is alive: on the boot that started them, no
  process has their (pid, start time); a machine that has rebooted since (same host,
  another boot id) runs neither.

An attempt that ran on another host is never judged from here: its pids mean nothing on
this machine. Read-only: file reads and /proc; the caller settles what it decides to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from controller.config import StageConfig
from controller.durable import read_json
from controller.outcome import Verdict
from controller.states import Outcome
from workers import artifacts, identity, jobenv


@dataclass(frozen=True)
class Evidence:
    attempt_id: int
    conclusive: bool
    words: str
    """What was found (why it is conclusive, or what is missing)."""
    outcome: Outcome | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    result: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempt_id": self.attempt_id,
            "conclusive": self.conclusive,
            "words": self.words,
            "outcome": None if self.outcome is None else self.outcome.value,
            "exit_code": self.exit_code,
            "exit_signal": self.exit_signal,
        }


def judge(attempt: Any, stage: StageConfig, *, worker_host: str | None) -> Evidence:
    """The evidence for one unknown attempt (an ``attempts`` row, its stage, the host of
    the worker that claimed it)."""
    aid = attempt.id
    if worker_host is not None and worker_host != identity.host():
        return Evidence(aid, False, f"it ran on host {worker_host}; judge it there")
    alive = _alive(attempt)
    if alive:
        return Evidence(aid, False, f"its {alive} is still running")
    path = Path(attempt.attempt_dir) / "exit.json"
    try:
        record = read_json(path)
    except (OSError, ValueError) as exc:
        return Evidence(aid, False, f"no whole exit record ({path}: {exc})")
    if not isinstance(record, dict) or record.get("attempt_id") != aid:
        return Evidence(aid, False, f"{path} does not name attempt {aid}")
    verdict, exit_record, result = jobenv.classify(
        attempt.attempt_dir,
        job_id=attempt.job_id,
        exit_codes=dict(stage.exit_codes),
        result_requirement=stage.result,
        secrets=jobenv.stage_secrets(stage, dict(os.environ)),
        missing_exit="no exit.json",
    )
    if verdict.outcome is None:
        return Evidence(
            aid, False, f"the exit record does not establish an outcome: {verdict.reason}"
        )
    record = exit_record or {}
    code, signum = record.get("exit_code"), record.get("signal")
    return Evidence(
        aid,
        True,
        f"supervisor and child are gone; exit.json: {verdict.reason}",
        outcome=verdict.outcome,
        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        exit_signal=signum if isinstance(signum, int) and not isinstance(signum, bool) else None,
        result=result if isinstance(result, dict) else None,
    )


def _alive(attempt: Any) -> str | None:
    """Which of the attempt's processes still runs on this machine, if any."""
    if attempt.boot_id != identity.boot_id():
        return None  # rebooted since (the caller checked the host): nothing of it runs
    for name, pid, start in (
        ("supervisor", attempt.supervisor_pid, attempt.supervisor_start_time),
        ("child", attempt.child_pid, attempt.child_start_time),
    ):
        if pid is not None and (start is None or identity.same_process(pid, start)):
            if start is None and identity.process_start_time(pid) is None:
                continue
            return f"{name} (pid {pid})"
    return None


def with_outputs(
    found: Evidence, attempt_dir: str, outputs: list[str], store_url: str
) -> tuple[Evidence, list[dict[str, Any]]]:
    """Conclusive evidence of a success, for a stage that declares outputs: the outputs
    stored as a worker's settle would (``artifacts.deliver``), and what to record; or
    the evidence of the outcome that says why they could not be (missing: ``failed``; a
    store failure: ``harness_failure``). Anything else passes through. Writes to the
    artifact store, never to the ledger."""
    if not found.conclusive or found.outcome is not Outcome.SUCCEEDED or not outputs:
        return found, []
    verdict, stored = artifacts.deliver(
        Verdict(Outcome.SUCCEEDED, found.words), attempt_dir, outputs, store_url
    )
    if verdict.outcome is Outcome.SUCCEEDED:
        return found, stored
    return replace(found, outcome=verdict.outcome, words=f"{found.words}; {verdict.reason}"), []
