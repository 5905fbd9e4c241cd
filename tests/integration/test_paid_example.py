"""The shipped example of paid work under control (configs/paid/pipeline.toml) runs as
its header says, and shows what it is for: a rate limit (refusals `rate_limit` with the
window's arithmetic, never more than 4 calls in 2 s), rate-limited attempts retried
after their delay, and a selection by yield that `explain` and `report` show. A real
`laneway run` in-process, its jobs real processes."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import ROOT

CONFIG = ROOT / "configs" / "paid" / "pipeline.toml"


def sql(runtime: Path, query: str) -> list[dict[str, Any]]:
    result = invoke("sql", query, "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def test_the_paid_example_limits_retries_and_selects_by_yield(tmp_path):
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    ran = invoke("run", str(CONFIG), *rt, "--json")
    assert ran.exit_code == 0, ran.output
    status = json.loads(ran.stdout)
    assert status["run"]["state"] == "finished"
    assert status["jobs"] == {"ask": {"succeeded": 12}}
    outcomes = sql(runtime, "SELECT outcome, COUNT(*) AS n FROM attempts GROUP BY outcome")
    assert {r["outcome"]: r["n"] for r in outcomes} == {"rate_limited": 4, "succeeded": 12}
    starts = sorted(
        datetime.fromisoformat(r["intent_at"])
        for r in sql(runtime, "SELECT intent_at FROM attempts")
    )
    for moment in starts:
        assert sum(1 for s in starts if moment - timedelta(seconds=2) <= s <= moment) <= 4
    refused = sql(runtime, "SELECT detail FROM decisions WHERE reason_code = 'rate_limit'")
    assert refused
    explained = invoke("explain", "p3-02.ask", *rt)
    assert explained.exit_code == 0, explained.output
    assert "chosen by the run's selection: group P3" in explained.stdout
    report = json.loads(invoke("report", *rt, "--json").stdout)
    groups = {g["group"]: g for g in report["selection"]["groups"]}
    assert groups["P2"]["yield"] == 9000.0 and groups["P3"]["yield"] == 3000.0
    text = invoke("report", *rt).stdout
    assert "selection by useful_tokens per cost_usd (explore 0.25;" in text
