"""Whether ``laneway retry`` can work: not on a run whose frozen sources changed.

Every claim re-checks a run's frozen sources and halts the run when one changed
(``controller/ledger/claim.py::_halt_on_source_drift``), and ``clear-halt`` cannot lift
that halt. So retrying a failed job after fixing the script it runs (``judge.py``)
would move the job to ready and then halt the run at its next dispatch. ``retry``
asks ``stale_sources`` first, before anything moves, and refuses with the one way on:
a new run, which freezes the sources again and reuses every job whose result the change
does not touch (its reuse count is ``laneway plan``'s own, ``run_plan.build_plan``).
Reads only.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select

from laneway.controller import advice, db, ledger, pipeline, run_plan
from laneway.controller import config as config_module
from laneway.controller.errors import LanewayError
from laneway.controller.models import Job
from laneway.controller.source_check import SourceChange, changed_sources


@dataclass(frozen=True)
class StaleSources:
    """A run that ``retry`` cannot carry on: its changed sources, the command that starts
    a new run and how many succeeded jobs that run would reuse."""

    run_id: int
    changes: list[SourceChange]
    command: str
    reused: int
    config_path: str | None
    """The config the run was started from, when the run records it (else the command
    says ``CONFIG``)."""

    @property
    def files(self) -> list[str]:
        return [change.path for change in self.changes]

    def lines(self) -> list[str]:
        """The refusal in two lines: what changed, and the one step."""
        return [
            f"not retried, nothing was changed: run {self.run_id}'s frozen sources changed "
            f"since it started ({'; '.join(c.line for c in self.changes)}); its next "
            "claim would halt it, and `clear-halt` cannot lift that",
            f"start a new run instead (it freezes the sources again and reuses "
            f"{self.reused} succeeded job(s)): {self.command}",
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "files": self.files,
            "changes": [change.as_dict() for change in self.changes],
            "command": self.command,
            "reused": self.reused,
            "config_path": self.config_path,
        }


class SourcesChanged(LanewayError):
    """``retry`` refused: the run's frozen sources changed; nothing was moved. Exit 1,
    as every refusal over the ledger's state (README, "Exit codes")."""

    def __init__(self, stale: StaleSources) -> None:
        self.stale = stale
        self.reasons = stale.lines()
        super().__init__("; ".join(self.reasons))


def runs_of(engine: Engine, job_ids: Collection[int]) -> list[int]:
    """The runs the jobs ``job_ids`` belong to (ids not in the ledger are left out: the
    retry itself refuses them, naming the id)."""
    if not job_ids:
        return []
    with db.one_read(engine) as session:
        found = session.scalars(select(Job.run_id).where(Job.id.in_(sorted(job_ids))))
        return sorted(set(found))


def stale_sources(engine: Engine, run_id: int) -> StaleSources | None:
    """Run ``run_id``'s changed frozen sources (``source_check.changed_sources``) and the
    new run that is the way on; None when none changed (a retry can work)."""
    with db.one_read(engine) as session:
        run = ledger.get_run(session, run_id)
        changes = changed_sources(run.source_hashes or {})
        if not changes:
            return None
        config_path = run.config_path  # None: not recorded (a run made before 0017)
        frozen = ledger.run_config(run)
        runtime_dir = run.runtime_dir
        recorded = dict(run.source_hashes or {})
    reused = _reused(engine, frozen, recorded, changes, config_path)
    command = advice.new_run_command(runtime_dir, config_path)
    return StaleSources(run_id, changes, command, reused, config_path)


def _reused(
    engine: Engine,
    frozen: config_module.PipelineConfig,
    recorded: dict[str, str],
    changes: list[SourceChange],
    config_path: str | None,
) -> int:
    """How many jobs a new run would take over (``laneway plan``'s count): of the config
    at ``config_path`` when it still loads, else of the run's frozen config with its
    sources as they are now (a file that cannot be read is left out, as the new run's
    preflight would refuse it)."""
    config, hashes = frozen, dict(recorded)
    for change in changes:
        if change.actual is None:
            hashes.pop(change.path, None)
        else:
            hashes[change.path] = change.actual
    on_disk = _loaded(config_path) if config_path else None
    if on_disk is not None:
        config, hashes = on_disk, pipeline.preflight(on_disk)[1]
    plan = run_plan.build_plan(engine, config, hashes, [])
    return sum(stage.reuse for stage in plan.stages)


def _loaded(config_path: str) -> config_module.PipelineConfig | None:
    """The config at ``config_path``; None when it no longer loads (the frozen config is
    then the best estimate, and the new run's own start says what is wrong)."""
    try:
        return config_module.load_config(Path(config_path))
    except (LanewayError, OSError):
        return None
