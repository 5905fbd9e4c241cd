"""The read side's named queries: what ``laneway status`` (controller/status.py), the live
view's ETA (controller/progress.py), the dashboard (controller/web.py) and the metrics
(controller/metrics.py) read.

One plain SQL string per query, dialect-neutral, with ``:name`` bind parameters, each
followed by its description (procrastinate's ``queries.sql``, as Python): they run over
a ``Rows`` source, either the stdlib ``sqlite3`` of ``readonly.ReadOnlyLedger`` (so ``laneway
status`` on SQLite imports no SQLAlchemy) or an ORM session (``rows.SessionRows``).
State literals are laneway's own constants, never user input. The hot path's write
statements live in ``controller/ledger/statements.py``.
"""

from __future__ import annotations

from typing import Final

from laneway.controller.states import AttemptState, EventKind, RunState, Verdict, WorkerState


def _states(*states: str) -> str:
    """An SQL list of state literals."""
    return ", ".join(f"'{state}'" for state in states)


_IN_FLIGHT = _states(AttemptState.INTENT.value, AttemptState.RUNNING.value)
RECENT_EVENTS = 12
"""How many of a run's newest events ``status`` shows."""
RECENT_STOPPED_WORKERS = 3
"""How many stopped or lost workers ``status`` shows per node (besides the active ones)."""
RECENT_ATTEMPTS = 200
"""How many of a run's newest settled attempts the live view's ETA is measured over."""
RETRY_BACKOFF_SHOWN = 20
"""How many jobs waiting out a retry backoff ``status`` lists."""

_RUN_COLUMNS = (
    "id, name, state, config_json, config_sha256, runtime_dir, created_at, finished_at, config_path"
)
RUN_COLUMNS: Final = tuple(_RUN_COLUMNS.split(", "))
"""The columns ``RUN_BY_ID`` and ``NEWEST_RUN`` return, in order."""

RUN_BY_ID: Final = f"SELECT {_RUN_COLUMNS} FROM runs WHERE id = :run"
"""-- name: run_by_id -- The run ``:run``: its row and its frozen config."""

NEWEST_RUN: Final = f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY id DESC LIMIT 1"
"""-- name: newest_run -- The newest run (``laneway status`` without a run)."""

JOB_COUNTS: Final = (
    "SELECT state, lane, stage, COUNT(*) FROM jobs WHERE run_id = :run GROUP BY state, lane, stage"
)
"""-- name: job_counts -- The run's jobs counted per state, lane and stage: an index-only
count over the leading columns of ``ix_jobs_dispatch`` (run_id, state, lane, stage, ...), in
its order (no sort), never the table's rows. ``status`` derives its per-stage and per-lane
counts from these few rows (tests/integration/test_quick_reads.py checks the plan)."""

REUSED_BY_STAGE: Final = (
    "SELECT stage, COUNT(*) FROM jobs WHERE run_id = :run AND reused_from IS NOT NULL "
    "GROUP BY stage"
)
"""-- name: reused_by_stage -- Per stage, the run's jobs that took an earlier run's result:
index-only over the partial index ``ix_jobs_reused`` (only reused jobs have an entry)."""

RETRY_BACKOFF: Final = (
    "SELECT j.id, i.key, j.stage, j.retry_after FROM jobs j "
    "JOIN items i ON i.id = j.item_id "
    "WHERE j.retry_after IS NOT NULL AND +j.run_id = :run "
    f"ORDER BY j.retry_after, j.id LIMIT {RETRY_BACKOFF_SHOWN}"
)
"""-- name: retry_backoff -- The run's jobs waiting out a retry backoff, soonest first: a
range of ``ix_jobs_retry_after`` (only jobs backing off have an entry). The unary ``+``
keeps SQLite from taking the run's jobs by ``run_id`` instead (every job of the run)."""

ATTEMPT_OUTCOMES: Final = (
    "SELECT stage, outcome, COUNT(*) FROM attempts "
    "WHERE run_id = :run AND outcome IS NOT NULL GROUP BY stage, outcome"
)
"""-- name: attempt_outcomes -- The run's settled attempts (those with an outcome) counted per
stage and outcome: index-only over the partial index ``ix_attempts_run_stage_outcome``
(migration 0016), in its order (no sort), never the attempts' rows or their jobs. A NULL
stage (an attempt row written without one, which the claim never does) is a group of its
own, which ``status`` resolves through ``ATTEMPTS_WITHOUT_STAGE``."""

