"""The Sampler with real process trees under a real per-attempt supervisor (psutil), the
Peaks arithmetic, GPU readings from scripted probes, and an attempt's peaks reaching the
ledger through an in-process worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import select

from laneway.controller import db, identity
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Run
from laneway.workers.gpu import FakeGpu, GpuDevice, GpuReading, NvmlGpu
from laneway.workers.sampler import Peaks, Sampler, TreeSample, attempt_tree, sample_tree
from laneway.workers.service import WorkerService
from tests.support import launch_supervisor, make_config, py_stage, wait_until

ATTEMPT_ID = 1

# The job: touches a 200 MiB buffer, starts a grandchild that touches 100 MiB, and both
# say so with a file once their buffer is resident; both then hold it until released.
# ``bytearray(b"\x01") * n`` memsets every byte, so every page is resident.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    mib, ready, release = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    buffer = bytearray(b"\\x01") * (mib * 2**20)
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(ready + ".tmp", ready)
    while not os.path.exists(release):
        time.sleep(0.02)
    """
)

JOB = textwrap.dedent(
    """
    import subprocess, sys
    holder, directory, new_session = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    release = directory + "/release"
    grandchild = subprocess.Popen(
        [sys.executable, "-c", holder, "100", directory + "/grandchild.ready", release],
        start_new_session=new_session,
    )
    sys.argv = ["holder", "200", directory + "/child.ready", release]
    exec(holder)
    grandchild.wait()
    """
)


def start_supervisor(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen[bytes], Path, int]:
    """Start ``python -m laneway.workers.supervisor SPEC_JSON`` the way the worker does (its own
    session); returns the supervisor, the attempt directory and the child's pid."""
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    proc, report = launch_supervisor(tmp_path, argv, attempt_id=ATTEMPT_ID, timeout=120, grace=2)
    return proc, attempt, int(report["child_pid"])


def start_holders(tmp_path: Path, *, new_session: bool):
    proc, attempt, child = start_supervisor(
        tmp_path, [sys.executable, "-c", JOB, HOLDER, str(tmp_path), "1" if new_session else "0"]
    )
    ready = [tmp_path / "child.ready", tmp_path / "grandchild.ready"]
    pids = wait_until(
        lambda: all(p.exists() for p in ready) and [int(p.read_text()) for p in ready]
    )
    assert pids[0] == child
    return proc, attempt, child, pids[1]


def release(tmp_path: Path, proc: subprocess.Popen[bytes]) -> None:
    (tmp_path / "release").touch()
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:  # only on failure: stop the attempt (TERM to group)
            proc.terminate()
            proc.wait(timeout=30)


def sample_until(sampler: Sampler, proc, attempt: Path, ok) -> TreeSample:
    """Sample the attempt until ``ok(sample)``; fail showing the last sample."""
    last: list[TreeSample] = []

    def reached():
        sample = sampler.sample([(ATTEMPT_ID, proc.pid, str(attempt))])[ATTEMPT_ID]
        last[:] = [sample]
        return ok(sample) and sample

    try:
        return wait_until(reached, timeout=20)
    except AssertionError:
        pytest.fail(f"sampled tree never reached the expected state; last sample {last}")


# -- real psutil trees -------------------------------------------------------------


def test_rss_of_a_supervised_tree_with_grandchild(tmp_path):
    proc, attempt, child, grandchild = start_holders(tmp_path, new_session=False)
    try:
        sampler = Sampler(FakeGpu())
        sample = sample_until(sampler, proc, attempt, lambda s: s.rss_mib >= 295)
        # Expected: 300 MiB of touched buffers (200 child + 100 grandchild) plus two
        # interpreters' own RSS (~10-25 MiB each). Tolerance: -5 MiB (page rounding, a
        # page not yet counted) to +80 MiB (interpreter, imports, shared-library pages
        # counted once per process because RSS is summed, not PSS).
        assert 295 <= sample.rss_mib <= 380, sample
        assert proc.pid not in sample.pids  # the supervisor is not the attempt's load
        assert child in sample.pids and grandchild in sample.pids
        assert sample.gpu_mib is None and sample.gpu_note
    finally:
        release(tmp_path, proc)
    assert json.loads((attempt / "exit.json").read_text())["exit_code"] == 0


