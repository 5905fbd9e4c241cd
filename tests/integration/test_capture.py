"""Failure preservation: the workspace of a failed attempt stays; an optional bounded
capture (archive + sha256 manifest) is recorded; a capture failure (ENOSPC) is its own
diagnostic and never changes the known exit code or outcome."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db, faults
from laneway.controller.models import Attempt, Event
from laneway.workers.gpu import FakeGpu
from laneway.workers.service import WorkerService
from tests.integration.test_worker import drive
from tests.support import make_config, py_stage

JOB = (
    "import os, sys\n"
    "w = os.environ['LANEWAY_WORKSPACE']\n"
    "open(os.path.join(w, 'a.txt'), 'w').write('evidence a')\n"
    "os.makedirs(os.path.join(w, 'sub'))\n"
    "open(os.path.join(w, 'sub', 'b.bin'), 'wb').write(b'x' * 5000)\n"
    "sys.exit(7)"
)


def run_failing(engine, make_run, capture):
    run_id = make_run(make_config([py_stage("s", JOB, capture=capture)]))
    service = WorkerService(
        engine, node="n1", slots=1, memory_probe=lambda: (64e3, 128e3), gpu=FakeGpu()
    )
    service.start()
    drive(engine, [service], run_id)
    with db.session_factory(engine)() as session:
        attempt = session.scalars(select(Attempt)).one()
        events = {e.kind: e.detail for e in session.scalars(select(Event))}
    return attempt, events


def test_capture_archives_the_workspace_with_a_manifest(engine, make_run):
    attempt, events = run_failing(engine, make_run, {"max_mib": 1})
    assert attempt.outcome == "failed" and attempt.exit_code == 7
    directory = Path(attempt.attempt_dir)
    assert (directory / "workspace" / "a.txt").read_text() == "evidence a"  # never deleted
    manifest = json.loads((directory / "capture.manifest.json").read_text())
    archive = (directory / "capture.tar.gz").read_bytes()
    assert manifest["archive_sha256"] == hashlib.sha256(archive).hexdigest()
    assert [f["path"] for f in manifest["files"]] == ["a.txt", "sub/b.bin"]
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert tar.extractfile("a.txt").read() == b"evidence a"
    assert events["capture_recorded"]["files"] == 2 and not manifest["truncated"]


def test_capture_respects_its_size_cap(engine, make_run):
    attempt, events = run_failing(engine, make_run, {"max_mib": 0.001})  # ~1 KiB
    manifest = json.loads((Path(attempt.attempt_dir) / "capture.manifest.json").read_text())
    assert manifest["truncated"] and manifest["skipped"] == ["sub/b.bin"]
    assert events["capture_recorded"]["truncated"] is True


@pytest.mark.parametrize("code", ["ENOSPC", "EIO"])
def test_capture_failure_is_its_own_diagnostic(engine, make_run, monkeypatch, code):
    monkeypatch.setenv(faults.ENV, f"capture:1:{code}")
    faults.reset()
    attempt, events = run_failing(engine, make_run, {"max_mib": 1})
    faults.reset()
    assert attempt.outcome == "failed" and attempt.exit_code == 7  # unchanged
    assert "capture_failed" in events and "capture_recorded" not in events
    directory = Path(attempt.attempt_dir)
    assert not (directory / "capture.tar.gz").exists()
    assert not list(directory.glob("*.partial"))
    assert (directory / "workspace" / "a.txt").exists()
