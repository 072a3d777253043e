"""Watching a gradient DTensor for in-place changes, and serving ``clip_grad_norm_`` from work done
as the gradient landed: the DTensor internals it takes, behind a few functions.

In-place foreach ops on a tensor subclass (``clip_grad_norm_``, ``clip_grad_value_`` and a gradient
scaler's ``unscale_`` use them) bump neither the DTensor's version counter nor its local tensor's,
so a version read alone misses them. :func:`watch_grad` re-classes a gradient to a DTensor subclass
whose dispatch bumps the version counter on every write to it; :func:`unwatch_grad` makes it a plain
DTensor again. Re-classing keeps the tensor itself (``param.grad is grad`` still holds) and reads
each op's schema (``OpOverload._schema``) to find the arguments it writes.

A watched gradient also takes the two ops of ``clip_grad_norm_`` off the caller's thread (see
Note: [Exact clipping at full overlap] in docs/design.md): ``_foreach_norm`` returns the norms
:func:`compute_norms` computed from the landed local shards (the same kernel on the same bytes,
so the same bits), wrapped as DTensor's own op would wrap them, and ``_foreach_mul_`` by a scalar
is recorded, to be applied by :func:`apply_scales` in the thread that steps the group, before
any other op reads the gradient.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.utils.weak import WeakIdKeyDictionary

from torch_fsdp_offload._integration.pending_updates import in_step

__all__ = [
    "apply_scales",
    "compute_norms",
    "expect_norms",
    "NORM_READS",
    "subclass_dispatch_works",
    "unwatch_grad",
    "watch_grad",
]

# Watched gradient -> its _LandedNorm.
_norms: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Gradient -> the scalars it is still to be multiplied by, in order.
_scales: WeakIdKeyDictionary = WeakIdKeyDictionary()
_lock = threading.Lock()
#: Norm reads of watched gradients: ``"served"`` from the landed norms, ``"computed"`` by the op
#: itself (the gradient changed since it landed, or its norm is not an entire 2-norm).
NORM_READS = {"served": 0, "computed": 0}

_aten = torch.ops.aten


class _WatchedGrad(DTensor):
    """A gradient DTensor whose in-place changes bump its version counter."""

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # clip_grad_norm_ runs the foreach ops on DTensors, and the per-tensor ones on this
        # subclass (torch's foreach support lists DTensor by type).
        if func is _aten._foreach_norm.Scalar or func is _aten.linalg_vector_norm.default:
            single = func is _aten.linalg_vector_norm.default
            if single:
                norms = _landed_norms([args[0]]) if _whole_two_norm(*args, **kwargs) else None
            else:
                norms = _landed_norms(*args, **kwargs)
            NORM_READS["served" if norms is not None else "computed"] += 1
            if norms is not None:
                return norms[0] if single else norms
        elif func is _aten._foreach_mul_.Tensor and _defer_scale(*args, **kwargs):
            return None
        elif func is _aten.mul_.Tensor and not kwargs and _defer_scale([args[0]], args[1]):
            return args[0]
        for value in args:
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, DTensor):
                    # Its norm may be computing in another thread: no op of this one beside it.
                    with _lock:
                        entry = _norms.get(tensor)
                    if entry is not None:
                        entry.ready.wait()
                    apply_scales(tensor)
        result = super().__torch_dispatch__(func, types, args, kwargs)
        # An optimizer step's fused kernel declares the gradients it reads as written: no change.
        if func._schema.is_mutable and not in_step():
            for position, argument in enumerate(func._schema.arguments):
                if argument.is_write:
                    value = args[position] if position < len(args) else kwargs.get(argument.name)
                    for tensor in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(tensor, _WatchedGrad):
                            torch.autograd.graph.increment_version(tensor)
        return result


class _LandedNorm:
    """A watched gradient's local 2-norm, computed in another thread: ``ready`` once it is (or
    failed: ``local`` None), with the gradient's versions it belongs to."""

    __slots__ = ("local", "ready", "versions")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.local: torch.Tensor | None = None
        self.versions: tuple[int, int] | None = None


def _versions(grad: DTensor) -> tuple[int, int]:
    return grad._version, grad._local_tensor._version


def _norm_placement(placement: Any) -> Any:
    """The placement of a full 2-norm of a tensor placed so, as DTensor's reduction gives it."""
    if isinstance(placement, Shard):
        return _NormPartial(2)
    if isinstance(placement, Replicate):
        return placement
    return None


