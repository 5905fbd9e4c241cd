"""The supervisor at its floor keeps every guarantee: the fsyncs it leaves out are only
those with nothing to make durable, and the ones it makes come in the order that keeps
``exit.json`` whole — the temp file's fsync before its rename, the directory's after —
on both ways a supervisor starts (forked by the launcher, as the worker starts it, and
exec'd). A forked supervisor hands the job the request's environment without putting it
in its own ``os.environ`` (only ``supervisor.HELPER_ENV`` goes there), so redaction and
the job's variables are checked on that path too.

Each supervisor runs with ``os.fsync`` and ``os.replace`` wrapped (a test bootstrap in
front of the real one) to append what they did, in order, to a trace file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from laneway.controller import durable
from laneway.workers import launcher, supervisor
from laneway.workers.flight import LaunchedSupervisor
from tests.support import wait_until

TRACE_ENV = "LANEWAY_TEST_FSYNC_TRACE"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
TRACING = """
import os as _os
_trace_path = {trace}
def _note(*parts):
    fd = _os.open(_trace_path, _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o600)
    try:
        _os.write(fd, ("\\t".join([str(_os.getpid()), *parts]) + "\\n").encode())
    finally:
        _os.close(fd)
_real_fsync, _real_replace = _os.fsync, _os.replace
def _fsync(fd):
    _note("fsync", _os.readlink(f"/proc/self/fd/{{int(fd)}}"))
    return _real_fsync(fd)
def _replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
    _note("replace", str(src), str(dst))
    return _real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
_os.fsync, _os.replace = _fsync, _replace
"""

OPEN_TRACING = """
import builtins as _builtins
_real_os_open, _real_open = _os.open, _builtins.open
def _note_open(how, path):
    if str(path) == _trace_path:
        return
    fd = _real_os_open(_trace_path, _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o600)
    try:
        _os.write(fd, ("\\t".join([str(_os.getpid()), how, str(path)]) + "\\n").encode())
    finally:
        _os.close(fd)
def _os_open(path, flags, mode=0o777, *, dir_fd=None):
    _note_open("os.open", path)
    return _real_os_open(path, flags, mode, dir_fd=dir_fd)
def _open(file, *args, **kwargs):
    _note_open("open", file)
    return _real_open(file, *args, **kwargs)
_os.open, _builtins.open = _os_open, _open
"""
"""Appended to ``TRACING``: every ``os.open`` and text or binary ``open``, by path."""

JOB = "import sys; print('out ' + sys.argv[1], flush=True)"
SECRET = "s3cret-value-for-the-floor"


def trace_of(path: Path, pid: int) -> list[tuple[str, ...]]:
    rows = [tuple(line.split("\t")) for line in path.read_text().splitlines()]
    return [row[1:] for row in rows if int(row[0]) == pid]


def spec_for(directory: Path, attempt_id: int) -> dict[str, Any]:
    return {
        "attempt_id": attempt_id,
        "attempt_dir": str(directory),
        "argv": [sys.executable, "-c", JOB, SECRET],
        "cwd": str(directory),
        "timeout_seconds": 30,
        "grace_seconds": 2,
        "log_cap_bytes": 1 << 20,
        "secret_env": ["FLOOR_SECRET"],
        "strip_env": [],
    }


def job_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FLOOR_SECRET": SECRET}


def run_forked(tmp_path: Path, trace: Path, directory: Path, tracing: str = TRACING) -> int:
    """One attempt through a launcher started as ``spawning.Launcher`` starts it, with the
    tracing in front of its bootstrap; returns the supervisor's pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = (
        supervisor.PACKAGE
        + tracing.format(trace=repr(str(trace)))
        + "from laneway.workers.launcher import serve; serve(int(sys.argv[3]))"
    )
    argv = launcher.launcher_argv(theirs.fileno())
    argv[argv.index(launcher.BOOTSTRAP)] = code
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=[theirs.fileno()],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    theirs.close()
    try:
        spec = spec_for(directory, 7)
        read_end, write_end = os.pipe()
        with open(directory / "supervisor.log", "ab") as log:
            request = {"spec": spec, "env": job_env()}
            socket.send_fds(ours, [json.dumps(request).encode()], [write_end, log.fileno()])
            reply = json.loads(ours.recv(4096))
        os.close(write_end)
        pid, start_time = int(reply["pid"]), reply["start_time"]
        watched = LaunchedSupervisor(pid, start_time, os.fdopen(read_end, "rb"), str(directory))
        assert json.loads(watched.stdout.readline())["child_pid"] > 0
        watched.stdout.close()
        wait_until(lambda: watched.poll() is not None)
        assert watched.returncode == 0
        return pid
    finally:
        ours.close()
        process.wait(timeout=30)


