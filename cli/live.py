"""Live progress for ``laneway run`` and ``laneway status --watch``.

On a terminal: a rich ``Live`` display redrawn in place. Unknown attempts first, in red,
with the reconcile command; controls; per stage a progress bar with done / running /
ready / waiting / failed and the rate seen while watching; per lane what runs or, if
idle, why and what to do; an ETA from measured durations. Elsewhere (a pipe, CI,
``--json``): plain lines, one per change. rich is imported only here, and only when a
terminal is shown.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import deque
from typing import Any, TextIO

from laneway.cli import render
from laneway.controller import advice
from laneway.controller import progress as progress_module
from laneway.controller.rows import Rows
from laneway.controller.status_model import Lane, StatusReport

RATE_WINDOW = 60.0
"""Seconds of history the per-stage rate is measured over."""


class Progress:
    """Shows each new status of one run (``show``); ``close`` before printing after it."""

    def __init__(
        self,
        run_id: int | None,
        *,
        quiet: bool = False,
        as_json: bool = False,
        stream: TextIO | None = None,
        live: bool | None = None,
    ) -> None:
        self.run_id = run_id
        self.quiet = quiet
        self.as_json = as_json
        self.stream = stream or sys.stderr
        self.live = (self.stream.isatty() and not as_json) if live is None else live
        self._seen: dict[str, str] = {}
        self._history: deque[tuple[float, dict[str, int]]] = deque()
        self._display: Any = None

    # -- feeding ---------------------------------------------------------------

    def show(self, status: StatusReport, source: Rows | None = None) -> None:
        """One refresh. ``source`` (inside the same read transaction) is read for the
        ETA's measured durations; without it there is no ETA."""
        if self.quiet:
            return
        durations = progress_module.recent_durations(source, status.run.id) if source else {}
        windows = progress_module.run_rate_windows(source, status.run.id) if source else []
        eta = progress_module.eta_seconds(status, durations, windows)
        rates = self._rates(status)
        if self.live:
            self._draw(status, eta, rates)
        elif self.as_json:
            self._json_line(status, eta)
        else:
            self._plain_lines(status, eta)

    def note(self, line: str) -> None:
        if self.quiet:
            return
        if self._display is not None:
            self._display.console.print(f"run {self.run_id}: {line}")
        elif self._seen.get("note") != line:
            self._seen["note"] = line
            self._write(f"run {self.run_id}: {line}")

    def closeout_running(self) -> None:
        """``laneway run`` waits for the run's closeout: said in words, once (a --json
        stream gets no line for it)."""
        if not self.as_json:
            self.note("closeout running ...")

    def close(self) -> None:
        if self._display is not None:
            self._display.stop()
            self._display = None

    # -- rates -----------------------------------------------------------------

    def _rates(self, status: StatusReport) -> dict[str, float | None]:
        """Jobs per minute per stage, over what this display saw in ``RATE_WINDOW``."""
        now = time.monotonic()
        done = {row.stage: row.done for row in progress_module.stage_progress(status)}
        self._history.append((now, done))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW:
            self._history.popleft()
        start, first = self._history[0]
        span = now - start
        if span < 1.0:
            return dict.fromkeys(done)
        return {stage: 60.0 * (count - first.get(stage, 0)) / span for stage, count in done.items()}

    # -- plain -----------------------------------------------------------------

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def _plain_lines(self, status: StatusReport, eta: float | None) -> None:
        """One line per change: the run's totals, each lane's state and reason, each
        unknown attempt (once)."""
        run = status.run.id
        totals = status.totals
        total = sum(totals.values())
        done = sum(totals.get(s, 0) for s in progress_module.TERMINAL)
        parts = [f"{k} {v}" for k, v in sorted(totals.items()) if v]
        self._once("totals", f"run {run}: {done}/{total} jobs terminal · " + " · ".join(parts))
        for unknown in status.unknown:
            self._once(
                f"unknown {unknown.attempt_id}",
                render.clean(
                    f"run {run}: UNKNOWN attempt {unknown.attempt_id} {unknown.item}."
                    f"{unknown.stage}: {unknown.reason}; resolve: {unknown.reconcile}"
                ),
            )
        said = render.controller_line(status)
        if said is not None:
            self._once("controller", render.clean(f"run {run}: {said}"))
        lanes = [render.clean(f"run {run}: {_lane_words(lane, status)}") for lane in status.lanes]
        step = advice.report_step(status)
        if step is not None and not any((step.command or step.words) in line for line in lanes):
            # The run's step when no lane's line says it (an unknown outcome on a lane with
            # nothing left, a controller a run needs).
            self._once("next step", render.clean(f"run {run}: next step: {step.line()}"))
        for worker in status.workers:
            # A worker's liveness once it is not live, and each change after (the same
            # field ``status`` prints); a worker that stays live says nothing.
            key = f"worker {worker.worker_id}"
            if worker.liveness == "live" and key not in self._seen:
                continue
            self._once(
                key,
                render.clean(
                    f"run {run}: worker {worker.worker_id} (node {worker.node}): {worker.liveness}"
                ),
            )
        for lane, line in zip(status.lanes, lanes, strict=True):
            self._once(f"lane {lane.lane}", line)

    def _once(self, key: str, line: str) -> None:
        if self._seen.get(key) != line:
            self._seen[key] = line
            self._write(line)

    def _json_line(self, status: StatusReport, eta: float | None) -> None:
        """The whole status as one JSON line, when anything but the clock changed."""
        body = status.as_dict()
        key = json.dumps(_without_clock(body), sort_keys=True, default=str)
        if self._seen.get("json") != key:
            self._seen["json"] = key
            self._write(json.dumps({**body, "eta_seconds": eta}, default=str))

    # -- rich ------------------------------------------------------------------

    def _draw(self, status: StatusReport, eta: float | None, rates: dict[str, Any]) -> None:
        from rich.console import Console
        from rich.live import Live

        body = renderable(status, eta, rates)
        if self._display is None:
            console = Console(file=self.stream)
            self._display = Live(body, console=console, auto_refresh=False, transient=False)
            self._display.start()
        self._display.update(body, refresh=True)


