"""Whether a process group still has a member: the one look the supervisor (its job's
group) and the controller (a closeout step's group) both take. Standard library only:
the supervisor imports it and starts once per attempt."""

from __future__ import annotations

import os


def group_alive(pgid: int, *, zombies_count: bool) -> bool:
    """Is a process of group ``pgid`` still there?

    ``zombies_count``: whether a zombie member counts as alive. The supervisor counts
    them (it is the subreaper of its job, so it reaps them itself, and must not report
    "stopped" before it has); the controller does not (it is no subreaper: a closeout
    step's orphans are reaped by init, or, where init does not reap, never, and a zombie
    holds no output open and can do nothing). Without ``/proc`` to tell a zombie, the
    signal's answer stands."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if zombies_count:
        return True
    try:
        pids = [name for name in os.listdir("/proc") if name.isascii() and name.isdigit()]
    except OSError:
        return True  # no /proc to look in: the signal said someone is there
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
