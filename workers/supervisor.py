"""The per-attempt supervisor: ``python -m laneway.workers.supervisor SPEC_JSON``.

One supervisor per attempt, started by the worker in its own session, so it outlives a
crash of the worker service (invariant 6; the numbered invariants are in
docs/invariants.md). It:

1. makes itself a child subreaper, so descendants that double-fork are re-parented to
   it and can be reaped and waited for (where the kernel offers ``prctl``; elsewhere,
   macOS or the portable paths forced, it tracks the job by its process group and
   session alone, and says so in the exit record: ``"subreaper": false, "tracks":
   "process group"``; see ``workers/seams.py``);
2. starts the command in a new process group, stdin from /dev/null, stdout and stderr
   into pipes;
3. reports the child's pid and start time on its stdout (one JSON line) to the worker;
4. streams both pipes through the redactor into ``stdout.log`` / ``stderr.log`` as
   output arrives;
5. enforces the timeout, and obeys TERM/INT/HUP (a controlled stop, invariant 7): TERM
   to the child's group, a grace budget, then KILL to the group;
6. after the child exits, stops any process of the attempt still alive the same way —
   in the job's group, or escaped from it (setsid) and re-parented to the subreaper —
   and verifies none is left;
7. fsyncs each log it wrote to, then writes ``exit.json`` atomically (temp, fsync,
   rename, fsync dir) and exits 0.

It imports only the standard library and laneway's stdlib-only helpers: it starts once
per attempt, so it must start fast. It never touches the ledger.

Its floor (``bench/bench_supervisor.py``): forked from the warm launcher, what an attempt
costs here beyond the job's own start is the fork's copy-on-write faults and a handful
of system calls. So nothing is imported, compiled or looked up per attempt (``warm_up``
runs in the launcher before it forks: libc's ``prctl``, the redactor's substitution
templates, the JSON encoder), ``/proc`` is read with bare system calls
(``identity.read_proc``), and the fsyncs are the fewest that keep every guarantee: one
per log that holds output (an empty log has nothing to lose; its name is made
durable by the directory's fsync below, in the same directory), then one of
``exit.json``'s temp file before its rename and one of the directory after it.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time

from laneway.controller import crashpoints, durable, faults
from laneway.controller.crashpoints import crash_point
from laneway.controller.durable import write_bytes
from laneway.controller.process_group import group_alive
from laneway.workers import identity
from laneway.workers.identity import boot_id, process_start_time
from laneway.workers.redact import Redactor

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: importing typing costs a start

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The ``laneway`` package's directory, which holds ``controller`` and ``workers``: the
checkout, or ``site-packages/laneway`` where laneway is installed."""
PACKAGE = (
    "import sys; laneway = type(sys)('laneway'); laneway.__path__ = [sys.argv[2]]; "
    "sys.modules['laneway'] = laneway; "
)
"""The start of a lean command line: ``-S`` skips site-packages, and with it the
installed package finder, so the ``laneway`` namespace is made by hand from ``ROOT``."""
BOOTSTRAP = PACKAGE + "from laneway.workers.supervisor import main; sys.exit(main(sys.argv[3:]))"
MARK = "laneway.workers.supervisor"
"""On the command line of every supervisor and launcher, so a restarted worker knows them."""


def launch_argv(spec_json: str) -> list[str]:
    """How the worker starts a supervisor: ``python -I -S``, so the interpreter reads no
    environment variables and skips site-packages (the supervisor needs only the
    standard library and laneway's own small modules, found through ``ROOT``). That
    keeps its start to a few milliseconds. ``MARK`` stays in the command line: a
    restarted worker finds supervisors by it (``recovery.find_supervisor``)."""
    return [sys.executable, "-I", "-S", "-c", BOOTSTRAP, MARK, ROOT, spec_json]


HELPER_ENV = (crashpoints.ENV, faults.ENV, durable.GROUP_READABLE_ENV)
"""The variables of the job's environment that the supervisor's helpers read from
``os.environ`` (test hooks, and the file mode). A supervisor forked by the launcher sets
only these in its ``os.environ`` (each one a ``putenv``); the rest of the job's
environment goes from the request to the job as it is, never through ``os.environ``."""

EXIT_RECORD = "exit.json"
EXIT_RECORD_FAILED = 3
DEFAULT_LOG_CAP = 1 << 30
"""Per stream, per attempt; beyond it one marker line, then output is discarded."""
PR_SET_CHILD_SUBREAPER = 36
READ_SIZE = 65536
DRAIN_SECONDS = 2.0
"""After the group is gone, how long to keep reading pipes held open by escapees."""


