"""A notify command, run as carefully as a job: argv without a shell, in a process group
of its own (``start_new_session``), with a job's clean environment
(``environment.inherited``: ``BASE_ENV`` and ``LC_*``), the ``pass_env`` variables and
the ``LANEWAY_NOTIFY_*`` ones; the notification as JSON on stdin.

- **Its output read with a bound**: stdout goes nowhere, stderr is read as it comes and
  only its last ``STDERR_TAIL`` bytes are kept (its last whole line is the detail of a
  failed try).
- **A wall-clock deadline** (``timeout_seconds``) on the command's own process; past it
  the whole group is stopped (TERM, then KILL after ``STOP_GRACE_SECONDS``).
- **Its exit is its answer**: once the command's own process exited, stderr is read for
  ``EXIT_GRACE_SECONDS`` more at most (a child it left may hold the pipe open for ever),
  then what is left of its group is stopped the same way. Exit 0 is delivered, whatever
  a leftover child still held; a try leaves nothing running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from laneway.controller import environment
from laneway.controller.config_models import NotifyConfig
from laneway.controller.notify_delivery import Undelivered
from laneway.controller.process_group import group_alive

STDERR_TAIL = 8192
"""Bytes of a command's stderr kept (its end): enough for its last line."""
EXIT_GRACE_SECONDS = 0.5
"""How long stderr is read once the command's own process exited."""
STOP_GRACE_SECONDS = 2.0
"""TERM to KILL, for what is left of a command's process group."""


def command_environment(
    config: NotifyConfig, payload: Mapping[str, Any], environ: Mapping[str, str], secrets: list[str]
) -> dict[str, str]:
    """What the command starts with; each ``pass_env`` value joins ``secrets``."""
    env = environment.inherited(environ)
    for name in config.pass_env:
        if name not in environ:
            raise Undelivered(
                f"pass_env {name}: not set in the notifying process's environment; set it "
                "where laneway controller / laneway run / laneway worker starts",
                transient=False,
            )
        env[name] = environ[name]
        secrets.append(environ[name])
    step = payload.get("next_step") or {}
    told = {
        "LANEWAY_NOTIFY_KIND": payload["kind"],
        "LANEWAY_NOTIFY_RUN": "" if payload.get("run") is None else payload["run"],
        "LANEWAY_NOTIFY_REASON": payload.get("reason") or "",
        "LANEWAY_NOTIFY_COMMAND": step.get("command") or "",
        "LANEWAY_NOTIFY_LINK": payload.get("link") or "",
    }
    # No environment value can carry a NUL.
    env.update({name: str(value).replace("\0", " ") for name, value in told.items()})
    return env


class _Tail:
    """Reads a pipe to its end in a thread, keeping its last ``STDERR_TAIL`` bytes."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.pipe = pipe
        self.data = bytearray()
        self.cut = False
        """Bytes before ``data`` were dropped."""
        self.thread = threading.Thread(target=self._run, name="laneway-notify-err", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # The pipe is closed here, by its reader, once no writer is left: never under
        # a blocked read (its descriptor could be reused meanwhile).
        with self.pipe:
            while chunk := os.read(self.pipe.fileno(), 65536):
                self.data += chunk
                if len(self.data) > STDERR_TAIL:
                    del self.data[: len(self.data) - STDERR_TAIL]
                    self.cut = True

    def last_line(self) -> str:
        """The last non-empty line wholly kept (a line cut at the front is not shown:
        its start may have been part of a secret)."""
        lines = bytes(self.data).splitlines()
        if self.cut and lines:
            lines = lines[1:]
        for line in reversed(lines):
            if line.strip():
                return line.decode("utf-8", "replace").strip()
        return ""


def _feed(process: subprocess.Popen[bytes], body: bytes) -> None:
    assert process.stdin is not None
    try:
        process.stdin.write(body)
        process.stdin.close()
    except OSError:
        pass  # the command does not read its stdin: its exit says what it made of it


def stop_group(pgid: int) -> None:
    """TERM the group, KILL it after ``STOP_GRACE_SECONDS``; back once none of it runs
    (or, where a signal cannot reach it, after the KILL's grace)."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(pgid, zombies_count=False):
            return
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            return
        except PermissionError:
            pass  # a member changed its user: what can be stopped was
        until = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < until and group_alive(pgid, zombies_count=False):
            time.sleep(0.02)


def run_command(
    config: NotifyConfig,
    body: bytes,
    payload: Mapping[str, Any],
    environ: Mapping[str, str],
    secrets: list[str],
) -> str:
    """Run the command with ``body`` on stdin; ``exit 0``, or Undelivered."""
    assert config.command is not None
    env = command_environment(config, payload, environ, secrets)
    try:
        process = subprocess.Popen(
            config.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise Undelivered(f"{config.command[0]}: {exc.strerror or exc}", transient=False) from None
    assert process.stderr is not None
    tail = _Tail(process.stderr)
    threading.Thread(target=_feed, args=(process, body), daemon=True).start()
    try:
        code: int | None = process.wait(timeout=config.timeout_seconds)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if process.returncode is not None:
            tail.thread.join(EXIT_GRACE_SECONDS)
        stop_group(process.pid)
        process.wait()
        tail.thread.join(EXIT_GRACE_SECONDS)
    if code is None:
        raise Undelivered(
            f"timed out after {config.timeout_seconds:g} s (its process group was stopped)",
            transient=True,
        )
    if code < 0:
        raise Undelivered(f"killed by signal {-code}: {tail.last_line()}", transient=True)
    if code != 0:
        raise Undelivered(f"exit {code}: {tail.last_line()}", transient=True)
    return "exit 0"
