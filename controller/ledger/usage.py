"""Usage and budgets in the ledger: what attempts spent, and what live ones hold.

Costs follow the work: every write here touches the rows of one attempt and of its
(run, stage) in ``usage_totals``; a budget check reads those few rows and a bounded
window of the stage's newest reported values, never every attempt of the run.

- The settle (or unknown mark, or reconcile) that reads an attempt's result stores its
  usage once (``record_usage``) and adds it to ``usage_totals.spent``.
- A claim of a budgeted stage writes the attempt's expected cost on its reservation and
  adds it to ``usage_totals.reserved`` (``hold_expected``); releasing the reservation
  gives it back (``release_expected``). An unknown attempt keeps its reservation, so
  its expected cost counts against the budget until it is reconciled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Integer, String, bindparam, exists, insert, select, update
from sqlalchemy.orm import Session

from laneway.controller import db
from laneway.controller import usage as usage_math
from laneway.controller.ledger.tables import (
    attempt_usage,
    attempts,
    jobs,
    reservations,
    usage_totals,
)
from laneway.controller.ledger.transitions import rowcount

_RUN = bindparam("b_run_id", type_=Integer)
_STAGE = bindparam("b_stage", type_=String)
_KEY = bindparam("b_key", type_=String)

# add_spent / add_reserved: one (run, stage, key) total moves by what a settle reported
# or what a claim reserved (a release reserves a negative amount).
ADD_SPENT = (
    update(usage_totals)
    .where(
        usage_totals.c.run_id == _RUN, usage_totals.c.stage == _STAGE, usage_totals.c.key == _KEY
    )
    .values(
        spent=usage_totals.c.spent + bindparam("b_amount", type_=Float),
        attempts=usage_totals.c.attempts + 1,
    )
)
ADD_RESERVED = (
    update(usage_totals)
    .where(
        usage_totals.c.run_id == _RUN, usage_totals.c.stage == _STAGE, usage_totals.c.key == _KEY
    )
    .values(reserved=usage_totals.c.reserved + bindparam("b_amount", type_=Float))
)
INSERT_TOTAL = insert(usage_totals)

# usage_recorded: has this attempt's usage been stored already? (one index probe)
USAGE_RECORDED = select(exists().where(attempt_usage.c.attempt_id == bindparam("attempt_id")))

# run_totals: the (stage, key) totals of the given runs (stages x keys rows per run).
RUN_TOTALS = select(
    usage_totals.c.run_id,
    usage_totals.c.stage,
    usage_totals.c.key,
    usage_totals.c.spent,
    usage_totals.c.reserved,
).where(usage_totals.c.run_id.in_(bindparam("run_ids", expanding=True)))

# stage_window: the newest values one stage of one run reported for one key.
STAGE_WINDOW = (
    select(attempt_usage.c.value)
    .where(
        attempt_usage.c.run_id == _RUN,
        attempt_usage.c.stage == _STAGE,
        attempt_usage.c.key == _KEY,
    )
    .order_by(attempt_usage.c.attempt_id.desc())
    .limit(usage_math.P90_WINDOW)
)

# attempt_stage: where a released reservation's expected cost goes back.
ATTEMPT_STAGE = (
    select(attempts.c.run_id, jobs.c.stage)
    .join(jobs, jobs.c.id == attempts.c.job_id)
    .where(attempts.c.id == bindparam("attempt_id"))
)


def _add(
    session: Session, statement: Any, run_id: int, stage: str, key: str, amount: float
) -> None:
    db.shared_write(session, lambda s: _add_now(s, statement, run_id, stage, key, amount))


def _add_now(
    session: Session, statement: Any, run_id: int, stage: str, key: str, amount: float
) -> None:
    params = {"b_run_id": run_id, "b_stage": stage, "b_key": key, "b_amount": amount}
    if rowcount(session.execute(statement, params)) == 0:
        # Writes to this row are serialised (BEGIN IMMEDIATE on SQLite; on PostgreSQL
        # the gate alone or the order lock: db.shared_write), so the row cannot appear
        # between the UPDATE and this INSERT.
        reported = statement is ADD_SPENT
        session.execute(
            INSERT_TOTAL,
            {
                "run_id": run_id,
                "stage": stage,
                "key": key,
                "spent": amount if reported else 0.0,
                "reserved": 0.0 if reported else amount,
                "attempts": 1 if reported else 0,
            },
        )


def record_usage(
    session: Session,
    *,
    attempt_id: int,
    run_id: int,
    job_id: int,
    stage: str,
    usage: dict[str, float],
    now: datetime,
) -> bool:
    """Store an attempt's reported usage and add it to its stage's spend, once: an
    attempt whose usage is already stored (marked unknown with a result, then
    reconciled) keeps it. False when nothing was stored."""
    if not usage or session.execute(USAGE_RECORDED, {"attempt_id": attempt_id}).scalar():
        return False
    session.execute(
        insert(attempt_usage),
        [
            {
                "attempt_id": attempt_id,
                "key": key,
                "run_id": run_id,
                "job_id": job_id,
                "stage": stage,
                "value": value,
                "recorded_at": now,
            }
            for key, value in sorted(usage.items())
        ],
    )
    for key, value in sorted(usage.items()):
        _add(session, ADD_SPENT, run_id, stage, key, value)
    return True


def hold_expected(session: Session, run_id: int, stage: str, expected: dict[str, float]) -> None:
    """A claimed attempt's expected cost now counts against its budgets."""
    for key, value in sorted(expected.items()):
        _add(session, ADD_RESERVED, run_id, stage, key, value)


