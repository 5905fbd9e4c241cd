"""What an operator needs to do about an idle lane: one line per reason code, built from
a ``status_report`` (read-only; shared by the live display and the web page).

A reason that clears by itself (a cap, the memory floor while attempts run, earlier
stages still pending) says so; one that needs a person names the command.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laneway.controller.status_model import Lane, StatusReport

WAITS = {
    "max_jobs": "nothing to do: the node runs its max_jobs; the next settle frees a slot",
    "slots_full": "nothing to do: every worker slot is busy; the next settle frees one",
    "lane_cap": "nothing to do: the lane's cap for the stage is reached; it frees as they settle",
    "stage_cap": "nothing to do: the stage's cap is reached; it frees as they settle",
    "needs_pending": "nothing to do: earlier stages of its items are still pending",
    "batch_cap": "nothing to do: the run's batch cap is reached",
}


def lane_action(lane: Lane, status: StatusReport) -> str | None:
    """The operator's next step for ``lane`` (one of ``status.lanes``), or None when the
    lane is running or done."""
    reason = lane.reason
    if lane.running or not lane.pending:
        return None
    run = status.run
    rt = f"--runtime-dir {shlex.quote(run.runtime_dir)}"
    if reason is None:
        return "no refusal recorded yet: `laneway explain JOB` lists what blocks a ready job"
    code = reason.code
    if status.unknown and code != "no_worker":
        # An unknown attempt halts the run's dispatch whatever was recorded last.
        code = "unknown_outcome"
    if code == "no_worker":
        return f"start a worker: {reason.detail.get('start')}"
    if code == "unknown_outcome":
        first = status.unknown[0] if status.unknown else None
        if first is not None:
            return f"reconcile the unknown attempt: {first.reconcile}"
        return (
            "reconcile the unknown attempt(s) that halt dispatch (another run's, scope everything)"
        )
    if code in ("paused", "stopped", "halted"):
        kinds = {"paused": "pause", "stopped": "stop", "halted": "halt"}
        scopes = {c.scope for c in status.controls if c.kind == kinds[code]}
        target = "--all" if scopes == {"global"} else str(run.id)
        verb = "clear-halt" if code == "halted" else "resume"
        return f"once the cause is fixed: laneway {verb} {target} --reason '...' {rt}"
    if code == "memory_floor":
        return (
            "wait for running attempts to release memory, free memory on node "
            f"{reason.node or lane.node}, or lower the stage's memory_mib; "
            "`laneway explain JOB` shows the arithmetic"
        )
    if code == "gpu_capacity":
        return (
            "nothing to do until a GPU attempt settles (a second one shares the node only "
            "when measured peaks say it fits)"
        )
    return WAITS.get(code, f"see `laneway explain JOB` ({code})")
