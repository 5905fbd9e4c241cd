"""What a worker checks of a run before it starts the run's jobs, from what it already has.

Two checks, both for the runs whose jobs a claim may start:

- invariant 12: a run whose frozen source files changed dispatches nothing
  (``pipeline.source_drift``; the claim halts it, naming the file and both hashes);
- the variables a stage references that this worker's environment lacks: such jobs
  are refused (``secret_missing``), not claimed.

Neither reads the ledger. The runs come from the claim's own admission snapshot, which
reads them anyway (``ledger.claim_jobs`` hands them back through ``seen["runs"]``): a
run seen at the last claim has its sources checked before the next claim's
transaction begins (``before_claim``), so no file is hashed under the ledger's locks;
a run the claim meets for the first time is checked inside it (``check_sources``),
once, since it is a known run from then on. A claim that sees no candidate of a run
forgets it, so what is kept follows the runs with work here, not every run there was.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from laneway.controller import pipeline
from laneway.workers.jobenv import missing_variables

if TYPE_CHECKING:
    from laneway.controller.ledger.snapshot import RunInfo


class RunChecks:
    def __init__(self) -> None:
        self._sources: dict[int, dict[str, str]] = {}
        """Run id -> its frozen source hashes, for the runs the last claim saw."""
        self._checked: set[int] = set()
        """The runs ``before_claim`` checked for the claim about to run."""
        self._lacking: dict[int, dict[str, list[str]]] = {}
        """Run id -> stage -> the variables this worker's environment lacks to start the
        stage's jobs (worked out once per run: its config is frozen, this environment
        fixed)."""

    def before_claim(self) -> dict[int, list[str]]:
        """Run id -> what changed in its frozen sources, for the runs the last claim saw;
        done before the claim's transaction (hashing is not work for the locks)."""
        problems: dict[int, list[str]] = {}
        for run_id, hashes in self._sources.items():
            drift = pipeline.source_drift(hashes) if hashes else []
            if drift:
                problems[run_id] = drift
        self._checked = set(self._sources)
        return problems

    def check_sources(self, run: RunInfo) -> list[str]:
        """Inside the claim, for a run about to dispatch: nothing more for a run
        ``before_claim`` checked; the check itself for a run it did not know."""
        if run.id in self._checked:
            return []
        return pipeline.source_drift(run.source_hashes) if run.source_hashes else []

    def lacking_for(self, run: RunInfo) -> dict[str, list[str]]:
        """Stage -> the variables this worker's environment lacks to start its jobs."""
        if run.id not in self._lacking:
            self._lacking[run.id] = {
                stage.name: names
                for stage in run.config.stages
                if (names := missing_variables(stage.env, stage.pass_env, os.environ))
            }
        return self._lacking[run.id]

    def saw(self, runs: dict[int, RunInfo]) -> None:
        """The runs with candidates at the claim that just ran: checked before the next
        one; the rest are forgotten."""
        self._sources = {run_id: dict(info.source_hashes) for run_id, info in runs.items()}
        self._lacking = {r: by_stage for r, by_stage in self._lacking.items() if r in runs}
        self._checked = set()
