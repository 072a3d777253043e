"""Reads of tensors whose optimizer step is still running: each read waits for the step first.

``OffloadOptimizer.step()`` may return while host steps still run (they finish under the next
forward, each group's copy-in waiting for its own step). Code that reads a parameter or its
optimizer state in between must see the stepped values, as after any ``torch.optim`` step.
:class:`PendingUpdate` re-classes those tensors to a subclass whose every op (torch function)
first waits for the step: FSDP2's DTensors (also ``to_local`` / ``full_tensor`` /
``redistribute``, which read the local tensor without one), and the plain tensors and parameters
of FSDP1's flat parameters and their state. The step's end gives them their own class back.
FSDP's own copy-in reads the local shards directly and waits for the group's step itself. See
Note: [Next-forward overlap] in docs/design.md.
"""

from __future__ import annotations

import contextlib
import concurrent.futures
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

__all__ = ["in_step", "PendingUpdate", "stepping"]

# Held on each guarded tensor: the PendingUpdate it waits for, and its own class.
_HOLDER = "_torch_fsdp_offload_pending_update"
_OWN_CLASS = "_torch_fsdp_offload_own_class"
# Set while this thread runs an optimizer step: its own reads of the tensors it steps must not wait.
_stepping = threading.local()


class _ReadWaits(DTensor):
    """A DTensor whose optimizer step may still run: every read waits for it first.

    It works at the torch-function level, which every release runs (some skip a DTensor
    subclass's ``__torch_dispatch__``). Metadata reads and setting the gradient (``zero_grad``)
    do not wait: they touch no bytes the step writes.
    """

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _call_after_steps(func, types, args, kwargs or {})

    def to_local(self, *args: Any, **kwargs: Any):
        _wait_for(self)
        return DTensor.to_local(self, *args, **kwargs)

    def full_tensor(self, *args: Any, **kwargs: Any):
        _wait_for(self)
        return DTensor.full_tensor(self, *args, **kwargs)

    def redistribute(self, *args: Any, **kwargs: Any):
        _wait_for(self)
        return DTensor.redistribute(self, *args, **kwargs)

    def __repr__(self, **kwargs: Any) -> str:
        _wait_for(self)
        return DTensor.__repr__(self, **kwargs)


class _WaitsBeforeReads:
    """Mixed into a plain tensor's or parameter's class (:func:`_guarded_class`): every op reading
    its values waits for the step first, as :class:`_ReadWaits` does for a DTensor."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _call_after_steps(func, types, args, kwargs or {})


def _call_after_steps(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` as the tensors' own classes run it, once the steps of the guarded tensors among its
    arguments have ended (unless it reads no values)."""
    if not _touches_no_values(func):
        for value in tree_leaves((args, kwargs)):
            if type(value) is _ReadWaits or isinstance(value, _WaitsBeforeReads):
                _wait_for(value)
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


# A guarded class per tensor class (torch.Tensor, nn.Parameter, FSDP1's FlatParameter), made once.
_guarded_classes: dict[type, type] = {}


def _guarded_class(tensor: Any) -> type | None:
    """The class that guards ``tensor``'s reads; None for a tensor whose class has its own
    ``__torch_function__`` (a subclass this module does not know), which is left as it is."""
    cls = type(tensor)
    if cls is DTensor:
        return _ReadWaits
    if cls is not torch.Tensor and not (
        isinstance(tensor, torch.nn.Parameter) and cls.__torch_function__ is torch._C._disabled_torch_function_impl
    ):
        return None
    if cls not in _guarded_classes:
        _guarded_classes[cls] = type(f"_ReadWaits{cls.__name__}", (_WaitsBeforeReads, cls), {"__slots__": ()})
    return _guarded_classes[cls]


# Tensor methods that read only metadata.
_METADATA_METHODS = frozenset(
    ("size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "element_size", "is_floating_point", "is_complex", "get_device", "__len__")
)


def _touches_no_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        # ``.data`` is the parameter's bytes, read or replaced; ``.grad`` and the rest are not.
        return attribute != "data"
    return name in _METADATA_METHODS


def in_step() -> bool:
    """Whether this thread runs an optimizer step (see :func:`stepping`)."""
    return getattr(_stepping, "active", False)


def _wait_for(tensor: DTensor) -> None:
    if in_step():
        return
    holder = tensor.__dict__.get(_HOLDER)
    if holder is None:  # released meanwhile
        return
    holder.result()


class PendingUpdate:
    """One group's optimizer step that may still run, and the DTensors it changes.

    Until :meth:`result` has returned, reading any of ``tensors`` waits for the step. It has the
    ``done()`` / ``result()`` of the step's future, so the group's copy-in waits on it like on
    the future.

    Args:
        future (concurrent.futures.Future): the step.
        tensors (Iterable): what it changes (the group's parameters and optimizer state); DTensors,
            plain tensors and parameters are guarded, the rest (other tensor subclasses, scalars)
            ignored.
    """

    def __init__(self, future: concurrent.futures.Future, tensors: Iterable[Any]) -> None:
        self._future = future
        # Weak: each tensor holds this object, which must not keep it alive.
        self._guarded: list[weakref.ref] = []
        for tensor in tensors:
            guarded = _guarded_class(tensor) if isinstance(tensor, torch.Tensor) else None
            if guarded is not None:
                tensor.__dict__[_OWN_CLASS] = type(tensor)
                tensor.__class__ = guarded
                tensor.__dict__[_HOLDER] = self
                self._guarded.append(weakref.ref(tensor))

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        """Wait for the step (re-raising its error); the tensors have their own class after."""
        try:
            return self._future.result()
        finally:
            self.release()

    def release(self) -> None:
        """Give the guarded tensors their own class back (the step ended, or was waited for)."""
        guarded, self._guarded = self._guarded, []
        for ref in guarded:
            tensor = ref()
            if tensor is None:
                continue
            own = tensor.__dict__.pop(_OWN_CLASS, None)
            if own is not None and type(tensor) is _guarded_class_of(own):
                tensor.__class__ = own
            tensor.__dict__.pop(_HOLDER, None)


def _guarded_class_of(own: type) -> type | None:
    return _ReadWaits if own is DTensor else _guarded_classes.get(own)


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """The optimizer step this thread runs inside reads and writes the tensors it changes itself:
    its reads of them do not wait, and its writes to watched gradients are no change of them."""
    previous = in_step()
    _stepping.active = True
    try:
        yield
    finally:
        _stepping.active = previous
