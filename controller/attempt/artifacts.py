"""Stage artifacts in an attempt's files: declared outputs found and hashed, put in the
run's artifact store, and fetched back as inputs, re-verified, for the stages that
need them (docs/architecture.md, "Artifacts"). The worker's settle, the controller's
lease expiry and the operator's reconcile all deliver through ``deliver``, called by
``controller.attempt.judge_attempt``; the worker fetches inputs with ``fetch``.

The store is any fsspec URL (``file://`` on a shared mount, ``s3://bucket/prefix``;
credentials and endpoint come only from the worker's environment). Objects are
content-addressed, ``<store>/sha256/ab/<sha256>``: written once (atomically where the
store is a local file system: a temporary name, fsync, then a rename), never
overwritten while it verifies, and read back and hashed before the settle records
them. A fetch hashes the bytes as it writes them and keeps them only when they match
the recorded sha256.

Every store failure (ENOSPC, EIO, a network or credential error) is raised as
``StoreError``: laneway's side broke, so the attempt settles ``harness_failure`` and is
never ``succeeded``.

An object that is there but does not hash to its name (a disk error, a hand edit) is
not permanent: the next producer with the right bytes replaces it the way a new one is
written, and the settle's diagnostics say so.

The workspace is the job's: outputs are matched by walking it through
``durable.AttemptDir`` (no link is followed, to a directory or a file, and a link is
never an output), and the walk is bounded (``MAX_OUTPUT_MATCHES`` files,
``MAX_OUTPUT_DEPTH`` directories deep, ``MAX_OUTPUT_ENTRIES`` names looked at, each
output at most the stage's ``output_max_mib``, judged before a byte is read); it renews
the leases as it goes. Past a bound the attempt settles ``harness_failure`` with the
bound in its reason, and nothing is stored. Inputs are written the same way: a name
under ``inputs/`` planted before the fetch (a symlink out of the runtime dir, say) is
refused, never written through.
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import glob
import hashlib
import os
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from laneway.controller import faults
from laneway.controller.durable import (
    AttemptDir,
    PathRefused,
    fsync_dir,
    make_private_dir,
    open_private,
)
from laneway.controller.outcome import Verdict
from laneway.controller.states import Outcome

CHUNK = 1 << 20
MIB = 1024 * 1024
DEFAULT_OUTPUT_MAX_MIB = 1024
"""The default of a stage's ``output_max_mib`` (controller/config.py)."""
MAX_OUTPUT_MATCHES = 10_000
"""Most files a stage's declared outputs may match."""
MAX_OUTPUT_DEPTH = 32
"""Deepest directory (below the workspace) a glob looks into."""
MAX_OUTPUT_ENTRIES = 200_000
"""Most names (files and directories) the globs of one attempt look at."""
RENEW_EVERY = 256
"""The walk offers to renew leases after this many names."""


class StoreError(Exception):
    """The artifact store could not be written or read."""


class OutputBound(Exception):
    """The declared outputs pass a bound (matches, depth, names looked at, size)."""


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

    def open(self) -> IO[bytes]:
        """The file for reading, below the directory it was found in, never through a
        link (``durable.PathRefused`` if one was put in its place since)."""
        depth = len(Path(self.name).parts)
        with AttemptDir(self.path.parents[depth - 1]) as root:
            return root.read(self.name)


@dataclass(frozen=True)
class Placed:
    """Where ``ArtifactStore.put`` left an object, and the sha256 the object it replaced
    hashed to when one was there and did not verify (else None)."""

    location: str
    replaced: str | None = None


Between = Callable[[], None] | None
"""Called after each CHUNK a transfer moves: the worker renews its leases there when
they are due, so one large file cannot outlast them."""


def hash_file(path: Path, between: Between = None) -> tuple[str, int]:
    with open(path, "rb") as source:
        return hash_stream(source, between)


def hash_stream(source: IO[bytes], between: Between = None) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    while chunk := source.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if between is not None:
            between()
    return digest.hexdigest(), size


