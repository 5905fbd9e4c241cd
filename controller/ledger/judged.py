"""The one write of a verdict: what ``controller.attempt.judge_attempt`` decided (or an
operator said), written in the caller's transaction.

Four actors write a verdict on an attempt: the worker's settle, its restart recovery
(an orphan settled from its exit record), the controller settling an attempt whose
lease expired, and an operator's reconcile (by hand or from conclusive evidence). Each
calls ``settle_judged``, which owns what they have in common:

- an outcome that is not established marks the attempt unknown (``mark_unknown``);
  an established one settles it (``settle_from_verdict``), or, for an operator's
  reconcile of an unknown attempt, reconciles it (``reconcile_attempt``);
- an attempt whose identity was still waiting for its worker's next write (the worker
  died first) gets it from its exit record first (``record_spawn_from_exit``);
- a success's stored outputs are recorded with the settle (``record_artifacts``), so an
  attempt is ``succeeded`` with its outputs in the ledger, or not at all.

The caller judges outside the transaction (file reads, the artifact store) and says
how it holds the attempt: ``Fenced`` (the lease's fence: the worker, its recovery, the
controller) or ``Reconciled`` (the operator's say on an unknown attempt).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, overload

from sqlalchemy.orm import Session

from laneway.controller.attempt import Judged
from laneway.controller.ledger.artifacts import record_artifacts
from laneway.controller.ledger.operator import reconcile_attempt
from laneway.controller.ledger.settle import (
    mark_unknown,
    record_spawn_from_exit,
    settle_from_verdict,
)
from laneway.controller.states import JobState


@dataclass(frozen=True)
class Fenced:
    """A settle by the lease's holder, or on its behalf, under the lease's fence."""

    fence: int
    identity_from_exit: bool = False
    """The attempt is still ``intent`` (its identity never reached the ledger): record
    it from the exit record before the settle."""
    measured: dict[str, Any] | None = None
    """The worker's latest and peak samples (``workers.flight.measurements``)."""
    revoke: bool = False
    """Settling on the holder's behalf after its lease expired: the fence is bumped."""
    reason_suffix: str = ""
    """Appended to the verdict's reason (who settled it, when not its worker)."""


@dataclass(frozen=True)
class Reconciled:
    """An operator's say on an unknown attempt (``reconcile_attempt``): ``as_`` one of
    ``RECONCILE_AS``, or ``evidence`` (the attempt then settles into the judged
    verdict's outcome, which its conclusive exit record established)."""

    as_: str
    reason: str
    exit_code: int | None = None
    exit_signal: int | None = None


@overload
def settle_judged(
    session: Session,
    attempt_id: int,
    judged: Judged,
    how: Reconciled,
    *,
    actor: str,
    now: datetime,
    node: str,
) -> JobState: ...


@overload
def settle_judged(
    session: Session,
    attempt_id: int,
    judged: Judged,
    how: Fenced,
    *,
    actor: str,
    now: datetime,
    node: str,
) -> JobState | None: ...


def settle_judged(
    session: Session,
    attempt_id: int,
    judged: Judged,
    how: Fenced | Reconciled,
    *,
    actor: str,
    now: datetime,
    node: str,
) -> JobState | None:
    """Write ``judged`` for ``attempt_id`` as ``how`` holds it (module docstring), the
    outputs it stored recorded as stored by a worker of ``node``. Returns the job's new
    state, or None when the attempt was marked unknown. StaleLease (``Fenced``, before
    anything is written) or IllegalTransition (``Reconciled``: another reconcile won)."""
    verdict = judged.verdict
    if isinstance(how, Reconciled):
        job_state = reconcile_attempt(
            session,
            attempt_id,
            verdict=how.as_,
            reason=how.reason,
            actor=actor,
            now=now,
            result=judged.result,
            exit_code=how.exit_code,
            exit_signal=how.exit_signal,
            outcome=verdict.outcome if how.as_ == "evidence" else None,
        )
    elif verdict.outcome is None:
        mark_unknown(
            session,
            attempt_id,
            reason=verdict.reason,
            actor=actor,
            now=now,
            fence=how.fence,
            result=judged.result,
        )
        return None
    else:
        if how.identity_from_exit:
            record_spawn_from_exit(
                session,
                attempt_id,
                fence=how.fence,
                actor=actor,
                now=now,
                exit_record=judged.exit_record,
            )
        job_state = settle_from_verdict(
            session,
            attempt_id,
            fence=how.fence,
            verdict=verdict,
            exit_record=judged.exit_record,
            result=judged.result,
            actor=actor,
            now=now,
            measured=how.measured,
            revoke=how.revoke,
            reason_suffix=how.reason_suffix,
        )
    record_artifacts(session, attempt_id, judged.stored, node=node, now=now)
    return job_state
