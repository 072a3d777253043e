"""Host memory for offloading: exact-size pinned tensors, managed allocations, zero-copy device views.

PyTorch's pinned memory (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``) comes from its
caching host allocator, which rounds every block up to a power of two: a 2.1 GiB shard pins 4 GiB, and
offloading a model that nearly fills host RAM fails halfway. :func:`pinned_empty` instead maps exactly
the pages it needs (2 MiB aligned and huge-page backed once a buffer is that large), pins them with
``cudaHostRegister`` and keeps freed blocks in a pool for reuse, one size class per page-rounded size.
Without an accelerator the same code returns page-aligned, unpinned host tensors, so its logic runs in
CPU tests.

:func:`managed_empty` hands out ``cudaMallocManaged`` memory as a CUDA tensor plus a CPU view of the same
bytes (``TransferTensor(memory="managed")`` is built on it).
:func:`device_view` turns pinned host memory into a CUDA tensor that reads it over the link, no copy.

Every allocation is checked against what the machine can give (``MemAvailable``, ``ulimit -l``, free GPU
memory) before anything is allocated, and :func:`memory_stats` reports what is live, so tests can show
that the totals return to where they started.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import os
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from torch_fsdp_offload.platform import (
    detect_platform,
    read_host_available_bytes,
    read_locked_memory_limit_bytes,
    resolve_device,
)

__all__ = [
    "ENV_HOST_MEMORY",
    "HostMemoryError",
    "ManagedBuffer",
    "PinnedFreeList",
    "check_host_capacity",
    "device_view",
    "empty_cache",
    "host_capacity_bytes",
    "managed_empty",
    "memory_stats",
    "pinned_empty",
]

PAGE_SIZE = mmap.PAGESIZE
# Replaces MemAvailable in the capacity checks. For machines whose MemAvailable understates what they
# can give: VMs whose memory is hot-plugged as it is touched (a 2 x H200 VM reads 31 GiB at start and
# grows to 255 GiB), or hosts whose page cache the kernel will drop but does not count as available.
ENV_HOST_MEMORY = "TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES"
_BYTE_UNITS = {
    "": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
HUGE_PAGE_SIZE = 2 << 20
# cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process, as in
# torch.cuda._pin_memory_utils.
_CUDA_HOST_REGISTER_PORTABLE = 1
# cudaMemAttachGlobal (a #define in cuda_runtime_api.h): any stream on any device may access the memory.
_CUDA_MEM_ATTACH_GLOBAL = 1
# Linux capability that lets a process lock memory beyond RLIMIT_MEMLOCK (include/uapi/linux/capability.h).
_CAP_IPC_LOCK = 14


class HostMemoryError(MemoryError):
    """An allocation asked for more host, locked or managed memory than the machine can give.

    The message names the request, what is available, the limit that applies and how to fix it.

    Example::

        >>> try:
        ...     shards = pinned_empty(total_numel, torch.bfloat16)
        ... except HostMemoryError as error:
        ...     print(error)  # "Cannot pin 80.0 GiB of host memory ... Raise the limit ..."
    """


def _format_bytes(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _locked_memory_limit_bytes() -> int | None:
    """The ``ulimit -l`` that applies to this process; None when unlimited or not enforced for it."""
    if _has_ipc_lock_capability():
        return None
    return read_locked_memory_limit_bytes()


def _has_ipc_lock_capability() -> bool:
    # The kernel does not apply RLIMIT_MEMLOCK to a process holding CAP_IPC_LOCK.
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        return False
    return False


def _parse_byte_size(text: str, name: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(
            f"{name}={text!r} is not a byte size: give plain bytes (e.g. 274877906944) or a number "
            "with a unit, B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), "
            "e.g. 256GiB"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def host_capacity_bytes() -> tuple[int | None, str]:
    """Host memory the capacity checks allow, and where the figure comes from.

    ``MemAvailable`` from ``/proc/meminfo``, unless the environment variable
    ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES`` (:data:`ENV_HOST_MEMORY`) is set: then its value replaces
    it, in bytes or with a unit (``"274877906944"``, ``"256GiB"``, ``"200 GB"``). Set it where
    ``MemAvailable`` understates what the machine can give, e.g. on VMs whose memory is hot-plugged as
    it is touched. It is read on every call.

    Returns:
        tuple[int | None, str]: the bytes (None when ``/proc/meminfo`` cannot be read and the variable
        is unset) and a description of the source for messages.

    Raises:
        ValueError: if the variable is set but is not a byte size.

    Example::

        >>> os.environ[ENV_HOST_MEMORY] = "256GiB"
        >>> host_capacity_bytes()
        (274877906944, 'TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES=256GiB')
    """
    override = os.environ.get(ENV_HOST_MEMORY, "").strip()
    if override:
        return _parse_byte_size(override, ENV_HOST_MEMORY), f"{ENV_HOST_MEMORY}={override}"
    return read_host_available_bytes(), "MemAvailable in /proc/meminfo"


def check_host_capacity(nbytes: int, *, pinned: bool, what: str) -> None:
    """Check that ``nbytes`` more bytes of host memory can be allocated, before allocating them.

    The request is compared with ``MemAvailable`` (or ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES`` where
    set, see :func:`host_capacity_bytes`) and, for pinned memory, with the locked-memory limit
    (``ulimit -l``) minus what this library has pinned already. :func:`pinned_empty` calls it for every
    new block; callers that are about to allocate many buffers can call it once with the total.

    Args:
        nbytes (int): bytes about to be allocated.
        pinned (bool): whether they will be page-locked (pinned); then ``ulimit -l`` applies as well.
        what (str): what the memory is for, used in the error message (e.g. ``"parameter shards"``).

    Raises:
        ValueError: if ``nbytes`` is negative, or ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES`` is not a
            byte size.
        HostMemoryError: if the request exceeds ``MemAvailable`` (or the override) or the
            locked-memory limit; the
            message gives the requested, available and limit figures and the fix.

    Example::

        >>> check_host_capacity(64 << 20, pinned=True, what="optimizer state")
    """
    if nbytes < 0:
        raise ValueError(f"check_host_capacity: nbytes must be >= 0, got {nbytes}")
    available, source = host_capacity_bytes()
    if available is not None and nbytes > available:
        raise HostMemoryError(
            f"Cannot allocate {_format_bytes(nbytes)} of host memory for {what}: only "
            f"{_format_bytes(available)} is available ({source}). Offload less "
            "(lower the offload fraction, or keep gradients/optimizer state on the GPU), free host "
            "memory, or use a machine with more host RAM. If this machine can give more than "
            f"MemAvailable says (memory hot-plugged as it is used), set {ENV_HOST_MEMORY} to the "
            "host memory to allow, e.g. 256GiB."
        )
    if not pinned:
        return
    limit = _locked_memory_limit_bytes()
    if limit is None:
        return
    already_locked = _pinned_pool.locked_bytes()
    if already_locked + nbytes > limit:
        raise HostMemoryError(
            f"Cannot pin {_format_bytes(nbytes)} of host memory for {what}: the locked-memory limit "
            f"(ulimit -l, RLIMIT_MEMLOCK) is {_format_bytes(limit)} and torch_fsdp_offload already "
            f"holds {_format_bytes(already_locked)} pinned. Raise the limit (`ulimit -l unlimited`; "
            "in docker `--ulimit memlock=-1`) or lower the offload fraction."
        )


@dataclasses.dataclass(eq=False)
class _HostBlock:
    """One page-aligned anonymous mapping, pinned or not, owned by the pool while it lives."""

    mapping: mmap.mmap
    offset: int  # start of the aligned region inside ``mapping``
    ptr: int
    capacity: int  # bytes of the aligned region: the request rounded up to whole pages
    pinned: bool


def _mapping_address(mapping: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # release the export so the mapping can be closed later


def _cuda_error_string(result: Any) -> str:
    """Message for a ``torch.cuda.cudart()`` result (a pybind enum, which does not convert from int)."""
    return f"{torch.cuda.cudart().cudaGetErrorString(result)} (error {int(result)})"


class _HostPool:
    """Free host blocks by (capacity, pinned), and the counters behind :func:`memory_stats`.

    A tensor handed out holds a ``memoryview`` of its block; a finalizer on that view returns the
    block to the free list when the tensor's storage dies (the storage is the last owner of the view).
    The lock is re-entrant because a finalizer can run inside an allocation (garbage collection).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._free: dict[tuple[int, bool], list[_HostBlock]] = {}
        self.live_bytes = 0
        self.live_count = 0
        self.live_pinned_bytes = 0
        self.live_pinned_count = 0
        self.cached_bytes = 0
        self.cached_count = 0
        self.reserved_bytes = 0
        self.locked = 0

    def locked_bytes(self) -> int:
        with self._lock:
            return self.locked

    def allocate(self, nbytes: int, pinned: bool, device: torch.device | None) -> memoryview:
        capacity = _round_up(nbytes, PAGE_SIZE)
        block = self._take_free(capacity, pinned)
        if block is None:
            block = self._new_block(capacity, pinned, device)
        with self._lock:
            self.live_bytes += nbytes
            self.live_count += 1
            if pinned:
                self.live_pinned_bytes += nbytes
                self.live_pinned_count += 1
        view = memoryview(block.mapping)[block.offset : block.offset + nbytes]
        finalizer = weakref.finalize(view, self._give_back, block, nbytes)
        # At interpreter exit the OS reclaims the memory; CUDA may already be torn down.
        finalizer.atexit = False
        return view

    def _take_free(self, capacity: int, pinned: bool) -> _HostBlock | None:
        with self._lock:
            free_blocks = self._free.get((capacity, pinned))
            if not free_blocks:
                return None
            block = free_blocks.pop()
            self.cached_bytes -= capacity
            self.cached_count -= 1
            return block

    def _new_block(self, capacity: int, pinned: bool, device: torch.device | None) -> _HostBlock:
        what = f"a {_format_bytes(capacity)} {'pinned' if pinned else 'host'} buffer"
        try:
            check_host_capacity(capacity, pinned=pinned, what=what)
        except HostMemoryError:
            # Cached blocks of other sizes may be what stands in the way: give them back and retry.
            if not self.empty():
                raise
            check_host_capacity(capacity, pinned=pinned, what=what)
        huge = capacity >= HUGE_PAGE_SIZE
        # Over-map by (2 MiB - 1 page) so that a 2 MiB-aligned region of ``capacity`` bytes fits; the
        # slack is address space only, never touched, so it costs no memory.
        mapping = mmap.mmap(-1, capacity + (HUGE_PAGE_SIZE - PAGE_SIZE if huge else 0), flags=mmap.MAP_PRIVATE)
        base = _mapping_address(mapping)
        offset = (-base) % HUGE_PAGE_SIZE if huge else 0
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, capacity)
        block = _HostBlock(mapping, offset, base + offset, capacity, pinned)
        if pinned:
            if hasattr(mmap, "MADV_DONTFORK"):
                # Forked children (DataLoader workers) cannot use CUDA, and without this the kernel
                # may copy each DMA-pinned page into every child at fork (early copy-on-write).
                mapping.madvise(mmap.MADV_DONTFORK, offset, capacity)
            self._register(block, device)
        with self._lock:
            self.reserved_bytes += capacity
            if pinned:
                self.locked += capacity
        return block

    @staticmethod
    def _register(block: _HostBlock, device: torch.device | None) -> None:
        # Register with the target device current, so pointer queries attribute the pages to it.
        with torch.cuda.device(device):
            result = torch.cuda.cudart().cudaHostRegister(block.ptr, block.capacity, _CUDA_HOST_REGISTER_PORTABLE)
        if int(result) != 0:
            block.mapping.close()
            raise HostMemoryError(
                f"cudaHostRegister of {_format_bytes(block.capacity)} failed: {_cuda_error_string(result)}. "
                "Check `ulimit -l` or lower the offload fraction."
            )

    def _give_back(self, block: _HostBlock, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes
            self.live_count -= 1
            if block.pinned:
                self.live_pinned_bytes -= nbytes
                self.live_pinned_count -= 1
            self._free.setdefault((block.capacity, block.pinned), []).append(block)
            self.cached_bytes += block.capacity
            self.cached_count += 1

    def empty(self) -> bool:
        """Unpin and unmap every free block; return whether there was any."""
        with self._lock:
            blocks = [block for free_blocks in self._free.values() for block in free_blocks]
            self._free.clear()
            self.cached_bytes = 0
            self.cached_count = 0
            for block in blocks:
                self.reserved_bytes -= block.capacity
                if block.pinned:
                    self.locked -= block.capacity
        for block in blocks:
            if block.pinned:
                result = torch.cuda.cudart().cudaHostUnregister(block.ptr)
                if int(result) != 0:
                    raise RuntimeError(
                        f"cudaHostUnregister failed: {_cuda_error_string(result)}; "
                        "an earlier asynchronous CUDA error may be the cause (try CUDA_LAUNCH_BLOCKING=1)."
                    )
            block.mapping.close()
        return bool(blocks)


_pinned_pool = _HostPool()


def _normalize_shape(shape: int | Sequence[int] | torch.Size) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(dim, int) and dim >= 0 for dim in dims):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    return dims


