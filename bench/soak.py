"""Random-kill soak: SIGKILL workers, supervisors and the controller at random moments
while a pipeline of side-effect-counting jobs runs; restart them; reconcile unknowns
from the side-effect file (the ground truth); then check the promises.

    .venv/bin/python bench/soak.py --kills 300 [--items 80] [--seed 1]

Each job appends its idempotency key to one file (O_APPEND + fsync) before doing its
"work", so a duplicate execution shows as a key written twice. Checks at the end:

- 0 duplicate executions per key;
- 0 lost outcomes: every attempt settled (with evidence, or unknown-then-reconciled);
- 0 unknowns settled without a reconcile (every unknown has an operator event);
- every item's job finally succeeded; ``PRAGMA integrity_check`` is ok.

Prints the figures; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

JOB = """
import json, os, random, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.write(fd, (os.environ["LANEWAY_IDEMPOTENCY_KEY"] + "\\n").encode())
os.fsync(fd)
time.sleep(random.uniform(0.05, 0.4))
held = time.monotonic()
while os.path.exists(sys.argv[2]) and time.monotonic() - held < HOLD_SECONDS:
    time.sleep(0.05)
with open(os.environ["LANEWAY_RESULT_PATH"], "w") as f:
    json.dump({"job_id": os.environ["LANEWAY_JOB_ID"]}, f)
"""


# While the soak still owes kills, a job waits (at most this long) after its side effect,
# so the run cannot finish before every kill has landed on live work: 40 items on 4 slots
# take at least 50 s held, where 30 kills take about 15 s.
HOLD_SECONDS = 5.0


def write_config(root: Path, items: int) -> Path:
    (root / "job.py").write_text(f"HOLD_SECONDS = {HOLD_SECONDS}\n" + JOB)
    config = {
        "name": "soak",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 4}],
        "lanes": [{"name": "a", "node": "n1"}, {"name": "b", "node": "n1"}],
        "stages": [
            {
                "name": "paid",
                "argv": [
                    sys.executable,
                    str(root / "job.py"),
                    str(root / "side-effects.log"),
                    str(root / "hold"),
                ],
                "timeout_seconds": 60,
            }
        ],
        "items": [{"key": f"i{n:04d}", "lane": "ab"[n % 2]} for n in range(items)],
    }
    path = root / "soak.json"
    path.write_text(json.dumps(config))
    return path


class Fleet:
    """The worker and controller processes, restartable."""

    def __init__(self, runtime: Path, log: Path) -> None:
        self.runtime = runtime
        self.log = log
        self.worker: subprocess.Popen[bytes] | None = None
        self.controller: subprocess.Popen[bytes] | None = None

    def _start(self, *args: str) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "laneway", *args, "--runtime-dir", str(self.runtime)],
                stdout=log,
                stderr=log,
            )

    def ensure(self) -> None:
        if self.worker is None or self.worker.poll() is not None:
            self.worker = self._start("worker", "--node", "n1", "--slots", "4")
        if self.controller is None or self.controller.poll() is not None:
            self.controller = self._start("controller", "--interval", "0.1")

    def stop(self) -> None:
        for process in (self.worker, self.controller):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (self.worker, self.controller):
            if process is not None:
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def supervisors(runtime: Path) -> list[psutil.Process]:
    """The runtime's supervisors: exec'd ones name it in their command line; ones forked
    by a worker's launcher carry the launcher's command line but work in their attempt
    directory (the launcher itself works in /)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if "laneway.workers.supervisor" not in cmdline:
            continue
        try:
            forked = process.cwd().startswith(str(runtime) + os.sep)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if forked or str(runtime) in " ".join(cmdline):
            found.append(process)
    return found


def attempt_processes_alive(attempt_id: int, attempt_dir: str) -> bool:
    """Is any process (supervisor or job) of this attempt still running? Jobs and exec'd
    supervisors carry the attempt's id in their environment; a forked supervisor works
    in the attempt's directory."""
    for process in psutil.process_iter():
        try:
            if (
                process.environ().get("LANEWAY_ATTEMPT_ID") == str(attempt_id)
                or process.cwd() == attempt_dir
            ):
                return process.status() != psutil.STATUS_ZOMBIE
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return False


def side_effects(root: Path) -> Counter[str]:
    path = root / "side-effects.log"
    return Counter(path.read_text().split()) if path.exists() else Counter()


