"""The groups' steps that run on after ``step()`` returned (``OffloadOptimizer(overlap_next_forward=
True)``), and the ``zero_grad()`` calls that wait for them."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Iterable

import torch
import torch.nn as nn

from torch_fsdp_offload.optimizer.groups import OffloadedGroup
from torch_fsdp_offload.optimizer.pending_updates import PendingUpdate

__all__ = ["changed_by_step", "FinishingSteps", "zero_grads"]


class FinishingSteps:
    """The steps of the last ``step()`` that may still run, one per group.

    ``step()`` hands each over as the group's :class:`PendingUpdate`: the group's next copy-in, and
    every read of what the step changes, waits for it. A ``zero_grad()`` that comes while a group
    still steps is done by the step's thread once the step ends (its writes would otherwise wait for
    the step they run beside).

    Example::

        >>> finishing = FinishingSteps()
        >>> finishing.started([group])
        >>> finishing.hand_over({group: future}, {group: changed_by_step(group, optim.state)})
        >>> finishing.wait()  # every step ended; re-raises a step's error
    """

    def __init__(self) -> None:
        #: The steps handed over by the last ``step()``, by group, until :meth:`wait` waited for them.
        self.pending: dict[OffloadedGroup, PendingUpdate] = {}
        self._lock = threading.Lock()
        # Groups whose step ended since it was started, and the zero_grad() calls deferred until a
        # group's step ends (value: set_to_none); under _lock, as the steps' threads change them.
        self._ended: set[OffloadedGroup] = set()
        self._zero_after: dict[OffloadedGroup, bool] = {}

    def started(self, owners: Iterable[OffloadedGroup]) -> None:
        """The steps of ``owners`` are about to be queued."""
        with self._lock:
            self._ended.difference_update(owners)

    def ended(self, owner: OffloadedGroup) -> None:
        """``owner``'s step ended; called by the thread that ran it, inside the step (its zero_grad
        writes then wait for nothing)."""
        with self._lock:
            set_to_none = self._zero_after.pop(owner, None)
            self._ended.add(owner)
        if set_to_none is not None:
            # zero_grad() came while this group was stepping.
            zero_grads(owner.params, set_to_none)

    def hand_over(
        self, futures: dict[OffloadedGroup, concurrent.futures.Future], guarded: dict[OffloadedGroup, list[torch.Tensor]]
    ) -> None:
        """``step()`` returns while the steps of ``futures`` run: each group's next copy-in waits for
        its own, and so does every read of ``guarded[group]`` (what the step changes)."""
        for owner, future in futures.items():
            owner.update_pending = PendingUpdate(future, guarded[owner])
        self.pending = {owner: owner.update_pending for owner in futures}

    def running(self) -> list[OffloadedGroup]:
        """The groups whose handed-over step has not ended yet."""
        return [owner for owner, pending in self.pending.items() if not pending.done()]

    def wait(self) -> None:
        """Wait for every handed-over step, re-raising an error one raised."""
        pending, self.pending = self.pending, {}
        for owner, update in pending.items():
            update.result()
            owner.update_pending = None

    def defer_zero_grad(self, set_to_none: bool) -> set[OffloadedGroup]:
        """``zero_grad()`` came: return the groups still stepping, whose step's thread zeroes their
        gradients once the step ends; the caller zeroes the others."""
        deferred = set()
        with self._lock:
            for owner in self.pending:
                if owner not in self._ended:
                    self._zero_after[owner] = set_to_none
                    deferred.add(owner)
        return deferred

    def zero_grad_came(self, owner: OffloadedGroup) -> bool:
        """Whether a ``zero_grad()`` waits for ``owner``'s step to end: nobody reads its gradients."""
        with self._lock:
            return owner in self._zero_after


def changed_by_step(owner: OffloadedGroup, state: dict[torch.Tensor, dict[str, Any]]) -> list[torch.Tensor]:
    """What ``owner``'s step changes: its parameters, their optimizer state (in ``state``), and their
    gradients (a clip recorded for the step to apply)."""
    values = [value for param in owner.params for value in state.get(param, {}).values()]
    grads = [param.grad for param in owner.params if param.grad is not None]
    return [*owner.params, *values, *grads]


def zero_grads(params: Iterable[nn.Parameter], set_to_none: bool) -> None:
    """``zero_grad`` of ``params``, as ``torch.optim.Optimizer.zero_grad`` does it."""
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()
