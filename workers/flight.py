"""What a worker holds for each attempt in flight: its claim, a handle on its supervisor
(a child, one forked by the launcher, or one adopted after a restart), its peaks.

Shared by the worker's parts (``workers.recovery``, ``workers.spawning``,
``workers.finishing``) and ``workers.service``, which keeps them in ``in_flight``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from laneway.controller import identity, ledger
from laneway.controller.config import CaptureConfig
from laneway.controller.states import Outcome
from laneway.workers import launcher as launcher_module
from laneway.workers.sampler import Peaks


@dataclass
class InFlight:
    claim: ledger.Claim
    supervisor: subprocess.Popen[bytes] | AdoptedSupervisor | LaunchedSupervisor
    exit_codes: dict[int, Outcome]
    marked_unknown: bool = False
    """Already unknown in the ledger (e.g. its receipt could not be saved): watched only
    to reap its supervisor; an operator reconciles it from the evidence."""
    peaks: Peaks = field(default_factory=Peaks)
    exited: bool = False
    """Its supervisor has exited (seen this tick): it is settled next, not sampled."""
    awaiting_report: bool = False
    """Started; its supervisor has not yet reported the child's identity."""
    secrets: list[str] = field(default_factory=list)
    """Values redacted from its result before the result reaches the ledger."""
    result_requirement: Literal["optional", "required"] = "optional"
    unrecorded_report: dict[str, Any] | None = None
    """Its supervisor's report, read but not yet in the ledger (it waits for the
    worker's next write, ``Spawning.write_identities``, or that write failed)."""
    reported_at: float = 0.0
    """When the report was read (``time.monotonic``): its ``started_at`` and how long it
    has waited to be recorded."""
    supervisor_start_time: int | None = None
    """Its supervisor's start time, read with its report (it may be gone by the write
    that records the identity)."""
    receipt_error: str | None = None
    """Why its ``receipt.json`` could not be saved: it is marked unknown as its identity
    is recorded."""
    oom_kills_at_start: int | None = None
    """The worker cgroup's OOM kill count as it started (None: unknown; ``workers.oom``)."""
    free_before_exit: float | None = None
    """The node's free memory (MiB) at the worker's last probe before it saw the exit."""


class AdoptedSupervisor:
    """A supervisor this worker did not start: it outlived the worker that did. It is
    not our child, so it is watched by identity (pid + start time), not waited for."""

    def __init__(self, pid: int, start_time: int | None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while the supervisor lives; afterwards 0. Its exit status is not ours to
        know (``returncode`` stays None): exit.json is the record."""
        if identity.same_process(self.pid, self.start_time):
            return None
        return 0


class LaunchedSupervisor:
    """A supervisor forked by this worker's launcher (``workers.launcher``): not our
    child either, so watched by its pidfd; ``stdout`` is our end of its report pipe."""

    def __init__(self, pid: int, start_time: int | None, stdout: Any, attempt_dir: str) -> None:
        self.pid = pid
        self.start_time = start_time
        self.stdout = stdout
        self.returncode: int | None = None
        self._status = Path(attempt_dir) / launcher_module.STATUS_FILE
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None  # already gone (reaped): poll() reads its status
        if self._pidfd is not None and identity.process_start_time(pid) != start_time:
            os.close(self._pidfd)  # reaped, and the pid taken by another process since
            self._pidfd = None

    def poll(self) -> int | None:
        """None while it runs (one ``select`` on its pidfd: a long attempt costs no file
        reads); once it exited, the wait status the launcher recorded (written before it
        reaps, so the process stays visible until then); 0, with ``returncode`` None,
        when it is gone without one (the launcher died)."""
        if self.returncode is not None:
            return self.returncode
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], 0)
            if not ready:
                return None
        if self._recorded() or identity.same_process(self.pid, self.start_time):
            return self.returncode
        # Gone. The launcher writes the status before it reaps, so if it wrote one it is
        # there now (it may have landed between the two looks above).
        self._recorded()
        self._close()
        return 0 if self.returncode is None else self.returncode

    def _recorded(self) -> bool:
        """Read the status the launcher recorded, if it did (sets ``returncode``)."""
        try:
            self.returncode = int(json.loads(self._status.read_text())["returncode"])
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError):
            self.returncode = None  # unreadable: exited, status unknown
            return False
        self._close()
        return True

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def measurements(peaks: Peaks) -> dict[str, Any]:
    """The attempt columns a Peaks fills."""
    return {
        "current_rss_mib": peaks.current_rss_mib,
        "peak_rss_mib": peaks.peak_rss_mib,
        "peak_rss_at": peaks.peak_rss_at,
        "peak_gpu_mib": peaks.peak_gpu_mib,
        "peak_gpu_at": peaks.peak_gpu_at,
        "gpu_note": peaks.gpu_note,
        "sampled_at": peaks.sampled_at,
    }


@dataclass
class StageRules:
    """What the worker keeps of each stage it runs attempts of, read once per run and
    stage (frozen with the run): its exit-code map, capture settings, result rule and
    output cap."""

    exit_codes: dict[int, dict[str, dict[int, Outcome]]] = field(default_factory=dict)
    captures: dict[tuple[int, str], CaptureConfig | None] = field(default_factory=dict)
    results: dict[tuple[int, str], Literal["optional", "required"]] = field(default_factory=dict)
    output_caps: dict[tuple[int, str], int] = field(default_factory=dict)

    def remember(self, session: Any, claim: ledger.Claim) -> None:
        """Cache a claimed attempt's stage rules (frozen with the run)."""
        by_stage = self.exit_codes.setdefault(claim.run_id, {})
        if claim.stage not in by_stage:
            run = ledger.get_run(session, claim.run_id)
            stage = ledger.run_config(run).stage(claim.stage)
            by_stage[claim.stage] = dict(stage.exit_codes)
            self.captures[(claim.run_id, claim.stage)] = stage.capture
            self.results[(claim.run_id, claim.stage)] = stage.result
            self.output_caps[(claim.run_id, claim.stage)] = stage.output_max_mib
