"""Hand-written status bodies for render and live-view tests, made whole and typed.

A test writes only the parts of ``laneway status --json`` it is about; ``typed`` fills
every other key with an empty or None value and returns the ``StatusReport`` the views
take (``StatusReport.from_dict``)."""

from __future__ import annotations

import copy
from typing import Any

from laneway.controller.status_model import StatusReport

TOP = {
    "generated_at": None,
    "controls": [],
    "unknown": [],
    "jobs": {},
    "totals": {},
    "reused": {},
    "retry_backoff": [],
    "outcomes": {},
    "running": [],
    "workers": [],
    "nodes": [],
    "no_worker": [],
    "lanes": [],
    "placement": [],
    "throughput": {"settled_attempts": 0, "per_hour": 0.0},
    "closeout": {
        "state": "none",
        "step": None,
        "step_count": 0,
        "current": None,
        "failed_steps": [],
        "steps": [],
    },
    "recent_events": [],
}
ENTRY: dict[str, dict[str, Any]] = {
    "run": dict.fromkeys(
        ("id", "name", "state", "created_at", "finished_at", "config_sha256", "runtime_dir")
    ),
    "controls": {
        "id": 1,
        "kind": "pause",
        "scope": "run",
        "lane": None,
        "reason": "",
        "set_by": "",
        "set_at": None,
    },
    "unknown": {
        "attempt_id": 1,
        "job_id": 1,
        "item": "",
        "stage": "",
        "reason": None,
        "evidence": None,
        "reconcile": "",
    },
    "running": dict.fromkeys(("job_id", "pid", "timeout_seconds", "peak_rss_mib")),
    "workers": dict.fromkeys(
        (
            "worker_id",
            "host",
            "pid",
            "state",
            "started_at",
            "heartbeat_at",
            "heartbeat_age_seconds",
            "stopped_at",
        )
    ),
    "lanes": {
        "lane": "a",
        "node": "n1",
        "running": 0,
        "ready": 0,
        "waiting": 0,
        "done": 0,
        "last_start": None,
        "idle_since": None,
        "idle_seconds": None,
        "reason": None,
    },
}
REASON = {"stage": None, "since": None, "detail": {}, "words": ""}


def typed(body: dict[str, Any]) -> StatusReport:
    whole = {**copy.deepcopy(TOP), **copy.deepcopy(body)}
    whole["run"] = ENTRY["run"] | whole["run"]
    whole["closeout"] = TOP["closeout"] | whole["closeout"]
    for part, defaults in ENTRY.items():
        if part != "run":
            whole[part] = [defaults | entry for entry in whole[part]]
    for lane in whole["lanes"]:
        if lane["reason"] is not None:
            lane["reason"] = REASON | lane["reason"]
    return StatusReport.from_dict(whole)
