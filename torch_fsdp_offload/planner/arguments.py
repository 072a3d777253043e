"""The arguments of ``plan`` and ``plan_and_shard``, checked before anything is traced, timed or
sharded: each refusal names the argument, the value and what to pass instead."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from torch_fsdp_offload.planner.profiles import PLATFORM_PROFILES, PlatformProfile
from torch_fsdp_offload.policy import check_fully_shard_kwargs

__all__ = ["MODEL_ONLY_ARGUMENTS", "check_plan_and_shard_arguments", "check_plan_arguments", "check_positive_number", "is_int"]

# plan()'s arguments that describe a model; a scenario carries its own figures instead.
MODEL_ONLY_ARGUMENTS = (
    "batch_size", "seq_len", "microbatch_factors", "compute_dtype", "reduce_dtype", "measure", "world_size",
    "example_input", "blocks", "device", "clipping", "grad_accum_steps",
)
_DTYPES = "torch.bfloat16, torch.float16 or torch.float32"


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (any integral type), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_number(name: str, value: Any, meaning: str) -> None:
    """Refuse ``value`` unless it is None or a finite real number above 0 (``meaning`` says what
    it measures, for the message)."""
    if value is not None and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number above 0 ({meaning}) or None, got {value!r}")


def _differs(value: Any, default: Any) -> bool:
    """Whether an argument was given a value other than its default."""
    if value is default:
        return False
    if isinstance(default, tuple) and isinstance(value, (list, tuple)):
        return tuple(value) != default
    return default is None or not isinstance(value, type(default)) or value != default


def check_plan_arguments(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse :func:`~torch_fsdp_offload.planner.plan`'s arguments of the wrong type or out of range,
    and a model's arguments given with a scenario (which would ignore them).

    Args:
        given: ``plan``'s arguments by name, as it was called.
        defaults: ``plan``'s defaults by name.

    Raises:
        ValueError: neither or both of ``model`` and ``scenario``; ``gpu_memory_GiB`` not a finite
            number above 0; ``platform`` neither a name, a ``PlatformProfile`` nor None; with a
            scenario, any of :data:`MODEL_ONLY_ARGUMENTS` given; with a model, ``batch_size``,
            ``seq_len`` or ``world_size`` not an int, ``world_size`` or ``grad_accum_steps`` not an
            int >= 1, ``microbatch_factors``
            not a sequence of ints, a ``compute_dtype`` (or ``reduce_dtype`` other than None) that
            is no floating-point ``torch.dtype``, ``measure`` or ``clipping`` not a bool,
            ``device`` naming no device, or ``blocks`` one string.

    Example::

        >>> check_plan_arguments({**defaults, "model": "tiny", "gpu_memory_GiB": float("inf")}, defaults)
        Traceback (most recent call last):
        ValueError: gpu_memory_GiB must be a positive number of GiB, got inf: ...
    """
    if (given["model"] is None) == (given["scenario"] is None):
        raise ValueError("plan() needs exactly one of a model or scenario=")
    budget = given["gpu_memory_GiB"]
    if budget is not None and not (isinstance(budget, numbers.Real) and not isinstance(budget, bool) and 0 < budget < math.inf):
        raise ValueError(
            f"gpu_memory_GiB must be a positive number of GiB, got {budget!r}: pass the finite memory the step's "
            "peak must fit in (14, say), or leave it out for 90% of the platform's"
        )
    platform = given["platform"]
    if platform is not None and not isinstance(platform, (str, PlatformProfile)):
        raise ValueError(
            f"platform must be a profile name ({', '.join(sorted(PLATFORM_PROFILES))}), a PlatformProfile, or None "
            f"for this machine, got {platform!r}"
        )
    if given["scenario"] is not None:
        extra = [name for name in MODEL_ONLY_ARGUMENTS if _differs(given[name], defaults[name])]
        if extra:
            raise ValueError(
                f"{', '.join(extra)} only apply to a model; scenario= takes the micro-batch, sequence and timings "
                f"from the scenario: drop {', '.join(f'{name}=' for name in extra)}, or plan a model"
            )
        return
    for name in ("batch_size", "seq_len"):
        if given[name] is not None and not is_int(given[name]):
            raise ValueError(f"{name} must be an int >= 1 or None, got {given[name]!r}")
    factors = given["microbatch_factors"]
    if isinstance(factors, str) or not isinstance(factors, Sequence) or not all(is_int(f) for f in factors):
        raise ValueError(
            f"microbatch_factors must be a sequence of ints >= 1 (micro-batch multiples to time, e.g. (1, 2, 4)), "
            f"got {factors!r}"
        )
    world_size = given["world_size"]
    if not is_int(world_size):
        raise ValueError(f"world_size must be an int (the GPUs of one host FSDP shards over), got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    accumulated = given["grad_accum_steps"]
    if not is_int(accumulated) or accumulated < 1:
        raise ValueError(
            f"grad_accum_steps must be an int >= 1 (the micro-batches the loop accumulates per optimizer step; 1 for "
            f"none), got {accumulated!r}"
        )
    for name, optional in (("compute_dtype", False), ("reduce_dtype", True)):
        dtype = given[name]
        if not (dtype is None and optional) and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"{name} must be a floating-point torch.dtype ({_DTYPES}){' or None' if optional else ''}, got {dtype!r}"
            )
    for name, optional in (("measure", True), ("clipping", False)):
        if not isinstance(given[name], bool) and not (optional and given[name] is None):
            raise ValueError(f"{name} must be True or False{' (or None)' if optional else ''}, got {given[name]!r}")
    device = given["device"]
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device={device!r} names no device ({exc}); pass 'cuda', 'cuda:N' or 'cpu'") from None
    if isinstance(given["blocks"], str):
        raise ValueError(
            f"blocks={given['blocks']!r} is one name; pass a sequence of the blocks (modules or qualified names) in "
            f"forward order, e.g. [{given['blocks']!r}]"
        )


