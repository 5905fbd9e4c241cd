"""Stage artifacts end to end, in-process worker and controller, real supervisors and
jobs: declared outputs are hashed and stored when an attempt succeeds, recorded with
its settle; the stages that need them get them under inputs/<stage>/, verified, with
their lineage recorded; a missing output fails the attempt, a store that cannot take
it is a harness failure, and an input whose bytes changed never starts its job."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from sqlalchemy import select, text

from laneway.controller import db
from laneway.controller.attempt import artifacts
from laneway.controller.clock import SystemClock
from laneway.controller.models import Artifact, AttemptInput, Control, Run
from laneway.controller.states import ControlKind
from tests.integration.test_worker import attempts, drive, start_worker
from tests.support import clear_run_control, control_run, escape, make_config, py_stage, wait_until

PREPARE = """
import json, os, sys
os.makedirs("shards", exist_ok=True)
with open("packet.json", "w") as f:
    json.dump({"item": sys.argv[1], "question": "6 x 7"}, f)
for n in range(2):
    with open(f"shards/{n}.jsonl", "w") as f:
        f.write(sys.argv[1] + str(n))
"""

SOLVE = """
import json, os, sys
inputs = sys.argv[2]
packet = json.load(open(os.path.join(inputs, "packet.json")))
shards = sorted(os.listdir(os.path.join(inputs, "shards")))
with open(sys.argv[3], "a") as f:
    f.write(os.environ["LANEWAY_IDEMPOTENCY_KEY"] + "\\n")
with open("answer.txt", "w") as f:
    f.write(packet["item"] + ":42:" + ",".join(shards))
json.dump({"job_id": os.environ["LANEWAY_JOB_ID"], "inputs_dir": os.environ["LANEWAY_INPUTS_DIR"]},
          open(os.environ["LANEWAY_RESULT_PATH"], "w"))
