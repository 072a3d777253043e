"""The loop users fine-tune with, on a Hugging Face model loaded on the CPU, against the peers.

The model: a ``transformers`` Qwen2 decoder of the 3B class (``USER_MODEL``: 36 layers of width
2048, grouped-query attention with 2 key-value heads, an MLP of 11008, a 151,936-token vocabulary
with tied embeddings; 3.09B parameters). It is written once with ``save_pretrained`` (random
weights, fp32) and each row loads it with ``from_pretrained`` onto the CPU, as a fine-tune starts.
Every row trains the same seeded 4 x 2048 tokens with the model's own loss
(``model(input_ids=tokens, labels=tokens).loss``: the fp32 logits of the whole vocabulary), bf16
compute, AdamW (lr 1e-5), each in a process of its own, under a GPU cap
(``torch.cuda.set_per_process_memory_fraction``) unless it is marked uncapped.

Rows are named ``system;cap=G;mb=B;accum=N;clip`` (``cap`` in GiB, none: the whole GPU; ``mb``:
sequences per micro-batch, default ``--batch-size``; ``accum``: N
micro-batches per optimizer step, FSDP2 rows calling ``set_requires_gradient_sync`` on the last;
``clip``: ``clip_grad_norm_(1.0)`` before ``step()``, DeepSpeed's ``gradient_clipping``;
``plan_unclipped``: a clipping ``plan`` row runs the plan made for the loop without clipping, so
the clip's own cost shows beside the unclipped row; ``early``: a ``plan`` row's optimizer also
steps during backward, ``step_during_backward=True``, which changes parameters before ``step()``:
what host steps under backward would gain, the bound of an exact speculative step;
``offload_optimizer``: an ``fsdp1`` row's optimizer is ``OffloadOptimizer`` over the front door;
``compile``: a ``resident``, ``stock`` or ``every`` row checkpoints each decoder layer with torch's
``checkpoint_wrapper`` and compiles it, ``layer.compile()``, before ``fully_shard``, as torchtitan
does, and records dynamo's graph breaks and the frames it compiled in the timed steps;
``memory=pinned|managed`` and ``platform=discrete|coherent|unified``: an ``every`` row's
``CoherentOffload(shard_memory=..., platform=...)``, the platform class forced, which records the
managed bytes it allocated and the GPU memory in use by the device's count, ``cudaMemGetInfo``,
managed pages included).
Systems:

- ``resident``: FSDP2 on every decoder layer and the root, fused AdamW on the GPU, the layers
  checkpointed (``gradient_checkpointing_enable``);
- ``stock``: the same with ``CPUOffloadPolicy(pin_memory=True)`` and fused CPU AdamW;
- ``zero3``: DeepSpeed ZeRO-3, parameters and optimizer on the CPU (DeepSpeedCPUAdam), checkpointed;
- ``fsdp1``: the FSDP1 front door, ``FullyShardedDataParallel(model, auto_wrap_policy=<the decoder
  layer>, offload_policy=CoherentOffload())``, fused AdamW, checkpointed;
- ``every``: the FSDP2 path at the front door's placement: ``CoherentOffload(optimizer="host")`` on
  every decoder layer and the root, ``OffloadOptimizer`` with fused AdamW, checkpointed;
- ``plan``: README's one call, ``plan_and_shard(model, example_input=tokens, fully_shard_kwargs=
  {"mp_policy": mp}, microbatch_factors=[1], grad_accum_steps=N, clipping=clip)`` (held to the
  micro-batch of 4, the loop given), then ``result.recommended.optimizer(model, lr, fused=True)``.

The bound of a row: ``max(T_gpu, T_host, T_gpu - T_fwd + T_host, H2D / BW_h2d, D2H / BW_d2h)`` where
``T_gpu`` is the uncapped resident row's step over as many sequences (compute with checkpointing),
``T_host`` the row's host-stepped parameters at the fused CPU AdamW rate measured here
(``measure_host_step``), and the link terms count the bytes this library's engine moved (its rows
only). The third term is torch.optim's contract: nothing steps before ``step()``, which comes after
the last backward, and every host step must end before the next forward is through (its last group
needs its step), so at most one forward (``T_fwd``, resident's, of one micro-batch) runs beside
them; rows that step during backward (``early``) do not have it. ``of_bound`` is the bound over the
row's step.

Each row records its phases per step (``forward``, ``backward``, ``clip``, ``step``: seconds on
the GPU's clock and the host's), the gradient norms of clipping rows, a ``plan`` row's predicted
phases and the profile its plan was made from, and with ``--profile DIR`` and ``--memory-snapshot``
one more step's copy-compute overlap and allocation peak by site.

Usage (GPU machine, from the repository root; DeepSpeed builds its CPU Adam on first use):
    python benchmarks/user_loop.py --out benchmarks/results/user_loop.json
    python benchmarks/user_loop.py --rows "plan;cap=24,plan;cap=24;clip" --resume-from FILE --out FILE
    python benchmarks/user_loop.py --tiny --out /tmp/user_loop.json   # a 2-layer model on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peers import describe_machine, error_line, exit_skipping_teardown, Runner, versions  # noqa: E402

GiB = 1 << 30
LR = 1e-5
USER_MODEL = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
    "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}
TINY_MODEL = {**USER_MODEL, "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}
ROWS = (
    "resident", "resident;accum=4", "plan;cap=24", "plan;cap=24;clip", "plan;cap=24;mb=2;accum=8",
    "stock;cap=24", "fsdp1;cap=24", "zero3;cap=24", "plan;cap=40", "plan;cap=40;accum=4", "plan;cap=24;accum=4",
)
SYSTEMS = ("resident", "stock", "zero3", "fsdp1", "every", "plan")


def parse_row(name: str) -> dict:
    """``"plan;cap=24;mb=2;accum=4;clip"`` -> ``{"system": "plan", "cap": 24.0, "accum": 4, "clip": True,
    "micro_batch": 2}`` (``micro_batch`` None: ``--batch-size``)."""
    system, *items = name.split(";")
    if system not in SYSTEMS:
        raise ValueError(f"row {name!r}: unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    row = {"system": system, "cap": None, "accum": 1, "clip": False, "micro_batch": None}
    for item in items:
        key, _, value = item.partition("=")
        if key == "cap" and value:
            row["cap"] = float(value)
        elif key == "accum" and value:
            row["accum"] = int(value)
        elif key == "mb" and value:
            row["micro_batch"] = int(value)
        elif key == "clip" and not value:
            row["clip"] = True
        elif key in ("plan_unclipped", "early", "offload_optimizer", "compile") and not value:
            row[key] = True
        elif (key, value) in {("memory", "pinned"), ("memory", "managed")} or (
            key == "platform" and value in ("discrete", "coherent", "unified")
        ):
            row[key] = value
        else:
            raise ValueError(
                f"row {name!r}: unknown item {item!r} (cap=G, mb=N, accum=N, clip, plan_unclipped, early, "
                "offload_optimizer, compile, memory=pinned|managed, platform=discrete|coherent|unified)"
            )
    if row.get("compile") and system not in ("resident", "stock", "every"):
        raise ValueError(f"row {name!r}: compile applies to the resident, stock and every rows")
    if (row.get("memory") or row.get("platform")) and system != "every":
        raise ValueError(f"row {name!r}: memory= and platform= apply to the every rows")
    return row


def failed_row(name: str, error: str) -> dict:
    """The record of a row that did not run, and why."""
    return {"name": name, **parse_row(name), "error": error}


def save_model(model_dir: str, tiny: bool, layers: int | None = None) -> dict:
    """Write the model with random weights once (``save_pretrained``), and say its size; ``layers``:
    that many decoder layers instead of the family's."""
    import torch
    import transformers

    fields = dict(TINY_MODEL if tiny else USER_MODEL, **({"num_hidden_layers": layers} if layers else {}))
    described = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.02, generator=generator)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.fill_(1.0)
        model.tie_weights()
        model.save_pretrained(model_dir)
    return {"config": described}


