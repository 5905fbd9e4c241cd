"""Issue 18, item 7: a job can write its attempt directory (and its run's), so a link it
plants there must never make laneway write or read outside the attempt. Real worker,
supervisors and jobs; each case plants a real symlink at a name laneway will use and
checks that the file or directory it points at is unchanged and never printed."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db
from laneway.controller.models import Attempt, Control, Event, Job
from laneway.controller.web import Dashboard
from tests.integration.test_cli import invoke
from tests.integration.test_worker import drive, start_worker
from tests.support import escape, make_config, py_stage, wait_until

PRECIOUS = b"precious: not the job's to overwrite\n"
SHADOW = "root:$6$not-for-the-dashboard:19000:0:99999:7:::"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside every attempt directory, readable only by its owner."""
    path = tmp_path / "outside.txt"
    path.write_bytes(PRECIOUS)
    path.chmod(0o644)
    return path


def plant(name: str, target: Path, then: str = "sys.exit(7)") -> str:
    """A job that replaces ``$LANEWAY_ATTEMPT_DIR/<name>`` by a symlink to ``target``."""
    return (
        "import os, sys\n"
        f"path = os.path.join(os.environ['LANEWAY_ATTEMPT_DIR'], {name!r})\n"
        "if os.path.lexists(path): os.remove(path)\n"
        f"os.symlink({str(target)!r}, path)\n"
        "open(os.path.join(os.environ['LANEWAY_WORKSPACE'], 'a.txt'), 'w').write('a')\n"
        f"{then}\n"
    )


def events_of(engine, kind: str) -> list[dict]:
    with db.session_factory(engine)() as session:
        return [e.detail for e in session.scalars(select(Event).where(Event.kind == kind))]


def test_a_planted_capture_partial_is_refused_and_the_file_it_points_at_untouched(
    engine, make_run, outside
):
    """(a) Before: the capture opened ``capture.tar.gz.partial`` with O_TRUNC through the
    link: the outside file was truncated, overwritten with the archive, chmodded 0600."""
    stage = py_stage("s", plant("capture.tar.gz.partial", outside), capture={"max_mib": 1})
    run_id = make_run(make_config([stage]))
    drive(engine, [start_worker(engine)], run_id)
    assert outside.read_bytes() == PRECIOUS
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    (failed,) = wait_until(lambda: events_of(engine, "capture_failed"))
    assert "exists already" in failed["error"]
    assert events_of(engine, "capture_recorded") == []
    with db.session_factory(engine)() as session:
        attempt = session.scalars(select(Attempt)).one()
    assert attempt.outcome == "failed" and attempt.exit_code == 7  # unchanged by it
    assert not (Path(attempt.attempt_dir) / "capture.tar.gz").exists()


def test_a_planted_exit_record_partial_is_not_written_through(engine, make_run, outside):
    """The supervisor's exit.json is written through ``durable.write_bytes``: its
    ``*.partial`` planted as a link is removed and recreated exclusively, so the exit
    record is whole and the outside file untouched."""
    run_id = make_run(make_config([py_stage("s", plant("exit.json.partial", outside))]))
    drive(engine, [start_worker(engine)], run_id)
    assert outside.read_bytes() == PRECIOUS
    with db.session_factory(engine)() as session:
        attempt = session.scalars(select(Attempt)).one()
    assert attempt.outcome == "failed" and attempt.exit_code == 7
    record = Path(attempt.attempt_dir) / "exit.json"
    assert not record.is_symlink() and json.loads(record.read_text())["exit_code"] == 7


def test_a_log_replaced_by_a_link_is_refused_by_logs_and_the_dashboard(tmp_path: Path):
    """(b) Before: ``laneway logs`` and the dashboard's attempt view opened
    ``stdout.log`` by name and printed what the link pointed at."""
    shadow = tmp_path / "shadow"
    shadow.write_text(SHADOW + "\n")
    body = {
        "name": "links",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {
                "name": "only",
                "argv": [sys.executable, "-c", escape(plant("stdout.log", shadow, "print('x')"))],
                "timeout_seconds": 60,
            }
        ],
        "items": [{"key": "x0", "lane": "a"}],
    }
    config = tmp_path / "links.json"
    config.write_text(json.dumps(body))
    runtime = tmp_path / "rt"
    ran = invoke("run", str(config), "--runtime-dir", str(runtime))
    assert ran.exit_code == 0, ran.output
    for args in (["1"], ["1", "--tail", "5"], ["1", "--json"], ["x0.only", "--tail", "1"]):
        shown = invoke("logs", *args, "--runtime-dir", str(runtime))
        assert shown.exit_code == 1, shown.output
        assert SHADOW not in shown.output
        assert "stdout.log" in shown.output and "link" in shown.output, shown.output
    dashboard = Dashboard(runtime)
    try:
        view = dashboard.attempt(1)
    finally:
        dashboard.close()
    assert (
        view["logs"]["stdout"]["text"] is None and "link" in view["logs"]["stdout"]["unavailable"]
    )
    assert SHADOW not in json.dumps(view)
    assert shadow.read_text() == SHADOW + "\n"


CONSUMER = "os.path.join(os.environ['LANEWAY_ATTEMPT_DIR'], '..', '..', sys.argv[1] + '.consume')"
PLANTS = {
    # The consumer's inputs/prepare, made ahead of it as a link out of the runtime dir.
    "inputs": (
        "import os, sys\n"
        f"inputs = os.path.join({CONSUMER}, 'attempt-1', 'inputs')\n"
        "os.makedirs(inputs)\n"
        "os.symlink(sys.argv[2], os.path.join(inputs, 'prepare'))\n"
    ),
    # The consumer's job directory itself, a link: its whole attempt would live there.
    "job dir": "import os, sys\nos.symlink(sys.argv[2], " + CONSUMER + ")\n",
}


@pytest.mark.parametrize("planted", sorted(PLANTS))
def test_a_producer_cannot_redirect_its_consumers_inputs(
    engine, make_run, tmp_path: Path, planted: str
):
    """(c) Before: ``fetch`` made ``inputs/<stage>`` with ``make_private_dir`` (an
    existing link counts as a directory) and wrote the verified inputs through it, out
    of the runtime dir. Now the attempt directory must not exist before its attempt
    starts, and the directories from the run's down are entered without following a
    link: the consumer is refused (harness_failure, run paused), nothing is written."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    produce = PLANTS[planted] + "open('x.txt', 'w').write('verified bytes')\n"
    stages = [
        {
            "name": "prepare",
            "argv": [sys.executable, "-c", escape(produce), "{item}", str(elsewhere)],
            "outputs": ["x.txt"],
            "timeout_seconds": 30,
        },
        py_stage("consume", "print(open('../inputs/prepare/x.txt').read())", needs=["prepare"]),
    ]
    run_id = make_run(make_config(stages))
    worker = start_worker(engine)

    def consumer_settled() -> Attempt | None:
        worker.tick()
        with db.session_factory(engine)() as session:
            return session.scalars(
                select(Attempt)
                .join(Job, Job.id == Attempt.job_id)
                .where(Job.stage == "consume", Attempt.state == "settled")
            ).first()

    consumer = wait_until(consumer_settled)
    assert consumer.outcome == "harness_failure"
    assert "not started" in consumer.state_reason and "attempt directory" in consumer.state_reason
    assert list(elsewhere.iterdir()) == []  # nothing of the consumer's landed outside
    with db.session_factory(engine)() as session:
        paused = session.scalars(select(Control).where(Control.run_id == run_id)).all()
    assert [c.kind for c in paused] == ["pause"]
