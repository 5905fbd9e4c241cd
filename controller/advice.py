"""What an operator needs to do about a run and each of its lanes, from a
``status_report`` (read-only): the ONE order of concerns every view weighs.

``run_concern(status)`` is what the run itself needs, first: unknown outcomes (the
reconcile command of the first; ``reconcile --run N --from-evidence`` on the node's host
when a restarted worker noted conclusive evidence there), frozen sources that changed
(the halt of ``controller/ledger/claim.py::_halt_on_source_drift``: a new run, naming
the files; ``clear-halt`` cannot lift it), a halt (``clear-halt``), a budget that leaves
nothing more to start (a pause whose reason begins with ``usage.BUDGET_SPENT``: raise
``budget`` and start a new run, ``laneway run <config> --new``, which reuses every job
that succeeded; never ``resume``, which would pause it again), the infrastructure
breaker's pause, a pause, a stop (``resume``). Only run-wide controls count here.

``next_step(lane, status)`` is each lane's step; ``status_report`` sets it on every lane:

- a running lane: nothing to do, unless every attempt it has in flight is unverified
  (its worker stale or lost): the command that starts a worker of its node;
- a lane with nothing left to start: done (no command), unless its run is halted or has
  an unknown outcome (``HALTING``), which it then shows;
- a lane with work: the run's concern if there is one; else its own hold (a lane's
  pause, admission's ``budget`` refusal, a secret the worker lacks), no live worker (the
  command that starts one), or a capacity refusal (a cap, full slots, earlier stages
  pending: nothing to do, it clears by itself);
- no controller (``StatusReport.controller`` gone or stopped) while the run has work it
  could do and no concern: ``no_controller``, the command that continues the run in the
  foreground (``laneway run --continue N``; its words name ``laneway controller`` too);
  never in place of what a person must lift first (``OPERATOR_FIRST``), never on a done
  lane.

``run_next_step(status)`` is the run's one step (``StatusReport.next_step``), which
``laneway status`` (text and ``--json``), ``status --watch``, the live display and exit
message of ``laneway run``, ``explain``, the web page's banner, the report, the metrics
and every notification lead with: the run's concern; else a lane's own hold; else a
missing controller; else the first lane step with a command (``RUN_ORDER``); None when
nobody is needed. Each step names at most ONE command.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from laneway.controller.codes import CONTROL_CODES, CONTROL_KINDS, RefusalCode, StepCode
from laneway.controller.states import ControlKind, ControlScope
from laneway.controller.status_model import NextStep
from laneway.controller.usage import BUDGET_SPENT

if TYPE_CHECKING:
    from laneway.controller.status_model import Lane, StatusReport

SOURCES_CHANGED = "frozen sources changed: "
"""How the reason of the halt over changed sources begins
(``controller/ledger/claim.py::_halt_on_source_drift``)."""
BREAKER = "infrastructure failures of "
"""How the reason of the infrastructure breaker's pause begins
(``controller/ledger/settle.py::_trip_infra_breaker``)."""

DONE = StepCode.DONE
RUNNING = StepCode.RUNNING
NO_CONTROLLER = StepCode.NO_CONTROLLER
NEW_RUN_CODES = frozenset({RefusalCode.BUDGET, StepCode.SOURCES_CHANGED})
"""Steps whose way on is a new run, not continuing this one."""

WAITS: dict[str, str] = {
    RefusalCode.MAX_JOBS: "nothing to do: the node runs its max_jobs; the next settle frees a slot",
    RefusalCode.SLOTS_FULL: "nothing to do: every worker slot is busy; the next settle frees one",
    RefusalCode.LANE_CAP: (
        "nothing to do: the lane's cap for the stage is reached; it frees as they settle"
    ),
    RefusalCode.STAGE_CAP: "nothing to do: the stage's cap is reached; it frees as they settle",
    RefusalCode.NEEDS_PENDING: "nothing to do: earlier stages of its items are still pending",
    RefusalCode.BATCH_CAP: "nothing to do: the run's batch cap is reached",
    RefusalCode.RATE_LIMIT: (
        "nothing to do: the stage's rate limit is reached; its window frees by itself "
        "(`laneway explain JOB` shows the arithmetic and when)"
    ),
    RefusalCode.GPU_CAPACITY: (
        "nothing to do until a GPU attempt settles (a second one shares the node only "
        "when measured peaks say it fits)"
    ),
}
"""The words of a capacity wait, by its refusal code: it clears by itself."""

OPERATOR_FIRST = frozenset(
    {
        RefusalCode.UNKNOWN_OUTCOME,
        RefusalCode.HALTED,
        RefusalCode.PAUSED,
        RefusalCode.STOPPED,
        StepCode.BREAKER,
        RefusalCode.BUDGET,
        StepCode.SOURCES_CHANGED,
        RefusalCode.SECRET_MISSING,
    }
)
"""Steps a person takes first even when the controller is gone: continuing the run
would only be held by them again."""

RUN_ORDER: tuple[str, ...] = (
    RefusalCode.UNKNOWN_OUTCOME,
    StepCode.SOURCES_CHANGED,
    RefusalCode.BUDGET,
    RefusalCode.HALTED,
    StepCode.BREAKER,
    RefusalCode.PAUSED,
    RefusalCode.STOPPED,
    RefusalCode.SECRET_MISSING,
    StepCode.NO_CONTROLLER,
    RefusalCode.NO_WORKER,
)
"""Which lane's step is the run's (``run_next_step``): what must happen first. What a
person must lift (``OPERATOR_FIRST``) comes before ``no_controller``: a run held by its
budget whose other lanes are done says raise the budget, not continue."""


def _where(runtime_dir: str | None) -> str:
    return "" if runtime_dir is None else f" --runtime-dir {shlex.quote(runtime_dir)}"


def new_run_command(runtime_dir: str | None, config_path: str | None = None) -> str:
    """The command that starts a new run of the config (reusing what succeeded): of the
    file the run was started from when it recorded one, else ``CONFIG``."""
    config = "CONFIG" if config_path is None else shlex.quote(config_path)
    return f"laneway run {config} --new{_where(runtime_dir)}"


def continue_command(run_id: int, runtime_dir: str) -> str:
    """The command that continues run ``run_id`` in the foreground (the same words as
    ``controller/pipeline.py::continue_command``, which sits a floor above)."""
    return f"laneway run --continue {run_id}{_where(runtime_dir)}"


HALTING = frozenset({RefusalCode.UNKNOWN_OUTCOME, RefusalCode.HALTED, StepCode.SOURCES_CHANGED})
"""Run concerns that hold even a lane with nothing left to start: its run dispatches
nothing and cannot finish until they are lifted."""


def run_concern(status: StatusReport) -> NextStep | None:
    """What the run itself needs before anything else, or None: the ONE order every view
    weighs first (the module docstring says the whole order): an unknown outcome (the first
    unknown attempt's reconcile command), a halt over changed sources (a new run), a
    halt, the budget (raise it, then a new run), the infrastructure breaker's pause, a
    pause, a stop. Only the run-wide controls count (``scope`` run or global); a lane's
    own control holds only that lane (``next_step``). A finished run needs nothing."""
    if status.run.finished:
        return None
    if status.unknown:
        found = next((u for u in status.unknown if u.evidence_on), None)
        if found is not None and found.evidence_on is not None:
            return _evidence_step(found.attempt_id, found.evidence_on, status)
        # The first unknown attempt's command names it; ``status`` lists them all.
        first = status.unknown[0]
        return NextStep(
            RefusalCode.UNKNOWN_OUTCOME, "reconcile the unknown attempt", first.reconcile
        )
    wide = [c for c in status.controls if c.lane is None]
    for kind in (ControlKind.HALT, ControlKind.PAUSE, ControlKind.STOP):
        held = [c for c in wide if c.kind == kind]
        if held:
            # Of several pauses, the budget's, then the breaker's: they say how to go on.
            held.sort(key=lambda c: _control_rank(c.reason or ""))
            scopes = {c.scope for c in held}
            return _control_step(CONTROL_CODES[kind], held[0].reason or "", scopes, status)
    return None


def _control_rank(why: str) -> int:
    if why.startswith(SOURCES_CHANGED) or why.startswith(BUDGET_SPENT):
        return 0
    return 1 if why.startswith(BREAKER) else 2


def _evidence_step(attempt_id: int, found: dict[str, Any], status: StatusReport) -> NextStep:
    """An unknown attempt whose conclusive evidence a restarted worker read on its node
    (``ledger.note_evidence``): settle it from that evidence, on that node's machine."""
    run = status.run
    host = found.get("host") or "its machine"
    return NextStep(
        RefusalCode.UNKNOWN_OUTCOME,
        f"conclusive evidence of unknown attempt {attempt_id} is on node {found.get('node')} "
        f"(host {host}: it settles as {found.get('outcome')}); run this on {host} to settle "
        "it from that evidence",
        f"laneway reconcile --run {run.id} --from-evidence{_where(run.runtime_dir)}",
    )


def next_step(lane: Lane, status: StatusReport) -> NextStep:
    """The operator's next step for ``lane`` (one of ``status.lanes``): what its run
    needs first (``run_concern``), then what blocks work the lane could do (no live
    controller, no live worker), then why it waits (a capacity refusal)."""
    concern = run_concern(status)
    step = _held_step(lane, status, concern)
    if concern is None and step.code not in OPERATOR_FIRST | {DONE} and controller_needed(status):
        return no_controller_step(status)
    return step


def controller_needed(status: StatusReport) -> bool:
    """No controller serves a run that is not finished (gone, or stopped cleanly: either
    way nothing closes the run or expires a lost worker's lease)."""
    controller = status.controller
    return (
        controller is not None
        and controller.state in ("gone", "stopped")
        and not status.run.finished
    )


def no_controller_step(status: StatusReport) -> NextStep:
    """The run has work it could do and no controller serves it: continue it."""
    run = status.run
    live = any(w.live for w in status.workers)
    what = (
        "workers go on dispatching, but no lost worker's lease expires, no breaker trips "
        "and the run is not closed"
        if live
        else "nothing is dispatched, settled or closed"
    )
    return NextStep(
        NO_CONTROLLER,
        f"no controller serves the run, so {what}; continue the run in the foreground "
        f"(or start `laneway controller{_where(run.runtime_dir)}`)",
        continue_command(run.id, run.runtime_dir),
    )


def _control_step(
    code: RefusalCode, why: str, scopes: set[ControlScope], status: StatusReport
) -> NextStep:
    """The step of a control that holds the run or a lane: ``code`` ``halted``,
    ``paused`` or ``stopped``, ``why`` its reason."""
    run = status.run
    if code == RefusalCode.PAUSED and why.startswith(BUDGET_SPENT):
        return _budget_step(status)
    if code == RefusalCode.HALTED and why.startswith(SOURCES_CHANGED):
        # Each problem names its file first (``pipeline.source_drift``); an unreadable
        # one's own "; frozen HASH" is no file.
        parts = why[len(SOURCES_CHANGED) :].split("; ")
        files = [part.split(": ", 1)[0] for part in parts if not part.startswith("frozen ")]
        return NextStep(
            StepCode.SOURCES_CHANGED,
            f"the run's frozen sources changed ({', '.join(files)}); `clear-halt` cannot "
            "lift this halt: start a new run, which freezes them again and reuses what "
            "succeeded",
            new_run_command(run.runtime_dir, run.config_path),
        )
    target = "--all" if scopes == {ControlScope.GLOBAL} else str(run.id)
    verb = "clear-halt" if code == RefusalCode.HALTED else "resume"
    command = f"laneway {verb} {target} --reason '...'{_where(run.runtime_dir)}"
    if code == RefusalCode.PAUSED and why.startswith(BREAKER):
        return NextStep(
            StepCode.BREAKER,
            "the infrastructure breaker paused the run; once the infrastructure is fixed",
            command,
        )
    return NextStep(code, "once the cause is fixed", command)


def _budget_step(status: StatusReport) -> NextStep:
    succeeded = status.totals.get("succeeded", 0)
    return NextStep(
        RefusalCode.BUDGET,
        f"the run stopped at its budget; raise `budget` in the config and start a new "
        f"run ({succeeded} succeeded job(s) are reused, not run or paid for again; "
        "`resume` would pause it again)",
        new_run_command(status.run.runtime_dir, status.run.config_path),
    )


def _held_step(lane: Lane, status: StatusReport, concern: NextStep | None) -> NextStep:
    """The lane's step from what holds it (``next_step`` before the controller's)."""
    if lane.running:
        return _unverified_step(lane, status) or NextStep(
            RUNNING, f"nothing to do: {lane.running} running", None
        )
    if not lane.pending:
        if concern is not None and concern.code in HALTING:
            return concern
        return NextStep(DONE, "done: the lane has no job left to start", None)
    if concern is not None:
        return concern
    reason = lane.reason
    if reason is None:
        return NextStep(
            StepCode.UNRECORDED,
            "no refusal recorded yet: `laneway explain JOB` lists what blocks a ready job",
            None,
        )
    code = reason.code
    why = str(reason.detail.get("reason") or "")
    if code == RefusalCode.UNKNOWN_OUTCOME:
        return NextStep(
            RefusalCode.UNKNOWN_OUTCOME,
            "reconcile the unknown attempt(s) that halt dispatch (another run's, scope everything)",
            None,
        )
    if code == RefusalCode.NO_WORKER:
        return NextStep(RefusalCode.NO_WORKER, "start a worker", str(reason.detail.get("start")))
    if code == RefusalCode.BUDGET:
        return _budget_step(status)
    kind = CONTROL_KINDS.get(code)
    if kind is not None:
        scopes = {c.scope for c in status.controls if c.kind == kind}
        return _control_step(CONTROL_CODES[kind], why, scopes, status)
    if code == RefusalCode.SECRET_MISSING:
        names = " ".join(str(v) for v in reason.detail.get("variables", []))
        node = reason.detail.get("node") or reason.node or lane.node
        return NextStep(
            code,
            f"the worker on node {node} lacks {names or 'a secret the stage references'}: "
            "set it in that worker's environment and restart the worker (it adopts what "
            "runs); nothing of the stage was started or failed",
            None,
        )
    if code == RefusalCode.MEMORY_FLOOR:
        return NextStep(
            code,
            "wait for running attempts to release memory, free memory on node "
            f"{reason.node or lane.node}, or lower the stage's memory_mib; "
            "`laneway explain JOB` shows the arithmetic",
            None,
        )
    return NextStep(code, WAITS.get(code, f"see `laneway explain JOB` ({code})"), None)


def _unverified_step(lane: Lane, status: StatusReport) -> NextStep | None:
    """A lane whose every in-flight attempt is unverified (its worker stale or lost):
    the command that starts a worker of its node, which adopts the supervisors that
    still run or settles them from their exit records. None while any is verified."""
    mine = [a for a in status.running if a.lane == lane.lane]
    if not mine or any(a.verified for a in mine):
        return None
    starts = {n.node: n.start for n in status.no_worker}
    start = starts.get(lane.node)
    if start is None:
        return None
    return NextStep(
        RefusalCode.NO_WORKER,
        f"nobody can say its {len(mine)} attempt(s) still run ({mine[0].unverified_because});"
        " start a worker: it adopts the supervisors that still run and settles the rest "
        "from their exit records",
        start,
    )


def lane_step(lane: Lane, status: StatusReport) -> NextStep:
    """The lane's step as ``status_report`` set it; a report read back from JSON written
    without it gets it from ``next_step`` (the same mapping)."""
    return lane.next_step if lane.next_step is not None else next_step(lane, status)


def action_words(step: NextStep | None) -> str | None:
    """The "what to do" cell: the step's line; nothing for a running or done lane."""
    if step is None or step.code in (DONE, RUNNING):
        return None
    return step.line()


def run_next_step(status: StatusReport) -> NextStep | None:
    """The run's one next step, the answer every view gives (``status`` text and
    ``--json``, ``status --watch``, the live display, ``explain``, the web banner and
    "Needs you", the report, the metrics, ``laneway run``'s exit message, every
    notification): what the run itself needs (``run_concern``); else, while the run has
    work it could do, a missing controller (``no_controller``) or what a lane needs from
    a person (a command: a worker to start, a secret to set), the one that must come
    first (``RUN_ORDER``); None when nothing needs a person (it runs, waits for capacity,
    or is finished)."""
    concern = run_concern(status)
    if concern is not None:
        return concern
    steps = [lane_step(lane, status) for lane in status.lanes]
    needed = [s for s in steps if s.command is not None]
    rank = {code: i for i, code in enumerate(RUN_ORDER)}
    first = [s for s in needed if s.code in OPERATOR_FIRST]
    if first:  # a lane's own hold (its pause, an admission budget refusal, a secret)
        return min(first, key=lambda s: rank.get(s.code, len(rank)))
    if controller_needed(status):
        return no_controller_step(status)
    if not needed:
        return None
    return min(needed, key=lambda s: rank.get(s.code, len(rank)))


def report_step(status: StatusReport) -> NextStep | None:
    """``StatusReport.next_step`` as ``status_report`` set it; a report read back from
    JSON written without it gets it from ``run_next_step``."""
    return status.next_step if status.next_step is not None else run_next_step(status)