def _layer_class(model):
    return type(model.model.layers[0])


def _checkpoint_layers(model, compiled: bool) -> None:
    """Checkpoint each decoder layer: ``transformers``' own way, or with ``compiled`` torch's
    ``checkpoint_wrapper`` around each layer, compiled (``fully_shard`` comes after)."""
    if not compiled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, layer in enumerate(model.model.layers):
        wrapped = checkpoint_wrapper(layer)
        wrapped.compile()
        model.model.layers[index] = wrapped


def _build(row: dict, model_dir: str, tokens, device):
    """The row's model and one optimizer step over ``row["accum"]`` micro-batches: ``step() -> loss``,
    and what the plan chose (plan rows)."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy
    from torch_fsdp_offload import CoherentOffload, plan_and_shard

    system, accum, clip = row["system"], row["accum"], row["clip"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()  # from_pretrained leaves it in eval mode, where transformers skips checkpointing
    extra = {}
    if system == "zero3":
        import deepspeed

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        offload = {"device": "cpu", "pin_memory": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": tokens.shape[0], "gradient_accumulation_steps": accum,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0 if clip else 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload,
                                  "overlap_comm": True, "contiguous_gradients": True},
            "steps_per_print": 1 << 30,
        })

        def step():
            for _ in range(accum):
                loss = engine(input_ids=tokens, labels=tokens).loss
                engine.backward(loss)
                engine.step()
            return loss

        return engine, step, extra
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if system == "plan":
        planned_clip = clip and not row.get("plan_unclipped", False)
        result = plan_and_shard(model, example_input=tokens, fully_shard_kwargs={"mp_policy": mp},
                                microbatch_factors=[1], grad_accum_steps=accum, clipping=planned_clip)
        chosen = result.recommended
        extra = {"plan": chosen.code(), "plan_timing": result.timing, "predicted_step_s": chosen.predicted_step_s,
                 "predicted_peak_GiB": chosen.predicted_peak_gpu_GiB, "plan_micro_batch": chosen.micro_batch_size,
                 "plan_accum": chosen.grad_accum_steps, "report": result.report()}
        if result.training is not None and result.training.best is not None:
            # What the step model took and gave, to compare phase by phase with the measured run.
            best = result.training.to_dict()["best"]
            extra["predicted_phases"] = {key: best[key] for key in ("forward_s", "backward_s", "optimizer_s", "host_optimizer_s")}
            extra["plan_profile"] = dict(result.training.profiles)[best["microbatch_factor"]].to_dict()
        optimizer = chosen.optimizer(model, lr=LR, fused=True, **({"step_during_backward": True} if row.get("early") else {}))
        extra["optimizer"] = optimizer
    elif system == "fsdp1":
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from torch_fsdp_offload import FullyShardedDataParallel

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({_layer_class(model)}), device_id=device,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            offload_policy=CoherentOffload())
        if row.get("offload_optimizer"):
            from torch_fsdp_offload import OffloadOptimizer

            optimizer = extra["optimizer"] = OffloadOptimizer(model, torch.optim.AdamW, lr=LR, fused=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    elif system == "every":
        from torch_fsdp_offload import OffloadOptimizer

        _checkpoint_layers(model, row.get("compile", False))
        knobs = {"shard_memory": row.get("memory", "auto"), "platform": row.get("platform")}
        policy = CoherentOffload(**knobs)
        if device.type == "cuda" and policy.resolve().copies:
            policy = policy.replace(optimizer="host")  # the host steps: where shards are read in place, always
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mp_policy=mp, offload_policy=policy)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=LR, fused=True)
        extra["optimizer"] = optimizer
    else:
        _checkpoint_layers(model, row.get("compile", False))
        policy = CPUOffloadPolicy(pin_memory=True) if system == "stock" else None
        kwargs = {"mp_policy": mp, **({"offload_policy": policy} if policy else {})}
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    fsdp2 = system != "fsdp1"
    norms = extra["grad_norms"] = []  # read after the timed steps: no sync inside them
    # Compiled layers get no cache object to guard on (transformers turns the cache off itself
    # only for its own checkpointing).
    call = {"use_cache": False} if row.get("compile") else {}

    def step(mark=lambda name: None):
        for micro in range(accum):
            if fsdp2:
                model.set_requires_gradient_sync(micro == accum - 1)
            loss = model(input_ids=tokens, labels=tokens, **call).loss / accum
            mark("forward")
            loss.backward()
            mark("backward")
        if clip:
            if fsdp2:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                norm = model.clip_grad_norm_(1.0)
            norms.append(norm.detach())
            mark("clip")
        optimizer.step()
        mark("step")
        optimizer.zero_grad()
        return loss

    return model, step, extra


def step_phases(marks: list) -> dict:
    """Seconds between consecutive marks of one step (forward, backward, clip, step), on the GPU's
    clock (CUDA events on the current stream) and on the host's (when the call returned), summed
    per phase name over the micro-batches."""
    phases = {}
    for (_, event0, host0), (name, event1, host1) in zip(marks, marks[1:]):
        gpu = event0.elapsed_time(event1) / 1e3 if event0 is not None else None
        entry = phases.setdefault(name, {"gpu_s": 0.0, "host_s": 0.0})
        entry["host_s"] = round(entry["host_s"] + host1 - host0, 4)
        if gpu is not None:
            entry["gpu_s"] = round(entry["gpu_s"] + gpu, 4)
    return phases


def offloaded_params(model) -> int:
    """Parameters whose shard lives on the CPU (DeepSpeed's: all of them)."""
    total = 0
    for param in model.parameters():
        if hasattr(param, "ds_numel"):
            total += param.ds_numel
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        total += param.numel() if local.device.type == "cpu" else 0
    return total


def profile_step(step, name: str, profile_dir: str) -> dict:
    """Run ``step`` once more under ``torch.profiler``; write its chrome trace to ``profile_dir``
    and return how long the copies and kernels ran and how much of the copies ran under kernels."""
    import torch
    from fsdp_offload import copy_compute_overlap

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    os.makedirs(profile_dir, exist_ok=True)
    trace = os.path.join(profile_dir, re.sub(r"[^A-Za-z0-9]+", "_", name) + ".trace.json")
    prof.export_chrome_trace(trace)
    host = {}
    for event in prof.events():
        if event.name.startswith("torch_fsdp_offload::"):
            kind = event.name.split(":")[2]
            host[kind] = round(host.get(kind, 0.0) + event.cpu_time_total / 1e6, 4)
    return {"trace": os.path.basename(trace), **copy_compute_overlap(prof, 1), "labelled_cpu_s": host}


def run_one_row(name: str, model_dir: str, batch: int, seq_len: int, steps: int, warmup: int,
                profile_dir: str | None = None, memory_snapshot: bool = False) -> dict:
    """One row in this process (the ``--one-row`` child)."""
    import torch
    from torch_fsdp_offload.transfer import get_transfer_engine

    row = {"name": name, **parse_row(name), "seq_len": seq_len}
    batch = row["batch_size"] = row.pop("micro_batch") or batch
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
        if row["cap"] is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, row["cap"] * GiB / total), 0)
    started = time.perf_counter()
    generator = torch.Generator(device=device).manual_seed(0)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as config:
        config_vocab = json.load(config)["vocab_size"]
    tokens = torch.randint(0, config_vocab, (batch, seq_len), device=device, generator=generator)
    model, step, extra = _build(row, model_dir, tokens, device)
    optimizer = extra.pop("optimizer", None)
    row.update(extra, setup_s=round(time.perf_counter() - started, 1),
               params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
    engine = get_transfer_engine(device) if gpu else None
    times, losses, phases = [], [], []
    frames_before = None
    for index in range(warmup + steps):
        if index == warmup:
            if row.get("compile"):
                from torch._dynamo.utils import counters

                frames_before = counters["frames"]["ok"]
            if engine is not None:
                engine.stats.reset()
            if gpu:
                torch.cuda.reset_peak_memory_stats()
        marks = []

        def mark(name):
            event = torch.cuda.Event(enable_timing=True) if gpu else None
            if event is not None:
                event.record()
            marks.append((name, event, time.perf_counter()))

        t0 = time.perf_counter()
        mark("start")
        loss = step(mark) if row["system"] != "zero3" else step()
        losses.append(loss.item())
        if gpu:
            torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - t0)
            phases.append(step_phases(marks))
    step_s = statistics.median(times)
    row["phases"] = phases
    if frames_before is not None:
        row.update(compiled_frames_timed=counters["frames"]["ok"] - frames_before,
                   compiled_frames=counters["frames"]["ok"], graph_breaks=dict(counters["graph_break"]))
    # Counted over the timed steps only (a profiled or recorded step below copies too).
    if engine is not None and row["system"] in ("plan", "fsdp1", "every"):
        row.update(h2d_GB=round(engine.stats.h2d_bytes / steps / 1e9, 2), d2h_GB=round(engine.stats.d2h_bytes / steps / 1e9, 2))
    if gpu and row["system"] == "every":
        from torch_fsdp_offload.memory import memory_stats

        free, total = torch.cuda.mem_get_info(device)
        row.update(managed_GiB=round(memory_stats()["managed_bytes"] / GiB, 2), device_used_GiB=round((total - free) / GiB, 2))
    if row.get("grad_norms"):
        row["grad_norms"] = [round(float(norm), 4) for norm in row["grad_norms"]]
    row.update(host_step_s=getattr(optimizer, "last_host_step_seconds", None),
               stream_step_s=getattr(optimizer, "last_stream_step_seconds", None))
    if gpu and profile_dir:
        row["profile"] = profile_step(step, row["name"], profile_dir)
    if gpu and memory_snapshot:
        from memory_snapshot import record_step

        row["memory_at_peak"] = record_step(step)
    row.update(
        step_s=round(step_s, 4), step_s_each=[round(t, 4) for t in times],
        tokens_per_s=round(batch * seq_len * row["accum"] / step_s),
        losses=[round(value, 5) for value in losses],
        offloaded_params=offloaded_params(model),
    )
    stepped = getattr(optimizer, "stepped_numel", None)  # OffloadOptimizer: host and streamed
    row["host_stepped_params"] = stepped["host"] if stepped is not None else row["offloaded_params"]
    if gpu:
        row.update(peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / GiB, 2),
                   peak_allocated_GiB=round(torch.cuda.max_memory_allocated() / GiB, 2))
    return row


