"""The run report: durations are the commands' own (from exit.json), not settle times;
the window ends where the run did (``report_window``); the HTML timeline labels only
what fits, never two labels on top of each other, and has a time axis."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from laneway.controller import db, ledger
from laneway.controller.clock import iso
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html, text_width
from laneway.controller.report_window import WindowFacts, report_window, window_text
from laneway.controller.states import Outcome
from tests.support import claim_on_n1, make_config

SVG = "{http://www.w3.org/2000/svg}"


def write_exit_record(attempt_dir: str, started: Any, seconds: float) -> None:
    from datetime import timedelta

    directory = Path(attempt_dir)
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "started_at": iso(started),
        "ended_at": iso(started + timedelta(seconds=seconds)),
        "exit_code": 0,
    }
    (directory / "exit.json").write_text(json.dumps(record))


CREATED = datetime(2026, 1, 1, 12, 0, 0)
LATER = CREATED + timedelta(minutes=30)


def at(seconds: float) -> datetime:
    return CREATED + timedelta(seconds=seconds)


def facts(**given: object) -> WindowFacts:
    values: dict[str, object] = {
        "created_at": CREATED,
        "finished_at": None,
        "in_flight": False,
        "unknown": False,
        "runnable": False,
        "last_settle": None,
        "last_control": None,
    }
    values.update(given)
    return WindowFacts(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "end", "why"),
    [
        # A finished run ends where it finished, whatever else was recorded after.
        (
            {"finished_at": at(90), "last_settle": at(90), "last_control": at(120)},
            at(90),
            "finished",
        ),
        # Still under way: an attempt in flight, one of unknown outcome (it may still
        # run), or work it could run (no control holds it).
        ({"in_flight": True, "last_settle": at(10)}, LATER, "now"),
        ({"unknown": True, "last_control": at(10)}, LATER, "now"),
        ({"runnable": True, "last_control": at(10)}, LATER, "now"),
        # Standing (stopped, paused, halted; nothing in flight, nothing it could run):
        # its last settle or control, whichever is later, not now.
        ({"last_settle": at(200), "last_control": at(50)}, at(200), "last_settle"),
        ({"last_settle": at(200), "last_control": at(260)}, at(260), "last_control"),
        ({"last_settle": at(200), "last_control": at(200)}, at(200), "last_settle"),
        ({"last_control": at(5)}, at(5), "last_control"),
        # Nothing settled and no control of its own: where it was created.
        ({}, CREATED, "created"),
        ({"last_control": CREATED - timedelta(hours=1)}, CREATED, "created"),
    ],
)
def test_report_window_ends_where_the_run_did(given, end, why):
    assert report_window(facts(**given), LATER) == (end, why)


def test_report_window_never_ends_after_now_nor_before_the_run():
    # A settle stamped by a clock ahead of this one's: the window stops at now.
    assert report_window(facts(last_settle=LATER + timedelta(seconds=5)), LATER) == (
        LATER,
        "last_settle",
    )
    # A now behind the run's creation (another host's clock): an empty window, not a
    # negative one.
    assert report_window(facts(in_flight=True), CREATED - timedelta(seconds=5)) == (
        CREATED,
        "now",
    )


def test_window_text_says_where_and_why_it_ends():
    def text(ends_at: str, held: str | None = None) -> str:
        window = {"start": "S", "end": "E", "ends_at": ends_at, "held": held}
        return window_text({"window": window})

    assert text("finished") == "S → E"
    assert text("now") == "S → now (active)"
    assert text("last_settle", "paused") == "S → E (paused)"
    assert text("last_control", "stopped") == "S → E (stopped)"
    assert text("last_control", "halted") == "S → E (halted)"


def test_durations_come_from_exit_records_and_skip_unknown_and_not_run(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=4))
    worker = register_worker()
    claims = claim_on_n1(factory, worker, clock, slots=4)
    assert len(claims) == 4
    with db.transaction(factory) as session:
        for claim in claims:
            ledger.record_spawn(
                session,
                claim.attempt_id,
                fence=claim.fence,
                actor=worker,
                now=clock.now(),
                boot_id="boot",
                supervisor_pid=1,
                supervisor_start_time=1,
                child_pid=2,
                child_start_time=2,
            )
    fast, slow, not_run, unknown = claims
    for claim, seconds in ((fast, 0.9), (slow, 2.0), (not_run, 5.0)):
        write_exit_record(claim.attempt_dir, clock.now(), seconds)
    clock.advance(59)  # settled a minute later (say, by a restarted worker)
    with db.transaction(factory) as session:
        for claim in (fast, slow):
            ledger.settle_attempt(
                session,
                claim.attempt_id,
                fence=claim.fence,
                outcome=Outcome.SUCCEEDED,
                actor=worker,
                now=clock.now(),
            )
        for claim in (not_run, unknown):
            ledger.mark_unknown(
                session, claim.attempt_id, reason="test", actor=worker, now=clock.now()
            )
        ledger.reconcile_attempt(
            session,
            not_run.attempt_id,
            verdict="not-run",
            reason="it never ran",
            actor="op",
            now=clock.now(),
        )
    clock.advance(1)
    with db.session_factory(factory.kw["bind"])() as session:
        report = build_report(session, ledger.get_run(session, run_id), now=clock.now())
    lane = report["lanes"]["a"]
    assert lane["stage_duration_seconds"]["only"] == {"p50": 2.0, "p90": 2.0, "max": 2.0}
    took = {bar["attempt_id"]: bar["duration"] for bar in lane["bars"]}
    assert took == {
        fast.attempt_id: 0.9,
        slow.attempt_id: 2.0,
        not_run.attempt_id: None,
        unknown.attempt_id: None,
    }
    bar = next(b for b in lane["bars"] if b["attempt_id"] == fast.attempt_id)
    assert round(bar["end"] - bar["start"], 3) == 0.9  # the timeline draws the command too
    assert "0.9 s" in render_html(report)


def busy_report(gaps: int, *, long_every: int = 30) -> dict[str, Any]:
    """A run's report with many short idle gaps (and a few wide ones) in two lanes."""
    lanes = {}
    for lane in ("a", "b"):
        bars, idle, t = [], [], 0.0
        for i in range(gaps):
            wide = i % long_every == 0
            bars.append(
                {
                    "attempt_id": i,
                    "item": f"i{i}",
                    "stage": "solve",
                    "start": t,
                    "end": t + 2.0,
                    "duration": 2.0,
                    "outcome": "succeeded",
                    "wait": 0.0,
                }
            )
            t += 2.0
            gap = 200.0 if wide else 0.6
            idle.append(
                {
                    "start": t,
                    "end": t + gap,
                    "seconds": gap,
                    "reasons": [
                        "memory_floor — free 900 MiB - unreleased 0 - stage 2048 < floor 1024"
                    ],
                }
            )
            t += gap
        lanes[lane] = {
            "node": "n1",
            "attempts": len(bars),
            "throughput_per_hour": 1.0,
            "all_idle_share": 0.5,
            "failures_by_class": {},
            "idle_periods": idle,
            "bars": bars,
        }
    return {
        "run": {
            "id": 1,
            "name": "busy",
            "state": "finished",
            "created_at": "2026-01-01T00:00:00.000Z",
            "finished_at": "2026-01-01T01:00:00.000Z",
        },
        "window": {
            "start": "2026-01-01T00:00:00.000Z",
            "end": "2026-01-01T01:00:00.000Z",
            "ends_at": "finished",
            "held": None,
        },
        "window_seconds": t,
        "generated_at": "2026-01-01T01:00:00.000Z",
        "lanes": lanes,
    }


