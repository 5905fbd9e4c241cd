"""Costs follow the work, not the backlog: the statements a claim, a settle and an idle
controller tick run are the same at 40 jobs and at 1,600, and the controller's safety
net promotes what in-transaction promotion missed by following events, not by sweeping.
(Counts of statements, never times.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from sqlalchemy import select

from laneway.controller import db, ledger, ledger_open
from laneway.controller.daemon import Controller, ControllerReport
from laneway.controller.models import Attempt, Decision, Job, Lease, Reservation, StageStats
from laneway.controller.states import JobState, Outcome
from tests import backends
from tests.support import claim_on_n1, make_config, py_stage, settle_one, statements

THREE_STAGES = [
    py_stage("prepare", "pass"),
    py_stage("solve", "pass", needs=["prepare"]),
    py_stage("judge", "pass", needs=["solve"]),
]


def backlog(make_run, items: int) -> int:
    return make_run(
        make_config(
            THREE_STAGES,
            [{"key": f"i{n}", "lane": "a" if n % 2 else "b"} for n in range(items)],
            lanes=[{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}],
        )
    )


def one_cycle(engine, factory, make_run, register_worker, clock, items: int) -> dict[str, int]:
    """Statements of one claim, one settle and one idle controller tick on a run of
    ``items`` items x 3 stages (every prepare ready, everything else waiting)."""
    backlog(make_run, items)
    worker = register_worker()
    # Its time-driven steps fixed, so only the backlog differs between the two sizes:
    # the lost-worker and lease look only on the first tick (recovery_seconds), and a
    # status snapshot in every tick that follows a change (snapshot_seconds=0), never
    # in whichever later tick a slow machine lets a second pass.
    controller = Controller(engine, clock=clock, recovery_seconds=3600, snapshot_seconds=0)
    controller.tick()  # its first tick makes the one full pass
    with statements(engine) as claim_count:
        (claim,) = claim_on_n1(factory, worker, clock)
    with statements(engine) as settle_count:
        settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED)
    controller.tick()  # sees the settle
    with statements(engine) as tick_count:
        controller.tick()
    writes = [t for t in tick_count if t.split()[0] in ("INSERT", "UPDATE", "DELETE")]
    assert writes == [] and "BEGIN IMMEDIATE" not in tick_count  # no write lock taken
    return {
        "claim": sum(claim_count.values()),
        "settle": sum(settle_count.values()),
        "idle tick": sum(tick_count.values()),
    }


def test_claim_settle_and_idle_tick_run_the_same_statements_at_any_backlog(
    tmp_path, migrated_template, clock, ledger_backend, monkeypatch
):
    counts = {}
    for size, items in (("small", 20), ("large", 800)):
        if ledger_backend == "postgres":  # a database of its own for each size
            name = backends.create_database()
            monkeypatch.setenv("LANEWAY_DATABASE_URL", backends.database_url(name))
        try:
            counts[size] = one_cycle_in(tmp_path / size, migrated_template, clock, items)
        finally:
            if ledger_backend == "postgres":
                backends.drop_database(name)
    small, large = counts["small"], counts["large"]
    assert small == large, (small, large)
    # An idle tick writes nothing and reads only what is live (a handful of probes).
    assert small["idle tick"] <= 8, small


def one_cycle_in(directory, template, clock, items: int) -> dict[str, int]:
    directory.mkdir()
    if db.ledger_url(directory).startswith("sqlite"):
        shutil.copy(template, directory / db.LEDGER_FILENAME)
    engine = ledger_open.open_ledger(directory)
    factory = db.session_factory(engine)

    def make_run(config):
        with db.transaction(factory) as session:
            return ledger.create_run(
                session,
                config,
                runtime_dir=str(directory),
                source_hashes={},
                actor="test",
                now=clock.now(),
            ).id

    def register_worker():
        with db.transaction(factory) as session:
            return ledger.register_worker(
                session,
                node="n1",
                host="h",
                pid=os.getpid(),
                boot_id="b",
                process_start_time=None,
                slots=2,
                now=clock.now(),
            )

    try:
        return one_cycle(engine, factory, make_run, register_worker, clock, items)
    finally:
        engine.dispose()


def test_the_controller_promotes_what_a_settle_left_waiting(engine, factory, make_run, clock):
    """The safety net: a job that ended without its item being promoted (here moved by
    hand, as a writer that crashed between two steps would leave it) is promoted by
    the controller's next tick, which finds it through the event log."""
    run_id = make_run(make_config(THREE_STAGES, 3))
    controller = Controller(engine, clock=clock)
    controller.tick()
    with factory() as session:
        prepare = session.scalars(
            select(Job.id).where(Job.run_id == run_id, Job.stage == "prepare").order_by(Job.id)
        ).first()
    with db.transaction(factory) as session:
        ledger.move_job(
            session, prepare, JobState.READY, JobState.CANCELLED, now=clock.now(), actor="test"
        )
    report = controller.tick()
    assert report.promoted == 2  # solve and judge of that item: skipped
    with factory() as session:
        states = dict(
            session.execute(
                select(Job.stage, Job.state).where(
                    Job.item_id == select(Job.item_id).where(Job.id == prepare).scalar_subquery()
                )
            ).all()
        )
    assert states == {"prepare": "cancelled", "solve": "skipped", "judge": "skipped"}


