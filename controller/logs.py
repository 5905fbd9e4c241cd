"""An attempt's output, read-only: which attempt, where its files are, their tail, and
following them while the attempt runs (``laneway logs``, and the web page's attempt view).

The supervisor writes ``stdout.log`` / ``stderr.log`` in the attempt directory, redacted
as it writes (workers/capture.py), so what is read here is already redacted. The ledger
is read through a ``Rows`` source (``readonly.ReadOnlyLedger``, as ``laneway status`` reads
it); the files are read where this process runs. On PostgreSQL with workers on several
machines the directory may be on another machine: ``LogsElsewhere`` names the node and
host that hold it.

The job can write its attempt directory, so these files are read through
``durable.AttemptDir``: a ``stdout.log`` replaced by a symlink (to ``/etc/shadow``, say),
a FIFO or a device is refused (``LogRefused``), never followed or printed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from laneway.controller import identity
from laneway.controller.durable import AttemptDir, PathRefused
from laneway.controller.errors import LanewayError, NotFound, UsageError
from laneway.controller.ids import parse_id
from laneway.controller.rows import Rows
from laneway.controller.states import AttemptState
from laneway.controller.status import find_run

STREAMS = ("stdout", "stderr")
TAIL_BLOCK = 64 * 1024
TAIL_MAX_BYTES = 4 * 1024 * 1024
"""A tail is at most this many bytes: a last line longer than that comes as its end."""
FOLLOW_CHUNK = 256 * 1024
"""At most this much is read from a log per look while following."""
IN_FLIGHT = (AttemptState.INTENT.value, AttemptState.RUNNING.value)


class LogsElsewhere(LanewayError):
    """The attempt's directory is not on this machine."""


class LogRefused(LanewayError):
    """The log's name holds a symlink or something else than a regular file."""


def _refusal(path: Path, exc: OSError) -> LogRefused:
    return LogRefused(
        f"{path}: {exc.strerror or exc}; laneway reads only a regular file there (the job "
        "can write its attempt directory: a link it plants is not followed)"
    )


def _open_log(path: Path) -> Any:
    """``path`` opened for reading without following a link (FileNotFoundError when it
    or its directory is missing; ``LogRefused`` for a link or a non-regular file)."""
    try:
        with AttemptDir(path.parent) as directory:
            return directory.read(path.name)
    except PathRefused as exc:
        raise _refusal(path, exc) from exc


@dataclass(frozen=True)
class AttemptRef:
    attempt_id: int
    job_id: int
    run_id: int
    number: int
    item: str
    stage: str
    state: str
    outcome: str | None
    node: str
    host: str | None
    attempt_dir: str
    peak_rss_mib: float | None
    peak_gpu_mib: float | None
    reused_by_job: int | None = None
    """The job of a later run that was asked for and reused this attempt's result
    (``jobs.reused_from``); None when the attempt is the job's own."""

    def path(self, stream: str) -> Path:
        return Path(self.attempt_dir) / f"{stream}.log"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_COLUMNS = (
    "a.id, a.job_id, a.run_id, a.number, i.key, j.stage, a.state, a.outcome, a.node, "
    "w.host, a.attempt_dir, a.peak_rss_mib, a.peak_gpu_mib"
)
_FROM = (
    "FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
    "LEFT JOIN workers w ON w.id = a.worker_id"
)


def _ref(row: tuple[Any, ...]) -> AttemptRef:
    return AttemptRef(*row)


def get_attempt(source: Rows, attempt_id: int) -> AttemptRef:
    """One attempt by id (NotFound if there is none)."""
    found = source.rows(f"SELECT {_COLUMNS} {_FROM} WHERE a.id = :id", {"id": attempt_id})
    if not found:
        raise NotFound(f"attempt {attempt_id} is not in the ledger; `laneway status` lists them")
    return _ref(found[0])


def newest_attempt(source: Rows, job_id: int) -> AttemptRef:
    """The job's newest attempt; for a job reused from an earlier run (it has no attempt
    of its own), the attempt that produced its result (``jobs.reused_from``), with
    ``reused_by_job`` set. NotFound if the job is unknown or has no attempt yet."""
    found = source.rows(
        f"SELECT {_COLUMNS} {_FROM} WHERE a.job_id = :job ORDER BY a.number DESC LIMIT 1",
        {"job": job_id},
    )
    if found:
        return _ref(found[0])
    job = source.rows(
        "SELECT i.key, j.stage, j.state, j.reused_from FROM jobs j "
        "JOIN items i ON i.id = j.item_id WHERE j.id = :job",
        {"job": job_id},
    )
    if not job:
        raise NotFound(f"job {job_id} is not in the ledger; `laneway status` lists the run's jobs")
    item, stage, state, reused_from = job[0]
    if reused_from is not None:
        producer = source.rows(f"SELECT {_COLUMNS} {_FROM} WHERE a.id = :id", {"id": reused_from})
        if producer:
            return replace(_ref(producer[0]), reused_by_job=job_id)
        raise NotFound(
            f"job {job_id} ({item}.{stage}) was reused from attempt {reused_from}, which is "
            "no longer in the ledger"
        )
    raise NotFound(f"job {job_id} ({item}.{stage}) has no attempt yet: it is {state}")


def reused_note(attempt: AttemptRef) -> str | None:
    """The line that says a reused job's logs are an earlier run's attempt's, e.g.
    ``i01.solve was reused from run 1, attempt 7:``; None for a job's own attempt."""
    if attempt.reused_by_job is None:
        return None
    return (
        f"{attempt.item}.{attempt.stage} was reused from run {attempt.run_id}, "
        f"attempt {attempt.attempt_id}:"
    )


