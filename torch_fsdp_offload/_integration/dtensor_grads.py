"""Watching a gradient DTensor for in-place changes: the DTensor internals it takes, behind three
functions.

In-place foreach ops on a tensor subclass (``clip_grad_norm_``, ``clip_grad_value_`` and a gradient
scaler's ``unscale_`` use them) bump neither the DTensor's version counter nor its local tensor's,
so a version read alone misses them. :func:`watch_grad` re-classes a gradient to a DTensor subclass
whose dispatch bumps the version counter on every write to it; :func:`unwatch_grad` makes it a plain
DTensor again. Re-classing keeps the tensor itself (``param.grad is grad`` still holds) and reads
each op's schema (``OpOverload._schema``) to find the arguments it writes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["unwatch_grad", "unwatched_writes", "watch_grad"]

# Set while this thread runs ops whose writes to watched gradients are no change of them.
_unwatched = threading.local()


class _WatchedGrad(DTensor):
    """A gradient DTensor whose in-place changes bump its version counter."""

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if func._schema.is_mutable and not getattr(_unwatched, "active", False):
            kwargs = kwargs or {}
            for position, argument in enumerate(func._schema.arguments):
                if argument.is_write:
                    value = args[position] if position < len(args) else kwargs.get(argument.name)
                    for tensor in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(tensor, _WatchedGrad):
                            torch.autograd.graph.increment_version(tensor)
        return result


def watch_grad(grad: torch.Tensor | None) -> None:
    """From now on, every in-place change of ``grad`` (a plain DTensor; anything else is left as it
    is) bumps its version counter, foreach ops included."""
    if type(grad) is DTensor:
        grad.__class__ = _WatchedGrad


def unwatch_grad(grad: torch.Tensor | None) -> None:
    """Make a gradient :func:`watch_grad` watched a plain DTensor again (anything else: no-op)."""
    if type(grad) is _WatchedGrad:
        grad.__class__ = DTensor


@contextlib.contextmanager
def unwatched_writes() -> Iterator[None]:
    """Ops this thread runs inside do not count as changes of watched gradients (fused optimizer
    kernels declare the gradients they read as written)."""
    _unwatched.active = True
    try:
        yield
    finally:
        _unwatched.active = False
