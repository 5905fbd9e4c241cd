"""``laneway artifacts`` and the bytes per node in ``laneway report``, over a real
in-process run on two nodes (worker and controller in-process, real supervisors): item
``a`` runs on node n1, item ``bbbbbbbbbbbb`` on n2, so each node stores its item's
outputs (up) and fetches its item's ``prepare`` outputs as ``solve``'s inputs (down),
with sizes that differ by node."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from laneway.cli import render
from laneway.controller import db, ledger
from laneway.controller.models import Artifact
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html
from laneway.controller.units import byte_size
from tests.integration.test_artifacts import rows, stages
from tests.integration.test_cli import assert_clean_error, invoke
from tests.integration.test_worker import attempts, drive, start_worker
from tests.support import make_config

LONG = "bbbbbbbbbbbb"
NODES = [
    {"name": "n1", "memory_floor_mib": 0, "max_jobs": 4},
    {"name": "n2", "memory_floor_mib": 0, "max_jobs": 4},
]
LANES = [{"name": "a", "node": "n1"}, {"name": "b", "node": "n2"}]
ITEMS = [{"key": "a", "lane": "a"}, {"key": LONG, "lane": "b"}]
PRODUCED = {
    "prepare": ["packet.json", "shards/0.jsonl", "shards/1.jsonl"],
    "solve": ["answer.txt"],
}


def two_node_config(tmp_path: Path):
    return make_config(stages(tmp_path), items=ITEMS, lanes=LANES, nodes=NODES)


@pytest.fixture
def two_node_run(engine, make_run, tmp_path) -> int:
    run_id = make_run(two_node_config(tmp_path))
    drive(engine, [start_worker(engine, "n1"), start_worker(engine, "n2")], run_id)
    done = attempts(engine, run_id)
    assert [a.outcome for a in done] == ["succeeded"] * 4, [a.state_reason for a in done]
    return run_id


def workspace_files(engine, run_id: int) -> dict[tuple[str, str], dict[str, Path]]:
    """(item, stage) -> output name -> the file its attempt wrote, from the attempt
    directories (runs/<run>/<item>.<stage>/attempt-1), not from the ledger's rows."""
    found: dict[tuple[str, str], dict[str, Path]] = {}
    for attempt in attempts(engine, run_id):
        item, stage = Path(attempt.attempt_dir).parent.name.rsplit(".", 1)
        workspace = Path(attempt.attempt_dir) / "workspace"
        found[(item, stage)] = {name: workspace / name for name in PRODUCED[stage]}
    return found


def artifacts(runtime: Path, *args: str):
    return invoke("artifacts", *args, "--runtime-dir", str(runtime))


def test_artifacts_lists_every_output_with_full_hashes_in_json(engine, runtime, two_node_run):
    files = workspace_files(engine, two_node_run)
    result = artifacts(runtime, str(two_node_run), "--json")
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert listing["run"]["id"] == two_node_run and listing["why_none"] is None
    got = {(row["item"], row["stage"], row["name"]): row for row in listing["artifacts"]}
    assert set(got) == {
        (item, stage, name) for (item, stage), names in files.items() for name in names
    }
    assert listing["count"] == 8
    total = 0
    for (item, stage, name), row in got.items():
        path = files[(item, stage)][name]
        assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert row["size_bytes"] == path.stat().st_size
        assert row["node"] == ("n1" if item == "a" else "n2")
        assert row["location"].endswith(f"/sha256/{row['sha256'][:2]}/{row['sha256']}")
        assert row["reused_from_run"] is None
        total += row["size_bytes"]
    assert listing["total_bytes"] == total
    # By item, stage and name.
    order = [(row["item"], row["stage"], row["name"]) for row in listing["artifacts"]]
    assert order == sorted(order)
    stored = {a.attempt_id for a in rows(engine, Artifact, run_id=two_node_run)}
    assert {row["attempt_id"] for row in listing["artifacts"]} == stored


