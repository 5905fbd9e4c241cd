"""The live display (cli/live.py): on a terminal, unknown attempts first and in red with
the reconcile command, a bar per stage, each lane's work or idle reason and next step;
elsewhere, one plain line per change (or one JSON line per change with --json)."""

from __future__ import annotations

import copy
import io
import json
from typing import Any

from rich.console import Console

from laneway.cli import live
from laneway.controller import progress
from tests.status_bodies import typed

RECONCILE = "laneway reconcile 7 --as succeeded|failed|not-run --reason '...' --runtime-dir /rt"


def status(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "run": {"id": 1, "name": "demo", "state": "active", "runtime_dir": "/rt"},
        "generated_at": "2026-01-01T00:00:00Z",
        "controls": [],
        "unknown": [],
        "jobs": {"prep": {"succeeded": 3, "running": 1}, "solve": {"waiting": 3, "failed": 1}},
        "totals": {"succeeded": 3, "running": 1, "waiting": 3, "failed": 1},
        "outcomes": {},
        "running": [
            {
                "attempt_id": 4,
                "item": "i3",
                "stage": "prep",
                "lane": "a",
                "node": "n1",
                "state": "running",
                "elapsed_seconds": 5.0,
            }
        ],
        "workers": [{"node": "n1", "live": True, "slots": 2}],
        "lanes": [
            {
                "lane": "a",
                "node": "n1",
                "running": 1,
                "ready": 0,
                "waiting": 2,
                "done": 2,
                "idle_seconds": None,
                "reason": None,
            },
            {
                "lane": "b",
                "node": "n1",
                "running": 0,
                "ready": 0,
                "waiting": 1,
                "done": 2,
                "idle_seconds": 700.0,
                "reason": {
                    "code": "no_worker",
                    "words": "no live worker on node n1",
                    "detail": {"start": "laneway worker --node n1 --runtime-dir /rt"},
                },
            },
        ],
    }
    body.update(changes)
    return body


def test_eta_from_measured_durations_on_live_slots():
    # prep: 1 running at 2 s; solve: 3 waiting at 10 s (the failed one is done); 2 slots.
    assert progress.eta_seconds(typed(status()), {"prep": 2.0, "solve": 10.0}) == 16.0
    assert progress.eta_seconds(typed(status()), {"prep": 2.0}) is None  # solve not measured yet


def draw(body: dict[str, Any], width: int = 160) -> tuple[str, str]:
    """(plain text, text with ANSI styles) of one refresh."""
    console = Console(
        record=True, width=width, force_terminal=True, color_system="truecolor", file=io.StringIO()
    )
    console.print(live.renderable(typed(body), 15.0, {"prep": 12.0, "solve": None}))
    return console.export_text(clear=False), console.export_text(styles=True)


def test_terminal_display_puts_unknown_attempts_first_in_red_with_the_command():
    unknown = {
        "attempt_id": 7,
        "job_id": 3,
        "item": "i9",
        "stage": "solve",
        "reason": "lease expired",
        "evidence": "/rt/runs/1/jobs/i9.solve/attempt-1",
        "reconcile": RECONCILE,
    }
    body = status(unknown=[unknown])
    body["lanes"][1]["reason"] = {"code": "max_jobs", "words": "max_jobs — 2 running", "detail": {}}
    text, styled = draw(body, width=260)
    lines = text.splitlines()
    assert lines[0].startswith("run 1 (demo) — active · ETA 15 s")
    assert lines[1].startswith("UNKNOWN OUTCOMES")
    assert any(RECONCILE in line for line in lines[2:5])
    assert "\x1b[1;31mUNKNOWN" in styled
    # The idle lane's next step: the unknown attempt halts the run, whatever was recorded.
    assert f"reconcile the unknown attempt: {RECONCILE}" in text


def test_terminal_display_shows_stages_rates_and_why_a_lane_is_idle():
    text, _ = draw(status())
    assert "prep" in text and "3/4" in text and "12.0/min" in text
    solve = next(line for line in text.splitlines() if line.startswith("solve"))
    assert solve.split()[-2:] == ["1", "-"]  # failed, rate
    assert "i3.prep (5 s)" in text
    lane_b = next(line for line in text.splitlines() if line.startswith("b "))
    assert "idle 11 m 40 s: no live worker on node n1" in lane_b
    assert "start a worker: laneway worker --node n1" in text


def test_a_finished_run_has_no_eta():
    body = status()
    body["run"]["state"] = "finished"
    text, _ = draw(body)
    assert text.splitlines()[0] == "run 1 (demo) — finished"


def test_plain_lines_one_per_change():
    out = io.StringIO()
    shown = live.Progress(1, stream=out, live=False)
    shown.show(typed(status()))
    first = out.getvalue().splitlines()
    assert first == [
        "run 1: 4/8 jobs terminal · failed 1 · running 1 · succeeded 3 · waiting 3",
        "run 1: lane a: 1 running",
        "run 1: lane b: idle: no live worker on node n1; "
        "next: start a worker: laneway worker --node n1 --runtime-dir /rt",
    ]
    # A reason whose words name the command already is not followed by it again.
    named = status()
    named["lanes"][1]["reason"]["words"] = "no live worker; start one: laneway worker --node n1"
    named["lanes"][1]["reason"]["detail"]["start"] = "laneway worker --node n1"
    again = io.StringIO()
    live.Progress(1, stream=again, live=False).show(typed(named))
    assert again.getvalue().splitlines()[-1] == (
        "run 1: lane b: idle: no live worker; start one: laneway worker --node n1"
    )
    later = status()
    later["lanes"][1]["idle_seconds"] = 900.0  # the clock alone: nothing new to say
    shown.show(typed(later))
    assert out.getvalue().splitlines() == first
    unknown = {
        "attempt_id": 7,
        "item": "i9",
        "stage": "solve",
        "reason": "lease expired",
        "evidence": None,
        "reconcile": RECONCILE,
    }
    shown.show(typed(status(unknown=[unknown])))
    assert out.getvalue().splitlines()[len(first) :] == [
        f"run 1: UNKNOWN attempt 7 i9.solve: lease expired; resolve: {RECONCILE}",
        # The lane's next step changes with it: the unknown attempt comes first.
        "run 1: lane b: idle: no live worker on node n1; "
        f"next: reconcile the unknown attempt: {RECONCILE}",
    ]


def test_json_lines_one_per_change():
    out = io.StringIO()
    shown = live.Progress(1, stream=out, as_json=True)
    body = status()
    shown.show(typed(body))
    clock_only = copy.deepcopy(body)
    clock_only["generated_at"] = "2026-01-01T00:00:09Z"
    clock_only["running"][0]["elapsed_seconds"] = 14.0
    shown.show(typed(clock_only))
    moved = copy.deepcopy(body)
    moved["totals"] = {"succeeded": 4, "waiting": 3, "failed": 1}
    shown.show(typed(moved))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["totals"] for line in lines] == [body["totals"], moved["totals"]]
    assert all("eta_seconds" in line for line in lines)
