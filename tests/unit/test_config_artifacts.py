"""Config checks for stage artifacts: declared outputs, {inputs.<stage>} placeholders,
stage nodes and the artifact store URL, each refused with a line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneway.controller.config import PREVIEW_INPUTS_ROOT, preview_argv
from laneway.controller.errors import ConfigError
from laneway.controller.launch import render_command
from tests.support import make_config

pytestmark = pytest.mark.no_ledger


def stages(**consumer):
    return [
        {"name": "prepare", "argv": ["true"], "outputs": ["packet.json", "shards/*.jsonl"]},
        {
            "name": "solve",
            "argv": ["cat", "{inputs.prepare}/packet.json"],
            "needs": ["prepare"],
            **consumer,
        },
    ]


def problems(**extra) -> str:
    with pytest.raises((ConfigError, ValueError)) as caught:
        make_config(**extra)
    return str(caught.value)


def test_inputs_placeholder_renders_to_the_attempts_inputs_dir():
    config = make_config(stages())
    item = config.items[0]
    argv, _, _ = render_command(config.stage("solve"), item, inputs_root="/att/inputs")
    assert argv == ["cat", "/att/inputs/prepare/packet.json"]
    assert preview_argv(config)["solve"] == ["cat", f"{PREVIEW_INPUTS_ROOT}/prepare/packet.json"]


@pytest.mark.parametrize("output", ["/etc/passwd", "../outside", "a/../../b", "", "a\\b"])
def test_an_output_outside_the_workspace_is_refused(output):
    message = problems(stages=[{"name": "prepare", "argv": ["true"], "outputs": [output]}])
    assert "outputs" in message


def test_inputs_of_a_stage_that_is_not_needed_or_has_no_outputs_are_refused():
    message = problems(stages=stages(needs=[]))
    assert "{inputs.prepare}" in message and "needs" in message
    no_outputs = stages()
    no_outputs[0]["outputs"] = []
    assert "declare outputs on 'prepare'" in problems(stages=no_outputs)


def test_stage_nodes_must_be_known_and_not_empty():
    assert "stages.1.nodes: unknown node 'elsewhere'" in problems(
        stages=stages(nodes=["elsewhere"])
    )
    assert "stages.1.nodes: empty" in problems(stages=stages(nodes=[]))
    assert make_config(stages(nodes=["n1"])).stage("solve").nodes == ["n1"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("/srv/artifacts", "is not a URL"),
        ("s3://AKIAEXAMPLE:secret@bucket/prefix", "holds credentials"),
        ("s3://bucket/prefix?key=abc", "holds credentials"),
        ("file://host/srv", "absolute path"),
        ("memory://x", "one process"),
        ("nosuchstore://bucket", "fsspec knows no nosuchstore://"),
    ],
)
def test_a_bad_artifact_store_is_one_line_naming_the_field(url, expected):
    message = problems(stages=stages(), artifact_store=url)
    assert message.count("artifact_store:") == 1 and expected in message


def test_file_and_s3_stores_are_accepted(tmp_path: Path):
    assert make_config(stages(), artifact_store=tmp_path.as_uri()).artifact_store
    assert make_config(stages(), artifact_store="s3://bucket/prefix").artifact_store
