"""Streaming redaction of secret values from a job's output (invariant 8).

A secret may be split across two reads, so the redactor holds back the last
``len(longest secret) - 1`` bytes of each chunk until the next chunk (or the end)
shows whether they start a secret. Stdlib only: the supervisor imports this.
"""

from __future__ import annotations

MASK = b"[REDACTED]"
MIN_SECRET_LEN = 4
"""Shorter values are not redacted: masking "1" or "yes" everywhere would ruin logs."""


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        values = {s.encode() for s in secrets if len(s) >= MIN_SECRET_LEN}
        # Longest first, so a secret containing another is masked whole.
        self._secrets = sorted(values, key=len, reverse=True)
        self._hold = max((len(s) for s in self._secrets), default=1) - 1
        self._carry = b""

    def feed(self, chunk: bytes) -> bytes:
        """Return the bytes of ``chunk`` (and earlier carry) that are safe to write now."""
        if not self._secrets:
            return chunk
        data = self._mask(self._carry + chunk)
        if self._hold == 0:
            self._carry = b""
            return data
        cut = max(0, len(data) - self._hold)
        self._carry = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """The held-back tail, at end of stream."""
        data, self._carry = self._mask(self._carry), b""
        return data

    def _mask(self, data: bytes) -> bytes:
        for secret in self._secrets:
            data = data.replace(secret, MASK)
        return data
