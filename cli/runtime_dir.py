"""Where a ledger can never appear: a runtime dir (or a directory above it) that is a
file. The commands that wait for a ledger (`worker`, `controller`, `status --watch`)
refuse such a path at once, in one line, instead of waiting for ever."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from laneway.controller.errors import NoLedgerYet, UsageError


def never_there(error: NoLedgerYet) -> UsageError | None:
    """The refusal for a missing SQLite ledger whose path runs through something that is
    not a directory (None when the ledger may still appear there, or is not a file)."""
    where = error.where
    if "://" in where:
        return None  # a database server's: nothing on this machine's disk decides it
    ledger = Path(where)
    for place in ledger.parents:
        try:
            mode = os.stat(place).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet, or under a file found further up
        except OSError:
            return None  # the commands' own checks report what cannot be reached
        if stat.S_ISDIR(mode):
            return None
        what = "a file" if stat.S_ISREG(mode) else "not a directory"
        return UsageError(
            f"no ledger can appear at {where}: {place} is {what}, not a directory; pass a "
            "directory as --runtime-dir (or set LANEWAY_RUNTIME_DIR to one)"
        )
    return None
