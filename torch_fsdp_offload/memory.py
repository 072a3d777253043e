"""Host memory for offloading: exact-size pinned tensors, and capacity checks before allocating.

PyTorch's pinned memory (``torch.empty(..., pin_memory=True)``, ``Tensor.pin_memory()``) comes from its
caching host allocator, which rounds every block up to a power of two: a 2.1 GiB shard pins 4 GiB, and
offloading a model that nearly fills host RAM fails halfway. :func:`pinned_empty` instead maps exactly
the pages it needs (2 MiB aligned and huge-page backed once a buffer is that large), pins them with
``cudaHostRegister`` and keeps freed blocks in a pool for reuse, one size class per page-rounded size.
Without an accelerator the same code returns page-aligned, unpinned host tensors, so its logic runs in
CPU tests.

Every allocation is checked against what the machine can give (``MemAvailable``, ``ulimit -l``) before
anything is allocated, and :func:`memory_stats` reports what is live (managed allocations of
:mod:`torch_fsdp_offload.device_memory` included), so tests can show that the totals return to where
they started.
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

from torch_fsdp_offload.platform import read_host_available_bytes, read_locked_memory_limit_bytes, resolve_device

__all__ = [
    "ENV_HOST_MEMORY",
    "HostMemoryError",
    "HostPromise",
    "PinnedFreeList",
    "check_host_capacity",
    "empty_cache",
    "host_capacity_bytes",
    "memory_stats",
    "pinned_empty",
    "promise_host_bytes",
    "promised_host_bytes",
]

PAGE_SIZE = mmap.PAGESIZE
# Replaces MemAvailable in the capacity checks. For machines whose MemAvailable understates what they
# can give: VMs whose memory is hot-plugged as it is touched (MemAvailable then reads a fraction of
# what the VM grows to), or hosts whose page cache the kernel will drop but does not count as available.
ENV_HOST_MEMORY = "TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES"
_BYTE_UNITS = {
    "": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
HUGE_PAGE_SIZE = 2 << 20
# cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process.
_CUDA_HOST_REGISTER_PORTABLE = 1
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
        # What owners will allocate later (HostPromise), weakly: a promise ends with its owner.
        self.promises: "weakref.WeakSet[HostPromise]" = weakref.WeakSet()

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


class HostPromise:
    """Host bytes an owner will allocate later: an offloaded FSDP group or handle, built now, makes
    its buffers at its first forward. Checks of the host's capacity for later groups count every open
    promise (:func:`promised_host_bytes`), so two groups are never promised the same memory. It ends
    at :meth:`fulfil` or when its owner is collected.

    Args:
        nbytes (int): the bytes promised.
        managed (bool): whether they will be managed memory, which also counts against the GPU's
            free memory (:func:`promised_host_bytes` with ``managed_only=True``).

    Example::

        >>> promise = promise_host_bytes(group_bytes, group)  # the group is built
        >>> promise.fulfil()  # its buffers were allocated
    """

    def __init__(self, nbytes: int, managed: bool = False) -> None:
        self.nbytes = nbytes
        self.managed = managed

    def fulfil(self) -> None:
        """The owner allocated the bytes (or never will): they count no more."""
        self.nbytes = 0


def promise_host_bytes(nbytes: int, owner: Any, *, managed: bool = False) -> HostPromise:
    """Promise ``nbytes`` of host memory (``managed``: managed memory) to ``owner`` until it
    allocates them (the returned :class:`HostPromise`'s :meth:`~HostPromise.fulfil`) or is
    collected."""
    promise = HostPromise(nbytes, managed)
    with _pinned_pool._lock:
        _pinned_pool.promises.add(promise)
    weakref.finalize(owner, promise.fulfil)  # holds the promise as long as the owner lives
    return promise


def promised_host_bytes(*, managed_only: bool = False) -> int:
    """Host bytes promised and not allocated yet, to count beside a new request; ``managed_only``:
    those promised as managed memory."""
    with _pinned_pool._lock:
        return sum(p.nbytes for p in list(_pinned_pool.promises) if p.managed or not managed_only)


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


# The live allocations of :func:`torch_fsdp_offload.device_memory.managed_empty`, which
# :func:`memory_stats` reports.
_managed_lock = threading.Lock()
_managed_totals = {"bytes": 0, "count": 0}
# The same allocations by start address: (end address, the allocation, weakly), for
# :func:`torch_fsdp_offload.device_memory.managed_device_alias`.
_managed_ranges: dict[int, tuple[int, Any]] = {}
