"""Smaller things the plan, preflight and report must get right (issues 46 and 47):
``[notify]``'s ``${NAME}`` references are preflighted like a stage's (refused, exit 1,
naming the field and the variable, nothing created); a rendered cwd with a newline stays
on one line; the plan's first decisions take items in the order a claim does (highest
priority first); a retried job's first attempt has no negative queue wait; the live
view's rate windows come from the run's frozen config."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from laneway.controller import db, ledger, pipeline, progress
from laneway.controller.report import build_report, queue_wait
from laneway.controller.rows import SessionRows
from laneway.controller.states import Outcome
from tests.integration.test_cli import invoke
from tests.support import claim_on_n1, make_config, py_stage, settle_one

HOOK = "https://hooks.example/${LANEWAY_TEST_HOOK_PATH}"


def notify_config(tmp_path: Path) -> Path:
    body: dict[str, Any] = {
        "name": "told",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [{"name": "s", "argv": ["true"], "timeout_seconds": 10}],
        "items": [{"key": "x", "lane": "a"}],
        "notify": {
            "webhook": HOOK,
            "headers": {"Authorization": "Bearer ${LANEWAY_TEST_HOOK_TOKEN}"},
        },
    }
    path = tmp_path / "told.json"
    path.write_text(json.dumps(body))
    return path


@pytest.mark.no_ledger
def test_preflight_names_each_unset_notify_reference(monkeypatch):
    config = make_config(
        notify={"webhook": HOOK, "headers": {"X-Token": "${LANEWAY_TEST_HOOK_TOKEN}"}}
    )
    reasons, _ = pipeline.preflight(config, environ={})
    assert [r for r in reasons if r.startswith("notify.")] == [
        "notify.webhook: ${LANEWAY_TEST_HOOK_PATH} is not set; export it in the environment "
        "of laneway's controller and workers, which send the notifications (or pass "
        "--secrets-on-workers when only they have it)",
        "notify.headers.X-Token: ${LANEWAY_TEST_HOOK_TOKEN} is not set; export it in the "
        "environment of laneway's controller and workers, which send the notifications (or "
        "pass --secrets-on-workers when only they have it)",
    ]
    set_both = {"LANEWAY_TEST_HOOK_PATH": "p", "LANEWAY_TEST_HOOK_TOKEN": "t"}
    assert pipeline.preflight(config, environ=set_both)[0] == []
    assert pipeline.preflight(config, environ={}, secrets_on_workers=True)[0] == []


@pytest.mark.no_ledger
def test_dry_run_refuses_an_unset_notify_reference_with_exit_1(tmp_path, monkeypatch):
    monkeypatch.delenv("LANEWAY_TEST_HOOK_PATH", raising=False)
    monkeypatch.setenv("LANEWAY_TEST_HOOK_TOKEN", "t0ken-value")
    result = invoke("dry-run", str(notify_config(tmp_path)))
    assert result.exit_code == 1, result.output
    assert "preflight: REFUSED" in result.stdout
    assert "  notify.webhook: ${LANEWAY_TEST_HOOK_PATH} is not set" in result.stdout
    assert "notify.headers" not in result.stdout  # that one is set
    assert "t0ken-value" not in result.output


def test_start_pipeline_creates_nothing_while_a_notify_reference_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("LANEWAY_TEST_HOOK_PATH", raising=False)
    monkeypatch.delenv("LANEWAY_TEST_HOOK_TOKEN", raising=False)
    runtime = tmp_path / "rt"
    config = notify_config(tmp_path)
    result = invoke("start-pipeline", str(config), "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 1, result.output
    body = json.loads(result.stdout)
    assert body["ok"] is False
    assert any(p.startswith("notify.webhook: ${LANEWAY_TEST_HOOK_PATH}") for p in body["problems"])
    assert any(p.startswith("notify.headers.Authorization: ") for p in body["problems"])
    assert not (runtime / db.LEDGER_FILENAME).exists() or ledger_has_no_runs(runtime)


def ledger_has_no_runs(runtime: Path) -> bool:
    result = invoke("runs", "--runtime-dir", str(runtime), "--json")
    return result.exit_code != 0 or json.loads(result.stdout) == []


@pytest.mark.no_ledger
def test_a_rendered_cwd_with_a_newline_stays_on_one_preflight_line(tmp_path):
    config = make_config(
        [{"name": "s", "argv": ["true"], "cwd": "{where}"}],
        items=[{"key": "x", "lane": "a", "where": "no\nsuch"}],
        base_dir=tmp_path,
    )
    reasons, _ = pipeline.preflight(config, environ={})
    [cwd] = [r for r in reasons if r.startswith("stages.s.cwd:")]
    assert "\n" not in cwd and "no\\nsuch" in cwd, cwd


PRIORITIES = [
    {"key": "low-a", "lane": "a"},
    {"key": "high-a", "lane": "a", "prio": 5},
    {"key": "low-b", "lane": "a"},
    {"key": "mid", "lane": "a", "prio": 2},
    {"key": "high-b", "lane": "a", "prio": 5},
]


def test_the_plans_first_decisions_take_items_in_the_claims_order(
    factory, make_run, clock, register_worker
):
    """dry-run listed the first items of the config; a run admits the highest first."""
    stages = [py_stage("left", "pass"), py_stage("right", "pass")]
    config = make_config(stages, items=PRIORITIES, max_jobs=3, priority_field="prio")
    planned = [
        (d["item"], d["stage"])
        for d in pipeline.plan(config, mem_available_mib=64_000)["first_decisions"]
        if d["verdict"] == "dispatch"
    ]
    assert planned == [("high-a", "right"), ("high-b", "right"), ("high-a", "left")]
    make_run(config)
    claimed = claim_on_n1(factory, register_worker(), clock, slots=3)
    assert [(c.item, c.stage) for c in claimed] == planned


def test_a_retried_jobs_first_attempt_has_no_negative_queue_wait(
    factory, make_run, clock, register_worker
):
    """The report took a job's latest ready (after its retry) for every attempt."""
    retry = {"max_attempts": 2, "on": ["failed"]}
    run_id = make_run(make_config([py_stage("s", "pass", retry=retry)]))
    worker = register_worker()
    clock.advance(5)
    [first] = claim_on_n1(factory, worker, clock)
    clock.advance(30)
    settle_one(factory, first, worker, clock, Outcome.FAILED)
    clock.advance(7)
    [second] = claim_on_n1(factory, worker, clock)
    clock.advance(1)
    settle_one(factory, second, worker, clock, Outcome.SUCCEEDED)
    with factory() as session:
        found = build_report(session, ledger.get_run(session, run_id), now=clock.now())
    bars = found["lanes"]["a"]["bars"]
    assert [round(b["wait"], 3) for b in bars] == [5.0, 7.0]
    assert found["lanes"]["a"]["queue_wait_clamped"] == 0


