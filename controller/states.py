"""The state sets of the ledger, each member annotated with who moves a row out of it.

Pure Python (no SQLAlchemy) so config validation, admission and the supervisor-facing
code can share the names. The models mirror every set as a named CHECK constraint;
changing a set means a migration (a table rebuild on SQLite), so add members sparingly.
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    ACTIVE = "active"
    """Jobs may still move. The controller moves it to finished when every job is terminal."""
    FINISHED = "finished"
    """Every job is terminal. Only an operator's retry of one of its jobs reopens it."""


class JobState(StrEnum):
    WAITING = "waiting"
    """Some `needs` have not succeeded yet. The controller moves it to ready or skipped."""
    READY = "ready"
    """Eligible for dispatch. A worker's claim moves it to running; cancel to cancelled."""
    RUNNING = "running"
    """Holds a lease and an attempt in flight. The lease holder's settle moves it to a
    terminal state or back to ready (retry policy); lease expiry or a lost worker moves
    it to unknown (crash-safety reconciler)."""
    UNKNOWN = "unknown"
    """Its attempt's outcome could not be established. Only an operator's reconcile moves
    it (to succeeded, failed, or ready when the attempt did not run)."""
    SUCCEEDED = "succeeded"
    """Terminal. Only an operator's retry of a job that needs it, after the outputs it
    stored left the store, moves it back to ready, or to waiting while a job it needs is
    re-run too (one confirmation, ``laneway retry``)."""
    FAILED = "failed"
    """Terminal unless an operator asks for a retry (then ready, or waiting while a job it
    needs is re-run with it). The attempt's outcome column says which failure class."""
    SKIPPED = "skipped"
    """Terminal: a needed stage did not succeed (reason on the job). Only an operator's
    retry of that stage moves it back to waiting."""
    CANCELLED = "cancelled"
    """Terminal: an operator cancelled it. Nothing moves it."""


TERMINAL_JOB_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.SKIPPED, JobState.CANCELLED}
)


class AttemptState(StrEnum):
    INTENT = "intent"
    """Committed before any process exists (invariant 1, docs/invariants.md). The worker
    moves it to running once the supervisor's identity is recorded; a crash leaves it
    for the reconciler."""
    RUNNING = "running"
    """Supervisor and child identity recorded. The worker settles it from exit.json;
    the reconciler marks it unknown when its outcome cannot be established."""
    SETTLED = "settled"
    """Terminal: `outcome` holds the class. Nothing moves it."""
    UNKNOWN = "unknown"
    """Outcome could not be established; dispatch halts. Only an operator's reconcile
    moves it to settled."""


class Outcome(StrEnum):
    """The class an attempt settles into (docs/architecture.md, "Outcome classification")."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INFRA_FAILURE = "infra_failure"
    HARNESS_FAILURE = "harness_failure"
    FATAL = "fatal"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    NOT_RUN = "not_run"
    """Only by an operator's reconcile: the process never ran."""
    RATE_LIMITED = "rate_limited"
    """The job says a provider refused it for its rate (result.json ``rate_limited:
    true``, or an exit code the stage maps here): retried after ``retry_after_seconds``
    (or the stage's backoff) while attempts remain, whatever its ``retry.on``; never
    counted by the infrastructure breaker."""


RETRYABLE_OUTCOMES = frozenset({Outcome.FAILED, Outcome.INFRA_FAILURE, Outcome.TIMED_OUT})
"""The classes a stage's retry policy may name. A lost worker, a harness failure, a fatal
failure or an unknown outcome is never retried automatically (invariant 2)."""


class ControlKind(StrEnum):
    PAUSE = "pause"
    """Resumable: an operator's resume clears it."""
    STOP = "stop"
    """Drain: no new dispatch; running work finishes. An operator's resume clears it."""
    HALT = "halt"
    """Fatal: only an explicit, reasoned clear-halt lifts it. (An unknown attempt stops
    dispatch by itself, through admission's ``unknown_outcome`` check, not as a control.)"""


