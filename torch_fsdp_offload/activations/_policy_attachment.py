"""``CoherentOffload(activations=...)``: activation offload attached as ``fully_shard`` builds groups.

``fully_shard`` is called bottom-up: each block, then the model around them. As each parameter group
is built, its modules are registered with one
:class:`~torch_fsdp_offload.activations.ActivationOffload` per model (per model sharding: one policy
object until a module containing all the modules registered so far closes it):

* a module that contains no module registered before is a *block*: each of its forwards is one
  offload and prefetch unit, numbered in forward order;
* a module that contains registered modules is a *container* (the root, or a sub-model): its forward
  opens the offloaded pass when none is open, and what it saves outside its blocks (embeddings, the
  head) stays on the device, so nothing is offloaded twice.

Hooks are attached at group construction, because a module's forward hooks cannot be added from
inside its own pre-forward hook (they would first run on the next call). FSDP's own pre-forward hook
is registered first and prepended, so a block's parameters are already unsharded (and recognised as
parameters, never copied) when its block starts. Copies use the transfer engine of the group's device,
the one parameter offload uses: activation D2H copies run in forward while parameter copies go the
other way, and in backward a block's parameter prefetch (FSDP's pre-backward unshard) is issued
before its first saved tensor is unpacked, which is when the activation reloads are issued.

This module reads the group through :class:`ShardedGroup` only; it imports nothing of the FSDP
integration.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Union

import torch
import torch.nn as nn

from torch_fsdp_offload.activations._ownership import MadeBy, check_can_hook, offloader_of
from torch_fsdp_offload.activations._offloader import ActivationOffload
from torch_fsdp_offload.platform import Platform

__all__ = ["ShardedGroup", "attach_activation_offload", "check_activation_offload", "get_activation_offload"]


class _ActivationsPolicy(Protocol):
    activations: Union[bool, float]  # CoherentOffload.activations, as the user gave it


class _ActivationsPlan(Protocol):
    activations: float  # the fraction of blocks to offload, 0.0 where nothing is copied
    platform: Platform


class _GroupOffload(Protocol):
    plan: _ActivationsPlan


class _ModelSharding(Protocol):
    activation_model: Any  # this module's slot for the model's offloader while it is being sharded


class ShardedGroup(Protocol):
    """What :func:`attach_activation_offload` reads from a parameter group ``fully_shard`` is building
    with a :class:`~torch_fsdp_offload.CoherentOffload` (the FSDP integration's group has these)."""

    modules: Sequence[nn.Module]  # the modules fully_shard was called on, sharing this group
    device: torch.device  # the compute device
    coherent_policy: _ActivationsPolicy
    _offload: _GroupOffload  # the group's offload state, whose ``plan`` is the resolved policy
    _model_sharding: _ModelSharding  # what this policy object accumulates for the model being sharded


class _ModelBeingSharded:
    """The offloader of the model whose modules a policy is sharding now, and those modules."""

    def __init__(self, offload: ActivationOffload) -> None:
        self.offload = offload
        self.modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _offloads_activations(policy: _ActivationsPolicy) -> bool:
    return policy.activations is not False and policy.activations != 0


def check_activation_offload(policy: _ActivationsPolicy, modules: Iterable[nn.Module]) -> None:
    """Refuse, before the group is built (no parameter converted), modules whose activations
    another offloader already offloads (``offload_activations`` on the model before sharding).
    Each module is sharded once, so no offloader of this policy can have them yet.

    Raises:
        ValueError: naming the module and how to keep one offloader.
    """
    if _offloads_activations(policy):
        check_can_hook(modules, None, MadeBy.POLICY.value)


def attach_activation_offload(group: ShardedGroup) -> None:
    """Register ``group``'s modules with their model's activation offloader (at group construction).

    A no-op unless the group's :class:`~torch_fsdp_offload.CoherentOffload` has ``activations``
    set. On UNIFIED and HOST_ONLY platforms the offloader is still attached, inactive: it copies
    nothing and its counters stay at zero.
    """
    if not _offloads_activations(group.coherent_policy):
        return
    plan = group._offload.plan
    sharding = group._model_sharding
    model = sharding.activation_model
    if model is None:
        offload = ActivationOffload(fraction=plan.activations, platform=plan.platform, device=group.device)
        offload._made_by = MadeBy.POLICY
        model = _ModelBeingSharded(offload)
        sharding.activation_model = model
    for module in group.modules:
        contained = {id(m) for m in module.modules() if m is not module and m in model.modules}
        if contained:
            model.offload.attach(module)
            if len(contained) == len(model.modules):
                # The model's root: the next module sharded with this policy belongs to another model.
                sharding.activation_model = None
        else:
            model.offload.register_blocks([module])
        model.modules.add(module)


def get_activation_offload(module: nn.Module) -> ActivationOffload | None:
    """The activation offloader ``fully_shard`` attached to ``module`` (a block or the model).

    Args:
        module (nn.Module): a module ``fully_shard`` was called on with
            ``CoherentOffload(activations=...)``.

    Returns:
        ActivationOffload | None: the model's offloader (its ``stats`` count what moved), or None
        when ``module`` was not sharded with activation offload.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        >>> policy = CoherentOffload(activations=True)
        >>> for block in model.blocks:
        ...     fully_shard(block, offload_policy=policy)
        >>> fully_shard(model, offload_policy=policy)
        >>> causal_lm_loss(model(tokens), tokens).backward()
        >>> get_activation_offload(model).stats.d2h_bytes > 0
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"get_activation_offload expects the nn.Module fully_shard was called on, got {type(module).__name__}")
    offload = offloader_of(module)
    return offload if offload is not None and offload._made_by is MadeBy.POLICY else None
