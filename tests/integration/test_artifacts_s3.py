"""Stage artifacts across machines: two worker services for two node names, each with
its own runtime dir, sharing nothing but the ledger and an S3-compatible server on
loopback (moto's server mode, a real HTTP S3 endpoint reached through s3fs).

prepare and solve run on node "a", review on node "b" (the stage's ``nodes``). b's
inputs arrive verified from the object store; then a byte flipped in a stored object
makes b's next review attempt a harness failure naming both hashes, and nothing of it
runs."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from laneway.controller import db
from laneway.controller.models import Artifact, Attempt, AttemptInput, Control, Job
from tests.integration.test_two_nodes import Cluster
from tests.support import escape, wait_until

pytestmark = pytest.mark.slow

BUCKET = "laneway-artifacts"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "moto-test-key-id",
    "AWS_SECRET_ACCESS_KEY": "moto-test-secret-access-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}

PREPARE = """
import sys
open("packet.txt", "w").write("question for " + sys.argv[1])
"""
SOLVE = """
import sys
packet = open(sys.argv[2]).read()
open("answer.txt", "w").write(packet + " -> 42")
"""
REVIEW = """
import json, os, sys
answer = open(sys.argv[2]).read()
with open(sys.argv[3], "a") as f:
    f.write(sys.argv[1] + " " + answer + "\\n")
leaked = sorted(k for k in os.environ if k.startswith("AWS_"))
json.dump({"job_id": os.environ["LANEWAY_JOB_ID"], "aws_env": leaked},
          open(os.environ["LANEWAY_RESULT_PATH"], "w"))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def s3(tmp_path):
    """A moto S3 server on loopback; yields its endpoint URL."""
    port = free_port()
    log = (tmp_path / "moto.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=log,
    )
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    try:
        wait_until(up)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def s3fs_for(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(
        key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": endpoint},
    )


def write_config(tmp: Path, items: list[str], store: str = f"s3://{BUCKET}/runs") -> Path:
    def argv(code: str, *rest: str) -> str:
        return json.dumps([sys.executable, "-c", escape(code), "{item}", *rest])

    listed = ", ".join(f'{{ key = "{key}", lane = "main" }}' for key in items)
    path = tmp / f"pipeline-{'-'.join(items)}.toml"
    path.write_text(
        f"""
name = "across"
artifact_store = "{store}"
nodes = [
  {{ name = "a", memory_floor_mib = 0, max_jobs = 2 }},
  {{ name = "b", memory_floor_mib = 0, max_jobs = 2 }},
]
lanes = [{{ name = "main", node = "a" }}]
items = [{listed}]

[[stages]]
name = "prepare"
argv = {argv(PREPARE)}
outputs = ["packet.txt"]

[[stages]]
name = "solve"
argv = {argv(SOLVE, "{inputs.prepare}/packet.txt")}
needs = ["prepare"]
outputs = ["answer.txt"]

[[stages]]
name = "review"
argv = {argv(REVIEW, "{inputs.solve}/answer.txt", str(tmp / "reviewed.log"))}
needs = ["solve"]
nodes = ["b"]
"""
    )
    return path


class Nodes(Cluster):
    """Nodes a and b (tests/integration/test_two_nodes.py's Cluster), with the S3
    endpoint and credentials in every process's environment."""

    def __init__(self, tmp: Path, endpoint: str | None) -> None:
        env = {"AWS_ENDPOINT_URL": endpoint, **CREDENTIALS} if endpoint else {}
        super().__init__(tmp, ("a", "b"), env)
        for directory in self.dirs.values():
            directory.mkdir()

    def worker(self, node: str) -> None:
        self.start(node, "worker", "--node", node, "--slots", "2", where=node)

    def stop_one(self, name: str) -> None:
        process = self.processes.pop(name)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)

    def rows(self, model, *where):
        with db.session_factory(self.engine)() as session:
            return list(session.scalars(select(model).where(*where)))

    def stage_attempts(self, run_id: int, stage: str) -> list[Attempt]:
        with db.session_factory(self.engine)() as session:
            return list(
                session.scalars(
                    select(Attempt)
                    .join(Job, Job.id == Attempt.job_id)
                    .where(Attempt.run_id == run_id, Job.stage == stage)
                    .order_by(Attempt.id)
                )
            )

    def reviewed(self) -> list[str]:
        path = self.tmp / "reviewed.log"
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def nodes(tmp_path, s3, ledger_backend):
    s3fs_for(s3).mkdir(BUCKET)
    made = Nodes(tmp_path, s3)
    yield made
    made.stop()


def start_run(nodes: Nodes, items: list[str], store: str = f"s3://{BUCKET}/runs") -> int:
    config = write_config(nodes.tmp, items, store)
    started = nodes.cli("start-pipeline", str(config), "--no-controller", "--json")
    assert started.returncode == 0, started.stderr
    return int(json.loads(started.stdout)["run_id"])


