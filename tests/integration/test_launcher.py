"""Supervisors forked by the worker's launcher behave as exec'd ones: the same outcome,
receipt and exit record; the exec path still works (``LANEWAY_SUPERVISOR_LAUNCHER=0``)
and is taken when the launcher cannot be reached; a launcher's supervisor is found by
its attempt directory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from laneway.workers import launcher
from laneway.workers.flight import LaunchedSupervisor
from laneway.workers.recovery import find_supervisor
from laneway.workers.spawning import LAUNCHER_ENV, Launcher
from tests.integration.test_worker import attempts, drive, start_worker
from tests.support import escape, make_config, wait_until

JOB = (
    "import json, os, sys; print('hello', flush=True); "
    "json.dump({'job_id': os.environ['LANEWAY_JOB_ID']}, "
    "open(os.environ['LANEWAY_RESULT_PATH'], 'w')); sys.exit(int(sys.argv[1]))"
)


@pytest.mark.parametrize("forked", [True, False], ids=["launcher", "exec"])
def test_both_ways_of_starting_a_supervisor_give_the_same_evidence(
    engine, make_run, monkeypatch, forked
):
    monkeypatch.setenv(LAUNCHER_ENV, "1" if forked else "0")
    stage = {
        "name": "s",
        "argv": [sys.executable, "-c", escape(JOB), "{code}"],
        "exit_codes": {0: "succeeded", 3: "failed"},
        "timeout_seconds": 30,
    }
    items = [{"key": "ok", "lane": "a", "code": "0"}, {"key": "no", "lane": "a", "code": "3"}]
    run_id = make_run(make_config([stage], items))
    service = start_worker(engine, slots=2)
    assert (service.launcher is not None) is forked
    drive(engine, [service], run_id)
    done = {a.exit_code: a for a in attempts(engine, run_id)}
    assert (done[0].outcome, done[3].outcome) == ("succeeded", "failed")
    for attempt in done.values():
        directory = Path(attempt.attempt_dir)
        receipt = json.loads((directory / "receipt.json").read_text())
        assert receipt["supervisor_pid"] == attempt.supervisor_pid
        assert receipt["child_pid"] == attempt.child_pid is not None
        assert (directory / "stdout.log").read_text() == "hello\n"
        assert json.loads((directory / "exit.json").read_text())["exit_code"] == attempt.exit_code
        status = directory / launcher.STATUS_FILE
        assert status.exists() is forked
        if forked:
            assert json.loads(status.read_text())["returncode"] == 0
    service.stop()


def test_an_unreachable_launcher_falls_back_to_exec(engine, make_run, monkeypatch):
    monkeypatch.setenv(LAUNCHER_ENV, "1")

    def broken(self, request, stdout_fd, stderr_fd):
        raise ConnectionError("the supervisor launcher exited")

    monkeypatch.setattr(Launcher, "spawn", broken)
    run_id = make_run(make_config([{"name": "s", "argv": ["true"], "timeout_seconds": 30}]))
    service = start_worker(engine)
    drive(engine, [service], run_id)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "succeeded"
    assert service.launcher is None and "launcher exited" in (service.launcher_error or "")


def test_a_forked_supervisor_is_found_by_its_attempt_directory(tmp_path):
    directory = tmp_path / "attempt-1"
    directory.mkdir()
    spec = {
        "attempt_id": 424242,
        "attempt_dir": str(directory),
        "argv": [sys.executable, "-c", "import time; time.sleep(60)"],
        "cwd": str(directory),
        "timeout_seconds": 60,
        "grace_seconds": 1,
        "log_cap_bytes": 1 << 20,
        "secret_env": [],
    }
    forker = Launcher()
    read_end, write_end = os.pipe()
    with open(directory / "supervisor.log", "ab") as log:
        pid, start_time = forker.spawn(
            {"spec": spec, "env": {"PATH": "/usr/bin:/bin"}}, write_end, log.fileno()
        )
    os.close(write_end)
    supervisor = LaunchedSupervisor(pid, start_time, os.fdopen(read_end, "rb"), str(directory))
    try:
        report = json.loads(supervisor.stdout.readline())
        assert report["child_pid"] > 0 and supervisor.poll() is None
        # Its /proc environ is the launcher's; its working directory names the attempt.
        assert find_supervisor(424242, str(directory)) == (pid, start_time)
        assert find_supervisor(424242, str(tmp_path / "other")) is None
    finally:
        os.kill(pid, 15)  # a controlled stop: TERM to the supervisor
        supervisor.stdout.close()
    wait_until(lambda: supervisor.poll() is not None)
    assert supervisor.returncode == 0  # recorded by the launcher, which reaped it
    assert json.loads((directory / "exit.json").read_text())["stopped"] is True
    forker.close()
