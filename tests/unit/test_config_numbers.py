"""Numbers in a config are numbers (issue 47 item 9): text and booleans are refused where
a number is meant, a misspelt or unexpected rate-limit key is refused rather than kept
as a usage limit that never binds, a usage limit of 0 is refused (and a run frozen with
one plans without a traceback), and range messages quote the real bound."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import usage
from laneway.controller.config import config_from_frozen, parse_config
from laneway.controller.config_models import PRIORITY_MAX, USAGE_KEY_PATTERN
from laneway.controller.errors import ConfigError
from tests.unit.test_config_hostile import BASE, named, refusal, with_value

pytestmark = pytest.mark.no_ledger


def limited(limit: dict[str, Any], expected: dict[str, float] | None = None) -> dict[str, Any]:
    """BASE with its stage drawing from limit ``p`` = ``limit``."""
    raw = copy.deepcopy(BASE)
    raw["limits"] = {"p": limit}
    if expected is not None:
        raw["stages"][0]["expected_usage"] = expected
        raw["stages"][0]["budget"] = None
        raw["budget"] = None
    return raw


@pytest.mark.parametrize(
    ("key", "field"), [("cals", "calls"), ("call", "calls"), ("per_second", "per_seconds")]
)
def test_a_misspelt_limit_field_is_refused_naming_the_field_it_meant(tmp_path, key, field):
    lines = refusal(limited({"calls": 5, "per_seconds": 60, key: 60}), tmp_path)
    [line] = [line for line in lines if line.startswith(f"limits.p.{key}:")]
    assert f"did you mean {field}?" in line


def test_a_limit_key_no_stage_expects_is_refused_not_kept_as_a_limit_that_never_binds(tmp_path):
    lines = refusal(limited({"calls": 60, "per_seconds": 60, "burst": 3}), tmp_path)
    [line] = [line for line in lines if line.startswith("limits.p.burst:")]
    assert "no stage that draws from p (s) gives expected_usage.burst" in line


def test_a_usage_limit_the_stages_expect_is_accepted(tmp_path):
    raw = limited({"api_calls": 100, "per_seconds": 60}, expected={"api_calls": 1})
    config = parse_config(raw, tmp_path)
    assert config.limits["p"].usage == {"api_calls": 100.0}
    assert config.limits["p"].calls is None


def test_a_usage_limit_of_zero_is_refused_at_load(tmp_path):
    lines = refusal(limited({"tokens": 0, "per_seconds": 60}, expected={"tokens": 5}), tmp_path)
    assert named(lines, "limits.p.tokens")
    assert "a limit of 0 admits nothing" in "\n".join(lines)


def test_a_run_frozen_with_a_usage_limit_of_zero_still_loads_and_plans_in_words(tmp_path):
    """dry-run/plan raised TypeError formatting None (controller/usage.py) for it."""
    config = parse_config(limited({"tokens": 1, "per_seconds": 60}, {"tokens": 5}), tmp_path)
    frozen = json.loads(config.canonical_json())
    frozen["limits"]["p"]["usage"]["tokens"] = 0.0
    loaded = config_from_frozen(json.dumps(frozen))
    [plan] = [p for p in usage.limit_plan(loaded, {"s": 3}) if p["key"] == "tokens"]
    assert plan["least_seconds"] is None
    [line] = [line for line in usage.limit_plan_lines([plan])]
    assert line.endswith("never: the limit is 0"), line


def test_dry_run_of_a_usage_limit_of_zero_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(limited({"tokens": 0, "per_seconds": 60}, {"tokens": 5})))
    result = CliRunner().invoke(app, ["dry-run", str(path)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "laneway: limits.p.tokens: a limit of 0 admits nothing" in result.stderr


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("budget.cost_usd", True, "true is a boolean, not a number"),
        ("stages.0.expected_usage.cost_usd", "0.5", "'0.5' is text, not a number"),
        ("limits.p.calls", "60", "'60' is text, not a whole number"),
        ("limits.p.per_seconds", False, "false is a boolean, not a number"),
        ("stages.0.retry.max_attempts", True, "true is a boolean, not a whole number"),
        ("stages.0.retry.backoff_seconds", "5", "'5' is text, not a number"),
        ("notify.retries", "2", "'2' is text, not a whole number"),
        ("notify.timeout_seconds", True, "true is a boolean, not a number"),
        ("nodes.0.max_jobs", [2], "give a whole number, not a list"),
    ],
)
def test_text_and_booleans_are_not_numbers(tmp_path, path, value, words):
    lines = refusal(with_value(path, value), tmp_path)
    [line] = [line for line in lines if line.startswith(f"{path}: ")]
    assert line.startswith(f"{path}: {words}"), line


def test_a_whole_float_is_an_integer_and_a_fraction_is_refused(tmp_path):
    assert parse_config(with_value("nodes.0.max_jobs", 2.0), tmp_path).nodes[0].max_jobs == 2
    lines = refusal(with_value("nodes.0.max_jobs", 2.5), tmp_path)
    assert "nodes.0.max_jobs: 2.5 is not a whole number; give one without a fraction" in lines


def test_a_huge_float_where_an_integer_is_meant_is_named_as_the_number_it_is(tmp_path):
    """``calls = 1e308`` said "exceeded maximum size" of a string."""
    lines = refusal(with_value("limits.p.calls", 1e308), tmp_path)
    assert lines == [
        "limits.p.calls: 1e+308 does not fit the ledger, which stores integers from "
        "-2147483648 to 2147483647"
    ]


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70, PRIORITY_MAX + 1])
def test_a_priority_out_of_range_quotes_the_priority_bound_only(tmp_path, value):
    lines = refusal(with_value("items.0.priority", value), tmp_path)
    assert lines == [
        f"items.0.priority: the priority of item 'i1' must be an integer from "
        f"{-PRIORITY_MAX} to {PRIORITY_MAX}"
    ]


def test_a_custom_priority_field_gets_the_same_message(tmp_path):
    raw = with_value("items.0.rank", 2**63)
    raw["priority_field"] = "rank"
    assert refusal(raw, tmp_path) == [
        f"items.0.rank: the priority of item 'i1' must be an integer from "
        f"{-PRIORITY_MAX} to {PRIORITY_MAX}"
    ]


def test_exit_code_keys_stay_text_as_toml_and_json_write_them(tmp_path):
    config = parse_config(
        with_value("stages.0.exit_codes", {"0": "succeeded", "9": "fatal"}), tmp_path
    )
    assert sorted(config.stage("s").exit_codes) == [0, 9]


USAGE_KEYS = st.from_regex(re.compile(USAGE_KEY_PATTERN.removesuffix("$") + r"\Z"))


@settings(max_examples=120, deadline=None)
@given(key=USAGE_KEYS, amount=st.floats(min_value=0.001, max_value=1e9), expected=st.booleans())
def test_any_other_limit_key_is_a_usage_key_only_when_a_stage_expects_it(key, amount, expected):
    """The property: a limit's key other than calls and per_seconds loads only as a usage
    key that a stage drawing from the limit gives an expected_usage for (and that does not
    look like a misspelt field); otherwise it is refused, one line naming it."""
    raw = limited({"per_seconds": 60, key: amount}, {key: 1.0} if expected else {"other": 1.0})
    if key in ("calls", "per_seconds"):
        return
    try:
        config = parse_config(raw, Path("/"))
    except ConfigError as caught:
        lines = caught.problems
        assert named(lines, f"limits.p.{key}"), lines
        assert not expected or "did you mean" in "\n".join(lines), lines
        return
    assert expected, f"limit key {key!r} loaded though no stage expects it"
    assert config.limits["p"].usage == {key: amount}
