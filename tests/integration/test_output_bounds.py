"""Issue 18, items 3 and 14: matching a stage's declared outputs is bounded and never
follows a link, and an output over the stage's ``output_max_mib`` is not stored. Real
`laneway run` processes, each bounded by a timeout: the old glob walked a loop of
directory links for ever (the attempt never settled, the worker stopped
heartbeating), so the bound turns that hang into a failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from laneway.controller import db, ledger_open
from laneway.controller.models import Artifact, Attempt, Job
from tests.integration.test_cli_services import LANEWAY, ROOT
from tests.support import escape

BOUND = 90  # seconds: a hung `laneway run` fails the test instead of hanging it

LOOPS = """
import os
os.makedirs("out/deeper", exist_ok=True)
open("out/deeper/result.txt", "w").write("the answer")
for name in ("a", "b", "out/loop", "out/deeper/up"):
    os.symlink(".", name)          # ln -s . a; ln -s . b: 2^40 paths for glob.glob
os.symlink("/", "root")            # and the whole machine behind one more
os.symlink("out/deeper/result.txt", "alias.txt")
"""

SPARSE = """
with open("model.bin", "wb") as f:
    f.truncate(2 << 30)            # 2 GiB, no blocks: it was copied whole into the store
"""

BIG = """
open("weights.bin", "wb").write(b"w" * (2 << 20))
"""


def run_pipeline(tmp_path: Path, runtime: Path, stages: list[dict[str, Any]]) -> None:
    body = {
        "name": "bounds",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": stages,
        "items": [{"key": "x0", "lane": "a"}],
    }
    config = tmp_path / "bounds.json"
    config.write_text(json.dumps(body))
    try:
        subprocess.run(
            [*LANEWAY, "run", str(config), "--runtime-dir", str(runtime)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=BOUND,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`laneway run` did not finish within {BOUND} s: {exc.stderr!r:.2000}")


def stage(name: str, code: str, outputs: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "argv": [sys.executable, "-c", escape(code)],
        "outputs": outputs,
        "timeout_seconds": 30,
        **extra,
    }


def settled(runtime: Path) -> dict[str, Attempt]:
    engine = ledger_open.open_ledger(runtime)
    try:
        with db.session_factory(engine)() as session:
            found = session.execute(
                select(Job.stage, Attempt).join(Attempt, Attempt.job_id == Job.id)
            ).all()
            artifacts = session.scalars(select(Artifact)).all()
            session.expunge_all()
    finally:
        engine.dispose()
    by_stage = {stage_name: attempt for stage_name, attempt in found}
    for attempt in by_stage.values():
        attempt.stored = sorted(a.name for a in artifacts if a.attempt_id == attempt.id)
    return by_stage


def test_a_doublestar_glob_over_directory_link_loops_settles(tmp_path: Path, runtime: Path):
    run_pipeline(tmp_path, runtime, [stage("loops", LOOPS, ["**/*.txt"])])
    attempt = settled(runtime)["loops"]
    assert attempt.outcome == "succeeded", attempt.state_reason
    # Only the real file, found once: no link is walked or handed over.
    assert attempt.stored == ["out/deeper/result.txt"]


def test_an_output_over_its_cap_is_a_harness_failure_and_not_stored(tmp_path: Path, runtime: Path):
    run_pipeline(
        tmp_path,
        runtime,
        [
            stage("sparse", SPARSE, ["model.bin"]),  # the default cap, 1024 MiB
            stage("big", BIG, ["weights.bin"], output_max_mib=1),
        ],
    )
    attempts = settled(runtime)
    sparse, big = attempts["sparse"], attempts["big"]
    assert sparse.outcome == "harness_failure" and sparse.stored == []
    assert "model.bin is 2147483648 bytes" in sparse.state_reason
    assert "output_max_mib (1024 MiB)" in sparse.state_reason
    assert big.outcome == "harness_failure" and big.stored == []
    assert "output_max_mib (1 MiB)" in big.state_reason
    store = runtime / "artifacts"
    assert not store.exists() or not [p for p in store.rglob("*") if p.is_file()]


BAD_NAME = """
import os
os.makedirs("out", exist_ok=True)
with open(os.path.join(b"out", b"\\xff.txt"), "wb") as f:   # not UTF-8
    f.write(b"x")
"""


def test_an_output_whose_name_is_not_utf8_settles_with_a_reason(tmp_path: Path, runtime: Path):
    """Before, the name reached the settle as a lone surrogate and the ledger's encode
    raised inside the transaction: the worker died, and so did every restarted one."""
    run_pipeline(tmp_path, runtime, [stage("named", BAD_NAME, ["out/*.txt"])])
    attempt = settled(runtime)["named"]
    assert attempt.state == "settled" and attempt.outcome == "harness_failure"
    assert "not printable UTF-8" in attempt.state_reason and attempt.stored == []
