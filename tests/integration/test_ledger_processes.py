"""Several laneway processes on one runtime dir at once, then the ledger after every one
of them has exited: it holds every event, control and attempt each process printed, and
continuing the run executes nothing twice.

Before the fix, `laneway run` opened the SQLite ledger file by name a second time while
its first connection was open: closing that descriptor dropped every POSIX lock the
process held on the file, so the next laneway process to close its last connection (a
pause, a refused second run) checkpointed and deleted the WAL, and every later commit
of `laneway run` went into a deleted file: printed, then lost.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger_open, readonly
from laneway.controller.models import Attempt, Control, Event, Job, Run
from tests.integration.test_cli_services import BOUND, LANEWAY, ROOT
from tests.integration.test_continue import executions, write_config
from tests.support import wait_until

pytestmark = pytest.mark.slow


def laneway(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LANEWAY, *argv], cwd=ROOT, capture_output=True, text=True, timeout=BOUND
    )


def ledger_rows(runtime: Path) -> dict[str, Any]:
    """What the ledger holds, read by a fresh engine after every process exited."""
    engine = db.make_engine(db.ledger_url(runtime), readonly=True)
    try:
        with db.session_factory(engine)() as session:
            return {
                "events": {e.id: e.kind for e in session.scalars(select(Event))},
                "controls": {c.id: c.kind for c in session.scalars(select(Control))},
                "attempts": [
                    (a.job_id, a.state, a.outcome)
                    for a in session.scalars(select(Attempt).order_by(Attempt.id))
                ],
                "jobs": {j.id: j.state for j in session.scalars(select(Job))},
                "runs": {r.id: r.state for r in session.scalars(select(Run))},
            }
    finally:
        engine.dispose()


def test_a_run_beside_a_pause_a_refused_run_a_retry_and_a_status_loses_nothing(
    tmp_path, runtime, ledger_backend
):
    config = write_config(tmp_path, items=3)
    (tmp_path / "gate.fail.x1").touch()  # x1 fails: the operator retries it below
    rt = str(runtime)
    out_path, err_path = tmp_path / "run.out", tmp_path / "run.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        first = subprocess.Popen(
            [*LANEWAY, "run", str(config), "--runtime-dir", rt, "--json", "--quiet"],
            cwd=ROOT,
            stdout=out,
            stderr=err,
            text=True,
        )
        try:
            # x1 failed, x2 succeeded, x3 runs (held at its gate) under `laneway run`.
            wait_until(lambda: "work x3" in executions(tmp_path), BOUND)
            printed: dict[str, Any] = {}

            refused = laneway("run", str(config), "--runtime-dir", rt)
            assert refused.returncode == 1, refused.stderr
            assert "laneway run --continue 1" in refused.stderr

            status = laneway("status", "1", "--runtime-dir", rt, "--json")
            assert status.returncode == 0, status.stderr
            printed["status_events"] = {
                e["id"]: e["kind"] for e in json.loads(status.stdout)["recent_events"]
            }

            pause = laneway("pause", "1", "--reason", "hold", "--runtime-dir", rt, "--json")
            assert pause.returncode == 0, pause.stderr
            printed["pause"] = json.loads(pause.stdout)["control_id"]

            (tmp_path / "gate.fail.x1").unlink()
            retry = laneway("retry", "1", "--reason", "fixed", "--runtime-dir", rt, "--json")
            assert retry.returncode == 0, retry.stderr + retry.stdout

            resume = laneway("resume", "1", "--reason", "go", "--runtime-dir", rt, "--json")
            assert resume.returncode == 0, resume.stderr
            assert json.loads(resume.stdout)["cleared"] >= 1

            (tmp_path / "gate").touch()
            code = first.wait(timeout=BOUND)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    assert code == 0, err_path.read_text()[-2000:]
    final = json.loads(out_path.read_text())
    assert final["run"]["state"] == "finished"

    # Every process has exited. The ledger holds what each of them printed.
    found = ledger_rows(runtime)
    run_events = {e["id"]: e["kind"] for e in final["recent_events"]}
    for printed_events in (run_events, printed["status_events"]):
        assert printed_events, "each process printed events to check"
        assert {i: found["events"].get(i) for i in printed_events} == printed_events
    assert found["controls"].get(printed["pause"]) == "pause"
    assert found["runs"] == {1: "finished"}
    assert set(found["jobs"].values()) == {"succeeded"}
    # Job 1 (x1): failed, then the operator's retry; the others ran once each.
    assert [(job, outcome) for job, _, outcome in found["attempts"]] == [
        (1, "failed"),
        (2, "succeeded"),
        (3, "succeeded"),
        (1, "succeeded"),
    ]
    assert sorted(executions(tmp_path)) == ["work x1", "work x1", "work x2", "work x3"]

    # Continuing executes nothing: the run is finished in the ledger, as `run` said.
    again = laneway("run", "--continue", "1", "--runtime-dir", rt)
    assert again.returncode == 2 and "run 1 is finished" in again.stderr, again.stderr
    assert sorted(executions(tmp_path)) == ["work x1", "work x1", "work x2", "work x3"]


def test_every_open_of_an_existing_ledger_leaves_the_file_to_sqlite(runtime, engine, monkeypatch):
    """No code path opens the ledger file by name while a connection to it may be open
    in the process: the commands' opens of an existing ledger go through SQLite only."""
    if not db.is_sqlite(engine):
        pytest.skip("SQLite only: a file ledger")
    import builtins
    import os

    ledger_file = os.path.realpath(runtime / db.LEDGER_FILENAME)
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def watch(path: Any) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            name = os.fsdecode(path)
            if os.path.realpath(name) == ledger_file:
                opened.append(name)

    def guarded_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        watch(file)
        return real_open(file, *args, **kwargs)

    def guarded_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        watch(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    for opener in (
        ledger_open.open_ledger,
        ledger_open.open_existing_ledger,
        ledger_open.open_writer,
    ):
        opener(runtime).dispose()
    readonly.ReadOnlyLedger(runtime).close()
    db.make_engine(ledger_open.existing_ledger_url(runtime), readonly=True).dispose()
    assert opened == []
