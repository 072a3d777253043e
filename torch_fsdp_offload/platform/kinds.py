"""The four kinds of CPU-GPU memory, and how a machine's device attributes decide its kind.

This module only interprets attribute values; reading them from a machine is
:mod:`torch_fsdp_offload.platform.readers`, and :mod:`torch_fsdp_offload.platform` combines the two
into a :class:`~torch_fsdp_offload.platform.Platform`. The rule is laid out in ``docs/platforms.md``.
"""

from __future__ import annotations

import difflib
import enum
import types
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = [
    "CUDA_DEVICE_ATTRIBUTES",
    "Classification",
    "DEVICE_COUNT",
    "ENV_PLATFORM",
    "NVML_ADDRESSING_MODE",
    "NVML_ATTRIBUTES",
    "NVML_C2C_ENABLED",
    "PlatformKind",
    "TORCH_IS_INTEGRATED",
    "check_attribute_values",
    "classify",
    "parse_kind",
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
DEVICE_COUNT = "DeviceCount"  # torch.cuda.device_count(); 0 means no accelerator
TORCH_IS_INTEGRATED = "TorchIsIntegrated"  # torch.cuda.get_device_properties(d).is_integrated
NVML_C2C_ENABLED = "NvmlC2cEnabled"  # nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled
NVML_ADDRESSING_MODE = "NvmlAddressingMode"  # nvmlDeviceGetAddressingMode: 0 none, 1 HMM, 2 ATS
NVML_ATTRIBUTES = (NVML_C2C_ENABLED, NVML_ADDRESSING_MODE)

_COHERENCE_EVIDENCE = (
    "PageableMemoryAccessUsesHostPageTables",
    "HostNativeAtomicSupported",
    NVML_C2C_ENABLED,
)

# The values each attribute can take, as inclusive (low, high) bounds (high None: unbounded). An
# attribute set given by hand (platform_from_attributes) is checked against them: a misspelt name
# or an impossible value would otherwise be classified as "unknown" or as plain evidence.
_ATTRIBUTE_RANGES: Mapping[str, tuple[int, int | None]] = types.MappingProxyType(
    {
        **dict.fromkeys((DEVICE_COUNT, "L2CacheSize", "AsyncEngineCount", "MaxPersistingL2CacheSize"), (0, None)),
        **dict.fromkeys(
            (
                "Integrated", "CanMapHostMemory", "UnifiedAddressing", "ManagedMemory",
                "HostNativeAtomicSupported", "PageableMemoryAccess", "ConcurrentManagedAccess",
                "CanUseHostPointerForRegisteredMem", "HostRegisterSupported",
                "PageableMemoryAccessUsesHostPageTables", "DirectManagedMemAccessFromHost",
                "MemoryPoolsSupported", "GPUDirectRDMASupported", TORCH_IS_INTEGRATED, NVML_C2C_ENABLED,
            ),
            (0, 1),
        ),
        "NumaConfig": (0, 1),  # cudaDeviceNumaConfigNone, cudaDeviceNumaConfigNumaNode
        "NumaId": (-1, None),  # -1: the GPU's memory is no NUMA node
        "HostNumaId": (-1, None),  # -1: the host has no NUMA
        NVML_ADDRESSING_MODE: (0, 2),  # none, HMM, ATS
    }
)


class PlatformKind(str, enum.Enum):
    """The four kinds of CPU-GPU memory the library tells apart (see ``docs/platforms.md``)."""

    UNIFIED = "unified"
    COHERENT = "coherent"
    DISCRETE = "discrete"
    HOST_ONLY = "host_only"


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
        TypeError: if ``attributes`` is not a mapping, or a value is neither an int nor None.

    Example::

        >>> classify({"Integrated": 0, "PageableMemoryAccess": 1,
        ...           "PageableMemoryAccessUsesHostPageTables": 0}).kind
        <PlatformKind.DISCRETE: 'discrete'>
    """
    if not isinstance(attributes, Mapping):
        raise TypeError(
            f"attributes must be a mapping of attribute name to int or None, got {type(attributes).__name__}; "
            'e.g. {"Integrated": 0, "PageableMemoryAccessUsesHostPageTables": 1}'
        )
    for name, value in attributes.items():
        if value is not None and not isinstance(value, int):
            raise TypeError(
                f"attribute {name!r} has value {value!r} of type {type(value).__name__}; "
                "attribute values must be int, or None for unknown"
            )
    device_count = attributes.get(DEVICE_COUNT)
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
    if attributes.get(TORCH_IS_INTEGRATED) == 1:
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


def parse_kind(value: str | PlatformKind, origin: str) -> PlatformKind | None:
    """The kind ``value`` names, or None for ``"auto"`` (detect).

    Case, surrounding space and ``-`` for ``_`` are forgiven: ``"Host-Only"`` names HOST_ONLY.

    Args:
        value: a :class:`PlatformKind`, its value, or ``"auto"``.
        origin: what ``value`` came from (e.g. ``"kind"`` or the environment variable's name), for
            the error message.

    Returns:
        PlatformKind | None: the kind, or None for ``"auto"``.

    Raises:
        ValueError: if ``value`` names no kind; the message lists the valid ones.

    Example::

        >>> parse_kind("Host-Only", "kind")
        <PlatformKind.HOST_ONLY: 'host_only'>
    """
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


def check_attribute_values(attributes: Mapping[str, int | None]) -> None:
    """Refuse an attribute set given by hand whose names or values no machine reports.

    Every name must be one :func:`classify` and ``Platform.attributes`` know, and every known value
    must lie in that attribute's range (e.g. ``Integrated`` is 0 or 1, ``NumaId`` is -1 or more).

    Args:
        attributes: as for :func:`classify`.

    Raises:
        ValueError: for an unknown name (the message suggests the closest known one and lists them
            all) or a value out of range (the message says what the attribute takes).

    Example::

        >>> check_attribute_values({"Integrated": 2})
        Traceback (most recent call last):
        ValueError: attribute Integrated=2 is out of range: Integrated takes an integer in [0, 1], or null for unknown
    """
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
