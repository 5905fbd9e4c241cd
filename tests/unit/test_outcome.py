"""controller/outcome.py: every rule of classify() and check_result()."""

from __future__ import annotations

from typing import Any

import pytest

from laneway.controller.outcome import Verdict, check_result, classify
from laneway.controller.states import Outcome

JOB_ID = 42
DEFAULT_CODES = {0: Outcome.SUCCEEDED}
CUSTOM_CODES = {0: Outcome.SUCCEEDED, 75: Outcome.INFRA_FAILURE, 3: Outcome.FATAL}


def verdict(
    exit_record: dict[str, Any] | None,
    *,
    result: Any = None,
    exit_problem: str | None = None,
    exit_codes: dict[int, Outcome] | None = None,
) -> Verdict:
    """classify() the way the worker calls it: the result is checked first."""
    result_problem = check_result(result, JOB_ID) if result is not None else None
    return classify(
        exit_record,
        exit_problem=exit_problem,
        result=result if isinstance(result, dict) else None,
        result_problem=result_problem,
        exit_codes=DEFAULT_CODES if exit_codes is None else exit_codes,
    )


def ok_result(**flags: Any) -> dict[str, Any]:
    return {"job_id": JOB_ID, **flags}


# -- check_result ------------------------------------------------------------------


@pytest.mark.parametrize(
    "result",
    [
        {"job_id": JOB_ID},
        {"job_id": str(JOB_ID)},
        {"job_id": JOB_ID, "infrastructure_failure": False, "fatal_failure": False},
        {"job_id": JOB_ID, "fatal_failure": True, "anything": {"kept": [1, 2]}},
    ],
)
def test_check_result_accepts(result: dict[str, Any]) -> None:
    assert check_result(result, JOB_ID) is None


@pytest.mark.parametrize(
    ("result", "fragment"),
    [
        ([1, 2], "must be a JSON object"),
        ("ok", "must be a JSON object"),
        (None, "must be a JSON object"),
        ({}, "job_id None is not this job (42)"),
        ({"job_id": 41}, "job_id 41 is not this job (42)"),
        ({"job_id": "42x"}, "is not this job"),
        ({"job_id": JOB_ID, "infrastructure_failure": "false"}, "infrastructure_failure must"),
        ({"job_id": JOB_ID, "infrastructure_failure": None}, "infrastructure_failure must"),
        ({"job_id": JOB_ID, "fatal_failure": 1}, "fatal_failure must be true or false, not 1"),
        ({"job_id": JOB_ID, "fatal_failure": 0}, "fatal_failure must be true or false, not 0"),
    ],
)
def test_check_result_refuses(result: Any, fragment: str) -> None:
    problem = check_result(result, JOB_ID)
    assert problem is not None
    assert fragment in problem


# -- classify: rules in order ---------------------------------------------------


@pytest.mark.parametrize("problem", [None, "exit.json unreadable: bad JSON"])
def test_no_exit_record_is_unknown(problem: str | None) -> None:
    result = verdict(None, exit_problem=problem, result=ok_result())
    assert result.outcome is None
    assert result.reason == (problem or "no exit record")


def test_no_exit_record_is_unknown_even_with_a_result_saying_fatal() -> None:
    assert verdict(None, result=ok_result(fatal_failure=True)).outcome is None


def test_spawn_error_is_harness_failure() -> None:
    result = verdict({"spawn_error": "No such file: ./run.sh", "exit_code": None})
    assert result.outcome is Outcome.HARNESS_FAILURE
    assert "No such file: ./run.sh" in result.reason


def test_stopped_is_cancelled() -> None:
    result = verdict({"stopped": True, "signal": 15, "exit_code": None})
    assert result.outcome is Outcome.CANCELLED


def test_timed_out_is_timed_out() -> None:
    result = verdict({"timed_out": True, "signal": 9, "exit_code": None})
    assert result.outcome is Outcome.TIMED_OUT


def test_a_timeout_names_its_limit_and_the_field_that_set_it() -> None:
    result = classify(
        {"timed_out": True, "signal": 15, "exit_code": None},
        exit_problem=None,
        result=None,
        result_problem=None,
        exit_codes=DEFAULT_CODES,
        stage="solve",
        timeout_seconds=30,
    )
    assert result.outcome is Outcome.TIMED_OUT
    assert result.reason == "timed out after 30 s (stages.solve.timeout_seconds = 30)"