def _utc() -> str:
    """Now, as ISO 8601 UTC with milliseconds (``time``, not ``datetime``: it starts
    faster)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


_prctl: Any = None
"""libc's ``prctl``, looked up once per process (``warm_up``): a forked supervisor finds it
ready instead of loading libc through ctypes again."""


def _libc_prctl() -> Any:
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl


def _become_subreaper() -> bool:
    if identity.portable():
        return False  # the portable paths: no prctl, the job is tracked by its group
    prctl = _libc_prctl()
    return bool(prctl) and bool(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def record_bytes(record: dict[str, Any]) -> bytes:
    """``exit.json``'s bytes: the layout of ``durable.write_json`` (sorted keys, two-space
    indent, trailing newline) for a record of one level, from the C encoder (``indent``
    would select the pure-Python one, ten times slower). A list value stays on one line."""
    body = json.dumps(record, sort_keys=True, default=str, separators=(",\n  ", ": "))
    return ("{\n  " + body[1:-1] + "\n}\n").encode() if record else b"{}\n"


def warm_up() -> None:
    """Do once, in the launcher before it forks, what each supervisor would otherwise do
    for itself: load libc's ``prctl``, compile the redactor's patterns' substitution
    templates (``re`` caches them per process) and build the JSON encoders."""
    _libc_prctl()
    redactor = Redactor(["laneway-warm-up-secret"])
    redactor.feed(b"Bearer abcdefghijklmnop laneway-warm-up-secret\n")
    redactor.flush()
    record_bytes({"warm": [1, None, "x"]})
    json.dumps({"child_pid": 1})
    _utc()


def _on_child(_signum: int, _frame: object) -> None:
    """SIGCHLD: nothing to do here; its arrival wakes the watch loop (``set_wakeup_fd``),
    which reaps."""


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _children() -> list[int]:
    """Our direct children. As a subreaper we inherit every orphaned descendant, so this
    also finds processes that left the job's group (setsid) once their parent is gone.
    Without ``/proc`` (or with the portable paths forced) none are listed: the job is
    tracked by its process group."""
    pids: list[int] = []
    if identity.portable():
        return pids
    base = f"/proc/{os.getpid()}/task"
    try:
        tasks = os.listdir(base)
    except OSError:
        return pids
    for task in tasks:
        # Bytes, by bare system calls: a text-mode open costs its io and codec objects.
        found = identity.read_proc(f"{base}/{task}/children")
        if found:
            pids += [int(pid) for pid in found.split()]
    return pids


def _attempt_alive(pgid: int) -> bool:
    """Any process of the attempt left: in the job's group, or re-parented to us."""
    return group_alive(pgid, zombies_count=True) or bool(_children())


def _signal_attempt(pgid: int, signum: int) -> int:
    """Signal the job's group and every child of ours; returns how many escapees (our
    children outside the group) were signalled."""
    _signal_group(pgid, signum)
    escapees = 0
    for pid in _children():
        try:
            if os.getpgid(pid) != pgid:
                escapees += 1
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
    return escapees


