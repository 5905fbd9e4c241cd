"""A real `laneway worker` settling hostile result.json files (issue 18, item 2).

Before: a result with ``"usage": {"cost_usd": <401 digits>}`` raised OverflowError inside
the settle transaction; the worker died, and so did every worker restarted on the
runtime dir. Now each such attempt settles with a diagnostic, the worker keeps running,
and later jobs run: the item's next stage, and a run started afterwards. Real processes
(`laneway controller`, `laneway worker`), bounded waits, both backends.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import select

from laneway.controller import db, ledger_open
from laneway.controller.models import Attempt, AttemptUsage, Item, Job, Run
from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import finish, spawn
from tests.support import escape, wait_until

# Each item's job writes one kind of hostile result.json (JSON's own escapes carry the
# NUL and the lone surrogate: json.dumps writes "\u0000" and "\ud800").
HOSTILE = """
import json, os, sys
job = os.environ["LANEWAY_JOB_ID"]
kind = sys.argv[1]
if kind == "huge":
    text = json.dumps({"job_id": job, "usage": {"cost_usd": 10**400, "calls": 2}})
elif kind == "deep":
    text = "[" * 10000 + "]" * 10000
elif kind == "nul":
    text = json.dumps({"job_id": job, "note": "a\\x00b\\ud800", "usage": {"cost_usd\\n": 9}})
elif kind == "types":
    text = json.dumps({"job_id": [[job]], "fatal_failure": 10**400, "usage": [1]})
else:
    text = json.dumps({"job_id": job, "usage": {"cost_usd": 0.5}})
with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
    f.write(text)
"""
KINDS = ["huge", "deep", "nul", "types", "fine"]
BOUND = 120


def write_config(tmp_path: Path, name: str, kinds: list[str], *, reuse: bool = True) -> Path:
    """Two stages running HOSTILE; ``reuse = false`` for a later run that must run again
    what an earlier run already did."""
    stage = {
        "argv": [sys.executable, "-c", escape(HOSTILE), "{item}"],
        "timeout_seconds": 60,
        "reuse": reuse,
    }
    body: dict[str, Any] = {
        "name": name,
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {"name": "hostile", **stage},
            {"name": "after", **stage, "needs": ["hostile"]},  # runs only on success
        ],
        "items": [{"key": kind, "lane": "a"} for kind in kinds],
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(body))
    return path


def finished(engine: Any, run_id: int, worker: Any) -> bool:
    """The run is finished, or the worker died (then the test says so, not a timeout)."""
    with db.session_factory(engine)() as session:
        run = session.get(Run, run_id)
        return (run is not None and run.state == "finished") or worker.poll() is not None


def attempts_by_job(engine: Any, run_id: int) -> dict[tuple[str, str], Any]:
    with db.session_factory(engine)() as session:
        rows = session.execute(
            select(Item.key, Job.stage, Attempt, Job.state)
            .join(Job, Job.id == Attempt.job_id)
            .join(Item, Item.id == Job.item_id)
            .where(Attempt.run_id == run_id)
        ).all()
        usage = session.execute(
            select(Item.key, AttemptUsage.key, AttemptUsage.value)
            .join(Job, Job.id == AttemptUsage.job_id)
            .join(Item, Item.id == Job.item_id)
            .where(AttemptUsage.run_id == run_id, Job.stage == "hostile")
        ).all()
    found: dict[tuple[str, str], Any] = {
        (item, stage): (attempt, state) for item, stage, attempt, state in rows
    }
    found[("usage", "")] = {(item, key): value for item, key, value in usage}
    return found


def test_a_real_worker_settles_hostile_results_and_keeps_running(tmp_path: Path):
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    started = invoke(
        "start-pipeline", str(write_config(tmp_path, "hostile", KINDS)), *rt, "--no-controller"
    )
    assert started.exit_code == 0, started.output
    engine = ledger_open.open_ledger(runtime)
    controller = spawn("controller", *rt, "--interval", "0.05")
    worker = spawn("worker", "--node", "n1", *rt)
    try:
        wait_until(lambda: finished(engine, 1, worker), BOUND, interval=0.1)
        assert worker.poll() is None, finish(worker)  # the worker survived every settle
        found = attempts_by_job(engine, 1)

        huge, huge_job = found[("huge", "hostile")]
        assert (huge.state, huge.outcome, huge_job) == ("settled", "succeeded", "succeeded")
        assert huge.diagnostics == [
            "usage.cost_usd ignored: (an integer of about 401 digits) is more than 1e+15"
        ]
        assert huge.result["usage"]["cost_usd"] == 10**400  # the evidence is kept as written

        deep, _ = found[("deep", "hostile")]
        assert (deep.state, deep.outcome) == ("settled", "failed")
        assert deep.diagnostics == ["result.json is nested deeper than 64 levels"]

        nul, _ = found[("nul", "hostile")]
        assert (nul.state, nul.outcome) == ("settled", "succeeded")
        assert nul.result["note"] == "a\ufffdb\ufffd"
        assert nul.diagnostics[0].startswith("result: 1 strings held a NUL or an unpaired")
        assert nul.diagnostics[1].startswith("usage.'cost_usd\\n' ignored: a key is a name")

        types, _ = found[("types", "hostile")]
        assert (types.state, types.outcome) == ("settled", "failed")
        assert "job_id (a list of 1 items) is not this job" in types.diagnostics[0]

        # What is not usage stays out of the spend; what is, is counted.
        assert found[("usage", "")] == {("huge", "calls"): 2.0, ("fine", "cost_usd"): 0.5}
        # Later jobs ran: each succeeded item's next stage, on the same worker.
        for kind in ("huge", "nul", "fine"):
            after, state = found[(kind, "after")]
            assert (after.outcome, state) == ("succeeded", "succeeded"), kind
        assert ("deep", "after") not in found and ("types", "after") not in found

        # And a run started afterwards is taken by the same worker process.
        config = write_config(tmp_path, "later", ["huge", "fine"], reuse=False)
        assert invoke("start-pipeline", str(config), *rt, "--no-controller").exit_code == 0
        wait_until(lambda: finished(engine, 2, worker), BOUND, interval=0.1)
        assert worker.poll() is None, finish(worker)
        later = attempts_by_job(engine, 2)
        assert later[("huge", "after")][0].outcome == "succeeded"
    finally:
        for process in (worker, controller):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            finish(process)
        engine.dispose()
