"""GPUs as devices, on a node described by the shipped example (configs/gpu-node-4x80g.json)
rather than measured: real supervisors and jobs, an in-process worker, both backends.

- 8 attempts of a ``gpus = 1`` stage run 4 at a time, each given a distinct device in
  ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` (by UUID), as recorded on the
  attempt (``attempts.gpu_devices``); the fifth waits with ``gpu_busy``.
- The sharing rule per device, with peaks the jobs script (a usage file the described
  probe reads): serial until measured, then two share a device while
  ``baseline + 2 x peak <= fraction x total`` and a third does not.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

from laneway.cli import render
from laneway.controller import db, ledger, metrics, readonly
from laneway.controller.clock import SystemClock
from laneway.controller.models import Attempt, Decision, Node
from laneway.controller.status import build_status
from laneway.workers.gpu import DescribedGpu
from laneway.workers.service import WorkerService
from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import ROOT, finish, spawn
from tests.integration.test_web import (
    browser_or_skip,
    browser_page,
    get_json,
    serving_url,
)
from tests.integration.test_web import pipeline as web_pipeline
from tests.integration.test_worker import drive
from tests.support import (
    GATE_BOUND,
    controller_serving,
    escape,
    make_config,
    wait_for_file,
    wait_until,
)

EXAMPLE = ROOT / "configs" / "gpu-node-4x80g.json"
PLENTY = (1_000_000.0, 2_000_000.0)

# Each job marks itself running (its file in ``running`` holds its CUDA_VISIBLE_DEVICES)
# and waits for the test's release (``release_together``): a file naming the devices of
# every job running when ``want`` of them waited at once. An item not named in
# ``patient`` gives the others ``patience`` s, then names the devices it sees itself. With
# a ``usage`` directory it holds its scripted GPU use until the test says the worker
# sampled it. Then it writes what it saw to ``seen`` and unmarks itself.
BARRIER = (
    """
import json, os, sys, time
running, seen, patience = sys.argv[1], sys.argv[2], float(sys.argv[3])
patient, usage = sys.argv[4].split(","), sys.argv[5] if len(sys.argv) > 5 else None
item = os.environ["LANEWAY_ITEM"]
release = os.path.join(seen, "..", "release", item)
sampled = os.path.join(seen, "..", "sampled", item)
me = os.path.join(running, item)
staged = os.path.join(seen, "." + item)  # whole, then renamed in
open(staged, "w").write(os.environ["CUDA_VISIBLE_DEVICES"])
os.replace(staged, me)
if usage:  # the scripted use of the described device: DEVICE MIB
    open(os.path.join(usage, str(os.getpid())), "w").write(
        os.environ["CUDA_VISIBLE_DEVICES"] + " 3000")
deadline = time.monotonic() + (BOUND if item in patient else patience)
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.02)
if os.path.exists(release):
    devices = json.load(open(release))
else:
    devices = sorted(open(os.path.join(running, n)).read() for n in os.listdir(running))
if usage:
"""
    + textwrap.indent(wait_for_file("sampled"), "    ")
    + """
