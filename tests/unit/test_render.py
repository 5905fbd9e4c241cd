"""Terminal escape sequences and carriage-return tricks from job output are neutralised
in what `status` prints."""

from __future__ import annotations

from laneway.cli import render
from tests.status_bodies import typed


def test_escapes_and_carriage_returns_are_neutralised():
    nasty = "ok\x1b[2J\x1b[31mred\rOVERWRITE\x07\x1b]0;title\x07"
    cleaned = render.clean(nasty)
    assert "\x1b" not in cleaned and "\r" not in cleaned and "\x07" not in cleaned
    assert cleaned.startswith("ok?") and "red?OVERWRITE" in cleaned


def test_status_text_cleans_reasons_from_the_ledger():
    status = {
        "run": {"id": 1, "name": "r", "state": "active", "created_at": "t", "finished_at": None},
        "unknown": [
            {
                "attempt_id": 3,
                "item": "i",
                "stage": "s",
                "reason": "exit\x1b[2K\rfaked",
                "evidence": "/x",
                "reconcile": "cmd",
            }
        ],
        "controls": [],
        "jobs": {},
        "totals": {},
        "outcomes": {},
        "running": [],
        "lanes": [],
        "throughput": {"settled_attempts": 0, "per_hour": 0},
        "recent_events": [],
    }
    text = render.status_text(typed(status))
    assert "\x1b" not in text and "\r" not in text and "exit??faked" in text
