"""A stage with result = "required": a missing, unreadable, invalid or incomplete
result.json never settles succeeded; it is a harness_failure naming what is missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from laneway.controller.outcome import read_outcome
from laneway.controller.states import Outcome
from tests.support import make_config

JOB = 7
COMPLETE = {"job_id": JOB, "infrastructure_failure": False, "fatal_failure": False}


def attempt(tmp_path: Path, *, exit_code: int = 0, result: Any = None, raw: str | None = None):
    (tmp_path / "exit.json").write_text(json.dumps({"exit_code": exit_code, "signal": None}))
    if raw is not None:
        (tmp_path / "result.json").write_text(raw)
    elif result is not None:
        (tmp_path / "result.json").write_text(json.dumps(result))
    return tmp_path


def outcome(directory: Path, requirement: str = "required"):
    verdict, _, _ = read_outcome(
        directory,
        job_id=JOB,
        exit_codes={0: Outcome.SUCCEEDED},
        missing_exit="gone",
        result_requirement=requirement,  # type: ignore[arg-type]
    )
    return verdict


@pytest.mark.parametrize(
    ("result", "raw", "reason"),
    [
        (None, None, "result.json is missing; the stage requires one"),
        (None, "{not json", "result.json is not valid JSON"),
        ([1, 2], None, "result.json must be a JSON object"),
        ({"job_id": 8, **{k: v for k, v in COMPLETE.items() if k != "job_id"}}, None, "job_id 8"),
        ({"infrastructure_failure": False, "fatal_failure": False}, None, "lacks job_id"),
        ({"job_id": JOB, "fatal_failure": False}, None, "lacks infrastructure_failure,"),
        ({"job_id": JOB, "infrastructure_failure": False}, None, "lacks fatal_failure,"),
        ({"job_id": JOB}, None, "lacks infrastructure_failure, fatal_failure, which"),
        ({**COMPLETE, "fatal_failure": "no"}, None, "fatal_failure must be true or false"),
    ],
)
def test_required_result_missing_or_incomplete_is_a_harness_failure(tmp_path, result, raw, reason):
    verdict = outcome(attempt(tmp_path, result=result, raw=raw))
    assert verdict.outcome is Outcome.HARNESS_FAILURE
    assert verdict.reason.startswith("exit 0 but ") and reason in verdict.reason


def test_optional_result_keeps_the_old_rules(tmp_path):
    assert outcome(attempt(tmp_path), "optional").outcome is Outcome.SUCCEEDED
    assert outcome(attempt(tmp_path, result={"job_id": JOB}), "optional").outcome is (
        Outcome.SUCCEEDED
    )
    verdict = read_outcome(tmp_path, job_id=JOB, exit_codes={}, missing_exit="gone")[0]
    assert verdict.outcome is Outcome.SUCCEEDED  # the default is optional


def test_a_complete_required_result_succeeds_and_its_flags_count(tmp_path):
    assert outcome(attempt(tmp_path, result=COMPLETE)).outcome is Outcome.SUCCEEDED
    infra = {**COMPLETE, "infrastructure_failure": True}
    assert outcome(attempt(tmp_path, exit_code=75, result=infra)).outcome is Outcome.INFRA_FAILURE


def test_a_failing_exit_keeps_its_class_with_the_missing_result_as_a_diagnostic(tmp_path):
    verdict = outcome(attempt(tmp_path, exit_code=1))
    assert verdict.outcome is Outcome.FAILED
    assert any("missing" in d for d in verdict.diagnostics)


def test_a_result_the_job_made_a_directory_is_invalid_not_a_harness_failure(tmp_path):
    attempt(tmp_path)
    (tmp_path / "result.json").mkdir()  # the job's doing: an invalid result, no pause
    verdict = outcome(tmp_path, "optional")
    assert verdict.outcome is Outcome.FAILED
    assert "result.json is not a regular file (a directory)" in verdict.reason


def test_our_own_io_failing_on_the_result_is_a_harness_failure(tmp_path, monkeypatch):
    from laneway.controller import faults

    attempt(tmp_path, result=COMPLETE)
    monkeypatch.setenv(faults.ENV, "result_read:1:EIO")
    faults.reset()
    verdict = outcome(tmp_path)
    faults.reset()
    assert verdict.outcome is Outcome.HARNESS_FAILURE and "could not be read" in verdict.reason


def test_a_bad_requirement_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="result_requirement: 'yes' is not allowed"):
        outcome(attempt(tmp_path), "yes")


def test_stage_option_defaults_to_optional_and_is_validated():
    config = make_config(stages=[{"name": "s", "argv": ["true"], "result": "required"}])
    assert config.stage("s").result == "required"
    assert make_config().stages[0].result == "optional"
    from laneway.controller.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        make_config(stages=[{"name": "s", "argv": ["true"], "result": "always"}])
    assert caught.value.problems[0].startswith("stages.0.result:")
