"""FSDP2 training step: GPU-resident vs stock CPUOffloadPolicy vs CoherentOffload, one process.

The built-in benchmark model ``anchor-1.6b`` (8 blocks, d 4096, 32 heads, SDPA attention, 4x GELU
MLP, LayerNorm, 1.61B params), bf16 compute (MixedPrecisionPolicy(param bf16, reduce fp32)),
AdamW, FSDP2 at world size 1, micro-batches 4, 8 and 16 x 2048 tokens.

Every row runs in this process, after the link was measured in the same process. For each row:
median step time and its forward / backward / optimizer parts (CUDA events, no extra syncs
inside a step), peak GPU memory, the bytes that crossed the link each way, and the lower bound

    LB = max(T_gpu, H2D / BW_h2d, D2H / BW_d2h, (H2D + D2H) / BW_both, T_host_unhidden)

where T_gpu is the resident row's forward + backward (the GPU work any offload must still do;
for rows that checkpoint activations, ``;ac``, that of ``resident;ac``, recompute included),
the bandwidths are measured here, and T_host_unhidden is the host optimizer time that cannot hide
under backward: a group's host step can start only when its gradients landed and the next
forward needs the first group, whose gradients land last, so at best the host work of all but the
backward of one group is hidden: T_host_unhidden = T_gpu + T_host - T_bwd * (N - 1) / N (rows
named ``next-fwd`` let host steps finish under the next forward too: T_host_unhidden = T_host), with
T_host the host work of the parameters the row steps on the host (fused CPU AdamW plus, for
CoherentOffload rows, the bf16 cast: stock offload and ``cast=device`` rows cast on the GPU; per parameter, measured in
this process by ``measure_host_optimizer``; 0 for rows that step nothing on the host). ``LBs`` (``lower_bound_shared_dram_s``) is the same bound with the host
work slowed by the row's own link traffic: host DRAM serves the DMA and the optimizer at once, and
the host step runs slower while the link copies (on our H200 hosts ~1.5x with both directions
busy). With T_host and T_host_busy the host work timed alone and while both link directions copy
at BW_busy (both measured in this process), and T_dma = (H2D + D2H) / BW_busy the time the row's
bytes keep the link that busy, the host work can take no less than

    T_host_shared = T_host + min(T_dma, T_host_busy) * (1 - T_host / T_host_busy)

(every second the DMA runs beside the host step costs it 1 - T_host / T_host_busy seconds of
work; DMA that runs while the host idles costs as much step time or more). It replaces T_host in
the host term.

``LBd`` (``lower_bound_chain_s``) adds to the host term of ``next-fwd`` rows the GPU work no host
step can run beside. The next forward needs first the host-stepped group whose gradients landed
last, so from the end of its step until the next gradients land the host has nothing to step
while the GPU runs the forward from that group on and at least one group's backward:

    T_chain = T_fwd * P_host / P + T_bwd / N

(the forward counted in proportion to the parameters, P_host of the P stepped on the host; N
groups), and the host term becomes T_host + T_chain. LB leaves this chain out; rows without
next-fwd already count it. ``LBsd`` is LBd with T_host_shared. Neither counts the copies
on the chain (the last group's gradients down, the first group's parameters up).
``--rederive FILE...`` recomputes these columns for stored result files and prints their tables.
With ``--profile DIR`` each CoherentOffload row at the first batch size also
writes a chrome trace and a summary of how much copy time ran under compute (``profile_overlap``).

Usage (GPU machine):
    python benchmarks/fsdp_offload.py --out benchmarks/results/fsdp_offload.json [--profile DIR]
    python benchmarks/fsdp_offload.py --repeats 3 ...   # rows measured in 3 rounds, alternate ones reversed
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory_snapshot import record_step  # noqa: E402
from rounds import median_of_rounds, round_order  # noqa: E402
from row_grammar import (  # noqa: E402
    accumulated_micro_batches, baseline, checkpointed, coherent_row_config, DEFAULT_ROWS, kept_unsharded_blocks, known_row,
    last_blocks_fraction, optimizer_kwargs, spread_blocks_fraction, units_per_block, user_clips,
)
from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, OffloadOptimizer  # noqa: E402
from torch_fsdp_offload.memory import empty_cache as empty_pinned_cache  # noqa: E402
from torch_fsdp_offload.models import build_model, causal_lm_loss  # noqa: E402
from torch_fsdp_offload.host_step import measure_host_step  # noqa: E402
from torch_fsdp_offload.planner.traffic import shared_dram_host_seconds  # noqa: E402
from torch_fsdp_offload.platform import measure_bandwidth  # noqa: E402
from torch_fsdp_offload.transfer import get_transfer_engine  # noqa: E402

GiB = 1 << 30
# Per-row times that --repeats reports as the median of the rounds.
_ROUND_TIME_KEYS = ("step_s", "fwd_s", "bwd_s", "opt_s", "host_optimizer_s", "host_optimizer_wait_s", "streamed_optimizer_s")


@contextlib.contextmanager
def _phase_peak(peaks: dict, phase: str, record: bool):
    """Peak allocated GPU memory inside the block, kept per phase (timed steps only)."""
    torch.cuda.reset_peak_memory_stats()
    yield
    if record:
        peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated())


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def copy_compute_overlap(profiler, steps: int) -> dict:
    """From a CUDA trace: per step, GPU time of host<->device copies, of kernels, and of copies
    running while some kernel ran (the overlap the offload must achieve to be free)."""
    copies = {"HtoD": [], "DtoH": []}
    kernels = []
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        interval = (event.time_range.start, event.time_range.end)
        if "Memcpy HtoD" in event.name:
            copies["HtoD"].append(interval)
        elif "Memcpy DtoH" in event.name:
            copies["DtoH"].append(interval)
        elif "Memcpy" not in event.name and "Memset" not in event.name and not event.name.startswith("nccl"):
            # NCCL kernels wait on peers and other streams: not compute that can hide a copy.
            kernels.append(interval)
    kernel_union = _union(kernels)
    summary = {"kernels_ms": round(sum(b - a for a, b in kernel_union) / 1e3 / steps, 2)}
    for direction, intervals in copies.items():
        union = _union(intervals)
        busy = sum(b - a for a, b in union)
        hidden = _intersection(union, kernel_union)
        summary[f"{direction}_ms"] = round(busy / 1e3 / steps, 2)
        summary[f"{direction}_under_compute_ms"] = round(hidden / 1e3 / steps, 2)
    both = _intersection(_union(copies["HtoD"]), _union(copies["DtoH"]))
    summary["both_directions_at_once_ms"] = round(both / 1e3 / steps, 2)
    return summary


def _shard(
    model: nn.Module,
    offload_policy,
    activation_checkpointing: bool = False,
    last_fraction: float | None = None,
    keep_unsharded_last: int = 0,
    units: int = 1,
    spread_fraction: float | None = None,
) -> None:
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.blocks)
    if activation_checkpointing:
        # As torchtitan does: checkpoint each block, then shard the wrapper.
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
    # units=2: the attention and the feed-forward of each block are the groups (inside the
    # checkpoint wrapper, which then recomputes both in backward as it does a whole block).
    groups = [unit for block in blocks for unit in (block.attention, block.feed_forward)] if units == 2 else model.blocks
    last_blocks = None if last_fraction is None else round(last_fraction * len(model.blocks)) * units
    fully_shard_with_policy(
        model,
        groups,
        offload_policy,
        last_blocks=last_blocks,
        spread_fraction=spread_fraction,
        keep_unsharded_last=keep_unsharded_last * units,
        mp_policy=mp_policy,
    )


def run_row(
    name: str,
    batch_size: int,
    seq_len: int,
    steps: int,
    warmup: int,
    model_name: str,
    profile_dir=None,
    memory_snapshot: bool = False,
):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_model(model_name, device="cuda")
    params = sum(p.numel() for p in model.parameters())
    ac = checkpointed(name)
    base = baseline(name)
    if base == "resident":
        _shard(model, None, ac)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif base == "stock_cpu_offload+fused_cpu_adamw":
        _shard(model, CPUOffloadPolicy(pin_memory=True), ac)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif name.startswith("coherent("):
        policy = CoherentOffload(**coherent_row_config(name))
        _shard(
            model,
            policy,
            ac,
            last_blocks_fraction(name),
            kept_unsharded_blocks(name),
            units_per_block(name),
            spread_blocks_fraction(name),
        )
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, **optimizer_kwargs(name))
    else:
        raise ValueError(name)
    engine = get_transfer_engine("cuda")
    norm_reads = dict(optimizer.norm_reads) if isinstance(optimizer, OffloadOptimizer) else {}
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    step_s, fwd_s, bwd_s, opt_s, host_s, host_wait_s, stream_s, losses = [], [], [], [], [], [], [], []
    phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}
    h2d = d2h = 0
    profiler = None
    micro_batches = accumulated_micro_batches(name)
    for step in range(warmup + steps):
        if step == warmup:
            engine.stats.reset()
            if profile_dir is not None:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                profiler.__enter__()
        torch.cuda.synchronize()
        start_event, fwd_event, bwd_event = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        end_event = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start_event.record()
        # Accumulating rows: the micro-batches before the last one are timed with the forward.
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            with _phase_peak(phase_peaks, "forward", step >= warmup):
                loss = causal_lm_loss(model(tokens), tokens) / micro_batches
            if micro < micro_batches - 1:
                with _phase_peak(phase_peaks, "backward", step >= warmup):
                    loss.backward()
        fwd_event.record()
        with _phase_peak(phase_peaks, "backward", step >= warmup):
            loss.backward()
        bwd_event.record()
        with _phase_peak(phase_peaks, "optimizer", step >= warmup):
            if user_clips(name):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        end_event.record()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if step >= warmup:
            step_s.append(t1 - t0)
            fwd_s.append(start_event.elapsed_time(fwd_event) / 1e3)
            bwd_s.append(fwd_event.elapsed_time(bwd_event) / 1e3)
            opt_s.append((t1 - t0) - start_event.elapsed_time(bwd_event) / 1e3)
            host_s.append(getattr(optimizer, "last_host_step_seconds", 0.0))
            host_wait_s.append(getattr(optimizer, "last_host_wait_seconds", 0.0))
            stream_s.append(getattr(optimizer, "last_stream_step_seconds", 0.0))
            losses.append(loss.item())
    # Counted over the timed steps only (the snapshot and profiler steps below copy too).
    h2d_copied, d2h_copied = engine.stats.h2d_bytes, engine.stats.d2h_bytes
    memory_at_peak = None
    if memory_snapshot:
        # One more step, untimed, with the allocator's history recorded.
        def one_step():
            causal_lm_loss(model(tokens), tokens).backward()
            optimizer.step()
            optimizer.zero_grad()

        memory_at_peak = record_step(one_step)
    overlap = None
    if profiler is not None:
        profiler.__exit__(None, None, None)
        overlap = copy_compute_overlap(profiler, steps)
        os.makedirs(profile_dir, exist_ok=True)
        trace = os.path.join(profile_dir, f"{name.replace('=', '').replace(',', '_')}_bs{batch_size}.trace.json")
        profiler.export_chrome_trace(trace)
    if name.startswith("coherent"):
        h2d = h2d_copied / steps
        d2h = d2h_copied / steps
    elif name.startswith("stock"):
        # FSDP copies every fp32 shard in for forward and again for backward (the root group is
        # not resharded after forward), and every fp32 gradient out.
        root_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
        h2d = 4 * (2 * params - root_params)
        d2h = 4 * params
    row = {
        "name": name,
        "batch_size": batch_size,
        "params_M": round(params / 1e6, 1),
        "step_s": statistics.median(step_s),
        "fwd_s": statistics.median(fwd_s),
        "bwd_s": statistics.median(bwd_s),
        "opt_s": statistics.median(opt_s),
        "host_optimizer_s": statistics.median(host_s),
        "host_optimizer_wait_s": statistics.median(host_wait_s),
        "streamed_optimizer_s": statistics.median(stream_s),
        "peak_gpu_GiB": round(max(phase_peaks.values()) / GiB, 2),
        "peak_GiB_by_phase": {phase: round(peak / GiB, 2) for phase, peak in phase_peaks.items()},
        "h2d_GB": round(h2d / 1e9, 3),
        "d2h_GB": round(d2h / 1e9, 3),
        "tokens_per_s": round(micro_batches * batch_size * seq_len / statistics.median(step_s)),
        "micro_batches": micro_batches,
        "loss_last": losses[-1],
        "n_blocks": len(model.blocks),
        "offloaded_params": sum(
            p.numel() for p in model.parameters() if getattr(p, "_local_tensor", p).device.type == "cpu"
        ),
    }
    if isinstance(optimizer, OffloadOptimizer):
        row["plan"] = policy.resolve().describe()  # the auto placements as resolved here
        row["host_stepped_params"] = optimizer.stepped_numel["host"]
        # How clip_grad_norm_ read the offloaded gradients' norms in this row.
        row["norm_reads"] = {key: count - norm_reads[key] for key, count in optimizer.norm_reads.items()}
    elif name.startswith("stock"):
        row["host_stepped_params"] = row["offloaded_params"]
    if overlap is not None:
        row["profile_overlap"] = overlap
    if memory_at_peak is not None:
        row["memory_at_peak"] = memory_at_peak
    if isinstance(optimizer, OffloadOptimizer):
        # The last step's host steps may still run (overlap_next_forward); until they end they
        # hold the optimizer, with the resident groups' parameters and state, past the
        # collection below, and the next row would carry them in its peak (9 GiB measured).
        optimizer.synchronize()
    del model, optimizer, loss
    gc.collect()
    torch.cuda.synchronize()
    # What this row leaves allocated is in the next row's peak: recorded, so that it shows.
    row["allocated_after_teardown_GiB"] = round(torch.cuda.memory_allocated() / GiB, 2)
    torch.cuda.empty_cache()
    # The pinned pool keeps freed blocks for reuse; rows differ in sizes, so hand them back (29 GB
    # a fully offloaded row: a handful would exhaust a 128 GiB host).
    empty_pinned_cache()
    return row


def measure_host_optimizer(numel: int = 1 << 26, repeats: int = 3) -> dict:
    """Seconds per parameter of the host work an offloaded step needs, measured here by the
    planner's ``measure_host_step`` (a fused CPU AdamW step on fp32 param, grad and two moments,
    then the bf16 cast of the result), at several thread counts (OffloadOptimizer's default, all
    cores but one, among them); the fastest is the lower bound's, and is timed again while both
    link directions copy (as during an offloaded step: the DMA reads and writes host DRAM too,
    which the AdamW step is bound by). Host-memory bound, so it scales with the parameter count."""

    def per_Gparam(total: float, cast: float) -> dict:
        return {"adamw_s_per_Gparam": round((total - cast) * 1e9, 4), "cast_s_per_Gparam": round(cast * 1e9, 4)}

    threads = torch.get_num_threads()
    alone = {
        count: measure_host_step(numel, threads=count, repeats=repeats, link_busy=False)
        for count in sorted({max(1, threads // 2), max(1, (3 * threads) // 4), max(1, threads - 1), threads})
    }
    best = min(alone, key=lambda count: alone[count].alone_s_per_param)
    busy = measure_host_step(numel, threads=best, repeats=repeats, link_busy=True)
    return {
        **per_Gparam(alone[best].alone_s_per_param, alone[best].alone_cast_s_per_param),
        "threads": best,
        "by_threads": {count: per_Gparam(r.alone_s_per_param, r.alone_cast_s_per_param) for count, r in alone.items()},
        "link_busy": {
            **per_Gparam(busy.link_busy_s_per_param, busy.link_busy_cast_s_per_param),
            "link_GBps_meanwhile": round(busy.link_GBps_meanwhile, 1),
        },
    }


def measure_clipped_host_step(threads: int, repeats: int = 3) -> dict:
    """Seconds per 1e9 parameters of a fused CPU AdamW step over one block's fp32 shapes of
    ``anchor-1.6b`` (four 4096 x 4096 and two 16384 x 4096 weights) at ``threads`` threads, alone:
    unclipped, and after the clip's scaling pass (``clip_grad_norm_``'s multiply, which a clipped
    host step runs over each group first). The difference is what a clip costs a host-bound step
    on an idle host; inside a step the link's DMA shares host DRAM with both."""
    params = [torch.nn.Parameter(torch.randn(rows, 4096)) for rows in (4096,) * 4 + (16384,) * 2]
    for param in params:
        param.grad = torch.randn_like(param)
    numel = sum(param.numel() for param in params)
    optim = torch.optim.AdamW(params, lr=1e-4, fused=True)
    scale = torch.tensor(0.999)

    def scaled_step() -> None:
        torch._foreach_mul_([param.grad for param in params], scale)
        optim.step()

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        optim.step()  # the first step allocates the moments
        seconds: dict[str, float] = {}
        for name, way in {"unclipped": optim.step, "scaling_pass_then_step": scaled_step}.items():
            way()
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                way()
                times.append(time.perf_counter() - started)
            seconds[name] = min(times)
    finally:
        torch.set_num_threads(previous)
    return {**{f"{name}_s_per_Gparam": round(value / numel * 1e9, 4) for name, value in seconds.items()}, "threads": threads}