def test_log_errors_are_harness_failure_with_diagnostics() -> None:
    result = verdict({"exit_code": 0, "log_errors": ["stdout.log: ENOSPC", "stderr.log: EIO"]})
    assert result.outcome is Outcome.HARNESS_FAILURE
    assert "stdout.log: ENOSPC" in result.reason
    assert result.diagnostics == ["log: stdout.log: ENOSPC", "log: stderr.log: EIO"]


def test_empty_log_errors_do_not_count() -> None:
    assert verdict({"exit_code": 0, "log_errors": []}).outcome is Outcome.SUCCEEDED


def test_result_fatal_failure_is_fatal() -> None:
    result = verdict({"exit_code": 0}, result=ok_result(fatal_failure=True))
    assert result.outcome is Outcome.FATAL


def test_result_infrastructure_failure_is_infra_failure() -> None:
    result = verdict({"exit_code": 1}, result=ok_result(infrastructure_failure=True))
    assert result.outcome is Outcome.INFRA_FAILURE


def test_fatal_wins_over_infrastructure_failure() -> None:
    both = ok_result(fatal_failure=True, infrastructure_failure=True)
    assert verdict({"exit_code": 0}, result=both).outcome is Outcome.FATAL


def test_result_flags_false_leave_the_exit_code_in_charge() -> None:
    flags = ok_result(fatal_failure=False, infrastructure_failure=False)
    assert verdict({"exit_code": 0}, result=flags).outcome is Outcome.SUCCEEDED
    assert verdict({"exit_code": 2}, result=flags).outcome is Outcome.FAILED


def test_signal_is_failed() -> None:
    result = verdict({"signal": 11, "exit_code": None})
    assert result.outcome is Outcome.FAILED
    assert "11" in result.reason


def test_result_infra_flag_is_honoured_even_after_a_crash() -> None:
    result = verdict(
        {"signal": 9, "exit_code": None}, result=ok_result(infrastructure_failure=True)
    )
    assert result.outcome is Outcome.INFRA_FAILURE


@pytest.mark.parametrize(
    ("code", "codes", "expected"),
    [
        (0, DEFAULT_CODES, Outcome.SUCCEEDED),
        (1, DEFAULT_CODES, Outcome.FAILED),
        (255, DEFAULT_CODES, Outcome.FAILED),
        (0, CUSTOM_CODES, Outcome.SUCCEEDED),
        (75, CUSTOM_CODES, Outcome.INFRA_FAILURE),
        (3, CUSTOM_CODES, Outcome.FATAL),
        (4, CUSTOM_CODES, Outcome.FAILED),
        (0, {75: Outcome.INFRA_FAILURE}, Outcome.SUCCEEDED),
        (75, {75: Outcome.INFRA_FAILURE}, Outcome.INFRA_FAILURE),
        (0, {0: Outcome.FAILED}, Outcome.FAILED),
        (9, {0: Outcome.SUCCEEDED, 9: Outcome.HARNESS_FAILURE}, Outcome.HARNESS_FAILURE),
    ],
)
def test_exit_code_map(code: int, codes: dict[int, Outcome], expected: Outcome) -> None:
    result = verdict({"exit_code": code}, exit_codes=codes)
    assert result.outcome is expected
    assert result.reason == f"exit code {code}"
    assert result.diagnostics == []


def test_exit_record_without_code_or_signal_is_unknown() -> None:
    assert verdict({"exit_code": None}).outcome is None
    assert verdict({}).outcome is None


# -- an invalid result can never be success ------------------------------------


@pytest.mark.parametrize(
    "bad_result",
    [
        {"job_id": 7},
        {"job_id": JOB_ID, "fatal_failure": "no"},
        {"job_id": JOB_ID, "infrastructure_failure": None},
        {"no_job_id": True},
        [JOB_ID],
    ],
)
def test_exit_zero_with_invalid_result_is_failed(bad_result: Any) -> None:
    problem = check_result(bad_result, JOB_ID)
    assert problem is not None
    result = verdict({"exit_code": 0}, result=bad_result)
    assert result.outcome is Outcome.FAILED
    assert problem in result.diagnostics
    assert problem in result.reason


