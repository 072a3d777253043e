"""What the optimizer needs of an offloaded parameter group, and how the FSDP integration hands its
groups over.

The integration implements the two protocols below for every group ``CoherentOffload`` manages,
calls :func:`register_offloaded_group` once per group and :func:`notify_grads_ready` each time the
group's gradient copy to the host was issued. This module imports nothing of the optimizer's, so
the integration can import it without pulling the optimizer in.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from typing import Any, Protocol

import torch
import torch.nn as nn

__all__ = [
    "OffloadedGroup",
    "StreamedGroup",
    "attach_optimizer",
    "managed_group",
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
    #: The ``OffloadOptimizer`` that steps the group, told when its gradients land: a weak reference
    #: (the optimizer holds its groups, and a dropped one must not live on), set by
    #: :func:`attach_optimizer`; None until an optimizer steps the group.
    optimizer_ref: weakref.ref | None
    #: The group's ``ResolvedPlan``: its ``optimizer_gpu_fraction`` picks the streamed groups.
    plan: Any
    #: Whether the optimizer may re-class the group's parameters, gradients and state to
    #: subclasses (read guards, watched gradients): False where FSDP2's offload hooks keep them plain.
    reclasses_user_tensors: bool

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


def register_offloaded_group(group: OffloadedGroup) -> None:
    """Called by the FSDP integration for every parameter group CoherentOffload manages."""
    for param in group.params:
        setattr(param, _GROUP_ATTRIBUTE, weakref.ref(group))


def notify_grads_ready(group: OffloadedGroup, *, is_last_backward: bool) -> None:
    """Called by the FSDP integration once a group's gradient copy to the host was issued."""
    optimizer = group.optimizer_ref() if group.optimizer_ref is not None else None
    if optimizer is not None:
        optimizer._on_grads_ready(group, is_last_backward)


def attach_optimizer(group: OffloadedGroup, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` (an ``OffloadOptimizer``) the one :func:`notify_grads_ready` tells about
    ``group``."""
    group.optimizer_ref = weakref.ref(optimizer)


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
