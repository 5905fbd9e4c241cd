"""No paid re-run without a yes, anywhere (issue 46 item 3): `laneway run CONFIG` and
`laneway start-pipeline CONFIG`, with or without --new, whose plan would run a paid
stage's jobs again refuse off a terminal and with --json (exit 2, nothing created)
unless --yes, and ask on one; a first run, and one that pays nothing again, start as
before; `--reuse-despite STAGE` keeps a stage's earlier results through a deliberate edit
of its files, recorded in the run.

Real CLI; the paid stage appends one line per call to a provider log (the paid-call
counter) and reports its usage in its result, so a re-payment shows as more lines.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import BOUND, LANEWAY, ROOT

SOLVE = """import json, os, sys
item, calls = sys.argv[1:3]
with open(calls, 'a') as handle:
    handle.write(item + chr(10))
with open(os.environ['LANEWAY_RESULT_PATH'], 'w') as handle:
    json.dump({'job_id': os.environ['LANEWAY_JOB_ID'], 'usage': {'cost_usd': 0.02}}, handle)
"""
JUDGE = """import sys
item, count = sys.argv[1:3]
open(count, 'a').write('judge ' + item + chr(10))
"""


def paid_pipeline(tmp_path: Path, items: int = 3) -> Path:
    """solve (paid: each call a line in calls.log, usage cost_usd 0.02, no
    expected_usage: its cost is known only from what earlier attempts reported) ->
    judge (free: a line in count.txt), two scripts their argv names."""
    (tmp_path / "solve.py").write_text(SOLVE)
    (tmp_path / "judge.py").write_text(JUDGE)
    calls, count = tmp_path / "calls.log", tmp_path / "count.txt"
    py = sys.executable
    body = {
        "name": "paid",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {"name": "solve", "argv": [py, "solve.py", "{item}", str(calls)], "cwd": "."},
            {
                "name": "judge",
                "needs": ["solve"],
                "argv": [py, "judge.py", "{item}", str(count)],
                "cwd": ".",
            },
        ],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(1, items + 1)],
    }
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(body))
    return path


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def sql(runtime: Path, query: str) -> list[dict[str, Any]]:
    result = invoke("sql", query, "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def runs(runtime: Path) -> int:
    return int(sql(runtime, "SELECT COUNT(*) AS n FROM runs")[0]["n"])


def detail(value: Any) -> dict[str, Any]:
    """An event's detail as `laneway sql --json` gives it: JSON text on SQLite, an
    object on PostgreSQL."""
    loaded = value if isinstance(value, dict) else json.loads(value)
    assert isinstance(loaded, dict)
    return loaded


def edit(script: Path) -> None:
    """A cosmetic edit: a comment (the script computes the same)."""
    script.write_text(script.read_text() + "# a comment\n")


def run_json(config: Path, runtime: Path, *extra: str) -> Any:
    return invoke("run", str(config), "--runtime-dir", str(runtime), "--json", "--quiet", *extra)


def test_a_new_run_that_would_pay_again_refuses_off_a_terminal_unless_yes(tmp_path):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    calls = tmp_path / "calls.log"
    assert run_json(config, runtime).exit_code == 0
    assert len(lines(calls)) == 3
    edit(tmp_path / "solve.py")

    # The command, as cron or CI runs it: stdin /dev/null, no terminal.
    refused = subprocess.run(
        [*LANEWAY, "run", str(config), *rt, "--new"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BOUND,
        cwd=ROOT,
    )
    assert refused.returncode == 2, refused.stderr
    assert "  solve  run 3 paid (3 solve.py changed)" in refused.stderr  # the plan first
    words = [line for line in refused.stderr.splitlines() if line.startswith("laneway: ")]
    assert len(words) == 1
    assert "not started, nothing was created" in words[0]
    assert "solve: 3 ran before (3 solve.py changed)" in words[0]
    assert "expected spend cost_usd 0.06 (0.02 per job: p90 of 3 earlier attempt(s))" in words[0]
    assert "--yes" in words[0] and "--reuse-despite STAGE" in words[0]
    assert runs(runtime) == 1 and len(lines(calls)) == 3

    # --json refuses the same, as one JSON object.
    as_json = run_json(config, runtime, "--new")
    assert as_json.exit_code == 2, as_json.output
    body = json.loads(as_json.stdout)
    assert body["ok"] is False and "solve: 3 ran before" in body["problems"][0]
    # start-pipeline --new too (it has --yes now).
    started = invoke("start-pipeline", str(config), *rt, "--new", "--no-controller")
    assert started.exit_code == 2, started.output
    assert "solve: 3 ran before (3 solve.py changed)" in started.stderr
    assert runs(runtime) == 1 and len(lines(calls)) == 3

    # --yes pays, knowingly.
    assert run_json(config, runtime, "--new", "--yes").exit_code == 0
    assert runs(runtime) == 2 and len(lines(calls)) == 6


def test_reuse_despite_keeps_the_earlier_results_and_is_recorded(tmp_path):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    calls, count = tmp_path / "calls.log", tmp_path / "count.txt"
    assert run_json(config, runtime).exit_code == 0
    edit(tmp_path / "solve.py")

    plan = invoke("plan", str(config), *rt, "--reuse-despite", "solve", "--json")
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.stdout)
    stages = {s["stage"]: s for s in planned["stages"]}
    assert stages["solve"]["reuse"] == 3 and stages["solve"]["run"] == 0
    assert stages["solve"]["reuse_despite"] == {"solve.py changed": 3}
    # judge needs solve: kept with it (its own files did not change).
    assert stages["judge"]["reuse"] == 3
    assert stages["judge"]["reuse_despite"] == {"solve reused despite its changes": 3}
    assert planned["reuse_despite"] == ["solve"] and planned["reruns_paid_work"] is False
    text = invoke("plan", str(config), *rt, "--reuse-despite", "solve")
    assert "  solve  reuse 3 (from run 1; 3 despite solve.py changed: --reuse-despite)" in (
        text.stdout
    )

    # Off a terminal, no --yes needed: nothing paid runs again.
    done = run_json(config, runtime, "--new", "--reuse-despite", "solve")
    assert done.exit_code == 0, done.output
    assert len(lines(calls)) == 3 and len(lines(count)) == 3
    created = sql(runtime, "SELECT detail FROM events WHERE kind = 'run_created' AND run_id = 2")
    assert detail(created[0]["detail"])["reuse_despite"] == ["solve"]
    reused = sql(
        runtime,
        "SELECT j.stage, j.state_reason, e.detail FROM jobs j JOIN events e ON "
        "e.job_id = j.id AND e.kind = 'job_reused' WHERE j.run_id = 2 ORDER BY j.id",
    )
    assert len(reused) == 6
    solve = [row for row in reused if row["stage"] == "solve"]
    assert all(detail(row["detail"])["despite"] == "solve.py changed" for row in solve)
    assert all(
        row["state_reason"].startswith("reused despite a change (--reuse-despite solve)")
        for row in solve
    )
    # The edit is the baseline now: the next plan reuses without the flag.
    again = json.loads(invoke("plan", str(config), *rt, "--json").stdout)
    assert {s["stage"]: s["reuse"] for s in again["stages"]} == {"solve": 3, "judge": 3}


def test_a_new_run_that_re_runs_no_paid_stage_starts_without_asking(tmp_path):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    calls, count = tmp_path / "calls.log", tmp_path / "count.txt"
    assert run_json(config, runtime).exit_code == 0
    edit(tmp_path / "judge.py")
    done = run_json(config, runtime, "--new")
    assert done.exit_code == 0, done.output
    assert len(lines(calls)) == 3 and len(lines(count)) == 6
    # New items of a paid stage are not a re-run either.
    body = json.loads(config.read_text())
    body["items"].append({"key": "x9", "lane": "a"})
    config.write_text(json.dumps(body))
    assert run_json(config, runtime, "--new").exit_code == 0
    assert lines(calls)[3:] == ["x9"]


def test_reuse_despite_names_a_stage_of_the_config(tmp_path):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    for command in (["run", "--new"], ["start-pipeline", "--new"], ["plan"]):
        result = invoke(
            command[0], str(config), *command[1:], "--runtime-dir", str(runtime),
            "--reuse-despite", "solv",
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [
            "laneway: --reuse-despite: 'solv' is not a stage of 'paid'; name one of solve, judge"
        ]
    clash = invoke(
        "plan", str(config), "--runtime-dir", str(runtime),
        "--reuse-despite", "solve", "--rerun", "solve",
    )  # fmt: skip
    assert clash.exit_code == 2
    assert "--reuse-despite solve and --rerun solve contradict" in clash.stderr
    assert not runtime.exists()


def on_a_terminal(args: list[str], answer: str) -> tuple[int, str]:
    """Run laneway with stdin and stderr on a pseudo-terminal; answer its question
    once it is asked (a handshake on the prompt), return the exit code and the screen."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [*LANEWAY, *args], stdin=slave, stdout=subprocess.PIPE, stderr=slave, cwd=ROOT
    )
    os.close(slave)
    screen, answered = b"", False
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the terminal (EIO)
                break
            if not chunk:
                break
            screen += chunk
        if not answered and b"start it?" in screen:
            os.write(master, answer.encode() + b"\n")
            answered = True
        if process.poll() is not None and not ready:
            break
    os.close(master)
    out, _ = process.communicate(timeout=BOUND)
    return process.returncode, screen.decode(errors="replace") + out.decode(errors="replace")


