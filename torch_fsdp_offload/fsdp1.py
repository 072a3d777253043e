"""``FullyShardedDataParallel(..., offload_policy=)``: FSDP1's front door to :class:`CoherentOffload`.

Design: this is FSDP1 itself (a subclass of ``torch.distributed.fsdp.FullyShardedDataParallel``),
not FSDP2 underneath. What FSDP1 users rely on is FSDP1's ``FlatParameter`` machinery:
``state_dict_type`` with FULL / SHARDED (``ShardedTensor``) / LOCAL state dicts,
``FSDP.optim_state_dict`` and existing checkpoints keyed by it, ``summon_full_params`` (writeback,
``rank0_only``, ``offload_to_cpu``), ``no_sync``, the ``clip_grad_norm_`` method, ``FSDP.fsdp_modules``,
``use_orig_params=False`` (optimizers built over flat parameters) and every ``ShardingStrategy``.
Emulating that surface on FSDP2 would change state-dict layouts and optimizer-state keys and break
existing checkpoints; keeping FSDP1 keeps all of it bit for bit. The offload policy changes only
where a handle's shard lives and how its bytes cross the link, through seven patch points of FSDP1's
internals, all in this file and checked against the torch versions they were read from
(fsdp-internals.md §2):

* ``FlatParamHandle.init_flat_param_attributes``: the host shard and gradient buffer are exact-size
  pinned memory (:func:`~torch_fsdp_offload.memory.pinned_empty`) instead of FSDP1's unconditional
  ``pin_memory()`` (power-of-two rounded; and impossible on CPU-only builds); plain host memory for
  ``CPUOffloadPolicy(pin_memory=False)``.
* ``FlatParamHandle._use_low_precision_shard`` (parameter mixed precision): the shard is cast to the
  compute dtype on the host into a persistent pinned mirror, and only those bytes are copied, on the
  :class:`~torch_fsdp_offload.transfer.TransferEngine`'s H2D stream (FSDP1 copies fp32 and casts on
  the GPU: twice the bytes); with ``CoherentOffload(cast_on="device")`` the fp32 shard is copied on
  that stream and cast on the device as it lands, with no mirror.
* ``FlatParamHandle.flat_param_to`` (no mixed precision): the H2D copy runs on the engine's stream.
* ``_runtime_utils._offload_grad``: the reduced gradient shard goes down on the engine's D2H stream
  into the persistent host buffer; the post-backward stream waits for it, so FSDP1's end-of-backward
  synchronisation covers it.
* ``_runtime_utils._post_backward_final_callback``: on a CPU compute device that synchronisation is
  skipped (copies there are synchronous, and ``torch.cpu.Stream`` has no ``synchronize``, so stock
  FSDP1 offload cannot finish a backward on the CPU).
* ``FlatParamHandle._reset_flat_param_grad_info_if_needed`` (``use_orig_params=True``): after
  ``zero_grad(set_to_none=True)`` the handle's gradient-is-None mask is set, so the post-forward
  reshard does not hand the original parameters views of the stale persistent ``_cpu_grad`` again.
  Stock FSDP1 does (``sharded_grad`` returns ``_cpu_grad`` whenever it exists); on a CUDA compute
  device the stale values are then dropped in ``prepare_gradient_for_backward`` (they are "on the
  CPU"), but on a CPU compute device they are accumulated into the next gradient, so stock
  ``CPUOffload`` + ``use_orig_params=True`` diverges from no offload from the third step.
* ``FlatParamHandle.prepare_gradient_for_backward`` (with ``_offload_grad``): gradient accumulation
  across backward passes outside ``no_sync()``. When the previous gradient is on the host and the
  compute device is a GPU, FSDP1 drops it (its own TODO: it cannot add the host gradient to the
  new device one), and the new gradient overwrites ``_cpu_grad``: the earlier micro-batches are
  silently lost. The front door copies the previous gradient to the device there and adds it to
  the reduced gradient before it goes down, for every sharding strategy (``NO_SHARD`` included).
  On a CPU compute device the gradient is not "offloaded" in FSDP1's sense and FSDP1 accumulates
  it itself; nothing is patched there.

Prefetching is FSDP1's own (``forward_prefetch``, ``backward_prefetch``): an unshard issued early
issues its H2D early. Where shards are offloaded, ``prefetch_depth=N`` sets FSDP1's forward and
backward prefetch limits, so each unshard prefetches the handle ``N`` ahead in the recorded execution
order. Every FSDP instance in the tree, including those ``auto_wrap_policy`` builds with
the base class, gets the policy: it is applied to every handle of ``FSDP.fsdp_modules(root)``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel as _FSDP1,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp import _flat_param, _runtime_utils

from torch_fsdp_offload._fsdp2 import torch_version
from torch_fsdp_offload.memory import pinned_empty
from torch_fsdp_offload.platform import PlatformKind, detect_platform
from torch_fsdp_offload.policy import CoherentOffload
from torch_fsdp_offload.transfer import Transfer, TransferEngine, get_transfer_engine

__all__ = ["FullyShardedDataParallel"]

logger = logging.getLogger(__name__)

# FSDP1 releases whose internals (the seven patch points above) were read: 2.11 and 2.13 are line
# for line identical there (fsdp-internals.md §2); 2.12 and 2.14 did not change FSDP1.
_SUPPORTED_TORCH = ((2, 11), (2, 14))
_HANDLE_ATTRIBUTE = "_torch_fsdp_offload"
_originals: dict[str, object] = {}


@dataclass
class _HandleOffload:
    """What one ``FlatParamHandle`` does differently under an offload policy."""

    # Host shard in exact-size pinned memory (True), plain host memory (False), or FSDP1's own
    # pin_memory() (None).
    pinned: bool | None
    engine: TransferEngine | None  # copies through the engine; None: FSDP1's own copies
    chunk_bytes: int | None = None
    cast_on_device: bool = False  # CoherentOffload(cast_on="device"): no mirror, cast after the copy
    mirror: torch.Tensor | None = None  # pinned compute-dtype copy of the shard
    mirror_transfer: Transfer | None = None  # last H2D that read the mirror
    # The previous backward's (host) gradient, on the compute device, while a backward outside
    # no_sync() accumulates onto it; added to the reduced gradient before it is offloaded.
    previous_grad: torch.Tensor | None = None


class FullyShardedDataParallel(_FSDP1):
    """FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) with an ``offload_policy``.

    Takes FSDP1's constructor unchanged, plus ``offload_policy``. Everything FSDP1 offers works as in
    FSDP1 (state dicts, ``optim_state_dict``, ``summon_full_params``, ``no_sync``,
    ``clip_grad_norm_``, ``fsdp_modules``, all sharding strategies); the policy decides where shards
    live and how they are copied. See the module docstring for why this is FSDP1 and not FSDP2.

    Args:
        module, process_group, sharding_strategy, cpu_offload, auto_wrap_policy, backward_prefetch,
        mixed_precision, ignored_modules, param_init_fn, device_id, sync_module_states,
        forward_prefetch, limit_all_gathers, use_orig_params, ignored_states, device_mesh:
            as for FSDP1.
        offload_policy (OffloadPolicy | None): ``None`` or ``OffloadPolicy()``: no offload (FSDP1's
            ``cpu_offload`` argument applies as usual). ``CPUOffloadPolicy(pin_memory=...)``: FSDP1's
            parameter offload, with the host shard pinned or not as asked. :class:`CoherentOffload`:
            exact-size pinned shards, H2D/D2H on the transfer engine's streams, cast to the compute
            dtype before the copy; ``prefetch_depth=0`` turns FSDP1's prefetching off, ``N >= 1``
            turns on ``forward_prefetch`` as well and prefetches the handle ``N`` ahead in forward
            and backward. Where nothing needs offloading, FSDP1 runs exactly as without offload
            (prefetch arguments as given): on a UNIFIED machine (the GPU's memory is the host's, so
            a copy would move bytes within one memory), without an accelerator (the compute device
            is the host), and with ``offload_params=False``. The optimizer is yours: FSDP1 never reads the policy's
            ``optimizer`` placement.

    Raises:
        ValueError: before anything is wrapped (the module is left unchanged), for a combination
            this class cannot honour: ``cpu_offload=`` together with ``offload_policy=``; a
            ``CoherentOffload`` with an ``optimizer`` placement other than ``"auto"`` (FSDP1 steps
            with your optimizer; the placement is FSDP2's ``OffloadOptimizer``), with
            ``module_fraction < 1`` (FSDP1 keeps one ``cpu_offload`` per tree: its end-of-backward
            host synchronisation and ``clip_grad_norm_`` read the root's, so a mix of host and GPU
            shards is not safe; use FSDP2 ``fully_shard``), or with ``activations`` (call
            :func:`~torch_fsdp_offload.offload_activations` on the wrapped model instead);
            ``prefetch_depth=0`` with ``forward_prefetch=True`` or ``BackwardPrefetch.BACKWARD_POST``,
            or ``prefetch_depth >= 1`` with ``backward_prefetch=None`` (the depth sets both); and
            what :meth:`CoherentOffload.resolve` refuses for the detected platform.
        TypeError: ``offload_policy`` is not an ``OffloadPolicy``.
        RuntimeError: a torch release whose FSDP1 internals were not checked.

    Example::

        >>> from torch.distributed.fsdp import MixedPrecision
        >>> from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        >>> from torch_fsdp_offload import CoherentOffload, FullyShardedDataParallel as FSDP
        >>> model = FSDP(
        ...     model,
        ...     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        ...     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        ...     device_id=torch.cuda.current_device(),
        ...     offload_policy=CoherentOffload(),
        ... )
        >>> optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        >>> with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        ...     state = model.state_dict()
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy=None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=None,
        ignored_modules=None,
        param_init_fn=None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh=None,
        *,
        offload_policy: OffloadPolicy | None = None,
    ) -> None:
        handle_offload, cpu_offload = _plan(offload_policy, cpu_offload, device_id, forward_prefetch, backward_prefetch)
        # The policy's prefetch depth is how far ahead shards are copied in; where nothing is
        # offloaded, FSDP1's own prefetch arguments apply as given.
        prefetch_depth = handle_offload.prefetch_depth if handle_offload is not None else None
        if prefetch_depth == 0:
            backward_prefetch, forward_prefetch = None, False
        elif prefetch_depth is not None:
            forward_prefetch = True
        super().__init__(
            module,
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
            device_mesh=device_mesh,
        )
        self.offload_policy = offload_policy if offload_policy is not None else OffloadPolicy()
        if prefetch_depth:
            # FSDP1 prefetches the handle ``limit`` places ahead of the current one; the root's
            # execution-order data is shared with every FSDP instance of the tree at lazy init.
            self._exec_order_data._forward_prefetch_limit = prefetch_depth
            self._exec_order_data._backward_prefetch_limit = prefetch_depth
        if handle_offload is None:
            return
        _install()
        for state in _FSDP1.fsdp_modules(self):
            if state._handle is not None:
                engine = get_transfer_engine(state._handle.device) if handle_offload.engine else None
                setattr(state._handle, _HANDLE_ATTRIBUTE, _HandleOffload(
                    pinned=handle_offload.pinned,
                    engine=engine,
                    chunk_bytes=handle_offload.chunk_bytes,
                    cast_on_device=handle_offload.cast_on_device,
                ))