def host_work_s(host_params: float, link_GB: float, host: dict, *, cast: bool, shared_dram: bool) -> float:
    """Host optimizer work (fused CPU AdamW, plus the bf16 cast with ``cast``) of ``host_params``
    parameters at the rates of ``host`` (``measure_host_optimizer``); with ``shared_dram``, slowed by
    ``link_GB`` crossing the link meanwhile (``T_host_shared`` of the module docstring, the planner's
    ``shared_dram_host_seconds``)."""

    def rate(measured: dict) -> float:
        return measured["adamw_s_per_Gparam"] + (measured["cast_s_per_Gparam"] if cast else 0.0)

    alone = host_params / 1e9 * rate(host)
    busy_rates = host.get("link_busy")
    if not shared_dram or not busy_rates:
        return alone
    return shared_dram_host_seconds(alone, host_params / 1e9 * rate(busy_rates), link_GB / busy_rates["link_GBps_meanwhile"])


def _groups(row: dict) -> int:
    """FSDP groups of a row's model: its blocks' (``units=N`` each) and the root."""
    return row["n_blocks"] * units_per_block(row["name"]) + 1


def dependency_chain_s(row: dict, resident: dict) -> float:
    """``T_chain`` of the module docstring: GPU work of ``resident`` that runs while a ``next-fwd``
    row's host waits, between the step of the group the next forward needs first and the next
    gradients landing: the forward over the host-stepped parameters' share of the model and one
    group's share of the backward."""
    host_share = row.get("host_stepped_params", 0) / (row["params_M"] * 1e6)
    return resident["fwd_s"] * host_share + resident["bwd_s"] / _groups(row)


