"""Issue 47 item 8 and issue 46 item 5 at the command line: a bad GPU description is one
line and exit 2 wherever the flag is taken (`dry-run`, a real `laneway worker`
process), and the GPU preflight refusal names the one fix every command that checks it
can use, the config's `[nodes.gpu]`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import finish, spawn

REFUSAL = (
    "stages.train.gpus: 2 GPU(s) per attempt, but no node it runs on (n1) has that many; "
    "give the node its GPUs in the config: `[nodes.gpu]` with total_mib and devices"
)


def gpu_config(tmp_path: Path, gpu: dict | None = None) -> Path:
    node: dict = {"name": "n1", "memory_floor_mib": 0, "max_jobs": 2}
    if gpu is not None:
        node["gpu"] = gpu
    body = {
        "name": "gpu-flag",
        "nodes": [node],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [{"name": "train", "argv": [sys.executable, "-c", "pass"], "gpus": 2}],
        "items": [{"key": "x0", "lane": "a"}],
    }
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(body))
    return path


def bad_descriptions(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each bad description and the end of its one line."""
    twins = tmp_path / "twins.json"
    twins.write_text(
        json.dumps(
            {
                "devices": [
                    {"uuid": "GPU-same", "total_mib": 80},
                    {"uuid": "GPU-same", "total_mib": 80},
                ]
            }
        )
    )
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    return {
        "duplicate uuid": (
            twins,
            "devices[1].uuid: GPU-same is named twice; two attempts would get the same GPU",
        ),
        "fifo": (fifo, "cannot read it: not a regular file (a FIFO)"),
        "deep": (deep, "is not JSON (nested too deeply)"),
    }


@pytest.mark.timeout(120)
def test_a_bad_description_is_one_line_and_exit_2_in_dry_run_and_a_real_worker(tmp_path):
    config = gpu_config(tmp_path)
    for name, (path, said) in bad_descriptions(tmp_path).items():
        line = f"laneway: --gpu-description: {path}: {said}"
        planned = invoke("dry-run", str(config), "--gpu-description", str(path))
        assert planned.exit_code == 2, (name, planned.output)
        assert planned.stderr.strip().splitlines() == [line], name
        worker = spawn(
            "worker", "--node", "n1", "--gpu-description", str(path), "--exit-if-unknown",
            "--runtime-dir", str(tmp_path / "rt"),
        )  # fmt: skip
        code, _out, err = finish(worker)
        assert code == 2 and err.strip().splitlines() == [line], (name, err)


def test_the_gpu_refusal_names_the_config_and_the_config_is_the_fix(tmp_path):
    """`run` and `start-pipeline` check the config alone: the refusal names
    `[nodes.gpu]`, never a flag they do not take; with it, both preflight clean."""
    runtime = ["--runtime-dir", str(tmp_path / "rt")]
    config = gpu_config(tmp_path)
    for command in (["start-pipeline", str(config), *runtime], ["run", str(config), *runtime]):
        refused = invoke(*command, "--json")
        assert refused.exit_code == 1, refused.output
        assert REFUSAL in refused.output and "--gpu-description" not in refused.output
    planned = invoke("dry-run", str(config), "--json")
    assert json.loads(planned.stdout)["preflight"]["reasons"] == [REFUSAL]
    fixed = gpu_config(tmp_path, {"total_mib": 81920, "devices": 2})
    planned = invoke("dry-run", str(fixed), "--json")
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["preflight"] == {"ok": True, "reasons": []}
