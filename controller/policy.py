"""Where a job goes after an attempt settles: the one retry decision.

Pure: no ledger access. A job gets another attempt only when its stage's retry policy
names the outcome and attempts remain (invariant 2, docs/invariants.md); a lost worker,
a harness failure, a fatal failure or an unknown outcome is never retried automatically.
"""

from __future__ import annotations

from controller.config import StageConfig, retryable
from controller.states import JobState, Outcome


def next_job_state(stage: StageConfig, outcome: Outcome, attempts_made: int) -> JobState:
    """The job's state after an attempt settled into ``outcome``."""
    if outcome is Outcome.SUCCEEDED:
        return JobState.SUCCEEDED
    if outcome is Outcome.CANCELLED:
        return JobState.CANCELLED
    if retryable(stage, outcome) and attempts_made < stage.retry.max_attempts:
        return JobState.READY
    return JobState.FAILED
