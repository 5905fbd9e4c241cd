"""Stopping a running attempt from this machine (``laneway cancel``): check that the
attempt's supervisor is that very process here, then send it TERM. ``cancel`` is the
whole operator's workflow (record, then signal); the other two are its steps.

The supervisor (workers/supervisor.py) does the rest: TERM to the job's process group,
the stage's grace budget, KILL, a check that nothing of the group is left, ``stopped``
in ``exit.json``; the worker settles the attempt ``cancelled``. Identity is boot id, pid
and start time (workers/identity.py), so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from laneway.controller import db, ledger
from laneway.controller.errors import IllegalTransition, UsageError
from laneway.controller.states import ControlKind, ControlScope
from laneway.workers import identity

if TYPE_CHECKING:
    from sqlalchemy import Engine


@dataclass(frozen=True)
class Cancelled:
    """What ``cancel`` did: pending jobs cancelled (``run`` only) and the supervisor pids
    sent TERM, in the order signalled."""

    jobs_cancelled: int = 0
    attempts_signalled: list[int] = field(default_factory=list)


def cancel(
    engine: Engine,
    *,
    reason: str,
    actor: str,
    now: datetime,
    attempt: int | None = None,
    run: int | None = None,
    patience: float = 30.0,
) -> Cancelled:
    """Cancel one running ``attempt``, or a whole ``run`` (exactly one of them).

    In one write transaction (retried on a transient ledger failure for up to
    ``patience`` seconds, as ``db.retrying`` does): find the targets (the attempt; or
    every running attempt of the run), check every one's supervisor is that very
    process on this machine before anything is recorded (``check_local_supervisor``: a
    refused cancel leaves the ledger as it was), then for a run set a ``stop`` control
    on it and cancel its waiting and ready jobs, and record ``cancel_requested`` for
    each target. Once committed, TERM to each target's supervisor
    (``terminate_supervisor``), which stops the job's group and reports; the worker
    settles the attempt ``cancelled``.

    Raises NotFound for an unknown attempt or run, UsageError for a target that is not
    running here (or for naming neither or both), LedgerUnavailable when the ledger stays
    unreachable. ``reason`` is recorded as given (the caller checks it says something).
    """
    if (attempt is None) == (run is None):
        raise UsageError("name one attempt, or a run (not both)")
    for trying in db.retrying(patience=patience):
        with trying, db.transaction(db.session_factory(engine)) as session:
            if run is not None:
                ledger.get_run(session, run)
                targets = ledger.running_attempts(session, run)
            else:
                assert attempt is not None
                targets = [ledger.get_attempt(session, attempt)]
            # Check every supervisor's identity before recording anything: a refused
            # cancel leaves the ledger as it was.
            for target in targets:
                check_local_supervisor(target)
            pending = 0
            if run is not None:
                ledger.set_control(
                    session,
                    ControlKind.STOP,
                    scope=ControlScope.RUN,
                    run_id=run,
                    reason=reason,
                    actor=actor,
                    now=now,
                )
                pending = ledger.cancel_pending(session, run, reason=reason, actor=actor, now=now)
            for target in targets:
                ledger.request_cancel(session, target.id, reason=reason, actor=actor, now=now)
    signalled = [terminate_supervisor(target) for target in targets]
    return Cancelled(jobs_cancelled=pending, attempts_signalled=signalled)


def check_local_supervisor(attempt: Any) -> None:
    """Refuse unless ``attempt`` is running (IllegalTransition, exit 1: a row in another
    state) and its supervisor is that very process on this machine (UsageError, exit 2:
    the command belongs on the machine where it runs)."""
    if attempt.state != "running":
        raise IllegalTransition(
            f"attempt {attempt.id} is {attempt.state}; only a running attempt can be cancelled"
        )
    same = (
        identity.same_boot(attempt.boot_id)
        and attempt.supervisor_pid is not None
        and identity.same_process(attempt.supervisor_pid, attempt.supervisor_start_time)
    )
    if not same:
        raise UsageError(
            f"attempt {attempt.id}: its supervisor (pid {attempt.supervisor_pid}) is not "
            "running on this machine; run cancel where it runs, or reconcile it"
        )


def terminate_supervisor(attempt: Any) -> int:
    """TERM to the attempt's supervisor, its identity checked again just before; returns
    the pid signalled."""
    check_local_supervisor(attempt)
    pid = int(attempt.supervisor_pid)
    os.kill(pid, signal.SIGTERM)
    return pid
