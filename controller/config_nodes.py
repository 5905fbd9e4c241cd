"""Where work runs: the nodes (their memory floor, slots and GPUs) and the lanes that
place items on them, with each lane's per-stage caps."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from laneway.controller import limits
from laneway.controller.config_fields import Finite, LedgerInt, Name, Strict


class GpuCapacity(Strict):
    """A node's GPU budget for the concurrency rule of invariant 9."""

    total_mib: LedgerInt = Field(gt=0, description="GPU memory of each of the node's devices, MiB.")
    devices: LedgerInt = Field(1, ge=1, le=64, description="How many such devices the node has.")
    fraction: Finite = Field(0.9, gt=0, le=1, description="Usable share of total_mib.")
    baseline_mib: LedgerInt = Field(0, ge=0, description="Memory used by processes not ours, MiB.")

    @model_validator(mode="after")
    def _baseline_fits(self) -> GpuCapacity:
        # As a GPU description's devices are checked (workers/gpu.py::devices_problem).
        if self.baseline_mib > self.total_mib:
            raise ValueError(
                f"baseline_mib {self.baseline_mib} is more than total_mib {self.total_mib}; "
                "give the memory others use of each device, at most its total"
            )
        return self


class NodeConfig(Strict):
    name: Name
    memory_floor_mib: LedgerInt = Field(ge=0, description="Free memory never to go below, MiB.")
    max_jobs: LedgerInt = Field(
        ge=1, le=limits.MAX_SLOTS, description="Most attempts running at once on the node."
    )
    gpu: GpuCapacity | None = None


class LaneConfig(Strict):
    name: Name
    node: Name
    caps: dict[Name, Annotated[LedgerInt, Field(ge=0)]] = Field(
        default_factory=dict, description="stage name -> most running at once in this lane"
    )