@dataclass(frozen=True)
class _Plan:
    pinned: bool | None
    engine: bool
    chunk_bytes: int | None
    cast_on_device: bool = False
    prefetch_depth: int | None = None  # CoherentOffload's; None: FSDP1's prefetch arguments as given


def _plan(
    offload_policy: OffloadPolicy | None,
    cpu_offload: CPUOffload | None,
    device_id,
    forward_prefetch: bool = False,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
) -> tuple[_Plan | None, CPUOffload | None]:
    """Validate the policy; return what each handle does and FSDP1's ``cpu_offload`` argument.

    Every check runs here, before FSDP1's constructor touches the module.
    """
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return None, cpu_offload
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"FullyShardedDataParallel(offload_policy=...) takes an OffloadPolicy (e.g. CoherentOffload()), "
            f"got {type(offload_policy).__name__}"
        )
    if cpu_offload is not None:
        raise ValueError(
            "FullyShardedDataParallel got both cpu_offload= and offload_policy=; pass only "
            "offload_policy (CPUOffload(offload_params=True) is CPUOffloadPolicy())"
        )
    if not isinstance(offload_policy, CPUOffloadPolicy):
        raise TypeError(
            f"FullyShardedDataParallel cannot honour {type(offload_policy).__name__}: only OffloadPolicy(), "
            "CPUOffloadPolicy and CoherentOffload are understood"
        )
    _check_torch_version()
    if not isinstance(offload_policy, CoherentOffload):
        # FSDP1 pins the shard itself (pinned=None) unless asked not to; the handles still carry
        # the plan so that gradient accumulation outside no_sync() is not lost.
        plan = _Plan(pinned=None if offload_policy.pin_memory else False, engine=False, chunk_bytes=None)
        return plan, CPUOffload(offload_params=True)
    _refuse_unread_knobs(offload_policy, forward_prefetch, backward_prefetch)
    if not offload_policy.offload_params:
        return None, None
    device = _compute_device(device_id)
    resolved = offload_policy.resolve(detect_platform(device, kind=offload_policy.platform))
    if resolved.platform is PlatformKind.UNIFIED:
        logger.info("CoherentOffload on a unified-memory machine: FSDP1 keeps shards in the GPU's "
                    "memory, which is the host's, and copies nothing")
        return None, None
    if resolved.platform is PlatformKind.HOST_ONLY:
        # The compute device is the host: the shards already live where they would be offloaded
        # to. As FSDP2's fully_shard with this policy, FSDP1 then runs without offload.
        logger.info("CoherentOffload without an accelerator: FSDP1 keeps shards on the host, where "
                    "compute runs, and copies nothing")
        return None, None
    plan = _Plan(
        pinned=True,
        engine=resolved.copies,
        chunk_bytes=offload_policy.chunk_bytes,
        cast_on_device=resolved.cast_on == "device",
        prefetch_depth=offload_policy.prefetch_depth,
    )
    return plan, CPUOffload(offload_params=True)