class ControlScope(StrEnum):
    RUN = "run"
    LANE = "lane"
    GLOBAL = "global"


class Verdict(StrEnum):
    DISPATCHED = "dispatched"
    REFUSED = "refused"


class WorkerState(StrEnum):
    ACTIVE = "active"
    """Heartbeating. It moves itself to stopped on a clean exit; the controller marks it
    lost when its heartbeat stops."""
    STOPPED = "stopped"
    """Terminal: exited cleanly."""
    LOST = "lost"
    """Terminal: heartbeat stopped; its attempts are reconciled."""


class StepState(StrEnum):
    """The state of one closeout step (``closeout_progress.json`` and its events)."""

    PENDING = "pending"
    """Not started. The controller starts it when the steps before it have ended."""
    RUNNING = "running"
    """Its process runs. The controller's poll moves it to an end state."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    INTERRUPTED = "interrupted"
    """It was running when the controller died; never run again."""


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.WAITING: frozenset({JobState.READY, JobState.SKIPPED, JobState.CANCELLED}),
    JobState.READY: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.READY,  # the stage's retry policy allows another attempt
            JobState.UNKNOWN,
        }
    ),
    JobState.UNKNOWN: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.READY, JobState.CANCELLED}
    ),
    # only an operator's retry; waiting when a producer it needs is re-run with it
    JobState.FAILED: frozenset({JobState.READY, JobState.WAITING}),
    # only an operator's retry of a consumer whose input left the store (waiting while
    # a producer it needs is re-run with it)
    JobState.SUCCEEDED: frozenset({JobState.READY, JobState.WAITING}),
    JobState.SKIPPED: frozenset({JobState.WAITING}),  # only an operator's retry upstream
    JobState.CANCELLED: frozenset(),
}
"""Every legal job transition; the ledger's ``move_job`` refuses anything else."""

ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.INTENT: frozenset(
        {AttemptState.RUNNING, AttemptState.SETTLED, AttemptState.UNKNOWN}
    ),
    AttemptState.RUNNING: frozenset({AttemptState.SETTLED, AttemptState.UNKNOWN}),
    AttemptState.UNKNOWN: frozenset({AttemptState.SETTLED}),
    AttemptState.SETTLED: frozenset(),
}
"""Every legal attempt transition; the ledger's ``move_attempt`` refuses anything else."""

IN_FLIGHT_ATTEMPT_STATES = (AttemptState.INTENT, AttemptState.RUNNING)
"""An attempt whose process may be starting or running under a live lease."""
HELD_ATTEMPT_STATES = (AttemptState.INTENT, AttemptState.RUNNING, AttemptState.UNKNOWN)
"""An attempt that holds a slot on its node: unknown ones too (their process may run)."""
OPEN_JOB_STATES = (JobState.WAITING, JobState.READY, JobState.RUNNING, JobState.UNKNOWN)
"""The complement of TERMINAL_JOB_STATES: a run with one of these is not finished."""


class Attention(StrEnum):
    """A state that needs a person, told to the operator once (controller/notify.py):
    one notification per new occurrence, each with its reason and next step."""

    HALT = "halt"
    """laneway halted a run by itself (a fatal outcome, frozen sources that changed)."""
    UNKNOWN_OUTCOME = "unknown_outcome"
    """Attempts whose outcome could not be established: a reconcile is needed."""
    BUDGET_STOP = "budget_stop"
    """A run paused because its budget leaves nothing more to start."""
    BREAKER_PAUSE = "breaker_pause"
    """A run paused by a breaker: infrastructure failures in a row, a harness failure."""
    WORKER_LOST = "worker_lost"
    """A worker stopped heartbeating and the controller judged it lost."""
    CONTROLLER_LOST = "controller_lost"
    """The controller stopped heartbeating (noticed by a worker)."""
    RUN_FINISHED = "run_finished"
    """Every job of a run is terminal."""