LANE_ACTIVITY: Final = (
    "SELECT l.name, l.node, "
    "(SELECT MAX(a.started_at) FROM attempts a WHERE a.run_id = l.run_id "
    "AND a.lane = l.name AND a.started_at IS NOT NULL), "
    "(SELECT MAX(a.settled_at) FROM attempts a WHERE a.run_id = l.run_id "
    "AND a.lane = l.name AND a.settled_at IS NOT NULL) "
    "FROM lanes l WHERE l.run_id = :run ORDER BY l.name"
)
"""-- name: lane_activity -- The run's lanes by name, their nodes, and each one's newest
attempt start and newest settle: per lane one seek to the end of its range in
``ix_attempts_run_lane_started`` and one in ``ix_attempts_run_lane_settled`` (partial,
migration 0016), whatever the run's history."""

ATTEMPTS_WITHOUT_STAGE: Final = (
    "SELECT j.lane, j.stage, a.outcome, COUNT(*), MAX(a.started_at), MAX(a.settled_at) "
    "FROM attempts a JOIN jobs j ON j.id = a.job_id "
    "WHERE a.run_id = :run AND a.stage IS NULL AND a.outcome IS NOT NULL "
    "GROUP BY j.lane, j.stage, a.outcome"
)
"""-- name: attempts_without_stage -- The run's settled attempts whose row has no stage (none
the claim writes; migration 0015 filled older ones), per their job's lane, stage and outcome,
with their newest start and settle. ``status`` reads it only when ``ATTEMPT_OUTCOMES`` has a
NULL-stage group: a range of ``ix_attempts_run_stage_outcome`` (those attempts only), each
joined to its job."""

IN_FLIGHT_ATTEMPTS: Final = (
    "SELECT a.id, j.id, i.key, j.stage, j.lane, a.node, a.state, a.child_pid, "
    "COALESCE(a.started_at, a.intent_at), a.peak_rss_mib, a.worker_id "
    "FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
    f"WHERE a.state IN ({_IN_FLIGHT}) AND +a.run_id = :run ORDER BY a.id"
)
"""-- name: in_flight_attempts -- The run's attempts in intent or running, with their job,
item, pid, since when, measured peak RSS and the worker that runs them: a range of
``ix_attempts_state`` (the attempts in flight on the whole ledger), not the run's attempts
(the unary ``+`` keeps SQLite off ``run_id``)."""

IN_FLIGHT_DEVICES: Final = (
    "SELECT a.id, a.gpu_devices FROM attempts a "
    f"WHERE a.state IN ({_IN_FLIGHT}) AND +a.run_id = :run AND a.gpu_devices IS NOT NULL"
)
"""-- name: in_flight_devices -- The GPUs each of the run's attempts in flight holds
(``attempts.gpu_devices``, as the claim gave them): the same range as
``in_flight_attempts``."""

UNKNOWN_ATTEMPTS: Final = (
    "SELECT a.id, j.id, i.key, j.stage, a.state_reason, a.attempt_dir "
    "FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN items i ON i.id = j.item_id "
    f"WHERE a.state = '{AttemptState.UNKNOWN.value}' AND +a.run_id = :run ORDER BY a.id"
)
"""-- name: unknown_attempts -- The run's attempts whose outcome is unknown, with why and
their directory (the evidence): a range of ``ix_attempts_state``, as ``in_flight_attempts``."""

EVIDENCE_FOUND: Final = (
    "SELECT attempt_id, detail FROM events "
    f"WHERE run_id = :run AND kind = '{EventKind.ATTEMPT_EVIDENCE_FOUND.value}' ORDER BY id"
)
"""-- name: evidence_found -- The run's notes of conclusive evidence that restarted
workers read on their own nodes (``ledger.note_evidence``): one ``ix_events_run_kind``
range, as long as the run's unknown attempts are few."""

UNKNOWN_PIDS: Final = (
    "SELECT id, supervisor_pid, child_pid FROM attempts "
    f"WHERE state = '{AttemptState.UNKNOWN.value}' AND +run_id = :run"
)
"""-- name: unknown_pids -- The supervisor and child pids of the run's unknown attempts: a
range of ``ix_attempts_state``, as ``unknown_attempts``."""

