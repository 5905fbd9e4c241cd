"""What an operator's ``retry`` must re-run besides the jobs it names.

A failed consumer whose input has left the store (deleted, or other bytes under its
name) would fail the same way on every retry: the producer that stored it must run
again first. ``producers_to_rerun`` reads what each retried job would be given
(``ledger.delivered_inputs``) and looks at the store for each artifact
(``attempt.artifacts.still_stored``), before any write transaction, so nothing of it
waits under the write lock; a producer chosen this way is looked at in turn, so a chain
whose first output is gone re-runs from there. A store this machine cannot look at is
trusted, as a new run's reuse trusts it (``pipeline.gone_outputs``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from laneway.controller import db, ledger
from laneway.controller.attempt.artifacts import GONE, still_stored


@dataclass(frozen=True)
class Rerun:
    """A succeeded job to run again because an output it stored is gone."""

    job_id: int
    label: str
    """``ITEM.STAGE``."""
    why: str
    for_job: int
    """The job it is re-run for (a retried job, or another re-run producer)."""
    paid: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "job": self.label,
            "why": self.why,
            "for_job": self.for_job,
            "paid": self.paid,
        }


def producers_to_rerun(engine: Engine, job_ids: Collection[int]) -> list[Rerun]:
    """The producers whose stored outputs the jobs ``job_ids`` (and, in turn, those
    producers) would need and that are gone, in the order they were found."""
    found: list[Rerun] = []
    chosen: set[int] = set()
    todo = sorted(set(job_ids))
    while todo:
        with db.one_read(engine) as session:
            delivered = ledger.delivered_inputs(session, todo)
        todo = []
        for given in delivered:
            if given.producer in chosen:
                continue
            for name, sha256, location in given.outputs:
                verdict = still_stored(location, sha256)
                if verdict is not None and verdict[0] == GONE:
                    why = f"output {name} of attempt {given.attempt_id}: {verdict[1]}"
                    found.append(
                        Rerun(given.producer, given.label, why, given.consumer, given.paid)
                    )
                    chosen.add(given.producer)
                    todo.append(given.producer)
                    break
    return found
