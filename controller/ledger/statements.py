"""The hot path's statements, each named, built once, with bind parameters.

A claim, a spawn record and a settle run only these (plus event inserts); each is a
Core statement on the tables (no ORM entities are built), dialect-neutral, and uses
``RETURNING`` instead of reading back what the same transaction just wrote. Statements
that vary with the number of lanes or runs are built by the functions at the bottom,
sized to what the claim can use, and kept by their arguments (``_built_once``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import (
    Float,
    Integer,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    insert,
    literal,
    select,
    union_all,
    update,
)

from laneway.controller.ledger.tables import (
    attempt_usage,
    attempts,
    controls,
    decisions,
    events,
    items,
    jobs,
    leases,
    node_low_water,
    nodes,
    reservations,
    runs,
    stage_stats,
    workers,
)
from laneway.controller.states import (
    HELD_ATTEMPT_STATES,
    IN_FLIGHT_ATTEMPT_STATES,
    OPEN_JOB_STATES,
    AttemptState,
    JobState,
    RunState,
    WorkerState,
)

# -- events

# insert_event: one append-only event row (executemany for a batch).
INSERT_EVENT = insert(events)

# insert_events: a write transaction's events, all in one statement, returning their
# ids (the newest is what the writer has seen).
INSERT_EVENTS = insert(events).returning(events.c.id)

# latest_event_id: the newest event id, a cheap "did anything change?" probe.
LATEST_EVENT_ID = select(func.max(events.c.id))

# events_since: after event :seen, the newest event and the newest not among :own (the
# events a worker's last claim wrote itself), an index range over what came since.
EVENTS_SINCE = select(
    func.max(events.c.id),
    func.max(events.c.id).filter(events.c.id.not_in(bindparam("own", expanding=True))),
).where(events.c.id > bindparam("seen"))

# events_after: the next page of events after a cursor, with the item of each job event.
EVENTS_AFTER = (
    select(events.c.id, events.c.kind, events.c.run_id, jobs.c.item_id)
    .outerjoin(jobs, jobs.c.id == events.c.job_id)
    .where(events.c.id > bindparam("cursor"))
    .order_by(events.c.id)
    .limit(bindparam("batch"))
)

# -- runs and nodes

# run_frozen: what a claim or settle needs of a run (its config is parsed once per hash).
RUN_FROZEN = select(
    runs.c.id, runs.c.config_sha256, runs.c.runtime_dir, runs.c.source_hashes
).where(runs.c.id == bindparam("run_id"))

# run_config_json: a run's frozen config text, read only when the parse cache misses.
RUN_CONFIG_JSON = select(runs.c.config_json).where(runs.c.id == bindparam("run_id"))

# node_row: the node's configured and last-sampled capacity.
NODE_ROW = select(nodes).where(nodes.c.name == bindparam("node"))

# active_runs: the active runs, with what admission needs of each. A claim keeps those
# with a lane on its node or a stage whose ``nodes`` name it (their configs are parsed
# once per hash); few rows: one per active run, never per job.
ACTIVE_RUNS = select(
    runs.c.id.label("run_id"),
    runs.c.config_sha256,
    runs.c.runtime_dir,
    runs.c.source_hashes,
).where(runs.c.state == RunState.ACTIVE.value)

# -- jobs

# job_move: compare-and-set a job's state; returns what the caller needs next.
JOB_MOVE_RETURNING = (
    jobs.c.run_id,
    jobs.c.item_id,
    jobs.c.stage,
    jobs.c.fence,
    jobs.c.attempt_count,
)

# job_context: a job's stage, item, attempts so far and its run's config hash.
JOB_CONTEXT = (
    select(
        jobs.c.id,
        jobs.c.run_id,
        jobs.c.item_id,
        jobs.c.stage,
        jobs.c.lane,
        jobs.c.attempt_count,
        jobs.c.group_name,
        runs.c.config_sha256,
    )
    .join(runs, runs.c.id == jobs.c.run_id)
    .where(jobs.c.id == bindparam("job_id"))
)

# item_jobs: every job of one item (promotion decides on the whole item at once).
ITEM_JOBS = (
    select(jobs.c.id, jobs.c.run_id, jobs.c.stage, jobs.c.state, jobs.c.stage_position)
    .where(jobs.c.item_id == bindparam("item_id"))
    .order_by(jobs.c.stage_position)
)

# items_waiting: which of these items still have a waiting job.
ITEMS_WAITING = (
    select(jobs.c.item_id)
    .where(
        jobs.c.item_id.in_(bindparam("item_ids", expanding=True)),
        jobs.c.state == JobState.WAITING.value,
    )
    .distinct()
)

# run_open_job: does the run still have a job that is not terminal? (one index probe)
RUN_OPEN_JOB = select(
    exists().where(
        jobs.c.run_id == bindparam("run_id"),
        jobs.c.state.in_([s.value for s in OPEN_JOB_STATES]),
    )
)

# next_retry_at: the earliest retry backoff's end (an index probe, ix_jobs_retry_after).
NEXT_RETRY_AT = select(func.min(jobs.c.retry_after))

# running_by_lane_stage: running jobs per (run, lane, stage) of the node's runs.
RUNNING_BY_LANE_STAGE = (
    select(jobs.c.run_id, jobs.c.lane, jobs.c.stage, func.count())
    .where(
        jobs.c.run_id.in_(bindparam("run_ids", expanding=True)),
        jobs.c.state == JobState.RUNNING.value,
    )
    .group_by(jobs.c.run_id, jobs.c.lane, jobs.c.stage)
)

# -- attempts, leases, reservations

# insert_attempt: the intent rows of a claim (invariant 1), one statement for all of a
# shape, returning each id with its idempotency key (unique: what maps an id to its row,
# as a multi-row insert's RETURNING keeps no order).
INSERT_ATTEMPT = insert(attempts).returning(attempts.c.id, attempts.c.idempotency_key)

# start_jobs: a claim's jobs ready -> running in one statement, each fence bumped (its
# new lease's) and its attempt count raised by one (the intent's number).
START_JOBS = (
    update(jobs)
    .where(
        jobs.c.id.in_(bindparam("b_ids", expanding=True)),
        jobs.c.state == JobState.READY.value,
    )
    .values(
        state=JobState.RUNNING.value,
        updated_at=bindparam("b_now"),
        state_reason=None,
        fence=jobs.c.fence + 1,
        attempt_count=jobs.c.attempt_count + 1,
    )
    .returning(jobs.c.id, jobs.c.run_id, jobs.c.fence, jobs.c.attempt_count)
)

# insert_lease / insert_reservation: granted in the same transaction as the intent.
INSERT_LEASE = insert(leases)
INSERT_RESERVATION = insert(reservations)

# attempt_move_returning: what a settle or spawn needs of the attempt it moved.
ATTEMPT_MOVE_RETURNING = (
    attempts.c.id,
    attempts.c.job_id,
    attempts.c.run_id,
    attempts.c.number,
    attempts.c.fence,
    attempts.c.worker_id,
    attempts.c.peak_rss_mib,
    attempts.c.peak_gpu_mib,
)


def of_attempts_job(column: Any) -> Any:
    """A column of an attempt's job, as a scalar subquery correlated to ``attempts``
    (for a WHERE or RETURNING clause of a statement on the attempts table)."""
    return select(column).where(jobs.c.id == attempts.c.job_id).scalar_subquery()


# attempt_job_context: returned beside ATTEMPT_MOVE_RETURNING by a settle's move, so it
# needs no read of its job afterwards: the job's stage, item, attempts so far and group,
# and its run's config hash (one primary-key probe each, inside the same statement).
ATTEMPT_JOB_CONTEXT = (
    of_attempts_job(jobs.c.stage).label("job_stage"),
    of_attempts_job(jobs.c.item_id).label("item_id"),
    of_attempts_job(jobs.c.attempt_count).label("attempt_count"),
    of_attempts_job(jobs.c.group_name).label("group_name"),
    select(runs.c.config_sha256)
    .where(runs.c.id == attempts.c.run_id)
    .scalar_subquery()
    .label("config_sha256"),
)

# release_lease: an attempt's lease ends (its reservation ends with
# usage.RELEASE_RESERVATION_USAGE, which returns the expected cost it held).
RELEASE_LEASE = (
    update(leases)
    .where(leases.c.attempt_id == bindparam("b_attempt_id"), leases.c.released_at.is_(None))
    .values(released_at=bindparam("b_now"))
)

# node_held: attempts holding a slot on the node (unknown ones too: they may run).
NODE_HELD = (
    select(func.count())
    .select_from(attempts)
    .where(
        attempts.c.node == bindparam("node"),
        attempts.c.state.in_([s.value for s in HELD_ATTEMPT_STATES]),
    )
)

# node_unreleased: the part of the node's live reservations their attempts have not
# yet grown into (free memory already shows what they use), summed; never sampled:
# the whole reservation.
_UNRELEASED = reservations.c.memory_mib - func.coalesce(attempts.c.current_rss_mib, 0.0)
NODE_UNRELEASED = (
    select(func.sum(case((_UNRELEASED > 0, cast(_UNRELEASED, Float)), else_=cast(0.0, Float))))
    .select_from(reservations.join(attempts, attempts.c.id == reservations.c.attempt_id))
    .where(reservations.c.node == bindparam("node"), reservations.c.released_at.is_(None))
)

# node_row_held: node_row with node_held (``held``) and node_unreleased (``unreleased``)
# beside it, for a claim's snapshot: one statement, not three.
NODE_ROW_HELD = select(
    nodes,
    NODE_HELD.scalar_subquery().label("held"),
    NODE_UNRELEASED.scalar_subquery().label("unreleased"),
).where(nodes.c.name == bindparam("node"))

# node_ports: ports held by the node's in-flight and unknown attempts.
NODE_PORTS = select(attempts.c.ports).where(
    attempts.c.node == bindparam("node"),
    attempts.c.ports.is_not(None),
    attempts.c.state.in_([s.value for s in HELD_ATTEMPT_STATES]),
)

# node_reservations: the node's live reservations with their GPU share and devices
# (read for a node with GPUs: who holds which device).
NODE_RESERVATIONS = (
    select(
        reservations.c.gpu_mib,
        attempts.c.run_id,
        jobs.c.stage,
        attempts.c.gpu_devices,
    )
    .join(attempts, attempts.c.id == reservations.c.attempt_id)
    .join(jobs, jobs.c.id == attempts.c.job_id)
    .where(reservations.c.node == bindparam("node"), reservations.c.released_at.is_(None))
)

# stoppers: what stops dispatch whatever the candidates, in one read per claim: every
# control not yet cleared (``unknown`` NULL), and per run the number of attempts
# awaiting reconciliation (a row with ``unknown`` set, its other columns NULL).
STOPPERS = union_all(
    select(
        controls.c.kind,
        controls.c.scope,
        controls.c.run_id,
        controls.c.lane,
        controls.c.reason,
        cast(literal(None), Integer).label("unknown"),
    ).where(controls.c.cleared_at.is_(None)),
    select(
        literal(None),
        literal(None),
        attempts.c.run_id,
        literal(None),
        literal(None),
        func.count(),
    )
    .where(attempts.c.state == AttemptState.UNKNOWN.value)
    .group_by(attempts.c.run_id),
)

# stage_peaks: the measured peaks of the given runs' stages (one row per stage).
STAGE_PEAKS = select(
    stage_stats.c.run_id,
    stage_stats.c.stage,
    stage_stats.c.peak_rss_mib,
    stage_stats.c.peak_gpu_mib,
).where(stage_stats.c.run_id.in_(bindparam("run_ids", expanding=True)))

# stage_measured: a settle folds its measured attempt's peaks into its stage's row (the
# casts give PostgreSQL a type for a NULL peak).
_RSS = cast(bindparam("rss"), stage_stats.c.peak_rss_mib.type)
_GPU = cast(bindparam("gpu"), stage_stats.c.peak_gpu_mib.type)
STAGE_MEASURED = (
    update(stage_stats)
    .where(
        stage_stats.c.run_id == bindparam("b_run_id"), stage_stats.c.stage == bindparam("b_stage")
    )
    .values(
        measured=stage_stats.c.measured + 1,
        peak_rss_mib=case(
            (_RSS.is_(None), stage_stats.c.peak_rss_mib),
            (stage_stats.c.peak_rss_mib.is_(None), _RSS),
            (stage_stats.c.peak_rss_mib < _RSS, _RSS),
            else_=stage_stats.c.peak_rss_mib,
        ),
        peak_gpu_mib=case(
            (_GPU.is_(None), stage_stats.c.peak_gpu_mib),
            (stage_stats.c.peak_gpu_mib.is_(None), _GPU),
            (stage_stats.c.peak_gpu_mib < _GPU, _GPU),
            else_=stage_stats.c.peak_gpu_mib,
        ),
    )
)

# insert_stage_stats: a new run's stages start unmeasured.
INSERT_STAGE_STATS = insert(stage_stats)

# insert_decision: a dispatch decision (executemany: one per (run, lane, stage) that
# changed).
INSERT_DECISION = insert(decisions)

# -- workers

# stale_workers: active workers whose heartbeat is older than the cutoff.
STALE_WORKERS = select(workers.c.id).where(
    workers.c.state == WorkerState.ACTIVE.value, workers.c.heartbeat_at < bindparam("cutoff")
)

# lower_low_water: a heartbeat's free memory lowers its node's low-water mark in each run
# the worker has attempts running for (primary key), and writes nothing when it is not
# lower.
LOWER_LOW_WATER = (
    update(node_low_water)
    .where(
        node_low_water.c.node == bindparam("low_node"),
        node_low_water.c.run_id.in_(bindparam("run_ids", expanding=True)),
        (node_low_water.c.low_free_mib.is_(None))
        | (node_low_water.c.low_free_mib > bindparam("low")),
    )
    .values(low_free_mib=bindparam("low"), low_at=bindparam("at"))
)

# expired_leases: live leases past their expiry whose attempt is still in flight.
EXPIRED_LEASES = (
    select(
        leases.c.id,
        leases.c.attempt_id,
        leases.c.worker_id,
        leases.c.expires_at,
        leases.c.fence,
    )
    .join(attempts, attempts.c.id == leases.c.attempt_id)
    .where(
        leases.c.released_at.is_(None),
        leases.c.expires_at < bindparam("now"),
        attempts.c.state.in_([s.value for s in IN_FLIGHT_ATTEMPT_STATES]),
    )
    .order_by(leases.c.id)
)

# -- statements sized to the claim


_CANDIDATE = select(
    jobs.c.id,
    jobs.c.run_id,
    jobs.c.lane,
    jobs.c.stage,
    jobs.c.stage_position,
    jobs.c.fence,
    jobs.c.attempt_count,
    jobs.c.priority_rank,
    jobs.c.group_name,
    items.c.key.label("item_key"),
    items.c.lane.label("item_lane"),
    items.c.position.label("item_position"),
    items.c.fields.label("item_fields"),
).join(items, items.c.id == jobs.c.item_id)

# window_attempts: the attempts of some stages of a run started since a moment (a rate
# limit's window; ix_attempts_run_intent), with their state.
WINDOW_ATTEMPTS = (
    select(attempts.c.id, attempts.c.intent_at, attempts.c.state, jobs.c.stage)
    .join(jobs, jobs.c.id == attempts.c.job_id)
    .where(
        attempts.c.run_id == bindparam("b_run_id"),
        attempts.c.intent_at >= bindparam("b_since"),
        jobs.c.stage.in_(bindparam("b_stages", expanding=True)),
    )
)

# window_usage: what some attempts reported of some usage keys (pk_attempt_usage).
WINDOW_USAGE = select(attempt_usage.c.attempt_id, attempt_usage.c.key, attempt_usage.c.value).where(
    attempt_usage.c.attempt_id.in_(bindparam("b_ids", expanding=True)),
    attempt_usage.c.key.in_(bindparam("b_keys", expanding=True)),
)

# ready_job: one ready job as a candidate (explain asks about one job).
READY_JOB = _CANDIDATE.where(
    jobs.c.id == bindparam("job_id"),
    jobs.c.state == JobState.READY.value,
    jobs.c.retry_after.is_(None),
)


def _built_once(build: Callable[..., Any]) -> Callable[..., Any]:
    """Keep the statements a builder made, by its arguments (the first a sequence of
    keys): a claim that asks for the same lanes again reuses the statement object, so
    it is neither built nor keyed for SQLAlchemy's compiled cache again."""
    cached = functools.lru_cache(maxsize=256)(build)

    @functools.wraps(build)
    def get(keys: Sequence[Any], *rest: Any) -> Any:
        return cached(tuple(keys), *rest)

    return get


