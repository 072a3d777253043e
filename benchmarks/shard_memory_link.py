"""How fast the GPU gets shard bytes out of each kind of host memory, and puts them back.

``CoherentOffload(shard_memory=...)`` keeps shards in pinned or managed host memory. The GPU gets
them by a copy on the transfer engine's H2D stream (DISCRETE machines) or by reading them in place
through a device view, as FSDP's all-gather does where the plan reads shards in place (UNIFIED,
and COHERENT with managed memory). This times, for one ``--size-gib`` buffer:

- ``pinned, engine copy``: the engine's chunked H2D copy from pinned memory (the default path);
- ``managed, engine copy``: the same copy from the CPU view of managed memory advised to stay on
  the host (``shared_empty(..., "managed", ...)``, what the policy allocates), which the engine
  makes through the allocation's CUDA view;
- ``managed, copy_ of the CPU view``: a plain ``copy_`` from that CPU view, which torch makes as
  from pageable memory (why the engine copies the CUDA view);
- ``managed, copy of the device view``: a device-to-device ``copy_`` from the managed allocation's
  CUDA view;
- ``pinned, read in place`` and ``managed, read in place``: a kernel reading the device view (an
  add into device memory), the GPU pulling the bytes over the link itself;
- ``down: pinned, engine copy`` and ``down: managed, engine copy``: the engine's device-to-host
  copy into each, as reduced gradients go down.

Each figure is the median GB/s (1e9 bytes a second) of ``--repeats`` passes timed with CUDA events
after a warm-up pass. The managed buffer is far below the GPU's free memory (checked before it is
allocated).

Usage::

    python benchmarks/shard_memory_link.py [--size-gib 1] [--repeats 5] [--out benchmarks/results/shard_memory_link.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from torch_fsdp_offload.device_memory import shared_empty
from torch_fsdp_offload.platform import detect_platform
from torch_fsdp_offload.transfer import get_transfer_engine


def _rate(issue: Callable[[], None], nbytes: int, repeats: int) -> float:
    """Median GB/s of ``repeats`` passes of ``issue`` (after one warm-up), timed on the current stream."""
    rates = []
    for attempt in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issue()
        end.record()
        end.synchronize()
        if attempt:
            rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/shard_memory_link.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    numel = int(args.size_gib * (1 << 30)) // 4
    nbytes = numel * 4
    engine = get_transfer_engine(device)
    pinned = shared_empty(numel, torch.float32, "pinned", device)
    managed = shared_empty(numel, torch.float32, "managed", device)
    pinned.host_view.fill_(1.0)
    managed.host_view.fill_(1.0)  # first touched by the CPU: the pages start in host memory
    target = torch.empty(numel, dtype=torch.float32, device=device)

    def engine_copy(source: torch.Tensor) -> Callable[[], None]:
        return lambda: engine.h2d(source, target).wait()

    def device_copy(view: torch.Tensor) -> Callable[[], None]:
        return lambda: target.copy_(view, non_blocking=True)

    paths = {
        "pinned, engine copy": engine_copy(pinned.host_view),
        "managed, engine copy": engine_copy(managed.host_view),
        "managed, copy_ of the CPU view": device_copy(managed.host_view),
        "managed, copy of the device view": device_copy(managed.device_tensor),
        "pinned, read in place": lambda: target.add_(pinned.device_tensor),
        "managed, read in place": lambda: target.add_(managed.device_tensor),
        # Device to host, as reduced gradients go down.
        "down: pinned, engine copy": lambda: engine.d2h(target, pinned.host_view).wait(torch.cuda.current_stream()),
        "down: managed, engine copy": lambda: engine.d2h(target, managed.host_view).wait(torch.cuda.current_stream()),
    }
    rows = []
    print(f"{'path':36s} {'GB/s':>7s}")
    for name, issue in paths.items():
        rate = _rate(issue, nbytes, args.repeats)
        rows.append({"path": name, "GBps": round(rate, 1)})
        print(f"{name:36s} {rate:7.1f}")
    platform = detect_platform(device)
    result = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "platform": platform.kind.value,
        "link_GBps": {"h2d": rows[0]["GBps"], "d2h": rows[-2]["GBps"]},
        "size_bytes": nbytes,
        "repeats": args.repeats,
        "rows": rows,
    }
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
