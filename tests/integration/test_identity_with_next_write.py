"""An attempt's identity (supervisor and child pids, ``intent -> running``) goes into
the ledger with the worker's next write, its settle or the claim of its successor, and
in a transaction of its own only once it has waited ``identity_wait_seconds``; a worker
that stops records what it read. The crash in that window is in
tests/crash/test_crash_points.py (``worker_after_receipt_before_identity``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from sqlalchemy import event, select

from laneway.controller import db
from laneway.controller.clock import SystemClock
from laneway.controller.models import Attempt
from laneway.controller.states import AttemptState, Outcome
from laneway.workers.service import WorkerService
from tests.support import make_config, py_stage, wait_until

PLENTY = (64_000.0, 128_000.0)


def worker(engine, *, identity_wait_seconds: float) -> WorkerService:
    service = WorkerService(
        engine,
        node="n1",
        slots=1,
        memory_probe=lambda: PLENTY,
        heartbeat_seconds=600.0,  # no heartbeat or sample flush in what is counted
        sample_seconds=600.0,
        sample_flush_seconds=600.0,
        identity_wait_seconds=identity_wait_seconds,
    )
    service.start()
    return service


def attempts(engine, run_id: int) -> list[Attempt]:
    with db.session_factory(engine)() as session:
        return list(
            session.scalars(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.id))
        )


def settled(engine, run_id: int, n: int) -> bool:
    found = attempts(engine, run_id)
    return len(found) == n and all(a.state == AttemptState.SETTLED for a in found)


def drive(service: WorkerService, engine, run_id: int, n: int) -> None:
    """Tick until the run's ``n`` attempts are settled."""

    def done() -> bool:
        service.tick()
        return settled(engine, run_id, n)

    wait_until(done, timeout=60)


def spawned(service: WorkerService) -> bool:
    """Tick; True once an attempt is in flight."""
    service.tick()
    return bool(service.in_flight)


def test_short_attempts_share_one_commit_with_their_settle_and_the_next_claim(engine, make_run):
    """Two one-slot attempts that exit at once: the first claim, then the first's
    identity + settle + the second's claim, then the second's identity + settle: three
    commits on SQLite. Recording each identity on its own would make five."""
    run_id = make_run(make_config([py_stage("s", "pass")], items=2, max_jobs=1))
    service = worker(engine, identity_wait_seconds=600.0)
    commits: list[list[str]] = []
    current: list[str] = []

    def statement(_c, _cur, sql, *_):
        current.append(" ".join(sql.split()[:2]))

    def commit(_c):
        commits.append(list(current))
        current.clear()

    def rollback(_c):  # the test's own reads end so
        current.clear()

    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)
    event.listen(engine, "rollback", rollback)
    try:

        def done() -> bool:
            service.tick()
            return settled(engine, run_id, 2)

        wait_until(done, timeout=60)
    finally:
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "commit", commit)
        event.remove(engine, "rollback", rollback)
    first, second = attempts(engine, run_id)
    assert [a.outcome for a in (first, second)] == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]
    # The commits that moved something (each appends its events); a heartbeat and the
    # first sample flush move nothing.
    writes = [c for c in commits if "INSERT INTO" in c]
    # Each attempt's intent -> running and its settle are in the same commit ...
    assert [c.count("UPDATE attempts") for c in writes if "UPDATE attempts" in c] == [2, 2]
    if db.is_sqlite(engine):  # ... with the next claim (PostgreSQL commits it apart)
        assert len(writes) == 3, "\n".join(map(str, writes))
    for attempt in (first, second):
        assert attempt.supervisor_pid is not None and attempt.child_pid is not None
        # Read with the report: the supervisor has ended by the write that records it.
        assert attempt.supervisor_start_time is not None and attempt.child_start_time
        assert attempt.intent_at <= attempt.started_at <= attempt.settled_at
    service.stop()


def test_started_at_is_when_the_report_was_read_not_when_it_was_recorded(
    engine, make_run, tmp_path
):
    """The job waits for a file the test writes once the worker has read its report (and
    not recorded it: the identity goes with the settle); its ``started_at`` is the time
    the report was read, before the release, not the time of the settle's write."""
    gate = tmp_path / "release"
    code = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)"
    run_id = make_run(make_config([py_stage("s", code)], items=1))
    service = worker(engine, identity_wait_seconds=600.0)

    def report_read() -> bool:
        service.tick()
        return any(f.unrecorded_report is not None for f in service.in_flight.values())

    wait_until(report_read, timeout=60)
    (waiting,) = attempts(engine, run_id)
    assert waiting.started_at is None  # read, not recorded
    released = SystemClock().now()
    gate.touch()
    drive(service, engine, run_id, 1)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == Outcome.SUCCEEDED
    assert attempt.started_at < released < attempt.settled_at
    service.stop()


def test_a_long_attempts_identity_is_recorded_once_it_has_waited(engine, make_run, tmp_path):
    """Nothing else to write: the identity goes in a transaction of its own once it has
    waited ``identity_wait_seconds``, while the job still runs."""
    release = tmp_path / "release"
    code = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.01)"
    run_id = make_run(make_config([py_stage("s", code)], items=1))
    service = worker(engine, identity_wait_seconds=0.05)

    def running() -> Attempt | None:
        service.tick()
        found = attempts(engine, run_id)
        return found[0] if found and found[0].state == AttemptState.RUNNING else None

    attempt = wait_until(running, timeout=60)
    assert not release.exists() and attempt.supervisor_pid is not None
    receipt = json.loads((Path(attempt.attempt_dir) / "receipt.json").read_text())
    assert receipt["supervisor_pid"] == attempt.supervisor_pid
    assert receipt["child_pid"] == attempt.child_pid
    release.touch()
    drive(service, engine, run_id, 1)
    assert attempts(engine, run_id)[0].outcome == Outcome.SUCCEEDED
    service.stop()