"""


def stages(tmp: Path, **solve_extra):
    return [
        {
            "name": "prepare",
            "argv": [sys.executable, "-c", escape(PREPARE), "{item}"],
            "outputs": ["packet.json", "shards/*.jsonl"],
            "timeout_seconds": 30,
        },
        {
            "name": "solve",
            "argv": [
                sys.executable,
                "-c",
                escape(SOLVE),
                "{item}",
                "{inputs.prepare}",
                str(tmp / "solve-ran.log"),
            ],
            "needs": ["prepare"],
            "outputs": ["answer.txt"],
            "timeout_seconds": 30,
            **solve_extra,
        },
    ]


def rows(engine, model, **where):
    with db.session_factory(engine)() as session:
        query = select(model)
        for name, value in where.items():
            query = query.where(getattr(model, name) == value)
        return list(session.scalars(query))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_outputs_are_stored_and_given_verified_to_the_stage_that_needs_them(
    engine, runtime, make_run, tmp_path
):
    run_id = make_run(make_config(stages(tmp_path), items=2))
    drive(engine, [start_worker(engine)], run_id)
    done = attempts(engine, run_id)
    assert [a.outcome for a in done] == ["succeeded"] * 4, [a.state_reason for a in done]
    by_job = {a.id: a for a in done}

    stored = rows(engine, Artifact, run_id=run_id)
    assert {(a.stage, a.name) for a in stored} == {
        (stage, name)
        for stage, name in [
            ("prepare", "packet.json"),
            ("prepare", "shards/0.jsonl"),
            ("prepare", "shards/1.jsonl"),
            ("solve", "answer.txt"),
        ]
        for _ in range(2)
    }
    assert len(stored) == 8
    for artifact in stored:
        produced = Path(by_job[artifact.attempt_id].attempt_dir) / "workspace" / artifact.name
        assert artifact.sha256 == sha256(produced)
        assert artifact.size_bytes == produced.stat().st_size
        assert artifact.node == "n1"
        # Content-addressed under the runtime dir, private to its owner.
        assert artifact.location == (
            f"{(runtime / 'artifacts').resolve().as_uri()}/sha256/"
            f"{artifact.sha256[:2]}/{artifact.sha256}"
        )
        obj = runtime / "artifacts" / "sha256" / artifact.sha256[:2] / artifact.sha256
        assert sha256(obj) == artifact.sha256
        assert stat.S_IMODE(obj.stat().st_mode) == 0o600

    # Each solve attempt got its own item's packet, under inputs/prepare/, verified.
    solves = [a for a in done if a.attempt_dir.endswith(".solve/attempt-1")]
    for solve in solves:
        given = rows(engine, AttemptInput, attempt_id=solve.id)
        assert sorted(g.name for g in given) == ["packet.json", "shards/0.jsonl", "shards/1.jsonl"]
        inputs = Path(solve.attempt_dir) / "inputs"
        assert solve.result["inputs_dir"] == str(inputs)
        for g in given:
            assert g.stage == "prepare" and sha256(inputs / "prepare" / g.name) == g.sha256
        item = json.loads((inputs / "prepare" / "packet.json").read_text())["item"]
        answer = (Path(solve.attempt_dir) / "workspace" / "answer.txt").read_text()
        assert answer == f"{item}:42:0.jsonl,1.jsonl"

    # Lineage is one query: which attempt wrote what each solve attempt read.
    with db.session_factory(engine)() as session:
        lineage = session.execute(
            text(
                "SELECT item, stage, attempt_id, input_stage, input_name, sha256, "
                "producing_attempt_id FROM v_lineage WHERE run_id = :run AND input_name = "
                "'packet.json' ORDER BY item"
            ),
            {"run": run_id},
        ).all()
    assert [row.item for row in lineage] == ["item0", "item1"]
    for row in lineage:
        producer = by_job[row.producing_attempt_id]
        assert producer.attempt_dir.endswith(f"{row.item}.prepare/attempt-1")
        assert row.stage == "solve" and row.input_stage == "prepare"
        assert row.sha256 == sha256(Path(producer.attempt_dir) / "workspace" / "packet.json")


def test_a_missing_declared_output_fails_the_attempt_naming_the_file(engine, make_run, tmp_path):
    config = stages(tmp_path)
    config[0]["outputs"] = ["packet.json", "report.md"]
    config[0]["retry"] = {"max_attempts": 1}
    run_id = make_run(make_config(config, items=1))
    drive(engine, [start_worker(engine)], run_id)
    prepare = attempts(engine, run_id)[0]
    assert prepare.outcome == "failed"
    assert "report.md" in prepare.state_reason and "did not deliver" in prepare.state_reason
    assert prepare.exit_code == 0
    assert rows(engine, Artifact, run_id=run_id) == []
    assert not (tmp_path / "solve-ran.log").exists()


def test_a_store_that_cannot_take_the_outputs_is_a_harness_failure(engine, make_run, tmp_path):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the store's directory would be")
    config = stages(tmp_path)
    config[0]["retry"] = {"max_attempts": 1}
    run_id = make_run(
        make_config(config, items=1, artifact_store=blocked.resolve().as_uri() + "/store")
    )
    drive(engine, [start_worker(engine)], run_id)
    prepare = attempts(engine, run_id)[0]
    assert prepare.outcome == "harness_failure"
    assert "could not be stored" in prepare.state_reason
    assert prepare.exit_code == 0  # kept
    # The files stay where the job wrote them; nothing is recorded as stored.
    assert (Path(prepare.attempt_dir) / "workspace" / "packet.json").exists()
    assert rows(engine, Artifact, run_id=run_id) == []


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_an_input_whose_stored_bytes_changed_never_starts_and_pauses_the_run(
    engine, runtime, make_run, tmp_path, damage
):
    """A stored input whose bytes changed, or that is gone from the store, never starts
    the attempt that needs it: harness_failure naming the hash, the run paused."""
    release = tmp_path / "release"
    config = stages(tmp_path)
    config[0]["argv"][2] = escape(
        f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.02)\n" + PREPARE
    )
    run_id = make_run(make_config(config, items=1))
    worker = start_worker(engine)
    factory = db.session_factory(engine)
    wait_until(lambda: worker.tick() and attempts(engine, run_id))
    # Held by an operator's pause while prepare finishes, so solve is claimed only after
    # a byte of the packet's stored object has flipped.
    with db.transaction(factory) as session:
        control_run(
            session,
            ControlKind.PAUSE,
            run_id,
            reason="test",
            actor="test",
            now=db.ledger_now(session, SystemClock()),
        )
    release.touch()

    def prepared():
        worker.tick()
        return [a for a in rows(engine, Artifact, run_id=run_id) if a.name == "packet.json"]

    packet = wait_until(prepared)[0]
    obj = runtime / "artifacts" / "sha256" / packet.sha256[:2] / packet.sha256
    if damage == "flipped":
        data = bytearray(obj.read_bytes())
        data[0] ^= 0x01
        os.chmod(obj, 0o600)
        obj.write_bytes(bytes(data))
        found = hashlib.sha256(bytes(data)).hexdigest()
    else:
        obj.unlink()
        found = "is not in the store"
    with db.transaction(factory) as session:
        clear_run_control(
            session,
            ControlKind.PAUSE,
            run_id,
            reason="test",
            actor="test",
            now=db.ledger_now(session, SystemClock()),
        )

    def solve_settled():
        worker.tick()
        found = [a for a in attempts(engine, run_id) if a.attempt_dir.endswith(".solve/attempt-1")]
        return found and found[0].state == "settled" and found[0]

    solve = wait_until(solve_settled)
    assert solve.outcome == "harness_failure"
    assert packet.sha256 in solve.state_reason and found in solve.state_reason
    assert solve.state_reason.startswith("not started:")
    # Nothing of it ran: no process, no side effect, no file kept from the bad bytes.
    assert solve.child_pid is None and solve.supervisor_pid is None
    assert not (tmp_path / "solve-ran.log").exists()
    assert not (Path(solve.attempt_dir) / "inputs" / "prepare" / "packet.json").exists()
    # Its intended inputs are recorded (the lineage of what it was to read).
    assert {g.sha256 for g in rows(engine, AttemptInput, attempt_id=solve.id)} >= {packet.sha256}
    pauses = [c for c in rows(engine, Control, run_id=run_id, kind="pause") if not c.cleared_at]
    assert len(pauses) == 1
    assert packet.sha256 in pauses[0].reason
    with db.session_factory(engine)() as session:
        assert session.get(Run, run_id).state == "active"


def test_a_reused_job_hands_on_the_outputs_its_earlier_run_stored(engine, make_run, tmp_path):
    first = make_run(make_config(stages(tmp_path), items=1))
    worker = start_worker(engine)
    drive(engine, [worker], first)
    (packet,) = [a for a in rows(engine, Artifact, run_id=first) if a.name == "packet.json"]

    # The next run changes solve only: prepare is reused, solve runs on its packet.
    changed = stages(tmp_path)
    changed[1]["argv"].append("--version-2")
    second = make_run(make_config(changed, items=1))
    drive(engine, [worker], second)
    ran = attempts(engine, second)
    assert [a.attempt_dir.rsplit("/", 2)[-2] for a in ran] == ["item0.solve"]
    assert ran[0].outcome == "succeeded", ran[0].state_reason
    given = {g.name: g for g in rows(engine, AttemptInput, attempt_id=ran[0].id)}
    assert given["packet.json"].artifact_id == packet.id
    assert given["packet.json"].sha256 == packet.sha256
    fetched = Path(ran[0].attempt_dir) / "inputs" / "prepare" / "packet.json"
    assert sha256(fetched) == packet.sha256


def test_a_stage_that_now_declares_outputs_is_not_reused_from_a_run_that_stored_none(
    engine, make_run, tmp_path
):
    before = stages(tmp_path)
    before[0]["outputs"] = []
    before = before[:1]  # prepare alone, delivering nothing
    first = make_run(make_config(before, items=1))
    worker = start_worker(engine)
    drive(engine, [worker], first)
    assert rows(engine, Artifact, run_id=first) == []

    # The same prepare, now declaring its outputs, and solve needing them: prepare runs
    # again (its earlier result stored nothing to hand on), then solve gets its packet.
    second = make_run(make_config(stages(tmp_path), items=1))
    drive(engine, [worker], second)
    ran = sorted(a.attempt_dir.rsplit("/", 2)[-2] for a in attempts(engine, second))
    assert ran == ["item0.prepare", "item0.solve"]
    assert all(a.outcome == "succeeded" for a in attempts(engine, second))


def test_the_worker_renews_its_leases_within_one_large_transfer(
    engine, make_run, tmp_path, monkeypatch
):
    """The worker's lease renewal runs after every chunk of a single file it stores or
    fetches, not only between files (here 64 bytes in chunks of 8)."""
    monkeypatch.setattr(artifacts, "CHUNK", 8)
    producer = "open('big.bin', 'wb').write(bytes(range(64)))"
    consumer = "import sys; assert len(open(sys.argv[1], 'rb').read()) == 64"
    config = make_config(
        [
            py_stage("p", producer, outputs=["big.bin"]),
            {
                **py_stage("c", consumer, needs=["p"]),
                "argv": [sys.executable, "-c", consumer, "{inputs.p}/big.bin"],
            },
        ],
        items=1,
    )
    run_id = make_run(config)
    worker = start_worker(engine)
    beats: list[str] = []
    renew, give = worker._heartbeat_if_due, worker.spawning.give_inputs
    deliver = worker.finishing.deliver

    def counted(name, call):
        def wrapped(*args):
            before = len(beats)
            result = call(*args)
            beats.append(f"{name}:{len(beats) - before}")
            return result

        return wrapped

    monkeypatch.setattr(worker, "_heartbeat_if_due", lambda: (beats.append("."), renew())[1])
    monkeypatch.setattr(worker.spawning, "give_inputs", counted("fetch", give))
    monkeypatch.setattr(worker.finishing, "deliver", counted("store", deliver))
    drive(engine, [worker], run_id)
    done: dict[str, int] = {}
    for entry in beats:
        if ":" in entry:  # the most renewals any one store or fetch made
            name, count = entry.split(":")
            done[name] = max(done.get(name, 0), int(count))
    # Storing: 8 chunks hashed, 8 written, 8 read back (+1 before the file); fetching: 8.
    assert done["store"] >= 24 and done["fetch"] >= 8
    assert {a.outcome for a in attempts(engine, run_id)} == {"succeeded"}


def test_reuse_trusts_only_the_store_a_producer_whose_output_is_gone_runs_again(
    engine, make_run, tmp_path
):
    """A new run takes over a producer only while every artifact it stored is still in
    the store with its bytes (``pipeline.gone_outputs``, looked at before the run's
    transaction); otherwise the producer runs again (the reason on its job) and its
    consumer with it, instead of failing on an input that is not there."""
    from urllib.parse import urlsplit

    from laneway.controller import pipeline
    from laneway.controller.models import Job

    config = make_config(stages(tmp_path), items=3)
    first = make_run(config)
    worker = start_worker(engine)
    drive(engine, [worker], first)
    packets = {
        a.attempt_id: a for a in rows(engine, Artifact, run_id=first) if a.name == "packet.json"
    }
    gone, changed, kept = sorted(packets.values(), key=lambda a: a.attempt_id)
    Path(urlsplit(gone.location).path).unlink()
    Path(urlsplit(changed.location).path).write_text('{"item": "tampered"}')

    distrust = pipeline.gone_outputs(engine, config, {}, ())
    assert distrust == {
        gone.attempt_id: (
            f"output packet.json of attempt {gone.attempt_id}: {gone.location} is no longer "
            "in the store"
        ),
        changed.attempt_id: (
            f"output packet.json of attempt {changed.attempt_id}: {changed.location} holds "
            f"sha256 {sha256(Path(urlsplit(changed.location).path))[:12]}…, not the "
            f"{changed.sha256[:12]}… it stored"
        ),
    }
    second = make_run(config, distrust=distrust)
    # Created ready, each saying why it was not reused; the intact producer is reused.
    prepares = sorted(rows(engine, Job, run_id=second, stage="prepare"), key=lambda j: j.id)
    assert [(j.state.value, j.reused_from) for j in prepares] == [
        ("ready", None),
        ("ready", None),
        ("succeeded", kept.attempt_id),
    ]
    assert [j.state_reason for j in prepares[:2]] == [
        f"runs again, not reused: {distrust[gone.attempt_id]}",
        f"runs again, not reused: {distrust[changed.attempt_id]}",
    ]
    drive(engine, [worker], second)
    ran = sorted(a.attempt_dir.rsplit("/", 2)[-2] for a in attempts(engine, second))
    assert ran == ["item0.prepare", "item0.solve", "item1.prepare", "item1.solve"]
    assert all(a.outcome == "succeeded" for a in attempts(engine, second))