def add_bounds(rows: list[dict], machine: dict) -> None:
    """Each row's bound and the share of it the row reaches, and its tokens/s over resident's."""
    def per_step(row):  # sequences per optimizer step: a row is set beside the resident row of as many
        return row.get("batch_size", 0) * row["accum"]

    resident = {per_step(r): r for r in rows if r["system"] == "resident" and "step_s" in r}
    link = machine.get("link_GBps", {})
    # Fused AdamW alone where it was measured so, else with the bf16 mirror cast.
    rate = machine.get("host_adamw_params_per_s") or machine.get("host_step_params_per_s")
    for row in rows:
        if "step_s" not in row or per_step(row) not in resident:
            continue
        base = resident[per_step(row)]
        terms = {"gpu": base["step_s"]}
        host_params = row.get("host_stepped_params")
        if host_params is None and row.get("offloaded_params"):
            # Where only the offloaded count is known: the plan's optimizer=F streams F of them.
            streamed = re.search(r"optimizer=([0-9.]+)", row.get("plan") or "")
            host_params = row["offloaded_params"] * (1 - float(streamed.group(1)) if streamed else 1)
        if rate and host_params:
            terms["host"] = host_params / rate
            if not row.get("early"):
                forwards = sorted(phases["forward"]["gpu_s"] for phases in base.get("phases", ()) if "forward" in phases)
                if forwards:  # the median step's forward, over its micro-batches
                    terms["after_step"] = base["step_s"] - forwards[len(forwards) // 2] / base["accum"] + terms["host"]
        if link and "h2d_GB" in row:
            terms["h2d"] = row["h2d_GB"] / link["h2d"]
            terms["d2h"] = row["d2h_GB"] / link["d2h"]
        row["bound_terms_s"] = {k: round(v, 3) for k, v in terms.items()}
        row["bound_s"] = round(max(terms.values()), 3)
        row["of_bound"] = round(row["bound_s"] / row["step_s"], 3)
        row["of_resident"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)


def print_table(rows: list[dict]) -> None:
    print(f"{'row':28s} {'step s':>7s} {'tok/s':>7s} {'peak GiB':>8s} {'bound s':>7s} {'of bound':>8s} "
          f"{'of res.':>7s} {'pred s':>6s} {'pred GiB':>8s}")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['name']:28s} {r.get('error', 'not run')[:90]}")
            continue
        pred_s, pred_gib = r.get("predicted_step_s"), r.get("predicted_peak_GiB")
        print(f"{r['name']:28s} {r['step_s']:7.3f} {r['tokens_per_s']:7d} {r.get('peak_reserved_GiB', 0):8.1f} "
              f"{r.get('bound_s', float('nan')):7.3f} {r.get('of_bound', float('nan')):8.2f} "
              f"{r.get('of_resident', float('nan')):7.2f} {pred_s if pred_s is not None else float('nan'):6.3f} "
              f"{pred_gib if pred_gib is not None else float('nan'):8.1f}")


