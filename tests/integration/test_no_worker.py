"""Nothing runs without a worker, and laneway says so: `status` lists the workers and
names `no_worker` (with the command that starts one) for an idle lane whose node no live
worker serves, instead of a stale recorded refusal; `explain` says it first; `explain`
on a failed job shows its outcome, exit code, directory, end of stderr and the retry
command; the report labels the time without a worker `no_worker`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from sqlalchemy import select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db, ledger
from laneway.controller.daemon import Controller
from laneway.controller.models import Job
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html
from laneway.controller.states import ControlKind, Outcome
from laneway.controller.status import build_status, explain_job
from laneway.controller.status_nodes import LOST_AFTER_SECONDS, STALE_AFTER_SECONDS
from tests.support import (
    claim_on_n1,
    control_run,
    heartbeat,
    make_config,
    mark_unknown_one,
    py_stage,
    settle_one,
)

runner = CliRunner()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


def status_at(factory, run_id: int, clock) -> dict[str, Any]:
    with db.session_factory(factory.kw["bind"])() as session:
        return build_status(session, ledger.get_run(session, run_id), now=clock.now()).as_dict()


def start_command(runtime: Path) -> str:
    return f"laneway worker --node n1 --runtime-dir {shlex.quote(str(runtime))}"


def held_by_max_jobs(factory, make_run, register_worker, clock) -> tuple[int, str]:
    """A run of two jobs on a node of max_jobs 1: the first ran and succeeded, the second
    was refused (max_jobs) and waits, ready, with nothing running."""
    run_id = make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)
    clock.advance(2)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    return run_id, worker


def test_status_names_no_worker_once_the_nodes_worker_stopped(
    factory, make_run, register_worker, clock, runtime
):
    run_id, worker = held_by_max_jobs(factory, make_run, register_worker, clock)
    before = status_at(factory, run_id, clock)
    (lane,) = before["lanes"]
    assert lane["running"] == 0 and lane["ready"] == 1
    assert lane["reason"]["code"] == "max_jobs"  # a live worker: the recorded refusal
    assert before["no_worker"] == []
    (row,) = before["workers"]
    assert row["worker_id"] == worker and row["live"] and row["state"] == "active"
    assert row["heartbeat_age_seconds"] == 2.0 and row["slots"] == 4 and row["pid"] == 1

    clock.advance(5)
    with db.transaction(factory) as session:
        ledger.stop_worker(session, worker, now=clock.now())
    after = status_at(factory, run_id, clock)
    (lane,) = after["lanes"]
    assert lane["reason"]["code"] == "no_worker"
    assert lane["reason"]["detail"] == {"node": "n1", "start": start_command(runtime)}
    assert lane["reason"]["since"] == after["workers"][0]["stopped_at"]
    assert lane["reason"]["words"] == (
        f"no_worker — no live worker on node n1; start one: {start_command(runtime)}"
    )
    assert after["no_worker"] == [{"node": "n1", "start": start_command(runtime)}]
    (row,) = after["workers"]
    assert row["state"] == "stopped" and not row["live"]
    assert row["heartbeat_age_seconds"] == 7.0 and row["host"] == "test"

    # The command line, both forms (its own clock: the worker is stopped either way).
    shown = invoke("status", str(run_id), "--runtime-dir", str(runtime), "--json")
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.stdout)
    assert [lane["reason"]["code"] for lane in body["lanes"]] == ["no_worker"]
    assert body["workers"][0]["worker_id"] == worker
    text = invoke("status", str(run_id), "--runtime-dir", str(runtime))
    assert text.exit_code == 0, text.output
    assert "max_jobs" not in text.stdout
    workers_section = text.stdout.split("workers:\n", 1)[1].split("\nlanes:", 1)[0]
    assert worker in workers_section and "stopped" in workers_section
    assert f"node n1: no live worker — start one: {start_command(runtime)}" in workers_section
    lane_line = next(line for line in text.stdout.splitlines() if line.startswith("a "))
    assert f"no_worker — no live worker on node n1; start one: {start_command(runtime)}" in (
        lane_line
    )


def test_a_worker_is_live_until_its_heartbeat_is_older_than_the_threshold(
    factory, make_run, register_worker, clock
):
    run_id, _ = held_by_max_jobs(factory, make_run, register_worker, clock)
    clock.advance(STALE_AFTER_SECONDS - 2)  # heartbeat exactly STALE_AFTER_SECONDS old
    live = status_at(factory, run_id, clock)
    assert live["lanes"][0]["reason"]["code"] == "max_jobs"
    assert live["workers"][0]["liveness"] == "live" and live["workers"][0]["live"]
    clock.advance(1)
    stale = status_at(factory, run_id, clock)
    assert stale["lanes"][0]["reason"]["code"] == "no_worker"
    (row,) = stale["workers"]
    assert row["state"] == "active" and not row["live"] and row["liveness"] == "stale"
    clock.advance(LOST_AFTER_SECONDS - STALE_AFTER_SECONDS)  # LOST_AFTER_SECONDS + 1 old
    aged = status_at(factory, run_id, clock)
    assert aged["workers"][0]["state"] == "active" and aged["workers"][0]["liveness"] == "lost"
    # The controller then marks it lost: still no worker.
    Controller(factory.kw["bind"], clock=clock).tick()
    lost = status_at(factory, run_id, clock)
    assert lost["workers"][0]["state"] == "lost"
    assert lost["lanes"][0]["reason"]["code"] == "no_worker"


def test_a_run_no_worker_ever_served_says_no_worker(factory, make_run, clock, runtime):
    run_id = make_run(make_config(items=2))
    status = status_at(factory, run_id, clock)
    assert status["workers"] == []
    (lane,) = status["lanes"]
    assert lane["reason"]["code"] == "no_worker"
    assert lane["reason"]["since"] == status["run"]["created_at"]


def test_a_finished_run_asks_for_no_worker(factory, make_run, register_worker, clock, runtime):
    run_id = make_run(make_config())
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    with db.transaction(factory) as session:
        ledger.stop_worker(session, worker, now=clock.now())
    Controller(factory.kw["bind"], clock=clock).tick()  # closes the run
    status = status_at(factory, run_id, clock)
    assert status["run"]["state"] == "finished"
    assert status["no_worker"] == [] and status["workers"][0]["state"] == "stopped"
    text = invoke("status", str(run_id), "--runtime-dir", str(runtime)).stdout
    assert "laneway worker" not in text and "no_worker" not in text


def test_status_shows_a_bounded_list_of_workers(factory, make_run, register_worker, clock):
    run_id = make_run(make_config(items=1))
    stopped = []
    for _ in range(6):
        worker = register_worker()
        clock.advance(1)
        with db.transaction(factory) as session:
            ledger.stop_worker(session, worker, now=clock.now())
        stopped.append(worker)
    active = [register_worker(), register_worker()]
    shown = [w["worker_id"] for w in status_at(factory, run_id, clock)["workers"]]
    # Every active one, then the last three stopped, newest first.
    assert sorted(shown[:2]) == sorted(active)
    assert shown[2:] == stopped[::-1][:3]


def test_explain_says_first_that_no_worker_runs_on_the_node(
    factory, make_run, register_worker, clock, runtime
):
    run_id, worker = held_by_max_jobs(factory, make_run, register_worker, clock)
    with db.session_factory(factory.kw["bind"])() as session:
        (job_id,) = session.scalars(
            select(Job.id).where(Job.run_id == run_id, Job.state == "ready")
        ).all()
        live = explain_job(session, job_id, now=clock.now())
    assert live["worker"]["live"] and all(b["code"] != "no_worker" for b in live["blocked_by"])

    clock.advance(1)
    with db.transaction(factory) as session:
        ledger.stop_worker(session, worker, now=clock.now())
    shown = invoke("explain", str(job_id), "--runtime-dir", str(runtime), "--json")
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.stdout)
    assert body["blocked_by"][0]["code"] == "no_worker"
    assert body["worker"] == {"node": "n1", "live": False, "start": start_command(runtime)}
    text = invoke("explain", str(job_id), "--runtime-dir", str(runtime))
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"job {job_id} ")
    # The job's next step leads (its lane's, as `status` gives it): on SQLite no
    # controller serves this run either, so continuing it in the foreground starts both;
    # on a shared ledger the controller may run elsewhere, so it is the worker.
    step = body["next_step"]
    assert step["code"] in ("no_controller", "no_worker"), step
    assert lines[1] == f"next step: {step['words']}: {step['command']}"
    assert lines[2] == (
        "no worker is running on node n1: nothing will claim or settle its jobs; "
        f"start one: {start_command(runtime)}"
    )
    # The other reasons as before, after it (no memory sample: no worker reported one).
    assert lines[3] == "also blocked by:"
    assert any(line.startswith("  memory_floor") for line in lines[4:])


def test_explain_a_failed_job_shows_its_evidence_and_the_retry_command(
    factory, make_run, register_worker, clock, runtime
):
    make_run(make_config([py_stage("solve", "pass"), py_stage("judge", "pass", needs=["solve"])]))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock)
    directory = Path(claim.attempt_dir)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"line {n}" for n in range(1, 16)] + ["token=[REDACTED] \x1b[31mred"]
    (directory / "stderr.log").write_text("\n".join(lines) + "\n")
    settle_one(factory, claim, worker, clock, Outcome.FAILED, exit_code=3, reason="exit code 3")

    shown = invoke("explain", str(claim.job_id), "--runtime-dir", str(runtime), "--json")
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.stdout)
    attempt = body["last_attempt"]
    assert attempt["outcome"] == "failed" and attempt["exit_code"] == 3
    assert attempt["attempt_dir"] == claim.attempt_dir
    assert attempt["stderr_tail"] == lines[-10:]
    retry = f"laneway retry {claim.job_id} --reason '...' --runtime-dir {shlex.quote(str(runtime))}"
    assert body["retry"] == {"job_id": claim.job_id, "command": retry}

    text = invoke("explain", str(claim.job_id), "--runtime-dir", str(runtime)).stdout
    assert (
        f"attempt {claim.attempt_id} (the job's attempt 1): failed, exit code 3 — exit code 3"
        in text
    )
    assert f"directory: {claim.attempt_dir}" in text
    assert "last 10 line(s) of stderr.log:\n    line 7\n" in text
    assert "line 6\n" not in text and "\x1b" not in text  # escapes neutralised
    assert text.rstrip().endswith(f"retry: {retry}")

    # The job skipped because of it points at the same retry.
    with db.session_factory(factory.kw["bind"])() as session:
        (judge,) = session.scalars(select(Job.id).where(Job.stage == "judge")).all()
        skipped = explain_job(session, judge, now=clock.now())
    assert skipped["state"] == "skipped" and skipped["retry"]["job_id"] == claim.job_id
    assert skipped["last_attempt"] is None


def test_explain_a_killed_job_names_the_signal_and_an_unreadable_log(
    factory, make_run, register_worker, clock
):
    make_run(make_config())
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock)
    settle_one(factory, claim, worker, clock, Outcome.FAILED, exit_signal=9)
    with db.session_factory(factory.kw["bind"])() as session:
        body = explain_job(session, claim.job_id, now=clock.now())
    attempt = body["last_attempt"]
    assert attempt["exit_signal"] == 9 and attempt["signal_name"] == "SIGKILL"
    assert attempt["stderr_tail"] is None and "cannot read it here" in attempt["stderr_unreadable"]
    from laneway.cli.render import explain_text

    text = explain_text(body)
    assert "failed, signal 9 (SIGKILL)" in text and "stderr.log: " in text


def report_of(factory, run_id: int, clock) -> dict[str, Any]:
    with db.session_factory(factory.kw["bind"])() as session:
        return build_report(session, ledger.get_run(session, run_id), now=clock.now())


def test_report_labels_the_time_without_a_worker_no_worker(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=2, max_jobs=1))
    clock.advance(120)  # two minutes before the node's first worker starts
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)  # the other: refused, max_jobs
    clock.advance(10)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    clock.advance(20)
    heartbeat(factory, worker, clock, 64_000, total=128_000)
    clock.advance(5)
    with db.transaction(factory) as session:
        ledger.stop_worker(session, worker, now=clock.now())
    clock.advance(300)  # five minutes with no worker at all

    report = report_of(factory, run_id, clock)
    lane = report["lanes"]["a"]
    first, last = lane["idle_periods"]
    assert (first["start"], first["end"]) == (0.0, 120.0)
    assert first["reasons"] == ["no_worker — no live worker on node n1 (+0 s to +120 s)"]
    assert first["no_worker_seconds"] == 120.0
    # After the attempt: max_jobs while the worker lived (25 s), no_worker after it stopped.
    assert (last["start"], last["end"]) == (130.0, 455.0)
    assert last["reasons"] == [
        "no_worker — no live worker on node n1 (+155 s to +455 s)",
        "max_jobs — 1 running, node max_jobs 1",
    ]
    assert last["no_worker_seconds"] == 300.0
    page = render_html(report)
    assert "<title>idle 120.0 s: no_worker — no live worker on node n1 (+0 s to +120 s)" in page


def test_report_keeps_recorded_reasons_while_a_worker_lives(
    factory, make_run, register_worker, clock
):
    run_id = make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)
    clock.advance(10)
    settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    clock.advance(10)  # the worker's heartbeat is 20 s old: live
    lane = report_of(factory, run_id, clock)["lanes"]["a"]
    (gap,) = lane["idle_periods"]
    assert gap["reasons"] == ["max_jobs — 1 running, node max_jobs 1"]
    assert gap["no_worker_seconds"] == 0.0


def test_what_an_operator_must_lift_comes_before_a_stale_refusal_and_no_worker(
    factory, make_run, register_worker, clock
):
    """An idle lane's reason is what holds it now, in admission's order: the run's
    unknown attempt (not the max_jobs refusal recorded while it ran), then a pause,
    whether or not a worker is live."""
    run_id = make_run(make_config(items=2, max_jobs=1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock, slots=2)  # the other: max_jobs
    assert status_at(factory, run_id, clock)["lanes"][0]["reason"] is None  # one runs
    mark_unknown_one(factory, claim, clock, "lease expired")
    (lane,) = status_at(factory, run_id, clock)["lanes"]
    assert lane["running"] == 0 and lane["ready"] == 1
    assert lane["reason"]["code"] == "unknown_outcome"
    assert lane["reason"]["words"].startswith("unknown_outcome — 1 attempt(s) await")

    with db.transaction(factory) as session:
        ledger.reconcile_attempt(
            session,
            claim.attempt_id,
            verdict="succeeded",
            reason="checked",
            actor="operator",
            now=clock.now(),
        )
        control_run(
            session,
            ControlKind.PAUSE,
            run_id,
            reason="provider maintenance",
            actor="operator",
            now=clock.now(),
        )
    for stopped in (False, True):
        if stopped:
            with db.transaction(factory) as session:
                ledger.stop_worker(session, worker, now=clock.now())
        (lane,) = status_at(factory, run_id, clock)["lanes"]
        assert lane["reason"]["code"] == "paused", stopped
        assert lane["reason"]["words"] == "paused (run) — provider maintenance"