def _resolve_pin_device(device: torch.device | str | int | None) -> torch.device | None:
    """The CUDA device to pin for, or None for plain host memory."""
    resolved = resolve_device(device)
    return resolved if resolved.type == "cuda" else None


def pinned_empty(
    shape: int | Sequence[int] | torch.Size,
    dtype: torch.dtype,
    *,
    device: torch.device | str | int | None = None,
) -> torch.Tensor:
    """Return an uninitialized host tensor of exactly ``shape``, pinned when an accelerator exists.

    Unlike ``torch.empty(..., pin_memory=True)``, whose allocator rounds each block up to a power of
    two, the tensor's storage is exactly ``numel * itemsize`` bytes and the memory behind it is that
    size rounded up to whole pages (4 KiB). The buffer is page-aligned, and 2 MiB-aligned and
    huge-page backed once it is 2 MiB or more. Freed buffers return to a pool and are reused by the
    next request of the same page-rounded size; :func:`empty_cache` gives them back to the system.

    Args:
        shape (int | Sequence[int]): shape of the tensor.
        dtype (torch.dtype): element type.
        device (torch.device | str | int | None): the accelerator the memory is pinned for. ``None``
            (default): the current CUDA device when CUDA is available, otherwise no pinning.
            ``"cpu"``: exact-size, page-aligned, unpinned memory.

    Returns:
        torch.Tensor: a contiguous CPU tensor; ``is_pinned()`` is True when it was pinned.

    Raises:
        ValueError: if ``shape`` has negative or non-integer entries, or ``device`` is not CUDA/CPU
            or is a CUDA device on a machine without CUDA.
        TypeError: if ``dtype`` is not a ``torch.dtype``.
        HostMemoryError: if the machine cannot provide the memory (``MemAvailable``, ``ulimit -l``) or
            pinning fails; nothing is allocated then.

    Example::

        >>> shard = pinned_empty((4096, 4096), torch.bfloat16)
        >>> shard.untyped_storage().nbytes() == 4096 * 4096 * 2
        True
    """
    dims = _normalize_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"pinned_empty: dtype must be a torch.dtype, got {dtype!r}")
    pin_device = _resolve_pin_device(device)
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype)
    view = _pinned_pool.allocate(nbytes, pin_device is not None, pin_device)
    # torch.frombuffer keeps ``view`` alive for as long as the storage lives.
    return torch.frombuffer(view, dtype=dtype).view(dims)


