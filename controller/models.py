"""The ledger's tables as SQLAlchemy 2.x typed models.

Only ``controller.ledger`` writes these rows' state columns. Every state set from
``controller.states`` is mirrored as a named CHECK constraint, and state is tied to its
timestamps by CHECKs so a half-finished row cannot exist. All timestamps are naive UTC.
Alembic migrations (``migrations/``) are the only way this schema changes; the drift
test proves ``alembic upgrade head`` builds exactly these tables.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from laneway.controller.states import (
    AttemptState,
    Attention,
    ControlKind,
    ControlScope,
    JobState,
    NotificationState,
    Outcome,
    RunState,
    Verdict,
    WorkerState,
)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime()}  # noqa: RUF012


E = TypeVar("E", bound=StrEnum)


class EnumText(TypeDecorator[E], Generic[E]):
    """A state column: stored as its plain text value (the CHECK constraint names the
    set), read back as its enum, so a bare ``"running"`` in code is a type error."""

    impl = String
    cache_ok = True

    def __init__(self, enum: type[E], length: int) -> None:
        super().__init__(length)
        self.enum = enum

    def process_bind_param(self, value: E | str | None, dialect: Dialect) -> str | None:
        return None if value is None else self.enum(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> E | None:
        return None if value is None else self.enum(value)


def one_of(column: str, enum: type[StrEnum], name: str) -> CheckConstraint:
    values = ", ".join(f"'{member.value}'" for member in enum)
    return CheckConstraint(f"{column} IN ({values})", name=name)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        one_of("state", RunState, "state"),
        CheckConstraint("(state = 'finished') = (finished_at IS NOT NULL)", name="finished_at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    state: Mapped[RunState] = mapped_column(EnumText(RunState, 16), default=RunState.ACTIVE.value)
    config_json: Mapped[str] = mapped_column(Text)
    config_sha256: Mapped[str] = mapped_column(String(64))
    source_hashes: Mapped[dict[str, Any]] = mapped_column(JSON)
    runtime_dir: Mapped[str] = mapped_column(Text)
    config_path: Mapped[str | None] = mapped_column(Text)
    """The config file the run was started from, absolute (migration 0017; None: built in
    code, or made before the migration)."""
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime())
    closeout_finished_at: Mapped[datetime | None] = mapped_column(DateTime())
    """When its closeout steps all ended (None: none ran yet, or it has none)."""


class Lane(Base):
    __tablename__ = "lanes"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    name: Mapped[str] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name"))
    caps: Mapped[dict[str, Any]] = mapped_column(JSON)


class Item(Base):
    __tablename__ = "items"
    __table_args__ = (UniqueConstraint("run_id", "key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    key: Mapped[str] = mapped_column(String(128))
    lane: Mapped[str] = mapped_column(String(64))
    position: Mapped[int] = mapped_column(Integer)
    fields: Mapped[dict[str, Any]] = mapped_column(JSON)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("item_id", "stage"),
        one_of("state", JobState, "state"),
        CheckConstraint(
            "(state IN ('succeeded', 'failed', 'skipped', 'cancelled')) = "
            "(finished_at IS NOT NULL)",
            name="finished_at",
        ),
        CheckConstraint("fence >= 0", name="fence"),
        Index("ix_jobs_run_state", "run_id", "state"),
        # Claims: the first ready jobs of one (run, lane, stage), highest priority first,
        # in item order among equals.
        # (A run that selects by yield: one range per item group.)
        Index(
            "ix_jobs_dispatch",
            "run_id",
            "state",
            "lane",
            "stage",
            "group_name",
            "priority_rank",
            "id",
        ),
        # Reuse: a new run looks up earlier jobs by what their result depends on.
        Index("ix_jobs_reuse_key", "reuse_key"),
        # Backoff: only jobs waiting out a retry delay have one (cleared when it ends).
        Index("ix_jobs_retry_after", "retry_after"),
        # Status: a run's reused jobs per stage, index-only; partial, so only reused jobs
        # have an entry and no state change touches it (migration 0014).
        Index(
            "ix_jobs_reused",
            "run_id",
            "stage",
            "reused_from",
            sqlite_where=text("reused_from IS NOT NULL"),
            postgresql_where=text("reused_from IS NOT NULL"),
        ),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id"))
    stage: Mapped[str] = mapped_column(String(64))
    stage_position: Mapped[int] = mapped_column(Integer)
    lane: Mapped[str] = mapped_column(String(64))
    state: Mapped[JobState] = mapped_column(EnumText(JobState, 16))
    fence: Mapped[int] = mapped_column(Integer, default=0)
    """Only grows: bumped on every lease grant and every revocation (invariant 4)."""
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    state_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    updated_at: Mapped[datetime] = mapped_column(DateTime())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime())
    reuse_key: Mapped[str | None] = mapped_column(String(64))
    """sha256 of everything the job's result depends on (its frozen stage definition,
    item, source hashes and the reuse keys of the jobs it needs; controller.reuse)."""
    reused_from: Mapped[int | None] = mapped_column(Integer)
    """The succeeded attempt of an earlier run whose result this job took over (the job
    was created succeeded and never ran). Not a foreign key: attempts point at jobs."""
    retry_after: Mapped[datetime | None] = mapped_column(DateTime())
    """A ready job waiting out its stage's retry backoff: not claimed until the
    controller clears this once the time has come (``release_due_retries``)."""
    group_name: Mapped[str | None] = mapped_column(String(64))
    """Its item's group, in a run whose config selects by yield (``select``); else NULL."""
    priority_rank: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Minus its item's priority: claims take the lowest rank first (``ix_jobs_dispatch``
    ascending), so the highest priority goes first and equals keep item order."""


class Attempt(Base):
    """An attempt row *is* the intent: it is committed before any process starts."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        UniqueConstraint("idempotency_key"),
        one_of("state", AttemptState, "state"),
        CheckConstraint(
            "outcome IS NULL OR outcome IN (" + ", ".join(f"'{o.value}'" for o in Outcome) + ")",
            name="outcome",
        ),
        CheckConstraint("(state = 'settled') = (outcome IS NOT NULL)", name="settled_outcome"),
        CheckConstraint("(state = 'settled') = (settled_at IS NOT NULL)", name="settled_at"),
        CheckConstraint("state <> 'running' OR started_at IS NOT NULL", name="started_at"),
        Index("ix_attempts_state", "state"),
        # The infrastructure breaker reads a run's newest settles, newest first.
        # Rate limits: the attempts of a run started within a window.
        Index("ix_attempts_run_intent", "run_id", "intent_at"),
        Index("ix_attempts_run_settled", "run_id", "settled_at", "id"),
        # Status (migration 0016): settled attempts per stage and outcome, index-only; each
        # lane's newest start and settle, one seek each. Partial: an intent has no entry in
        # any, so the claim maintains none (the spawn adds one, the settle two).
        Index(
            "ix_attempts_run_stage_outcome",
            "run_id",
            "stage",
            "outcome",
            sqlite_where=text("outcome IS NOT NULL"),
            postgresql_where=text("outcome IS NOT NULL"),
        ),
        Index(
            "ix_attempts_run_lane_started",
            "run_id",
            "lane",
            "started_at",
            sqlite_where=text("started_at IS NOT NULL"),
            postgresql_where=text("started_at IS NOT NULL"),
        ),
        Index(
            "ix_attempts_run_lane_settled",
            "run_id",
            "lane",
            "settled_at",
            sqlite_where=text("settled_at IS NOT NULL"),
            postgresql_where=text("settled_at IS NOT NULL"),
        ),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    number: Mapped[int] = mapped_column(Integer)
    idempotency_key: Mapped[str] = mapped_column(String(64))
    state: Mapped[AttemptState] = mapped_column(EnumText(AttemptState, 16))
    outcome: Mapped[Outcome | None] = mapped_column(EnumText(Outcome, 32))
    state_reason: Mapped[str | None] = mapped_column(Text)
    fence: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id"))
    node: Mapped[str] = mapped_column(String(64))
    stage: Mapped[str | None] = mapped_column(String(64))
    """The job's stage and lane, copied when the intent is written (migration 0015)."""
    lane: Mapped[str | None] = mapped_column(String(64))
    argv_hash: Mapped[str] = mapped_column(String(64))
    attempt_dir: Mapped[str] = mapped_column(Text)
    intent_at: Mapped[datetime] = mapped_column(DateTime())
    started_at: Mapped[datetime | None] = mapped_column(DateTime())
    settled_at: Mapped[datetime | None] = mapped_column(DateTime())
    boot_id: Mapped[str | None] = mapped_column(String(64))
    supervisor_pid: Mapped[int | None] = mapped_column(Integer)
    supervisor_start_time: Mapped[int | None] = mapped_column(BigInteger)
    """Clock ticks since boot (/proc/PID/stat field 22): with boot id and pid, an identity
    a recycled pid cannot fake."""
    child_pid: Mapped[int | None] = mapped_column(Integer)
    child_start_time: Mapped[int | None] = mapped_column(BigInteger)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    exit_signal: Mapped[int | None] = mapped_column(Integer)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    diagnostics: Mapped[list[Any]] = mapped_column(JSON, default=list)
    peak_rss_mib: Mapped[float | None] = mapped_column(Float)
    peak_gpu_mib: Mapped[float | None] = mapped_column(Float)
    peak_rss_at: Mapped[datetime | None] = mapped_column(DateTime())
    peak_gpu_at: Mapped[datetime | None] = mapped_column(DateTime())
    current_rss_mib: Mapped[float | None] = mapped_column(Float)
    """The latest RSS sample of the attempt's process tree: admission counts only the part
    of the reservation not yet in use (max(0, reservation - current))."""
    gpu_note: Mapped[str | None] = mapped_column(Text)
    """Why the GPU columns are null (no driver, no device, no per-process figures)."""
    sampled_at: Mapped[datetime | None] = mapped_column(DateTime())
    gpu_devices: Mapped[list[Any] | None] = mapped_column(JSON)
    """The GPUs admission gave it (``[{"index", "uuid", "whole"}]``; stage ``gpus`` or
    ``gpu_mib``): its job's ``CUDA_VISIBLE_DEVICES``. Null: it asked for none."""
    ports: Mapped[list[Any] | None] = mapped_column(JSON)
    """Ports allocated to the attempt (stage ``ports = N``): distinct from every other
    in-flight attempt's on the node; free again once it settles."""


