"""What a job is given: a clean environment, its stage's variables, named pass-through
variables; and what reaches the ledger of what it leaves: secrets redacted everywhere,
also from its result.json."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from sqlalchemy import select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db, ledger, ledger_open
from laneway.controller.daemon import Controller
from laneway.controller.models import Decision, Run
from tests.integration.test_worker import attempts, drive, run_with_token, start_worker
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


SET_FOR_THE_JOB = {
    "LANEWAY_IDEMPOTENCY_KEY",
    "LANEWAY_JOB_ID",
    "LANEWAY_ATTEMPT_ID",
    "LANEWAY_ATTEMPT",
    "LANEWAY_RUN_ID",
    "LANEWAY_ITEM",
    "LANEWAY_STAGE",
    "LANEWAY_LANE",
    "LANEWAY_ATTEMPT_DIR",
    "LANEWAY_WORKSPACE",
    "LANEWAY_RESULT_PATH",
    "LANEWAY_PORTS",
}
"""The ``LANEWAY_*`` variables the worker sets for a job without inputs."""


def test_no_laneway_variable_of_the_worker_reaches_the_job(engine, runtime, make_run, monkeypatch):
    password = "pw-readonly-7f3a9c1e"
    readonly = f"postgresql://reader:{password}@127.0.0.1:5432/ledger"
    monkeypatch.setenv("LANEWAY_READONLY_DATABASE_URL", readonly)
    monkeypatch.setenv("LANEWAY_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("LANEWAY_SOMETHING_ELSE", "worker-only-value-2d4f")
    # The supervisor's own variables: it reads them, the job must not see them.
    monkeypatch.setenv("LANEWAY_GROUP_READABLE", "1")
    monkeypatch.setenv("LANEWAY_FAULTS", "no_such_site:1:EIO")
    stage = {
        "name": "dump",
        "argv": [sys.executable, "-c", escape(ENV_DUMP)],
        "timeout_seconds": 30,
    }
    run_id = make_run(make_config([stage]))
    drive(engine, [start_worker(engine)], run_id)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "succeeded", attempt.state_reason
    directory = Path(attempt.attempt_dir)
    dumped = json.loads((directory / "stdout.log").read_text())
    assert {name for name in dumped if name.startswith("LANEWAY_")} == SET_FOR_THE_JOB
    assert {name for name in attempt.result["names"] if name.startswith("LANEWAY_")} == (
        SET_FOR_THE_JOB
    )
    # The supervisor was given its variable: the logs it wrote are group-readable.
    assert (directory / "stdout.log").stat().st_mode & 0o777 == 0o640
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert password.encode() not in data, path
            assert b"worker-only-value-2d4f" not in data, path


def test_a_worker_without_a_pass_env_variable_refuses_the_stage_naming_it(
    engine, make_run, monkeypatch
):
    """An unset ``pass_env`` variable is the worker's refusal (``secret_missing``, the
    variable and the node), not a failed attempt: nothing is started."""
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
    assert attempts(engine, run_id) == []
    with db.session_factory(engine)() as session:
        (refusal,) = session.scalars(select(Decision).where(Decision.run_id == run_id)).all()
    assert (refusal.reason_code, refusal.detail) == (
        "secret_missing",
        {"node": "n1", "variables": ["NOT_SET_ANYWHERE"]},
    )


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
    attempt = run_with_token(engine, make_run, RESULT_LEAK, "CANARY_RESULT")
    run_id = attempt.run_id
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
    with db.session_factory(ledger_open.open_ledger(runtime))() as session:
        assert ledger.get_run(session, run_id).state == "finished"
        assert session.get(Run, run_id) is not None