CONTROLS_IN_FORCE: Final = (
    "SELECT id, kind, scope, lane, reason, set_by, set_at FROM controls "
    "WHERE cleared_at IS NULL AND (run_id = :run OR run_id IS NULL) ORDER BY id"
)
"""-- name: controls_in_force -- Pauses, stops and halts not cleared: the run's and global."""

LANES: Final = "SELECT name, node FROM lanes WHERE run_id = :run ORDER BY name"
"""-- name: lanes -- The run's lanes and their nodes, by name."""

RECENT_RUN_EVENTS: Final = (
    "SELECT id, at, kind, job_id, attempt_id, actor, detail FROM events "
    f"WHERE run_id = :run ORDER BY id DESC LIMIT {RECENT_EVENTS}"
)
"""-- name: recent_run_events -- The run's ``RECENT_EVENTS`` newest events, newest first."""

NEWEST_RUN_EVENT: Final = "SELECT MAX(id) FROM events WHERE run_id = :run"
"""-- name: newest_run_event -- The id of the run's newest event (has the run changed?)."""

_WORKER_COLUMNS = "id, node, host, pid, boot_id, slots, state, started_at, heartbeat_at, stopped_at"

ACTIVE_WORKERS: Final = (
    f"SELECT {_WORKER_COLUMNS} FROM workers "
    f"WHERE state = '{WorkerState.ACTIVE.value}' AND node = :node "
    "ORDER BY started_at DESC, id"
)
"""-- name: active_workers -- The active workers of node ``:node``, newest first."""

ENDED_WORKERS: Final = (
    f"SELECT {_WORKER_COLUMNS} FROM workers "
    f"WHERE state IN ({_states(WorkerState.STOPPED.value, WorkerState.LOST.value)}) "
    f"AND node = :node ORDER BY stopped_at DESC, id LIMIT {RECENT_STOPPED_WORKERS}"
)
"""-- name: ended_workers -- The last ``RECENT_STOPPED_WORKERS`` stopped or lost workers of
node ``:node``."""

LATEST_CONTROLLER: Final = (
    "SELECT id, host, pid, heartbeat_at, stopped_at FROM controllers ORDER BY id DESC LIMIT 1"
)
"""-- name: latest_controller -- The newest controller's row: its heartbeat and stop, which
say whether a controller serves a shared ledger (``status.controller_state``)."""

NODE_MEMORY: Final = (
    "SELECT mem_available_mib, mem_total_mib, memory_floor_mib, max_jobs, gpus, gpu_note "
    "FROM nodes WHERE name = :node"
)
"""-- name: node_memory -- Node ``:node``'s free and total memory (last heartbeat), its
floor, its ``max_jobs``, and its GPUs as its worker last reported them (per device, or
why there are none)."""

NODE_IN_FLIGHT: Final = (
    f"SELECT COUNT(*) FROM attempts WHERE node = :node AND state IN ({_IN_FLIGHT})"
)
"""-- name: node_in_flight -- How many attempts of any run are in flight on ``:node``."""

NODE_MAX_JOBS: Final = "SELECT max_jobs FROM nodes WHERE name = :node"
"""-- name: node_max_jobs -- Node ``:node``'s ``max_jobs``."""

NODE_NAMES: Final = "SELECT name FROM nodes ORDER BY name"
"""-- name: node_names -- Every node the ledger knows."""

LANE_LAST_DECISION: Final = (
    "SELECT verdict, reason_code, stage, decided_at, detail, node FROM decisions "
    "WHERE run_id = :run AND lane = :lane ORDER BY id DESC LIMIT 1"
)
"""-- name: lane_last_decision -- The newest admission decision for lane ``:lane`` of the
run (a refusal, unless a dispatch came after it)."""

CLOSEOUT_EVENTS: Final = (
    "SELECT kind, detail FROM events WHERE run_id = :run AND kind IN ("
    + _states(
        EventKind.CLOSEOUT_STEP_STARTED.value,
        EventKind.CLOSEOUT_STEP_FINISHED.value,
        EventKind.CLOSEOUT_FINISHED.value,
    )
    + ") ORDER BY +id"
)
"""-- name: closeout_events -- The run's closeout events, in order: three ranges of
``ix_events_run_kind`` and a sort of those few rows. The unary ``+`` keeps SQLite from
walking every event of the run through ``ix_events_run`` for its order instead."""

