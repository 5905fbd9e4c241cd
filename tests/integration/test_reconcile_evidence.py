"""`reconcile --run RUN --from-evidence`: unknown attempts whose supervisor has since
written a verified exit record, with supervisor and child gone, are shown and settled as
the record says, after one confirmation; `status` marks them. An attempt whose process
still runs is left unknown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.cli.main import app
from laneway.controller import db, evidence, ledger, reconcile
from laneway.controller.durable import make_private_dir, write_json
from laneway.controller.errors import IllegalTransition
from laneway.controller.models import Artifact, Attempt, Job
from laneway.controller.rows import SessionRows
from laneway.controller.states import JobState, Outcome
from laneway.controller.status import status_report
from laneway.workers import identity
from tests.integration.test_cli import invoke, runner
from tests.support import claim_on_n1, make_config, py_stage, record_spawn


def dead_process() -> tuple[int, int]:
    """(pid, start time) of a process that has exited."""
    process = subprocess.Popen(["sleep", "30"])
    start = identity.process_start_time(process.pid)
    assert start is not None
    process.kill()
    process.wait()
    return process.pid, start


def worker_here(factory, clock, *, pid: int, slots: int) -> str:
    """A worker on n1 registered as this host and boot (pid ``pid``, started at
    ``pid``), so its attempts' evidence is looked for here."""
    with db.transaction(factory) as session:
        return ledger.register_worker(
            session,
            node="n1",
            host=identity.host(),
            pid=pid,
            boot_id=identity.boot_id(),
            process_start_time=pid,
            slots=slots,
            now=clock.now(),
        )


def unknown_attempts(factory, clock, count: int, supervisors) -> list:
    """Claim ``count`` jobs on n1 for a worker of this host, record each attempt's
    supervisor (``supervisors``: one (pid, start time) per claim) and mark it unknown,
    as a lease that expired would. Returns the claims."""
    worker = worker_here(factory, clock, pid=1, slots=count)
    claims = claim_on_n1(factory, worker, clock, slots=count)
    assert len(claims) == count
    for claim, (pid, start) in zip(claims, supervisors, strict=True):
        with db.transaction(factory) as session:
            record_spawn(session, claim, worker, clock.now(), (identity.boot_id(), pid, start))
            ledger.mark_unknown(
                session, claim.attempt_id, reason="lease expired", actor="t", now=clock.now()
            )
    return claims


def leave_exit_record(claim, exit_code: int | None) -> None:
    """``claim``'s attempt directory made, with an exit.json of ``exit_code`` in it
    (none when None)."""
    make_private_dir(claim.attempt_dir)
    if exit_code is not None:
        write_json(
            Path(claim.attempt_dir) / "exit.json",
            {"attempt_id": claim.attempt_id, "exit_code": exit_code, "signal": None},
        )


def gone_and_alive(factory, clock, *, exit_code: int) -> tuple[int, int]:
    """Two unknown attempts (``unknown_attempts``), each with an exit.json of
    ``exit_code``: the first's supervisor is gone, the second's is this process (alive).
    Returns their attempt ids."""
    claims = unknown_attempts(factory, clock, 2, [dead_process(), identity.current()])
    for claim in claims:
        leave_exit_record(claim, exit_code)
    gone, alive = (claim.attempt_id for claim in claims)
    return gone, alive


