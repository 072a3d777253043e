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
activations=0.5,checkpoint)``; ``act=`` and ``ckpt`` are accepted as short forms.

Usage::

    python benchmarks/planner_validate.py --out benchmarks/results/planner_validate.json
    python benchmarks/planner_validate.py benchmarks/results/fsdp_offload.json --model anchor-1.6b
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

from torch_fsdp_offload.planner import get_profile, predict_step, TrainingConfig  # noqa: E402
from torch_fsdp_offload.planner.profile import model_breakdown, training_profile  # noqa: E402

GiB = 1 << 30
TARGET_ERROR = 0.15
_OUTPUT_NAME = "planner_validate.json"


def _value(row: dict, *keys, default=None):
    return next((row[k] for k in keys if k in row), default)


def row_config(row: dict, default_optimizer) -> TrainingConfig | None:
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
    elif name.startswith("offload"):
        knobs.update(module_fraction=0.0, activations=1.0)
    elif name.startswith("coherent") or explicit:
        knobs["module_fraction"] = 1.0
        knobs["optimizer"] = default_optimizer
    else:
        return None
    inside = re.search(r"\((.*)\)", name)
    for item in (inside.group(1).split(",") if inside else []):
        key, _, value = item.strip().partition("=")
        if key == "depth":
            knobs["prefetch_depth"] = int(value)
        elif key == "fraction":
            knobs[fraction_knob] = float(value)
        elif key == "optimizer":
            knobs["optimizer"] = value if value in ("host", "stream") else float(value)
        elif key in ("activations", "act"):
            knobs["activations"] = 1.0 if value in ("", "True", "true") else float(value)
        elif key in ("checkpoint", "ckpt"):
            knobs["checkpointing"] = True
    if "checkpoint" in name or "ckpt" in name:
        knobs["checkpointing"] = True
    for key, value in explicit.items():
        if key == "activations" and isinstance(value, bool):
            value = 1.0 if value else 0.0
        if key == "optimizer" and value == "auto":
            value = default_optimizer
        knobs[key] = value
    return TrainingConfig(**knobs)


def auto_optimizer(kind: str) -> str:
    """What ``CoherentOffload(optimizer="auto")`` resolves to on ``kind``, asked of the policy itself."""
    try:
        from torch_fsdp_offload.platform import detect_platform
        from torch_fsdp_offload.policy import CoherentOffload

        resolved = CoherentOffload().resolve(detect_platform(kind=kind)).optimizer
    except Exception as error:  # the policy module may be unavailable; "host" is its default
        print(f"note: could not resolve optimizer='auto' through the policy ({error}); assuming 'host'")
        return "host"
    # "device": nothing offloaded for the step (UNIFIED), i.e. the step runs on the GPU.
    return "host" if resolved == "host" else "stream"


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


