"""FSDP1's ``FlatParamHandle`` and ``_runtime_utils`` as the FSDP1 front door patches them.

The front door (:class:`torch_fsdp_offload.FullyShardedDataParallel`) changes only where a handle's
shard lives and how its bytes cross the link. Each replacement below delegates to FSDP1's own
function for a handle that carries no :class:`HandleOffload`, so FSDP1 models built without an
offload policy run unchanged. See Note: [FSDP1 patch points] in docs/design.md:

* ``FlatParamHandle.init_flat_param_attributes``: the host shard and gradient buffer are exact-size
  pinned memory (:func:`~torch_fsdp_offload.memory.pinned_empty`) instead of FSDP1's unconditional
  ``pin_memory()`` (power-of-two rounded; and impossible on CPU-only builds); plain host memory for
  ``CPUOffloadPolicy(pin_memory=False)``. FSDP1's two ``Tensor.pin_memory()`` calls are redirected
  by a ``TorchFunctionMode`` on the calling thread only, for the duration of that call.
* ``FlatParamHandle._use_low_precision_shard`` (parameter mixed precision): the shard is cast to the
  compute dtype on the host into a persistent pinned mirror, and only those bytes are copied, on the
  :class:`~torch_fsdp_offload.transfer.TransferEngine`'s H2D stream. The mirror is cast again only
  when the shard changed since (the optimizer's host step casts it in its worker, once per step;
  backward's unshard finds it current); with
  ``CoherentOffload(cast_on="device")`` the fp32 shard is copied on that stream and cast on the
  device as it lands, with no mirror.
* ``FlatParamHandle.flat_param_to`` (no mixed precision): the H2D copy runs on the engine's stream.
* ``_runtime_utils._offload_grad``: the reduced gradient shard goes down on the engine's D2H stream
  into the persistent host buffer; the post-backward stream waits for it, so FSDP1's end-of-backward
  synchronisation covers it.
* ``_runtime_utils._post_backward_final_callback``: on a CPU compute device that synchronisation is
  skipped (copies there are synchronous, and ``torch.cpu.Stream`` has no ``synchronize``).
* ``FlatParamHandle._reset_flat_param_grad_info_if_needed`` (``use_orig_params=True``): after
  ``zero_grad(set_to_none=True)`` the handle's gradient-is-None mask is set, so the post-forward
  reshard does not hand the original parameters views of the stale persistent ``_cpu_grad``
  (Note: [FSDP1 stale gradients with use_orig_params]).
* ``FlatParamHandle.prepare_gradient_for_backward`` (with ``_offload_grad``): gradient accumulation
  across backward passes outside ``no_sync()`` keeps the earlier micro-batches
  (Note: [FSDP1 gradient accumulation]).

:func:`patches` lists these for :func:`torch_fsdp_offload._integration.install`, which applies them.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as _FSDP1
from torch.distributed.fsdp import _flat_param, _runtime_utils
from torch.distributed.fsdp._flat_param import HandleTrainingState
from torch.overrides import TorchFunctionMode

from torch_fsdp_offload import optim
from torch_fsdp_offload._integration import installation
from torch_fsdp_offload.data_path.group_offload import host_bytes
from torch_fsdp_offload.memory import HostPromise, pinned_empty, promise_host_bytes
from torch_fsdp_offload.transfer import Transfer, TransferEngine, get_transfer_engine

_HANDLE_ATTRIBUTE = "_torch_fsdp_offload"
_SITE_PREFIX = {
    _flat_param.FlatParamHandle: "torch.distributed.fsdp._flat_param.FlatParamHandle",
    _runtime_utils: "torch.distributed.fsdp._runtime_utils",
}
# An FSDP1 handle's optimizer steps on the host: OffloadOptimizer streams none of them.
_HOST_STEPPED = types.SimpleNamespace(optimizer_gpu_fraction=0.0)


@dataclass(eq=False)
class HandleOffload:
    """What one ``FlatParamHandle`` does differently under an offload policy, and, for a handle
    whose shard the policy offloads through the engine, the handle as ``OffloadOptimizer`` steps
    it (:class:`~torch_fsdp_offload.optimizer.groups.OffloadedGroup`): its gradients land on the
    host through the engine, the step runs in the optimizer's worker, and the handle's next
    unshard waits for that step (Note: [FSDP1 host steps] in docs/design.md)."""

    # Host shard in exact-size pinned memory (True), plain host memory (False), or FSDP1's own
    # pin_memory() (None).
    pinned: bool | None
    engine: TransferEngine | None  # copies through the engine; None: FSDP1's own copies
    cast_on_device: bool = False  # CoherentOffload(cast_on="device"): no mirror, cast after the copy
    mirror: torch.Tensor | None = None  # pinned compute-dtype copy of the shard
    mirror_transfer: Transfer | None = None  # last H2D that read the mirror
    # The shard the mirror was cast from (weakly) and its version counters then: an in-place write
    # to the shard since (the user's, FSDP1's) changes one of them; a fused optimizer step does not.
    mirror_source: tuple[weakref.ref, tuple[int, ...]] | None = None
    # The mirror was cast after the optimizer's host step, and no forward has read it since.
    mirror_stepped: bool = False
    # The previous backward's (host) gradient, on the compute device, while a backward outside
    # no_sync() accumulates onto it; added to the reduced gradient before it is offloaded.
    previous_grad: torch.Tensor | None = None
    # The exact-size pinned shard, gradient buffer and mirror, promised until FSDP1's lazy init
    # allocates them.
    host_promise: HostPromise | None = None
    # The optimizer group: the handle (weakly), its place in the tree (pre-order: forward order
    # for a chain of blocks), the last gradient copy down, and what OffloadOptimizer sets.
    handle_ref: weakref.ref | None = None
    position: int = 0
    grad_transfer: Transfer | None = None
    offloaded: bool = True
    update_pending: Any = None
    optimizer_ref: weakref.ref | None = None
    plan = _HOST_STEPPED
    # The optimizer may guard reads of the handle's parameters and state by re-classing them.
    reclasses_user_tensors = True

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """What an optimizer over the model holds of this handle: its ``FlatParameter``, or with
        ``use_orig_params=True`` the original parameters (views into it)."""
        handle = self.handle_ref()
        return list(handle.flat_param._params) if handle._use_orig_params else [handle.flat_param]

    def grads_landed(self) -> bool:
        return self.grad_transfer is None or self.grad_transfer.done()

    def wait_grads(self) -> None:
        if self.grad_transfer is not None:
            self.grad_transfer.synchronize()
            self.grad_transfer = None

    def wait_update(self) -> None:
        """Wait for the handle's optimizer step, if one still runs (re-raising its error)."""
        pending = self.update_pending
        if pending is not None:
            pending.result()
            self.update_pending = None

    def refresh_mirror(self) -> None:
        """Cast the stepped shard into the mirror, in the optimizer's worker, so the next forward's
        unshard only copies it (once the mirror exists: parameter mixed precision, host cast)."""
        handle = self.handle_ref()
        if self.mirror is not None and handle is not None:
            self.cast_to_mirror(handle, reuse=False)
            self.mirror_stepped = True

    def cast_to_mirror(self, handle: Any, reuse: bool) -> None:
        """Cast ``handle``'s shard into the mirror; with ``reuse``, not if the shard is the one last
        cast and no version counter of it moved since.

        Only the caller knows whether a write that moves no counter can have happened since: a
        fused optimizer step (``torch._fused_adamw_`` bumps none) runs between a backward and the
        next forward, never between a forward and its backward."""
        local_shard = handle.flat_param._local_shard
        versions = _shard_versions(handle)
        source = self.mirror_source
        if reuse and source is not None and source[0]() is local_shard and source[1] == versions:
            return
        self.cast(local_shard)
        self.mirror_source = (weakref.ref(local_shard), versions)

    def cast(self, local_shard: torch.Tensor) -> None:
        """Cast ``local_shard`` into the mirror, once the mirror's last copy-in has read it."""
        if self.mirror_transfer is not None:
            self.mirror_transfer.synchronize()
        with torch.profiler.record_function(f"torch_fsdp_offload::mirror_cast:{self.label()}"):
            self.mirror.copy_(local_shard)

    def forward_index(self) -> int:
        return self.position

    def label(self) -> str:
        return f"fsdp1_handle{self.position}"

    def prefetch_next_forward(self) -> None:
        """Nothing: FSDP1 prefetches by its own order."""

    def as_param_dtensor(self, index: int, local: torch.Tensor) -> torch.Tensor:
        return local  # FSDP1's parameters are plain tensors, and so is their state


