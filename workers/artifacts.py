"""Stage artifacts on the worker's side: declared outputs found and hashed, put in the
run's artifact store, and fetched back as inputs, re-verified, for the stages that
need them (docs/architecture.md, "Artifacts").

The store is any fsspec URL (``file://`` on a shared mount, ``s3://bucket/prefix``;
credentials and endpoint come only from the worker's environment). Objects are
content-addressed, ``<store>/sha256/ab/<sha256>``: written once (atomically where the
store is a local file system: a temporary name, then a rename), never overwritten, and
read back and hashed before the settle records them. A fetch hashes the bytes as it
writes them and keeps them only when they match the recorded sha256.

Every store failure (ENOSPC, EIO, a network or credential error) is raised as
``StoreError``: laneway's side broke, so the attempt settles ``harness_failure`` and is
never ``succeeded``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from controller import faults
from controller.durable import make_private_dir, open_private
from controller.outcome import Verdict
from controller.states import Outcome

CHUNK = 1 << 20


class StoreError(Exception):
    """The artifact store could not be written or read."""


class InputMismatch(Exception):
    """A fetched input's bytes do not hash to what its producer recorded."""

    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(
            f"input {name}: stored bytes hash to sha256 {actual}, its producer recorded {expected}"
        )
        self.name = name
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True)
class Output:
    """One declared output as delivered: its name under the workspace, path, hash."""

    name: str
    path: Path
    sha256: str
    size_bytes: int


Between = Callable[[], None] | None
"""Called after each CHUNK a transfer moves: the worker renews its leases there when
they are due, so one large file cannot outlast them."""


def hash_file(path: Path, between: Between = None) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as source:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if between is not None:
                between()
    return digest.hexdigest(), size


def find_outputs(
    workspace: Path, patterns: list[str], between: Between = None
) -> tuple[list[Output], list[str]]:
    """The files ``patterns`` (names or globs relative to ``workspace``) match, hashed,
    and the patterns that match no regular file inside the workspace. A symlink that
    leads out of the workspace is not an output (the job cannot hand over other
    files)."""
    root = workspace.resolve()
    found: dict[str, Output] = {}
    missing: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            paths = [Path(p) for p in sorted(glob.glob(str(workspace / pattern), recursive=True))]
        else:
            paths = [workspace / pattern]
        matched = 0
        for path in paths:
            if not path.is_file() or not path.resolve().is_relative_to(root):
                continue
            name = path.relative_to(workspace).as_posix()
            if name not in found:
                sha256, size = hash_file(path, between)
                found[name] = Output(name, path, sha256, size)
            matched += 1
        if not matched:
            missing.append(pattern)
    return list(found.values()), missing


