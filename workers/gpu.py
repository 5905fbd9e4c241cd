"""GPU readings through NVML, behind a small probe interface so that tests can script
devices and processes (``FakeGpu``) and machines without a GPU degrade cleanly.

A reading holds, per device, total and used memory, and per process (pid) the GPU memory
NVML attributes to it. When NVML cannot answer (library or driver missing, no device,
a per-process query unsupported), ``GpuReading.note`` says why and the figures are empty:
laneway then stores null with that note and never invents a number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuDevice:
    index: int
    total_mib: float
    used_mib: float


@dataclass(frozen=True)
class GpuReading:
    devices: list[GpuDevice] = field(default_factory=list)
    process_mib: dict[int, float] = field(default_factory=dict)
    """pid -> GPU memory in MiB, summed over devices."""
    note: str | None = None
    """Why there is no (complete) reading; None when NVML answered fully."""

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
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                devices.append(GpuDevice(index, memory.total / MIB, memory.used / MIB))
                # nvidia-ml-py picks the newest _v3/_v2 entry point the driver offers.
                processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError as exc:
                note = f"NVML query on device {index} failed: {exc}"
                continue
            for process in processes:
                used = getattr(process, "usedGpuMemory", None)
                if used is None:  # NVML_VALUE_NOT_AVAILABLE (e.g. some vGPU / WSL setups)
                    note = f"device {index} does not report per-process memory"
                    continue
                per_process[process.pid] = per_process.get(process.pid, 0.0) + used / MIB
        return GpuReading(devices=devices, process_mib=per_process, note=note)


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
