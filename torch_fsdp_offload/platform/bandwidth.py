"""Measuring the CPU-GPU link and the GPU's own DRAM, and what their ratio means for offloading.

The ratio of the two bandwidths says how many bytes the GPU moves in its own memory while the link
moves one, and so how much offloading can pay (see ``docs/platforms.md``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_fsdp_offload._helpers.tensors import host_empty_cache
from torch_fsdp_offload.platform.readers import resolve_device

__all__ = [
    "BandwidthReport",
    "BandwidthRow",
    "DEFAULT_CHUNK_SIZES",
    "clear_bandwidth_cache",
    "interpret_link_ratio",
    "measure_bandwidth",
]

_MiB = 1 << 20
DEFAULT_CHUNK_SIZES: tuple[int, ...] = tuple(m * _MiB for m in (1, 4, 16, 64, 256))
_MIN_BUFFER_BYTES = 256 * _MiB

# The GPU-DRAM : link bandwidth ratio bands. Each kind has a typical ratio: about 1 on unified
# memory, 10 over NVLink-C2C (GH200) and 80 over PCIe (x86 + H200), measured on those machines or
# taken from public reports (see docs/platforms.md); the bands split them at the geometric midpoints.
_UNIFIED_RATIO_MAX = 3.0
_COHERENT_RATIO_MAX = 30.0


def interpret_link_ratio(ratio: float) -> str:
    """Say what a GPU-DRAM : CPU-GPU link bandwidth ratio means for offloading.

    The ratio is how many bytes the GPU moves in its own memory in the time the link moves one.
    Near 1 the memory is one (UNIFIED: never copy); near 10 the link is fast enough that
    offloading often pays (GH200-class); near 80 it rarely pays without a plan (x86 + H200 PCIe).

    Args:
        ratio: GPU device-to-device copy bandwidth divided by the one-way link bandwidth.

    Returns:
        str: a one-line meaning.

    Raises:
        ValueError: if ``ratio`` is not positive.

    Example::

        >>> interpret_link_ratio(80.0)
        '~80 (discrete-class link): offload only what the planner says pays'
    """
    if not ratio > 0:
        raise ValueError(f"the GPU-DRAM : link ratio must be positive, got {ratio!r}")
    if ratio <= _UNIFIED_RATIO_MAX:
        return "~1 (unified memory): never copy; let the GPU read the one allocation"
    if ratio <= _COHERENT_RATIO_MAX:
        return "~10 (coherent-class link): offloading weights, grads, optimizer state often pays"
    return "~80 (discrete-class link): offload only what the planner says pays"


@dataclass(frozen=True)
class BandwidthRow:
    """Measured copy bandwidths (GB/s, 1e9 bytes/s) for one chunk size.

    ``bidirectional_pinned_gbps`` counts the bytes of both ways, copied at once on two streams.
    """

    chunk_bytes: int
    h2d_pinned_gbps: float
    d2h_pinned_gbps: float
    bidirectional_pinned_gbps: float
    h2d_pageable_gbps: float
    d2h_pageable_gbps: float


@dataclass(frozen=True)
class BandwidthReport:
    """What :func:`measure_bandwidth` measured on one GPU.

    Attributes:
        device: the measured device, e.g. ``"cuda:0"``.
        device_name: its name, e.g. ``"NVIDIA H200"``.
        buffer_bytes: bytes copied per timed pass (in chunks of each row's size).
        repeats: timed passes per figure (after one warm-up); each figure is their median.
        rows: one :class:`BandwidthRow` per chunk size, smallest first.
        device_copy_gbps: the GPU's own device-to-device copy bandwidth, read + write bytes.
        torch_version: ``torch.__version__`` at measurement.
    """

    device: str
    device_name: str
    buffer_bytes: int
    repeats: int
    rows: tuple[BandwidthRow, ...]
    device_copy_gbps: float
    torch_version: str

    @property
    def h2d_gbps(self) -> float:
        """Best pinned host-to-device bandwidth over the chunk sizes."""
        return max(row.h2d_pinned_gbps for row in self.rows)

    @property
    def d2h_gbps(self) -> float:
        """Best pinned device-to-host bandwidth over the chunk sizes."""
        return max(row.d2h_pinned_gbps for row in self.rows)

    @property
    def bidirectional_gbps(self) -> float:
        """Best total pinned bandwidth with both ways copying at once."""
        return max(row.bidirectional_pinned_gbps for row in self.rows)

    @property
    def link_gbps(self) -> float:
        """The link's one-way bandwidth: the faster of pinned H2D and D2H."""
        return max(self.h2d_gbps, self.d2h_gbps)

    @property
    def dram_to_link_ratio(self) -> float:
        """GPU-DRAM : link ratio, ``device_copy_gbps / link_gbps`` (see :func:`interpret_link_ratio`)."""
        return self.device_copy_gbps / self.link_gbps

    @property
    def ratio_meaning(self) -> str:
        """What :attr:`dram_to_link_ratio` means for offloading."""
        return interpret_link_ratio(self.dram_to_link_ratio)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the measurements and the derived figures."""
        return {
            **dataclasses.asdict(self),
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
            "bidirectional_gbps": self.bidirectional_gbps,
            "link_gbps": self.link_gbps,
            "dram_to_link_ratio": self.dram_to_link_ratio,
            "ratio_meaning": self.ratio_meaning,
        }


_BANDWIDTHS: dict[tuple[Any, ...], BandwidthReport] = {}


def _issue_chunked_copies(
    copies: Sequence[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]], chunk_bytes: int
) -> None:
    """Enqueue each (stream, dst, src) copy in chunks, alternating between the copies chunk by
    chunk so that copies on different streams run at the same time from the start."""
    nbytes = copies[0][1].numel()
    for start in range(0, nbytes, chunk_bytes):
        chunk = slice(start, min(start + chunk_bytes, nbytes))
        for stream, dst, src in copies:
            with torch.cuda.stream(stream):
                dst[chunk].copy_(src[chunk], non_blocking=True)


def _median_gbps(
    nbytes: int, repeats: int, streams: Sequence[torch.cuda.Stream], issue: Callable[[], None]
) -> float:
    """Median GB/s of ``nbytes`` moved by ``issue()`` on ``streams``.

    Timed with CUDA events on the first stream, which waits for the others; one untimed warm-up
    pass first (it also faults in pageable pages).
    """
    main_stream = streams[0]
    seconds = []
    for attempt in range(repeats + 1):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(main_stream)
        for stream in streams[1:]:
            stream.wait_event(start)
        issue()
        for stream in streams[1:]:
            done = torch.cuda.Event()
            done.record(stream)
            main_stream.wait_event(done)
        end.record(main_stream)
        end.synchronize()
        if attempt:
            seconds.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(seconds) / 1e9


def _measure(
    device: torch.device, nbytes: int, chunk_sizes: Sequence[int], repeats: int
) -> tuple[tuple[BandwidthRow, ...], float]:
    """The rows and the device copy GB/s; every buffer dies on return."""
    pinned_in = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned_out = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(nbytes, dtype=torch.uint8)
    gpu_in = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    gpu_out = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    h2d_stream = torch.cuda.Stream(device)
    d2h_stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)

    def gbps(streams: Sequence[torch.cuda.Stream], copies: Sequence[tuple], chunk_bytes: int) -> float:
        moved = nbytes * len(copies)
        return _median_gbps(moved, repeats, streams, lambda: _issue_chunked_copies(copies, chunk_bytes))

    rows = []
    for chunk_bytes in chunk_sizes:
        h2d_pinned = (h2d_stream, gpu_in, pinned_in)
        d2h_pinned = (d2h_stream, pinned_out, gpu_out)
        rows.append(
            BandwidthRow(
                chunk_bytes=chunk_bytes,
                h2d_pinned_gbps=gbps([h2d_stream], [h2d_pinned], chunk_bytes),
                d2h_pinned_gbps=gbps([d2h_stream], [d2h_pinned], chunk_bytes),
                bidirectional_pinned_gbps=gbps(
                    [h2d_stream, d2h_stream], [h2d_pinned, d2h_pinned], chunk_bytes
                ),
                h2d_pageable_gbps=gbps([h2d_stream], [(h2d_stream, gpu_in, pageable)], chunk_bytes),
                d2h_pageable_gbps=gbps([d2h_stream], [(d2h_stream, pageable, gpu_out)], chunk_bytes),
            )
        )

    # Device-to-device copies are fast: repeat them so one timed pass lasts about a millisecond.
    device_copy_repeats = 8

    def device_copy() -> None:
        with torch.cuda.stream(h2d_stream):
            for _ in range(device_copy_repeats):
                gpu_out.copy_(gpu_in)

    device_copy_gbps = _median_gbps(2 * nbytes * device_copy_repeats, repeats, [h2d_stream], device_copy)
    torch.cuda.synchronize(device)
    return tuple(rows), device_copy_gbps


def measure_bandwidth(
    device: torch.device | str | int | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_CHUNK_SIZES,
    repeats: int = 5,
) -> BandwidthReport:
    """Measure the CPU-GPU link and the GPU's own DRAM bandwidth (cached per process).

    For each chunk size, a buffer of ``max(256 MiB, max(sizes))`` bytes is copied in chunks of that
    size: host to device and device to host from pinned and from pageable memory, and pinned both
    ways at once on two streams. The GPU's device-to-device copy bandwidth counts read + write
    bytes. Each figure is the median of ``repeats`` passes timed with CUDA events after a warm-up;
    GB/s means 1e9 bytes/s. With the defaults it takes seconds and uses three 256 MiB host buffers
    (two pinned, one pageable) and two on the GPU, all freed after.

    Args:
        device: the CUDA device; default the current one.
        sizes: chunk sizes in bytes, each positive.
        repeats: timed passes per figure, at least 1.

    Returns:
        BandwidthReport: the table, the device copy bandwidth and the GPU-DRAM : link ratio.

    Raises:
        RuntimeError: on a machine without a GPU or for a CPU device: there is no link to measure
            (``detect_platform(bandwidth=True)`` then leaves ``Platform.bandwidth`` None instead).
        ValueError: if ``sizes`` is empty or holds a non-positive size, or ``repeats`` < 1.

    Example::

        >>> report = measure_bandwidth("cuda:0")  # on an x86 + H200 over PCIe:
        >>> report.ratio_meaning
        '~80 (discrete-class link): offload only what the planner says pays'
    """
    chunk_sizes = tuple(sorted(set(sizes)))
    if not chunk_sizes or any(not isinstance(size, int) or size <= 0 for size in chunk_sizes):
        raise ValueError(f"sizes must be a non-empty sequence of positive byte counts, got {sizes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "measure_bandwidth needs a CUDA device, and torch.cuda.is_available() is False: there "
            "is no CPU-GPU link to measure on this machine"
        )
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        raise RuntimeError(
            f"measure_bandwidth needs a CUDA device, got {str(resolved)!r}: there is no CPU-GPU link "
            "to measure on the CPU"
        )
    key = (resolved, chunk_sizes, repeats)
    cached = _BANDWIDTHS.get(key)
    if cached is not None:
        return cached

    nbytes = max(_MIN_BUFFER_BYTES, chunk_sizes[-1])
    with torch.cuda.device(resolved):
        rows, device_copy_gbps = _measure(resolved, nbytes, chunk_sizes, repeats)
    # Hand the measurement's pinned blocks back rather than leave them in the caching host
    # allocator for the rest of the process.
    host_empty_cache()
    torch.cuda.empty_cache()
    report = BandwidthReport(
        device=str(resolved),
        device_name=torch.cuda.get_device_name(resolved),
        buffer_bytes=nbytes,
        repeats=repeats,
        rows=rows,
        device_copy_gbps=device_copy_gbps,
        torch_version=torch.__version__,
    )
    _BANDWIDTHS[key] = report
    return report


def clear_bandwidth_cache() -> None:
    """Forget the measurements :func:`measure_bandwidth` cached (tests, or after the machine changed)."""
    _BANDWIDTHS.clear()
