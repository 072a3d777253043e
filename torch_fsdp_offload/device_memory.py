"""GPU access to memory torch did not allocate: zero-copy device views and managed memory.

:func:`device_view` turns pinned host memory (from :func:`~torch_fsdp_offload.memory.pinned_empty`)
into a CUDA tensor that reads it over the link, no copy. :func:`managed_empty` hands out
``cudaMallocManaged`` memory as a CUDA tensor plus a CPU view of the same bytes; it is checked
against the GPU's free memory before anything is allocated, and
:func:`~torch_fsdp_offload.memory.memory_stats` counts it. :func:`shared_empty` gives either kind
seen from both sides: the buffers of a ``CoherentOffload`` group placed with
``shard_memory="managed"``, or read in place by the GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from torch_fsdp_offload.memory import (
    HostMemoryError,
    _format_bytes,
    _managed_lock,
    _managed_ranges,
    _managed_totals,
    _normalize_shape,
    pinned_empty,
)
from torch_fsdp_offload.platform import detect_platform, resolve_device

__all__ = ["SharedBuffer", "check_managed_fits", "device_view", "managed_device_alias", "managed_empty", "shared_empty"]

# cudaMemAttachGlobal (a #define in cuda_runtime_api.h): any stream on any device may access the memory.
_CUDA_MEM_ATTACH_GLOBAL = 1
# cudaCpuDeviceId: the host, where an advice call of CUDA 12 takes a device ordinal.
_CUDA_CPU_DEVICE_ID = -1


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
        host_tensor (torch.Tensor): a pinned CPU tensor, e.g. from
            :func:`~torch_fsdp_offload.memory.pinned_empty`; any shape and non-negative strides.
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
                "depend on it), or use pinned memory."
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
    with _managed_lock:
        _managed_ranges.pop(ptr, None)
    # cudaFree waits for outstanding work on the range, so a kernel still reading it is safe.
    _check_cuda(runtime, runtime.cudaFree(ptr), "cudaFree")
    with _managed_lock:
        _managed_totals["bytes"] -= nbytes
        _managed_totals["count"] -= 1


def managed_device_alias(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` over the same bytes as the CPU tensor ``tensor`` where those
    bytes are managed memory (:func:`managed_empty`), else None.

    torch copies to or from the CPU view of managed memory as from pageable memory, at about a
    sixth of the link's speed (8.8 against 54.3 GB/s on a PCIe H200, docs/benchmarks.md); a copy of
    the CUDA view of the same bytes is a device-to-device copy that runs at the link's speed. The
    transfer engine copies through this alias. Without managed allocations it returns at once.
    """
    if not _managed_ranges or tensor.device.type != "cpu" or device.type != "cuda":
        return None
    start = tensor.data_ptr()
    with _managed_lock:
        found = next(
            (owner for base, (end, owner) in _managed_ranges.items() if base <= start < end), None
        )
    allocation = found() if found is not None else None
    if allocation is None:
        return None
    span = _element_span_bytes(tensor)
    if start + span > allocation.ptr + allocation.nbytes:
        return None
    if span == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    byte_tensor = _wrap_device_bytes(start, span, allocation, device)
    return torch.as_strided(byte_tensor.view(tensor.dtype), tensor.shape, tensor.stride())


@dataclasses.dataclass(frozen=True, eq=False)
class SharedBuffer:
    """Host memory the GPU addresses too, seen from both sides: a ``cudaMallocManaged`` allocation,
    or pinned memory with its :func:`device_view`.

    Attributes:
        device_tensor (torch.Tensor): the bytes as a tensor on the CUDA device.
        host_view (torch.Tensor): the same bytes as a CPU tensor (the CPU touches them in place; for
            managed memory the driver migrates pages on demand, unless advised otherwise).
        nbytes (int): size of the allocation in bytes.

    Managed memory is freed with ``cudaFree`` when both tensors (and every view of them) are gone.

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
    *,
    prefer_host: bool = False,
) -> SharedBuffer:
    """Allocate managed (unified) memory of exactly ``shape`` and return its CUDA and CPU views.

    Managed memory has one address for CPU and GPU; the driver moves pages to whichever side touches
    them (on discrete GPUs by page fault, slow unless prefetched), and on unified-memory machines
    (Grace Hopper, DGX Spark) it is cached in GPU L2. The request must fit in the GPU's free memory:
    oversubscribing managed memory can stall the GPU.

    Args:
        shape (int | Sequence[int]): shape of both tensors.
        dtype (torch.dtype): element type.
        device (torch.device | str | int): the CUDA device the allocation belongs to.
        prefer_host (bool): advise the driver that the pages live in host memory (preferred
            location: the host) and that ``device`` reads them there (accessed by: the device), so
            the GPU's accesses map the host pages instead of migrating them: the advice for state
            the host owns and the GPU reads, the reverse of memory the GPU owns. Default False: the
            driver migrates pages to whichever side touches them.

    Returns:
        SharedBuffer: ``device_tensor`` (on ``device``) and ``host_view`` (CPU) over the same bytes.

    Raises:
        ValueError: if ``shape`` is invalid or ``device`` is not an available CUDA device.
        TypeError: if ``dtype`` is not a ``torch.dtype``.
        RuntimeError: if ``cuda.bindings`` is not available, the device does not support
            concurrent managed memory, or ``cudaMallocManaged`` (or the advice) fails.
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
    check_managed_fits(nbytes, device, "managed memory")
    if nbytes == 0:
        empty = torch.empty(dims, dtype=dtype)
        return SharedBuffer(empty.to(device), empty, 0)
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
    with _managed_lock:
        _managed_ranges[ptr] = (ptr + nbytes, weakref.ref(owner))
    if prefer_host:
        _advise(runtime, ptr, nbytes, runtime.cudaMemoryAdvise.cudaMemAdviseSetPreferredLocation, None)
        _advise(runtime, ptr, nbytes, runtime.cudaMemoryAdvise.cudaMemAdviseSetAccessedBy, device.index)
    device_bytes = _wrap_device_bytes(ptr, nbytes, owner, device)
    host_bytes = (ctypes.c_uint8 * nbytes).from_address(ptr)
    host_bytes.owner = owner  # the CPU view keeps the allocation alive too
    host_view = torch.frombuffer(host_bytes, dtype=dtype).view(dims)
    return SharedBuffer(device_bytes.view(dtype).view(dims), host_view, nbytes)