class Lease(Base):
    """One row per grant. The active lease of a job is the one with released_at NULL."""

    __tablename__ = "leases"
    __table_args__ = (
        UniqueConstraint("job_id", "fence"),
        CheckConstraint("released_at IS NULL OR released_at >= granted_at", name="released_at"),
        Index("ix_leases_worker_active", "worker_id", "released_at"),
        Index("ix_leases_attempt", "attempt_id"),
        # Expiry: only live leases (released_at NULL) are looked at.
        Index("ix_leases_open", "released_at", "expires_at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"))
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id"))
    fence: Mapped[int] = mapped_column(Integer)
    granted_at: Mapped[datetime] = mapped_column(DateTime())
    expires_at: Mapped[datetime] = mapped_column(DateTime())
    released_at: Mapped[datetime | None] = mapped_column(DateTime())


class Node(Base):
    __tablename__ = "nodes"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    memory_floor_mib: Mapped[int] = mapped_column(Integer)
    max_jobs: Mapped[int] = mapped_column(Integer)
    gpu_total_mib: Mapped[int | None] = mapped_column(Integer)
    gpu_fraction: Mapped[float | None] = mapped_column(Float)
    gpu_baseline_mib: Mapped[int | None] = mapped_column(Integer)
    gpu_devices: Mapped[int | None] = mapped_column(Integer)
    """How many devices of ``gpu_total_mib`` each the config says it has (null: one)."""
    mem_available_mib: Mapped[float | None] = mapped_column(Float)
    mem_total_mib: Mapped[float | None] = mapped_column(Float)
    gpus: Mapped[list[Any] | None] = mapped_column(JSON)
    """Per device: index, total_mib, used_mib, baseline_mib (used by processes not ours)."""
    gpu_note: Mapped[str | None] = mapped_column(Text)
    """Why ``gpus`` is null: NVML missing, no driver, no device."""
    sampled_at: Mapped[datetime | None] = mapped_column(DateTime())
    updated_at: Mapped[datetime] = mapped_column(DateTime())


