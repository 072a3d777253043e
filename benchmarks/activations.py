"""Activation offload on one GPU: resident vs save_on_cpu vs checkpointing vs offload_activations,
on a plain model and on one sharded with FSDP2.

The built-in benchmark model ``anchor-1.6b`` (8 blocks, d 4096, 32 heads, SDPA attention, 4x GELU
MLP, LayerNorm, 1.61B params), GPU-resident with bf16 weights (so the weights autograd saves are
parameters, never copied), fused AdamW. Configs: ``--batch-sizes`` (default 4 and 8) at ``--seq-len``
(default 2048), and ``--long-context BxS`` (default 2x8192), where activations outweigh the weights,
gradients and optimizer state.

Rows, all in this process after the link was measured in it:

* ``resident``: activations stay on the GPU;
* ``checkpoint``: ``torch.utils.checkpoint`` per block (``use_reentrant=False``);
* ``checkpoint+offload``: the same, with :func:`offload_activations` moving what checkpointing still
  saves to the host: each block's input, and the final norm's and the head's inputs (the norm and
  the head are given as units after the blocks); its baseline is ``checkpoint``;
* ``offload(all)``: :func:`offload_activations` on every block;
* ``offload(fraction=F)``: on the first F of the blocks;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``fsdp2``: each block and the model ``fully_shard``-ed (one rank), parameters on the GPU;
* ``fsdp2+act(all)``, ``fsdp2+act(F)``: the same with :func:`offload_activations` on every block, or on
  the first F of them (parameters stay on the GPU).

Columns: median step time (forward + backward + optimizer, CUDA events) and its parts, peak GPU memory
(``max_memory_allocated``) and how much of the offloaded bytes it saved against its baseline (resident
or fsdp2), activation bytes moved each way per step, and two lower bounds:

    LB        = max(T_base, D2H / BW_d2h, H2D / BW_h2d, (D2H + H2D) / BW_both)
    LB_phased = max(F_base, D2H / BW_d2h) + max(B_base, H2D / BW_h2d) + O_base

with T_base (F, B, O: forward, backward, optimizer) the baseline row's step, and the bandwidths of a 1
GiB pinned copy each way and both ways at once, measured here. ``LB`` is the bound if copies could
run anywhere in the step; ``LB_phased`` holds when the peak must fall by the offloaded bytes: the D2H
copies must land within the forward and the reloads within the backward.
Targets: ``offload(all)`` at least 3x faster than ``save_on_cpu`` at batch 4, at least 80%
of the activation bytes copied off the GPU, and a step within 1.15 x LB; ``checkpoint+offload`` is
checked the same way, its 80% counted of what checkpointing still saves.

Usage (GPU machine, one process, about 2 minutes for the defaults):
    python benchmarks/activations.py --out benchmarks/results/activations.json [--profile]
    python benchmarks/activations.py --repeats 3 ...   # rows measured in 3 rounds, alternate ones reversed
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory_snapshot import record_step  # noqa: E402
from rounds import median_of_rounds, round_order  # noqa: E402
from torch_fsdp_offload.activations import DEFAULT_MAX_INFLIGHT_BYTES, offload_activations  # noqa: E402
from torch_fsdp_offload.memory import empty_cache as empty_pinned_cache  # noqa: E402
from torch_fsdp_offload.models import build_model, causal_lm_loss, MODEL_CONFIGS  # noqa: E402
from torch_fsdp_offload.platform import measure_bandwidth  # noqa: E402

GiB = 1 << 30
_PLAIN_ROWS = ("resident", "checkpoint", "checkpoint+offload", "offload(all)", "offload(fraction)", "save_on_cpu")
_FSDP_ROWS = ("fsdp2", "fsdp2+act(all)", "fsdp2+act(fraction)")
_TARGET_SPEEDUP = 3.0
_TARGET_OFFLOADED = 0.8
_TARGET_LB_RATIO = 1.15


class _CheckpointedBlock(nn.Module):
    """A block run under ``torch.utils.checkpoint`` (non-reentrant): it saves only its input."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor, rope) -> torch.Tensor:
        return checkpoint(self.block, h, rope, use_reentrant=False)


