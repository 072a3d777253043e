"""What kind of CPU-GPU memory this machine has, and how fast its link is.

Offloading pays very differently depending on whether the GPU shares the CPU's DRAM (UNIFIED:
DGX Spark, Jetson, MI300A), has its own memory kept hardware-coherent with the CPU's over
NVLink-C2C (COHERENT: GH200, GB200, GB300), sits across PCIe (DISCRETE: x86 + H100/H200/B200), or
is absent (HOST_ONLY). :func:`detect_platform` reads the device attributes that tell these apart,
classifies them with :func:`classify`, and records what it read and why it chose; everything else
in the library asks the resulting :class:`Platform` what to do. :func:`measure_bandwidth` measures
the link and the GPU's own DRAM, whose ratio says how much offload can pay (see
``docs/platforms.md``).

This module holds :class:`Platform` and its detection, and is where the rest of the library
imports every platform name from. The parts live beside it:

- :mod:`torch_fsdp_offload.platform.kinds`: :class:`PlatformKind`, the attribute names and
  :func:`classify`, the rule from attribute values to a kind;
- :mod:`torch_fsdp_offload.platform.readers`: reading this machine (the CUDA attributes through
  ``cuda.bindings`` or ``libcuda``, NVML, GPU and host memory, ``ulimit -l``);
- :mod:`torch_fsdp_offload.platform.bandwidth`: :func:`measure_bandwidth` and what the GPU-DRAM :
  link ratio means.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torch_fsdp_offload.platform.bandwidth import (
    BandwidthReport,
    BandwidthRow,
    clear_bandwidth_cache,
    DEFAULT_CHUNK_SIZES,
    interpret_link_ratio,
    measure_bandwidth,
)
from torch_fsdp_offload.platform.kinds import (
    check_attribute_values,
    Classification,
    classify,
    CUDA_DEVICE_ATTRIBUTES,
    DEVICE_COUNT,
    ENV_PLATFORM,
    parse_kind,
    PlatformKind,
)
from torch_fsdp_offload.platform.readers import (
    read_device_attributes,
    read_gpu_memory,
    read_host_available_bytes,
    read_locked_memory_limit_bytes,
    resolve_device,
)

__all__ = [
    "BandwidthReport",
    "BandwidthRow",
    "CUDA_DEVICE_ATTRIBUTES",
    "Classification",
    "DEFAULT_CHUNK_SIZES",
    "ENV_PLATFORM",
    "Platform",
    "PlatformKind",
    "classify",
    "detect_platform",
    "interpret_link_ratio",
    "measure_bandwidth",
    "platform_from_attributes",
    "read_host_available_bytes",
    "read_locked_memory_limit_bytes",
    "resolve_device",
]


_STRATEGIES: Mapping[PlatformKind, str] = types.MappingProxyType(
    {
        PlatformKind.UNIFIED: (
            "one allocation shared by CPU and GPU, no copies (a copy only duplicates memory); "
            "capacity from MemAvailable"
        ),
        PlatformKind.COHERENT: (
            "pinned host memory, big chunks; offloading weights, grads, optimizer state and "
            "activations pays often; the optimizer step is streamed through the GPU"
        ),
        PlatformKind.DISCRETE: (
            "pinned host memory only, big coalesced chunks, copies overlapped with compute, "
            "optimizer step on the host; offload only what the planner says pays"
        ),
        PlatformKind.HOST_ONLY: (
            "the CPU is the compute device: shards already live where compute happens; "
            "the policy still applies, with no streams"
        ),
    }
)


@dataclass(frozen=True)
class Platform:
    """A machine's CPU-GPU memory platform, as detected (or forced) for one device.

    Attributes:
        kind: the class, which decides the offload strategy.
        device: ``cuda:N``, or ``cpu`` for HOST_ONLY and for a kind forced on a machine without a
            GPU (then every copy still runs, on the CPU, so CPU tests drive the real copy path).
        reason: why this kind: the values used, or the override and what detection said.
        source: ``"detected"``, ``"argument"``, ``"environment"`` or ``"attributes"``.
        attributes: the raw values read (:data:`CUDA_DEVICE_ATTRIBUTES` plus ``DeviceCount``,
            ``TorchIsIntegrated``, ``NvmlC2cEnabled``, ``NvmlAddressingMode``); None = unknown.
        gpu_total_bytes: device memory in total (``torch.cuda.mem_get_info``), None without a GPU.
        gpu_free_bytes: device memory free when detected.
        host_available_bytes: ``MemAvailable`` from ``/proc/meminfo`` when detected.
        locked_memory_limit_bytes: ``ulimit -l`` (``RLIMIT_MEMLOCK``); None = unlimited.
        bandwidth: the measured link, when asked for and a GPU exists; else None.
        device_name: the GPU's name, None without one.
        attribute_reader: what read the CUDA attributes: ``"cuda.bindings"``, ``"libcuda"``, or
            None when nothing could.
    """

    kind: PlatformKind
    device: torch.device
    reason: str
    source: str
    attributes: Mapping[str, int | None]
    gpu_total_bytes: int | None
    gpu_free_bytes: int | None
    host_available_bytes: int | None
    locked_memory_limit_bytes: int | None
    bandwidth: BandwidthReport | None = None
    device_name: str | None = None
    attribute_reader: str | None = None

    @property
    def has_accelerator(self) -> bool:
        """Whether compute runs on a GPU (``device`` is CUDA), so copy streams exist."""
        return self.device.type == "cuda"

    @property
    def copies_needed(self) -> bool:
        """Whether offloaded tensors are copied to compute memory: True on COHERENT and DISCRETE.

        False on UNIFIED (the GPU reads the one allocation) and HOST_ONLY (shards already live
        where compute happens).
        """
        return self.kind in (PlatformKind.COHERENT, PlatformKind.DISCRETE)

    @property
    def supports_managed_memory(self) -> bool:
        """Whether managed memory (``cudaMallocManaged``) can be used concurrently by CPU and GPU.

        Needs a GPU with ``ConcurrentManagedAccess=1`` (Jetson Orin has 0) and ``ManagedMemory``
        not reported as 0.
        """
        return (
            self.has_accelerator
            and self.attributes.get("ConcurrentManagedAccess") == 1
            and self.attributes.get("ManagedMemory") != 0
        )

    @property
    def preferred_memory(self) -> str:
        """The host memory kind for offloaded tensors: ``"pinned"`` or ``"managed"``.

        Pinned everywhere it works: it is the fast DMA source on DISCRETE/COHERENT and, on UNIFIED,
        skips the GPU L2 coherence overhead, best for streaming reads. Managed only on UNIFIED when
        the GPU cannot map pinned host memory (``CanMapHostMemory=0``) but can share managed memory.
        """
        if (
            self.kind is PlatformKind.UNIFIED
            and self.attributes.get("CanMapHostMemory") == 0
            and self.supports_managed_memory
        ):
            return "managed"
        return "pinned"

    @property
    def usable_device_bytes(self) -> int | None:
        """Memory the compute device can use: MemAvailable on UNIFIED and HOST_ONLY, else GPU free.

        On UNIFIED ``cudaMemGetInfo`` ignores reclaimable page cache (DGX Spark), so the host's
        MemAvailable is the honest figure.
        """
        if self.kind in (PlatformKind.UNIFIED, PlatformKind.HOST_ONLY) or not self.has_accelerator:
            return self.host_available_bytes
        return self.gpu_free_bytes

    @property
    def strategy(self) -> str:
        """One line on what the library does on this kind of platform."""
        return _STRATEGIES[self.kind]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: every field, ``kind`` first, plus the derived properties."""
        return {
            "kind": self.kind.value,
            "device": str(self.device),
            "device_name": self.device_name,
            "reason": self.reason,
            "source": self.source,
            "strategy": self.strategy,
            "attribute_reader": self.attribute_reader,
            "attributes": dict(self.attributes),
            "gpu_total_bytes": self.gpu_total_bytes,
            "gpu_free_bytes": self.gpu_free_bytes,
            "host_available_bytes": self.host_available_bytes,
            "locked_memory_limit_bytes": self.locked_memory_limit_bytes,
            "copies_needed": self.copies_needed,
            "supports_managed_memory": self.supports_managed_memory,
            "preferred_memory": self.preferred_memory,
            "usable_device_bytes": self.usable_device_bytes,
            "bandwidth": None if self.bandwidth is None else self.bandwidth.to_dict(),
        }


