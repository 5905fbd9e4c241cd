"""Classifying a finished attempt into one outcome class.

The classes and rules are documented in docs/architecture.md ("Outcome classification").

Pure policy over what the supervisor and the job left on disk. The rules, in order:

1. No readable exit record → the outcome cannot be established: ``None`` (unknown).
2. The command could not be started → ``harness_failure``.
3. Stopped by an operator → ``cancelled``; killed by its timeout → ``timed_out``, its
   reason naming the limit and its field (``timeout_reason``).
4. The supervisor could not write the logs, or laneway's own I/O failed reading
   result.json (EIO, EMFILE: the machine's error, not the file's kind or content) →
   ``harness_failure`` (the exit code is kept).
5. A valid result JSON with ``fatal_failure: true`` → ``fatal``; with
   ``rate_limited: true`` → ``rate_limited`` (its ``retry_after_seconds``, if any, is
   the retry's delay); with ``infrastructure_failure: true`` → ``infra_failure``.
6. Killed by a signal nobody sent on purpose → ``failed``.
7. Otherwise the stage's exit-code map (unlisted non-zero codes → ``failed``).
8. A result that is present but invalid can never be "succeeded": ``failed``, with the
   problem kept as a diagnostic. Never turn a crash or an unreadable result into success.
9. A stage with ``result = "required"``: a missing, invalid or incomplete result.json
   (it must carry ``job_id`` and both ``infrastructure_failure`` and ``fatal_failure``
   as booleans) can never be "succeeded" either: an exit that maps to success becomes
   ``harness_failure``, its reason naming what is missing; any other class is kept
   (a ``true`` flag that is there still counts, rule 5), with the problem as a
   diagnostic.

Nothing a job writes makes reading its attempt raise, hang or leave it: both files are
read through ``durable.AttemptDir`` (no link followed, regular files only, a FIFO never
waited on, a bounded size). A result.json that is a link, a directory, a FIFO, a device
or a socket, that the job made unreadable (its mode), larger than ``RESULT_MAX_BYTES``,
nested deeper than ``usage.RESULT_MAX_DEPTH`` or not JSON at all is an invalid result
(rule 8), never ``harness_failure``; an exit record that is any of these, or whose
fields a supervisor would not write, is not trusted (rule 1). What a valid result holds
that no backend can store (NUL, unpaired surrogates) is replaced by the settle, with a
diagnostic (``usage.stored_result``).
"""

from __future__ import annotations

import errno
import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from laneway.controller import faults
from laneway.controller import usage as usage_math
from laneway.controller.durable import AttemptDir, PathRefused
from laneway.controller.states import Outcome

ResultRequirement = Literal["optional", "required"]
REQUIRED_FIELDS = ("job_id", "infrastructure_failure", "fatal_failure")
RESULT_MAX_BYTES = 16 * 1024 * 1024
"""A larger result.json is not read (it would be parsed in the worker's memory and
stored whole in the ledger): an invalid result, said so in a diagnostic."""
EXIT_INT_LIMIT = 2**31
"""An exit record's exit code and signal fit the ledger's 32-bit integer columns."""


@dataclass
class Verdict:
    outcome: Outcome | None
    """None means unknown: nothing on disk establishes what happened."""
    reason: str
    diagnostics: list[str] = field(default_factory=list)


def _shown(value: Any) -> str:
    """A value from result.json as a reason may quote it: numbers, booleans and null
    as they are; strings and containers only by kind and size, since a job may have put
    a secret there and reasons are stored in the ledger unredacted."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return "(an integer of more than 19 digits)"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"(a string of {len(value)} characters)"
    if isinstance(value, dict):
        return f"(an object of {len(value)} keys)"
    if isinstance(value, list):
        return f"(a list of {len(value)} items)"
    return f"(a {type(value).__name__})"


def check_result(result: Any, job_id: int) -> str | None:
    """Why ``result`` (parsed result.json) is not acceptable, or None if it is."""
    if not isinstance(result, dict):
        return "result.json must be a JSON object"
    if not _names_job(result.get("job_id"), job_id):
        return f"result.json job_id {_shown(result.get('job_id'))} is not this job ({job_id})"
    for flag in ("infrastructure_failure", "fatal_failure", "rate_limited"):
        if flag in result and not isinstance(result[flag], bool):
            return f"result.json {flag} must be true or false, not {_shown(result[flag])}"
    if "retry_after_seconds" in result and retry_after(result) is None:
        return (
            "result.json retry_after_seconds must be a number from 0 to "
            f"{RETRY_AFTER_MAX:g}, not {_shown(result['retry_after_seconds'])}"
        )
    return None


RETRY_AFTER_MAX = 86400.0
"""The longest delay a job may ask for before its rate-limited retry (a day)."""


def retry_after(result: dict[str, Any] | None) -> float | None:
    """The delay a rate-limited result asks for (``retry_after_seconds``), or None when
    it names none or one that is not a number in [0, ``RETRY_AFTER_MAX``]."""
    value = (result or {}).get("retry_after_seconds")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not 0 <= value <= RETRY_AFTER_MAX:  # NaN compares false: refused too
        return None
    return float(value)


def _names_job(value: Any, job_id: int) -> bool:
    """The job's id as a number or as its text (``LANEWAY_JOB_ID`` is text). Compared
    without ``str()`` of anything else: that of a deeply nested value can raise."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value == job_id
    return isinstance(value, str) and value == str(job_id)


