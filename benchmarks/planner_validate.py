"""Validate the planner's FSDP2 step model against measured benchmark rows.

Reads the JSON written by ``benchmarks/fsdp_offload.py`` and ``benchmarks/activations.py``
(default: every ``*.json`` under ``benchmarks/results/`` except this script's own output),
predicts each row's configuration with :func:`torch_fsdp_offload.planner.predict_step`, and prints
predicted against measured step time and peak GPU memory (error %), then whether the setting the
planner would pick (fastest predicted that fits) is the measured fastest, per benchmark file and
micro-batch.

Calibration, as FlexGen fits its constants from short runs: each group's GPU-resident row gives
the forward, backward and GPU optimizer times and, through its peak memory, the activation bytes
per block; the link bandwidths are those measured in the benchmark run (``link_GBps``). The
resident row is therefore exact by construction and is marked ``calibration``, not counted in the
errors. Rows the step model does not describe (stock ``CPUOffloadPolicy``, ``save_on_cpu``) are
listed as skipped.

Row keys read (docs/planner.md, "Validation"): ``name``, ``batch_size``, ``step_s``,
``peak_gpu_GiB``, optional ``fwd_s``/``bwd_s``/``opt_s`` (resident rows), ``error`` (skipped),
and the configuration either as explicit keys (``module_fraction``, ``optimizer``,
``activations``, ``checkpointing``, ``prefetch_depth``, also inside a ``config`` object) or in
the name: ``resident``, ``resident+checkpoint``, ``coherent(depth=2,fraction=0.75,optimizer=host,
activations=0.5,checkpoint)``; ``act=`` and ``ckpt`` are accepted as short forms, and a ``;ac``
suffix (``resident;ac``, ``coherent(host;modules=0.625;ac)``) means every block checkpointed.

Usage::

    python benchmarks/planner_validate.py --out benchmarks/results/planner_validate.json
    python benchmarks/planner_validate.py benchmarks/results/fsdp_offload.json --model anchor-1.6b
    python benchmarks/planner_validate.py --offline FILES... --plot docs/img/planner_validate.png

Each file's host step comes from its own run (timed alone and with the link busy, the step model's
shared-DRAM inputs), as the GPU times come from its resident row. Besides the strict
check (the pick is the measured fastest), each pick is compared with the planner's decision rule
applied to the measured steps (``decide``, the planner's ``choose``: a plan that moves bytes must
beat the fastest plan that moves nothing by ``OFFLOAD_MARGIN``; within 2%, fewer bytes moved
wins), and, for rows measured in several
rounds (``--repeats``: ``step_s_rounds``), the measurement's own spread: where the pick's fastest
round is no slower than the best row's slowest (``measured_tie``), the runs cannot order the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from torch_fsdp_offload.planner import get_profile, predict_per_gpu, predict_step, TrainingConfig  # noqa: E402
from torch_fsdp_offload.host_step import host_GBps_from_link_busy, HostStepRates  # noqa: E402
from torch_fsdp_offload.planner.memory_breakdown import model_breakdown  # noqa: E402
from torch_fsdp_offload.planner.training_profile import training_profile  # noqa: E402
from torch_fsdp_offload.planner.search import choose  # noqa: E402

GiB = 1 << 30
TARGET_ERROR = 0.15
# A pick whose measured step is within this of the measured best agrees "within tolerance"
# (run-to-run noise of one step time is a few percent); the strict agreement is kept too.
AGREEMENT_TOLERANCE = 0.05
_OUTPUT_NAME = "planner_validate.json"
# CoherentOffload's prefetch_depth when a row (``default``) gives none.
_POLICY_DEFAULT_DEPTH = 1
# What a torn-down benchmark row may leave allocated before its measured peak is not its own.
_LEFTOVER_GiB = 0.25


def leftover_before(rows: list[dict], index: int, kind: str) -> str | None:
    """Why row ``index``'s measured peak may include memory the row before it left allocated, or None.

    benchmarks/fsdp_offload.py records ``allocated_after_teardown_GiB`` per row. For a file without
    it, a row whose OffloadOptimizer may still have run host steps (``next-fwd``) when it was torn
    down with GPU-resident groups (``modules=`` below 1) is taken to have left them allocated into
    the next row. Such rows are shown but not counted in the peak statistic.
    """
    if kind != "fsdp_offload" or index == 0:
        return None
    previous = rows[index - 1]
    left = previous.get("allocated_after_teardown_GiB")
    if left is not None:
        return f"the row before left {left:.2f} GiB allocated" if left > _LEFTOVER_GiB else None
    name = str(previous.get("name", ""))
    if "next-fwd" in name and "modules=" in name and "error" not in previous:
        return f"measured after {name}, whose teardown left its resident groups allocated"
    return None


def _value(row: dict, *keys, default=None):
    return next((row[k] for k in keys if k in row), default)


def row_config(row: dict, default_optimizer, default_depth: int = 1) -> TrainingConfig | None:
    """The TrainingConfig a benchmark row ran, or None when the step model does not describe it."""
    name = str(_value(row, "name", "row", default=""))
    explicit = dict(row.get("config") or {}) if isinstance(row.get("config"), dict) else {}
    explicit.update({k: row[k] for k in ("module_fraction", "optimizer", "activations", "checkpointing", "prefetch_depth") if k in row})
    if "stock" in name or "save_on_cpu" in name:
        return None
    knobs: dict = {}
    # "coherent(...)" rows offload parameter groups; "offload(...)" rows (activations.py) offload
    # the activations of a fraction of the blocks.
    fraction_knob = "activations" if name.startswith("offload") else "module_fraction"
    if name.startswith(("resident", "checkpoint")):
        knobs["module_fraction"] = 0.0
        if name == "checkpoint+offload":  # activations.py: the checkpoint inputs offloaded
            knobs["activations"] = 1.0
    elif name.startswith("offload"):
        knobs.update(module_fraction=0.0, activations=1.0)
    elif name.startswith("coherent") or explicit:
        knobs.update(module_fraction=1.0, optimizer=default_optimizer, prefetch_depth=default_depth)
    else:
        return None
    inside = re.search(r"\((.*)\)", name)
    for item in (re.split(r"[,;]", inside.group(1)) if inside else []):
        key, _, value = item.strip().partition("=")
        if key == "default":
            # CoherentOffload() and OffloadOptimizer's defaults: every group, optimizer="auto".
            knobs.update(module_fraction=1.0, optimizer=default_optimizer, prefetch_depth=_POLICY_DEFAULT_DEPTH)
        elif key == "early":
            knobs["step_during_backward"] = True
        elif key in ("clip", "user-clip"):
            knobs["clipping"] = True
        elif key == "depth":
            knobs["prefetch_depth"] = int(value)
        elif key == "fraction":
            knobs[fraction_knob] = float(value)
        elif key in ("modules", "last"):
            # "last=" rows give the policy per module to the last blocks; "modules=" rows to blocks
            # spread evenly (fully_shard_with_policy(spread_fraction=...)).
            knobs["module_fraction"] = float(value)
            knobs["block_placement"] = "last" if key == "last" else "spread"
        elif key in ("host", "stream"):
            knobs["optimizer"] = key
        elif key in ("optimizer", "split"):
            knobs["optimizer"] = value if value in ("host", "stream") else float(value)
        elif key in ("activations", "act"):
            knobs["activations"] = 1.0 if value in ("", "True", "true") else float(value)
        elif key in ("checkpoint", "ckpt", "ac"):
            knobs["checkpointing"] = True
        elif key == "keep":
            knobs["keep_unsharded"] = int(value)
        elif key == "cast":
            # CoherentOffload(cast_on=...): TrainingConfig refuses a value other than host / device.
            knobs["cast_on"] = value
    if "checkpoint" in name or "ckpt" in name or name.endswith(";ac"):
        knobs["checkpointing"] = True
    for key, value in explicit.items():
        if key == "activations" and isinstance(value, bool):
            value = 1.0 if value else 0.0
        if key == "optimizer" and value == "auto":
            value = default_optimizer
        knobs[key] = value
    return TrainingConfig(**knobs)


def auto_optimizer(kind: str) -> str | float:
    """What ``CoherentOffload(optimizer="auto")`` resolves to on ``kind``, asked of the policy
    itself: ``"host"``, ``"stream"`` or the streamed fraction (0.5 on a discrete GPU)."""
    try:
        from torch_fsdp_offload.platform import detect_platform
        from torch_fsdp_offload.policy import CoherentOffload

        resolved = CoherentOffload().resolve(detect_platform(kind=kind))
    except Exception as error:  # the policy module may be unavailable; "host" is its default
        print(f"note: could not resolve optimizer='auto' through the policy ({error}); assuming 'host'")
        return "host"
    # "device": nothing offloaded for the step (UNIFIED), i.e. the step runs on the GPU.
    if resolved.optimizer == "device":
        return "stream"
    return {0.0: "host", 1.0: "stream"}.get(resolved.optimizer_gpu_fraction, resolved.optimizer_gpu_fraction)


def _groups(data: dict, seq_len: int) -> list[tuple[str, int, int, list[dict]]]:
    # fsdp_offload.py: {"rows": [...]} with a batch_size per row; activations.py: {"configs":
    # [{"config", "batch_size", "seq_len", "rows": [...]}]}.
    groups: dict[tuple[str, int, int], list[dict]] = {}
    for row in data.get("rows", []):
        if isinstance(row, dict):
            groups.setdefault((f"bs {int(row.get('batch_size', 0))}", int(row.get("batch_size", 0)), seq_len), []).append(row)
    for config in data.get("configs", []):
        if isinstance(config, dict):
            key = (str(config.get("config", "")), int(config.get("batch_size", 0)), int(config.get("seq_len", seq_len)))
            groups.setdefault(key, []).extend(r for r in config.get("rows", []) if isinstance(r, dict))
    return [(label, batch, seq, rows) for (label, batch, seq), rows in groups.items()]


def _measured_platform(data: dict, base):
    link = data.get("link_GBps") or data.get("bandwidth") or {}
    if not isinstance(link, dict) or not link:
        return base
    return dataclasses.replace(
        base,
        name=f"{base.name} (link measured in the run)",
        h2d_GBps=float(_value(link, "h2d_GBps", "h2d_gbps", default=base.h2d_GBps)),
        d2h_GBps=float(_value(link, "d2h_GBps", "d2h_gbps", default=base.d2h_GBps)),
        bidirectional_GBps=float(
            _value(link, "both_GBps", "bidirectional_GBps", "bidirectional_gbps", default=base.bidirectional_GBps)
        ),
    )


def _long_enough(model: str, seq_len: int):
    """The built-in config with ``max_seq_len`` raised to the run's (long-context rows train the
    same weights at 8192 tokens)."""
    from torch_fsdp_offload.models import MODEL_CONFIGS

    config = MODEL_CONFIGS.get(model)
    if config is None or seq_len <= config.max_seq_len:
        return model
    return dataclasses.replace(config, max_seq_len=seq_len)


def host_step_rates(data: dict) -> HostStepRates | None:
    """The host step (fused AdamW plus the bf16 cast) per parameter as the run measured it, alone and
    while both link directions copied (``host_optimizer_measured`` and its ``link_busy``), with the
    cast's part of each (what ``cast=device`` rows do not pay on the host), as
    ``measure_host_step`` measures it for ``plan``; None when the run did not measure both."""
    alone = data.get("host_optimizer_measured") or {}
    busy = alone.get("link_busy")
    if not isinstance(busy, dict):
        return None
    return HostStepRates(
        alone_s_per_param=(float(alone["adamw_s_per_Gparam"]) + float(alone["cast_s_per_Gparam"])) / 1e9,
        link_busy_s_per_param=(float(busy["adamw_s_per_Gparam"]) + float(busy["cast_s_per_Gparam"])) / 1e9,
        link_GBps_meanwhile=float(busy["link_GBps_meanwhile"]),
        alone_cast_s_per_param=float(alone["cast_s_per_Gparam"]) / 1e9,
        link_busy_cast_s_per_param=float(busy["cast_s_per_Gparam"]) / 1e9,
    )


def in_situ_host_s_per_param(row: dict, config: TrainingConfig, profile) -> float | None:
    """The row's own host step rate: its measured ``host_optimizer_s`` (the host steps' time in
    the step, gradient waits included) over the parameters it steps on the host. Those are counted
    as ``OffloadOptimizer`` places them (whole groups), not from the row's ``host_stepped_params``
    (the benchmark's ``offloaded * (1 - split)``, which splits a group)."""
    host_s = float(row.get("host_optimizer_s") or 0.0)
    offloaded = round(config.module_fraction * profile.n_blocks)
    host_blocks = offloaded - round(config.optimizer_gpu_fraction * offloaded)
    if host_s <= 0 or host_blocks <= 0:
        return None
    return host_s / (host_blocks * profile.block_params)


def calibrated_profile(
    model: str, batch_size: int, seq_len: int, resident: dict, platform, *, host_GBps, plain_bf16: bool, host_rates=None
):
    """The step model's input for one micro-batch, calibrated on the group's resident row.

    Sizes (parameters, activation bytes per block) come from the model's meta-device breakdown;
    the resident row gives the forward, backward and GPU optimizer times and, as ``fixed_bytes``,
    what its measured peak holds beyond the predicted one (workspaces, allocator state).
    """
    breakdown = model_breakdown(_long_enough(model, seq_len), batch_size=batch_size, seq_len=seq_len)
    profile = training_profile(breakdown, platform, host_GBps=host_GBps, host_rates=host_rates)
    # activations.py trains a plain (unsharded) module with bf16 weights, grads and AdamW state.
    state_bytes = {"param_bytes": 2, "reduce_bytes": 2, "optimizer_state_bytes": 4} if plain_bf16 else {}
    profile = dataclasses.replace(
        profile,
        forward_s=float(_value(resident, "fwd_s", "forward_s", default=profile.forward_s)),
        backward_s=float(_value(resident, "bwd_s", "backward_s", default=profile.backward_s)),
        gpu_optimizer_s=float(_value(resident, "opt_s", "optimizer_s", default=profile.gpu_optimizer_s)),
        source="sizes from the meta-device breakdown, times and fixed memory from the resident row",
        **state_bytes,
    )
    predicted = predict_step(profile, TrainingConfig(), platform).peak_gpu_bytes
    measured = float(_value(resident, "peak_gpu_GiB", "peak_gib")) * GiB
    return dataclasses.replace(profile, fixed_bytes=int(measured - predicted))


def validate_multi_gpu(path: str, data: dict, args) -> dict:
    """``benchmarks/multi_gpu.py`` rows: measured per-GPU step and peak against ``predict_per_gpu``
    (analytic times, no calibration) with the run's link."""
    links = data.get("link_GBps") or [{}]
    link = {key: min(float(entry[key]) for entry in links) for key in ("h2d_GBps", "d2h_GBps", "both_GBps") if key in links[0]}
    platform = _measured_platform({"link_GBps": link}, get_profile(args.platform))
    world_size = int(data.get("world_size", 2))
    rows = []
    for name, measured_rows in data.get("rows", {}).items():
        if "stock" in name:
            continue
        offload = TrainingConfig(module_fraction=1.0, prefetch_depth=2) if name.startswith("coherent") else False
        for row in measured_rows:
            batch_size = int(row["batch_size"])
            predicted = predict_per_gpu(data["model"], world_size=world_size, batch_size=batch_size, seq_len=int(data["seq_len"]),
                                        offload=offload, platform=platform)
            entry = {"row": name, "batch_size": batch_size, "predicted_step_s": predicted["step_s"],
                     "predicted_tokens_per_s_per_gpu": predicted["tokens_per_s_per_gpu"],
                     "predicted_peak_GiB": predicted["peak_gpu_GiB"]}
            if "skipped" in row:
                entry["measured"] = row["skipped"]
            else:
                entry.update(measured_step_s=row["step_s"], measured_tokens_per_s_per_gpu=row["tokens_per_s_per_gpu"],
                             measured_peak_GiB=row["peak_gpu_GiB"], step_error=predicted["step_s"] / row["step_s"] - 1.0,
                             peak_error=predicted["peak_gpu_GiB"] / row["peak_gpu_GiB"] - 1.0)
            rows.append(entry)
    return {"file": path, "model": data["model"], "world_size": world_size, "platform": dataclasses.asdict(platform), "rows": rows}


def print_multi_gpu(validated: dict) -> None:
    print(f"{validated['model']} on {validated['world_size']} GPUs, per GPU (predict_per_gpu, not calibrated)")
    print("| row | bs | step pred s | meas s | err | tok/s/GPU pred | meas | peak pred GiB | meas GiB | err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in validated["rows"]:
        if "measured_step_s" not in r:
            print(f"| {r['row']} | {r['batch_size']} | {r['predicted_step_s']:.3f} | | | {r['predicted_tokens_per_s_per_gpu']:.0f} | "
                  f"| {r['predicted_peak_GiB']:.1f} | {r['measured']} | |")
            continue
        print(f"| {r['row']} | {r['batch_size']} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | {r['step_error']:+.0%} | "
              f"{r['predicted_tokens_per_s_per_gpu']:.0f} | {r['measured_tokens_per_s_per_gpu']:.0f} | "
              f"{r['predicted_peak_GiB']:.1f} | {r['measured_peak_GiB']:.1f} | {r['peak_error']:+.0%} |")
    print()


def validate_file(path: str, args) -> dict | None:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        # A bare list of rows has no link and no resident row to calibrate from.
        raise ValueError(f"a JSON {type(data).__name__}, not a benchmark's result object")
    kind = str(data.get("benchmark", ""))
    if kind == "multi_gpu":
        return validate_multi_gpu(path, data, args)
    if kind and not kind.startswith(("fsdp_offload", "activations")):
        return None  # transfer.py and others: no training rows
    model = str(data.get("model", args.model)).split(" ")[0]
    seq_len = int(data.get("seq_len", args.seq_len))
    platform = _measured_platform(data, get_profile(args.platform))
    default_optimizer = auto_optimizer(platform.kind)
    # benchmarks/fsdp_offload.py runs every CoherentOffload row at prefetch_depth=2.
    default_depth = 1 if kind == "activations" else 2
    # The host step's speed alone and beside the link's DMA differs between machines and runs
    # (0.29-0.44 and 0.44-0.70 ns per parameter on our H200s): like the GPU times from the
    # resident row, it comes from the run's own measurement, as `plan` measures it
    # (measure_host_step), unless --measure-host measured this machine's for every file or
    # --host-GBps fixes a bandwidth instead.
    rates = None if args.host_GBps else (args.host_rates or host_step_rates(data))
    if rates is not None and rates.link_busy_s_per_param is None:
        rates = None  # measured here without a link to keep busy: the bandwidth model
    busy_rate = None if rates is None else rates.link_busy_s_per_param
    host_GBps = args.host_GBps or (host_GBps_from_link_busy(busy_rate) if busy_rate else None)
    results = []
    agreements = []
    run_position = {id(row): position for position, row in enumerate(data.get("rows", []))}
    for label, batch_size, seq_len, group in sorted(_groups(data, seq_len), key=lambda g: (g[1], g[0])):
        resident = next(
            (r for r in group if _value(r, "name", "row") == "resident" and "error" not in r), None
        )
        if resident is None:
            print(f"{path}: {label}: no resident row to calibrate from; skipped")
            continue
        profile = calibrated_profile(
            model, batch_size, seq_len, resident, platform, host_GBps=host_GBps, plain_bf16=kind == "activations",
            host_rates=rates,
        )
        predicted = []
        for row in group:
            entry = {"file": os.path.basename(path), "group": label, "name": _value(row, "name", "row"), "batch_size": batch_size,
                     "tokens": batch_size * seq_len}
            if "error" in row:
                entry["skipped"] = f"benchmark error: {row['error']}"
                results.append(entry)
                continue
            if row.get("micro_batches", 1) > 1:
                entry["skipped"] = "accumulates several micro-batches a step: the step model prices one"
                results.append(entry)
                continue
            config = row_config(row, default_optimizer, default_depth)
            if config is None:
                entry["skipped"] = "not a configuration the step model describes"
                results.append(entry)
                continue
            prediction = predict_step(profile, config, platform)
            in_situ = in_situ_host_s_per_param(row, config, profile)
            # The whole host step at the link-busy rate, for comparison.
            link_busy = (
                predict_step(dataclasses.replace(profile, host_step_s_per_param=busy_rate, host_alone_s_per_param=None), config, platform)
                if busy_rate else prediction
            )
            measured_peak = float(_value(row, "peak_gpu_GiB", "peak_gib"))
            entry.update(
                config=config.label,
                measured_step_s=float(row["step_s"]),
                predicted_step_s=prediction.step_s,
                step_error=prediction.step_s / float(row["step_s"]) - 1.0,
                predicted_host_s=prediction.host_optimizer_s,
                host_s_per_Gparam_in_situ=None if in_situ is None else in_situ * 1e9,
                step_error_link_busy_host_rate=link_busy.step_s / float(row["step_s"]) - 1.0,
                measured_peak_GiB=measured_peak,
                predicted_peak_GiB=prediction.peak_gpu_GiB,
                peak_error=prediction.peak_gpu_GiB / measured_peak - 1.0,
                calibration=row is resident,
                moved_bytes=prediction.h2d_bytes + prediction.d2h_bytes,
                checkpointing=config.checkpointing,
                clipping=config.clipping,
                breaks_contract=config.breaks_contract,
                measured_step_s_rounds=row.get("step_s_rounds"),
            )
            if id(row) in run_position:
                leftover = leftover_before(data["rows"], run_position[id(row)], kind)
                if leftover is not None:
                    entry["peak_not_counted"] = leftover
            results.append(entry)
            predicted.append(entry)
        capacity = args.gpu_memory_GiB * GiB
        # A loop that clips picks among clipped settings only: each clipping mode is its own pool.
        for clipping, rows in _by_clipping(predicted):
            pools = {}
            for scope, pool in (("all rows", rows), ("without resident", [e for e in rows if not e["calibration"]])):
                pools.setdefault(tuple(map(id, pool)), (scope, pool))
            for scope, pool in pools.values():
                pool_fit = [e for e in pool if e["predicted_peak_GiB"] * GiB <= capacity]
                if _a_choice(pool) and pool_fit:
                    agreements.append(agreement(os.path.basename(path), label, batch_size, scope + clipping, pool, pool_fit))
    # The planner's question when the resident run does not fit: a GPU budget of half the resident
    # peak at the file's smallest micro-batch (the half-memory target), any micro-batch
    # the file measured, ranked by tokens per second.
    measured = [e for e in results if "predicted_step_s" in e]
    smallest = min((e for e in measured if e["calibration"]), key=lambda e: e["tokens"], default=None)
    if smallest is not None:
        budget = smallest["measured_peak_GiB"] / 2
        for clipping, rows in _by_clipping(measured):
            pool = [e for e in rows if e["measured_peak_GiB"] <= budget]
            pool_fit = [e for e in rows if e["predicted_peak_GiB"] <= budget]
            if _a_choice(pool) and pool_fit:
                agreements.append(agreement(
                    os.path.basename(path), "any micro-batch", None, f"budget {budget:.1f} GiB{clipping}", pool, pool_fit))
    return {"file": path, "model": model, "seq_len": seq_len, "platform": dataclasses.asdict(platform),
            "host_GBps": host_GBps or platform.host_GBps,
            "host_step_ns_per_param": None if rates is None else {
                "alone": rates.alone_s_per_param * 1e9, "link_busy": rates.link_busy_s_per_param * 1e9,
                "link_GBps_meanwhile": rates.link_GBps_meanwhile},
            "rows": results, "agreements": agreements}


def _by_clipping(entries: list[dict]) -> list[tuple[str, list[dict]]]:
    """``entries`` split by whether their loop clips: ``("", unclipped)`` and ``(", clipped", ...)``,
    each where there are such rows."""
    split = [("", [e for e in entries if not e["clipping"]]), (", clipped", [e for e in entries if e["clipping"]])]
    return [(suffix, rows) for suffix, rows in split if rows]


def _a_choice(pool: list[dict]) -> bool:
    """Whether ``pool`` holds two settings to choose between (rows of one setting, such as ``clip``
    and ``user-clip``, differ by noise only)."""
    return len({(e["config"], e["batch_size"]) for e in pool}) >= 2


def agreement(file: str, group: str, batch_size: int | None, scope: str, pool: list[dict], pool_fit: list[dict]) -> dict:
    """The planner's pick among ``pool_fit`` (the rows predicted to fit) against the measured best
    of ``pool`` (the rows measured to fit), both by tokens per second."""
    chosen = decide(pool_fit, "predicted_step_s")
    best = max(pool, key=lambda e: _rate(e, "measured_step_s"))
    # The same decision taken on the measured steps: what a user reading the measured table would
    # run under the planner's rule.
    measured_choice = decide(pool, "measured_step_s")
    pairs = [(a, b) for i, a in enumerate(pool) for b in pool[i + 1 :]]
    same_order = sum(
        (_rate(a, "predicted_step_s") > _rate(b, "predicted_step_s")) == (_rate(a, "measured_step_s") > _rate(b, "measured_step_s"))
        for a, b in pairs
    )
    # How much slower per token the pick ran than the best (1.0: it is the best).
    pick_over_best = _rate(best, "measured_step_s") / _rate(chosen, "measured_step_s")
    return {
        "file": file,
        "group": group,
        "batch_size": batch_size,
        "scope": scope,
        "planner_pick": chosen["name"] + ("" if batch_size else f" (bs {chosen['batch_size']})"),
        "measured_best": best["name"] + ("" if batch_size else f" (bs {best['batch_size']})"),
        "agree": chosen is best,
        "agree_or_measured_tie": chosen is best or measured_tie(chosen, best),
        "measured_choice": measured_choice["name"] + ("" if batch_size else f" (bs {measured_choice['batch_size']})"),
        "agree_same_rule": chosen is measured_choice,
        "pick_over_best": pick_over_best,
        "agree_within_tolerance": pick_over_best <= 1 + AGREEMENT_TOLERANCE,
        "pairwise_order_agreement": same_order / len(pairs),
    }


def _rate(entry: dict, step_key: str) -> float:
    """Tokens per second (steps per second for an entry without ``tokens``)."""
    return entry.get("tokens", 1) / entry[step_key]


def measured_tie(pick: dict, best: dict) -> bool:
    """Whether the rounds of two rows measured with ``--repeats`` cannot order them: the pick's
    fastest round was no slower per token than the best row's slowest. False without rounds for
    both."""
    pick_rounds, best_rounds = pick.get("measured_step_s_rounds"), best.get("measured_step_s_rounds")
    if not pick_rounds or not best_rounds:
        return False
    return min(pick_rounds) / pick.get("tokens", 1) <= max(best_rounds) / best.get("tokens", 1)


def decide(entries: list[dict], step_key: str) -> dict:
    """The planner's decision rule (:func:`~torch_fsdp_offload.planner.search.choose`, as
    ``search_training`` applies it) over ``entries`` by ``step_key``: the most tokens per second
    among the rows that pay (a row that moves bytes must beat the fastest row that moves nothing
    by ``OFFLOAD_MARGIN``); within 2% of it, the row that moves the fewest bytes (as predicted),
    then the one without checkpointing; a row that breaks torch.optim's contract (``early``) must
    beat the fastest that keeps it by ``OFFLOAD_MARGIN``."""
    return choose(entries, throughput=lambda e: _rate(e, step_key), bytes_moved=lambda e: e["moved_bytes"],
                  checkpointing=lambda e: e.get("checkpointing", False),
                  breaks_contract=lambda e: e.get("breaks_contract", False))


def summarize(files: list[dict]) -> dict:
    counted = [r for f in files for r in f["rows"] if "predicted_step_s" in r and not r["calibration"]]
    agreements = [a for f in files for a in f["agreements"]]
    peak_counted = [r for r in counted if "peak_not_counted" not in r]

    def share(values):
        return sum(values) / len(values) if values else None

    return {
        "rows_predicted": len(counted),
        "step_within_target": share([abs(r["step_error"]) <= TARGET_ERROR for r in counted]),
        # The same with the host step at the run's measured link-busy rate (not the default).
        "step_within_target_link_busy_host_rate": share(
            [abs(r["step_error_link_busy_host_rate"]) <= TARGET_ERROR for r in counted]),
        "peak_within_target": share([abs(r["peak_error"]) <= TARGET_ERROR for r in peak_counted]),
        "peak_rows_not_counted": len(counted) - len(peak_counted),
        "peak_within_target_every_row": share([abs(r["peak_error"]) <= TARGET_ERROR for r in counted]),
        "mean_abs_step_error": share([abs(r["step_error"]) for r in counted]),
        "mean_abs_peak_error": share([abs(r["peak_error"]) for r in peak_counted]),
        "recommendation_agreement": share([a["agree"] for a in agreements]),
        "recommendation_agreement_within_tolerance": share([a["agree_within_tolerance"] for a in agreements]),
        # The pick is the measured fastest, or the rounds of both rows overlap (measured_tie).
        "recommendation_agreement_or_measured_tie": share([a["agree_or_measured_tie"] for a in agreements]),
        # The pick against the same rule applied to the measured steps (see decide()).
        "recommendation_agreement_same_rule": share([a["agree_same_rule"] for a in agreements]),
        "agreement_tolerance": AGREEMENT_TOLERANCE,
        "target_error": TARGET_ERROR,
        "target_agreement": 0.9,
    }


def print_table(files: list[dict], summary: dict) -> None:
    """Markdown: the rows (docs/planner.md's validation table), then the picks and the summary."""
    print("| file | group | row | config | step pred s | meas s | err | peak pred GiB | meas GiB | err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in files:
        for r in f["rows"]:
            if "skipped" in r:
                print(f"| {r['file']} | {r['group']} | {r['name']} | skipped: {r['skipped']} | | | | | | |")
                continue
            mark = " (calibration)" if r["calibration"] else ""
            peak_mark = " (not counted: after a leftover)" if "peak_not_counted" in r else ""
            print(
                f"| {r['file']} | {r['group']} | {r['name']}{mark} | {r['config']} | {r['predicted_step_s']:.3f} | "
                f"{r['measured_step_s']:.3f} | {r['step_error']:+.0%} | {r['predicted_peak_GiB']:.1f} | "
                f"{r['measured_peak_GiB']:.1f} | {r['peak_error']:+.0%}{peak_mark} |"
            )
    print()
    print("| file | group | scope | planner picks | measured best | agree | or rounds tie | within 5% "
          "| pick's measured step / best | same rule on measured | agree |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f in files:
        for a in f["agreements"]:
            print(
                f"| {a['file']} | {a['group']} | {a['scope']} | {a['planner_pick']} | {a['measured_best']} | "
                f"{'yes' if a['agree'] else 'NO'} | {'yes' if a['agree_or_measured_tie'] else 'NO'} | "
                f"{'yes' if a['agree_within_tolerance'] else 'NO'} | {a['pick_over_best']:.3f} "
                f"| {a['measured_choice']} | {'yes' if a['agree_same_rule'] else 'NO'} |"
            )
    print()
    print("| file | host step ns/param alone | with the link busy | link GB/s meanwhile |")
    print("|---|---|---|---|")
    for f in files:
        rates = f.get("host_step_ns_per_param")
        if rates:
            print(f"| {os.path.basename(f['file'])} | {rates['alone']:.3f} | {rates['link_busy']:.3f} | {rates['link_GBps_meanwhile']:.0f} |")
        else:
            print(f"| {os.path.basename(f['file'])} | host bandwidth {f['host_GBps']:.0f} GB/s | | |")
    print()
    print(json.dumps(summary, indent=1))


def plot_validation(files: list[dict], path: str) -> str:
    """Predicted against measured step time and peak memory of every counted row, with the +-15%
    band of the target; calibration rows are left out (exact by construction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = [r for f in files for r in f["rows"] if "predicted_step_s" in r and not r["calibration"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (what, unit) in zip(axes, (("step", "s"), ("peak", "GiB"))):
        key = "step_s" if what == "step" else "peak_GiB"
        for source in sorted({r["file"] for r in counted}):
            rows = [r for r in counted if r["file"] == source]
            ax.scatter([r[f"measured_{key}"] for r in rows], [r[f"predicted_{key}"] for r in rows], s=30, label=source)
        top = max(max(r[f"measured_{key}"], r[f"predicted_{key}"]) for r in counted) * 1.05
        line = [0.0, top]
        ax.plot(line, line, color="black", linewidth=1)
        for factor in (1 - TARGET_ERROR, 1 + TARGET_ERROR):
            ax.plot(line, [factor * x for x in line], color="grey", linestyle="--", linewidth=1)
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel(f"measured {what} ({unit})")
        ax.set_ylabel(f"predicted {what} ({unit})")
        ax.set_title(f"{what}: {sum(abs(r[what + '_error']) <= TARGET_ERROR for r in counted)} of {len(counted)} "
                     f"within {TARGET_ERROR:.0%} (dashed)", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("Planner step model against measured rows (benchmarks/planner_validate.py)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", help="benchmark JSON files (default: benchmarks/results/*.json)")
    parser.add_argument("--from-json", nargs="+", default=[], metavar="JSON",
                        help="benchmark JSON files written by fsdp_offload.py / activations.py (same as positional)")
    parser.add_argument("--offline", action="store_true",
                        help="validate committed JSON on a machine without a GPU: measure nothing here")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", _OUTPUT_NAME))
    parser.add_argument("--model", default="anchor-1.6b", help="model when a file does not name one")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length when a file does not give one")
    parser.add_argument("--platform", default="h200-pcie", help="profile for what the run did not measure")
    parser.add_argument("--gpu-memory-GiB", type=float, default=139.8, help="GPU memory the picks must fit in")
    parser.add_argument("--host-GBps", type=float, default=None,
                        help="host optimizer bandwidth, GB/s, for every file (the bandwidth model instead of each "
                        "file's measured host step)")
    parser.add_argument("--measure-host", action="store_true",
                        help="time the host optimizer step on this machine, alone and with the link busy, as plan "
                        "does, and use it for every file")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw predicted against measured step time and peak memory (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'torch-fsdp-offload[plot]' (or matplotlib)")
    if args.measure_host and args.offline:
        parser.error("--measure-host measures this machine; --offline validates without measuring: pick one")
    if args.measure_host and args.host_GBps:
        parser.error("--measure-host measures the host step; --host-GBps fixes a bandwidth instead: pick one")
    args.host_rates = None
    if args.measure_host:
        from torch_fsdp_offload.host_step import measure_host_step

        args.host_rates = measure_host_step()
        print(f"host optimizer step measured here: {args.host_rates}")
    paths = [*args.results, *args.from_json] or sorted(
        p for p in glob.glob(os.path.join("benchmarks", "results", "*.json")) if os.path.basename(p) != _OUTPUT_NAME
    )
    if not paths:
        print("no benchmark results found: run benchmarks/fsdp_offload.py and benchmarks/activations.py first", file=sys.stderr)
        return 2
    files, multi_gpu = [], []
    for path in paths:
        try:
            validated = validate_file(path, args)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            print(f"{path}: cannot validate ({type(error).__name__}: {error}); skipped", file=sys.stderr)
            continue
        if validated is None:
            continue
        if "world_size" in validated:
            multi_gpu.append(validated)
        else:
            files.append(validated)
    summary = summarize(files)
    print_table(files, summary)
    for validated in multi_gpu:
        print_multi_gpu(validated)
    output = {
        "benchmark": "planner_validate",
        "torch": torch.__version__,
        "gpu": None if args.offline or not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "platform_profile": args.platform,
        "host_GBps": args.host_GBps or get_profile(args.platform).host_GBps,
        "host_step_measured_here": None if args.host_rates is None else dataclasses.asdict(args.host_rates),
        "files": files,
        "multi_gpu": multi_gpu,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(output, handle, indent=1)
    if args.plot:
        print(plot_validation(files, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