def test_invalid_result_flags_are_ignored() -> None:
    # A result for another job saying fatal must not halt this one: exit code decides.
    wrong_job = {"job_id": 7, "fatal_failure": True, "infrastructure_failure": True}
    result = verdict({"exit_code": 1}, result=wrong_job)
    assert result.outcome is Outcome.FAILED
    assert check_result(wrong_job, JOB_ID) in result.diagnostics


def test_unreadable_result_with_exit_zero_is_failed() -> None:
    result = classify(
        {"exit_code": 0},
        exit_problem=None,
        result=None,
        result_problem="result.json unreadable: Expecting value",
        exit_codes=DEFAULT_CODES,
    )
    assert result.outcome is Outcome.FAILED
    assert result.diagnostics == ["result.json unreadable: Expecting value"]


def test_invalid_result_with_failing_exit_code_keeps_that_class() -> None:
    result = verdict({"exit_code": 75}, result={"job_id": 1}, exit_codes=CUSTOM_CODES)
    assert result.outcome is Outcome.INFRA_FAILURE
    assert len(result.diagnostics) == 1


@pytest.mark.parametrize("signum", [6, 9, 11])
def test_crash_with_result_saying_success_is_failed(signum: int) -> None:
    happy = ok_result(infrastructure_failure=False, fatal_failure=False, status="ok")
    result = verdict({"signal": signum, "exit_code": None}, result=happy)
    assert result.outcome is Outcome.FAILED


def test_crash_with_exit_code_zero_and_signal_is_failed() -> None:
    assert verdict({"signal": 9, "exit_code": 0}).outcome is Outcome.FAILED


@pytest.mark.parametrize(
    "record",
    [
        {"spawn_error": "ENOENT"},
        {"stopped": True, "signal": 15},
        {"timed_out": True, "signal": 9},
        {"exit_code": 0, "log_errors": ["x"]},
        {"signal": 9},
    ],
)
def test_result_problem_is_kept_as_diagnostic(record: dict[str, Any]) -> None:
    result = verdict(record, result={"job_id": 1})
    assert result.outcome is not Outcome.SUCCEEDED
    assert check_result({"job_id": 1}, JOB_ID) in result.diagnostics


# -- rule order ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "result", "expected"),
    [
        ({"spawn_error": "x", "stopped": True, "timed_out": True}, None, Outcome.HARNESS_FAILURE),
        ({"stopped": True, "timed_out": True, "signal": 9}, None, Outcome.CANCELLED),
        ({"timed_out": True, "log_errors": ["x"]}, None, Outcome.TIMED_OUT),
        ({"stopped": True, "exit_code": 0}, ok_result(fatal_failure=True), Outcome.CANCELLED),
        ({"timed_out": True, "exit_code": 0}, ok_result(fatal_failure=True), Outcome.TIMED_OUT),
        (
            {"exit_code": 0, "log_errors": ["x"]},
            ok_result(fatal_failure=True),
            Outcome.HARNESS_FAILURE,
        ),
        ({"signal": 9}, ok_result(fatal_failure=True), Outcome.FATAL),
        ({"exit_code": 0}, ok_result(infrastructure_failure=True), Outcome.INFRA_FAILURE),
    ],
)
def test_rule_order(record: dict[str, Any], result: Any, expected: Outcome) -> None:
    assert verdict(record, result=result).outcome is expected


@pytest.mark.parametrize(
    "result",
    [
        {"job_id": "sk-live-canary-0123456789"},
        {"job_id": JOB_ID, "fatal_failure": "sk-live-canary-0123456789"},
        {"job_id": JOB_ID, "infrastructure_failure": ["sk-live-canary-0123456789"]},
        {"job_id": {"token": "sk-live-canary-0123456789"}},
    ],
)
def test_reasons_never_quote_strings_from_the_result(result: Any) -> None:
    """Reasons are stored in the ledger unredacted: a job's strings stay out of them."""
    problem = check_result(result, JOB_ID)
    assert problem is not None and "canary" not in problem and "token" not in problem
