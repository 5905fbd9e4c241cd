"""`laneway controller` waits for its runtime dir's ledger as a worker does (issue 46
item 5): it logs `controller_waiting` once, writes nothing, starts once `start-pipeline`
creates the ledger, and stops on TERM while waiting (exit 0); `--exit-if-missing` exits
2 with one line instead. A runtime dir that is a regular file, where no ledger can ever
appear, is refused at once by every command that waits (`controller`, `worker`, `status
--watch`): exit 2, one line, instead of waiting for ever (issue 47 item 9). Real
processes through the real CLI; lines read with a bounded timeout, no sleep."""

from __future__ import annotations

import json

import pytest

from laneway.controller import db
from tests.integration.test_cli_waiting import pipeline, running, start_pipeline

__all__ = ["running"]  # the fixture, shared with test_cli_waiting


def test_a_controller_started_before_its_ledger_waits_then_serves(
    tmp_path, running, without_ledger
):
    runtime = tmp_path / "rt"
    controller = running("controller", "--runtime-dir", str(runtime), "--json")
    waiting = json.loads(controller.err.next() or "null")
    assert waiting["event"] == "controller_waiting" and waiting["waiting_for"] == "ledger"
    if without_ledger is None:
        assert waiting["ledger"] == str(runtime.resolve() / db.LEDGER_FILENAME)
        assert not runtime.exists()  # waiting creates nothing
    start_pipeline(pipeline(tmp_path, "p", "n1"), runtime)
    started = controller.err.json_until(lambda body: body["event"] != "controller_waiting")
    assert started["event"] == "controller_started"
    assert controller.stop() == 0
    events = [json.loads(line)["event"] for line in [*controller.err.seen, *controller.err.rest()]]
    assert events.count("controller_waiting") == 1
    assert events[-1] == "controller_stopped"


def test_term_while_a_controller_waits_exits_0_creating_nothing(tmp_path, running, without_ledger):
    runtime = tmp_path / "rt"
    controller = running("controller", "--runtime-dir", str(runtime))
    said = controller.err.next() or ""
    assert said.startswith("laneway controller: no ledger at ") and "waiting" in said
    assert controller.stop() == 0
    assert "stopped while waiting for a ledger; nothing was written" in "".join(
        controller.err.rest()
    )
    if without_ledger is None:
        assert not runtime.exists()


def test_exit_if_missing_exits_2_with_one_line(tmp_path, running, without_ledger):
    runtime = tmp_path / "rt"
    controller = running("controller", "--runtime-dir", str(runtime), "--exit-if-missing")
    assert controller.wait() == 2
    [line] = controller.err.rest()
    if without_ledger is None:
        assert line.startswith(f"laneway: --runtime-dir {runtime}: no ledger at ")
        assert not runtime.exists()
    else:
        assert "the database holds no laneway ledger" in line


@pytest.mark.sqlite_only("the SQLite ledger lives in the runtime dir")
@pytest.mark.parametrize(
    "argv",
    [["controller"], ["worker", "--node", "n1"], ["status", "--watch"]],
    ids=lambda argv: argv[0],
)
@pytest.mark.parametrize("below", [False, True], ids=["the-dir", "a-parent"])
def test_a_runtime_dir_that_is_a_file_is_refused_at_once(tmp_path, running, argv, below):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x\n")
    runtime = blocker / "rt" if below else blocker
    process = running(*argv, "--runtime-dir", str(runtime))
    assert process.wait() == 2
    [line] = process.err.rest()
    assert line.startswith("laneway: no ledger can appear at "), line
    assert f"{blocker} is a file, not a directory" in line
    assert process.out.rest() == []
    assert blocker.read_text() == "x\n"