def validate_file(path: str, args) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    model = str(data.get("model", args.model)).split(" ")[0]
    seq_len = int(data.get("seq_len", args.seq_len))
    platform = get_profile(args.platform)
    link = data.get("link_GBps") or data.get("bandwidth") or {}
    if isinstance(link, dict) and link:
        platform = dataclasses.replace(
            platform,
            name=f"{platform.name} (link measured in the run)",
            h2d_GBps=float(_value(link, "h2d_GBps", "h2d_gbps", default=platform.h2d_GBps)),
            d2h_GBps=float(_value(link, "d2h_GBps", "d2h_gbps", default=platform.d2h_GBps)),
            bidirectional_GBps=float(
                _value(link, "both_GBps", "bidirectional_GBps", "bidirectional_gbps", default=platform.bidirectional_GBps)
            ),
        )
    # activations.py trains a plain (unsharded) module with bf16 weights, grads and AdamW state.
    state_bytes = (
        {"param_bytes": 2, "reduce_bytes": 2, "optimizer_state_bytes": 4}
        if data.get("benchmark") == "activations"
        else {}
    )
    default_optimizer = auto_optimizer(platform.kind)
    results = []
    agreements = []
    for label, batch_size, seq_len, group in sorted(_groups(data, seq_len), key=lambda g: (g[1], g[0])):
        resident = next(
            (r for r in group if _value(r, "name", "row") == "resident" and "error" not in r), None
        )
        if resident is None:
            print(f"{path}: {label}: no resident row to calibrate from; skipped")
            continue
        breakdown = model_breakdown(model, batch_size=batch_size, seq_len=seq_len)
        profile = training_profile(breakdown, platform, host_adamw_s_per_gparam=args.host_adamw_s_per_gparam)
        profile = dataclasses.replace(
            profile,
            forward_s=float(_value(resident, "fwd_s", "forward_s", default=profile.forward_s)),
            backward_s=float(_value(resident, "bwd_s", "backward_s", default=profile.backward_s)),
            gpu_optimizer_s=float(_value(resident, "opt_s", "optimizer_s", default=profile.gpu_optimizer_s)),
            source="calibrated on the resident row",
            **state_bytes,
        )
        # Activation bytes per block: what the resident peak leaves after everything else.
        empty = predict_step(dataclasses.replace(profile, block_activation_bytes=0, other_activation_bytes=0), TrainingConfig(), platform)
        measured_peak = float(_value(resident, "peak_gpu_GiB", "peak_gib")) * GiB
        per_block = max(0.0, (measured_peak - empty.peak_gpu_bytes) / profile.n_blocks)
        profile = dataclasses.replace(profile, block_activation_bytes=int(per_block), other_activation_bytes=0)
        predicted = []
        for row in group:
            entry = {"file": os.path.basename(path), "group": label, "name": _value(row, "name", "row"), "batch_size": batch_size}
            if "error" in row:
                entry["skipped"] = f"benchmark error: {row['error']}"
                results.append(entry)
                continue
            config = row_config(row, default_optimizer)
            if config is None:
                entry["skipped"] = "not a CoherentOffload configuration"
                results.append(entry)
                continue
            prediction = predict_step(profile, config, platform)
            measured_peak = float(_value(row, "peak_gpu_GiB", "peak_gib"))
            entry.update(
                config=config.label,
                measured_step_s=float(row["step_s"]),
                predicted_step_s=prediction.step_s,
                step_error=prediction.step_s / float(row["step_s"]) - 1.0,
                measured_peak_GiB=measured_peak,
                predicted_peak_GiB=prediction.peak_gpu_GiB,
                peak_error=prediction.peak_gpu_GiB / measured_peak - 1.0,
                calibration=row is resident,
            )
            results.append(entry)
            predicted.append(entry)
        predicted_resident = next((e for e in predicted if e["calibration"]), None)
        capacity = args.gpu_memory_GiB * GiB
        fitting = [e for e in predicted if e["predicted_peak_GiB"] * GiB <= capacity]
        for scope, pool in (("all rows", predicted), ("without resident", [e for e in predicted if e is not predicted_resident])):
            pool_fit = [e for e in pool if e in fitting]
            if len(pool) < 2 or not pool_fit:
                continue
            chosen = min(pool_fit, key=lambda e: e["predicted_step_s"])
            best = min(pool, key=lambda e: e["measured_step_s"])
            pairs = [(a, b) for i, a in enumerate(pool) for b in pool[i + 1 :]]
            same_order = sum(
                (a["predicted_step_s"] < b["predicted_step_s"]) == (a["measured_step_s"] < b["measured_step_s"]) for a, b in pairs
            )
            agreements.append(
                {
                    "file": os.path.basename(path),
                    "group": label,
                    "batch_size": batch_size,
                    "scope": scope,
                    "planner_pick": chosen["name"],
                    "measured_best": best["name"],
                    "agree": chosen["name"] == best["name"],
                    "pairwise_order_agreement": same_order / len(pairs),
                }
            )
    return {"file": path, "model": model, "seq_len": seq_len, "rows": results, "agreements": agreements}