class PinnedFreeList:
    """Buffers from :func:`pinned_empty` that one owner keeps for itself, by exact byte size.

    For an owner that needs the same sizes every step and writes a buffer asynchronously: each buffer
    comes back with the event recorded after the last copy that read it (None when none did), which
    the stream of the next write into it must wait for. A buffer taken back is never handed to
    another owner, so no other write can race that copy. Every buffer returns to the
    :func:`pinned_empty` pool when the free list dies.

    Args:
        device (torch.device | str | int | None): the accelerator the memory is pinned for, as in
            :func:`pinned_empty`.

    Example::

        >>> free_list = PinnedFreeList("cuda")
        >>> buffer, read_done = free_list.take(1 << 20)  # (a new buffer, None) the first time
        >>> free_list.give_back(buffer, None)
        >>> free_list.take(1 << 20)[0] is buffer
        True
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self._device = device
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()
        self.held_bytes = 0  # bytes of every buffer this list made, taken or free

    def take(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A free ``uint8`` buffer of ``nbytes`` and the event its last reader recorded, or a new
        buffer and None.

        Raises:
            HostMemoryError: as :func:`pinned_empty`, when a new buffer cannot be had.
        """
        with self._lock:
            free_buffers = self._free.get(nbytes)
            if free_buffers:
                return free_buffers.pop()
        buffer = pinned_empty(nbytes, torch.uint8, device=self._device)
        with self._lock:
            self.held_bytes += nbytes
        return buffer, None

    def give_back(self, buffer: torch.Tensor, read_done: Any) -> None:
        """Keep ``buffer`` (from :meth:`take`) for the next :meth:`take` of its size, with the event
        (or None) that a write into it must wait for."""
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, read_done))


