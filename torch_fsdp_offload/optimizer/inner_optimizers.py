"""The wrapped optimizer class, run once per offloaded parameter group: ``OffloadOptimizer``'s inner
optimizers."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn

from torch_fsdp_offload._helpers.tensors import local_tensor
from torch_fsdp_offload.optimizer.groups import OffloadedGroup, offloaded_group
from torch_fsdp_offload.optimizer.hyperparameters import copy_hyperparameters, GroupPairs, hyperparameters_changed

__all__ = ["InnerOptimizers"]


class InnerOptimizers:
    """One optimizer of the wrapped class per offloaded group, and one (key None) for the parameters
    no group offloads, each over its parameters as the wrapper's parameter groups split them. All
    share the wrapper's state, keyed by parameter as the wrapped class keeps it.

    Args:
        optimizer_class (type): the wrapped ``torch.optim.Optimizer`` class.
        optimizer_kwargs (dict): its keyword arguments (validated by the wrapper).

    Example::

        >>> inner = InnerOptimizers(torch.optim.AdamW, {"lr": 1e-4})
        >>> offloaded = inner.build(optim.param_groups, optim.state)
        >>> inner.take_hyperparameters(offloaded[0])  # lr set by a scheduler, ...
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any]) -> None:
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        #: The state every inner optimizer shares: the wrapper's (set by :meth:`build`).
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        # key: an offloaded group, or None; value: its optimizer and (inner group, outer group)
        # pairs. None until built, and again once a parameter group was added.
        self._by_group: dict[OffloadedGroup | None, tuple[torch.optim.Optimizer, GroupPairs]] | None = None

    @property
    def built(self) -> bool:
        """Whether the inner optimizers match the wrapper's parameter groups."""
        return self._by_group is not None

    def build(self, param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> list[OffloadedGroup]:
        """Split ``param_groups`` (the wrapper's) by offloaded group into inner optimizers sharing
        ``state``; return the offloaded groups."""
        owners: dict[OffloadedGroup | None, dict[int, list[nn.Parameter]]] = {}
        for index, group in enumerate(param_groups):
            for param in group["params"]:
                owners.setdefault(offloaded_group(param), {}).setdefault(index, []).append(param)
        self._by_group = {}
        for owner, by_outer in owners.items():
            inner = self.make([{**param_groups[index], "params": params} for index, params in by_outer.items()])
            inner.state = state
            self._by_group[owner] = (inner, list(zip(inner.param_groups, (param_groups[i] for i in by_outer))))
        self.state = state
        return self.offloaded_groups()

    def forget(self) -> None:
        """The wrapper's parameter groups changed: rebuild before the next step."""
        self._by_group = None

    def use_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Share ``state`` (the wrapper's, loaded anew) from now on."""
        self.state = state
        for inner, _ in (self._by_group or {}).values():
            inner.state = state

    def make(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The wrapped class over ``param_groups``, with the wrapper's arguments, and no state: what
        a class creates at construction (Adagrad's sums) the wrapper took once
        (:meth:`initial_state`), and state made here over placeholders would be stepped as theirs."""
        optimizer = self.optimizer_class(param_groups, **self.optimizer_kwargs)
        optimizer.state = defaultdict(dict)
        return optimizer

    def initial_state(self, param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, dict[str, Any]]:
        """The state the wrapped class creates at construction over ``param_groups`` (the wrapper's):
        Adagrad's, for every parameter; most classes create theirs at the first step, and have none."""
        return dict(self.optimizer_class([dict(group) for group in param_groups], **self.optimizer_kwargs).state)

    def owners(self) -> list[OffloadedGroup | None]:
        """What each inner optimizer steps: an offloaded group, or None for the parameters no group
        offloads (if any), in the order their parameters first appear."""
        return list(self._by_group)

    def offloaded_groups(self) -> list[OffloadedGroup]:
        """The offloaded groups, in the order their parameters first appear."""
        return [owner for owner in self._by_group if owner is not None]

    def optimizer(self, owner: OffloadedGroup | None) -> torch.optim.Optimizer:
        """The inner optimizer of ``owner`` (None: of the parameters no group offloads)."""
        return self._by_group[owner][0]

    def numel(self, owner: OffloadedGroup | None) -> int:
        """This rank's parameter elements ``owner``'s inner optimizer steps."""
        inner = self.optimizer(owner)
        return sum(local_tensor(param).numel() for group in inner.param_groups for param in group["params"])

    def take_hyperparameters(self, owner: OffloadedGroup | None) -> None:
        """``owner``'s inner optimizer takes the wrapper's hyperparameters (lr set by a scheduler,
        ...) as they are now."""
        copy_hyperparameters(self._by_group[owner][1])

    def hyperparameters_changed(self, owner: OffloadedGroup) -> bool:
        """Whether the wrapper's hyperparameters differ from those ``owner`` last stepped with."""
        return hyperparameters_changed(self._by_group[owner][1])

    def step_resident(self) -> None:
        """Step the parameters no group offloads (if any) with the wrapped class, here."""
        if None in self._by_group:
            self.take_hyperparameters(None)
            self.optimizer(None).step()
