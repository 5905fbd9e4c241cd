"""Issue 47, item 7: a job that makes its result.json a directory, a symlink to a file
outside its attempt, or a FIFO gets an invalid result (``failed``) and its run goes on.

Before: a directory raised IsADirectoryError inside the read, which became
``harness_failure`` ("our own I/O failed") and paused the run; a symlink was followed
(``os.stat`` and ``open`` by name), so a job could make laneway read any file the worker
can (``ln -s /etc/shadow result.json``) and, here, settle as a success it never wrote.
Real worker, supervisors and jobs, both backends.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select

from laneway.controller import db
from laneway.controller.models import Attempt, Control, Event, Item, Job, Run
from tests.integration.test_worker import drive, start_worker
from tests.support import make_config, py_stage

# Each item makes $LANEWAY_RESULT_PATH something else, then exits 0: the result alone
# decides. "link" points at a file outside the attempt holding a valid, succeeding
# result for this very job: followed, the attempt would settle succeeded.
HOSTILE = """
import json, os, sys
kind, path = sys.argv[1], os.environ["LANEWAY_RESULT_PATH"]
job = os.environ["LANEWAY_JOB_ID"]
if kind == "dir":
    os.mkdir(path)
elif kind == "link":
    outside = os.path.join(sys.argv[2], "outside-" + job + ".json")
    with open(outside, "w") as f:
        json.dump({"job_id": job}, f)
    os.symlink(outside, path)
elif kind == "fifo":
    os.mkfifo(path)
else:
    with open(path, "w") as f:
        json.dump({"job_id": job}, f)
"""
REASONS = {
    "dir": "exit 0 but result.json is not a regular file (a directory)",
    "link": "exit 0 but result.json is a symlink; laneway follows no link under an attempt "
    "directory",
    "fifo": "exit 0 but result.json is not a regular file (a FIFO)",
}


def test_a_hostile_result_file_fails_its_attempt_without_pausing_the_run(
    engine, make_run, tmp_path: Path
):
    outside = tmp_path / "outside"
    outside.mkdir()
    stage = py_stage("s", HOSTILE)
    stage["argv"] = [*stage["argv"], str(outside)]
    kinds = [*REASONS, "fine"]
    run_id = make_run(make_config([stage], items=[{"key": k, "lane": "a"} for k in kinds]))
    drive(engine, [start_worker(engine)], run_id)  # finishes: nothing paused it
    with db.session_factory(engine)() as session:
        rows = session.execute(
            select(Item.key, Attempt)
            .join(Job, Job.id == Attempt.job_id)
            .join(Item, Item.id == Job.item_id)
            .where(Attempt.run_id == run_id)
        ).all()
        controls = session.scalars(select(Control).where(Control.run_id == run_id)).all()
        kinds_seen = {e.kind for e in session.scalars(select(Event))}
        assert session.get(Run, run_id).state == "finished"
    found = {key: attempt for key, attempt in rows}
    assert sorted(found) == sorted(kinds)
    for kind, reason in REASONS.items():
        attempt = found[kind]
        assert (attempt.outcome, attempt.exit_code) == ("failed", 0), kind
        assert attempt.state_reason == reason
        assert attempt.result is None  # nothing read through the link
    assert found["fine"].outcome == "succeeded"
    assert controls == [] and "control_pause" not in kinds_seen
    # The file the link pointed at is still there, as the job wrote it: it was not
    # what settled the attempt.
    linked = json.loads((outside / f"outside-{found['link'].job_id}.json").read_text())
    assert linked == {"job_id": str(found["link"].job_id)}
