"""The platform seams (``workers/seams.py``) and the two forms of process identity
(``controller/identity.py``): each probe, the test-only switch ``LANEWAY_PORTABLE`` that
makes every probe answer "not available", and judging a value recorded in either form
whatever the mode of the process that judges it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from laneway.controller import identity, status_model
from laneway.controller import oom as oom_names
from laneway.workers import oom, seams, supervisor

LINUX = sys.platform.startswith("linux") and os.path.exists("/proc/sys/kernel/random/boot_id")


@pytest.fixture
def linux_mode(monkeypatch):
    monkeypatch.delenv(identity.PORTABLE_ENV, raising=False)
    identity.use_portable(None)
    seams.current.cache_clear()
    yield
    seams.current.cache_clear()


@pytest.fixture
def portable_mode(monkeypatch):
    monkeypatch.setenv(identity.PORTABLE_ENV, "1")
    identity.use_portable(None)
    seams.current.cache_clear()
    yield
    identity.use_portable(None)
    seams.current.cache_clear()


@pytest.mark.skipif(not LINUX, reason="Linux's facilities")
def test_on_linux_every_probe_finds_linux_facilities(linux_mode):
    found = seams.choose()
    assert found.wait == "pidfd"
    assert found.identity == "boot_id + start time"
    assert found.subreaper == "prctl"
    assert found.spawn == "fork"
    # The cgroup counter depends on the machine (a container may hide it).
    expected = "cgroup" if oom.OomCounter.of_this_process().path is not None else "inferred"
    assert found.oom == expected
    assert "portable" not in found.as_dict()


def test_the_switch_makes_every_probe_answer_not_available(portable_mode):
    found = seams.choose()
    assert found.as_dict() == {
        "wait": "poll",
        "identity": "boot time + start time",
        "subreaper": "process group",
        "oom": "inferred",
        "spawn": "exec",
        "portable": True,
    }
    assert oom.OomCounter.of_this_process().path is None
    assert found.words() == (
        "wait poll, identity boot time + start time, subreaper process group, oom inferred, "
        "spawn exec (portable paths forced)"
    )


@pytest.mark.parametrize("value", ["", "0"])
def test_the_switch_is_inert_unless_set(monkeypatch, value):
    monkeypatch.setenv(identity.PORTABLE_ENV, value)
    identity.use_portable(None)
    assert not identity.portable()


def test_the_launcher_switched_off_means_exec(linux_mode, monkeypatch):
    monkeypatch.setenv(seams.LAUNCHER_ENV, "0")
    assert seams.probe_spawn() == "exec"


def test_probed_once(portable_mode, monkeypatch):
    first = seams.current()
    monkeypatch.delenv(identity.PORTABLE_ENV)
    assert seams.current() is first  # the choice stands for the process's life


@pytest.mark.skipif(not LINUX, reason="the Linux form")
def test_the_portable_start_time_is_psutils_in_milliseconds(portable_mode):
    pid, start = identity.current()
    assert start is not None and start >= identity.EPOCH_MS_FLOOR
    # psutil's create_time reads the boot time in whole seconds: within a second.
    assert abs(start - psutil.Process(pid).create_time() * 1000) < 1500
    assert identity.same_process(pid, start)
    assert not identity.same_process(pid, start - 5000)  # another process's start
    assert identity.boot_id().startswith("boot time ")
    assert identity.same_boot(identity.boot_id())
    assert abs(int(identity.boot_id()[10:]) - psutil.boot_time()) <= 2


@pytest.mark.skipif(not LINUX, reason="both forms on one machine")
def test_a_value_recorded_in_either_form_is_judged_in_either_mode(monkeypatch):
    """A portable worker beside a Linux one on the same machine: each judges the other's
    records (a restarted worker, ``status``, ``cancel``) by the form they carry."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        identity.use_portable(False)
        linux = (identity.boot_id(), identity.process_start_time(sleeper.pid))
        identity.use_portable(True)
        portable = (identity.boot_id(), identity.process_start_time(sleeper.pid))
        assert linux[1] is not None and linux[1] < identity.EPOCH_MS_FLOOR
        assert portable[1] is not None and portable[1] >= identity.EPOCH_MS_FLOOR
        for mode in (False, True):
            identity.use_portable(mode)
            for boot, start in (linux, portable):
                assert identity.same_boot(boot)
                assert identity.same_process(sleeper.pid, start)
        sleeper.kill()
        sleeper.wait()
        for mode in (False, True):
            identity.use_portable(mode)
            for _, start in (linux, portable):
                assert not identity.same_process(sleeper.pid, start)
    finally:
        identity.use_portable(None)
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_another_boot_is_not_this_one(portable_mode):
    now = int(identity.boot_id()[10:])
    assert identity.same_boot(f"boot time {now + 5}")  # the clock's jitter
    assert not identity.same_boot(f"boot time {now - 3600}")  # rebooted an hour later
    assert not identity.same_boot("00000000-0000-0000-0000-000000000000")
    assert not identity.same_boot("bootsession 0000")
    assert not identity.same_boot("unknown-boot")
    assert not identity.same_boot(None)


