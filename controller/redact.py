"""Streaming redaction of a job's output before it reaches a log file (invariant 8,
docs/invariants.md).

Two stages, each safe across read boundaries:

1. secret values (those resolved from ``${NAME}`` references), and their encoded forms
   (``encoded_forms``: JSON-escaped, URL-encoded, hex, base64 and base32), are replaced
   wherever they occur; a secret may be split across two reads, so this stage holds back
   the last ``len(longest form) - 1`` bytes until the next read (or the end) shows
   whether they start a secret;
2. ``Authorization:`` header values and ``Bearer`` tokens are masked line by line; a
   partial line is held until its newline (or until it grows past ``MAX_LINE``).

``redact_json`` applies the same rules to a parsed JSON value (a job's result).
docs/security.md lists exactly which forms are covered and which cannot be.

Stdlib only: the supervisor imports this (through ``workers.redact``), and the
controller redacts closeout step logs with it (``controller.closeout``).
"""

from __future__ import annotations

import base64
import json
import re

TYPE_CHECKING = False  # the supervisor imports this module: it must start fast
if TYPE_CHECKING:
    from typing import Any

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


_PERCENT_ESCAPE = re.compile(rb"%[0-9A-F]{2}")


def _url_forms(text: str) -> set[bytes]:
    """URL-encoded forms: ``quote`` with nothing safe and with its default ``/`` safe,
    ``quote_plus`` likewise, each with upper- and lowercase ``%xx`` escapes."""
    import urllib.parse  # only with secrets to redact: it is slow to import

    forms = set()
    for safe in ("", "/"):
        for encode in (urllib.parse.quote, urllib.parse.quote_plus):
            upper = encode(text, safe=safe).encode()
            forms.add(upper)
            forms.add(_PERCENT_ESCAPE.sub(lambda m: m.group(0).lower(), upper))
    return forms


def _aligned_cores(secret: bytes, encode: Any, group: int, bits: int) -> set[bytes]:
    """The characters of ``encode(prefix + secret)`` that depend on the secret alone, for
    every length of prefix modulo the encoding's input group (3 bytes for base64, 5 for
    base32): a secret inside a longer encoded string appears as one of these."""
    cores = set()
    for offset in range(group):
        encoded = encode(b"\0" * offset + secret)
        start = -(-(offset * 8) // bits)  # first character made of secret bits only
        end = ((offset + len(secret)) * 8) // bits  # characters before the mixed tail
        core = encoded[start:end]
        if len(core) >= MIN_SECRET_LEN:
            cores.add(core)
    return cores


def encoded_forms(secret: bytes) -> set[bytes]:
    """A secret as it may appear in output: raw; JSON-escaped (ASCII-only and not, and
    with ``/`` escaped as ``\\/``); URL-encoded (see ``_url_forms``); hex, lower- and
    uppercase; base64 (standard and URL-safe) and base32 (upper- and lowercase) at each
    alignment it can have inside a longer encoded string, keeping only the characters
    that depend on the secret alone."""
    forms = {secret}
    text = secret.decode("utf-8", errors="replace")
    for ensure_ascii in (True, False):
        escaped = json.dumps(text, ensure_ascii=ensure_ascii)[1:-1]
        forms.add(escaped.encode())
        forms.add(escaped.replace("/", "\\/").encode())
    forms |= _url_forms(text)
    forms.add(secret.hex().encode())
    forms.add(secret.hex().upper().encode())
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        forms |= _aligned_cores(secret, encode, 3, 6)
    for core in _aligned_cores(secret, base64.b32encode, 5, 5):
        forms.add(core)
        forms.add(core.lower())
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

    def redact_text(self, text: str) -> str:
        """``text`` with both stages applied at once (not streaming): for whole values."""
        data = self._mask_tokens(self._mask_values(text.encode("utf-8", "surrogatepass")))
        return data.decode("utf-8", "surrogatepass")

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


def redact_json(value: Any, secrets: list[str]) -> Any:
    """A redacted copy of a parsed JSON value (e.g. a job's result.json), by the rules
    used for logs: in every string and every object key, secret values and their
    encoded forms become ``[REDACTED]`` and ``Authorization``/``Bearer`` tokens are
    masked; a number whose JSON text holds a secret becomes the string ``[REDACTED]``.
    Two keys that become equal get `` #2``, `` #3``… appended, so no entry is lost.
    Iterative, so any depth that ``json`` could parse is handled."""
    redactor = Redactor(secrets)
    mask = MASK.decode()

    def scalar(item: Any) -> Any:
        if isinstance(item, str):
            return redactor.redact_text(item)
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            text = json.dumps(item)
            return mask if redactor.redact_text(text) != text else item
        return item

    def container(item: Any) -> Any:
        if isinstance(item, dict):
            return {}
        if isinstance(item, (list, tuple)):
            return []
        return None

    root = container(value)
    if root is None:
        return scalar(value)
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        source, target = stack.pop()
        entries = source.items() if isinstance(source, dict) else enumerate(source)
        for key, item in entries:
            copy = container(item)
            new = scalar(item) if copy is None else copy
            if isinstance(target, dict):
                name = redactor.redact_text(str(key))
                unique, n = name, 1
                while unique in target:
                    n += 1
                    unique = f"{name} #{n}"
                target[unique] = new
            else:
                target.append(new)
            if copy is not None:
                stack.append((item, copy))
    return root