def job_by_name(source: Rows, name: str, run_id: int | None) -> int:
    """The id of job ``ITEM.STAGE`` in run ``run_id`` (the newest run when None)."""
    item, dot, stage = name.rpartition(".")
    if not dot or not item or not stage:
        raise UsageError(f"{name!r}: name an attempt id, --job JOB, or a job as ITEM.STAGE")
    run = find_run(source, run_id)
    found = source.rows(
        "SELECT j.id FROM jobs j JOIN items i ON i.id = j.item_id "
        "WHERE j.run_id = :run AND i.key = :item AND j.stage = :stage",
        {"run": run["id"], "item": item, "stage": stage},
    )
    if not found:
        raise NotFound(f"run {run['id']} has no job {item}.{stage}")
    return int(found[0][0])


def resolve(
    source: Rows, target: str, *, job: bool = False, run_id: int | None = None
) -> AttemptRef:
    """``target``: an attempt id; a job id when ``job``; or a job as ``ITEM.STAGE`` (in
    run ``run_id``, default the newest; with or without ``job``), whose newest attempt
    is meant (for a reused job, the attempt that produced its result)."""
    number = parse_id(target)
    if number is not None:
        return newest_attempt(source, number) if job else get_attempt(source, number)
    return newest_attempt(source, job_by_name(source, target, run_id))


def this_host() -> str:
    """This machine's name as a worker records it (``controller.identity.host``)."""
    return identity.host()


def check_here(attempt: AttemptRef, stream: str) -> Path:
    """The stream's path, if this machine can read the attempt's directory; else
    ``LogsElsewhere`` naming the node and host that hold it, or NotFound when no file
    was ever written (an attempt that never started)."""
    path = attempt.path(stream)
    try:
        with _open_log(path):
            return path
    except FileNotFoundError:
        pass
    if Path(attempt.attempt_dir).is_dir() or (
        attempt.host in (None, this_host()) and attempt.state in IN_FLIGHT
    ):
        # Its directory is here (or will be: a starting attempt on this host): the file
        # just has not been written yet.
        return path
    if attempt.host is not None and attempt.host != this_host():
        raise LogsElsewhere(
            f"attempt {attempt.attempt_id}'s files are on node {attempt.node} (host "
            f"{attempt.host}), not on {this_host()}: {path}; run `laneway logs "
            f"{attempt.attempt_id}` there"
        )
    raise NotFound(
        f"attempt {attempt.attempt_id} has no {stream}.log at {path} (an attempt that "
        "never started may have no directory)"
    )


def tail_bytes(
    path: Path, lines: int | None, *, max_bytes: int = TAIL_MAX_BYTES
) -> tuple[bytes, int]:
    """The last ``lines`` lines of ``path`` (all of it when None), at most ``max_bytes``
    of them, and the offset where the file ended when read (to follow from). A missing
    file is empty; a link or a non-regular file is ``LogRefused``.

    Linear in what it returns: blocks are read backwards (``os.pread``), each counted
    for newlines once, until enough lines or ``max_bytes`` are in hand, then joined
    once; a 32 MiB file without a newline costs one ``max_bytes`` read, not a rescan
    per block."""
    try:
        with _open_log(path) as log:
            fd = log.fileno()
            size = os.fstat(fd).st_size
            if lines is None:
                return log.read(size), size
            if lines <= 0:
                return b"", size
            blocks: list[bytes] = []
            start, newlines, limit = size, 0, max(1, max_bytes)
            # One newline more than asked: the file's final newline ends the last line,
            # it does not start one.
            while start > 0 and newlines <= lines and size - start < limit:
                step = min(TAIL_BLOCK, start, limit - (size - start))
                start -= step
                block = os.pread(fd, step, start)
                blocks.append(block)
                newlines += block.count(b"\n")
    except FileNotFoundError:
        return b"", 0
    data = b"".join(reversed(blocks))
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    cut = end
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            break
    return (data if cut < 0 else data[cut + 1 :]), size


def read_from(path: Path, offset: int) -> tuple[bytes, int]:
    """What was appended to ``path`` after ``offset`` (at most ``FOLLOW_CHUNK``)."""
    try:
        with _open_log(path) as log:
            data = os.pread(log.fileno(), FOLLOW_CHUNK, offset)
    except FileNotFoundError:
        return b"", offset
    return data, offset + len(data)


def follow(
    path: Path,
    offset: int,
    state: Callable[[], str],
    wait: Callable[[float], None],
    *,
    interval: float = 0.2,
) -> Iterator[bytes]:
    """Chunks appended to ``path`` after ``offset`` until the attempt is no longer in
    flight (``state()``, one ledger row, is asked once per ``interval`` when nothing new
    was read); then what the file holds at that point, and the end."""
    while True:
        data, offset = read_from(path, offset)
        if data:
            yield data
            continue
        if state() not in IN_FLIGHT:
            # Settled (or unknown): the supervisor has written its last byte; drain.
            while True:
                data, offset = read_from(path, offset)
                if not data:
                    return
                yield data
        wait(interval)


def attempt_state(source: Rows, attempt_id: int) -> str:
    """The attempt's state (one row)."""
    found = source.rows("SELECT state FROM attempts WHERE id = :id", {"id": attempt_id})
    return str(found[0][0]) if found else AttemptState.SETTLED.value
