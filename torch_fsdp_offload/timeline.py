"""Stream timeline of a training step, from a ``torch.profiler`` chrome trace.

One lane per CUDA stream (its kernels and copies) and one per CPU thread that runs host optimizer
work (``torch_fsdp_offload::host_optimizer_step``, ``::grad_norms``, ...), each event coloured by its
kind, so that what overlaps what is visible: compute kernels, host-to-device copies, device-to-host
copies and host optimizer steps. ``python -m torch_fsdp_offload.train --profile DIR`` and
``benchmarks/stream_timeline.py`` draw it; drawing needs matplotlib, reading the trace does not.

Example::

    >>> lanes = timeline_lanes(json.load(open("step.trace.json")))
    >>> {lane: counts["h2d"] for lane, counts in lane_counts(lanes).items()}
    >>> draw_timeline(lanes, "step.png")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torch_fsdp_offload._helpers.profiling import all_threads_config

__all__ = [
    "HOST_OPTIMIZER_LABELS", "KINDS", "TimelineEvent", "draw_timeline", "lane_counts", "load_trace", "step_profiler",
    "timeline_lanes",
]

# Colours of the kinds, in legend order.
KINDS = {"compute": "tab:blue", "h2d": "tab:green", "d2h": "tab:orange", "host_optimizer": "tab:red", "other": "tab:gray"}
# Host work of OffloadOptimizer and CoherentOffload, as record_function labels: a CPU thread that
# runs any of these gets a lane.
HOST_OPTIMIZER_LABELS = (
    "torch_fsdp_offload::host_optimizer_step",
    "torch_fsdp_offload::grad_norms",
    "torch_fsdp_offload::cast_master_to_mirror",
)
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class TimelineEvent:
    """One drawn event: start and duration in microseconds (the trace's clock), its kind
    (a key of :data:`KINDS`) and its name."""

    start_us: float
    duration_us: float
    kind: str
    name: str


def step_profiler(device: torch.device | str) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` (not started) for a step's timeline: CPU, and CUDA on a CUDA
    ``device``, recording every thread where this torch can, so that the host optimizer's workers
    get their lanes."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    config = all_threads_config()
    return torch.profiler.profile(activities=activities, **({} if config is None else {"experimental_config": config}))


def load_trace(path: str) -> dict:
    """A chrome trace file as a dict (a bare list of events is wrapped as ``traceEvents``)."""
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    return {"traceEvents": trace} if isinstance(trace, list) else trace


def _gpu_kind(event: Mapping) -> str:
    name = event.get("name", "")
    if event.get("cat") == "gpu_memcpy":
        if "HtoD" in name:
            return "h2d"
        return "d2h" if "DtoH" in name else "other"
    if event.get("cat") == "gpu_memset" or name.startswith("nccl"):
        return "other"
    return "compute"


def timeline_lanes(trace: Mapping) -> dict[str, list[TimelineEvent]]:
    """The lanes of a chrome trace: ``"GPU <device> stream <id>"`` for each CUDA stream with a kernel
    or a copy, and ``"CPU thread <tid>"`` for each thread that runs an event of
    :data:`HOST_OPTIMIZER_LABELS`; streams first, each lane's events in time order."""
    streams: dict[tuple, list[TimelineEvent]] = {}
    threads: dict[object, list[TimelineEvent]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "ts" not in event:
            continue
        start, duration = float(event["ts"]), float(event.get("dur", 0.0))
        args = event.get("args") or {}
        if event.get("cat") in _GPU_CATEGORIES:
            key = (args.get("device", event.get("pid")), args.get("stream", event.get("tid")))
            streams.setdefault(key, []).append(TimelineEvent(start, duration, _gpu_kind(event), event.get("name", "")))
        elif event.get("name", "").startswith(HOST_OPTIMIZER_LABELS):
            threads.setdefault(event.get("tid"), []).append(TimelineEvent(start, duration, "host_optimizer", event["name"]))
    lanes = {f"GPU {device} stream {stream}": events for (device, stream), events in sorted(streams.items(), key=str)}
    lanes.update({f"CPU thread {tid}": events for tid, events in sorted(threads.items(), key=str)})
    return {lane: sorted(events, key=lambda e: e.start_us) for lane, events in lanes.items()}


def lane_counts(lanes: Mapping[str, list[TimelineEvent]]) -> dict[str, dict[str, int]]:
    """Events per kind in each lane (every kind of :data:`KINDS`, zeros included)."""
    counts = {}
    for lane, events in lanes.items():
        counts[lane] = dict.fromkeys(KINDS, 0)
        for event in events:
            counts[lane][event.kind] += 1
    return counts


def draw_timeline(lanes: Mapping[str, list[TimelineEvent]], path: str, title: str | None = None) -> None:
    """Draw the lanes as a PNG at ``path``: time in ms from the first event, one row per lane.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
        ValueError: there is nothing to draw.
    """
    events = [event for lane in lanes.values() for event in lane]
    if not events:
        raise ValueError("the trace has no CUDA kernels, copies or host optimizer events to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(event.start_us for event in events)
    names = list(lanes)
    figure, axes = plt.subplots(figsize=(14, 1.0 + 0.45 * len(names)))
    for row, name in enumerate(names):
        for kind in KINDS:
            spans = [((e.start_us - origin) / 1e3, max(e.duration_us / 1e3, 1e-3)) for e in lanes[name] if e.kind == kind]
            if spans:
                axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=KINDS[kind], linewidth=0)
    axes.set_yticks(range(len(names)), names)
    axes.invert_yaxis()
    axes.set_xlabel("ms from the first event")
    axes.legend(handles=[Patch(color=colour, label=kind) for kind, colour in KINDS.items()], loc="upper right", ncols=len(KINDS))
    if title:
        axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