class _Detection(NamedTuple):
    classification: Classification
    attributes: Mapping[str, int | None]
    attribute_reader: str | None
    device_name: str | None


_DETECTIONS: dict[torch.device, _Detection] = {}


def _requested_kind(kind: str | PlatformKind | None) -> tuple[PlatformKind | None, str]:
    """The forced kind (None = detect) and its source: the argument beats the environment."""
    if kind is not None:
        forced = parse_kind(kind, "kind")
        if forced is not None:
            return forced, "argument"
        return None, "detected"
    env_value = os.environ.get(ENV_PLATFORM, "").strip()
    if env_value:
        forced = parse_kind(env_value, ENV_PLATFORM)
        if forced is not None:
            return forced, "environment"
    return None, "detected"


def _detect(device: torch.device) -> _Detection:
    cached = _DETECTIONS.get(device)
    if cached is not None:
        return cached
    if device.type == "cpu":
        attributes: dict[str, int | None] = {DEVICE_COUNT: torch.cuda.device_count()}
        if attributes[DEVICE_COUNT]:
            classification = Classification(
                PlatformKind.HOST_ONLY, "device cpu was asked for: the CPU is the compute device"
            )
        else:
            classification = classify(attributes)
        detection = _Detection(classification, types.MappingProxyType(attributes), None, None)
    else:
        attributes, reader, name = read_device_attributes(device.index)
        detection = _Detection(classify(attributes), types.MappingProxyType(attributes), reader, name)
    _DETECTIONS[device] = detection
    return detection