def _refuse_unread_knobs(
    policy: CoherentOffload, forward_prefetch: bool, backward_prefetch: BackwardPrefetch | None
) -> None:
    """Raise ValueError for every knob of ``policy`` FSDP1 would not honour (it never reads them),
    and for prefetch arguments the policy's ``prefetch_depth`` would override."""
    # getattr: knobs a policy version may not have count as left at their defaults.
    optimizer = getattr(policy, "optimizer", "auto")
    module_fraction = getattr(policy, "module_fraction", 1.0)
    activations = getattr(policy, "activations", False)
    prefetch_depth = getattr(policy, "prefetch_depth", 1)
    problems = []
    if not (isinstance(optimizer, str) and optimizer == "auto"):
        problems.append(
            f"optimizer={optimizer!r}: FSDP1 steps with your own optimizer over model.parameters(), "
            "which never reads a placement (placing the step on the host or the GPU is FSDP2's "
            "OffloadOptimizer). Leave optimizer at 'auto', or shard with FSDP2 fully_shard("
            "offload_policy=...) and step with torch_fsdp_offload.OffloadOptimizer"
        )
    if module_fraction < 1:
        problems.append(
            f"module_fraction={module_fraction!r}: FSDP1 offloads every handle of a tree alike (its "
            "end-of-backward synchronisation and clip_grad_norm_ follow the root's cpu_offload). "
            "Leave module_fraction at 1.0, or shard with FSDP2 fully_shard(offload_policy=...)"
        )
    if activations:
        problems.append(
            f"activations={activations!r}: FSDP1 has no per-block hook for it. Leave activations at "
            "False and call torch_fsdp_offload.offload_activations(model) on the wrapped model, or "
            "shard with FSDP2 fully_shard(offload_policy=...)"
        )
    if prefetch_depth == 0 and (forward_prefetch or backward_prefetch is BackwardPrefetch.BACKWARD_POST):
        problems.append(
            f"prefetch_depth=0 turns FSDP1's prefetching off, but forward_prefetch={forward_prefetch!r}, "
            f"backward_prefetch={backward_prefetch} ask for it. Drop those arguments, or give "
            "prefetch_depth >= 1 (it sets FSDP1's forward and backward prefetch)"
        )
    if prefetch_depth and backward_prefetch is None:
        problems.append(
            f"prefetch_depth={prefetch_depth!r} prefetches in backward too, but backward_prefetch=None "
            "turns that off. Drop backward_prefetch=None, or give prefetch_depth=0 (no prefetching)"
        )
    if problems:
        raise ValueError(
            "FullyShardedDataParallel(offload_policy=CoherentOffload(...)) cannot honour "
            + "; ".join(problems)
            + ". Nothing was wrapped: the module is unchanged."
        )