def test_review_on_another_node_gets_verified_inputs_and_a_flipped_byte_never_runs(nodes, s3):
    # Run 1: prepare and solve on a, review on b; b's input came through S3, verified.
    first = start_run(nodes, ["q1"])
    nodes.start("controller", "controller", where="control")
    nodes.worker("a")
    nodes.worker("b")
    wait_until(lambda: nodes.reviewed() == ["q1 question for q1 -> 42"], timeout=120)
    for stage, node in (("prepare", "a"), ("solve", "a"), ("review", "b")):
        (attempt,) = wait_until(
            lambda stage=stage: [
                a for a in nodes.stage_attempts(first, stage) if a.state == "settled"
            ]
        )
        assert attempt.outcome == "succeeded", attempt.state_reason
        assert attempt.node == node
        assert attempt.attempt_dir.startswith(str(nodes.dirs[node]))
    (review,) = nodes.stage_attempts(first, "review")
    assert review.result["aws_env"] == []  # store credentials never reach a job
    (answer,) = nodes.rows(Artifact, Artifact.run_id == first, Artifact.stage == "solve")
    assert (
        answer.location == (f"s3://{BUCKET}/runs/sha256/{answer.sha256[:2]}/{answer.sha256}")
        and answer.node == "a"
    )
    (given,) = nodes.rows(AttemptInput, AttemptInput.attempt_id == review.id)
    assert given.artifact_id == answer.id and given.node == "b"
    fetched = Path(review.attempt_dir) / "inputs" / "solve" / "answer.txt"
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == answer.sha256
    # Nothing of a's runtime dir is on b's side: the bytes came from the object store.
    assert not any(nodes.dirs["b"].rglob("packet.txt"))
    assert not (nodes.dirs["a"] / "artifacts").exists()

    # Run 2: b is away while solve stores its answer; one byte of the object flips.
    nodes.stop_one("b")
    second = start_run(nodes, ["q2"])
    (stored,) = wait_until(
        lambda: nodes.rows(Artifact, Artifact.run_id == second, Artifact.stage == "solve"),
        timeout=120,
    )
    store = s3fs_for(s3)
    key = stored.location.removeprefix("s3://")
    data = bytearray(store.cat_file(key))
    data[-1] ^= 0x01
    store.pipe_file(key, bytes(data))
    flipped = hashlib.sha256(bytes(data)).hexdigest()
    nodes.worker("b")

    (refused,) = wait_until(
        lambda: [a for a in nodes.stage_attempts(second, "review") if a.state == "settled"],
        timeout=120,
    )
    assert refused.outcome == "harness_failure" and refused.node == "b"
    assert stored.sha256 in refused.state_reason and flipped in refused.state_reason
    assert refused.child_pid is None and refused.supervisor_pid is None
    assert nodes.reviewed() == ["q1 question for q1 -> 42"]  # nothing of it ran
    assert not (Path(refused.attempt_dir) / "inputs" / "solve" / "answer.txt").exists()
    pauses = nodes.rows(Control, Control.run_id == second, Control.cleared_at.is_(None))
    assert [p.kind for p in pauses] == ["pause"]


def test_a_store_on_a_shared_mount_hands_files_between_nodes(tmp_path, ledger_backend):
    """``file://`` on a mount both nodes see (here a directory both processes reach):
    objects land there, not in either runtime dir, and b's input is a's bytes."""
    shared = tmp_path / "shared-mount"
    shared.mkdir()
    nodes = Nodes(tmp_path, endpoint=None)
    try:
        run_id = start_run(nodes, ["q1"], store=shared.as_uri() + "/laneway")
        nodes.start("controller", "controller", where="control")
        nodes.worker("a")
        nodes.worker("b")
        wait_until(lambda: nodes.reviewed() == ["q1 question for q1 -> 42"], timeout=120)
        (answer,) = nodes.rows(Artifact, Artifact.run_id == run_id, Artifact.stage == "solve")
        expected = shared / "laneway" / "sha256" / answer.sha256[:2] / answer.sha256
        assert answer.location == expected.as_uri() and expected.is_file()
        (review,) = wait_until(
            lambda: [a for a in nodes.stage_attempts(run_id, "review") if a.state == "settled"]
        )
        assert review.outcome == "succeeded" and review.node == "b"
        fetched = Path(review.attempt_dir) / "inputs" / "solve" / "answer.txt"
        assert hashlib.sha256(fetched.read_bytes()).hexdigest() == answer.sha256
        assert not any((nodes.dirs[n] / "artifacts").exists() for n in ("a", "b"))
    finally:
        nodes.stop()
