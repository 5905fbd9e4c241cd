"""Issue 46 item 5: `status` and `explain` say which GPU each running attempt holds,
the devices its job was given in ``CUDA_VISIBLE_DEVICES`` (``attempts.gpu_devices``).

Real supervisors and jobs, an in-process worker on a fake two-GPU probe, both backends;
the jobs hold their devices until the test, having looked, opens their gate."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from laneway.cli import render
from laneway.controller import db, ledger, readonly
from laneway.controller.clock import SystemClock
from laneway.controller.explain import explain_job
from laneway.controller.models import Attempt, Job
from laneway.controller.status import status_report
from laneway.workers.gpu import FakeGpu, GpuDevice
from laneway.workers.service import WorkerService
from tests.integration.test_worker import drive
from tests.support import GATE_BOUND, gated_argv, make_config, wait_until

PLENTY = (1_000_000.0, 2_000_000.0)
DEVICES = [GpuDevice(0, 81920.0, 0.0, "GPU-held-0"), GpuDevice(1, 81920.0, 0.0, "GPU-held-1")]


def test_status_and_explain_show_the_gpus_each_running_attempt_holds(
    engine, runtime, make_run, tmp_path: Path
):
    gate = tmp_path / "gate"
    stage = {"name": "train", "argv": gated_argv(gate), "gpus": 1, "timeout_seconds": GATE_BOUND}
    plain = {"name": "cpu", "argv": gated_argv(gate), "timeout_seconds": GATE_BOUND}
    run_id = make_run(make_config([stage, plain], items=2, max_jobs=4))
    worker = WorkerService(
        engine, node="n1", slots=4, memory_probe=lambda: PLENTY, gpu=FakeGpu(list(DEVICES))
    )
    worker.start()

    def all_running() -> bool:
        worker.tick()
        with db.session_factory(engine)() as session:
            states = session.scalars(select(Attempt.state).where(Attempt.run_id == run_id))
            return list(states).count("running") == 4

    wait_until(all_running, GATE_BOUND)
    with db.session_factory(engine)() as session:
        given = {
            a.id: a.gpu_devices
            for a in session.scalars(select(Attempt).where(Attempt.run_id == run_id))
        }
        train_job = session.scalars(
            select(Job).where(Job.run_id == run_id, Job.stage == "train")
        ).first()
        assert train_job is not None
        explained = explain_job(session, train_job.id, now=SystemClock().now())
        run = ledger.get_run(session, run_id)
    with readonly.ReadOnlyLedger(runtime) as source:  # as `laneway status` reads it
        status = status_report(source, run.id, now=SystemClock().now())

    held = {r.attempt_id: (r.stage, r.gpus) for r in status.running}
    assert len(held) == 4
    for attempt_id, (stage_name, gpus) in held.items():
        assert gpus == (given[attempt_id] or [])
        assert bool(gpus) == (stage_name == "train")
    uuids = sorted(d["uuid"] for _, gpus in held.values() for d in gpus)
    assert uuids == ["GPU-held-0", "GPU-held-1"]  # one device each, distinct

    lines = render.status_text(status).splitlines()
    for attempt_id, (_, gpus) in held.items():
        said = [line for line in lines if line.startswith(f"  attempt {attempt_id} holds ")]
        if gpus:
            (device,) = gpus
            assert said == [
                f"  attempt {attempt_id} holds GPU {device['index']} ({device['uuid']})"
            ]
        else:
            assert said == []
    assert status.as_dict()["running"][0]["gpus"] == status.running[0].gpus  # --json too

    assert explained["attempt"]["gpus"] == given[explained["attempt"]["attempt_id"]]
    (device,) = explained["attempt"]["gpus"]
    assert f"  holds GPU {device['index']} ({device['uuid']})" in render.explain_text(explained)

    if engine.dialect.name == "sqlite":  # the page, in Chromium, on the runtime dir's ledger
        seen_on_the_page(runtime, held)
    gate.touch()
    drive(engine, [worker], run_id)


def seen_on_the_page(runtime: Path, held: dict) -> None:
    """The dashboard's running table names the GPU each attempt holds."""
    import signal

    from tests.integration.test_cli_services import finish, spawn
    from tests.integration.test_web import browser_or_skip, browser_page, serving_url

    playwright_api = browser_or_skip()
    web = spawn("web", "--bind", "127.0.0.1:0", "--runtime-dir", str(runtime))
    try:
        with browser_page(playwright_api, serving_url(web)) as (page, errors):
            page.wait_for_selector("#running tr:nth-child(5)", timeout=30_000)
            rows = page.locator("#running tr").all_inner_texts()[1:]
            for attempt_id, (_, gpus) in held.items():
                (row,) = [r for r in rows if r.startswith(f"{attempt_id}\t")]
                if gpus:
                    assert f"GPU {gpus[0]['index']} ({gpus[0]['uuid']})" in row, row
                else:
                    assert "GPU" not in row, row
            assert errors == []
    finally:
        web.send_signal(signal.SIGTERM)
        finish(web)