def _count_saved_bytes(model: nn.Module, tokens: torch.Tensor) -> tuple[int, int]:
    """(distinct activation storage bytes, bytes save_on_cpu copies each way) of one forward."""
    storages: dict[int, int] = {}
    every_save = 0
    # Held only for the forward, so that storages stay distinct as in a real forward (a freed one's
    # address would be reused), then dropped: the graph itself keeps nothing. A saved output kept
    # by the graph would keep its own grad_fn, and with it every activation, alive for the rest of
    # the process (a cycle through C++ that gc cannot break; 8.1 GiB at bs 4, in every row's peak).
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> None:
        nonlocal every_save
        every_save += tensor.numel() * tensor.element_size()
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            saved.append(tensor.detach())
        return None

    with saved_tensors_hooks(pack, lambda unused: None):
        loss = causal_lm_loss(model(tokens), tokens)
    del loss
    saved.clear()
    return sum(storages.values()), every_save


def _release_host_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    empty_pinned_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if host_empty_cache is not None:
        host_empty_cache()
    torch.cuda.empty_cache()


def _row_label(row: str, fraction: float) -> str:
    return row.replace("(fraction)", f"({fraction:g})" if row.startswith("fsdp2") else f"(fraction={fraction:g})")


def _fsdp2_model(config):
    """A fresh model, each block then the root ``fully_shard``-ed on one rank, parameters on the GPU."""
    torch.manual_seed(0)
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def run_row(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    *,
    args: argparse.Namespace,
    save_on_cpu_bytes: int,
    profile_path: str | None,
) -> dict:
    offload = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if name == "save_on_cpu":
        context = functools.partial(save_on_cpu, pin_memory=True)
    elif name.startswith("checkpoint"):
        # Each block checkpointed inside itself (so with "+offload" the checkpoint input is saved
        # within the block the offload tracks); the model's blocks are put back after the row.
        original_blocks = list(model.blocks)
        for index, block in enumerate(original_blocks):
            model.blocks[index] = _CheckpointedBlock(block)
        if name == "checkpoint+offload":
            # The final norm and the head are units too: what they save (their inputs, one
            # block input's size each) is what checkpointing keeps outside the blocks.
            offload = offload_activations(
                model, blocks=[*model.blocks, model.norm, model.output], prefetch_blocks=args.prefetch_blocks
            )
    elif name.startswith("offload"):
        offload = offload_activations(
            model, fraction=args.fraction if "fraction" in name else 1.0, prefetch_blocks=args.prefetch_blocks
        )
    elif name.startswith("fsdp2+act"):
        offload = offload_activations(model, fraction=1.0 if name == "fsdp2+act(all)" else args.fraction)
    if offload is not None and not offload.active:
        raise RuntimeError(f"activation offload is a no-op on this platform ({offload.platform.kind.value})")

    events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(args.warmup + args.steps)]
    stats_before = None

    def step(marks: list[torch.cuda.Event]) -> None:
        marks[0].record()
        with context():
            loss = causal_lm_loss(model(tokens), tokens)
        marks[1].record()
        loss.backward()
        marks[2].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks[3].record()

    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if offload is not None:
                stats_before = dataclasses.replace(offload.stats)
        step(events[index])
    torch.cuda.synchronize()
    measured = events[args.warmup :]
    times = {
        part: statistics.median(marks[start].elapsed_time(marks[end]) / 1e3 for marks in measured)
        for part, (start, end) in {"step": (0, 3), "forward": (0, 1), "backward": (1, 2), "optimizer": (2, 3)}.items()
    }
    row = {"row": name, **{f"{part}_s": value for part, value in times.items()}}
    row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    row["reserved_peak_gib"] = torch.cuda.max_memory_reserved() / GiB
    if offload is not None:
        for counter in ("d2h_bytes", "h2d_bytes", "reused_device_copies", "inflight_waits", "on_demand_copies"):
            row[counter] = (getattr(offload.stats, counter) - getattr(stats_before, counter)) // args.steps
        row["pinned_pool_bytes"] = offload.pinned_bytes
        saved = (offload.stats.saved_bytes - stats_before.saved_bytes) // args.steps
        row["offloaded_of_saved"] = row["d2h_bytes"] / max(1, saved)
    elif name == "save_on_cpu":
        row["d2h_bytes"] = row["h2d_bytes"] = save_on_cpu_bytes
    else:
        row["d2h_bytes"] = row["h2d_bytes"] = 0
    if args.memory_snapshot:
        # One more step, untimed, with the allocator's history recorded.
        row["memory_at_peak"] = record_step(lambda: step([torch.cuda.Event(enable_timing=True) for _ in range(4)]))
    if profile_path is not None:
        row["profile"] = profile_steps(step, profile_path)
    if offload is not None:
        offload.remove()
    if name.startswith("checkpoint"):
        for index, block in enumerate(original_blocks):
            model.blocks[index] = block
    return row


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(interval: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(interval[1], end) - max(interval[0], start)) for start, end in merged)