def _compute_device(device_id) -> torch.device:
    if device_id is not None:
        device = torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_torch_version() -> None:
    low, high = _SUPPORTED_TORCH
    if not (low <= torch_version() <= high):
        raise RuntimeError(
            f"torch_fsdp_offload's FSDP1 front door supports torch {low[0]}.{low[1]} through "
            f"{high[0]}.{high[1]}; this is torch {torch.__version__}. Use FSDP1's own cpu_offload= "
            "on this release, or a supported torch."
        )


# ------------------------------------------------------------------------------------------------
# Patch points into FSDP1 (installed once; each delegates to FSDP1 for handles without an offload).


def _install() -> None:
    if _originals:
        return
    handle_class = _flat_param.FlatParamHandle
    _originals["init_flat_param_attributes"] = handle_class.init_flat_param_attributes
    _originals["_use_low_precision_shard"] = handle_class._use_low_precision_shard
    _originals["flat_param_to"] = handle_class.flat_param_to
    _originals["_offload_grad"] = _runtime_utils._offload_grad
    _originals["_post_backward_final_callback"] = _runtime_utils._post_backward_final_callback
    _originals["_reset_flat_param_grad_info_if_needed"] = handle_class._reset_flat_param_grad_info_if_needed
    _originals["prepare_gradient_for_backward"] = handle_class.prepare_gradient_for_backward
    handle_class._reset_flat_param_grad_info_if_needed = _reset_flat_param_grad_info_if_needed
    handle_class.prepare_gradient_for_backward = _prepare_gradient_for_backward
    handle_class.init_flat_param_attributes = _init_flat_param_attributes
    handle_class._use_low_precision_shard = _use_low_precision_shard
    handle_class.flat_param_to = _flat_param_to
    _runtime_utils._offload_grad = _offload_grad
    _runtime_utils._post_backward_final_callback = _post_backward_final_callback


