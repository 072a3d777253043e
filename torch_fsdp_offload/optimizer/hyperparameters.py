"""Hyperparameters flowing from ``OffloadOptimizer``'s parameter groups to its inner optimizers'."""

from __future__ import annotations

import torch

__all__ = ["copy_hyperparameters", "GroupPairs", "hyperparameters_changed"]

# (inner group, outer group) pairs: the inner optimizer's group and the user-visible group it
# takes its hyperparameters from.
GroupPairs = list[tuple[dict, dict]]


def hyperparameters_changed(pairs: GroupPairs) -> bool:
    """Whether an outer group's hyperparameters differ from what its inner group last used."""
    for inner_group, outer_group in pairs:
        for key, value in outer_group.items():
            if key == "params":
                continue
            used = inner_group.get(key)
            if isinstance(value, torch.Tensor) or isinstance(used, torch.Tensor):
                if not (isinstance(value, torch.Tensor) and isinstance(used, torch.Tensor) and torch.equal(value, used)):
                    return True
            elif used != value:
                return True
    return False


def copy_hyperparameters(pairs: GroupPairs) -> None:
    """Hyperparameters (lr set by a scheduler, ...) flow from the outer groups to the inners;
    tensors are copied, so a step taken later still sees the values of this moment."""
    for inner_group, outer_group in pairs:
        for key, value in outer_group.items():
            if key != "params":
                inner_group[key] = value.clone() if isinstance(value, torch.Tensor) else value
