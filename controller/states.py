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
    """Terminal. Nothing moves it."""
    FAILED = "failed"
    """Terminal unless an operator asks for a retry (then ready). The attempt's outcome
    column says which failure class."""
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
    """Committed before any process exists (invariant 1). The worker moves it to running
    once the supervisor's identity is recorded; a crash leaves it for the reconciler."""
    RUNNING = "running"
    """Supervisor and child identity recorded. The worker settles it from exit.json;
    the reconciler marks it unknown when its outcome cannot be established."""
    SETTLED = "settled"
    """Terminal: `outcome` holds the class. Nothing moves it."""
    UNKNOWN = "unknown"
    """Outcome could not be established; dispatch halts. Only an operator's reconcile
    moves it to settled."""


class Outcome(StrEnum):
    """The class an attempt settles into (SPEC "Outcome classes")."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INFRA_FAILURE = "infra_failure"
    HARNESS_FAILURE = "harness_failure"
    FATAL = "fatal"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    NOT_RUN = "not_run"
    """Only by an operator's reconcile: the process never ran."""


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
