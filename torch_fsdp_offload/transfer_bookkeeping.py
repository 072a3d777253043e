"""What a :class:`~torch_fsdp_offload.transfer.TransferEngine` remembers of the copies it issued.

Each copy the engine issues is kept as an :class:`IssuedCopy` until it has finished: its event
(which keeps the host tensors it uses alive), its stream and the byte ranges it reads and writes.
:class:`PendingCopies` holds the unfinished ones. Before a new copy is issued it says which of them
the copy must be ordered after (their memory conflicts with its own, on another stream) and forgets
the finished ones, which releases the host buffers they kept alive.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import torch

from torch_fsdp_offload.transfer_streams import CopyEvent, CopyStream, InFlight

__all__ = ["IssuedCopy", "PendingCopies", "byte_range", "overlaps"]


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The ``[start, end)`` addresses of a contiguous tensor's bytes."""
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


def overlaps(ranges: Iterable[tuple[int, int]], others: Iterable[tuple[int, int]]) -> bool:
    """Whether any of ``ranges`` shares a byte with any of ``others``."""
    others = list(others)
    return any(start < other_end and other_start < end for start, end in ranges for other_start, other_end in others)


class IssuedCopy:
    """What the engine remembers of an issued copy until it finished: its event (which keeps the
    copy's host tensors alive), the stream it runs on, and the byte ranges it reads and writes (to
    order later conflicting copies after it). Not the device tensor: the engine must not decide how
    long device memory lives. It was allocated on the copy stream or record_stream()-ed there, so
    the allocator cannot hand it out before the copy ends; an engine reference would instead keep
    every copied-in buffer (a block's parameters, a reloaded activation) alive until a later copy
    happened to prune it."""

    __slots__ = ("event", "stream", "reads", "writes")

    def __init__(
        self,
        event: CopyEvent,
        stream: CopyStream,
        reads: Sequence[tuple[int, int]],
        writes: Sequence[tuple[int, int]],
    ) -> None:
        self.event = event
        self.stream = stream
        self.reads = tuple(reads)
        self.writes = tuple(writes)


class PendingCopies:
    """The copies an engine issued that were not yet seen finished, oldest first.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self) -> None:
        self._copies: collections.deque[IssuedCopy] = collections.deque()

    def add(self, copy: IssuedCopy) -> None:
        self._copies.append(copy)

    def in_flight(
        self, stream: CopyStream, reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]]
    ) -> InFlight:
        """What a coming copy on ``stream``, reading and writing these byte ranges, meets of the
        unfinished copies: those on other streams it must follow (whose memory conflicts with its:
        read after write, write after read or write), whether any, on any stream, reads or writes
        the memory it writes, and whether any writes the memory it reads.

        Finished copies are forgotten here, which releases the host buffers they kept alive.
        """
        still_running: collections.deque[IssuedCopy] = collections.deque()
        conflicting = []
        writes_in_use = reads_in_flight = False
        for earlier in self._copies:
            if earlier.event.landed():
                continue
            still_running.append(earlier)
            overwrites = overlaps(writes, [*earlier.reads, *earlier.writes])
            reads_written = overlaps(reads, earlier.writes)
            writes_in_use = writes_in_use or overwrites
            reads_in_flight = reads_in_flight or reads_written
            if earlier.stream is not stream and (overwrites or reads_written):
                conflicting.append(earlier.event)  # same stream: already ordered
        self._copies = still_running
        return InFlight(conflicting, writes_in_use, reads_in_flight)

    def synchronize(self) -> None:
        """Wait for every copy, forget them all, then raise the first misuse an asynchronous CPU
        copy among them found, if any."""
        copies, self._copies = self._copies, collections.deque()
        errors = []
        for copy in copies:
            try:
                copy.event.synchronize()
            except RuntimeError as error:  # a misuse an asynchronous CPU copy found
                errors.append(error)
        if errors:
            raise errors[0]
