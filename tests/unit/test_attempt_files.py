"""Issue 47, item 7: the files a settle reads from an attempt directory (exit.json,
result.json) are read through ``durable.AttemptDir``: regular files only, no link
followed, a FIFO never waited on, a bounded size. What the job made of them is its own
doing: an invalid result (``failed``) or an untrusted exit record (unknown), never
``harness_failure``, never a hang."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from laneway.controller.durable import AttemptDir, PathRefused
from laneway.controller.outcome import EXIT_MAX_BYTES, read_outcome
from laneway.controller.states import Outcome

JOB_ID = 7
CODES = {0: Outcome.SUCCEEDED}


def judged(directory: Path, requirement: str = "optional"):
    return read_outcome(
        directory,
        job_id=JOB_ID,
        exit_codes=CODES,
        missing_exit="no exit.json",
        result_requirement=requirement,  # type: ignore[arg-type]
    )


def exit_record(directory: Path) -> None:
    (directory / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None}))


def test_a_result_linked_to_a_valid_result_outside_is_not_followed(tmp_path: Path):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"job_id": JOB_ID}))  # followed: a success
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    exit_record(attempt)
    (attempt / "result.json").symlink_to(outside)
    verdict, _, result = judged(attempt)
    assert result is None and verdict.outcome is Outcome.FAILED
    assert verdict.diagnostics == [
        "result.json is a symlink; laneway follows no link under an attempt directory"
    ]


def test_a_dangling_result_link_is_refused_not_missing(tmp_path: Path):
    exit_record(tmp_path)
    (tmp_path / "result.json").symlink_to(tmp_path / "nowhere")
    verdict, _, _ = judged(tmp_path)
    assert verdict.outcome is Outcome.FAILED and "symlink" in verdict.reason


def test_a_result_the_job_made_unreadable_is_invalid_not_a_harness_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    exit_record(tmp_path)
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"job_id": JOB_ID}))
    path.chmod(0)  # the job's doing; root reads it anyway, so the refusal is simulated
    real = AttemptDir.read_bytes

    def denied(self: AttemptDir, relative: str, limit: int) -> bytes:
        if relative == "result.json":
            raise PermissionError(errno.EACCES, "Permission denied", relative)
        return real(self, relative, limit)

    monkeypatch.setattr(AttemptDir, "read_bytes", denied)
    verdict, _, _ = judged(tmp_path)
    assert verdict.outcome is Outcome.FAILED
    assert verdict.reason == (
        "exit 0 but result.json cannot be read as the job left it: Permission denied"
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "link", "directory"])
def test_an_exit_record_that_is_not_a_regular_file_is_not_trusted(tmp_path: Path, kind: str):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"exit_code": 0, "signal": None}))
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    target = attempt / "exit.json"
    if kind == "fifo":
        os.mkfifo(target)  # opened by name for reading, it would wait for a writer
    elif kind == "link":
        target.symlink_to(outside)
    else:
        target.mkdir()
    verdict, record, _ = judged(attempt)
    assert record is None and verdict.outcome is None  # unknown: nothing establishes it
    assert verdict.reason.startswith("exit.json is")


def test_an_exit_record_past_its_bound_is_not_read(tmp_path: Path):
    (tmp_path / "exit.json").write_text(json.dumps({"exit_code": 0, "pad": "x" * EXIT_MAX_BYTES}))
    verdict, record, _ = judged(tmp_path)
    assert record is None and verdict.outcome is None
    assert verdict.reason == f"exit.json is larger than the {EXIT_MAX_BYTES} bytes laneway reads"


def test_a_missing_attempt_directory_is_a_missing_exit_record(tmp_path: Path):
    verdict, record, result = judged(tmp_path / "never-made")
    assert (verdict.outcome, verdict.reason, record, result) == (None, "no exit.json", None, None)


def test_an_attempt_directory_that_is_a_link_is_not_entered(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir()
    exit_record(real)
    (tmp_path / "attempt").symlink_to(real)
    verdict, record, _ = judged(tmp_path / "attempt")
    assert record is None and verdict.outcome is None
    assert "cannot be opened" in verdict.reason


def test_read_bytes_refuses_a_file_past_its_limit_by_reading_it(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"abcd")
    with AttemptDir(tmp_path) as directory:
        assert directory.read_bytes("f", 4) == b"abcd"
        with pytest.raises(PathRefused, match="larger than 3 bytes"):
            directory.read_bytes("f", 3)
