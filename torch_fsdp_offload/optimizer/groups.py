"""What the optimizer needs of an offloaded parameter group, and how the FSDP integration hands its
groups over.

The integration implements the two protocols below for every group ``CoherentOffload`` manages,
calls :func:`register_offloaded_group` once per group and :func:`notify_grads_ready` each time the
group's gradient copy to the host was issued. This module imports nothing of the optimizer's, so
the integration can import it without pulling the optimizer in.
"""

from __future__ import annotations

import concurrent.futures
import warnings
import weakref
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = [
    "OffloadedGroup",
    "StreamedGroup",
    "attach_optimizer",
    "mark_internal",
    "notify_grads_ready",
    "offloaded_group",
    "register_offloaded_group",
]


class OffloadedGroup(Protocol):
    """One offloaded FSDP parameter group, as its host step needs it.

    The group's parameters are DTensors whose local shards live in host memory; a host step runs
    the optimizer over them once their gradients have landed, then the group refreshes what its
    next copy-in reads.
    """

    #: Whether the group is offloaded now (a registered group may stay resident).
    offloaded: bool
    #: Its step while it may still run after ``step()`` returned (``overlap_next_forward``): set
    #: and cleared by the optimizer; the group's next copy-in waits for it.
    update_pending: concurrent.futures.Future | None
    #: The group's ``ResolvedPlan``: its ``optimizer_gpu_fraction`` picks the streamed groups.
    plan: Any

    @property
    def params(self) -> list[nn.Parameter]:
        """The group's sharded parameters, in a fixed order."""
        ...

    def grads_landed(self) -> bool:
        """Whether the gradient copy to the host has landed, without blocking."""
        ...

    def wait_grads(self) -> None:
        """Block until the gradient copy to the host has landed."""
        ...

    def refresh_mirror(self) -> None:
        """Bring what the next copy-in reads up to date with the stepped parameters."""
        ...

    def forward_index(self) -> int:
        """The group's position in forward order (groups not seen yet last)."""
        ...

    def label(self) -> str:
        """What a trace calls the group (its module's name)."""
        ...

    def prefetch_next_forward(self) -> None:
        """Start the copies the next forward needs first."""
        ...

    def as_param_dtensor(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """``local`` as a DTensor sharded like parameter ``index``, for its optimizer state."""
        ...


class StreamedGroup(OffloadedGroup, Protocol):
    """An offloaded group whose step is streamed through the GPU: its flat host buffers go up, the
    optimizer steps there, and the stepped master comes back.

    Every flat buffer (master, gradients, optimizer state) is laid out alike: parameter ``i``'s
    shard occupies ``param_ranges()[i]``, unpadded, from the start of its range.
    """

    #: The fp32 shards, one flat pinned buffer; None until the group is placed.
    master: torch.Tensor | None
    #: The reduced gradient shards, laid out like ``master``; None until the first backward.
    grads: torch.Tensor | None
    #: The GPU the group computes on.
    device: torch.device
    #: The transfer engine of ``device`` (``h2d``, ``d2h``).
    engine: Any

    def param_ranges(self) -> list[tuple[int, int]]:
        """``(offset, padded numel)`` of each parameter's shard in the flat buffers."""
        ...

    def write_back(self, master_on_device: torch.Tensor, start: int = 0) -> list:
        """Copy a stepped run of the master (elements ``start:``, as many as ``master_on_device``
        holds) back to host memory, with what the next copy-in reads; return the transfers, for the
        caller to synchronize."""
        ...


# Set on each parameter a group manages (parameters compare elementwise, so no dict keys).
_GROUP_ATTRIBUTE = "_torch_fsdp_offload_group"
# Weak both ways: a strong value would keep its key alive (the optimizer holds its groups), and
# with them every pinned buffer of a model the user dropped.
_optimizer_by_group: weakref.WeakKeyDictionary[OffloadedGroup, weakref.ref] = weakref.WeakKeyDictionary()


def register_offloaded_group(group: OffloadedGroup) -> None:
    """Called by the FSDP integration for every parameter group CoherentOffload manages."""
    for param in group.params:
        setattr(param, _GROUP_ATTRIBUTE, weakref.ref(group))
    global _plain_step_hook
    if _plain_step_hook is None:
        _plain_step_hook = register_optimizer_step_pre_hook(_warn_plain_optimizer)


# OffloadOptimizer and the optimizers it runs inside: they step offloaded groups where they should.
_internal: weakref.WeakSet = weakref.WeakSet()
# Optimizers already looked at by _warn_plain_optimizer.
_seen: weakref.WeakSet = weakref.WeakSet()
_plain_step_hook: Any = None
_warned = False
PLAIN_OPTIMIZER = (
    "{name} steps parameters that CoherentOffload keeps in host memory: each step runs on the "
    "training loop's thread after backward, as with stock CPU offload, and the GPU waits for it. "
    "Wrap the class instead, OffloadOptimizer(model, {name}, ...), to step each group off the "
    "critical path (torch.optim's contract is kept)."
)


def mark_internal(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` is OffloadOptimizer or one it runs: no plain-optimizer warning for it."""
    _internal.add(optimizer)


def _warn_plain_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Once per process: a plain torch.optim optimizer steps offloaded parameters."""
    global _warned
    if _warned or optimizer in _internal or optimizer in _seen:
        return
    _seen.add(optimizer)
    if any(offloaded_group(param) is not None for group in optimizer.param_groups for param in group["params"]):
        _warned = True
        warnings.warn(PLAIN_OPTIMIZER.format(name=type(optimizer).__name__), stacklevel=3)


def notify_grads_ready(group: OffloadedGroup, *, is_last_backward: bool) -> None:
    """Called by the FSDP integration once a group's gradient copy to the host was issued."""
    optimizer_ref = _optimizer_by_group.get(group)
    optimizer = optimizer_ref() if optimizer_ref is not None else None
    if optimizer is not None:
        optimizer._on_grads_ready(group, is_last_backward)


def attach_optimizer(group: OffloadedGroup, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` (an ``OffloadOptimizer``) the one :func:`notify_grads_ready` tells about
    ``group``."""
    _optimizer_by_group[group] = weakref.ref(optimizer)


def managed_group(param: nn.Parameter) -> OffloadedGroup | None:
    """The group built with ``CoherentOffload`` that holds ``param``, offloaded or not (the policy
    offloads nothing where the platform copies nothing); None if
    ``param`` was not sharded with the policy."""
    owner_ref = getattr(param, _GROUP_ATTRIBUTE, None)
    return owner_ref() if owner_ref is not None else None


def offloaded_group(param: nn.Parameter) -> OffloadedGroup | None:
    """The offloaded group that manages ``param``, None if none does."""
    owner = managed_group(param)
    return owner if owner is not None and owner.offloaded else None
