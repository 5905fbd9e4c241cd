"""The status report's types: what ``laneway status`` shows for one run.

``controller/status.py`` builds a ``StatusReport`` from the named read queries of
``controller/queries.py``; the CLI, the live view, the web page, metrics, the snapshots
and the foreground run read its attributes. ``StatusReport.as_dict()`` is the one JSON
form (``laneway status --json``, ``status.json``, ``SUMMARY.json``, ``/api/state``,
``laneway run --json``): keys in the order each dataclass declares its fields.

Standard library only: ``laneway status`` on SQLite imports this without SQLAlchemy.
Timestamps are ISO text (``clock.iso``), as they are printed. A field that holds a state
is typed with its enum (``controller/states.py``), a code with ``controller/codes.py``'s:
``StrEnum`` members, so the JSON form holds the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeVar

from laneway.controller.codes import RefusalCode, StepCode, refusal_code, step_code
from laneway.controller.states import (
    AttemptState,
    ControlKind,
    ControlScope,
    RunState,
    StepState,
    WorkerState,
)

E = TypeVar("E", bound=StrEnum)


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _member(enum: type[E], value: Any) -> Any:
    """``value`` read back from JSON as the member of ``enum`` it is the text of; anything
    else (a hand-written body's None) as it is."""
    try:
        return enum(value)
    except ValueError:
        return value


class _Flat:
    """A flat dataclass whose JSON form is its fields, in declaration order."""

    def as_dict(self) -> dict[str, Any]:
        """The fields, in declaration order (a shallow copy)."""
        return dict(self.__dict__)


@dataclass
class RunInfo(_Flat):
    """The run's row."""

    id: int
    name: str
    state: RunState
    created_at: str | None
    finished_at: str | None
    config_sha256: str
    runtime_dir: str
    config_path: str | None = None
    """The config file the run was started from (None: not recorded)."""

    @property
    def finished(self) -> bool:
        return self.state == RunState.FINISHED


@dataclass
class Control(_Flat):
    """A pause, stop or halt in force (global or the run's)."""

    id: int
    kind: ControlKind
    scope: ControlScope
    lane: str | None
    reason: str
    set_by: str
    set_at: str | None


@dataclass
class OnDisk:
    """What the dashboard adds to an unknown attempt: its evidence files found here and
    its processes' pids."""

    files: list[str]
    supervisor_pid: int | None
    child_pid: int | None


@dataclass
class UnknownAttempt:
    """An attempt whose outcome is unknown, with the command that settles it.

    ``conclusive``: its evidence, once conclusive (``evidence.mark_conclusive``);
    ``on_disk``: set by the dashboard. Each is in ``as_dict`` only when set."""

    attempt_id: int
    job_id: int
    item: str
    stage: str
    reason: str | None
    evidence: str | None
    reconcile: str
    conclusive: dict[str, Any] | None = None
    on_disk: OnDisk | None = None
    evidence_on: dict[str, Any] | None = None
    """Conclusive evidence a restarted worker read on the attempt's node
    (``ledger.note_evidence``): ``node``, ``host``, ``outcome``, ``words``; in ``as_dict``
    only when set."""

    def as_dict(self) -> dict[str, Any]:
        body = {
            "attempt_id": self.attempt_id,
            "job_id": self.job_id,
            "item": self.item,
            "stage": self.stage,
            "reason": self.reason,
            "evidence": self.evidence,
            "reconcile": self.reconcile,
        }
        if self.conclusive is not None:
            body["conclusive"] = self.conclusive
        if self.on_disk is not None:
            body["files"] = self.on_disk.files
            body["supervisor_pid"] = self.on_disk.supervisor_pid
            body["child_pid"] = self.on_disk.child_pid
        if self.evidence_on is not None:
            body["evidence_on"] = self.evidence_on
        return body


@dataclass
class BackingOff(_Flat):
    """A ready job waiting out its stage's retry backoff."""

    job_id: int
    item: str
    stage: str
    retry_after: str | None


@dataclass
class RunningAttempt(_Flat):
    """An attempt in flight (intent or running)."""

    attempt_id: int
    job_id: int
    item: str
    stage: str
    lane: str
    node: str
    state: AttemptState
    pid: int | None
    elapsed_seconds: float
    timeout_seconds: float | None
    peak_rss_mib: float | None
    worker_id: str | None = None
    verified: bool = True
    """False when its worker is not ``live`` (stale, lost, stopped or not found): nobody
    can say it still runs; ``unverified_because`` says why (``worker w-1 stale for 12
    s``). Never shown as running."""
    unverified_because: str | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    """The GPUs it holds (``attempts.gpu_devices``: ``index``, ``uuid``, ``whole``), the
    devices its job was given in ``CUDA_VISIBLE_DEVICES``; [] when it holds none."""

    @property
    def shown_state(self) -> str:
        """Its state as every view shows it: ``unverified`` unless its worker is live."""
        return self.state if self.verified else "unverified"


def held_gpus_words(devices: list[dict[str, Any]] | None) -> str:
    """The GPUs an attempt holds in words: ``GPU 0 (GPU-0c1d…), a share of GPU 1``
    (a ``gpu_mib`` stage shares its device); '' for none."""
    words = []
    for device in devices or []:
        name = f"GPU {device.get('index')}"
        if device.get("uuid"):
            name += f" ({device['uuid']})"
        words.append(name if device.get("whole", True) else f"a share of {name}")
    return ", ".join(words)


SEAM_NAMES = ("wait", "identity", "subreaper", "oom", "spawn")
"""The platform seams a worker records (``workers/seams.py``), in the order shown."""


def seams_words(seams: dict[str, Any] | None) -> str:
    """A worker's seams in words: ``wait pidfd, identity boot_id + start time, subreaper
    prctl, oom cgroup, spawn fork`` ('' when it recorded none); ``(portable paths
    forced)`` after them when the test hook switched Linux's facilities off."""
    if not seams:
        return ""
    text = ", ".join(f"{name} {seams[name]}" for name in SEAM_NAMES if seams.get(name))
    return text + (" (portable paths forced)" if seams.get("portable") else "")


@dataclass
class Worker(_Flat):
    """A worker of one of the run's nodes. ``liveness`` (``status_nodes.worker_liveness``):
    ``live``, ``stale``, ``lost`` or ``stopped``, from its row and its heartbeat's age;
    ``live`` is ``liveness == "live"``."""

    worker_id: str
    node: str
    host: str
    pid: int
    slots: int
    state: WorkerState
    live: bool
    started_at: str | None
    heartbeat_at: str | None
    heartbeat_age_seconds: float
    stopped_at: str | None
    liveness: str
    seams: dict[str, Any] | None = None
    """What it chose for each platform seam as it registered (``workers/seams.py``):
    ``wait``, ``identity``, ``subreaper``, ``oom``, ``spawn``; None if it did not say.
    In ``as_dict`` only when set."""

    def as_dict(self) -> dict[str, Any]:
        body = dict(self.__dict__)
        if body["seams"] is None:
            del body["seams"]
        return body

    def liveness_words(self) -> str:
        """Its liveness in words: ``stale for 12 s``, ``lost``, ``live``, ``stopped``."""
        if self.liveness == "stale":
            return f"stale for {self.heartbeat_age_seconds:.0f} s"
        return self.liveness


@dataclass
class ControllerState(_Flat):
    """Whether a controller serves the run's runtime dir (``status._controller_state``):
    ``running`` (``pid``), ``stopped`` (the newest controller stopped cleanly: its row's
    ``stopped_at`` is set, and nothing runs in its place), ``gone`` (it died: on SQLite no
    live process holds its pidfile, on a shared ledger its heartbeat is lost) or
    ``unknown`` (a shared ledger, whose controller may run on another machine); ``words``
    says which and how it is known."""

    state: str
    pid: int | None
    words: str


@dataclass
class NodeSummary(_Flat):
    """A node of the run: live workers, newest heartbeat, free memory, in-flight attempts."""

    node: str
    live_workers: int
    last_heartbeat_at: str | None
    heartbeat_age_seconds: float | None
    mem_available_mib: float | None
    mem_total_mib: float | None
    memory_floor_mib: int | None
    running: int
    max_jobs: int | None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    """Per device, as its worker last reported: index, uuid, total_mib, used_mib, ours_mib,
    baseline_mib, and ``described`` (the file) when described rather than measured."""
    gpu_note: str | None = None
    """Why no GPU figures: NVML missing, no driver, no device.

    ``gpus`` and ``gpu_note`` are in ``as_dict`` only when set."""

    def as_dict(self) -> dict[str, Any]:
        body = dict(self.__dict__)
        if not body["gpus"]:
            del body["gpus"]
        if body["gpu_note"] is None:
            del body["gpu_note"]
        return body


@dataclass
class NoWorker(_Flat):
    """A node of an unfinished run that no live worker serves, and how to start one."""

    node: str
    start: str


@dataclass
class Reason:
    """Why a lane holds jobs it could start: ``code`` (admission's reason codes, or
    ``halted``/``paused``/``stopped``/``unknown_outcome``/``no_worker``: a ``RefusalCode``;
    a code this version does not know, recorded by an older one, stays text) in ``words``.

    ``recorded``: a refusal admission recorded, which names its ``node`` (in ``as_dict``
    only then)."""

    code: RefusalCode | str
    stage: str | None
    since: str | None
    detail: dict[str, Any]
    words: str
    node: str | None = None
    recorded: bool = False

    def as_dict(self) -> dict[str, Any]:
        if self.recorded:
            return {
                "code": self.code,
                "stage": self.stage,
                "node": self.node,
                "since": self.since,
                "detail": self.detail,
                "words": self.words,
            }
        return {
            "code": self.code,
            "stage": self.stage,
            "since": self.since,
            "detail": self.detail,
            "words": self.words,
        }


@dataclass
class Advice:
    """The lane's next step as one line (``advice.action_words`` of its ``next_step``),
    set by the dashboard (``/api/state``'s ``action``)."""

    words: str | None


@dataclass
class NextStep(_Flat):
    """What an operator does about a lane (``advice.next_step``): ``code`` (the holding
    reason: ``budget``, ``sources_changed``, ``halted``, ``breaker``, ``paused``,
    ``stopped``, ``unknown_outcome``, ``no_worker``, a capacity code, ``running``,
    ``done``, ...: a ``StepCode``, or the ``RefusalCode`` that holds the lane), the
    step in ``words`` and at most one ``command`` (None: nothing to type; it clears by
    itself, or the lane is done)."""

    code: StepCode | RefusalCode | str
    words: str
    command: str | None

    def line(self) -> str:
        """The step as one line: its words, then its command."""
        return self.words if self.command is None else f"{self.words}: {self.command}"


@dataclass
class Lane:
    """A lane: its jobs by state, when it last started one, and why it idles."""

    lane: str
    node: str
    running: int
    ready: int
    waiting: int
    done: int
    last_start: str | None
    idle_since: str | None
    idle_seconds: float | None
    reason: Reason | None
    action: Advice | None = None
    """In ``as_dict`` (as ``action``) only when set."""
    next_step: NextStep | None = None
    """Set by ``status_report`` (every lane: a running one's says so); in ``as_dict``
    (as ``next_step``) only when set."""

    @property
    def pending(self) -> bool:
        """It has jobs to start (ready or waiting)."""
        return bool(self.ready or self.waiting)

    def as_dict(self) -> dict[str, Any]:
        body = {
            "lane": self.lane,
            "node": self.node,
            "running": self.running,
            "ready": self.ready,
            "waiting": self.waiting,
            "done": self.done,
            "last_start": self.last_start,
            "idle_since": self.idle_since,
            "idle_seconds": self.idle_seconds,
            "reason": None if self.reason is None else self.reason.as_dict(),
        }
        if self.action is not None:
            body["action"] = self.action.words
        if self.next_step is not None:
            body["next_step"] = self.next_step.as_dict()
        return body


@dataclass
class Placement(_Flat):
    """Where a stage runs: ``nodes`` as configured (None: its lane's node), ``runs_on``,
    ``words``, and ``no_live_worker``: those of ``runs_on`` no live worker serves."""

    stage: str
    nodes: list[str] | None
    runs_on: list[str]
    words: str
    no_live_worker: list[str]


@dataclass
class Throughput(_Flat):
    settled_attempts: int
    per_hour: float


@dataclass
class CloseoutStep(_Flat):
    name: str
    state: StepState | None
    exit_code: int | None


@dataclass
class Closeout:
    """The run's closeout: ``state`` ``none``, ``pending``, ``running`` (``step`` k of
    ``step_count``, named ``current``), ``finished`` or ``failed`` (``failed_steps``)."""

    state: str
    step: int | None
    step_count: int
    current: str | None
    failed_steps: list[str]
    steps: list[CloseoutStep]

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "step": self.step,
            "step_count": self.step_count,
            "current": self.current,
            "failed_steps": self.failed_steps,
            "steps": [step.as_dict() for step in self.steps],
        }