def _lane_words(lane: Lane, status: StatusReport) -> str:
    step = advice.lane_step(lane, status)
    if lane.running:
        words = f"lane {lane.lane}: {lane.running} running"
        doubts = render.unverified_words(status, lane.lane)
        if doubts:
            words += f", UNVERIFIED ({_without_seconds(doubts)})"
        what = advice.action_words(step)
        return f"{words}; next: {what}" if what else words
    if step.code == advice.DONE:
        return f"lane {lane.lane}: done"
    idle = (
        f"lane {lane.lane}: idle: {lane.reason.words}" if lane.reason else f"lane {lane.lane}: idle"
    )
    what = advice.action_words(step)
    if not what or (step.command is not None and step.command in idle):
        return idle  # the reason's words name the command already (no_worker's do)
    return f"{idle}; next: {what}"


def _without_seconds(words: str) -> str:
    """``worker w-1 stale for 12 s`` as ``worker w-1 stale``: a plain line changes with
    what is known, not with the clock."""
    return re.sub(r" for \d+ s\b", "", words)


_CLOCK_KEYS = {
    "generated_at",
    "elapsed_seconds",
    "idle_seconds",
    "heartbeat_age_seconds",
    "heartbeat_at",
    "per_hour",
    "unverified_because",
}


def _without_clock(value: Any) -> Any:
    """``value`` without the fields that change with the clock alone."""
    if isinstance(value, dict):
        return {k: _without_clock(v) for k, v in value.items() if k not in _CLOCK_KEYS}
    if isinstance(value, list):
        return [_without_clock(v) for v in value]
    return value