def detect_platform(
    device: torch.device | str | int | None = None,
    *,
    kind: str | PlatformKind | None = None,
    bandwidth: bool = False,
) -> Platform:
    """Detect the CPU-GPU memory platform of ``device`` (see ``docs/platforms.md``).

    The attributes and their classification are read once per device and cached for the process;
    capacities (free GPU memory, MemAvailable, ``ulimit -l``) are read fresh on each call. An
    attribute that cannot be read is recorded as None (unknown), never as 0.

    Args:
        device: the CUDA device (``torch.device``, ``"cuda:N"`` or an index), or ``"cpu"``. Default:
            the current CUDA device, or the CPU on a machine without one. Under torchrun, call
            ``torch.cuda.set_device(local_rank)`` first.
        kind: force a kind (a :class:`PlatformKind` or its value; ``"auto"`` detects). Beats the
            ``TORCH_FSDP_OFFLOAD_PLATFORM`` environment variable, which beats detection. A forced
            kind other than HOST_ONLY on a machine without a GPU keeps ``device=cpu``, so the
            strategy's copies run (and are counted) on the CPU; HOST_ONLY always means the CPU.
        bandwidth: also measure the link with :func:`measure_bandwidth` (cached per process).
            Without a GPU there is no link: ``Platform.bandwidth`` is then None.

    Returns:
        Platform: the kind, why, what was read, and the capacities.

    Raises:
        ValueError: if ``kind`` or the environment variable names no kind (the message lists the
            valid ones), or ``device`` is not a device (e.g. ``"banana"``), a CPU or an existing
            CUDA device.

    Example::

        >>> platform = detect_platform()  # on a machine without a GPU:
        >>> platform.kind, platform.reason
        (<PlatformKind.HOST_ONLY: 'host_only'>, 'no accelerator (DeviceCount=0): the CPU is the compute device')
        >>> forced = detect_platform(kind="discrete")  # drives the copy path on the CPU
        >>> forced.device, forced.copies_needed
        (device(type='cpu'), True)
    """
    forced, source = _requested_kind(kind)
    resolved = resolve_device(device)
    detection = _detect(resolved)
    if forced is None:
        platform_kind, reason = detection.classification
    else:
        origin = "argument kind=" if source == "argument" else f"{ENV_PLATFORM}="
        platform_kind = forced
        reason = (
            f"forced by {origin}{forced.value!r}; detection says "
            f"{detection.classification.kind.value}: {detection.classification.reason}"
        )
    platform_device = torch.device("cpu") if platform_kind is PlatformKind.HOST_ONLY else resolved
    gpu_free, gpu_total = read_gpu_memory(platform_device)
    measured = None
    if bandwidth and platform_device.type == "cuda":
        measured = measure_bandwidth(platform_device)
    return Platform(
        kind=platform_kind,
        device=platform_device,
        reason=reason,
        source=source,
        attributes=detection.attributes,
        gpu_total_bytes=gpu_total,
        gpu_free_bytes=gpu_free,
        host_available_bytes=read_host_available_bytes(),
        locked_memory_limit_bytes=read_locked_memory_limit_bytes(),
        bandwidth=measured,
        device_name=detection.device_name if platform_device.type == "cuda" else None,
        attribute_reader=detection.attribute_reader,
    )