@dataclass
class Event(_Flat):
    """One of the run's recent events."""

    id: int
    at: str | None
    kind: str
    job_id: int | None
    attempt_id: int | None
    actor: str
    detail: dict[str, Any]


def _with_liveness(worker: dict[str, Any]) -> dict[str, Any]:
    """A worker read back from JSON written before ``liveness`` was: live when it said
    ``live``, else what its row says (``lost`` for an active one whose heartbeat aged)."""
    if "liveness" in worker:
        return worker
    state = worker.get("state")
    guessed = "live" if worker.get("live") else ("stopped" if state == "stopped" else "lost")
    return {**worker, "liveness": guessed}


def _typed(entry: dict[str, Any], **enums: type[StrEnum]) -> dict[str, Any]:
    """An entry read back from JSON with the fields named in ``enums`` as their members."""
    return {
        **entry,
        **{key: _member(enum, entry[key]) for key, enum in enums.items() if key in entry},
    }


def _reason(entry: dict[str, Any]) -> Reason:
    code = entry["code"]
    typed = refusal_code(code) if isinstance(code, str) else code
    return Reason(**{**entry, "code": typed}, recorded="node" in entry)


def _next_step(entry: dict[str, Any]) -> NextStep:
    code = entry["code"]
    return NextStep(**{**entry, "code": step_code(code) if isinstance(code, str) else code})


