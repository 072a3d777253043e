"""What an FSDP2 parameter group will be under ``CoherentOffload``, decided from ``fully_shard``'s
arguments before FSDP converts a parameter: the policy's plan, whether the group is offloaded, and
every refusal (mixed dtypes, host capacity), so that a refusal leaves the model as it was."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_fsdp_offload.memory import check_host_capacity
from torch_fsdp_offload.policy import CoherentOffload, ResolvedPlan


def host_bytes(numel: int, master_dtype: torch.dtype, param_dtype: torch.dtype | None, cast_on: str) -> int:
    """Host bytes an offloaded group of ``numel`` padded shard elements pins: master, gradient
    buffer and, when the copy-in reads one (``cast_on="host"`` with a compute dtype other than the
    master's), a mirror."""
    mirrored = cast_on == "host" and param_dtype is not None and param_dtype != master_dtype
    return numel * master_dtype.itemsize * 2 + (numel * param_dtype.itemsize if mirrored else 0)


def padded_shard_numel(param: nn.Parameter, mesh_info: Any, shard_placement_fn: Any) -> int:
    """Elements of ``param``'s padded shard, as ``FSDPParam`` will lay it out (``torch.chunk``
    along the shard dim: every shard as large as the first), before FSDP shards it."""
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    placement = getattr(result, "placement", result)
    world_size = getattr(getattr(result, "mesh_info", mesh_info), "shard_mesh_size", 1)
    if param.dim() == 0:
        return 1
    dim = placement.dim % param.dim() if placement is not None else 0
    size = param.shape[dim]
    return 0 if size == 0 else -(-size // world_size) * (param.numel() // size)


def plan_group(
    policy: CoherentOffload, call: dict[str, Any], *, pending_host_bytes: int
) -> tuple[ResolvedPlan, bool]:
    """The policy's plan for the group ``fully_shard`` is about to build from ``call`` (the base
    constructor's arguments) and whether it is offloaded, raising every refusal the policy makes,
    all before FSDP converts a parameter. ``pending_host_bytes``: what live offloaded groups not yet
    homed will pin, counted against the same host capacity.

    Every group built with the policy is offloaded where the platform copies (placement is per
    module: a module sharded without the policy is not); on UNIFIED and HOST_ONLY platforms none is.
    """
    plan = policy.resolve()
    offloaded = plan.copies
    if offloaded:
        params = call["params"]
        check_one_dtype(params)
        numel = sum(padded_shard_numel(p, call["mesh_info"], call.get("shard_placement_fn")) for p in params)
        check_host_capacity(
            pending_host_bytes + host_bytes(numel, params[0].dtype, call["mp_policy"].param_dtype, plan.cast_on),
            pinned=plan.memory == "pinned",
            what="CoherentOffload shards and gradients (and compute-dtype mirrors with cast_on='host')",
        )
    return plan, offloaded


def check_one_dtype(params: list[nn.Parameter]) -> None:
    """An offloaded group's shards live in one flat host buffer of one dtype: a group mixing dtypes
    would have its parameters silently converted to the first one's. Refused before FSDP shards."""
    dtypes = sorted({str(param.dtype) for param in params})
    if len(dtypes) > 1:
        raise ValueError(
            f"CoherentOffload keeps an FSDP group's shards in one host buffer of one dtype, but this "
            f"group's parameters mix {', '.join(dtypes)}. Cast them to one dtype before fully_shard, or "
            "call fully_shard (with the policy) on the submodules of each dtype first, so that each "
            "dtype gets its own group"
        )
