"""The per-attempt supervisor with real processes: streaming, timeout of a whole process
group (child and grandchild), controlled stop, spawn errors, redaction."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from laneway.controller import identity
from laneway.workers.identity import process_start_time
from tests.support import launch_supervisor, supervisor_argv, wait_for, wait_until

GRANDCHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        f.write(str(grandchild.pid))
    print("child started", flush=True)
    time.sleep(600)
    """
)


def start(tmp_path: Path, argv: list[str], *, timeout=30.0, grace=5.0, secret_env=(), env=None):
    attempt = tmp_path / "attempt"
    attempt.mkdir(exist_ok=True)
    proc, report = launch_supervisor(
        tmp_path, argv, env=env, timeout=timeout, grace=grace, secret_env=secret_env
    )
    return proc, attempt, report


def exit_record(attempt: Path) -> dict:
    return json.loads((attempt / "exit.json").read_text())


def gone(pid: int) -> bool:
    return process_start_time(pid) is None


def test_streams_output_and_records_exit_code(tmp_path):
    code = (
        "import sys; print('out line', flush=True); print('err line', file=sys.stderr); sys.exit(3)"
    )
    proc, attempt, report = start(tmp_path, [sys.executable, "-c", code])
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["exit_code"] == 3 and record["signal"] is None
    assert record["child_pid"] == report["child_pid"]
    assert record["timed_out"] is False and record["group_empty"] is True
    assert (attempt / "stdout.log").read_text() == "out line\n"
    assert (attempt / "stderr.log").read_text() == "err line\n"
    assert not list(attempt.glob("*.partial"))


def test_timeout_kills_the_whole_group_including_grandchild(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    proc, attempt, report = start(
        tmp_path, [sys.executable, "-c", GRANDCHILD, str(pid_file)], timeout=1.0, grace=0.5
    )
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text()))
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["timed_out"] is True
    assert record["signal"] == signal.SIGTERM
    assert record["group_empty"] is True
    assert gone(report["child_pid"]) and gone(grandchild)


def test_term_to_supervisor_stops_group_then_reports(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    proc, attempt, report = start(tmp_path, [sys.executable, "-c", GRANDCHILD, str(pid_file)])
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text()))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["stopped"] is True and record["timed_out"] is False
    assert record["group_empty"] is True
    assert gone(report["child_pid"]) and gone(grandchild)


def test_term_ignoring_child_is_killed_after_grace(tmp_path):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('ready', flush=True); time.sleep(600)"
    )
    proc, attempt, report = start(tmp_path, [sys.executable, "-c", code], timeout=0.5, grace=0.5)
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["timed_out"] is True and record["signal"] == signal.SIGKILL
    assert gone(report["child_pid"])


def test_leftover_group_members_are_stopped_after_child_exits(tmp_path):
    code = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open(sys.argv[1], 'w').write(str(p.pid))"
    )
    pid_file = tmp_path / "left.pid"
    proc, attempt, _ = start(tmp_path, [sys.executable, "-c", code, str(pid_file)], grace=0.5)
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["exit_code"] == 0
    assert record["leftovers_signalled"] is True and record["group_empty"] is True
    assert gone(int(pid_file.read_text()))


def test_spawn_error_is_recorded_not_raised(tmp_path):
    proc, attempt, report = start(tmp_path, [str(tmp_path / "does-not-exist")])
    assert "error" in report
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert "does-not-exist" in record["spawn_error"] and record["exit_code"] is None


def test_secret_values_are_redacted_from_logs(tmp_path):
    secret = "canary-7f3a9c1e55"
    code = (
        "import os, sys; v = os.environ['API_TOKEN']; print(v[:5], end='', flush=True); "
        "print(v[5:] + ' tail'); print(v, file=sys.stderr)"
    )
    proc, attempt, _ = start(
        tmp_path,
        [sys.executable, "-c", code],
        secret_env=["API_TOKEN"],
        env={"API_TOKEN": secret},
    )
    assert proc.wait(timeout=30) == 0
    logs = (attempt / "stdout.log").read_text() + (attempt / "stderr.log").read_text()
    assert secret not in logs
    assert "[REDACTED] tail" in logs


