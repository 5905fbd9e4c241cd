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
"""

from __future__ import annotations

import json
import os
import stat

from controller import faults

TYPE_CHECKING = False
if TYPE_CHECKING:  # the supervisor imports this module: it must start fast (no typing)
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
    is left untouched: a torn file is never visible under the final name.
    """
    target = os.fspath(path)
    partial = target + ".partial"
    site = faults.site_of(target)
    file_mode = modes()[0]
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, file_mode)
    try:
        try:
            # Why: a stale partial keeps its old mode through O_TRUNC, and the umask
            # may take bits off; the replaced file takes this mode too.
            _set_mode(fd, file_mode)
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
    fsync_dir(os.path.dirname(target) or ".")


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Atomically write ``payload`` as pretty JSON (sorted keys, trailing newline)."""
    data = (json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n").encode()
    write_bytes(path, data)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; raises OSError or ValueError (json.JSONDecodeError) as they come."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
