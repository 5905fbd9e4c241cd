"""GPU readings through NVML, behind a small probe interface so that tests can script
devices and processes (``FakeGpu``) and machines without a GPU degrade cleanly.

A reading holds, per device, total and used memory, and per process (pid) the GPU memory
NVML attributes to it. When NVML cannot answer (library or driver missing, no device,
a per-process query unsupported), ``GpuReading.note`` says why and the figures are empty:
laneway then stores null with that note and never invents a number.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from laneway.controller import limits

MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuDevice:
    index: int
    total_mib: float
    used_mib: float
    uuid: str | None = None
    """``GPU-…`` (or ``MIG-…`` for a MIG instance): what ``CUDA_VISIBLE_DEVICES`` names."""
    process_mib: dict[int, float] = field(default_factory=dict, compare=False)
    """pid -> GPU memory in MiB on this device."""


@dataclass(frozen=True)
class GpuReading:
    devices: list[GpuDevice] = field(default_factory=list)
    process_mib: dict[int, float] = field(default_factory=dict)
    """pid -> GPU memory in MiB, summed over devices."""
    note: str | None = None
    """Why there is no (complete) reading; None when NVML answered fully."""
    described: str | None = None
    """The description file the devices come from (``DescribedGpu``); None: measured."""

    @property
    def available(self) -> bool:
        return bool(self.devices) and self.note is None


class GpuProbe(Protocol):
    def read(self) -> GpuReading: ...


class NvmlGpu:
    """The real probe (nvidia-ml-py). Initialises NVML once, lazily; any NVML failure
    becomes a note, never an exception out of ``read``."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._init_note: str | None = None
        self._initialised = False

    def _init(self) -> None:
        self._initialised = True
        try:
            import pynvml
        except ImportError:
            self._init_note = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # library or driver missing, no permission, ...
            self._init_note = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml

    def read(self) -> GpuReading:
        if not self._initialised:
            self._init()
        if self._nvml is None:
            return GpuReading(note=self._init_note)
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            return GpuReading(note=f"NVML device count failed: {exc}")
        if count == 0:
            return GpuReading(note="no GPU device")
        devices: list[GpuDevice] = []
        per_process: dict[int, float] = {}
        note = None
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                handles = _mig_instances(nvml, handle) or [handle]
            except nvml.NVMLError as exc:
                note = f"NVML query on device {index} failed: {exc}"
                continue
            for handle in handles:
                position = len(devices)  # MIG instances are devices of their own
                try:
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                    # nvidia-ml-py picks the newest _v3/_v2 entry point the driver offers.
                    processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except nvml.NVMLError as exc:
                    note = f"NVML query on device {position} failed: {exc}"
                    continue
                on_device: dict[int, float] = {}
                for process in processes:
                    used = getattr(process, "usedGpuMemory", None)
                    if used is None:  # NVML_VALUE_NOT_AVAILABLE (some vGPU / WSL setups)
                        note = f"device {position} does not report per-process memory"
                        continue
                    on_device[process.pid] = on_device.get(process.pid, 0.0) + used / MIB
                    per_process[process.pid] = per_process.get(process.pid, 0.0) + used / MIB
                devices.append(
                    GpuDevice(position, memory.total / MIB, memory.used / MIB, uuid, on_device)
                )
        problem = devices_problem(devices)
        if problem:  # e.g. two devices with one uuid: none is given out on its word
            return GpuReading(note=f"NVML devices refused: {problem}")
        return GpuReading(devices=devices, process_mib=per_process, note=note)


def _text(value: Any) -> str:
    """NVML's text (bytes from older bindings); what is not UTF-8 is replaced, and
    ``devices_problem`` then refuses the name."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _mig_instances(nvml: Any, handle: Any) -> list[Any]:
    """The MIG instances of a device in MIG mode (each is given to jobs as a device of
    its own), or [] when MIG is off or not supported."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # not supported by this device or driver: a whole device
        return []
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    found = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
        except nvml.NVMLError:  # NVML_ERROR_NOT_FOUND: an empty slot
            continue
    return found


class DescriptionError(ValueError):
    """A GPU description file that cannot be used, in one line naming the field."""


