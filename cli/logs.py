"""``laneway logs``: print (and follow) an attempt's redacted output.

The ledger is read through ``readonly.ReadOnlyLedger`` (as ``laneway status`` reads it) and the
files through ``controller.logs``; this module only writes what they return. With
``LANEWAY_WEB_URL`` set, the attempt's dashboard address (``web_links``) comes first on
stderr as ``link: URL`` (stdout stays the attempt's bytes), or as ``"link"`` in --json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from laneway.cli import render
from laneway.controller import logs as logs_module
from laneway.controller import readonly, web_links


def show(
    target: str,
    *,
    runtime_dir: Path,
    job: bool,
    run: int | None,
    stream: str,
    follow: bool,
    tail: int | None,
    as_json: bool,
) -> None:
    """Print the attempt's ``stream`` (its last ``tail`` lines, or all of it), then, with
    ``follow``, what is appended until the attempt leaves intent/running. A job reused
    from an earlier run shows the attempt that produced its result, after a line on
    stderr that says so (with ``--json``: the attempt's ``reused_by_job``). Raises
    LanewayError for the caller to print."""
    with readonly.ReadOnlyLedger(runtime_dir) as source:
        with source.snapshot():
            attempt = logs_module.resolve(source, target, job=job, run_id=run)
        link = web_links.link(web_links.attempt_path(attempt.attempt_id))
        path = logs_module.check_here(attempt, stream)
        data, offset = logs_module.tail_bytes(path, tail)
        if as_json and not follow:
            body = {
                "attempt": attempt.as_dict(),
                "stream": stream,
                "path": str(path),
                "text": data.decode("utf-8", errors="replace"),
            }
            if link is not None:
                body["link"] = link
            sys.stdout.write(render.as_json(body) + "\n")
            return
        note = logs_module.reused_note(attempt)
        if not as_json:
            # On stderr, so that stdout stays the attempt's bytes (a pipe gets them as
            # they were written); a terminal shows them as the first lines.
            for line in (f"laneway: {note}" if note else None, f"link: {link}" if link else None):
                if line is not None:
                    sys.stderr.write(line + "\n")
            sys.stderr.flush()
        out = _Writer(attempt.attempt_id, stream, as_json, link)
        out.write(data)
        if not follow:
            return

        def state() -> str:
            with source.snapshot():
                return logs_module.attempt_state(source, attempt.attempt_id)

        for chunk in logs_module.follow(path, offset, state, time.sleep):
            out.write(chunk)
        final = state()
        if not as_json:
            sys.stderr.write(f"laneway: attempt {attempt.attempt_id} is {final}\n")


class _Writer:
    """Raw bytes to a pipe or file; to a terminal, with escape sequences neutralised
    (job output must not drive the operator's terminal); JSON lines with ``--json``."""

    def __init__(self, attempt_id: int, stream: str, as_json: bool, link: str | None) -> None:
        self.attempt_id = attempt_id
        self.stream = stream
        self.as_json = as_json
        self.link = link
        self.tty = sys.stdout.isatty()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self.as_json:
            line = {
                "attempt_id": self.attempt_id,
                "stream": self.stream,
                "text": data.decode("utf-8", errors="replace"),
            }
            if self.link is not None:
                line["link"] = self.link
            sys.stdout.write(json.dumps(line) + "\n")
        elif self.tty:
            sys.stdout.write(render.clean(data.decode("utf-8", errors="replace")))
        else:
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
        sys.stdout.flush()
