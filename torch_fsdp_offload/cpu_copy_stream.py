"""Asynchronous copies on a CPU "device": the transfer engine's streams and events, emulated for CI.

Without a GPU, a :class:`~torch_fsdp_offload.transfer.TransferEngine` on the CPU copies synchronously,
so a consumer that forgets to wait, a buffer reused while a copy still reads it, or a prefetch that
was never issued all go unnoticed. With asynchronous CPU copies on, each direction (host to device,
device to host) gets a :class:`CpuCopyStream`: one worker thread that runs that direction's copies
in issue order, each after a random delay, and ends each in a :class:`CpuCopyEvent` that
``Transfer.done()``, ``wait()`` and ``synchronize()`` honour. A copy across directions that touches
the memory of an unfinished copy waits for it first, as the GPU engine orders its streams.

So that mistakes show instead of passing by luck:

* a destination is filled with ``0xFF`` bytes (NaN for floating dtypes) when the copy is issued, so
  reading it before waiting gives NaNs;
* a source is snapshotted when the copy is issued and compared once the copy ran: if it changed
  while the copy was in flight (a buffer reused or written too early), waiting on the copy raises;
* a poisoned destination that is no longer poison when the copy lands was written while the copy was
  in flight: waiting on the copy raises too.

Each misuse found is also appended to :data:`misuses_detected`, so a test harness can fail a test
in which nobody waited on the copy that found it.

Turn it on with the environment variable ``TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES=<max delay in ms>``
or ``<max delay in ms>:<seed>`` (inherited by spawned ranks; the test suite sets it), or for a block of
code with :func:`cpu_async_copies`. The delays are drawn from a generator seeded per stream. It
costs a snapshot and a poison fill per copy: a testing tool, off by default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from torch_fsdp_offload.transfer_bookkeeping import byte_range, overlaps
from torch_fsdp_offload.transfer_streams import SYNCHRONOUS, CopyRequest, CopyStream

__all__ = [
    "ENV_CPU_ASYNC_COPIES",
    "CpuAsyncCopies",
    "CpuCopyEvent",
    "CpuCopyStream",
    "CpuCopyStreams",
    "cpu_async_copies",
    "current_cpu_async_copies",
    "misuses_detected",
    "parse_cpu_async_copies",
    "versioned_at_issue",
]

ENV_CPU_ASYNC_COPIES = "TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES"
_POISON = 0xFF


@dataclasses.dataclass(frozen=True)
class CpuAsyncCopies:
    """How asynchronous CPU copies run.

    Attributes:
        max_delay_ms (float): each copy starts after a delay drawn uniformly from ``[0, max_delay_ms]``.
        seed (int): seed of the delays (one generator per stream, seeded from it and the direction).
    """

    max_delay_ms: float
    seed: int = 0

    def __post_init__(self) -> None:
        delay = self.max_delay_ms
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay) or delay < 0:
            raise ValueError(
                f"asynchronous CPU copies: max_delay_ms must be a finite number >= 0 (milliseconds), got {delay!r}; "
                "a few ms (e.g. 2) make late completion likely at little cost"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"asynchronous CPU copies: seed must be an int (e.g. 0), got {self.seed!r}")


def parse_cpu_async_copies(value: str) -> CpuAsyncCopies | None:
    """Parse the value of ``TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES``: empty or ``off`` means synchronous
    copies, ``<max delay in ms>`` or ``<max delay in ms>:<seed>`` asynchronous ones.

    Raises:
        ValueError: if the value is none of these.
    """
    text = value.strip()
    if text.lower() in ("", "off"):
        return None
    delay, _, seed = text.partition(":")
    try:
        return CpuAsyncCopies(float(delay), int(seed) if seed else 0)
    except ValueError as error:
        raise ValueError(
            f"{ENV_CPU_ASYNC_COPIES}={value!r} is not valid: give '<max delay in ms>' or "
            f"'<max delay in ms>:<seed>' (e.g. '2' or '2:0'), or 'off' for synchronous copies ({error})"
        ) from None


# "<label>: <what was wrong>" per misuse found by a copy, in the order found, for test harnesses.
misuses_detected: list[str] = []
_overrides: list[CpuAsyncCopies | None] = []
_parsed_env: tuple[str, CpuAsyncCopies | None] = ("", None)


def current_cpu_async_copies() -> CpuAsyncCopies | None:
    """The mode CPU copies issued now run in: the innermost :func:`cpu_async_copies`, else the
    environment variable; None for synchronous copies."""
    global _parsed_env
    if _overrides:
        return _overrides[-1]
    value = os.environ.get(ENV_CPU_ASYNC_COPIES, "")
    if value != _parsed_env[0]:
        _parsed_env = (value, parse_cpu_async_copies(value))
    return _parsed_env[1]


@contextlib.contextmanager
def cpu_async_copies(max_delay_ms: float = 2.0, *, seed: int = 0, enabled: bool = True) -> Iterator[None]:
    """Run the CPU transfer engines' copies issued inside the block asynchronously, late by up to
    ``max_delay_ms`` each (or synchronously with ``enabled=False``), in every thread of the process.

    Args:
        max_delay_ms (float): largest delay before a copy starts, in milliseconds (>= 0).
        seed (int): seed of the delays.
        enabled (bool): False: synchronous copies inside the block, whatever the environment says.

    Raises:
        ValueError: if ``max_delay_ms`` is not a finite number >= 0 or ``seed`` not an int.

    Example::

        >>> with cpu_async_copies(max_delay_ms=2.0, seed=0):
        ...     transfer = get_transfer_engine("cpu").h2d(host)
        ...     transfer.tensor.isnan().all()  # not waited on yet: still poison
        ...     transfer.wait()                # now the copy has landed
    """
    mode = CpuAsyncCopies(max_delay_ms, seed) if enabled else None
    _overrides.append(mode)
    try:
        yield
    finally:
        _overrides.pop()


def versioned_at_issue(tensors: Sequence[torch.Tensor], *, written: Sequence[bool]) -> list[torch.Tensor]:
    """Aliases of ``tensors``' memory, each with a version counter of its own, for a copy to run
    through later; the ``written`` ones are versioned now, at issue, as a CUDA copy's ``copy_``
    versions its destination when the host issues it. Code comparing version counters (the
    optimizer's check that gradients were not changed after they landed) then sees what it sees
    on a GPU, not a bump whenever the worker thread gets to the copy."""
    torch.autograd.graph.increment_version([tensor for tensor, writes in zip(tensors, written) if writes])
    return [
        tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        for tensor in tensors
    ]


class CpuCopyEvent:
    """Completion of one asynchronous CPU copy (a :class:`~torch_fsdp_offload.transfer_streams.CopyEvent`)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.error: BaseException | None = None
        self._landed = threading.Event()

    def query(self) -> bool:
        """Whether the copy has finished; raises the misuse it detected, if any."""
        if not self._landed.is_set():
            return False
        self._raise_error()
        return True

    def synchronize(self) -> None:
        """Block until the copy has finished; raises the misuse it detected, if any."""
        self._landed.wait()
        self._raise_error()

    def wait_landed(self) -> None:
        """Block until the copy has finished, whatever it detected (for copies ordered after it)."""
        self._landed.wait()

    def landed(self) -> bool:
        """Whether the copy has finished, whatever it detected (for the engine's bookkeeping)."""
        return self._landed.is_set()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"torch_fsdp_offload::{self.label}: {self.error}") from self.error

    def _set(self) -> None:
        self._landed.set()