@_built_once
def ready_candidates(
    partitions: Sequence[tuple[int, str, str, str | None]],
    per_partition: int,
    locked: bool = False,
) -> Any:
    """The first ``per_partition`` ready jobs of each (run, lane, stage, item group):
    highest priority first (``priority_rank``), in item order among equals. The group is
    None in a run that does not select by yield (every job's ``group_name`` is NULL).

    More than the free slots of one partition can never start in one claim, so one more
    than that is enough to also record why the next would wait. Each branch reads the
    first rows of one index range (``ix_jobs_dispatch``) in the index's own order: the
    cost follows the slots and lanes, not the backlog
    (tests/integration/test_claim_plans.py checks the plans on both backends).

    ``locked`` (a claim): on PostgreSQL each branch locks the job rows it returns and
    skips those another claim holds (``FOR NO KEY UPDATE OF jobs SKIP LOCKED``, under
    its LIMIT, so a branch still returns up to ``per_partition`` jobs nobody holds);
    SQLite renders no lock (its write lock already serialises claims).
    """
    branches = [
        _held(
            _CANDIDATE.where(
                jobs.c.run_id == run_id,
                jobs.c.state == JobState.READY.value,
                jobs.c.lane == lane,
                jobs.c.stage == stage,
                jobs.c.group_name.is_(None) if group is None else jobs.c.group_name == group,
                # Waiting out a retry backoff: not a candidate until the controller clears it.
                jobs.c.retry_after.is_(None),
            )
            # The group leads the order although it is one value here: PostgreSQL
            # takes only equalities, not IS NULL, as fixing an index column, so
            # without it the index's order is not the query's and every ready job
            # of the partition is read and sorted for the first few.
            .order_by(jobs.c.group_name, jobs.c.priority_rank, jobs.c.id)
            .limit(per_partition),
            locked,
        )
        .subquery()
        .select()
        for run_id, lane, stage, group in partitions
    ]
    if len(branches) == 1:
        return branches[0]
    return union_all(*branches)


