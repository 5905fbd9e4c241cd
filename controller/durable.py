"""The one helper for durable files: write ``*.partial``, fsync, rename, fsync the directory.

Every receipt, exit record, status snapshot and summary goes through ``write_json`` so a
reader either sees the old file or the whole new one, and a crash after ``write_json``
returns cannot lose it. Kept dependency-free: the per-attempt supervisor imports it.

Permissions: laneway's files can hold job output, results and paths that are nobody
else's business, so every file written here is created owner-only (0600), whatever the
umask, and a replaced file gets that mode too (a file an older laneway left readable is
tightened on its next write); ``make_private_dir`` creates directories 0700, and
``open_private`` opens a log or other streamed file 0600. ``LANEWAY_GROUP_READABLE=1``
in the environment relaxes this to group-readable (0640 files, 0750 directories) for a
team that shares a Unix group; nothing is ever made world-readable. See
docs/security.md.

Links: an attempt directory is predictable and writable by the job, so a job (or a
sibling job of its run) can plant a symlink where laneway will read or write. The one
rule, kept by ``AttemptDir``: laneway's own reads and writes under an attempt directory
never follow a symlink (every component is opened with ``O_NOFOLLOW`` relative to its
parent's directory descriptor), only regular files are read, a file laneway creates
there is created with ``O_EXCL`` (a path that should not exist yet is refused, never
reused), and a rename replaces whatever name it lands on instead of writing through
it. ``write_bytes`` keeps the same rule for the file it writes (its ``*.partial`` is
created exclusively, never through a link) wherever it writes. A refusal is
``PathRefused`` (an ``OSError``), which the callers already turn into a recorded
outcome or diagnostic.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from laneway.controller import faults

TYPE_CHECKING = False
if TYPE_CHECKING:  # the supervisor imports this module: it must start fast (no typing)
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from typing import IO, Any

GROUP_READABLE_ENV = "LANEWAY_GROUP_READABLE"
_OWNER_ONLY = (0o600, 0o700)
_GROUP_READABLE = (0o640, 0o750)


def modes(environ: dict[str, str] | None = None, *, strict: bool = False) -> tuple[int, int]:
    """(file mode, directory mode) for what laneway creates: owner-only, or with
    ``LANEWAY_GROUP_READABLE=1`` group-readable. A value that is neither raises
    ValueError naming the variable when ``strict``; otherwise it means owner-only (the
    writers never fail over it: ``check_modes`` is how a command reports it)."""
    raw = (os.environ if environ is None else environ).get(GROUP_READABLE_ENV, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return _GROUP_READABLE
    if value in ("", "0", "false", "no") or not strict:
        return _OWNER_ONLY
    raise ValueError(
        f"{GROUP_READABLE_ENV}: {raw!r} is not allowed; set it to 1 to let the group read "
        "laneway's files, or unset it (owner only)"
    )


def check_modes(environ: dict[str, str] | None = None) -> str | None:
    """The one-line problem with ``LANEWAY_GROUP_READABLE``, or None: for a command to
    report at startup, before anything is written."""
    try:
        modes(environ, strict=True)
    except ValueError as exc:
        return str(exc)
    return None


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and any missing parents with the directory mode (0700, or 0750
    when group-readable), whatever the umask. Directories that already exist are left
    as they are. Returns the path; raises OSError (e.g. a file in the way)."""
    from pathlib import Path  # not on the supervisor's path

    directory = Path(path)
    dir_mode = modes()[1]
    missing = []
    for candidate in (directory, *directory.parents):
        if candidate.is_dir():
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        try:
            os.mkdir(candidate, dir_mode)
        except FileExistsError:
            if not candidate.is_dir():
                raise
            continue  # made by a concurrent process: theirs, left as it is
        os.chmod(candidate, dir_mode)  # the umask may have taken bits off
    return directory


def _set_mode(fd: int, mode: int) -> None:
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)