def platform_from_attributes(
    attributes: Mapping[str, int | None], *, kind: str | PlatformKind | None = None
) -> Platform:
    """The :class:`Platform` a machine with these attributes gets, e.g. to plan for another machine.

    Nothing is read from this machine: capacities are None (unknown; set them with
    ``dataclasses.replace``) and the environment variable is ignored, since it describes this
    machine.

    Args:
        attributes: as for :func:`classify`.
        kind: force a kind, as for :func:`detect_platform`.

    Returns:
        Platform: ``device`` is ``cuda:0``, or ``cpu`` for HOST_ONLY; ``source`` is
        ``"attributes"``, or ``"argument"`` when ``kind`` forced the kind.

    Raises:
        TypeError: if ``attributes`` is not a mapping, or a value is neither an int nor None.
        ValueError: if ``kind`` names no kind, an attribute name is not one :func:`classify` and
            :attr:`Platform.attributes` know, or a value is outside the attribute's range (e.g.
            ``Integrated=2``); the message names the attribute and what it accepts.

    Example::

        >>> platform_from_attributes({"Integrated": 1}).copies_needed
        False
    """
    forced = None if kind is None else parse_kind(kind, "kind")
    classification = classify(attributes)
    check_attribute_values(attributes)
    if forced is None:
        platform_kind, reason, source = classification.kind, classification.reason, "attributes"
    else:
        platform_kind, source = forced, "argument"
        reason = (
            f"forced by argument kind={forced.value!r}; the attributes say "
            f"{classification.kind.value}: {classification.reason}"
        )
    device = torch.device("cpu") if platform_kind is PlatformKind.HOST_ONLY else torch.device("cuda", 0)
    return Platform(
        kind=platform_kind,
        device=device,
        reason=reason,
        source=source,
        attributes=types.MappingProxyType(dict(attributes)),
        gpu_total_bytes=None,
        gpu_free_bytes=None,
        host_available_bytes=None,
        locked_memory_limit_bytes=None,
    )


def _clear_caches() -> None:
    """Forget cached detections and measurements (tests, or after the machine changed)."""
    _DETECTIONS.clear()
    clear_bandwidth_cache()
