"""`make demo`: run the demo pipeline end to end on SQLite, then show what happened.

Starts from a fresh runtime dir (.demo-runtime/), runs `laneway run`, prints the final
status, checks the paid-call log against the ledger (one line per succeeded solve, no
key twice), and shows how to open the ledger with sqlite3.

The run's budget stops it before its last paid call: `laneway run` ends with exit code 3
(blocked: the run is paused, reason `budget`), which is the demo's expected end; any
other early end is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RUNTIME = ROOT / ".demo-runtime"
LANEWAY = Path(sys.executable).parent / "laneway"
EXIT_BLOCKED = 3
"""`laneway run`'s exit code for a run that cannot go on without an operator."""


def main() -> int:
    if RUNTIME.exists():
        shutil.rmtree(RUNTIME)
    RUNTIME.mkdir()
    paid_calls = RUNTIME / "paid_calls.jsonl"
    env = {
        **os.environ,
        # A stand-in credential: laneway resolves ${DEMO_API_KEY} at spawn time and never
        # stores it; real ones come from your environment or a secret manager.
        "DEMO_API_KEY": os.environ.get("DEMO_API_KEY", "demo-not-a-real-key-7f3a9c"),
        "DEMO_PAID_CALLS": str(paid_calls),
    }
    command = [str(LANEWAY), "run", str(HERE / "pipeline.toml"), "--runtime-dir", str(RUNTIME)]
    print("$ " + " ".join(command), flush=True)
    code = subprocess.call(command, env=env)
    ledger = RUNTIME / "ledger.sqlite3"
    pause = budget_pause(ledger) if code == EXIT_BLOCKED else None
    if code != 0 and pause is None:
        print(f"demo: laneway run exited {code}", file=sys.stderr)
        return code
    lines = [json.loads(line) for line in paid_calls.read_text().splitlines() if line.strip()]
    keys = [line["idempotency_key"] for line in lines]
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        succeeded = {
            row[0]
            for row in db.execute(
                "SELECT a.idempotency_key FROM attempts a JOIN jobs j ON j.id = a.job_id "
                "WHERE j.stage = 'solve' AND a.outcome = 'succeeded'"
            )
        }
    print()
    print(
        f"paid calls: {len(lines)} lines, {len(set(keys))} distinct idempotency keys, "
        f"{len(succeeded)} succeeded solve attempts"
    )
    ok = len(keys) == len(set(keys)) and set(keys) == succeeded
    print(
        "paid-call check: "
        + (
            "OK — every real call is one succeeded attempt, none twice"
            if ok
            else "MISMATCH — see " + str(paid_calls)
        )
    )
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        spent = db.execute(
            "SELECT COALESCE(SUM(value), 0) FROM attempt_usage WHERE key = 'cost_usd'"
        ).fetchone()[0]
    print(f"spent: ${spent:.2f} of the run's $2.60 budget")
    if pause is not None:
        print(f"stopped by its budget, as designed: {pause}")
    print()
    print("Look around:")
    shown = LANEWAY.relative_to(ROOT) if LANEWAY.is_relative_to(ROOT) else LANEWAY
    print(f"  {shown} status --runtime-dir {RUNTIME.relative_to(ROOT)}")
    print(f"  sqlite3 {ledger.relative_to(ROOT)} 'SELECT * FROM v_job_current'")
    print(f"  sqlite3 {ledger.relative_to(ROOT)} 'SELECT id, kind, job_id, detail FROM events'")
    print(f"  {shown} artifacts 1 --runtime-dir {RUNTIME.relative_to(ROOT)}")
    print(f"  {shown} report 1 --yield useful_tokens --runtime-dir {RUNTIME.relative_to(ROOT)}")
    print(f"  ls {RUNTIME.relative_to(ROOT)}/runs/1/jobs/i07.solve/attempt-1/")
    print(f"  ls {RUNTIME.relative_to(ROOT)}/runs/1/jobs/i01.judge/attempt-1/inputs/solve/")
    print("  (the tables and views are documented in docs/ledger.md)")
    return 0 if ok else 1


def budget_pause(ledger: Path) -> str | None:
    """The reason of the run's active pause when its budget set it, else None."""
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        row = db.execute(
            "SELECT reason FROM controls WHERE kind = 'pause' AND cleared_at IS NULL "
            "AND reason LIKE 'nothing more fits the budget%' ORDER BY id DESC LIMIT 1"
        ).fetchone()
    return None if row is None else str(row[0])


if __name__ == "__main__":
    sys.exit(main())
