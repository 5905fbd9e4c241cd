"""Process identity that survives restarts: (boot identity, pid, start time).

A pid alone is recycled; the start time of that pid and the boot identity together
tell "the same process" from "a new process that got the same number". Two forms, one
per platform seam (``workers/seams.py`` records which a worker uses):

- **Linux** (``/proc`` offers it): the boot id of ``/proc/sys/kernel/random/boot_id``,
  and the start time in clock ticks since boot (field 22 of ``/proc/PID/stat``).
- **Portable** (macOS; and Linux with ``LANEWAY_PORTABLE`` set): the boot session's
  uuid (``sysctl kern.bootsessionuuid``: ``bootsession <uuid>``), else the boot time
  (``kern.boottime``; on Linux the realtime clock less ``CLOCK_BOOTTIME``:
  ``boot time <epoch seconds>``), and the start time in milliseconds since the epoch
  (``sysctl kern.proc.pid``'s ``p_starttime`` on macOS; on Linux psutil's
  ``create_time`` computed the same way, from the start tick and the boot time).

Each recorded value says its own form: a boot identity by its prefix, a start time by
its size (milliseconds since the epoch are at least ``EPOCH_MS_FLOOR``; clock ticks
since boot stay below it for centuries). So ``same_boot`` and ``same_process`` judge a
value recorded by a worker in either mode, whatever this process's mode is.

``LANEWAY_PORTABLE`` is a test hook, like ``LANEWAY_CRASH_POINT``: set to ``1`` it
makes every probe of a Linux-only facility answer "not available", so the portable
implementations run on Linux (the portable-path CI pass). Inert unless set.

Stdlib only: the supervisor imports this (through ``workers.identity``), and the
controller, judging an attempt's processes, uses it too.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: importing typing costs a start
if TYPE_CHECKING:
    import ctypes

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PORTABLE_ENV = "LANEWAY_PORTABLE"
"""Test hook: ``1`` switches every Linux-only facility off (see the module's docstring)."""
EPOCH_MS_FLOOR = 10**12
"""A start time at least this large is milliseconds since the epoch (the portable form,
any moment after 2001-09-09); below it, clock ticks since boot (Linux, ``/proc``)."""
BOOT_TIME_SLACK_SECONDS = 120
"""Two ``boot time`` identities this close are the same boot: the boot time is derived
from the realtime clock and moves when it is stepped or slewed. Two real boots are
further apart than this (a boot, a worker's attempt, a reboot), and a boot judged the
same in error still needs a process with the same pid and start time to matter."""
DARWIN_START_SLACK_MS = 1
"""macOS records a process's start (``p_starttime``, microseconds): only rounding."""
LINUX_START_SLACK_MS = 1000
"""The Linux emulation derives the epoch from the realtime clock each time it reads one:
a clock step under a second is not taken for another process."""

_forced: bool | None = None


def portable() -> bool:
    """Is every Linux-only facility to be treated as absent? (``LANEWAY_PORTABLE``, or
    ``use_portable``: a supervisor is told by its worker.)"""
    if _forced is not None:
        return _forced
    return os.environ.get(PORTABLE_ENV, "") not in ("", "0")


def use_portable(on: bool | None) -> None:
    """Set this process's mode (the supervisor, from its spec: it is started with the
    job's environment, not the worker's); None: back to ``LANEWAY_PORTABLE``."""
    global _forced
    _forced = on


# -- the Linux form -----------------------------------------------------------------


def read_proc(path: str) -> bytes | None:
    """The whole of a small ``/proc`` file, or None where it cannot be opened or read.
    Bare system calls, bytes: a text-mode ``open`` costs a freshly forked supervisor its
    io and codec objects (about 1.5 ms the first time; ``bench/bench_supervisor.py``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def _read_proc_boot_id() -> str | None:
    found = read_proc(_BOOT_ID_PATH)
    return (found.decode("ascii", errors="replace").strip() or None) if found else None


def _read_proc_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, from ``/proc``; None if it does
    not exist (or there is no ``/proc``)."""
    stat = read_proc(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # The command name (field 2) may contain spaces and ')' : split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def proc_identity() -> bool:
    """Does this kernel offer the Linux form (boot id and ``/proc/PID/stat``), and is it
    to be used?"""
    if portable():
        return False
    return _read_proc_boot_id() is not None and _read_proc_ticks(os.getpid()) is not None


# -- the portable form --------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def _darwin_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _sysctl_by_name(name: str) -> bytes | None:
    """``sysctlbyname(name)``'s bytes (macOS, BSD); None where it is not offered."""
    if not sys.platform.startswith(("darwin", "freebsd")):
        return None
    import ctypes

    try:
        libc = _darwin_libc()
        size = ctypes.c_size_t(0)
        if libc.sysctlbyname(name.encode(), None, ctypes.byref(size), None, 0) != 0:
            return None
        buffer = ctypes.create_string_buffer(size.value)
        if libc.sysctlbyname(name.encode(), buffer, ctypes.byref(size), None, 0) != 0:
            return None
        return buffer.raw[: size.value]
    except (OSError, AttributeError):
        return None


def _darwin_start_ms(pid: int) -> int | None:
    """``p_starttime`` of ``pid`` (``sysctl`` ``CTL_KERN.KERN_PROC.KERN_PROC_PID``) in
    milliseconds since the epoch; None if it does not exist. It is the first member of
    ``kinfo_proc`` (``kp_proc.p_un.p_starttime``, a ``struct timeval``)."""
    import ctypes

    try:
        libc = _darwin_libc()
        mib = (ctypes.c_int * 4)(1, 14, 1, pid)  # CTL_KERN, KERN_PROC, KERN_PROC_PID
        buffer = ctypes.create_string_buffer(1024)  # sizeof(struct kinfo_proc) is 648
        size = ctypes.c_size_t(len(buffer))
        if libc.sysctl(mib, 4, buffer, ctypes.byref(size), None, 0) != 0 or size.value == 0:
            return None
        seconds = int.from_bytes(buffer.raw[0:8], sys.byteorder, signed=True)
        micros = int.from_bytes(buffer.raw[8:12], sys.byteorder, signed=True)
    except (OSError, AttributeError):
        return None
    return seconds * 1000 + micros // 1000


def _linux_boot_epoch() -> float | None:
    """This boot's start in seconds since the epoch, from two clocks (no ``/proc``)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is None:
        return None
    return time.time() - time.clock_gettime(clock)


def _darwin_boot() -> str | None:
    found = _sysctl_by_name("kern.bootsessionuuid")
    if found:
        text = found.split(b"\0", 1)[0].decode("ascii", "replace").strip()
        if text:
            return f"bootsession {text}"
    found = _sysctl_by_name("kern.boottime")  # struct timeval
    if found and len(found) >= 8:
        return f"boot time {int.from_bytes(found[0:8], sys.byteorder, signed=True)}"
    return None


def portable_boot() -> str:
    """The portable boot identity: ``bootsession <uuid>`` or ``boot time <epoch>``."""
    found = _darwin_boot()
    if found is not None:
        return found
    epoch = _linux_boot_epoch()
    if epoch is not None:
        return f"boot time {round(epoch)}"
    return "unknown-boot"


def portable_start_ms(pid: int) -> int | None:
    """Start time of ``pid`` in milliseconds since the epoch; None if it does not exist.
    macOS: the kernel's ``p_starttime``. Linux: what psutil's ``create_time`` gives (the
    start tick over the tick rate, plus the boot time)."""
    if sys.platform.startswith("darwin"):
        return _darwin_start_ms(pid)
    ticks = _read_proc_ticks(pid)
    epoch = _linux_boot_epoch()
    if ticks is None or epoch is None:
        return None
    return round((epoch + ticks / os.sysconf("SC_CLK_TCK")) * 1000)


def _start_slack_ms() -> int:
    return DARWIN_START_SLACK_MS if sys.platform.startswith("darwin") else LINUX_START_SLACK_MS


# -- the seam -------------------------------------------------------------------------


def describe() -> str:
    """The identity this process uses, in words (the worker's ``identity`` seam)."""
    if proc_identity():
        return "boot_id + start time"
    boot = portable_boot()
    if boot.startswith("bootsession "):
        return "boot uuid + start time"
    if boot.startswith("boot time "):
        return "boot time + start time"
    return "start time"


def boot_id() -> str:
    """This boot's identity: the kernel's boot id (Linux), else the portable one
    (``portable_boot``); 'unknown-boot' where neither is offered. Compare a recorded
    one with ``same_boot``, which reads either form."""
    if not portable():
        found = _read_proc_boot_id()
        if found is not None:
            return found
    return portable_boot()


def same_boot(recorded: str | None) -> bool:
    """Was ``recorded`` (a ``boot_id()`` of some process, in either form) taken in this
    boot of this machine? ``unknown-boot`` is never the same."""
    if not recorded or recorded == "unknown-boot":
        return False
    if recorded.startswith("boot time "):
        now = portable_boot()
        if not now.startswith("boot time "):
            return False
        try:
            then_s, now_s = int(recorded[10:]), int(now[10:])
        except ValueError:
            return False
        return abs(then_s - now_s) <= BOOT_TIME_SLACK_SECONDS
    if recorded.startswith("bootsession "):
        return recorded == _darwin_boot()
    return recorded == _read_proc_boot_id()


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in this process's form (clock ticks since boot on Linux,
    milliseconds since the epoch where portable), or None if it does not exist."""
    if portable():
        return portable_start_ms(pid)
    ticks = _read_proc_ticks(pid)
    if ticks is not None or os.path.exists(_BOOT_ID_PATH):
        return ticks
    return portable_start_ms(pid)  # no /proc here: the portable form


def host() -> str:
    return os.uname().nodename


def same_process(pid: int, start_time: int | None) -> bool:
    """True if ``pid`` is alive and is the process that had ``start_time`` (either form:
    the recorded value says which it is)."""
    if start_time is None:
        return False
    if start_time >= EPOCH_MS_FLOOR:
        now = portable_start_ms(pid)
        return now is not None and abs(now - start_time) <= _start_slack_ms()
    return _read_proc_ticks(pid) == start_time


def current() -> tuple[int, int | None]:
    pid = os.getpid()
    return pid, process_start_time(pid)
