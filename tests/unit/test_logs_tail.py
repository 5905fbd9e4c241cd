"""``controller.logs.tail_bytes`` / ``read_from``: the last N lines of a log, whatever
its size, block boundaries and final newline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from laneway.controller import logs


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


def bytes_read() -> int:
    """What this process has read so far (``rchar``: every read and pread counted)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_a_32_mib_line_without_newline_reads_only_the_byte_bound(tmp_path: Path):
    """Before: blocks were prepended and every newline recounted for each (32 MiB, no
    newline: the whole file read, about 8 s of CPU). Now at most ``TAIL_MAX_BYTES``
    are read, once."""
    path = tmp_path / "stdout.log"
    with path.open("wb") as log:
        log.write(b"y" * (32 << 20))
    before = bytes_read()
    data, offset = logs.tail_bytes(path, 5)
    spent = bytes_read() - before
    assert offset == 32 << 20
    assert data == b"y" * logs.TAIL_MAX_BYTES  # the end of the one long line
    assert spent <= logs.TAIL_MAX_BYTES + logs.TAIL_BLOCK


def test_the_reads_are_blocks_counted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "stdout.log"
    path.write_bytes(b"z" * (3 * logs.TAIL_BLOCK) + b"\nlast\n")
    reads: list[int] = []
    real = logs.os.pread

    def counted(fd: int, size: int, offset: int) -> bytes:
        reads.append(size)
        return real(fd, size, offset)

    monkeypatch.setattr(logs.os, "pread", counted)
    data, _ = logs.tail_bytes(path, 1)
    assert data == b"last\n" and reads == [logs.TAIL_BLOCK]
    reads.clear()
    data, _ = logs.tail_bytes(path, 2, max_bytes=logs.TAIL_BLOCK + 100)
    assert data == b"z" * (logs.TAIL_BLOCK + 100 - 6) + b"\nlast\n"
    assert sum(reads) == logs.TAIL_BLOCK + 100 and len(reads) == 2


def test_a_log_that_is_a_link_or_a_fifo_is_refused_not_read(tmp_path: Path):
    outside = tmp_path / "shadow"
    outside.write_bytes(b"root:secret-hash\n")
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "stdout.log").symlink_to(outside)
    os.mkfifo(attempt / "stderr.log")
    # A writer held open, so that code opening the FIFO by name fails here, not hangs.
    writer = os.open(attempt / "stderr.log", os.O_RDWR | os.O_NONBLOCK)
    try:
        for name in ("stdout.log", "stderr.log"):
            with pytest.raises(logs.LogRefused):
                logs.tail_bytes(attempt / name, 5)
            with pytest.raises(logs.LogRefused):
                logs.read_from(attempt / name, 0)
    finally:
        os.close(writer)
