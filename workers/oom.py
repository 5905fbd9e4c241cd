"""Naming an attempt that the kernel's OOM killer ended.

The kernel counts its OOM kills per memory cgroup: ``oom_kill`` in ``memory.events``
(cgroup v2, counting the cgroup and everything below it) or in ``memory.oom_control``
(cgroup v1, the cgroup alone). Supervisors and their jobs live in the worker's cgroup,
so the worker reads its own counter once as it starts an attempt, and once more only
when an attempt's child died of a SIGKILL that laneway did not send. Laneway sends one
only after a timeout or an operator's stop (the exit record says ``timed_out`` or
``stopped``) or to leftovers after the child had already exited, so for the child
itself ``signal == 9`` without those flags is someone else's kill. A counter that went
up since the attempt started names it; without a counter (no cgroup, no permission, a
recovered attempt) the node's free memory under its floor at the worker's last probe
does. Anything unreadable means no evidence, never an error. Where the kernel counts
no kills at all (macOS; Linux with ``LANEWAY_PORTABLE``, the ``oom`` seam ``inferred``
of ``workers/seams.py``) the free-memory evidence is the only kind, and it is named
inferred (``controller.oom``).

Several attempts share the worker's cgroup: an OOM kill while two of them ran, one
killed by someone else, would name both.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from laneway.controller import identity, oom

PROC_SELF = "/proc/self"


def _oom_kills(text: str) -> int | None:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def locate(cgroup_text: str, mountinfo_text: str) -> Path | None:
    """The file holding the oom_kill counter of the process whose ``/proc/PID/cgroup``
    and ``/proc/PID/mountinfo`` these are: cgroup v2's ``memory.events`` when the
    memory controller is enabled there, else cgroup v1's ``memory.oom_control``;
    None when neither exists."""
    paths: dict[str, str] = {}
    for line in cgroup_text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths["cgroup2"] = path
        elif "memory" in controllers.split(","):
            paths["cgroup"] = path
    mounts: dict[str, tuple[str, str]] = {}
    for line in mountinfo_text.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, after = fields.split(), tail.split()
        if len(parts) < 5 or len(after) < 3:
            continue
        root, mountpoint, fstype, options = parts[3], parts[4], after[0], after[2]
        if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in options.split(",")):
            mounts.setdefault(fstype, (root, mountpoint))
    for fstype, name in (("cgroup2", "memory.events"), ("cgroup", "memory.oom_control")):
        if fstype not in paths or fstype not in mounts:
            continue
        root, mountpoint = mounts[fstype]
        path = paths[fstype]
        if root != "/" and path.startswith(root):
            path = path[len(root) :]  # a cgroup namespace: the mount shows its root
        candidate = Path(mountpoint) / path.lstrip("/") / name
        if candidate.is_file():
            return candidate
    return None


class OomCounter:
    """The kernel's count of OOM kills in one memory cgroup (``path``: its
    ``memory.events`` or ``memory.oom_control``; None: no counter)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)

    @classmethod
    def of_this_process(cls, proc: str = PROC_SELF) -> OomCounter:
        """The counter of the cgroup this process runs in (None path if none is found,
        or the Linux facilities are switched off: ``identity.portable``)."""
        if identity.portable():
            return cls(None)
        try:
            cgroup = Path(proc, "cgroup").read_text()
            mountinfo = Path(proc, "mountinfo").read_text()
        except OSError:
            return cls(None)
        return cls(locate(cgroup, mountinfo))

    def read(self) -> int | None:
        """The count now; None when there is no counter or it cannot be read."""
        if self.path is None:
            return None
        try:
            return _oom_kills(self.path.read_text())
        except (OSError, UnicodeDecodeError):
            return None


def unexplained_sigkill(exit_record: dict[str, Any] | None) -> bool:
    """The child died of a SIGKILL that laneway did not send."""
    record = exit_record or {}
    return (
        record.get("signal") == signal.SIGKILL
        and not record.get("timed_out")
        and not record.get("stopped")
    )


def name_oom(
    exit_record: dict[str, Any] | None,
    *,
    kills_at_start: int | None,
    kills_now: int | None,
    mem_available_mib: float | None,
    memory_floor_mib: int | None,
    peak_rss_mib: float | None,
) -> dict[str, Any] | None:
    """The ``oom_killed`` evidence of an attempt (``controller.oom.evidence``), or None
    when nothing says the OOM killer ended it."""
    if not unexplained_sigkill(exit_record):
        return None
    source: oom.Source
    if kills_at_start is not None and kills_now is not None and kills_now > kills_at_start:
        source = "cgroup"
    elif (
        mem_available_mib is not None
        and memory_floor_mib is not None
        and mem_available_mib < memory_floor_mib
    ):
        source = "free_memory"
    else:
        return None
    return oom.evidence(
        source,
        mem_available_mib=mem_available_mib,
        memory_floor_mib=memory_floor_mib,
        peak_rss_mib=peak_rss_mib,
    )
