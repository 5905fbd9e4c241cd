"""The live display's ETA counts the run's rate limits (issue 46 item 5): a stage limited
to N calls (or N of a usage key) per window cannot finish its jobs not started yet
faster than the windows they fill, whatever the free slots say."""

from __future__ import annotations

import json

import pytest

from laneway.controller import progress
from laneway.controller.config import parse_config
from tests.status_bodies import typed
from tests.unit.test_live import status

pytestmark = pytest.mark.no_ledger

DURATIONS = {"prep": 2.0, "solve": 10.0}
"""With ``status()``: prep has 1 running, solve 3 waiting; 2 live slots: 16 s unlimited."""


def window(key: str = "calls", amount: float = 1, per: float = 60, each: float = 1.0):
    return progress.RateWindow("p", key, amount, per, {"solve": each})


def test_without_limits_the_eta_is_the_work_over_the_slots():
    assert progress.eta_seconds(typed(status()), DURATIONS, []) == 16.0


def test_one_call_a_minute_makes_three_jobs_take_two_windows_and_a_run():
    # The first starts now, the second a window later, the third two: then 10 s to run.
    assert progress.eta_seconds(typed(status()), DURATIONS, [window()]) == 130.0


def test_a_limit_the_jobs_fit_in_one_window_leaves_the_eta_to_the_slots():
    assert progress.eta_seconds(typed(status()), DURATIONS, [window(amount=3)]) == 16.0


def test_a_usage_key_limit_counts_each_attempts_expected_use():
    # 3 jobs x 400 tokens at 500 per 30 s: 1200 fills 3 windows, the last starts at 60 s.
    tokens = window("tokens", amount=500, per=30, each=400)
    assert progress.eta_seconds(typed(status()), DURATIONS, [tokens]) == 70.0


def test_the_slowest_limit_decides():
    slow, fast = window(amount=1, per=100), window(amount=2, per=10)
    assert progress.eta_seconds(typed(status()), DURATIONS, [fast, slow]) == 210.0


def test_a_limit_of_zero_with_work_left_has_no_eta():
    assert progress.eta_seconds(typed(status()), DURATIONS, [window(amount=0)]) is None


def test_a_limit_whose_stages_have_nothing_left_does_not_count():
    prep_only = progress.RateWindow("p", "calls", 1, 3600, {"prep": 1.0})  # prep: 1 running
    assert progress.eta_seconds(typed(status()), DURATIONS, [prep_only]) == 16.0


def test_rate_windows_read_a_frozen_config(tmp_path):
    raw = {
        "name": "eta",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {"name": "prep", "argv": ["true"]},
            {
                "name": "solve",
                "argv": ["true"],
                "limits": ["api", "tokens"],
                "expected_usage": {"output_tokens": 400},
            },
        ],
        "items": [{"key": "i", "lane": "a"}],
        "limits": {
            "api": {"calls": 1, "per_seconds": 60},
            "tokens": {"output_tokens": 500, "per_seconds": 30},
        },
    }
    frozen = json.loads(parse_config(raw, tmp_path).canonical_json())
    assert progress.rate_windows(frozen) == [
        progress.RateWindow("api", "calls", 1.0, 60.0, {"solve": 1.0}),
        progress.RateWindow("tokens", "output_tokens", 500.0, 30.0, {"solve": 400.0}),
    ]
