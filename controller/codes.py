"""The codes that say why work waits and what a person does next, each member annotated
with what it means and who lifts it.

``RefusalCode`` is admission's vocabulary (``controller/admission.py`` decides, the
decisions table stores it as ``reason_code``, ``controller/refusal_words.py`` words it);
``StepCode`` holds the next-step codes that are not a refusal (``controller/advice.py``
and ``controller/notice_steps.py`` give them). A next step's code is either: a lane held
by a refusal says so with the refusal's own code. Both are ``StrEnum``: a member is its
text, so JSON and the ledger hold the same strings as before they were typed.

Pure Python: the standard library and ``controller/states.py``, which it sits beside.
"""

from __future__ import annotations

from enum import StrEnum

from laneway.controller.states import ControlKind


class RefusalCode(StrEnum):
    """Why admission leaves a job (or a lane) waiting, in the order it checks them."""

    OTHER_NODE = "other_node"
    """The job's stage runs on other nodes. Nothing lifts it on this node: a worker of
    one of the stage's nodes claims it."""
    HALTED = "halted"
    """A halt control covers the run, lane or everything. Only an operator's reasoned
    ``clear-halt`` lifts it (a halt over changed sources: only a new run)."""
    UNKNOWN_OUTCOME = "unknown_outcome"
    """An attempt's outcome is unknown (invariant 3). Only an operator's ``reconcile``
    lifts it."""
    PAUSED = "paused"
    """A pause covers it (an operator's, a breaker's or the budget's). An operator's
    ``resume`` lifts it (a budget's pause: a new run with more budget)."""
    STOPPED = "stopped"
    """A stop (drain) covers it. An operator's ``resume`` lifts it."""
    BUDGET = "budget"
    """The run's or stage's budget leaves nothing for this attempt. More budget (a new
    run) lifts it, or a reconcile that gives a reservation back."""
    RATE_LIMIT = "rate_limit"
    """A rate limit of the stage is reached. Its window lifts it by itself."""
    SECRET_MISSING = "secret_missing"
    """This worker lacks a variable the stage needs. A worker that has it (this one,
    restarted with it) lifts it."""
    MAX_JOBS = "max_jobs"
    """The node runs its ``max_jobs``. The next settle on the node lifts it."""
    SLOTS_FULL = "slots_full"
    """This worker has no free slot. Its next settle lifts it."""
    LANE_CAP = "lane_cap"
    """The lane's cap for the stage is reached. A settle in the lane lifts it."""
    STAGE_CAP = "stage_cap"
    """The stage's global cap is reached. A settle of the stage lifts it."""
    GPU_CAPACITY = "gpu_capacity"
    """The node has no GPU, or fewer than the stage asks for. Only a config (or node)
    with the devices lifts it."""
    GPU_BUSY = "gpu_busy"
    """The whole devices the stage needs are held. A GPU attempt's settle lifts it."""
    GPU_MEMORY = "gpu_memory"
    """A share of a device fits on none (invariant 9). A GPU attempt's settle, or a
    measured peak that says it fits, lifts it."""
    MEMORY_FLOOR = "memory_floor"
    """Free memory minus what is held would fall under the node's floor. Memory that
    running attempts release (or a smaller reservation) lifts it."""
    NEEDS_PENDING = "needs_pending"
    """(Lane-level) nothing is ready; jobs wait on earlier stages. Their settles lift it."""
    BATCH_CAP = "batch_cap"
    """The run's batch cap is reached. No module emits it today: a run takes on its first
    ``batch_cap`` items when it starts and never the rest (a new run takes them); advice
    keeps its words for a lane that says so."""
    RETRY_BACKOFF = "retry_backoff"
    """Not admission's own (``laneway explain``'s): a ready job waits out its stage's retry
    backoff. The controller makes it claimable when the backoff passes."""
    NO_WORKER = "no_worker"
    """Not admission's own: no live worker serves the node (``controller/status_nodes.py``,
    the report, explain). Starting a worker there lifts it."""


CONTROL_CODES: dict[ControlKind, RefusalCode] = {
    ControlKind.HALT: RefusalCode.HALTED,
    ControlKind.PAUSE: RefusalCode.PAUSED,
    ControlKind.STOP: RefusalCode.STOPPED,
}
"""A control's kind -> the refusal it holds work with."""
CONTROL_KINDS: dict[str, ControlKind] = {code: kind for kind, code in CONTROL_CODES.items()}
"""The refusal of a control -> its kind (keyed by text: a code read back from the ledger)."""

OPERATOR_LIFTS = frozenset(
    {RefusalCode.HALTED, RefusalCode.UNKNOWN_OUTCOME, RefusalCode.PAUSED, RefusalCode.STOPPED}
)
"""The refusals only an operator lifts (a control, an unknown outcome)."""


class StepCode(StrEnum):
    """A next step's code where it is no refusal (``status_model.NextStep.code``; a lane
    held by a refusal gives that ``RefusalCode`` instead)."""

    DONE = "done"
    """The lane (or the run) has nothing left to start. Nothing to lift."""
    RUNNING = "running"
    """The lane runs attempts; nothing to do. Their settles move it on."""
    NO_CONTROLLER = "no_controller"
    """No controller serves an unfinished run. Continuing the run in the foreground, or
    starting ``laneway controller``, lifts it."""
    SOURCES_CHANGED = "sources_changed"
    """The run halted because its frozen sources changed. Only a new run lifts it
    (``clear-halt`` cannot: the next claim halts again)."""
    BREAKER = "breaker"
    """The infrastructure breaker paused the run. An operator's ``resume`` lifts it, once
    the infrastructure is fixed."""
    UNRECORDED = "unrecorded"
    """A lane with jobs to start and no refusal recorded yet. The next claim records one."""
    UNPLACED = "unplaced"
    """A notification whose run is gone from the ledger: see ``laneway status``."""
    SEE_STATUS = "see_status"
    """A notification whose run holds nothing for a person any more (it was lifted)."""
    WORKER_LOST = "worker_lost"
    """A notification: a worker was judged lost. Starting a worker on its node lifts it."""
    CONTROLLER_LOST = "controller_lost"
    """A notification: the controller stopped heartbeating. Starting one lifts it."""


def refusal_code(text: str) -> RefusalCode | str:
    """A code read back (the ledger's ``reason_code``, a ``status.json``) as its member;
    a code this version does not know (an older ledger's) stays the text it was."""
    try:
        return RefusalCode(text)
    except ValueError:
        return text


def step_code(text: str) -> StepCode | RefusalCode | str:
    """A next step's code read back as its member (a ``StepCode``, else a
    ``RefusalCode``); a code this version does not know stays the text it was."""
    try:
        return StepCode(text)
    except ValueError:
        return refusal_code(text)
