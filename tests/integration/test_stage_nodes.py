"""A stage's ``nodes``: its jobs run on those nodes, not on their lane's node. A worker of
the lane's node never claims them, a worker of a named node does; the lane's caps still
count them; reservations are the running node's; ``status``, ``explain`` and ``dry-run``
say where each stage runs and why a node is not taking a job."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import db, ledger
from laneway.controller.clock import SystemClock
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Decision, Job, Reservation
from laneway.controller.status import explain_job
from laneway.workers.gpu import FakeGpu
from laneway.workers.service import WorkerService
from tests.integration.test_two_nodes import Cluster
from tests.support import GATE_BOUND, escape, make_config, py_stage, wait_for_file, wait_until

runner = CliRunner()

HOLD = wait_for_file("sys.argv[2]")


def holding(name: str, release: Path, **extra) -> dict:
    stage = py_stage(name, HOLD, timeout_seconds=GATE_BOUND, **extra)
    stage["argv"] = [*stage["argv"], str(release)]
    return stage


def placed_config(tmp: Path, *, cap: int = 1):
    """Lane ``main`` on node a; stage ``local`` runs there, stage ``remote`` on b only."""
    return make_config(
        [
            holding("local", tmp / "release-local"),
            holding("remote", tmp / "release-remote", nodes=["b"]),
        ],
        items=[{"key": f"i{n}", "lane": "main"} for n in range(3)],
        lanes=[{"name": "main", "node": "a", "caps": {"remote": cap}}],
        nodes=[
            {"name": "a", "memory_floor_mib": 0, "max_jobs": 2},
            {"name": "b", "memory_floor_mib": 0, "max_jobs": 2},
        ],
    )


def worker(engine, node: str) -> WorkerService:
    service = WorkerService(
        engine, node=node, slots=2, memory_probe=lambda: (64e3, 128e3), gpu=FakeGpu()
    )
    service.start()
    return service


def attempts(engine, stage: str | None = None) -> list[tuple[Attempt, str]]:
    with db.session_factory(engine)() as session:
        query = select(Attempt, Job.stage).join(Job, Job.id == Attempt.job_id)
        if stage is not None:
            query = query.where(Job.stage == stage)
        return [(a, s) for a, s in session.execute(query.order_by(Attempt.id)).all()]


def ready_job(engine, stage: str) -> int:
    with db.session_factory(engine)() as session:
        return session.scalars(
            select(Job.id).where(Job.stage == stage, Job.state == "ready").order_by(Job.id)
        ).first()


def cli_json(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def cli_text(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_stage_on_another_node_runs_only_there_and_the_lane_cap_counts_it(
    engine, runtime, make_run, tmp_path
):
    run_id = make_run(placed_config(tmp_path))
    rt = ("--runtime-dir", str(runtime))
    controller = Controller(engine)
    on_a = worker(engine, "a")
    services = [on_a]

    def tick() -> None:
        controller.tick()
        for service in services:
            service.tick()

    try:
        # Node a fills its two slots with `local` jobs: never with `remote` ones, though
        # later stages come first in dispatch order.
        def a_full() -> bool:
            tick()
            return len([a for a, _ in attempts(engine) if a.state == "running"]) == 2

        wait_until(a_full)
        assert [(a.node, stage) for a, stage in attempts(engine)] == [("a", "local")] * 2

        # status: where each stage runs; node b has no worker.
        status = cli_json("status", str(run_id), *rt)
        placement = {p["stage"]: p for p in status["placement"]}
        assert placement["remote"] == {
            "stage": "remote",
            "nodes": ["b"],
            "runs_on": ["b"],
            "words": "b",
            "no_live_worker": ["b"],
        }
        assert placement["local"]["nodes"] is None
        assert placement["local"]["words"] == "lane's node"
        assert placement["local"]["runs_on"] == ["a"]
        assert {n["node"] for n in status["no_worker"]} == {"b"}
        text = cli_text("status", str(run_id), *rt)
        assert "stages run on:" in text
        assert "  remote: b; no live worker on node b" in text
        assert "  local: lane's node (a)" in text

        # explain: a remote job waits for a worker of b; a does not run the stage.
        remote = ready_job(engine, "remote")
        report = cli_json("explain", str(remote), *rt)
        assert report["worker"]["node"] == "b" and not report["worker"]["live"]
        first = report["blocked_by"][0]
        assert first["code"] == "no_worker"
        assert first["detail"]["node"] == "b" and first["detail"]["nodes"] == ["b"]
        per_node = {entry["node"]: entry for entry in report["placement"]["per_node"]}
        assert report["placement"]["runs_on"] == ["b"]
        assert report["placement"]["lane_node"] == "a"
        assert [b["code"] for b in per_node["a"]["why_not"]] == ["other_node"]
        assert per_node["a"]["runs_it"] is False and per_node["a"]["live"] is True
        assert [b["code"] for b in per_node["b"]["why_not"]] == ["no_worker"]
        text = cli_text("explain", str(remote), *rt)
        assert "no worker is running on node b" in text
        assert "runs on: b" in text
        assert "  node a: other_node — node a does not run this stage; it runs on b" in text

        # Once lane main has only remote jobs left, it is idle for want of b's worker.
        (tmp_path / "release-local").touch()

        def local_done() -> bool:
            tick()
            states = [a.state for a, _ in attempts(engine, "local")]
            return states == ["settled"] * 3

        wait_until(local_done)
        (lane,) = cli_json("status", str(run_id), *rt)["lanes"]
        assert lane["running"] == 0 and lane["ready"] == 3
        assert lane["reason"]["code"] == "no_worker"
        assert lane["reason"]["detail"]["node"] == "b"
        assert lane["reason"]["stage"] == "remote"
        assert "no live worker on node b (stage remote runs on b)" in lane["reason"]["words"]
        assert attempts(engine, "remote") == []

        # A worker of b takes them, one at a time: lane main's cap for remote is 1,
        # though b has two free slots.
        services.append(worker(engine, "b"))

        def b_capped() -> bool:
            tick()
            with db.session_factory(engine)() as session:
                refused = session.scalars(
                    select(Decision.id).where(
                        Decision.node == "b", Decision.reason_code == "lane_cap"
                    )
                ).first()
            return refused is not None

        wait_until(b_capped)
        # Refused in the claim that started the first (its intent, or already running).
        claimed = [(a.node, a.state) for a, _ in attempts(engine, "remote")]
        assert len(claimed) == 1 and claimed[0][0] == "b"
        assert claimed[0][1] in ("intent", "running")
        with db.session_factory(engine)() as session:
            (reservation,) = session.scalars(
                select(Reservation).where(Reservation.released_at.is_(None))
            ).all()
        assert reservation.node == "b"
        report = cli_json("explain", str(ready_job(engine, "remote")), *rt)
        assert [b["code"] for b in report["blocked_by"]] == ["lane_cap"]
        assert report["worker"] == {"node": "b", "live": True, "start": None}
        assert report["arithmetic"]["node"] == "b"

        (tmp_path / "release-remote").touch()

        def all_done() -> bool:
            tick()
            with db.session_factory(engine)() as session:
                states = session.scalars(select(Job.state)).all()
            return set(states) == {"succeeded"}

        wait_until(all_done)
        where = sorted({(stage, a.node) for a, stage in attempts(engine)})
        assert where == [("local", "a"), ("remote", "b")]
        assert len(attempts(engine, "remote")) == 3
    finally:
        (tmp_path / "release-local").touch()
        (tmp_path / "release-remote").touch()
        for service in services:
            service.drain()
            service.stop()


def test_the_lane_cap_counts_a_job_running_on_another_node(
    engine, make_run, register_worker, tmp_path
):
    """Stage `both` may run on a or b; lane main (node a) caps it at 1. With one running on
    b, a worker of a starts none and records the lane cap."""
    config = make_config(
        [holding("both", tmp_path / "release", nodes=["a", "b"])],
        items=[{"key": f"i{n}", "lane": "main"} for n in range(2)],
        lanes=[{"name": "main", "node": "a", "caps": {"both": 1}}],
        nodes=[
            {"name": "a", "memory_floor_mib": 0, "max_jobs": 2},
            {"name": "b", "memory_floor_mib": 0, "max_jobs": 2},
        ],
    )
    make_run(config)
    on_b = worker(engine, "b")
    services = [on_b]
    try:

        def b_started() -> bool:
            on_b.tick()
            return bool(attempts(engine))

        wait_until(b_started)
        # A claim on node a looks at the other ready job and starts nothing.
        worker_a = register_worker("a")
        seen: dict[str, int] = {}
        with db.transaction(db.session_factory(engine)) as session:
            claims = ledger.claim_jobs(
                session,
                worker_id=worker_a,
                node="a",
                free_slots=2,
                mem_available_mib=64e3,
                now=db.ledger_now(session, SystemClock()),
                seen=seen,
            )
        assert claims == [] and seen["candidates"] == 1
        assert [a.node for a, _ in attempts(engine)] == ["b"]
        with db.session_factory(engine)() as session:
            report = explain_job(session, ready_job(engine, "both"), now=utc_now(session))
        per_node = {entry["node"]: entry for entry in report["placement"]["per_node"]}
        assert [b["code"] for b in per_node["b"]["why_not"]] == ["lane_cap"]
    finally:
        (tmp_path / "release").touch()
        for service in services:
            service.drain()
            service.stop()


DRY_RUN = """
name = "placed"
nodes = [
  { name = "a", memory_floor_mib = 0, max_jobs = 4 },
  { name = "b", memory_floor_mib = 0, max_jobs = 4 },
]
lanes = [{ name = "main", node = "a", caps = { remote = 1 } }]
items = [
  { key = "i0", lane = "main" },
  { key = "i1", lane = "main" },
  { key = "i2", lane = "main" },
]

