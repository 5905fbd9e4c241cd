"""The operator's writes: `pause`, `stop`, `resume`, `halt`, `clear-halt`, `cancel`,
`reconcile`, `retry`.

Each parses its arguments, calls the one action of controller/operator.py that makes
its recorded change (who, when, why; retried while the ledger is briefly away) and
renders what it returns (`reconcile`: controller/reconcile.py and the ledger).
Registered in order by cli/main.py.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from laneway.cli import common, complete, render
from laneway.cli.common import (
    DEFAULT_RUNTIME,
    MAX_ID,
    RETRY_SECONDS,
    DatabaseUrl,
    JsonFlag,
    RuntimeDir,
)
from laneway.controller.errors import UsageError

if TYPE_CHECKING:
    from laneway.controller.operator import Operator
    from laneway.controller.retry_plan import Rerun

RunArg = Annotated[
    int | None,
    typer.Argument(
        help="Run id (omit with --all).",
        min=1,
        max=MAX_ID,
        show_default=False,
        autocompletion=complete.runs,
    ),
]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why (recorded with who and when).")]
AllOpt = Annotated[bool, typer.Option("--all", help="Every run (a global control).")]
LaneOpt = Annotated[str | None, typer.Option("--lane", help="Only this lane of the run.")]


def _control(
    action: str,
    run: int | None,
    everything: bool,
    reason: str,
    runtime_dir: Path,
    as_json: bool,
    *,
    lane: str | None = None,
) -> None:
    """A control command: its arguments checked, ``controller.operator``'s ``action``
    (``pause``, ``stop``, ``halt``; ``resume``, ``clear_halt`` lift) called, the control
    set or the count cleared rendered."""
    from laneway.controller import operator

    with common.refusals(as_json):
        if (run is None) == (not everything):
            raise UsageError("name a RUN, or pass --all for every run (not both)")
        if lane is not None and run is None:
            raise UsageError("--lane needs a RUN")
        op = _operator(runtime_dir)
        act = getattr(operator, action)
        done = act(op, run, reason=reason, lane=lane) if lane else act(op, run, reason=reason)
    body = {"ok": True, **done.as_dict()}
    target = "every run" if run is None else f"run {run}" + (f" lane {lane}" if lane else "")
    if isinstance(done, operator.ControlsCleared):
        common.emit(body, as_json, lambda b: f"cleared {b['cleared']} control(s) on {target}")
    else:
        common.emit(
            body, as_json, lambda b: f"{b['kind']} set on {target} (control {b['control_id']})"
        )


def _operator(runtime_dir: Path) -> Operator:
    """The operator acting from here (``user@host``) on the runtime dir's ledger."""
    from laneway.controller.operator import Operator

    return Operator(common.writer(runtime_dir), common.actor(), patience=RETRY_SECONDS)


