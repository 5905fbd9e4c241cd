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
this machine. Read-only: file reads and /proc; the caller settles what it decides to
(``controller/reconcile.py``). ``mark_conclusive`` is the judgement ``laneway status``
and the dashboard (``controller/web.py``) show, with the command that settles them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laneway.controller import identity
from laneway.controller.attempt import Delivery, ExitRules, judge_attempt
from laneway.controller.config import StageConfig, config_from_frozen
from laneway.controller.durable import AttemptDir
from laneway.controller.outcome import EXIT_MAX_BYTES, Verdict, read_attempt_json
from laneway.controller.states import Outcome

if TYPE_CHECKING:
    from laneway.controller.rows import Rows
    from laneway.controller.status_model import StatusReport

_UNKNOWN_COLUMNS = (
    "id",
    "job_id",
    "attempt_dir",
    "boot_id",
    "supervisor_pid",
    "supervisor_start_time",
    "child_pid",
    "child_start_time",
    "node",
)


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


def read_exit_record(attempt_dir: str) -> Any:
    """The attempt's ``exit.json``, parsed, read as the settle reads it
    (``outcome.read_attempt_json``): a regular file of bounded size, through
    ``AttemptDir``, so no link the job planted is followed and a FIFO is never waited on.
    FileNotFoundError when there is none; OSError or ValueError when it cannot be used."""
    with AttemptDir(attempt_dir) as directory:
        return read_attempt_json(directory, "exit.json", EXIT_MAX_BYTES)


def by_hand(attempt_id: int, runtime_dir: str | None = None) -> str:
    """The command an operator settles an attempt with once they know what happened."""
    where = f" --runtime-dir {shlex.quote(runtime_dir)}" if runtime_dir else ""
    return f"`laneway reconcile {attempt_id} --as succeeded|failed|not-run --reason '...'{where}`"


