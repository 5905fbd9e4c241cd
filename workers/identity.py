"""Process identity (boot identity, pid, start time): it lives in
``controller/identity.py``, on the bottom floor, because the controller judges processes
too and does not import ``workers``. Stdlib only, like the supervisor that imports it
from here."""

from laneway.controller.identity import (
    boot_id,
    current,
    describe,
    host,
    portable,
    process_start_time,
    read_proc,
    same_boot,
    same_process,
    use_portable,
)

__all__ = [
    "boot_id",
    "current",
    "describe",
    "host",
    "portable",
    "process_start_time",
    "read_proc",
    "same_boot",
    "same_process",
    "use_portable",
]
