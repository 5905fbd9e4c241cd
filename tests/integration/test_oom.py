"""Out-of-memory, named: an attempt whose child died of a SIGKILL laneway did not send
records ``oom_killed`` evidence (from the memory cgroup's oom_kill counter, else from
the node's free memory under its floor); the report counts OOM kills per node and stage;
the OOM-killed attempt's peak feeds the stage's learned reservation. Last, a real process
under a small cgroup memory limit, where this machine lets the test create one."""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.cli import oom_text
from laneway.controller import db, ledger, oom
from laneway.controller.daemon import Controller
from laneway.controller.models import Attempt, Reservation
from laneway.controller.report import build_report
from laneway.controller.report_html import render_html
from laneway.workers.gpu import FakeGpu
from laneway.workers.oom import OomCounter
from laneway.workers.service import WorkerService
from tests.support import make_config, py_stage, wait_until

MIB = 2**20


def _grow_then_die(events: Path | None, release: Path, mib: int) -> str:
    """A job that holds ``mib`` MiB until ``release`` exists, then (as the kernel would)
    bumps the oom_kill counter in ``events`` and dies of SIGKILL."""
    bump = (
        ""
        if events is None
        else (
            f"p = {str(events)!r}; n = int(open(p).read().split('oom_kill ')[1]) + 1\n"
            "open(p, 'w').write(f'oom {n}\\noom_kill {n}\\n')\n"
        )
    )
    return (
        f"import os, signal, time; x = bytearray(b'1') * ({mib} * 2**20)\n"
        f"while not os.path.exists({str(release)!r}): time.sleep(0.01)\n"
        f"{bump}os.kill(os.getpid(), signal.SIGKILL)"
    )


def _attempts(engine, run_id):
    with db.session_factory(engine)() as session:
        return session.scalars(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.id)
        ).all()


def _worker(engine, probe, counter, heartbeat_seconds=2.0):
    service = WorkerService(
        engine,
        node="n1",
        slots=1,
        memory_probe=probe,
        gpu=FakeGpu(),
        sample_seconds=0.0,
        sample_flush_seconds=0.0,
        heartbeat_seconds=heartbeat_seconds,
        oom_counter=counter,
    )
    service.start()
    return service


def _drive_until(engine, service, predicate):
    controller = Controller(engine)

    def step():
        controller.tick()
        service.tick()
        return predicate()

    return wait_until(step)


def test_cgroup_oom_kill_is_named_counted_and_grows_the_learned_reservation(
    engine, make_run, tmp_path
):
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 3\noom_kill 3\n")
    release = tmp_path / "release"
    stage = py_stage(
        "grow",
        _grow_then_die(events, release, 60),
        memory_mib=10,
        learn_memory=True,
        memory_margin=1.5,
    )
    run_id = make_run(make_config([stage], items=2, max_jobs=1))
    service = _worker(engine, lambda: (64e3, 128e3), OomCounter(events))

    _drive_until(engine, service, lambda: (_attempts(engine, run_id)[0].peak_rss_mib or 0) >= 60)
    release.touch()
    _drive_until(
        engine, service, lambda: [a.state for a in _attempts(engine, run_id)] == ["settled"] * 2
    )

    first, second = _attempts(engine, run_id)
    assert first.outcome == "failed" and first.exit_signal == 9  # the class is kept
    assert "from the OOM killer" in first.state_reason
    found = oom.from_diagnostics(first.diagnostics)
    assert found == {
        "source": "cgroup",
        "mem_available_mib": 64000.0,
        "memory_floor_mib": 0,
        "peak_rss_mib": round(first.peak_rss_mib, 1),
    }
    assert oom.from_diagnostics(second.diagnostics)["source"] == "cgroup"
    with db.session_factory(engine)() as session:
        reserved = session.scalars(
            select(Reservation.memory_mib).order_by(Reservation.attempt_id)
        ).all()
    # The first attempt's OOM peak is folded: the second reserves peak x margin, not 10.
    assert reserved == [10, math.ceil(first.peak_rss_mib * 1.5)]

    with db.session_factory(engine)() as session:
        report = build_report(session, ledger.get_run(session, run_id), now=second.settled_at)
    kills = report["oom_kills"]
    assert kills["total"] == 2
    assert kills["by_node"] == {"n1": 2} and kills["by_stage"] == {"grow": 2}
    assert kills["attempts"][0] == {
        "attempt_id": first.id,
        "item": "item0",
        "stage": "grow",
        "node": "n1",
        **found,
    }
    assert "OOM kills: 2" in render_html(report)
    text = "\n".join(oom_text.oom_lines(kills))  # laneway report's text lines
    assert "OOM kills: 2; per node: n1 2; per stage: grow 2" in text
    assert f"attempt {first.id} (item0.grow on n1, cgroup): free 64000 MiB, floor 0" in text