def test_a_stopping_worker_records_the_identities_it_read(engine, make_run, tmp_path):
    """A worker that leaves its attempts running (stop without a drain) records the
    identities it has read, however short a time they have waited."""
    release = tmp_path / "release"
    code = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.01)"
    run_id = make_run(make_config([py_stage("s", code)], items=1))
    service = worker(engine, identity_wait_seconds=600.0)

    def read() -> bool:
        service.tick()
        return any(f.unrecorded_report is not None for f in service.in_flight.values())

    wait_until(read, timeout=60)
    assert attempts(engine, run_id)[0].state == AttemptState.INTENT  # still waiting
    service.stop()
    (attempt,) = attempts(engine, run_id)
    assert attempt.state == AttemptState.RUNNING and attempt.supervisor_pid is not None
    release.touch()
    flights = list(service.in_flight.values())
    wait_until(lambda: all(f.supervisor.poll() is not None for f in flights), timeout=60)
    service = worker(engine, identity_wait_seconds=600.0)  # settles it from exit.json
    drive(service, engine, run_id, 1)
    assert attempts(engine, run_id)[0].outcome == Outcome.SUCCEEDED
    service.stop()


def unread_flight(engine, make_run, tmp_path) -> tuple[WorkerService, Any, Any, Path, int]:
    """A worker with one attempt in flight whose supervisor's report it has not read
    (its reads are switched off), the job waiting for ``release``: (service, flight,
    our end of the report pipe, release, run id)."""
    release = tmp_path / "release"
    code = f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.01)"
    run_id = make_run(make_config([py_stage("s", code)], items=1))
    service = worker(engine, identity_wait_seconds=600.0)
    service.spawning.read_reports = lambda: None  # type: ignore[method-assign]  # none arrived
    wait_until(functools.partial(spawned, service), timeout=60)
    (flight,) = service.in_flight.values()
    stream = flight.supervisor.stdout
    assert flight.awaiting_report and stream is not None and not stream.closed
    return service, flight, stream, release, run_id


def test_a_stopping_worker_closes_the_report_pipes_it_never_read(engine, make_run, tmp_path):
    """A worker that stops before a supervisor's report arrived closes its end of that
    pipe (a stopped worker holds no descriptor of an attempt it left running; a dropped
    one would leave it to the garbage collector), and the attempt, whose report then
    fails quietly or lies unread, still ends once, adopted by the next worker."""
    service, flight, stream, release, run_id = unread_flight(engine, make_run, tmp_path)
    service.stop()
    assert stream.closed
    release.touch()
    wait_until(lambda: flight.supervisor.poll() is not None, timeout=60)
    service = worker(engine, identity_wait_seconds=600.0)  # adopts it, settles from exit.json
    drive(service, engine, run_id, 1)
    (attempt,) = attempts(engine, run_id)
    assert attempt.outcome == Outcome.SUCCEEDED
    service.stop()


def test_a_dropped_worker_closes_the_report_pipes_it_never_read(engine, make_run, tmp_path):
    """A worker let go without ``stop`` (a test, an embedding program) closes them too,
    when it is collected, not whenever the garbage collector reaches each pipe."""
    import gc

    service, flight, stream, release, _ = unread_flight(engine, make_run, tmp_path)
    del service
    gc.collect()
    assert stream.closed
    release.touch()
    # Reaped here: started by exec (LANEWAY_PORTABLE), it is this process's child.
    wait_until(lambda: flight.supervisor.poll() is not None, timeout=60)


def test_an_identity_whose_lease_was_revoked_is_refused_and_the_rest_stands(
    engine, make_run, tmp_path
):
    """Two attempts' identities wait; one is made unknown meanwhile (its lease revoked,
    as the controller does when it expires). The other's exit brings the transaction
    that carries both identities: the revoked one is refused before it writes, the
    other's identity and settle commit, and the worker goes on."""
    from laneway.controller import ledger

    code = (
        "import os, sys, time\n"
        f"gate = os.path.join({str(tmp_path)!r}, sys.argv[1])\n"
        "while not os.path.exists(gate): time.sleep(0.01)"
    )
    run_id = make_run(make_config([py_stage("s", code)], items=2, max_jobs=2))
    service = WorkerService(
        engine,
        node="n1",
        slots=2,
        memory_probe=lambda: PLENTY,
        identity_wait_seconds=600.0,
    )
    service.start()

    def both_read() -> bool:
        service.tick()
        flights = list(service.in_flight.values())
        return len(flights) == 2 and all(f.unrecorded_report is not None for f in flights)

    wait_until(both_read, timeout=60)
    revoked, kept = attempts(engine, run_id)
    with db.transaction(db.session_factory(engine)) as session:
        ledger.mark_unknown(
            session, revoked.id, reason="revoked by the test", actor="test", now=revoked.intent_at
        )
    items = {attempt_id: f.claim.item for attempt_id, f in service.in_flight.items()}
    (tmp_path / items[kept.id]).touch()

    def kept_settled() -> bool:
        service.tick()
        return attempts(engine, run_id)[1].state == AttemptState.SETTLED

    wait_until(kept_settled, timeout=60)
    revoked, kept = attempts(engine, run_id)
    assert kept.outcome == Outcome.SUCCEEDED and kept.supervisor_pid is not None
    assert revoked.state == AttemptState.UNKNOWN and revoked.supervisor_pid is None
    (tmp_path / items[revoked.id]).touch()
    wait_until(lambda: service.tick() is not None and not service.in_flight, timeout=60)
    assert attempts(engine, run_id)[0].state == AttemptState.UNKNOWN  # its settle refused
    service.stop()
