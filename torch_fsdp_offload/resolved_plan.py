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
        memory (str): where offloaded shards live: ``"pinned"`` (exact-size page-locked host
            memory), ``"managed"`` (``cudaMallocManaged`` memory advised to stay on the host and be
            read by the GPU), ``"device"`` (UNIFIED by default: the GPU's allocation, which is the
            one DRAM; nothing is offloaded) or ``"host"`` (no accelerator).
        copies (bool): whether the transfer engine copies shards over the link (False on UNIFIED
            and HOST_ONLY, and where the GPU reads them in place).
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
        reads_in_place (bool): the shards are offloaded to ``memory`` and the GPU reads them there
            through a device view, with no copy (``"pinned"`` or ``"managed"`` on UNIFIED,
            ``"managed"`` on COHERENT); the host steps them in place.
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
    reads_in_place: bool = False

    @property
    def offloads(self) -> bool:
        """Whether groups with this plan keep their shards in host memory (pinned or managed):
        copied over the link, or read in place."""
        return self.memory in ("pinned", "managed")

    def describe(self) -> str:
        return (
            f"CoherentOffload plan on {self.platform.value}: memory={self.memory}, "
            f"copies={'yes' if self.copies else 'none'}"
            f"{', read in place by the GPU' if self.reads_in_place else ''}, "
            f"optimizer step={self.optimizer} ({self.optimizer_gpu_fraction:.2f} on the GPU), "
            f"cast to the compute dtype on the {self.cast_on}, prefetch depth={self.prefetch_depth}, "
            f"activations offloaded={self.activations:.2f} of the blocks. "
            f"Why: {self.reason}"
        )