def empty_cache() -> None:
    """Unpin and return to the system every free block kept by the :func:`pinned_empty` pool.

    Memory still used by live tensors is untouched; it returns to the pool when they die.

    Raises:
        RuntimeError: if ``cudaHostUnregister`` fails.

    Example::

        >>> del shard
        >>> empty_cache()
        >>> memory_stats()["cached_bytes"]
        0
    """
    _pinned_pool.empty()


def memory_stats() -> dict[str, int]:
    """Return live counters of the memory this module handed out (not torch's own allocators).

    Keys:
        ``host_bytes`` / ``host_count``: live tensors from :func:`pinned_empty` (requested bytes).
        ``pinned_bytes`` / ``pinned_count``: those among them that are pinned.
        ``cached_bytes`` / ``cached_count``: free blocks kept in the pool for reuse.
        ``reserved_bytes``: host memory mapped by the pool (live and cached blocks, page-rounded).
        ``locked_bytes``: the part of it that is pinned, which counts against ``ulimit -l``.
        ``managed_bytes`` / ``managed_count``: live :func:`managed_empty` allocations.

    Returns:
        dict[str, int]: the counters above.

    Example::

        >>> before = memory_stats()
        >>> shard = pinned_empty(1024, torch.float32)
        >>> memory_stats()["host_bytes"] - before["host_bytes"]
        4096
    """
    with _pinned_pool._lock:
        stats = {
            "host_bytes": _pinned_pool.live_bytes,
            "host_count": _pinned_pool.live_count,
            "pinned_bytes": _pinned_pool.live_pinned_bytes,
            "pinned_count": _pinned_pool.live_pinned_count,
            "cached_bytes": _pinned_pool.cached_bytes,
            "cached_count": _pinned_pool.cached_count,
            "reserved_bytes": _pinned_pool.reserved_bytes,
            "locked_bytes": _pinned_pool.locked,
        }
    with _managed_lock:
        stats["managed_bytes"] = _managed_totals["bytes"]
        stats["managed_count"] = _managed_totals["count"]
    return stats


