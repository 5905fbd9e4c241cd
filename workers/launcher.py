"""The supervisor launcher: a warm process that forks one supervisor per attempt.

Starting a supervisor as a new interpreter costs about 50 ms of CPU (the interpreter,
then ``json``, ``re``, ``ctypes``, ``subprocess``...), more than everything else laneway
does for a job. The launcher is started once per worker, with the same lean command
line as a supervisor (``python -I -S``, standard library and laneway's small helpers
only), imports ``workers.supervisor`` once, and then forks a ready supervisor for each
request: about a millisecond. Before its first fork it runs ``supervisor.warm_up`` and
freezes what it holds out of the cyclic GC, so a forked supervisor copies as few of the
pages it shares with the launcher as it can (``bench/bench_supervisor.py``).

What a forked supervisor is, is exactly what an exec'd one is (invariant 6,
docs/invariants.md): its own session, a subreaper, the job's environment (handed from
the request to the job as it is; of it, only ``supervisor.HELPER_ENV`` is set in the
supervisor's own ``os.environ``), its stdout a pipe to the worker (the report of the
child's identity) and its stderr the attempt's ``supervisor.log``, both passed with the
request (``SCM_RIGHTS``). Differences a reader of ``/proc`` sees: its command line is
the launcher's (it still names ``workers.supervisor``), and its ``/proc/PID/environ`` is
the launcher's, so a restarted worker finds it by its working directory, the attempt
directory, which it enters at once (``recovery.find_supervisor``).

The launcher reaps the supervisors it forked; the worker watches them through pidfds.
When the worker goes away (its end of the socket closes) the launcher exits and its
supervisors run on, adopted by init, as an exec'd supervisor would. The request socket
is a ``SOCK_SEQPACKET`` pair: one message per request, one per reply.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys

from laneway.controller import durable
from laneway.workers import supervisor
from laneway.workers.identity import process_start_time

MAX_REQUEST = 1 << 22
BOOTSTRAP = (
    supervisor.PACKAGE + "from laneway.workers.launcher import serve; serve(int(sys.argv[3]))"
)


def launcher_argv(fd: int) -> list[str]:
    """The launcher's command line; ``fd`` is its end of the request socket."""
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        BOOTSTRAP,
        supervisor.MARK,  # how a restarted worker recognises what it forked
        supervisor.ROOT,
        str(fd),
    ]


def serve(fd: int) -> None:
    """Fork a supervisor for each request until the worker's end closes."""
    os.chdir("/")  # only the supervisors it forks work in attempt directories
    sock = socket.socket(fileno=fd)
    # Non-blocking: ``socket.recv_fds`` passes no flags to recvmsg (Python 3.11), and a
    # blocking read would leave exited supervisors unreaped until the next request.
    sock.setblocking(False)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector to reap
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    directories: dict[int, str] = {}
    # What every supervisor would do for itself is done here once; then everything
    # alive is frozen out of the cyclic GC, whose passes would otherwise write to (and
    # so copy, page by page) the memory each forked supervisor shares with us.
    supervisor.warm_up()
    gc.collect()
    gc.freeze()
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
        _reap(directories)
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 2)
        except BlockingIOError:
            continue
        if not message:
            return  # the worker is gone; our supervisors run on
        request = json.loads(message)
        _flush_stdio()  # a forked supervisor must not inherit output still buffered
        pid = os.fork()
        if pid == 0:
            _become_supervisor(request, fds, sock, selector, (wake_r, wake_w))
        directories[pid] = str(request["spec"]["attempt_dir"])
        for passed in fds:
            os.close(passed)
        sock.send(json.dumps({"pid": pid, "start_time": process_start_time(pid)}).encode())


def _flush_stdio() -> None:
    """Write out what our stdout and stderr still buffer (``_reap``'s diagnostics)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            continue  # the worker's end is gone or closed: nothing can be written out


_FILE_MODE = durable.modes()[0]
"""The launcher's environment is only ``PATH`` (``spawning.Launcher``): owner-only."""
STATUS_FILE = "supervisor_status.json"
"""Written by the launcher into the attempt directory when a supervisor it forked
exits: its wait status, which only its parent (the launcher) can know."""


def _reap(directories: dict[int, str]) -> None:
    """Record each exited supervisor's status, then reap it. Until the status is written
    the supervisor stays a zombie, so a worker that sees it gone can read the file."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        directory = directories.pop(info.si_pid, None)
        if directory is not None:
            status = {
                "pid": info.si_pid,
                "returncode": -info.si_status if killed else info.si_status,
            }
            partial = os.path.join(directory, STATUS_FILE + ".partial")
            try:
                # Not fsynced (a diagnostic; exit.json is the durable record), and
                # written with bare system calls: once per attempt.
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
                try:
                    os.write(fd, json.dumps(status).encode())
                finally:
                    os.close(fd)
                os.replace(partial, os.path.join(directory, STATUS_FILE))
            except OSError as exc:
                # A diagnostic only (exit.json is the record): say so, reap anyway.
                sys.stderr.write(f"laneway launcher: {directory}: {exc}\n")
        os.waitpid(info.si_pid, 0)


def _become_supervisor(
    request: dict[str, object],
    fds: list[int],
    sock: socket.socket,
    selector: selectors.BaseSelector,
    wake: tuple[int, int],
) -> None:
    """In the forked child: become the attempt's supervisor; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        sock.close()
        for fd in wake:
            os.close(fd)
        os.setsid()
        stdout, stderr = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        environ = request["env"]
        assert isinstance(environ, dict)
        for name in supervisor.HELPER_ENV:
            value = environ.get(name)
            if value is not None:
                os.environ[name] = value
            elif name in os.environ:
                del os.environ[name]
        spec = request["spec"]
        assert isinstance(spec, dict)
        os.chdir(str(spec["attempt_dir"]))
        code = supervisor.Supervision(spec, environ).run()
    except BaseException:
        # Into supervisor.log; the worker then finds a supervisor gone without an exit
        # record, which it settles as it would an exec'd one's (never as success).
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # os._exit does not: supervisor.log must get every line
        except (OSError, ValueError):
            continue  # a closed stdout (the report was sent) has nothing to flush
    os._exit(code)
