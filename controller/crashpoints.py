"""Named crash points: a test hook for proving crash safety with real SIGKILLs.

``crash_point(name)`` kills the calling process with SIGKILL when the environment
variable ``LANEWAY_CRASH_POINT`` equals ``name``, and does nothing otherwise. It is
inert in production (the variable is unset). The points, in the order an attempt meets
them:

- ``worker_after_intent_commit`` — claim + intent committed, nothing spawned;
- ``supervisor_after_spawn`` — the supervisor dies with its child running;
- ``worker_after_spawn_before_identity`` — supervisor running, identity not recorded;
- ``worker_after_receipt_before_identity`` — the supervisor's report read and its
  receipt.json written, the identity waiting for the worker's next write;
- ``supervisor_before_exit_record`` — the child exited, exit.json not yet written;
- ``worker_after_store_before_settle`` — a succeeded attempt's outputs are in the
  artifact store, the settle that records them not begun;
- ``worker_before_settle`` — exit.json written, settle not begun;
- ``worker_mid_settle`` — inside the settle transaction, before its commit;
- ``worker_after_outputs_recorded`` — the settle recording stored outputs committed;
- ``worker_fetching_inputs`` — a claimed attempt's intent committed, its inputs being
  fetched, its process not started;
- ``controller_mid_tick`` — inside the controller's closing step, after it closed a run,
  before its commit.

Stdlib only: the supervisor imports it.
"""

from __future__ import annotations

import os
import signal

ENV = "LANEWAY_CRASH_POINT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
