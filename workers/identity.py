"""Process identity (boot id, pid, start time): it lives in ``controller/identity.py``,
on the bottom floor, because the controller judges processes too and does not import
``workers``. Stdlib only, like the supervisor that imports it from here."""

from laneway.controller.identity import boot_id, current, host, process_start_time, same_process

__all__ = ["boot_id", "current", "host", "process_start_time", "same_process"]