[[stages]]
name = "local"
argv = ["true"]

[[stages]]
name = "remote"
argv = ["true"]
nodes = ["b"]
"""


@pytest.mark.no_ledger
def test_dry_run_plans_each_stage_on_its_nodes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    config.write_text(DRY_RUN)
    plan = cli_json("dry-run", str(config))
    stages = {s["name"]: s for s in plan["stages"]}
    assert stages["remote"]["nodes"] == ["b"] and stages["remote"]["placement"] == "b"
    assert stages["local"]["nodes"] is None and stages["local"]["placement"] == "lane's node"
    assert stages["local"]["runs_on"] == ["a"]
    dispatched = [
        (d["stage"], d["node"], d["item"])
        for d in plan["first_decisions"]
        if d["verdict"] == "dispatch"
    ]
    # local on the lane's node a; remote on b only, once (the lane's cap is 1).
    assert sorted(dispatched) == [
        ("local", "a", "i0"),
        ("local", "a", "i1"),
        ("local", "a", "i2"),
        ("remote", "b", "i0"),
    ]
    refused = [
        (d["stage"], d["node"], d["reason"])
        for d in plan["first_decisions"]
        if d["verdict"] == "refused"
    ]
    assert refused == [("remote", "b", "lane_cap")]
    text = cli_text("dry-run", str(config))
    assert "stages run on:" in text
    assert "  remote: b" in text and "  local: lane's node (a)" in text
    assert "dispatch i0.remote (lane main, node b)" in text


REAL = """
import pathlib, sys, time
with open(sys.argv[2], "a") as f:
    f.write(sys.argv[1] + "\\n")
