"""The controller's pidfile: which process serves a runtime dir, readable without the
ledger (standard library only, so ``laneway status`` reads it without SQLAlchemy).

``controller/controller_lock.py`` writes it whenever a process takes the runtime dir's
controller lock (``laneway controller`` and ``laneway run`` alike) and removes it when
that process gives the lock back; a process killed with SIGKILL leaves it behind, and
``running_controller`` then finds no live process behind it. The record is (boot id,
pid, start time), so a recycled pid is not mistaken for the controller.
"""

from __future__ import annotations

import os
from pathlib import Path

from laneway.controller import identity
from laneway.controller.durable import read_json, write_json

PIDFILE = "controller.pid"


def running_controller(runtime_dir: str | os.PathLike[str]) -> int | None:
    """The pid of the live controller of this runtime dir, from its pidfile, if any.

    The pidfile holds (boot id, pid, start time): a recycled pid is not mistaken for it.
    """
    try:
        record = read_json(Path(runtime_dir) / PIDFILE)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not identity.same_boot(record.get("boot_id")):
        return None
    pid = record.get("pid")
    if isinstance(pid, int) and identity.same_process(pid, record.get("start_time")):
        return pid
    return None


def claim_pidfile(runtime_dir: str | os.PathLike[str]) -> None:
    """Record this process as the runtime dir's controller."""
    pid, start_time = identity.current()
    write_json(
        Path(runtime_dir) / PIDFILE,
        {"pid": pid, "start_time": start_time, "boot_id": identity.boot_id()},
    )


def release_pidfile(runtime_dir: str | os.PathLike[str]) -> None:
    """Remove the pidfile if it is still ours."""
    if running_controller(runtime_dir) == os.getpid():
        (Path(runtime_dir) / PIDFILE).unlink(missing_ok=True)
