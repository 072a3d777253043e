"""What FSDP1's handles will hold under the front door, decided before FSDP1 wraps the module.

FSDP1 builds one ``FlatParamHandle`` per module its ``auto_wrap_policy`` picks, in post-order, and one
for the root; each handle takes the parameters, not ignored, registered in its module's tree outside
the handles built before it (with ``use_orig_params=True``, also none that such a handle took
through a shared parameter). Its flat parameter pads each parameter's start to 16 bytes of the compute
dtype and the total to a multiple of the shard group's size where ``use_orig_params=True``, and a
rank keeps ``ceil(numel / world_size)`` elements of it (all of it under ``NO_SHARD``). This module
reads the same decisions from FSDP1's own policy code, without wrapping anything, so that the
front door's host-capacity refusal comes before FSDP1's constructor touches the module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp._flat_param import _get_aligned_numel
from torch.distributed.fsdp._init_utils import _init_ignored_module_states
from torch.distributed.fsdp.wrap import (
    _or_policy,
    _Policy,
    _recursive_wrap,
    _run_mixed_precision_override_policy,
    _wrap_module_cls_individually,
)

from torch_fsdp_offload.data_path.group_offload import host_bytes
from torch_fsdp_offload.memory import check_host_capacity, promised_host_bytes

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class PlannedShard:
    """One handle's local shard, as FSDP1 will build it."""

    numel: int  # elements, padding included
    dtype: torch.dtype  # the parameters' dtype
    param_dtype: torch.dtype | None  # the handle's MixedPrecision.param_dtype (None: no cast)


def check_arguments(call: dict[str, Any]) -> None:
    """Raise TypeError for an FSDP1 argument the plan reads that is not of a type FSDP1 takes:
    FSDP1 itself fails on it with an unrelated error, or runs a strategy string as another one."""
    strategy, mixed_precision, policy = call["sharding_strategy"], call["mixed_precision"], call["auto_wrap_policy"]
    if strategy is not None and not isinstance(strategy, ShardingStrategy):
        raise TypeError(
            f"FullyShardedDataParallel(sharding_strategy=...) takes a ShardingStrategy (e.g. "
            f"ShardingStrategy.FULL_SHARD) or None, got {strategy!r}"
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"FullyShardedDataParallel(mixed_precision=...) takes a MixedPrecision (e.g. "
            f"MixedPrecision(param_dtype=torch.bfloat16)) or None, got {mixed_precision!r}"
        )
    if policy is not None and not (isinstance(policy, _Policy) or callable(policy)):
        raise TypeError(
            f"FullyShardedDataParallel(auto_wrap_policy=...) takes a ModuleWrapPolicy, a CustomPolicy or a "
            f"policy function (e.g. functools.partial(size_based_auto_wrap_policy, min_num_params=...)), got {policy!r}"
        )


def check_capacity(module: nn.Module, call: dict[str, Any], device: torch.device, *, cast_on: str) -> None:
    """Raise :class:`~torch_fsdp_offload.memory.HostMemoryError` unless the host can hold the
    exact-size shards, gradient buffers and mirrors (``cast_on="host"``) of every handle FSDP1 will
    build over ``module`` from ``call``, on top of what built handles will allocate at their first
    forward. The shards are pinned where CUDA is (:func:`~torch_fsdp_offload.memory.pinned_empty`)."""
    need = sum(host_bytes(s.numel, s.dtype, s.param_dtype, cast_on) for s in planned_shards(module, call, device))
    check_host_capacity(
        promised_host_bytes() + need,
        pinned=torch.cuda.is_available(),
        what="FullyShardedDataParallel(offload_policy=CoherentOffload()) shards and gradients (and "
        "compute-dtype mirrors with cast_on='host')",
    )


