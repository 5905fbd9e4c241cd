from __future__ import annotations

import pytest

from workers.redact import MASK, Redactor

SECRET = "s3cr3t-value-123"


def run(redactor: Redactor, chunks: list[bytes]) -> bytes:
    return b"".join(redactor.feed(c) for c in chunks) + redactor.flush()


@pytest.mark.parametrize("split", range(1, len(SECRET)))
def test_secret_split_across_two_reads_is_caught(split):
    text = f"token={SECRET}; done".encode()
    cut = text.index(SECRET.encode()) + split
    out = run(Redactor([SECRET]), [text[:cut], text[cut:]])
    assert SECRET.encode() not in out
    assert out == b"token=" + MASK + b"; done"


def test_byte_at_a_time_and_several_secrets():
    other = "another-one"
    text = f"a {SECRET} b {other} c {SECRET}".encode()
    out = run(Redactor([SECRET, other]), [bytes([b]) for b in text])
    assert out == b"a " + MASK + b" b " + MASK + b" c " + MASK


def test_nothing_to_redact_passes_through_unchanged():
    assert run(Redactor([]), [b"abc", b"def"]) == b"abcdef"
    assert run(Redactor(["xy"]), [b"xy"]) == b"xy"  # too short to redact meaningfully