def run_execd(tmp_path: Path, trace: Path, directory: Path) -> int:
    """One attempt through an exec'd supervisor (``launch_argv``), tracing in front."""
    spec = spec_for(directory, 8)
    argv = supervisor.launch_argv(json.dumps(spec))
    argv[argv.index(supervisor.BOOTSTRAP)] = (
        supervisor.PACKAGE
        + TRACING.format(trace=repr(str(trace)))
        + "from laneway.workers.supervisor import main; sys.exit(main(sys.argv[3:]))"
    )
    with open(directory / "supervisor.log", "ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env=job_env(),
        )
    assert process.stdout is not None
    assert json.loads(process.stdout.readline())["child_pid"] > 0
    process.stdout.close()
    assert process.wait(timeout=30) == 0
    return process.pid


@pytest.mark.parametrize("way", ["forked", "execd"])
def test_exit_record_fsyncs_are_one_of_the_file_then_one_of_the_directory(tmp_path, way):
    directory = tmp_path / "attempt"
    directory.mkdir()
    trace = tmp_path / "trace.tsv"
    pid = (run_forked if way == "forked" else run_execd)(tmp_path, trace, directory)

    ops = trace_of(trace, pid)
    partial = str(directory / "exit.json.partial")
    fsyncs = [row[1] for row in ops if row[0] == "fsync"]
    # Exactly one fsync of each: the log that holds output, exit.json's temp file, and
    # the attempt directory; none of the empty stderr.log.
    assert sorted(fsyncs) == sorted([str(directory / "stdout.log"), partial, str(directory)])
    order = [
        ops.index(("fsync", str(directory / "stdout.log"))),
        ops.index(("fsync", partial)),
        ops.index(("replace", "exit.json.partial", "exit.json")),
        ops.index(("fsync", str(directory))),
    ]
    assert order == sorted(order), ops  # logs, then the record's data, rename, directory

    record = json.loads((directory / "exit.json").read_text())
    assert record["exit_code"] == 0 and record["group_empty"] is True
    assert not list(directory.glob("*.partial"))
    # The secret came from the job's environment (the request's, when forked).
    assert (directory / "stdout.log").read_text() == "out [REDACTED]\n"
    assert (directory / "stderr.log").read_bytes() == b""  # there, though never fsynced
    assert oct((directory / "stderr.log").stat().st_mode & 0o777) == oct(durable.modes()[0])


def test_exit_record_keeps_the_durable_json_layout():
    record = {
        "schema": 1,
        "exit_code": None,
        "log_errors": ["stdout: No space left on device", "x"],
        "logs_truncated": [],
        "ended_at": "2026-01-01T00:00:00.000Z",
    }
    text = supervisor.record_bytes(record).decode()
    assert json.loads(text) == record
    assert text.startswith('{\n  "ended_at": ') and text.endswith("\n}\n")
    flat = {key: value for key, value in record.items() if not isinstance(value, list)}
    assert supervisor.record_bytes(flat) == durable._json_bytes(flat)


@pytest.mark.skipif(not os.path.exists(BOOT_ID), reason="Linux's /proc")
def test_a_forked_supervisor_reads_proc_by_system_calls(tmp_path):
    """Its ``/proc`` reads (its own start time, the boot id, its children) are bare
    ``os.open``s: a text-mode ``open`` costs a freshly forked process its io and codec
    objects (about 1.5 ms). What it records is unchanged."""
    directory = tmp_path / "attempt"
    directory.mkdir()
    trace = tmp_path / "trace.tsv"
    pid = run_forked(tmp_path, trace, directory, TRACING + OPEN_TRACING)

    rows = [tuple(line.split("\t")) for line in trace.read_text().splitlines()]
    ours = [
        (row[1], row[2]) for row in rows if row[1] in ("open", "os.open") and int(row[0]) == pid
    ]
    assert ("os.open", f"/proc/{pid}/stat") in ours, ours  # its own start time
    assert ("os.open", BOOT_ID) in ours, ours
    assert not [path for how, path in ours if how == "open" and path.startswith("/proc/")], ours

    record = json.loads((directory / "exit.json").read_text())
    assert record["boot_id"] == Path(BOOT_ID).read_text().strip()
    assert record["supervisor_pid"] == pid and record["exit_code"] == 0
