"""The worker kernel end to end, in-process worker and controller, real supervisors and
real child processes: lease -> intent committed -> spawn -> exit record -> settle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db, ledger
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Control, Decision, Event, Job, Run
from laneway.workers.service import WorkerService
from tests.support import escape, gated_stage, make_config, py_stage, statements, wait_until

PLENTY = (64_000.0, 128_000.0)


def drive(engine, services, run_id, *, on_tick=None, timeout=60.0, controller=None):
    """Tick controller (a new one unless given) and workers until the run is finished."""
    controller = controller or Controller(engine)

    def finished():
        controller.tick()
        for service in services:
            service.tick()
        if on_tick:
            on_tick()
        with db.session_factory(engine)() as session:
            return session.get(Run, run_id).state == "finished"

    wait_until(finished, timeout=timeout)


def start_worker(engine, node="n1", slots=4):
    service = WorkerService(engine, node=node, slots=slots, memory_probe=lambda: PLENTY)
    service.start()
    return service


def attempts(engine, run_id):
    with db.session_factory(engine)() as session:
        return session.scalars(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.id)
        ).all()


INTENT_PROBE = textwrap.dedent(
    """
    import json, os, sqlite3, sys
    key = os.environ["LANEWAY_IDEMPOTENCY_KEY"]
    if sys.argv[2].startswith("postgresql"):
        import psycopg
        with psycopg.connect(sys.argv[2]) as db:
            row = db.execute(
                "SELECT state, fence FROM attempts WHERE idempotency_key = %s", (key,)
            ).fetchone()
    else:
        ledger = os.path.join(sys.argv[2], "ledger.sqlite3")
        with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
            row = db.execute(
                "SELECT state, fence FROM attempts WHERE idempotency_key = ?", (key,)
            ).fetchone()
    env = {k: v for k, v in os.environ.items() if k.startswith("LANEWAY_")}
    result = {"job_id": os.environ["LANEWAY_JOB_ID"], "intent_row": row, "env": env,
              "token_len": len(os.environ["API_TOKEN"]), "cwd": os.getcwd()}
    with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
        json.dump(result, f)
    """
)


def _ledger_arg(runtime: Path) -> str:
    """Where the probe finds the ledger: the runtime dir (SQLite) or a libpq URL."""
    url = db.ledger_url(runtime)
    return str(runtime) if url.startswith("sqlite") else url.replace("+psycopg", "")


def test_intent_is_committed_before_the_process_starts(engine, runtime, make_run, monkeypatch):
    canary = "canary-token-value-991"
    monkeypatch.setenv("CANARY_TOKEN", canary)
    stage = {
        "name": "probe",
        "argv": [sys.executable, "-c", escape(INTENT_PROBE), "{item}", _ledger_arg(runtime)],
        "env": {"API_TOKEN": "${CANARY_TOKEN}"},
        "timeout_seconds": 30,
    }
    run_id = make_run(make_config([stage], items=3))
    drive(engine, [start_worker(engine)], run_id)
    rows = attempts(engine, run_id)
    assert len(rows) == 3
    for attempt in rows:
        assert attempt.outcome == "succeeded", attempt.state_reason
        result = attempt.result
        # The child found its own intent row, with its key, already committed.
        assert result["intent_row"] is not None and result["intent_row"][1] == attempt.fence
        env = result["env"]
        assert env["LANEWAY_IDEMPOTENCY_KEY"] == attempt.idempotency_key
        assert env["LANEWAY_JOB_ID"] == str(attempt.job_id)
        assert env["LANEWAY_RESULT_PATH"] == str(Path(attempt.attempt_dir) / "result.json")
        assert env["LANEWAY_ATTEMPT_DIR"] == attempt.attempt_dir
        assert result["cwd"] == str(Path(attempt.attempt_dir) / "workspace")
        assert result["token_len"] == len(canary)  # resolved in the child's environment
        receipt = json.loads((Path(attempt.attempt_dir) / "receipt.json").read_text())
        assert receipt["idempotency_key"] == attempt.idempotency_key
        assert receipt["child_pid"] == attempt.child_pid and attempt.child_start_time
        assert attempt.boot_id and attempt.supervisor_pid and attempt.supervisor_start_time
    # The secret's value is stored nowhere laneway writes.
    for path in runtime.rglob("*"):
        if path.is_file():
            assert canary.encode() not in path.read_bytes(), path


def test_outcome_classes_from_exit_codes_and_results(engine, make_run):
    code = textwrap.dedent(
        """
        import json, os, sys
        item = sys.argv[1]
        result = {"job_id": os.environ["LANEWAY_JOB_ID"]}
        if item == "infra":
            result["infrastructure_failure"] = True
        if item == "fatal":
            result["fatal_failure"] = True
        if item == "liar":
            result["job_id"] = "someone-else"
        with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
            json.dump(result, f)
        sys.exit({"ok": 0, "no": 1, "infra": 0, "fatal": 0, "liar": 0, "mapped": 75}[item])
        """
    )
    stage = py_stage("s", code, exit_codes={0: "succeeded", 75: "infra_failure"})
    keys = ["ok", "no", "infra", "liar", "mapped"]
    run_id = make_run(make_config([stage], items=[{"key": k, "lane": "a"} for k in keys]))
    drive(engine, [start_worker(engine)], run_id)
    with db.session_factory(engine)() as session:
        rows = session.execute(
            select(Job.item_id, Attempt.outcome, Attempt.diagnostics, Job.state)
            .join(Attempt, Attempt.job_id == Job.id)
            .order_by(Job.item_id)
        ).all()
    outcomes = [row.outcome for row in rows]
    assert outcomes == ["succeeded", "failed", "infra_failure", "failed", "infra_failure"]
    assert "not this job" in rows[3].diagnostics[0]
    assert [row.state for row in rows] == ["succeeded"] + ["failed"] * 4


@pytest.mark.parametrize(
    ("code", "outcome", "control"),
    [
        (
            "import json, os; json.dump({'job_id': os.environ['LANEWAY_JOB_ID'], "
            "'fatal_failure': True}, open(os.environ['LANEWAY_RESULT_PATH'], 'w'))",
            "fatal",
            "halt",
        ),
        ("raise SystemExit(0)", "harness_failure", "pause"),
    ],
)
def test_fatal_halts_and_harness_failure_pauses_the_run(engine, make_run, code, outcome, control):
    extra = (
        {"env": {"API_KEY": "${LANEWAY_TEST_UNSET_VAR}"}} if outcome == "harness_failure" else {}
    )
    run_id = make_run(make_config([py_stage("s", code, **extra)], items=3, max_jobs=1))
    service = start_worker(engine, slots=1)
    if outcome == "harness_failure":
        # Its look at the variable passed; the spawn's fails.
        service.run_checks._lacking[run_id] = {}
    controller = Controller(engine)

    def first_settled():
        controller.tick()
        service.tick()
        return any(a.state == "settled" for a in attempts(engine, run_id))

    wait_until(first_settled)
    for _ in range(5):  # and nothing more is dispatched
        controller.tick()
        service.tick()
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == outcome
    with db.session_factory(engine)() as session:
        controls = session.scalars(select(Control).where(Control.run_id == run_id)).all()
        codes = set(session.scalars(select(Decision.reason_code).where(Decision.run_id == run_id)))
    assert [(c.kind, c.scope) for c in controls] == [(control, "run")]
    assert f"attempt {attempt.id} settled {outcome}" in controls[0].reason
    assert ("halted" if control == "halt" else "paused") in codes


def test_timeout_settles_timed_out(engine, make_run):
    stage = py_stage("slow", "import time; time.sleep(600)", timeout_seconds=1, grace_seconds=0.2)
    run_id = make_run(make_config([stage]))
    drive(engine, [start_worker(engine)], run_id)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "timed_out" and attempt.exit_signal is not None
    assert attempt.state_reason == "timed out after 1 s (stages.slow.timeout_seconds = 1)"


def test_a_secret_gone_after_the_claim_settles_harness_failure_without_starting(engine, make_run):
    """A worker claims no job whose secret it lacks (``secret_missing``,
    test_secrets_on_workers.py); should the variable leave its environment after that
    check (its look is cached per run), the spawn finds it missing and the attempt
    settles ``harness_failure`` with nothing started."""
    stage = py_stage("s", "raise SystemExit(0)", env={"API_KEY": "${LANEWAY_TEST_UNSET_VAR}"})
    run_id = make_run(make_config([stage]))
    worker = start_worker(engine)
    worker.run_checks._lacking[run_id] = {}  # as if it had been set when the worker looked
    drive(engine, [worker], run_id)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == "harness_failure"
    assert "LANEWAY_TEST_UNSET_VAR" in attempt.state_reason
    assert attempt.supervisor_pid is None
    assert not (Path(attempt.attempt_dir) / "exit.json").exists()


def test_caps_and_max_jobs_are_never_exceeded(engine, make_run, tmp_path):
    # The first jobs hold until the test has seen two of them run at once (a handshake:
    # the caps allow it, and no clock decides whether the test looked in time).
    gate = tmp_path / "gate"
    config = make_config(
        [
            gated_stage("prep", gate),
            gated_stage("work", gate, needs=["prep"], cap=2),
        ],
        items=[{"key": f"i{n}", "lane": "ab"[n % 2]} for n in range(8)],
        lanes=[
            {"name": "a", "node": "n1", "caps": {"prep": 1}},
            {"name": "b", "node": "n1", "caps": {"prep": 1}},
        ],
        max_jobs=3,
    )
    run_id = make_run(config)
    peaks = {"node": 0, "prep_a": 0, "prep_b": 0, "work": 0}

    def observe():
        with db.session_factory(engine)() as session:
            running = session.execute(
                select(Job.lane, Job.stage, func.count())
                .where(Job.run_id == run_id, Job.state == "running")
                .group_by(Job.lane, Job.stage)
            ).all()
        counts = {(lane, stage): n for lane, stage, n in running}
        peaks["node"] = max(peaks["node"], sum(counts.values()))
        peaks["prep_a"] = max(peaks["prep_a"], counts.get(("a", "prep"), 0))
        peaks["prep_b"] = max(peaks["prep_b"], counts.get(("b", "prep"), 0))
        peaks["work"] = max(peaks["work"], sum(n for (_, s), n in counts.items() if s == "work"))
        if peaks["node"] >= 2:
            gate.touch()

    drive(engine, [start_worker(engine, slots=8)], run_id, on_tick=observe)
    assert peaks["node"] <= 3 and peaks["prep_a"] <= 1 and peaks["prep_b"] <= 1
    assert peaks["work"] <= 2
    assert peaks["node"] >= 2  # and the caps did not serialise everything
    assert all(a.outcome == "succeeded" for a in attempts(engine, run_id))


def test_controller_writes_status_and_summary_snapshots(engine, runtime, make_run):
    run_id = make_run(make_config(items=2))
    drive(engine, [start_worker(engine)], run_id)
    directory = runtime / "runs" / str(run_id)
    summary = json.loads((directory / "SUMMARY.json").read_text())
    status = json.loads((directory / "status.json").read_text())
    assert summary["run"]["state"] == "finished" and summary["totals"] == {"succeeded": 2}
    assert status["run"]["state"] == "finished"
    assert not list(directory.glob("*.partial"))


RACER = textwrap.dedent(
    """
    import json, os, sys
    from laneway.controller import db, ledger
    from laneway.controller.clock import SystemClock
    runtime = sys.argv[1]
    engine = db.make_engine(db.ledger_url(runtime))
    factory = db.session_factory(engine)
    clock = SystemClock()
    with db.transaction(factory) as s:
        worker = ledger.register_worker(s, node="n1", host="h", pid=os.getpid(), boot_id="b",
                                        process_start_time=None, slots=1, now=clock.now())
    print("ready", flush=True)
    sys.stdin.readline()  # the starting gun: every racer is blocked here until it fires
    with db.transaction(factory) as s:
        claims = ledger.claim_jobs(s, worker_id=worker, node="n1", free_slots=1,
                                   mem_available_mib=64000, now=clock.now())
    print(json.dumps([c.job_id for c in claims]), flush=True)
    """
)


def test_racing_workers_lease_a_job_exactly_once(engine, runtime, make_run):
    for _ in range(2):
        run_id = make_run(make_config(items=1))
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, str(runtime)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )
            for _ in range(4)
        ]
        for racer in racers:
            assert racer.stdout.readline().strip() == "ready"
        for racer in racers:
            racer.stdin.write("go\n")
            racer.stdin.flush()
        claimed = []
        for racer in racers:
            out, _ = racer.communicate(timeout=120)
            assert racer.returncode == 0
            claimed += json.loads(out)
        assert len(claimed) == 1
        assert len(attempts(engine, run_id)) == 1


def test_worker_that_cannot_heartbeat_takes_no_new_work(engine, make_run):
    run_id = make_run(make_config(items=2))
    service = WorkerService(
        engine,
        node="n1",
        slots=2,
        memory_probe=lambda: PLENTY,
        lease_seconds=5,
        heartbeat_seconds=3600,
    )
    service.start()
    service._heartbeat_if_due()  # first heartbeat, no claim yet
    service._last_heartbeat -= 10  # as if heartbeats had failed for longer than a lease
    assert not service.trusts_its_leases()
    report = service.tick()
    assert report.claimed == 0 and attempts(engine, run_id) == []


def test_worker_declared_lost_stops_writing(engine, make_run):
    run_id = make_run(make_config(items=2))
    service = start_worker(engine, slots=1)
    with db.transaction(db.session_factory(engine)) as session:
        ledger.mark_worker_lost(
            session,
            service.worker_id,
            now=service.clock.now(),
            actor="controller",
            reason="heartbeat stopped",
        )
    service.serve(lambda: False)  # returns at once: its first heartbeat is refused
    assert service.revoked is not None and "no longer active" in service.revoked
    assert not service.trusts_its_leases()
    assert attempts(engine, run_id) == []


def run_with_token(engine, make_run, code: str, variable: str):
    """One job running ``python -c CODE`` with API_TOKEN set from environment variable
    ``variable`` (the config names it, as a secret is named), driven to its end by one
    worker; returns its attempt."""
    stage = {
        "name": "leaky",
        "argv": [sys.executable, "-c", escape(code)],
        "env": {"API_TOKEN": f"${{{variable}}}"},
        "timeout_seconds": 30,
    }
    run_id = make_run(make_config([stage]))
    drive(engine, [start_worker(engine)], run_id)
    (attempt,) = attempts(engine, run_id)
    return attempt


CANARY_JOB = textwrap.dedent(
    """
    import os
    token = os.environ["API_TOKEN"]
    print("calling with", token)
    raise ValueError(f"provider rejected token {token!r}")
    """
)


def test_secret_canary_appears_nowhere_not_even_in_a_traceback(
    engine, runtime, make_run, monkeypatch
):
    canary = "canary-secret-0f9e8d7c6b"
    monkeypatch.setenv("CANARY_SECRET", canary)
    attempt = run_with_token(engine, make_run, CANARY_JOB, "CANARY_SECRET")
    assert attempt.outcome == "failed"
    stderr = (Path(attempt.attempt_dir) / "stderr.log").read_text()
    assert "Traceback" in stderr and "ValueError" in stderr and "[REDACTED]" in stderr
    for path in runtime.rglob("*"):
        if path.is_file():
            assert canary.encode() not in path.read_bytes(), path
    for args in (["status", "--json"], ["status"], ["explain", str(attempt.job_id)]):
        shown = CliRunner().invoke(app, [*args, "--runtime-dir", str(runtime)])
        assert shown.exit_code == 0 and canary not in shown.output


def test_a_freed_slot_is_refilled_before_sampling_and_the_heartbeat(engine, make_run):
    """A tick that settles a finished attempt claims and spawns the next one before it
    samples the process trees or writes its heartbeat (issue 22: nothing periodic
    between a child's exit and the next child's start)."""
    run_id = make_run(make_config([py_stage("only", "pass")], items=3))
    service = start_worker(engine, slots=1)
    log: list[str] = []
    periodic, spawn_all = service._periodic, service.spawning.spawn_all

    def logged_periodic() -> None:
        log.append("periodic")
        periodic()

    def logged_spawn(claims) -> None:
        log.append("spawn")
        spawn_all(claims)

    service._periodic = logged_periodic
    service.spawning.spawn_all = logged_spawn

    def on_tick() -> None:
        log.append("tick")

    drive(engine, [service], run_id, on_tick=on_tick)
    ticks = " ".join(log).split("tick")
    # A tick that spawned after a settle (the second and third attempts) ran the
    # periodic steps after the spawn, never before it.
    refills = [t.split() for t in ticks if t.split() == ["spawn", "periodic"]]
    assert len(refills) == 2, log
    assert not any(t.split() == ["periodic", "spawn"] for t in ticks[1:]), log


def test_an_attempt_whose_supervisor_has_exited_is_not_sampled(engine, make_run):
    """Between a supervisor's exit and the tick that settles its attempt, sampling that
    attempt could only fall back to scanning every process on the machine for its
    markers (a short job's supervisor has often exited by the next sample): it is left
    to the settle."""
    make_run(make_config([py_stage("only", "pass")], items=1))
    service = start_worker(engine, slots=1)
    Controller(engine).tick()
    service.tick()  # claims and spawns
    (flight,) = service.in_flight.values()
    wait_until(lambda: flight.supervisor.poll() is not None, timeout=30)
    assert not flight.exited  # not yet seen by a tick
    sampled: list[list[tuple[int, int | None, str]]] = []
    service.sampler.sample = lambda attempts, gpu=None: sampled.append(attempts) or {}
    service._last_sample = float("-inf")  # a sample is due
    service._sample_if_due()
    assert sampled == []
    service.tick()  # the settle
    assert service.in_flight == {}


def test_an_attempts_first_sample_is_written_with_its_second(engine, make_run, tmp_path):
    """Starting an attempt costs no transaction of samples: its first sample waits for
    the second (or the periodic flush, or its settle), and is written then."""
    from sqlalchemy import event

    gate = tmp_path / "gate"  # the job runs until both samples are taken
    run_id = make_run(make_config([gated_stage("only", gate)], items=1))
    service = start_worker(engine, slots=1)
    service._last_flush = float("inf")  # no periodic flush in this test
    Controller(engine).tick()
    service.tick()  # claims, spawns; its first sample is taken and kept
    (flight,) = service.in_flight.values()
    wait_until(lambda: (service.tick(), flight.peaks.sampled_at)[1] is not None, timeout=30)
    (row,) = attempts(engine, run_id)
    assert row.peak_rss_mib is None  # sampled, not written
    commits: list[int] = []

    def on_commit(_connection):
        commits.append(1)

    event.listen(engine, "commit", on_commit)
    try:
        service._last_sample = float("-inf")
        service._sample_if_due()  # the second sample: both are written now
    finally:
        event.remove(engine, "commit", on_commit)
    assert len(commits) == 1
    (row,) = attempts(engine, run_id)
    assert row.peak_rss_mib is not None
    gate.touch()
    service.drain()


def test_a_claim_remembers_the_events_it_was_claimed_from(engine, make_run):
    """A claim remembers what it has seen, so the worker claims again only after a
    change, and reads no event id after its writes (one statement fewer per claim). On
    SQLite the claim holds the write lock: what it saw is the last event it wrote, taken
    from the insert's returned ids. On PostgreSQL other nodes write meanwhile: it is the
    newest event when the claim began (read in its first statement) and the events the
    claim wrote itself (test_claim_late_lock.py has the race this keeps)."""
    run_id = make_run(make_config([py_stage("only", "pass")], items=2))
    service = start_worker(engine, slots=2)
    with db.session_factory(engine)() as session:
        before = session.scalar(select(func.max(Event.id)))
    with statements(engine) as counted:
        report = service.tick()
    assert report.claimed == 2
    with db.session_factory(engine)() as session:
        # The claim's own: identities recorded after it (attempt_running) may follow.
        own = session.scalars(
            select(Event.id)
            .where(Event.id > before, Event.kind != "attempt_running")
            .order_by(Event.id)
        ).all()
    assert own, "the claim wrote its intents' events"
    if db.is_sqlite(engine):
        assert (service._seen_event, service._own_events) == (own[-1], [])
    else:
        assert (service._seen_event, sorted(service._own_events)) == (before, own)
    newest_reads = sum(n for sql, n in counted.items() if "max(events.id)" in sql)
    assert newest_reads == 0, counted
    drive(engine, [service], run_id)