def release_expected(session: Session, attempt_id: int, held: dict[str, Any] | None) -> None:
    """A released reservation gives its expected cost back (``held``: its ``usage``)."""
    if not held:
        return
    row = session.execute(ATTEMPT_STAGE, {"attempt_id": attempt_id}).one()
    for key, value in sorted(held.items()):
        _add(session, ADD_RESERVED, row.run_id, row.stage, key, -float(value))


@dataclass
class Spend:
    """One budget scope's figures for one key: spent, and held by live attempts."""

    spent: float = 0.0
    reserved: float = 0.0


@dataclass
class RunSpend:
    """A run's spend per key, and per (stage, key)."""

    run: dict[str, Spend] = field(default_factory=dict)
    stages: dict[tuple[str, str], Spend] = field(default_factory=dict)


def run_spend(session: Session, run_ids: Iterable[int]) -> dict[int, RunSpend]:
    """What the given runs spent and hold, from ``usage_totals`` (a few rows per run)."""
    ids = sorted(set(run_ids))
    result: dict[int, RunSpend] = {run_id: RunSpend() for run_id in ids}
    if not ids:
        return result
    for row in session.execute(RUN_TOTALS, {"run_ids": ids}):
        spend = result[row.run_id]
        total = spend.run.setdefault(row.key, Spend())
        total.spent += row.spent
        total.reserved += max(0.0, row.reserved)
        spend.stages[(row.stage, row.key)] = Spend(row.spent, max(0.0, row.reserved))
    return result


def expected_cost(
    session: Session, run_id: int, stage: Any, keys: Iterable[str]
) -> dict[str, tuple[float, str]]:
    """Key -> (expected cost of one more attempt of ``stage``, where it comes from): the
    p90 of the stage's newest reported values in this run, or its configured
    ``expected_usage`` until there are any (0 when neither exists)."""
    expected: dict[str, tuple[float, str]] = {}
    for key in sorted(set(keys)):
        values = list(
            session.execute(
                STAGE_WINDOW, {"b_run_id": run_id, "b_stage": stage.name, "b_key": key}
            ).scalars()
        )
        measured = usage_math.p90(values)
        if measured is not None:
            expected[key] = (measured, f"p90 of {len(values)} attempt(s)")
        elif key in stage.expected_usage:
            expected[key] = (float(stage.expected_usage[key]), "expected_usage")
        else:
            expected[key] = (0.0, "no measurement, no expected_usage")
    return expected


RELEASE_RESERVATION_USAGE = (
    update(reservations)
    .where(
        reservations.c.attempt_id == bindparam("b_attempt_id"),
        reservations.c.released_at.is_(None),
    )
    .values(released_at=bindparam("b_now"))
    .returning(reservations.c.usage)
)
"""release_reservation_usage: an attempt's reservation ends, returning the expected cost
it held (NULL for stages without a budget)."""
