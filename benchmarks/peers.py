"""This library against its peers on one GPU: the same model, data and optimizer through six systems.

The built-in ``anchor-1.6b`` (``torch_fsdp_offload.models.build_model``), seeded synthetic tokens,
bf16 compute and AdamW (lr 1e-4, weight decay 0.01) through:

- ``resident``: GPU-resident FSDP2 (``MixedPrecisionPolicy(bf16, fp32)``), fused AdamW on the GPU;
- ``stock_cpu_offload``: FSDP2 with ``CPUOffloadPolicy(pin_memory=True)``, fused CPU AdamW;
- ``deepspeed_zero2``: DeepSpeed ZeRO-2, ``offload_optimizer`` on the CPU (DeepSpeedCPUAdam);
- ``deepspeed_zero3``: DeepSpeed ZeRO-3, ``offload_param`` and ``offload_optimizer`` on the CPU;
- ``torchao_cpu_offload``: torchao's ``CPUOffloadOptimizer(offload_gradients=True)`` (fused CPU AdamW
  inside) on a plain one-GPU model under ``torch.autocast(bf16)``;
- ``torch_fsdp_offload``: this library's defaults, ``CoherentOffload()`` and
  ``OffloadOptimizer(model, torch.optim.AdamW, lr, fused=True)`` (README's usage);
- ``torch_fsdp_offload_planned``: the one call, ``plan_and_shard(model, example_input=batch,
  gpu_memory_GiB=budget)`` for each batch size, then ``result.recommended.optimizer(...)``. The
  budget is ``--plan-budget-fraction`` (default 0.5) of the resident row's peak at that batch size
  in this run, so the planned row trains within that share of resident memory. Under a cap no
  budget is given: the call plans within the memory the process may use, as README's usage does
  (the model built on ``meta`` and materialised as planned).

Each system runs in a process of its own (this script with ``--one-row``), its model built once and
trained at each batch size in turn, so that DeepSpeed's global state and process group never meet
another system, and the process's RSS and pinned bytes are the system's own. Each row reports tokens/s and the median step time over ``--steps`` after
``--warmup``, the peak allocated GPU memory over those steps, the host memory (pinned bytes as the
system reports them: torch's pinned allocator and this library's pool; the process's RSS, now and
at its peak) and the loss after all its steps (``steps_in_process``: the model's steps so far,
smaller batch sizes' included; the planned rows, each in a process of its own, count only theirs). DeepSpeed and torchao are an optional extra
(``pip install -e ".[peers]"``); a system whose package is missing is a row with an ``error``.

``--capacity``: under GPU caps (``--caps``, GiB), for each system the largest model of
anchor-1.6b's width that trains (``peers_capacity.py``), its tokens/s and measured host bytes per
parameter, and the uncapped resident tokens/s of that model where it fits the whole GPU (else it is
marked not measurable).
``--max-seconds`` stops rows and probes gracefully: what ran is written, what did not is marked.
The capacity result is written after every probe; ``--resume-from`` that file continues a run
stopped or killed, without probing again the sizes it answered.

Usage (GPU machine; DeepSpeed builds its CPU Adam on first use, which needs g++ and ninja):
    python benchmarks/peers.py --batch-sizes 4,16 --out benchmarks/results/peers.json
    python benchmarks/peers.py --batch-sizes 4 --capacity --max-seconds 500 --out ...
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peers_capacity import capacity, estimate_seconds, model_config, print_capacity, read_meminfo  # noqa: E402

GiB = 1 << 30
SYSTEMS = {
    "resident": "GPU-resident FSDP2, fused AdamW on the GPU",
    "stock_cpu_offload": "FSDP2 + CPUOffloadPolicy(pin_memory=True), fused CPU AdamW",
    "deepspeed_zero2": "DeepSpeed ZeRO-2, offload_optimizer cpu (DeepSpeedCPUAdam)",
    "deepspeed_zero3": "DeepSpeed ZeRO-3, offload_param + offload_optimizer cpu (DeepSpeedCPUAdam)",
    "torchao_cpu_offload": "torchao CPUOffloadOptimizer(offload_gradients=True), fused CPU AdamW",
    "torch_fsdp_offload": "CoherentOffload() + OffloadOptimizer(model, AdamW, lr, fused=True)",
    "torch_fsdp_offload_planned": "plan_and_shard(model, example_input=batch, gpu_memory_GiB=budget)",
}
PLANNED = "torch_fsdp_offload_planned"
# The optional package each peer needs (the benchmark's "peers" extra).
REQUIRES = {"deepspeed_zero2": "deepspeed", "deepspeed_zero3": "deepspeed", "torchao_cpu_offload": "torchao"}
LR, WEIGHT_DECAY = 1e-4, 0.01


def missing_package(system: str) -> str | None:
    """The error of a row whose optional package is not installed, else None."""
    package = REQUIRES.get(system)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"{package} is not installed (pip install -e \".[peers]\")"


def deepspeed_config(system: str, batch_size: int) -> dict:
    """The ``deepspeed.initialize`` config of a DeepSpeed row: bf16, AdamW as the other rows run
    it, ZeRO-2 with the optimizer on the CPU or ZeRO-3 with parameters and optimizer there."""
    offload = {"device": "cpu", "pin_memory": True}
    zero: dict = {"stage": 2, "offload_optimizer": offload, "overlap_comm": True, "contiguous_gradients": True}
    if system == "deepspeed_zero3":
        zero = {**zero, "stage": 3, "offload_param": offload}
    elif system != "deepspeed_zero2":
        raise ValueError(f"{system!r} is not a DeepSpeed row")
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def versions() -> dict:
    found = {}
    for package in ("torch", "deepspeed", "torchao"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _pinned_bytes() -> int:
    """Pinned host bytes this process holds as its systems report them: torch's pinned allocator
    (stock offload, DeepSpeed, torchao) and this library's pool."""
    import torch
    from torch_fsdp_offload.memory import memory_stats

    total = memory_stats()["locked_bytes"]
    try:
        total += int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):
        pass
    return total


