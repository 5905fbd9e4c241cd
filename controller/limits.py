"""Bounds on what laneway takes in: config values, command-line numbers and the files it
is told to read, so that bad input is refused with one line naming it instead of
overflowing, hanging or filling memory later (docs/security.md).

- Every integer a config gives lies in ``[LEDGER_INT_MIN, LEDGER_INT_MAX]``, what the
  narrowest ledger column holds (PostgreSQL's 4-byte INTEGER: ``nodes.max_jobs``,
  ``memory_floor_mib``, ``gpu_total_mib``, ``reservations.memory_mib`` ...); an integer
  inside a JSON value (an item field, a result) lies in the 64-bit range SQLite's JSON
  functions read; a size in MiB has its byte count fit 64 bits (``MAX_MIB``).
- Floats are finite: ``nan`` and ``inf`` compare false with every bound, so a range
  check alone lets them through.
- Text holds no NUL (no argument, path or environment value can carry one) and no lone
  surrogate (not Unicode: it cannot be written as UTF-8, to a file or to the ledger).
- A file laneway reads whole (a config, an items file, a result given to ``reconcile``)
  must be a regular file and is read up to a bound: ``/dev/zero`` or a FIFO is refused
  at once instead of hanging the command or exhausting memory.

Standard library only: the CLI imports it before any heavy module.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from typing import Any

LEDGER_INT_MAX = 2**31 - 1
"""The largest integer every ledger column holds: PostgreSQL's INTEGER is 4 bytes
(SQLite's INTEGER is 8), and config integers land in such columns."""
LEDGER_INT_MIN = -(2**31)
JSON_INT_MAX = 2**63 - 1
"""The largest integer inside a JSON value the ledger stores (an item field, a result):
SQLite's JSON functions read 64 bits."""
JSON_INT_MIN = -(2**63)
MAX_MIB = 2**43
"""A size in MiB must be below this so that its byte count fits 64 bits."""
MAX_SLOTS = 1 << 20
"""The most attempts one node runs at once (``max_jobs``, ``worker --slots``): the
claim asks the ledger for one candidate more than its free slots."""
MAX_ARGV_JSON_BYTES = 120 * 1024
"""The most an attempt's rendered argv may take, JSON-encoded as the worker hands it to
the supervisor: Linux passes at most 128 KiB in one argument (MAX_ARG_STRLEN), and the
rest of the supervisor's spec needs a few KiB."""
MAX_SECONDS = 10**9
"""The longest a command-line duration may be (about 31 years): beyond it a deadline
no longer fits a timestamp."""
CONFIG_MAX_BYTES = 64 << 20
ITEMS_FILE_MAX_BYTES = 1 << 30
RESULT_MAX_BYTES = 16 << 20
MAX_NESTING = 64
"""How deep lists and tables may nest in an item field or a result."""


class FileRefused(OSError):
    """A file laneway will not read: not a regular file, or larger than its bound.
    ``strerror`` says which, so callers that print ``exc.strerror`` need no change."""


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole content of the regular file at ``path``, at most ``limit`` bytes.

    Raises FileRefused for a device, FIFO, socket or directory (opened non-blocking, so
    a FIFO without a writer does not hang the open) and for a file longer than
    ``limit`` (read up to ``limit + 1`` bytes: ``st_size`` is not trusted, a file in
    /proc says 0); OSError as it comes otherwise."""
    fd = open_regular(path)
    try:
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise FileRefused(errno.EFBIG, f"larger than {_size(limit)}", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file at ``path``. Opened non-blocking, so a
    FIFO without a writer is refused rather than waited on; raises FileRefused for a
    device, FIFO, socket or directory, OSError as it comes otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileRefused(errno.EINVAL, f"not a regular file ({_kind(mode)})", str(path))
    return fd


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((words for test, words in kinds if test(mode)), "not a plain file")


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be passed on as text (None when it can)."""
    if "\0" in value:
        return (
            "holds a NUL character, which no argument, path or environment value can "
            "carry; remove it"
        )
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start]
            return f"holds a lone surrogate ({bad!a}), which is not Unicode text; remove it"
    return None


def int_problem(value: int, *, json: bool = False) -> str | None:
    """Why integer ``value`` cannot be stored in the ledger (None when it can): in a
    column (``LEDGER_INT_*``), or with ``json`` inside a JSON value (``JSON_INT_*``)."""
    low, high, words = (
        (JSON_INT_MIN, JSON_INT_MAX, "-2**63 to 2**63-1 in a JSON value")
        if json
        else (LEDGER_INT_MIN, LEDGER_INT_MAX, f"{LEDGER_INT_MIN} to {LEDGER_INT_MAX}")
    )
    if low <= value <= high:
        return None
    shown = str(value) if value.bit_length() < 128 else f"a {value.bit_length()}-bit integer"
    return f"{shown} does not fit the ledger, which stores integers from {words}"


def float_problem(value: float) -> str | None:
    """Why float ``value`` is refused: nan and inf (None when it is finite)."""
    return None if math.isfinite(value) else f"{value} is not a finite number"


def value_problem(value: Any, depth: int = 0) -> str | None:
    """Why a JSON-like value (an item field, a result) cannot be stored and passed on:
    text that is not (NUL, lone surrogate), an integer beyond the ledger's, nan or inf,
    nesting deeper than ``MAX_NESTING``. None when every part is fine."""
    if isinstance(value, str):
        return text_problem(value)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return int_problem(value, json=True)
    if isinstance(value, float):
        return float_problem(value)
    if depth >= MAX_NESTING:
        return f"nests deeper than {MAX_NESTING} levels"
    if isinstance(value, list | tuple):
        for index, part in enumerate(value):
            problem = value_problem(part, depth + 1)
            if problem:
                return _at(f"[{index}]", problem)
        return None
    if isinstance(value, dict):
        for key, part in value.items():
            problem = text_problem(key) if isinstance(key, str) else None
            problem = problem or value_problem(part, depth + 1)
            if problem:
                return _at(f"[{str(key)!a}]", problem)
        return None
    return (
        f"is a TOML {type(value).__name__}, which a run cannot store as it is; quote it to "
        "pass it as text"
    )


def _at(where: str, problem: str) -> str:
    return where + ("" if problem.startswith("[") else " ") + problem