@dataclasses.dataclass
class _Job:
    label: str
    copy: Callable[[], None]
    after: Sequence[CpuCopyEvent]
    sources: list[tuple[torch.Tensor, torch.Tensor | None]]  # (live bytes, snapshot; None: take it late)
    poisoned: list[torch.Tensor]
    keep_alive: list[torch.Tensor]
    event: CpuCopyEvent


class CpuCopyStream:
    """One direction's copies, run in issue order by one worker thread, each after a random delay
    (a :class:`~torch_fsdp_offload.transfer_streams.CopyStream`).

    Args:
        name (str): the direction (``"h2d"`` or ``"d2h"``), in the thread's name and the delays' seed.
        mode (CpuAsyncCopies): the delays.
    """

    def __init__(self, name: str, mode: CpuAsyncCopies) -> None:
        self.name = name
        self.mode = mode
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        delays = random.Random(f"{mode.seed}:{name}")
        self._thread = threading.Thread(
            target=_run_jobs, args=(self._jobs, delays, mode.max_delay_ms), name=f"torch_fsdp_offload_cpu_{name}", daemon=True
        )
        self._thread.start()

    def as_current(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to enter: a CPU "device" allocates and computes on the calling thread."""
        return contextlib.nullcontext()

    def at_issue(self, tensors: Sequence[torch.Tensor], *, written: Sequence[bool]) -> list[torch.Tensor]:
        """See :func:`versioned_at_issue`."""
        return versioned_at_issue(tensors, written=written)

    def issue(self, copy: CopyRequest) -> CpuCopyEvent:
        """Queue ``copy``: it runs after the copies queued before it here and after those it must follow.

        The targets are filled with poison now and must still hold it when the copy lands, unless
        an unfinished copy or this copy's own sources also touch them. The sources are snapshotted
        now, or, if an unfinished copy writes them, once the copies before this one have landed.
        The job holds ``copy.keep_alive`` until it ran. ``device_tensor`` and ``mark_used`` ask
        nothing more: the calling thread's work on a CPU "device" has run, and the job holds its
        memory."""
        event = CpuCopyEvent(copy.label)
        in_flight = copy.in_flight
        snapshots = [(source, None if in_flight.sources_in_flight else source.clone()) for source in copy.sources]
        reads, writes = [byte_range(t) for t in copy.sources], [byte_range(t) for t in copy.targets]
        # Not where another copy or this copy's own source (a CPU "device" tensor aliasing its host
        # copy) touches the targets: the poison would corrupt what they read.
        poison = not in_flight.targets_in_use and not overlaps(reads, writes)
        if poison:
            for destination in copy.targets:
                destination.fill_(_POISON)
        poisoned = list(copy.targets) if poison else []
        job = _Job(copy.label, copy.run, tuple(in_flight.after), snapshots, poisoned, list(copy.keep_alive), event)
        self._jobs.put(job)
        return event

    def hand_over(self, event: CpuCopyEvent, destination: torch.Tensor, consumer: object, *, mark_used: bool) -> None:
        """Block the calling thread, the consumer of a CPU copy in both directions, until it landed."""
        event.synchronize()

    def close(self) -> None:
        """End the thread once the copies already queued have run."""
        self._jobs.put(None)


class CpuCopyStreams:
    """The copy streams of a CPU "device" (a
    :class:`~torch_fsdp_offload.transfer_streams.CopyStreams`): synchronous copies, or, while
    asynchronous CPU copies are on (:func:`current_cpu_async_copies`), a :class:`CpuCopyStream` per
    direction, made on first use.

    Args:
        drain (Callable[[], None]): waits for every copy issued so far, raising the first misuse
            found; called before the mode changes, so that the copies of the new mode do not
            overtake those of the old.
    """

    def __init__(self, drain: Callable[[], None]) -> None:
        self._drain = drain
        self._streams: tuple[CpuCopyStream, CpuCopyStream] | None = None

    def stream(self, to_device: bool) -> CopyStream:
        mode = current_cpu_async_copies()
        if self._streams is not None and (mode is None or self._streams[0].mode != mode):
            self._drain()
            for stream in self._streams:
                stream.close()
            self._streams = None
        if mode is None:
            return SYNCHRONOUS
        if self._streams is None:
            self._streams = (CpuCopyStream("h2d", mode), CpuCopyStream("d2h", mode))
        return self._streams[0 if to_device else 1]


def _run_jobs(jobs: queue.SimpleQueue, delays: random.Random, max_delay_ms: float) -> None:
    # The profiler label of the copy as it runs, beside the one of its issue (as a GPU trace
    # shows the kernel under the issuing op).
    while True:
        job = jobs.get()
        if job is None:
            return
        time.sleep(delays.uniform(0.0, max_delay_ms) / 1e3)
        for earlier in job.after:
            earlier.wait_landed()
        job.sources = [(live, live.clone() if snapshot is None else snapshot) for live, snapshot in job.sources]
        try:
            with torch.profiler.record_function(f"torch_fsdp_offload::{job.label}"), torch.no_grad():
                if not all(bool((destination == _POISON).all()) for destination in job.poisoned):
                    job.event.error = RuntimeError(
                        "the destination was written while the copy was in flight; wait on the "
                        "copy's Transfer before writing its destination"
                    )
                job.copy()
                if not all(torch.equal(live, snapshot) for live, snapshot in job.sources):
                    job.event.error = RuntimeError(
                        "the source changed while the copy was in flight (written or reused before "
                        "the copy finished); wait on the copy's Transfer (synchronize()) before "
                        "writing or reusing its source"
                    )
        except BaseException as error:  # handed to whoever waits on the copy
            job.event.error = error
        finally:
            if job.event.error is not None:
                misuses_detected.append(f"torch_fsdp_offload::{job.label}: {job.event.error}")
            event = job.event
            # Nothing of a finished copy stays referenced while the thread waits for the next.
            del job
            event._set()
            del event
