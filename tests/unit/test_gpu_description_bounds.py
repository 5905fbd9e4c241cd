"""Issue 47, item 8: a GPU description (``--gpu-description FILE``) is an input like a
config, and the devices NVML reports pass the same check.

Before: 100,000 nested arrays raised RecursionError; a 401-digit ``total_mib`` raised
OverflowError; a FIFO hung the command; a link to /dev/zero ran out of memory after
53 s; a uuid with NUL, a lone surrogate, a space or a newline was accepted (and reached
``CUDA_VISIBLE_DEVICES`` verbatim, or made every GPU attempt a harness failure); two
devices with the same uuid gave one GPU to two whole-GPU attempts at once."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laneway.controller import limits
from laneway.workers.gpu import (
    DESCRIPTION_MAX_BYTES,
    MAX_DEVICES,
    UUID_PATTERN,
    DescribedGpu,
    DescriptionError,
    GpuDevice,
    NvmlGpu,
    devices_problem,
    load_description,
)
from tests.integration.test_sampler import fake_pynvml


def device(i: int, **change: Any) -> dict[str, Any]:
    return {"index": i, "uuid": f"GPU-{i:04d}", "total_mib": 81920, "baseline_mib": 0, **change}


def write(tmp_path: Path, body: Any, name: str = "gpus.json") -> Path:
    path = tmp_path / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def refusal(path: Path) -> str:
    with pytest.raises(DescriptionError) as caught:
        load_description(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--gpu-description: {path}")
    return message[len(f"--gpu-description: {path}: ") :]


@pytest.mark.parametrize(
    ("devices", "said"),
    [
        ([device(0), device(1, uuid="GPU-0000")], "devices[1].uuid: GPU-0000 is named twice"),
        ([device(0), device(1, uuid="gpu-0000")], "devices[1].uuid: gpu-0000 is named twice"),
        ([device(0), device(0, uuid="GPU-9")], "devices[1].index: 0 is named twice"),
        (
            [device(0, total_mib=10**400)],
            "devices[0]: total_mib must be a number in (0, 2147483647]",
        ),
        (
            [device(0, baseline_mib=-(10**400))],
            "devices[0]: total_mib must be a number in (0, 2147483647]",
        ),
        ([device(0, total_mib=True)], "devices[0]: total_mib must be a number in (0, 2147483647]"),
        (
            [device(0, total_mib="81920")],
            "devices[0]: total_mib must be a number in (0, 2147483647]",
        ),
        (
            [device(0, total_mib=limits.LEDGER_INT_MAX + 1)],
            "devices[0]: total_mib must be a number in",
        ),
        ([device(10**400)], "devices[0].index: must be an integer in [0, 63]"),
        ([device(MAX_DEVICES)], "devices[0].index: must be an integer in [0, 63]"),
        ([device(0, index=True)], "devices[0].index: must be an integer"),
        ([device(0, uuid="GPU-a\x00b")], "devices[0].uuid: must be a device name"),
        ([device(0, uuid="GPU-\ud800")], "devices[0].uuid: must be a device name"),
        ([device(0, uuid="GPU-a b")], "devices[0].uuid: must be a device name"),
        ([device(0, uuid="GPU-a\n")], "devices[0].uuid: must be a device name"),
        ([device(0, uuid="GPU-a,GPU-b")], "devices[0].uuid: must be a device name"),
        ([device(0, uuid="")], "devices[0].uuid: must be a device name"),
        ([device(0, uuid=7)], "devices[0].uuid: must be a device name"),
        ([device(i) for i in range(MAX_DEVICES + 1)], "`devices` has 65, more than the 64"),
        ([], "needs a non-empty list `devices`"),
    ],
)
def test_a_bad_device_is_one_line_naming_the_field(tmp_path: Path, devices, said):
    path = tmp_path / "gpus.json"
    # ensure_ascii keeps a lone surrogate as its JSON escape, as a hostile file holds it
    path.write_text(json.dumps({"devices": devices}))
    assert refusal(path).startswith(said)


def test_deep_nesting_is_refused_in_one_line(tmp_path: Path):
    deep = write(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert refusal(deep) == "is not JSON (nested too deeply)"
    shallow_but_deep = write(tmp_path, {"devices": [device(0)], "x": [[[[[[[[[1]]]]]]]]]}, "b")
    assert refusal(shallow_but_deep).startswith("nests deeper than 8 levels")


@pytest.mark.timeout(30)
def test_a_fifo_a_device_and_a_huge_file_are_refused_at_once(tmp_path: Path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # read by name, it would wait for a writer for ever
    assert refusal(fifo) == "cannot read it: not a regular file (a FIFO)"
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")  # read whole, it never ends
    assert refusal(zero) == "cannot read it: not a regular file (a character device)"
    huge = write(tmp_path, " " * (DESCRIPTION_MAX_BYTES + 1), "huge.json")
    assert refusal(huge) == "cannot read it: larger than 1 MiB"
    assert refusal(tmp_path / "missing.json") == "cannot read it: No such file or directory"


def test_the_usage_dir_is_text_without_nul(tmp_path: Path):
    bad = write(tmp_path, {"devices": [device(0)], "usage_dir": "a\x00b"})
    assert refusal(bad).startswith("usage_dir must be a path")


@pytest.mark.timeout(30)
def test_a_usage_entry_that_is_a_fifo_or_not_ascii_digits_is_ignored(tmp_path: Path):
    """A job writes the usage directory: a FIFO named like a pid must not hang the
    worker's sampling, a name of non-ASCII digits must not raise."""
    path = write(tmp_path, {"devices": [device(0)], "usage_dir": "use"})
    (tmp_path / "use").mkdir()
    os.mkfifo(tmp_path / "use" / "123")
    (tmp_path / "use" / "\u00b2").write_text("GPU-0000 100")  # '²'.isdigit() is True
    (tmp_path / "use" / "456").write_text("GPU-0000 100")
    reading = DescribedGpu(path).read()
    assert reading.process_mib == {456: 100.0}


