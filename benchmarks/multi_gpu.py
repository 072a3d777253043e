"""Multi-GPU FSDP2 training step on an 8B model: how far offloading lets the micro-batch grow.

Rows (bf16 compute, fp32 reduce, AdamW lr 1e-4, sequences of ``--seq-len`` tokens):

* ``resident``: FSDP2 without offload, fused CUDA AdamW;
* ``stock_cpu_offload+fused_cpu_adamw``: ``CPUOffloadPolicy(pin_memory=True)``, ``AdamW(fused=True)``
  on the host shards;
* ``coherent(host)`` and ``coherent(host;modules=0.5)`` (or any ``coherent(...)`` row of
  ``benchmarks/row_grammar.py``): ``CoherentOffload`` with
  ``OffloadOptimizer(model, AdamW, lr=1e-4, fused=True)``.

Each row is built once on the meta device, ``fully_shard``-ed block by block, and each group's shards
are materialised where FSDP keeps them (host for offloaded groups, GPU otherwise) and filled there,
so no rank ever holds the whole model. The micro-batch then doubles from 1 until ``--max-batch``,
an out-of-memory error, or a step whose peak GPU memory, extrapolated from the previous ones,
would not fit (an OOM on one rank only would leave the other waiting in a collective). Every batch
size runs ``--warmup`` + ``--steps`` steps; reported: per-GPU tokens/s (slowest rank's median
step), peak GPU memory (largest over ranks), host optimizer time, and beside them the planner's
per-GPU prediction (``predict_per_gpu`` on the H200 PCIe profile with the link measured here; stock
offload has none, the planner models CoherentOffload). ``--time-budget`` stops
starting new work once the run would overrun it.

Usage (2 GPUs; set TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES where MemAvailable understates the host)::

    torchrun --nproc_per_node 2 benchmarks/multi_gpu.py --out results/multi_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fsdp_offload import GiB, _shard  # noqa: E402
from row_grammar import (  # noqa: E402
    checkpointed, coherent_row_config, known_row, last_blocks_fraction, optimizer_kwargs, spread_blocks_fraction,
)
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer  # noqa: E402
from torch_fsdp_offload.memory import empty_cache as empty_pinned_cache  # noqa: E402
from torch_fsdp_offload.models import build_model, causal_lm_loss, rope_tables  # noqa: E402
from torch_fsdp_offload.planner import get_profile, predict_per_gpu, TrainingConfig  # noqa: E402
from torch_fsdp_offload.platform import measure_bandwidth  # noqa: E402
from torch_fsdp_offload import materialize_sharded  # noqa: E402

# Set before the process group exists: some multi-GPU VMs refuse NVLink multicast objects.
os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

RESIDENT = "resident"
STOCK = "stock_cpu_offload+fused_cpu_adamw"
DEFAULT_ROWS = (RESIDENT, "coherent(host)", STOCK, "coherent(host;modules=0.5)")
LR = 1e-4
# A batch size is tried only if its extrapolated peak stays under this share of GPU memory.
MEMORY_HEADROOM = 0.93
# A row that left more host memory than this behind after being freed (per rank) stops the run:
# the next offloaded row's ~70 GiB per rank on top could bring in the OOM killer.
HOST_LEFT_LIMIT_GIB = 32.0


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _all_max(values: list[float]) -> list[float]:
    """Element-wise maximum over ranks (CPU tensors: the gloo half of the process group)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _host_rss_gib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1 << 20)
    raise RuntimeError("no VmRSS in /proc/self/status")


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate each group's shards where FSDP keeps them and fill them, without the full model.

    Values are drawn on the GPU per local shard (N(0, 0.02), 1-D parameters such as norm weights
    1): only throughput matters here, and drawing 8B values on the host would take minutes.
    """
    materialize_sharded(model, device)
    for param in model.parameters():
        local = param.to_local()
        if local.dim() == 1:
            local.fill_(1.0)
        else:
            local.copy_(torch.empty(local.shape, device=device).normal_(0.0, 0.02))
    if model.config.rope:
        cos, sin = rope_tables(model.config, device)
        model.register_buffer("rope_cos", cos, persistent=False)
        model.register_buffer("rope_sin", sin, persistent=False)


def build_row(name: str, model_name: str, device: torch.device):
    model = build_model(model_name, device="meta")
    if name == RESIDENT:
        _shard(model, None)
    elif name == STOCK:
        _shard(model, CPUOffloadPolicy(pin_memory=True))
    else:
        _shard(model, CoherentOffload(**coherent_row_config(name)), spread_fraction=spread_blocks_fraction(name))
    materialize(model, device)
    if name in (RESIDENT, STOCK):
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, **{**optimizer_kwargs(name), "lr": LR})
    return model, optimizer


def run_batch(model, optimizer, batch_size: int, seq_len: int, warmup: int, steps: int, device) -> dict:
    torch.cuda.reset_peak_memory_stats(device)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), device=device,
                           generator=torch.Generator(device=device).manual_seed(dist.get_rank()))
    step_s, host_s, loss = [], [], None
    for step in range(warmup + steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize(device)
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
            host_s.append(getattr(optimizer, "last_host_step_seconds", 0.0))
    loss_value = loss.item()
    step_median, peak, peak_reserved, steady, host_median = _all_max([
        statistics.median(step_s),
        torch.cuda.max_memory_allocated(device) / GiB,
        torch.cuda.max_memory_reserved(device) / GiB,
        torch.cuda.memory_allocated(device) / GiB,  # between steps: what does not scale with the batch
        statistics.median(host_s),
    ])
    return {
        "batch_size": batch_size,
        "step_s": round(step_median, 4),
        "tokens_per_s_per_gpu": round(batch_size * seq_len / step_median),
        "peak_gpu_GiB": round(peak, 2),
        "peak_reserved_GiB": round(peak_reserved, 2),
        "between_steps_GiB": round(steady, 2),
        "host_optimizer_s": round(host_median, 4),
        "loss_last_rank0": loss_value,
    }


def _predicted_peak(done: list[dict], batch_size: int) -> float:
    """Reserved GPU memory at ``batch_size``, extrapolated linearly in the batch from the measured ones.

    From one batch size, what the step allocated beyond the memory held between steps is taken to
    grow in proportion to the batch (it also holds gradients and gathered parameters, which do not
    grow: an overestimate); from two, the line through them.
    """
    last = done[-1]
    if len(done) >= 2:
        first = done[-2]
        slope = (last["peak_reserved_GiB"] - first["peak_reserved_GiB"]) / (last["batch_size"] - first["batch_size"])
    else:
        slope = (last["peak_gpu_GiB"] - last["between_steps_GiB"]) / last["batch_size"]
    return last["peak_reserved_GiB"] + slope * (batch_size - last["batch_size"])


def planner_prediction(name: str, model_name: str, batch_size: int, seq_len: int, platform) -> dict | None:
    """The planner's per-GPU prediction for this row (None for stock offload: it models CoherentOffload)."""
    if name == STOCK:
        return None
    if name == RESIDENT:
        offload = False
    else:
        knobs = coherent_row_config(name)
        spread = spread_blocks_fraction(name)
        offload = TrainingConfig(module_fraction=1.0 if spread is None else spread, optimizer=knobs["optimizer"],
                                 prefetch_depth=knobs["prefetch_depth"])
    predicted = predict_per_gpu(model_name, world_size=dist.get_world_size(), batch_size=batch_size,
                                seq_len=seq_len, offload=offload, platform=platform,
                                gpu_memory_GiB=MEMORY_HEADROOM * platform.gpu_memory_GB * 1e9 / GiB)
    return {"step_s": round(predicted["step_s"], 4),
            "tokens_per_s_per_gpu": round(predicted["tokens_per_s_per_gpu"]),
            "peak_gpu_GiB": round(predicted["peak_gpu_GiB"], 2), "fits": predicted["fits"]}


