"""The host's share of an offloaded step, counted: fused CPU AdamW's rate, and the copy a speculative
step would add.

A host step that runs while backward still runs, and stays invisible until ``step()`` commits it,
must step copies of what the user can read: the fp32 parameters and AdamW's ``exp_avg`` and
``exp_avg_sq``, 12 bytes a parameter (the fused kernel updates in place). This measures, on this
host and with ``--threads`` threads (OffloadOptimizer's default: intra-op threads minus one):

- ``step``: ``torch.optim.AdamW(fused=True).step()`` over ``--params`` fp32 parameters in
  ``--tensors`` tensors (reads 16 and writes 12 bytes a parameter);
- ``copy``: copying the parameters and both moments into a second set (12 bytes read and written);
- ``step_and_copy``: both, one after the other: the host time of a speculative step.

Each figure is the median of ``--repeats`` passes after a warm-up. Usage::

    python benchmarks/shadow_copy.py [--params 268435456] [--tensors 16] [--threads N] [--repeats 5]
        [--out benchmarks/results/shadow_copy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(params: int, tensors: int, threads: int, repeats: int) -> dict:
    """Seconds and rates of the step, the shadow copy, and both, over ``params`` parameters."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    size = params // tensors
    weights = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
    for weight in weights:
        weight.grad = torch.randn(size)
    optim = torch.optim.AdamW(weights, lr=1e-5, fused=True)
    optim.step()  # creates exp_avg and exp_avg_sq
    sources = [t for w in weights for t in (w.detach(), optim.state[w]["exp_avg"], optim.state[w]["exp_avg_sq"])]
    shadows = [torch.empty_like(t) for t in sources]

    def copy():
        for shadow, source in zip(shadows, sources):
            shadow.copy_(source)

    def step_and_copy():
        copy()
        optim.step()

    numel = size * tensors
    rows = {}
    for name, run, bytes_per_param in (("step", optim.step, 28), ("copy", copy, 24), ("step_and_copy", step_and_copy, 52)):
        seconds = _median_seconds(run, repeats)
        rows[name] = {
            "seconds": round(seconds, 4),
            "G_params_per_s": round(numel / seconds / 1e9, 3),
            "seconds_per_G_params": round(seconds / numel * 1e9, 4),
            "GB_per_s": round(numel * bytes_per_param / seconds / 1e9, 1),
        }
    rows["copy_over_step"] = round(rows["copy"]["seconds"] / rows["step"]["seconds"], 3)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--threads", type=int, default=max(1, torch.get_num_threads() - 1))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = measure(args.params, args.tensors, args.threads, args.repeats)
    print(f"{'what':<14} {'s':>8} {'G params/s':>11} {'s / G params':>13} {'GB/s':>7}")
    for name in ("step", "copy", "step_and_copy"):
        row = rows[name]
        print(f"{name:<14} {row['seconds']:>8.3f} {row['G_params_per_s']:>11.3f} {row['seconds_per_G_params']:>13.3f} {row['GB_per_s']:>7.1f}")
    print(f"the shadow copy costs {rows['copy_over_step']:.2f} of a step")
    result = {
        "rows": rows,
        "params": args.params,
        "tensors": args.tensors,
        "threads": args.threads,
        "host_cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
