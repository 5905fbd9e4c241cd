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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
        return GpuReading(devices=devices, process_mib=per_process, note=note)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
        if self.usage_dir is not None and self.usage_dir.is_dir():
            for entry in self.usage_dir.iterdir():
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


def _scripted_use(entry: Path) -> tuple[str, int, float] | None:
    """(device, pid, MiB) from one usage file; None for anything else (a job writes it:
    a malformed, vanished or oversized one is ignored, never an error)."""
    if not entry.name.isdigit() or entry.is_symlink():
        return None
    try:
        with open(entry, "rb") as handle:
            words = handle.read(256).decode("ascii", "replace").split()
        mib = float(words[1])
    except (OSError, IndexError, ValueError):
        return None
    if not math.isfinite(mib) or mib < 0:
        return None
    return words[0], int(entry.name), mib


def load_description(path: Path) -> tuple[list[GpuDevice], Path | None]:
    """The devices and usage directory of a description file; DescriptionError (one
    line, naming the field) when it cannot be used."""
    try:
        body = json.loads(path.read_text())
    except OSError as exc:
        raise DescriptionError(f"--gpu-description: cannot read {path}: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DescriptionError(f"--gpu-description: {path} is not JSON ({exc})") from exc
    if not isinstance(body, dict) or not isinstance(body.get("devices"), list):
        raise DescriptionError(f"--gpu-description: {path}: needs a list `devices`")
    devices: list[GpuDevice] = []
    for i, raw in enumerate(body["devices"]):
        where = f"--gpu-description: {path}: devices[{i}]"
        if not isinstance(raw, dict):
            raise DescriptionError(f"{where}: is not an object")
        total, baseline = raw.get("total_mib"), raw.get("baseline_mib", 0)
        if not _positive(total) or not _positive(baseline, zero=True) or baseline > total:
            raise DescriptionError(
                f"{where}: total_mib must be a number > 0 and baseline_mib one in [0, total_mib]"
            )
        assert isinstance(total, (int, float)) and isinstance(baseline, (int, float))
        uuid = raw.get("uuid")
        if uuid is not None and (not isinstance(uuid, str) or not uuid.strip() or "," in uuid):
            raise DescriptionError(f"{where}.uuid: must be a name such as GPU-0c1d…, no commas")
        devices.append(GpuDevice(i, float(total), float(baseline), uuid))
    if not devices:
        raise DescriptionError(f"--gpu-description: {path}: `devices` is empty")
    usage = body.get("usage_dir")
    if usage is not None and not isinstance(usage, str):
        raise DescriptionError(f"--gpu-description: {path}: usage_dir must be a path")
    return devices, None if usage is None else (path.parent / usage)


def _positive(value: Any, *, zero: bool = False) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero else value > 0)
    )


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