def _advise(runtime, ptr: int, nbytes: int, advice: Any, device_index: int | None) -> None:
    """``cudaMemAdvise`` for the host (``device_index`` None) or a device: a ``cudaMemLocation``
    since CUDA 13, a device ordinal (``cudaCpuDeviceId`` for the host) before."""
    location_type = getattr(runtime, "cudaMemLocationType", None)
    if location_type is not None and hasattr(runtime, "cudaMemLocation"):
        location = runtime.cudaMemLocation()
        host = device_index is None
        location.type = location_type.cudaMemLocationTypeHost if host else location_type.cudaMemLocationTypeDevice
        location.id = 0 if host else device_index
        try:
            _check_cuda(runtime, runtime.cudaMemAdvise(ptr, nbytes, advice, location), f"cudaMemAdvise({advice})")
            return
        except TypeError:
            pass  # CUDA 12's signature: a device ordinal
    ordinal = _CUDA_CPU_DEVICE_ID if device_index is None else device_index
    _check_cuda(runtime, runtime.cudaMemAdvise(ptr, nbytes, advice, ordinal), f"cudaMemAdvise({advice})")


def check_managed_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse ``nbytes`` of managed memory that would not fit in ``device``'s free memory
    (``cudaMemGetInfo``), before anything is allocated: an oversubscribed managed allocation can
    stall the GPU, not only the process.

    Raises:
        HostMemoryError: naming ``what``, the request, what is free, and what to do instead.
    """
    if device.type != "cuda":
        return  # no GPU: the CPU stand-in of shared_empty is plain host memory
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    if nbytes > free_bytes:
        raise HostMemoryError(
            f"Cannot allocate {_format_bytes(nbytes)} of {what} on {device}: only "
            f"{_format_bytes(free_bytes)} of its {_format_bytes(total_bytes)} is free (cudaMemGetInfo), "
            "and oversubscribing managed memory can stall the GPU, not only this process. Offload "
            "fewer modules, or keep the shards in pinned memory (CoherentOffload(shard_memory=\"pinned\"), "
            "the default on a discrete GPU)."
        )


def shared_empty(
    shape: int | Sequence[int] | torch.Size,
    dtype: torch.dtype,
    memory: str,
    device: torch.device | str | int,
) -> SharedBuffer:
    """Host memory of kind ``memory`` that ``device`` addresses too: pinned memory and its
    :func:`device_view`, or managed memory advised to stay on the host
    (``managed_empty(..., prefer_host=True)``).

    Without a GPU (``device`` the CPU: a platform class forced on a CPU machine, as the tests do)
    both views are one plain host tensor, so code that reads "the device view" runs unchanged.

    Args:
        shape (int | Sequence[int]): shape of both tensors.
        dtype (torch.dtype): element type.
        memory (str): ``"pinned"`` or ``"managed"``.
        device (torch.device | str | int): the CUDA device that reads the memory, or the CPU.

    Returns:
        SharedBuffer: the CPU and device views of the same bytes.

    Raises:
        ValueError: ``memory`` is neither ``"pinned"`` nor ``"managed"``; as :func:`managed_empty`
            and :func:`~torch_fsdp_offload.memory.pinned_empty` otherwise.
        HostMemoryError: as those two.

    Example::

        >>> buffer = shared_empty(1024, torch.float32, "pinned", "cuda")
        >>> buffer.host_view.fill_(1.0)
        >>> buffer.device_tensor.sum().item()  # the GPU reads the host's bytes, no copy
        1024.0
    """
    if memory not in ("pinned", "managed"):
        raise ValueError(f"shared_empty: memory must be 'pinned' or 'managed', got {memory!r}")
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        host = pinned_empty(shape, dtype, device="cpu")
        return SharedBuffer(host, host, host.numel() * host.element_size())
    if memory == "managed":
        return managed_empty(shape, dtype, resolved, prefer_host=True)
    host = pinned_empty(shape, dtype, device=resolved)
    return SharedBuffer(device_view(host, resolved), host, host.numel() * host.element_size())


def _require_managed_support(device: torch.device) -> None:
    platform = detect_platform(device)
    if not platform.supports_managed_memory:
        found = {name: platform.attributes.get(name) for name in ("ManagedMemory", "ConcurrentManagedAccess")}
        raise RuntimeError(
            f"{device} does not support managed memory shared by CPU and GPU at the same time "
            f"(needs ManagedMemory=1 and ConcurrentManagedAccess=1, read {found}); "
            "use pinned memory instead."
        )
