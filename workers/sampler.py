"""The Sampler: measures each running attempt's process tree.

The tree is every descendant of the attempt's supervisor — the child and all it started,
including processes that left the job's process group: the supervisor is a child
subreaper, so orphans are re-parented to it and stay in its tree (where the kernel
offers one: without, ``workers.seams``, an orphan that left the group is not counted).
If the supervisor is gone, processes carrying the attempt's environment markers are
found instead. RSS is summed with psutil; GPU memory per process comes from a GpuProbe
(NVML). Without a GPU reading the GPU figure stays None and the probe's note says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime

import psutil

from laneway.workers import identity
from laneway.workers.gpu import GpuProbe, GpuReading
from laneway.workers.supervisor import MARK

MIB = 1024 * 1024


@dataclass
class Peaks:
    """What one attempt's samples add up to."""

    current_rss_mib: float | None = None
    peak_rss_mib: float | None = None
    peak_rss_at: datetime | None = None
    current_gpu_mib: float | None = None
    peak_gpu_mib: float | None = None
    peak_gpu_at: datetime | None = None
    gpu_note: str | None = None
    sampled_at: datetime | None = None
    changed: bool = False
    """A peak moved since the ledger last heard of it."""

    def add(self, rss_mib: float, gpu_mib: float | None, note: str | None, now: datetime) -> None:
        self.current_rss_mib = rss_mib
        self.current_gpu_mib = gpu_mib
        self.gpu_note = note
        self.sampled_at = now
        if self.peak_rss_mib is None or rss_mib > self.peak_rss_mib:
            self.peak_rss_mib, self.peak_rss_at, self.changed = rss_mib, now, True
        if gpu_mib is not None and (self.peak_gpu_mib is None or gpu_mib > self.peak_gpu_mib):
            self.peak_gpu_mib, self.peak_gpu_at, self.changed = gpu_mib, now, True


@dataclass
class TreeSample:
    rss_mib: float
    gpu_mib: float | None
    gpu_note: str | None
    pids: list[int] = field(default_factory=list)


def _children_files() -> bool:
    """Does ``/proc`` list each task's children here (and are they to be used)?"""
    return not identity.portable() and os.path.isdir(f"/proc/{os.getpid()}/task")


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, from ``/proc/PID/task/TID/children``: the cost follows
    the tree, not the machine (psutil's ``children`` reads every process's parent).
    Raises NoSuchProcess if ``pid`` is gone; psutil where the kernel does not offer the
    children files (macOS; the portable paths forced, ``workers.seams``)."""
    if not _children_files():
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except (FileNotFoundError, ProcessLookupError):
            # Gone, or exiting right now (the kernel then answers ESRCH).
            if parent == pid:
                raise psutil.NoSuchProcess(pid) from None
            continue  # a descendant that just exited
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as handle:
                    children = [int(child) for child in handle.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread or process that just exited
            except OSError:
                return [p.pid for p in psutil.Process(pid).children(recursive=True)]
            found += children
            queue += children
    return found


def attempt_tree(
    supervisor_pid: int | None, attempt_id: int, attempt_dir: str
) -> list[psutil.Process]:
    """The attempt's processes, without the supervisor itself."""
    if supervisor_pid is not None:
        try:
            return [psutil.Process(pid) for pid in descendants(supervisor_pid)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    found = []
    for process in psutil.process_iter():
        try:
            environ = process.environ()
            ours = (
                environ.get("LANEWAY_ATTEMPT_ID") == str(attempt_id)
                and environ.get("LANEWAY_ATTEMPT_DIR") == attempt_dir
                and MARK not in process.cmdline()
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if ours:
            found.append(process)
    return found


def sample_tree(processes: list[psutil.Process], gpu: GpuReading) -> TreeSample:
    """Sum RSS (and GPU memory, when the reading has it) over ``processes``."""
    rss = 0
    pids = []
    for process in processes:
        try:
            rss += process.memory_info().rss
            pids.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    if gpu.available:
        gpu_mib: float | None = sum(gpu.process_mib.get(pid, 0.0) for pid in pids)
        note = None
    else:
        gpu_mib, note = None, gpu.note or "no GPU reading"
    return TreeSample(rss / MIB, gpu_mib, note, pids)


class Sampler:
    """Samples many attempts with one GPU reading per round."""

    def __init__(self, gpu: GpuProbe) -> None:
        self.gpu = gpu

    def read_gpu(self) -> GpuReading:
        return self.gpu.read()

    def sample(
        self, attempts: list[tuple[int, int | None, str]], gpu: GpuReading | None = None
    ) -> dict[int, TreeSample]:
        """``attempts``: (attempt id, supervisor pid, attempt dir) triples."""
        reading = gpu if gpu is not None else self.gpu.read()
        if reading.process_mib and not any(psutil.pid_exists(p) for p in reading.process_mib):
            # NVML names host pids; in a container with its own pid namespace none of them
            # is visible here. Say so rather than record a made-up 0.
            reading = GpuReading(
                devices=reading.devices,
                note="GPU process ids are not visible in this pid namespace (container?)",
            )
        return {
            attempt_id: sample_tree(attempt_tree(pid, attempt_id, directory), reading)
            for attempt_id, pid, directory in attempts
        }