def lower_bound(
    row: dict, resident: dict, bandwidth: dict, host: dict, *, shared_dram: bool = False, chain: bool = False
) -> float:
    """LB of one row from quantities measured in this run (see the module docstring); the host
    term is the measured host work per parameter times the parameters this row steps on the
    host, not the row's own host time. ``shared_dram``: LBs, the host work slowed by the row's
    link traffic. ``chain``: LBd, the host term of ``next-fwd`` rows plus the GPU work no host
    step can run beside (:func:`dependency_chain_s`). Accumulating rows do ``micro_batches`` times
    the GPU work, and no host step starts before the last micro-batch's backward."""
    # The GPU work before the last micro-batch: no group's gradients are final during it.
    accumulating = (row.get("micro_batches", 1) - 1) * (resident["fwd_s"] + resident["bwd_s"])
    t_gpu = resident["fwd_s"] + resident["bwd_s"] + accumulating
    terms = [
        t_gpu,
        row["h2d_GB"] / bandwidth["h2d_GBps"],
        row["d2h_GB"] / bandwidth["d2h_GBps"],
        (row["h2d_GB"] + row["d2h_GB"]) / bandwidth["both_GBps"],
    ]
    host_params = row.get("host_stepped_params", 0)
    if host_params:
        # Stock offload and cast=device rows cast on the GPU (they copy fp32 parameters in); other
        # CoherentOffload rows on the host.
        cast = row["name"].startswith("coherent") and coherent_row_config(row["name"]).get("cast_on", "host") == "host"
        t_host = host_work_s(host_params, row["h2d_GB"] + row["d2h_GB"], host, cast=cast, shared_dram=shared_dram)
        kwargs = optimizer_kwargs(row["name"])
        next_forward, early = kwargs.get("overlap_next_forward", True), kwargs.get("step_during_backward", False)
        if early and next_forward:
            # Host steps may run under the next forward as well as backward, but for the chain.
            terms.append(t_host + accumulating + (dependency_chain_s(row, resident) if chain else 0.0))
        elif early:
            n = _groups(row)
            terms.append(t_gpu + t_host - resident["bwd_s"] * (n - 1) / n)
        elif next_forward:
            # Nothing steps before step(): host steps start after backward, under the next forward.
            terms.append(resident["bwd_s"] + t_host + accumulating)
        else:
            terms.append(t_gpu + t_host)
    return max(terms)


