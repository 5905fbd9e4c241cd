"""A report's window ends where the run did: a finished run at its end, a stopped,
paused or halted one at its last settle or control (not when the report is read), an
active one with work in flight or work it could run at now; a lane with no job left to
end is not idle after its last one ended; the text and the HTML never print None; the
dashboard's timeline ends at the same place."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from laneway.cli import render
from laneway.controller import db, ledger, report_html
from laneway.controller.clock import iso
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html
from laneway.controller.states import ControlKind, ControlScope, Outcome
from tests.support import claim_on_n1, make_config, settle_one

LATER = 600
"""How long after the run stood the report is read: ten minutes."""


def report_of(factory: Any, run_id: int, clock: Any) -> dict[str, Any]:
    with db.session_factory(factory.kw["bind"])() as session:
        return build_report(session, ledger.get_run(session, run_id), now=clock.now())


def control(factory: Any, kind: ControlKind, run_id: int, clock: Any) -> None:
    with db.transaction(factory) as session:
        ledger.set_control(
            session,
            kind,
            scope=ControlScope.RUN,
            run_id=run_id,
            reason=f"test {kind}",
            actor="op",
            now=clock.now(),
        )


def stop_worker(factory: Any, worker: str, clock: Any) -> None:
    with db.transaction(factory) as session:
        ledger.stop_worker(session, worker, now=clock.now())


def texts(report: dict[str, Any]) -> tuple[str, str]:
    """The report's text and its HTML page."""
    return render.report_text({**report, "html": "report.html"}), render_html(report)


def assert_no_none(*outputs: str) -> None:
    for output in outputs:
        for word in ("None", "null", "nan"):
            assert word not in output, f"{word!r} in:\n{output}"


def test_a_paused_run_read_ten_minutes_later_ends_at_its_pause(
    factory, make_run, register_worker, clock
):
    """The budget's pause (here set by hand) after two settles, the worker gone, the
    report read ten minutes on: the window ends at the pause, no idle period after it
    and no no_worker for the ten minutes."""
    run_id = make_run(make_config(items=3))
    created = clock.now()
    worker = register_worker()
    first, second = claim_on_n1(factory, worker, clock, slots=2)  # the third: ready
    clock.advance(10)
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    clock.advance(10)
    settle_one(factory, second, worker, clock, Outcome.SUCCEEDED)
    clock.advance(5)
    control(factory, ControlKind.PAUSE, run_id, clock)  # +25
    clock.advance(5)
    stop_worker(factory, worker, clock)
    clock.advance(LATER)

    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 25.0
    lane = report["lanes"]["a"]
    # The lane's five seconds between its last settle and the pause: idle, and nothing
    # after the pause.
    assert [(gap["start"], gap["end"]) for gap in lane["idle_periods"]] == [(20.0, 25.0)]
    assert lane["all_idle_share"] == 0.2
    assert not any("no_worker" in r for gap in lane["idle_periods"] for r in gap["reasons"])
    end = created + timedelta(seconds=25)
    assert report["window"] == {
        "start": iso(created),
        "end": iso(end),
        "ends_at": "last_control",
        "held": "paused",
    }
    assert lane["done_at_seconds"] is None  # a job is left (ready, held by the pause)
    text, page = texts(report)
    assert f"{iso(created)} → {iso(end)} (paused), window 25 s" in text
    assert f"{iso(created)} → {iso(end)} (paused), window 25.0 s" in page
    assert_no_none(text, page)
    # Read another ten minutes on: the same report.
    clock.advance(LATER)
    again = report_of(factory, run_id, clock)
    assert {k: v for k, v in again.items() if k != "generated_at"} == {
        k: v for k, v in report.items() if k != "generated_at"
    }


def test_a_stopped_run_drained_after_the_stop_ends_at_its_last_settle(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=3))
    created = clock.now()
    worker = register_worker()
    first, second = claim_on_n1(factory, worker, clock, slots=2)
    clock.advance(5)
    control(factory, ControlKind.STOP, run_id, clock)  # drain: the two running finish
    clock.advance(5)
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    clock.advance(10)
    settle_one(factory, second, worker, clock, Outcome.FAILED)  # +20
    clock.advance(5)
    stop_worker(factory, worker, clock)
    clock.advance(LATER)

    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 20.0
    lane = report["lanes"]["a"]
    assert lane["idle_periods"] == [] and lane["all_idle_share"] == 0.0
    assert report["window"]["ends_at"] == "last_settle"
    assert report["window"]["end"] == iso(created + timedelta(seconds=20))
    assert report["window"]["held"] == "stopped"
    text, page = texts(report)
    assert "(stopped), window 20 s" in text and "(stopped), window 20.0 s" in page
    assert_no_none(text, page)


def test_a_halted_run_ends_at_the_halt_and_says_so(factory, make_run, register_worker, clock):
    run_id = make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)
    clock.advance(10)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    clock.advance(30)
    control(factory, ControlKind.HALT, run_id, clock)  # +40
    clock.advance(LATER)
    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 40.0
    (gap,) = report["lanes"]["a"]["idle_periods"]
    assert (gap["start"], gap["end"]) == (10.0, 40.0)
    assert (report["window"]["ends_at"], report["window"]["held"]) == ("last_control", "halted")
    text, page = texts(report)
    assert "(halted)" in text and "(halted)" in page
    assert_no_none(text, page)