def test_descendant_that_left_the_process_group_is_sampled(tmp_path):
    proc, attempt, child, grandchild = start_holders(tmp_path, new_session=True)
    try:
        # It really left: its own session and group, not the job's.
        assert os.getsid(grandchild) == grandchild != os.getsid(child)
        assert os.getpgid(grandchild) != os.getpgid(child)
        sample = sample_until(Sampler(FakeGpu()), proc, attempt, lambda s: grandchild in s.pids)
        assert child in sample.pids and proc.pid not in sample.pids
        assert sample.rss_mib >= 295
    finally:
        release(tmp_path, proc)


WAITER = textwrap.dedent(
    """
    import os, sys, time
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    """
)

# Starts a new-session process and exits at once: that process is orphaned and
# re-parented to the nearest subreaper, the supervisor.
INTERMEDIATE = (
    "import subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c'] + sys.argv[1:], start_new_session=True)"
)

ORPHANER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    directory, intermediate, waiter = sys.argv[1:4]
    release = directory + "/release"
    subprocess.run(
        [sys.executable, "-c", intermediate, waiter, directory + "/orphan.pid", release],
        check=True,
    )
    while not os.path.exists(release):
        time.sleep(0.02)
    """
)


@pytest.mark.skipif(
    identity.portable(),
    reason="without a subreaper (LANEWAY_PORTABLE) an escaped orphan is not re-parented",
)
def test_orphaned_escapee_is_reparented_to_the_supervisor_and_sampled(tmp_path):
    proc, attempt, child = start_supervisor(
        tmp_path, [sys.executable, "-c", ORPHANER, str(tmp_path), INTERMEDIATE, WAITER]
    )
    pid_file = tmp_path / "orphan.pid"
    try:
        orphan = int(wait_until(lambda: pid_file.exists() and pid_file.read_text()))
        # Its parent exits right after starting it: wait until the subreaper adopted it.
        wait_until(lambda: psutil.Process(orphan).ppid() == proc.pid)
        sample = sample_until(Sampler(FakeGpu()), proc, attempt, lambda s: orphan in s.pids)
        assert child in sample.pids and proc.pid not in sample.pids
    finally:
        release(tmp_path, proc)


def test_tree_of_a_gone_supervisor_is_found_by_environment_markers(tmp_path):
    marker_dir = str(tmp_path / "attempt-x")
    env = {**os.environ, "LANEWAY_ATTEMPT_ID": "987654", "LANEWAY_ATTEMPT_DIR": marker_dir}
    code = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)"
    job = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "release")], env=env)
    try:
        # A pid that cannot be a live process: the supervisor is gone.
        found = wait_until(lambda: [p.pid for p in attempt_tree(2**22 + 1, 987654, marker_dir)])
        assert found == [job.pid]
        assert attempt_tree(2**22 + 1, 987654, marker_dir + "-other") == []
    finally:
        (tmp_path / "release").touch()
        job.wait(timeout=30)


# -- Peaks -------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, 12, 0, 0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_peaks_move_only_upward():
    peaks = Peaks()
    peaks.add(100.0, None, "n", at(0))
    assert (peaks.peak_rss_mib, peaks.peak_rss_at) == (100.0, at(0))
    peaks.add(250.0, None, "n", at(1))
    peaks.add(120.0, None, "n", at(2))
    peaks.add(250.0, None, "n", at(3))  # equal is not higher: the time of peak stays
    assert (peaks.peak_rss_mib, peaks.peak_rss_at) == (250.0, at(1))
    assert (peaks.current_rss_mib, peaks.sampled_at) == (250.0, at(3))
    peaks.add(0.0, None, "n", at(4))
    assert (peaks.current_rss_mib, peaks.peak_rss_mib, peaks.peak_rss_at) == (0.0, 250.0, at(1))


def test_gpu_peak_moves_only_upward_and_survives_a_missing_reading():
    peaks = Peaks()
    peaks.add(10.0, 500.0, None, at(0))
    peaks.add(10.0, 800.0, None, at(1))
    peaks.add(10.0, 300.0, None, at(2))
    assert (peaks.peak_gpu_mib, peaks.peak_gpu_at, peaks.current_gpu_mib) == (800.0, at(1), 300.0)
    assert peaks.gpu_note is None
    peaks.add(10.0, None, "NVML query on device 0 failed: x", at(3))
    # The peak already seen stays; the current figure and the note say "no reading now".
    assert (peaks.peak_gpu_mib, peaks.peak_gpu_at) == (800.0, at(1))
    assert peaks.current_gpu_mib is None
    assert peaks.gpu_note == "NVML query on device 0 failed: x"


def test_changed_flag_is_set_only_when_a_peak_moves():
    peaks = Peaks()
    assert peaks.changed is False
    peaks.add(100.0, None, "n", at(0))  # the first sample is a peak
    assert peaks.changed is True
    peaks.changed = False  # what the worker does once the ledger has it
    peaks.add(90.0, None, "n", at(1))
    peaks.add(100.0, None, "n", at(2))
    assert peaks.changed is False
    peaks.add(101.0, None, "n", at(3))
    assert peaks.changed is True
    peaks.changed = False
    peaks.add(50.0, 5.0, None, at(4))  # RSS lower, but the first GPU figure is a peak
    assert peaks.changed is True
    peaks.changed = False
    peaks.add(50.0, 4.0, None, at(5))
    assert peaks.changed is False


def test_gpu_none_stays_none_with_the_note():
    peaks = Peaks()
    for second in range(3):
        peaks.add(100.0 + second, None, "NVML unavailable: driver not loaded", at(second))
    assert peaks.peak_gpu_mib is None and peaks.peak_gpu_at is None
    assert peaks.current_gpu_mib is None
    assert peaks.gpu_note == "NVML unavailable: driver not loaded"
    assert peaks.peak_rss_mib == 102.0


# -- GPU readings: scripted probes -------------------------------------------------

DEVICES = [GpuDevice(0, 81920.0, 12000.0), GpuDevice(1, 81920.0, 3000.0)]


@pytest.fixture
def two_processes(tmp_path):
    """Two live processes (this one and a sleeping child) to sample."""
    code = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)"
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "release")])
    yield [psutil.Process(os.getpid()), psutil.Process(other.pid)]
    (tmp_path / "release").touch()
    other.wait(timeout=30)


def test_gpu_is_summed_over_the_tree_pids_only(two_processes):
    mine, other = two_processes
    stranger = 2**22 + 7  # NVML reports a process that is not in the tree
    probe = FakeGpu(DEVICES, {mine.pid: 1500.0, other.pid: 250.5, stranger: 9000.0})
    sample = sample_tree(two_processes, probe.read())
    assert sample.gpu_mib == pytest.approx(1750.5)
    assert sample.gpu_note is None
    assert sorted(sample.pids) == sorted([mine.pid, other.pid])
    assert sample.rss_mib > 0
    # A tree without GPU processes on a machine whose GPU answered: 0, not None.
    assert sample_tree([other], FakeGpu(DEVICES, {stranger: 9000.0}).read()).gpu_mib == 0.0


def test_sampler_sums_gpu_for_each_attempt_from_one_reading(tmp_path, two_processes):
    mine, other = two_processes
    probe = FakeGpu(DEVICES, {other.pid: 640.0})
    # ``other`` is a child of this process: the test process plays the supervisor.
    samples = Sampler(probe).sample([(7, mine.pid, str(tmp_path))])
    # This process may have other children too (the supervisor launcher of a worker an
    # earlier test made): ``other`` is among the tree, and only its GPU memory counts.
    assert other.pid in samples[7].pids and mine.pid not in samples[7].pids
    assert samples[7].gpu_mib == 640.0


@pytest.mark.parametrize(
    ("probe", "note"),
    [
        (
            FakeGpu(DEVICES, {1: 10.0}, note="NVML unavailable: Driver Not Loaded"),
            "NVML unavailable: Driver Not Loaded",
        ),
        (FakeGpu(note="nvidia-ml-py is not installed"), "nvidia-ml-py is not installed"),
        (FakeGpu([], {1: 10.0}), "no GPU reading"),
    ],
    ids=["note-with-devices", "note-without-devices", "no-devices"],
)
def test_without_a_gpu_reading_the_figure_is_none_and_the_note_says_why(two_processes, probe, note):
    reading = probe.read()
    assert reading.available is False
    sample = sample_tree([psutil.Process(p.pid) for p in two_processes], reading)
    assert sample.gpu_mib is None
    assert sample.gpu_note == note
    assert sample.rss_mib > 0  # RSS is measured regardless


def test_nvml_on_this_machine_degrades_to_a_note():
    probe = NvmlGpu()
    reading = probe.read()  # never raises, whatever is (not) installed
    assert isinstance(reading, GpuReading)
    if reading.devices and reading.note is None:  # pragma: no cover - GPU machines only
        pytest.skip("this machine has a working NVML; the degraded path is not reachable")
    assert reading.available is False
    assert reading.note
    assert reading.process_mib == {}
    assert probe.read().note == reading.note  # and keeps answering the same way


class FakeNvmlError(Exception):
    pass


def fake_pynvml(
    per_device: list[list[tuple[int, float | None]] | Exception],
    mig: dict[int, int] | None = None,
) -> types.SimpleNamespace:
    """A stand-in for the ``pynvml`` module: per device, its (pid, bytes) processes or the
    exception its process query raises; ``mig``: device index -> MIG instances (device
    in MIG mode; each instance a handle ``(index, slot)`` with 10 GiB and no process)."""
    mig = mig or {}

    def processes(handle: Any) -> list[types.SimpleNamespace]:
        if isinstance(handle, tuple):
            return []
        entry = per_device[handle]
        if isinstance(entry, Exception):
            raise entry
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entry]

    def memory(handle: Any) -> types.SimpleNamespace:
        if isinstance(handle, tuple):
            return types.SimpleNamespace(total=10 * 1024 * 2**20, used=0)
        return types.SimpleNamespace(total=80 * 1024 * 2**20, used=(handle + 1) * 1024 * 2**20)

    def mig_mode(handle: int) -> tuple[int, int]:
        if handle not in mig:
            raise FakeNvmlError("Not Supported")
        return 1, 1

    def mig_instance(handle: int, slot: int) -> tuple[int, int]:
        if slot >= mig[handle]:
            raise FakeNvmlError("Not Found")  # an empty slot
        return handle, slot

    def uuid(handle: Any) -> bytes:
        if isinstance(handle, tuple):
            return f"MIG-{handle[0]}-{handle[1]}".encode()
        return f"GPU-{handle}".encode()

    # ``import pynvml`` returns whatever sys.modules holds under that name.
    return types.SimpleNamespace(
        NVMLError=FakeNvmlError,
        NVML_DEVICE_MIG_ENABLE=1,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(per_device),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetComputeRunningProcesses=processes,
        nvmlDeviceGetUUID=uuid,
        nvmlDeviceGetMigMode=mig_mode,
        nvmlDeviceGetMaxMigDeviceCount=lambda handle: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_instance,
    )


def test_nvml_probe_gives_mig_instances_as_devices_with_their_uuids(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[(10, 2**20)], []], mig={1: 2}))
    reading = NvmlGpu().read()
    assert [(d.index, d.uuid, d.total_mib) for d in reading.devices] == [
        (0, "GPU-0", 81920.0),
        (1, "MIG-1-0", 10240.0),
        (2, "MIG-1-1", 10240.0),
    ]
    assert reading.devices[0].process_mib == {10: 1.0}


def test_nvml_probe_sums_a_pid_over_devices(monkeypatch):
    mib = 2**20
    module = fake_pynvml([[(10, 100 * mib), (11, 50 * mib)], [(10, 28 * mib)]])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = NvmlGpu().read()
    assert reading.available and reading.note is None
    assert reading.process_mib == {10: 128.0, 11: 50.0}
    assert [(d.index, d.total_mib, d.used_mib) for d in reading.devices] == [
        (0, 81920.0, 1024.0),
        (1, 81920.0, 2048.0),
    ]


@pytest.mark.parametrize(
    ("per_device", "note"),
    [
        ([[(10, None)]], "device 0 does not report per-process memory"),
        ([[(10, 2**20)], FakeNvmlError("Not Supported")], "NVML query on device 1 failed"),
        ([], "no GPU device"),
    ],
)
def test_nvml_probe_incomplete_readings_carry_a_note(monkeypatch, per_device, note):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(per_device))
    reading = NvmlGpu().read()
    assert reading.available is False
    assert reading.note is not None and reading.note.startswith(note)


def test_nvml_init_failure_is_a_note(monkeypatch):
    module = fake_pynvml([])

    def fail():
        raise FakeNvmlError("Driver Not Loaded")

    module.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = NvmlGpu().read()
    assert reading.available is False
    assert reading.note == "NVML unavailable: Driver Not Loaded"


# -- an in-process worker writes the peaks to the ledger ---------------------------


def test_worker_records_peak_rss_and_gpu_note_in_the_ledger(engine, make_run, tmp_path):
    release_file = tmp_path / "release"
    ready_file = tmp_path / "ready"
    code = textwrap.dedent(
        f"""
        import os, time
        buffer = bytearray(b"\\x01") * (100 * 2**20)
        open({str(ready_file)!r}, "w").close()  # the whole buffer is touched now
        while not os.path.exists({str(release_file)!r}):
            time.sleep(0.02)
        """
    )
    run_id = make_run(make_config([py_stage("hold", code, timeout_seconds=120)]))
    service = WorkerService(
        engine,
        node="n1",
        slots=1,
        memory_probe=lambda: (64e3, 128e3),
        gpu=FakeGpu(),
        sample_seconds=0.05,
        sample_flush_seconds=0.1,
    )
    service.start()
    controller = Controller(engine)
    factory = db.session_factory(engine)

    def finished():
        controller.tick()
        service.tick()
        with factory() as session:
            peak = session.scalar(select(Attempt.peak_rss_mib).where(Attempt.run_id == run_id))
            # Release only once a sample taken after the allocation finished is stored.
            if ready_file.exists() and peak is not None and peak >= 100:
                release_file.touch()
            return session.get(Run, run_id).state == "finished"

    try:
        wait_until(finished, timeout=90)
    finally:
        release_file.touch()  # never leave the stage holding its buffer
    with factory() as session:
        (attempt,) = session.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()
    assert attempt.outcome == "succeeded", attempt.state_reason
    # 100 MiB touched plus one interpreter (~10-25 MiB); the supervisor is not counted.
    assert 100 <= attempt.peak_rss_mib <= 180, attempt.peak_rss_mib
    assert attempt.peak_rss_at is not None and attempt.sampled_at is not None
    assert attempt.peak_rss_at <= attempt.sampled_at
    assert attempt.peak_gpu_mib is None and attempt.peak_gpu_at is None
    assert attempt.gpu_note == "no GPU reading"  # FakeGpu() has no device and no note


def test_gpu_pids_from_another_pid_namespace_give_none_not_zero():
    probe = FakeGpu(devices=[GpuDevice(0, 81_920, 2_048)], processes={2**22 + 12345: 1_024.0})
    samples = Sampler(probe).sample([(1, os.getpid(), "/nonexistent")])
    assert samples[1].gpu_mib is None
    assert "pid namespace" in samples[1].gpu_note


@pytest.mark.skipif(
    identity.portable(), reason="a regression of the /proc reader, which LANEWAY_PORTABLE turns off"
)
def test_the_tree_of_a_process_exiting_right_now_is_gone_not_an_error(monkeypatch):
    """Regression: /proc/PID/task of a process in the middle of exiting answers ESRCH
    (ProcessLookupError), which crashed `laneway run` from the sampler."""
    from laneway.workers import sampler as sampler_module

    real_listdir = os.listdir

    def exiting(path):
        if isinstance(path, str) and path.startswith("/proc/") and path.endswith("/task"):
            raise ProcessLookupError(3, "No such process", path)
        return real_listdir(path)

    monkeypatch.setattr(sampler_module.os, "listdir", exiting)
    with pytest.raises(psutil.NoSuchProcess):
        sampler_module.descendants(os.getpid())
    assert sampler_module.attempt_tree(os.getpid(), 1, "/nowhere") == []
