"""Where a job goes after an attempt settles: the one retry decision.

Pure: no ledger access. A job gets another attempt only when its stage's retry policy
names the outcome (a rate-limited one needs no naming) and attempts remain (invariant
2, docs/invariants.md); a lost worker,
a harness failure, a fatal failure or an unknown outcome is never retried automatically.
"""

from __future__ import annotations

from laneway.controller.config import RetryPolicy, StageConfig, retryable
from laneway.controller.states import JobState, Outcome


def next_job_state(stage: StageConfig, outcome: Outcome, attempts_made: int) -> JobState:
    """The job's state after an attempt settled into ``outcome``."""
    if outcome is Outcome.SUCCEEDED:
        return JobState.SUCCEEDED
    if outcome is Outcome.CANCELLED:
        return JobState.CANCELLED
    rate_limited = outcome is Outcome.RATE_LIMITED  # the provider's refusal, not the job's
    if (rate_limited or retryable(stage, outcome)) and attempts_made < stage.retry.max_attempts:
        return JobState.READY
    return JobState.FAILED


def rate_limited_delay(retry: RetryPolicy, attempts_made: int, asked: float | None) -> float:
    """Seconds a rate-limited attempt's retry waits: what the job asked for
    (``retry_after_seconds``), else the stage's backoff."""
    return asked if asked is not None else retry_delay(retry, attempts_made)


def retry_delay(retry: RetryPolicy, attempts_made: int) -> float:
    """Seconds an automatic retry waits after attempt number ``attempts_made`` (1 for
    the first): ``backoff_seconds`` x ``backoff_multiplier`` ^ (attempts_made - 1), at
    most ``backoff_max_seconds``; 0 when the stage sets no backoff."""
    if retry.backoff_seconds <= 0:
        return 0.0
    exponent = max(0, attempts_made - 1)
    delay = retry.backoff_seconds * retry.backoff_multiplier**exponent
    return float(min(delay, retry.backoff_max_seconds))
