"""The only place that touches FSDP2's private internals (``torch.distributed.fsdp._fully_shard``).

FSDP2's offload policies are plain data: FSDP only asks ``isinstance(policy, CPUOffloadPolicy)``.
To act on a :class:`~torch_fsdp_offload.CoherentOffload`, we install one subclass of
``FSDPParamGroup`` at the three places FSDP constructs it. The subclass behaves exactly like its
base class for any other policy. ``FSDPState.init`` is wrapped to see every ``fully_shard`` call,
so that a model's root is known even when it builds no group of ours (``sharding.py``). See ``docs/architecture.md`` ("FSDP internals we touch") and
``docs/upstream.md`` for the public hooks that would make this package unnecessary.
"""

from __future__ import annotations

import importlib

import torch

# Releases whose internals were read (fsdp-internals.md: 2.11 and 2.13 line by line) and whose CPU
# test suite passes (.ci/torch_versions: 2.11.0, 2.12.1, 2.14.1; CI: 2.13.0).
SUPPORTED_TORCH = ((2, 11), (2, 14))

_installed = False


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    """Raise a clear error on a torch whose FSDP2 internals this package was not written for."""
    low, high = SUPPORTED_TORCH
    version = torch_version()
    if not (low <= version <= high):
        raise RuntimeError(
            f"torch_fsdp_offload supports torch {low[0]}.{low[1]} through {high[0]}.{high[1]}; "
            f"this is torch {torch.__version__}. CoherentOffload patches FSDP2 internals that "
            "change between releases: install a supported torch, or use FSDP2's own "
            "CPUOffloadPolicy on this one."
        )


def install() -> None:
    """Install the FSDP2 integration once per process (called by ``CoherentOffload()``)."""
    global _installed
    if _installed:
        return
    check_torch_version()
    from torch_fsdp_offload._fsdp2.param_group import CoherentFSDPParamGroup
    from torch_fsdp_offload._fsdp2.sharding import install_call_hook

    base = CoherentFSDPParamGroup.__mro__[1]
    for module_name in ("_fully_shard", "_fsdp_init", "_fsdp_param_group"):
        module = importlib.import_module(f"torch.distributed.fsdp._fully_shard.{module_name}")
        if getattr(module, "FSDPParamGroup", None) is base:
            module.FSDPParamGroup = CoherentFSDPParamGroup
    install_call_hook()
    _installed = True