def add_derived_columns(rows: list[dict], batch_size: int, bandwidth: dict, host: dict) -> None:
    """Lower bounds, peak against resident and speedups against stock, for the rows of ``batch_size``
    measured so far (against its ``resident``, ``resident;ac`` and stock rows, where measured)."""
    measured = {r["name"]: r for r in rows if r["batch_size"] == batch_size and "error" not in r}
    resident = measured.get("resident")
    if resident is None:
        return
    stock = measured.get("stock_cpu_offload+fused_cpu_adamw")
    stock_ac = measured.get("stock_cpu_offload+fused_cpu_adamw;ac")
    for row in measured.values():
        # A checkpointing row's GPU work includes the recompute: its LB uses resident;ac.
        compute = measured.get("resident;ac", resident) if checkpointed(row["name"]) else resident
        row["lower_bound_s"] = round(lower_bound(row, compute, bandwidth, host), 4)
        row["step_over_lb"] = round(row["step_s"] / row["lower_bound_s"], 2)
        row["lower_bound_shared_dram_s"] = round(lower_bound(row, compute, bandwidth, host, shared_dram=True), 4)
        row["step_over_lb_shared_dram"] = round(row["step_s"] / row["lower_bound_shared_dram_s"], 2)
        row["lower_bound_chain_s"] = round(lower_bound(row, compute, bandwidth, host, chain=True), 4)
        row["step_over_lb_chain"] = round(row["step_s"] / row["lower_bound_chain_s"], 2)
        row["lower_bound_shared_dram_chain_s"] = round(
            lower_bound(row, compute, bandwidth, host, shared_dram=True, chain=True), 4
        )
        row["step_over_lb_shared_dram_chain"] = round(row["step_s"] / row["lower_bound_shared_dram_chain_s"], 2)
        row["peak_vs_resident"] = round(row["peak_gpu_GiB"] / resident["peak_gpu_GiB"], 2)
        if stock is not None:
            row["speedup_vs_stock"] = round(stock["step_s"] / row["step_s"], 2)
        if stock_ac is not None:
            row["speedup_vs_stock_ac"] = round(stock_ac["step_s"] / row["step_s"], 2)


