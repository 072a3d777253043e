"""Watching a gradient DTensor for in-place changes, and serving ``clip_grad_norm_`` from work done
as the gradient landed: the DTensor internals it takes, behind a few functions.

In-place foreach ops on a tensor subclass (``clip_grad_norm_``, ``clip_grad_value_`` and a gradient
scaler's ``unscale_`` use them) bump neither the DTensor's version counter nor its local tensor's,
so a version read alone misses them. :func:`watch_grad` re-classes a gradient to a DTensor subclass
whose ``__torch_function__`` bumps the version counter on every write to it (an in-place op's first
argument, or its ``out=``); :func:`unwatch_grad` makes it a plain DTensor again. Re-classing keeps
the tensor itself (``param.grad is grad`` still holds).

A watched gradient also takes the two ops of ``clip_grad_norm_`` off the caller's thread (see
Note: [Exact clipping at full overlap] in docs/design.md): ``_foreach_norm`` returns the norms
:func:`compute_norms` computed from the landed local shards (the same kernel on the same bytes,
so the same bits), wrapped as DTensor's own op would wrap them, and ``_foreach_mul_`` by a scalar
is recorded, to be applied by :func:`apply_scales` in the thread that steps the group, before
any other op reads the gradient. Both are held on the gradient itself, as attributes.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.utils._pytree import tree_leaves

from torch_fsdp_offload._helpers.tensors import local_tensor
from torch_fsdp_offload.optimizer.pending_updates import in_step

__all__ = [
    "apply_scales",
    "compute_norms",
    "expect_norms",
    "multiply",
    "multiply_grads",
    "NORM_READS",
    "take_scales",
    "unwatch_grad",
    "watch_grad",
]

# Held on the gradient itself: a watched gradient's _LandedNorm, and the scalars a gradient is still
# to be multiplied by, in order.
_NORM = "_torch_fsdp_offload_landed_norm"
_SCALES = "_torch_fsdp_offload_scales"
# Guards both attributes: the thread that steps a group takes its scales while the caller's records.
_lock = threading.Lock()
#: Norm reads of watched gradients: ``"served"`` from the landed norms, ``"computed"`` by the op
#: itself (the gradient changed since it landed, or its norm is not an entire 2-norm).
NORM_READS = {"served": 0, "computed": 0}

class _WatchedGrad(DTensor):
    """A gradient DTensor whose in-place changes bump its version counter.

    It works at the torch-function level, before DTensor's dispatch: some releases route every
    DTensor, subclasses included, through a native dispatch fast path that skips a subclass's
    ``__torch_dispatch__`` (pytorch issue 177716), while ``__torch_function__`` runs on all.
    """

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # metadata (the version, the device): nothing to wait for
            return _plain_call(func, types, args, kwargs)
        # clip_grad_norm_ takes the norms with the foreach op where the device has one, else one
        # tensor at a time, and scales the same way.
        if func in _FOREACH_NORM or func in _VECTOR_NORM:
            single = func in _VECTOR_NORM
            if single:
                norms = _landed_norms([args[0]]) if _whole_two_norm(*args, **kwargs) else None
            else:
                norms = _landed_norms(*args, **kwargs)
            NORM_READS["served" if norms is not None else "computed"] += 1
            if norms is not None:
                return norms[0] if single else norms
        elif func in _FOREACH_MUL and not kwargs and _defer_scale(*args):
            return None
        elif func in _MUL and not kwargs and _defer_scale([args[0]], args[1]):
            return args[0]
        for tensor in tree_leaves((args, kwargs)):
            if type(tensor) is _WatchedGrad:
                # Its norm may be computing in another thread: no op of this one beside it.
                with _lock:
                    entry = tensor.__dict__.get(_NORM)
                if entry is not None:
                    entry.ready.wait()
                apply_scales(tensor)
        result = _plain_call(func, types, args, kwargs)
        # An optimizer step's fused kernel writes in place beside the gradients it reads: no change.
        if not in_step():
            written = list(_tensors(args[0])) if args and _writes_first_argument(name) else []
            written += list(_tensors(kwargs.get("out")))
            for tensor in written:
                if type(tensor) is _WatchedGrad:
                    torch.autograd.graph.increment_version(tensor)
        return result


# Each op as a torch function and as its aten overload (both reach a subclass's torch function).
_FOREACH_NORM = (torch._foreach_norm, torch.ops.aten._foreach_norm.Scalar)
_VECTOR_NORM = (torch.linalg.vector_norm, torch.ops.aten.linalg_vector_norm.default)
_FOREACH_MUL = (torch._foreach_mul_, torch.ops.aten._foreach_mul_.Tensor)
_MUL = (torch.Tensor.mul_, torch.ops.aten.mul_.Tensor)


def _plain_call(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` as a plain DTensor runs it (no subclass's torch function inside)."""
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


def _tensors(value: Any) -> Iterable[Any]:
    return value if isinstance(value, (list, tuple)) else (value,)


# In-place dunders; every other in-place op is named with a trailing underscore.
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
) | {"__setitem__", "__set__"}


def _writes_first_argument(name: str) -> bool:
    """Whether a torch function so named writes its first argument (a tensor or, for a foreach
    op, a list): in-place ops and setters do; ``out=`` is read apart."""
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