@pytest.mark.no_ledger
def test_a_ready_stamped_after_the_intent_counts_as_no_wait_and_is_flagged():
    assert queue_wait([ledger_moment(0)], ledger_moment(4)) == {"wait": 4.0}
    readies = [ledger_moment(0), ledger_moment(2), ledger_moment(9)]
    assert queue_wait(readies, ledger_moment(5)) == {"wait": 3.0}
    # Another machine's clock stamped the ready 2 s after the worker's intent.
    assert queue_wait([ledger_moment(7)], ledger_moment(5)) == {
        "wait": 0.0,
        "wait_clamped": True,
    }


def ledger_moment(seconds: float) -> Any:
    from datetime import datetime

    return datetime(2026, 1, 1, 12) + timedelta(seconds=seconds)


def test_the_live_views_rate_windows_come_from_the_runs_frozen_config(factory, make_run):
    stage = py_stage("ask", "pass", limits=["api"], expected_usage={"tokens": 40})
    limits = {"api": {"calls": 2, "per_seconds": 30, "tokens": 100}}
    run_id = make_run(make_config([stage], limits=limits))
    with factory() as session:
        windows = progress.run_rate_windows(SessionRows(session), run_id)
    assert windows == [
        progress.RateWindow("api", "calls", 2.0, 30.0, {"ask": 1.0}),
        progress.RateWindow("api", "tokens", 100.0, 30.0, {"ask": 40.0}),
    ]
