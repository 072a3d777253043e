"""Private tensor, autograd and allocator internals the library reads, each behind one function,
and torch's pytree utilities (``torch.utils._pytree``) as ``pytree``."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "current_graph_task_id",
    "disable_torch_function_subclass",
    "foreach_add_",
    "foreach_copy_",
    "host_empty_cache",
    "in_backward",
    "local_tensor",
    "make_subclass",
    "parse_to_device",
    "pytree",
    "tensor_str",
    "unversioned_alias",
    "version_counter",
]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard a DTensor wraps (the tensor itself for a plain tensor), aliasing its storage:
    writes through it change the DTensor. ``DTensor.to_local()`` would be the public spelling, but
    under autograd it returns a new view whose in-place changes autograd tracks separately."""
    return getattr(tensor, "_local_tensor", tensor)


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's version counter: bumped by every in-place change that goes through autograd's
    in-place handling (including under ``torch.no_grad()``)."""
    return tensor._version


def unversioned_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory with a version counter of its own (not a view): writes
    through it do not count as changes of ``tensor`` (:func:`version_counter`), for writes that
    complete a value still on its way rather than change it."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def current_graph_task_id() -> int:
    """An id of the backward pass running on this thread, or -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether this thread is inside an autograd backward pass."""
    return current_graph_task_id() != -1


def disable_torch_function_subclass() -> Any:
    """A context manager in which a tensor subclass's ``__torch_function__`` is not consulted, so its
    methods act on it as on a plain tensor."""
    return torch._C.DisableTorchFunctionSubclass()


def parse_to_device(*args: Any, **kwargs: Any) -> torch.device | None:
    """The target device of ``Tensor.to(*args, **kwargs)``, parsed the way ``Tensor.to`` parses it."""
    return torch._C._nn._parse_to(*args, **kwargs)[0]


def host_empty_cache() -> None:
    """Give the blocks cached by torch's pinned-host allocator back to the system, where this torch
    release exposes it; a no-op elsewhere."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def make_subclass(cls: type, data: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """An instance of the tensor subclass ``cls`` sharing ``data``'s storage (how torch's own
    subclasses such as ``nn.Parameter`` are built)."""
    return torch.Tensor._make_subclass(cls, data, requires_grad)


def tensor_str(tensor: torch.Tensor, tensor_contents: Any = None) -> str:
    """``repr(tensor)`` as torch formats it, for a subclass's ``__repr__``."""
    return torch._tensor_str._str(tensor, tensor_contents=tensor_contents)


def foreach_add_(totals: list[torch.Tensor], addends: list[torch.Tensor]) -> None:
    """``total.add_(addend)`` for each pair, in one multi-tensor kernel where the device has one."""
    torch._foreach_add_(totals, addends)


def foreach_copy_(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``destination.copy_(source)`` for each pair, in one multi-tensor kernel where the device has one."""
    torch._foreach_copy_(destinations, sources)