def attach_handle_offload(
    root: _FSDP1, pinned: bool | None, engine: bool, cast_on_device: bool
) -> None:
    """Give every handle of the FSDP1 tree under ``root`` a :class:`HandleOffload`."""
    for position, state in enumerate(_FSDP1.fsdp_modules(root)):
        handle = state._handle
        if handle is not None:
            offload = HandleOffload(
                pinned=pinned,
                engine=get_transfer_engine(handle.device) if engine else None,
                cast_on_device=cast_on_device,
                handle_ref=weakref.ref(handle),
                position=position,
            )
            setattr(handle, _HANDLE_ATTRIBUTE, offload)
            installation.hold("fsdp1", handle)
            if engine and handle._offload_params:
                optim.register_offloaded_group(offload)
            if pinned and handle._offload_params:
                flat_param = handle.flat_param
                param_dtype = handle._fwd_bwd_param_dtype if engine else None
                cast_on = "device" if cast_on_device else "host"
                nbytes = host_bytes(flat_param.numel(), flat_param.dtype, param_dtype, cast_on)
                offload.host_promise = promise_host_bytes(nbytes, handle)


def set_prefetch_limit(root: _FSDP1, depth: int) -> None:
    """Make FSDP1 prefetch the handle ``depth`` places ahead in forward and backward; the root's
    execution-order data is shared with every FSDP instance of the tree at lazy init."""
    root._exec_order_data._forward_prefetch_limit = depth
    root._exec_order_data._backward_prefetch_limit = depth


