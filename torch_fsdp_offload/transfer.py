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

On a CPU "device" (HOST_ONLY, or a platform forced to another kind in CPU tests) the same API runs
with synchronous copies and no streams, and still counts every byte, so callers can prove what they
copy. For CI, the CPU copies can instead run late on one worker thread per direction, ending in
events, with destinations poisoned until they land and sources checked for changes while in flight
(:mod:`torch_fsdp_offload._cpu_copy_stream`; ``TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES=<max delay ms>``,
set by the test suite, or :func:`~torch_fsdp_offload._cpu_copy_stream.cpu_async_copies`). Every copy
runs under ``torch.profiler.record_function("torch_fsdp_offload::<label>")``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from torch_fsdp_offload._cpu_copy_stream import (
    CpuCopyEvent,
    CpuCopyStream,
    current_cpu_async_copies,
    versioned_at_issue,
)
from torch_fsdp_offload.platform import resolve_device

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "PrefetchQueue",
    "Transfer",
    "TransferEngine",
    "TransferStats",
    "get_transfer_engine",
]

# 64 MiB chunks reached 54.3 GB/s of a 54.6 GB/s link on an H200 over PCIe Gen5 (4 MiB: 52 GB/s);
# chunks that size keep a long copy interleavable with other streams' copies at little cost.
DEFAULT_CHUNK_BYTES = 64 << 20
# Stream priority for the copy streams: lower is higher priority; torch clamps it to what the
# device supports. Copies gate compute (a layer cannot start before its weights arrived), so they
# should not queue behind compute kernels.
_COPY_STREAM_PRIORITY = -1
_PROFILER_PREFIX = "torch_fsdp_offload::"


@dataclasses.dataclass
class TransferStats:
    """Bytes and copies moved by one engine, each way.

    A copy is one call (``h2d``, ``d2h``, or a coalesced call), whatever its number of chunks;
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


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage behind ``tensor``."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _runs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Flat uint8 views of ``tensors`` (contiguous), neighbours in one storage merged into one view.

    Tensors carved out of one flat buffer (the usual layout of a parameter group) then move in one
    copy instead of one per tensor; separate allocations are never merged.
    """
    runs: list[torch.Tensor] = []
    index = 0
    while index < len(tensors):
        first = tensors[index]
        storage_ptr = first.untyped_storage().data_ptr()
        end = first.data_ptr() + _nbytes(first)
        last = index
        while last + 1 < len(tensors):
            candidate = tensors[last + 1]
            if candidate.untyped_storage().data_ptr() != storage_ptr or candidate.data_ptr() != end:
                break
            end += _nbytes(candidate)
            last += 1
        if last == index:
            runs.append(_as_bytes(first))
        else:
            start = first.data_ptr() - storage_ptr
            runs.append(_storage_bytes(first)[start : start + end - first.data_ptr()])
        index = last + 1
    return runs


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.data_ptr() + _nbytes(tensor)


def _overlaps(ranges: Iterable[tuple[int, int]], others: Iterable[tuple[int, int]]) -> bool:
    others = list(others)
    return any(start < other_end and other_start < end for start, end in ranges for other_start, other_end in others)


class _IssuedCopy:
    """What the engine remembers of an issued copy until it finished: its event, the stream it
    runs on (CUDA, or a :class:`CpuCopyStream`), the byte ranges it reads and writes (to order later
    conflicting copies after it) and the host tensors it uses (kept alive). Not the device tensor: the engine must not decide how
    long device memory lives. It was allocated on the copy stream or record_stream()-ed there, so
    the allocator cannot hand it out before the copy ends; an engine reference would instead keep
    every copied-in buffer (a block's parameters, a reloaded activation) alive until a later copy
    happened to prune it."""

    __slots__ = ("event", "stream", "reads", "writes", "keep_alive")

    def __init__(
        self,
        event: torch.cuda.Event | CpuCopyEvent,
        stream: torch.cuda.Stream | CpuCopyStream,
        reads: Sequence[tuple[int, int]],
        writes: Sequence[tuple[int, int]],
        keep_alive: Sequence[torch.Tensor],
    ) -> None:
        self.event = event
        self.stream = stream
        self.reads = tuple(reads)
        self.writes = tuple(writes)
        # Dropped once the event completed.
        self.keep_alive: list[torch.Tensor] | None = list(keep_alive)

    def done(self) -> bool:
        """Whether the copy finished; an asynchronous CPU copy raises the misuse it found."""
        if isinstance(self.event, CpuCopyEvent):
            return self.event.query() and self.landed()
        return self.landed()

    def landed(self) -> bool:
        """Whether the copy finished (dropping the host buffers kept for it), raising nothing."""
        if self.keep_alive is None:
            return True
        if not (self.event.landed() if isinstance(self.event, CpuCopyEvent) else self.event.query()):
            return False
        self.keep_alive = None
        return True

    def synchronize(self) -> None:
        if self.keep_alive is not None or isinstance(self.event, CpuCopyEvent):
            self.event.synchronize()
            self.keep_alive = None


