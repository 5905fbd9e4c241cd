"""Each notification's next step and link (``controller/notify.py``'s payload): the step
every view gives the affected run (``advice.run_next_step``), or, for a notice about no
one run, the step of the thing it names, always with its command and a link to the
page that shows it (read-only).

- a halt, a budget stop, a breaker pause, unknown outcomes: the run's next step (the
  same one ``laneway status`` leads with), linked to the run, or to the first unknown
  attempt;
- a lost worker: start a worker on its node (it adopts the supervisors that still run
  and settles the rest from their exit records), linked to the workers section of the
  newest active run that has work on that node;
- a lost controller: start one (``laneway controller``), linked to the newest active run;
- a finished run: its outcome counts, and the command that reports it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from laneway.controller import advice, ledger, web_links
from laneway.controller.codes import StepCode
from laneway.controller.models import Run, Worker
from laneway.controller.states import Attention
from laneway.controller.status import build_status
from laneway.controller.status_model import NextStep
from laneway.controller.status_nodes import worker_command

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

OUTCOME_ORDER = ("succeeded", "failed", "skipped", "cancelled", "unknown")
WORKERS_ANCHOR = "#workers"
"""The workers section of the dashboard's page (``web_page.py``'s ``id="workers"``)."""


@dataclass(frozen=True)
class Placed:
    """A notice's next step and where to look: ``path`` is a dashboard path (None: no
    page fits); ``reason`` replaces the notice's when set (a finished run's counts)."""

    step: NextStep
    path: str | None
    reason: str | None = None


def place(
    session: Session,
    *,
    kind: Attention,
    run_id: int | None,
    attempt_id: int | None,
    worker_id: str | None,
    now: datetime,
) -> Placed:
    """The next step and link of one notice (``notify.Notice``'s fields)."""
    if kind == Attention.WORKER_LOST:
        return _worker_lost(session, worker_id)
    if kind == Attention.CONTROLLER_LOST:
        return _controller_lost(session)
    run = session.get(Run, run_id) if run_id is not None else None
    if run is None:
        return Placed(
            NextStep(StepCode.UNPLACED, "see `laneway status`", "laneway status"), None, reason=None
        )
    status = build_status(session, run, now=now)
    where = (
        web_links.attempt_path(attempt_id) if attempt_id is not None else web_links.run_path(run.id)
    )
    if kind == Attention.RUN_FINISHED or status.run.finished:
        counts = outcome_counts(status.totals)
        return Placed(
            NextStep(
                advice.DONE,
                f"done: every job is terminal ({counts}); the report says what each cost "
                "and how long it waited",
                f"laneway report {run.id} --runtime-dir {shlex.quote(run.runtime_dir)}",
            ),
            where,
            reason=f"run {run.id} finished: {counts}",
        )
    step = advice.report_step(status)
    if step is None or step.command is None:
        # The run holds nothing for a person any more (it was lifted meanwhile): say
        # where it stands, with the command that shows it.
        step = NextStep(
            StepCode.SEE_STATUS,
            "nothing holds the run now (it was lifted since); its status says where it stands",
            f"laneway status {run.id} --runtime-dir {shlex.quote(run.runtime_dir)}",
        )
    return Placed(step, where)


def outcome_counts(totals: dict[str, int]) -> str:
    """``30 succeeded, 2 failed, 1 skipped``: the run's jobs by terminal state."""
    known = [f"{totals[s]} {s}" for s in OUTCOME_ORDER if totals.get(s)]
    known += [f"{n} {s}" for s, n in sorted(totals.items()) if n and s not in OUTCOME_ORDER]
    return ", ".join(known) or "no jobs"


def _newest_active(session: Session, node: str | None = None) -> Run | None:
    """The newest active run (of those whose config names ``node``, when given)."""
    for run_id in sorted(ledger.active_run_ids(session), reverse=True):
        run = session.get(Run, run_id)
        if run is None:
            continue
        if node is None or any(n.name == node for n in ledger.run_config(run).nodes):
            return run
    return None


def _worker_lost(session: Session, worker_id: str | None) -> Placed:
    worker = session.get(Worker, worker_id) if worker_id else None
    node = worker.node if worker is not None else None
    run = _newest_active(session, node) or _newest_active(session)
    if node is None or run is None:
        return Placed(
            NextStep(
                StepCode.WORKER_LOST,
                f"worker {worker_id} is lost; `laneway status` names the nodes without one",
                "laneway status",
            ),
            WORKERS_ANCHOR if run is None else web_links.run_path(run.id) + WORKERS_ANCHOR,
        )
    words = (
        f"worker {worker_id} on node {node} is lost; start a worker on that node: it adopts "
        "the supervisors that still run and settles the rest from their exit records"
    )
    return Placed(
        NextStep(StepCode.WORKER_LOST, words, worker_command(node, run.runtime_dir)),
        web_links.run_path(run.id) + WORKERS_ANCHOR,
    )


def _controller_lost(session: Session) -> Placed:
    run = _newest_active(session)
    if run is None:
        return Placed(
            NextStep(
                StepCode.CONTROLLER_LOST,
                "the controller is lost; no run is active, so nothing waits for it",
                "laneway runs",
            ),
            None,
        )
    return Placed(
        NextStep(
            StepCode.CONTROLLER_LOST,
            "the controller is lost: no lease of a lost worker expires, no breaker trips and "
            "no run is closed; start one (or continue the run with `laneway run --continue "
            f"{run.id}`)",
            f"laneway controller --runtime-dir {shlex.quote(run.runtime_dir)}",
        ),
        web_links.run_path(run.id),
    )


def as_payload(placed: Placed, dashboard: str | None) -> dict[str, Any]:
    """The ``next_step`` and ``link`` fields of a notification's payload."""
    link = None if dashboard is None or placed.path is None else dashboard + placed.path
    return {"next_step": placed.step.as_dict(), "link": link}
