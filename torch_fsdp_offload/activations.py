"""Offload the tensors autograd saves for backward to host memory, and bring them back ahead of need.

:func:`offload_activations` installs ``torch.autograd.graph.saved_tensors_hooks`` around a model's
forward. Each saved tensor of an offloaded block is copied, as soon as it is final, into a reused
pinned host buffer on the transfer engine's D2H stream; its GPU memory is released once the copy has
landed, and the forward waits rather than let more than ``max_inflight_bytes`` of copies pile up (a
forward can make activations several times faster than a PCIe link carries them; unbounded, the
copies would land after the peak and save nothing). In backward, when the first tensor of block ``i`` is needed, the H2D copies of blocks
``i - 1 .. i - prefetch_blocks`` are issued on the H2D stream, so they land while block ``i``
computes; the compute stream waits on the copy event of exactly the tensor it unpacks.

How it differs from ``torch.autograd.graph.save_on_cpu``: copies leave the compute stream (save_on_cpu
copies on it and reloads on demand), pinned memory is pooled and reused across steps instead of
allocated per tensor, reloads are prefetched block by block, parameters and views of parameters are
never copied, and a view shares its base's copy.

Where it does nothing: on a UNIFIED platform (CPU and GPU share one memory, a copy only duplicates
it) and without an accelerator. A platform kind can be forced (``platform="discrete"``) to run the
whole copy path on the CPU with synchronous copies: that is how CPU tests exercise it.

Sharing the link with parameter offload: activation copies use the streams of
:func:`torch_fsdp_offload.transfer.get_transfer_engine` for the device, the same streams FSDP's
parameter and gradient copies use, so copies are served in the order they are issued on each stream.
The FSDP integration gives parameters priority by issuing a block's parameter prefetch (in its
pre-backward hook) before the block's first saved tensor is unpacked, which is when activation
prefetch is issued; ``prefetch_blocks`` bounds how far activation reloads run ahead.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import record_function

from torch_fsdp_offload.memory import pinned_empty
from torch_fsdp_offload.platform import detect_platform, Platform, PlatformKind
from torch_fsdp_offload.transfer import get_transfer_engine, Transfer

__all__ = ["ActivationOffload", "ActivationOffloadStats", "DEFAULT_MAX_INFLIGHT_BYTES", "offload_activations"]

# How many blocks the CPU may run ahead of the GPU while activations are offloaded. Copies land in
# GPU time but are noticed in CPU time: a CPU far ahead would see no copy landed during forward (so
# frees nothing) and, in backward, decide reloads before copies land (so skips them). Two blocks
# keep the GPU queue full while tying those decisions to GPU progress.
_CPU_LEAD_BLOCKS = 2
_D2H_LABEL = "torch_fsdp_offload::activations_d2h"
_H2D_LABEL = "activations_h2d"  # the engine adds the torch_fsdp_offload:: prefix
_BLOCK_LIST_NAMES = ("blocks", "layers", "model.layers")
# How an offloader was made, for the message that refuses a second one on the same module.
_MADE_BY_CALL = "offload_activations(...)"
_MADE_BY_CLASS = "ActivationOffload.attach/register_blocks"
_NONE_YET = 0x7FFFFFFF
# Device bytes whose copy to the host may be in flight at once. The forward produces activations
# several times faster than a PCIe link carries them (H200, 1.6B model, batch 4: 195 GB/s made,
# 55 GB/s carried), so without a bound the copies fall behind, nothing is freed before backward, and
# the peak does not fall. 1 GiB keeps a few of the largest saved tensors (MLP hidden states, 0.25-0.5
# GiB) queued, enough to keep the link busy.
DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30


@dataclasses.dataclass
class ActivationOffloadStats:
    """Counters of what :class:`ActivationOffload` did since it was created or last :meth:`reset`.

    Attributes:
        saved_bytes (int): bytes of distinct storages autograd saved on the device during offloading
            passes, parameters excluded (the activation footprint the hooks saw).
        offloaded_bytes (int): the part of ``saved_bytes`` copied to host memory (= ``d2h_bytes``).
        d2h_copies (int), d2h_bytes (int): device-to-host copies issued and their bytes.
        h2d_copies (int), h2d_bytes (int): host-to-device reloads issued and their bytes.
        prefetched_copies (int): reloads issued ahead of need, when an earlier block was reached.
        on_demand_copies (int): reloads issued when the tensor itself was unpacked (out-of-order
            backward, or a second backward through a retained graph).
        reused_device_copies (int): reloads skipped because the tensor's device copy had not been
            released yet (its D2H copy had not landed when backward came close to it).
        deduplicated_views (int): saved tensors that shared an already offloaded storage.
        kept_tensors (int): saved tensors left on the device (small, parameter, buffer, or in a
            block that is not offloaded).
        inflight_waits (int): times the forward waited for the oldest copy to the host to land,
            because ``max_inflight_bytes`` were in flight (the link was slower than the forward).
    """

    saved_bytes: int = 0
    offloaded_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    prefetched_copies: int = 0
    on_demand_copies: int = 0
    reused_device_copies: int = 0
    deduplicated_views: int = 0
    kept_tensors: int = 0
    inflight_waits: int = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


class _PinnedPool:
    """Pinned host buffers by exact byte size. The first step allocates them; later steps reuse them.

    A buffer comes back with the event of the last H2D copy that read it (None if none): the next
    D2H copy into it must wait for that event.
    """

    def __init__(self, pin_device: torch.device) -> None:
        self._pin_device = pin_device
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self.pinned_bytes = 0

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        with self._lock:
            free_buffers = self._free[nbytes]
            if free_buffers:
                return free_buffers.pop()
            self.pinned_bytes += nbytes
        return pinned_empty(nbytes, torch.uint8, device=self._pin_device), None

    def release(self, host: torch.Tensor, read_done: torch.cuda.Event | None) -> None:
        with self._lock:
            self._free[host.numel()].append((host, read_done))


class _Stored:
    """One offloaded storage: its host copy, and its device copy while one exists."""

    __slots__ = (
        "pass_",
        "block",
        "last_block",
        "dtype",
        "numel",
        "nbytes",
        "host",
        "pool",
        "device_data",
        "is_original",
        "retained",
        "d2h_done",
        "host_read_done",
        "h2d",
        "handles",
        "unpacked",
        "unpack_task",
        "__weakref__",
    )

    def __init__(self, pass_: _Pass, block: int, original: torch.Tensor, pool: _PinnedPool) -> None:
        self.pass_ = pass_
        self.block = block
        self.last_block = block
        self.dtype = original.dtype
        self.nbytes = original.untyped_storage().nbytes()
        self.numel = self.nbytes // original.element_size()
        host, self.host_read_done = pool.acquire(self.nbytes)
        self.host = host.view(self.dtype)
        self.pool = pool
        # The whole storage as a 1-D tensor: the original until released, later a reloaded copy.
        self.device_data: torch.Tensor | None = original.detach().as_strided((self.numel,), (1,), 0)
        self.is_original = True
        self.retained = False
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d: Transfer | None = None  # the reload that device_data came from, if any
        self.handles = 0
        self.unpacked = 0
        self.unpack_task = -1

    def __del__(self) -> None:
        self.pool.release(self.host.view(torch.uint8), self.host_read_done)


class _Kept:
    """A saved tensor left on the device, remembered only to trigger prefetch when it is unpacked."""

    __slots__ = ("tensor", "pass_", "trigger")

    def __init__(self, tensor: torch.Tensor, pass_: _Pass, trigger: int) -> None:
        self.tensor = tensor
        self.pass_ = pass_
        self.trigger = trigger


class _Saved:
    """A saved tensor whose storage is offloaded: the storage and how the tensor views it."""

    __slots__ = ("stored", "size", "stride", "offset", "trigger")

    def __init__(self, stored: _Stored, tensor: torch.Tensor, trigger: int) -> None:
        self.stored = stored
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.trigger = trigger


class _Pass:
    """The state of one forward (one entry of the context) and of the backwards through its graph."""

    __slots__ = (
        "block",
        "in_block",
        "block_depth",
        "offloading",
        "any_offloaded",
        "blocks",
        "storages",
        "root_param_storages",
        "block_param_storages",
        "forward_marks",
        "backward_task",
        "lowest_reached",
        "lowest_issued",
        "backward_marks",
        "__weakref__",
    )

    def __init__(self, root_param_storages: frozenset[int]) -> None:
        self.block = -1  # the block started last; -1 before the first one
        self.in_block = False
        self.block_depth = 0
        self.offloading = False  # whether the current block is offloaded
        self.any_offloaded = False
        self.blocks: list[list[weakref.ref[_Stored]]] = []  # offloaded storages per block
        # storage data_ptr -> weak refs to (the storage, its _Stored or None when kept on the device);
        # weak both: a _Stored refers to its pass, and must die with the graph that saved it.
        self.storages: dict[int, tuple[weakref.ref, weakref.ref[_Stored] | None]] = {}
        self.root_param_storages = root_param_storages
        self.block_param_storages: frozenset[int] = frozenset()
        self.forward_marks: collections.deque[torch.cuda.Event] = collections.deque(maxlen=_CPU_LEAD_BLOCKS + 1)
        self.backward_task = -1
        # The lowest block backward has reached, and the lowest whose reload is issued.
        self.lowest_reached = _NONE_YET
        self.lowest_issued = _NONE_YET
        self.backward_marks: dict[int, torch.cuda.Event] = {}


def _param_storages(module: nn.Module, recurse: bool) -> frozenset[int]:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if type(t) in (torch.Tensor, nn.Parameter))


def _check_knobs(
    min_offload_bytes: Any, prefetch_blocks: Any, keep_last_blocks: Any, fraction: Any, max_inflight_bytes: Any
) -> None:
    if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
        raise ValueError(
            f"min_offload_bytes must be an int >= 0, got {min_offload_bytes!r}; use 0 to offload every "
            "saved tensor, or a byte count such as 1 << 20 to leave smaller ones on the device"
        )
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 1:
        raise ValueError(
            f"prefetch_blocks must be an int >= 1, got {prefetch_blocks!r}; backward needs at least the "
            "next block's activations in flight (1 is the usual choice, 2 on a slow link)"
        )
    keep_is_count = isinstance(keep_last_blocks, int) and not isinstance(keep_last_blocks, bool)
    keep_is_fraction = isinstance(keep_last_blocks, float) and 0.0 <= keep_last_blocks <= 1.0
    if not ((keep_is_count and keep_last_blocks >= 0) or keep_is_fraction):
        raise ValueError(
            f"keep_last_blocks must be a block count (int >= 0) or a fraction of the blocks (float in "
            f"[0, 1]), got {keep_last_blocks!r}"
        )
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"fraction must be a number in [0, 1] (the fraction of blocks whose activations are "
            f"offloaded), got {fraction!r}"
        )
    if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 0:
        raise ValueError(
            f"max_inflight_bytes must be an int >= 0, got {max_inflight_bytes!r}; it bounds the device "
            "memory held by copies to the host that have not landed yet (e.g. 1 << 30; 0 waits for each "
            "copy before the next tensor is saved)"
        )


# The live offloader whose hooks each module carries, as a model or as a block: one per module, since
# a second would offload what the module saves twice. remove() releases its modules.
_offloader_of_module: "weakref.WeakKeyDictionary[nn.Module, ActivationOffload]" = weakref.WeakKeyDictionary()


def offloader_of(module: nn.Module) -> ActivationOffload | None:
    """The live offloader whose hooks ``module`` carries (as a model or a block), if any."""
    return _offloader_of_module.get(module)


def check_not_offloaded_twice(modules: Iterable[nn.Module], offload: ActivationOffload | None, caller: str) -> None:
    """Refuse, before anything is hooked, modules whose activations an offloader other than
    ``offload`` already offloads.

    Raises:
        ValueError: naming the module, the offloader that has it and how to keep only one.
    """
    for module in modules:
        other = _offloader_of_module.get(module)
        if other is None or other is offload:
            continue
        if other._made_by == _MADE_BY_CALL:
            fix = "Keep one: call .remove() on the object offload_activations returned first, or keep it and drop this call"
        elif other._made_by == _MADE_BY_CLASS:
            fix = "Keep one: call .remove() on that ActivationOffload first, or keep it and drop this call"
        else:
            fix = (
                "Keep one: drop this call (the model's CoherentOffload(activations=...) offloads it "
                "already), or shard with activations=False and use offload_activations alone"
            )
        raise ValueError(
            f"{caller}: {type(module).__name__} already has its activations offloaded by "
            f"{other._made_by}; a second offloader on it would copy them twice. {fix}."
        )


def _resolve_platform(
    platform: Platform | PlatformKind | str | None, device: torch.device | str | int | None
) -> Platform:
    if isinstance(platform, Platform):
        if device is not None and torch.device(device) != platform.device:
            raise ValueError(
                f"device={device} contradicts platform.device={platform.device}; pass one of them"
            )
        return platform
    if platform is not None and not isinstance(platform, (str, PlatformKind)):
        raise TypeError(
            f"platform must be a Platform, a PlatformKind, its name or None, got {type(platform).__name__}"
        )
    return detect_platform(device, kind=platform)


def _find_blocks(module: nn.Module) -> nn.ModuleList:
    for name in _BLOCK_LIST_NAMES:
        candidate: Any = module
        for part in name.split("."):
            candidate = getattr(candidate, part, None)
        if isinstance(candidate, nn.ModuleList) and len(candidate) > 0:
            return candidate
    raise ValueError(
        f"offload_activations could not find the blocks of {type(module).__name__} (looked for a "
        f"non-empty nn.ModuleList at {', '.join(_BLOCK_LIST_NAMES)}); pass blocks=[...] explicitly, "
        "e.g. blocks=model.transformer.h"
    )


class ActivationOffload:
    """Offloads the activations autograd saves in forward to pinned host memory and prefetches them
    back, block by block, during backward.

    Enter it around each forward (or attach it to a module with :func:`offload_activations`, which
    enters it around that module's forward); run backward after leaving it. Block boundaries come
    from modules given to :meth:`register_blocks` (each call of one starts a block) or from
    :meth:`mark_block` calls; without either, the whole forward is one block. Create it once and
    reuse it every step: its pinned pool is sized by the first step and reused by the next ones.

    What is offloaded: tensors saved inside offloaded blocks, on the platform's device, whose storage
    holds at least ``min_offload_bytes``, that are neither parameters (nor views of them) nor buffers
    of registered modules. Blocks are offloaded from the first: the first ``floor(fraction * n)`` of
    the ``n`` blocks of a forward, minus the last ``keep_last_blocks`` (their activations are needed
    first in backward, so offloading them saves the least memory for the most link time). ``n`` is
    the number of blocks the previous forward had (at the first forward: the number of registered
    blocks, or unknown, in which case every block is offloaded when ``fraction > 0``).

    A tensor's GPU memory is released once its D2H copy has landed (checked at every saved tensor and
    block boundary). At most ``max_inflight_bytes`` of copies are in flight: past that, the forward
    waits for the oldest to land, so where the forward makes activations faster than the link carries
    them it runs at the link's pace, and the peak falls by the offloaded bytes instead of holding them
    until after the copies land. If backward comes within ``prefetch_blocks`` of a block before its
    copies landed, the device copies still alive are used in place and not reloaded. So that "landed"
    is judged in GPU time, the CPU runs at most two blocks ahead of the GPU while blocks are offloaded
    (it waits on an event recorded at the start of the block two back).

    Under ``torch.autocast`` with fp32 weights, the bf16 weight casts autograd saves are not
    parameters and are offloaded like activations; keep weights in the compute dtype (or use FSDP's
    ``MixedPrecisionPolicy``, whose unsharded parameters are parameters) to avoid moving them.

    Composes with ``torch.utils.checkpoint`` (either flavour): only what autograd saves outside the
    checkpointed regions, i.e. the checkpoint inputs, is offloaded; tensors saved by the recomputation
    during backward are never offloaded. Nested use is allowed: entering the same object again, or
    another one, makes it the innermost hook for what is saved inside; the forward pass and its blocks
    belong to the outermost entry of each object.

    Args:
        min_offload_bytes (int): storages smaller than this stay on the device; their copies would run
            far below link speed. Default 1 MiB.
        prefetch_blocks (int): how many blocks ahead of the one backward is in are reloaded (>= 1).
            Each costs one block of activations in device memory.
        keep_last_blocks (int | float): the last blocks kept on the device, as a count or as a fraction
            of the blocks. Default 0.
        fraction (float): the fraction of blocks offloaded, counted from the first. Default 1.0.
        max_inflight_bytes (int): device bytes whose copy to the host may be in flight at once before
            the forward waits for the oldest (>= 0). Default 1 GiB. Larger hides more of the copies
            under compute and saves less memory at the peak.
        platform (Platform | PlatformKind | str | None): the platform to act for; ``None`` detects it
            (``TORCH_FSDP_OFFLOAD_PLATFORM`` overrides). Copies happen on DISCRETE and COHERENT only;
            forcing ``"discrete"`` on a machine without a GPU runs every copy synchronously on the CPU.
        device (torch.device | str | int | None): the compute device; default the current CUDA device
            (or the CPU without one). Ignored when ``platform`` is a :class:`Platform`.

    Raises:
        ValueError: ``min_offload_bytes < 0``, ``prefetch_blocks < 1``, ``fraction`` outside [0, 1],
            ``keep_last_blocks`` negative or a float outside [0, 1], ``max_inflight_bytes < 0``, or an
            unknown platform kind; raised before anything is allocated.
        TypeError: ``platform`` of the wrong type.

    Example::

        >>> model = build_model("tiny")
        >>> offload = ActivationOffload(min_offload_bytes=0, platform="discrete")
        >>> offload.register_blocks(model.blocks)
        >>> with offload:
        ...     loss = causal_lm_loss(model(tokens), tokens)
        >>> loss.backward()
        >>> offload.stats.d2h_bytes == offload.stats.h2d_bytes > 0
        True
    """

    def __init__(
        self,
        *,
        min_offload_bytes: int = 1 << 20,
        prefetch_blocks: int = 1,
        keep_last_blocks: int | float = 0,
        fraction: float = 1.0,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        platform: Platform | PlatformKind | str | None = None,
        device: torch.device | str | int | None = None,
    ) -> None:
        _check_knobs(min_offload_bytes, prefetch_blocks, keep_last_blocks, fraction, max_inflight_bytes)
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_blocks = prefetch_blocks
        self.keep_last_blocks = keep_last_blocks
        self.fraction = float(fraction)
        self.max_inflight_bytes = max_inflight_bytes
        self.platform = _resolve_platform(platform, device)
        self.device = self.platform.device
        self.stats = ActivationOffloadStats()
        self._copies = self.platform.copies_needed
        self._cuda = self._copies and self.device.type == "cuda"
        self._engine = get_transfer_engine(self.device) if self._copies else None
        self._d2h_stream = self._engine.d2h_stream if self._cuda else None
        self._pool = _PinnedPool(self.device)
        self._lock = threading.Lock()
        self._pending: collections.deque[_Stored] = collections.deque()  # D2H copies not seen landed
        self._pending_bytes = 0
        self._pass: _Pass | None = None
        self._depth = 0
        self._hook_stack: list[saved_tensors_hooks | None] = []
        # Weak: the module's hooks refer to this object, which must not keep the module alive.
        self._root: weakref.ref[nn.Module] | None = None
        self._registered_blocks = 0
        self._last_pass_blocks: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._root_entered: list[bool] = []
        self._warned_outside = False
        self._made_by = _MADE_BY_CLASS  # how it was made: names it when a second offloader is refused

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory the pool holds (in use and free); stops growing after the first step."""
        return self._pool.pinned_bytes

    @property
    def active(self) -> bool:
        """Whether copies happen at all (False on UNIFIED and HOST_ONLY platforms: a no-op)."""
        return self._copies

    # ------------------------------------------------------------------ entering and blocks
    def __enter__(self) -> ActivationOffload:
        return self._enter(self._root() if self._root is not None else None)

    def _enter(self, root: nn.Module | None) -> ActivationOffload:
        if self._depth == 0:
            # The module whose forward opens the pass: its parameters and buffers (e.g. RoPE tables
            # passed into the blocks) are never copied.
            root_storages = _param_storages(root, recurse=True) if root is not None else frozenset()
            self._pass = _Pass(root_storages)
            if self._registered_blocks == 0:
                self._start_block(None)
        self._depth += 1
        hooks = saved_tensors_hooks(self._pack, self._unpack) if self._copies else None
        if hooks is not None:
            hooks.__enter__()
        self._hook_stack.append(hooks)
        return self

    def __exit__(self, *exc_info: object) -> None:
        hooks = self._hook_stack.pop()
        if hooks is not None:
            hooks.__exit__(*exc_info)
        self._depth -= 1
        if self._depth == 0:
            pass_ = self._pass
            self._pass = None
            if pass_ is not None and pass_.block >= 0:
                self._last_pass_blocks = pass_.block + 1
            self._poll()

    def mark_block(self) -> None:
        """Start the next block of the current forward (ends the one before).

        Without registered blocks the forward starts in block 0, so call it between blocks:
        ``for block in blocks: offload.mark_block(); h = block(h)`` makes the first call start block 1
        and leaves the prologue (embedding) in block 0.

        Raises:
            RuntimeError: outside a forward (the context is not entered).

        Example::

            >>> with offload:
            ...     h = embed(tokens)
            ...     for block in blocks:
            ...         offload.mark_block()
            ...         h = block(h)
        """
        if self._pass is None:
            raise RuntimeError("mark_block() is only meaningful inside `with offload:` (during a forward)")
        self._start_block(None)

    def register_blocks(self, blocks: Iterable[nn.Module]) -> None:
        """Use these modules as block boundaries: each forward call of one is a block.

        Tensors saved before the first block (embeddings) and after a block ends (between blocks, the
        head and the loss) stay on the device. Calls made during backward (checkpoint recomputation)
        are not blocks.

        Args:
            blocks (Iterable[nn.Module]): the model's repeated layers, in forward order.

        Raises:
            TypeError: an entry is not an ``nn.Module``.
            ValueError: an entry's activations are offloaded by another offloader already; nothing
                is hooked then.

        Example::

            >>> offload.register_blocks(model.blocks)
        """
        modules = list(blocks)
        for module in modules:
            if not isinstance(module, nn.Module):
                raise TypeError(f"register_blocks expects nn.Module entries, got {type(module).__name__}")
        check_not_offloaded_twice(modules, self, "ActivationOffload.register_blocks")
        for module in modules:
            _offloader_of_module[module] = self
            self._handles.append(module.register_forward_pre_hook(self._block_pre_hook))
            self._handles.append(module.register_forward_hook(self._block_post_hook, always_call=True))
        self._registered_blocks += len(modules)

    def attach(self, module: nn.Module) -> None:
        """Enter this object around every forward of ``module`` (no ``with`` needed).

        Forwards run without grad (evaluation) or during backward (recomputation) are left alone.
        Several modules may be attached, one inside another (a model and its sub-models): the
        outermost one running opens the forward pass, and its parameters and buffers are never copied.

        Args:
            module (nn.Module): the model whose forward produces the activations.

        Raises:
            ValueError: ``module``'s activations are offloaded by another offloader already.

        Example::

            >>> offload.attach(model)
            >>> causal_lm_loss(model(tokens), tokens).backward()
        """
        check_not_offloaded_twice([module], self, "ActivationOffload.attach")
        _offloader_of_module[module] = self
        self._root = weakref.ref(module)
        self._handles.append(module.register_forward_pre_hook(self._root_pre_hook))
        self._handles.append(module.register_forward_hook(self._root_post_hook, always_call=True))

    def remove(self) -> None:
        """Remove every hook this object installed and wait for its copies in flight.

        Example::

            >>> offload.remove()
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in [module for module, offload in _offloader_of_module.items() if offload is self]:
            del _offloader_of_module[module]
        self._registered_blocks = 0
        self._root = None
        with self._lock:
            for stored in self._pending:
                stored.d2h_done.synchronize()
        self._poll()

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        entered = torch.is_grad_enabled() and not _in_backward()
        self._root_entered.append(entered)
        if entered:
            self._enter(module)

    def _root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._root_entered.pop():
            self.__exit__(None, None, None)

    def _block_pre_hook(self, module: nn.Module, args: Any) -> None:
        pass_ = self._pass
        if pass_ is None and self._copies and not self._warned_outside and torch.is_grad_enabled() and not _in_backward():
            self._warned_outside = True
            warnings.warn(
                f"activation offload: block {type(module).__name__} ran with grad enabled outside an "
                "offloaded forward, so its activations stay on the device. Attach the model "
                "(offload_activations(model) or ActivationOffload.attach), or enter the offloader "
                "around the forward. Under fully_shard with CoherentOffload(activations=...), shard each "
                "block, then the model around them (which needs parameters of its own).",
                stacklevel=2,
            )
        if pass_ is None or _in_backward():
            return
        pass_.block_depth += 1
        if pass_.block_depth == 1:
            self._start_block(module)

    def _block_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        pass_ = self._pass
        if pass_ is None or _in_backward() or pass_.block_depth == 0:
            return
        pass_.block_depth -= 1
        if pass_.block_depth == 0:
            pass_.in_block = False
            pass_.offloading = False
            pass_.block_param_storages = frozenset()
            self._poll()

    def _expected_blocks(self) -> int | None:
        if self._last_pass_blocks is not None:
            return self._last_pass_blocks
        return self._registered_blocks or None

    def _block_is_offloaded(self, block: int) -> bool:
        if not self._copies or self.fraction == 0.0:
            return False
        n = self._expected_blocks()
        if n is None:
            return True
        keep = self.keep_last_blocks if isinstance(self.keep_last_blocks, int) else math.floor(self.keep_last_blocks * n)
        return block < min(math.floor(self.fraction * n), n - keep)

    def _start_block(self, module: nn.Module | None) -> None:
        pass_ = self._pass
        pass_.block += 1
        pass_.in_block = True
        pass_.offloading = self._block_is_offloaded(pass_.block)
        pass_.blocks.append([])
        pass_.block_param_storages = _param_storages(module, recurse=True) if module is not None else frozenset()
        if pass_.offloading:
            pass_.any_offloaded = True
        if self._cuda and pass_.any_offloaded:
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(self.device))
            pass_.forward_marks.append(mark)
            if len(pass_.forward_marks) > _CPU_LEAD_BLOCKS:
                pass_.forward_marks[0].synchronize()
        self._poll()

    # ------------------------------------------------------------------ pack
    def _pack(self, tensor: torch.Tensor) -> Any:
        pass_ = self._pass
        # Saves made while backward runs (reentrant checkpoint recomputation inside the context) are
        # consumed at once by that backward: copying them would only slow it down.
        if pass_ is None or _in_backward():
            return tensor.detach()
        self._poll()
        trigger = pass_.block
        if not self._is_activation(tensor, pass_):
            return self._keep(tensor, pass_, trigger)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        seen = pass_.storages.get(key)
        nbytes = storage.nbytes()
        if seen is not None and seen[0]() is storage:
            if seen[1] is None:
                return self._keep(tensor, pass_, trigger)
            stored = seen[1]()
            if stored is not None and stored.dtype != tensor.dtype:
                # A reinterpretation of an offloaded storage (rare): stay on the device.
                return self._keep(tensor, pass_, trigger)
            if stored is not None:
                stored.handles += 1
                self.stats.deduplicated_views += 1
                if trigger > stored.last_block:
                    # Saved again by a later block, which backward reaches first: reload it with that one.
                    pass_.blocks[trigger].append(weakref.ref(stored))
                    stored.last_block = trigger
                return _Saved(stored, tensor, trigger)
            # The graph that saved this storage before is gone: offload it afresh.
        else:
            self.stats.saved_bytes += nbytes
        if not pass_.offloading or nbytes < max(self.min_offload_bytes, 1) or nbytes % tensor.element_size():
            pass_.storages[key] = (weakref.ref(storage), None)
            return self._keep(tensor, pass_, trigger)
        stored = self._offload(tensor, pass_)
        pass_.storages[key] = (weakref.ref(storage), weakref.ref(stored))
        stored.handles += 1
        return _Saved(stored, tensor, trigger)

    def _is_activation(self, tensor: torch.Tensor, pass_: _Pass) -> bool:
        if type(tensor) is not torch.Tensor or tensor.device != self.device or tensor.layout != torch.strided:
            return False
        if tensor.is_conj() or tensor.is_neg():
            return False
        # F.linear saves weight.t(): a plain tensor viewing the parameter.
        if isinstance(tensor._base, nn.Parameter):
            return False
        key = tensor.untyped_storage().data_ptr()
        return key not in pass_.block_param_storages and key not in pass_.root_param_storages

    def _keep(self, tensor: torch.Tensor, pass_: _Pass, trigger: int) -> Any:
        self.stats.kept_tensors += 1
        # Detached: a saved output that held on to itself would hold its own grad_fn, a cycle
        # through C++ that gc cannot break, so a forward never backwarded would never be freed.
        # Unpacking re-attaches the grad_fn, so nothing is lost.
        if trigger < 0 or not pass_.any_offloaded:
            return tensor.detach()
        return _Kept(tensor.detach(), pass_, trigger)

    def _offload(self, tensor: torch.Tensor, pass_: _Pass) -> _Stored:
        stored = _Stored(pass_, pass_.block, tensor, self._pool)
        # Not TransferEngine.d2h: it record_stream()s the source on the D2H stream, and the allocator
        # then holds freed memory until that stream drains everything queued at the time of the free,
        # which, with copies lagging compute, is long after this copy landed. Here the original stays
        # referenced until its own event is seen complete (_poll), then is freed for immediate reuse.
        with record_function(_D2H_LABEL):
            if self._cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                self._d2h_stream.wait_event(ready)
                if stored.host_read_done is not None:
                    self._d2h_stream.wait_event(stored.host_read_done)
                    stored.host_read_done = None
                with torch.cuda.stream(self._d2h_stream):
                    stored.host.copy_(stored.device_data, non_blocking=True)
                stored.d2h_done = torch.cuda.Event()
                stored.d2h_done.record(self._d2h_stream)
                with self._lock:
                    self._pending.append(stored)
                    self._pending_bytes += stored.nbytes
            else:
                stored.host.copy_(stored.device_data)
                stored.device_data = None
                stored.is_original = False
        pass_.blocks[stored.block].append(weakref.ref(stored))
        # Counted in the engine too: its counters are the process's record of what crossed the link.
        for stats in (self.stats, self._engine.stats):
            stats.d2h_copies += 1
            stats.d2h_bytes += stored.nbytes
        self.stats.offloaded_bytes += stored.nbytes
        self._bound_inflight()
        return stored

    def _poll(self) -> None:
        """Release the device copies whose D2H copy has landed (oldest first: one stream, in order)."""
        if not self._cuda:
            return
        with self._lock:
            while self._pending and self._pending[0].d2h_done.query():
                self._landed(self._pending.popleft())

    def _bound_inflight(self) -> None:
        """Wait, oldest first, until at most ``max_inflight_bytes`` of device copies are in flight.

        Waiting here makes the forward run at the link's pace where it outruns the link, instead of
        holding every activation on the device until its copy lands after the forward (or not before
        backward needs it, so that nothing is freed at all).
        """
        if not self._cuda:
            return
        with self._lock:
            while self._pending and self._pending_bytes > self.max_inflight_bytes:
                stored = self._pending.popleft()
                self.stats.inflight_waits += 1
                stored.d2h_done.synchronize()
                self._landed(stored)

    def _landed(self, stored: _Stored) -> None:
        self._pending_bytes -= stored.nbytes
        if stored.is_original and not stored.retained:
            stored.device_data = None
            stored.is_original = False

    # ------------------------------------------------------------------ unpack
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            self._reach(packed.pass_, packed.trigger)
            return packed.tensor
        stored = packed.stored
        self._reach(stored.pass_, packed.trigger)
        if stored.device_data is None:
            self._load(stored, ahead=False)
        data = stored.device_data
        if stored.h2d is not None:
            # This stream waits for this tensor's reload only, and marks the buffer as used here.
            stored.h2d.wait(torch.cuda.current_stream(self.device) if self._cuda else None)
        tensor = data.as_strided(packed.size, packed.stride, packed.offset)
        task = torch._C._current_graph_task_id()
        if stored.unpack_task != task:
            stored.unpack_task = task
            stored.unpacked = 0
        stored.unpacked += 1
        if stored.unpacked >= stored.handles:
            self._release_device_copy(stored)
        return tensor

    def _reach(self, pass_: _Pass, trigger: int) -> None:
        """Backward reached a tensor saved in (or after) block ``trigger``: prefetch the blocks before it."""
        task = torch._C._current_graph_task_id()
        if task != pass_.backward_task:
            pass_.backward_task = task
            pass_.lowest_reached = _NONE_YET
            pass_.lowest_issued = _NONE_YET
            pass_.backward_marks = {}
        if trigger >= pass_.lowest_reached or trigger < 0:
            return
        pass_.lowest_reached = trigger
        if self._cuda:
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(self.device))
            pass_.backward_marks[trigger] = mark
            previous = pass_.backward_marks.pop(trigger + _CPU_LEAD_BLOCKS, None)
            if previous is not None:
                previous.synchronize()
            self._poll()
        lowest = max(trigger - self.prefetch_blocks, 0)
        for block in range(min(trigger, pass_.lowest_issued - 1), lowest - 1, -1):
            for ref in pass_.blocks[block]:
                stored = ref()
                if stored is not None:
                    self._load(stored, ahead=True)
        pass_.lowest_issued = min(pass_.lowest_issued, lowest)

    def _load(self, stored: _Stored, *, ahead: bool) -> None:
        if stored.device_data is not None:
            if stored.is_original and not stored.retained:
                stored.retained = True
                self.stats.reused_device_copies += 1
            return
        if self._cuda:
            self._engine.h2d_stream.wait_event(stored.d2h_done)
        stored.h2d = self._engine.h2d(stored.host, label=_H2D_LABEL)
        stored.device_data = stored.h2d.tensor
        if self._cuda:
            stored.host_read_done = torch.cuda.Event()
            stored.host_read_done.record(self._engine.h2d_stream)
        self.stats.h2d_copies += 1
        self.stats.h2d_bytes += stored.nbytes
        if ahead:
            self.stats.prefetched_copies += 1
        else:
            self.stats.on_demand_copies += 1

    def _release_device_copy(self, stored: _Stored) -> None:
        if stored.is_original and self._cuda and not stored.d2h_done.query():
            # Its D2H copy still reads it: the allocator must not hand the memory out before that lands.
            stored.device_data.record_stream(self._d2h_stream)
        stored.device_data = None
        stored.h2d = None
        stored.is_original = False


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def offload_activations(
    module: nn.Module | None = None,
    *,
    blocks: Iterable[nn.Module] | None = None,
    min_offload_bytes: int = 1 << 20,
    prefetch_blocks: int = 1,
    keep_last_blocks: int | float = 0,
    fraction: float = 1.0,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    platform: Platform | PlatformKind | str | None = None,
    device: torch.device | str | int | None = None,
) -> ActivationOffload:
    """Offload the activations of ``module`` (every forward) or of a ``with`` block to host memory.

    With a module, its forward enters the returned :class:`ActivationOffload` automatically and its
    blocks (``blocks``, or the first non-empty ``nn.ModuleList`` among ``module.blocks``,
    ``module.layers``, ``module.model.layers``) are the offload and prefetch units; parameters and
    buffers of the module are never copied. Works on plain modules and on FSDP1/FSDP2-wrapped ones
    (call it after wrapping). Without a module, use the result as a context manager around forward.

    Args:
        module (nn.Module | None): the model to attach to; None for a bare context manager.
        blocks (Iterable[nn.Module] | None): the block modules, in forward order.
        min_offload_bytes, prefetch_blocks, keep_last_blocks, fraction, max_inflight_bytes, platform,
            device: see :class:`ActivationOffload`.

    Returns:
        ActivationOffload: the offloader; ``.stats`` counts copies, ``.remove()`` detaches it.

    Raises:
        ValueError: a knob out of range (see :class:`ActivationOffload`), ``module`` given without
            ``blocks`` and no block list found, or ``module`` or a block already offloaded by another
            offloader (an earlier ``offload_activations`` not ``.remove()``-d, or ``fully_shard`` with
            ``CoherentOffload(activations=...)``); raised before anything is allocated or hooked.
        TypeError: ``module`` is not an ``nn.Module`` or a block is not one.

    Example::

        >>> model = build_model("anchor-1.6b", device="cuda", dtype=torch.bfloat16)
        >>> offload = offload_activations(model, prefetch_blocks=1, keep_last_blocks=1)
        >>> loss = causal_lm_loss(model(tokens), tokens)
        >>> loss.backward()
        >>> offload.stats.d2h_bytes > 0
        True
    """
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"offload_activations expects an nn.Module or None, got {type(module).__name__}")
    _check_knobs(min_offload_bytes, prefetch_blocks, keep_last_blocks, fraction, max_inflight_bytes)
    if module is not None and blocks is None:
        blocks = _find_blocks(module)
    block_list = list(blocks) if blocks is not None else []
    for block in block_list:
        if not isinstance(block, nn.Module):
            raise TypeError(f"blocks must be nn.Module instances, got {type(block).__name__}")
    check_not_offloaded_twice([*([module] if module is not None else []), *block_list], None, "offload_activations")
    offload = ActivationOffload(
        min_offload_bytes=min_offload_bytes,
        prefetch_blocks=prefetch_blocks,
        keep_last_blocks=keep_last_blocks,
        fraction=fraction,
        max_inflight_bytes=max_inflight_bytes,
        platform=platform,
        device=device,
    )
    offload._made_by = _MADE_BY_CALL
    # The module's hooks go first: its forward must open the pass before a block can start.
    if module is not None:
        offload.attach(module)
    if block_list:
        offload.register_blocks(block_list)
    return offload