RECENT_SETTLED_DURATIONS: Final = (
    "SELECT COALESCE(a.stage, (SELECT j.stage FROM jobs j WHERE j.id = a.job_id)), "
    "a.started_at, a.settled_at FROM attempts a "
    f"WHERE a.run_id = :run AND a.state = '{AttemptState.SETTLED.value}' "
    f"ORDER BY a.settled_at DESC LIMIT {RECENT_ATTEMPTS}"
)
"""-- name: recent_settled_durations -- The run's ``RECENT_ATTEMPTS`` newest settled
attempts' stage, start and settle (an index range on ``ix_attempts_run_settled``); the
stage is the attempt's own (its job's only for a row written without one)."""

NEWEST_ACTIVE_RUN_IDS: Final = (
    f"SELECT id FROM runs WHERE state = '{RunState.ACTIVE.value}' ORDER BY id DESC LIMIT :limit"
)
"""-- name: newest_active_run_ids -- The ids of the ``:limit`` newest active runs."""

NEWEST_RUN_ID: Final = "SELECT id FROM runs ORDER BY id DESC LIMIT 1"
"""-- name: newest_run_id -- The id of the newest run."""

REFUSALS_BY_REASON: Final = (
    "SELECT reason_code, COUNT(*) FROM decisions "
    f"WHERE run_id = :run AND verdict = '{Verdict.REFUSED.value}' GROUP BY reason_code"
)
"""-- name: refusals_by_reason -- The run's recorded admission refusals per reason code."""

STAGE_PEAKS: Final = (
    "SELECT stage, measured, peak_rss_mib, peak_gpu_mib FROM stage_stats "
    "WHERE run_id = :run ORDER BY stage"
)
"""-- name: stage_peaks -- Per stage of the run, its measured attempts and highest peaks."""

LEASES_RELEASED_EXPIRED: Final = (
    "SELECT COUNT(*) FROM leases l JOIN attempts a ON a.id = l.attempt_id "
    "WHERE a.run_id = :run AND l.released_at IS NOT NULL AND l.released_at > l.expires_at"
)
"""-- name: leases_released_expired -- How many of the run's leases were released after
they had expired."""

NODES_MEMORY: Final = (
    "SELECT name, mem_available_mib, mem_total_mib, memory_floor_mib, sampled_at "
    "FROM nodes ORDER BY name"
)
"""-- name: nodes_memory -- Every node's free, total and floor memory and when it was
sampled."""

OPEN_LEASE_EXPIRIES: Final = (
    "SELECT l.expires_at FROM leases l JOIN attempts a ON a.id = l.attempt_id "
    f"WHERE l.released_at IS NULL AND a.state IN ({_IN_FLIGHT})"
)
"""-- name: open_lease_expiries -- When each live lease of an in-flight attempt expires (an
index range: ``ix_leases_open``)."""

RECENT_RUNS: Final = (
    "SELECT id, name, state, created_at, finished_at FROM runs ORDER BY id DESC LIMIT :limit"
)
"""-- name: recent_runs -- The ``:limit`` newest runs (the dashboard's run list)."""

SUCCESSORS: Final = (
    "SELECT r.id, MIN(n.id) FROM runs r JOIN runs n ON n.name = r.name AND n.id > r.id "
    f"WHERE r.id >= :oldest AND r.state <> '{RunState.FINISHED.value}' GROUP BY r.id"
)
"""-- name: successors -- Each unfinished run from ``:oldest`` on that a later run of the
same pipeline (same ``name``) superseded, with the first such run's id (``laneway runs``
shows it as ``superseded (by run N)``)."""

ATTEMPT_TIMES: Final = (
    "SELECT exit_code, exit_signal, state_reason, intent_at, started_at, "
    "settled_at, current_rss_mib FROM attempts WHERE id = :id"
)
"""-- name: attempt_times -- Attempt ``:id``'s exit, reason, times and current RSS (the
dashboard's attempt page)."""
