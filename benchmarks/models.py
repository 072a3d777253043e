"""The defaults, the one-call plan and hand-tuned placements, on three kinds of model, one GPU.

Models (fp32 master, bf16 compute through ``MixedPrecisionPolicy(bf16, fp32)``, AdamW lr 1e-4):
``anchor-1.6b``, the built-in benchmark transformer; ``llama-1b-hf``, a transformers
``LlamaForCausalLM`` from a config (hidden 2048, 16 layers, 16 heads, MLP 5632, vocab 32000, SDPA:
0.95B parameters, random weights, no download); ``plain-1.5b``, :class:`PlainBlocks`: 30 residual
attention + GELU MLP blocks of width 2048 at ``model.stack``, hidden states ``(batch, seq, 2048)``
in, the output's mean square the loss (1.51B parameters).

Settings: ``--batch-sizes`` (4, 16) x ``--seq-len`` (2048) on the whole GPU, and
``--capped-batch-sizes`` (4) under a ``--cap-GiB`` (16) cap (``set_per_process_memory_fraction``
before anything is allocated). Rows of a setting, each on a model built afresh:

- ``default``: README's usage as written there, the one call with its defaults:
  ``plan_and_shard(model, example_input=batch, fully_shard_kwargs={"mp_policy": mp})`` (the blocks
  found by the planner, the memory this process may use, micro-batches up to 8x timed), then
  ``result.recommended.optimizer(model, lr, fused=True)``, trained at the recommended micro-batch;
- ``planned``: the same call held to the setting's micro-batch,
  ``plan_and_shard(..., microbatch_factors=--microbatch-factors, blocks=)``, within the same
  budget as ``default`` (90% of the memory this process may use). Both record the plan's choice
  (``plan_label``, ``recommendation``), ``plan_timing`` (measured or estimated), its predicted step,
  host optimizer seconds and peak, and ``plan_s``; ``planned`` also ``predictions``: the same step
  model (``predict_step``) on every other row of the setting;
- ``every-block``: ``fully_shard(block, mp_policy=mp, offload_policy=CoherentOffload())`` per block and
  the root, ``OffloadOptimizer(model, torch.optim.AdamW, lr, fused=True)``: every block offloaded,
  as that form asks;
- ``resident`` (uncapped only): FSDP2 without offload, fused AdamW on the GPU;
- the sweep: ``coherent(...)`` rows of ``benchmarks/fsdp_offload.py``'s grammar (but ``units=`` and
  ``user-clip``), those predicted to fit first, each group fastest predicted first.

Each (model, setting) runs in a child process (``--one-setting``); a CUDA OOM is a row with an
``error``, a child that dies, or whose row left more than 1 GiB allocated after its teardown, is
followed by one for the rows it had left. Every row records each timed step (``step_s_each``, the
median ``step_s``), the median forward and backward on the GPU's clock (``forward_s``, which
includes waiting for host steps, and ``backward_s``), the CPU's seconds to run backward
(``backward_cpu_s``: when the loop reaches ``step()``), the peak reserved GPU memory and the
allocator's retries (``alloc_retries``: cache flushes near a cap); an ``OffloadOptimizer`` row also
the median seconds of host steps that ended between two ``step()`` calls (``host_optimizer_s``,
with next-forward overlap mostly the step before's: to set beside the prediction's) and
``host_stepped_params``. ``over_best``: the setting's fastest tokens/s (its summary names the row)
over the row's; ``over_best_at_batch`` the same among the rows at the setting's micro-batch (all
but ``default``), what ``planned`` is held to. ``--max-seconds`` stops
starting rows: each child gets an equal share of the time left for its rows after ``default`` and
``planned``; the JSON is rewritten after each child.

Usage (GPU machine, from the repository root):
    PYTHONPATH=$PWD python benchmarks/models.py --max-seconds 500 --out benchmarks/results/models.json
    python benchmarks/models.py --tiny --out /tmp/models.json   # tiny models on the CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from row_grammar import checkpointed, coherent_row_config, kept_unsharded_blocks, last_blocks_fraction  # noqa: E402
from row_grammar import optimizer_kwargs, row_items, spread_blocks_fraction, units_per_block, user_clips  # noqa: E402
from peers import error_line, exit_skipping_teardown, Runner, timed_steps  # noqa: E402
from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, OffloadOptimizer, plan_and_shard  # noqa: E402
from torch_fsdp_offload.memory import empty_cache as empty_pinned_cache  # noqa: E402
from torch_fsdp_offload.models import build_hf_causal_lm, build_model, causal_lm_loss  # noqa: E402
from torch_fsdp_offload.planner import predict_step, TrainingConfig  # noqa: E402

GiB = 1 << 30
LR = 1e-4
MODELS = {"anchor-1.6b": "built-in transformer, token ids in ('tiny' with --tiny)",
          "llama-1b-hf": "transformers LlamaForCausalLM from a config, SDPA, token ids in",
          "plain-1.5b": "PlainBlocks: residual attention + MLP blocks at model.stack, hidden states in, mean-square loss"}
LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
         "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
         "max_position_embeddings": 2048, "attn_implementation": "sdpa"}
LLAMA_TINY = {**LLAMA, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4}
PLAIN = {"dim": 2048, "heads": 16, "n_blocks": 30}
PLAIN_TINY = {"dim": 32, "heads": 4, "n_blocks": 4}
# The rows every setting starts with, whatever the budget; "resident" joins them uncapped.
MUST_ROWS = ("default", "planned")
# Run after the sweep, as time allows.
LAST_ROWS = ("every-block",)
# Hand-tuned placements. On the whole GPU: the last half of the blocks offloaded with host steps,
# with checkpointing and the cast on the GPU, then without either; everything offloaded with host
# steps and the cast on the GPU (the default splits the optimizer and casts on the host). Under the
# cap, every one checkpointed: a quarter, a half, three quarters or all of the blocks offloaded (the
# last ones), their optimizer on the host, a quarter or half of it streamed through the GPU.
SWEEP = (
    "coherent(host;next-fwd;last=0.5;keep=1;ac;depth=1;cast=device)",
    "coherent(host;next-fwd;last=0.5;keep=1;depth=1)",
    "coherent(host;next-fwd;cast=device)",
)
CAPPED_SWEEP = (
    "coherent(host;next-fwd;last=0.25;ac;cast=device)",
    "coherent(split=0.25;next-fwd;last=0.5;ac;cast=device)",
    "coherent(split=0.5;next-fwd;last=0.5;ac)",
    "coherent(host;next-fwd;last=0.75;keep=1;ac;depth=1;cast=device)",
    "coherent(host;next-fwd;keep=1;ac;cast=device)",
    "coherent(split=0.5;next-fwd;depth=1;ac)",
)


class PlainBlock(nn.Module):
    """Pre-norm residual block on hidden states: causal SDPA attention, then a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        heads = self.qkv(self.attention_norm(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class PlainBlocks(nn.Module):
    """Blocks in an ``nn.ModuleList`` at ``stack`` (a name no known layout uses), then a norm."""

    def __init__(self, dim: int, heads: int, n_blocks: int) -> None:
        super().__init__()
        self.stack = nn.ModuleList(PlainBlock(dim, heads) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.stack:
            x = block(x)
        return self.norm(x)


def missing_package(model_name: str) -> str | None:
    """The error of every row of a model whose package is not installed, else None."""
    if model_name == "llama-1b-hf" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e \".[test]\")"
    return None


def build(model_name: str, tiny: bool, device: torch.device) -> tuple[nn.Module, nn.ModuleList]:
    """The model, initialised on ``device`` (seed 0), and its blocks in forward order."""
    torch.manual_seed(0)
    if model_name == "anchor-1.6b":
        model = build_model("tiny" if tiny else "anchor-1.6b", device=device)
        return model, model.blocks
    if model_name == "llama-1b-hf":
        model = build_hf_causal_lm(LLAMA_TINY if tiny else LLAMA, device=device)
        return model, model.model.layers
    if model_name == "plain-1.5b":
        with torch.device(device):
            model = PlainBlocks(**(PLAIN_TINY if tiny else PLAIN))
        return model, model.stack
    raise ValueError(f"unknown model {model_name!r}; choose from {', '.join(MODELS)}")


def example_batch(model_name: str, model: nn.Module, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Seeded token ids, or hidden states for the plain model."""
    generator = torch.Generator(device=device).manual_seed(0)
    if model_name == "plain-1.5b":
        return torch.randn(batch_size, seq_len, model.norm.normalized_shape[0], device=device, generator=generator)
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (batch_size, seq_len), device=device, generator=generator)


def loss_of(model_name: str, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if model_name == "anchor-1.6b":
        return causal_lm_loss(model(batch), batch)
    if model_name == "llama-1b-hf":
        return causal_lm_loss(model(input_ids=batch, use_cache=False).logits, batch)
    return model(batch).float().square().mean()


def check_row(name: str) -> None:
    """Raises ValueError for a row this benchmark cannot run."""
    if name in ("default", "planned", "resident", *LAST_ROWS):
        return
    coherent_row_config(name)  # raises for a name outside the grammar
    if units_per_block(name) != 1 or user_clips(name):
        raise ValueError(f"row {name!r}: units= and user-clip are benchmarks/fsdp_offload.py's only")


def row_training_config(name: str, n_blocks: int) -> TrainingConfig:
    """The planner's ``TrainingConfig`` of a ``resident``, ``every-block`` or ``coherent(...)`` row
    (the policy's ``auto`` knobs resolved for this machine)."""
    if name == "resident":
        return TrainingConfig()
    resolved = CoherentOffload(**coherent_row_config("coherent(default)" if name == "every-block" else name)).resolve()
    last, spread = last_blocks_fraction(name), spread_blocks_fraction(name)
    fraction = round(last * n_blocks) / n_blocks if last is not None else 1.0 if spread is None else spread
    gpu_fraction = resolved.optimizer_gpu_fraction
    return TrainingConfig(
        module_fraction=fraction,
        optimizer={0.0: "host", 1.0: "stream"}.get(gpu_fraction, gpu_fraction),
        activations=resolved.activations,
        checkpointing=checkpointed(name),
        prefetch_depth=resolved.prefetch_depth,
        block_placement="last" if last is not None or fraction == 1.0 else "spread",
        keep_unsharded=kept_unsharded_blocks(name),
        cast_on=resolved.cast_on,
        step_during_backward="early" in row_items(name),
    )


def predictions(result, names: list[str], n_blocks: int) -> dict[str, dict]:
    """The planner's step model on each row of the setting, from the plan's own profile and platform
    (``default`` has its own plan's)."""
    training = result.training
    if training is None:
        return {}
    profile, platform = training.profiles[0][1], result.scenario.platform
    found = {}
    for name in names:
        if name == "default":
            continue
        if name == "planned":
            if training.best is None:
                continue
            config, prediction = training.best[1].config, training.best[1]
        else:
            config = row_training_config(name, n_blocks)
            prediction = predict_step(profile, config, platform)
        found[name] = {"step_s": round(prediction.step_s, 4), "peak_gpu_GiB": round(prediction.peak_gpu_GiB, 2),
                       "host_optimizer_s": round(prediction.host_optimizer_s, 6),
                       "fits": prediction.fits(training.capacity_bytes), "label": config.label}
    return found


def shard_and_optimizer(name: str, model: nn.Module, blocks: nn.ModuleList, mp: MixedPrecisionPolicy):
    """Shard ``model`` as the row says; its optimizer."""
    if name == "every-block":
        policy = CoherentOffload()
        for block in blocks:
            fully_shard(block, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mp_policy=mp, offload_policy=policy)
        return OffloadOptimizer(model, torch.optim.AdamW, **optimizer_kwargs("coherent(default)"))
    if name == "resident":
        fully_shard_with_policy(model, blocks, None, mp_policy=mp)
        return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    last = last_blocks_fraction(name)
    fully_shard_with_policy(
        model, blocks, CoherentOffload(**coherent_row_config(name)),
        last_blocks=None if last is None else round(last * len(blocks)), spread_fraction=spread_blocks_fraction(name),
        keep_unsharded_last=kept_unsharded_blocks(name), activation_checkpointing=checkpointed(name), mp_policy=mp,
    )
    return OffloadOptimizer(model, torch.optim.AdamW, **optimizer_kwargs(name))


def run_row(name: str, args, names: list[str], held: dict) -> dict:
    """One row in this process; ``held`` keeps the model and optimizer for the caller to release."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the setup's peak is this row's own
    model, blocks = build(args.one_setting, args.tiny, device)
    held.update(model=model)
    batch = example_batch(args.one_setting, model, args.batch_size, args.seq_len, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    row: dict = {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "n_blocks": len(blocks)}
    if name in ("default", "planned"):
        plan_kwargs: dict = {}  # README's call passes none
        if name == "planned":
            plan_kwargs.update(microbatch_factors=[int(f) for f in args.microbatch_factors.split(",")], blocks=blocks)
            if device.type == "cpu":  # nothing to measure the link of: plan for the H200, the block timed here
                plan_kwargs.update(platform="h200-pcie", measure=True, device="cpu")
        started = time.perf_counter()
        result = plan_and_shard(model, example_input=batch, fully_shard_kwargs={"mp_policy": mp}, **plan_kwargs)
        recommended = result.recommended
        best = result.training.best if result.training is not None else None
        row.update(plan_s=round(time.perf_counter() - started, 2), plan_timing=result.timing,
                   plan_label=None if best is None else best[1].config.label, recommendation=recommended.code(),
                   predicted_host_optimizer_s=None if best is None else round(best[1].host_optimizer_s, 6),
                   technique=recommended.technique, predicted_step_s=recommended.predicted_step_s,
                   predicted_peak_gpu_GiB=recommended.predicted_peak_gpu_GiB,
                   plan_budget_GiB=None if result.training is None else round(result.training.capacity_bytes / GiB, 2),
                   micro_batch_size=recommended.micro_batch_size)
        if name == "planned":
            row["predictions"] = predictions(result, names, len(blocks))
        optimizer = recommended.optimizer(model, lr=LR, fused=True)
        if recommended.micro_batch_size not in (None, args.batch_size):
            batch = example_batch(args.one_setting, model, recommended.micro_batch_size, args.seq_len, device)
    else:
        optimizer = shard_and_optimizer(name, model, blocks, mp)
    held.update(optimizer=optimizer)
    if device.type == "cuda":
        row["peak_setup_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        torch.cuda.reset_peak_memory_stats()

    host_seconds: list[float] = []
    # Per step: CUDA events at its start, after forward and after backward (None on the CPU), and
    # the seconds the CPU took to run backward (when the loop reaches step()).
    phases: list[tuple[list | None, float]] = []

    def step(batch: torch.Tensor) -> torch.Tensor:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else None
        if events:
            events[0].record()
        loss = loss_of(args.one_setting, model, batch)
        if events:
            events[1].record()
        forwarded = time.perf_counter()
        loss.backward()
        phases.append((events, time.perf_counter() - forwarded))
        if events:
            events[2].record()
        optimizer.step()
        # Seconds of the host steps that ended since the last step() returned (a plain torch
        # optimizer has none).
        host_seconds.append(getattr(optimizer, "last_host_step_seconds", 0.0))
        optimizer.zero_grad()
        return loss

    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.type == "cuda" else 0
    times, losses = timed_steps(step, batch, args.steps, args.warmup)
    step_s = statistics.median(times)
    row.update(micro_batch_size=batch.shape[0], step_s=round(step_s, 4), step_s_each=[round(t, 4) for t in times],
               tokens_per_s=round(batch.shape[0] * args.seq_len / step_s), loss_last=losses[-1],
               peak_gpu_GiB=round(torch.cuda.max_memory_allocated() / GiB, 2) if device.type == "cuda" else 0.0,
               backward_cpu_s=round(statistics.median(cpu for _, cpu in phases[args.warmup:]), 4))
    if device.type == "cuda":
        timed = [events for events, _ in phases[args.warmup:]]
        row.update(forward_s=round(statistics.median(e[0].elapsed_time(e[1]) for e in timed) / 1e3, 4),
                   backward_s=round(statistics.median(e[1].elapsed_time(e[2]) for e in timed) / 1e3, 4),
                   peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / GiB, 2),
                   alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before)
    if isinstance(optimizer, OffloadOptimizer):
        row.update(host_optimizer_s=round(statistics.median(host_seconds[args.warmup:]), 6),
                   host_stepped_params=optimizer.stepped_numel["host"])
    return row


def ranked(sweep: list[str], predicted: dict[str, dict]) -> list[str]:
    """Sweep rows predicted to fit first, each group by predicted step; unpredicted ones last, as given."""
    def key(name: str) -> tuple:
        found = predicted.get(name)
        return (2, 0.0) if found is None else (0 if found["fits"] else 1, found["step_s"])

    return sorted(sweep, key=key)


def release(held: dict, failed: bool) -> float:
    """Drop a row's model and optimizer (its last host steps finished first) and the cached GPU
    blocks; the GiB still allocated after. The pinned pool keeps its blocks for the next row (the same
    model's buffers, and the pool gives blocks back itself where a new size does not fit), but for
    a failed row's."""
    optimizer = held.get("optimizer")
    if isinstance(optimizer, OffloadOptimizer):
        try:
            optimizer.synchronize()
        except Exception:  # noqa: BLE001 (a failed row's steps may have failed too: release anyway)
            traceback.print_exc()
    held.clear()
    gc.collect()
    if failed:
        empty_pinned_cache()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / GiB


def run_setting(args) -> int:
    """The rows of one (model, batch size, cap) in this process (the ``--one-setting`` child); the
    rows so far, the one running and the order left are rewritten to ``--row-out`` around each row."""
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(0)
        if args.gpu_cap_GiB is not None:  # before anything is allocated
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_GiB * GiB / total), 0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", rank=0, world_size=1)
    started = time.monotonic()
    names = args.rows.split(",")
    pending, rows, longest = list(names), [], 0.0
    base = {"model": args.one_setting, "batch_size": args.batch_size, "gpu_cap_GiB": args.gpu_cap_GiB}

    def write(running: str | None) -> None:
        with open(args.row_out + ".tmp", "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "running": running, "order": pending}, handle)
        os.replace(args.row_out + ".tmp", args.row_out)

    while pending:
        name = pending.pop(0)
        row = {**base, "name": name}
        if name not in MUST_ROWS and time.monotonic() - started + longest > args.share_s:
            rows.append({**row, "error": "not run: its share of --max-seconds was spent"})
            continue
        write(name)
        held: dict = {}
        row_started = time.monotonic()
        try:
            row.update(run_row(name, args, names, held))
        except Exception as error:  # noqa: BLE001 (the row records what failed; the rest go on)
            traceback.print_exc()
            row["error"] = error_line(error)
        row["allocated_after_teardown_GiB"] = round(release(held, "error" in row), 2)
        longest = max(longest, time.monotonic() - row_started)
        rows.append(row)
        if name == "planned" and "predictions" in row:
            sweep = [n for n in pending if n.startswith("coherent(")]
            last = [n for n in pending if n in LAST_ROWS]
            pending = [n for n in pending if n not in sweep and n not in last] + ranked(sweep, row["predictions"]) + last
        if row["allocated_after_teardown_GiB"] > 1.0:
            break  # what the row left would weigh on the next: a fresh process takes the rest
    write(None)
    dist.destroy_process_group()
    return 0


def summarize(rows: list[dict]) -> list[dict]:
    """Per setting: the fastest row, every row's ``over_best`` and prediction error (from the planned
    row's ``predictions``), the default's and the plan's ratios, and the rows that failed."""
    settings: dict[tuple, list[dict]] = {}
    for row in rows:
        settings.setdefault((row["model"], row["batch_size"], row["gpu_cap_GiB"]), []).append(row)
    summaries = []
    for (model, batch_size, cap), group in settings.items():
        by_name = {row["name"]: row for row in group}
        measured = [row for row in group if "error" not in row]
        best = max(measured, key=lambda row: row["tokens_per_s"], default=None)
        # The rows at the setting's micro-batch (every row but default, which picks its own).
        at_batch = [row for row in measured if row.get("micro_batch_size", batch_size) == batch_size]
        best_at_batch = max(at_batch, key=lambda row: row["tokens_per_s"], default=None)
        predicted = by_name.get("planned", {}).get("predictions", {})
        for row in measured:
            row["over_best"] = round(best["tokens_per_s"] / row["tokens_per_s"], 2)
            row.pop("over_best_at_batch", None)
            if row in at_batch:
                row["over_best_at_batch"] = round(best_at_batch["tokens_per_s"] / row["tokens_per_s"], 2)
            if row["name"] in predicted:
                row["predicted_step_s"] = predicted[row["name"]]["step_s"]
            if row.get("predicted_step_s"):
                row["prediction_error"] = round(row["predicted_step_s"] / row["step_s"] - 1, 3)
        planned = by_name.get("planned", {})
        summaries.append({
            "model": model, "batch_size": batch_size, "gpu_cap_GiB": cap,
            "best_row": None if best is None else best["name"],
            "best_tokens_per_s": None if best is None else best["tokens_per_s"],
            "best_row_at_batch": None if best_at_batch is None else best_at_batch["name"],
            "best_at_batch_tokens_per_s": None if best_at_batch is None else best_at_batch["tokens_per_s"],
            "default_over_best": by_name.get("default", {}).get("over_best"),
            "planned_over_best": planned.get("over_best"),
            "planned_over_best_at_batch": planned.get("over_best_at_batch"),
            "planned_choice": planned.get("plan_label"), "planned_timing": planned.get("plan_timing"),
            "planned_prediction_error": planned.get("prediction_error"),
            "failed": {row["name"]: row["error"] for row in group if "error" in row},
        })
    return summaries


def print_table(rows: list[dict], summaries: list[dict]) -> None:
    print(f"{'model':12s} {'bs':>3s} {'cap':>4s} {'row':62s} {'step s':>7s} {'tokens/s':>9s} {'peak GiB':>8s} "
          f"{'pred s':>7s} {'pred err':>8s} {'/best':>6s}")
    for r in rows:
        cap = "-" if r["gpu_cap_GiB"] is None else f"{r['gpu_cap_GiB']:g}"
        name = r["name"] + (f" = {r['plan_label']}" if r.get("plan_label") else "")
        lead = f"{r['model']:12s} {r['batch_size']:>3d} {cap:>4s} {name[:62]:62s}"
        if "error" in r:
            print(f"{lead} error: {r['error'][:100]}")
            continue
        predicted = f"{r['predicted_step_s']:7.3f}" if r.get("predicted_step_s") else f"{'-':>7s}"
        error = f"{r['prediction_error']:+8.0%}" if "prediction_error" in r else f"{'-':>8s}"
        print(f"{lead} {r['step_s']:7.3f} {r['tokens_per_s']:9d} {r['peak_gpu_GiB']:8.1f} {predicted} {error} "
              f"{r['over_best']:6.2f}")
    for s in summaries:
        cap = "uncapped" if s["gpu_cap_GiB"] is None else f"cap {s['gpu_cap_GiB']:g} GiB"
        print(f"{s['model']} bs {s['batch_size']} {cap}: best {s['best_row']} ({s['best_tokens_per_s']} tokens/s), "
              f"at bs {s['batch_size']} {s['best_row_at_batch']} ({s['best_at_batch_tokens_per_s']}); "
              f"default x{s['default_over_best']}, planned x{s['planned_over_best']} (x{s['planned_over_best_at_batch']} at bs) "
              f"({s['planned_choice']}, {s['planned_timing']}, prediction error {s['planned_prediction_error']})"
              + (f"; failed: {', '.join(s['failed'])}" if s["failed"] else ""))


def row_list(text: str) -> list[str]:
    """The rows of a comma-separated list (``coherent(...)`` items are separated by ``;``)."""
    return [name for name in text.split(",") if name]


def run_settings(runner: Runner, args, settings: list[tuple[str, int, float | None]], rows: list[dict], write) -> None:
    """Each setting's rows in child processes (a child that dies is followed by one for its rows left),
    each child with an equal share of the time left for its optional rows."""
    only = row_list(args.only)
    for index, (model_name, batch_size, cap) in enumerate(settings):
        base = {"model": model_name, "batch_size": batch_size, "gpu_cap_GiB": cap}
        optional = row_list(args.capped_sweep) if cap is not None else ["resident", *row_list(args.sweep)]
        pending = [name for name in (*MUST_ROWS, *optional, *LAST_ROWS) if not only or name in only]
        missing = missing_package(model_name)
        if missing is not None:
            rows.extend({**base, "name": name, "error": missing} for name in pending)
            pending = []
        while pending:
            if runner.remaining() < 20:
                rows.extend({**base, "name": name, "error": "not run: --max-seconds reached"} for name in pending)
                break
            share = runner.remaining() / (len(settings) - index)
            flags = ["--one-setting", model_name, "--batch-size", str(batch_size), "--rows", ",".join(pending),
                     "--share-s", f"{share:.0f}", "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                     "--warmup", str(args.warmup), "--microbatch-factors", args.microbatch_factors,
                     *(["--gpu-cap-GiB", str(cap)] if cap is not None else []), *(["--tiny"] if args.tiny else [])]
            found, error = runner.child(flags, min(runner.remaining(), args.row_timeout * len(pending)))
            if found is None:  # it failed before its first row: so would another
                rows.extend({**base, "name": name, "error": error or "no row written"} for name in pending)
                break
            rows.extend(found["rows"])
            for row in found["rows"]:
                print(json.dumps({k: v for k, v in row.items() if k != "predictions"}), flush=True)
            if found["running"] is not None:
                rows.append({**base, "name": found["running"], "error": error or "the process ended while this row ran"})
            pending = found["order"]
            write()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--batch-sizes", default="4,16", help="settings on the whole GPU ('none': no such setting)")
    parser.add_argument("--capped-batch-sizes", default="4", help="settings under --cap-GiB ('none': no such setting)")
    parser.add_argument("--cap-GiB", type=float, default=16.0)
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048, 32 with --tiny")
    parser.add_argument("--steps", type=int, default=3)
    # Three untimed steps: a host-stepped row's first host step allocates and first touches its
    # moments, and with next-forward overlap it spills into the step after it.
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sweep", default=",".join(SWEEP), help="coherent(...) rows of the uncapped settings")
    parser.add_argument("--capped-sweep", default=",".join(CAPPED_SWEEP), help="coherent(...) rows under the cap")
    parser.add_argument("--microbatch-factors", default="1", help="plan()'s microbatch_factors for the planned rows")
    parser.add_argument("--only", default="", help="run only these rows of each setting (comma-separated, e.g. default,planned)")
    parser.add_argument("--tiny", action="store_true", help="tiny versions of the models (a CPU smoke run)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop starting rows after this long")
    parser.add_argument("--row-timeout", type=float, default=240.0, help="seconds a row may take (a setting's process: times its rows)")
    parser.add_argument("--out", default="benchmarks/results/models.json")
    parser.add_argument("--one-setting", choices=sorted(MODELS), help=argparse.SUPPRESS)  # a setting's child
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-cap-GiB", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--share-s", type=float, default=float("inf"), help=argparse.SUPPRESS)
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (32 if args.tiny else 2048)
    if args.one_setting:
        return run_setting(args)
    models = row_list(args.models)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    try:
        [check_row(name) for name in (*row_list(args.sweep), *row_list(args.capped_sweep), *row_list(args.only))]
    except ValueError as error:
        parser.error(str(error))
    settings = [(m, int(b), cap) for text, cap in ((args.batch_sizes, None), (args.capped_batch_sizes, args.cap_GiB))
                for b in row_list("" if text == "none" else text) for m in models]
    if args.tiny and not torch.cuda.is_available():
        # No link here: the copy path runs on the CPU anyway, as the tests run it (a host_only
        # platform copies nothing and refuses an explicit optimizer placement).
        os.environ.setdefault("TORCH_FSDP_OFFLOAD_PLATFORM", "discrete")
    started = time.monotonic()
    runner = Runner(args, started + (args.max_seconds if args.max_seconds is not None else float("inf")),
                    script=os.path.abspath(__file__))
    machine, error = Runner(args, runner.deadline).child(["--describe"], timeout=300)  # peers.py's own child
    if machine is None or ("gpu" not in machine and not args.tiny):
        print(f"benchmarks/models.py needs a GPU, or --tiny ({error or 'none visible'})", file=sys.stderr)
        return 2
    print(f"machine: {json.dumps(machine)}", flush=True)
    rows: list[dict] = []
    hidden = {"one_setting", "batch_size", "gpu_cap_GiB", "rows", "share_s", "row_out"}
    result = {"benchmark": "models", "torch": torch.__version__,
              "transformers": None if missing_package("llama-1b-hf") else importlib.metadata.version("transformers"),
              "gpu": machine.get("gpu"), "link_GBps": machine.get("link_GBps"), "machine": machine,
              "args": {key: value for key, value in vars(args).items() if key not in hidden},
              "models": {m: MODELS[m] for m in models}, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def write() -> None:
        result["settings"] = summarize(rows)
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)

    run_settings(runner, args, settings, rows, write)
    write()
    print_table(rows, result["settings"])
    return 0


if __name__ == "__main__":
    exit_skipping_teardown(main())