def text_boxes(page: str) -> list[tuple[str, float, float, float, float]]:
    """(text, x0, y0, x1, y1) of every <text> in the timeline, from its x, y, font-size
    and text-anchor, with the renderer's monospace width."""
    match = re.search(r"<svg .*?</svg>", page, re.S)
    assert match is not None
    svg = ET.fromstring(match.group(0))
    boxes = []
    for element in svg.iter(f"{SVG}text"):
        text = element.text or ""
        size = float(element.attrib["font-size"])
        width = text_width(text, size)
        x, y = float(element.attrib["x"]), float(element.attrib["y"])
        anchor = element.attrib.get("text-anchor", "start")
        x0 = x - width / 2 if anchor == "middle" else x - width if anchor == "end" else x
        boxes.append((text, x0, y - 0.8 * size, x0 + width, y + 0.2 * size))
    return boxes


def overlaps(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]


def test_timeline_labels_never_overlap_and_short_gaps_get_tooltips():
    report = busy_report(90)
    page = render_html(report)
    boxes = text_boxes(page)
    clashes = [(a[0], b[0]) for a, b in combinations(boxes, 2) if overlaps(a, b)]
    assert clashes == []
    labels = [b for b in boxes if b[0].startswith("idle ")]
    wide = sum(1 for gap in report["lanes"]["a"]["idle_periods"] if gap["seconds"] > 10)
    assert 0 < len(labels) <= 2 * wide  # only the wide gaps are labelled
    # Every gap, labelled or not, carries its reason as a tooltip.
    assert page.count('<rect class="idle"') == 2 * 90
    assert page.count("<title>idle 0.6 s: memory_floor") == 2 * (90 - wide)
    # Every label lies inside the SVG.
    svg_width = float(re.search(r'<svg [^>]*width="(\d+)"', page).group(1))  # type: ignore[union-attr]
    assert all(0 <= b[1] and b[3] <= svg_width for b in boxes)


def test_timeline_has_a_readable_time_axis():
    page = render_html(busy_report(90))
    ticks = [b for b in text_boxes(page) if 'class="tick-label"' in page and b[0][0].isdigit()]
    labels = [t[0] for t in ticks]
    assert len(labels) >= 4
    assert labels[0] == "0 s"
    assert all(re.fullmatch(r"\d+( h| m| s)( \d\d [ms])?", label) for label in labels)
    assert page.count('<line class="tick"') == len(labels)
    positions = [t[1] for t in ticks]
    assert positions == sorted(positions)
    short = render_html(busy_report(3, long_every=100))
    assert "0.5 s" in short or "1 s" in short or "2 s" in short
