"""The transfer engine: host <-> device copies on their own streams, in chunks, with events.

One :class:`TransferEngine` per device (:func:`get_transfer_engine`) owns a host-to-device stream and a
device-to-host stream, so copies overlap compute and each other. Every copy is split into chunks issued
back to back with no host synchronization between them, ends in a CUDA event, and returns a
:class:`Transfer` handle; consumers wait on that event (``Transfer.wait``), never on a whole stream.

The engine enforces the rule that no buffer is reused or freed before the copy that touches it has
finished:

* a device-to-host copy first waits for an event recorded on the producer's (current) stream, so it
  reads finished data, and ``record_stream`` keeps the source's memory from being reused under it;
* a host-to-device copy into a buffer the engine allocates writes into memory of its own stream; the
  consumer's ``Transfer.wait`` marks it used on the consumer's stream (``record_stream``);
* host buffers are kept alive by the engine until the copy's event has completed, even if the caller
  drops the :class:`Transfer` (pinned memory returned to a pool early would be overwritten mid-copy);
* a copy whose memory overlaps that of an unfinished copy on the other stream waits for it first.

Managed host memory (:func:`~torch_fsdp_offload.device_memory.managed_empty`) is copied through
its CUDA view (:func:`~torch_fsdp_offload.device_memory.managed_device_alias`), device to device at
the link's speed: torch copies its CPU view as pageable memory, at a sixth of it or less.

On a CPU "device" (HOST_ONLY, or a platform forced to another kind in CPU tests) the same API runs
with synchronous copies and no CUDA streams, and still counts every byte, so callers can prove what
they copy. For CI, the CPU copies can instead run late on one worker thread per direction, ending in
events, with destinations poisoned until they land and sources checked for changes while in flight
(:mod:`torch_fsdp_offload.cpu_copy_stream`; ``TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES=<max delay ms>``,
set by the test suite, or :func:`~torch_fsdp_offload.cpu_copy_stream.cpu_async_copies`). The engine
sees every kind of stream through one interface (:mod:`torch_fsdp_offload.transfer_streams`). Every
copy runs under ``torch.profiler.record_function("torch_fsdp_offload::<label>")``. What the engine
remembers of the copies it issued lives in :mod:`torch_fsdp_offload.transfer_bookkeeping`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from torch_fsdp_offload.cpu_copy_stream import CpuCopyStreams
from torch_fsdp_offload.device_memory import managed_device_alias
from torch_fsdp_offload.platform import resolve_device
from torch_fsdp_offload.transfer_bookkeeping import IssuedCopy, PendingCopies, byte_range
from torch_fsdp_offload.transfer_streams import CopyRequest, CopyStream, CopyStreams, CudaCopyStreams

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Transfer",
    "TransferEngine",
    "TransferStats",
    "get_transfer_engine",
]

# Large enough for a copy to run at the link's speed (measured on an H200, see docs/benchmarks.md),
# small enough that a long copy interleaves with other streams' copies.
DEFAULT_CHUNK_BYTES = 64 << 20
# Stream priority for the copy streams: lower is higher priority; torch clamps it to what the
# device supports. Copies gate compute (a layer cannot start before its weights arrived), so they
# should not queue behind compute kernels.
_COPY_STREAM_PRIORITY = -1
_PROFILER_PREFIX = "torch_fsdp_offload::"


@dataclasses.dataclass
class TransferStats:
    """Bytes and copies moved by one engine, each way.

    A copy is one call (``h2d`` or ``d2h``), whatever its number of chunks;
    zero-byte copies are not counted. On a unified-memory path the counters stay at zero, which is
    how callers prove that nothing crossed the link.

    Attributes:
        h2d_bytes (int): bytes copied host to device.
        d2h_bytes (int): bytes copied device to host.
        h2d_copies (int): host-to-device copies issued.
        d2h_copies (int): device-to-host copies issued.

    Example::

        >>> engine = get_transfer_engine("cuda")
        >>> engine.stats.reset()
        >>> train_step()
        >>> assert engine.stats.h2d_bytes == 0  # on a unified-memory machine nothing crossed
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        self.h2d_bytes = self.d2h_bytes = self.h2d_copies = self.d2h_copies = 0


def _chunks(nbytes: int, chunk_bytes: int) -> list[slice]:
    return [slice(start, min(start + chunk_bytes, nbytes)) for start in range(0, nbytes, chunk_bytes)]