# --------------------------------------------------------------------------------------------------
# Zero-copy CUDA tensors over memory torch did not allocate.


class _CudaArrayInterface:
    """Presents ``nbytes`` at ``ptr`` as a CUDA byte array; holds ``owner`` while a tensor uses it."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def _wrap_device_bytes(ptr: int, nbytes: int, owner: Any, device: torch.device) -> torch.Tensor:
    with torch.cuda.device(device):
        byte_tensor = torch.as_tensor(_CudaArrayInterface(ptr, nbytes, owner), device=device)
    if byte_tensor.data_ptr() != ptr:
        # torch.as_tensor infers the device from the pointer and copies when it differs.
        raise RuntimeError(
            f"the memory at {ptr:#x} is attributed to another device than {device}; "
            "allocate or pin it with that device current (torch.cuda.set_device)."
        )
    return byte_tensor


def _cuda_device(device: torch.device | str | int, fn: str) -> torch.device:
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        raise ValueError(f"{fn}: device must be a CUDA device, got {resolved}")
    return resolved


def _element_span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from ``data_ptr()`` to the end of the last element the tensor can reach."""
    if tensor.numel() == 0:
        return 0
    if any(stride < 0 for stride in tensor.stride()):
        raise ValueError("negative strides are not supported")
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def device_view(host_tensor: torch.Tensor, device: torch.device | str | int) -> torch.Tensor:
    """Return a CUDA tensor that aliases pinned host memory: the GPU reads it over the link, no copy.

    Under unified virtual addressing a pinned host pointer is also a device pointer, so kernels can
    read (and write) ``host_tensor`` in place. Reads cross the CPU-GPU link at link speed each time,
    which pays for data touched once (streaming) and on machines where the link is fast (NVLink-C2C).
    The view keeps ``host_tensor`` alive.

    Args:
        host_tensor (torch.Tensor): a pinned CPU tensor, e.g. from :func:`pinned_empty`; any shape and
            non-negative strides.
        device (torch.device | str | int): the CUDA device that will read it.

    Returns:
        torch.Tensor: a tensor on ``device`` with ``host_tensor``'s shape, strides and dtype, sharing
        its memory.

    Raises:
        ValueError: if ``host_tensor`` is not on the CPU, is not pinned (pageable memory is not
            addressable by a discrete GPU), has negative strides, or ``device`` is not an available
            CUDA device.
        RuntimeError: if torch wraps the pointer on another device than ``device``.

    Example::

        >>> host = pinned_empty(1 << 20, torch.float32).fill_(1.0)
        >>> device_view(host, "cuda").sum().item()
        1048576.0
    """
    device = _cuda_device(device, "device_view")
    if host_tensor.device.type != "cpu":
        raise ValueError(f"device_view: host_tensor must be a CPU tensor, got one on {host_tensor.device}")
    if not host_tensor.is_pinned():
        raise ValueError(
            "device_view: host_tensor is pageable; a discrete GPU can only address pinned host memory. "
            "Allocate it with torch_fsdp_offload.memory.pinned_empty (or copy it into such a buffer)."
        )
    span = _element_span_bytes(host_tensor)
    if span == 0:
        return torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=device)
    byte_tensor = _wrap_device_bytes(host_tensor.data_ptr(), span, host_tensor, device)
    return torch.as_strided(byte_tensor.view(host_tensor.dtype), host_tensor.shape, host_tensor.stride())