def measured_platform(links: list[dict], total_bytes: int):
    """The planner's H200 PCIe profile with this run's link (slowest rank) and GPU memory."""
    return dataclasses.replace(
        get_profile("h200-pcie"),
        gpu_memory_GB=total_bytes / 1e9,
        h2d_GBps=min(link["h2d_GBps"] for link in links),
        d2h_GBps=min(link["d2h_GBps"] for link in links),
        link_GBps=min(min(link["h2d_GBps"], link["d2h_GBps"]) for link in links),
        bidirectional_GBps=min(link["both_GBps"] for link in links),
        source="h200-pcie profile with the link and GPU memory measured in this run",
    )


def run_row(name: str, args, device: torch.device, started: float, total_bytes: float, platform) -> list[dict]:
    results: list[dict] = []
    build_start = time.perf_counter()
    model, optimizer = build_row(name, args.model, device)
    _log(f"{name}: built in {time.perf_counter() - build_start:.1f}s")
    batch_size = 1
    last_step_s = 0.0
    while batch_size <= args.max_batch:
        done = [r for r in results if "step_s" in r]
        skip = None
        if done and _predicted_peak(done, batch_size) > MEMORY_HEADROOM * total_bytes / GiB:
            skip = f"predicted peak {_predicted_peak(done, batch_size):.1f} GiB does not fit"
        # Rank 0's clock decides for everyone, so every rank takes the same branch.
        estimate = last_step_s * 2 * (args.warmup + args.steps)
        over_budget = _all_max([float(dist.get_rank() == 0 and time.perf_counter() - started + estimate > args.time_budget)])[0]
        if skip is None and over_budget:
            skip = "time budget"
        if skip is not None:
            results.append({"batch_size": batch_size, "skipped": skip})
            _log(f"{name} bs{batch_size}: skipped ({skip})")
            break
        try:
            result = run_batch(model, optimizer, batch_size, args.seq_len, args.warmup, args.steps, device)
            failed = 0.0
        except torch.OutOfMemoryError as error:
            result = {"batch_size": batch_size, "error": f"OOM: {error}"[:200]}
            failed = 1.0
        # Both ranks leave together when either ran out of memory.
        if _all_max([failed])[0]:
            results.append(result if failed else {"batch_size": batch_size, "error": "OOM on another rank"})
            _log(f"{name} bs{batch_size}: out of memory")
            break
        results.append(result)
        _log(f"{name} bs{batch_size}: {json.dumps(result)}")
        last_step_s = result["step_s"]
        batch_size *= 2
    if isinstance(optimizer, OffloadOptimizer):
        optimizer.synchronize()  # host steps still running would keep it (and its state) past gc
    del model, optimizer
    if dist.get_rank() == 0:  # analytic, after the timed steps; also where the ladder stopped
        for result in results:
            try:
                result["planner"] = planner_prediction(name, args.model, result["batch_size"], args.seq_len, platform)
            except Exception as error:  # a planner failure must not lose the measurements
                result["planner"] = {"error": f"{type(error).__name__}: {error}"[:200]}
    gc.collect()
    torch.cuda.empty_cache()
    empty_pinned_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if host_empty_cache is not None:  # stock offload's pinned blocks, cached by torch
        host_empty_cache()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"comma-separated: {RESIDENT}, {STOCK}, or a CoherentOffload row of "
                        "fsdp_offload.py (coherent(item;...), see benchmarks/row_grammar.py)")
    parser.add_argument("--max-batch", type=int, default=16, help="largest micro-batch tried")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=360.0, metavar="SECONDS",
                        help="start no new batch size or row that would end after this (default 360)")
    parser.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="process group timeout: a rank stuck in a collective fails instead of hanging")
    parser.add_argument("--out", default="benchmarks/results/multi_gpu.json")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    # This script shards every block alike and checkpoints nothing: ac and last= rows are refused.
    unknown = [row for row in rows if row not in (RESIDENT, STOCK)
               and (not known_row(row) or checkpointed(row) or last_blocks_fraction(row) is not None)]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose {RESIDENT}, {STOCK} or a coherent(item;...) row of "
                     "fsdp_offload.py without ac or last=")
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print("benchmarks/multi_gpu.py needs GPUs and torchrun (torchrun --nproc_per_node N ...)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = init_distributed(args.collective_timeout)
    world_size = dist.get_world_size()
    report = measure_bandwidth(device)
    links = [None] * world_size
    dist.all_gather_object(links, {"device": str(device), "h2d_GBps": round(report.h2d_gbps, 1),
                                   "d2h_GBps": round(report.d2h_gbps, 1),
                                   "both_GBps": round(report.bidirectional_gbps, 1)})
    _log(f"world size {world_size}, link per rank: {links}")
    total_bytes = torch.cuda.get_device_properties(device).total_memory
    platform = measured_platform(links, total_bytes)
    result = {
        "benchmark": "multi_gpu",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "gpu_memory_GiB": round(total_bytes / GiB, 1),
        "world_size": world_size,
        "link_GBps": links,
        "model": args.model,
        "params_B": round(build_model(args.model, device="meta").param_count() / 1e9, 3),
        "seq_len": args.seq_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "planner": f"predict_per_gpu on {platform.source}",
        "host_memory_override": os.environ.get("TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES"),
        "rows": {},
    }
    result["host_rss_GiB"] = {"start": round(_all_max([_host_rss_gib()])[0], 1)}
    for name in rows:
        host_left = max(result["host_rss_GiB"].values())
        if host_left > HOST_LEFT_LIMIT_GIB:
            result["rows"][name] = [{"skipped": f"an earlier row left {host_left:.0f} GiB of host memory in use"}]
            _log(f"{name}: skipped (host memory of an earlier row was not freed: {host_left:.0f} GiB)")
        elif _all_max([float(dist.get_rank() == 0 and time.perf_counter() - started > args.time_budget - 30)])[0]:
            result["rows"][name] = [{"skipped": "time budget"}]
            _log(f"{name}: skipped (time budget)")
        else:
            result["rows"][name] = run_row(name, args, device, started, total_bytes, platform)
            # Largest over ranks, once the row's model, optimizer and caches were freed.
            result["host_rss_GiB"][f"after {name}"] = round(_all_max([_host_rss_gib()])[0], 1)
            _log(f"{name}: host RSS after freeing it {result['host_rss_GiB'][f'after {name}']} GiB")
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        if dist.get_rank() == 0:  # after every row: a later failure keeps what was measured
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)
    if dist.get_rank() == 0:
        print(format_table(result), flush=True)
    dist.destroy_process_group()
    return 0


