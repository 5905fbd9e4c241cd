"""Secrets are checked where they are resolved (issue 'Never re-pay ...', item 5).

`start-pipeline` on a submit host without the workers' secrets is refused, naming the
reference and the option, and works with `--secrets-on-workers`. A worker that lacks a
variable a stage references then claims none of that stage's jobs: the refusal is
recorded as `secret_missing`, naming the variable and the node, `status` and `explain`
say it with the next step, no attempt is created and no retry is spent; the same worker
restarted with the variable runs the jobs, the value redacted from their logs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sqlalchemy import select

from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.explain import explain_job
from laneway.controller.models import Decision, Job
from laneway.controller.status import build_status
from tests.integration.test_cli import invoke
from tests.integration.test_worker import attempts, drive, start_worker
from tests.support import make_config, py_stage, wait_until

VARIABLE = "LANEWAY_TEST_PROVIDER_KEY_X"
"""Not a ``LANEWAY_*`` variable a job could be given by accident: only by reference."""
KEY = "sk-test-5f1c9e2a77d04b"

PRINTS_KEY = "import os, sys; print('key', os.environ['API_KEY']); sys.exit(0)"


def config_body(tmp_path: Path) -> dict[str, object]:
    return {
        "name": "keyed",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "name": "call",
                "argv": ["python3", "-c", "print(1)"],
                "env": {"API_KEY": f"${{{VARIABLE}}}"},
            }
        ],
        "items": [{"key": "x1", "lane": "a"}],
    }


def test_start_pipeline_without_the_workers_secrets_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(config_body(tmp_path)))
    runtime = ["--runtime-dir", str(tmp_path / "rt")]
    refused = invoke("start-pipeline", str(config), *runtime, "--no-controller")
    assert refused.exit_code == 1, refused.output
    assert (
        f"stages.call.env.API_KEY: ${{{VARIABLE}}} is not set; export it in the environment "
        "of laneway and its workers (or pass --secrets-on-workers when only the workers have it)"
    ) in refused.stderr
    dry = invoke("dry-run", str(config), "--secrets-on-workers", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["preflight"] == {"ok": True, "reasons": []}
    started = invoke(
        "start-pipeline", str(config), *runtime, "--no-controller", "--secrets-on-workers", "--json"
    )
    assert started.exit_code == 0, started.output
    assert json.loads(started.stdout)["run_id"] == 1  # the refusal created nothing


def test_a_worker_without_a_referenced_secret_refuses_the_stage_instead_of_failing_it(
    engine, make_run, monkeypatch
):
    monkeypatch.delenv(VARIABLE, raising=False)
    stages = [
        py_stage("call", PRINTS_KEY, env={"API_KEY": f"${{{VARIABLE}}}"}),
        py_stage("free", "print('no secret needed')"),
    ]
    run_id = make_run(make_config(stages, items=2))
    lacking = start_worker(engine)
    factory = db.session_factory(engine)

    def free_done() -> bool:
        lacking.tick()
        with factory() as session:
            states = session.scalars(select(Job.state).where(Job.stage == "free")).all()
        return all(state == "succeeded" for state in states)

    wait_until(free_done)
    for _ in range(3):
        lacking.tick()
    clock = SystemClock()
    with factory() as session:
        refusals = session.scalars(
            select(Decision).where(Decision.run_id == run_id, Decision.stage == "call")
        ).all()
        assert [(d.reason_code, d.detail) for d in refusals] == [
            ("secret_missing", {"node": "n1", "variables": [VARIABLE]})
        ]
        jobs = {(j.stage, j.state.value) for j in session.scalars(select(Job))}
        call = session.scalars(select(Job.id).where(Job.stage == "call")).first()
        explained = explain_job(session, call, now=clock.now())
        status = build_status(session, ledger.get_run(session, run_id), now=clock.now()).as_dict()
    # The stage that needs no secret ran; the other was never started, so never failed.
    assert jobs == {("call", "ready"), ("free", "succeeded")}
    assert {a.attempt_dir.rsplit("/", 2)[-2].split(".")[1] for a in attempts(engine, run_id)} == {
        "free"
    }
    words = f"secret_missing — {VARIABLE} not set in the environment of the worker on node n1"
    assert explained["blocked_by"][0] == {
        "code": "secret_missing",
        "words": words,
        "detail": {"node": "n1", "variables": [VARIABLE]},
    }
    lane = status["lanes"][0]
    assert lane["reason"]["code"] == "secret_missing"
    assert lane["next_step"]["code"] == "secret_missing"
    assert f"the worker on node n1 lacks {VARIABLE}" in lane["next_step"]["words"]
    lacking.stop()

    monkeypatch.setenv(VARIABLE, KEY)  # the worker restarted with the secret
    having = start_worker(engine)
    drive(engine, [having], run_id)
    done = [a for a in attempts(engine, run_id) if "call/" in a.attempt_dir]
    assert [a.outcome for a in done] == ["succeeded", "succeeded"]
    for attempt in done:
        logged = (Path(attempt.attempt_dir) / "stdout.log").read_text()
        assert logged == "key [REDACTED]\n"
        assert KEY not in logged
    assert os.environ[VARIABLE] == KEY