def test_artifacts_text_is_a_table_with_short_hashes(engine, runtime, two_node_run):
    full = {a.name + a.node: a for a in rows(engine, Artifact, run_id=two_node_run)}
    result = artifacts(runtime, str(two_node_run))
    assert result.exit_code == 0, result.output
    head, header, *lines = result.stdout.splitlines()
    total = sum(a.size_bytes for a in full.values())
    assert head == f"run {two_node_run} (t) — finished: 8 artifacts, {byte_size(total)}"
    assert header.split() == [
        "item",
        "stage",
        "attempt",
        "name",
        "size",
        "sha256",
        "node",
        "location",
    ]
    assert len(lines) == 8
    for line in lines:
        cells = line.split()
        artifact = full[cells[3] + cells[-2]]
        assert cells == [
            "a" if artifact.node == "n1" else LONG,
            artifact.stage,
            str(artifact.attempt_id),
            artifact.name,
            *byte_size(artifact.size_bytes).split(),
            artifact.sha256[:12],
            artifact.node,
            artifact.location,
        ]


def test_artifacts_filters_by_item_and_stage(runtime, two_node_run):
    def listed(*args: str) -> list[tuple[str, str, str]]:
        result = artifacts(runtime, str(two_node_run), "--json", *args)
        assert result.exit_code == 0, result.output
        return [(r["item"], r["stage"], r["name"]) for r in json.loads(result.stdout)["artifacts"]]

    assert listed("--item", "a") == [("a", "prepare", n) for n in PRODUCED["prepare"]] + [
        ("a", "solve", "answer.txt")
    ]
    assert listed("--stage", "solve") == [
        ("a", "solve", "answer.txt"),
        (LONG, "solve", "answer.txt"),
    ]
    assert listed("--item", LONG, "--stage", "prepare") == [
        (LONG, "prepare", n) for n in PRODUCED["prepare"]
    ]
    text = artifacts(runtime, str(two_node_run), "--item", "a", "--stage", "solve").stdout
    assert text.splitlines()[0].startswith(f"run {two_node_run} (t) — finished: 1 artifact of ")
    assert "of item a stage solve" in text.splitlines()[0]
    assert len(text.splitlines()) == 3


def test_a_bad_run_item_or_stage_is_one_clean_line(runtime, two_node_run):
    assert_clean_error(artifacts(runtime, "99"), 2)
    assert "run 99 is not in the ledger" in artifacts(runtime, "99").stderr
    as_json = artifacts(runtime, "99", "--json")
    assert as_json.exit_code == 2
    assert json.loads(as_json.stdout)["ok"] is False
    unknown_item = artifacts(runtime, str(two_node_run), "--item", "zz")
    assert_clean_error(unknown_item, 2)
    assert "--item zz" in unknown_item.stderr
    unknown_stage = artifacts(runtime, str(two_node_run), "--stage", "judge")
    assert_clean_error(unknown_stage, 2)
    assert "its stages: prepare, solve" in unknown_stage.stderr
    # Out of range: click's usage error, as for `status` and `report`.
    zero = artifacts(runtime, "0")
    assert zero.exit_code == 2 and "Traceback" not in zero.output


def test_a_missing_ledger_is_a_clean_error(tmp_path, without_ledger):
    assert_clean_error(artifacts(tmp_path / "nothing-here"), 2)


def test_a_run_without_artifacts_says_why(engine, runtime, make_run, tmp_path):
    plain = make_run(make_config())
    result = artifacts(runtime, str(plain))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"run {plain} (t) — active: no artifacts; no stage of its pipeline declares outputs"
    )
    only = artifacts(runtime, str(plain), "--stage", "only")
    assert only.exit_code == 0
    assert "no artifacts of stage only; stage only declares no outputs" in only.stdout
    listing = json.loads(artifacts(runtime, str(plain), "--json").stdout)
    assert listing["count"] == 0 and listing["artifacts"] == [] and listing["total_bytes"] == 0
    # A pipeline with outputs, not run yet: the newest run is the default.
    pending = make_run(two_node_config(tmp_path))
    newest = artifacts(runtime)
    assert newest.exit_code == 0
    assert newest.stdout.startswith(f"run {pending} (t)")
    assert "no artifacts; none stored yet" in newest.stdout


