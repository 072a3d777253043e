"""Transfer engine vs a plain ``copy_``: host to device, device to host, and both at once.

For each direction the same pinned buffers (>= 1 GiB, from ``torch_fsdp_offload.memory.pinned_empty``)
are copied two ways in one run: a plain ``dst.copy_(src, non_blocking=True)`` of the whole buffer on a
side stream, and the transfer engine's chunked copy on its own streams. Each figure is the median of
``--repeats`` passes timed with CUDA events after a warm-up pass. Before each pass the current stream
is held by a short GPU sleep while the copies are queued, so the timing covers the copies on the GPU,
not the Python that issues them; both paths are timed the same way. GB/s means 1e9 bytes per second.

Usage::

    python benchmarks/transfer.py [--size-gib 1] [--repeats 7] [--chunk-mib 64 4] [--profile]
        [--out benchmarks/results/transfer.json]

The target: the engine reaches >= 95% of the plain copy in all three directions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

from torch_fsdp_offload.memory import empty_cache, pinned_empty
from torch_fsdp_offload.platform import detect_platform
from torch_fsdp_offload.transfer import get_transfer_engine

DIRECTIONS = ("h2d", "d2h", "both")
TARGET_RATIO = 0.95
# GPU cycles the current stream sleeps before each timed pass (~5 ms at 2 GHz): longer than it takes
# to issue a pass's copies from Python.
HOLD_CYCLES = 10_000_000


def _time_pass(issue: Callable[[], None], nbytes: int, repeats: int) -> list[float]:
    """GB/s of ``repeats`` passes (after one warm-up) of ``issue``, which orders its copies after the
    current stream and makes the current stream wait for them."""
    current = torch.cuda.current_stream()
    rates = []
    for attempt in range(repeats + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOLD_CYCLES)
        start.record(current)
        issue()
        end.record(current)
        end.synchronize()
        if attempt:
            rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return rates


def _plain_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], streams: list[torch.cuda.Stream]) -> Callable[[], None]:
    """One ``copy_`` per (dst, src) pair, each on its own side stream."""
    current = torch.cuda.current_stream()

    def issue() -> None:
        for (dst, src), stream in zip(pairs, streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    return issue


def _engine_copy(directions: tuple[str, ...], buffers: dict[str, torch.Tensor], chunk_bytes: int) -> Callable[[], None]:
    engine = get_transfer_engine(torch.cuda.current_device())

    def issue() -> None:
        # Given destinations: each copy is ordered after the current stream (the held start).
        transfers = []
        if "h2d" in directions:
            transfers.append(engine.h2d(buffers["host_in"], buffers["device_in"], label="bench_h2d", chunk_bytes=chunk_bytes))
        if "d2h" in directions:
            transfers.append(engine.d2h(buffers["device_out"], buffers["host_out"], label="bench_d2h", chunk_bytes=chunk_bytes))
        for transfer in transfers:
            transfer.wait(torch.cuda.current_stream())

    return issue


def _profile_summary(buffers: dict[str, torch.Tensor], chunk_bytes: int) -> list[dict[str, object]]:
    """Profiler rows of the engine's labelled copies (one pass both ways)."""
    issue = _engine_copy(("h2d", "d2h"), buffers, chunk_bytes)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        issue()
        torch.cuda.synchronize()
    rows = []
    for event in profile.key_averages():
        if event.key.startswith("torch_fsdp_offload::"):
            rows.append({"label": event.key, "count": event.count, "cpu_time_us": round(event.cpu_time_total, 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="bytes per direction, GiB (>= 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per figure (>= 5)")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 4], help="engine chunk sizes, MiB")
    parser.add_argument("--profile", action="store_true", help="record a torch.profiler summary of the labels")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "transfer.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/transfer.py needs a CUDA GPU: there is no CPU-GPU link to measure here", file=sys.stderr)
        return 1
    if args.size_gib < 1 or args.repeats < 5 or any(chunk <= 0 for chunk in args.chunk_mib):
        parser.error("--size-gib must be >= 1, --repeats >= 5 and every --chunk-mib > 0")

    nbytes = int(args.size_gib * (1 << 30))
    device = torch.device("cuda", torch.cuda.current_device())
    buffers = {
        "host_in": pinned_empty(nbytes, torch.uint8).fill_(1),
        "host_out": pinned_empty(nbytes, torch.uint8),
        "device_in": torch.empty(nbytes, dtype=torch.uint8, device=device),
        "device_out": torch.ones(nbytes, dtype=torch.uint8, device=device),
    }
    pairs = {
        "h2d": [(buffers["device_in"], buffers["host_in"])],
        "d2h": [(buffers["host_out"], buffers["device_out"])],
    }
    side_streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    results = []
    for direction in DIRECTIONS:
        moved = nbytes * (2 if direction == "both" else 1)
        copy_pairs = pairs["h2d"] + pairs["d2h"] if direction == "both" else pairs[direction]
        plain = _time_pass(_plain_copy(copy_pairs, side_streams), moved, args.repeats)
        engine_directions = ("h2d", "d2h") if direction == "both" else (direction,)
        for chunk_mib in args.chunk_mib:
            engine = _time_pass(_engine_copy(engine_directions, buffers, chunk_mib << 20), moved, args.repeats)
            results.append(
                {
                    "direction": direction,
                    "chunk_bytes": chunk_mib << 20,
                    "bytes_moved": moved,
                    "plain_gbps": statistics.median(plain),
                    "engine_gbps": statistics.median(engine),
                    "ratio": statistics.median(engine) / statistics.median(plain),
                    "plain_gbps_passes": plain,
                    "engine_gbps_passes": engine,
                }
            )

    print(f"{'direction':<10} {'chunk':>8} {'plain GB/s':>11} {'engine GB/s':>12} {'ratio':>7}")
    for row in results:
        print(
            f"{row['direction']:<10} {row['chunk_bytes'] >> 20:>5} MiB {row['plain_gbps']:>11.2f} "
            f"{row['engine_gbps']:>12.2f} {row['ratio']:>7.3f}"
        )
    meets_target = all(row["ratio"] >= TARGET_RATIO for row in results if row["chunk_bytes"] == args.chunk_mib[0] << 20)
    print(f"engine >= {TARGET_RATIO:.0%} of plain copy_ in all directions at {args.chunk_mib[0]} MiB chunks: {meets_target}")

    report = {
        "benchmark": "transfer",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpu_name": torch.cuda.get_device_name(device),
        "platform": detect_platform(device).to_dict(),
        "buffer_bytes": nbytes,
        "repeats": args.repeats,
        "hold_cycles": HOLD_CYCLES,
        "link_gbps_plain_copy": {row["direction"]: row["plain_gbps"] for row in results},
        "target_ratio": TARGET_RATIO,
        "meets_target": meets_target,
        "rows": results,
    }
    if args.profile:
        report["profile"] = _profile_summary(buffers, args.chunk_mib[0] << 20)
        for row in report["profile"]:
            print(f"profiler: {row['label']}: {row['count']} call(s), {row['cpu_time_us']} us on the CPU")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=1)
    print(f"wrote {args.out}")
    del buffers, pairs
    empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