def find_outputs(
    workspace: Path,
    patterns: list[str],
    between: Between = None,
    *,
    max_bytes: int = DEFAULT_OUTPUT_MAX_MIB * MIB,
) -> tuple[list[Output], list[str]]:
    """The regular files ``patterns`` (names or globs relative to ``workspace``) match,
    hashed, and the patterns that match none. A link is never followed nor an output
    (the job cannot hand over other files, nor send the walk round a loop). Raises
    ``OutputBound`` past a bound (see the module docstring; an output over
    ``max_bytes`` is judged by its size, unread) and OSError when the workspace cannot
    be read. ``between`` runs every ``RENEW_EVERY`` names and after each chunk hashed."""
    found: dict[str, int] = {}
    missing: list[str] = []
    try:
        opened = AttemptDir(workspace)
    except FileNotFoundError:
        return [], list(patterns)  # no workspace: nothing was delivered
    with opened as root:
        seen = _Walk(root, between)
        for pattern in patterns:
            matched = seen.matches(pattern)
            for name, size in matched:
                if not name.isprintable() or _not_utf8(name):
                    raise OutputBound(
                        f"declared output {name.encode('utf-8', 'backslashreplace')!r} has a "
                        "name that is not printable UTF-8, which the ledger cannot record: "
                        "not stored (have the job write plain names)"
                    )
                if size > max_bytes:
                    raise OutputBound(
                        f"declared output {name} is {size} bytes, over the stage's "
                        f"output_max_mib ({max_bytes // MIB} MiB): not stored (raise "
                        "output_max_mib in the stage if it is meant to be this large)"
                    )
                found.setdefault(name, size)
            if len(found) > MAX_OUTPUT_MATCHES:
                raise OutputBound(
                    f"declared outputs match more than {MAX_OUTPUT_MATCHES} files "
                    f"(at {pattern!r}): not stored"
                )
            if not matched:
                missing.append(pattern)
        outputs = []
        for name in found:
            with root.read(name) as source:
                sha256, size = hash_stream(source, between)
            if size > max_bytes:  # grew since it was looked at
                raise OutputBound(
                    f"declared output {name} grew past the stage's output_max_mib "
                    f"({max_bytes // MIB} MiB) while it was hashed: not stored"
                )
            outputs.append(Output(name, workspace / name, sha256, size))
    return outputs, missing


def _not_utf8(name: str) -> bool:
    """Bytes of a file name that are not UTF-8 reach Python as lone surrogates."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _Walk:
    """The bounded, link-free matching of output patterns in one workspace."""

    def __init__(self, root: AttemptDir, between: Between) -> None:
        self.root = root
        self.between = between
        self.entries = 0

    def matches(self, pattern: str) -> list[tuple[str, int]]:
        """(name, size) of each regular file ``pattern`` matches, sorted."""
        parts = tuple(part for part in pattern.split("/") if part not in ("", "."))
        if not glob.has_magic(pattern):
            try:
                info = self.root.lstat("/".join(parts))
            except (FileNotFoundError, NotADirectoryError, PathRefused):
                return []
            return [("/".join(parts), info.st_size)] if stat.S_ISREG(info.st_mode) else []
        matcher = _Matcher(parts)
        found = []
        for names, is_dir, size in self.root.walk(descend=matcher.could_hold):
            self.entries += 1
            if self.entries > MAX_OUTPUT_ENTRIES:
                raise OutputBound(
                    f"declared output {pattern!r}: the workspace holds more than "
                    f"{MAX_OUTPUT_ENTRIES} names to look at: not stored"
                )
            if self.between is not None and self.entries % RENEW_EVERY == 0:
                self.between()
            if is_dir:
                if len(names) > MAX_OUTPUT_DEPTH and matcher.could_hold(names):
                    raise OutputBound(
                        f"declared output {pattern!r}: the workspace is more than "
                        f"{MAX_OUTPUT_DEPTH} directories deep: not stored"
                    )
            elif matcher.match(names):
                found.append(("/".join(names), size))
        return sorted(found)


class _Matcher:
    """Glob semantics, one path component at a time: ``*``, ``?`` and ``[...]`` within
    a name, ``**`` for any number of directories; a wildcard never matches a name
    starting with ``.`` unless the pattern's component does (as ``glob.glob``)."""

    def __init__(self, pattern: tuple[str, ...]) -> None:
        self.pattern = pattern

    def match(self, names: tuple[str, ...]) -> bool:
        return self._walk(names, prefix=False)

    def could_hold(self, names: tuple[str, ...]) -> bool:
        """Whether a file below directory ``names`` could match."""
        return self._walk(names, prefix=True)

    def _walk(self, names: tuple[str, ...], *, prefix: bool) -> bool:
        pattern = self.pattern

        @functools.cache
        def at(p: int, n: int) -> bool:
            if n == len(names):
                if prefix:
                    return p < len(pattern)
                return all(part == "**" for part in pattern[p:])  # ** may match nothing
            if p == len(pattern):
                return False
            head = pattern[p]
            if head == "**":
                return at(p + 1, n) or (not names[n].startswith(".") and at(p, n + 1))
            return _component(head, names[n]) and at(p + 1, n + 1)

        return at(0, 0)