def profile_steps(step: Callable, trace_path: str) -> dict:
    """Profile two steps; return how much of each copy direction ran while compute kernels ran."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            step([torch.cuda.Event(enable_timing=True) for _ in range(4)])
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    copies: dict[str, list[tuple[float, float]]] = {"DtoH": [], "HtoD": []}
    compute: list[tuple[float, float]] = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        interval = (event.time_range.start, event.time_range.end)
        kind = next((direction for direction in copies if f"Memcpy {direction}" in event.name), None)
        if kind is not None:
            copies[kind].append(interval)
        elif not event.name.startswith("Memset") and not event.name.startswith("Memcpy"):
            compute.append(interval)
    compute_merged = _merged(compute)
    summary = {"trace": trace_path}
    for direction, intervals in copies.items():
        total = sum(end - start for start, end in intervals)
        hidden = sum(_overlap(interval, compute_merged) for interval in intervals)
        summary[direction] = {
            "copies": len(intervals),
            "copy_ms": total / 1e3,
            "under_compute_ms": hidden / 1e3,
            "under_compute_fraction": hidden / total if total else None,
        }
        print(
            f"{direction}: {len(intervals)} copies, {total / 1e3:.1f} ms, "
            f"{hidden / 1e3:.1f} ms of it while compute kernels ran ({(hidden / total if total else 0):.0%})"
        )
    return summary


def lower_bounds(row: dict, base: dict, bandwidth: dict) -> tuple[float, float]:
    """(LB, LB_phased) of ``row`` against its baseline row ``base`` (see the module docstring)."""
    gbps = 1e9
    d2h_s = row["d2h_bytes"] / (bandwidth["d2h_gbps"] * gbps)
    h2d_s = row["h2d_bytes"] / (bandwidth["h2d_gbps"] * gbps)
    both_s = (row["d2h_bytes"] + row["h2d_bytes"]) / (bandwidth["bidirectional_gbps"] * gbps)
    anywhere = max(base["step_s"], d2h_s, h2d_s, both_s)
    phased = max(base["forward_s"], d2h_s) + max(base["backward_s"], h2d_s) + base["optimizer_s"]
    return anywhere, phased


def _measure_rows(
    rows: list[str],
    build: Callable[[str], tuple[nn.Module, torch.optim.Optimizer]],
    tokens: torch.Tensor,
    args: argparse.Namespace,
    save_on_cpu_bytes: int,
    config_name: str,
) -> list[dict]:
    """Measure ``rows`` in ``args.repeats`` rounds; ``build(row)`` gives the model and optimizer
    each row runs. Returns one row dict per name, in the order of ``rows``."""

    def measure(row_name: str) -> dict:
        model, optimizer = build(row_name)
        if row_name == "save_on_cpu":
            # Our pinned blocks (cached for the offload rows) go back before torch's host allocator pins.
            _release_host_memory()
        profile_path = None
        if args.profile and row_name == "offload(all)" and not args.profiled:
            args.profiled = True
            profile_path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "activations_profile.trace.json")
        label = _row_label(row_name, args.fraction)
        print(f"[{config_name}] {label} ...", flush=True)
        row = run_row(
            row_name, model, optimizer, tokens, args=args, save_on_cpu_bytes=save_on_cpu_bytes, profile_path=profile_path
        )
        row["row"] = label
        del model, optimizer  # a fresh FSDP2 model is built for the next row: drop this one first
        if row_name == "save_on_cpu":
            _release_host_memory()
        return row

    rounds = [{row_name: measure(row_name) for row_name in round_order(rows, index)} for index in range(args.repeats)]
    return [_median_of_rounds([measured[row_name] for measured in rounds]) for row_name in rows]


def _median_of_rounds(rounds: list[dict]) -> dict:
    """One row measured in several rounds: the median of its times, the highest of its peaks."""
    return median_of_rounds(rounds, ("step_s", "forward_s", "backward_s", "optimizer_s"), ("peak_gib", "reserved_peak_gib"))


def run_config(batch: int, seq_len: int, args: argparse.Namespace, bandwidth: dict) -> dict:
    name = f"bs{batch}x{seq_len}"
    config = dataclasses.replace(MODEL_CONFIGS["anchor-1.6b"], max_seq_len=max(seq_len, 2048))
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), device="cuda")
    results = []
    plain_rows = [row for row in _PLAIN_ROWS if row not in args.skip_rows]
    torch.manual_seed(0)
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    activation_bytes, save_on_cpu_bytes = _count_saved_bytes(model, tokens)
    if plain_rows:
        results += _measure_rows(plain_rows, lambda row: (model, optimizer), tokens, args, save_on_cpu_bytes, name)
    del model, optimizer
    _release_host_memory()

    holder: dict = {}

    def build_fsdp2(row: str):
        holder.clear()  # the previous row's model and optimizer go first
        gc.collect()
        torch.cuda.empty_cache()
        holder["model"] = _fsdp2_model(config)
        holder["optimizer"] = torch.optim.AdamW(holder["model"].parameters(), lr=1e-5, fused=True)
        return holder["model"], holder["optimizer"]

    fsdp_rows = [row for row in _FSDP_ROWS if row not in args.skip_rows]
    if fsdp_rows:
        results += _measure_rows(fsdp_rows, build_fsdp2, tokens, args, save_on_cpu_bytes, name)
    holder.clear()
    _release_host_memory()

    by_name = {row["row"]: row for row in results}
    save_row = by_name.get("save_on_cpu")
    for row in results:
        base = by_name.get(
            "fsdp2" if row["row"].startswith("fsdp2") else "checkpoint" if row["row"].startswith("checkpoint+") else "resident"
        )
        offloads = row["row"].startswith(("offload", "fsdp2+act", "checkpoint+offload"))
        row["offloaded_fraction"] = row["d2h_bytes"] / activation_bytes if offloads else None
        if base is not None:
            row["lower_bound_s"], row["lower_bound_phased_s"] = lower_bounds(row, base, bandwidth)
            row["step_over_lb"] = row["step_s"] / row["lower_bound_s"]
            row["step_over_lb_phased"] = row["step_s"] / row["lower_bound_phased_s"]
            if offloads and row["d2h_bytes"]:
                row["peak_saved_fraction"] = (base["peak_gib"] - row["peak_gib"]) * GiB / row["d2h_bytes"]
        if save_row is not None:
            row["speedup_vs_save_on_cpu"] = save_row["step_s"] / row["step_s"]
    return {
        "config": name,
        "batch_size": batch,
        "seq_len": seq_len,
        "activation_bytes": activation_bytes,
        "save_on_cpu_bytes_each_way": save_on_cpu_bytes,
        "rows": results,
    }


def _print_table(config: dict) -> None:
    print(
        f"\n{config['config']}: batch {config['batch_size']} x {config['seq_len']}, "
        f"activations {config['activation_bytes'] / GiB:.1f} GiB"
    )
    header = (
        f"{'row':<22}{'step s':>8}{'fwd':>7}{'bwd':>7}{'opt':>7}{'peak GiB':>10}{'saved':>7}"
        f"{'D2H GiB':>9}{'H2D GiB':>9}{'off %':>7}{'LB s':>7}{'x LB':>6}{'LBph s':>8}{'x LBph':>7}{'vs soc':>8}"
    )
    print(header)
    print("-" * len(header))

    def percent(value: float | None) -> str:
        return "" if value is None else f"{value:.0%}"

    for row in config["rows"]:
        print(
            f"{row['row']:<22}{row['step_s']:>8.3f}{row['forward_s']:>7.3f}{row['backward_s']:>7.3f}"
            f"{row['optimizer_s']:>7.3f}{row['peak_gib']:>10.1f}{percent(row.get('peak_saved_fraction')):>7}"
            f"{row['d2h_bytes'] / GiB:>9.2f}{row['h2d_bytes'] / GiB:>9.2f}{percent(row.get('offloaded_fraction')):>7}"
            f"{row.get('lower_bound_s', float('nan')):>7.3f}{row.get('step_over_lb', float('nan')):>6.2f}"
            f"{row.get('lower_bound_phased_s', float('nan')):>8.3f}{row.get('step_over_lb_phased', float('nan')):>7.2f}"
            f"{row.get('speedup_vs_save_on_cpu', float('nan')):>8.2f}"
        )


def _targets(configs: list[dict]) -> list[dict]:
    checks = []

    def check(config: str, what: str, value: float, ok: bool) -> None:
        checks.append({"config": config, "check": what, "value": value, "ok": ok})

    for config in configs:
        name = config["config"]
        rows = {row["row"]: row for row in config["rows"]}
        for label in ("offload(all)", "checkpoint+offload"):
            ours = rows.get(label)
            if ours is None:
                continue
            if config["batch_size"] == 4 and "speedup_vs_save_on_cpu" in ours:
                value = ours["speedup_vs_save_on_cpu"]
                check(name, f"{label} speedup vs save_on_cpu >= 3", value, value >= _TARGET_SPEEDUP)
            # offload(all): of the activations without checkpointing; checkpoint+offload: of
            # what checkpointing still saves (the block inputs).
            value = ours["offloaded_fraction"] if label == "offload(all)" else ours["offloaded_of_saved"]
            check(name, f"{label} activation bytes offloaded >= 80%", value, value >= _TARGET_OFFLOADED)
        for row in config["rows"]:
            if row["offloaded_fraction"] is not None and "step_over_lb" in row:
                value = row["step_over_lb"]
                check(name, f"{row['row']} step <= 1.15 x LB", value, value <= _TARGET_LB_RATIO)
    return checks


def _batch_sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def _long_context(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        batch, seq_len = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--long-context takes BATCHxSEQ such as 2x8192, got {text!r}") from None
    return batch, seq_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/activations.json", help="JSON results path")
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=[4, 8], help="comma-separated, at --seq-len")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--long-context", type=_long_context, default=(2, 8192), metavar="BxS",
        help="activation-dominated config, e.g. 2x8192; '' to skip",
    )
    parser.add_argument(
        "--skip-rows", default="",
        help=f"comma-separated rows to skip, from {', '.join(_PLAIN_ROWS + _FSDP_ROWS)}",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps per row (median)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per row (the first sizes the pool)")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="rounds of the row list (every other one reversed); times are the median over the rounds",
    )
    parser.add_argument("--fraction", type=float, default=0.5, help="fraction of blocks for the partial rows")
    parser.add_argument("--prefetch-blocks", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="profile offload(all) on the first config")
    parser.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="after timing each row, run one more step with the allocator's history recorded and store what is "
        "live at its peak, by allocation site (memory_at_peak)",
    )
    args = parser.parse_args(argv)
    args.skip_rows = {name.strip() for name in args.skip_rows.split(",") if name.strip()}
    unknown = args.skip_rows - set(_PLAIN_ROWS + _FSDP_ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(_PLAIN_ROWS + _FSDP_ROWS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first warm-up step sizes the pinned pool)")
    if not 0.0 < args.fraction < 1.0:
        parser.error(f"--fraction must be in (0, 1), got {args.fraction}")
    if args.seq_len < 1:
        parser.error(f"--seq-len must be >= 1, got {args.seq_len}")
    if not torch.cuda.is_available():
        print("benchmarks/activations.py needs a CUDA GPU", file=sys.stderr)
        return 1
    args.profiled = False
    started = time.perf_counter()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    if not dist.is_initialized():
        # One rank: FSDP2 rows need a process group; nothing crosses a network.
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)

    report = measure_bandwidth(sizes=(GiB,), repeats=3)
    bandwidth = {
        "h2d_gbps": report.h2d_gbps,
        "d2h_gbps": report.d2h_gbps,
        "bidirectional_gbps": report.bidirectional_gbps,
        "copy_bytes": report.buffer_bytes,
    }
    print(
        f"link: H2D {bandwidth['h2d_gbps']:.1f} GB/s, D2H {bandwidth['d2h_gbps']:.1f} GB/s, "
        f"both {bandwidth['bidirectional_gbps']:.1f} GB/s (1 GiB pinned)"
    )
    shapes = [(batch, args.seq_len) for batch in args.batch_sizes]
    if args.long_context is not None:
        shapes.append(args.long_context)
    configs = []
    for batch, seq_len in shapes:
        configs.append(run_config(batch, seq_len, args, bandwidth))
        _print_table(configs[-1])
    checks = _targets(configs)
    print("\ntargets:")
    for item in checks:
        print(f"  [{'ok' if item['ok'] else 'MISS'}] {item['config']}: {item['check']}: {item['value']:.2f}")
    elapsed = time.perf_counter() - started
    result = {
        "benchmark": "activations",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "model": "anchor-1.6b (bf16 weights, fused AdamW)",
        "bandwidth": bandwidth,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "prefetch_blocks": args.prefetch_blocks,
        "max_inflight_bytes": DEFAULT_MAX_INFLIGHT_BYTES,
        "elapsed_s": elapsed,
        "configs": configs,
        "targets": checks,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out_file:
        json.dump(result, out_file, indent=2)
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