def test_a_tick_reads_backoffs_and_closeouts_only_after_events_that_change_them(
    engine, factory, make_run, register_worker, clock
):
    """A job that succeeded cannot start a retry backoff nor make a run owe a closeout,
    so the tick that sees it reads neither; nor, in a run where no stage needs another,
    which of its items have jobs waiting; nor the newest event id again for the status
    snapshot (the events it just read say it). A job made ready again to retry is looked
    at, and its backoff is released once it has passed, with no event in between."""
    retry = {"max_attempts": 3, "on": ["infra_failure"], "backoff_seconds": 30}
    make_run(make_config([py_stage("call", "pass", retry=retry)], 3))
    worker = register_worker()
    controller = Controller(engine, clock=clock, recovery_seconds=3600, snapshot_seconds=3600)
    controller.tick(clock.now())  # the first tick makes its full pass and looks at both
    first, second = claim_on_n1(factory, worker, clock, slots=2)

    def tick() -> tuple[str, ControllerReport]:
        with statements(engine) as counted:
            report = controller.tick(clock.now())  # the test's clock on every backend
        return "\n".join(counted), report

    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    read, _ = tick()
    assert "FROM events" in read  # it saw the settle
    assert "retry_after" not in read
    assert "closeout_finished_at IS NULL" not in read
    assert "DISTINCT jobs.item_id" not in read
    assert "max(events.id)" not in read

    settle_one(factory, second, worker, clock, Outcome.INFRA_FAILURE)  # ready, backing off
    read, report = tick()
    assert "min(jobs.retry_after)" in read and report.promoted == 0
    assert "closeout_finished_at IS NULL" not in read
    read, _ = tick()
    assert "retry_after" not in read  # nothing new, and the backoff has not passed

    clock.advance(30)
    read, report = tick()
    assert "retry_after" in read and report.promoted == 1


def test_a_tick_reads_through_one_connection_on_postgresql(
    engine, factory, make_run, register_worker, clock, on_postgres
):
    """On PostgreSQL a tick's reads (the events since its cursor, the closing look, the
    status snapshot) share one session, so the tick checks one connection out of the
    pool for all of them. On SQLite each step reads in a session of its own: a session
    there keeps one snapshot, and a step must see what the steps before it wrote."""
    from sqlalchemy import event

    make_run(make_config([py_stage("only", "pass")], 2))
    worker = register_worker()
    controller = Controller(engine, clock=clock, recovery_seconds=3600, snapshot_seconds=0)
    controller.tick(clock.now())  # the first tick makes its full pass
    first, _ = claim_on_n1(factory, worker, clock, slots=2)
    settle_one(factory, first, worker, clock, Outcome.SUCCEEDED)
    checkouts: list[tuple[object, ...]] = []

    def checkout(*args: object) -> None:
        checkouts.append(args)

    # SQLite's reads go through a read-only engine of their own, with its own pool.
    pools = {engine.pool, db.reader(engine).kw["bind"].pool}
    for pool in pools:
        event.listen(pool, "checkout", checkout)
    try:
        with statements(engine) as counted:
            report = controller.tick(clock.now())
    finally:
        for pool in pools:
            event.remove(pool, "checkout", checkout)
    read = "\n".join(counted)
    assert "FROM events" in read and "EXISTS" in read  # the changes and the closing look
    assert "FROM attempts" in read  # the status snapshot
    assert report.closed == [] and report.promoted == 0  # nothing written: reads only
    assert len(checkouts) == (1 if on_postgres else 3), counted


