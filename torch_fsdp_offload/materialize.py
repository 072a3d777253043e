"""Materialise a model built on ``meta`` and sharded with ``fully_shard``, each group's shards where
FSDP keeps them."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from torch_fsdp_offload._integration import fsdp2_shards_on_host

__all__ = ["materialize_sharded"]


def _shard_home(module: nn.Module, device: torch.device) -> torch.device:
    return torch.device("cpu") if fsdp2_shards_on_host(module) else device


@torch.no_grad()
def materialize_sharded(model: nn.Module, device: torch.device | str) -> None:
    """Allocate, uninitialised, the shards of a model built on ``meta`` and sharded with ``fully_shard``.

    Each FSDP parameter group's shards go where FSDP keeps them: on the host for an offloaded group,
    on ``device`` for a resident one (a model only some of whose blocks were given an offload policy
    mixes both; so do platforms where nothing is offloaded). Buffers, which FSDP does not shard, go
    to ``device``. Only local shards are allocated, so no rank ever holds the whole model. Fill the values
    afterwards (e.g. ``Transformer.init_weights``).

    Args:
        model (nn.Module): built on the ``meta`` device, with ``fully_shard`` applied to it (the
            root) and to any of its submodules.
        device (torch.device | str): the compute device.

    Raises:
        ValueError: ``model`` is not an FSDP2 module (``fully_shard`` was not applied to it).

    Example::

        >>> model = build_model("tiny", device="meta")
        >>> # Blocks 1, 3, ... offloaded (their shards on the host); blocks 0, 2, ... and the root on the GPU.
        >>> fully_shard_with_policy(model, model.blocks, CoherentOffload(), spread_fraction=0.5)
        >>> materialize_sharded(model, "cuda")
        >>> model.init_weights(seed=0)
    """
    if not isinstance(model, FSDPModule):
        raise ValueError(
            f"materialize_sharded expects a model sharded with fully_shard, got a plain {type(model).__name__}; "
            "call fully_shard(model, ...) first"
        )
    device = torch.device(device)
    owner: dict[nn.Module, nn.Module] = {}

    def assign(module: nn.Module, group_root: nn.Module) -> None:
        owner[module] = group_root = module if isinstance(module, FSDPModule) else group_root
        for child in module.children():
            assign(child, group_root)

    assign(model, model)
    # Children before parents: an FSDP module's _apply re-reads its group's parameters, which may
    # live in its submodules and must already be materialised.
    for module in reversed(list(model.modules())):
        module.to_empty(device=_shard_home(owner[module], device), recurse=False)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
