"""torch_fsdp_offload: CPU offloading for PyTorch FSDP that runs at the speed of the link.

Importing the package changes nothing of torch. The FSDP integration installs the part a user needs
when it is first used: constructing a :class:`CoherentOffload` installs FSDP2's (nothing at all on a
torch with the offload-policy hooks), the FSDP1 front door FSDP1's. :func:`install` applies every
part at once and :func:`uninstall` restores torch's originals exactly. See Note: [Installing the
integration] in docs/design.md.
"""

from torch_fsdp_offload._integration import install, uninstall
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
    "NothingFitsError",
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
    "uninstall",
]


def __getattr__(name: str):
    # The planner reads every room and no room imports it: load it only when asked for.
    if name in ("NothingFitsError", "plan", "plan_and_shard", "predict_per_gpu"):
        from torch_fsdp_offload import planner

        return getattr(planner, name)
    if name == "TransferTensor":
        raise AttributeError(
            "torch_fsdp_offload.TransferTensor is not part of the offload package's API: the policy's "
            "data path does not use it. Import it from its own module: "
            "from torch_fsdp_offload.transfer_tensor import TransferTensor (docs/transfer_tensor.md)"
        )
    raise AttributeError(f"module 'torch_fsdp_offload' has no attribute {name!r}")
