"""Bounded failure capture: a tar.gz of a failed attempt's workspace and a sha256
manifest, written next to it after the outcome is settled.

The workspace itself is never deleted or moved by laneway (invariant 5,
docs/invariants.md); the capture is an extra, portable copy with caps on size and time.
It runs after the settle commit, so nothing it does — including failing with ENOSPC —
can change the recorded outcome; its result or failure is recorded as an event of its
own.

The job can write its attempt directory, so every file here is read and written
through ``durable.AttemptDir``: the archive's ``*.partial`` is created exclusively (one
planted there, a symlink to a file outside say, is refused: the capture fails as its own
diagnostic and the outside file is untouched), workspace files are opened without
following links (a link is not archived), and the archive is hashed as it is written,
never read back by name.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import time
from typing import IO, Any, cast

from laneway.controller import faults
from laneway.controller.durable import AttemptDir, PathRefused

ARCHIVE = "capture.tar.gz"
PARTIAL = ARCHIVE + ".partial"
MANIFEST = "capture.manifest.json"


def capture_workspace(attempt_dir: str, *, max_bytes: int, max_seconds: float) -> dict[str, Any]:
    """Archive ``attempt_dir/workspace`` into ``capture.tar.gz`` with a manifest.

    Files are added in sorted order until the next one would pass ``max_bytes`` (of
    input) or ``max_seconds`` have passed; what was left out is listed. Links and other
    special files are left out. Raises OSError (the caller records it as a diagnostic),
    ``durable.PathRefused`` among them when a name it writes was planted.
    """
    with AttemptDir(attempt_dir) as directory:
        with directory.subdir("workspace") as workspace:
            paths = sorted(parts for parts, is_dir, _ in workspace.walk() if not is_dir)
            handle = directory.create(PARTIAL)  # O_EXCL: nothing planted is reused
            try:
                with handle:
                    sink = _Hashing(handle)
                    files, skipped, total = _archive(sink, workspace, paths, max_bytes, max_seconds)
                    handle.flush()
                    os.fsync(handle.fileno())
                directory.replace(PARTIAL, ARCHIVE)
                directory.fsync()
            except OSError:
                directory.unlink(PARTIAL, missing_ok=True)  # a torn archive is never trusted
                raise
        manifest = {
            "archive": ARCHIVE,
            "archive_sha256": sink.digest.hexdigest(),
            "files": files,
            "bytes": total,
            "skipped": skipped,
            "truncated": bool(skipped),
        }
        directory.write_json(MANIFEST, manifest)
    return {k: manifest[k] for k in ("archive_sha256", "bytes", "truncated")} | {
        "files": len(files),
        "skipped": len(skipped),
        "path": os.path.join(attempt_dir, ARCHIVE),
    }


class _Hashing:
    """A file object that hashes what passes through it (``write`` or ``read``)."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        return data


def _archive(
    sink: _Hashing,
    workspace: AttemptDir,
    paths: list[tuple[str, ...]],
    max_bytes: int,
    max_seconds: float,
) -> tuple[list[dict[str, Any]], list[str], int]:
    started = time.monotonic()
    files: list[dict[str, Any]] = []
    skipped: list[str] = []
    total = 0
    with tarfile.open(fileobj=cast(IO[bytes], sink), mode="w:gz") as tar:
        for parts in paths:
            relative = "/".join(parts)
            try:
                source = workspace.read(relative)
            except (FileNotFoundError, PathRefused):
                skipped.append(relative)  # gone, or made a link, since it was listed
                continue
            with source:
                info = tar.gettarinfo(arcname=relative, fileobj=source)
                if total + info.size > max_bytes or time.monotonic() - started > max_seconds:
                    skipped.append(relative)
                    continue
                faults.check("capture")  # test hook
                reader = _Hashing(source)
                tar.addfile(info, reader)
            digest = reader.digest.hexdigest()
            files.append({"path": relative, "bytes": info.size, "sha256": digest})
            total += info.size
    return files, skipped, total