# --------------------------------------------------------------------------------------------------
# Managed (unified) memory through cuda.bindings.

_managed_lock = threading.Lock()
_managed_totals = {"bytes": 0, "count": 0}


def _cuda_runtime():
    """``cuda.bindings.runtime`` (or the older ``cuda.cudart`` layout), or a clear error."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise RuntimeError(
                "managed memory needs NVIDIA's cuda.bindings (cudaMallocManaged has no torch API): "
                "`pip install cuda-bindings` matching your CUDA major version (the torch CUDA wheels "
                "depend on it), or use memory=\"pinned\"."
            ) from None
    return runtime


def _check_cuda(runtime, result: tuple, call: str) -> tuple:
    error, *values = result
    if error != runtime.cudaError_t.cudaSuccess:
        _, name = runtime.cudaGetErrorString(error)
        raise RuntimeError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name} ({error})")
    return tuple(values)


class _ManagedAllocation:
    """Owns one ``cudaMallocManaged`` range; both tensor views hold it, ``cudaFree`` runs when both die."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        finalizer = weakref.finalize(self, _free_managed, ptr, nbytes)
        finalizer.atexit = False


def _free_managed(ptr: int, nbytes: int) -> None:
    runtime = _cuda_runtime()
    # cudaFree waits for outstanding work on the range, so a kernel still reading it is safe.
    _check_cuda(runtime, runtime.cudaFree(ptr), "cudaFree")
    with _managed_lock:
        _managed_totals["bytes"] -= nbytes
        _managed_totals["count"] -= 1


@dataclasses.dataclass(frozen=True, eq=False)
class ManagedBuffer:
    """A ``cudaMallocManaged`` allocation seen from both sides.

    Attributes:
        device_tensor (torch.Tensor): the bytes as a tensor on the CUDA device.
        host_view (torch.Tensor): the same bytes as a CPU tensor (the CPU touches them in place; the
            driver migrates pages on demand).
        nbytes (int): size of the allocation in bytes.

    The memory is freed with ``cudaFree`` when both tensors (and every view of them) are gone.

    Example::

        >>> buffer = managed_empty(1024, torch.float32, "cuda")
        >>> buffer.host_view.fill_(1.0)  # written by the CPU ...
        >>> buffer.device_tensor.sum().item()  # ... read by the GPU, same bytes
        1024.0
    """

    device_tensor: torch.Tensor
    host_view: torch.Tensor
    nbytes: int


