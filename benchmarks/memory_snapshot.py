"""What is allocated at the peak of one training step: a breakdown by allocation site.

Used by ``benchmarks/fsdp_offload.py --memory-snapshot`` and ``benchmarks/activations.py
--memory-snapshot``: the step runs once more, untimed, under
``torch.cuda.memory._record_memory_history``; the allocator's trace is replayed to find the moment
the most bytes were live, and those bytes are grouped by the innermost stack frames in this
repository (the library, the models, the benchmarks) or, failing that, the innermost frame.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable

import torch

GiB = 1 << 30
# Frames from these paths name an allocation site (innermost first).
_OUR_PATHS = ("torch_fsdp_offload", "benchmarks")


def _site(frames: list[dict], depth: int = 3) -> str:
    ours = [frame for frame in frames if any(part in frame["filename"] for part in _OUR_PATHS)]
    chosen = (ours or frames)[:depth]
    return " <- ".join(f"{os.path.basename(frame['filename'])}:{frame['line']}:{frame['name']}" for frame in chosen) or "?"


def peak_breakdown(snapshot: dict, top: int = 12) -> dict:
    """The live allocations at the peak of a memory snapshot's trace, grouped by site.

    Args:
        snapshot (dict): ``torch.cuda.memory._snapshot()`` taken with history recording on.
        top (int): how many sites to list.

    Returns:
        dict: ``peak_above_start_GiB`` (bytes allocated inside the trace and live at its peak) and
        ``sites``: ``[{"site", "GiB", "count"}]``, largest first.

    Example::

        >>> torch.cuda.memory._record_memory_history(max_entries=200000)
        >>> step()
        >>> peak_breakdown(torch.cuda.memory._snapshot())["sites"][0]
    """
    live: dict[int, dict] = {}
    current = peak = 0
    at_peak: dict[int, dict] = {}
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = event
                current += event["size"]
            elif event["action"] == "free_requested" and event["addr"] in live:
                current -= live.pop(event["addr"])["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
    sizes: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for event in at_peak.values():
        site = _site(event.get("frames", []))
        sizes[site] += event["size"]
        counts[site] += 1
    return {
        "peak_above_start_GiB": round(peak / GiB, 3),
        "sites": [{"site": site, "GiB": round(size / GiB, 3), "count": counts[site]} for site, size in sizes.most_common(top)],
    }


def record_step(step: Callable[[], object], max_entries: int = 300_000) -> dict:
    """Run ``step`` once with the CUDA allocator's history recorded; return :func:`peak_breakdown`
    plus ``allocated_at_start_GiB`` and ``max_allocated_GiB`` (both from the allocator's stats).

    Recording still costs host time per allocation: compare ``max_allocated_GiB`` with the peak of
    the timed steps; where they differ, the recorded step did not reproduce that peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    # Python stacks only: C++ stack capture slows the host enough to change how far it runs ahead
    # of the GPU, and with it what is live at the peak.
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {
        "allocated_at_start_GiB": round(start / GiB, 3),
        "max_allocated_GiB": round(torch.cuda.max_memory_allocated() / GiB, 3),
        **peak_breakdown(snapshot),
    }