class _LandedNorm:
    """A watched gradient's local 2-norm, computed in another thread: ``ready`` once it is (or
    failed: ``local`` None), with the gradient's versions it belongs to, and the local shard it is
    computed from until then."""

    __slots__ = ("local", "ready", "source", "versions")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.local: torch.Tensor | None = None
        self.source: torch.Tensor | None = None
        self.versions: tuple[int, int] | None = None

    def __reduce__(self) -> tuple:
        # A pickled gradient (torch.save) carries its attributes; the tensor loaded is another,
        # whose norm nobody computed: it holds None instead (and an event cannot be pickled).
        return type(None), ()


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
        entries = [tensor.__dict__.get(_NORM) for tensor in tensors]
    if any(entry is None for entry in entries):
        return None
    for entry in entries:
        entry.ready.wait()
    if any(entry.local is None or entry.versions != _versions(t) or _SCALES in t.__dict__ for entry, t in zip(entries, tensors)):
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
            tensor.__dict__.setdefault(_SCALES, []).append(scale)
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)
    return True


def expect_norms(grads: Iterable[torch.Tensor | None]) -> None:
    """The norms of these watched gradients will be computed (:func:`compute_norms`): until they
    are, ``_foreach_norm`` over them waits for them."""
    with _lock:
        for grad in grads:
            if type(grad) is _WatchedGrad:
                grad.__dict__[_NORM] = _LandedNorm()


def _local_norm(entry: _LandedNorm) -> None:
    # The task holds the entry, not the shard: once the norm ran, nothing of the pool's references
    # the gradient's memory (a dropped model's buffers are freed at once).
    source, entry.source = entry.source, None
    try:
        with torch.profiler.record_function("torch_fsdp_offload::grad_norm"):
            entry.local = torch.linalg.vector_norm(source, 2)
    finally:
        del source
        entry.ready.set()


def compute_norms(grads: Iterable[torch.Tensor | None], pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:
    """Start the 2-norm of each gradient's local shard that :func:`expect_norms` named, now that
    its bytes are final: each in a thread of ``pool`` (the same kernel on the same bytes as the
    caller's norm op, so the same bits); ``_foreach_norm`` over them waits for each. Returns the
    norms' futures: until each is done, its task holds the gradient's memory."""
    started = []
    for grad in grads:
        with _lock:
            entry = grad.__dict__.get(_NORM) if grad is not None else None
        if entry is None:
            continue
        entry.versions = _versions(grad)
        entry.source = grad._local_tensor
        try:
            started.append(pool.submit(_local_norm, entry))
        except RuntimeError:  # the interpreter is shutting down: no norm, the op computes it
            entry.source = None
            entry.ready.set()
    return started


def take_scales(grad: torch.Tensor | None) -> list[torch.Tensor]:
    """The scalars a deferred ``_foreach_mul_`` recorded for ``grad``, in order, each on the
    gradient's device, now taken: the caller multiplies by them (or a copy it steps with).

    A host scalar of exactly 1 is left out: ``clip_grad_norm_`` multiplies by a coefficient clamped
    to 1 whenever the norm is within its bound, and a multiply by 1 returns every value bit for bit,
    so skipping it spares the host a read and a write of the whole gradient."""
    if grad is None:
        return []
    with _lock:
        scales = grad.__dict__.pop(_SCALES, None)
    device = local_tensor(grad).device
    return [scale.to(device) for scale in scales or () if not _is_host_one(scale)]


def _is_host_one(scale: torch.Tensor) -> bool:
    # Read only on the host: reading a device scalar would wait for the device.
    return scale.device.type == "cpu" and bool(scale == 1)


def apply_scales(grad: torch.Tensor | None) -> None:
    """Multiply ``grad`` by the scalars a deferred ``_foreach_mul_`` recorded, in order (in the
    caller's thread, on the local shard)."""
    if grad is not None:
        multiply(local_tensor(grad), take_scales(grad))


def multiply(tensor: torch.Tensor, scales: list[torch.Tensor]) -> None:
    """Multiply ``tensor`` in place by ``scales`` in order, as ``clip_grad_norm_``'s
    ``_foreach_mul_`` would (the same kernel, so the same bits)."""
    for scale in scales:
        torch._foreach_mul_([tensor], scale)


def multiply_grads(grads: list[torch.Tensor | None], scales: list[list[torch.Tensor]], flat: torch.Tensor | None) -> None:
    """Multiply each gradient's local shard by its ``scales`` (taken by :func:`take_scales`), in
    order. Where every gradient is there, has the same scales and lies in ``flat`` (its group's
    host buffer), ``flat`` is multiplied once instead.

    ``clip_grad_norm_`` gives every gradient the same coefficient tensor. One multiply is the same
    bits per element, and one parallel region of the host's threads instead of one per parameter.
    Each region waits for its slowest thread, and beside the training thread, the copy engine and
    the streamed steps one of the 15 is often descheduled. On the H200 host the clipped host step of
    a 3B model took 0.95 s against 0.76 unclipped scaling per parameter, and 0.85 against 0.72
    scaling per group (docs/benchmarks.md, "Clipping"). Padding between shards holds the
    reduce-scatter's zeros, which stay zeros.
    """
    if not any(scales):
        return
    first = scales[0]
    if flat is not None and all(
        grad is not None and len(factors) == len(first) and all(a is b for a, b in zip(factors, first))
        and _inside(local_tensor(grad), flat)
        for grad, factors in zip(grads, scales)
    ):
        multiply(flat, first)
        return
    for grad, factors in zip(grads, scales):
        if factors:
            multiply(local_tensor(grad), factors)


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    return tensor.dtype == flat.dtype and start <= tensor.data_ptr() and (
        tensor.data_ptr() + tensor.numel() * tensor.element_size() <= end)


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
            grad.__dict__.pop(_NORM, None)