def pause(
    reason: ReasonOpt,
    run: RunArg = None,
    lane: LaneOpt = None,
    everything: AllOpt = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Pause dispatch (resumable): running attempts go on; nothing new starts.

    A pause of a finished run (or of one of its lanes) is refused, nothing written:
    nothing of it is dispatched any more (`retry` reopens a job of it).
    """
    _control("pause", run, everything, reason, runtime_dir, as_json, lane=lane)


def _control_command(action: str, doc: str) -> Callable[..., None]:
    """A control command on a run or on every run (``pause`` alone also takes --lane)."""

    def command(
        reason: ReasonOpt,
        run: RunArg = None,
        everything: AllOpt = False,
        runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
        database_url: DatabaseUrl = None,
        as_json: JsonFlag = False,
    ) -> None:
        _control(action, run, everything, reason, runtime_dir, as_json)

    command.__doc__ = doc
    return command


stop = _control_command(
    "stop", "Drain: no new dispatch; running attempts finish and settle. `resume` lifts it."
)
resume = _control_command("resume", "Lift pauses and stops (not halts: those need `clear-halt`).")
halt = _control_command("halt", "Halt dispatch (fatal): only `clear-halt` with a reason lifts it.")
clear_halt = _control_command("clear_halt", "Lift halts, with a recorded reason.")


def cancel(
    reason: ReasonOpt,
    attempt: Annotated[
        int | None,
        typer.Argument(
            help="A running attempt's id.",
            min=1,
            max=MAX_ID,
            show_default=False,
            autocompletion=complete.attempts,
        ),
    ] = None,
    run: Annotated[
        int | None, typer.Option("--run", help="Cancel a whole run instead.", min=1, max=MAX_ID)
    ] = None,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Cancel a running attempt, or a whole run (--run): TERM, grace, KILL, verified.

    The attempt's supervisor gets TERM; it forwards it to the job's process group, waits
    the stage's grace budget, KILLs the group, verifies no process of it is left, and
    reports; the worker settles the attempt as cancelled. --run also stops the run's
    dispatch and cancels its waiting and ready jobs. Run it on the attempt's machine.
    """
    from laneway.controller import operator
    from laneway.workers import stopping

    with common.refusals(as_json):
        if (attempt is None) == (run is None):
            raise UsageError("name one ATTEMPT, or pass --run RUN (not both)")
        op = _operator(runtime_dir)
        done = operator.cancel(op, attempt=attempt, run=run, reason=reason, here=stopping)
    signalled = done.attempts_signalled
    body = {"ok": True, "jobs_cancelled": done.jobs_cancelled, "attempts_signalled": signalled}
    common.emit(
        body,
        as_json,
        lambda b: (
            f"{b['jobs_cancelled']} pending job(s) cancelled; TERM sent to "
            f"{len(signalled)} supervisor(s): {', '.join(str(p) for p in signalled) or 'none'}"
        ),
    )


class ReconcileAs(StrEnum):
    succeeded = "succeeded"
    failed = "failed"
    not_run = "not-run"


def reconcile(
    attempt: Annotated[
        int | None,
        typer.Argument(
            help="The unknown attempt's id (see `status`); omit with --run --from-evidence.",
            min=1,
            max=MAX_ID,
            autocompletion=complete.unknown_attempts,
            show_default=False,
        ),
    ] = None,
    as_: Annotated[
        ReconcileAs | None,
        typer.Option("--as", help="What really happened to the attempt.", show_default=False),
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Why you know (recorded).")] = "",
    result: Annotated[
        Path | None, typer.Option("--result", help="A result JSON file to record with it.")
    ] = None,
    run: Annotated[
        int | None,
        typer.Option("--run", min=1, max=MAX_ID, help="With --from-evidence: the run."),
    ] = None,
    from_evidence: Annotated[
        bool,
        typer.Option(
            "--from-evidence",
            help="Settle every unknown attempt of --run whose evidence has become "
            "conclusive (a verified exit record, supervisor and child gone) as it says.",
        ),
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", help="With --from-evidence: do not ask for confirmation.")
    ] = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Settle an unknown attempt as succeeded, failed or not-run, with a reason.

    Recorded with who and when. not-run makes the job ready for a new attempt (a new
    idempotency key). When a run has no unknown attempt left, its dispatch resumes;
    halts set by operators stay.

    `reconcile --run RUN --from-evidence` shows, for each unknown attempt of the run,
    what its evidence says, and settles those whose evidence is conclusive into the
    outcome their exit record establishes, after one confirmation (--yes for scripts).
    """
    from laneway.controller.reconcile import read_result_file, reconcile_by_hand

    if from_evidence:
        _reconcile_from_evidence(run, attempt, as_, result, reason, yes, runtime_dir, as_json)
        return
    with common.refusals(as_json):
        if attempt is None or as_ is None:
            raise UsageError(
                "name the unknown ATTEMPT with --as and --reason, or use --run RUN --from-evidence"
            )
        if run is not None or yes:
            raise UsageError("--run and --yes go with --from-evidence")
        recorded = read_result_file(result) if result else None
        job_state = reconcile_by_hand(
            common.writer(runtime_dir),
            attempt,
            as_=as_.value,
            reason=reason,
            result=recorded,
            actor=common.actor(),
            patience=RETRY_SECONDS,
        )
    body = {"ok": True, "attempt_id": attempt, "as": as_.value, "job_state": job_state.value}
    common.emit(
        body,
        as_json,
        lambda b: f"attempt {attempt} reconciled as {b['as']}; job is now {b['job_state']}",
    )


def _reconcile_from_evidence(
    run: int | None,
    attempt: int | None,
    as_: Any,
    result: Path | None,
    reason: str,
    yes: bool,
    runtime_dir: Path,
    as_json: bool,
) -> None:
    """``reconcile --run RUN --from-evidence``: judge, show, confirm once, settle
    (``controller.reconcile``)."""
    from laneway.controller import reconcile

    with common.refusals(as_json):
        if run is None:
            raise UsageError("--from-evidence needs --run RUN")
        if attempt is not None or as_ is not None or result is not None:
            raise UsageError(
                "--from-evidence settles as the evidence says: no ATTEMPT, --as or --result"
            )
        engine = common.writer(runtime_dir)
        review = reconcile.review_evidence(engine, run)
    conclusive = review.conclusive
    if not as_json:
        for found in review.judged:
            verdict = f"settle as {found.outcome}" if found.conclusive else "left unknown"
            typer.echo(f"attempt {found.attempt_id}: {verdict} — {render.clean(found.words)}")
    if conclusive and not yes:
        if as_json:
            common.fail(
                UsageError("--from-evidence with --json asks no question: pass --yes"), True
            )
        if not typer.confirm(f"settle {len(conclusive)} attempt(s) as their evidence says?"):
            raise typer.Exit(1)
    with common.refusals(as_json):
        settled = reconcile.settle_from_evidence(
            engine, review, actor=common.actor(), reason=reason, patience=RETRY_SECONDS
        )
    body = {
        "ok": True,
        "run_id": run,
        "settled": [done.as_dict() for done in settled],
        "left_unknown": [e.as_dict() for e in review.left_unknown],
    }
    common.emit(
        body,
        as_json,
        lambda b: (
            f"{len(settled)} attempt(s) settled from evidence; "
            f"{len(b['left_unknown'])} left unknown"
        ),
    )


class RetryOutcome(StrEnum):
    failed = "failed"
    infra_failure = "infra_failure"
    timed_out = "timed_out"


def retry(
    job: Annotated[
        str | None,
        typer.Argument(
            help="The failed job: its id, or ITEM.STAGE (in --run, default the newest run); "
            "omit with --run to retry every failed job of the run that matches.",
            autocompletion=complete.jobs,
            show_default=False,
        ),
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Why it is safe to run again.")] = "",
    run: Annotated[
        int | None,
        typer.Option("--run", min=1, max=MAX_ID, help="The run (bulk: every failed job of it)."),
    ] = None,
    stage: Annotated[
        str | None, typer.Option("--stage", help="Bulk: only this stage's failed jobs.")
    ] = None,
    outcome: Annotated[
        RetryOutcome | None,
        typer.Option("--outcome", help="Bulk: only jobs whose last attempt settled so."),
    ] = None,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes", help="Re-run producers whose stored outputs are gone without asking."
        ),
    ] = False,
    runtime_dir: RuntimeDir = DEFAULT_RUNTIME,
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Make failed jobs ready for a new attempt (new idempotency key), with a reason.

    One job (`retry JOB` or `retry ITEM.STAGE`), or every failed job of a run that
    matches (`retry --run RUN [--stage S] [--outcome failed|infra_failure|timed_out]`),
    in one transaction. Jobs of the same item skipped because of them wait again; a
    finished run reopens. When an input a retried job needs has left the store, the job
    that produced it runs again too, after one confirmation (`--yes` for scripts).
    Refused (exit 1, nothing moved) when the run's frozen sources changed since it
    started (the next claim would halt it): it names the files and the new run to
    start instead (`laneway run CONFIG --new`), with how many succeeded jobs that run
    reuses.
    """
    from laneway.controller import operator
    from laneway.controller.states import Outcome

    with common.refusals(as_json), _sources_refused(as_json):
        why = common.reason_given(reason)
        if job is not None and (stage is not None or outcome is not None):
            raise UsageError("--stage and --outcome choose jobs for a bulk retry: omit JOB")
        if job is None and run is None:
            raise UsageError("name a JOB (id or ITEM.STAGE), or --run RUN for a bulk retry")
        op = _operator(runtime_dir)
        done = operator.retry(
            op,
            reason=why,
            job=None if job is None else common.job_id(op.engine, job, run),
            run=run,
            stage=stage,
            outcome=None if outcome is None else Outcome(outcome.value),
            confirm=(lambda _reruns: True) if yes else functools.partial(_confirm, as_json),
        )
    rerun_ids = [rerun.job_id for rerun in done.reruns]
    also = f"; re-run first: job(s) {', '.join(map(str, rerun_ids))}" if rerun_ids else ""
    listed = [rerun.as_dict() for rerun in done.reruns]
    if done.job_id is not None:
        common.emit(
            {"ok": True, "job_id": done.job_id, "jobs_moved": done.moved, "rerun": listed},
            as_json,
            lambda b: (
                f"job {done.job_id} is ready for a new attempt ({done.moved} job(s) moved){also}"
            ),
        )
        return
    retried = done.retried
    common.emit(
        {"ok": True, "run_id": run, "retried": retried, "rerun": listed},
        as_json,
        lambda b: (
            f"{len(retried)} failed job(s) of run {run} are ready for a new attempt"
            + (f": {', '.join(map(str, retried))}" if retried else " (none matched)")
            + also
        ),
    )


@contextmanager
def _sources_refused(as_json: bool) -> Iterator[None]:
    """``retry`` refused over changed frozen sources: with --json one object that adds
    the files, the new run's command and its reuse count to the refusal's lines
    (``retry_sources.StaleSources.as_dict``); in words, the lines alone."""
    from laneway.controller.retry_sources import SourcesChanged

    try:
        yield
    except SourcesChanged as error:
        if not as_json:
            raise
        body = {"ok": False, "error": type(error).__name__, "problems": error.reasons}
        typer.echo(render.as_json({**body, **error.stale.as_dict()}))
        raise typer.Exit(error.exit_code) from None


def _confirm(as_json: bool, reruns: Sequence[Rerun]) -> bool:
    """Name each producer that must run again and why, and ask once; without a terminal
    (or with --json) refuse, naming ``--yes``: re-running succeeded work needs the
    operator's word."""
    lines = [
        f"job {r.job_id} ({r.label}) succeeded, but {r.why}"
        + ("; it reported usage, so running it again may cost money" if r.paid else "")
        for r in reruns
    ]
    if as_json or not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise UsageError(
            f"{len(reruns)} producer(s) must run again first ({lines[0]}"
            + (f"; and {len(reruns) - 1} more" if len(reruns) > 1 else "")
            + "): pass --yes to re-run them with this retry"
        )
    for line in lines:
        typer.echo(render.clean(line), err=True)
    return typer.confirm(f"re-run {len(reruns)} producer(s) first, then retry?", err=True)