class Worker(Base):
    __tablename__ = "workers"
    __table_args__ = (
        one_of("state", WorkerState, "state"),
        CheckConstraint("(state = 'active') = (stopped_at IS NULL)", name="stopped_at"),
        Index("ix_workers_state", "state", "node"),
    )
    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name"))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    boot_id: Mapped[str] = mapped_column(String(64))
    process_start_time: Mapped[int | None] = mapped_column(BigInteger)
    slots: Mapped[int] = mapped_column(Integer)
    state: Mapped[WorkerState] = mapped_column(EnumText(WorkerState, 16))
    started_at: Mapped[datetime] = mapped_column(DateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime())
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime())
    seams: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """What the worker chose for each platform seam (migration 0015; None: not said)."""


class Reservation(Base):
    """Memory/GPU held for a running attempt; unreleased rows count against headroom."""

    __tablename__ = "reservations"
    __table_args__ = (
        UniqueConstraint("attempt_id"),
        CheckConstraint("memory_mib >= 0 AND gpu_mib >= 0", name="amounts"),
        Index("ix_reservations_node_active", "node", "released_at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"))
    node: Mapped[str] = mapped_column(String(64))
    memory_mib: Mapped[int] = mapped_column(Integer)
    gpu_mib: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    released_at: Mapped[datetime | None] = mapped_column(DateTime())
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Usage key -> the attempt's expected cost, held against its run's and stage's
    budgets (``usage_totals.reserved``) until the reservation is released."""


class Control(Base):
    __tablename__ = "controls"
    __table_args__ = (
        one_of("kind", ControlKind, "kind"),
        one_of("scope", ControlScope, "scope"),
        CheckConstraint("(scope = 'global') = (run_id IS NULL)", name="scope_run"),
        CheckConstraint("(scope = 'lane') = (lane IS NOT NULL)", name="scope_lane"),
        CheckConstraint("(cleared_at IS NULL) = (cleared_by IS NULL)", name="cleared"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    scope: Mapped[ControlScope] = mapped_column(EnumText(ControlScope, 16))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"))
    lane: Mapped[str | None] = mapped_column(String(64))
    kind: Mapped[ControlKind] = mapped_column(EnumText(ControlKind, 16))
    reason: Mapped[str] = mapped_column(Text)
    set_by: Mapped[str] = mapped_column(String(128))
    set_at: Mapped[datetime] = mapped_column(DateTime())
    cleared_by: Mapped[str | None] = mapped_column(String(128))
    cleared_at: Mapped[datetime | None] = mapped_column(DateTime())
    clear_reason: Mapped[str | None] = mapped_column(Text)


class Decision(Base):
    """An admission verdict. Refusals are deduplicated: a row only when the reason for
    (run, lane, stage) changes."""

    __tablename__ = "decisions"
    __table_args__ = (
        one_of("verdict", Verdict, "verdict"),
        Index("ix_decisions_run_lane", "run_id", "lane", "id"),
        # Deduplication reads the newest decision of one (run, lane, stage).
        Index("ix_decisions_key", "run_id", "lane", "stage", "id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    lane: Mapped[str] = mapped_column(String(64))
    stage: Mapped[str | None] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(String(64))
    worker_id: Mapped[str | None] = mapped_column(String(96))
    verdict: Mapped[Verdict] = mapped_column(EnumText(Verdict, 16))
    reason_code: Mapped[str | None] = mapped_column(String(32))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_id: Mapped[int | None] = mapped_column(Integer)
    decided_at: Mapped[datetime] = mapped_column(DateTime())


class Event(Base):
    """Append-only; ``id`` grows monotonically (AUTOINCREMENT on SQLite: never reused)."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_run", "run_id", "id"),
        Index("ix_events_run_kind", "run_id", "kind", "id"),
        {"sqlite_autoincrement": True},
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime())
    run_id: Mapped[int | None] = mapped_column(Integer)
    job_id: Mapped[int | None] = mapped_column(Integer)
    attempt_id: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(48))
    actor: Mapped[str] = mapped_column(String(128))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


