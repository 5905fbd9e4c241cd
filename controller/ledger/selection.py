"""Choosing by yield: what a run that selects by yield (config ``select``) reads before a
claim and writes after one (``group_stats``), and the decision each choice leaves.

``group_stats`` keeps, per (run, item group), how many attempts were admitted (by the
claim) and what settled attempts reported of the selection's ``by`` and ``per`` keys (by
the settle, like ``usage_totals``), so a choice reads one row per group, never the
attempts (``admission.order_by_yield`` decides).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Float, bindparam, insert, select, update
from sqlalchemy.orm import Session

from laneway.controller import admission, db
from laneway.controller.ledger import statements
from laneway.controller.ledger.tables import group_stats
from laneway.controller.ledger.transitions import rowcount
from laneway.controller.states import Verdict

_RUN: Any = bindparam("b_run_id")
_GROUP: Any = bindparam("b_group")

# add_group: one admission and what one settled attempt reported, added to a group's row.
ADD_GROUP = (
    update(group_stats)
    .where(group_stats.c.run_id == _RUN, group_stats.c.group_name == _GROUP)
    .values(
        admitted=group_stats.c.admitted + bindparam("b_admitted"),
        measured=group_stats.c.measured + bindparam("b_measured"),
        by_total=group_stats.c.by_total + bindparam("b_by", type_=Float),
        per_total=group_stats.c.per_total + bindparam("b_per", type_=Float),
    )
)
INSERT_GROUP = insert(group_stats)

# run_groups: the group rows of some runs.
RUN_GROUPS = select(group_stats).where(
    group_stats.c.run_id.in_(bindparam("b_runs", expanding=True))
)

SELECT_CODE = "select"
"""The reason code of a dispatch decision that records a selection's choice."""


def _add(
    session: Session,
    run_id: int,
    group: str,
    *,
    admitted: int = 0,
    measured: int = 0,
    by: float = 0.0,
    per: float = 0.0,
) -> None:
    db.shared_write(
        session,
        lambda s: _add_now(s, run_id, group, admitted=admitted, measured=measured, by=by, per=per),
    )


def _add_now(
    session: Session,
    run_id: int,
    group: str,
    *,
    admitted: int,
    measured: int,
    by: float,
    per: float,
) -> None:
    params = {
        "b_run_id": run_id,
        "b_group": group,
        "b_admitted": admitted,
        "b_measured": measured,
        "b_by": by,
        "b_per": per,
    }
    if rowcount(session.execute(ADD_GROUP, params)) == 0:
        # Writes to this row are serialised (BEGIN IMMEDIATE on SQLite; on PostgreSQL
        # the gate alone or the order lock: db.shared_write), so the row cannot appear
        # between the UPDATE and this INSERT.
        session.execute(
            INSERT_GROUP,
            {
                "run_id": run_id,
                "group_name": group,
                "admitted": admitted,
                "measured": measured,
                "by_total": by,
                "per_total": per,
            },
        )


def selection_views(
    session: Session, configs: dict[int, Any]
) -> dict[int, admission.SelectionView]:
    """Run id -> its selection as it stands (``configs``: run id -> frozen config; only
    those with ``select`` count). One indexed read for all of them."""
    chosen = {run_id: c.select for run_id, c in configs.items() if c.select is not None}
    if not chosen:
        return {}
    groups: dict[int, dict[str, admission.GroupView]] = {run_id: {} for run_id in chosen}
    for row in session.execute(RUN_GROUPS, {"b_runs": sorted(chosen)}):
        groups[row.run_id][row.group_name] = admission.GroupView(
            row.admitted, row.measured, float(row.by_total), float(row.per_total)
        )
    return {
        run_id: admission.SelectionView(select.by, select.per, select.explore, groups[run_id])
        for run_id, select in chosen.items()
    }


def record_choices(
    session: Session,
    chosen: Iterable[tuple[admission.Candidate, dict[str, Any]]],
    *,
    node: str,
    worker_id: str | None,
    now: datetime,
) -> None:
    """Each admission a selection chose: its group's count goes up, and a dispatch
    decision (reason code ``select``) keeps the figures it used (``explain`` and
    ``report`` read them)."""
    rows = []
    for candidate, figures in chosen:
        _add(session, candidate.run_id, figures["group"], admitted=1)
        rows.append(
            {
                "run_id": candidate.run_id,
                "lane": candidate.lane,
                "stage": candidate.stage,
                "node": node,
                "worker_id": worker_id,
                "verdict": Verdict.DISPATCHED,
                "reason_code": SELECT_CODE,
                "detail": figures,
                "job_id": candidate.job_id,
                "decided_at": now,
            }
        )
    if rows:
        session.execute(statements.INSERT_DECISION, rows)


def record_group_usage(
    session: Session, config: Any, run_id: int, group: str | None, usage: dict[str, float]
) -> None:
    """A settled attempt's reported usage counts for its group's yield (a run that
    selects by yield, an attempt that reported ``by`` or ``per``)."""
    select_ = config.select
    if select_ is None or group is None or not ({select_.by, select_.per} & set(usage)):
        return
    _add(
        session,
        run_id,
        group,
        measured=1,
        by=float(usage.get(select_.by, 0.0)),
        per=float(usage.get(select_.per, 0.0)),
    )