def check_plan_and_shard_arguments(model: Any, fully_shard_kwargs: Any) -> None:
    """Refuse what :func:`~torch_fsdp_offload.planner.plan_and_shard` would refuse only after
    planning, or at the ``fully_shard`` of a block: a model that is no module or is sharded, and
    ``fully_shard_kwargs`` that ``fully_shard`` does not take.

    Args:
        model: what ``plan_and_shard`` was given to plan and shard.
        fully_shard_kwargs: its ``fully_shard`` keyword arguments (None for none).

    Raises:
        TypeError: ``model`` is no ``nn.Module``; ``fully_shard_kwargs`` is no mapping, or holds
            a name ``fully_shard`` does not take or a ``mesh`` / ``mp_policy`` of another type.
        ValueError: ``model`` or one of its modules is already sharded; ``offload_policy`` among
            ``fully_shard_kwargs``.

    Example::

        >>> check_plan_and_shard_arguments(model, {"mp_polcy": mp})
        Traceback (most recent call last):
        TypeError: plan_and_shard: fully_shard takes no argument 'mp_polcy' (did you mean 'mp_policy'?); ...
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"plan_and_shard shards the model itself: pass the nn.Module, got {type(model).__name__} "
            "(plan() takes model names and configs)"
        )
    sharded = next((name for name, module in model.named_modules() if isinstance(module, FSDPModule)), None)
    if sharded is not None:
        raise ValueError(
            f"{repr(sharded) if sharded else 'the model'} is already sharded (fully_shard ran on it); plan_and_shard "
            "plans and shards a model that is not: build the model anew, or plan() it and shard it yourself"
        )
    if fully_shard_kwargs is None:
        return
    check_fully_shard_kwargs(fully_shard_kwargs, "plan_and_shard")
    if "offload_policy" in fully_shard_kwargs:
        raise ValueError(
            "plan_and_shard places the plan's offload policy itself: drop offload_policy from fully_shard_kwargs"
        )
