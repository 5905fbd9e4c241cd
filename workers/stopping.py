"""Stopping a running attempt from this machine (``laneway cancel``): check that the
attempt's supervisor is that very process here, then send it TERM.

The supervisor (workers/supervisor.py) does the rest: TERM to the job's process group,
the stage's grace budget, KILL, a check that nothing of the group is left, ``stopped``
in ``exit.json``; the worker settles the attempt ``cancelled``. Identity is boot id, pid
and start time (workers/identity.py), so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from controller.errors import UsageError
from workers import identity


def check_local_supervisor(attempt: Any) -> None:
    """Refuse (UsageError) unless ``attempt`` is running and its supervisor is that very
    process on this machine."""
    if attempt.state != "running":
        raise UsageError(
            f"attempt {attempt.id} is {attempt.state}; only a running attempt can be cancelled"
        )
    same = (
        attempt.boot_id == identity.boot_id()
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