class StageStats(Base):
    """Per (run, stage): what its settled attempts measured, kept by the settle that
    measured it, so admission reads one row instead of every attempt of the stage."""

    __tablename__ = "stage_stats"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    stage: Mapped[str] = mapped_column(String(64), primary_key=True)
    measured: Mapped[int] = mapped_column(Integer, default=0)
    """How many settled attempts had a measurement folded in."""
    peak_rss_mib: Mapped[float | None] = mapped_column(Float)
    peak_gpu_mib: Mapped[float | None] = mapped_column(Float)


class NodeLowWater(Base):
    """Per (run, node): the lowest free memory the node's workers measured while the run
    was active, beside the run's floor for that node. Created with the run; lowered by
    heartbeats (one UPDATE, only when a lower value comes), so ``laneway report`` can say
    how close each node came to its floor."""

    __tablename__ = "node_low_water"
    __table_args__ = (Index("ix_node_low_water_node", "node", "run_id"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    node: Mapped[str] = mapped_column(ForeignKey("nodes.name"), primary_key=True)
    memory_floor_mib: Mapped[int] = mapped_column(Integer)
    """The run's configured floor for the node, frozen with the run."""
    low_free_mib: Mapped[float | None] = mapped_column(Float)
    """The lowest free memory measured; NULL until a worker of the node reports."""
    low_at: Mapped[datetime | None] = mapped_column(DateTime())
    """When it was measured (ledger clock)."""


class AttemptUsage(Base):
    """What an attempt reported in its result's ``usage``: one row per key. Written once,
    by the settle (or the unknown mark, or the reconcile) that read the result."""

    __tablename__ = "attempt_usage"
    __table_args__ = (
        # The expected cost: a stage's newest values of one key in one run.
        Index("ix_attempt_usage_window", "run_id", "stage", "key", "attempt_id"),
    )
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    stage: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime] = mapped_column(DateTime())


class GroupStats(Base):
    """Per (run, item group) of a run that selects by yield: how many attempts were
    admitted, and what settled attempts reported of the selection's ``by`` and ``per``
    keys (kept by the claim and the settle, so a choice reads a few rows)."""

    __tablename__ = "group_stats"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    group_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    admitted: Mapped[int] = mapped_column(Integer, default=0)
    measured: Mapped[int] = mapped_column(Integer, default=0)
    """Settled attempts that reported ``by`` or ``per``."""
    by_total: Mapped[float] = mapped_column(Float, default=0.0)
    per_total: Mapped[float] = mapped_column(Float, default=0.0)


class UsageTotal(Base):
    """Per (run, stage, usage key): what was spent and what live attempts hold, kept by
    the transactions that report or reserve it, so a budget check reads a few rows
    instead of every attempt. A run's total is the sum over its stages."""

    __tablename__ = "usage_totals"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    stage: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    spent: Mapped[float] = mapped_column(Float, default=0.0)
    reserved: Mapped[float] = mapped_column(Float, default=0.0)
    """Expected costs of attempts that hold a reservation (running, or unknown until
    reconciled: they may have spent)."""
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """How many attempts reported this key."""


class Artifact(Base):
    """A declared output of a succeeded attempt, hashed and put in its run's artifact
    store: written once, by the settle that made the attempt succeeded (same
    transaction), never changed. ``location`` is the stored object's URL."""

    __tablename__ = "artifacts"
    __table_args__ = (
        UniqueConstraint("attempt_id", "name"),
        Index("ix_artifacts_run_stage", "run_id", "stage"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"))
    stage: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(Text)
    """The file's path relative to the attempt's workspace."""
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    location: Mapped[str] = mapped_column(Text)
    node: Mapped[str] = mapped_column(String(64))
    """The node whose worker stored it (bytes moved up from that node)."""
    created_at: Mapped[datetime] = mapped_column(DateTime())


class AttemptInput(Base):
    """An artifact an attempt was given as an input (an output of a stage its stage
    needs), recorded with the attempt's intent: lineage is a join (``v_lineage``)."""

    __tablename__ = "attempt_inputs"
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"), primary_key=True)
    artifact_id: Mapped[int] = mapped_column(
        ForeignKey("artifacts.id"), primary_key=True, index=True
    )
    stage: Mapped[str] = mapped_column(String(64))
    """The producing stage."""
    name: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    node: Mapped[str] = mapped_column(String(64))
    """The node whose worker fetched it (bytes moved down to that node)."""
    created_at: Mapped[datetime] = mapped_column(DateTime())


class ControllerRow(Base):
    """One serving controller (``laneway controller`` or ``laneway run``'s), from the
    first tick that held the ledger's lock to its clean stop: its heartbeat makes it
    ``live``, ``stale`` or ``lost`` to every view and to the workers, on any machine."""

    __tablename__ = "controllers"
    __table_args__ = ({"sqlite_autoincrement": True},)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    boot_id: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(DateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime())
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime())
    notify_cursor: Mapped[int | None] = mapped_column(Integer)
    """The newest event its notifier has turned into notifications; the next
    controller's notifier starts after it."""


class Notification(Base):
    """One attention state told to the operator (controller/notify.py): ``key`` names
    the occurrence, so it is created once, whoever notices it and however often."""

    __tablename__ = "notifications"
    __table_args__ = (
        one_of("kind", Attention, "kind"),
        one_of("state", NotificationState, "state"),
        Index("ix_notifications_state", "state", "id"),
        {"sqlite_autoincrement": True},
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[Attention] = mapped_column(EnumText(Attention, 32))
    run_id: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    created_by: Mapped[str] = mapped_column(String(128))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    """What was sent: kind, run, reason, next step, link."""
    state: Mapped[NotificationState] = mapped_column(EnumText(NotificationState, 16))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime())


class NotificationDelivery(Base):
    """One try of one channel of a notification: what answered, or why it failed
    (secrets redacted)."""

    __tablename__ = "notification_deliveries"
    __table_args__ = ({"sqlite_autoincrement": True},)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    notification_id: Mapped[int] = mapped_column(ForeignKey("notifications.id"), index=True)
    channel: Mapped[str] = mapped_column(String(16))
    """``webhook`` or ``command``."""
    target: Mapped[str] = mapped_column(Text)
    """The URL or argv as configured: ``${NAME}`` references unresolved."""
    try_number: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime())
    ok: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(Text)
    """``HTTP 204``, ``exit 0``, or the failure in words."""
