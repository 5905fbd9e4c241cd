"""Which commands create a ledger, and `laneway run` beside other controllers.

Only `start-pipeline` and `run` create a ledger, and only after preflight accepts the
config; services and read-only commands refuse a runtime dir without one (exit 2, one
line naming the path). `laneway run` ends when its run is finished in the ledger,
whoever closed it, and its closeout is done. Real processes, bounded waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from laneway.controller import controller_lock, db, ledger_open
from tests.integration.conftest import tables_in
from tests.integration.test_cli import assert_clean_error, invoke
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
LANEWAY = [sys.executable, "-m", "laneway"]
BOUND = 120  # seconds: a hung `laneway run` fails the test instead of hanging it


def config_file(tmp_path: Path, *, items: int = 3, max_jobs: int = 2, **extra: Any) -> Path:
    body = {
        "name": "svc",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": max_jobs}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [{"name": "only", "argv": [sys.executable, "-c", "pass"], "timeout_seconds": 30}],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(items)],
        **extra,
    }
    path = tmp_path / f"svc-{len(list(tmp_path.glob('svc-*.json')))}.json"
    path.write_text(json.dumps(body))
    return path


def closeout_step(marker: Path) -> list[dict[str, Any]]:
    code = f"open({str(marker)!r}, 'a').write('closed out\\n')"
    return [{"name": "mark", "argv": [sys.executable, "-c", code], "timeout_seconds": 60}]


def spawn(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*LANEWAY, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"`laneway {process.args[3:]}` did not exit within {BOUND} s: {err[-2000:]}")
    return process.returncode, out, err


@pytest.fixture
def controller_on(tmp_path: Path):
    """A `laneway controller` serving a runtime dir that already has a ledger."""
    started: list[subprocess.Popen[str]] = []

    def _start(runtime: Path) -> subprocess.Popen[str]:
        process = spawn("controller", "--runtime-dir", str(runtime), "--interval", "0.05")
        started.append(process)
        wait_until(lambda: controller_lock.running_controller(runtime.resolve()) == process.pid, 60)
        return process

    yield _start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


def test_run_ends_when_another_controller_closes_its_run(tmp_path, controller_on):
    runtime = tmp_path / "rt"
    ledger_open.open_ledger(runtime).dispose()  # as an earlier start-pipeline leaves it
    controller_on(runtime)
    marker = tmp_path / "closeout.txt"
    config = config_file(tmp_path, closeout=closeout_step(marker))
    code, out, err = finish(spawn("run", str(config), "--runtime-dir", str(runtime), "--json"))
    assert code == 0, err[-2000:]
    status = json.loads(out)
    assert status["run"]["state"] == "finished" and status["totals"] == {"succeeded": 3}
    # The controller (which holds the runtime dir) ran the closeout, once, and `run`
    # waited for it.
    assert status["closeout"]["state"] == "finished"
    assert marker.read_text() == "closed out\n"


def test_two_runs_on_one_runtime_dir_both_end(tmp_path):
    runtime = tmp_path / "rt"
    ledger_open.open_ledger(runtime).dispose()
    # Two runs of one pipeline at once: deliberately (--new), or the second is refused.
    first = spawn(
        "run", str(config_file(tmp_path, items=4)), "--runtime-dir", str(runtime), "--new"
    )
    second = spawn(
        "run", str(config_file(tmp_path, items=2)), "--runtime-dir", str(runtime), "--new"
    )
    for process in (first, second):
        code, _out, err = finish(process)
        assert code == 0, err[-2000:]
    rows = json.loads(
        invoke(
            "sql", "SELECT id, state FROM runs ORDER BY id", "--runtime-dir", str(runtime), "--json"
        ).stdout
    )
    assert rows == [{"id": 1, "state": "finished"}, {"id": 2, "state": "finished"}]


def test_run_refused_by_preflight_creates_nothing(tmp_path):
    body = json.loads(config_file(tmp_path).read_text())
    body["stages"][0]["argv"][0] = "/no/such/python"
    path = tmp_path / "refused.json"
    path.write_text(json.dumps(body))
    runtime = tmp_path / "fresh"
    result = invoke("run", str(path), "--runtime-dir", str(runtime))
    assert_clean_error(result, 1)
    assert "/no/such/python does not exist" in result.stderr
    assert not runtime.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    assert_clean_error(invoke("run", str(path), "--runtime-dir", str(existing)), 1)
    assert list(existing.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [  # controller and worker: as real processes below (a regression would serve forever)
        ["status"],
        ["explain", "1"],
        ["sql", "SELECT 1"],
        ["report"],
        ["pause", "--all", "--reason", "r"],
        ["retry", "1", "--reason", "r"],
    ],
)
def test_a_runtime_dir_without_a_ledger_is_refused_and_left_alone(tmp_path, args, without_ledger):
    for runtime in (tmp_path / "typo", tmp_path / "empty"):
        if runtime.name == "empty":
            runtime.mkdir()
        result = invoke(*args, "--runtime-dir", str(runtime))
        assert_clean_error(result, 2)
        assert len(result.stderr.splitlines()) == 1
        if without_ledger is None:
            assert str(runtime / db.LEDGER_FILENAME) in result.stderr
        else:  # PostgreSQL: the database named by the URL holds no ledger
            assert f"/{without_ledger}: the database holds no laneway ledger" in result.stderr
            assert tables_in(without_ledger) == []
        assert "`laneway start-pipeline` or `laneway run` creates one" in result.stderr
        assert runtime.exists() == (runtime.name == "empty")
        if runtime.exists():
            assert list(runtime.iterdir()) == []


def test_services_refuse_a_missing_ledger_as_real_processes(tmp_path, without_ledger):
    runtime = tmp_path / "typo"
    # A worker and a controller wait for their ledger unless told not to
    # (tests/integration/test_cli_waiting.py, tests/integration/test_services_wait.py).
    for args in (
        ["controller", "--exit-if-missing"],
        ["worker", "--node", "n1", "--exit-if-unknown"],
    ):
        code, _out, err = finish(spawn(*args, "--runtime-dir", str(runtime)))
        assert code == 2 and "Traceback" not in err
        if without_ledger is None:
            assert err.startswith(f"laneway: --runtime-dir {runtime}: no ledger at ")
        else:
            assert "the database holds no laneway ledger" in err
            assert tables_in(without_ledger) == []
    assert not runtime.exists()


def test_worker_slots_default_to_the_nodes_max_jobs(tmp_path):
    runtime = tmp_path / "rt"
    config = config_file(tmp_path, max_jobs=3)
    assert invoke("start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller")
    paused = invoke("pause", "--all", "--reason", "only looking", "--runtime-dir", str(runtime))
    assert paused.exit_code == 0, paused.output
    process = spawn("worker", "--node", "n1", "--runtime-dir", str(runtime), "--json")
    try:
        assert process.stderr is not None
        first = json.loads(process.stderr.readline())
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.communicate(timeout=60)
    assert first["event"] == "worker_started" and first["slots"] == 3
    unknown = invoke("worker", "--node", "nope", "--runtime-dir", str(runtime), "--exit-if-unknown")
    assert_clean_error(unknown, 2)
    assert "node 'nope' is not in the ledger (known: 'n1')" in unknown.stderr


def test_laneway_run_gives_the_controller_lock_back_when_its_run_ends(tmp_path):
    """Another controller (here: this process again) can take the runtime dir's lock
    once a foreground run has ended; before, `laneway run` kept it until it exited."""
    from typer.testing import CliRunner

    from laneway.cli.main import app

    config = tmp_path / "pipeline.toml"
    config.write_text(
        'name = "lock"\n[[nodes]]\nname = "box"\nmemory_floor_mib = 0\nmax_jobs = 1\n'
        '[[lanes]]\nname = "main"\nnode = "box"\n'
        '[[stages]]\nname = "s"\nargv = ["true"]\n'
        '[[items]]\nkey = "one"\nlane = "main"\n'
    )
    runtime = tmp_path / "rt"
    shown = CliRunner().invoke(app, ["run", str(config), "--runtime-dir", str(runtime)])
    assert shown.exit_code == 0, shown.output
    assert str(runtime.resolve()) not in controller_lock._controller_locks
    assert controller_lock.hold_controller_lock(runtime)
    controller_lock.release_controller_lock(runtime)