def patches() -> list[tuple[str, Any, str, Any, Any]]:
    """``(site, owner, name, torch's original, replacement)`` for each FSDP1 patch point."""
    return [
        (f"{_SITE_PREFIX[owner]}.{name}", owner, name, _originals[name], replacement)
        for owner, name, replacement in _patch_sites()
    ]


def _patch_sites() -> list[tuple[Any, str, Any]]:
    handle_class = _flat_param.FlatParamHandle
    return [
        (handle_class, "init_flat_param_attributes", _init_flat_param_attributes),
        (handle_class, "_use_low_precision_shard", _use_low_precision_shard),
        (handle_class, "flat_param_to", _flat_param_to),
        (handle_class, "_reset_flat_param_grad_info_if_needed", _reset_flat_param_grad_info_if_needed),
        (handle_class, "prepare_gradient_for_backward", _prepare_gradient_for_backward),
        (_runtime_utils, "_offload_grad", _offload_grad),
        (_runtime_utils, "_post_backward_final_callback", _post_backward_final_callback),
    ]


def _original(name: str) -> Any:
    return _originals[name]


class _PinMemoryAs(TorchFunctionMode):
    """Routes ``Tensor.pin_memory()`` on this thread to exact-size pinned memory (or none):
    FSDP1 calls it on the shard and the gradient buffer, and this redirects those two calls
    without copying FSDP1's initialisation logic."""

    def __init__(self, pinned: bool) -> None:
        super().__init__()
        self.pinned = pinned

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            tensor = args[0]
            if not self.pinned:
                return tensor
            host = pinned_empty(tensor.shape, tensor.dtype)
            host.copy_(tensor)
            return host
        return func(*args, **kwargs)


