"""Plots of the benchmark JSON under benchmarks/results/ (needs matplotlib: pip install matplotlib).

    python benchmarks/plot_results.py [--results benchmarks/results] [--out docs/img]
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [r for r in json.load(f)["rows"] if "error" not in r]


def _save(fig, out: str, name: str) -> str:
    """Lay ``fig`` out, write it to ``out/name`` and return that path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    return path


def plot_fsdp_bs4(results: str, out: str) -> str:
    """Step time against peak memory of the bs 4 rows of ``fsdp_offload_bs4_default_rows.json``
    (every row in one process), with the half-memory and 1.9x-stock lines."""
    current = _rows(os.path.join(results, "fsdp_offload_bs4_default_rows.json"))
    resident = next(r for r in current if r["name"] == "resident")
    stock = next(r for r in current if r["name"] == "stock_cpu_offload+fused_cpu_adamw")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for row in current:
        ax.scatter(row["peak_gpu_GiB"], row["step_s"], s=40, edgecolors="C0")
        ax.annotate(row["name"], (row["peak_gpu_GiB"], row["step_s"]), fontsize=6, xytext=(4, 2), textcoords="offset points")
    ax.axvline(resident["peak_gpu_GiB"] / 2, linestyle="--", color="grey", linewidth=1)
    ax.axhline(stock["step_s"] / 1.9, linestyle="--", color="grey", linewidth=1)
    ax.text(resident["peak_gpu_GiB"] / 2, ax.get_ylim()[1] * 0.97, " 50% of resident memory", fontsize=7, va="top")
    ax.text(ax.get_xlim()[1], stock["step_s"] / 1.9, "1.9x stock ", fontsize=7, ha="right", va="bottom")
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("step (s)")
    ax.set_title("FSDP2 anchor-1.6b bs 4 x 2048 on one H200 (PCIe Gen5), default rows", fontsize=9)
    return _save(fig, out, "fsdp_offload_bs4.png")


def _system_and_clip(name: str) -> tuple[str, str]:
    """A row name without its clip item, and that item (``"unclipped"`` without one)."""
    for clip in ("user-clip", "clip"):
        for spelling in (f";{clip})", f";{clip}"):
            if name.endswith(spelling):
                return name[: -len(spelling)] + (")" if spelling.endswith(")") else ""), clip
    return name, "unclipped"


def plot_contract(results: str, out: str) -> str:
    """Step time of each system unclipped, with ``max_grad_norm=1.0`` and with the loop's own
    ``clip_grad_norm_``, at bs 4 and 16 (``fsdp_offload_contract_bs{4,16}.json``, with the rows of
    that batch size in ``fsdp_offload_default_clip.json`` where that file exists: the defaults
    measured apart)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    defaults = os.path.join(results, "fsdp_offload_default_clip.json")
    for ax, batch_size in zip(axes, (4, 16)):
        rows = {r["name"]: r for r in _rows(os.path.join(results, f"fsdp_offload_contract_bs{batch_size}.json"))}
        if os.path.exists(defaults):
            rows.update({r["name"]: r for r in _rows(defaults) if r["batch_size"] == batch_size})
        systems: dict[str, dict[str, float]] = {}
        for name, row in rows.items():
            if "accum=" in name:  # several micro-batches a step: not comparable here
                continue
            if "split=" in name:  # a split as the defaults once resolved it: the defaults stand in
                continue
            system, clip = _system_and_clip(name)
            systems.setdefault(system, {})[clip] = row["step_s"]
        labels = list(systems)
        for offset, kind in enumerate(("unclipped", "clip", "user-clip")):
            values = [systems[label].get(kind, 0.0) for label in labels]
            ax.bar([i + 0.27 * (offset - 1) for i in range(len(labels))], values, width=0.27, label=kind)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([label.replace(";", ";\n") for label in labels], fontsize=5)
        ax.set_ylabel("step (s)")
        ax.set_title(f"anchor-1.6b bs {batch_size} x 2048, one H200", fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, out, "fsdp_offload_contract.png")


_PEER_LABELS = {
    "resident": "resident FSDP2", "stock_cpu_offload": "stock CPUOffloadPolicy", "deepspeed_zero2": "DeepSpeed ZeRO-2",
    "deepspeed_zero3": "DeepSpeed ZeRO-3", "torchao_cpu_offload": "torchao CPUOffloadOptimizer",
    "torch_fsdp_offload": "CoherentOffload() defaults", "torch_fsdp_offload_planned": "plan_and_shard (half resident memory)",
}


def plot_peers(results: str, out: str) -> str:
    """Tokens/s against peak GPU memory of every system of ``peers.json``, at each batch size."""
    rows = _rows(os.path.join(results, "peers.json"))
    batch_sizes = sorted({row["batch_size"] for row in rows})
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(6 * len(batch_sizes), 4.5), squeeze=False)
    for ax, batch_size in zip(axes[0], batch_sizes):
        for index, row in enumerate(r for r in rows if r["batch_size"] == batch_size):
            ours = row["system"].startswith("torch_fsdp_offload")
            ax.scatter(row["peak_gpu_GiB"], row["tokens_per_s"] / 1e3, s=60 if ours else 40, color=f"C{index}",
                       marker="*" if ours else "o", label=_PEER_LABELS.get(row["system"], row["system"]))
        ax.set_xlabel("peak GPU memory (GiB)")
        ax.set_ylabel("thousand tokens/s")
        ax.set_title(f"anchor-1.6b bs {batch_size} x 2048, one H200 (PCIe Gen5)", fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, out, "peers.png")


def plot_user_loop(results: str, out: str) -> str:
    """Tokens/s of each row of ``user_loop.json`` beside the uncapped resident row's, the cap and
    the peak allocated GPU memory in each label."""
    rows = _rows(os.path.join(results, "user_loop.json"))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for index, row in enumerate(rows):
        ours = row["system"] in ("plan", "fsdp1", "every")
        ax.barh(index, row["tokens_per_s"] / 1e3, color="C1" if ours else "C0")
        ax.annotate(f"{row['peak_allocated_GiB']:.1f} GiB", (row["tokens_per_s"] / 1e3, index), fontsize=7,
                    xytext=(3, -3), textcoords="offset points")
    ax.set_yticks(range(len(rows)), [row["name"] for row in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("thousand tokens/s (label: peak allocated GPU memory)")
    ax.set_title("3.09B Qwen2-class Hugging Face model from the CPU, 2048-token sequences, one H200 (PCIe Gen5)",
                 fontsize=9)
    return _save(fig, out, "user_loop.png")


def plot_activations(results: str, out: str) -> str:
    configs = []
    with open(os.path.join(results, "activations_default_rows.json")) as f:
        configs += json.load(f)["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4))
    for ax, config in zip(axes, configs):
        for row in config["rows"]:
            ax.scatter(row["peak_gib"], row["step_s"], s=40)
            ax.annotate(row["row"], (row["peak_gib"], row["step_s"]), fontsize=8, xytext=(4, 2), textcoords="offset points")
        ax.set_xlabel("peak GPU memory (GiB)")
        ax.set_ylabel("step (s)")
        ax.set_title(f"anchor-1.6b {config['batch_size']} x {config['seq_len']}")
    fig.suptitle("Activation offload on one H200 (PCIe Gen5)")
    return _save(fig, out, "activations.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for plot in (plot_fsdp_bs4, plot_contract, plot_peers, plot_user_loop, plot_activations):
        print(plot(args.results, args.out))


if __name__ == "__main__":
    main()