class ArtifactStore:
    """A content-addressed store at an fsspec URL."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise StoreError(f"cannot open artifact store {self.url}: {exc}") from exc
        self.local = isinstance(self.fs, LocalFileSystem)

    def location(self, sha256: str) -> str:
        return f"{self.url}/sha256/{sha256[:2]}/{sha256}"

    def _key(self, sha256: str) -> str:
        return f"{self.root}/sha256/{sha256[:2]}/{sha256}"

    def put(self, output: Output, between: Between = None) -> str:
        """Store ``output`` under its hash unless that object is there already; read it
        back and check its hash either way. Returns its location."""
        key = self._key(output.sha256)
        try:
            self.fs.invalidate_cache()
            if not self.fs.exists(key):
                self._write(output.path, key, between)
            stored = self._hash_object(key, between)
        except StoreError:
            raise
        except Exception as exc:  # fsspec backends raise their own types: all are the store's
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        if stored != output.sha256:
            raise StoreError(
                f"{self.location(output.sha256)} reads back as sha256 {stored}: the store "
                "(or the file, changed while it was stored) does not hold the bytes that "
                "were hashed"
            )
        return self.location(output.sha256)

    def _write(self, source: Path, key: str, between: Between = None) -> None:
        parent = key.rsplit("/", 1)[0]
        if self.local:
            make_private_dir(Path(parent))
            temporary = f"{key}.tmp-{uuid.uuid4().hex}"
            try:
                with open_private(temporary, "xb") as target, open(source, "rb") as data:
                    while chunk := data.read(CHUNK):
                        target.write(chunk)
                        if between is not None:
                            between()
                    faults.check("store_write")  # test hook: the write or its fsync failing
                    target.flush()
                    os.fsync(target.fileno())
                os.replace(temporary, key)  # atomic: never a half-written object
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
        else:
            self.fs.put_file(str(source), key)  # one PUT: the object appears whole or not

    def _hash_object(self, key: str, between: Between = None) -> str:
        digest = hashlib.sha256()
        with self.fs.open(key, "rb") as stored:
            while chunk := stored.read(CHUNK):
                digest.update(chunk)
                if between is not None:
                    between()
        return digest.hexdigest()


def fetch(location: str, sha256: str, name: str, target: Path, between: Between = None) -> None:
    """Copy the object at ``location`` to ``target`` (private), hashing the bytes as
    they are written; raises InputMismatch (nothing kept) when they do not match
    ``sha256``, StoreError when the store cannot be read."""
    make_private_dir(target.parent)
    temporary = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
    digest = hashlib.sha256()
    try:
        fs, path = fsspec.core.url_to_fs(location)
        fs.invalidate_cache()
        with open_private(temporary, "xb") as copy, fs.open(path, "rb") as stored:
            while chunk := stored.read(CHUNK):
                digest.update(chunk)
                copy.write(chunk)
                if between is not None:
                    between()
            faults.check("input_fetch")  # test hook: the copy failing
    except Exception as exc:  # fsspec backends raise their own types: all are the store's
        temporary.unlink(missing_ok=True)
        if isinstance(exc, FileNotFoundError):
            raise StoreError(f"input {name}: {location} is not in the store") from exc
        raise StoreError(f"input {name}: {location}: {type(exc).__name__}: {exc}") from exc
    actual = digest.hexdigest()
    if actual != sha256:
        temporary.unlink(missing_ok=True)
        raise InputMismatch(name, sha256, actual)
    os.replace(temporary, target)


def deliver(
    verdict: Verdict,
    attempt_dir: str,
    outputs: list[str],
    store_url: str,
    between: Between = None,
) -> tuple[Verdict, list[dict[str, Any]]]:
    """An attempt that would succeed hands over its declared outputs: each is hashed and
    put in the run's store (call it outside any transaction); returns the verdict and
    what the settle records (name, sha256, size_bytes, location). A declared output
    that is missing makes it ``failed`` (the job ran and did not deliver); a store that
    cannot take them makes it ``harness_failure`` (laneway's side broke; the files stay
    in the workspace, the exit code is kept). Anything else passes through. ``between``
    runs before each file and after each chunk of it is hashed, written or read back
    (the worker renews its leases there when they are due). A store that takes a file in
    one call (S3: one PUT) runs nothing in between."""
    if verdict.outcome is not Outcome.SUCCEEDED or not outputs:
        return verdict, []
    workspace = Path(attempt_dir) / "workspace"
    try:
        found, missing = find_outputs(workspace, outputs, between)
    except OSError as exc:
        reason = f"its outputs could not be read: {exc.strerror or exc}"
        return replace(verdict, outcome=Outcome.HARNESS_FAILURE, reason=reason), []
    if missing:
        reason = (
            f"declared output {', '.join(missing)} is missing from its workspace: the job "
            "ran and did not deliver it"
        )
        return replace(verdict, outcome=Outcome.FAILED, reason=reason), []
    try:
        store = ArtifactStore(store_url)
        stored = []
        for output in found:
            if between is not None:
                between()
            stored.append(
                {
                    "name": output.name,
                    "sha256": output.sha256,
                    "size_bytes": output.size_bytes,
                    "location": store.put(output, between),
                }
            )
    except StoreError as exc:
        reason = (
            f"its outputs could not be stored ({exc}); they are kept in {workspace}, the "
            "exit code with them"
        )
        return replace(verdict, outcome=Outcome.HARNESS_FAILURE, reason=reason), []
    return verdict, stored