class ResultRefused(ValueError):
    """result.json is something laneway will not take: not a regular file (a link, a
    directory, a FIFO, a device, a socket), not readable as the job left it, too large
    or nested too deeply. What the job made it, so an invalid result, never our I/O."""


RESULT_FILE = "result.json"
EXIT_FILE = "exit.json"
EXIT_MAX_BYTES = 1 << 20
"""A supervisor's exit record is a few hundred bytes; a larger exit.json is not read."""
JOB_CAUSED_ERRNOS = frozenset(
    {
        errno.EACCES,  # the job took its own read permission off
        errno.EPERM,
        errno.ELOOP,  # a symlink (O_NOFOLLOW)
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENXIO,  # a socket (or a FIFO opened for writing)
        errno.EINVAL,
        errno.EFBIG,
        errno.EOVERFLOW,
        errno.ENAMETOOLONG,
    }
)
"""Errors of reading a file in the attempt directory that the job's own doing explains
(the kind or mode of what it left there); any other OSError (EIO, EMFILE, ...) is the
machine's, and so laneway's side: ``harness_failure`` for a result."""


def _kind_of(directory: AttemptDir, name: str) -> str | None:
    """What is at ``name`` (without following a link) when it is not a regular file:
    ``a symlink``, ``a directory``, ``a FIFO`` ...; None for a regular file or nothing."""
    try:
        mode = directory.lstat(name).st_mode
    except OSError:
        return None
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((words for test, words in kinds if test(mode)), None)


def _job_caused(exc: OSError) -> bool:
    return isinstance(exc, PathRefused) or exc.errno in JOB_CAUSED_ERRNOS


def _refusal(directory: AttemptDir, name: str, exc: OSError, limit: int) -> str:
    """One line saying why ``name`` is not read: what the job made it."""
    kind = _kind_of(directory, name)
    if kind == "a symlink":
        return f"{name} is a symlink; laneway follows no link under an attempt directory"
    if kind is not None:
        return f"{name} is not a regular file ({kind})"
    if exc.errno == errno.EFBIG:
        return f"{name} is larger than the {limit} bytes laneway reads"
    return f"{name} cannot be read as the job left it: {exc.strerror or exc}"


def read_attempt_json(directory: AttemptDir, name: str, limit: int) -> Any:
    """``name`` in the attempt directory, parsed: a regular file of at most ``limit``
    bytes, read through ``AttemptDir`` (no link followed, a FIFO never waited on).
    FileNotFoundError when there is none; ResultRefused when the job made it something
    laneway does not read (module docstring); OSError when our own I/O failed;
    ValueError when it is not UTF-8 JSON; RecursionError when nested past Python's
    reader."""
    try:
        data = directory.read_bytes(name, limit)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if _job_caused(exc):
            raise ResultRefused(_refusal(directory, name, exc, limit)) from None
        raise
    return json.loads(data.decode("utf-8"))


def read_result(directory: AttemptDir) -> Any:
    """A job's result.json, parsed (``read_attempt_json``): FileNotFoundError when there
    is none, ResultRefused when it is not a regular file (a link, a directory, a FIFO,
    a device, a socket), cannot be read as the job left it, is larger than
    ``RESULT_MAX_BYTES`` or is nested deeper than ``usage.RESULT_MAX_DEPTH``, ValueError
    when it is not JSON, OSError when our own I/O failed reading it."""
    too_deep = f"result.json is nested deeper than {usage_math.RESULT_MAX_DEPTH} levels"
    try:
        size = directory.lstat(RESULT_FILE).st_size
    except FileNotFoundError:
        raise
    except OSError:
        size = 0  # said by the read below
    if size > RESULT_MAX_BYTES:
        raise ResultRefused(
            f"result.json is {size} bytes, more than the {RESULT_MAX_BYTES} laneway reads"
        )
    try:
        result = read_attempt_json(directory, RESULT_FILE, RESULT_MAX_BYTES)
    except RecursionError:
        # Python's JSON reader recurses once per level of nesting.
        raise ResultRefused(too_deep) from None
    if _depth_exceeds(result, usage_math.RESULT_MAX_DEPTH):
        raise ResultRefused(too_deep)
    return result