def managed_empty(
    shape: int | Sequence[int] | torch.Size,
    dtype: torch.dtype,
    device: torch.device | str | int,
) -> ManagedBuffer:
    """Allocate managed (unified) memory of exactly ``shape`` and return its CUDA and CPU views.

    Managed memory has one address for CPU and GPU; the driver moves pages to whichever side touches
    them (on discrete GPUs by page fault, slow unless prefetched), and on unified-memory machines
    (Grace Hopper, DGX Spark) it is cached in GPU L2. The request must fit in the GPU's free memory:
    oversubscribing managed memory can stall the GPU.

    Args:
        shape (int | Sequence[int]): shape of both tensors.
        dtype (torch.dtype): element type.
        device (torch.device | str | int): the CUDA device the allocation belongs to.

    Returns:
        ManagedBuffer: ``device_tensor`` (on ``device``) and ``host_view`` (CPU) over the same bytes.

    Raises:
        ValueError: if ``shape`` is invalid or ``device`` is not an available CUDA device.
        TypeError: if ``dtype`` is not a ``torch.dtype``.
        RuntimeError: if ``cuda.bindings`` is not available, the device does not support
            concurrent managed memory, or ``cudaMallocManaged`` fails.
        HostMemoryError: if the request exceeds the GPU's free memory.

    Example::

        >>> buffer = managed_empty((1024, 1024), torch.float32, "cuda")
        >>> buffer.device_tensor.fill_(2.0); torch.cuda.synchronize()
        >>> buffer.host_view[0, 0].item()
        2.0
    """
    dims = _normalize_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"managed_empty: dtype must be a torch.dtype, got {dtype!r}")
    device = _cuda_device(device, "managed_empty")
    nbytes = math.prod(dims) * dtype.itemsize
    runtime = _cuda_runtime()
    _require_managed_support(device)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    if nbytes > free_bytes:
        raise HostMemoryError(
            f"Cannot allocate {_format_bytes(nbytes)} of managed memory on {device}: only "
            f"{_format_bytes(free_bytes)} of its {_format_bytes(total_bytes)} is free (cudaMemGetInfo), "
            "and oversubscribing managed memory can stall the GPU. Lower the offload fraction, "
            "split the allocation, or use memory=\"pinned\"."
        )
    if nbytes == 0:
        empty = torch.empty(dims, dtype=dtype)
        return ManagedBuffer(empty.to(device), empty, 0)
    with torch.cuda.device(device):
        (ptr,) = _check_cuda(
            runtime,
            runtime.cudaMallocManaged(nbytes, _CUDA_MEM_ATTACH_GLOBAL),
            f"cudaMallocManaged({nbytes})",
        )
    ptr = int(ptr)
    with _managed_lock:
        _managed_totals["bytes"] += nbytes
        _managed_totals["count"] += 1
    owner = _ManagedAllocation(ptr, nbytes)
    device_bytes = _wrap_device_bytes(ptr, nbytes, owner, device)
    host_bytes = (ctypes.c_uint8 * nbytes).from_address(ptr)
    host_bytes.owner = owner  # the CPU view keeps the allocation alive too
    host_view = torch.frombuffer(host_bytes, dtype=dtype).view(dims)
    return ManagedBuffer(device_bytes.view(dtype).view(dims), host_view, nbytes)


def _require_managed_support(device: torch.device) -> None:
    platform = detect_platform(device)
    if not platform.supports_managed_memory:
        found = {name: platform.attributes.get(name) for name in ("ManagedMemory", "ConcurrentManagedAccess")}
        raise RuntimeError(
            f"{device} does not support managed memory shared by CPU and GPU at the same time "
            f"(needs ManagedMemory=1 and ConcurrentManagedAccess=1, read {found}); "
            "use memory=\"pinned\"."
        )