@torch.no_grad()
def _init_flat_param_attributes(self) -> None:
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    if offload is None or offload.pinned is None or not self._offload_params:
        return _original("init_flat_param_attributes")(self)
    try:
        with _PinMemoryAs(offload.pinned):
            return _original("init_flat_param_attributes")(self)
    finally:
        if offload.host_promise is not None and hasattr(self.flat_param, "_cpu_grad"):
            offload.host_promise.fulfil()


def _use_low_precision_shard(self) -> None:
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    if offload is None or offload.engine is None or not self._offload_params:
        return _original("_use_low_precision_shard")(self)
    self._check_low_precision_shard()
    offload.wait_update()  # the shard is read below, outside any guarded op
    flat_param = self.flat_param
    local_shard = flat_param._local_shard
    if offload.cast_on_device:
        # The fp32 shard crosses and is cast on the device as it lands. The host optimizer writes
        # the shard only after backward, which FSDP1 ends by synchronizing the compute stream, and
        # that stream waited for this copy.
        _flat_param._alloc_storage(flat_param._mp_shard, local_shard.size())
        offload.engine.h2d(
            local_shard,
            flat_param._mp_shard,
            dtype=self._fwd_bwd_param_dtype,
            label="fsdp1_param_h2d",
        ).wait()
        flat_param.data = flat_param._mp_shard
        return
    if offload.mirror is None:
        offload.mirror = pinned_empty(local_shard.shape, self._fwd_bwd_param_dtype)
    # Cast on the host: only compute-dtype bytes cross the link. Backward reuses the forward's cast;
    # a forward, only the cast after this library's optimizer step (another optimizer's step may
    # have written the shard unseen).
    backward = self._training_state in (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST)
    offload.cast_to_mirror(self, reuse=backward or offload.mirror_stepped)
    offload.mirror_stepped = False
    _flat_param._alloc_storage(flat_param._mp_shard, local_shard.size())
    offload.mirror_transfer = offload.engine.h2d(offload.mirror, flat_param._mp_shard, label="fsdp1_param_h2d")
    offload.mirror_transfer.wait()
    flat_param.data = flat_param._mp_shard


def _shard_versions(handle: Any) -> tuple[int, ...]:
    """The version counters a write to ``handle``'s shard bumps: the shard's, the ``FlatParameter``'s
    and, with ``use_orig_params``, each original parameter's (``.data`` assignments give each
    tensor a counter of its own)."""
    flat_param = handle.flat_param
    originals = flat_param._params if handle._use_orig_params else ()
    return (flat_param._local_shard._version, flat_param._version, *(p._version for p in originals))


def _flat_param_to(self, *args, **kwargs) -> None:
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    target = args[0] if args else kwargs.get("device")
    to_compute_device = (
        offload is not None
        and offload.engine is not None
        and self.device.type == "cuda"
        and isinstance(target, (torch.device, str))
        and torch.device(target) == self.device
        and self.flat_param.device.type == "cpu"
    )
    if not to_compute_device:
        return _original("flat_param_to")(self, *args, **kwargs)
    offload.wait_update()
    transfer = offload.engine.h2d(self.flat_param.data, label="fsdp1_param_h2d")
    self.flat_param.data = transfer.wait()
    # As FSDP1's flat_param_to: the original parameters are views that must follow the new storage.
    if self._use_orig_params:
        if self.is_sharded(self.flat_param):
            self._use_sharded_views()
        else:
            self._use_unsharded_views(as_params=True)