@contextlib.contextmanager
def _pin_memory_as(pinned: bool):
    # FSDP1 calls Tensor.pin_memory() on the shard and the gradient buffer; route those two calls to
    # exact-size pinned memory (or none) without copying FSDP1's initialisation logic.
    original = torch.Tensor.pin_memory

    def pin(tensor: torch.Tensor, device=None) -> torch.Tensor:
        if not pinned:
            return tensor
        host = pinned_empty(tensor.shape, tensor.dtype)
        host.copy_(tensor)
        return host

    torch.Tensor.pin_memory = pin
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original


@torch.no_grad()
def _init_flat_param_attributes(self) -> None:
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    if offload is None or offload.pinned is None or not self._offload_params:
        return _originals["init_flat_param_attributes"](self)
    with _pin_memory_as(offload.pinned):
        return _originals["init_flat_param_attributes"](self)


def _use_low_precision_shard(self) -> None:
    offload = getattr(self, _HANDLE_ATTRIBUTE, None)
    if offload is None or offload.engine is None or not self._offload_params:
        return _originals["_use_low_precision_shard"](self)
    self._check_low_precision_shard()
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
            chunk_bytes=offload.chunk_bytes,
        ).wait()
        flat_param.data = flat_param._mp_shard
        return
    if offload.mirror is None:
        offload.mirror = pinned_empty(local_shard.shape, self._fwd_bwd_param_dtype)
    elif offload.mirror_transfer is not None:
        offload.mirror_transfer.synchronize()  # the previous copy may still read the mirror
    # Cast on the host: only compute-dtype bytes cross the link.
    offload.mirror.copy_(local_shard)
    _flat_param._alloc_storage(flat_param._mp_shard, local_shard.size())
    offload.mirror_transfer = offload.engine.h2d(
        offload.mirror, flat_param._mp_shard, label="fsdp1_param_h2d", chunk_bytes=offload.chunk_bytes
    )
    offload.mirror_transfer.wait()
    flat_param.data = flat_param._mp_shard


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
        return _originals["flat_param_to"](self, *args, **kwargs)
    transfer = offload.engine.h2d(self.flat_param.data, label="fsdp1_param_h2d", chunk_bytes=offload.chunk_bytes)
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
    _originals["prepare_gradient_for_backward"](self)
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
        return _originals["_offload_grad"](state, handle, grad_to_offload)
    transfer = offload.engine.d2h(
        grad_to_offload.detach().contiguous(), handle.flat_param._cpu_grad, label="fsdp1_grad_d2h",
        chunk_bytes=offload.chunk_bytes,
    )
    # The post-backward stream (current here) waits, so FSDP1's end-of-backward synchronisation
    # of the current stream covers this copy; on a CPU device the host is that stream and waits.
    on_cuda = grad_to_offload.device.type == "cuda"
    transfer.wait(torch.cuda.current_stream(grad_to_offload.device) if on_cuda else None)


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
        return _originals["_post_backward_final_callback"](state, module)
    # FSDP1 reads cpu_offload only to synchronise the (CPU) stream for D2H copies that already ran.
    state.cpu_offload = CPUOffload(offload_params=False)
    try:
        return _originals["_post_backward_final_callback"](state, module)
    finally:
        state.cpu_offload = cpu_offload


def _reset_flat_param_grad_info_if_needed(self) -> None:
    _originals["_reset_flat_param_grad_info_if_needed"](self)
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