@pytest.mark.skipif(
    identity.portable(),
    reason="without a subreaper (LANEWAY_PORTABLE) a job that leaves its group is not followed",
)
def test_descendant_that_escaped_the_group_is_stopped_too(tmp_path):
    code = (
        "import os, subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
        "start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid))"
    )
    pid_file = tmp_path / "escaped.pid"
    proc, attempt, _ = start(tmp_path, [sys.executable, "-c", code, str(pid_file)], grace=0.5)
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["exit_code"] == 0 and record["group_empty"] is True
    assert record["escapees_signalled"] >= 1
    assert gone(int(pid_file.read_text()))


def test_stop_after_the_child_exited_keeps_its_exit_code(tmp_path):
    # The child exits at once but a grandchild keeps the pipes open, so the supervisor
    # is still draining when the stop arrives.
    # The grandchild ignores TERM, so the supervisor is surely still in its grace period.
    code = (
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'"
        "], stdout=sys.stdout); print('bye', flush=True)"
    )
    proc, attempt, report = start(tmp_path, [sys.executable, "-c", code], grace=2)
    wait_until(lambda: gone(report["child_pid"]))  # exited and reaped by the supervisor
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["exit_code"] == 0 and record["stopped"] is False


def test_log_cap_keeps_a_marker_and_the_exit_code(tmp_path):
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    code = "import sys\nfor _ in range(200): print('x' * 99)\nsys.exit(4)"
    proc = subprocess.Popen(
        supervisor_argv(tmp_path, [sys.executable, "-c", code], grace=1, log_cap_bytes=1000),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.wait(timeout=30) == 0
    record = exit_record(attempt)
    assert record["exit_code"] == 4 and record["logs_truncated"] == ["stdout"]
    log = (attempt / "stdout.log").read_bytes()
    assert log.startswith(b"x" * 99) and log.endswith(
        b"[laneway: stdout truncated at 1000 bytes; further output discarded]\n"
    )
    assert len(log) < 1100


def test_output_that_meets_the_cap_exactly_then_goes_on_is_marked_truncated(tmp_path):
    """The cap filled exactly by one read, more output after: the marker still says so
    (it once dropped the rest silently)."""
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    # The rest is written once the supervisor has read the first 1000 bytes (written at
    # once, so read at once): the job's stdout pipe holds nothing unread (FIONREAD). No
    # clock decides whether the two were read apart.
    unread = "fcntl.ioctl(1, termios.FIONREAD, bytes(4)) != bytes(4)"
    code = (
        "import fcntl, sys, termios\nsys.stdout.write('x' * 1000)\nsys.stdout.flush()\n"
        + wait_for(f"not {unread}", "'the first 1000 bytes read'")
        + "print('y' * 10)"
    )
    proc = subprocess.Popen(
        supervisor_argv(tmp_path, [sys.executable, "-c", code], grace=1, log_cap_bytes=1000),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.wait(timeout=30) == 0
    assert exit_record(attempt)["logs_truncated"] == ["stdout"]
    log = (attempt / "stdout.log").read_bytes()
    assert log == b"x" * 1000 + (
        b"\n[laneway: stdout truncated at 1000 bytes; further output discarded]\n"
    )


def test_a_log_planted_as_a_link_is_never_written_through(tmp_path):
    """A log name planted as a link (by a sibling job that knows the layout) makes the
    supervisor stop before the child starts; the file the link points at is untouched."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "stdout.log").symlink_to(outside)
    marker = tmp_path / "ran"
    child = [sys.executable, "-c", f"open({str(marker)!r}, 'w'); print('x' * 100)"]
    done = subprocess.run(
        supervisor_argv(tmp_path, child),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert outside.read_text() == "precious\n" and not marker.exists()


def test_the_childs_exit_wakes_the_supervisor(tmp_path):
    """The supervisor catches SIGCHLD (a handler of its own, whose arrival writes to its
    wake-up pipe): with the default disposition the child's exit went unnoticed until the
    watch loop's next timeout whenever its pipes closed before it could be reaped, which
    delayed the exit record, the settle and the slot's refill of many attempts."""
    release = tmp_path / "release"
    code = (
        "import pathlib, time\n"
        f"while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.01)\n"
    )
    proc, attempt, _ = start(tmp_path, [sys.executable, "-c", code])
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        mask = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt"))
        caught = int(mask, 16)
        assert caught & (1 << (signal.SIGCHLD - 1)), status
    finally:
        release.touch()
        assert proc.wait(timeout=30) == 0
    assert exit_record(attempt)["exit_code"] == 0