def _prepare_child(args) -> int:
    """Write the model and measure the machine (link, host AdamW rate), in a process of its own."""
    import torch
    from torch_fsdp_offload.host_step import measure_host_step

    info = {"model": save_model(args.model_dir, args.tiny, args.layers), "versions": versions()}
    if torch.cuda.is_available():
        info["machine"] = describe_machine()
        rates = measure_host_step(1 << 26, link_busy=False)
        info["machine"]["host_step_params_per_s"] = round(1 / rates.alone_s_per_param)
        info["machine"]["host_adamw_params_per_s"] = round(1 / (rates.alone_s_per_param - rates.alone_cast_s_per_param))
    with open(args.row_out, "w", encoding="utf-8") as handle:
        json.dump(info, handle)
    return 0


def _row_child(args) -> int:
    try:
        row = run_one_row(args.one_row, args.model_dir, args.batch_size, args.seq_len, args.steps, args.warmup,
                          profile_dir=args.profile, memory_snapshot=args.memory_snapshot)
    except Exception as error:  # noqa: BLE001 (the row records what failed; the parent goes on)
        traceback.print_exc()
        row = failed_row(args.one_row, error_line(error))
    with open(args.row_out, "w", encoding="utf-8") as handle:
        json.dump(row, handle)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (system;cap=G;mb=B;accum=N;clip)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch (default 4, 2 with --tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048, 64 with --tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model-dir", default="/tmp/user_loop_model", help="where the model is written once")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (a CPU smoke run)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default the family's 36); "
                        "give a --model-dir of its own")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop starting rows after this long")
    parser.add_argument("--row-timeout", type=float, default=300.0)
    parser.add_argument("--min-row-seconds", type=float, default=90.0, help="start no row with less time left")
    parser.add_argument("--resume-from", default=None, help="keep the rows this file already holds")
    parser.add_argument("--out", default="benchmarks/results/user_loop.json")
    parser.add_argument("--profile", default=None, help="profile one more step of each row into this folder")
    parser.add_argument("--memory-snapshot", action="store_true", help="record the allocator over one more step")
    parser.add_argument("--one-row", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    if args.prepare:
        return _prepare_child(args)
    if args.one_row:
        return _row_child(args)
    names = [name for name in args.rows.split(",") if name]
    for name in names:
        try:
            parse_row(name)
        except ValueError as error:
            parser.error(str(error))
    deadline = time.monotonic() + (args.max_seconds if args.max_seconds is not None else float("inf"))
    runner = Runner(args, deadline, script=os.path.abspath(__file__))
    common = ["--model-dir", args.model_dir, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])
    common += ["--layers", str(args.layers)] if args.layers else []
    common += (["--profile", args.profile] if args.profile else []) + (["--memory-snapshot"] if args.memory_snapshot else [])
    result = {"rows": []}
    if args.resume_from and os.path.exists(args.resume_from):
        with open(args.resume_from, encoding="utf-8") as handle:
            result = json.load(handle)
    info, error = runner.child(["--prepare", *common], timeout=600)
    if info is None:
        print(f"preparing the model failed: {error}")
        return 1
    result.update(info, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup)
    done = {row["name"]: row for row in result["rows"] if "step_s" in row}
    for name in names:
        if name in done:
            continue
        if runner.remaining() < args.min_row_seconds:
            done[name] = failed_row(name, "not run: --max-seconds reached")
            continue
        t0 = time.monotonic()
        row, error = runner.child(["--one-row", name, *common], timeout=min(args.row_timeout, runner.remaining()))
        row = row or failed_row(name, error)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        done[name] = row
        print(f"{name}: {row.get('step_s', row.get('error'))} ({row['wall_s']} s)", flush=True)
        result["rows"] = list(done.values())
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    result["rows"] = list(done.values())
    add_bounds(result["rows"], result.get("machine", {}))
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print_table(result["rows"])
    return 0


if __name__ == "__main__":
    exit_skipping_teardown(main())
