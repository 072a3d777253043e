"""Built-in platform profiles: the bandwidths and capacities the planner assumes for machines we
cannot measure from here.

Figures come from docs/platforms.md (NVIDIA specs, public reports, and an x86 + H200 PCIe host
measured with ``detect_platform(bandwidth=True)``). Measured figures of the machine the planner
runs on replace them (see :func:`measured_profile`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["PLATFORM_PROFILES", "PlatformProfile", "get_profile", "measured_profile"]

_KINDS = ("unified", "coherent", "discrete", "host_only")


@dataclass(frozen=True)
class PlatformProfile:
    """What the cost model needs to know about a CPU-GPU machine.

    Attributes:
        name (str): profile name (``"gh200"``) or ``"measured"``.
        kind (str): ``"unified"``, ``"coherent"``, ``"discrete"`` or ``"host_only"``, as
            :class:`torch_fsdp_offload.platform.PlatformKind` values.
        gpu_memory_GB (float): GPU memory capacity (1 GB = 1e9 bytes).
        gpu_dram_GBps (float): peak GPU DRAM bandwidth the model's own traffic is compared with.
        link_GBps (float): the nominal one-way CPU-GPU link figure the talk-level analysis budgets
            all offload traffic against (conservative on full-duplex links).
        h2d_GBps (float), d2h_GBps (float): achieved copy bandwidth each way (large pinned copies).
        bidirectional_GBps (float): achieved total when both ways copy at once.
        host_GBps (float): host DRAM bandwidth the host optimizer step shares with the link's DMA:
            the bytes of :func:`~torch_fsdp_offload.planner.traffic.host_step_bytes_per_param`
            (38 per fp32 AdamW parameter with a bf16 mirror) plus the bytes the link copies to and
            from host memory in the same window, over its time. The step model uses it where the
            host step was not timed on the machine; ``plan`` times it there
            (:func:`~torch_fsdp_offload.host_step.measure_host_step`), alone and beside a busy
            link, and models the sharing from those two rates instead.
        gpu_interconnect_GBps (float): per-GPU bandwidth of FSDP's all-gather and reduce-scatter
            between the GPUs of one host (``world_size > 1``).
        gpu_bf16_TFLOPS (float): dense bf16 peak, used only to estimate compute time when no GPU
            timing is available.
        source (str): where the figures come from.
        host_alone_cast_s_per_param (float | None): seconds per parameter the host step's cast of
            the fp32 master into the compute-dtype mirror takes with nothing beside it
            (``CoherentOffload(cast_on="host")``'s share of the host step; ``cast_on="device"``
            does not pay it). The step model takes it where the host step was not measured on
            the machine (:func:`~torch_fsdp_offload.host_step.measure_host_step` times the
            cast itself). None: unknown (the model then splits the step by bytes).
        host_link_busy_cast_s_per_param (float | None): the same while the link copies both ways.
    """

    name: str
    kind: str
    gpu_memory_GB: float
    gpu_dram_GBps: float
    link_GBps: float
    h2d_GBps: float
    d2h_GBps: float
    bidirectional_GBps: float
    host_GBps: float
    gpu_interconnect_GBps: float
    gpu_bf16_TFLOPS: float
    source: str
    host_alone_cast_s_per_param: float | None = None
    host_link_busy_cast_s_per_param: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"PlatformProfile.kind must be one of {_KINDS}, got {self.kind!r}")


# Host DRAM bandwidth the host step shares with the link's DMA, fitted to CoherentOffload's own
# path with every group offloaded: the host step's 38 bytes and the DMA's 4 bytes per parameter over
# the time from the first gradients landing to the end of the host step (measured on an x86 + H200
# PCIe host, see docs/planner.md, "Calibration"). The DMA's bytes count against it because the host
# step slows while the link copies. Other hosts: assumed the same until measured.
_H200_HOST_GBPS = 113.0
# The cast of the fp32 master into the bf16 mirror, timed on its own, alone and with the link
# copying both ways, on the same host (see docs/planner.md, "Calibration"). Its share of the host
# step's time is larger than its share of the bytes. Other hosts: assumed the same until measured.
_H200_HOST_CAST = {"host_alone_cast_s_per_param": 0.0763e-9, "host_link_busy_cast_s_per_param": 0.2248e-9}
# NCCL all-gather / reduce-scatter bandwidth per GPU between the GPUs of one PCIe host: the model's
# bytes over the backward of a multi-GPU run bound by its collectives (measured on two H200s, see
# docs/benchmarks.md).
_PCIE_GPU_GPU_GBPS = 150.0

PLATFORM_PROFILES: dict[str, PlatformProfile] = {
    "h100-pcie": PlatformProfile(
        name="h100-pcie",
        kind="discrete",
        gpu_memory_GB=80.0,
        gpu_dram_GBps=3350.0,
        link_GBps=55.0,
        h2d_GBps=55.0,
        d2h_GBps=55.0,
        # Same PCIe Gen5 x16 link as the h200-pcie profile; its both-ways figure is assumed.
        bidirectional_GBps=98.5,
        host_GBps=_H200_HOST_GBPS,
        **_H200_HOST_CAST,
        gpu_interconnect_GBps=_PCIE_GPU_GPU_GBPS,
        gpu_bf16_TFLOPS=756.0,
        source="docs/platforms.md: x86 + H100 PCIe Gen5 (~55 GB/s each way); both-ways and host figures from h200-pcie",
    ),
    "h100-sxm": PlatformProfile(
        name="h100-sxm",
        kind="discrete",
        gpu_memory_GB=80.0,
        gpu_dram_GBps=3350.0,
        # PCIe Gen5 x16 to the host as on the PCIe cards: ~55 GB/s achieved of 64 GB/s nominal.
        link_GBps=55.0,
        h2d_GBps=55.0,
        d2h_GBps=55.0,
        bidirectional_GBps=98.5,
        host_GBps=_H200_HOST_GBPS,
        **_H200_HOST_CAST,
        # NVLink 4 between the GPUs of an HGX board, 450 GB/s each way (spec; not measured).
        gpu_interconnect_GBps=450.0,
        gpu_bf16_TFLOPS=989.0,
        source="docs/platforms.md: x86 + H100 SXM5 80 GB HBM3 (HGX), PCIe Gen5 x16 host link; both-ways and host figures from h200-pcie",
    ),
    "h200-pcie": PlatformProfile(
        name="h200-pcie",
        kind="discrete",
        gpu_memory_GB=150.1,
        gpu_dram_GBps=4212.3,
        link_GBps=54.6,
        h2d_GBps=54.6,
        d2h_GBps=54.6,
        bidirectional_GBps=98.5,
        host_GBps=_H200_HOST_GBPS,
        **_H200_HOST_CAST,
        gpu_interconnect_GBps=_PCIE_GPU_GPU_GBPS,
        gpu_bf16_TFLOPS=835.0,
        source="docs/platforms.md: x86 + H200 PCIe Gen5 x16, measured (DRAM = device copy read+write)",
    ),
    "gh200": PlatformProfile(
        name="gh200",
        kind="coherent",
        gpu_memory_GB=96.0,
        gpu_dram_GBps=4000.0,
        link_GBps=450.0,
        # Middle of the public measurements (H2D 335-421, D2H 170-297 GB/s): D2H is the slow way.
        h2d_GBps=378.0,
        d2h_GBps=234.0,
        bidirectional_GBps=612.0,
        host_GBps=_H200_HOST_GBPS,
        **_H200_HOST_CAST,
        gpu_interconnect_GBps=450.0,
        gpu_bf16_TFLOPS=989.0,
        source="docs/platforms.md: GH200 96 GB HBM3, NVLink-C2C 450 GB/s each way, public copy measurements",
    ),
    "gb200": PlatformProfile(
        name="gb200",
        kind="coherent",
        gpu_memory_GB=186.0,
        gpu_dram_GBps=8000.0,
        # C2C 900 GB/s total is shared by the two GPUs of a superchip.
        link_GBps=450.0,
        h2d_GBps=225.0,
        d2h_GBps=225.0,
        bidirectional_GBps=450.0,
        host_GBps=_H200_HOST_GBPS,
        **_H200_HOST_CAST,
        gpu_interconnect_GBps=900.0,
        gpu_bf16_TFLOPS=2500.0,
        source="docs/platforms.md: GB200 8 TB/s HBM3e, C2C 900 GB/s shared by 2 GPUs (estimate; GB300 measured ~211/~193)",
    ),
    "dgx-spark": PlatformProfile(
        name="dgx-spark",
        kind="unified",
        gpu_memory_GB=128.0,
        gpu_dram_GBps=273.0,
        link_GBps=273.0,
        h2d_GBps=273.0,
        d2h_GBps=273.0,
        bidirectional_GBps=273.0,
        host_GBps=_H200_HOST_GBPS,
        **_H200_HOST_CAST,
        gpu_interconnect_GBps=273.0,
        gpu_bf16_TFLOPS=125.0,
        source="docs/platforms.md: DGX Spark GB10, one 128 GB LPDDR5X memory at 273 GB/s shared by CPU and GPU",
    ),
}


def get_profile(name: str) -> PlatformProfile:
    """Look up a built-in platform profile.

    Args:
        name (str): one of ``h100-pcie``, ``h100-sxm``, ``h200-pcie``, ``gh200``, ``gb200``, ``dgx-spark``.

    Returns:
        PlatformProfile: the built-in figures.

    Raises:
        ValueError: unknown name (the message lists the known ones).

    Example::

        >>> get_profile("gh200").link_GBps
        450.0
    """
    try:
        return PLATFORM_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown platform profile {name!r}; choose one of {', '.join(sorted(PLATFORM_PROFILES))}"
        ) from None


def measured_profile(platform, base: PlatformProfile | None = None) -> PlatformProfile:
    """A profile for the machine ``platform`` describes, measured figures first.

    Args:
        platform: a :class:`torch_fsdp_offload.platform.Platform` (from ``detect_platform``).
        base (PlatformProfile | None): figures to use where ``platform`` has no measurement
            (default: ``h200-pcie`` for DISCRETE, ``gh200`` for COHERENT, ``dgx-spark`` for UNIFIED).

    Returns:
        PlatformProfile: named ``"measured"``, with the detected kind, GPU capacity and any measured
        link bandwidths replacing those of ``base``.

    Example::

        >>> from torch_fsdp_offload.platform import detect_platform
        >>> measured_profile(detect_platform(bandwidth=True)).h2d_GBps
    """
    kind = getattr(platform.kind, "value", str(platform.kind))
    if base is None:
        base = PLATFORM_PROFILES[
            {"unified": "dgx-spark", "coherent": "gh200"}.get(kind, "h200-pcie")
        ]
    changes: dict[str, object] = {"name": "measured", "kind": kind}
    sources = [f"detected {kind}"]
    if getattr(platform, "gpu_total_bytes", None):
        # A cap set with torch.cuda.set_per_process_memory_fraction is all this process may use.
        fraction = process_memory_fraction(platform.device)
        changes["gpu_memory_GB"] = platform.gpu_total_bytes * fraction / 1e9
        if fraction < 1.0:
            sources.append(f"{fraction:.0%} of the GPU's memory (this process's cap)")
    elif kind == "host_only" and getattr(platform, "host_available_bytes", None):
        # Without an accelerator, compute runs in host memory.
        changes["gpu_memory_GB"] = platform.host_available_bytes / 1e9
    report = getattr(platform, "bandwidth", None)
    if report is not None:
        changes.update(
            h2d_GBps=report.h2d_gbps,
            d2h_GBps=report.d2h_gbps,
            bidirectional_GBps=report.bidirectional_gbps,
            link_GBps=report.link_gbps,
            gpu_dram_GBps=report.device_copy_gbps,
        )
        sources.append(f"link and DRAM bandwidth measured on {report.device_name}")
    sources.append(f"other figures from {base.name}")
    changes["source"] = ", ".join(sources)
    return dataclasses.replace(base, **changes)


def process_memory_fraction(device) -> float:
    """The share of ``device``'s memory this process may allocate: the fraction given to
    ``torch.cuda.set_per_process_memory_fraction`` (1.0 where none was, on a CPU, or on a torch
    that cannot tell)."""
    device = torch.device(device)
    reader = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if device.type != "cuda" or reader is None or not torch.cuda.is_available():
        return 1.0
    # The reader takes an index: "cuda" alone means the current device.
    return float(reader(device.index if device.index is not None else torch.cuda.current_device()))