def _depth_exceeds(value: Any, limit: int) -> bool:
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth >= limit:
                return True
            pending.extend((child, depth + 1) for child in item)
    return False


def exit_record_problem(record: dict[str, Any]) -> str | None:
    """Why an exit record is not one a supervisor writes (its fields have the wrong
    type or size for the ledger), or None. The job can write into its attempt
    directory, so a record that does not look right is not trusted."""
    for name in ("exit_code", "signal"):
        value = record.get(name)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not -EXIT_INT_LIMIT < value < EXIT_INT_LIMIT
        ):
            return f"exit.json {name} is {_shown(value)}, not a 32-bit integer"
    if not isinstance(record.get("spawn_error") or "", str):
        return "exit.json spawn_error is not text"
    log_errors = record.get("log_errors") or []
    if not isinstance(log_errors, list) or not all(isinstance(e, str) for e in log_errors):
        return "exit.json log_errors is not a list of texts"
    return None


def missing_fields(result: dict[str, Any]) -> str | None:
    """What a valid result lacks for a stage with ``result = "required"``, or None."""
    missing = [name for name in REQUIRED_FIELDS if name not in result]
    if missing:
        return (
            f"result.json lacks {', '.join(missing)}, which the stage requires "
            '(result = "required")'
        )
    return None


def timeout_reason(stage: str | None, timeout_seconds: int | None) -> str:
    """The reason of an attempt killed by its timeout: the limit and the config field
    that set it, e.g. ``timed out after 30 s (stages.solve.timeout_seconds = 30)``;
    without the limit known, ``killed by its timeout``."""
    if timeout_seconds is None:
        return "killed by its timeout"
    field_name = f"stages.{stage}.timeout_seconds" if stage else "timeout_seconds"
    return f"timed out after {timeout_seconds} s ({field_name} = {timeout_seconds})"


def classify(
    exit_record: dict[str, Any] | None,
    *,
    exit_problem: str | None,
    result: dict[str, Any] | None,
    result_problem: str | None,
    exit_codes: dict[int, Outcome],
    result_unreadable: bool = False,
    required_problem: str | None = None,
    stage: str | None = None,
    timeout_seconds: int | None = None,
) -> Verdict:
    """The outcome of one attempt; see the module docstring for the rules. ``stage``
    and ``timeout_seconds`` (the stage's limit) name a timeout in its reason."""
    if exit_record is None:
        return Verdict(None, exit_problem or "no exit record")
    diagnostics = [result_problem] if result_problem else []
    if required_problem and required_problem != result_problem:
        diagnostics.append(required_problem)
    if exit_record.get("spawn_error"):
        return Verdict(
            Outcome.HARNESS_FAILURE, f"could not start: {exit_record['spawn_error']}", diagnostics
        )
    if exit_record.get("stopped"):
        return Verdict(Outcome.CANCELLED, "stopped by an operator", diagnostics)
    if exit_record.get("timed_out"):
        return Verdict(Outcome.TIMED_OUT, timeout_reason(stage, timeout_seconds), diagnostics)
    log_errors = exit_record.get("log_errors") or []
    if log_errors:
        return Verdict(
            Outcome.HARNESS_FAILURE,
            "log write failed: " + "; ".join(log_errors),
            diagnostics + [f"log: {e}" for e in log_errors],
        )
    if result_unreadable:
        return Verdict(
            Outcome.HARNESS_FAILURE,
            f"{result_problem} (exit code {exit_record.get('exit_code')} kept)",
            diagnostics,
        )
    if result is not None and result_problem is None:
        if result.get("fatal_failure") is True:
            return Verdict(Outcome.FATAL, "result.json reports fatal_failure", diagnostics)
        if result.get("rate_limited") is True:
            delay = retry_after(result)
            return Verdict(
                Outcome.RATE_LIMITED,
                "result.json reports rate_limited"
                + (f" (retry after {delay:g} s)" if delay is not None else ""),
                diagnostics,
            )
        if result.get("infrastructure_failure") is True:
            return Verdict(
                Outcome.INFRA_FAILURE, "result.json reports infrastructure_failure", diagnostics
            )
    signum = exit_record.get("signal")
    if signum is not None:
        return Verdict(Outcome.FAILED, f"killed by signal {signum}", diagnostics)
    code = exit_record.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool):
        return Verdict(None, "exit record has neither an exit code nor a signal", diagnostics)
    outcome = exit_codes.get(code, Outcome.SUCCEEDED if code == 0 and 0 not in exit_codes else None)
    if outcome is None:
        outcome = Outcome.FAILED
    if outcome is Outcome.SUCCEEDED and required_problem:
        return Verdict(Outcome.HARNESS_FAILURE, f"exit {code} but {required_problem}", diagnostics)
    if outcome is Outcome.SUCCEEDED and result_problem:
        return Verdict(Outcome.FAILED, f"exit {code} but {result_problem}", diagnostics)
    return Verdict(outcome, f"exit code {code}", diagnostics)