@dataclass
class StatusReport:
    """Everything ``laneway status`` shows for one run."""

    run: RunInfo
    generated_at: str | None
    controls: list[Control]
    unknown: list[UnknownAttempt]
    jobs: dict[str, dict[str, int]]
    """Per stage (the config's order), jobs per state."""
    totals: dict[str, int]
    """Jobs per state, over every stage."""
    reused: dict[str, int]
    """Per stage, jobs that took over an earlier run's result."""
    retry_backoff: list[BackingOff]
    outcomes: dict[str, dict[str, int]]
    """Per stage, settled attempts per outcome class."""
    running: list[RunningAttempt]
    workers: list[Worker]
    nodes: list[NodeSummary]
    no_worker: list[NoWorker]
    lanes: list[Lane]
    placement: list[Placement]
    throughput: Throughput
    closeout: Closeout
    recent_events: list[Event] = field(default_factory=list)
    controller: ControllerState | None = None
    """In ``as_dict`` (as ``controller``) only when set (``status_report`` sets it)."""
    next_step: NextStep | None = None
    """The run's one next step (``advice.run_next_step``), set by ``status_report``: what
    every view leads with; None when nothing needs a person. In ``as_dict`` (as
    ``next_step``, null when none) always."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON form, as ``laneway status --json`` prints it."""
        body: dict[str, Any] = {
            "run": self.run.as_dict(),
            "generated_at": self.generated_at,
            "controls": [c.as_dict() for c in self.controls],
            "unknown": [u.as_dict() for u in self.unknown],
            "jobs": self.jobs,
            "totals": self.totals,
            "reused": self.reused,
            "retry_backoff": [b.as_dict() for b in self.retry_backoff],
            "outcomes": self.outcomes,
            "running": [r.as_dict() for r in self.running],
            "workers": [w.as_dict() for w in self.workers],
            "nodes": [n.as_dict() for n in self.nodes],
            "no_worker": [n.as_dict() for n in self.no_worker],
            "lanes": [lane.as_dict() for lane in self.lanes],
            "placement": [p.as_dict() for p in self.placement],
            "throughput": self.throughput.as_dict(),
            "closeout": self.closeout.as_dict(),
            "recent_events": [e.as_dict() for e in self.recent_events],
        }
        if self.controller is not None:
            body["controller"] = self.controller.as_dict()
        body["next_step"] = None if self.next_step is None else self.next_step.as_dict()
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> StatusReport:
        """The report ``as_dict`` gave (a ``status.json`` read back): its inverse."""

        def unknown(u: dict[str, Any]) -> UnknownAttempt:
            on_disk = None
            if "files" in u:
                on_disk = OnDisk(u["files"], u["supervisor_pid"], u["child_pid"])
            optional = ("conclusive", "on_disk", "evidence_on")
            base = {k: u[k] for k in _names(UnknownAttempt) if k not in optional}
            return UnknownAttempt(
                **base,
                conclusive=u.get("conclusive"),
                on_disk=on_disk,
                evidence_on=u.get("evidence_on"),
            )

        def lane(entry: dict[str, Any]) -> Lane:
            optional = ("reason", "action", "next_step")
            base = {k: entry[k] for k in _names(Lane) if k not in optional}
            reason, step = entry["reason"], entry.get("next_step")
            return Lane(
                **base,
                reason=None if reason is None else _reason(reason),
                action=Advice(entry["action"]) if "action" in entry else None,
                next_step=None if step is None else _next_step(step),
            )

        closeout = dict(body["closeout"])
        closeout["steps"] = [
            CloseoutStep(**_typed(step, state=StepState)) for step in closeout["steps"]
        ]
        return cls(
            run=RunInfo(**_typed(body["run"], state=RunState)),
            generated_at=body["generated_at"],
            controls=[
                Control(**_typed(c, kind=ControlKind, scope=ControlScope)) for c in body["controls"]
            ],
            unknown=[unknown(u) for u in body["unknown"]],
            jobs=body["jobs"],
            totals=body["totals"],
            reused=body["reused"],
            retry_backoff=[BackingOff(**b) for b in body["retry_backoff"]],
            outcomes=body["outcomes"],
            running=[RunningAttempt(**_typed(r, state=AttemptState)) for r in body["running"]],
            workers=[
                Worker(**_typed(_with_liveness(w), state=WorkerState)) for w in body["workers"]
            ],
            nodes=[NodeSummary(**n) for n in body["nodes"]],
            no_worker=[NoWorker(**n) for n in body["no_worker"]],
            lanes=[lane(entry) for entry in body["lanes"]],
            placement=[Placement(**p) for p in body["placement"]],
            throughput=Throughput(**body["throughput"]),
            closeout=Closeout(**closeout),
            recent_events=[Event(**e) for e in body["recent_events"]],
            controller=ControllerState(**body["controller"]) if "controller" in body else None,
            next_step=_next_step(body["next_step"]) if body.get("next_step") else None,
        )

    def summary(self) -> dict[str, Any]:
        """``SUMMARY.json``: the run, its totals, jobs, outcomes, throughput, unknown
        attempts and controls."""
        body = self.as_dict()
        keys = ("run", "totals", "jobs", "outcomes", "throughput", "unknown", "controls")
        return {key: body[key] for key in keys}
