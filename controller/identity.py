"""Process identity that survives restarts: (boot id, pid, start time in clock ticks).

A pid alone is recycled; the kernel's start time of that pid (field 22 of
/proc/PID/stat) and the boot id together tell "the same process" from "a new process
that got the same number". Stdlib only: the supervisor imports this (through
``workers.identity``), and the controller, judging an attempt's processes, uses it too.
"""

from __future__ import annotations

import os

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """The kernel's boot id; 'unknown-boot' where /proc does not offer one."""
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return "unknown-boot"


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and ')' : split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])


def host() -> str:
    return os.uname().nodename


def same_process(pid: int, start_time: int | None) -> bool:
    """True if ``pid`` is alive and is the process that had ``start_time``."""
    return start_time is not None and process_start_time(pid) == start_time


def current() -> tuple[int, int | None]:
    pid = os.getpid()
    return pid, process_start_time(pid)