def test_settles_what_the_evidence_establishes(factory, make_run, runtime: Path, clock):
    stage = py_stage("call", "pass", exit_codes={"0": "succeeded", "3": "infra_failure"})
    run_id = make_run(make_config([stage], items=3))
    me, my_start = identity.current()
    claims = unknown_attempts(factory, clock, 3, [dead_process(), dead_process(), (me, my_start)])
    for claim, exit_code in zip(claims, (0, 3, None), strict=True):
        leave_exit_record(claim, exit_code)
    rt = ["--runtime-dir", str(runtime)]
    ok, infra, alive = (claim.attempt_id for claim in claims)

    status = json.loads(invoke("status", str(run_id), *rt, "--json").stdout)
    marked = {u["attempt_id"]: u.get("conclusive") for u in status["unknown"]}
    assert marked[ok]["outcome"] == "succeeded" and marked[infra]["outcome"] == "infra_failure"
    assert marked[alive] is None
    assert "--from-evidence" in marked[ok]["settle"]
    assert "CONCLUSIVE" in invoke("status", str(run_id), *rt).stdout

    # One question for all; no means nothing is settled.
    declined = runner.invoke(
        app, ["reconcile", "--run", str(run_id), "--from-evidence", *rt], input="n\n"
    )
    assert declined.exit_code == 1
    assert f"attempt {alive}: left unknown" in declined.stdout
    with factory() as session:
        assert session.get(Attempt, ok).state == "unknown"

    done = invoke("reconcile", "--run", str(run_id), "--from-evidence", "--yes", *rt, "--json")
    assert done.exit_code == 0, done.output
    body = json.loads(done.stdout)
    assert [s["attempt_id"] for s in body["settled"]] == [ok, infra]
    assert [e["attempt_id"] for e in body["left_unknown"]] == [alive]
    with factory() as session:
        rows = {a: session.get(Attempt, a) for a in (ok, infra, alive)}
        states = {a: (r.state, r.outcome, r.exit_code) for a, r in rows.items() if r}
        jobs = {a: session.get(Job, r.job_id).state for a, r in rows.items() if r}
    assert states[ok] == ("settled", "succeeded", 0)
    assert states[infra] == ("settled", "infra_failure", 3)
    assert states[alive][0] == "unknown"
    assert jobs == {ok: "succeeded", infra: "failed", alive: "unknown"}

    for bad in (
        ["reconcile", "--from-evidence", "--yes"],
        ["reconcile", str(alive), "--run", str(run_id), "--from-evidence"],
        ["reconcile", str(alive), "--reason", "r"],
    ):
        result = invoke(*bad, *rt)
        assert result.exit_code == 2, (bad, result.output)


def test_a_success_from_evidence_stores_its_declared_outputs(
    factory, make_run, runtime: Path, clock
):
    stage = py_stage("prepare", "pass", outputs=["packet.json"], retry={"max_attempts": 1})
    run_id = make_run(make_config([stage], items=2))
    claims = unknown_attempts(factory, clock, 2, [dead_process(), dead_process()])
    for claim, delivered in zip(claims, (True, False), strict=True):
        workspace = make_private_dir(Path(claim.attempt_dir) / "workspace")
        if delivered:
            (workspace / "packet.json").write_text('{"q": 1}')
        write_json(
            Path(claim.attempt_dir) / "exit.json",
            {"attempt_id": claim.attempt_id, "exit_code": 0, "signal": None},
        )
    done = invoke(
        "reconcile",
        "--run",
        str(run_id),
        "--from-evidence",
        "--yes",
        "--runtime-dir",
        str(runtime),
        "--json",
    )
    assert done.exit_code == 0, done.output
    delivered, missing = (claim.attempt_id for claim in claims)
    with factory() as session:
        ok, bad = session.get(Attempt, delivered), session.get(Attempt, missing)
        stored = session.scalars(select(Artifact).where(Artifact.run_id == run_id)).all()
    assert (ok.outcome, bad.outcome) == ("succeeded", "failed")
    assert "packet.json is missing" in bad.state_reason
    (artifact,) = stored
    assert artifact.attempt_id == delivered and artifact.name == "packet.json"
    obj = runtime / "artifacts" / "sha256" / artifact.sha256[:2] / artifact.sha256
    assert obj.read_text() == '{"q": 1}'


def test_a_success_reconciled_by_hand_hands_its_outputs_on_or_is_refused(
    factory, make_run, runtime: Path, clock
):
    """`reconcile ATTEMPT --as succeeded` of a stage with declared outputs stores them
    from the attempt's workspace and records them with the settle, so the stage that
    needs it gets its input; with an output missing it is refused (exit 1) and nothing
    changes: the operator reconciles it failed or not-run instead."""
    stages = [
        py_stage("prepare", "pass", outputs=["packet.json"]),
        py_stage("solve", "pass", needs=["prepare"]),
    ]
    run_id = make_run(make_config(stages, items=2))
    claims = unknown_attempts(factory, clock, 2, [dead_process(), dead_process()])
    delivered, missing = claims
    workspace = make_private_dir(Path(delivered.attempt_dir) / "workspace")
    (workspace / "packet.json").write_text('{"q": 1}')
    rt = ["--reason", "checked by hand", "--runtime-dir", str(runtime)]

    done = invoke("reconcile", str(delivered.attempt_id), "--as", "succeeded", *rt)
    assert done.exit_code == 0, done.output
    refused = invoke("reconcile", str(missing.attempt_id), "--as", "succeeded", *rt)
    assert refused.exit_code == 1
    assert (
        f"attempt {missing.attempt_id} cannot be reconciled as succeeded: declared output "
        "packet.json is missing"
    ) in refused.stderr
    assert "--as failed or --as not-run" in refused.stderr
    with factory() as session:
        (artifact,) = session.scalars(select(Artifact).where(Artifact.run_id == run_id)).all()
        assert session.get(Attempt, missing.attempt_id).state == "unknown"  # unchanged
        item_id = session.get(Job, delivered.job_id).item_id
        solve = session.scalars(
            select(Job).where(Job.item_id == item_id, Job.stage == "solve")
        ).one()
    assert artifact.attempt_id == delivered.attempt_id and artifact.name == "packet.json"
    assert (runtime / "artifacts" / "sha256" / artifact.sha256[:2] / artifact.sha256).is_file()
    with factory() as session:
        given, problems = ledger.inputs_for(session, job_id=solve.id, needs_outputs=["prepare"])
    assert [(g["name"], g["sha256"]) for g in given] == [("packet.json", artifact.sha256)]
    assert problems == []
    # Reconciled failed instead, the other needs no outputs.
    failed = invoke("reconcile", str(missing.attempt_id), "--as", "failed", *rt)
    assert failed.exit_code == 0, failed.output