def planned_shards(module: nn.Module, call: dict[str, Any], device: torch.device) -> list[PlannedShard]:
    """The local shard of every handle FSDP1 will build over ``module`` that offloads its
    parameters, given FSDP1's constructor arguments ``call`` (``process_group``,
    ``sharding_strategy``, ``cpu_offload``, ``auto_wrap_policy``, ``mixed_precision``,
    ``ignored_modules``, ``use_orig_params``, ``ignored_states``, ``device_mesh``) and the compute
    ``device``. Reads the module; changes nothing."""
    ignored = SimpleNamespace()
    _init_ignored_module_states(ignored, module, call["ignored_modules"], call["ignored_states"])
    root_kwargs = {
        name: call[name]
        for name in ("process_group", "sharding_strategy", "cpu_offload", "mixed_precision", "use_orig_params", "device_mesh")
    }
    targets = _wrap_targets(module, call["auto_wrap_policy"], ignored._ignored_modules, ignored._ignored_params, root_kwargs)
    targets[module] = root_kwargs
    ignored_params = ignored._ignored_params
    use_orig_params = call["use_orig_params"]
    # Once a handle is built, the modules under it hold no original parameter any more; with
    # use_orig_params=True its parameters stay registered, marked as flattened, wherever else
    # they are shared, and no later handle takes them.
    wrapped: set[nn.Module] = set()
    taken: set[nn.Parameter] = set()
    shards = []
    for target in _post_order(module):
        if target not in targets:
            continue
        params = []
        for submodule in target.modules():
            if submodule not in wrapped:
                params.extend(p for p in submodule.parameters(recurse=False) if p not in ignored_params and p not in taken)
        params = list(dict.fromkeys(params))
        wrapped.update(target.modules())
        if use_orig_params:
            taken.update(params)
        kwargs = targets[target]
        offload = kwargs["cpu_offload"]
        if params and offload is not None and offload.offload_params:
            shards.append(_shard(params, kwargs, device))
    return shards


def _wrap_targets(
    root: nn.Module, policy: Any, ignored_modules: set, ignored_params: set, root_kwargs: dict[str, Any]
) -> dict[nn.Module, dict[str, Any]]:
    """The modules FSDP1's ``_auto_wrap`` wraps below ``root``, each with its constructor arguments,
    found by FSDP1's own policy code with a wrapper that records instead of wrapping."""
    if policy is None:
        return {}
    mixed_precision = root_kwargs["mixed_precision"]
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root, ignored_modules, dict(root_kwargs))
        if mixed_precision is not None:
            targets = _run_mixed_precision_override_policy(
                root, mixed_precision._module_classes_to_ignore, ignored_modules, dict(root_kwargs), targets
            )
        return targets
    # With mixed precision FSDP1 also wraps each module of the classes it keeps in full precision
    # (batch norms), with mixed_precision=None; it marks them with _override_module_mixed_precision,
    # which registers hooks on them, so the same policy and override are made here instead.
    keep_full_precision: tuple = ()
    if mixed_precision is not None:
        keep_full_precision = tuple(mixed_precision._module_classes_to_ignore)
        policy = functools.partial(
            _or_policy,
            policies=[policy, functools.partial(_wrap_module_cls_individually, module_classes=keep_full_precision)],
        )
    targets: dict[nn.Module, dict[str, Any]] = {}

    def record(child: nn.Module, **kwargs: Any) -> nn.Module:
        if isinstance(child, keep_full_precision):
            kwargs["mixed_precision"] = None
        targets[child] = kwargs
        return child  # FSDP1 sets the wrapper as the child: setting the child itself changes nothing

    _recursive_wrap(root, policy, record, ignored_modules, ignored_params, only_wrap_children=True, **root_kwargs)
    return targets


def _post_order(root: nn.Module) -> list[nn.Module]:
    """``root``'s modules in the order FSDP1 wraps them: children first, each module once."""
    order, seen = [], {root}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if child not in seen:
                seen.add(child)
                visit(child)
        order.append(module)

    visit(root)
    return order


def _shard(params: list[nn.Parameter], kwargs: dict[str, Any], device: torch.device) -> PlannedShard:
    dtype = params[0].dtype
    mixed_precision = kwargs["mixed_precision"]
    param_dtype = mixed_precision.param_dtype if mixed_precision is not None else None
    strategy = kwargs["sharding_strategy"] or ShardingStrategy.FULL_SHARD
    world_size = _shard_group_size(strategy, kwargs["process_group"], kwargs["device_mesh"], device)
    if kwargs["use_orig_params"]:
        # Each parameter starts 16-byte aligned in the compute dtype, in the order FSDP1 flattens them.
        aligned = _get_aligned_numel(param_dtype or dtype)
        numel = 0
        for param in params:
            numel = -(-numel // aligned) * aligned + param.numel()
        numel = -(-numel // world_size) * world_size
    else:
        numel = sum(param.numel() for param in params)
    local = numel if strategy is ShardingStrategy.NO_SHARD else math.ceil(numel / world_size)
    return PlannedShard(local, dtype, param_dtype)


def _shard_group_size(strategy: ShardingStrategy, process_group: Any, device_mesh: Any, device: torch.device) -> int:
    """The size of the group FSDP1 shards over (its handles' ``world_size``)."""
    if strategy in _HYBRID:
        if device_mesh is not None:
            return device_mesh.size(1)
        if isinstance(process_group, tuple):
            return process_group[0].size()
        # FSDP1 makes one intra-node group per node of this many devices.
        return torch.get_device_module(device.type).device_count()
    if device_mesh is not None:
        return device_mesh.size(0)
    return process_group.size() if process_group is not None else dist.get_world_size()
