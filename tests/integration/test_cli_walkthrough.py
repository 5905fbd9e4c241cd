"""Messages a new user met in the walk-through, each saying what happened and what to do:
a timeout names its limit and the field that set it; an empty items file is named, with
what to write in it; a pause of a finished run is refused; `start-pipeline` names the
config's nodes, and on a shared ledger does not offer this machine's runtime dir to the
others. Real `laneway` commands, on each ledger backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.integration.test_cli import assert_clean_error, invoke


def write_config(tmp_path: Path, stages: list[dict[str, Any]], **extra: Any) -> Path:
    body: dict[str, Any] = {
        "name": "walk",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": stages,
        "items": [{"key": "x0", "lane": "a"}],
        **extra,
    }
    path = tmp_path / "walk.json"
    path.write_text(json.dumps(body))
    return path


def test_a_timeout_names_its_limit_and_field_in_explain_and_status(tmp_path: Path):
    stage = {"name": "solve", "argv": ["sleep", "600"], "timeout_seconds": 1, "grace_seconds": 0}
    runtime = tmp_path / "rt"
    ran = invoke("run", str(write_config(tmp_path, [stage])), "--runtime-dir", str(runtime))
    assert ran.exit_code == 0, ran.output
    said = "timed out after 1 s (stages.solve.timeout_seconds = 1)"
    explained = invoke("explain", "x0.solve", "--runtime-dir", str(runtime))
    assert explained.exit_code == 0, explained.output
    assert f"timed_out, signal 15 (SIGTERM) — {said}" in explained.stdout
    body = json.loads(invoke("explain", "x0.solve", "--json", "--runtime-dir", str(runtime)).stdout)
    assert body["last_attempt"]["reason"] == said
    assert said in invoke("status", "--runtime-dir", str(runtime)).stdout


def test_an_empty_items_file_is_named_with_the_fix(tmp_path: Path):
    items = tmp_path / "items.jsonl"
    items.write_text("\n\n")  # blank lines only: no items
    stage = {"name": "solve", "argv": ["true"]}
    config = write_config(tmp_path, [stage], items_file="items.jsonl")
    body = json.loads(config.read_text())
    del body["items"]
    config.write_text(json.dumps(body))
    said = (
        f"items_file: {items} holds no items; write one JSON object per line, e.g. "
        '{"key": "i01", "lane": "a"}'
    )
    runtime = tmp_path / "rt"
    for command in ("start-pipeline", "run"):
        refused = invoke(command, str(config), "--runtime-dir", str(runtime))
        assert_clean_error(refused, 1)
        assert refused.stderr == f"laneway: {said}\n"
        assert not runtime.exists()  # nothing created
    plan = json.loads(invoke("dry-run", str(config), "--json").stdout)
    assert plan["preflight"] == {"ok": False, "reasons": [said]}


def sql(runtime: Path, query: str) -> list[dict[str, Any]]:
    result = invoke("sql", query, "--runtime-dir", str(runtime), "--json")
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


def test_a_pause_of_a_finished_run_is_refused_and_writes_nothing(tmp_path: Path):
    runtime = tmp_path / "rt"
    config = write_config(tmp_path, [{"name": "solve", "argv": ["true"]}])
    ran = invoke("run", str(config), "--runtime-dir", str(runtime))
    assert ran.exit_code == 0, ran.output
    before = sql(runtime, "SELECT COUNT(*) AS n FROM events")
    for lane in ([], ["--lane", "a"]):
        refused = invoke("pause", "1", *lane, "--reason", "look", "--runtime-dir", str(runtime))
        assert_clean_error(refused, 1)
        assert len(refused.stderr.splitlines()) == 1
        assert "run 1 finished at " in refused.stderr and "not paused (nothing written)" in (
            refused.stderr
        )
        assert "`laneway retry JOB --run 1 --reason '...'` reopens a job of it" in refused.stderr
    as_json = invoke("pause", "1", "--reason", "look", "--json", "--runtime-dir", str(runtime))
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["error"] == "IllegalTransition"
    assert sql(runtime, "SELECT COUNT(*) AS n FROM controls") == [{"n": 0}]
    assert sql(runtime, "SELECT COUNT(*) AS n FROM events") == before


def test_start_pipeline_names_the_real_nodes_and_where_workers_run(
    tmp_path: Path, on_postgres: bool
):
    config = write_config(tmp_path, [{"name": "solve", "argv": ["true"]}])
    body = json.loads(config.read_text())
    body["nodes"].append({"name": "gpu-box", "memory_floor_mib": 0, "max_jobs": 1})
    config.write_text(json.dumps(body))
    runtime = (tmp_path / "rt").resolve()
    rt = ["--runtime-dir", str(runtime), "--no-controller"]
    shown = invoke("start-pipeline", str(config), *rt)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    if on_postgres:
        assert lines[0].startswith("run 1 created in the ledger postgresql://")
        assert lines[1:] == [
            "no controller runs from this runtime dir: if none runs on another machine, "
            "start `laneway controller` on one (with LANEWAY_DATABASE_URL set)",
            "next: a worker for each node, on that node's machine, with LANEWAY_DATABASE_URL "
            "set to this ledger and DIR a runtime dir of that machine:",
            "  laneway worker --node n1 --runtime-dir DIR",
            "  laneway worker --node gpu-box --runtime-dir DIR",
        ]
        assert str(runtime) not in shown.stdout
    else:
        assert lines == [
            f"run 1 created in {runtime}",
            f"no controller runs for it: start `laneway controller --runtime-dir {runtime}`",
            "next: a worker for each node, on this machine:",
            f"  laneway worker --node n1 --runtime-dir {runtime}",
            f"  laneway worker --node gpu-box --runtime-dir {runtime}",
        ]
    again = json.loads(invoke("start-pipeline", str(config), *rt, "--new", "--json").stdout)
    assert again["nodes"] == ["n1", "gpu-box"]
    assert again["backend"] == ("postgresql" if on_postgres else "sqlite")
    where = "DIR" if on_postgres else str(runtime)
    assert again["worker_commands"] == [
        f"laneway worker --node {node} --runtime-dir {where}" for node in ("n1", "gpu-box")
    ]