def test_without_a_cgroup_counter_free_memory_under_the_floor_names_it(engine, make_run, tmp_path):
    release = tmp_path / "release"
    free = {"mib": 64e3}
    stage = py_stage("grow", _grow_then_die(None, release, 20), memory_mib=10)
    node = {"name": "n1", "memory_floor_mib": 1024, "max_jobs": 1}
    run_id = make_run(make_config([stage], nodes=[node]))
    service = _worker(engine, lambda: (free["mib"], 128e3), OomCounter(None), heartbeat_seconds=0)

    _drive_until(engine, service, lambda: (_attempts(engine, run_id)[0].peak_rss_mib or 0) >= 20)
    free["mib"] = 700.0  # the node ran short while the attempt ran
    service.tick()  # a heartbeat probes it
    release.touch()
    _drive_until(engine, service, lambda: _attempts(engine, run_id)[0].state == "settled")

    (attempt,) = _attempts(engine, run_id)
    assert attempt.outcome == "failed" and attempt.exit_signal == 9
    # Without a counter of kills the evidence is inferred, and the reason says so.
    assert "out of memory (inferred: no memory cgroup counts kills" in attempt.state_reason
    assert oom.inferred(oom.from_diagnostics(attempt.diagnostics))
    assert oom.from_diagnostics(attempt.diagnostics) == {
        "source": "free_memory",
        "mem_available_mib": 700.0,
        "memory_floor_mib": 1024,
        "peak_rss_mib": round(attempt.peak_rss_mib, 1),
    }


def test_a_sigkill_without_evidence_is_not_called_oom(engine, make_run, tmp_path):
    events = tmp_path / "memory.events"
    events.write_text("oom 0\noom_kill 0\n")
    release = tmp_path / "release"
    release.touch()
    run_id = make_run(make_config([py_stage("die", _grow_then_die(None, release, 1))]))
    service = _worker(engine, lambda: (64e3, 128e3), OomCounter(events))
    _drive_until(engine, service, lambda: _attempts(engine, run_id)[0].state == "settled")
    (attempt,) = _attempts(engine, run_id)
    assert attempt.exit_signal == 9 and attempt.outcome == "failed"
    assert oom.from_diagnostics(attempt.diagnostics) is None
    assert "OOM" not in attempt.state_reason


# -- a real process under a small cgroup memory limit ---------------------------------


def _mounts() -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        parts, after = fields.split(), tail.split()
        if after[0] == "cgroup2" or (after[0] == "cgroup" and "memory" in after[2].split(",")):
            found.setdefault(after[0], (parts[3], parts[4]))
    return found


def _small_cgroup(limit: int) -> tuple[Path, Path]:
    """A new memory cgroup limited to ``limit`` bytes: (its directory, its oom_kill
    counter file). Skips when this machine does not allow one."""
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    mounts = _mounts()
    name = f"laneway-test-{uuid.uuid4().hex[:8]}"
    if "cgroup2" in mounts:
        root = Path(mounts["cgroup2"][1])
        controllers = (root / "cgroup.subtree_control").read_text().split()
        if "memory" in controllers:
            directory = root / name
            try:
                directory.mkdir()
            except OSError as exc:
                pytest.skip(f"cannot create a cgroup v2 memory cgroup: {exc}")
            (directory / "memory.max").write_text(str(limit))
            swap = directory / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            return directory, directory / "memory.events"
    if "cgroup" in mounts:
        directory = Path(mounts["cgroup"][1]) / name
        try:
            directory.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot create a cgroup v1 memory cgroup: {exc}")
        (directory / "memory.limit_in_bytes").write_text(str(limit))
        try:
            (directory / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            pass  # no swap accounting: no swap to escape to either
        if "oom_kill " not in (directory / "memory.oom_control").read_text():
            directory.rmdir()
            pytest.skip("this kernel's cgroup v1 memory.oom_control has no oom_kill counter")
        return directory, directory / "memory.oom_control"
    pytest.skip(
        "no cgroup with the memory controller to create a child in (cgroup v2 without "
        "memory in cgroup.subtree_control, and no cgroup v1 memory hierarchy)"
    )


def test_a_real_process_over_its_cgroup_memory_limit_is_killed_and_named(
    engine, make_run, tmp_path
):
    directory, counter = _small_cgroup(64 * MIB)
    release = tmp_path / "release"
    code = (
        "import os, time\n"
        f"open({str(directory / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
        "held = [bytearray(b'1') * (32 * 2**20)]\n"
        f"while not os.path.exists({str(release)!r}): time.sleep(0.01)\n"
        "for _ in range(128): held.append(bytearray(b'1') * (8 * 2**20))\n"
        "print('survived 1 GiB under a 64 MiB limit')"
    )
    try:
        run_id = make_run(make_config([py_stage("hog", code, memory_mib=10)]))
        service = _worker(engine, lambda: (64e3, 128e3), OomCounter(counter))
        _drive_until(
            engine, service, lambda: (_attempts(engine, run_id)[0].peak_rss_mib or 0) >= 30
        )
        release.touch()
        _drive_until(engine, service, lambda: _attempts(engine, run_id)[0].state == "settled")
    finally:
        release.touch()
        wait_until(lambda: not (directory / "cgroup.procs").read_text().strip())
        directory.rmdir()
    (attempt,) = _attempts(engine, run_id)
    assert attempt.exit_signal == 9 and attempt.outcome == "failed", attempt.state_reason
    found = oom.from_diagnostics(attempt.diagnostics)
    assert found is not None and found["source"] == "cgroup"
    assert found["peak_rss_mib"] >= 30
