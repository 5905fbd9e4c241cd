"""The operator's actions: the controls (``pause``, ``stop``, ``resume``, ``halt``,
``clear_halt``), ``retry`` and ``cancel``, each one function that checks the rules and
makes its recorded change (who, when, why) in one write transaction, retried while
the ledger is briefly away (``db.retrying``). ``laneway pause|stop|resume|halt|
clear-halt|retry|cancel`` parse their arguments, call one of these and render what it
returns; nothing here prints. ``reconcile`` is ``controller/reconcile.py``'s.

Refusals are ``LanewayError``\\ s with the one line the CLI prints: a finished run's
pause (``ledger.check_pausable``), a lane the run does not have, an empty reason, a
retry whose run's frozen sources changed (``retry_sources.SourcesChanged``), or whose
producers must re-run and were not confirmed (``RetryDeclined``). A refused action has
written nothing.

``cancel`` signals the attempt's supervisor on this machine through the ``Supervisors``
its caller passes (``workers/stopping.py``), so nothing here imports ``workers/``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from laneway.controller import db, ledger, retry_plan, retry_sources
from laneway.controller.clock import SystemClock
from laneway.controller.errors import LanewayError, UsageError
from laneway.controller.retry_plan import Rerun
from laneway.controller.states import ControlKind, ControlScope, Outcome

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from laneway.controller.models import Attempt


@dataclass(frozen=True)
class Operator:
    """Who acts on which ledger: every action records ``actor`` (``user@host``) with its
    reason and the time ``now`` reads, and retries a ledger that is unreachable or
    locked for up to ``patience`` seconds before it gives up (``LedgerUnavailable``)."""

    engine: Engine
    actor: str
    now: Callable[[], datetime] = field(default=SystemClock().now)
    patience: float = 30.0


def given_reason(reason: str) -> str:
    """``reason``, stripped; refused when it says nothing (it is recorded)."""
    if not reason.strip():
        raise UsageError("--reason must say why (it is recorded in the ledger)")
    return reason.strip()


# -- controls -------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlSet:
    """A control set: its id, kind and scope (global, run or lane)."""

    control_id: int
    kind: ControlKind
    scope: ControlScope

    def as_dict(self) -> dict[str, Any]:
        return {"control_id": self.control_id, "kind": self.kind.value, "scope": self.scope.value}


@dataclass(frozen=True)
class ControlsCleared:
    """Controls lifted: how many, of which kinds."""

    cleared: int
    kinds: tuple[ControlKind, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"cleared": self.cleared, "kinds": [kind.value for kind in self.kinds]}


def pause(op: Operator, run: int | None, *, reason: str, lane: str | None = None) -> ControlSet:
    """Pause dispatch (resumable) of ``run``, of one ``lane`` of it, or of every run
    (``run`` None). Refused, nothing written, for an unknown run or lane and for a
    finished run (``ledger.check_pausable``: nothing of it is dispatched any more)."""
    return _set(op, ControlKind.PAUSE, run, reason, lane=lane)


def stop(op: Operator, run: int | None, *, reason: str) -> ControlSet:
    """Drain ``run`` (every run when None): no new dispatch, running attempts finish."""
    return _set(op, ControlKind.STOP, run, reason)


def halt(op: Operator, run: int | None, *, reason: str) -> ControlSet:
    """Halt dispatch (fatal) of ``run`` (every run when None) until ``clear_halt``."""
    return _set(op, ControlKind.HALT, run, reason)


def resume(op: Operator, run: int | None, *, reason: str) -> ControlsCleared:
    """Lift the pauses and stops of ``run`` (the global ones when None); halts stay."""
    return _clear(op, (ControlKind.PAUSE, ControlKind.STOP), run, reason)


def clear_halt(op: Operator, run: int | None, *, reason: str) -> ControlsCleared:
    """Lift the halts of ``run`` (the global ones when None), with a recorded reason."""
    return _clear(op, (ControlKind.HALT,), run, reason)


def _set(
    op: Operator, kind: ControlKind, run: int | None, reason: str, *, lane: str | None = None
) -> ControlSet:
    if lane is not None and run is None:
        raise UsageError("--lane needs a RUN")
    scope = ControlScope.GLOBAL if run is None else ControlScope.LANE if lane else ControlScope.RUN
    now = op.now()
    for trying in db.retrying(patience=op.patience):
        with trying, db.transaction(db.session_factory(op.engine)) as session:
            if run is not None:
                _check_run(session, run, lane)
                if kind is ControlKind.PAUSE:
                    ledger.check_pausable(session, run, lane=lane)
            control_id = ledger.set_control(
                session,
                kind,
                scope=scope,
                run_id=run,
                lane=lane,
                reason=given_reason(reason),
                actor=op.actor,
                now=now,
            )
    return ControlSet(control_id, kind, scope)


def _clear(
    op: Operator, kinds: tuple[ControlKind, ...], run: int | None, reason: str
) -> ControlsCleared:
    now = op.now()
    for trying in db.retrying(patience=op.patience):
        with trying, db.transaction(db.session_factory(op.engine)) as session:
            if run is not None:
                _check_run(session, run, None)
            count = ledger.clear_controls(
                session, kinds, reason=given_reason(reason), actor=op.actor, now=now, run_id=run
            )
    return ControlsCleared(count, kinds)


def _check_run(session: Any, run: int, lane: str | None) -> None:
    """NotFound for an unknown run; UsageError for a ``lane`` its config does not name."""
    run_row = ledger.get_run(session, run)
    if lane is not None and lane not in {entry.name for entry in ledger.run_config(run_row).lanes}:
        raise UsageError(f"run {run} has no lane {lane!r}")


# -- retry ----------------------------------------------------------------------------


class RetryDeclined(LanewayError):
    """``retry`` not confirmed: producers had to re-run first and the operator said no.
    Nothing was changed. Exit 1."""

    def __init__(self) -> None:
        super().__init__("not retried: nothing was changed (--yes re-runs without asking)")


@dataclass(frozen=True)
class Retried:
    """What ``retry`` moved: the one job named (``job_id``) or the failed jobs of
    ``run_id`` retried in bulk (``retried``), how many jobs moved (skipped jobs of the
    same item wait again), and the producers re-run first (``reruns``)."""

    job_id: int | None
    run_id: int | None
    retried: list[int]
    moved: int
    reruns: list[Rerun]


Confirm = Callable[[Sequence[Rerun]], bool]
"""Asked once, before anything is written, when producers whose stored outputs are gone
must re-run first: True goes on, False refuses (``RetryDeclined``); it may raise a
``LanewayError`` of its own (a caller that cannot ask)."""


def retry(
    op: Operator,
    *,
    reason: str,
    job: int | None = None,
    run: int | None = None,
    stage: str | None = None,
    outcome: Outcome | None = None,
    confirm: Confirm,
) -> Retried:
    """Make failed jobs ready for a new attempt (new idempotency key), in one
    transaction: the one ``job`` named, or every failed job of ``run`` (only of
    ``stage``, only whose last attempt settled as ``outcome``). A producer whose stored
    output a retried job needs is gone re-runs first, deepest first, once ``confirm``
    says so. Refused before anything moves when the run's frozen sources changed
    (``retry_sources.SourcesChanged``: its next claim would halt it), for a stage the
    run does not have, and for a job that is not failed (with re-runs, a bulk retry's
    job no longer failed refuses the whole retry)."""
    why = given_reason(reason)
    if job is None and run is None:
        raise UsageError("name a JOB (id or ITEM.STAGE), or --run RUN for a bulk retry")
    if job is not None and (stage is not None or outcome is not None):
        raise UsageError("--stage and --outcome choose jobs for a bulk retry: omit JOB")
    named = [job] if job is not None else _failed_jobs(op.engine, run, stage, outcome)
    _refuse_changed_sources(op.engine, run if job is None else None, named)
    reruns = retry_plan.producers_to_rerun(op.engine, named)
    if reruns and not confirm(reruns):
        raise RetryDeclined()
    for trying in db.retrying(patience=op.patience):
        with trying, db.transaction(db.session_factory(op.engine)) as session:
            now = op.now()
            for rerun in reversed(reruns):  # the deepest producer first
                ledger.rerun_producer(
                    session, rerun.job_id, why=rerun.why, reason=why, actor=op.actor, now=now
                )
            if job is not None:
                moved = ledger.retry_job(session, job, reason=why, actor=op.actor, now=now)
                retried = [job]
            elif reruns:
                # The producers re-run for exactly the jobs looked at: one that is no
                # longer failed refuses the whole retry (nothing is half done).
                for named_id in named:
                    ledger.retry_job(session, named_id, reason=why, actor=op.actor, now=now)
                retried, moved = named, len(named)
            else:
                assert run is not None
                ledger.get_run(session, run)
                retried = ledger.retry_failed(
                    session, run, reason=why, actor=op.actor, now=now, stage=stage, outcome=outcome
                )
                moved = len(retried)
    return Retried(job, run if job is None else None, retried, moved, reruns)


def _failed_jobs(
    engine: Engine, run: int | None, stage: str | None, outcome: Outcome | None
) -> list[int]:
    """The failed jobs of ``run`` a bulk retry looks at; UsageError for a ``stage`` the
    run does not have, NotFound for an unknown run."""
    assert run is not None
    with db.one_read(engine) as session:
        run_row = ledger.get_run(session, run)
        if stage is not None and stage not in {s.name for s in ledger.run_config(run_row).stages}:
            raise UsageError(f"--stage: {stage!r} is not a stage of run {run}")
        return ledger.failed_jobs(session, run, stage=stage, outcome=outcome)


def _refuse_changed_sources(engine: Engine, run: int | None, named: list[int]) -> None:
    """``SourcesChanged`` for the first run (``run``, else the runs of the jobs
    ``named``) whose frozen sources changed on disk: the next claim would halt it."""
    for run_id in [run] if run is not None else retry_sources.runs_of(engine, named):
        stale = retry_sources.stale_sources(engine, run_id)
        if stale is not None:
            raise retry_sources.SourcesChanged(stale)


# -- cancel ---------------------------------------------------------------------------


class Supervisors(Protocol):
    """This machine's attempt supervisors (``workers/stopping.py``)."""

    def check_local_supervisor(self, attempt: Attempt) -> None:
        """Refuse unless ``attempt`` runs and its supervisor is that process here."""

    def terminate_supervisor(self, attempt: Attempt) -> int:
        """TERM to ``attempt``'s supervisor; the pid signalled."""