time.sleep(0.2)
"""


def test_real_workers_run_each_stage_on_its_node(tmp_path):
    """Separate processes: a controller and a worker per node, sharing only the ledger.
    Stage `remote` (nodes = ["n2"]) of lane a (node n1) runs in n2's runtime dir."""
    argv = json.dumps([sys.executable, "-c", escape(REAL), "{item}"])[:-1]
    items = ", ".join(f'{{ key = "i{n}", lane = "a" }}' for n in range(3))
    path = tmp_path / "pipeline.toml"
    path.write_text(
        f"""
name = "placed"
nodes = [
  {{ name = "n1", memory_floor_mib = 0, max_jobs = 2 }},
  {{ name = "n2", memory_floor_mib = 0, max_jobs = 2 }},
]
lanes = [{{ name = "a", node = "n1", caps = {{ remote = 1 }} }}]
items = [{items}]

[[stages]]
name = "local"
argv = {argv}, "{tmp_path / "side.log"}"]

[[stages]]
name = "remote"
argv = {argv}, "{tmp_path / "side.log"}"]
nodes = ["n2"]
"""
    )
    cluster = Cluster(tmp_path)
    try:
        (tmp_path / "control").mkdir()
        started = cluster.cli("start-pipeline", str(path), "--no-controller")
        assert started.returncode == 0, started.stderr
        cluster.start("controller", "controller", where="control")
        for node in ("n1", "n2"):
            cluster.start(node, "worker", "--node", node, where=node)

        def finished() -> bool:
            shown = cluster.cli("status", "--json")
            return shown.returncode == 0 and json.loads(shown.stdout)["run"]["state"] == "finished"

        wait_until(finished, timeout=120)
        with db.session_factory(cluster.engine)() as session:
            rows = session.execute(
                select(Attempt, Job.stage).join(Job, Job.id == Attempt.job_id)
            ).all()
        assert sorted({(stage, a.node) for a, stage in rows}) == [("local", "n1"), ("remote", "n2")]
        assert all(a.outcome == "succeeded" for a, _ in rows)
        remote = sorted((a for a, stage in rows if stage == "remote"), key=lambda a: a.intent_at)
        assert len(remote) == 3
        n2_dir = cluster.dirs["n2"].resolve()
        assert all(Path(a.attempt_dir).is_relative_to(n2_dir) for a in remote)
        # The lane's cap of 1: each remote attempt was claimed after the previous settled.
        for previous, following in itertools.pairwise(remote):
            assert following.intent_at >= previous.settled_at
    finally:
        cluster.stop()


def utc_now(session):
    return db.ledger_now(session, SystemClock())
