"""What a :class:`~torch_fsdp_offload.transfer.TransferEngine` remembers of the copies it issued.

Each copy the engine issues is kept as an :class:`IssuedCopy` until it has finished: its event, its
stream, the byte ranges it reads and writes, and the host tensors it uses. :class:`PendingCopies`
holds the unfinished ones. Before a new copy is issued it says which of them the copy must be
ordered after (their memory conflicts with its own, on another stream) and forgets the finished
ones, which releases the host buffers they kept alive.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import torch

from torch_fsdp_offload.cpu_copy_stream import CpuCopyEvent, CpuCopyStream

__all__ = ["IssuedCopy", "PendingCopies", "byte_range", "overlaps"]


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The ``[start, end)`` addresses of a contiguous tensor's bytes."""
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


def overlaps(ranges: Iterable[tuple[int, int]], others: Iterable[tuple[int, int]]) -> bool:
    """Whether any of ``ranges`` shares a byte with any of ``others``."""
    others = list(others)
    return any(start < other_end and other_start < end for start, end in ranges for other_start, other_end in others)


class IssuedCopy:
    """What the engine remembers of an issued copy until it finished: its event, the stream it
    runs on (CUDA, or a :class:`CpuCopyStream`), the byte ranges it reads and writes (to order later
    conflicting copies after it) and the host tensors it uses (kept alive). Not the device tensor:
    the engine must not decide how long device memory lives. It was allocated on the copy stream
    or record_stream()-ed there, so the allocator cannot hand it out before the copy ends; an
    engine reference would instead keep every copied-in buffer (a block's parameters, a reloaded
    activation) alive until a later copy happened to prune it."""

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
        """Block until the copy finished; an asynchronous CPU copy raises the misuse it found."""
        if self.keep_alive is not None or isinstance(self.event, CpuCopyEvent):
            self.event.synchronize()
            self.keep_alive = None


class PendingCopies:
    """The copies an engine issued that were not yet seen finished, oldest first.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self) -> None:
        self._copies: collections.deque[IssuedCopy] = collections.deque()

    def add(self, copy: IssuedCopy) -> None:
        self._copies.append(copy)

    def unfinished_conflicts(
        self,
        stream: torch.cuda.Stream | CpuCopyStream,
        reads: Sequence[tuple[int, int]],
        writes: Sequence[tuple[int, int]],
    ) -> tuple[list[IssuedCopy], bool, bool]:
        """The unfinished copies on other streams that a coming copy on ``stream`` must follow (whose
        memory conflicts with its: read after write, write after read or write), whether any
        unfinished copy, on any stream, reads or writes the memory it writes, and whether any writes
        the memory it reads.

        Finished copies are forgotten here, which releases the host buffers they kept alive.
        """
        still_running: collections.deque[IssuedCopy] = collections.deque()
        conflicting = []
        writes_in_use = reads_in_flight = False
        for earlier in self._copies:
            if earlier.landed():
                continue
            still_running.append(earlier)
            overwrites = overlaps(writes, [*earlier.reads, *earlier.writes])
            reads_written = overlaps(reads, earlier.writes)
            writes_in_use = writes_in_use or overwrites
            reads_in_flight = reads_in_flight or reads_written
            if earlier.stream != stream and (overwrites or reads_written):
                conflicting.append(earlier)  # same stream: already ordered
        self._copies = still_running
        return conflicting, writes_in_use, reads_in_flight

    def synchronize(self) -> None:
        """Wait for every copy, forget them all, then raise the first misuse an asynchronous CPU
        copy among them found, if any."""
        copies, self._copies = self._copies, collections.deque()
        errors = []
        for copy in copies:
            try:
                copy.synchronize()
            except RuntimeError as error:  # a misuse an asynchronous CPU copy found
                errors.append(error)
        if errors:
            raise errors[0]
