"""Injected I/O faults: a test hook for proving that no partial file is trusted and no
known outcome is lost when a durable write or a read fails.

``LANEWAY_FAULTS`` holds comma-separated ``SITE:K:ERRNO[:persist]`` rules. Each process
counts calls of ``check(SITE)``; call K (and, with ``persist``, every later call) raises
``OSError(ERRNO)``. Unset (production), ``check`` does nothing. Sites:

- ``receipt`` — writing receipt.json (worker);
- ``exit_record`` — writing exit.json (supervisor);
- ``log_write`` — writing stdout.log / stderr.log (supervisor);
- ``result_read`` — reading result.json (worker);
- ``status_snapshot`` — writing status.json / SUMMARY.json (controller);
- ``capture`` — adding a file to a failure capture archive (worker);
- ``store_write`` — writing an output into a local artifact store (worker);
- ``input_fetch`` — copying an input from the artifact store (worker).

Stdlib only: the supervisor imports it.
"""

from __future__ import annotations

import errno
import os
from collections import Counter

ENV = "LANEWAY_FAULTS"
_calls: Counter[str] = Counter()


def check(site: str) -> None:
    """Raise the injected OSError for this call of ``site``, if a rule says so."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    _calls[site] += 1
    call = _calls[site]
    for rule in spec.split(","):
        parts = rule.split(":")
        if len(parts) < 3 or parts[0] != site:
            continue
        k, name = int(parts[1]), parts[2]
        persist = len(parts) > 3 and parts[3] == "persist"
        if call == k or (persist and call >= k):
            code = getattr(errno, name)
            raise OSError(code, f"{os.strerror(code)} (injected at {site} call {call})")


def site_of(path: str | os.PathLike[str]) -> str | None:
    """The fault site of a durable file, by its name."""
    name = os.path.basename(os.fspath(path))
    return {
        "receipt.json": "receipt",
        "exit.json": "exit_record",
        "status.json": "status_snapshot",
        "SUMMARY.json": "status_snapshot",
    }.get(name)


def reset() -> None:
    """Forget call counts (tests running several scenarios in one process)."""
    _calls.clear()
