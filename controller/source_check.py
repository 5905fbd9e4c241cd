"""Frozen sources: has a run's code changed on disk since the run started?

A run freezes the sha256 of every source file its config names (``runs.source_hashes``,
hashed by ``pipeline.preflight`` with ``hash_file``). Before each dispatch the claim
re-checks them (``controller/ledger/claim.py::_halt_on_source_drift``, handed
``source_drift`` by the worker) and halts the run on a change; ``laneway retry`` asks
the same question before it moves anything (``controller/retry_sources.py``), and
``laneway explain`` may too. One judgement, ``changed_sources``, for all of them.

Standard library only (floor 0), so every floor above can ask it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laneway.controller import limits


def hash_file(path: str | Path) -> str:
    """The sha256 of a regular file. Raises OSError for anything else (a device such
    as /dev/zero would be read forever, a FIFO without a writer would block the open:
    it is opened non-blocking and refused)."""
    digest = hashlib.sha256()
    with open(limits.open_regular(path), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_hash_cache: dict[str, tuple[int, int, str]] = {}


@dataclass(frozen=True)
class SourceChange:
    """One frozen source that no longer matches: ``actual`` is its sha256 now, None when
    it cannot be read (gone, or no longer a regular file: ``problem`` says why)."""

    path: str
    frozen: str
    actual: str | None
    problem: str | None = None

    @property
    def line(self) -> str:
        """The change in one line, naming the file first and both hashes."""
        if self.actual is None:
            return f"{self.path}: unreadable ({self.problem}); frozen {self.frozen[:12]}"
        return f"{self.path}: sha256 {self.actual[:12]}… != frozen {self.frozen[:12]}…"

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "frozen_sha256": self.frozen,
            "sha256": self.actual,
            "problem": self.problem,
        }


def changed_sources(recorded: Mapping[str, str]) -> list[SourceChange]:
    """Each frozen source (``recorded``: path -> sha256, a run's ``source_hashes``) whose
    content differs from its recorded sha256 or cannot be read, by path. Files are
    re-hashed only when their size or mtime changed since the last check in this
    process; an edit undone (the same bytes again) is no change."""
    changes = []
    for path, expected in sorted(recorded.items()):
        try:
            stat = os.stat(path)
            cached = _hash_cache.get(path)
            if cached and cached[:2] == (stat.st_size, stat.st_mtime_ns):
                actual = cached[2]
            else:
                actual = hash_file(path)
                _hash_cache[path] = (stat.st_size, stat.st_mtime_ns, actual)
        except OSError as exc:
            changes.append(SourceChange(path, expected, None, str(exc.strerror or exc)))
            continue
        if actual != expected:
            changes.append(SourceChange(path, expected, actual))
    return changes


def source_drift(recorded: Mapping[str, str]) -> list[str]:
    """``changed_sources`` as lines (``SourceChange.line``): the reason of the claim's
    halt (``frozen sources changed: LINE; LINE``)."""
    return [change.line for change in changed_sources(recorded)]
