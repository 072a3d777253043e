"""The one record of which offloader offloads each module's activations (kept on the module), and who
made that offloader.

A module carries the hooks of at most one live offloader, as a model or as a block: a second would
offload what the module saves twice. Every front door (:func:`offload_activations`,
:class:`ActivationOffload` used directly, ``CoherentOffload(activations=...)``) checks and writes this
record through the same functions, before anything is hooked.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

__all__ = ["MadeBy", "check_can_hook", "forget_owner", "offloader_of", "record_owner"]


class MadeBy(enum.Enum):
    """How an offloader was made; its value names it in the refusal of a second one."""

    CALL = "offload_activations(...)"
    CLASS = "ActivationOffload.attach/register_blocks"
    POLICY = "fully_shard(..., offload_policy=CoherentOffload(activations=...))"


_KEEP_ONE = {
    MadeBy.CALL: "call .remove() on the object offload_activations returned first, or keep it and drop this call",
    MadeBy.CLASS: "call .remove() on that ActivationOffload first, or keep it and drop this call",
    MadeBy.POLICY: (
        "drop this call (the model's CoherentOffload(activations=...) offloads it already), or shard "
        "with activations=False and use offload_activations alone"
    ),
}

# On each module an offloader hooked: that offloader, weakly (the module does not keep it alive).
_OWNER_ATTRIBUTE = "_torch_fsdp_offload_activation_offloader"


def offloader_of(module: nn.Module) -> Any:
    """The live offloader whose hooks ``module`` carries (as a model or a block), or None."""
    ref = module.__dict__.get(_OWNER_ATTRIBUTE)
    return ref() if ref is not None else None


def check_can_hook(modules: Iterable[Any], offload: Any, caller: str) -> None:
    """Refuse, before any is hooked, entries that are not modules or whose activations an offloader
    other than ``offload`` already offloads.

    Args:
        modules (Iterable): the modules about to be hooked.
        offload: the offloader about to hook them, or None for one not made yet.
        caller (str): the call that refuses, as the message's first words.

    Raises:
        TypeError: an entry is not an ``nn.Module``.
        ValueError: naming the module, the offloader that has it and how to keep only one.

    Example::

        >>> check_can_hook([model, *model.blocks], None, "offload_activations")  # before sharding
    """
    modules = list(modules)
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"{caller} expects nn.Module instances, got {type(module).__name__}; pass the model "
                "and its blocks themselves (e.g. model.blocks)"
            )
    for module in modules:
        other = offloader_of(module)
        if other is None or other is offload:
            continue
        raise ValueError(
            f"{caller}: {type(module).__name__} already has its activations offloaded by "
            f"{other._made_by.value}; a second offloader on it would copy them twice. "
            f"Keep one: {_KEEP_ONE[other._made_by]}."
        )


def record_owner(module: nn.Module, offload: Any) -> None:
    """Note on ``module`` that ``offload``'s hooks are on it (checked with :func:`check_can_hook`)."""
    module.__dict__[_OWNER_ATTRIBUTE] = weakref.ref(offload)


def forget_owner(modules: Iterable[nn.Module], offload: Any) -> None:
    """Release ``modules``, those ``offload`` hooked (it removed its hooks)."""
    for module in modules:
        if offloader_of(module) is offload:
            del module.__dict__[_OWNER_ATTRIBUTE]
