"""`retry` on a run whose frozen sources changed is refused before anything moves, with
the new run to start instead and how many succeeded jobs it reuses; an unchanged source
retries as before; `runs` shows a run a later run of its pipeline superseded. Real
`laneway run`s through the CLI, on every backend."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from tests.integration.test_cli import invoke

FAILING = "import sys\nsys.exit(1)\n"
FIXED = "import sys\nsys.exit(0)\n"
BY_FLAG = "import os, sys\nsys.exit(1 if os.path.exists(sys.argv[2]) else 0)\n"


def pipeline(tmp_path: Path, judge: str, *extra: str) -> tuple[Path, Path]:
    """A config of three items through `prepare` (succeeds) and `judge`, which runs
    code/judge.py (frozen with the run: its argv names it); the config and judge.py."""
    code = tmp_path / "code"
    code.mkdir()
    script = code / "judge.py"
    script.write_text(judge)
    body = {
        "name": "judged",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [
            {"name": "prepare", "argv": [sys.executable, "-c", "pass"], "timeout_seconds": 60},
            {
                "name": "judge",
                "argv": [sys.executable, "judge.py", "{item}", *extra],
                "cwd": str(code),
                "needs": ["prepare"],
                "timeout_seconds": 60,
            },
        ],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(1, 4)],
    }
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(body))
    return config, script


def sql(rt: list[str], query: str) -> list[dict[str, Any]]:
    result = invoke("sql", query, *rt, "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def ledger_state(rt: list[str]) -> tuple[Any, ...]:
    """Everything a retry would move: job states and fences, runs, events, controls."""
    return (
        sql(rt, "SELECT id, state, fence FROM jobs ORDER BY id"),
        sql(rt, "SELECT id, state FROM runs ORDER BY id"),
        sql(rt, "SELECT COUNT(*) AS n, MAX(id) AS last FROM events"),
        sql(rt, "SELECT COUNT(*) AS n FROM controls"),
    )


def job_states(rt: list[str], run: int) -> dict[str, int]:
    rows = sql(
        rt,
        f"SELECT stage, state, COUNT(*) AS n FROM jobs WHERE run_id = {run} GROUP BY stage, state",
    )
    return {f"{row['stage']}:{row['state']}": row["n"] for row in rows}


def test_retry_after_a_source_changed_is_refused_and_names_the_new_run(tmp_path: Path):
    config, script = pipeline(tmp_path, FAILING)
    runtime = tmp_path / "rt"
    rt = ["--runtime-dir", str(runtime)]
    first = invoke("run", str(config), *rt, "--json")
    assert first.exit_code == 0, first.output
    assert job_states(rt, 1) == {"judge:failed": 3, "prepare:succeeded": 3}
    before = ledger_state(rt)

    script.write_text(FIXED)  # the fix: judge.py is one of the run's frozen sources
    bulk = invoke("retry", "--run", "1", "--stage", "judge", "--reason", "fixed", *rt)
    assert bulk.exit_code == 1, bulk.output
    assert "Traceback" not in bulk.output
    lines = bulk.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("laneway: ") for line in lines)
    assert "not retried, nothing was changed" in lines[0]
    assert str(script) in lines[0]
    # The run recorded its config's path: the command runs as printed.
    command = f"laneway run {config.resolve()} --new --runtime-dir {runtime}"
    assert lines[1].endswith(f"reuses 3 succeeded job(s)): {command}"), lines[1]

    one = invoke("retry", "x1.judge", "--run", "1", "--reason", "fixed", *rt, "--json")
    assert one.exit_code == 1, one.output
    body = json.loads(one.stdout)
    assert (body["ok"], body["error"], body["run_id"]) == (False, "SourcesChanged", 1)
    assert body["files"] == [str(script)]
    assert body["changes"][0]["sha256"] != body["changes"][0]["frozen_sha256"]
    assert (body["command"], body["reused"]) == (command, 3)
    assert body["problems"] == [line.removeprefix("laneway: ") for line in lines]
    assert ledger_state(rt) == before  # nothing moved: jobs, runs, events, controls

    # `explain` on a failed job says the same before anything moves: no retry command.
    explained = invoke("explain", "x1.judge", "--run", "1", *rt)
    assert explained.exit_code == 0, explained.output
    assert "laneway retry" not in explained.stdout
    assert f"a retry cannot work: the run's frozen sources changed ({script})" in explained.stdout
    assert explained.stdout.rstrip().endswith(command)
    as_json = json.loads(invoke("explain", "x1.judge", "--run", "1", *rt, "--json").stdout)
    assert as_json["retry"]["sources_changed"] == [str(script)]
    assert as_json["retry"]["command"] == command
    assert ledger_state(rt) == before

    # The one step it names works as printed, and reuses what it said.
    new = invoke(*shlex.split(command)[1:], "--json")
    assert new.exit_code == 0, new.output
    assert job_states(rt, 2) == {"judge:succeeded": 3, "prepare:succeeded": 3}
    reused = sql(rt, "SELECT COUNT(*) AS n FROM jobs WHERE run_id = 2 AND reused_from IS NOT NULL")
    assert reused == [{"n": 3}]


def test_retry_with_unchanged_sources_moves_the_jobs_as_before(tmp_path: Path):
    flag = tmp_path / "broken"
    flag.write_text("")
    config, script = pipeline(tmp_path, BY_FLAG, str(flag))
    rt = ["--runtime-dir", str(tmp_path / "rt")]
    assert invoke("run", str(config), *rt, "--json").exit_code == 0
    assert job_states(rt, 1) == {"judge:failed": 3, "prepare:succeeded": 3}

    flag.unlink()  # the cause was outside the frozen sources
    script.write_text(BY_FLAG)  # rewritten with the same bytes: no change
    retried = invoke("retry", "--run", "1", "--stage", "judge", "--reason", "fixed", *rt, "--json")
    assert retried.exit_code == 0, retried.output
    assert len(json.loads(retried.stdout)["retried"]) == 3
    assert job_states(rt, 1) == {"judge:ready": 3, "prepare:succeeded": 3}
    finished = invoke("run", "--continue", "1", *rt, "--json")
    assert finished.exit_code == 0, finished.output
    assert job_states(rt, 1) == {"judge:succeeded": 3, "prepare:succeeded": 3}


def test_runs_shows_an_unfinished_run_a_later_run_superseded(tmp_path: Path):
    config, _ = pipeline(tmp_path, FIXED)
    rt = ["--runtime-dir", str(tmp_path / "rt")]
    started = invoke("start-pipeline", str(config), *rt, "--no-controller")
    assert started.exit_code == 0, started.output
    halted = invoke("halt", "1", "--reason", "as in issue 46", *rt)
    assert halted.exit_code == 0, halted.output  # run 1: active and halted, for good
    assert invoke("run", str(config), "--new", *rt, "--json").exit_code == 0  # run 2
    assert invoke("run", str(config), "--new", *rt, "--json").exit_code == 0  # run 3

    listed = json.loads(invoke("runs", *rt, "--json").stdout)
    shown = {run["id"]: (run["state"], run["superseded_by"]) for run in listed}
    # Run 1 stays active in the ledger, superseded by the first later run; a finished
    # run is not superseded (run 2), nor the newest (run 3).
    assert shown == {1: ("active", 2), 2: ("finished", None), 3: ("finished", None)}

    text = invoke("runs", *rt)
    assert text.exit_code == 0, text.output
    lines = {line.split()[0]: line for line in text.stdout.splitlines()[1:]}
    assert "superseded (by run 2)" in lines["1"]
    assert "superseded" not in lines["2"] + lines["3"]
