"""How long a host optimizer step over DTensors keeps the GIL from the training thread (CPU only).

A worker thread runs ``torch.optim.AdamW(fused=True)`` steps over four parameters, as DTensors (as
FSDP2 hands them over) or as plain tensors (as ``OffloadOptimizer`` steps them since the sixth
session), while the main thread wakes every 0.5 ms. The longest gap between two wake-ups is how
long the main thread, which launches the GPU work in training, could not run Python.

Usage: python benchmarks/host_step_gil.py [--numel 16777216] [--out benchmarks/results/host_step_gil_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def measure(as_dtensor: bool, numel: int, mesh, steps: int = 5) -> dict:
    params = []
    for _ in range(4):
        data, grad = torch.randn(numel), torch.randn(numel)
        if as_dtensor:
            data, grad = DTensor.from_local(data, mesh, [Shard(0)]), DTensor.from_local(grad, mesh, [Shard(0)])
        param = torch.nn.Parameter(data)
        param.grad = grad
        params.append(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    optimizer.step()  # creates the state
    done = threading.Event()

    def work() -> None:
        for _ in range(steps):
            optimizer.step()
        done.set()

    worker = threading.Thread(target=work)
    started = last = time.perf_counter()
    worker.start()
    wakeups, longest = 0, 0.0
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        wakeups += 1
        time.sleep(0.0005)
    worker.join()
    return {"elapsed_s": round(time.perf_counter() - started, 3), "main_thread_wakeups": wakeups,
            "longest_gap_ms": round(longest * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements per parameter (4 parameters)")
    parser.add_argument("--out", default="benchmarks/results/host_step_gil_cpu.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        rows = {name: measure(name == "dtensor", args.numel, mesh) for name in ("plain", "dtensor")}
    finally:
        dist.destroy_process_group()
    print(f"{'parameters':12s} {'elapsed s':>10s} {'wake-ups':>9s} {'longest gap ms':>15s}")
    for name, row in rows.items():
        print(f"{name:12s} {row['elapsed_s']:10.3f} {row['main_thread_wakeups']:9d} {row['longest_gap_ms']:15.1f}")
    result = {"benchmark": "host_step_gil", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "numel_per_param": args.numel, "params": 4, "steps": 5, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