@dataclass(frozen=True)
class Cancelled:
    """What ``cancel`` did: pending jobs cancelled (``run`` only) and the supervisor pids
    sent TERM, in the order signalled."""

    jobs_cancelled: int = 0
    attempts_signalled: list[int] = field(default_factory=list)


def cancel(
    op: Operator,
    *,
    reason: str,
    here: Supervisors,
    attempt: int | None = None,
    run: int | None = None,
) -> Cancelled:
    """Cancel one running ``attempt``, or a whole ``run`` (exactly one of them).

    In one write transaction: find the targets (the attempt; or every running attempt
    of the run), check every one's supervisor is that very process on this machine
    before anything is recorded (``here.check_local_supervisor``: a refused cancel leaves
    the ledger as it was), then for a run set a ``stop`` control on it and cancel its
    waiting and ready jobs, and record ``cancel_requested`` for each target. Once
    committed, TERM to each target's supervisor (``here.terminate_supervisor``), which
    stops the job's group and reports; the worker settles the attempt ``cancelled``.

    Raises NotFound for an unknown attempt or run, UsageError for a target that is not
    running here (or for naming neither or both, or an empty reason), LedgerUnavailable
    when the ledger stays unreachable.
    """
    why = given_reason(reason)
    if (attempt is None) == (run is None):
        raise UsageError("name one attempt, or a run (not both)")
    now = op.now()
    for trying in db.retrying(patience=op.patience):
        with trying, db.transaction(db.session_factory(op.engine)) as session:
            if run is not None:
                ledger.get_run(session, run)
                targets = ledger.running_attempts(session, run)
            else:
                assert attempt is not None
                targets = [ledger.get_attempt(session, attempt)]
            # Check every supervisor's identity before recording anything: a refused
            # cancel leaves the ledger as it was.
            for target in targets:
                here.check_local_supervisor(target)
            pending = 0
            if run is not None:
                ledger.set_control(
                    session,
                    ControlKind.STOP,
                    scope=ControlScope.RUN,
                    run_id=run,
                    reason=why,
                    actor=op.actor,
                    now=now,
                )
                pending = ledger.cancel_pending(session, run, reason=why, actor=op.actor, now=now)
            for target in targets:
                ledger.request_cancel(session, target.id, reason=why, actor=op.actor, now=now)
    signalled = [here.terminate_supervisor(target) for target in targets]
    return Cancelled(jobs_cancelled=pending, attempts_signalled=signalled)
