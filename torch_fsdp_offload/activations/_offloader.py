""":class:`ActivationOffload`: the saved-tensor hooks that decide what to offload and when to reload it.

Every saved tensor of an offloaded block is handed to :class:`~._copies.StorageCopies`, which copies
it to pinned host memory as soon as it is saved. In backward, when the first tensor of block ``i`` is
needed, the reloads of blocks ``i - 1 .. i - prefetch_blocks`` are issued, so they land while block
``i`` computes; the compute stream waits on the reload of exactly the tensor it unpacks.

Block boundaries come from hooks on block modules, and the forward pass from hooks on the model (or a
``with`` block); both are registered by :meth:`ActivationOffload.attach` and
:meth:`ActivationOffload.register_blocks`, the one registration path of every front door.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.fsdp import FSDPModule

from torch_fsdp_offload._helpers.compiled import compiled_regions, fsdp_hooks_traced
from torch_fsdp_offload._helpers.tensors import current_graph_task_id, in_backward
from torch_fsdp_offload.activations._ownership import MadeBy, check_can_hook, forget_owner, record_owner
from torch_fsdp_offload.activations._copies import ActivationOffloadStats, DEFAULT_MAX_INFLIGHT_BYTES, StorageCopies
from torch_fsdp_offload.activations._saved_tensors import (
    CPU_LEAD_BLOCKS,
    ForwardPass,
    KeptTensor,
    NO_BLOCK_YET,
    OffloadedView,
    param_storages,
)
from torch_fsdp_offload.platform import detect_platform, Platform, PlatformKind

__all__ = [
    "ActivationOffload",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DEFAULT_PREFETCH_BLOCKS",
    "check_knobs",
    "check_outside_compiled_regions",
]

# Blocks ahead of the one backward is in whose offloaded activations are reloaded.
DEFAULT_PREFETCH_BLOCKS = 1
# Storages smaller than this stay on the device: their copies would run far below link speed.
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20


def check_knobs(
    min_offload_bytes: Any, prefetch_blocks: Any, keep_last_blocks: Any, fraction: Any, max_inflight_bytes: Any
) -> None:
    """Refuse knobs of :class:`ActivationOffload` out of range, before anything is allocated.

    Raises:
        ValueError: naming the knob, its range and a usual value.
    """
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


def check_outside_compiled_regions(modules: Iterable[nn.Module], caller: str) -> None:
    """Refuse, before anything is hooked, modules to hook (a model and its blocks) one of which a
    ``torch.compile``'d module among them calls from inside its compiled code: a model compiled as a
    whole around its blocks.

    The hooks run outside any compiled graph: those of a module whose call opens one run before and
    after its graph, but a module called from inside the graph would split it into two and run eager
    code between them, at every call. FSDP2 modules are let through where FSDP2's hooks are not
    traced (:func:`fsdp_hooks_traced`): those hooks split the graph at the same places.

    Raises:
        ValueError: naming the compiled module, the module inside it and how to compile instead.
    """
    modules = list(modules)
    split_by_fsdp = not fsdp_hooks_traced()
    hooked = [module for module in modules if not (split_by_fsdp and isinstance(module, FSDPModule))]
    for model in modules:
        for region in compiled_regions(model):
            inside = [m for m in hooked if m is not region and any(sub is m for sub in region.modules())]
            if inside:
                raise ValueError(
                    f"{caller}: {type(region).__name__} is torch.compile'd as a whole, and "
                    f"{type(inside[0]).__name__}, whose activations are offloaded block by block, runs "
                    "inside it. The offloader marks each block from Python, outside compiled code: the "
                    "compiled graph would break at every block and run the code between blocks "
                    "eagerly. Compile each block instead (block.compile() on each), or shard the "
                    "blocks with fully_shard, whose hooks split the graph at the same places"
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


class ActivationOffload:
    """Offloads the activations autograd saves in forward to pinned host memory and prefetches them
    back, block by block, during backward.

    Enter it around each forward (or attach it to a module with :func:`offload_activations`, which
    enters it around that module's forward); run backward after leaving it. Block boundaries come
    from modules given to :meth:`register_blocks` (each call of one starts a block) or from
    :meth:`mark_block` calls; without either, the whole forward is one block. Create it once and
    reuse it every step: its pinned buffers are sized by the first step and reused by the next ones.

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

    With ``torch.compile``, compile each block (``block.compile()``): the hooks run outside the
    compiled code and break no graph. In a model compiled as a whole they split its graph at each
    block, as FSDP2's hooks do: around FSDP2 blocks that adds no break; around others, hooking a
    model already compiled so is refused.

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
            far below link speed. Default :data:`DEFAULT_MIN_OFFLOAD_BYTES` (1 MiB).
        prefetch_blocks (int): how many blocks ahead of the one backward is in are reloaded (>= 1).
            Each costs one block of activations in device memory. Default
            :data:`DEFAULT_PREFETCH_BLOCKS`.
        keep_last_blocks (int | float): the last blocks kept on the device, as a count or as a fraction
            of the blocks. Default 0.
        fraction (float): the fraction of blocks offloaded, counted from the first. Default 1.0.
        max_inflight_bytes (int): device bytes whose copy to the host may be in flight at once before
            the forward waits for the oldest (>= 0). Default :data:`DEFAULT_MAX_INFLIGHT_BYTES`
            (1 GiB). Larger hides more of the copies
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
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        prefetch_blocks: int = DEFAULT_PREFETCH_BLOCKS,
        keep_last_blocks: int | float = 0,
        fraction: float = 1.0,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        platform: Platform | PlatformKind | str | None = None,
        device: torch.device | str | int | None = None,
    ) -> None:
        check_knobs(min_offload_bytes, prefetch_blocks, keep_last_blocks, fraction, max_inflight_bytes)
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_blocks = prefetch_blocks
        self.keep_last_blocks = keep_last_blocks
        self.fraction = float(fraction)
        self._max_inflight_bytes = max_inflight_bytes
        self.platform = _resolve_platform(platform, device)
        self.device = self.platform.device
        self.stats = ActivationOffloadStats()
        self._cuda = self.platform.copies_needed and self.device.type == "cuda"
        # None where nothing is copied (UNIFIED and HOST_ONLY platforms): the hooks are not installed.
        self._copies = (
            StorageCopies(self.device, max_inflight_bytes=max_inflight_bytes, stats=self.stats, asynchronous=self._cuda)
            if self.platform.copies_needed
            else None
        )
        self._pass: ForwardPass | None = None
        self._depth = 0
        self._hook_stack: list[saved_tensors_hooks | None] = []
        # Weak: the module's hooks refer to this object, which must not keep the module alive.
        self._root: weakref.ref[nn.Module] | None = None
        self._registered_blocks = 0
        self._last_pass_blocks: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # The modules it hooked, weakly: released from the ownership record at remove().
        self._hooked_modules: list[weakref.ReferenceType[nn.Module]] = []
        self._root_entered: list[bool] = []
        self._warned_outside = False
        # How it was made: names it when a second offloader is refused. Front doors other than this
        # class set it right after construction.
        self._made_by = MadeBy.CLASS

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory its buffers hold (in use and free); stops growing after the first step."""
        return self._copies.free_list.held_bytes if self._copies is not None else 0

    @property
    def active(self) -> bool:
        """Whether copies happen at all (False on UNIFIED and HOST_ONLY platforms: a no-op)."""
        return self._copies is not None

    @property
    def max_inflight_bytes(self) -> int:
        """Device bytes whose copy to the host may be in flight at once (see the class docstring)."""
        return self._max_inflight_bytes

    @max_inflight_bytes.setter
    def max_inflight_bytes(self, value: int) -> None:
        self._max_inflight_bytes = value
        if self._copies is not None:
            self._copies.max_inflight_bytes = value

    def _poll(self) -> None:
        """Release the device copies whose copy to the host has landed."""
        if self._copies is not None:
            self._copies.poll()

    # ------------------------------------------------------------------ entering and blocks
    def __enter__(self) -> ActivationOffload:
        return self._enter(self._root() if self._root is not None else None)

    def _enter(self, root: nn.Module | None) -> ActivationOffload:
        if self._depth == 0:
            # The module whose forward opens the pass: its parameters and buffers (e.g. RoPE tables
            # passed into the blocks) are never copied.
            root_storages = param_storages(root, recurse=True) if root is not None else frozenset()
            self._pass = ForwardPass(root_storages)
            if self._registered_blocks == 0:
                self._start_block(None)
        self._depth += 1
        hooks = None
        if self._copies is not None:
            # Plain Python, never compiled: eager code run under a torch.compile'd call (a compiled
            # model's code between FSDP's hooks, where its graph breaks) saves through them too, and
            # dynamo would compile each call as a frame of its own, breaking it at every storage read.
            pack, unpack = torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack)
            hooks = saved_tensors_hooks(pack, unpack)
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
            ValueError: an entry's activations are offloaded by another offloader already, or an
                entry runs inside a module ``torch.compile``-d as a whole (compile each block
                instead); nothing is hooked then.

        Example::

            >>> offload.register_blocks(model.blocks)
        """
        self._hook(list(blocks), as_blocks=True, caller="ActivationOffload.register_blocks")

    def attach(self, module: nn.Module) -> None:
        """Enter this object around every forward of ``module`` (no ``with`` needed).

        Forwards run without grad (evaluation) or during backward (recomputation) are left alone.
        Several modules may be attached, one inside another (a model and its sub-models): the
        outermost one running opens the forward pass, and its parameters and buffers are never copied.

        Args:
            module (nn.Module): the model whose forward produces the activations.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: ``module``'s activations are offloaded by another offloader already, or a
                block registered with this object runs inside ``module``'s compiled code (``module``
                ``torch.compile``-d as a whole: compile each block instead).

        Example::

            >>> offload.attach(model)
            >>> causal_lm_loss(model(tokens), tokens).backward()
        """
        self._hook([module], as_blocks=False, caller="ActivationOffload.attach")

    def _hook(self, modules: list[nn.Module], *, as_blocks: bool, caller: str) -> None:
        """Hook ``modules`` as blocks or as the model, once all of them passed the checks."""
        check_can_hook(modules, self, caller)
        hooked = (module for module in (ref() for ref in self._hooked_modules) if module is not None)
        check_outside_compiled_regions([*hooked, *modules], caller)
        for module in modules:
            record_owner(module, self)
            self._hooked_modules.append(weakref.ref(module))
            if as_blocks:
                pre_hook, post_hook = self._block_pre_hook, self._block_post_hook
            else:
                self._root = weakref.ref(module)
                pre_hook, post_hook = self._root_pre_hook, self._root_post_hook
            # Plain Python, as FSDP2's own hooks are: dynamo would compile the hooks of a compiled
            # block as frames of their own, and their bookkeeping (storage pointers, the backward's
            # task id) breaks every such frame into pieces, some compiled again each step.
            pre_hook, post_hook = torch.compiler.disable(pre_hook), torch.compiler.disable(post_hook)
            self._handles.append(module.register_forward_pre_hook(pre_hook))
            self._handles.append(module.register_forward_hook(post_hook, always_call=True))
        if as_blocks:
            self._registered_blocks += len(modules)

    def remove(self) -> None:
        """Remove every hook this object installed and wait for its copies in flight.

        Example::

            >>> offload.remove()
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        forget_owner([module for module in (ref() for ref in self._hooked_modules) if module is not None], self)
        self._hooked_modules.clear()
        self._registered_blocks = 0
        self._root = None
        if self._copies is not None:
            self._copies.drain()

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        entered = torch.is_grad_enabled() and not in_backward()
        self._root_entered.append(entered)
        if entered:
            self._enter(module)

    def _root_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._root_entered.pop():
            self.__exit__(None, None, None)

    def _block_pre_hook(self, module: nn.Module, args: Any) -> None:
        pass_ = self._pass
        forward_outside_pass = pass_ is None and torch.is_grad_enabled() and not in_backward()
        if forward_outside_pass and self._copies is not None and not self._warned_outside:
            self._warned_outside = True
            warnings.warn(
                f"activation offload: block {type(module).__name__} ran with grad enabled outside an "
                "offloaded forward, so its activations stay on the device. Attach the model "
                "(offload_activations(model) or ActivationOffload.attach), or enter the offloader "
                "around the forward. Under fully_shard with CoherentOffload(activations=...), shard each "
                "block, then the model around them (which needs parameters of its own).",
                stacklevel=2,
            )
        if pass_ is None or in_backward():
            return
        pass_.block_depth += 1
        if pass_.block_depth == 1:
            self._start_block(module)

    def _block_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        pass_ = self._pass
        if pass_ is None or in_backward() or pass_.block_depth == 0:
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
        if self._copies is None or self.fraction == 0.0:
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
        pass_.block_param_storages = param_storages(module, recurse=True) if module is not None else frozenset()
        if pass_.offloading:
            pass_.any_offloaded = True
        if self._cuda and pass_.any_offloaded:
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(self.device))
            pass_.forward_marks.append(mark)
            if len(pass_.forward_marks) > CPU_LEAD_BLOCKS:
                pass_.forward_marks[0].synchronize()
        self._poll()

    # ------------------------------------------------------------------ pack
    def _pack(self, tensor: torch.Tensor) -> Any:
        pass_ = self._pass
        # Saves made while backward runs (reentrant checkpoint recomputation inside the context) are
        # consumed at once by that backward: copying them would only slow it down.
        if pass_ is None or in_backward():
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
                return OffloadedView(stored, tensor, trigger)
            # The graph that saved this storage before is gone: offload it afresh.
        else:
            self.stats.saved_bytes += nbytes
        if not pass_.offloading or nbytes < max(self.min_offload_bytes, 1) or nbytes % tensor.element_size():
            pass_.storages[key] = (weakref.ref(storage), None)
            return self._keep(tensor, pass_, trigger)
        stored = self._copies.copy_out(tensor, pass_)
        pass_.storages[key] = (weakref.ref(storage), weakref.ref(stored))
        stored.handles += 1
        return OffloadedView(stored, tensor, trigger)

    def _is_activation(self, tensor: torch.Tensor, pass_: ForwardPass) -> bool:
        if type(tensor) is not torch.Tensor or tensor.device != self.device or tensor.layout != torch.strided:
            return False
        if tensor.is_conj() or tensor.is_neg():
            return False
        # F.linear saves weight.t(): a plain tensor viewing the parameter.
        if isinstance(tensor._base, nn.Parameter):
            return False
        key = tensor.untyped_storage().data_ptr()
        return key not in pass_.block_param_storages and key not in pass_.root_param_storages

    def _keep(self, tensor: torch.Tensor, pass_: ForwardPass, trigger: int) -> Any:
        self.stats.kept_tensors += 1
        # Detached: a saved output that held on to itself would hold its own grad_fn, a cycle
        # through C++ that gc cannot break, so a forward never backwarded would never be freed.
        # Unpacking re-attaches the grad_fn, so nothing is lost.
        if trigger < 0 or not pass_.any_offloaded:
            return tensor.detach()
        return KeptTensor(tensor.detach(), pass_, trigger)

    # ------------------------------------------------------------------ unpack
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, KeptTensor):
            self._reach(packed.pass_, packed.trigger)
            return packed.tensor
        stored = packed.stored
        self._reach(stored.pass_, packed.trigger)
        if stored.device_data is None:
            self._copies.load(stored, ahead=False)
        data = stored.device_data
        # This stream waits for this tensor's reload only, and marks the buffer as used here.
        self._copies.wait_for_reload(stored)
        tensor = data.as_strided(packed.size, packed.stride, packed.offset)
        task = current_graph_task_id()
        if stored.unpack_task != task:
            stored.unpack_task = task
            stored.unpacked = 0
        stored.unpacked += 1
        if stored.unpacked >= stored.handles:
            self._copies.release_device_copy(stored)
        return tensor

    def _reach(self, pass_: ForwardPass, trigger: int) -> None:
        """Backward reached a tensor saved in (or after) block ``trigger``: prefetch the blocks before it."""
        task = current_graph_task_id()
        if task != pass_.backward_task:
            pass_.backward_task = task
            pass_.lowest_reached = NO_BLOCK_YET
            pass_.lowest_issued = NO_BLOCK_YET
            pass_.backward_marks = {}
        if trigger >= pass_.lowest_reached or trigger < 0:
            return
        pass_.lowest_reached = trigger
        if self._cuda:
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(self.device))
            pass_.backward_marks[trigger] = mark
            previous = pass_.backward_marks.pop(trigger + CPU_LEAD_BLOCKS, None)
            if previous is not None:
                previous.synchronize()
            self._poll()
        lowest = max(trigger - self.prefetch_blocks, 0)
        for block in range(min(trigger, pass_.lowest_issued - 1), lowest - 1, -1):
            for ref in pass_.blocks[block]:
                stored = ref()
                if stored is not None:
                    self._copies.load(stored, ahead=True)
        pass_.lowest_issued = min(pass_.lowest_issued, lowest)