class Transfer:
    """Handle on one copy issued by a :class:`TransferEngine`.

    Attributes:
        tensor (torch.Tensor | None): the destination: the device buffer of a host-to-device copy
            (for ``h2d_coalesced`` the flat buffer), the host tensor of a device-to-host copy, None for
            ``d2h_coalesced`` (its destinations are the caller's ``views``).
        views (tuple[torch.Tensor, ...]): the destination per source, shaped like it (for
            ``h2d_coalesced``, views into the flat buffer).
        label (str): the profiler label the copy ran under.
        nbytes (int): bytes copied.

    Do not read ``tensor`` before :meth:`wait` (or :meth:`synchronize`): the copy may still be running.

    Example::

        >>> transfer = get_transfer_engine("cuda").h2d_coalesced([host_a, host_b], label="block0")
        >>> device_a, device_b = transfer.views
        >>> transfer.wait()  # the current stream waits for this copy, then may use the views
    """

    def __init__(
        self,
        tensor: torch.Tensor | None,
        views: Sequence[torch.Tensor],
        *,
        label: str,
        nbytes: int,
        copy: _IssuedCopy | None = None,
    ) -> None:
        self.tensor = tensor
        self.views = tuple(views)
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
        return self._copy is None or self._copy.done()

    def synchronize(self) -> None:
        """Block the calling thread until the copy has finished.

        Raises:
            RuntimeError: as :meth:`done`.

        Example::

            >>> get_transfer_engine("cuda").d2h(grad, host_grad).synchronize()
            >>> host_grad.sum()  # the host sees the gradient
        """
        if self._copy is not None:
            self._copy.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor | None:
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
            torch.Tensor | None: :attr:`tensor`, safe to use on ``stream`` (or on the host).

        Raises:
            RuntimeError: as :meth:`done`.

        Example::

            >>> weights = get_transfer_engine("cuda").h2d(host_weights).wait()
            >>> out = inputs @ weights  # ordered after the copy on the current stream
        """
        if self._copy is None:
            return self.tensor
        destination_on_host = self.tensor is None or self.tensor.device.type == "cpu"
        if isinstance(self._copy.stream, CpuCopyStream) or (stream is None and destination_on_host):
            self.synchronize()
            return self.tensor
        if stream is None:
            stream = torch.cuda.current_stream(self.tensor.device)
        stream.wait_event(self._copy.event)
        if not destination_on_host and stream != self._copy.stream:
            self.tensor.record_stream(stream)
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
        if self._copy is None:
            return self.tensor
        if not isinstance(self._copy.stream, torch.cuda.Stream):
            self.synchronize()  # a CPU copy: its consumer is the calling thread
            return self.tensor
        if stream is None:
            stream = torch.cuda.current_stream(self.tensor.device)
        stream.wait_event(self._copy.event)
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
        if self.device.type == "cuda":
            self.h2d_stream = torch.cuda.Stream(self.device, priority=_COPY_STREAM_PRIORITY)
            self.d2h_stream = torch.cuda.Stream(self.device, priority=_COPY_STREAM_PRIORITY)
        else:
            self.h2d_stream = self.d2h_stream = None
        self._pending: collections.deque[_IssuedCopy] = collections.deque()
        self._lock = threading.RLock()
        # Asynchronous CPU copies (h2d, d2h), made on first use; see _copy_stream.
        self._cpu_streams: tuple[CpuCopyStream, CpuCopyStream] | None = None

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
        return self._issue([src], dst, to_device=True, coalesced=False, label=label, chunk_bytes=chunk_bytes)

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
        return self._issue(
            [dst], src, to_device=False, coalesced=False, label=label, chunk_bytes=chunk_bytes, mark_used=mark_src_used
        )

    def h2d_coalesced(
        self,
        srcs: Sequence[torch.Tensor],
        dst: torch.Tensor | None = None,
        *,
        label: str = "h2d_coalesced",
        chunk_bytes: int | None = None,
    ) -> Transfer:
        """Copy many host tensors into one flat device buffer, as one transfer with one event.

        Sources that lie back to back in one storage (e.g. views of one flat pinned buffer) move in
        a single chunked copy; others move one after another on the same stream.

        Args:
            srcs (Sequence[torch.Tensor]): contiguous CPU tensors of one dtype.
            dst (torch.Tensor | None): flat (1-D) device tensor of that dtype with as many elements
                as ``srcs`` together; None (default): allocated on the engine's stream.
            label (str): profiler label, ``torch_fsdp_offload::<label>``.
            chunk_bytes (int | None): chunk size; default :attr:`chunk_bytes`.

        Returns:
            Transfer: ``tensor`` is the flat buffer and ``views`` one view of it per source, shaped
            like that source.

        Raises:
            ValueError: if ``srcs`` is empty, mixes dtypes, holds a non-contiguous or non-CPU tensor,
                or ``dst`` has the wrong device, dtype, shape or size.
        """
        chunk_bytes = self._chunk_bytes(chunk_bytes)
        dtype = _check_coalesced(srcs, "cpu", "h2d_coalesced", "srcs")
        numel = sum(src.numel() for src in srcs)
        if dst is not None:
            _check_flat(dst, self.device, dtype, numel, "h2d_coalesced")
        return self._issue(srcs, dst, to_device=True, coalesced=True, label=label, chunk_bytes=chunk_bytes)

    def d2h_coalesced(
        self,
        src: torch.Tensor,
        dsts: Sequence[torch.Tensor],
        *,
        label: str = "d2h_coalesced",
        chunk_bytes: int | None = None,
    ) -> Transfer:
        """Copy one flat device buffer back into many host tensors, as one transfer with one event.

        The inverse of :meth:`h2d_coalesced`: ``dsts`` receive consecutive slices of ``src``.

        Args:
            src (torch.Tensor): flat (1-D) contiguous tensor on the engine's device.
            dsts (Sequence[torch.Tensor]): contiguous CPU tensors of ``src``'s dtype whose sizes add
                up to ``src``'s.
            label (str): profiler label, ``torch_fsdp_offload::<label>``.
            chunk_bytes (int | None): chunk size; default :attr:`chunk_bytes`.

        Returns:
            Transfer: ``tensor`` is None and ``views`` are ``dsts``; ``synchronize()`` before reading.

        Raises:
            ValueError: if ``dsts`` is empty, mixes dtypes, holds a non-contiguous or non-CPU tensor,
                or ``src`` has the wrong device, dtype, shape or size.
        """
        chunk_bytes = self._chunk_bytes(chunk_bytes)
        dtype = _check_coalesced(dsts, "cpu", "d2h_coalesced", "dsts")
        _check_flat(src, self.device, dtype, sum(dst.numel() for dst in dsts), "d2h_coalesced")
        return self._issue(dsts, src, to_device=False, coalesced=True, label=label, chunk_bytes=chunk_bytes)

    def synchronize(self) -> None:
        """Wait for every copy issued so far and release the buffers kept for them.

        Raises:
            RuntimeError: asynchronous CPU copies only: the first misuse one of them found.

        Example::

            >>> engine.synchronize()
        """
        with self._lock:
            pending, self._pending = self._pending, collections.deque()
            errors = []
            for copy in pending:
                try:
                    copy.synchronize()
                except RuntimeError as error:  # a misuse an asynchronous CPU copy found
                    errors.append(error)
            if errors:
                raise errors[0]

    # ------------------------------------------------------------------------------- internals

    def _chunk_bytes(self, chunk_bytes: int | None) -> int:
        if chunk_bytes is None:
            return self.chunk_bytes
        _check_chunk_bytes(chunk_bytes)
        return chunk_bytes

    def _issue(
        self,
        host_tensors: Sequence[torch.Tensor],
        device_tensor: torch.Tensor | None,
        *,
        to_device: bool,
        coalesced: bool,
        label: str,
        chunk_bytes: int,
        mark_used: bool = True,
    ) -> Transfer:
        """Copy between ``host_tensors``, one after another, and ``device_tensor``'s bytes.

        ``device_tensor`` is flat for coalesced copies and shaped like the host tensor otherwise;
        None means allocate it (host to device only). ``mark_used``: see ``d2h``'s ``mark_src_used``.
        """
        nbytes = sum(_nbytes(tensor) for tensor in host_tensors)
        with self._lock, torch.profiler.record_function(_PROFILER_PREFIX + label), torch.no_grad():
            stream = self._copy_stream(to_device)
            allocated = device_tensor is None
            if allocated:
                shape = (sum(t.numel() for t in host_tensors),) if coalesced else host_tensors[0].shape
                with _on_stream(stream):
                    device_tensor = torch.empty(shape, dtype=host_tensors[0].dtype, device=self.device)
            if to_device:
                views = _split(device_tensor, host_tensors) if coalesced else [device_tensor]
                destination = device_tensor
            else:
                views = list(host_tensors)
                destination = None if coalesced else host_tensors[0]
            if nbytes == 0:
                return Transfer(destination, views, label=label, nbytes=0)

            device_bytes = _as_bytes(device_tensor)
            host_runs = _runs(host_tensors)
            if isinstance(stream, CpuCopyStream):
                written = [to_device] + [not to_device] * len(host_runs)
                device_bytes, *host_runs = versioned_at_issue([device_bytes, *host_runs], written=written)

            def copy() -> None:
                offset = 0
                for run in host_runs:
                    device_run = device_bytes[offset : offset + run.numel()]
                    if to_device:
                        _copy_in_chunks(device_run, run, _chunks(run.numel(), chunk_bytes))
                    else:
                        _copy_in_chunks(run, device_run, _chunks(run.numel(), chunk_bytes))
                    offset += run.numel()

            sources, targets = (host_runs, [device_bytes]) if to_device else ([device_bytes], host_runs)
            return self._launch(
                copy, stream, to_device, sources, targets, device_tensor, allocated, host_tensors, destination, views,
                label, nbytes, mark_used=mark_used,
            )

    def _issue_cast(
        self, src: torch.Tensor, dst: torch.Tensor | None, dtype: torch.dtype, *, label: str, chunk_bytes: int
    ) -> Transfer:
        """Host to device with a cast on the device: each chunk of ``src`` lands in one device buffer
        of ``src``'s dtype, reused for every chunk (the stream orders them), and is cast into ``dst``."""
        nbytes = _nbytes(src)
        with self._lock, torch.profiler.record_function(_PROFILER_PREFIX + label), torch.no_grad():
            stream = self._copy_stream(True)
            allocated = dst is None
            if allocated:
                with _on_stream(stream):
                    dst = torch.empty(src.shape, dtype=dtype, device=self.device)
            if nbytes == 0:
                return Transfer(dst, [dst], label=label, nbytes=0)
            flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
            if isinstance(stream, CpuCopyStream):
                flat_src, flat_dst = versioned_at_issue([flat_src, flat_dst], written=[False, True])
            chunks = _chunks(src.numel(), max(1, chunk_bytes // src.element_size()))
            with _on_stream(stream):
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
            return self._launch(copy, stream, True, sources, targets, dst, allocated, [src], dst, [dst], label, nbytes)

    def _copy_stream(self, to_device: bool) -> torch.cuda.Stream | CpuCopyStream | None:
        """The stream a copy runs on: this engine's CUDA stream of that direction; on a CPU device, a
        :class:`CpuCopyStream` when asynchronous CPU copies are on, else None (a synchronous copy,
        issued once the asynchronous ones before it have finished)."""
        if self.device.type == "cuda":
            return self.h2d_stream if to_device else self.d2h_stream
        mode = current_cpu_async_copies()
        if self._cpu_streams is not None and (mode is None or self._cpu_streams[0].mode != mode):
            self.synchronize()  # the new streams (or synchronous copies) must not overtake these
            for stream in self._cpu_streams:
                stream.close()
            self._cpu_streams = None
        if mode is None:
            return None
        if self._cpu_streams is None:
            self._cpu_streams = (CpuCopyStream("h2d", mode), CpuCopyStream("d2h", mode))
        return self._cpu_streams[0 if to_device else 1]

    def _launch(
        self,
        copy: Callable[[], None],
        stream: torch.cuda.Stream | CpuCopyStream | None,
        to_device: bool,
        sources: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        device_tensor: torch.Tensor,
        allocated: bool,
        host_tensors: Sequence[torch.Tensor],
        destination: torch.Tensor | None,
        views: Sequence[torch.Tensor],
        label: str,
        nbytes: int,
        mark_used: bool = True,
    ) -> Transfer:
        """Run ``copy`` (reading the byte views ``sources``, writing ``targets``) on ``stream``,
        ordered after what it must follow, count it, and end it in an event the engine tracks.
        ``mark_used``: see ``d2h``'s ``mark_src_used``."""
        if stream is None:
            copy()
            self._count(to_device, nbytes)
            return Transfer(destination, views, label=label, nbytes=nbytes)
        reads, writes = [_byte_range(t) for t in sources], [_byte_range(t) for t in targets]
        conflicting, writes_in_use, reads_in_flight = self._unfinished_conflicts(stream, reads, writes)
        if isinstance(stream, CpuCopyStream):
            event = stream.submit(
                label,
                copy,
                after=[earlier.event for earlier in conflicting],
                sources=sources,
                destinations=targets,
                # Nor where the copy reads what it writes (a CPU "device" tensor aliasing its host copy).
                poison=not writes_in_use and not _overlaps(reads, writes),
                sources_in_flight=reads_in_flight,
            )
        else:
            if not allocated:
                # The current stream produced the device tensor or may still use it.
                stream.wait_stream(torch.cuda.current_stream(self.device))
            for earlier in conflicting:
                stream.wait_event(earlier.event)
            if not allocated and mark_used:
                # Memory the caller may free while the copy runs must not be reused under it.
                device_tensor.record_stream(stream)
            with torch.cuda.stream(stream):
                copy()
            event = torch.cuda.Event()
            event.record(stream)
        self._count(to_device, nbytes)
        # A CPU copy's job holds its buffers itself and drops them as it lands.
        keep_alive = () if isinstance(stream, CpuCopyStream) else host_tensors
        issued = _IssuedCopy(event, stream, reads, writes, keep_alive=keep_alive)
        self._pending.append(issued)
        return Transfer(destination, views, label=label, nbytes=nbytes, copy=issued)

    def _unfinished_conflicts(
        self,
        stream: torch.cuda.Stream | CpuCopyStream,
        reads: Sequence[tuple[int, int]],
        writes: Sequence[tuple[int, int]],
    ) -> tuple[list[_IssuedCopy], bool, bool]:
        """The unfinished copies on other streams that a coming copy on ``stream`` must follow (whose
        memory conflicts with its: read after write, write after read or write), whether any
        unfinished copy, on any stream, reads or writes the memory it writes, and whether any writes
        the memory it reads.

        Finished copies are forgotten here, which releases the host buffers they kept alive.
        """
        still_running: collections.deque[_IssuedCopy] = collections.deque()
        conflicting = []
        writes_in_use = reads_in_flight = False
        for earlier in self._pending:
            if earlier.landed():
                continue
            still_running.append(earlier)
            overwrites = _overlaps(writes, [*earlier.reads, *earlier.writes])
            reads_written = _overlaps(reads, earlier.writes)
            writes_in_use = writes_in_use or overwrites
            reads_in_flight = reads_in_flight or reads_written
            if earlier.stream != stream and (overwrites or reads_written):
                conflicting.append(earlier)  # same stream: already ordered
        self._pending = still_running
        return conflicting, writes_in_use, reads_in_flight

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


def _check_coalesced(tensors: Sequence[torch.Tensor], device: str, fn: str, name: str) -> torch.dtype:
    if len(tensors) == 0:
        raise ValueError(f"{fn}: {name} is empty; pass at least one tensor")
    for index, tensor in enumerate(tensors):
        _check_tensor(tensor, device, fn, f"{name}[{index}]")
    dtypes = {tensor.dtype for tensor in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{fn}: {name} mixes dtypes {sorted(map(str, dtypes))}; coalesce one dtype per call")
    return tensors[0].dtype


def _check_flat(flat: torch.Tensor, device: torch.device, dtype: torch.dtype, numel: int, fn: str) -> None:
    _check_tensor(flat, device, fn, "the flat buffer")
    if flat.dim() != 1 or flat.dtype != dtype or flat.numel() != numel:
        raise ValueError(
            f"{fn}: the flat buffer must be 1-D {dtype} with {numel} elements (the tensors' total), "
            f"got shape {tuple(flat.shape)} {flat.dtype}"
        )


def _on_stream(stream: torch.cuda.Stream | CpuCopyStream | None):
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of ``flat``, shaped like ``like``."""
    views, offset = [], 0
    for tensor in like:
        views.append(flat[offset : offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    return views


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


class PrefetchQueue:
    """A bounded look-ahead of host-to-device copies, keyed by name.

    Issue copies ahead of use with :meth:`prefetch` (e.g. the next ``prefetch_depth`` layers' weights
    or saved activations); :meth:`get` returns a name's device tensor once the copy has landed, with
    the consumer stream waiting on that copy alone. At most ``prefetch_depth`` copies are queued: a
    new one beyond that evicts the oldest (its device memory is released once its copy finished).
    A :meth:`get` for a name not queued copies it then (a miss) when given the host tensor.

    Args:
        engine (TransferEngine): the engine that copies.
        prefetch_depth (int): copies in flight at most, >= 1.
        label (str): profiler label prefix; each copy runs under ``torch_fsdp_offload::<label>:<name>``.

    Attributes:
        hits (int): :meth:`get` calls served by a queued copy.
        misses (int): :meth:`get` calls that had to copy on demand.
        evictions (int): queued copies dropped unused to respect the bound.

    Raises:
        ValueError: if ``prefetch_depth`` is not a positive int.

    Example::

        >>> queue = PrefetchQueue(get_transfer_engine("cuda"), prefetch_depth=2)
        >>> for i, block in enumerate(blocks):
        ...     for ahead in range(i, min(i + 2, len(blocks))):
        ...         queue.prefetch(f"block{ahead}", host_weights[ahead])
        ...     weights = queue.get(f"block{i}")
    """

    def __init__(self, engine: TransferEngine, prefetch_depth: int = 2, *, label: str = "prefetch") -> None:
        if not isinstance(prefetch_depth, int) or isinstance(prefetch_depth, bool) or prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
        self.engine = engine
        self.prefetch_depth = prefetch_depth
        self.label = label
        self.hits = self.misses = self.evictions = 0
        self._queued: collections.OrderedDict[str, Transfer] = collections.OrderedDict()

    def prefetch(self, name: str, src: torch.Tensor, dst: torch.Tensor | None = None) -> bool:
        """Start copying ``src`` to the device under ``name`` unless it is already queued.

        Args:
            name (str): the key :meth:`get` will ask for.
            src (torch.Tensor): contiguous (pinned) CPU tensor.
            dst (torch.Tensor | None): device tensor to copy into; default: allocated by the engine.

        Returns:
            bool: True if a copy was issued, False if ``name`` was already queued.

        Raises:
            ValueError: as :meth:`TransferEngine.h2d`; nothing is queued or evicted then.
        """
        if name in self._queued:
            return False
        transfer = self.engine.h2d(src, dst, label=f"{self.label}:{name}")
        while len(self._queued) >= self.prefetch_depth:
            self._queued.popitem(last=False)
            self.evictions += 1
        self._queued[name] = transfer
        return True

    def get(
        self,
        name: str,
        src: torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor:
        """Remove ``name`` from the queue and return its device tensor, ready to use on ``stream``.

        Args:
            name (str): a name given to :meth:`prefetch`.
            src (torch.Tensor | None): the host tensor, copied now if ``name`` is not queued.
            stream (torch.cuda.Stream | None): consumer stream; default the current stream.

        Returns:
            torch.Tensor: the device tensor.

        Raises:
            KeyError: if ``name`` is not queued and no ``src`` is given.
        """
        transfer = self._queued.pop(name, None)
        if transfer is not None:
            self.hits += 1
        elif src is None:
            raise KeyError(
                f"PrefetchQueue.get({name!r}): not queued (queued: {list(self._queued)}); "
                "prefetch it first or pass src= to copy it on demand"
            )
        else:
            self.misses += 1
            transfer = self.engine.h2d(src, label=f"{self.label}:{name}")
        return transfer.wait(stream)

    def names(self) -> list[str]:
        """The queued names, oldest first."""
        return list(self._queued)

    def __contains__(self, name: object) -> bool:
        return name in self._queued

    def __len__(self) -> int:
        return len(self._queued)

    def clear(self) -> None:
        """Drop every queued copy (their memory is released once the copies finished)."""
        self._queued.clear()