def test_a_gone_pid_has_no_start_time_in_either_mode(monkeypatch):
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(done.stdout)
    for mode in (False, True):
        identity.use_portable(mode)
        assert identity.process_start_time(pid) is None or not psutil.pid_exists(pid)
    identity.use_portable(None)


def test_the_portable_supervisor_tracks_by_process_group(tmp_path, monkeypatch):
    """Told by its spec, the supervisor takes no subreaper, lists no children from
    ``/proc``, and says so in its exit record; its start times are epoch milliseconds."""
    monkeypatch.delenv(identity.PORTABLE_ENV, raising=False)
    spec = {
        "attempt_id": 1,
        "attempt_dir": str(tmp_path),
        "argv": [sys.executable, "-c", "print('hi')"],
        "cwd": str(tmp_path),
        "timeout_seconds": 30,
        "grace_seconds": 1,
        "portable": True,
    }
    done = subprocess.run(
        supervisor.launch_argv(json.dumps(spec)),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "exit.json").read_text())
    assert record["exit_code"] == 0 and record["group_empty"] is True
    assert record["subreaper"] is False and record["tracks"] == "process group"
    assert record["boot_id"].startswith(("boot time ", "bootsession "))
    assert record["child_start_time"] >= identity.EPOCH_MS_FLOOR
    assert record["supervisor_start_time"] >= identity.EPOCH_MS_FLOOR
    assert json.loads(done.stdout)["child_start_time"] == record["child_start_time"]
    assert (tmp_path / "stdout.log").read_text() == "hi\n"


@pytest.mark.skipif(not LINUX, reason="prctl")
def test_the_linux_supervisor_says_it_is_a_subreaper(tmp_path, linux_mode):
    spec = {
        "attempt_id": 1,
        "attempt_dir": str(tmp_path),
        "argv": [sys.executable, "-c", "pass"],
        "cwd": str(tmp_path),
        "timeout_seconds": 30,
        "grace_seconds": 1,
    }
    done = subprocess.run(
        supervisor.launch_argv(json.dumps(spec)),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "exit.json").read_text())
    assert record["subreaper"] is True and record["tracks"] == "subreaper + process group"
    assert record["child_start_time"] < identity.EPOCH_MS_FLOOR


def test_inferred_oom_evidence_is_named_so():
    found = oom_names.evidence(
        "free_memory", mem_available_mib=10, memory_floor_mib=100, peak_rss_mib=5
    )
    assert oom_names.inferred(found)
    assert not oom_names.inferred(
        oom_names.evidence(
            "cgroup", mem_available_mib=None, memory_floor_mib=None, peak_rss_mib=None
        )
    )
    assert not oom_names.inferred(None)


def test_seams_in_words():
    assert status_model.seams_words(None) == ""
    assert status_model.seams_words(
        {
            "wait": "kqueue",
            "identity": "boot uuid + start time",
            "subreaper": "process group",
            "oom": "inferred",
            "spawn": "exec",
        }
    ) == (
        "wait kqueue, identity boot uuid + start time, subreaper process group, "
        "oom inferred, spawn exec"
    )


def test_a_start_time_form_is_told_by_its_size():
    # Clock ticks since boot at 100 Hz stay under the floor for about 317 years of uptime.
    assert 317 * 365 * 24 * 3600 * 100 < identity.EPOCH_MS_FLOOR
    assert time.time() * 1000 > identity.EPOCH_MS_FLOOR
