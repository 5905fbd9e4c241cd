"""Platform seams: what this kernel offers the worker, probed once at start-up, and the
implementation chosen for each. Chosen by capability, never by the platform's name:

- ``wait`` (how the worker learns a supervisor exited): ``pidfd`` (Linux:
  ``pidfd_open``), ``kqueue`` (macOS, BSD: ``EVFILT_PROC`` / ``NOTE_EXIT``) or ``poll``
  (the bounded loop: ``serve`` and ``drain`` wake at least every ``poll_seconds`` and
  poll each supervisor).
- ``identity`` (``controller/identity.py``): ``boot_id + start time`` (``/proc``),
  ``boot uuid + start time`` (``kern.bootsessionuuid``) or ``boot time + start time``.
- ``subreaper``: ``prctl`` (``PR_SET_CHILD_SUBREAPER``: orphaned descendants come back
  to the supervisor, which finds them in ``/proc``) or ``process group`` (the job runs
  in its own session and group; the supervisor signals and waits for the group, and a
  descendant that leaves it with ``setsid`` is not followed: the exit record says
  ``"tracks": "process group"``).
- ``oom``: ``cgroup`` (the memory cgroup counts OOM kills) or ``inferred`` (no counter:
  a SIGKILL laneway did not send while free memory was under the floor is named an OOM
  kill, as inferred evidence).
- ``spawn``: ``fork`` (the warm launcher forks each supervisor) or ``exec`` (each
  supervisor is a fresh interpreter, started by ``subprocess``: where forking an
  interpreter that has run Python code is unsafe, or the launcher is switched off).

``identity.PORTABLE_ENV`` (``LANEWAY_PORTABLE=1``, a test hook, inert unless set) makes
every probe answer "not available", so the portable implementation of every seam runs
on Linux. The worker records its choices in its ``workers`` row (``seams``), which
``laneway status`` shows.
"""

from __future__ import annotations

import ctypes
import os
import select
import sys
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from laneway.controller import identity, status_model
from laneway.workers import oom

PR_GET_CHILD_SUBREAPER = 37
LAUNCHER_ENV = "LANEWAY_SUPERVISOR_LAUNCHER"
"""Set to 0 to start every supervisor by exec instead of forking it from the launcher
(``workers.spawning`` reads the same name)."""


@dataclass(frozen=True)
class Seams:
    """One choice per seam (see the module's docstring)."""

    wait: str
    identity: str
    subreaper: str
    oom: str
    spawn: str

    def as_dict(self) -> dict[str, Any]:
        found = asdict(self)
        if identity.portable():
            found["portable"] = True  # the test hook switched Linux's facilities off
        return found

    def words(self) -> str:
        """``wait pidfd, identity boot_id + start time, subreaper prctl, oom cgroup,
        spawn fork``"""
        return status_model.seams_words(self.as_dict())


def probe_wait() -> str:
    if not identity.portable() and hasattr(os, "pidfd_open"):
        try:
            os.close(os.pidfd_open(os.getpid()))
            return "pidfd"
        except OSError:
            pass
    if hasattr(select, "kqueue") and hasattr(select, "KQ_FILTER_PROC"):
        return "kqueue"
    return "poll"


def probe_subreaper() -> str:
    """``prctl`` when ``PR_GET_CHILD_SUBREAPER`` answers (it changes nothing) and
    ``/proc`` lists a process's children; else ``process group``."""
    if identity.portable() or not os.path.exists(f"/proc/{os.getpid()}/task"):
        return "process group"
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return "process group"
    value = ctypes.c_int(0)
    if prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) != 0:
        return "process group"
    return "prctl"


def probe_oom() -> str:
    return "cgroup" if oom.OomCounter.of_this_process().path is not None else "inferred"


def probe_spawn() -> str:
    """``fork`` where forking the warm launcher is safe (Linux's kernel, not forced
    portable, the launcher not switched off); ``exec`` elsewhere (macOS: a forked
    interpreter that goes on running Python may crash in system libraries)."""
    if identity.portable() or not sys.platform.startswith("linux"):
        return "exec"
    if os.environ.get(LAUNCHER_ENV, "1") == "0":
        return "exec"
    return "fork"


def choose() -> Seams:
    """Probe every seam now."""
    return Seams(
        wait=probe_wait(),
        identity=identity.describe(),
        subreaper=probe_subreaper(),
        oom=probe_oom(),
        spawn=probe_spawn(),
    )


@cache
def current() -> Seams:
    """The seams of this process, probed once (``current.cache_clear()`` probes again)."""
    return choose()


def kqueue_exit_fd(pid: int) -> int:
    """A kqueue (macOS, BSD) that turns readable when ``pid`` exits (``EVFILT_PROC``,
    ``NOTE_EXIT``), as a plain descriptor the worker's selector watches and closes.
    OSError when ``pid`` is already gone."""
    kq: Any = select  # kqueue's names exist only where the kernel has it (not Linux)
    queue = kq.kqueue()
    try:
        event = kq.kevent(
            pid,
            filter=kq.KQ_FILTER_PROC,
            flags=kq.KQ_EV_ADD | kq.KQ_EV_ONESHOT,
            fflags=kq.KQ_NOTE_EXIT,
        )
        queue.control([event], 0, 0)
        return os.dup(queue.fileno())
    finally:
        queue.close()