def test_a_reused_job_lists_the_artifacts_of_the_run_that_stored_them(
    engine, runtime, make_run, tmp_path, two_node_run
):
    again = make_run(two_node_config(tmp_path))
    assert attempts(engine, again) == []  # every job was reused
    first = json.loads(artifacts(runtime, str(two_node_run), "--json").stdout)["artifacts"]
    listing = json.loads(artifacts(runtime, str(again), "--json").stdout)
    assert listing["count"] == 8
    assert [r["reused_from_run"] for r in listing["artifacts"]] == [two_node_run] * 8
    strip = ("reused_from_run",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in listing["artifacts"]] == [
        {k: v for k, v in r.items() if k not in strip} for r in first
    ]
    text = artifacts(runtime, str(again), "--stage", "solve").stdout
    assert f"(reused, run {two_node_run})" in text


def test_report_counts_bytes_moved_per_node(engine, make_run, tmp_path, two_node_run):
    files = workspace_files(engine, two_node_run)

    def size(item: str, stage: str) -> int:
        return sum(path.stat().st_size for path in files[(item, stage)].values())

    expected = {
        node: {
            "stored": 4,
            "stored_bytes": size(item, "prepare") + size(item, "solve"),
            "fetched": 3,
            "fetched_bytes": size(item, "prepare"),
        }
        for node, item in (("n1", "a"), ("n2", LONG))
    }
    assert expected["n1"]["stored_bytes"] != expected["n2"]["stored_bytes"]
    with db.session_factory(engine)() as session:
        run = ledger.get_run(session, two_node_run)
        report = build_report(session, run, now=run.finished_at)
    traffic = report["artifacts"]
    assert traffic["by_node"] == expected
    assert list(traffic["by_node"]) == ["n1", "n2"]
    assert traffic["stored"] == 8 and traffic["fetched"] == 6
    assert traffic["stored_bytes"] == sum(e["stored_bytes"] for e in expected.values())
    assert traffic["fetched_bytes"] == sum(e["fetched_bytes"] for e in expected.values())

    report["html"] = "report.html"
    text = render.report_text(report).splitlines()
    at = text.index(
        f"artifacts: 8 stored ({byte_size(traffic['stored_bytes'])} up), 6 inputs fetched "
        f"({byte_size(traffic['fetched_bytes'])} down)"
    )
    assert text[at + 1].split() == ["node", "stored", "bytes", "up", "fetched", "bytes", "down"]
    for offset, node in ((2, "n1"), (3, "n2")):
        entry = expected[node]
        assert text[at + offset].split() == [
            node,
            "4",
            *byte_size(entry["stored_bytes"]).split(),
            "3",
            *byte_size(entry["fetched_bytes"]).split(),
        ]
    page = render_html(report)
    for node, entry in expected.items():
        assert (
            f"<tr><td>{node}</td><td>4</td><td>{byte_size(entry['stored_bytes'])}</td>"
            f"<td>3</td><td>{byte_size(entry['fetched_bytes'])}</td></tr>"
        ) in page

    # A later run that reused every job moved nothing itself: only its own run counts.
    again = make_run(two_node_config(tmp_path))
    with db.session_factory(engine)() as session:
        later = build_report(session, ledger.get_run(session, again), now=run.finished_at)
    assert later["artifacts"]["by_node"] == {} and later["artifacts"]["stored"] == 0


def test_report_of_a_run_without_artifacts_says_nothing_of_them(engine, make_run):
    run_id = make_run(make_config())
    drive(engine, [start_worker(engine)], run_id)
    with db.session_factory(engine)() as session:
        run = ledger.get_run(session, run_id)
        report = build_report(session, run, now=run.finished_at)
    assert report["artifacts"] == {
        "stored": 0,
        "stored_bytes": 0,
        "fetched": 0,
        "fetched_bytes": 0,
        "by_node": {},
    }
    report["html"] = "report.html"
    assert "artifacts:" not in render.report_text(report)
    assert 'class="artifacts"' not in render_html(report)