def test_a_claim_writes_its_grants_in_one_statement_per_table(
    engine, factory, make_run, register_worker, clock
):
    """Three grants: one move of the three jobs, one insert of the three intents, one
    of the three leases and one of the three reservations, each row bound to its own
    job and attempt."""
    make_run(make_config([py_stage("only", "pass")], 3))
    worker = register_worker()
    with statements(engine) as counted:
        claims = claim_on_n1(factory, worker, clock, slots=3)
    assert len(claims) == 3
    writes = {
        table: sum(n for sql, n in counted.items() if sql.startswith(table))
        for table in (
            "UPDATE jobs ",
            "INSERT INTO attempts ",
            "INSERT INTO leases ",
            "INSERT INTO reservations ",
        )
    }
    assert set(writes.values()) == {1}, writes
    with factory() as session:
        for claim in claims:
            attempt = session.get(Attempt, claim.attempt_id)
            job = session.get(Job, claim.job_id)
            assert (attempt.job_id, attempt.idempotency_key) == (
                claim.job_id,
                claim.idempotency_key,
            )
            assert (attempt.number, attempt.fence) == (job.attempt_count, job.fence)
            assert (job.state, claim.fence) == (JobState.RUNNING, job.fence)
            lease = session.scalars(select(Lease).where(Lease.attempt_id == claim.attempt_id)).one()
            assert (lease.job_id, lease.fence) == (claim.job_id, claim.fence)
            reservation = session.scalars(
                select(Reservation).where(Reservation.attempt_id == claim.attempt_id)
            ).one()
            assert reservation.node == "n1" and reservation.released_at is None


def test_a_claim_reads_peaks_only_for_a_stage_that_uses_them_and_its_stoppers_once(
    engine, factory, make_run, register_worker, clock
):
    """A claim reads the node's held slots and unreleased memory with its row (a node
    without GPUs reads no reservation rows), the active controls and the unknown
    attempts in one statement, and a stage's measured peaks only when a stage to start
    learns its memory: none for a plain stage, one read for a learning one."""

    def reads(counted) -> dict[str, list[str]]:
        selects = [sql for sql, n in counted.items() for _ in range(n) if sql.startswith("SELECT")]
        return {
            what: [sql for sql in selects if key in sql]
            for what, key in (
                ("node", "FROM nodes"),
                ("controls", "FROM controls"),
                ("peaks", "FROM stage_stats"),
            )
        }

    make_run(make_config([py_stage("plain", "pass")], 1))
    worker = register_worker()
    with statements(engine) as plain:
        assert len(claim_on_n1(factory, worker, clock)) == 1
    learning = py_stage("learn", "pass", memory_mib=10, learn_memory=True)
    make_run(make_config([learning], 1))
    with statements(engine) as learn:
        assert len(claim_on_n1(factory, worker, clock)) == 1
    for counted, peaks in ((plain, 0), (learn, 1)):
        seen = reads(counted)
        (node,) = seen["node"]
        assert "count(*)" in node  # the node's held slots, with its row
        assert "sum(CASE" in node  # and its unreleased reservations: no GPU, no row read
        assert not [sql for sql in counted if sql.startswith("SELECT reservations.")]
        (stoppers,) = seen["controls"]
        assert "UNION ALL" in stoppers and "attempts.state" in stoppers  # and unknown ones
        assert len(seen["peaks"]) == peaks, counted


def test_a_settle_reads_no_row_back(engine, factory, make_run, register_worker, clock):
    """What a settle needs of its job (stage, item, attempts so far, group) and of its run
    (the config hash) comes back with its compare-and-set on the attempt: it reads
    nothing of its own."""
    make_run(make_config([py_stage("only", "pass")], 1))
    worker = register_worker()
    (claim,) = claim_on_n1(factory, worker, clock)
    with statements(engine) as counted:
        assert settle_one(factory, claim, worker, clock, Outcome.SUCCEEDED) is JobState.SUCCEEDED
    # On PostgreSQL the transaction's first statement takes the write lock (a SELECT of
    # pg_advisory_xact_lock, with the ledger's clock): not a read of the ledger.
    reads = [sql for sql in counted if sql.startswith("SELECT") and "pg_advisory" not in sql]
    assert reads == []
    assert any(sql.startswith("UPDATE attempts") and "config_sha256" in sql for sql in counted)


