"""Bounded failure capture: a tar.gz of a failed attempt's workspace and a sha256
manifest, written next to it after the outcome is settled.

The workspace itself is never deleted or moved by laneway (invariant 5,
docs/invariants.md); the capture is an extra, portable copy with caps on size and time.
It runs after the settle commit, so nothing it does — including failing with ENOSPC —
can change the recorded outcome; its result or failure is recorded as an event of its
own.
"""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path
from typing import Any

from controller import faults
from controller.durable import fsync_dir, open_private, write_json
from controller.pipeline import hash_file


def capture_workspace(attempt_dir: str, *, max_bytes: int, max_seconds: float) -> dict[str, Any]:
    """Archive ``attempt_dir/workspace`` into ``capture.tar.gz`` with a manifest.

    Files are added in sorted order until the next one would pass ``max_bytes`` (of
    input) or ``max_seconds`` have passed; what was left out is listed. Raises OSError
    (the caller records it as a diagnostic).
    """
    directory = Path(attempt_dir)
    workspace = directory / "workspace"
    archive = directory / "capture.tar.gz"
    partial = directory / "capture.tar.gz.partial"
    paths = sorted(p for p in workspace.rglob("*") if p.is_file() and not p.is_symlink())
    try:
        files, skipped, total = _archive(partial, workspace, paths, max_bytes, max_seconds)
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, archive)
        fsync_dir(directory)
    except OSError:
        partial.unlink(missing_ok=True)  # a torn archive is never left to be trusted
        raise
    manifest = {
        "archive": archive.name,
        "archive_sha256": hash_file(archive),
        "files": files,
        "bytes": total,
        "skipped": skipped,
        "truncated": bool(skipped),
    }
    write_json(directory / "capture.manifest.json", manifest)
    return {k: manifest[k] for k in ("archive_sha256", "bytes", "truncated")} | {
        "files": len(files),
        "skipped": len(skipped),
        "path": str(archive),
    }


def _archive(
    partial: Path, workspace: Path, paths: list[Path], max_bytes: int, max_seconds: float
) -> tuple[list[dict[str, Any]], list[str], int]:
    started = time.monotonic()
    files: list[dict[str, Any]] = []
    skipped: list[str] = []
    total = 0
    with open_private(partial, "wb") as handle, tarfile.open(fileobj=handle, mode="w:gz") as tar:
        for path in paths:
            relative = str(path.relative_to(workspace))
            size = path.stat().st_size
            if total + size > max_bytes or time.monotonic() - started > max_seconds:
                skipped.append(relative)
                continue
            faults.check("capture")  # test hook
            tar.add(path, arcname=relative)
            files.append({"path": relative, "bytes": size, "sha256": hash_file(path)})
            total += size
    return files, skipped, total
