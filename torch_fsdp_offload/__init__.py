"""torch_fsdp_offload: CPU offloading for PyTorch FSDP that runs at the speed of the link."""

from torch_fsdp_offload.optim import OffloadOptimizer
from torch_fsdp_offload.platform import (
    Classification,
    classify,
    detect_platform,
    measure_bandwidth,
    Platform,
    PlatformKind,
)
from torch_fsdp_offload.policy import CoherentOffload, ResolvedPlan

__version__ = "0.1.0"

__all__ = [
    "Classification",
    "classify",
    "CoherentOffload",
    "detect_platform",
    "measure_bandwidth",
    "OffloadOptimizer",
    "Platform",
    "PlatformKind",
    "ResolvedPlan",
]