def _prepare_gradient_for_backward(self) -> None:
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    flat_param = self.flat_param
    previous = flat_param.grad
    # FSDP1's own test for "a synced gradient from an earlier backward, offloaded to the host".
    accumulating = (
        offload is not None
        and self._offload_params
        and previous is not None
        and previous.device != self.device
        and previous.size() == flat_param._local_shard.size()
    )
    _original("prepare_gradient_for_backward")(self)
    if accumulating:
        # FSDP1 drops `previous` here (it sets .grad to None and offloads only the new gradient
        # over _cpu_grad). On the device, it is added to the reduced gradient in _offload_grad.
        offload.previous_grad = previous.to(self.device, dtype=flat_param._local_shard.dtype)


def _offload_grad(state, handle, grad_to_offload: torch.Tensor) -> None:
    offload = getattr(handle, _HANDLE_ATTRIBUTE, None) if handle is not None else None
    if offload is not None and offload.previous_grad is not None:
        previous, offload.previous_grad = offload.previous_grad, None
        # Allocated on the compute stream, read here on FSDP1's post-backward (or all-reduce) stream.
        if previous.device.type == "cuda":
            previous.record_stream(torch.cuda.current_stream(previous.device))
        grad_to_offload.add_(previous)
    if offload is None or offload.engine is None or not handle._offload_params:
        return _original("_offload_grad")(state, handle, grad_to_offload)
    transfer = offload.engine.d2h(
        grad_to_offload.detach().contiguous(), handle.flat_param._cpu_grad, label="fsdp1_grad_d2h"
    )
    # The post-backward stream (current here) waits, so FSDP1's end-of-backward synchronisation
    # of the current stream covers this copy; on a CPU device the host is that stream and waits.
    on_cuda = grad_to_offload.device.type == "cuda"
    transfer.wait(torch.cuda.current_stream(grad_to_offload.device) if on_cuda else None)
    # An OffloadOptimizer may step the handle once the copy has landed. FSDP1 reduces (and so
    # offloads) in every backward outside no_sync(): each such landing counts as the last.
    offload.grad_transfer = transfer
    optim.notify_grads_ready(offload, is_last_backward=True)


def _post_backward_final_callback(state, module) -> None:
    for handle in state._all_handles:
        offload = getattr(handle, _HANDLE_ATTRIBUTE, None)
        if offload is not None:
            # A handle that got no new gradient this backward keeps the previous one in _cpu_grad.
            offload.previous_grad = None
    cpu_offload = state.cpu_offload
    # Any handle of the tree: the root itself has none when every parameter is in a wrapped child.
    on_cpu = (
        cpu_offload.offload_params
        and state.compute_device.type == "cpu"
        and any(hasattr(handle, _HANDLE_ATTRIBUTE) for handle in state._all_handles)
    )
    if not on_cpu:
        return _original("_post_backward_final_callback")(state, module)
    # FSDP1 reads cpu_offload only to synchronise the (CPU) stream for D2H copies that already ran.
    state.cpu_offload = CPUOffload(offload_params=False)
    try:
        return _original("_post_backward_final_callback")(state, module)
    finally:
        state.cpu_offload = cpu_offload


def _reset_flat_param_grad_info_if_needed(self) -> None:
    _original("_reset_flat_param_grad_info_if_needed")(self)
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    flat_param = self.flat_param
    if offload is None or not self._offload_params or not self._use_orig_params or flat_param.grad is not None:
        return
    if all(param.grad is None for param in flat_param._params):
        # zero_grad(set_to_none=True): FSDP1 keeps the persistent _cpu_grad, and its post-forward
        # reshard would expose it again as the parameters' .grad (stale values that a CPU compute
        # device then accumulates into). The mask makes those views None, as without offload;
        # the post-backward resets it once a new gradient exists.
        flat_param._is_grad_none_mask = [True] * len(flat_param._params)


# What each patch point held when this module was first imported: the function every replacement
# delegates to, and what install() requires the site to hold before it patches.
_originals: dict[str, Any] = {name: getattr(owner, name) for owner, name, _ in _patch_sites()}
