"""``laneway report``'s usage: per lane and stage totals, cost per succeeded item, yield
per hour, the spend curve, attempts whose usage is missing, the HTML spend chart."""

from __future__ import annotations

import pytest

from laneway.cli import render
from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html
from tests.integration.test_usage import REPORTER
from tests.integration.test_worker import drive, start_worker
from tests.support import make_config, py_stage


def test_report_sums_usage_per_lane_and_stage_with_yield_and_missing(engine, make_run, clock):
    # The run starts now, as the workers' clock has it: a window of seconds, not of the
    # months since the fixed clock's date (the yield, rounded to 3 places, would lose its
    # precision as the months go by).
    clock.moment = SystemClock().now()
    keys = ["ok1", "ok2", "fails", "bad", "silent"]
    lanes = [{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}]
    items = [{"key": k, "lane": "b" if k == "ok2" else "a"} for k in keys]
    run_id = make_run(make_config([py_stage("s", REPORTER)], items=items, lanes=lanes))
    drive(engine, [start_worker(engine)], run_id)
    with db.session_factory(engine)() as session:
        run = ledger.get_run(session, run_id)
        report = build_report(
            session, run, now=run.finished_at, yield_keys=("useful_tokens", "output_tokens")
        )
    usage = report["usage"]
    assert usage["totals"]["cost_usd"] == pytest.approx(4.0)
    lane_a, lane_b = usage["lanes"]["a"], usage["lanes"]["b"]
    # Lane a: ok1 0.5 + fails 2.0 (a failure's spend counts); succeeded items: ok1, bad,
    # silent (3).
    assert lane_a["totals"]["cost_usd"] == pytest.approx(2.5)
    assert lane_a["succeeded"] == 3
    assert lane_a["per_succeeded"]["cost_usd"] == pytest.approx(2.5 / 3, abs=1e-6)
    assert lane_b["per_succeeded"]["cost_usd"] == pytest.approx(1.5)
    assert lane_a["missing_usage"] == 1 and lane_b["missing_usage"] == 0
    # The run's exact window (the report's window_seconds is rounded to milliseconds,
    # which on a run of half a second is more than the tolerance). Rounding to
    # milliseconds is off by up to half of one, and exactly half (0.3705 -> 0.37) once
    # float error is added fails a 5e-4 bound: red in CI.
    hours = (run.finished_at - run.created_at).total_seconds() / 3600
    assert report["window_seconds"] == pytest.approx(hours * 3600, abs=6e-4)
    assert lane_a["yield_per_hour"]["useful_tokens"] == pytest.approx(40 / hours, rel=1e-3)
    assert set(lane_a["yield_per_hour"]) == {"useful_tokens", "output_tokens"}
    stage = usage["stages"]["s"]
    assert stage["totals"]["input_tokens"] == pytest.approx(450.0)
    assert stage["succeeded"] == 4
    assert [a["item"] for a in usage["missing_usage"]["attempts"]] == ["silent"]
    curve = usage["curve"]["cost_usd"]
    assert [round(total, 6) for _, total in curve] == sorted(round(t, 6) for _, t in curve)
    assert curve[-1][1] == pytest.approx(4.0) and len(curve) == 3
    assert all(0 <= at <= report["window_seconds"] for at, _ in curve)

    page = render_html(report)
    assert 'class="spend"' in page and "cost_usd: 4 in total" in page
    assert "attempts without usage" in page
    report["html"] = "report.html"
    text = render.report_text(report)
    assert "usage: cost_usd 4" in text
    assert "attempts without usage (1): " in text and "(silent.s, succeeded)" in text
