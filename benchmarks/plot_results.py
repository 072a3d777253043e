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


def plot_fsdp(results: str, out: str) -> str:
    """Tokens/s and peak memory per micro-batch of the eighth session's runs (current code): bs 8 and
    16 each in its own process, and the bs 4 rows of the same names."""
    sources = ["fsdp_offload_bs8_session8.json", "fsdp_offload_bs16_session8.json", "fsdp_offload_bs4_session8.json"]
    rows: list[dict] = []
    for source in sources:
        for row in _rows(os.path.join(results, source)):
            if not any(r["name"] == row["name"] and r["batch_size"] == row["batch_size"] for r in rows):
                rows.append(row)
    names = list(dict.fromkeys(r["name"] for source in sources[:2] for r in _rows(os.path.join(results, source))))
    batch_sizes = sorted({r["batch_size"] for r in rows})
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, steps, peaks = [], [], []
        for j, bs in enumerate(batch_sizes):
            row = next((r for r in rows if r["name"] == name and r["batch_size"] == bs), None)
            if row is not None:
                xs.append(j + i * width)
                steps.append(row["tokens_per_s"] / 1e3)
                peaks.append(row["peak_gpu_GiB"])
        ax_time.bar(xs, steps, width, label=name)
        ax_mem.bar(xs, peaks, width, label=name)
    for ax, label in ((ax_time, "tokens/s (thousands)"), (ax_mem, "peak GPU memory (GiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batch_sizes))])
        ax.set_xticklabels([f"bs {bs} x 2048" for bs in batch_sizes])
        ax.set_ylabel(label)
    handles, labels = ax_time.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("FSDP2 anchor-1.6b on one H200 (PCIe Gen5), torch 2.11")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = os.path.join(out, "fsdp_offload.png")
    fig.savefig(path, dpi=110)
    return path


def plot_fsdp_bs4(results: str, out: str) -> str:
    """Step time against peak memory of the bs 4 rows of the thirteenth session's run of the default
    rows (all in one process, current code) and, hollow, rows of other processes and earlier
    sessions it did not re-measure (the newest measurement of each)."""
    current = _rows(os.path.join(results, "fsdp_offload_bs4_default_session13.json"))
    earlier: list[dict] = []
    for source in ("fsdp_offload_bs4_cast_session13.json", "fsdp_offload_bs4_units_session12.json",
                   "fsdp_offload_bs4_landing_session11.json", "fsdp_offload_bs4_keep_rounds_session10.json",
                   "fsdp_offload_bs4_keep_session10.json", "fsdp_offload_bs4_async_session9.json", "fsdp_offload_bs4_session8.json",
                   "fsdp_offload_bs4_session6.json", "fsdp_offload_bs4_session5.json", "fsdp_offload_bs4_session4.json",
                   "fsdp_offload_bs4_rerun.json", "fsdp_offload_bs4_ac.json", "fsdp_offload_bs4.json", "fsdp_offload_bs4_combined.json"):
        earlier += [
            r for r in _rows(os.path.join(results, source))
            if r["name"].startswith("coherent") and r["name"] not in {c["name"] for c in current + earlier}
        ]
    resident = next(r for r in current if r["name"] == "resident")
    stock = next(r for r in current if r["name"] == "stock_cpu_offload+fused_cpu_adamw")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for group, hollow in ((current, False), (earlier, True)):
        for row in group:
            ax.scatter(row["peak_gpu_GiB"], row["step_s"], s=40, facecolors="none" if hollow else None, edgecolors="C0")
            ax.annotate(row["name"], (row["peak_gpu_GiB"], row["step_s"]), fontsize=6, xytext=(4, 2), textcoords="offset points")
    ax.axvline(resident["peak_gpu_GiB"] / 2, linestyle="--", color="grey", linewidth=1)
    ax.axhline(stock["step_s"] / 1.9, linestyle="--", color="grey", linewidth=1)
    ax.text(resident["peak_gpu_GiB"] / 2, ax.get_ylim()[1] * 0.97, " 50% of resident memory", fontsize=7, va="top")
    ax.text(ax.get_xlim()[1], stock["step_s"] / 1.9, "1.9x stock ", fontsize=7, ha="right", va="bottom")
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("step (s)")
    ax.set_title("FSDP2 anchor-1.6b bs 4 x 2048 on one H200 (PCIe Gen5): targets are the lower-left box", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out, "fsdp_offload_bs4.png")
    fig.savefig(path, dpi=110)
    return path


def plot_activations(results: str, out: str) -> str:
    configs = []
    with open(os.path.join(results, "activations_session7.json")) as f:
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
    fig.tight_layout()
    path = os.path.join(out, "activations.png")
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for plot in (plot_fsdp, plot_fsdp_bs4, plot_activations):
        print(plot(args.results, args.out))


if __name__ == "__main__":
    main()