def renderable(status: StatusReport, eta: float | None, rates: dict[str, Any]) -> Any:
    """The rich renderable of one refresh (a function of its arguments: tests render it
    to text)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    run = status.run
    parts: list[Any] = []
    header = Text()
    header.append(f"run {run.id} ({run.name})", style="bold")
    header.append(f" — {run.state}")
    if not run.finished:  # a finished run has nothing left to estimate
        header.append(f" · ETA {render.duration(eta) if eta is not None else 'not measured yet'}")
    parts.append(header)
    controller = status.controller
    if run.finished:
        pass  # a finished run needs no controller: nothing said
    elif controller is not None and controller.state == "running":
        header.append(f" · controller pid {controller.pid}", style="dim")
    elif controller is not None:
        # Gone (or unknown): its own line, right under the run's.
        said = render.controller_line(status) or ""
        step = advice.report_step(status)
        alarm = step is not None and step.code == advice.NO_CONTROLLER
        parts.append(Text(render.clean(said), style="bold red" if alarm else "yellow"))
    for worker in status.workers:
        if worker.liveness in ("stale", "lost") and worker.state == "active":
            parts.append(
                Text(
                    render.clean(
                        f"worker {worker.worker_id} (node {worker.node}): "
                        f"{worker.liveness_words()} (heartbeat "
                        f"{render.duration(max(0.0, worker.heartbeat_age_seconds))} ago)"
                    ),
                    style="bold red" if worker.liveness == "lost" else "yellow",
                )
            )
    if status.unknown:
        box = Table.grid(padding=(0, 1))
        box.add_row(
            Text(
                f"UNKNOWN OUTCOMES — dispatch halted until reconciled ({len(status.unknown)})",
                style="bold red",
            )
        )
        for u in status.unknown:
            box.add_row(
                Text(
                    render.clean(f"  attempt {u.attempt_id} {u.item}.{u.stage}: {u.reason}"),
                    style="red",
                )
            )
            box.add_row(Text(f"    evidence: {u.evidence}", style="red"))
            box.add_row(Text(f"    resolve:  {u.reconcile}", style="bold red"))
        parts.append(box)
    for c in status.controls:
        where = c.scope + (f" {c.lane}" if c.lane else "")
        parts.append(
            Text(
                render.clean(f"{c.kind} ({where}) by {c.set_by}: {c.reason}"),
                style="yellow",
            )
        )
    step = advice.report_step(status)
    if step is not None:
        parts.append(Text(render.clean(f"next step: {step.line()}"), style="bold"))
    stages = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("stage", "progress", "done", "running", "ready", "waiting", "failed", "rate"):
        stages.add_column(column, justify="left" if column in ("stage", "progress") else "right")
    for row in progress_module.stage_progress(status):
        rate = rates.get(row.stage)
        stages.add_row(
            row.stage,
            ProgressBar(total=max(1, row.total), completed=row.done, width=30),
            f"{row.done}/{row.total}",
            str(row.running),
            str(row.ready),
            str(row.waiting),
            Text(str(row.failed), style="red" if row.failed else ""),
            "-" if rate is None else f"{rate:.1f}/min",
        )
    parts.append(stages)
    lanes = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("lane", "node", "now", "what to do"):
        lanes.add_column(column, overflow="fold")
    running_by_lane: dict[str, list[str]] = {}
    for attempt in status.running:
        running_by_lane.setdefault(attempt.lane, []).append(
            f"{attempt.item}.{attempt.stage} ({render.duration(attempt.elapsed_seconds)})"
        )
    for lane in status.lanes:
        step = advice.lane_step(lane, status)
        doubts = render.unverified_words(status, lane.lane) if lane.running else None
        if doubts:
            # Not known to run: never the running green.
            shown = ", ".join(running_by_lane.get(lane.lane, [])) or "running"
            now = Text(render.clean(f"UNVERIFIED {shown}: {doubts}"), style="bold magenta")
        elif lane.running:
            now = Text(", ".join(running_by_lane.get(lane.lane, [])) or "running", style="green")
        elif step.code == advice.DONE:
            now = Text("done", style="dim")
        elif lane.reason:
            now = Text(
                render.clean(f"idle {render.duration(lane.idle_seconds)}: {lane.reason.words}"),
                style="yellow",
            )
        else:
            now = Text(f"idle {render.duration(lane.idle_seconds)}", style="yellow")
        lanes.add_row(lane.lane, lane.node, now, render.clean(advice.action_words(step) or ""))
    parts.append(lanes)
    return Group(*parts)