def print_table(rows: list[dict]) -> None:
    header = (f"{'row':42s} {'bs':>3s} {'step s':>7s} {'fwd':>6s} {'bwd':>6s} {'opt':>6s} {'host opt':>8s} {'peak GiB':>8s} "
              f"{'H2D GB':>7s} {'D2H GB':>7s} {'LB s':>6s} {'/LB':>5s} {'/LBs':>5s} {'/LBd':>5s} {'/LBsd':>5s} {'vs stock':>8s}")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['name']:42s} {r['batch_size']:>3d} {r['error']}")
            continue
        print(
            f"{r['name']:42s} {r['batch_size']:>3d} {r['step_s']:7.3f} {r['fwd_s']:6.3f} {r['bwd_s']:6.3f} {r['opt_s']:6.3f} "
            f"{r['host_optimizer_s']:8.3f} {r['peak_gpu_GiB']:8.1f} {r['h2d_GB']:7.2f} {r['d2h_GB']:7.2f} "
            f"{r.get('lower_bound_s', float('nan')):6.3f} {r.get('step_over_lb', float('nan')):5.2f} "
            f"{r.get('step_over_lb_shared_dram', float('nan')):5.2f} {r.get('step_over_lb_chain', float('nan')):5.2f} "
            f"{r.get('step_over_lb_shared_dram_chain', float('nan')):5.2f} {r.get('speedup_vs_stock', float('nan')):8.2f}"
        )