def open_private(path: str | os.PathLike[str], mode: str = "ab") -> IO[bytes]:
    """Open a file for writing in binary ``mode`` (``ab``, ``wb`` or ``xb``) with the
    file mode (0600, or 0640 when group-readable), also when it already exists."""
    flags = {
        "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
        "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
        "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    }
    if mode not in flags:
        raise ValueError(f"open_private mode: {mode!r} is not allowed; use 'ab', 'wb' or 'xb'")
    file_mode = modes()[0]
    fd = os.open(path, flags[mode] | os.O_CLOEXEC, file_mode)
    try:
        _set_mode(fd, file_mode)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, mode)


class PathRefused(OSError):
    """A path under an attempt directory that laneway will not use: a symlink, not the
    kind of file expected, or there already where laneway is about to create it."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_EXISTS = "exists already; laneway creates it and refuses one made before"
_LINK_ERRORS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)
"""What opening a symlink with O_NOFOLLOW (or a file as a directory) fails with."""


def _parts(relative: str) -> list[str]:
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise PathRefused(errno.EINVAL, "'..' is not allowed under an attempt directory", relative)
    return parts


def _refused(exc: OSError, path: str) -> OSError:
    if exc.errno in _LINK_ERRORS:
        return PathRefused(
            exc.errno,
            "is a symlink or not what laneway expects there; laneway does not follow links "
            "under an attempt directory",
            path,
        )
    return exc


def _open_dir(name: str | os.PathLike[str], dir_fd: int | None, shown: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(exc, shown) from exc


def _make_dir(name: str, dir_fd: int, shown: str, *, exclusive: bool) -> int:
    """mkdir ``name`` under ``dir_fd`` with the directory mode and open it (never
    through a link); ``exclusive``: one that exists already is refused."""
    dir_mode = modes()[1]
    created = True
    try:
        os.mkdir(name, dir_mode, dir_fd=dir_fd)
    except FileExistsError as exc:
        if exclusive:
            raise PathRefused(errno.EEXIST, _EXISTS, shown) from exc
        created = False
    fd = _open_dir(name, dir_fd, shown)
    if created:
        try:
            _set_mode(fd, dir_mode)  # the umask may have taken bits off
        except OSError:
            os.close(fd)
            raise
    return fd


class AttemptDir:
    """An attempt directory (or one below it: a workspace), opened once; laneway's own
    reads and writes under it never follow a symlink.

    The directory itself is opened with ``O_NOFOLLOW`` (its parents are the runtime
    dir's, which an operator may reach through a link of their own); every path below
    it is resolved one component at a time with ``O_NOFOLLOW`` against the parent's
    descriptor, so a planted link fails with ``PathRefused`` instead of leading laneway
    out. Use it as a context manager, or ``close`` it."""

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        self.path = os.fspath(path)
        self.fd = _open_dir(self.path, None, self.path) if fd is None else fd

    @classmethod
    def make(cls, path: str | os.PathLike[str], *, base: str | os.PathLike[str]) -> AttemptDir:
        """Make the attempt directory ``path`` below ``base`` (made as
        ``make_private_dir`` makes it): the directories between them are created or
        entered without following a link, and ``path`` itself must not exist yet (a
        directory planted before its attempt started is refused)."""
        target, top = os.fspath(path), os.fspath(base)
        relative = os.path.relpath(target, top)
        parts = _parts(relative)
        if not parts or relative.startswith(".."):
            raise ValueError(f"{target} is not below {top}")
        make_private_dir(top)
        fd = _open_dir(top, None, top)
        try:
            for index, part in enumerate(parts):
                shown = os.path.join(top, *parts[: index + 1])
                child = _make_dir(part, fd, shown, exclusive=index == len(parts) - 1)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return cls(target, fd=fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> AttemptDir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _shown(self, relative: str) -> str:
        return os.path.join(self.path, relative)

    def _dir_of(self, parts: list[str], *, create: bool) -> int:
        """A descriptor of the directory ``parts`` below this one (the caller closes it
        unless it is ``self.fd``)."""
        fd = self.fd
        try:
            for index, part in enumerate(parts):
                shown = self._shown("/".join(parts[: index + 1]))
                child = (
                    _make_dir(part, fd, shown, exclusive=False)
                    if create
                    else _open_dir(part, fd, shown)
                )
                if fd != self.fd:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd != self.fd:
                os.close(fd)
            raise
        return fd

    def _split(self, relative: str, *, create_dirs: bool = False) -> tuple[int, str]:
        parts = _parts(relative)
        if not parts:
            raise PathRefused(errno.EINVAL, "names no file", self._shown(relative))
        return self._dir_of(parts[:-1], create=create_dirs), parts[-1]

    def subdir(self, relative: str, *, create: bool = False) -> AttemptDir:
        """The directory ``relative`` below this one, as an ``AttemptDir`` of its own
        (``create``: made, with its missing parents, where missing)."""
        fd = self._dir_of(_parts(relative), create=create)
        if fd == self.fd:
            fd = os.dup(fd)
        return AttemptDir(self._shown(relative), fd=fd)

    def make_dir(self, relative: str, *, exclusive: bool = False) -> None:
        """Create directory ``relative`` (and missing parents) with the directory mode;
        ``exclusive``: the last one must not exist yet."""
        parent, name = self._split(relative, create_dirs=True)
        try:
            os.close(_make_dir(name, parent, self._shown(relative), exclusive=exclusive))
        finally:
            if parent != self.fd:
                os.close(parent)

    def open(self, relative: str, flags: int, *, create_dirs: bool = False) -> int:
        """``os.open`` of ``relative`` with ``O_NOFOLLOW`` added (and the file mode when
        it creates); a link is ``PathRefused``, and so is an existing file under
        ``O_EXCL``."""
        parent, name = self._split(relative, create_dirs=create_dirs)
        shown = self._shown(relative)
        file_mode = modes()[0]
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode, dir_fd=parent)
        except FileExistsError as exc:
            raise PathRefused(errno.EEXIST, _EXISTS, shown) from exc
        except OSError as exc:
            raise _refused(exc, shown) from exc
        finally:
            if parent != self.fd:
                os.close(parent)
        if flags & os.O_CREAT:
            try:
                _set_mode(fd, file_mode)
            except OSError:
                os.close(fd)
                raise
        return fd

    def read(self, relative: str) -> IO[bytes]:
        """Open regular file ``relative`` for reading (a FIFO, device or link is
        ``PathRefused``: opening never blocks on one)."""
        fd = self.open(relative, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PathRefused(errno.EINVAL, "is not a regular file", self._shown(relative))
            os.set_blocking(fd, True)
        except OSError:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def read_bytes(self, relative: str, limit: int) -> bytes:
        """The whole regular file ``relative`` (opened as ``read`` opens it: no link, no
        FIFO, no device), at most ``limit`` bytes: a longer one is ``PathRefused``
        (``EFBIG``), judged by what is read, not by ``st_size``."""
        with self.read(relative) as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise PathRefused(errno.EFBIG, f"is larger than {limit} bytes", self._shown(relative))
        return data

    def create(self, relative: str, *, create_dirs: bool = False) -> IO[bytes]:
        """Create file ``relative`` for writing; it must not exist yet (``O_EXCL``)."""
        fd = self.open(relative, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_dirs=create_dirs)
        return os.fdopen(fd, "wb")

    def append(self, relative: str) -> IO[bytes]:
        """Open file ``relative`` for appending, creating it (never through a link)."""
        return os.fdopen(self.open(relative, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")

    def lstat(self, relative: str) -> os.stat_result:
        """The ``lstat`` of ``relative`` (a link is described, not followed)."""
        parent, name = self._split(relative)
        try:
            return os.stat(name, dir_fd=parent, follow_symlinks=False)
        finally:
            if parent != self.fd:
                os.close(parent)

    def exists(self, relative: str) -> bool:
        """Whether anything (a link included) is at ``relative``."""
        try:
            self.lstat(relative)
        except FileNotFoundError:
            return False
        return True

    def replace(self, source: str, target: str) -> None:
        """Rename ``source`` to ``target`` (both below this directory): whatever is at
        ``target``, a link included, is replaced, never written through."""
        source_dir, source_name = self._split(source)
        try:
            target_dir, target_name = self._split(target)
            try:
                os.replace(source_name, target_name, src_dir_fd=source_dir, dst_dir_fd=target_dir)
            finally:
                if target_dir != self.fd:
                    os.close(target_dir)
        finally:
            if source_dir != self.fd:
                os.close(source_dir)

    def unlink(self, relative: str, *, missing_ok: bool = False) -> None:
        """Remove the name ``relative`` (a link itself, not what it points at)."""
        parent, name = self._split(relative)
        try:
            os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            if not missing_ok:
                raise
        finally:
            if parent != self.fd:
                os.close(parent)

    def fsync(self) -> None:
        """fsync this directory (a rename inside it survives a power cut)."""
        os.fsync(self.fd)

    def write_bytes(self, relative: str, data: bytes) -> None:
        """``write_bytes`` (atomic, private) of ``relative`` below this directory."""
        parent, name = self._split(relative)
        try:
            _write_atomic(parent, name, data, self._shown(relative))
        finally:
            if parent != self.fd:
                os.close(parent)

    def write_json(self, relative: str, payload: Any) -> None:
        """``write_json`` of ``relative`` below this directory."""
        self.write_bytes(relative, _json_bytes(payload))

    def walk(
        self, relative: str = "", *, descend: Callable[[tuple[str, ...]], bool] | None = None
    ) -> Iterator[tuple[tuple[str, ...], bool, int]]:
        """Every directory and regular file below ``relative``, as (path components,
        is a directory, size in bytes), depth first, in no set order. Links (to files or
        directories) and other special files are never entered, opened or yielded; a
        directory is entered only where ``descend(components)`` says so (default: all).
        Nothing is opened but directories, each with ``O_NOFOLLOW``; the caller bounds
        the walk by stopping the iteration."""
        top = self._dir_of(_parts(relative), create=False)
        try:
            yield from _scan(top, (), descend)
        finally:
            if top != self.fd:
                os.close(top)


def _scan(
    fd: int, prefix: tuple[str, ...], descend: Callable[[tuple[str, ...]], bool] | None
) -> Iterator[tuple[tuple[str, ...], bool, int]]:
    with os.scandir(fd) as entries:
        for entry in entries:
            parts = (*prefix, entry.name)
            if entry.is_symlink():
                continue
            if entry.is_dir(follow_symlinks=False):
                yield parts, True, 0
                if descend is not None and not descend(parts):
                    continue
                try:
                    child = _open_dir(entry.name, fd, entry.name)
                except PathRefused:
                    continue  # replaced by a link since it was listed: not entered
                try:
                    yield from _scan(child, parts, descend)
                finally:
                    os.close(child)
            elif entry.is_file(follow_symlinks=False):
                yield parts, False, entry.stat(follow_symlinks=False).st_size


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (mode 0600, or 0640 when
    group-readable, also when it replaces a file with another mode); raises OSError if
    any step fails.

    On failure the partial file is removed (best effort) and the old content, if any,
    is left untouched: a torn file is never visible under the final name. The partial
    is created exclusively and never through a link (a stale one, or a link planted
    under its name, is removed first), and the rename replaces whatever is at ``path``.
    """
    target = os.fspath(path)
    directory = os.path.dirname(target) or "."
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _write_atomic(dir_fd, os.path.basename(target), data, target)
    finally:
        os.close(dir_fd)


def _write_atomic(dir_fd: int, name: str, data: bytes, shown: str) -> None:
    partial = name + ".partial"
    site = faults.site_of(name)
    file_mode = modes()[0]
    # Why: a stale partial (a crash mid-write) or a link planted under its name is
    # removed, not written through; O_EXCL | O_NOFOLLOW then refuses one planted since.
    try:
        os.unlink(partial, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(partial, flags, file_mode, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(exc, shown + ".partial") from exc
    try:
        try:
            _set_mode(fd, file_mode)  # the umask may take bits off
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if site:
                faults.check(site)  # test hook: the write or its fsync failing
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        # Why: a stray partial must never be mistaken for evidence; the error still propagates.
        try:
            os.unlink(partial, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    os.fsync(dir_fd)


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Atomically write ``payload`` as pretty JSON (sorted keys, trailing newline)."""
    write_bytes(path, _json_bytes(payload))


def _json_bytes(payload: Any) -> bytes:
    return (json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n").encode()


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; raises OSError or ValueError (json.JSONDecodeError) as they come."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