def _component(pattern: str, name: str) -> bool:
    if name.startswith(".") and not pattern.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, pattern)


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

    def put(self, output: Output, between: Between = None) -> Placed:
        """Store ``output`` under its hash unless an object that verifies is there
        already; read it back and check its hash either way. An object there that does
        not verify is replaced (a temporary name, fsync, rename; one PUT elsewhere), and
        ``Placed.replaced`` says what it hashed to."""
        key = self._key(output.sha256)
        replaced = None
        try:
            self.fs.invalidate_cache()
            if self.fs.exists(key):
                found = self._hash_object(key, between)
                if found == output.sha256:
                    return Placed(self.location(output.sha256))
                replaced = found
            self._write(output, key, between)
            self.fs.invalidate_cache()
            stored = self._hash_object(key, between)
        except (StoreError, PathRefused):
            raise
        except Exception as exc:  # fsspec backends raise their own types: all are the store's
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        if stored != output.sha256:
            raise StoreError(
                f"{self.location(output.sha256)} reads back as sha256 {stored}: the store "
                "(or the file, changed while it was stored) does not hold the bytes that "
                "were hashed"
            )
        return Placed(self.location(output.sha256), replaced)

    def _write(self, output: Output, key: str, between: Between = None) -> None:
        parent = key.rsplit("/", 1)[0]
        with output.open() as data:  # never through a link put in its place
            if self.local:
                make_private_dir(Path(parent))
                temporary = f"{key}.tmp-{uuid.uuid4().hex}"
                try:
                    with open_private(temporary, "xb") as target:
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
                fsync_dir(parent)
            else:
                # One PUT: the object appears whole or not. The backend opens a path, so
                # it is given the descriptor's: the very file hashed, whatever the
                # workspace's names point at now.
                self.fs.put_file(f"/proc/self/fd/{data.fileno()}", key)

    def _hash_object(self, key: str, between: Between = None) -> str:
        digest = hashlib.sha256()
        with self.fs.open(key, "rb") as stored:
            while chunk := stored.read(CHUNK):
                digest.update(chunk)
                if between is not None:
                    between()
        return digest.hexdigest()


GONE = "gone"
"""``still_stored``: the object is not in the store, or holds other bytes."""
UNCHECKED = "unchecked"
"""``still_stored``: this machine cannot look (the store's root is not here, or the
store does not answer): the object is trusted as before; a consumer fetches and
verifies it again at its claim, so an unreachable store never makes paid work run
twice."""


def still_stored(location: str, sha256: str) -> tuple[str, str] | None:
    """None when the object at ``location`` is there and hashes to ``sha256``; else
    (``GONE`` or ``UNCHECKED``, why in words). A ``file://`` store whose root is not on
    this machine (a worker's own store, readable only there) is ``UNCHECKED``."""
    try:
        fs, path = fsspec.core.url_to_fs(location)
        if isinstance(fs, LocalFileSystem):
            root = path.rsplit("/sha256/", 1)[0]
            if not os.path.isdir(root):
                return UNCHECKED, f"{root} is not on this machine"
        fs.invalidate_cache()
        digest = hashlib.sha256()
        with fs.open(path, "rb") as stored:
            while chunk := stored.read(CHUNK):
                digest.update(chunk)
    except FileNotFoundError:
        return GONE, f"{location} is no longer in the store"
    except Exception as exc:  # fsspec backends raise their own types: all are the store's
        return UNCHECKED, f"the store did not answer ({type(exc).__name__}: {exc})"
    actual = digest.hexdigest()
    if actual != sha256:
        return GONE, f"{location} holds sha256 {actual[:12]}…, not the {sha256[:12]}… it stored"
    return None


