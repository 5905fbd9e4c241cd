"""Issue 47 item 8: ``[nodes.gpu]`` is checked as a GPU description's devices are: at
most 64 devices (``workers.gpu.MAX_DEVICES``), and the memory others use of each device
no more than its total. One line naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from laneway.controller.config import parse_config
from laneway.controller.errors import ConfigError
from laneway.workers.gpu import MAX_DEVICES


def config(gpu: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "t",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1, "gpu": gpu}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": [{"name": "s", "argv": ["true"]}],
        "items": [{"key": "x", "lane": "a"}],
    }


@pytest.mark.parametrize(
    ("gpu", "said"),
    [
        (
            {"total_mib": 100, "baseline_mib": 200},
            "nodes.0.gpu: baseline_mib 200 is more than total_mib 100; give the memory "
            "others use of each device, at most its total",
        ),
        (
            {"total_mib": 100, "devices": MAX_DEVICES + 1},
            f"nodes.0.gpu.devices: Input should be less than or equal to {MAX_DEVICES}",
        ),
        ({"total_mib": 10**400}, "nodes.0.gpu.total_mib:"),
    ],
)
def test_a_bad_gpu_table_is_one_line_naming_the_field(gpu: dict[str, Any], said: str):
    with pytest.raises(ConfigError) as caught:
        parse_config(config(gpu), Path.cwd())
    assert "\n" not in str(caught.value) and str(caught.value).startswith(said)


def test_a_good_gpu_table_is_taken():
    parsed = parse_config(
        config({"total_mib": 100, "baseline_mib": 100, "devices": 64}), Path.cwd()
    )
    (node,) = parsed.nodes
    assert node.gpu is not None and (node.gpu.devices, node.gpu.baseline_mib) == (64, 100)
