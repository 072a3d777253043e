"""``ResolvedPlan``: what a ``CoherentOffload`` does on one machine, as plain data the FSDP glue
and the data path read without knowing the policy class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch_fsdp_offload.platform import PlatformKind

CastPlacement = Literal["auto", "host", "device"]


@dataclass(frozen=True)
class ResolvedPlan:
    """What a :class:`CoherentOffload` does on one machine, after ``auto`` is resolved.

    Attributes:
        platform (PlatformKind): the platform class the plan was made for.
        memory (str): ``"pinned"`` (exact-size page-locked host memory), ``"device"`` (UNIFIED:
            the GPU's allocation, which is the one DRAM) or ``"host"`` (no accelerator).
        copies (bool): whether shards cross a link at all (False on UNIFIED and HOST_ONLY
            unless a copy path was forced for tests).
        optimizer (str): where the optimizer step of the offloaded groups runs: ``"host"``
            (fused, all cores, overlapped with backward), ``"stream"`` (every offloaded group
            streamed through the GPU), ``"split"`` (``optimizer_gpu_fraction`` of them streamed,
            the rest on the host, both at once) or ``"device"`` (nothing is offloaded for the
            step: UNIFIED memory).
        optimizer_gpu_fraction (float): fraction of the offloaded groups whose step is streamed
            through the GPU (0.0 for "host" and "device", 1.0 for "stream").
        cast_on (str): where the fp32 master is cast to the compute dtype for the copy-in:
            ``"host"`` (into a pinned mirror after each step; compute-dtype bytes cross the link)
            or ``"device"`` (the master's bytes cross the link and are cast on arrival).
        prefetch_depth (int): as asked.
        activations (float): fraction of the FSDP-wrapped blocks whose saved activations are
            offloaded (1.0 for ``activations=True``); 0.0 when off, and on UNIFIED and HOST_ONLY
            platforms, where activations already live in the one memory.
        reason (str): one line saying why ``auto`` choices were made.
    """

    platform: PlatformKind
    memory: str
    copies: bool
    optimizer: str
    optimizer_gpu_fraction: float
    cast_on: CastPlacement
    prefetch_depth: int
    activations: float
    reason: str

    def describe(self) -> str:
        return (
            f"CoherentOffload plan on {self.platform.value}: memory={self.memory}, "
            f"copies={'yes' if self.copies else 'none'}, "
            f"optimizer step={self.optimizer} ({self.optimizer_gpu_fraction:.2f} on the GPU), "
            f"cast to the compute dtype on the {self.cast_on}, prefetch depth={self.prefetch_depth}, "
            f"activations offloaded={self.activations:.2f} of the blocks. "
            f"Why: {self.reason}"
        )