def _whole_two_norm(self: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> bool:
    """Whether ``linalg_vector_norm``'s arguments (defaults spelt out or not) ask for the 2-norm of
    the whole tensor."""
    return ord == 2 and dim in (None, [], ()) and not keepdim and dtype is None


def _landed_norms(tensors: list, ord: Any = 2, dtype: Any = None) -> list[DTensor] | None:
    """``_foreach_norm(tensors, 2)`` from the norms computed as they landed; None where any of them
    has none current (the op then runs)."""
    if ord != 2 or dtype is not None:
        return None
    with _lock:
        entries = [_norms.get(tensor) for tensor in tensors]
    if any(entry is None for entry in entries):
        return None
    for entry in entries:
        entry.ready.wait()
    if any(entry.local is None or entry.versions != _versions(t) or t in _scales for entry, t in zip(entries, tensors)):
        return None
    norms = []
    for entry, tensor in zip(entries, tensors):
        local = entry.local
        placements = [_norm_placement(p) for p in tensor.placements]
        if any(p is None for p in placements):
            return None
        norms.append(DTensor.from_local(local, tensor.device_mesh, placements, run_check=False, shape=torch.Size(), stride=()))
    return norms


def _defer_scale(tensors: list, other: Any) -> bool:
    """Record ``_foreach_mul_(tensors, other)`` of watched gradients by a scalar for later."""
    if not all(type(t) is _WatchedGrad for t in tensors) or not isinstance(other, torch.Tensor) or other.numel() != 1:
        return False
    scale = other._local_tensor if isinstance(other, DTensor) else other
    if isinstance(other, DTensor) and not all(isinstance(p, Replicate) for p in other.placements):
        return False
    with _lock:
        for tensor in tensors:
            _scales.setdefault(tensor, []).append(scale)
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)
    return True


def expect_norms(grads: Iterable[torch.Tensor | None]) -> None:
    """The norms of these watched gradients will be computed (:func:`compute_norms`): until they
    are, ``_foreach_norm`` over them waits for them."""
    with _lock:
        for grad in grads:
            if type(grad) is _WatchedGrad:
                _norms[grad] = _LandedNorm()


class _DispatchProbe(DTensor):
    """Records that its ``__torch_dispatch__`` ran."""

    __slots__ = ()
    seen = False

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _DispatchProbe.seen = True
        return super().__torch_dispatch__(func, types, args, kwargs)


_dispatch_works: bool | None = None


def subclass_dispatch_works(like: DTensor) -> bool:
    """Whether this torch runs a DTensor subclass's ``__torch_dispatch__`` (checked once, on a tiny
    DTensor on ``like``'s mesh). Some releases route every DTensor, subclasses included, through a
    native fast path that skips it; then no op on a watched gradient or a guarded parameter is
    seen (their ``to_local``, ``full_tensor`` and ``redistribute`` still are)."""
    global _dispatch_works
    if _dispatch_works is None:
        mesh = like.device_mesh
        probe = DTensor.from_local(
            torch.zeros(1, device=like._local_tensor.device), mesh, [Replicate()] * mesh.ndim, run_check=False
        )
        probe.__class__ = _DispatchProbe
        _DispatchProbe.seen = False
        probe.add_(0)
        _dispatch_works = _DispatchProbe.seen
    return _dispatch_works


def compute_norms(grads: Iterable[torch.Tensor | None]) -> None:
    """Compute the 2-norm of each gradient's local shard that :func:`expect_norms` named, now (in
    the caller's thread, with the GIL released inside the kernel), once its bytes are final."""
    for grad in grads:
        with _lock:
            entry = _norms.get(grad) if grad is not None else None
        if entry is None:
            continue
        try:
            entry.versions = _versions(grad)
            entry.local = torch.linalg.vector_norm(grad._local_tensor, 2)
        finally:
            entry.ready.set()


def apply_scales(grad: torch.Tensor | None) -> None:
    """Multiply ``grad`` by the scalars a deferred ``_foreach_mul_`` recorded, in order (in the
    caller's thread, on the local shard)."""
    if grad is None:
        return
    with _lock:
        scales = _scales.pop(grad, None)
    if scales:
        local = grad._local_tensor
        for scale in scales:
            torch._foreach_mul_([local], scale.to(local.device))


def watch_grad(grad: torch.Tensor | None) -> None:
    """From now on, every in-place change of ``grad`` (a plain DTensor; anything else is left as it
    is) bumps its version counter, foreach ops included."""
    if type(grad) is DTensor:
        grad.__class__ = _WatchedGrad


def unwatch_grad(grad: torch.Tensor | None) -> None:
    """Make a gradient :func:`watch_grad` watched a plain DTensor again (anything else: no-op); a
    scale still to apply stays recorded for :func:`apply_scales`."""
    if type(grad) is _WatchedGrad:
        grad.__class__ = DTensor
        with _lock:
            _norms.pop(grad, None)
