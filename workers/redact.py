"""Streaming redaction of a job's output before it reaches a log file (invariant 8).

Two stages, each safe across read boundaries:

1. secret values (those resolved from ``${NAME}`` references), and their JSON-escaped,
   URL-encoded and base64 forms, are replaced wherever they occur; a secret may be
   split across two reads, so this stage holds back the
   last ``len(longest secret) - 1`` bytes until the next read (or the end) shows whether
   they start a secret;
2. ``Authorization:`` header values and ``Bearer`` tokens are masked line by line; a
   partial line is held until its newline (or until it grows past ``MAX_LINE``).

Stdlib only: the supervisor imports this.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.parse

MASK = b"[REDACTED]"
MIN_SECRET_LEN = 4
"""Shorter values are not redacted: masking "1" or "yes" everywhere would ruin logs."""
MAX_LINE = 64 * 1024
"""A line longer than this is written without waiting for its end."""

TOKEN_PATTERNS = (
    re.compile(
        rb"(?i)(authorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token)\s+)?)[^\s\"',;]+"
    ),
    re.compile(rb"(?i)(\bbearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
)


_KEYWORD_BEFORE = re.compile(rb"(?i)(bearer|basic|token|authorization[\"']?\s*[:=])[\"']?\s*$")
HOLD_TAIL = 1024


def _safe_cut(buffer: bytes) -> int:
    """Where to cut a line too long to hold whole: at whitespace (tokens have none), not
    right after a keyword whose token follows, keeping at least HOLD_TAIL bytes back."""
    cut = len(buffer) - HOLD_TAIL
    while cut > 0:
        space = max(buffer.rfind(b" ", 0, cut), buffer.rfind(b"\t", 0, cut))
        if space <= 0:
            break
        if not _KEYWORD_BEFORE.search(buffer[:space]):
            return space + 1
        cut = space
    return len(buffer) - HOLD_TAIL


def encoded_forms(secret: bytes) -> set[bytes]:
    """A secret as it may appear in output: raw, JSON-escaped, URL-encoded, and base64
    (standard and URL-safe) at each of the three alignments it can have inside a longer
    encoded string — only the characters that depend on the secret alone are kept."""
    forms = {secret}
    text = secret.decode("utf-8", errors="replace")
    forms.add(json.dumps(text)[1:-1].encode())
    forms.add(urllib.parse.quote(text, safe="").encode())
    forms.add(urllib.parse.quote_plus(text).encode())
    for offset in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            encoded = encode(b"\0" * offset + secret)
            start = (offset * 4 + 2) // 3  # characters that still mix in the padding bytes
            end = ((offset + len(secret)) * 4) // 3  # full characters before the tail
            core = encoded[start:end]
            if len(core) >= MIN_SECRET_LEN:
                forms.add(core)
    return {form for form in forms if len(form) >= MIN_SECRET_LEN}


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        values: set[bytes] = set()
        for secret in secrets:
            if len(secret) >= MIN_SECRET_LEN:
                values |= encoded_forms(secret.encode())
        # Longest first, so a secret containing another is masked whole.
        self._secrets = sorted(values, key=len, reverse=True)
        self._hold = max((len(s) for s in self._secrets), default=1) - 1
        self._carry = b""
        self._line = b""

    def feed(self, chunk: bytes) -> bytes:
        """Return the bytes (of ``chunk`` and earlier held bytes) safe to write now."""
        return self._lines(self._values(chunk))

    def flush(self) -> bytes:
        """Everything still held, at end of stream."""
        tail, self._carry = self._mask_values(self._carry), b""
        rest, self._line = self._line + tail, b""
        return self._mask_tokens(rest)

    def _values(self, chunk: bytes) -> bytes:
        if not self._secrets:
            return chunk
        data = self._mask_values(self._carry + chunk)
        cut = max(0, len(data) - self._hold)
        self._carry = data[cut:]
        return data[:cut]

    def _lines(self, data: bytes) -> bytes:
        buffer = self._line + data
        end = max(buffer.rfind(b"\n"), buffer.rfind(b"\r")) + 1
        if end == 0 and len(buffer) <= MAX_LINE:
            self._line = buffer
            return b""
        if end == 0:
            end = _safe_cut(buffer)
        self._line = buffer[end:]
        return self._mask_tokens(buffer[:end])

    def _mask_values(self, data: bytes) -> bytes:
        for secret in self._secrets:
            data = data.replace(secret, MASK)
        return data

    @staticmethod
    def _mask_tokens(data: bytes) -> bytes:
        for pattern in TOKEN_PATTERNS:
            data = pattern.sub(rb"\1" + MASK, data)
        return data