def init_distributed(timeout_s: float) -> torch.device:
    """Join torchrun's process group on this rank's GPU; CPU tensors go through gloo."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def format_table(result: dict) -> str:
    """One line per row and batch size; the best per-GPU throughput of each row marked with *."""
    lines = [f"{result['model']} ({result['params_B']}B), seq {result['seq_len']}, world size "
             f"{result['world_size']}, {result['gpu']}",
             f"{'row':34s} {'bs':>3s} {'step s':>7s} {'tok/s/GPU':>10s} {'peak GiB':>8s} {'host opt s':>10s} "
             f"{'planner tok/s':>13s} {'planner GiB':>11s}"]
    for name, batches in result["rows"].items():
        measured = [b for b in batches if "step_s" in b]
        best = max(measured, key=lambda b: b["tokens_per_s_per_gpu"], default=None)
        for b in batches:
            planner = b.get("planner") or {}
            predicted = (f"{planner.get('tokens_per_s_per_gpu', '-')!s:>13s} "
                         f"{planner.get('peak_gpu_GiB', '-')!s:>11s}{'' if planner.get('fits', True) else ' OOM'}")
            if "step_s" not in b:
                lines.append(f"{name:34s} {b.get('batch_size', '-')!s:>3s} {(b.get('error') or b.get('skipped'))[:38]:39s}"
                             f"{predicted if planner else ''}")
                continue
            lines.append(f"{name:34s} {b['batch_size']:>3d} {b['step_s']:7.3f} {b['tokens_per_s_per_gpu']:>10d}"
                         f"{'*' if b is best else ' '}{b['peak_gpu_GiB']:8.1f} {b['host_optimizer_s']:10.3f} "
                         f"{predicted}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
