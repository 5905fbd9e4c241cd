"""Capacity end to end: a lane held by its node's memory floor says so in `status --json`
and `explain`, while the other lane keeps running; learned reservations."""

from __future__ import annotations

import json
import math

from sqlalchemy import select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Job, Reservation
from laneway.workers.gpu import FakeGpu
from laneway.workers.service import WorkerService
from tests.support import make_config, py_stage, wait_until

runner = CliRunner()


def two_node_config():
    return make_config(
        [py_stage("work", "pass", memory_mib=2048)],
        items=[{"key": f"i{n}", "lane": "ab"[n % 2]} for n in range(6)],
        lanes=[{"name": "a", "node": "n1"}, {"name": "b", "node": "n2"}],
        nodes=[
            {"name": "n1", "memory_floor_mib": 1024, "max_jobs": 2},
            {"name": "n2", "memory_floor_mib": 1024, "max_jobs": 2},
        ],
    )


def run_until_lane_b_is_done(engine):
    """Run ``two_node_config``'s run with n1 below its memory floor (900 MiB free) and n2
    roomy, until every job of lane b (on n2) has succeeded."""
    tight = WorkerService(
        engine, node="n1", slots=2, memory_probe=lambda: (900.0, 16_000.0), gpu=FakeGpu()
    )
    roomy = WorkerService(
        engine, node="n2", slots=2, memory_probe=lambda: (64e3, 128e3), gpu=FakeGpu()
    )
    tight.start()
    roomy.start()
    controller = Controller(engine)

    def lane_b_done():
        controller.tick()
        tight.tick()
        roomy.tick()
        with db.session_factory(engine)() as session:
            states = session.scalars(select(Job.state).where(Job.lane == "b")).all()
        return all(state == "succeeded" for state in states)

    wait_until(lane_b_done)


def test_lane_held_by_memory_floor_is_named_while_the_other_runs(engine, runtime, make_run):
    run_id = make_run(two_node_config())
    run_until_lane_b_is_done(engine)
    result = runner.invoke(app, ["status", str(run_id), "--runtime-dir", str(runtime), "--json"])
    assert result.exit_code == 0, result.output
    lanes = {lane["lane"]: lane for lane in json.loads(result.stdout)["lanes"]}
    assert lanes["b"]["done"] == 3 and lanes["b"]["reason"] is None
    reason = lanes["a"]["reason"]
    assert reason["code"] == "memory_floor"
    assert reason["words"] == (
        "memory_floor — free 900 MiB - unreleased 0 - stage 2048 < floor 1024"
    )
    assert lanes["a"]["running"] == 0 and lanes["a"]["ready"] == 3
    with db.session_factory(engine)() as session:
        job_a = session.scalars(select(Job.id).where(Job.lane == "a")).first()
    explained = runner.invoke(app, ["explain", str(job_a), "--runtime-dir", str(runtime), "--json"])
    report = json.loads(explained.stdout)
    assert [b["code"] for b in report["blocked_by"]] == ["memory_floor"]
    assert report["arithmetic"]["headroom_after_mib"] == 900 - 0 - 2048 - 1024


def test_learned_reservation_follows_the_measured_peak(engine, make_run, tmp_path):
    release = tmp_path / "release"
    hold = (
        "import os, sys, time; x = bytearray(b'1') * (60 * 2**20)\n"
        f"while not os.path.exists({str(release)!r}): time.sleep(0.01)"
    )
    config = make_config(
        [py_stage("learn", hold, memory_mib=10, learn_memory=True, memory_margin=1.5)],
        items=2,
        max_jobs=1,
    )
    run_id = make_run(config)
    service = WorkerService(
        engine,
        node="n1",
        slots=1,
        memory_probe=lambda: (64e3, 128e3),
        gpu=FakeGpu(),
        sample_seconds=0.0,
        sample_flush_seconds=0.0,
    )
    service.start()
    controller = Controller(engine)

    def attempts():
        with db.session_factory(engine)() as session:
            return session.scalars(
                select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.id)
            ).all()

    def first_measured():
        controller.tick()
        service.tick()
        rows = attempts()
        return rows and (rows[0].peak_rss_mib or 0) >= 60

    wait_until(first_measured)
    release.touch()

    def finished():
        controller.tick()
        service.tick()
        return [a.state for a in attempts()] == ["settled", "settled"]

    wait_until(finished)
    first = attempts()[0]
    with db.session_factory(engine)() as session:
        reservations = [
            r.memory_mib
            for r in session.scalars(select(Reservation).order_by(Reservation.attempt_id))
        ]
    assert reservations[0] == 10  # nothing measured yet: the configured minimum
    assert reservations[1] == math.ceil(first.peak_rss_mib * 1.5)  # peak x margin
    assert first.peak_rss_at is not None and first.peak_gpu_mib is None


def test_report_shows_the_held_lanes_idle_period_with_its_reason(
    engine, runtime, make_run, tmp_path
):
    run_id = make_run(two_node_config())
    run_until_lane_b_is_done(engine)
    page = tmp_path / "report.html"
    result = runner.invoke(
        app,
        [
            "report",
            str(run_id),
            "--runtime-dir",
            str(runtime),
            "--html",
            str(page),
            "--idle-min-seconds",
            "0",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    lane_a, lane_b = report["lanes"]["a"], report["lanes"]["b"]
    assert lane_a["attempts"] == 0 and lane_a["all_idle_share"] == 1.0
    (gap,) = lane_a["idle_periods"]  # nothing of lane a ever ran: one gap, the window
    assert any(reason.startswith("memory_floor — free 900 MiB") for reason in gap["reasons"])
    assert lane_b["attempts"] == 3 and lane_b["failures_by_class"] == {}
    assert lane_b["stage_duration_seconds"]["work"]["max"] >= 0
    text = page.read_text()
    assert text.count('<rect class="attempt succeeded"') == 3
    assert "lane a" in text and "lane b" in text and "<svg" in text
    assert 'class="idle-label"' in text and "memory_floor" in text