def _read_exit(
    directory: AttemptDir, missing_exit: str
) -> tuple[dict[str, Any] | None, str | None]:
    """(exit record, None), or (None, why it is not trusted): missing, unreadable,
    not a regular file or not what a supervisor writes."""
    try:
        loaded = read_attempt_json(directory, EXIT_FILE, EXIT_MAX_BYTES)
    except FileNotFoundError:
        return None, missing_exit
    except ResultRefused as exc:
        return None, str(exc)
    except (OSError, ValueError) as exc:
        return None, f"exit.json unreadable: {exc}"
    except RecursionError:
        return None, "exit.json unreadable: nested too deeply"
    if not isinstance(loaded, dict):
        return None, "exit.json is not a JSON object"
    problem = exit_record_problem(loaded)
    return (loaded if problem is None else None), problem


def _read_job_result(directory: AttemptDir, job_id: int) -> tuple[Any, str | None, bool]:
    """(result, why it is invalid, whether our own I/O failed reading it)."""
    try:
        faults.check("result_read")  # test hook
        result = read_result(directory)
    except FileNotFoundError:
        return None, None, False
    except ResultRefused as exc:
        return None, str(exc), False
    except ValueError as exc:
        return None, f"result.json is not valid JSON: {exc}", False
    except OSError as exc:
        # Our own I/O failed (EIO, EMFILE, ...): the job's report is unavailable, not
        # negative. What the job made of the file is a ResultRefused above.
        return None, f"result.json could not be read: {exc.strerror or exc}", True
    return result, check_result(result, job_id), False


def read_outcome(
    attempt_dir: str | Path,
    *,
    job_id: int,
    exit_codes: dict[int, Outcome],
    missing_exit: str,
    result_requirement: ResultRequirement = "optional",
    stage: str | None = None,
    timeout_seconds: int | None = None,
) -> tuple[Verdict, dict[str, Any] | None, dict[str, Any] | None]:
    """Classify an attempt from what its supervisor and job left in ``attempt_dir``.

    Returns (verdict, exit record, result). ``missing_exit`` is the reason used when
    there is no exit.json. A torn or unreadable exit.json is never trusted: unknown.
    ``result_requirement`` is the stage's ``result`` option (rule 9); ``stage`` and
    ``timeout_seconds`` name the limit in a timeout's reason.
    """
    if result_requirement not in ("optional", "required"):
        raise ValueError(
            f"result_requirement: {result_requirement!r} is not allowed; use 'optional' or "
            "'required'"
        )
    required = result_requirement == "required"
    exit_problem: str | None = None
    try:
        directory: AttemptDir | None = AttemptDir(attempt_dir)
    except FileNotFoundError:
        directory, exit_problem = None, missing_exit
    except OSError as exc:
        directory = None
        exit_problem = f"attempt directory {attempt_dir} cannot be opened: {exc.strerror or exc}"
    exit_record: dict[str, Any] | None = None
    result: Any = None
    result_problem: str | None = None
    result_unreadable = False
    if directory is not None:
        with directory:
            exit_record, exit_problem = _read_exit(directory, missing_exit)
            result, result_problem, result_unreadable = _read_job_result(directory, job_id)
    valid = result if isinstance(result, dict) else None
    required_problem = None
    if required:
        if valid is not None and missing_fields(valid):
            required_problem = missing_fields(valid)  # names the field, not its effect
        elif result_problem:
            required_problem = result_problem
        elif valid is None:
            required_problem = (
                'result.json is missing; the stage requires one (result = "required")'
            )
    verdict = classify(
        exit_record,
        exit_problem=exit_problem,
        result=valid,
        result_problem=result_problem,
        exit_codes=exit_codes,
        result_unreadable=result_unreadable,
        required_problem=required_problem,
        stage=stage,
        timeout_seconds=timeout_seconds,
    )
    return verdict, exit_record, valid