class NotificationState(StrEnum):
    PENDING = "pending"
    """Created; its deliveries are being tried. The process that created it delivers
    it; a controller that starts delivers those its predecessor left pending."""
    DELIVERED = "delivered"
    """Terminal: every channel took it."""
    FAILED = "failed"
    """Terminal: a channel refused it after its bounded retries (each try recorded)."""


class EventKind(StrEnum):
    """Every kind of row in the append-only ``events`` table; nothing else writes one.

    Job and attempt transitions map to their kind through ``JOB_EVENT`` and
    ``ATTEMPT_EVENT`` (controls through ``CONTROL_SET_EVENT``/``CONTROL_CLEARED_EVENT``),
    so no kind is built from a string anywhere else.
    """

    RUN_CREATED = "run_created"
    RUN_FINISHED = "run_finished"
    RUN_REOPENED = "run_reopened"
    SOURCES_CHANGED = "sources_changed"
    SNAPSHOT_FAILED = "snapshot_failed"

    JOB_WAITING = "job_waiting"
    JOB_READY = "job_ready"
    JOB_RUNNING = "job_running"
    JOB_UNKNOWN = "job_unknown"
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    JOB_SKIPPED = "job_skipped"
    JOB_CANCELLED = "job_cancelled"
    JOB_RETRY = "job_retry"
    JOB_RETRY_DUE = "job_retry_due"
    """A retried job's backoff has passed: it may be claimed again (wakes workers)."""
    JOB_REUSED = "job_reused"
    """A new run's job was created succeeded, taking over an earlier run's result."""

    ATTEMPT_INTENT = "attempt_intent"
    ATTEMPT_RUNNING = "attempt_running"
    ATTEMPT_SETTLED = "attempt_settled"
    ATTEMPT_UNKNOWN = "attempt_unknown"
    ATTEMPT_ADOPTED = "attempt_adopted"
    ATTEMPT_EVIDENCE_FOUND = "attempt_evidence_found"
    """A restarted worker read conclusive evidence of an unknown attempt on its own node
    (its exit record, its processes gone): settles nothing, it tells the operator where
    ``laneway reconcile --from-evidence`` can settle it (``ledger.note_evidence``)."""
    CANCEL_REQUESTED = "cancel_requested"
    CAPTURE_RECORDED = "capture_recorded"
    CAPTURE_FAILED = "capture_failed"

    WORKER_STARTED = "worker_started"
    WORKER_STOPPED = "worker_stopped"
    WORKER_LOST = "worker_lost"

    CONTROL_PAUSE = "control_pause"
    CONTROL_STOP = "control_stop"
    CONTROL_HALT = "control_halt"
    CONTROL_PAUSE_CLEARED = "control_pause_cleared"
    CONTROL_STOP_CLEARED = "control_stop_cleared"
    CONTROL_HALT_CLEARED = "control_halt_cleared"

    CLOSEOUT_STEP_STARTED = "closeout_step_started"
    CLOSEOUT_STEP_FINISHED = "closeout_step_finished"
    CLOSEOUT_FINISHED = "closeout_finished"


JOB_EVENT: dict[JobState, EventKind] = {
    state: EventKind(f"job_{state.value}") for state in JobState
}
"""The event a job's move into each state appends."""
ATTEMPT_EVENT: dict[AttemptState, EventKind] = {
    state: EventKind(f"attempt_{state.value}") for state in AttemptState
}
"""The event an attempt's move into each state appends."""
CONTROL_SET_EVENT: dict[ControlKind, EventKind] = {
    kind: EventKind(f"control_{kind.value}") for kind in ControlKind
}
CONTROL_CLEARED_EVENT: dict[ControlKind, EventKind] = {
    kind: EventKind(f"control_{kind.value}_cleared") for kind in ControlKind
}
TERMINAL_JOB_EVENTS = frozenset(JOB_EVENT[state] for state in TERMINAL_JOB_STATES)
"""Events after which an item's waiting jobs may move, or its run may be finished."""