def test_a_success_by_hand_of_an_attempt_on_another_host_is_refused(
    factory, make_run, register_worker, runtime: Path, clock
):
    make_run(make_config([py_stage("prepare", "pass", outputs=["packet.json"])]))
    worker = register_worker()  # host "test": not this machine
    (claim,) = claim_on_n1(factory, worker, clock)
    with db.transaction(factory) as session:
        ledger.mark_unknown(session, claim.attempt_id, reason="lost", actor="t", now=clock.now())
    refused = invoke(
        "reconcile",
        str(claim.attempt_id),
        "--as",
        "succeeded",
        "--reason",
        "x",
        "--runtime-dir",
        str(runtime),
    )
    assert refused.exit_code == 1
    assert f"attempt {claim.attempt_id} ran on host test" in refused.stderr


def test_judge_review_and_settle_are_callable_without_the_cli(
    engine, factory, make_run, runtime: Path, clock
):
    """The judgement `status` and the dashboard show (``evidence.mark_conclusive``), and
    the two steps of `reconcile --from-evidence` (``reconcile.review_evidence``, then
    ``reconcile.settle_from_evidence``), called directly."""
    stage = py_stage("call", "pass", exit_codes={"0": "succeeded"})
    run_id = make_run(make_config([stage], items=2))
    ok, alive = gone_and_alive(factory, clock, exit_code=0)

    with factory() as session:
        rows = SessionRows(session)
        judged = evidence.judge_unknowns(rows, run_id)
        report = status_report(rows, run_id, now=clock.now())
        evidence.mark_conclusive(rows, report)
    assert judged[ok].conclusive and judged[ok].outcome is Outcome.SUCCEEDED
    assert not judged[alive].conclusive and "still running" in judged[alive].words
    marked = {u["attempt_id"]: u.get("conclusive") for u in report.as_dict()["unknown"]}
    assert marked[alive] is None
    assert marked[ok] == {
        **judged[ok].as_dict(),
        "settle": evidence.settle_command(run_id, str(runtime)),
    }
    assert marked[ok]["settle"].startswith(f"laneway reconcile --run {run_id} --from-evidence")

    review = reconcile.review_evidence(engine, run_id)
    assert [e.attempt_id for e in review.conclusive] == [ok]
    assert [e.attempt_id for e in review.left_unknown] == [alive]
    settled = reconcile.settle_from_evidence(engine, review, actor="tester", clock=clock)
    assert [(s.evidence.attempt_id, s.job_state) for s in settled] == [(ok, JobState.SUCCEEDED)]
    assert settled[0].as_dict()["job_state"] == "succeeded"
    with factory() as session:
        row = session.get(Attempt, ok)
        assert row is not None
        assert (row.state, row.outcome, row.exit_code) == ("settled", "succeeded", 0)
        assert row.state_reason.startswith(f"reconciled by tester: {reconcile.EVIDENCE_REASON}; ")
        assert evidence.verified_exit(row) == (0, None)
    # Settled once: nothing is conclusive any more, and a stale review settles nothing.
    assert reconcile.review_evidence(engine, run_id).conclusive == []
    with pytest.raises(IllegalTransition):
        reconcile.settle_from_evidence(engine, review, actor="tester", clock=clock)