class DescribedGpu:
    """GPUs described in a JSON file instead of measured (``--gpu-description FILE``),
    for a machine without them: a user's CI, a laptop's ``dry-run``, the project's tests.

    ``{"devices": [{"index": 0, "uuid": "GPU-…", "total_mib": 81920, "baseline_mib": 0},
    …], "usage_dir": "DIR"}``. Per-process use is scripted: a process writes
    ``DIR/<pid>`` holding ``DEVICE MIB`` (the device's uuid or index, as its
    ``CUDA_VISIBLE_DEVICES`` names it), and each read counts it on that device, adding
    to its ``baseline_mib``. A reading says it is described (``GpuReading.described``),
    and ``status`` shows it so."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.devices, self.usage_dir = load_description(self.path)

    def read(self) -> GpuReading:
        usage: dict[str, dict[int, float]] = {}
        for entry in self._usage_entries():
            scripted = _scripted_use(entry)
            if scripted is not None:
                device, pid, mib = scripted
                usage.setdefault(device, {})[pid] = mib
        devices: list[GpuDevice] = []
        per_process: dict[int, float] = {}
        for d in self.devices:
            on_device = {**usage.get(str(d.index), {}), **usage.get(d.uuid or "", {})}
            for pid, mib in on_device.items():
                per_process[pid] = per_process.get(pid, 0.0) + mib
            used = d.used_mib + sum(on_device.values())
            devices.append(GpuDevice(d.index, d.total_mib, used, d.uuid, on_device))
        return GpuReading(devices, per_process, None, described=str(self.path))

    def _usage_entries(self) -> list[os.DirEntry[str]]:
        """At most ``USAGE_MAX_ENTRIES`` names of the usage directory ([] without one)."""
        if self.usage_dir is None:
            return []
        try:
            with os.scandir(self.usage_dir) as entries:
                return [entry for entry, _ in zip(entries, range(USAGE_MAX_ENTRIES), strict=False)]
        except OSError:  # none yet, or not a directory: no scripted use
            return []


USAGE_MAX_ENTRIES = 10_000
"""The most names of a description's usage directory one read looks at (a job writes
them: a million files must not stall the worker's sampling)."""


def _scripted_use(entry: os.DirEntry[str]) -> tuple[str, int, float] | None:
    """(device, pid, MiB) from one usage file; None for anything else (a job writes it:
    a malformed, vanished or oversized one, a link, a FIFO, is ignored, never an error
    and never waited on)."""
    name = entry.name
    if not (name.isascii() and name.isdigit() and len(name) <= 10):
        return None
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        words = os.read(fd, 256).decode("ascii", "replace").split()
        mib = float(words[1])
    except (OSError, IndexError, ValueError):
        return None
    finally:
        os.close(fd)
    if not math.isfinite(mib) or not 0 <= mib <= limits.LEDGER_INT_MAX:
        return None
    return words[0], int(name), mib


DESCRIPTION_MAX_BYTES = 1 << 20
"""A GPU description is a few hundred bytes a device; a larger file is refused."""
DESCRIPTION_MAX_DEPTH = 8
"""How deep a description's values may nest (it needs 3: object, list, object)."""
MAX_DEVICES = 64
"""The most devices one node has: as ``[nodes.gpu] devices`` (8 GPUs of 7 MIG
instances each is 56)."""
UUID_PATTERN = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}\Z")
"""What a device name may be: ``GPU-…`` and ``MIG-…`` (or ``MIG-GPU-…/1/0``) as NVML
gives them; it reaches ``CUDA_VISIBLE_DEVICES``, a comma-separated list, verbatim, so no
comma, space, control character, NUL or non-ASCII."""


def uuid_problem(uuid: object) -> str | None:
    """Why ``uuid`` cannot name a device (None when it can, or when it is None)."""
    if uuid is None:
        return None
    if not isinstance(uuid, str) or not UUID_PATTERN.match(uuid):
        return (
            "must be a device name such as GPU-0c1d… or MIG-…: letters, digits and . _ : / -, "
            "at most 128, no space, comma or control character"
        )
    return None


def devices_problem(devices: list[GpuDevice]) -> str | None:
    """Why a set of devices cannot be used (None when it can): more than ``MAX_DEVICES``,
    a bad index, total or use, a bad name, or two devices with the same index or uuid
    (one GPU given to two whole-GPU attempts at once). The one check of every source of
    devices: a description file, NVML's readings."""
    if len(devices) > MAX_DEVICES:
        return f"{len(devices)} devices, more than the {MAX_DEVICES} a node may have"
    indices: set[int] = set()
    names: set[str] = set()
    for position, device in enumerate(devices):
        where = f"devices[{position}]"
        if not 0 <= device.index < MAX_DEVICES:
            return f"{where}.index: {device.index} is not in [0, {MAX_DEVICES - 1}]"
        if device.index in indices:
            return f"{where}.index: {device.index} is named twice; each device has its own"
        indices.add(device.index)
        for label, value in (("total_mib", device.total_mib), ("used_mib", device.used_mib)):
            if not math.isfinite(value) or not 0 <= value <= limits.LEDGER_INT_MAX:
                return f"{where}.{label}: {value!r} is not in [0, {limits.LEDGER_INT_MAX}] MiB"
        problem = uuid_problem(device.uuid)
        if problem:
            return f"{where}.uuid: {problem}"
        if device.uuid is not None:
            if device.uuid.lower() in names:
                return (
                    f"{where}.uuid: {device.uuid} is named twice; two attempts would get "
                    "the same GPU"
                )
            names.add(device.uuid.lower())
    return None


