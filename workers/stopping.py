"""Stopping a running attempt from this machine (``laneway cancel``): check that the
attempt's supervisor is that very process here, then send it TERM. ``cancel`` is the
operator's workflow (``controller.operator.cancel``: record, then signal) with this
machine's two steps below.

The supervisor (workers/supervisor.py) does the rest: TERM to the job's process group,
the stage's grace budget, KILL, a check that nothing of the group is left, ``stopped``
in ``exit.json``; the worker settles the attempt ``cancelled``. Identity is boot id, pid
and start time (workers/identity.py), so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
from datetime import datetime
from typing import TYPE_CHECKING, Any

from laneway.controller import operator
from laneway.controller.errors import IllegalTransition, UsageError
from laneway.controller.operator import Cancelled
from laneway.workers import identity

if TYPE_CHECKING:
    from sqlalchemy import Engine


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
    """Cancel one running ``attempt``, or a whole ``run`` (exactly one of them), from this
    machine: ``controller.operator.cancel`` with this module's two steps, recorded as
    ``actor`` at ``now``. Raises as that does."""
    from laneway.workers import stopping as here

    op = operator.Operator(engine, actor, now=lambda: now, patience=patience)
    return operator.cancel(op, attempt=attempt, run=run, reason=reason, here=here)


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
