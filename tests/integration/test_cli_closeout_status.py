"""`laneway status` shows each run's closeout: none, pending, running step k of n,
finished, or failed (naming the steps), read from that run's `closeout_*` events."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from laneway.controller import db, ledger
from laneway.controller.states import RunState
from tests.integration.test_cli import invoke
from tests.support import make_config

STEPS = [
    {"name": "aggregate", "argv": [sys.executable, "-c", "pass"]},
    {"name": "publish", "argv": [sys.executable, "-c", "pass"]},
]


def status(runtime: Path, run_id: int) -> dict[str, Any]:
    result = invoke("status", str(run_id), "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    body: dict[str, Any] = json.loads(result.stdout)
    return body


def text(runtime: Path, run_id: int) -> str:
    result = invoke("status", str(run_id), "--runtime-dir", str(runtime))
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("closeout:")]
    return line


def event(factory: Any, clock: Any, run_id: int, kind: str, **detail: Any) -> None:
    """What controller/closeout.py appends as it goes."""
    with db.transaction(factory) as session:
        ledger.append_event(
            session, kind, actor="controller", now=clock.now(), **detail, run_id=run_id
        )


def test_status_shows_the_closeout_as_it_goes(factory, make_run, runtime, clock):
    plain = make_run(make_config(items=1))
    run_id = make_run(make_config(items=1, closeout=STEPS))
    other = make_run(make_config(items=1, closeout=STEPS))
    assert status(runtime, plain)["closeout"]["state"] == "none"
    assert text(runtime, plain) == "closeout: none"

    shown = status(runtime, run_id)["closeout"]
    assert shown["state"] == "pending" and shown["step_count"] == 2
    assert text(runtime, run_id).startswith("closeout: pending (2 steps")

    event(factory, clock, run_id, "closeout_step_started", step="aggregate", pid=1)
    shown = status(runtime, run_id)["closeout"]
    assert (shown["state"], shown["step"], shown["current"]) == ("running", 1, "aggregate")
    assert text(runtime, run_id) == "closeout: running step 1 of 2 (aggregate)"

    event(
        factory,
        clock,
        run_id,
        "closeout_step_finished",
        step="aggregate",
        state="failed",
        exit_code=3,
    )
    event(factory, clock, run_id, "closeout_step_started", step="publish", pid=2)
    shown = status(runtime, run_id)["closeout"]
    assert (shown["state"], shown["step"], shown["failed_steps"]) == ("running", 2, ["aggregate"])
    assert text(runtime, run_id) == (
        "closeout: running step 2 of 2 (publish); failed so far: aggregate (failed, exit 3)"
    )

    event(
        factory,
        clock,
        run_id,
        "closeout_step_finished",
        step="publish",
        state="succeeded",
        exit_code=0,
    )
    event(
        factory,
        clock,
        run_id,
        "closeout_finished",
        steps={"aggregate": "failed", "publish": "succeeded"},
    )
    shown = status(runtime, run_id)["closeout"]
    assert (shown["state"], shown["failed_steps"]) == ("failed", ["aggregate"])
    assert text(runtime, run_id) == "closeout: failed: aggregate (failed, exit 3) (of 2 steps)"

    # Another run's events are not this run's: it is still pending.
    assert status(runtime, other)["closeout"]["state"] == "pending"
    for kind, step in (("closeout_step_started", "aggregate"),):
        event(factory, clock, other, kind, step=step, pid=3)
    for name in ("aggregate", "publish"):
        event(
            factory,
            clock,
            other,
            "closeout_step_finished",
            step=name,
            state="succeeded",
            exit_code=0,
        )
    shown = status(runtime, other)["closeout"]
    assert (shown["state"], shown["step"], shown["current"]) == ("running", 2, "publish")
    event(
        factory,
        clock,
        other,
        "closeout_finished",
        steps={"aggregate": "succeeded", "publish": "succeeded"},
    )
    assert status(runtime, other)["closeout"]["state"] == "finished"
    assert text(runtime, other) == "closeout: finished (2 steps succeeded)"
    assert status(runtime, run_id)["closeout"]["state"] == "failed"


def test_an_interrupted_step_reads_as_failed_once_the_closeout_finished(
    factory, make_run, runtime, clock
):
    run_id = make_run(make_config(items=1, closeout=STEPS[:1]))
    event(factory, clock, run_id, "closeout_step_started", step="aggregate", pid=1)
    event(factory, clock, run_id, "closeout_finished", steps={"aggregate": "interrupted"})
    shown = status(runtime, run_id)["closeout"]
    assert (shown["state"], shown["failed_steps"]) == ("failed", ["aggregate"])
    assert text(runtime, run_id) == "closeout: failed: aggregate (interrupted) (of 1 step)"
    assert RunState.ACTIVE.value == status(runtime, run_id)["run"]["state"]
