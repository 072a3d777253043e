"""The streams and events a :class:`~torch_fsdp_offload.transfer.TransferEngine` runs its copies on.

The engine asks its :class:`CopyStreams` for the stream of a direction, issues each copy on that
:class:`CopyStream` and tracks the :class:`CopyEvent` the stream returns; it never asks which kind of
stream it holds. Three kinds implement the interface:

* :class:`CudaCopyStreams`: the engine's two CUDA streams, a thin adapter over ``torch.cuda.Stream``
  and ``torch.cuda.Event``;
* :data:`SYNCHRONOUS`: copies that have run when they are issued (a CPU "device");
* :class:`~torch_fsdp_offload.cpu_copy_stream.CpuCopyStream`: copies that land late on a worker
  thread, for CI (chosen with the synchronous one by
  :class:`~torch_fsdp_offload.cpu_copy_stream.CpuCopyStreams`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

__all__ = [
    "SYNCHRONOUS",
    "CopyEvent",
    "CopyRequest",
    "CopyStream",
    "CopyStreams",
    "CudaCopyEvent",
    "CudaCopyStream",
    "CudaCopyStreams",
    "InFlight",
]


class CopyEvent(Protocol):
    """The end of one issued copy."""

    def query(self) -> bool:
        """Whether the copy finished; raises the misuse it found, where its stream looks for any."""

    def landed(self) -> bool:
        """Whether the copy finished, raising nothing (for the engine's bookkeeping)."""

    def synchronize(self) -> None:
        """Block the calling thread until the copy finished; raises as :meth:`query`."""


@dataclasses.dataclass(frozen=True)
class InFlight:
    """What a copy about to be issued meets of the unfinished copies issued before it.

    Attributes:
        after (Sequence[CopyEvent]): the events of those on another stream whose memory conflicts
            with the copy's (read after write, write after read or write): it must run after them.
        targets_in_use (bool): an unfinished copy, on any stream, reads or writes what it writes.
        sources_in_flight (bool): an unfinished copy writes what it reads.
    """

    after: Sequence[CopyEvent]
    targets_in_use: bool
    sources_in_flight: bool


@dataclasses.dataclass(frozen=True)
class CopyRequest:
    """A copy for a :class:`CopyStream` to issue.

    Attributes:
        run (Callable[[], None]): copies the bytes (all chunks), on the stream it is run on.
        label (str): the copy's profiler label.
        sources (Sequence[torch.Tensor]): flat uint8 views of the bytes it reads (from
            :meth:`CopyStream.at_issue`).
        targets (Sequence[torch.Tensor]): flat uint8 views of the bytes it writes (likewise).
        in_flight (InFlight): what it meets of the unfinished copies before it.
        keep_alive (Sequence[torch.Tensor]): host tensors that must stay allocated until it finished.
        device_tensor (torch.Tensor | None): the device tensor the caller gave (None: allocated for
            the copy on its stream). The copy follows the work queued on the device's current
            stream, which may have produced it or still use it.
        mark_used (bool): with ``device_tensor``: its memory is not reused before the copy
            finished, even if the caller frees it.
    """

    run: Callable[[], None]
    label: str
    sources: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    in_flight: InFlight
    keep_alive: Sequence[torch.Tensor]
    device_tensor: torch.Tensor | None
    mark_used: bool


class CopyStream(Protocol):
    """One direction's copies, run in issue order."""

    def as_current(self) -> contextlib.AbstractContextManager[None]:
        """A context in which device work and allocations are ordered on this stream."""

    def at_issue(self, tensors: Sequence[torch.Tensor], *, written: Sequence[bool]) -> list[torch.Tensor]:
        """The tensors that a copy issued now reads and writes through (``written``: which it writes)."""

    def issue(self, copy: CopyRequest) -> CopyEvent:
        """Run ``copy`` on this stream, after ``copy.in_flight.after``; return the event that ends it."""

    def hand_over(
        self, event: CopyEvent, destination: torch.Tensor, consumer: torch.cuda.Stream | None, *, mark_used: bool
    ) -> None:
        """Make the consumer of a copy's ``destination`` wait for the copy's ``event``: ``consumer``
        (None: the destination's default consumer), marking ``destination`` used there with
        ``mark_used``."""


class CopyStreams(Protocol):
    """The streams an engine's copies run on."""

    def stream(self, to_device: bool) -> CopyStream:
        """The stream of a copy issued now, host to device or device to host."""


class _Landed:
    """The event of a copy that ran when it was issued."""

    def query(self) -> bool:
        return True

    def landed(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Synchronous:
    """Copies that run when they are issued, on the calling thread, which is their only consumer."""

    _LANDED = _Landed()

    def as_current(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def at_issue(self, tensors: Sequence[torch.Tensor], *, written: Sequence[bool]) -> list[torch.Tensor]:
        return list(tensors)

    def issue(self, copy: CopyRequest) -> CopyEvent:
        copy.run()
        return self._LANDED

    def hand_over(self, event: CopyEvent, destination: torch.Tensor, consumer: object, *, mark_used: bool) -> None:
        pass


SYNCHRONOUS: CopyStream = _Synchronous()


class CudaCopyEvent:
    """The CUDA event recorded after a copy, keeping the copy's host tensors alive until it is seen
    complete (pinned memory returned to a pool early would be overwritten mid-copy)."""

    __slots__ = ("event", "_keep_alive")

    def __init__(self, stream: torch.cuda.Stream, keep_alive: Sequence[torch.Tensor]) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)
        # None once the event was seen complete.
        self._keep_alive: list[torch.Tensor] | None = list(keep_alive)

    def query(self) -> bool:
        return self.landed()

    def landed(self) -> bool:
        if self._keep_alive is None:
            return True
        if not self.event.query():
            return False
        self._keep_alive = None
        return True

    def synchronize(self) -> None:
        if self._keep_alive is not None:
            self.event.synchronize()
            self._keep_alive = None


class CudaCopyStream:
    """A CUDA stream of copies: ordered by events, buffers kept from reuse by ``record_stream``.

    Args:
        stream (torch.cuda.Stream): the stream.
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def as_current(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self.stream)

    def at_issue(self, tensors: Sequence[torch.Tensor], *, written: Sequence[bool]) -> list[torch.Tensor]:
        return list(tensors)

    def issue(self, copy: CopyRequest) -> CudaCopyEvent:
        if copy.device_tensor is not None:
            # The current stream produced the device tensor or may still use it.
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        for earlier in copy.in_flight.after:
            self.stream.wait_event(earlier.event)
        if copy.device_tensor is not None and copy.mark_used:
            # Memory the caller may free while the copy runs must not be reused under it.
            copy.device_tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            copy.run()
        return CudaCopyEvent(self.stream, copy.keep_alive)

    def hand_over(
        self, event: CudaCopyEvent, destination: torch.Tensor, consumer: torch.cuda.Stream | None, *, mark_used: bool
    ) -> None:
        on_host = destination.device.type == "cpu"
        if consumer is None and on_host:
            event.synchronize()  # a host reader has no stream to wait on
            return
        if consumer is None:
            consumer = torch.cuda.current_stream(destination.device)
        consumer.wait_event(event.event)
        if mark_used and not on_host and consumer != self.stream:
            destination.record_stream(consumer)


class CudaCopyStreams:
    """A host-to-device and a device-to-host CUDA stream of one device.

    Args:
        device (torch.device): the CUDA device.
        priority (int): the streams' priority (lower is higher; torch clamps it to the device's range).

    Attributes:
        h2d (CudaCopyStream): host-to-device copies.
        d2h (CudaCopyStream): device-to-host copies.
    """

    def __init__(self, device: torch.device, *, priority: int) -> None:
        self.h2d = CudaCopyStream(torch.cuda.Stream(device, priority=priority))
        self.d2h = CudaCopyStream(torch.cuda.Stream(device, priority=priority))

    def stream(self, to_device: bool) -> CudaCopyStream:
        return self.h2d if to_device else self.d2h
