"""``controller.logs.tail_bytes`` / ``read_from``: the last N lines of a log, whatever
its size, block boundaries and final newline."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller import logs


@pytest.mark.parametrize("final_newline", [True, False])
@pytest.mark.parametrize("line_length", [1, 100, logs.TAIL_BLOCK + 7])
def test_tail_returns_exactly_the_last_lines(tmp_path: Path, final_newline: bool, line_length: int):
    lines = [f"{i:05d}".ljust(line_length, "x") for i in range(40)]
    body = "\n".join(lines) + ("\n" if final_newline else "")
    path = tmp_path / "stdout.log"
    path.write_text(body)
    for n in (0, 1, 3, 40, 100):
        data, offset = logs.tail_bytes(path, n)
        got = data.decode().splitlines()
        assert got == (lines[-n:] if n else []), n
        assert offset == len(body.encode())
    data, _ = logs.tail_bytes(path, None)
    assert data.decode() == body


def test_tail_of_a_missing_file_is_empty_and_follow_resumes_at_the_offset(tmp_path: Path):
    path = tmp_path / "stderr.log"
    assert logs.tail_bytes(path, 5) == (b"", 0)
    assert logs.read_from(path, 0) == (b"", 0)
    path.write_bytes(b"one\n")
    data, offset = logs.read_from(path, 0)
    assert (data, offset) == (b"one\n", 4)
    with path.open("ab") as log:
        log.write(b"two\n")
    assert logs.read_from(path, offset) == (b"two\n", 8)


def test_follow_drains_what_was_written_after_the_attempt_settled(tmp_path: Path):
    path = tmp_path / "stdout.log"
    path.write_bytes(b"a\n")
    states = iter(["running", "settled"])

    def wait(_seconds: float) -> None:
        # Between the two looks at the attempt's state, the supervisor writes its last
        # bytes and settles: they must still be printed.
        with path.open("ab") as log:
            log.write(b"last\n")

    chunks = list(logs.follow(path, 0, lambda: next(states), wait))
    assert b"".join(chunks) == b"a\nlast\n"
