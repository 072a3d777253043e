"""Learned overlap: when an offloaded group may step during backward, and the checks ``step()``
makes of the groups that did.

A group that steps during backward steps with its gradients as they landed. That equals the step
``step()`` would take only if the group received exactly one gradient in the step and nothing
changed it between its landing and ``step()``. So overlap is learned, never assumed: the optimizer
starts in :attr:`OverlapState.LEARNING`, where every group steps in ``step()`` while the landings
are watched, and moves to :attr:`OverlapState.ON` after a step whose gradients arrived in that
pattern. From then on, a step whose pattern differs is refused.
"""

from __future__ import annotations

import enum
from collections import defaultdict

import torch

from torch_fsdp_offload.optimizer.dtensor_grads import unwatch_grad, watch_grad
from torch_fsdp_offload._helpers.tensors import local_tensor, version_counter
from torch_fsdp_offload.optimizer.groups import OffloadedGroup

__all__ = [
    "CHANGED_AFTER_STEP",
    "HYPERPARAMETERS_CHANGED",
    "LearnedOverlap",
    "OverlapState",
    "SECOND_GRADIENT",
]

# Each landed gradient, with its own version and its local tensor's.
_Landed = list[tuple[torch.Tensor | None, int, int]]

SECOND_GRADIENT = (
    "OffloadOptimizer(step_during_backward=True): a parameter group received a second gradient "
    "before step(), after it had already stepped during backward with its first, so this step() "
    "is refused: it steps nothing more (the groups that stepped during backward keep that step). "
    "Call zero_grad() and train on; the next step is exact. To accumulate gradients over "
    "micro-batches, call model.set_requires_gradient_sync(False) (or set_is_last_backward(False)) "
    "on all but the last, or keep step_during_backward=False, the default."
)
HYPERPARAMETERS_CHANGED = (
    "OffloadOptimizer: learning rate or another hyperparameter changed between "
    "backward and step(), after some groups had already stepped during backward with "
    "the old values. Change hyperparameters before backward (or after step(), as LR "
    "schedulers do), or keep OffloadOptimizer(..., step_during_backward=False), the default."
)
CHANGED_AFTER_STEP = (
    "OffloadOptimizer: gradients changed after some parameter groups had already "
    "stepped during backward (an in-place change such as clip_grad_norm_, "
    "clip_grad_value_ or a gradient scaler's unscale_, or a new .grad tensor): those "
    "groups stepped with the gradients as they landed, and this step() steps no other. "
    "To clip, pass OffloadOptimizer(..., max_grad_norm=...), applied before any group "
    "steps, instead of calling clip_grad_norm_; for any change of the gradients between "
    "backward and step(), keep OffloadOptimizer(..., step_during_backward=False), the "
    "default, under which every such change is exact."
)


class OverlapState(enum.Enum):
    """Whether offloaded groups may step during backward."""

    #: Every group steps in ``step()``; how gradients arrive is watched.
    LEARNING = enum.auto()
    #: A group whose gradients landed in the last backward steps right away.
    ON = enum.auto()


class LearnedOverlap:
    """The overlap state and what one step's gradient landings looked like.

    Between two ``step()`` calls it counts each group's landings and keeps its gradients as they
    landed, with ``watch_grads`` watched for in-place changes (:func:`watch_grad`); :meth:`end_cycle`
    forgets them. Unwatched (FSDP2's offload hooks keep gradients plain), only a new ``.grad`` tensor
    or an in-place change that bumps a version counter is seen: the optimizer then refuses to step
    during backward.
    """

    def __init__(self, watch_grads: bool = True) -> None:
        self.state = OverlapState.LEARNING
        self.watch_grads = watch_grads
        self._landings: defaultdict[OffloadedGroup, int] = defaultdict(int)
        self._landed_grads: dict[OffloadedGroup, _Landed] = {}

    def on_landing(self, owner: OffloadedGroup) -> None:
        """``owner``'s gradients landed: count it, and watch them from now on."""
        self._landings[owner] += 1
        landed = []
        for param in owner.params:
            grad = param.grad
            if self.watch_grads:
                watch_grad(grad)
            landed.append((grad, *_grad_versions(grad)))
        self._landed_grads[owner] = landed

    def received_twice(self) -> bool:
        """Whether a group received gradients more than once in this step."""
        return any(landings > 1 for landings in self._landings.values())

    def pattern_is_safe(self, clipping: bool) -> bool:
        """Whether this step's gradients arrived in the pattern that makes overlap safe: every
        group that received gradients received them once, and they are unchanged since. Never
        with ``clipping`` (the clip changes every gradient after it landed)."""
        if clipping or not self._landings:
            return False
        for owner, landings in self._landings.items():
            if landings != 1 or not _grads_unchanged(owner, self._landed_grads[owner]):
                return False
        return True

    def end_cycle(self, learned_safe: bool = False) -> None:
        """A step ended (or was refused): forget its landings; with ``learned_safe``, overlap turns
        on."""
        if learned_safe and self.state is OverlapState.LEARNING:
            self._transition(OverlapState.ON)
        self._landings.clear()
        for landed in self._landed_grads.values():
            for grad, _, _ in landed:
                unwatch_grad(grad)
        self._landed_grads.clear()

    def _transition(self, new: OverlapState) -> None:
        allowed = {OverlapState.LEARNING: {OverlapState.ON}, OverlapState.ON: set()}
        assert new in allowed[self.state], f"overlap cannot go from {self.state} to {new}"
        self.state = new


def _grad_versions(grad: torch.Tensor | None) -> tuple[int, int]:
    """The versions of ``grad`` and of its local tensor (an in-place change of the local tensor
    alone bumps only the latter)."""
    return (-1, -1) if grad is None else (version_counter(grad), version_counter(local_tensor(grad)))


def _grads_unchanged(owner: OffloadedGroup, landed: _Landed) -> bool:
    """Whether ``owner``'s gradients are the tensors that landed, unchanged in place since."""
    return all(
        param.grad is grad and _grad_versions(grad) == (version, local_version)
        for param, (grad, version, local_version) in zip(owner.params, landed)
    )
