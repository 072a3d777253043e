"""What kind of CPU-GPU memory this machine has, and how fast its link is.

Offloading pays very differently depending on whether the GPU shares the CPU's DRAM (UNIFIED:
DGX Spark, Jetson, MI300A), has its own memory kept hardware-coherent with the CPU's over
NVLink-C2C (COHERENT: GH200, GB200, GB300), sits across PCIe (DISCRETE: x86 + H100/H200/B200), or
is absent (HOST_ONLY). :func:`detect_platform` reads the device attributes that tell these apart,
classifies them with :func:`classify`, and records what it read and why it chose; everything else
in the library asks the resulting :class:`Platform` what to do. :func:`measure_bandwidth` measures
the link and the GPU's own DRAM, whose ratio says how much offload can pay (see
``docs/platforms.md``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import difflib
import enum
import os
import statistics
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

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
]

ENV_PLATFORM = "TORCH_FSDP_OFFLOAD_PLATFORM"

# CUDA device attributes read on every GPU, named as ``cudaDevAttr<Name>`` without the prefix; the
# ids are shared by the runtime (``cudaDeviceAttr``) and the driver (``CUdevice_attribute``).
CUDA_DEVICE_ATTRIBUTES: Mapping[str, int] = types.MappingProxyType(
    {
        "Integrated": 18,
        "CanMapHostMemory": 19,
        "L2CacheSize": 38,
        "AsyncEngineCount": 40,
        "UnifiedAddressing": 41,
        "ManagedMemory": 83,
        "HostNativeAtomicSupported": 86,
        "PageableMemoryAccess": 88,
        "ConcurrentManagedAccess": 89,
        "CanUseHostPointerForRegisteredMem": 91,
        "HostRegisterSupported": 99,
        "PageableMemoryAccessUsesHostPageTables": 100,
        "DirectManagedMemAccessFromHost": 101,
        "MaxPersistingL2CacheSize": 108,
        "MemoryPoolsSupported": 115,
        "GPUDirectRDMASupported": 116,
        "NumaConfig": 130,
        "NumaId": 131,
        "HostNumaId": 134,
    }
)

# Entries of ``Platform.attributes`` that are not CUDA device attributes.
_DEVICE_COUNT = "DeviceCount"  # torch.cuda.device_count(); 0 means no accelerator
_TORCH_IS_INTEGRATED = "TorchIsIntegrated"  # torch.cuda.get_device_properties(d).is_integrated
_NVML_C2C_ENABLED = "NvmlC2cEnabled"  # nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled
_NVML_ADDRESSING_MODE = "NvmlAddressingMode"  # nvmlDeviceGetAddressingMode: 0 none, 1 HMM, 2 ATS
_NVML_ATTRIBUTES = (_NVML_C2C_ENABLED, _NVML_ADDRESSING_MODE)

_COHERENCE_EVIDENCE = (
    "PageableMemoryAccessUsesHostPageTables",
    "HostNativeAtomicSupported",
    _NVML_C2C_ENABLED,
)

# The values each attribute can take, as inclusive (low, high) bounds (high None: unbounded). An
# attribute set given by hand (platform_from_attributes) is checked against them: a misspelt name
# or an impossible value would otherwise be classified as "unknown" or as plain evidence.
_ATTRIBUTE_RANGES: Mapping[str, tuple[int, int | None]] = types.MappingProxyType(
    {
        **dict.fromkeys((_DEVICE_COUNT, "L2CacheSize", "AsyncEngineCount", "MaxPersistingL2CacheSize"), (0, None)),
        **dict.fromkeys(
            (
                "Integrated", "CanMapHostMemory", "UnifiedAddressing", "ManagedMemory",
                "HostNativeAtomicSupported", "PageableMemoryAccess", "ConcurrentManagedAccess",
                "CanUseHostPointerForRegisteredMem", "HostRegisterSupported",
                "PageableMemoryAccessUsesHostPageTables", "DirectManagedMemAccessFromHost",
                "MemoryPoolsSupported", "GPUDirectRDMASupported", _TORCH_IS_INTEGRATED, _NVML_C2C_ENABLED,
            ),
            (0, 1),
        ),
        "NumaConfig": (0, 1),  # cudaDeviceNumaConfigNone, cudaDeviceNumaConfigNumaNode
        "NumaId": (-1, None),  # -1: the GPU's memory is no NUMA node
        "HostNumaId": (-1, None),  # -1: the host has no NUMA
        _NVML_ADDRESSING_MODE: (0, 2),  # none, HMM, ATS
    }
)

_MiB = 1 << 20
DEFAULT_CHUNK_SIZES: tuple[int, ...] = tuple(m * _MiB for m in (1, 4, 16, 64, 256))
_MIN_BUFFER_BYTES = 256 * _MiB

# The GPU-DRAM : link bandwidth ratio bands, between the talk's three reference points (unified
# ~1, GH200 ~10, x86 + H200 ~80), split at the geometric midpoints.
_UNIFIED_RATIO_MAX = 3.0
_COHERENT_RATIO_MAX = 30.0


class PlatformKind(str, enum.Enum):
    """The four kinds of CPU-GPU memory the library tells apart (see ``docs/platforms.md``)."""

    UNIFIED = "unified"
    COHERENT = "coherent"
    DISCRETE = "discrete"
    HOST_ONLY = "host_only"


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


class Classification(NamedTuple):
    """The result of :func:`classify`: the kind and a one-line reason naming the values used."""

    kind: PlatformKind
    reason: str


def _format_values(attributes: Mapping[str, int | None], names: Sequence[str]) -> str:
    return ", ".join(
        f"{name}={'unknown' if attributes.get(name) is None else attributes[name]}" for name in names
    )


def classify(attributes: Mapping[str, int | None]) -> Classification:
    """Classify a machine from its device attributes, following the rule in ``docs/platforms.md``.

    In order: no accelerator gives HOST_ONLY; ``Integrated=1`` (or torch's ``is_integrated``) gives
    UNIFIED; ``PageableMemoryAccessUsesHostPageTables=1``, ``HostNativeAtomicSupported=1`` or NVML
    C2C enabled gives COHERENT; anything else is DISCRETE. ``PageableMemoryAccess=1`` alone is HMM
    (software page faulting over PCIe), not coherence. Unknown attributes are never evidence: with
    the coherence attributes unknown the answer is DISCRETE, whose pinned copies are correct on
    every machine.

    Args:
        attributes: attribute name (as in :data:`CUDA_DEVICE_ATTRIBUTES`, plus ``DeviceCount``,
            ``TorchIsIntegrated``, ``NvmlC2cEnabled``, ``NvmlAddressingMode``) to value; a missing
            key or ``None`` means unknown. ``DeviceCount=0``, or no known value at all, means no
            accelerator.

    Returns:
        Classification: the kind and the reason for it.

    Raises:
        TypeError: if a value is neither an int nor None.

    Example::

        >>> classify({"Integrated": 0, "PageableMemoryAccess": 1,
        ...           "PageableMemoryAccessUsesHostPageTables": 0}).kind
        <PlatformKind.DISCRETE: 'discrete'>
    """
    for name, value in attributes.items():
        if value is not None and not isinstance(value, int):
            raise TypeError(
                f"attribute {name!r} has value {value!r} of type {type(value).__name__}; "
                "attribute values must be int, or None for unknown"
            )
    device_count = attributes.get(_DEVICE_COUNT)
    if device_count == 0:
        return Classification(
            PlatformKind.HOST_ONLY, "no accelerator (DeviceCount=0): the CPU is the compute device"
        )
    if device_count is None and all(value is None for value in attributes.values()):
        return Classification(
            PlatformKind.HOST_ONLY,
            "no accelerator: no device attribute is known: the CPU is the compute device",
        )
    if attributes.get("Integrated") == 1:
        return Classification(
            PlatformKind.UNIFIED, "Integrated=1: the GPU and the CPU share one physical DRAM"
        )
    if attributes.get(_TORCH_IS_INTEGRATED) == 1:
        return Classification(
            PlatformKind.UNIFIED,
            "torch reports is_integrated=1: the GPU and the CPU share one physical DRAM",
        )
    evidence = [name for name in _COHERENCE_EVIDENCE if attributes.get(name) == 1]
    if evidence:
        return Classification(
            PlatformKind.COHERENT,
            f"{_format_values(attributes, evidence)}: separate GPU memory, hardware-coherent with "
            "the CPU's (NVLink-C2C / ATS)",
        )
    reason = (
        f"{_format_values(attributes, ('Integrated',) + _COHERENCE_EVIDENCE)}: separate GPU "
        "memory, not coherent with the CPU's (PCIe-class link)"
    )
    if attributes.get("PageableMemoryAccess") == 1:
        reason += (
            "; PageableMemoryAccess=1 without PageableMemoryAccessUsesHostPageTables=1 is HMM "
            "(software page faulting), not coherence"
        )
    unknown = [
        name
        for name in ("Integrated", "PageableMemoryAccessUsesHostPageTables", "HostNativeAtomicSupported")
        if attributes.get(name) is None
    ]
    if unknown:
        reason += (
            f"; could not read {', '.join(unknown)}, so assumed discrete, whose pinned copies are "
            f"correct on every machine (override with {ENV_PLATFORM})"
        )
    return Classification(PlatformKind.DISCRETE, reason)


def interpret_link_ratio(ratio: float) -> str:
    """Say what a GPU-DRAM : CPU-GPU link bandwidth ratio means for offloading.

    The ratio is how many bytes the GPU moves in its own memory in the time the link moves one.
    Near 1 the memory is one (UNIFIED: never copy); near 10 the link is fast enough that
    offloading often pays (GH200-class); near 80 it rarely pays without a plan (x86 + H200 PCIe).

    Args:
        ratio: GPU device-to-device copy bandwidth divided by the one-way link bandwidth.

    Returns:
        str: a one-line meaning.

    Raises:
        ValueError: if ``ratio`` is not positive.

    Example::

        >>> interpret_link_ratio(77.0)
        '~80 (discrete-class link): offload only what the planner says pays'
    """
    if not ratio > 0:
        raise ValueError(f"the GPU-DRAM : link ratio must be positive, got {ratio!r}")
    if ratio <= _UNIFIED_RATIO_MAX:
        return "~1 (unified memory): never copy; let the GPU read the one allocation"
    if ratio <= _COHERENT_RATIO_MAX:
        return "~10 (coherent-class link): offloading weights, grads, optimizer state often pays"
    return "~80 (discrete-class link): offload only what the planner says pays"


@dataclass(frozen=True)
class BandwidthRow:
    """Measured copy bandwidths (GB/s, 1e9 bytes/s) for one chunk size.

    ``bidirectional_pinned_gbps`` counts the bytes of both ways, copied at once on two streams.
    """

    chunk_bytes: int
    h2d_pinned_gbps: float
    d2h_pinned_gbps: float
    bidirectional_pinned_gbps: float
    h2d_pageable_gbps: float
    d2h_pageable_gbps: float


@dataclass(frozen=True)
class BandwidthReport:
    """What :func:`measure_bandwidth` measured on one GPU.

    Attributes:
        device: the measured device, e.g. ``"cuda:0"``.
        device_name: its name, e.g. ``"NVIDIA H200"``.
        buffer_bytes: bytes copied per timed pass (in chunks of each row's size).
        repeats: timed passes per figure (after one warm-up); each figure is their median.
        rows: one :class:`BandwidthRow` per chunk size, smallest first.
        device_copy_gbps: the GPU's own device-to-device copy bandwidth, read + write bytes.
        torch_version: ``torch.__version__`` at measurement.
    """

    device: str
    device_name: str
    buffer_bytes: int
    repeats: int
    rows: tuple[BandwidthRow, ...]
    device_copy_gbps: float
    torch_version: str

    @property
    def h2d_gbps(self) -> float:
        """Best pinned host-to-device bandwidth over the chunk sizes."""
        return max(row.h2d_pinned_gbps for row in self.rows)

    @property
    def d2h_gbps(self) -> float:
        """Best pinned device-to-host bandwidth over the chunk sizes."""
        return max(row.d2h_pinned_gbps for row in self.rows)

    @property
    def bidirectional_gbps(self) -> float:
        """Best total pinned bandwidth with both ways copying at once."""
        return max(row.bidirectional_pinned_gbps for row in self.rows)

    @property
    def link_gbps(self) -> float:
        """The link's one-way bandwidth: the faster of pinned H2D and D2H."""
        return max(self.h2d_gbps, self.d2h_gbps)

    @property
    def dram_to_link_ratio(self) -> float:
        """GPU-DRAM : link ratio, ``device_copy_gbps / link_gbps`` (see :func:`interpret_link_ratio`)."""
        return self.device_copy_gbps / self.link_gbps

    @property
    def ratio_meaning(self) -> str:
        """What :attr:`dram_to_link_ratio` means for offloading."""
        return interpret_link_ratio(self.dram_to_link_ratio)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the measurements and the derived figures."""
        return {
            **dataclasses.asdict(self),
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
            "bidirectional_gbps": self.bidirectional_gbps,
            "link_gbps": self.link_gbps,
            "dram_to_link_ratio": self.dram_to_link_ratio,
            "ratio_meaning": self.ratio_meaning,
        }


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


# ---------------------------------------------------------------------------------------------
# Reading the machine


def read_host_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None where it cannot be read.

    Example::

        >>> read_host_available_bytes() > 0
        True
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_locked_memory_limit_bytes() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` (``ulimit -l``) in bytes; None when unlimited.

    Example::

        >>> limit = read_locked_memory_limit_bytes()  # None under `ulimit -l unlimited`
    """
    try:
        import resource
    except ImportError:  # not POSIX: there is no such limit to respect
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _read_attributes_cuda_bindings(index: int) -> dict[str, int | None]:
    from cuda.bindings import runtime as rt

    values: dict[str, int | None] = {}
    for name, attribute_id in CUDA_DEVICE_ATTRIBUTES.items():
        try:
            attribute = rt.cudaDeviceAttr(attribute_id)
        except ValueError:  # bindings older than the attribute
            values[name] = None
            continue
        err, value = rt.cudaDeviceGetAttribute(attribute, index)
        values[name] = int(value) if err == rt.cudaError_t.cudaSuccess else None
    return values


def _read_attributes_libcuda(index: int) -> dict[str, int | None]:
    libcuda = ctypes.CDLL("libcuda.so.1")
    result = libcuda.cuInit(0)
    if result != 0:
        raise OSError(f"cuInit failed with CUresult {result}")
    cu_device = ctypes.c_int()
    result = libcuda.cuDeviceGet(ctypes.byref(cu_device), ctypes.c_int(index))
    if result != 0:
        raise OSError(f"cuDeviceGet({index}) failed with CUresult {result}")
    values: dict[str, int | None] = {}
    for name, attribute_id in CUDA_DEVICE_ATTRIBUTES.items():
        value = ctypes.c_int()
        result = libcuda.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(attribute_id), cu_device)
        # An id the driver does not know (an old driver) fails: unknown, never 0.
        values[name] = value.value if result == 0 else None
    return values


def _read_cuda_attributes(index: int) -> tuple[dict[str, int | None], str | None]:
    """The CUDA attributes and the reader that got them; all None when no reader works."""
    for reader_name, reader in (
        ("cuda.bindings", _read_attributes_cuda_bindings),
        ("libcuda", _read_attributes_libcuda),
    ):
        try:
            values = reader(index)
        except Exception:  # a missing module or library, or a broken driver: try the next
            continue
        if any(value is not None for value in values.values()):
            return values, reader_name
    return dict.fromkeys(CUDA_DEVICE_ATTRIBUTES), None


def _read_nvml_attributes(index: int) -> dict[str, int | None]:
    values: dict[str, int | None] = dict.fromkeys(_NVML_ATTRIBUTES)
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return values
    try:
        # NVML ignores CUDA_VISIBLE_DEVICES; the PCI bus id names the same GPU in both.
        props = torch.cuda.get_device_properties(index)
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        try:
            values[_NVML_C2C_ENABLED] = int(pynvml.nvmlDeviceGetC2cModeInfoV(handle).isC2cEnabled)
        except Exception:
            pass
        try:
            mode = pynvml.nvmlDeviceGetAddressingMode(handle)
            values[_NVML_ADDRESSING_MODE] = int(getattr(mode, "value", mode))
        except Exception:
            pass
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return values


def _read_device_attributes(index: int) -> tuple[dict[str, int | None], str | None, str | None]:
    """(attributes, attribute reader, device name) of CUDA device ``index``; never raises."""
    attributes: dict[str, int | None] = {_DEVICE_COUNT: torch.cuda.device_count()}
    cuda_attributes, reader = _read_cuda_attributes(index)
    attributes.update(cuda_attributes)
    try:
        props = torch.cuda.get_device_properties(index)
        attributes[_TORCH_IS_INTEGRATED] = int(props.is_integrated)
        name: str | None = props.name
    except Exception:
        attributes[_TORCH_IS_INTEGRATED] = None
        name = None
    attributes.update(_read_nvml_attributes(index))
    return attributes, reader, name


def _read_gpu_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(free, total) bytes of ``device``, or (None, None) where they cannot be read."""
    if device.type != "cuda":
        return None, None
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:
        return None, None
    return int(free), int(total)


# ---------------------------------------------------------------------------------------------
# Detection


class _Detection(NamedTuple):
    classification: Classification
    attributes: Mapping[str, int | None]
    attribute_reader: str | None
    device_name: str | None


_DETECTIONS: dict[torch.device, _Detection] = {}
_BANDWIDTHS: dict[tuple[Any, ...], BandwidthReport] = {}


def _parse_kind(value: str | PlatformKind, origin: str) -> PlatformKind | None:
    """The kind ``value`` names, or None for ``"auto"`` (detect)."""
    if isinstance(value, PlatformKind):
        return value
    if isinstance(value, str):
        normalized = value.strip().lower().replace("-", "_")
        if normalized == "auto":
            return None
        for kind in PlatformKind:
            if normalized == kind.value:
                return kind
    valid = ", ".join(kind.value for kind in PlatformKind)
    raise ValueError(
        f"{origin}={value!r} is not a platform kind; valid kinds: {valid} (or 'auto' to detect)"
    )


def _requested_kind(kind: str | PlatformKind | None) -> tuple[PlatformKind | None, str]:
    """The forced kind (None = detect) and its source: the argument beats the environment."""
    if kind is not None:
        forced = _parse_kind(kind, "kind")
        if forced is not None:
            return forced, "argument"
        return None, "detected"
    env_value = os.environ.get(ENV_PLATFORM, "").strip()
    if env_value:
        forced = _parse_kind(env_value, ENV_PLATFORM)
        if forced is not None:
            return forced, "environment"
    return None, "detected"


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a device: pass a CUDA device as cuda:N or its index N (N >= 0), "
            "or 'cpu'"
        ) from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(
            f"device {str(resolved)!r} is not supported: pass a CUDA device (cuda:N) or 'cpu'"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(resolved)!r} was asked for, but torch.cuda.is_available() is False; "
            "pass device=None (or 'cpu') on a machine without a GPU"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device cuda:{index} does not exist: {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


def _detect(device: torch.device) -> _Detection:
    cached = _DETECTIONS.get(device)
    if cached is not None:
        return cached
    if device.type == "cpu":
        attributes: dict[str, int | None] = {_DEVICE_COUNT: torch.cuda.device_count()}
        if attributes[_DEVICE_COUNT]:
            classification = Classification(
                PlatformKind.HOST_ONLY, "device cpu was asked for: the CPU is the compute device"
            )
        else:
            classification = classify(attributes)
        detection = _Detection(classification, types.MappingProxyType(attributes), None, None)
    else:
        attributes, reader, name = _read_device_attributes(device.index)
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
    resolved = _resolve_device(device)
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
    gpu_free, gpu_total = _read_gpu_memory(platform_device)
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
        TypeError: if a value is neither an int nor None.
        ValueError: if ``kind`` names no kind, an attribute name is not one :func:`classify` and
            :attr:`Platform.attributes` know, or a value is outside the attribute's range (e.g.
            ``Integrated=2``); the message names the attribute and what it accepts.

    Example::

        >>> platform_from_attributes({"Integrated": 1}).copies_needed
        False
    """
    forced = None if kind is None else _parse_kind(kind, "kind")
    classification = classify(attributes)
    _check_attribute_values(attributes)
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


def _check_attribute_values(attributes: Mapping[str, int | None]) -> None:
    """Refuse names outside :data:`_ATTRIBUTE_RANGES` and values outside their range."""
    for name, value in attributes.items():
        if name not in _ATTRIBUTE_RANGES:
            close = difflib.get_close_matches(name, list(_ATTRIBUTE_RANGES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"attribute {name!r} is not a known attribute{hint}; the known attributes are "
                f"{', '.join(_ATTRIBUTE_RANGES)} (each an integer, or null for unknown)"
            )
        low, high = _ATTRIBUTE_RANGES[name]
        if value is not None and (value < low or (high is not None and value > high)):
            accepted = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            raise ValueError(f"attribute {name}={value} is out of range: {name} takes {accepted}, or null for unknown")


# ---------------------------------------------------------------------------------------------
# Bandwidth


def _issue_chunked_copies(
    copies: Sequence[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]], chunk_bytes: int
) -> None:
    """Enqueue each (stream, dst, src) copy in chunks, alternating between the copies chunk by
    chunk so that copies on different streams run at the same time from the start."""
    nbytes = copies[0][1].numel()
    for start in range(0, nbytes, chunk_bytes):
        chunk = slice(start, min(start + chunk_bytes, nbytes))
        for stream, dst, src in copies:
            with torch.cuda.stream(stream):
                dst[chunk].copy_(src[chunk], non_blocking=True)


def _median_gbps(
    nbytes: int, repeats: int, streams: Sequence[torch.cuda.Stream], issue: Callable[[], None]
) -> float:
    """Median GB/s of ``nbytes`` moved by ``issue()`` on ``streams``.

    Timed with CUDA events on the first stream, which waits for the others; one untimed warm-up
    pass first (it also faults in pageable pages).
    """
    main_stream = streams[0]
    seconds = []
    for attempt in range(repeats + 1):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(main_stream)
        for stream in streams[1:]:
            stream.wait_event(start)
        issue()
        for stream in streams[1:]:
            done = torch.cuda.Event()
            done.record(stream)
            main_stream.wait_event(done)
        end.record(main_stream)
        end.synchronize()
        if attempt:
            seconds.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(seconds) / 1e9


def _measure(
    device: torch.device, nbytes: int, chunk_sizes: Sequence[int], repeats: int
) -> tuple[tuple[BandwidthRow, ...], float]:
    """The rows and the device copy GB/s; every buffer dies on return."""
    pinned_in = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned_out = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(nbytes, dtype=torch.uint8)
    gpu_in = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    gpu_out = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    h2d_stream = torch.cuda.Stream(device)
    d2h_stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)

    def gbps(streams: Sequence[torch.cuda.Stream], copies: Sequence[tuple], chunk_bytes: int) -> float:
        moved = nbytes * len(copies)
        return _median_gbps(moved, repeats, streams, lambda: _issue_chunked_copies(copies, chunk_bytes))

    rows = []
    for chunk_bytes in chunk_sizes:
        h2d_pinned = (h2d_stream, gpu_in, pinned_in)
        d2h_pinned = (d2h_stream, pinned_out, gpu_out)
        rows.append(
            BandwidthRow(
                chunk_bytes=chunk_bytes,
                h2d_pinned_gbps=gbps([h2d_stream], [h2d_pinned], chunk_bytes),
                d2h_pinned_gbps=gbps([d2h_stream], [d2h_pinned], chunk_bytes),
                bidirectional_pinned_gbps=gbps(
                    [h2d_stream, d2h_stream], [h2d_pinned, d2h_pinned], chunk_bytes
                ),
                h2d_pageable_gbps=gbps([h2d_stream], [(h2d_stream, gpu_in, pageable)], chunk_bytes),
                d2h_pageable_gbps=gbps([d2h_stream], [(d2h_stream, pageable, gpu_out)], chunk_bytes),
            )
        )

    # Device-to-device copies are fast: repeat them so one timed pass lasts about a millisecond.
    device_copy_repeats = 8

    def device_copy() -> None:
        with torch.cuda.stream(h2d_stream):
            for _ in range(device_copy_repeats):
                gpu_out.copy_(gpu_in)

    device_copy_gbps = _median_gbps(2 * nbytes * device_copy_repeats, repeats, [h2d_stream], device_copy)
    torch.cuda.synchronize(device)
    return tuple(rows), device_copy_gbps


