"""What sampling one attempt's process tree costs the worker, per probe, side by side.

    .venv/bin/python bench/bench_sampler.py [--seconds N] [--children C]

Starts a real per-attempt supervisor (``python -m laneway.workers.supervisor``) whose job is one
parent process that starts C sleeping children (default 49: a 50-process tree), then
samples that tree at 1 Hz for N seconds (default 20) with ``Sampler(NvmlGpu())`` and
``Sampler(FakeGpu(...))``, one right after the other in each tick. Around each sample it
measures the sampler's own CPU time (``time.process_time()``: user + system, this
process) and wall time, and prints per probe: samples taken, mean/max CPU ms per
sample, the CPU cost at 1 Hz as % of one core, and the tree size actually sampled.
The first NVML sample (import pynvml + nvmlInit) is reported on its own.

No assertions: numbers to compare, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

from laneway.workers.gpu import FakeGpu, GpuDevice, GpuProbe, NvmlGpu
from laneway.workers.sampler import Sampler

ATTEMPT_ID = 1

PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    count, ready, release = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    children = [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]
    with open(ready + ".tmp", "w") as f:
        f.write(" ".join(str(c.pid) for c in children))
    os.rename(ready + ".tmp", ready)
    while not os.path.exists(release):
        time.sleep(0.1)
    for child in children:
        child.terminate()
    for child in children:
        child.wait()
    """
)


def start_tree(root: Path, children: int) -> tuple[subprocess.Popen[bytes], Path]:
    attempt = root / "attempt"
    attempt.mkdir()
    spec = {
        "attempt_id": ATTEMPT_ID,
        "attempt_dir": str(attempt),
        "argv": [
            sys.executable,
            "-c",
            PARENT,
            str(children),
            str(root / "ready"),
            str(root / "release"),
        ],
        "cwd": str(root),
        "timeout_seconds": 3600,
        "grace_seconds": 2,
        "secret_env": [],
    }
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "laneway.workers.supervisor", json.dumps(spec)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert supervisor.stdout is not None
    supervisor.stdout.readline()  # the child's identity: it has started
    supervisor.stdout.close()
    deadline = time.monotonic() + 60
    while not (root / "ready").exists():
        if time.monotonic() > deadline or supervisor.poll() is not None:
            raise SystemExit("the process tree did not start")
        time.sleep(0.05)
    return supervisor, attempt


def stop_tree(root: Path, supervisor: subprocess.Popen[bytes]) -> None:
    tree = _descendants(supervisor.pid)
    (root / "release").touch()
    try:
        supervisor.wait(timeout=30)
    except subprocess.TimeoutExpired:
        supervisor.send_signal(signal.SIGTERM)  # a controlled stop: TERM, grace, KILL
        supervisor.wait(timeout=30)
    for process in tree:  # anything still alive (should be none)
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return children


class Probe:
    def __init__(self, name: str, gpu: GpuProbe) -> None:
        self.name = name
        self.sampler = Sampler(gpu)
        self.cpu_ms: list[float] = []
        self.wall_ms: list[float] = []
        self.tree_sizes: list[int] = []
        self.gpu_figures: set[str] = set()

    def sample(self, attempt: tuple[int, int | None, str]) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        result = self.sampler.sample([attempt])[ATTEMPT_ID]
        self.cpu_ms.append((time.process_time() - cpu) * 1000)
        self.wall_ms.append((time.perf_counter() - wall) * 1000)
        self.tree_sizes.append(len(result.pids))
        self.gpu_figures.add(
            f"{result.gpu_mib:.1f} MiB"
            if result.gpu_mib is not None
            else f"None ({result.gpu_note})"
        )


def report(probes: list[Probe], seconds: float) -> None:
    def row(label: str, values: list[str]) -> None:
        print(f"{label:<34}" + "".join(f"{v:>22}" for v in values))

    row("", [p.name for p in probes])
    row("samples taken", [str(len(p.cpu_ms)) for p in probes])
    row("first sample: CPU ms", [f"{p.cpu_ms[0]:.2f}" for p in probes])
    steady = [p.cpu_ms[1:] or p.cpu_ms for p in probes]
    row("CPU ms per sample, mean (2nd on)", [f"{statistics.fmean(s):.2f}" for s in steady])
    row("CPU ms per sample, max (2nd on)", [f"{max(s):.2f}" for s in steady])
    row(
        "wall ms per sample, mean (2nd on)",
        [f"{statistics.fmean(p.wall_ms[1:] or p.wall_ms):.2f}" for p in probes],
    )
    # At 1 Hz one sample per second: ms per sample / 1000 ms, as a percentage.
    row("CPU at 1 Hz, % of one core", [f"{statistics.fmean(s) / 10:.3f}" for s in steady])
    row(
        "tree size sampled (min..max)",
        [f"{min(p.tree_sizes)}..{max(p.tree_sizes)}" for p in probes],
    )
    for probe in probes:
        print(f"{probe.name} GPU figure(s): {', '.join(sorted(probe.gpu_figures))}")
    print(f"({seconds:g} s at 1 Hz; both probes sampled the same tree in each tick)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--children", type=int, default=49)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laneway-bench-sampler-") as directory:
        root = Path(directory)
        supervisor, attempt = start_tree(root, args.children)
        try:
            parent = psutil.Process(supervisor.pid).children()[0].pid
            tree = len(_descendants(supervisor.pid))
            print(
                f"supervisor pid {supervisor.pid}; tree under it: {tree} processes "
                f"(1 parent + {args.children} children); cpu count {os.cpu_count()}"
            )
            fake = FakeGpu([GpuDevice(0, 81920.0, 2048.0)], {parent: 512.0, 1: 1024.0})
            probes = [Probe("NvmlGpu", NvmlGpu()), Probe("FakeGpu", fake)]
            target = (ATTEMPT_ID, supervisor.pid, str(attempt))
            start = time.monotonic()
            ticks = max(1, round(args.seconds))
            for tick in range(ticks):
                for probe in probes:
                    probe.sample(target)
                time.sleep(max(0.0, start + tick + 1 - time.monotonic()))
        finally:
            stop_tree(root, supervisor)
    report(probes, args.seconds)


if __name__ == "__main__":
    main()
