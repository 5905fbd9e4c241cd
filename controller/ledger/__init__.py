"""The ledger: the one package that writes state.

Every change to a run, job, attempt, lease, reservation, control, decision or worker row
happens here, as a compare-and-set (``UPDATE ... WHERE id = :id AND state = :expected
[AND fence = :fence]``) whose result is checked, with its event appended in the same
transaction. Callers pass an open Session (see ``controller.db.transaction``) and
``now`` from a Clock; nothing here commits or reads the wall clock.

One module per phase of an attempt's life, each importing only those listed before it:

- ``tables`` / ``statements``: the Core tables and the named hot-path statements;
- ``transitions``: ``move_job``, ``move_attempt`` and the event log;
- ``reuse``: earlier results a new run's jobs may take over;
- ``runs``: creating runs (with reuse), frozen configs, workers and their liveness;
- ``controls``: pause, stop, halt;
- ``promotion``: waiting jobs move on, finished runs close;
- ``snapshot``: what admission sees for a node;
- ``artifacts``: outputs a settle stores, inputs a claim gives;
- ``claim``: leases and intents;
- ``settle``: spawn identity, outcomes, breakers;
- ``recovery``: expired leases, orphans, adoption (the lease design note is there);
- ``notices``: controllers' heartbeats, notifications and their deliveries;
- ``operator``: reconcile, retry, cancel, closeout bookkeeping;
- ``judged``: the one write of a verdict (``settle_judged``): unknown, settled or
  reconciled, the late identity, a success's stored outputs.

Callers import this package (``from laneway.controller import ledger``) and use the names below.
"""

from laneway.controller.launch import argv_hash, artifact_store_url, attempt_dir, inputs_dir
from laneway.controller.ledger.artifacts import (
    inputs_for,
    record_inputs,
    run_artifacts,
)
from laneway.controller.ledger.claim import (
    DEFAULT_LEASE_SECONDS,
    Claim,
    ClaimRaced,
    claim_jobs,
    record_decisions,
)
from laneway.controller.ledger.controls import (
    check_pausable,
    clear_controls,
    run_paused,
    set_control,
)
from laneway.controller.ledger.judged import Fenced, Reconciled, settle_judged
from laneway.controller.ledger.notices import (
    attention_events,
    controller_heartbeat,
    create_notification,
    finish_notification,
    latest_controller,
    pending_notifications,
    record_delivery,
    register_controller,
)
from laneway.controller.ledger.operator import (
    RECONCILE_AS,
    cancel_pending,
    closeout_candidates,
    failed_jobs,
    get_attempt,
    mark_closeout_finished,
    reconcile_attempt,
    record_capture,
    request_cancel,
    retry_failed,
    retry_job,
    running_attempts,
    unknown_attempts,
)
from laneway.controller.ledger.promotion import (
    Changes,
    changes_after,
    close_run_if_done,
    items_with_waiting,
    next_retry_at,
    promote_item,
    promote_run,
    release_due_retries,
    run_has_open_jobs,
)
from laneway.controller.ledger.recovery import (
    adopt_attempt,
    expire_leases,
    expired_leases,
    note_evidence,
    orphaned_attempts,
    unknown_attempts_on_node,
)
from laneway.controller.ledger.rerun import Delivered, delivered_inputs, rerun_producer
from laneway.controller.ledger.reuse import hand_offs, stored_outputs
from laneway.controller.ledger.runs import (
    active_run_ids,
    active_workers,
    create_run,
    frozen_config,
    get_run,
    heartbeat,
    mark_lost_workers,
    mark_worker_lost,
    pipeline_runs,
    register_worker,
    reuse_candidates,
    run_config,
    stale_workers,
    stop_worker,
    takeovers,
    unfinished_runs,
    upsert_node,
)
from laneway.controller.ledger.settle import (
    MEASURED_COLUMNS,
    fold_peaks,
    mark_unknown,
    record_samples,
    record_spawn,
    record_spawn_from_exit,
    refuse_start,
    release,
    settle_attempt,
    settle_from_verdict,
)
from laneway.controller.ledger.snapshot import (
    RunInfo,
    admission_snapshot,
    reservation_mib,
    stage_peaks,
)
from laneway.controller.ledger.transitions import (
    append_event,
    append_events,
    event_row,
    events_since,
    flush_events,
    latest_event_id,
    move_attempt,
    move_job,
    refused_before_writing,
    written_events,
)
from laneway.controller.states import ATTEMPT_TRANSITIONS, JOB_TRANSITIONS

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "DEFAULT_LEASE_SECONDS",
    "JOB_TRANSITIONS",
    "MEASURED_COLUMNS",
    "RECONCILE_AS",
    "Changes",
    "Claim",
    "ClaimRaced",
    "Delivered",
    "Fenced",
    "Reconciled",
    "RunInfo",
    "active_run_ids",
    "active_workers",
    "admission_snapshot",
    "adopt_attempt",
    "append_event",
    "append_events",
    "argv_hash",
    "artifact_store_url",
    "attempt_dir",
    "attention_events",
    "cancel_pending",
    "changes_after",
    "check_pausable",
    "claim_jobs",
    "clear_controls",
    "close_run_if_done",
    "closeout_candidates",
    "controller_heartbeat",
    "create_notification",
    "create_run",
    "delivered_inputs",
    "event_row",
    "events_since",
    "expire_leases",
    "expired_leases",
    "failed_jobs",
    "finish_notification",
    "flush_events",
    "fold_peaks",
    "frozen_config",
    "get_attempt",
    "get_run",
    "hand_offs",
    "heartbeat",
    "inputs_dir",
    "inputs_for",
    "items_with_waiting",
    "latest_controller",
    "latest_event_id",
    "mark_closeout_finished",
    "mark_lost_workers",
    "mark_unknown",
    "mark_worker_lost",
    "move_attempt",
    "move_job",
    "next_retry_at",
    "note_evidence",
    "orphaned_attempts",
    "pending_notifications",
    "pipeline_runs",
    "promote_item",
    "promote_run",
    "reconcile_attempt",
    "record_capture",
    "record_decisions",
    "record_delivery",
    "record_inputs",
    "record_samples",
    "record_spawn",
    "record_spawn_from_exit",
    "refuse_start",
    "refused_before_writing",
    "register_controller",
    "register_worker",
    "release",
    "release_due_retries",
    "request_cancel",
    "rerun_producer",
    "reservation_mib",
    "retry_failed",
    "retry_job",
    "reuse_candidates",
    "run_artifacts",
    "run_config",
    "run_has_open_jobs",
    "run_paused",
    "running_attempts",
    "set_control",
    "settle_attempt",
    "settle_from_verdict",
    "settle_judged",
    "stage_peaks",
    "stale_workers",
    "stop_worker",
    "stored_outputs",
    "takeovers",
    "unfinished_runs",
    "unknown_attempts",
    "unknown_attempts_on_node",
    "upsert_node",
    "written_events",
]