def measure_bandwidth(
    device: torch.device | str | int | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_CHUNK_SIZES,
    repeats: int = 5,
) -> BandwidthReport:
    """Measure the CPU-GPU link and the GPU's own DRAM bandwidth (cached per process).

    For each chunk size, a buffer of ``max(256 MiB, max(sizes))`` bytes is copied in chunks of that
    size: host to device and device to host from pinned and from pageable memory, and pinned both
    ways at once on two streams. The GPU's device-to-device copy bandwidth counts read + write
    bytes. Each figure is the median of ``repeats`` passes timed with CUDA events after a warm-up;
    GB/s means 1e9 bytes/s. With the defaults this takes a few seconds on an x86 + H200 and uses
    three 256 MiB host buffers (two pinned, one pageable) and two on the GPU, all freed after.

    Args:
        device: the CUDA device; default the current one.
        sizes: chunk sizes in bytes, each positive.
        repeats: timed passes per figure, at least 1.

    Returns:
        BandwidthReport: the table, the device copy bandwidth and the GPU-DRAM : link ratio.

    Raises:
        RuntimeError: on a machine without a GPU or for a CPU device: there is no link to measure
            (``detect_platform(bandwidth=True)`` then leaves ``Platform.bandwidth`` None instead).
        ValueError: if ``sizes`` is empty or holds a non-positive size, or ``repeats`` < 1.

    Example::

        >>> report = measure_bandwidth("cuda:0")
        >>> print(f"{report.h2d_gbps:.1f} GB/s, ratio {report.dram_to_link_ratio:.0f}")
        54.6 GB/s, ratio 77
    """
    chunk_sizes = tuple(sorted(set(sizes)))
    if not chunk_sizes or any(not isinstance(size, int) or size <= 0 for size in chunk_sizes):
        raise ValueError(f"sizes must be a non-empty sequence of positive byte counts, got {sizes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "measure_bandwidth needs a CUDA device, and torch.cuda.is_available() is False: there "
            "is no CPU-GPU link to measure on this machine"
        )
    resolved = _resolve_device(device)
    if resolved.type != "cuda":
        raise RuntimeError(
            f"measure_bandwidth needs a CUDA device, got {str(resolved)!r}: there is no CPU-GPU link "
            "to measure on the CPU"
        )
    key = (resolved, chunk_sizes, repeats)
    cached = _BANDWIDTHS.get(key)
    if cached is not None:
        return cached

    nbytes = max(_MIN_BUFFER_BYTES, chunk_sizes[-1])
    with torch.cuda.device(resolved):
        rows, device_copy_gbps = _measure(resolved, nbytes, chunk_sizes, repeats)
    # Hand the measurement's pinned blocks back rather than leave them in the caching host
    # allocator for the rest of the process.
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if host_empty_cache is not None:
        host_empty_cache()
    torch.cuda.empty_cache()
    report = BandwidthReport(
        device=str(resolved),
        device_name=torch.cuda.get_device_name(resolved),
        buffer_bytes=nbytes,
        repeats=repeats,
        rows=rows,
        device_copy_gbps=device_copy_gbps,
        torch_version=torch.__version__,
    )
    _BANDWIDTHS[key] = report
    return report


def _clear_caches() -> None:
    """Forget cached detections and measurements (tests, or after the machine changed)."""
    _DETECTIONS.clear()
    _BANDWIDTHS.clear()