def summarize(files: list[dict]) -> dict:
    counted = [r for f in files for r in f["rows"] if "predicted_step_s" in r and not r["calibration"]]
    agreements = [a for f in files for a in f["agreements"]]

    def share(values):
        return sum(values) / len(values) if values else None

    return {
        "rows_predicted": len(counted),
        "step_within_target": share([abs(r["step_error"]) <= TARGET_ERROR for r in counted]),
        "peak_within_target": share([abs(r["peak_error"]) <= TARGET_ERROR for r in counted]),
        "mean_abs_step_error": share([abs(r["step_error"]) for r in counted]),
        "mean_abs_peak_error": share([abs(r["peak_error"]) for r in counted]),
        "recommendation_agreement": share([a["agree"] for a in agreements]),
        "target_error": TARGET_ERROR,
        "target_agreement": 0.9,
    }


def print_table(files: list[dict], summary: dict) -> None:
    print(f"{'file':24s} {'row':38s} {'bs':>3s} {'step pred':>9s} {'meas':>7s} {'err':>6s} {'peak pred':>9s} {'meas':>6s} {'err':>6s}")
    for f in files:
        for r in f["rows"]:
            if "skipped" in r:
                print(f"{r['file'][:24]:24s} {str(r['name'])[:38]:38s} {r['batch_size']:>3d} skipped: {r['skipped']}")
                continue
            mark = " (calibration)" if r["calibration"] else ""
            print(
                f"{r['file'][:24]:24s} {str(r['name'])[:38]:38s} {r['batch_size']:>3d} {r['predicted_step_s']:9.3f} "
                f"{r['measured_step_s']:7.3f} {r['step_error']:+6.0%} {r['predicted_peak_GiB']:9.1f} "
                f"{r['measured_peak_GiB']:6.1f} {r['peak_error']:+6.0%}{mark}"
            )
        for a in f["agreements"]:
            print(
                f"  {a['group']} ({a['scope']}): planner picks {a['planner_pick']}, measured best {a['measured_best']}: "
                f"{'agree' if a['agree'] else 'DISAGREE'}; pairwise order agreement {a['pairwise_order_agreement']:.0%}"
            )
    print(json.dumps(summary, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", help="benchmark JSON files (default: benchmarks/results/*.json)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", _OUTPUT_NAME))
    parser.add_argument("--model", default="anchor-1.6b", help="model when a file does not name one")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length when a file does not give one")
    parser.add_argument("--platform", default="h200-pcie", help="profile for what the run did not measure")
    parser.add_argument("--gpu-memory-GiB", type=float, default=139.8, help="GPU memory the picks must fit in")
    parser.add_argument(
        "--host-adamw-s-per-gparam",
        type=float,
        default=None,
        help="host fused AdamW seconds per 1e9 params (default: the profile's; --measure-host measures it)",
    )
    parser.add_argument("--measure-host", action="store_true", help="measure host AdamW speed on this machine")
    args = parser.parse_args(argv)
    if args.measure_host:
        from torch_fsdp_offload.planner.profile import measure_host_adamw_s_per_gparam

        args.host_adamw_s_per_gparam = measure_host_adamw_s_per_gparam()
    paths = args.results or sorted(
        p for p in glob.glob(os.path.join("benchmarks", "results", "*.json")) if os.path.basename(p) != _OUTPUT_NAME
    )
    if not paths:
        print("no benchmark results found: run benchmarks/fsdp_offload.py and benchmarks/activations.py first", file=sys.stderr)
        return 2
    files = []
    for path in paths:
        try:
            files.append(validate_file(path, args))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            print(f"{path}: cannot validate ({type(error).__name__}: {error}); skipped", file=sys.stderr)
    summary = summarize(files)
    print_table(files, summary)
    output = {
        "benchmark": "planner_validate",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform_profile": args.platform,
        "host_adamw_s_per_gparam": args.host_adamw_s_per_gparam,
        "files": files,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(output, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