def _build(system: str, config, batch_size: int, capped: bool, plan_budget_GiB: float | None = None):
    """The system's model, one training step ``step(tokens) -> loss`` and what a plan chose (None
    but for the planned system, which plans for ``batch_size`` within ``plan_budget_GiB``)."""
    import torch
    from torch_fsdp_offload.models import build_model, causal_lm_loss

    if system in ("resident", "stock_cpu_offload", "torch_fsdp_offload", PLANNED):
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        from torch_fsdp_offload import (CoherentOffload, fully_shard_with_policy, materialize_sharded, OffloadOptimizer,
                                        plan_and_shard)

        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        # Under a cap the model cannot pass through the GPU whole: built on meta, each shard
        # allocated where FSDP keeps it (the planner materialises only the layers it times).
        # Uncapped, as benchmarks/fsdp_offload.py builds it.
        model = build_model(config, device="meta" if capped else "cuda")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        plan = None
        if system == PLANNED:
            example = torch.randint(0, config.vocab_size, (batch_size, config.max_seq_len), device="cuda")
            result = plan_and_shard(model, example_input=example, fully_shard_kwargs={"mp_policy": mp},
                                    gpu_memory_GiB=plan_budget_GiB, microbatch_factors=[1])
            plan = {"plan": result.recommended.code(), "plan_budget_GiB": plan_budget_GiB,
                    "plan_timing": result.timing, "predicted_step_s": result.recommended.predicted_step_s}
        else:
            policy = {"resident": None, "stock_cpu_offload": CPUOffloadPolicy(pin_memory=True),
                      "torch_fsdp_offload": CoherentOffload()}[system]
            fully_shard_with_policy(model, model.blocks, policy, mp_policy=mp)
        if capped:
            materialize_sharded(model, "cuda")
            model.init_weights(seed=0)
        if system == PLANNED:
            optimizer = result.recommended.optimizer(model, lr=LR, fused=True)
        elif system == "torch_fsdp_offload":
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=LR, fused=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def step(tokens):
            loss = causal_lm_loss(model(tokens), tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        return model, step, plan
    if system.startswith("deepspeed"):
        import deepspeed

        model = build_model(config, device="cpu")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=deepspeed_config(system, batch_size))

        def step(tokens):
            loss = causal_lm_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
            return loss

        return engine, step, None
    if system == "torchao_cpu_offload":
        from torchao.optim import CPUOffloadOptimizer

        model = build_model(config, device="cuda")
        optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True,
                                        lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def step(tokens):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = causal_lm_loss(logits, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        return model, step, None
    raise ValueError(f"unknown system {system!r}; choose from {sorted(SYSTEMS)}")


def run_one_row(system: str, batch_sizes: list[int], seq_len: int, steps: int, warmup: int, n_blocks: int,
                gpu_cap_GiB: float | None = None, plan_budget_GiB: float | None = None) -> list[dict]:
    """The rows of one system, in this process (the ``--one-row`` child): build once, then train and
    measure at each batch size in turn (peak GPU memory per batch size; the RSS peak is the
    process's so far)."""
    import torch

    torch.cuda.set_device(0)
    if gpu_cap_GiB is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_cap_GiB * GiB / total), 0)
    rss_before = _status_bytes("VmRSS")
    started = time.perf_counter()
    config = model_config(n_blocks, seq_len)
    model, step, plan = _build(system, config, max(batch_sizes), capped=gpu_cap_GiB is not None,
                               plan_budget_GiB=None if gpu_cap_GiB is not None else plan_budget_GiB)
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    setup = {"params": params, "setup_s": round(time.perf_counter() - started, 2),
             "peak_gpu_setup_GiB": round(torch.cuda.max_memory_allocated() / GiB, 2), **(plan or {})}
    rows, steps_before = [], 0
    for batch_size in batch_sizes:
        row = {"system": system, "batch_size": batch_size, "seq_len": seq_len, "n_blocks": n_blocks,
               "gpu_cap_GiB": gpu_cap_GiB, **setup}
        try:
            tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len), device="cuda",
                                   generator=torch.Generator(device="cuda").manual_seed(0))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times, losses = timed_steps(step, tokens, steps, warmup)
        except torch.OutOfMemoryError as error:
            rows.append({**row, "error": f"OOM: {error}"[:300]})
            break  # a larger batch would not fit either
        step_s = statistics.median(times)
        rss_peak = _status_bytes("VmHWM")
        row.update(
            step_s=round(step_s, 4),
            tokens_per_s=round(batch_size * seq_len / step_s),
            peak_gpu_GiB=round(torch.cuda.max_memory_allocated() / GiB, 2),
            pinned_GiB=round(_pinned_bytes() / GiB, 2),
            host_rss_GiB=round(_status_bytes("VmRSS") / GiB, 2),
            host_rss_peak_GiB=round(rss_peak / GiB, 2),
            host_bytes_per_param=round((rss_peak - rss_before) / params, 2),
            loss_after_steps=losses[-1],
            steps_taken=len(losses),
            steps_in_process=steps_before + len(losses),
        )
        rows.append(row)
        steps_before += len(losses)
    return rows