class Supervision:
    """The state of one supervised child; ``run`` drives it to an exit record."""

    def __init__(self, spec: dict[str, Any], environ: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        if "portable" in spec:
            # Told by the worker (its seams): we run with the job's environment, which
            # does not carry the worker's LANEWAY_PORTABLE.
            identity.use_portable(bool(spec["portable"]))
        self.environ = os.environ if environ is None else environ
        """The job's environment (``os.environ`` where the supervisor was exec'd with it;
        the request's where the launcher forked it: see ``HELPER_ENV``)."""
        self.directory = spec["attempt_dir"]
        self.timeout = float(spec["timeout_seconds"])
        self.grace = float(spec["grace_seconds"])
        self.log_cap = max(1, int(spec.get("log_cap_bytes", DEFAULT_LOG_CAP)))
        self._written: dict[str, int] = {}
        self.record: dict[str, Any] = {
            "schema": 1,
            "attempt_id": spec["attempt_id"],
            "supervisor_pid": os.getpid(),
            "supervisor_start_time": process_start_time(os.getpid()),
            "boot_id": boot_id(),
            "child_pid": None,
            "child_start_time": None,
            "exit_code": None,
            "signal": None,
            "timed_out": False,
            "stopped": False,
            "spawn_error": None,
            "leftovers_signalled": False,
            "escapees_signalled": 0,
            "group_empty": None,
            "log_errors": [],
            "logs_truncated": [],
            "started_at": None,
            "ended_at": None,
        }
        self.stop_requested = False

    # -- signals -------------------------------------------------------------

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        self.stop_requested = True

    # -- main ----------------------------------------------------------------

    def run(self) -> int:
        self.record["subreaper"] = _become_subreaper()
        self.record["tracks"] = (
            "subreaper + process group" if self.record["subreaper"] else "process group"
        )
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_stop_signal)
        # A handler of its own for SIGCHLD, so that the child's exit writes to the wake-up
        # pipe below: without one (the default ignores it) the exit is seen only when a
        # pipe's end arrives after the child can be reaped, or at the watch loop's next
        # timeout (a quarter of a second later on a good share of attempts).
        signal.signal(signal.SIGCHLD, _on_child)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

        # O_NOFOLLOW: a log name a job planted as a link is refused (the supervisor stops
        # before the child starts, and the attempt is judged from that), never written
        # through (docs/security.md, "What a job controls").
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        logs = {
            "stdout": os.open(
                os.path.join(self.directory, "stdout.log"), flags, durable.modes()[0]
            ),
            "stderr": os.open(
                os.path.join(self.directory, "stderr.log"), flags, durable.modes()[0]
            ),
        }
        secrets = [self.environ.get(name, "") for name in self.spec.get("secret_env", [])]
        # Referenced secrets that are not the job's own variables reach us only so that
        # we can redact them: the job gets the variables its stage defines, not these.
        strip = set(self.spec.get("strip_env", []))
        child_env = {key: value for key, value in self.environ.items() if key not in strip}
        try:
            child = subprocess.Popen(
                self.spec["argv"],
                cwd=self.spec["cwd"],
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,
                close_fds=True,
            )
        except (OSError, ValueError) as exc:
            # ValueError: an argv, cwd or environment value holding a NUL (the config
            # refuses one in item fields; this keeps any other one a recorded harness
            # failure rather than a dead supervisor and an unknown attempt).
            self.record["spawn_error"] = f"{type(exc).__name__}: {exc}"
            self._report({"error": self.record["spawn_error"]})
            return self._finish(logs)
        self.record["started_at"] = _utc()
        self.record["child_pid"] = child.pid
        self.record["child_start_time"] = process_start_time(child.pid)
        self._report({"child_pid": child.pid, "child_start_time": self.record["child_start_time"]})
        crash_point("supervisor_after_spawn")
        self._watch(child, logs, secrets, wake_r)
        crash_point("supervisor_before_exit_record")
        return self._finish(logs)

    def _report(self, message: dict[str, Any]) -> None:
        """One JSON line to the worker. A dead worker (EPIPE) must not stop us."""
        try:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()
            sys.stdout.close()
        except (BrokenPipeError, OSError, ValueError) as exc:
            self.record["report_error"] = str(exc)

    def _watch(
        self, child: subprocess.Popen[bytes], logs: dict[str, int], secrets: list[str], wake: int
    ) -> None:
        pgid = child.pid
        assert child.stdout is not None and child.stderr is not None
        selector = selectors.DefaultSelector()
        redactors = {}
        for name, pipe in (("stdout", child.stdout), ("stderr", child.stderr)):
            selector.register(pipe, selectors.EVENT_READ, name)
            redactors[name] = Redactor(secrets)
        selector.register(wake, selectors.EVENT_READ, None)

        started = time.monotonic()
        deadline = started + self.timeout
        kill_at: float | None = None
        child_done = False
        group_gone_at: float | None = None
        last_output = float("-inf")
        open_pipes = 2

        while True:
            now = time.monotonic()
            # Why reap everything: as subreaper we inherit orphaned grandchildren.
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == child.pid:
                    child_done = True
                    child.returncode = os.waitstatus_to_exitcode(status)
                    if os.WIFSIGNALED(status):
                        self.record["signal"] = os.WTERMSIG(status)
                    else:
                        self.record["exit_code"] = os.WEXITSTATUS(status)
            if not child_done and now >= deadline and kill_at is None:
                self.record["timed_out"] = True
                self._escapees(_signal_attempt(pgid, signal.SIGTERM))
                kill_at = now + self.grace
            if self.stop_requested and kill_at is None and not child_done:
                # Only while the child runs: a stop after it exited must not turn its
                # known exit code into "cancelled".
                self.record["stopped"] = True
                self._escapees(_signal_attempt(pgid, signal.SIGTERM))
                kill_at = now + self.grace
            if child_done and kill_at is None and _attempt_alive(pgid):
                # Leftovers of the job (in its group, or escaped from it and re-parented
                # to us): the attempt owns them; stop them the same way.
                self.record["leftovers_signalled"] = True
                self._escapees(_signal_attempt(pgid, signal.SIGTERM))
                kill_at = now + self.grace
            if kill_at is not None and now >= kill_at and _attempt_alive(pgid):
                self._escapees(_signal_attempt(pgid, signal.SIGKILL))
            if child_done and not _attempt_alive(pgid):
                self.record["group_empty"] = True
                if group_gone_at is None:
                    group_gone_at = now
                # Pipes still held open by an escaped process are given up on only after
                # DRAIN_SECONDS without output: output still flowing is read to the end,
                # however slow this machine is right now.
                if open_pipes == 0 or now - max(group_gone_at, last_output) > DRAIN_SECONDS:
                    break

            wait = 0.05 if child_done or kill_at is not None else max(0.0, deadline - now)
            for key, _ in selector.select(timeout=min(wait, 0.25)):
                if key.data is None:
                    os.read(wake, 4096)
                    continue
                data = os.read(key.fd, READ_SIZE)
                if not data:
                    selector.unregister(key.fileobj)
                    open_pipes -= 1
                    tail = redactors[key.data].flush()
                    if tail:
                        self._write(logs[key.data], tail, key.data)
                    continue
                last_output = time.monotonic()
                self._write(logs[key.data], redactors[key.data].feed(data), key.data)
        selector.close()

    def _escapees(self, count: int) -> None:
        self.record["escapees_signalled"] = max(self.record["escapees_signalled"], count)

    def _write(self, fd: int, data: bytes, name: str) -> None:
        if not data:
            return
        written = self._written.get(name, 0)
        if name in self.record["logs_truncated"]:
            return  # past the cap: keep draining the pipe, keep nothing
        if written + len(data) > self.log_cap:
            # Also when the cap was met exactly by earlier output: the marker says so.
            data = (
                data[: max(0, self.log_cap - written)]
                + (
                    f"\n[laneway: {name} truncated at {self.log_cap} bytes; "
                    "further output discarded]\n"
                ).encode()
            )
            self.record["logs_truncated"].append(name)
        self._written[name] = written + len(data)
        try:
            faults.check("log_write")  # test hook
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as exc:
            # Keep draining the pipe (the job must not block), but never silently: a
            # log write failure is a harness failure of its own.
            if len(self.record["log_errors"]) < 10:
                self.record["log_errors"].append(f"{name}: {exc.strerror or exc}")

    def _finish(self, logs: dict[str, int]) -> int:
        # The watch is over: a stop that arrives from here on has nothing left to stop.
        # Ignored, not handled: Python restores the default action while the interpreter
        # shuts down, so a late SIGTERM would otherwise end this process by the signal
        # instead of with the status it reports.
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        for name, fd in logs.items():
            # Once, at the end, and only a log that was written to: an empty one has no
            # data to lose, and its name is in this directory, whose fsync after the
            # exit record's rename makes it durable with ``exit.json``.
            if self._written.get(name):
                try:
                    os.fsync(fd)
                except OSError as exc:
                    self.record["log_errors"].append(f"{name} fsync: {exc.strerror or exc}")
            os.close(fd)
        self.record["ended_at"] = _utc()
        try:
            # write_bytes: temp file, its fsync, rename, the directory's fsync.
            write_bytes(os.path.join(self.directory, EXIT_RECORD), record_bytes(self.record))
        except OSError as exc:
            # No exit record means unknown, never a guess: say why and exit non-zero. The
            # exit code is kept in supervisor.log for the operator who reconciles.
            sys.stderr.write(
                f"laneway supervisor: could not save exit.json ({exc}); "
                f"exit_code={self.record['exit_code']} signal={self.record['signal']}\n"
            )
            return EXIT_RECORD_FAILED
        return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write(
            "usage: python -m laneway.workers.supervisor SPEC_JSON (started by laneway)\n"
        )
        return 2
    return Supervision(json.loads(args[0])).run()


if __name__ == "__main__":
    sys.exit(main())