def load_description(path: Path) -> tuple[list[GpuDevice], Path | None]:
    """The devices and usage directory of a description file; DescriptionError (one
    line, naming the field) when it cannot be used: a file that is not regular (a FIFO,
    a device) or larger than ``DESCRIPTION_MAX_BYTES``, not JSON, nested deeper than
    ``DESCRIPTION_MAX_DEPTH``, or devices that ``devices_problem`` refuses."""
    body = _description_body(path)
    where = f"--gpu-description: {path}"
    raw_devices = body.get("devices")
    if not isinstance(raw_devices, list) or not raw_devices:
        raise DescriptionError(f"{where}: needs a non-empty list `devices`")
    if len(raw_devices) > MAX_DEVICES:
        raise DescriptionError(
            f"{where}: `devices` has {len(raw_devices)}, more than the {MAX_DEVICES} a node "
            "may have"
        )
    devices = [_described_device(raw, i, where) for i, raw in enumerate(raw_devices)]
    problem = devices_problem(devices)
    if problem:
        raise DescriptionError(f"{where}: {problem}")
    usage = body.get("usage_dir")
    if usage is not None and (
        not isinstance(usage, str) or not usage or len(usage) > 4096 or limits.text_problem(usage)
    ):
        raise DescriptionError(f"{where}: usage_dir must be a path (text without NUL)")
    return devices, None if usage is None else (path.parent / usage)


def _description_body(path: Path) -> dict[str, Any]:
    """The description's top-level object, read as a config is read: a regular file,
    bounded in size and nesting."""
    where = f"--gpu-description: {path}"
    try:
        data = limits.read_regular_file(path, DESCRIPTION_MAX_BYTES)
    except OSError as exc:
        raise DescriptionError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        body = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise DescriptionError(f"{where}: is not JSON ({why})") from None
    if _nesting(body) > DESCRIPTION_MAX_DEPTH:
        raise DescriptionError(
            f"{where}: nests deeper than {DESCRIPTION_MAX_DEPTH} levels; a description is "
            '{"devices": [{...}, ...]}'
        )
    if not isinstance(body, dict):
        raise DescriptionError(f"{where}: needs an object with a list `devices`")
    return body


def _nesting(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (no recursion: any depth)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _described_device(raw: Any, position: int, where: str) -> GpuDevice:
    """One entry of ``devices``, its numbers checked before they become floats."""
    here = f"{where}: devices[{position}]"
    if not isinstance(raw, dict):
        raise DescriptionError(f"{here}: is not an object")
    total, baseline = raw.get("total_mib"), raw.get("baseline_mib", 0)
    if (
        not _in_range(total, low=0, open_low=True)
        or not _in_range(baseline, low=0)
        or baseline > total
    ):
        raise DescriptionError(
            f"{here}: total_mib must be a number in (0, {limits.LEDGER_INT_MAX}] and "
            "baseline_mib one in [0, total_mib]"
        )
    assert isinstance(total, (int, float)) and isinstance(baseline, (int, float))
    index = raw.get("index", position)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_DEVICES:
        raise DescriptionError(f"{here}.index: must be an integer in [0, {MAX_DEVICES - 1}]")
    problem = uuid_problem(raw.get("uuid"))
    if problem:
        raise DescriptionError(f"{here}.uuid: {problem}")
    return GpuDevice(index, float(total), float(baseline), raw.get("uuid"))


def _in_range(value: Any, *, low: float, open_low: bool = False) -> bool:
    """A number (not a boolean), finite, above ``low`` (or at it unless ``open_low``)
    and at most ``limits.LEDGER_INT_MAX``; compared before any float conversion, so a
    401-digit integer is refused, not an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    above = value > low if open_low else value >= low
    return above and value <= limits.LEDGER_INT_MAX


class FakeGpu:
    """A scripted probe for tests: set ``devices`` and ``processes`` (pid -> MiB)."""

    def __init__(
        self,
        devices: list[GpuDevice] | None = None,
        processes: dict[int, float] | None = None,
        note: str | None = None,
    ) -> None:
        self.devices = devices or []
        self.processes = processes or {}
        self.note = note

    def read(self) -> GpuReading:
        return GpuReading(list(self.devices), dict(self.processes), self.note)