def _held(query: Any, locked: bool) -> Any:
    return query.with_for_update(skip_locked=True, key_share=True, of=jobs) if locked else query


@_built_once
def waiting_lanes(lane_keys: Sequence[tuple[int, str]]) -> Any:
    """Which of these (run, lane) pairs have a job waiting on its needs (one probe each)."""
    branches = [
        select(literal(run_id).label("run_id"), literal(lane).label("lane")).where(
            exists().where(
                jobs.c.run_id == run_id,
                jobs.c.state == JobState.WAITING.value,
                jobs.c.lane == lane,
            )
        )
        for run_id, lane in lane_keys
    ]
    if len(branches) == 1:
        return branches[0]
    return union_all(*branches)


@_built_once
def last_decisions(keys: Sequence[tuple[int, str, str | None]]) -> Any:
    """The newest decision of each (run, lane, stage) (one index probe each)."""
    branches = []
    for run_id, lane, stage in keys:
        stage_match = decisions.c.stage.is_(None) if stage is None else decisions.c.stage == stage
        branches.append(
            select(
                literal(run_id).label("k_run"),
                literal(lane).label("k_lane"),
                literal(stage).label("k_stage"),
                decisions.c.verdict,
                decisions.c.reason_code,
            )
            .where(and_(decisions.c.run_id == run_id, decisions.c.lane == lane, stage_match))
            .order_by(decisions.c.id.desc())
            .limit(1)
            .subquery()
            .select()
        )
    if len(branches) == 1:
        return branches[0]
    return union_all(*branches)


UNION_CHUNK = 100
"""Branches per compound statement (SQLite allows 500 per compound SELECT)."""


def chunks(keys: Sequence[Any]) -> list[Sequence[Any]]:
    return [keys[i : i + UNION_CHUNK] for i in range(0, len(keys), UNION_CHUNK)]