def rederive(paths: list[str]) -> int:
    """Recompute the derived columns (LB, LBs, against resident and stock) of stored result files
    from what they measured, and print their tables; the files are left as they are. A file that
    cannot be recomputed is named on stderr and skipped; the exit code is then 2."""
    skipped = 0
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, dict) or data.get("benchmark") != "fsdp_offload":
            reason = "not a benchmarks/fsdp_offload.py result"
        else:
            # A file without the host rates measured beside it cannot have its LB recomputed.
            missing = [key for key in ("rows", "link_GBps", "host_optimizer_measured") if key not in data]
            reason = f"no {', '.join(missing)} to recompute from" if missing else None
        if reason is not None:
            print(f"{path}: {reason}; skipped", file=sys.stderr)
            skipped += 1
            continue
        rows = data["rows"]
        for batch_size in sorted({r["batch_size"] for r in rows}):
            add_derived_columns(rows, batch_size, data["link_GBps"], data["host_optimizer_measured"])
        print(f"== {path}")
        print_table(rows)
    return 2 if skipped else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="anchor-1.6b")
    parser.add_argument("--batch-sizes", default="4,8,16")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help="comma-separated rows: resident, stock_cpu_offload+fused_cpu_adamw (each optionally with ;ac) "
        "or coherent(item;...) (see benchmarks/row_grammar.py)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the rows of each batch size in N rounds, every other one in reverse order; each row "
        "reports the median of its rounds and their step times (step_s_rounds)",
    )
    parser.add_argument("--out", default="benchmarks/results/fsdp_offload.json")
    parser.add_argument("--profile", default=None, help="directory for a chrome trace of each CoherentOffload row at the first batch size")
    parser.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="after timing each row at the first batch size, run one more step with the allocator's history "
        "recorded and store what is live at its peak, by allocation site (memory_at_peak)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        metavar="S",
        help="sys.setswitchinterval(S) for the run: how long a thread holding the GIL keeps it from one "
        "waiting for it (Python's default 0.005 s); our step threads take the GIL between copies and kernels",
    )
    parser.add_argument(
        "--rederive",
        nargs="+",
        metavar="FILE",
        help="recompute the derived columns (LB, LBs, x stock) of stored result files and print their tables; no GPU",
    )
    args = parser.parse_args(argv)
    if args.rederive:
        return rederive(args.rederive)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.switch_interval is not None and not args.switch_interval > 0:
        parser.error(f"--switch-interval must be > 0 seconds, got {args.switch_interval}")
    unknown = [name for name in args.rows.split(",") if not known_row(name)]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose resident, stock_cpu_offload+fused_cpu_adamw (optionally ;ac) or coherent(item;...) (see benchmarks/row_grammar.py)")
    if not torch.cuda.is_available():
        print("benchmarks/fsdp_offload.py needs a GPU", file=sys.stderr)
        return 2
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    report = measure_bandwidth(0)
    bandwidth = {"h2d_GBps": report.h2d_gbps, "d2h_GBps": report.d2h_gbps, "both_GBps": report.bidirectional_gbps}
    print(f"link measured in this run: H2D {bandwidth['h2d_GBps']:.1f} GB/s, D2H {bandwidth['d2h_GBps']:.1f} GB/s, both {bandwidth['both_GBps']:.1f} GB/s")
    host = measure_host_optimizer()
    print(
        f"host work measured in this run: fused AdamW {host['adamw_s_per_Gparam']:.3f} s and bf16 cast "
        f"{host['cast_s_per_Gparam']:.3f} s per 1e9 params ({host['threads']} threads); with the link busy "
        f"({host['link_busy']['link_GBps_meanwhile']:.0f} GB/s both ways) {host['link_busy']['adamw_s_per_Gparam']:.3f} s "
        f"and {host['link_busy']['cast_s_per_Gparam']:.3f} s"
    )
    clipped_host = measure_clipped_host_step(host["threads"])
    print(
        "clipped host step in this run, s per 1e9 params: "
        + ", ".join(f"{key[:-len('_s_per_Gparam')]} {value:.3f}" for key, value in clipped_host.items() if key.endswith("_s_per_Gparam"))
    )
    rows: list[dict] = []
    # The rows list is filled in place; the whole result is rewritten after every row, so that a
    # run stopped by a time limit keeps what it measured.
    result = {
        "benchmark": "fsdp_offload",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "link_GBps": bandwidth,
        "host_optimizer_measured": host,
        "clipped_host_step_measured": clipped_host,
        "model": args.model,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "switch_interval_s": sys.getswitchinterval(),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names = args.rows.split(",")
    for batch_size in batch_sizes:
        first_batch_size = batch_size == batch_sizes[0]
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for round_index in range(args.repeats):
            for name in round_order(names, round_index):
                # Traces and snapshots are taken in the first round only.
                profiled = first_batch_size and round_index == 0
                profile_dir = args.profile if (args.profile and name.startswith("coherent") and profiled) else None
                try:
                    row = run_row(
                        name, batch_size, args.seq_len, args.steps, args.warmup, args.model, profile_dir,
                        memory_snapshot=args.memory_snapshot and profiled,
                    )
                except torch.OutOfMemoryError as error:
                    row = {"name": name, "batch_size": batch_size, "error": f"OOM: {error}"[:200]}
                    gc.collect()
                    torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                rounds[name].append(row)
                if args.repeats == 1:
                    rows.append(row)
                    add_derived_columns(rows, batch_size, bandwidth, host)
                    with open(args.out, "w") as f:
                        json.dump(result, f, indent=1)
        if args.repeats > 1:
            for name in names:
                failed = [row for row in rounds[name] if "error" in row]
                if failed:
                    rows.append(failed[0])
                    continue
                row = median_of_rounds(rounds[name], _ROUND_TIME_KEYS, ("peak_gpu_GiB",))
                row["tokens_per_s"] = round(batch_size * args.seq_len / row["step_s"])
                rows.append(row)
            add_derived_columns(rows, batch_size, bandwidth, host)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print_table(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_code = main()
    # Everything is written and the process group destroyed; skip interpreter teardown, which
    # aborted once on the GPU machine (torch 2.11, NCCL, after --memory-snapshot: "terminate called
    # without an active exception") and would turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
