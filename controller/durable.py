"""The one helper for durable files: write ``*.partial``, fsync, rename, fsync the directory.

Every receipt, exit record, status snapshot and summary goes through ``write_json`` so a
reader either sees the old file or the whole new one, and a crash after ``write_json``
returns cannot lose it. Kept dependency-free: the per-attempt supervisor imports it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from controller import faults


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data``; raises OSError if any step fails.

    On failure the partial file is removed (best effort) and the old content, if any,
    is left untouched: a torn file is never visible under the final name.
    """
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    site = faults.site_of(target)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if site:
                faults.check(site)  # test hook: the write or its fsync failing
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, target)
    except OSError:
        # Why: a stray partial must never be mistaken for evidence; the error still propagates.
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(target.parent)


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Atomically write ``payload`` as pretty JSON (sorted keys, trailing newline)."""
    data = (json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n").encode()
    write_bytes(path, data)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; raises OSError or ValueError (json.JSONDecodeError) as they come."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
