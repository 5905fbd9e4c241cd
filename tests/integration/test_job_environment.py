"""What a job is given: a clean environment, its stage's variables, named pass-through
variables; and what reaches the ledger of what it leaves: secrets redacted everywhere,
also from its result.json."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from controller import db, ledger
from controller.daemon import Controller
from controller.models import Run
from tests.integration.test_worker import attempts, drive, start_worker
from tests.support import escape, make_config

ENV_DUMP = textwrap.dedent(
    """
    import json, os
    print(json.dumps(dict(os.environ)))
    with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
        json.dump({"job_id": os.environ["LANEWAY_JOB_ID"], "names": sorted(os.environ)}, f)
    """
)


def test_a_job_gets_a_clean_environment_and_what_its_stage_names(
    engine, runtime, make_run, monkeypatch
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-unreferenced-4c1d")
    monkeypatch.setenv("LANEWAY_DATABASE_URL", f"sqlite:///{runtime / db.LEDGER_FILENAME}")
    monkeypatch.setenv("HF_TOKEN", "hf-passed-through-77ab")
    monkeypatch.setenv("INNER_SECRET", "inner-referenced-5e6f")
    stage = {
        "name": "dump",
        "argv": [sys.executable, "-c", escape(ENV_DUMP)],
        "env": {"HEADER_LINE": "Bearer ${INNER_SECRET}", "MODE": "fast"},
        "pass_env": ["HF_TOKEN"],
        "timeout_seconds": 30,
    }
    run_id = make_run(make_config([stage]))
    drive(engine, [start_worker(engine)], run_id)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "succeeded", attempt.state_reason
    names = set(attempt.result["names"])
    assert {"HEADER_LINE", "MODE", "HF_TOKEN", "PATH", "LANEWAY_JOB_ID"} <= names
    # Never given: an unreferenced worker variable, the ledger URL, and a secret that
    # was only referenced inside another variable.
    assert not names & {"AWS_SECRET_ACCESS_KEY", "LANEWAY_DATABASE_URL", "INNER_SECRET"}
    stdout = (Path(attempt.attempt_dir) / "stdout.log").read_text()
    assert "aws-unreferenced-4c1d" not in stdout
    assert "hf-passed-through-77ab" not in stdout  # passed through, redacted like a secret
    assert "inner-referenced-5e6f" not in stdout and "[REDACTED]" in stdout
    assert '"MODE": "fast"' in stdout


def test_an_unset_pass_env_variable_is_a_harness_failure_naming_it(engine, make_run, monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    stage = {
        "name": "needy",
        "argv": [sys.executable, "-c", "pass"],
        "pass_env": ["NOT_SET_ANYWHERE"],
        "timeout_seconds": 30,
    }
    run_id = make_run(make_config([stage]))
    service = start_worker(engine)
    controller = Controller(engine)
    for _ in range(3):
        controller.tick()
        service.tick()
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "harness_failure"
    assert "pass_env NOT_SET_ANYWHERE" in attempt.state_reason


RESULT_LEAK = textwrap.dedent(
    """
    import json, os
    token = os.environ["API_TOKEN"]
    result = {
        "job_id": os.environ["LANEWAY_JOB_ID"],
        "infrastructure_failure": False,
        "fatal_failure": False,
        "echo": token,
        token: "as a key",
        "nested": {"list": [token, "prefix-" + token + "-suffix"]},
    }
    with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
        json.dump(result, f)
    """
)


def test_a_secret_in_result_json_reaches_no_ledger_file_and_no_report(
    engine, runtime, make_run, monkeypatch
):
    canary = "canary-result-3b2a1908"
    monkeypatch.setenv("CANARY_RESULT", canary)
    stage = {
        "name": "leaky",
        "argv": [sys.executable, "-c", escape(RESULT_LEAK)],
        "env": {"API_TOKEN": "${CANARY_RESULT}"},
        "timeout_seconds": 30,
    }
    run_id = make_run(make_config([stage]))
    drive(engine, [start_worker(engine)], run_id)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "succeeded", attempt.state_reason
    assert attempt.result["echo"] == "[REDACTED]"
    assert "prefix-[REDACTED]-suffix" in json.dumps(attempt.result)
    engine.dispose()
    for name in (db.LEDGER_FILENAME, db.LEDGER_FILENAME + "-wal"):
        path = runtime / name
        assert not path.exists() or canary.encode() not in path.read_bytes(), name
    report = runtime / "report.html"
    for args in (
        ["status", "--json"],
        ["explain", str(attempt.job_id)],
        ["report", "--html", str(report)],
    ):
        shown = CliRunner().invoke(app, [*args, "--runtime-dir", str(runtime)])
        assert shown.exit_code == 0, shown.output
        assert canary not in shown.output
    if report.exists():
        assert canary not in report.read_text()
    with db.session_factory(db.open_ledger(runtime))() as session:
        assert ledger.get_run(session, run_id).state == "finished"
        assert session.get(Run, run_id) is not None