def query(ledger: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows from the ledger: the runtime dir's SQLite file, or the PostgreSQL database
    LANEWAY_DATABASE_URL names (where ``PRAGMA integrity_check`` reads as ``ok``)."""
    url = os.environ.get("LANEWAY_DATABASE_URL", "")
    if url.startswith("postgresql"):
        if sql.startswith("PRAGMA integrity_check"):
            return [("ok",)]  # PostgreSQL checks its own pages; there is no such pragma
        import psycopg

        with psycopg.connect(url.replace("+psycopg", "")) as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=30) as db:
        return db.execute(sql).fetchall()


def reconcile_unknowns(runtime: Path, root: Path, counts: Counter[str]) -> None:
    """The operator's part: settle each unknown from the ground truth, once none of its
    processes is left (an orphaned job could still be about to run)."""
    ledger = runtime / "ledger.sqlite3"
    for attempt_id, key, attempt_dir in query(
        ledger, "SELECT id, idempotency_key, attempt_dir FROM attempts WHERE state = 'unknown'"
    ):
        if attempt_processes_alive(attempt_id, attempt_dir):
            continue
        ran = key in side_effects(root)
        verdict = "succeeded" if ran else "not-run"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "laneway",
                "reconcile",
                str(attempt_id),
                "--as",
                verdict,
                "--reason",
                "soak: side-effect file is the ground truth",
                "--runtime-dir",
                str(runtime),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0:
            counts[f"reconciled_{verdict}"] += 1


def soak(kills: int, items: int, seed: int, root: Path, say=print) -> dict[str, Any]:
    rng = random.Random(seed)
    runtime = root / "runtime"
    config = write_config(root, items)
    hold = root / "hold"
    hold.touch()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "laneway",
            "start-pipeline",
            str(config),
            "--runtime-dir",
            str(runtime),
            "--no-controller",
        ],
        check=True,
        capture_output=True,
    )
    fleet = Fleet(runtime, root / "fleet.log")
    counts: Counter[str] = Counter()
    ledger = runtime / "ledger.sqlite3"
    started = time.monotonic()
    try:
        fleet.ensure()
        while True:
            finished = query(ledger, "SELECT state FROM runs")[0][0] == "finished"
            if finished:
                break
            if counts["kills"] >= kills:
                hold.unlink(missing_ok=True)
            if counts["kills"] < kills:
                before = counts["kills"]
                time.sleep(rng.uniform(0.05, 0.6))
                victim = rng.choice(["worker", "worker", "supervisor", "supervisor", "controller"])
                if victim == "supervisor":
                    running = supervisors(runtime)
                    if running:
                        rng.choice(running).send_signal(signal.SIGKILL)
                        counts["kills"] += 1
                        counts["kill_supervisor"] += 1
                else:
                    process = fleet.worker if victim == "worker" else fleet.controller
                    if process is not None and process.poll() is None:
                        process.send_signal(signal.SIGKILL)
                        process.wait()
                        counts["kills"] += 1
                        counts[f"kill_{victim}"] += 1
                if counts["kills"] != before and counts["kills"] % 25 == 0:
                    say(f"  {counts['kills']} kills ...")
            else:
                time.sleep(0.2)
            fleet.ensure()
            reconcile_unknowns(runtime, root, counts)
            if time.monotonic() - started > 3600:
                raise TimeoutError("soak did not finish within an hour")
    finally:
        hold.unlink(missing_ok=True)
        fleet.stop()
    effects = side_effects(root)
    attempts = query(ledger, "SELECT idempotency_key, state, outcome FROM attempts")
    unknown_events = query(ledger, "SELECT COUNT(*) FROM events WHERE kind = 'attempt_unknown'")
    reconcile_events = query(
        ledger,
        "SELECT COUNT(*) FROM events WHERE kind = 'attempt_settled' "
        "AND CAST(detail AS TEXT) LIKE '%reconciled_as%'",
    )
    jobs = dict(query(ledger, "SELECT state, COUNT(*) FROM jobs GROUP BY state"))
    integrity = query(ledger, "PRAGMA integrity_check")[0][0]
    succeeded_without_evidence = [
        key for key, state, outcome in attempts if outcome == "succeeded" and key not in effects
    ]
    report = {
        "kills": counts["kills"],
        "kills_by_kind": {k[5:]: v for k, v in counts.items() if k.startswith("kill_")},
        "attempts": len(attempts),
        "unknown": unknown_events[0][0],
        "reconciled": {k[11:]: v for k, v in counts.items() if k.startswith("reconciled_")},
        "duplicate_executions": sum(1 for n in effects.values() if n > 1),
        "lost_outcomes": sum(1 for _, state, _ in attempts if state != "settled"),
        "unknown_settled_without_reconcile": unknown_events[0][0] - reconcile_events[0][0],
        "succeeded_without_side_effect": len(succeeded_without_evidence),
        "jobs": jobs,
        "integrity_check": integrity,
        "seconds": round(time.monotonic() - started, 1),
    }
    report["ok"] = (
        report["duplicate_executions"] == 0
        and report["lost_outcomes"] == 0
        and report["unknown_settled_without_reconcile"] == 0
        and report["succeeded_without_side_effect"] == 0
        and jobs == {"succeeded": items}
        and integrity == "ok"
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description="random-kill soak for laneway")
    parser.add_argument("--kills", type=int, default=300)
    parser.add_argument("--items", type=int, default=80)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laneway-soak-") as tmp:
        report = soak(args.kills, args.items, args.seed, Path(tmp))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.pop("LANEWAY_CRASH_POINT", None)
    sys.exit(main())