def test_settled_peaks_are_folded_into_the_stage_row(
    engine, factory, make_run, register_worker, clock
):
    make_run(make_config(items=3))
    worker = register_worker()
    peaks = [300.0, 700.0, 500.0]
    for peak in peaks:
        (claim,) = claim_on_n1(factory, worker, clock)
        settle_one(
            factory,
            claim,
            worker,
            clock,
            Outcome.SUCCEEDED,
            measured={"peak_rss_mib": peak, "current_rss_mib": peak, "sampled_at": clock.now()},
        )
    with factory() as session:
        row = session.scalars(select(StageStats)).one()
    assert (row.peak_rss_mib, row.measured) == (700.0, 3)


def test_the_supervisor_starts_on_the_standard_library_alone():
    """It starts once per attempt: ``launch_argv`` runs it without site-packages, and
    importing it pulls in nothing from outside the standard library and laneway."""
    from laneway.workers import supervisor

    argv = supervisor.launch_argv("{}")
    code = supervisor.PACKAGE + (
        "import laneway.workers.supervisor; "
        "print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    out = subprocess.run(
        [argv[0], "-I", "-S", "-c", code, "-", supervisor.ROOT],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    foreign = {"sqlalchemy", "pydantic", "psutil", "typer", "alembic", "pynvml", "site"}
    assert foreign.isdisjoint(out), foreign & set(out)
    assert "laneway" in out and argv[1:3] == ["-I", "-S"]
    assert "laneway.workers.supervisor" in argv  # how a restarted worker finds it
    assert sys.executable == argv[0]


def test_a_run_is_created_in_the_same_statements_at_any_size(engine, make_run):
    """Items and jobs are written in one executemany each (not one INSERT and flush per
    item): creating a run of 300 items runs the statements one of 10 does. (Below
    psycopg's page of 1,000 rows, which splits a larger executemany.)"""
    counts = []
    for items in (10, 300):
        with statements(engine) as counted:
            backlog(make_run, items)
        counts.append(sum(counted.values()))
    assert counts[0] == counts[1], counts


def test_a_lane_with_ready_jobs_is_not_asked_whether_jobs_wait(
    engine, factory, make_run, register_worker, clock
):
    """A lane's reason `needs_pending` (waiting on earlier stages) is given only where the
    lane has no ready job, so a claim asks whether jobs wait only there: a busy lane
    costs no such read."""
    run_id = make_run(make_config(THREE_STAGES[:2], items=2))
    worker = register_worker()

    def waiting_reads() -> int:
        return sum(n for text, n in counted.items() if "WHERE EXISTS (SELECT" in text)

    with statements(engine) as counted:  # a prepare job is ready: no read
        assert [c.stage for c in claim_on_n1(factory, worker, clock)] == ["prepare"]
    assert waiting_reads() == 0
    claim_on_n1(factory, worker, clock)  # the other prepare job
    with statements(engine) as counted:  # only solve jobs, waiting: read, and said
        assert claim_on_n1(factory, worker, clock) == []
    assert waiting_reads() == 1
    with factory() as session:
        reasons = [
            row.reason_code
            for row in session.scalars(
                select(Decision).where(Decision.run_id == run_id).order_by(Decision.id)
            )
        ]
    assert reasons[-1] == "needs_pending"


def test_the_snapshot_counts_what_live_reservations_have_not_grown_into(
    engine, factory, make_run, register_worker, clock
):
    """The node's unreleased memory, summed in the ledger with the node's row: a 1000
    MiB reservation whose attempt uses 300 MiB holds 700 more; one whose attempt grew
    past it (1200 MiB) holds none, never less; a released one nothing."""
    from sqlalchemy import update

    from laneway.controller.ledger.snapshot import admission_snapshot
    from laneway.controller.models import Attempt

    make_run(make_config([py_stage("big", "pass", memory_mib=1000)], 3))
    worker = register_worker()
    grown, growing, released = claim_on_n1(factory, worker, clock, slots=3)
    with db.transaction(factory) as session:
        for claim, rss in ((grown, 1200.0), (growing, 300.0)):
            session.execute(
                update(Attempt).where(Attempt.id == claim.attempt_id).values(current_rss_mib=rss)
            )
        session.execute(
            update(Reservation)
            .where(Reservation.attempt_id == released.attempt_id)
            .values(released_at=clock.now())
        )
    with factory() as session:
        snapshot, _ = admission_snapshot(session, node="n1", free_slots=1, mem=64_000.0)
    assert snapshot.node.reserved_mib == 700.0
    assert snapshot.node.running == 3  # a released reservation still holds its slot
