"""The live display on a real terminal: `laneway status --watch` and `laneway run` inside
tmux, read back as a user sees it (`tmux capture-pane`). The watch shows per stage a bar
and the counts, a lane's idle reason with the command that clears it, and, once an
attempt's outcome is unknown, that attempt first with its exact `laneway reconcile`
command; it redraws in place and Ctrl-C ends it cleanly, leaving the last frame. `laneway
run` shows the same display while its jobs run and leaves the finished state on screen.

``LANEWAY_TTY_CAPTURE``, when set, names a file that receives the watch's screen with the
unknown attempt (to look at what a user sees).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.test_cli_services import LANEWAY, ROOT, config_file, finish, spawn
from tests.integration.test_web import make_unknown, pipeline
from tests.support import GATE_BOUND, controller_serving, py_stage, wait_for_file, wait_until

TMUX = shutil.which("tmux")
WIDTH, HEIGHT = 160, 50
pytestmark = pytest.mark.skipif(TMUX is None, reason="no tmux on PATH (apt-get install tmux)")


class Tmux:
    """One tmux server of this test's own (its socket and config in ``directory``, so
    nothing is left behind), one session."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "tmux.sock"
        self.conf = directory / "tmux.conf"
        # A dead pane stays, with what its command left on the screen.
        self.conf.write_text(
            "set -g remain-on-exit on\nset -g history-limit 10000\nset -g default-shell /bin/sh\n"
        )
        # The command's exit status, as its shell saw it (tmux's own #{pane_dead_status}
        # is sometimes never filled in: its server misses the child's exit).
        self.status = directory / "tmux-exit-status"

    def tmux(self, *args: str) -> str:
        assert TMUX is not None
        # COLUMNS and LINES (pytest-xdist's workers set them) would override the
        # terminal's own size in what runs inside it.
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TMUX", "TMUX_PANE", "COLUMNS", "LINES")
        }
        done = subprocess.run(
            [TMUX, "-S", str(self.socket), "-f", str(self.conf), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"tmux {args}: {done.stderr}"
        return done.stdout

    def start(self, *argv: str) -> None:
        """Run ``argv`` in a detached WIDTH x HEIGHT terminal, in the repository root, with
        this test's ledger (on PostgreSQL, LANEWAY_DATABASE_URL names it)."""
        passed = [
            arg
            for name, value in os.environ.items()
            if name.startswith("LANEWAY_")
            for arg in ("-e", f"{name}={value}")
        ]
        self.tmux(
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            str(WIDTH),
            "-y",
            str(HEIGHT),
            "-c",
            str(ROOT),
            *passed,
            f"trap : INT; {shlex.join(argv)}; echo $? > {shlex.quote(str(self.status))}",
        )

    def screen(self, *, history: bool = False) -> str:
        """The pane's text as shown (with ``history``, what scrolled off too)."""
        return self.tmux("capture-pane", "-p", "-t", "t", *(["-S", "-"] if history else []))

    def exit_status(self) -> int | None:
        """The command's exit status once it has exited (128 + the signal that ended
        it), else None."""
        written = self.status.read_text() if self.status.exists() else ""
        return int(written) if written.endswith("\n") else None

    def kill(self) -> None:
        assert TMUX is not None
        subprocess.run(
            [TMUX, "-S", str(self.socket), "kill-server"],
            capture_output=True,
            timeout=60,
            check=False,
        )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, so the commands the display prints fit one line of
    the terminal (a long --runtime-dir wraps them, as it would for a user)."""
    path = Path(tempfile.mkdtemp(prefix="lw-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmux(short_dir: Path) -> Iterator[Tmux]:
    terminal = Tmux(short_dir)
    try:
        yield terminal
    finally:
        terminal.kill()


def shows(tmux: Tmux, check: Callable[[str], object]) -> str:
    """The screen, once ``check`` holds for it."""

    def shown() -> str | None:
        text = tmux.screen()
        return text if check(text) else None

    try:
        return wait_until(shown, 60)
    except AssertionError:
        raise AssertionError(f"never shown: {check}; the screen:\n{tmux.screen()}") from None


def now(text: str, lane: str = "a") -> str:
    """What the lanes table says ``lane`` does now ("" before it is shown)."""
    return lanes(text).get(lane, {}).get("now", "")


def todo(text: str, lane: str = "a") -> str:
    """The lanes table's next step for ``lane`` ("" if none, or before it is shown)."""
    return lanes(text).get(lane, {}).get("what to do", "")


def row(text: str, stage: str) -> list[str]:
    """The stage's row of the progress table: bar, done/total, running, ready, waiting,
    failed (not the rate, which moves with the clock); [] before it is shown."""
    found = [line.split() for line in text.splitlines() if line.split()[:1] == [stage]]
    return found[0][1:-1] if found else []


EMPTY = FULL = "━" * 30
HALF = "━" * 15 + "╺" + "━" * 14
"""A 30-column bar: none or all done (told apart only by colour), and half done."""


LANE_COLUMNS = ("lane", "node", "now", "what to do")


def lanes(text: str) -> dict[str, dict[str, str]]:
    """The lanes table as shown, by lane: each cell's text, its lines (a long cell folds
    onto the next lines of its column) joined by a space."""
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if line.split()[:2] == ["lane", "node"]]
    if not headers:
        return {}
    at = headers[0]
    starts = [lines[at].index(column) for column in LANE_COLUMNS]
    spans = list(zip(starts, [*starts[1:], None], strict=True))
    found: dict[str, dict[str, list[str]]] = {}
    cells: dict[str, list[str]] = {}
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        if line[: starts[1]].strip():
            cells = found.setdefault(line[: starts[1]].strip(), {c: [] for c in LANE_COLUMNS})
        for column, (begin, end) in zip(LANE_COLUMNS, spans, strict=True):
            part = line[begin:end].strip()
            if part:
                cells[column].append(part)
    return {lane: {c: " ".join(parts) for c, parts in row.items()} for lane, row in found.items()}


def test_watch_shows_progress_idle_reasons_and_unknown_attempts_first(tmux: Tmux, short_dir: Path):
    runtime, gate = pipeline(short_dir)
    rt = str(runtime.resolve())
    # As if a controller served the run (this process holds its lock and pidfile).
    serving = controller_serving(runtime)
    serving.__enter__()
    tmux.start(*LANEWAY, "status", "--watch", "--runtime-dir", str(runtime))
    worker = None
    try:
        # No worker yet: the lane is idle, says why, and gives the command that helps.
        text = shows(tmux, lambda text: "no live worker" in now(text))
        assert text.splitlines()[0].startswith("run 1 (web) — active · ETA")
        assert row(text, "only") == [EMPTY, "0/2", "0", "2", "0", "0"]
        lane = lanes(text)["a"]
        assert lane["node"] == "n1"
        assert re.fullmatch(r"idle .*: no_worker — no live worker on node n1; .*", lane["now"])
        start = f"laneway worker --node n1 --runtime-dir {rt}"
        assert lane["what to do"] == f"start a worker: {start}"
        assert "UNKNOWN" not in text

        worker = spawn("worker", "--node", "n1", "--runtime-dir", str(runtime))
        # x0 runs (it waits for the gate); x1 is ready: one slot.
        text = shows(tmux, lambda text: now(text).startswith("x0.only ("))
        assert row(text, "only") == [EMPTY, "0/2", "1", "1", "0", "0"]
        assert todo(text) == ""

        attempt = make_unknown(runtime)
        command = (
            f"laneway reconcile {attempt} --as succeeded|failed|not-run --reason '...' "
            f"--runtime-dir {rt}"
        )
        text = shows(tmux, lambda text: todo(text).startswith("reconcile the unknown attempt"))
        if os.environ.get("LANEWAY_TTY_CAPTURE"):
            Path(os.environ["LANEWAY_TTY_CAPTURE"]).write_text(text)
        lines = text.splitlines()
        # First, right under the run's line: the unknown attempt and how to resolve it.
        assert lines[0].startswith("run 1 (web) — active")
        assert lines[1] == "UNKNOWN OUTCOMES — dispatch halted until reconciled (1)"
        assert lines[2].startswith(f"  attempt {attempt} x0.only: lease expired")
        assert lines[3].startswith("    evidence: ")
        assert lines[4] == f"    resolve:  {command}"
        # Its job counts in no column; x1 waits ready; the lane is idle, and its next step
        # is that command, whatever refusal it recorded last (here the max_jobs one of
        # while x0 ran: its worker's slot is still taken, so no new refusal is recorded).
        assert row(text, "only") == [EMPTY, "0/2", "0", "1", "0", "0"]
        lane = lanes(text)["a"]
        assert re.fullmatch(r"idle .+: .+", lane["now"]), text
        assert lane["what to do"] == f"reconcile the unknown attempt: {command}"
        # Redrawn in place: one display on the screen, however many refreshes.
        assert text.count("run 1 (web)") == 1 and text.count("UNKNOWN OUTCOMES") == 1

        tmux.tmux("send-keys", "-t", "t", "C-c")
        assert wait_until(lambda: tmux.exit_status() is not None, 60)
        assert tmux.exit_status() == 130
        after = tmux.screen()
        assert "Traceback" not in after and "UNKNOWN OUTCOMES" in after  # the last frame stays
    finally:
        gate.touch()
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            finish(worker)
        serving.__exit__(None, None, None)


def test_run_shows_the_live_display_then_the_finished_state(tmux: Tmux, short_dir: Path):
    gates = short_dir / "gates"
    gates.mkdir()
    wait = wait_for_file(f"os.path.join({str(gates)!r}, sys.argv[1])")
    stages = [
        py_stage("prep", "pass"),
        py_stage("solve", wait, needs=["prep"], timeout_seconds=GATE_BOUND),
    ]
    config = config_file(short_dir, items=2, max_jobs=2, stages=stages)
    tmux.start(*LANEWAY, "run", str(config), "--runtime-dir", str(short_dir / "rt"))
    try:
        # Both items prepared; both solves run, each waiting for its gate.
        text = shows(tmux, lambda text: row(text, "solve")[1:3] == ["0/2", "2"])
        assert text.splitlines()[0].startswith("run 1 (svc) — active")
        assert row(text, "prep") == [FULL, "2/2", "0", "0", "0", "0"]
        assert row(text, "solve") == [EMPTY, "0/2", "2", "0", "0", "0"]
        assert sorted(re.findall(r"(x\d\.solve) \(", now(text))) == ["x0.solve", "x1.solve"]
        (gates / "x0").touch()
        # Redrawn as it moves: half the solves done, half the bar.
        text = shows(tmux, lambda text: row(text, "solve")[1:3] == ["1/2", "1"])
        assert row(text, "solve") == [HALF, "1/2", "1", "0", "0", "0"]
        assert re.fullmatch(r"x1\.solve \(.+\)", now(text)), text
    finally:
        for item in ("x0", "x1"):
            (gates / item).touch()
    assert wait_until(lambda: tmux.exit_status() is not None, 120)
    text = tmux.screen(history=True)
    assert tmux.exit_status() == 0, text
    assert "Traceback" not in text
    # Redrawn in place: no earlier frame is left in the scrollback. The last frame stays,
    # every job and the lane done, above the final status that follows it.
    assert "run 1 (svc) — active" not in text, text
    finished = [line for line in text.splitlines() if line.startswith("run 1 (svc) — finished")]
    assert len(finished) == 2, text
    assert finished[0].rstrip() == "run 1 (svc) — finished"  # nothing left: no ETA
    assert finished[1].startswith("run 1 (svc) — finished; started")
    assert row(text, "prep") == [FULL, "2/2", "0", "0", "0", "0"]
    assert row(text, "solve") == [FULL, "2/2", "0", "0", "0", "0"]
    assert lanes(text)["a"] == {"lane": "a", "node": "n1", "now": "done", "what to do": ""}
