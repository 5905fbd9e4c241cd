"""Closeout: every configured step is attempted once, in order, even after a failure;
progress is in the ledger and in an atomically written closeout_progress.json; a step
interrupted by a controller crash is recorded, never run again."""

from __future__ import annotations

import json
import sys

from sqlalchemy import select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db, ledger, ledger_open
from laneway.controller.daemon import Controller
from laneway.controller.models import Event
from tests.support import escape, make_config, wait_until

runner = CliRunner()


def steps(tmp_path):
    mark = str(tmp_path / "marks")
    return [
        {
            "name": "aggregate",
            "argv": [
                sys.executable,
                "-c",
                escape(
                    f"import sys; open({mark!r}, 'a').write('aggregate ' + sys.argv[1] + '\\n');"
                    " raise SystemExit(3)"
                ),
                "{run}",
            ],
        },
        {
            "name": "report",
            "argv": [sys.executable, "-c", escape(f"open({mark!r}, 'a').write('report\\n')")],
        },
        {
            "name": "slow",
            "argv": [sys.executable, "-c", "import time; time.sleep(600)"],
            "timeout_seconds": 1,
        },
    ]


def test_closeout_runs_every_step_once_after_the_run_finishes(tmp_path):
    config_path = tmp_path / "c.json"
    config = make_config(items=1, closeout=steps(tmp_path))
    config_path.write_text(config.model_dump_json())
    runtime = tmp_path / "rt"
    result = runner.invoke(app, ["run", str(config_path), "--runtime-dir", str(runtime), "--json"])
    assert result.exit_code == 0, result.output
    progress = json.loads((runtime / "runs/1/closeout_progress.json").read_text())
    assert progress["done"] is True
    assert [(s["name"], s["state"], s["exit_code"]) for s in progress["steps"]] == [
        ("aggregate", "failed", 3),
        ("report", "succeeded", 0),
        ("slow", "timed_out", -15),
    ]
    assert (tmp_path / "marks").read_text() == "aggregate 1\nreport\n"
    # A restarted controller does not run them again.
    engine = ledger_open.open_ledger(runtime)
    controller = Controller(engine)
    for _ in range(3):
        controller.tick()
    assert (tmp_path / "marks").read_text() == "aggregate 1\nreport\n"
    with db.session_factory(engine)() as session:
        kinds = session.scalars(
            select(Event.kind).where(Event.kind.like("closeout%")).order_by(Event.id)
        ).all()
    assert kinds.count("closeout_step_started") == 3 and kinds[-1] == "closeout_finished"


def test_a_step_interrupted_by_a_controller_crash_is_not_run_again(
    engine, runtime, make_run, clock, tmp_path
):
    run_id = make_run(make_config(items=1, closeout=steps(tmp_path)[:2]))
    factory = db.session_factory(engine)
    with db.transaction(factory) as session:
        # As if a controller had started "aggregate" and died before recording its end.
        ledger.append_event(
            session,
            "closeout_step_started",
            actor="controller",
            now=clock.now(),
            run_id=run_id,
            step="aggregate",
            pid=1,
        )
        ledger.cancel_pending(session, run_id, reason="t", actor="t", now=clock.now())
    controller = Controller(engine)

    def done():
        controller.tick()
        path = runtime / "runs" / str(run_id) / "closeout_progress.json"
        return path.exists() and json.loads(path.read_text())["done"] and path

    progress = json.loads(wait_until(done).read_text())
    assert [(s["name"], s["state"]) for s in progress["steps"]] == [
        ("aggregate", "interrupted"),
        ("report", "succeeded"),
    ]
    assert (tmp_path / "marks").read_text() == "report\n"
