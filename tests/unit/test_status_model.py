"""The typed status (controller/status_model.py) has one JSON form: ``as_dict`` gives
back, key for key and in the same order, what the untyped builder printed before the
status was typed (``status_golden.json``: ``laneway status --json`` of a 1,000-job
ledger from bench/bench_scale.py with a run paused, recorded from that builder), and
``from_dict`` is its inverse. The parts only some readers add (a conclusive unknown,
the dashboard's files, pids and next step, a refusal's node) appear only when set."""

from __future__ import annotations

import json
from pathlib import Path

from laneway.controller.status_model import Advice, OnDisk, Reason, StatusReport
from tests.status_bodies import typed

GOLDEN = Path(__file__).with_name("status_golden.json")


def test_as_dict_is_the_untyped_builders_json_byte_for_byte():
    text = GOLDEN.read_text()
    body = json.loads(text)
    again = StatusReport.from_dict(body).as_dict()
    assert again == body
    assert json.dumps(again, indent=2) == text.rstrip("\n")


def test_summary_keeps_the_snapshot_keys():
    report = StatusReport.from_dict(json.loads(GOLDEN.read_text()))
    summary = report.summary()
    assert list(summary) == [
        "run",
        "totals",
        "jobs",
        "outcomes",
        "throughput",
        "unknown",
        "controls",
    ]
    assert summary["totals"] == report.totals


def test_parts_some_readers_add_appear_only_when_set():
    report = typed(
        {
            "run": {"id": 1, "state": "active", "runtime_dir": "/rt"},
            "unknown": [{"attempt_id": 7}],
            "lanes": [{"lane": "a", "ready": 1, "reason": {"code": "max_jobs", "words": "w"}}],
        }
    )
    [unknown], [lane] = report.unknown, report.lanes
    plain = report.as_dict()
    assert "conclusive" not in plain["unknown"][0] and "files" not in plain["unknown"][0]
    assert "action" not in plain["lanes"][0] and "node" not in plain["lanes"][0]["reason"]
    unknown.conclusive = {"outcome": "succeeded", "settle": "cmd"}
    unknown.on_disk = OnDisk(["exit.json"], 11, None)
    lane.action = Advice(None)
    assert lane.reason is not None
    lane.reason = Reason("max_jobs", "s", "t", {}, "w", node="n1", recorded=True)
    marked = report.as_dict()
    assert list(marked["unknown"][0])[-4:] == ["conclusive", "files", "supervisor_pid", "child_pid"]
    assert marked["lanes"][0]["action"] is None
    assert list(marked["lanes"][0]["reason"]) == [
        "code",
        "stage",
        "node",
        "since",
        "detail",
        "words",
    ]
    assert StatusReport.from_dict(marked).as_dict() == marked