def test_evidence_that_is_not_conclusive_says_what_is_missing_and_what_to_do(
    factory, make_run, register_worker, runtime: Path, clock
):
    run_id = make_run(make_config([py_stage("call", "pass")], items=3))
    # Its worker never recorded a supervisor: it may still run.
    here = worker_here(factory, clock, pid=2, slots=1)
    (silent,) = claim_on_n1(factory, here, clock)
    # It ran on another machine.
    (far,) = claim_on_n1(factory, register_worker(), clock)
    # Its supervisor ran here and is gone, and it left no exit record.
    (ended,) = unknown_attempts(factory, clock, 1, [dead_process()])
    with db.transaction(factory) as session:
        for claim in (silent, far):
            ledger.mark_unknown(
                session, claim.attempt_id, reason="lost", actor="t", now=clock.now()
            )
    rt = ["--runtime-dir", str(runtime)]
    shown = invoke("reconcile", "--run", str(run_id), "--from-evidence", *rt)
    assert shown.exit_code == 0, shown.output

    def by_hand(aid: int) -> str:
        return (
            f"then `laneway reconcile {aid} --as succeeded|failed|not-run --reason '...' "
            f"--runtime-dir {runtime}`"
        )

    lines = shown.stdout.splitlines()
    assert lines == [
        f"attempt {silent.attempt_id}: left unknown — no exit record "
        f"({silent.attempt_dir}/exit.json) and no supervisor status (its worker never "
        "recorded a supervisor pid); the job may still be running on node n1 — check "
        f"there, {by_hand(silent.attempt_id)}",
        f"attempt {far.attempt_id}: left unknown — it ran on node n1 (host test), whose "
        "processes and files this machine cannot see; run this on test, or check there, "
        f"{by_hand(far.attempt_id)}",
        f"attempt {ended.attempt_id}: left unknown — no exit record "
        f"({ended.attempt_dir}/exit.json), and neither its supervisor nor its child is "
        "running: it ended without writing one, so its outcome is not known — read its "
        f"output (`laneway logs {ended.attempt_id}`), {by_hand(ended.attempt_id)}",
        "0 attempt(s) settled from evidence; 3 left unknown",
    ]


@pytest.mark.parametrize("planted", ["fifo", "symlink", "directory"])
def test_an_exit_record_the_job_replaced_is_never_trusted_nor_waited_on(
    factory, make_run, runtime: Path, clock, tmp_path, planted
):
    """The job owns its attempt directory: an exit.json that is a FIFO (reading it would
    wait for ever), a link to a valid record elsewhere, or a directory is not evidence;
    `reconcile --from-evidence` says it cannot be read and settles nothing."""
    import os

    run_id = make_run(make_config([py_stage("call", "pass")], items=1))
    (claim,) = unknown_attempts(factory, clock, 1, [dead_process()])
    leave_exit_record(claim, None)
    record = Path(claim.attempt_dir) / "exit.json"
    if planted == "fifo":
        os.mkfifo(record)
    elif planted == "symlink":
        elsewhere = tmp_path / "exit.json"
        elsewhere.write_text(json.dumps({"attempt_id": claim.attempt_id, "exit_code": 0}))
        record.symlink_to(elsewhere)
    else:
        record.mkdir()
    shown = invoke(
        "reconcile", "--run", str(run_id), "--from-evidence", "--runtime-dir", str(runtime)
    )
    assert shown.exit_code == 0, shown.output
    first = shown.stdout.splitlines()[0]
    assert first.startswith(
        f"attempt {claim.attempt_id}: left unknown — its exit record {record} cannot be read"
    ), first
    assert shown.stdout.splitlines()[-1] == "0 attempt(s) settled from evidence; 1 left unknown"
    with factory() as session:
        assert session.get(Attempt, claim.attempt_id).state == "unknown"


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_the_report_reads_no_exit_record_a_job_replaced(tmp_path: Path, planted):
    """``laneway report`` takes a settled attempt's command times from its exit.json: a
    FIFO there is not waited on, and a link is not followed."""
    import os

    from laneway.controller.report import exit_times

    attempt_dir = tmp_path / "attempt-1"
    make_private_dir(attempt_dir)
    times = {"started_at": "2026-01-01T00:00:00Z", "ended_at": "2026-01-01T00:00:05Z"}
    if planted == "fifo":
        os.mkfifo(attempt_dir / "exit.json")
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps(times))
        (attempt_dir / "exit.json").symlink_to(tmp_path / "elsewhere.json")
    assert exit_times(str(attempt_dir)) == (None, None)
    (attempt_dir / "exit.json").unlink()
    write_json(attempt_dir / "exit.json", times)
    started, ended = exit_times(str(attempt_dir))
    assert started is not None and ended is not None and (ended - started).seconds == 5