os.unlink(me)
with open(os.path.join(seen, item), "w") as out:
    json.dump({"devices": devices, "env": {k: os.environ.get(k) for k in
        ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LANEWAY_GPUS")}}, out)
if usage:
    os.unlink(os.path.join(usage, str(os.getpid())))
"""
).replace("BOUND", str(GATE_BOUND))


def release_together(
    tmp_path: Path, want: int, worker: WorkerService | None = None
) -> Callable[[], None]:
    """``drive``'s ``on_tick`` for BARRIER jobs: once ``want`` of them wait at once (and,
    with ``worker``, its sampler saw each one's GPU use), release them with the
    devices of every job running then. A handshake: however slowly they start."""
    running, release, sampled = (tmp_path / n for n in ("running", "release", "sampled"))

    def tick() -> None:
        for flight in list(worker.in_flight.values()) if worker else ():
            if (flight.peaks.peak_gpu_mib or 0) > 0:  # the job's use, not before it
                (sampled / flight.claim.item).touch()
        try:
            devices = {p.name: p.read_text() for p in running.iterdir()}
        except FileNotFoundError:  # a job unmarked itself meanwhile: look again
            return
        waiting = [name for name in devices if not (release / name).exists()]
        if len(waiting) < want or (worker and not all((sampled / n).exists() for n in waiting)):
            return
        for name in waiting:
            staged = release / ("." + name)
            staged.write_text(json.dumps(sorted(devices.values())))
            staged.rename(release / name)

    return tick


def described(tmp_path: Path, **change: object) -> DescribedGpu:
    """The shipped 4-GPU example, copied beside its usage directory (``change``: fields
    to replace)."""
    body = json.loads(EXAMPLE.read_text())
    body.update(change)
    path = tmp_path / EXAMPLE.name
    path.write_text(json.dumps(body))
    (tmp_path / body["usage_dir"]).mkdir()
    return DescribedGpu(path)


def stage_argv(
    tmp_path: Path, patience: float, usage: bool = False, patient: str = ""
) -> list[str]:
    """The BARRIER job's argv (``patient``: the items, comma-separated, that wait for
    their release as long as for a gate)."""
    for name in ("running", "seen", "release", "sampled"):
        (tmp_path / name).mkdir()
    argv = [sys.executable, "-c", escape(BARRIER), str(tmp_path / "running")]
    argv += [str(tmp_path / "seen"), str(patience), patient]
    return argv + ([str(tmp_path / "gpu-usage")] if usage else [])


def seen(tmp_path: Path) -> dict[str, dict[str, object]]:
    return {
        p.name: json.loads(p.read_text())
        for p in (tmp_path / "seen").iterdir()
        if not p.name.startswith(".")
    }


def test_eight_whole_gpu_attempts_run_four_at_a_time_on_distinct_devices(
    engine, runtime, make_run, tmp_path
):
    gpu = described(tmp_path)
    patient = ",".join(f"item{n}" for n in range(8))  # four run at once, however slowly
    argv = stage_argv(tmp_path, 0, patient=patient)
    stage = {"name": "train", "argv": argv, "gpus": 1, "timeout_seconds": GATE_BOUND}
    run_id = make_run(make_config([stage], items=8, max_jobs=8))
    worker = WorkerService(engine, node="n1", slots=8, memory_probe=lambda: PLENTY, gpu=gpu)
    worker.start()
    drive(engine, [worker], run_id, timeout=90, on_tick=release_together(tmp_path, 4))

    uuids = [d.uuid for d in gpu.devices]
    found = seen(tmp_path)
    assert len(found) == 8
    for item, saw in found.items():
        # Four ran at once, on four distinct devices, never more.
        assert sorted(saw["devices"]) == sorted(uuids), item
        env = saw["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"]
        assert env["CUDA_VISIBLE_DEVICES"] in uuids
        assert env["LANEWAY_GPUS"] == str(uuids.index(env["CUDA_VISIBLE_DEVICES"]))
    with db.session_factory(engine)() as session:
        recorded = session.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()
        busy = session.scalars(
            select(Decision).where(Decision.run_id == run_id, Decision.reason_code == "gpu_busy")
        ).all()
        node = session.get(Node, "n1")
    assert all(a.outcome == "succeeded" for a in recorded)
    for attempt in recorded:
        item = attempt.attempt_dir.rsplit("/", 2)[-2].split(".")[0]
        (given,) = attempt.gpu_devices
        assert given["whole"] is True
        assert given["uuid"] == found[item]["env"]["CUDA_VISIBLE_DEVICES"]
    assert busy and "asks for 1 whole GPU(s); 0 of 4 free" in busy[0].detail["why"]
    # The heartbeat says the devices are described, not measured; status, its text and
    # the metrics show each device so.
    assert [d["uuid"] for d in node.gpus] == uuids
    assert all(d["described"].endswith("gpu-node-4x80g.json") for d in node.gpus)
    with db.session_factory(engine)() as session:
        status = build_status(session, ledger.get_run(session, run_id), now=SystemClock().now())
    (summary,) = status.nodes
    assert [d["uuid"] for d in summary.gpus] == uuids
    lines = render.gpu_lines(summary.node, summary.gpus)
    assert lines[0] == (
        f"  n1 GPU 0 ({uuids[0]}): 512 of 81920 MiB used (ours 0, others 512) — described by "
        f"{tmp_path / EXAMPLE.name}"
    )
    with readonly.ReadOnlyLedger(runtime) as source:
        exposed = metrics.exposition(source.snapshot, SystemClock().now).decode()
    assert (
        f'laneway_gpu_total_mib{{described="true",device="3",node="n1",uuid="{uuids[3]}"}} 81920.0'
        in exposed
    )


def test_a_gpu_share_runs_alone_until_measured_then_two_share_and_a_third_waits(
    engine, make_run, tmp_path
):
    # One described device: 10000 MiB, 1000 of it used by others; usable 0.9 of it.
    gpu = described(
        tmp_path,
        devices=[{"index": 0, "uuid": "GPU-only", "total_mib": 10000, "baseline_mib": 1000}],
    )
    stage = {
        "name": "infer",
        # item1 and item2 are to run together: each waits for the other however long it
        # takes; item0 and item3 are to run alone: each gives a second 3 s to show up.
        "argv": stage_argv(tmp_path, 3, usage=True, patient="item1,item2"),
        "gpu_mib": 100,
        "timeout_seconds": GATE_BOUND,
    }
    gpu_node = {"name": "n1", "memory_floor_mib": 0, "max_jobs": 4}
    gpu_node["gpu"] = {"total_mib": 10000, "fraction": 0.9}
    run_id = make_run(make_config([stage], items=4, nodes=[gpu_node]))
    worker = WorkerService(
        engine, node="n1", slots=4, memory_probe=lambda: PLENTY, gpu=gpu, sample_seconds=0.2
    )
    worker.start()
    drive(engine, [worker], run_id, timeout=120, on_tick=release_together(tmp_path, 2, worker))

    found = seen(tmp_path)
    # item0 ran alone (no peak measured yet: it waited 3 s for a second, which never
    # came); then 1000 + 2 x 3000 = 7000 <= 9000 lets two share the device, while a third
    # (10000 > 9000) waits: item1 and item2 ran together, item3 after them, alone.
    assert found["item0"]["devices"] == ["GPU-only"]
    assert found["item1"]["devices"] == found["item2"]["devices"] == ["GPU-only", "GPU-only"]
    assert found["item3"]["devices"] == ["GPU-only"]
    with db.session_factory(engine)() as session:
        attempts = session.scalars(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.id)
        ).all()
        why = [
            d.detail["why"]
            for d in session.scalars(
                select(Decision).where(
                    Decision.run_id == run_id, Decision.reason_code == "gpu_memory"
                )
            )
        ]
    assert [a.peak_gpu_mib for a in attempts] == [3000.0] * 4
    assert any("no measured GPU peak yet" in w for w in why)
    assert any(
        "baseline 1000 + running peaks 6000 + peak 3000 = 10000 MiB > 0.9 x 10000 = 9000 MiB" in w
        for w in why
    )


def test_the_example_description_is_what_the_docs_say(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    reading = DescribedGpu(tmp_path / EXAMPLE.name).read()
    assert [(d.index, d.total_mib) for d in reading.devices] == [(i, 81920.0) for i in range(4)]
    assert reading.described == str(tmp_path / EXAMPLE.name) and reading.available


def test_dry_run_plans_whole_gpus_on_a_described_node_and_preflight_needs_one(tmp_path):
    """Without a description a ``gpus = 2`` stage has no node that can hold it (a one-line
    refusal naming the field and both ways on); with the shipped one, dry-run gives the
    first attempts distinct devices. A bad description is one line, exit 2."""
    body = {
        "name": "gpu-plan",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 4}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [{"name": "train", "argv": [sys.executable, "-c", "pass"], "gpus": 2}],
        "items": [{"key": f"x{i}", "lane": "a"} for i in range(3)],
    }
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(body))
    refused = invoke("dry-run", str(config), "--json")
    assert refused.exit_code == 1
    assert json.loads(refused.stdout)["preflight"]["reasons"] == [
        "stages.train.gpus: 2 GPU(s) per attempt, but no node it runs on (n1) has that many; "
        "give the node its GPUs in the config: `[nodes.gpu]` with total_mib and devices"
    ]
    planned = invoke("dry-run", str(config), "--gpu-description", str(EXAMPLE), "--json")
    assert planned.exit_code == 0, planned.output
    first = json.loads(planned.stdout)["first_decisions"]
    assert [(d["item"], d.get("gpus")) for d in first if d["verdict"] == "dispatch"] == [
        ("x0", ["GPU 0", "GPU 1"]),
        ("x1", ["GPU 2", "GPU 3"]),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": [{"total_mib": -1}]}))
    for command in (
        ["dry-run", str(config), "--gpu-description", str(bad)],
        ["worker", "--node", "n1", "--gpu-description", str(bad), "--exit-if-unknown"],
    ):
        result = invoke(*command)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"laneway: --gpu-description: {bad}: devices[0]: total_mib must be a number in "
            "(0, 2147483647] and baseline_mib one in [0, total_mib]"
        ]


def test_the_dashboard_shows_each_described_gpu(tmp_path):
    """A real `laneway worker --gpu-description` process reports the shipped 4-GPU
    node; `laneway web` shows each device, its use and that it is described."""
    playwright_api = browser_or_skip()
    runtime, gate = web_pipeline(tmp_path)
    worker = spawn(
        "worker", "--node", "n1", "--runtime-dir", str(runtime), "--gpu-description", str(EXAMPLE)
    )
    web = spawn("web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime))
    try:
        url = serving_url(web)
        wait_until(lambda: get_json(url + "api/state")["running"], 60)
        with controller_serving(runtime), browser_page(playwright_api, url) as (page, errors):
            page.wait_for_selector("#gpus td >> text=GPU 3", timeout=30_000)
            rows = page.locator("#gpus tr").all_text_contents()
            assert len(rows) == 5  # the header and four devices
            assert "GPU-described-0002-4x80g" in rows[3] and "512 of 81920 MiB" in rows[3]
            assert f"described by {EXAMPLE}" in rows[4]
            assert errors == []
    finally:
        gate.touch()
        for process in (web, worker):
            process.send_signal(signal.SIGTERM)
            finish(process)