def fetch(
    location: str,
    sha256: str,
    name: str,
    target: Path,
    between: Between = None,
    *,
    root: Path | None = None,
) -> None:
    """Copy the object at ``location`` to ``target`` (private), hashing the bytes as
    they are written; raises InputMismatch (nothing kept) when they do not match
    ``sha256``, StoreError when the store cannot be read, ``durable.PathRefused`` when
    a name on the way was planted (a link, or ``target`` there already).

    ``root`` (the attempt directory): the directories from it down to ``target`` are
    made or entered without following a link; without it ``target``'s directory is
    made as ``make_private_dir`` makes it."""
    if root is None:
        make_private_dir(target.parent)
        directory = AttemptDir(target.parent)
    else:
        with AttemptDir(root) as top:
            directory = top.subdir(target.parent.relative_to(root).as_posix(), create=True)
    with directory:
        if directory.exists(target.name):
            raise PathRefused(
                errno.EEXIST, "exists before its input was fetched; laneway refuses it", str(target)
            )
        temporary = f".{target.name}.tmp-{uuid.uuid4().hex}"
        digest = hashlib.sha256()
        copy = directory.create(temporary)
        try:
            with copy:
                fs, path = fsspec.core.url_to_fs(location)
                fs.invalidate_cache()
                with fs.open(path, "rb") as stored:
                    while chunk := stored.read(CHUNK):
                        digest.update(chunk)
                        copy.write(chunk)
                        if between is not None:
                            between()
                faults.check("input_fetch")  # test hook: the copy failing
        except Exception as exc:  # fsspec backends raise their own types: all are the store's
            directory.unlink(temporary, missing_ok=True)
            if isinstance(exc, FileNotFoundError):
                raise StoreError(f"input {name}: {location} is not in the store") from exc
            raise StoreError(f"input {name}: {location}: {type(exc).__name__}: {exc}") from exc
        actual = digest.hexdigest()
        if actual != sha256:
            directory.unlink(temporary, missing_ok=True)
            raise InputMismatch(name, sha256, actual)
        directory.replace(temporary, target.name)  # replaces a name, never writes through


def deliver(
    verdict: Verdict,
    attempt_dir: str,
    outputs: list[str],
    store_url: str,
    between: Between = None,
    *,
    max_bytes: int = DEFAULT_OUTPUT_MAX_MIB * MIB,
) -> tuple[Verdict, list[dict[str, Any]]]:
    """An attempt that would succeed hands over its declared outputs: each is hashed and
    put in the run's store (call it outside any transaction); returns the verdict and
    what the settle records (name, sha256, size_bytes, location). A declared output
    that is missing makes it ``failed`` (the job ran and did not deliver); outputs past
    a bound (``max_bytes`` each: the stage's ``output_max_mib``; matches, depth) or a
    store that cannot take them make it ``harness_failure`` (nothing is stored; the
    files stay in the workspace, the exit code is kept). A damaged object replaced in
    the store is one of the verdict's diagnostics. Anything else passes through.
    ``between`` runs before each file, as the globs walk, and after each chunk hashed,
    written or read back (the worker renews its leases there when they are due). A
    store that takes a file in one call (S3: one PUT) runs nothing in between."""
    if verdict.outcome is not Outcome.SUCCEEDED or not outputs:
        return verdict, []
    workspace = Path(attempt_dir) / "workspace"
    try:
        found, missing = find_outputs(workspace, outputs, between, max_bytes=max_bytes)
    except OutputBound as exc:
        return replace(verdict, outcome=Outcome.HARNESS_FAILURE, reason=str(exc)), []
    except OSError as exc:
        reason = f"its outputs could not be read: {exc.strerror or exc}"
        if exc.filename:
            reason += f" ({exc.filename})"
        return replace(verdict, outcome=Outcome.HARNESS_FAILURE, reason=reason), []
    if missing:
        reason = (
            f"declared output {', '.join(missing)} is missing from its workspace: the job "
            "ran and did not deliver it"
        )
        return replace(verdict, outcome=Outcome.FAILED, reason=reason), []
    diagnostics = list(verdict.diagnostics)
    try:
        store = ArtifactStore(store_url)
        stored = []
        for output in found:
            if between is not None:
                between()
            placed = store.put(output, between)
            if placed.replaced is not None:
                diagnostics.append(
                    f"artifact store: {placed.location} held bytes hashing to sha256 "
                    f"{placed.replaced}, not its name; replaced with output {output.name}'s "
                    "verified bytes"
                )
            stored.append(
                {
                    "name": output.name,
                    "sha256": output.sha256,
                    "size_bytes": output.size_bytes,
                    "location": placed.location,
                }
            )
    except (StoreError, PathRefused) as exc:
        reason = (
            f"its outputs could not be stored ({exc}); they are kept in {workspace}, the "
            "exit code with them"
        )
        return replace(verdict, outcome=Outcome.HARNESS_FAILURE, reason=reason), []
    if diagnostics != verdict.diagnostics:
        verdict = replace(verdict, diagnostics=diagnostics)
    return verdict, stored