# -- hypothesis: whatever the file holds, one line or devices that are safe to hand out --

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
uuid_like = st.one_of(
    st.none(),
    st.text(max_size=20),
    st.from_regex(r"\AGPU-[0-9a-f]{1,8}\Z"),
    st.sampled_from(["GPU-0", "gpu-0", "MIG-GPU-1/1/0", "GPU-0 ", "GPU-0\n", "GPU-0,GPU-1"]),
)
device_like = st.fixed_dictionaries(
    {},
    optional={
        "index": st.one_of(st.integers(-2, 70), json_leaf),
        "uuid": uuid_like,
        "total_mib": st.one_of(st.integers(0, 2**40), json_leaf),
        "baseline_mib": st.one_of(st.integers(0, 2**40), json_leaf),
    },
)
body_like = st.one_of(
    st.fixed_dictionaries(
        {"devices": st.lists(st.one_of(device_like, json_leaf), max_size=6)},
        optional={"usage_dir": st.one_of(st.text(max_size=8), json_leaf)},
    ),
    st.recursive(json_leaf, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)),
)


def _safe(devices: list[GpuDevice]) -> None:
    assert 0 < len(devices) <= MAX_DEVICES
    assert len({d.index for d in devices}) == len(devices)
    names = [d.uuid.lower() for d in devices if d.uuid is not None]
    assert len(set(names)) == len(names)
    for d in devices:
        assert d.uuid is None or UUID_PATTERN.match(d.uuid)
        assert 0 <= d.index < MAX_DEVICES
        assert math.isfinite(d.total_mib) and 0 < d.total_mib <= limits.LEDGER_INT_MAX
        assert math.isfinite(d.used_mib) and 0 <= d.used_mib <= d.total_mib


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=body_like, raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_any_description_is_one_line_or_safe_devices(tmp_path_factory, body, raw):
    path = tmp_path_factory.mktemp("d") / "gpus.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(json.dumps(body))  # ensure_ascii: surrogates and NUL as escapes
    try:
        devices, _usage = load_description(path)
    except DescriptionError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("--gpu-description: ")
        return
    _safe(devices)


# -- NVML's readings pass the same check -------------------------------------------


def test_devices_problem_is_the_check_of_every_source():
    twins = [GpuDevice(0, 80.0, 0.0, "GPU-x"), GpuDevice(1, 80.0, 0.0, "GPU-x")]
    assert devices_problem(twins) == (
        "devices[1].uuid: GPU-x is named twice; two attempts would get the same GPU"
    )
    assert devices_problem([GpuDevice(0, math.inf, 0.0)]) is not None
    assert devices_problem([GpuDevice(0, 80.0, 0.0, "GPU-0")]) is None


@pytest.mark.parametrize(
    ("names", "said"),
    [
        ([b"GPU-same", b"GPU-same"], "devices[1].uuid: GPU-same is named twice"),
        ([b"GPU-a b", b"GPU-1"], "devices[0].uuid: must be a device name"),
        ([b"GPU-\xff", b"GPU-1"], "devices[0].uuid: must be a device name"),
    ],
)
def test_nvml_devices_that_fail_the_check_are_a_note_not_devices(monkeypatch, names, said):
    module = fake_pynvml([[], []])
    module.nvmlDeviceGetUUID = lambda handle: names[handle]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = NvmlGpu().read()
    assert reading.available is False and reading.devices == []
    assert reading.note is not None and reading.note.startswith(f"NVML devices refused: {said}")