def judge(
    attempt: Any, stage: StageConfig, *, worker_host: str | None, runtime_dir: str | None = None
) -> Evidence:
    """The evidence for one unknown attempt (an ``attempts`` row, its stage, the host of
    the worker that claimed it). When it is not conclusive, its words say in plain terms
    what is missing, where to look and the command that settles it by hand (with
    ``runtime_dir``'s ``--runtime-dir`` when given)."""
    aid = attempt.id
    node = getattr(attempt, "node", None)
    on = f"node {node}" if node else "its node"
    then = f"then {by_hand(aid, runtime_dir)}"
    if worker_host is not None and worker_host != identity.host():
        return Evidence(
            aid,
            False,
            f"it ran on {on} (host {worker_host}), whose processes and files this machine "
            f"cannot see; run this on {worker_host}, or check there, {then}",
        )
    alive = _alive(attempt)
    if alive:
        return Evidence(
            aid,
            False,
            f"its {alive} is still running on {on}: the attempt has not finished; run this "
            "again once it has",
        )
    path = Path(attempt.attempt_dir) / "exit.json"
    try:
        record = read_exit_record(attempt.attempt_dir)
    except FileNotFoundError:
        return Evidence(aid, False, _no_exit_record(attempt, path, on, then))
    except (OSError, ValueError, RecursionError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return Evidence(
            aid,
            False,
            f"its exit record {path} cannot be read ({why}); check it and the job's output "
            f"(`laneway logs {aid}`) on {on}, {then}",
        )
    if not isinstance(record, dict) or record.get("attempt_id") != aid:
        return Evidence(
            aid,
            False,
            f"{path} is not attempt {aid}'s exit record (it does not name it); check the "
            f"attempt on {on}, {then}",
        )
    judged = judge_attempt(  # judged only: the read side stores nothing
        attempt.attempt_dir,
        ExitRules.of_stage(stage, job_id=attempt.job_id, missing_exit="no exit.json"),
    )
    verdict, result = judged.verdict, judged.result
    if verdict.outcome is None:
        return Evidence(
            aid,
            False,
            f"its exit record does not establish an outcome ({verdict.reason}); check the "
            f"job's output (`laneway logs {aid}`), {then}",
        )
    record = judged.exit_record or {}
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


def _no_exit_record(attempt: Any, path: Path, on: str, then: str) -> str:
    """What is missing for an attempt without an exit record, and what to do."""
    if attempt.supervisor_pid is None and attempt.child_pid is None:
        return (
            f"no exit record ({path}) and no supervisor status (its worker never recorded "
            f"a supervisor pid); the job may still be running on {on} — check there, {then}"
        )
    if attempt.boot_id is not None and not identity.same_boot(attempt.boot_id):
        gone = "the machine has rebooted since it started, so nothing of it runs"
    else:
        gone = "neither its supervisor nor its child is running"
    return (
        f"no exit record ({path}), and {gone}: it ended without writing one, so its "
        f"outcome is not known — read its output (`laneway logs {attempt.id}`), {then}"
    )


@dataclass(frozen=True)
class _UnknownRow:
    """The columns of an ``attempts`` row that ``judge`` reads."""

    id: int
    job_id: int
    attempt_dir: str
    boot_id: str | None
    supervisor_pid: int | None
    supervisor_start_time: int | None
    child_pid: int | None
    child_start_time: int | None
    node: str | None


def judge_unknowns(source: Rows, run_id: int) -> dict[int, Evidence]:
    """The evidence for every unknown attempt of run ``run_id``, by attempt id, read
    through ``source`` (a ``readonly.ReadOnlyLedger`` or ``rows.SessionRows``: plain SQL, no
    ORM) with the stage config the run froze."""
    [(frozen, runtime_dir)] = source.rows(
        "SELECT config_json, runtime_dir FROM runs WHERE id = :run", {"run": run_id}
    )
    config = config_from_frozen(frozen)
    columns = ", ".join(f"a.{name}" for name in _UNKNOWN_COLUMNS)
    rows = source.rows(
        f"SELECT {columns}, j.stage, w.host FROM attempts a "
        "JOIN jobs j ON j.id = a.job_id LEFT JOIN workers w ON w.id = a.worker_id "
        "WHERE a.run_id = :run AND a.state = 'unknown'",
        {"run": run_id},
    )
    width = len(_UNKNOWN_COLUMNS)
    judged = {}
    for row in rows:
        attempt = _UnknownRow(*row[:width])
        stage, host = row[width], row[width + 1]
        judged[attempt.id] = judge(
            attempt, config.stage(stage), worker_host=host, runtime_dir=runtime_dir
        )
    return judged


def settle_command(run_id: int, runtime_dir: str) -> str:
    """The command that settles a run's unknown attempts whose evidence is conclusive."""
    return (
        f"laneway reconcile --run {run_id} --from-evidence --runtime-dir {shlex.quote(runtime_dir)}"
    )


def mark_conclusive(source: Rows, report: StatusReport) -> None:
    """Mark, in a ``status_report``, each unknown attempt whose evidence has become
    conclusive (read here: its exit record, /proc): ``unknown.conclusive`` is the
    evidence (``Evidence.as_dict``) with ``settle``, the command that settles it
    (``settle_command``). Attempts not conclusive are left as they are. ``laneway
    status`` and the dashboard's state both show this."""
    if not report.unknown:
        return
    run_id = report.run.id
    judged = judge_unknowns(source, run_id)
    command = settle_command(run_id, report.run.runtime_dir)
    for unknown in report.unknown:
        found = judged.get(unknown.attempt_id)
        if found is not None and found.conclusive:
            unknown.conclusive = {**found.as_dict(), "settle": command}


def verified_exit(attempt: Any) -> tuple[int | None, int | None]:
    """The exit code and signal from the attempt's own exit record, when there is one
    that is whole and names this attempt (a known exit code is never lost by a
    reconcile); (None, None) otherwise. ``attempt``: anything with ``id`` and
    ``attempt_dir`` (an ``attempts`` row)."""
    try:
        record = read_exit_record(attempt.attempt_dir)
    except (OSError, ValueError, RecursionError):
        return None, None
    if not isinstance(record, dict) or record.get("attempt_id") != attempt.id:
        return None, None
    code, signum = record.get("exit_code"), record.get("signal")
    valid = [v for v in (code, signum) if isinstance(v, int) and not isinstance(v, bool)]
    if not valid:
        return None, None
    return (code if code in valid else None), (signum if signum in valid else None)


def _alive(attempt: Any) -> str | None:
    """Which of the attempt's processes still runs on this machine, if any."""
    if not identity.same_boot(attempt.boot_id):
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
    found: Evidence, attempt_dir: str, stage: StageConfig, store_url: str
) -> tuple[Evidence, list[dict[str, Any]]]:
    """Conclusive evidence of a success, for a stage that declares outputs: the outputs
    stored as a worker's settle would (``judge_attempt`` given the success), and what
    to record; or
    the evidence of the outcome that says why they could not be (missing: ``failed``; a
    store failure: ``harness_failure``). Anything else passes through. Writes to the
    artifact store, never to the ledger."""
    if not found.conclusive or found.outcome is not Outcome.SUCCEEDED or not stage.outputs:
        return found, []
    judged = judge_attempt(
        attempt_dir, Verdict(Outcome.SUCCEEDED, found.words), Delivery.of_stage(stage, store_url)
    )
    verdict = judged.verdict
    if verdict.outcome is Outcome.SUCCEEDED:
        return found, judged.stored
    return replace(found, outcome=verdict.outcome, words=f"{found.words}; {verdict.reason}"), []