def test_on_a_terminal_start_pipeline_new_asks_first(tmp_path):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    assert run_json(config, runtime).exit_code == 0
    edit(tmp_path / "solve.py")
    args = ["start-pipeline", str(config), "--runtime-dir", str(runtime), "--new"]
    code, screen = on_a_terminal([*args, "--no-controller"], "n")
    assert code == 2, screen
    assert "solve: 3 ran before (3 solve.py changed)" in screen and "start it?" in screen
    assert runs(runtime) == 1
    code, screen = on_a_terminal([*args, "--no-controller"], "y")
    assert code == 0, screen
    assert runs(runtime) == 2 and len(lines(tmp_path / "calls.log")) == 3  # created, not run


def plain_run(config: Path, runtime: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`laneway run CONFIG` as cron runs it: no --new, stdin /dev/null, no terminal."""
    return subprocess.run(
        [*LANEWAY, "run", str(config), "--runtime-dir", str(runtime), *extra],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BOUND,
        cwd=ROOT,
    )


def test_a_plain_run_after_a_finished_one_that_would_pay_again_refuses_unless_yes(tmp_path):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    calls = tmp_path / "calls.log"
    assert run_json(config, runtime).exit_code == 0
    edit(tmp_path / "solve.py")

    # Run 1 is finished, so no "unfinished run" refusal: the plan is what stops it.
    refused = plain_run(config, runtime)
    assert refused.returncode == 2, refused.stderr
    assert "  solve  run 3 paid (3 solve.py changed)" in refused.stderr  # the plan first
    words = [line for line in refused.stderr.splitlines() if line.startswith("laneway: ")]
    assert len(words) == 1
    assert words[0].startswith("laneway: not started, nothing was created: ")
    assert "solve: 3 ran before (3 solve.py changed)" in words[0] and "--yes" in words[0]
    assert runs(runtime) == 1 and len(lines(calls)) == 3

    as_json = run_json(config, runtime)
    assert as_json.exit_code == 2, as_json.output
    assert "solve: 3 ran before (3 solve.py changed)" in json.loads(as_json.stdout)["problems"][0]
    rt = ["--runtime-dir", str(runtime), "--no-controller"]
    started = invoke("start-pipeline", str(config), *rt)
    assert started.exit_code == 2, started.output
    assert "solve: 3 ran before (3 solve.py changed)" in started.stderr
    assert runs(runtime) == 1 and len(lines(calls)) == 3

    paid = plain_run(config, runtime, "--yes")
    assert paid.returncode == 0, paid.stderr
    assert "plan of a new run" not in paid.stderr
    assert runs(runtime) == 2 and len(lines(calls)) == 6


def test_a_first_run_and_a_plain_run_that_pays_nothing_again_start_as_before(tmp_path, monkeypatch):
    config = paid_pipeline(tmp_path)
    runtime = tmp_path / "rt"
    calls, count = tmp_path / "calls.log", tmp_path / "count.txt"
    first = plain_run(config, runtime)
    assert first.returncode == 0, first.stderr
    assert "plan of a new run" not in first.stderr and "laneway: " not in first.stderr
    assert len(lines(calls)) == 3

    edit(tmp_path / "judge.py")  # free work runs again; nothing paid does
    again = plain_run(config, runtime)
    assert again.returncode == 0, again.stderr
    assert "plan of a new run" not in again.stderr and "laneway: " not in again.stderr
    assert runs(runtime) == 2 and len(lines(calls)) == 3 and len(lines(count)) == 6

    # The plan costs hashes and reuse lookups (one read of the runs table comes first):
    # a pipeline's first run in a ledger that holds other pipelines' runs, and a start
    # refused because the pipeline has an unfinished run (exit 1, as before), never
    # compute it.
    def no_plan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the plan was computed")

    monkeypatch.setattr("laneway.controller.run_plan.build_plan", no_plan)
    other = json.loads(config.read_text())
    other["name"] = "other"
    (tmp_path / "other.json").write_text(json.dumps(other))
    rt = ["--runtime-dir", str(runtime), "--no-controller"]
    assert invoke("start-pipeline", str(tmp_path / "other.json"), *rt).exit_code == 0
    unfinished = invoke("start-pipeline", str(tmp_path / "other.json"), *rt)
    assert unfinished.exit_code == 1, unfinished.output
    assert "has an unfinished run in this ledger (run 3)" in unfinished.stderr
    assert runs(runtime) == 3 and len(lines(calls)) == 3