def timed_steps(step, batch, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of each of ``steps`` calls of ``step(batch) -> loss`` after ``warmup`` untimed ones,
    and the loss of every call (``loss.item()`` waits for the step's GPU work)."""
    import torch

    times, losses = [], []
    for index in range(warmup + steps):
        t0 = time.perf_counter()
        loss = step(batch)
        losses.append(loss.item())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def error_line(error: BaseException, limit: int = 300) -> str:
    """A row's ``error``: ``OOM: ...`` for running out of GPU or host memory, else the exception's type and message."""
    memory = isinstance(error, MemoryError) or "OutOfMemory" in type(error).__name__ or "out of memory" in str(error)
    return f"{'OOM' if memory else type(error).__name__}: {error}"[:limit]


def _child_main(args) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    try:
        rows = run_one_row(args.one_row, batch_sizes, args.seq_len, args.steps, args.warmup, args.n_blocks,
                           args.gpu_cap_GiB, args.plan_budget_GiB)
    except Exception as error:  # noqa: BLE001 (the rows record what failed; the parent goes on)
        traceback.print_exc()
        rows = [{"system": args.one_row, "batch_size": batch_size, "n_blocks": args.n_blocks,
                 "gpu_cap_GiB": args.gpu_cap_GiB, "error": error_line(error)} for batch_size in batch_sizes]
    with open(args.row_out, "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    return 0


def describe_machine() -> dict:
    """GPU, link (``measure_bandwidth``), host cores and RAM (the ``--describe`` child)."""
    import torch
    from torch_fsdp_offload.platform import measure_bandwidth

    meminfo = read_meminfo()
    machine = {"host_cores": len(os.sched_getaffinity(0)), "host_cpu_count": os.cpu_count(),
               "host_ram_GiB": round(meminfo.get("MemTotal", 0) / GiB, 1),
               "host_available_GiB": round(meminfo.get("MemAvailable", 0) / GiB, 1)}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        machine.update(gpu=properties.name, gpu_memory_GiB=round(properties.total_memory / GiB, 1))
        report = measure_bandwidth(0)
        machine["link_GBps"] = {"h2d": round(report.h2d_gbps, 1), "d2h": round(report.d2h_gbps, 1),
                                "both": round(report.bidirectional_gbps, 1)}
    return machine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Runner:
    """Runs rows in child processes of a script (default this one), within a deadline."""

    def __init__(self, args, deadline: float, script: str = os.path.abspath(__file__)):
        self.args, self.deadline, self.script = args, deadline, script

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def child(self, flags: list[str], timeout: float) -> tuple[dict | None, str]:
        """What the child wrote to ``--row-out`` (None if nothing) and why it failed ("" if it exited
        0): a child that wrote its file and then died or ran out of time returns both."""
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "row.json")
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                       RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONUNBUFFERED="1")
            command = [sys.executable, self.script, *flags, "--row-out", out]
            try:
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
                lines = (done.stdout + done.stderr).strip().splitlines()
                killed = " (killed: host memory?)" if done.returncode in (-9, 137) else ""
                error = f"exit {done.returncode}{killed}: {lines[-1] if lines else ''}"[:300] if done.returncode else ""
            except subprocess.TimeoutExpired:
                error = f"timeout after {timeout:.0f} s"
            if not os.path.exists(out):
                return None, error
            with open(out, encoding="utf-8") as handle:
                return json.load(handle), error

    def rows(self, system: str, batch_sizes: list[int], n_blocks: int = 8, gpu_cap_GiB: float | None = None,
             steps: int | None = None, warmup: int | None = None, plan_budget_GiB: float | None = None) -> list[dict]:
        """One system's rows at ``batch_sizes``, in one child process (``plan_budget_GiB``: the
        planned system's budget)."""
        base = [{"system": system, "batch_size": b, "n_blocks": n_blocks, "gpu_cap_GiB": gpu_cap_GiB} for b in batch_sizes]
        missing = missing_package(system)
        if missing is not None:
            return [{**row, "error": missing} for row in base]
        timeout = min(self.args.row_timeout, self.remaining())
        if timeout < 20:
            return [{**row, "error": "not run: --max-seconds reached"} for row in base]
        flags = ["--one-row", system, "--batch-sizes", ",".join(map(str, batch_sizes)), "--seq-len", str(self.args.seq_len),
                 "--steps", str(self.args.steps if steps is None else steps),
                 "--warmup", str(self.args.warmup if warmup is None else warmup), "--n-blocks", str(n_blocks)]
        if gpu_cap_GiB is not None:
            flags += ["--gpu-cap-GiB", str(gpu_cap_GiB)]
        if plan_budget_GiB is not None:
            flags += ["--plan-budget-GiB", str(plan_budget_GiB)]
        started = time.monotonic()
        rows, error = self.child(flags, timeout)
        elapsed = round(time.monotonic() - started, 1)
        if rows is None and error.startswith("timeout") and timeout < self.args.row_timeout:
            # Cut by --max-seconds, not by the row's own limit: it says nothing of whether the size fits.
            error = f"not run to its end: --max-seconds reached ({error})"
        if rows is None:
            rows = [{**row, "error": error} for row in base]
        return [{**row, "elapsed_s": elapsed} for row in rows]

    def row(self, system: str, batch_size: int, n_blocks: int = 8, gpu_cap_GiB: float | None = None,
            steps: int | None = None, warmup: int | None = None) -> dict:
        return self.rows(system, [batch_size], n_blocks, gpu_cap_GiB, steps, warmup)[0]


def print_table(rows: list[dict]) -> None:
    print(f"{'system':22s} {'bs':>3s} {'tokens/s':>9s} {'step s':>7s} {'peak GiB':>8s} {'pinned GiB':>10s} "
          f"{'RSS GiB':>7s} {'RSS peak':>8s} {'loss':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:22s} {r['batch_size']:>3d} error: {r['error'][:100]}")
            continue
        print(f"{r['system']:22s} {r['batch_size']:>3d} {r['tokens_per_s']:9d} {r['step_s']:7.3f} {r['peak_gpu_GiB']:8.1f} "
              f"{r['pinned_GiB']:10.1f} {r['host_rss_GiB']:7.1f} {r['host_rss_peak_GiB']:8.1f} {r['loss_after_steps']:7.4f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--batch-sizes", default="4,16", help="rows at these batch sizes ('none': no rows)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/peers.json")
    parser.add_argument("--capacity", action="store_true", help="after the rows, the capacity search under --caps")
    parser.add_argument("--caps", default="16,24,40", help="GPU caps of the capacity search, GiB")
    parser.add_argument("--capacity-batch-size", type=int, default=4)
    parser.add_argument("--capacity-systems", default=None,
                        help="the systems of the capacity search, in order (default: --systems)")
    parser.add_argument("--capacity-tolerance", type=float, default=0.0,
                        help="stop each search once the smallest size not fitting is within this share of the answer")
    parser.add_argument("--resume-from", default=None, metavar="FILE",
                        help="keep the complete capacity searches and probes of this earlier result and continue the rest")
    parser.add_argument("--seed-from", default=None, metavar="FILE",
                        help="a peers.json whose 8-block rows seed the capacity search's first sizes (else this run's rows)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop starting rows and probes after this long")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds one row's process may take")
    parser.add_argument("--one-row", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)  # a row's child process
    parser.add_argument("--describe", action="store_true", help=argparse.SUPPRESS)  # the machine's child process
    parser.add_argument("--n-blocks", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-cap-GiB", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan-budget-GiB", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan-budget-fraction", type=float, default=0.5,
                        help="the planned rows' GPU budget: this share of the resident row's peak at the batch size")
    args = parser.parse_args(argv)
    if args.one_row:
        return _child_main(args)
    if args.describe:
        with open(args.row_out, "w", encoding="utf-8") as handle:
            json.dump(describe_machine(), handle)
        return 0
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    batch_sizes = [] if args.batch_sizes == "none" else [int(b) for b in args.batch_sizes.split(",")]
    caps = sorted(float(c) for c in args.caps.split(",")) if args.capacity else []  # each cap's answer seeds the next
    started = time.monotonic()
    runner = Runner(args, started + (args.max_seconds if args.max_seconds is not None else float("inf")))
    machine, error = runner.child(["--describe"], timeout=300)
    if machine is None or "gpu" not in machine:
        print(f"benchmarks/peers.py needs a GPU ({error or 'none visible'})", file=sys.stderr)
        return 2
    args.gpu_memory_GiB = machine["gpu_memory_GiB"]
    available = read_meminfo().get("MemAvailable", 0)
    estimate, probes = estimate_seconds(systems, batch_sizes, caps, available)
    limit = f"; --max-seconds {args.max_seconds:.0f} stops it" if args.max_seconds is not None else ""
    print(f"machine: {json.dumps(machine)}\nversions: {json.dumps(versions())}")
    print(f"estimated worst case: {estimate:.0f} s ({len(systems) * len(batch_sizes)} rows, {probes} capacity probes){limit}", flush=True)
    rows: list[dict] = []
    result = {"benchmark": "peers", "model": "anchor-1.6b", "seq_len": args.seq_len, "steps": args.steps,
              "warmup": args.warmup, "systems": {s: SYSTEMS[s] for s in systems}, "machine": machine,
              "versions": versions(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def write() -> None:
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)

    for system in systems if batch_sizes else ():
        if system == PLANNED:  # planned per batch size, within a share of that size's resident peak
            found = []
            for batch_size in batch_sizes:
                peak = next((r["peak_gpu_GiB"] for r in rows if r["system"] == "resident"
                             and r["batch_size"] == batch_size and "peak_gpu_GiB" in r), None)
                budget = None if peak is None else round(args.plan_budget_fraction * peak, 2)
                found += runner.rows(system, [batch_size], plan_budget_GiB=budget)
        else:
            found = runner.rows(system, batch_sizes)
        for row in found:
            print(json.dumps(row), flush=True)
            rows.append(row)
        write()
    rows.sort(key=lambda row: row["batch_size"])  # stable: the systems in order within a batch size
    print_table(rows)
    if caps:
        seeds = rows
        if args.seed_from:
            with open(args.seed_from, encoding="utf-8") as handle:
                seeds = json.load(handle)["rows"] + rows
        measured = {r["system"]: r for r in seeds if r["batch_size"] == args.capacity_batch_size and "error" not in r
                    and r.get("n_blocks", 8) == 8}
        searched = [s for s in args.capacity_systems.split(",") if s] if args.capacity_systems else systems
        if set(searched) - set(SYSTEMS):
            parser.error(f"--capacity-systems: of {', '.join(SYSTEMS)}")
        previous = None
        if args.resume_from:
            with open(args.resume_from, encoding="utf-8") as handle:
                resumed = json.load(handle)
            previous = resumed.get("capacity")
            # The resumed probes ran with the packages that file names: a peer not installed now
            # (a run that only adds resident rows) keeps its version there.
            for package, version in resumed.get("versions", {}).items():
                if result["versions"].get(package) is None:
                    result["versions"][package] = version

        def checkpoint(partial: dict) -> None:
            result["capacity"] = partial
            write()

        result["capacity"] = capacity(runner, searched, caps, args.capacity_batch_size, available, measured,
                                      log=lambda line: print(line, flush=True), tolerance=args.capacity_tolerance,
                                      previous=previous, checkpoint=checkpoint)
        write()
        print_capacity(result["capacity"])
    write()
    return 0


def exit_skipping_teardown(exit_code: int) -> None:
    """Flush and exit without the interpreter's teardown, which NCCL, DeepSpeed and host-step
    threads can abort once everything is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    exit_skipping_teardown(main())
