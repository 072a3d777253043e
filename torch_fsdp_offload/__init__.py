"""torch_fsdp_offload: CPU offloading for PyTorch FSDP that runs at the speed of the link.

Importing the package installs its FSDP integration once (:func:`install`): the patch points in
FSDP2 and FSDP1 through which a :class:`CoherentOffload` policy and the FSDP1 front door act, each
verified. :func:`uninstall` restores torch's originals; while uninstalled, constructing a
``CoherentOffload`` or ``FullyShardedDataParallel(offload_policy=...)`` raises. See Note:
[Installing the integration] in docs/design.md.
"""

from torch_fsdp_offload._integration import install, install_on_import as _install_on_import, uninstall
from torch_fsdp_offload.activations import ActivationOffload, get_activation_offload, offload_activations
from torch_fsdp_offload.fsdp1 import FullyShardedDataParallel
from torch_fsdp_offload.materialize import materialize_sharded
from torch_fsdp_offload.optim import OffloadOptimizer
from torch_fsdp_offload.placement import measure_placement, PlacementAdvice
from torch_fsdp_offload.platform import (
    BandwidthReport,
    Classification,
    classify,
    detect_platform,
    ENV_PLATFORM,
    measure_bandwidth,
    Platform,
    platform_from_attributes,
    PlatformKind,
)
from torch_fsdp_offload.policy import CoherentOffload, fully_shard_with_policy, ResolvedPlan
from torch_fsdp_offload.transfer_tensor import TransferTensor

__version__ = "0.1.0"

__all__ = [
    "ActivationOffload",
    "BandwidthReport",
    "Classification",
    "classify",
    "CoherentOffload",
    "detect_platform",
    "ENV_PLATFORM",
    "FullyShardedDataParallel",
    "fully_shard_with_policy",
    "get_activation_offload",
    "install",
    "materialize_sharded",
    "measure_bandwidth",
    "measure_placement",
    "offload_activations",
    "OffloadOptimizer",
    "PlacementAdvice",
    "plan",
    "plan_and_shard",
    "predict_per_gpu",
    "Platform",
    "platform_from_attributes",
    "PlatformKind",
    "ResolvedPlan",
    "TransferTensor",
    "uninstall",
]

_install_on_import()


def __getattr__(name: str):
    # The planner reads every room and no room imports it: load it only when asked for.
    if name in ("plan", "plan_and_shard", "predict_per_gpu"):
        from torch_fsdp_offload import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'torch_fsdp_offload' has no attribute {name!r}")