def _copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, chunks: list[slice]) -> None:
    # All chunks are issued back to back: no host sync between them.
    for chunk in chunks:
        dst[chunk].copy_(src[chunk], non_blocking=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (any dtype, any shape, 0-dim included)."""
    return tensor.reshape(-1).view(torch.uint8)


class Transfer:
    """Handle on one copy issued by a :class:`TransferEngine`.

    Attributes:
        tensor (torch.Tensor): the destination: the device buffer of a host-to-device copy, the host
            tensor of a device-to-host copy.
        label (str): the profiler label the copy ran under.
        nbytes (int): bytes copied.

    Do not read ``tensor`` before :meth:`wait` (or :meth:`synchronize`): the copy may still be running.

    Example::

        >>> transfer = get_transfer_engine("cuda").h2d(host_weights, label="block0")
        >>> weights = transfer.wait()  # the current stream waits for this copy, then may use it
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        label: str,
        nbytes: int,
        copy: IssuedCopy | None = None,
    ) -> None:
        self.tensor = tensor
        self.label = label
        self.nbytes = nbytes
        self._copy = copy

    def done(self) -> bool:
        """Whether the copy has finished, without blocking.

        Returns:
            bool: True once the copy's event completed (on a CPU engine: at once, unless its copies
            run asynchronously).

        Raises:
            RuntimeError: asynchronous CPU copies only: the copy found its source changed or its
                destination written while it was in flight.

        Example::

            >>> transfer = get_transfer_engine("cuda").h2d(host)
            >>> while not transfer.done():
            ...     pass
        """
        return self._copy is None or self._copy.event.query()

    def synchronize(self) -> None:
        """Block the calling thread until the copy has finished.

        Raises:
            RuntimeError: as :meth:`done`.

        Example::

            >>> get_transfer_engine("cuda").d2h(grad, host_grad).synchronize()
            >>> host_grad.sum()  # the host sees the gradient
        """
        if self._copy is not None:
            self._copy.event.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Make the consumer wait for the copy (not for the whole copy stream); return ``tensor``.

        Host-to-device: ``stream`` (default: the current stream of the destination's device) waits
        on the copy's event, and the destination is marked as used on ``stream`` so that its memory
        is not reused while ``stream`` still reads it. Device-to-host: with ``stream`` given, that
        stream waits (e.g. before it overwrites the source); without, the calling thread blocks until
        the data is in host memory, since a host reader has no stream to wait on. An asynchronous
        CPU copy blocks the calling thread, its consumer, in both directions.

        Args:
            stream (torch.cuda.Stream | None): the consumer stream; see above.

        Returns:
            torch.Tensor: :attr:`tensor`, safe to use on ``stream`` (or on the host).

        Raises:
            RuntimeError: as :meth:`done`.

        Example::

            >>> weights = get_transfer_engine("cuda").h2d(host_weights).wait()
            >>> out = inputs @ weights  # ordered after the copy on the current stream
        """
        if self._copy is not None:
            self._copy.stream.hand_over(self._copy.event, self.tensor, stream, mark_used=True)
        return self.tensor

    def wait_unmarked(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Make ``stream`` wait for a host-to-device copy without marking its destination used there.

        The caller then decides when the memory may be reused: once ``stream``'s reads are queued,
        it makes the copy stream wait for them (``engine.h2d_stream.wait_stream(stream)``) and drops
        its references, and the allocator hands the memory out again at once, to later work of the
        copy stream only. :meth:`wait`'s ``record_stream`` keeps the memory allocated until an
        allocation after the GPU passed ``stream``'s reads, which can be long after the CPU moved on.

        Args:
            stream (torch.cuda.Stream | None): the consumer stream; default the current stream of
                the destination's device.

        Returns:
            torch.Tensor: :attr:`tensor`, safe to read on ``stream``.

        Example::

            >>> transfer = engine.h2d(master)
            >>> weights = transfer.wait_unmarked() * 2
            >>> engine.h2d_stream.wait_stream(torch.cuda.current_stream())
            >>> del transfer  # free now for the H2D stream, whose later copies follow the read
        """
        if self._copy is not None:
            self._copy.stream.hand_over(self._copy.event, self.tensor, stream, mark_used=False)
        return self.tensor


class TransferEngine:
    """Copies between host memory and one device, on dedicated streams, in chunks.

    Use :func:`get_transfer_engine` to get the process's engine for a device rather than building
    one: each engine owns two CUDA streams.

    Args:
        device (torch.device | str | int): the compute device: ``cuda:N``, or ``cpu`` (copies then run
            synchronously on the CPU and no streams exist).
        chunk_bytes (int): default chunk size of a copy, in bytes (64 MiB).

    Attributes:
        device (torch.device): the device.
        h2d_stream (torch.cuda.Stream | None): stream of host-to-device copies; None on a CPU device.
        d2h_stream (torch.cuda.Stream | None): stream of device-to-host copies; None on a CPU device.
        chunk_bytes (int): default chunk size.
        stats (TransferStats): bytes and copies each way.

    Raises:
        ValueError: if ``device`` is neither CUDA nor CPU, or ``chunk_bytes`` is not a positive int.

    Example::

        >>> engine = get_transfer_engine("cuda:0")
        >>> transfer = engine.h2d(pinned_weights, label="layer3.weights")
        >>> weights = transfer.wait()  # the current stream waits for this copy only
        >>> engine.d2h(grads, pinned_grads).synchronize()
    """

    def __init__(self, device: torch.device | str | int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.device = resolve_device(device)
        _check_chunk_bytes(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.stats = TransferStats()
        self._pending = PendingCopies()
        self._lock = threading.RLock()
        self._streams: CopyStreams
        if self.device.type == "cuda":
            self._streams = CudaCopyStreams(self.device, priority=_COPY_STREAM_PRIORITY)
            self.h2d_stream, self.d2h_stream = self._streams.h2d.stream, self._streams.d2h.stream
        else:
            # Synchronous copies, or late ones on worker threads while asynchronous CPU copies are on.
            self._streams = CpuCopyStreams(drain=self.synchronize)
            self.h2d_stream = self.d2h_stream = None

    # ---------------------------------------------------------------------------------------- API

    def h2d(
        self,
        src: torch.Tensor,
        dst: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        label: str = "h2d",
        chunk_bytes: int | None = None,
    ) -> Transfer:
        """Copy a host tensor to the device, asynchronously on :attr:`h2d_stream`.

        Args:
            src (torch.Tensor): contiguous CPU tensor; pinned for an asynchronous copy (pageable
                memory is copied correctly but the host waits for it).
            dst (torch.Tensor | None): contiguous device tensor with ``src``'s number of elements and
                ``dtype`` to copy into. None (default): the engine allocates one on its stream, and the
                copy starts at once. A given ``dst`` is written only after the work already queued on
                the current stream (which may still use it) has finished.
            dtype (torch.dtype | None): the destination's dtype, when it is not ``src``'s: ``src``'s
                bytes cross the link, each chunk into one device buffer of ``src``'s dtype, and are
                cast into the destination on the device, on :attr:`h2d_stream` (device memory: the
                destination plus one chunk). For a host that cannot spare the time to cast, at the
                cost of moving the wider dtype's bytes. None (default): ``src``'s dtype.
            label (str): profiler label, ``torch_fsdp_offload::<label>``.
            chunk_bytes (int | None): chunk size; default :attr:`chunk_bytes`.

        Returns:
            Transfer: ``tensor`` is the device tensor, shaped like ``src``, of ``dtype``.

        Raises:
            ValueError: if a tensor is on the wrong device, not contiguous, or ``dst`` differs from
                ``src`` in number of elements or from ``dtype`` (default ``src``'s) in dtype; nothing
                is copied then.
            TypeError: ``src`` or ``dst`` is not a tensor, or ``dtype`` not a ``torch.dtype``.

        Example::

            >>> master = pinned_empty((n,), torch.float32)
            >>> weights = engine.h2d(master, dtype=torch.bfloat16).wait()  # 4 bytes a weight cross
        """
        chunk_bytes = self._chunk_bytes(chunk_bytes)
        _check_tensor(src, "cpu", "h2d", "src")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"h2d: dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        dtype = src.dtype if dtype is None else dtype
        if dst is not None:
            _check_tensor(dst, self.device, "h2d", "dst")
            _check_same(dst, src, "h2d", dtype)
        if dtype != src.dtype:
            return self._issue_cast(src, dst, dtype, label=label, chunk_bytes=chunk_bytes)
        return self._issue(src, dst, to_device=True, label=label, chunk_bytes=chunk_bytes)

    def d2h(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        label: str = "d2h",
        chunk_bytes: int | None = None,
        mark_src_used: bool = True,
    ) -> Transfer:
        """Copy a device tensor to host memory, asynchronously on :attr:`d2h_stream`.

        The copy starts after the work already queued on the current stream (the producer of
        ``src``) and ``src``'s memory is not reused until it finished, even if ``src`` is freed.

        Args:
            src (torch.Tensor): contiguous tensor on the engine's device.
            dst (torch.Tensor): contiguous CPU tensor (pinned, e.g. from
                :func:`~torch_fsdp_offload.memory.pinned_empty`, for an asynchronous copy) with
                ``src``'s dtype and number of elements.
            label (str): profiler label, ``torch_fsdp_offload::<label>``.
            chunk_bytes (int | None): chunk size; default :attr:`chunk_bytes`.
            mark_src_used (bool): True (default): ``src`` is marked used on the copy stream
                (``record_stream``), so its memory stays allocated until an allocation finds the
                copy finished. False: the caller orders the reuse itself, making the stream that
                allocated ``src`` wait for the copy (``transfer.wait(that_stream)``) before it drops
                ``src``, which is then free at once.

        Returns:
            Transfer: ``tensor`` is ``dst``; call ``synchronize()`` (or ``wait()``) before reading it.

        Raises:
            ValueError: if a tensor is on the wrong device, not contiguous, or the two differ in dtype
                or number of elements; nothing is copied then.
        """
        chunk_bytes = self._chunk_bytes(chunk_bytes)
        _check_tensor(src, self.device, "d2h", "src")
        _check_tensor(dst, "cpu", "d2h", "dst")
        _check_same(dst, src, "d2h")
        return self._issue(dst, src, to_device=False, label=label, chunk_bytes=chunk_bytes, mark_used=mark_src_used)

    def synchronize(self) -> None:
        """Wait for every copy issued so far and release the buffers kept for them.

        Raises:
            RuntimeError: asynchronous CPU copies only: the first misuse one of them found.

        Example::

            >>> engine.synchronize()
        """
        with self._lock:
            self._pending.synchronize()

    # ------------------------------------------------------------------------------- internals

    def _chunk_bytes(self, chunk_bytes: int | None) -> int:
        if chunk_bytes is None:
            return self.chunk_bytes
        _check_chunk_bytes(chunk_bytes)
        return chunk_bytes

    def _issue(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None,
        *,
        to_device: bool,
        label: str,
        chunk_bytes: int,
        mark_used: bool = True,
    ) -> Transfer:
        """Copy between ``host_tensor``'s and ``device_tensor``'s bytes; ``device_tensor`` None means
        allocate it (host to device only). ``mark_used``: see ``d2h``'s ``mark_src_used``."""
        nbytes = _nbytes(host_tensor)
        with self._lock, torch.profiler.record_function(_PROFILER_PREFIX + label), torch.no_grad():
            stream = self._streams.stream(to_device)
            allocated = device_tensor is None
            if allocated:
                with stream.as_current():
                    device_tensor = torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=self.device)
            destination = device_tensor if to_device else host_tensor
            if nbytes == 0:
                return Transfer(destination, label=label, nbytes=0)

            device_bytes, host_bytes = stream.at_issue(
                [_as_bytes(device_tensor), _as_bytes(host_tensor)], written=[to_device, not to_device]
            )
            alias = managed_device_alias(host_tensor, self.device)
            if alias is not None:
                host_bytes = _as_bytes(alias)  # managed memory: copied through its CUDA view
            source, target = (host_bytes, device_bytes) if to_device else (device_bytes, host_bytes)

            def copy() -> None:
                _copy_in_chunks(target, source, _chunks(nbytes, chunk_bytes))

            return self._launch(
                copy, stream, to_device, [source], [target], device_tensor, allocated, host_tensor, destination,
                label, nbytes, mark_used=mark_used,
            )

    def _issue_cast(
        self, src: torch.Tensor, dst: torch.Tensor | None, dtype: torch.dtype, *, label: str, chunk_bytes: int
    ) -> Transfer:
        """Host to device with a cast on the device: each chunk of ``src`` lands in one device buffer
        of ``src``'s dtype, reused for every chunk (the stream orders them), and is cast into ``dst``."""
        nbytes = _nbytes(src)
        with self._lock, torch.profiler.record_function(_PROFILER_PREFIX + label), torch.no_grad():
            stream = self._streams.stream(True)
            allocated = dst is None
            if allocated:
                with stream.as_current():
                    dst = torch.empty(src.shape, dtype=dtype, device=self.device)
            if nbytes == 0:
                return Transfer(dst, label=label, nbytes=0)
            flat_src, flat_dst = stream.at_issue([src.reshape(-1), dst.reshape(-1)], written=[False, True])
            alias = managed_device_alias(src, self.device)
            if alias is not None:
                flat_src = alias.reshape(-1)  # managed memory: copied through its CUDA view
            chunks = _chunks(src.numel(), max(1, chunk_bytes // src.element_size()))
            with stream.as_current():
                # Allocated on the copy stream and only used there: when it is dropped, the
                # allocator hands it out again only to later work of this stream, which runs after
                # these casts.
                landed = torch.empty(chunks[0].stop, dtype=src.dtype, device=self.device)

            def copy() -> None:
                for chunk in chunks:
                    size = chunk.stop - chunk.start
                    landed[:size].copy_(flat_src[chunk], non_blocking=True)
                    flat_dst[chunk].copy_(landed[:size])

            sources, targets = [_as_bytes(flat_src)], [_as_bytes(flat_dst)]
            return self._launch(copy, stream, True, sources, targets, dst, allocated, src, dst, label, nbytes)

    def _launch(
        self,
        copy: Callable[[], None],
        stream: CopyStream,
        to_device: bool,
        sources: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        device_tensor: torch.Tensor,
        allocated: bool,
        host_tensor: torch.Tensor,
        destination: torch.Tensor,
        label: str,
        nbytes: int,
        mark_used: bool = True,
    ) -> Transfer:
        """Run ``copy`` (reading the byte views ``sources``, writing ``targets``) on ``stream``,
        ordered after what it must follow, count it, and track the event that ends it.
        ``mark_used``: see ``d2h``'s ``mark_src_used``."""
        reads, writes = [byte_range(t) for t in sources], [byte_range(t) for t in targets]
        event = stream.issue(
            CopyRequest(
                copy,
                label,
                sources,
                targets,
                in_flight=self._pending.in_flight(stream, reads, writes),
                keep_alive=(host_tensor,),
                device_tensor=None if allocated else device_tensor,
                mark_used=mark_used,
            )
        )
        self._count(to_device, nbytes)
        issued = IssuedCopy(event, stream, reads, writes)
        self._pending.add(issued)
        return Transfer(destination, label=label, nbytes=nbytes, copy=issued)

    def _count(self, to_device: bool, nbytes: int) -> None:
        if to_device:
            self.stats.h2d_bytes += nbytes
            self.stats.h2d_copies += 1
        else:
            self.stats.d2h_bytes += nbytes
            self.stats.d2h_copies += 1


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int (bytes), got {chunk_bytes!r}")


def _check_tensor(tensor: torch.Tensor, device: torch.device | str, fn: str, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    expected = torch.device(device)
    if tensor.device != expected:
        raise ValueError(f"{fn}: {name} must be on {expected}, got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (call .contiguous() first); got strides {tensor.stride()}")


def _check_same(dst: torch.Tensor, src: torch.Tensor, fn: str, dtype: torch.dtype | None = None) -> None:
    """``dst`` holds as many elements as ``src``, of ``dtype`` (default ``src``'s)."""
    dtype = src.dtype if dtype is None else dtype
    if dst.dtype != dtype or dst.numel() != src.numel():
        cast = "" if dtype == src.dtype else f" cast to {dtype}"
        hint = ", or pass dtype= to cast on the device" if fn == "h2d" and dst.dtype != dtype == src.dtype else ""
        raise ValueError(
            f"{fn}: dst ({dst.dtype}, {dst.numel()} elements) must match src ({src.dtype}, "
            f"{src.numel()} elements){cast}; give a dst of that dtype and size{hint}"
        )


_engines: dict[torch.device, TransferEngine] = {}
_engines_lock = threading.Lock()


def get_transfer_engine(device: torch.device | str | int | None = None) -> TransferEngine:
    """Return this process's :class:`TransferEngine` for ``device``, creating it on first use.

    Args:
        device (torch.device | str | int | None): ``cuda:N``, an index, ``"cuda"`` (the current
            device) or ``"cpu"``; None: the current CUDA device, or the CPU without one.

    Returns:
        TransferEngine: the same object for every call with the same device.

    Raises:
        ValueError: if ``device`` is neither CUDA nor CPU, or CUDA is asked for but not available.

    Example::

        >>> engine = get_transfer_engine(torch.device("cuda", local_rank))
        >>> engine is get_transfer_engine(local_rank)
        True
    """
    resolved = resolve_device(device)
    with _engines_lock:
        engine = _engines.get(resolved)
        if engine is None:
            engine = _engines[resolved] = TransferEngine(resolved)
        return engine

