"""What an FSDP2 parameter group will be under ``CoherentOffload``, decided from ``fully_shard``'s
arguments before FSDP converts a parameter: the policy's plan, whether the group is offloaded, and
every refusal (FSDP2's hooks traced by torch.compile, mixed dtypes, host capacity), so that a
refusal leaves the model as it was."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_fsdp_offload._helpers.compiled import fsdp_hooks_traced
from torch_fsdp_offload.data_path.group_offload import host_bytes
from torch_fsdp_offload.device_memory import check_managed_fits
from torch_fsdp_offload.memory import check_host_capacity, promised_host_bytes
from torch_fsdp_offload.resolved_plan import ResolvedPlan


# The hooks the patch adds to OffloadPolicy, all of which CoherentOffload implements.
HOOKS = (
    "offloads_group", "init_group", "place_shards", "on_shard_reset", "copy_in", "on_copy_in_read",
    "before_compute", "copy_out_grads", "on_grads_ready",
)


def implements_offload_hooks(policy: Any) -> bool:
    """Whether ``policy`` is one this integration runs (it implements every offload hook and
    resolves to a :class:`ResolvedPlan`), as opposed to FSDP's own offload policies."""
    return callable(getattr(policy, "resolve", None)) and all(callable(getattr(policy, name, None)) for name in HOOKS)


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


def plan_group(policy: Any, call: dict[str, Any]) -> tuple[ResolvedPlan, bool]:
    """The policy's plan for the group ``fully_shard`` is about to build from ``call`` (the base
    constructor's arguments) and whether it is offloaded, raising every refusal the policy makes,
    all before FSDP converts a parameter. What groups built before and not yet homed will allocate
    (:func:`~torch_fsdp_offload.memory.promised_host_bytes`) counts against the same host capacity.

    Every group built with the policy is offloaded where its plan keeps shards in host memory
    (placement is per module: a module sharded without the policy is not); on HOST_ONLY platforms,
    and on UNIFIED ones with the default ``shard_memory``, none is. Managed shards must also fit,
    with every group's promised before, in the GPU's free memory.
    """
    platform = policy.detect()
    plan = policy.resolve(platform)
    offloaded = plan.offloads
    if offloaded:
        check_fsdp_hooks_not_traced()
        params = call["params"]
        check_one_dtype(params)
        compute_dtype = one_compute_dtype(call["mp_policy"], params)
        numel = sum(padded_shard_numel(p, call["mesh_info"], call.get("shard_placement_fn")) for p in params)
        nbytes = host_bytes(numel, params[0].dtype, compute_dtype, plan.cast_on)
        what = "CoherentOffload shards and gradients (and compute-dtype mirrors with cast_on='host')"
        check_host_capacity(promised_host_bytes() + nbytes, pinned=plan.memory == "pinned", what=what)
        if plan.memory == "managed":
            check_managed_fits(promised_host_bytes(managed_only=True) + nbytes, platform.device, f"managed {what}")
    return plan, offloaded


def check_fsdp_hooks_not_traced() -> None:
    """An offloaded group's copies, events and locks run in FSDP2's hooks, which dynamo cannot put
    in a graph: with the hooks traced, every one would break the compiled graph and run eagerly.
    Refused before FSDP shards."""
    if fsdp_hooks_traced():
        raise RuntimeError(
            "CoherentOffload cannot offload an FSDP2 group whose hooks torch.compile traces "
            "(torch._dynamo.config.skip_fsdp_hooks=False): the policy copies shards and gradients in "
            "those hooks, and each copy would break the compiled graph into eager code. Keep "
            "skip_fsdp_hooks=True (the default: a compiled model or block then runs FSDP's hooks, and "
            "the policy's copies, between its compiled graphs), or shard this model without the policy"
        )


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


def one_compute_dtype(mp_policy: Any, params: list[nn.Parameter]) -> torch.dtype | None:
    """The compute dtype an offloaded group's one coalesced copy-in casts to: ``param_dtype``, or
    where ``param_dtype_override_fn`` (torch 2.15) gives parameters their own, the one they all get
    (``None`` where there is none to cast to). A group whose parameters get different ones is refused,
    before FSDP shards: one staging buffer cannot hold them."""
    override = getattr(mp_policy, "param_dtype_override_fn", None)
    if override is None:
        return mp_policy.param_dtype
    dtypes = {override(param) or mp_policy.param_dtype or param.dtype for param in params}
    if len(dtypes) > 1:
        raise ValueError(
            "CoherentOffload copies an FSDP group in as one buffer of one compute dtype, but "
            f"MixedPrecisionPolicy.param_dtype_override_fn gives this group's parameters "
            f"{', '.join(sorted(str(dtype) for dtype in dtypes))}. Return one dtype for all parameters "
            "of a group, or call fully_shard (with the policy) on the submodules of each compute dtype "
            "first, so that each gets its own group"
        )
    return dtypes.pop()