def test_a_lane_done_early_is_not_idle_after_its_last_job(
    factory, make_run, register_worker, clock
):
    """Lane a's one job settles at +10, lane b's last at +100: lane a is not idle after
    +10, while the run is under way nor once it has finished; the finished run's window
    ends where it finished, however late the report is read."""
    lanes = [{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}]
    items = [{"key": "a0", "lane": "a"}, {"key": "b0", "lane": "b"}, {"key": "b1", "lane": "b"}]
    run_id = make_run(make_config(items=items, lanes=lanes))
    created = clock.now()
    worker = register_worker()
    claims = {c.item: c for c in claim_on_n1(factory, worker, clock, slots=3)}
    assert set(claims) == {"a0", "b0", "b1"}
    clock.advance(10)
    settle_one(factory, claims["a0"], worker, clock, Outcome.SUCCEEDED)
    settle_one(factory, claims["b0"], worker, clock, Outcome.SUCCEEDED)
    clock.advance(90)  # b1 still runs: the window runs to now

    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 100.0
    lane_a, lane_b = report["lanes"]["a"], report["lanes"]["b"]
    assert lane_a["idle_periods"] == [] and lane_a["all_idle_share"] == 0.0
    assert report["window"]["ends_at"] == "now"
    assert lane_a["done_at_seconds"] == 10.0
    assert lane_b["idle_periods"] == [] and lane_b["done_at_seconds"] is None
    text, page = texts(report)
    assert f"{iso(created)} → now (active)" in text and f"{iso(created)} → now (active)" in page
    assert_no_none(text, page)

    settle_one(factory, claims["b1"], worker, clock, Outcome.SUCCEEDED)  # +100
    with db.transaction(factory) as session:
        assert ledger.close_run_if_done(session, run_id, now=clock.now(), actor="controller")
    finished = clock.now()
    clock.advance(LATER)
    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 100.0
    assert report["lanes"]["a"]["idle_periods"] == []
    assert report["lanes"]["a"]["all_idle_share"] == 0.0
    assert report["lanes"]["a"]["done_at_seconds"] == 10.0
    assert report["lanes"]["b"]["done_at_seconds"] == 100.0
    assert report["window"] == {
        "start": iso(created),
        "end": iso(finished),
        "ends_at": "finished",
        "held": None,
    }
    text, page = texts(report)
    assert f"{iso(created)} → {iso(finished)}, window 1 m 40 s" in text
    assert f"{iso(created)} → {iso(finished)}, window 100.0 s" in page
    assert_no_none(text, page)


def test_an_active_run_with_ready_work_and_no_worker_is_idle_to_now(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)  # the other: ready
    clock.advance(10)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    clock.advance(5)
    stop_worker(factory, worker, clock)
    clock.advance(LATER)
    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 615.0
    (gap,) = report["lanes"]["a"]["idle_periods"]
    assert (gap["start"], gap["end"]) == (10.0, 615.0)
    assert gap["reasons"][0] == "no_worker — no live worker on node n1 (+15 s to +615 s)"
    assert gap["no_worker_seconds"] == 600.0
    text, page = texts(report)
    assert_no_none(page)
    assert report["window"]["ends_at"] == "now"
    assert "→ now (active)" in text and "→ now (active)" in page
    assert_no_none(text, page)


def test_an_unknown_attempt_keeps_the_window_open(factory, make_run, register_worker, clock):
    """Its process may still run and only a reconcile ends it: the run is not standing."""
    run_id = make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)
    clock.advance(10)
    with db.transaction(factory) as session:
        ledger.mark_unknown(session, claim.attempt_id, reason="test", actor="op", now=clock.now())
    control(factory, ControlKind.PAUSE, run_id, clock)
    clock.advance(LATER)
    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 610.0
    (bar,) = report["lanes"]["a"]["bars"]
    assert bar["outcome"] == "unknown" and bar["end"] == 610.0
    assert report["window"]["ends_at"] == "now"


def test_the_dashboard_timeline_ends_where_the_report_does(
    factory, make_run, register_worker, clock, runtime: Path
):
    from laneway.controller.web import Dashboard

    run_id = make_run(make_config(items=3))
    worker = register_worker()
    first, second = claim_on_n1(factory, worker, clock, slots=2)
    clock.advance(10)
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    settle_one(factory, second, worker, clock, Outcome.SUCCEEDED)
    clock.advance(5)
    control(factory, ControlKind.STOP, run_id, clock)  # +15
    stop_worker(factory, worker, clock)
    clock.advance(LATER)

    dashboard = Dashboard(runtime, now=clock.now)
    try:
        svg = dashboard.timeline(run_id)
    finally:
        dashboard.close()
    report = report_of(factory, run_id, clock)
    assert report["window_seconds"] == 15.0
    assert svg == report_html.timeline_svg(report)
    # One idle gap, the five seconds before the stop, and it reaches the axis' end.
    assert svg.count('<rect class="idle"') == 1
    assert "<title>idle 5.0 s: " in svg
