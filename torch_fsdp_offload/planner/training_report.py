"""The FSDP2 step model's part of a real model's plan, and the report's sections it writes.

One memory model serves the whole report of a real model: the memory of today's run (step 1),
what runs without offload at each micro-batch (step 5), the fastest setting of each technique
(step 6) and the table of settings (step 7) all come from the step model's predictions, each
checked against the budget with the allocator's headroom (:meth:`StepPrediction.fits`). Gains are
quoted over one named run that fits (:meth:`TrainingPlan.baseline`), never over one that does not.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from torch_fsdp_offload.planner.scenario_cost import Candidate
from torch_fsdp_offload.planner.search import OFFLOAD_MARGIN, TIE_MARGIN, offload_that_pays, samples_per_s
from torch_fsdp_offload.planner.step_time import FRAGMENTATION_FACTOR, StepPrediction
from torch_fsdp_offload.planner.training_config import LABEL_LEGEND, label_kind
from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = ["TrainingPlan", "fits_all_offloaded", "memory_lines", "technique_lines", "training_lines", "without_offload"]

# What the allocator's headroom beside a peak is for (StepPrediction.fits).
_HEADROOM = f"free memory for the loss's fp32 output, {FRAGMENTATION_FACTOR:g}x its size"

_REPORT_WIDTH = 120
_Row = tuple[float, StepPrediction]
# Step 1's rows: a part of the peak (:func:`~torch_fsdp_offload.planner.peak_memory.phase_parts`)
# and what it holds.
_PARTS = {
    "weights": ("weights", "fp32 masters on the GPU"),
    "optimizer_state": ("optimizer state", "AdamW moments on the GPU"),
    "grads": ("grads", "sharded fp32 gradients on the GPU"),
    "unsharded": ("unsharded params", "gathered groups in the compute dtype"),
    "activations": ("activations", "saved for backward"),
    "loss": ("loss", ""),
    "streamed": ("streamed state", "optimizer runs in transit"),
    "fixed": ("fixed", "calibrated: workspaces and allocator residual"),
}


@dataclass(frozen=True)
class TrainingPlan:
    """The FSDP2 step model's part of a plan for a real model.

    Attributes:
        profiles (tuple): ``(microbatch_factor, TrainingProfile)`` pairs predicted.
        predictions (tuple): ``(microbatch_factor, StepPrediction)`` for every setting tried.
        best (tuple | None): the chosen ``(microbatch_factor, StepPrediction)``.
        capacity_bytes (float): GPU memory budget (per GPU) the peaks were checked against.
        world_size (int): GPUs of one host FSDP shards over; every prediction is per GPU.
        grad_accum_steps (int): micro-batches the loop accumulates per step at today's micro-batch.
        clipping (bool): the loop clips the gradients.
        what_would_fit (str | None): where nothing fits, what would (a smaller micro-batch with
            more accumulation, or what is left to change).

    Example::

        >>> training = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=14).training
        >>> training.run_name(training.today()), training.baseline()
        ("today's run (modules=0.00 at 1x)", None)
    """

    profiles: tuple[tuple[float, TrainingProfile], ...]
    predictions: tuple[_Row, ...]
    best: _Row | None
    capacity_bytes: float
    world_size: int = 1
    grad_accum_steps: int = 1
    clipping: bool = False
    what_would_fit: str | None = None

    def today(self) -> _Row:
        """Today's run: today's micro-batch and loop, nothing offloaded, no checkpointing."""
        return next(fp for fp in self.predictions if fp[0] == 1 and fp[1].config.module_fraction == 0
                    and fp[1].config.activations == 0 and not fp[1].config.checkpointing)

    def fits(self, row: _Row) -> bool:
        return row[1].fits(self.capacity_bytes)

    def baseline(self) -> _Row | None:
        """The run gains are quoted over: today's where it fits, else the fastest that fits
        without moving a byte over the link (checkpointed, or at another micro-batch); None where
        none does."""
        if self.fits(self.today()):
            return self.today()
        staying = [fp for fp in self.predictions if self.fits(fp) and fp[1].h2d_bytes + fp[1].d2h_bytes == 0]
        return max(staying, key=samples_per_s, default=None)

    def run_name(self, row: _Row) -> str:
        """How the report names a run: its setting and micro-batch."""
        name = f"{row[1].config.label} at {row[0]:g}x"
        return f"today's run ({name})" if row == self.today() else name

    def smallest(self) -> _Row:
        """The run that needs the least GPU memory."""
        return min(self.predictions, key=self.needed_GiB)

    @staticmethod
    def needed_GiB(row: _Row) -> float:
        """The GPU memory a run needs: its peak and the allocator's headroom beside it."""
        return (row[1].peak_gpu_bytes + row[1].allocation_slack_bytes) / 2**30

    def to_dict(self) -> dict[str, Any]:
        base = self.baseline()
        return {
            "capacity_GB": self.capacity_bytes / 1e9,
            "world_size": self.world_size,
            "grad_accum_steps": self.grad_accum_steps,
            "baseline": None if base is None else self.run_name(base),
            "what_would_fit": self.what_would_fit,
            "profiles": [{"microbatch_factor": f, **p.to_dict()} for f, p in self.profiles],
            "predictions": [{"microbatch_factor": f, **p.to_dict()} for f, p in self.predictions],
            "best": None if self.best is None else {"microbatch_factor": self.best[0], **self.best[1].to_dict()},
        }


def memory_lines(training: TrainingPlan) -> list[str]:
    """Step 1: today's run at its peak, part by part, with the allocator's headroom, against the
    budget: what is unused, or by how much it is over (never a negative amount).

    Example::

        >>> print("\n".join(memory_lines(plan("anchor-1.6b", platform="h200-pcie", batch_size=4).training)))
    """
    factor, today = training.today()
    profile = training.profiles[0][1]
    budget = training.capacity_bytes
    loss = f"the loss on {profile.loss_fp32_output_bytes / 4 / profile.tokens:,.0f} logits a token: fp32 copy, gradients"
    lines = [f"1. Memory per GPU of today's run ({today.config.label}) at its {today.peak_phase} peak "
             f"(budget {budget / 2**30:.1f} GiB = {budget / 1e9:.1f} GB)"]

    def line(label: str, amount: float, extra: str = "") -> str:
        return f"   {label:<18}{amount / 2**30:>7.1f} GiB {100 * amount / budget:>6.1f}%{'  (' + extra + ')' if extra else ''}"

    for part, amount in today.peak_parts.items():
        label, extra = _PARTS[part]
        lines.append(line(label, amount, loss if part == "loss" else extra))
    if today.allocation_slack_bytes:
        lines.append(line("headroom", today.allocation_slack_bytes, f"the allocator's: {_HEADROOM}"))
    need = today.peak_gpu_bytes + today.allocation_slack_bytes
    verdict = (f"fits, {(budget - need) / 2**30:.1f} GiB unused" if need <= budget else
               f"does not fit, {(need - budget) / 2**30:.1f} GiB over the budget")
    lines.append(f"{line('total', need)}: {verdict}")
    return lines


def without_offload(training: TrainingPlan, factor: float) -> tuple[float, bool]:
    """Step 5's column: the GiB today's setting needs at ``factor`` times the micro-batch, and
    whether that fits.

    Example::

        >>> without_offload(training, 1.0)
        (26.9..., False)
    """
    row = next(fp for fp in training.predictions if fp[0] == factor and fp[1].config.module_fraction == 0
               and fp[1].config.activations == 0 and not fp[1].config.checkpointing)
    return training.needed_GiB(row), training.fits(row)


def fits_all_offloaded(training: TrainingPlan, factor: float) -> bool:
    """Whether a setting offloading every block, without checkpointing, fits at ``factor``.

    Example::

        >>> fits_all_offloaded(training, 1.0)
        True
    """
    return any(fp[0] == factor and fp[1].config.module_fraction == 1 and not fp[1].config.checkpointing
               and fp[1].config.activations == 0 and training.fits(fp) for fp in training.predictions)


def technique_lines(candidates: tuple[Candidate, ...], training: TrainingPlan, picked: Candidate | None,
                    legend: dict[str, str]) -> list[str]:
    """Step 6 of a real model: the step model's fastest setting of each technique and micro-batch
    that fits, its gain over the baseline run; the recommended one marked; ``legend`` explains
    the techniques.

    Example::

        >>> technique_lines(result.search.candidates, result.training, result.search.recommended, TECHNIQUE_LEGEND)
    """
    base = training.baseline()
    lines = [
        "6. Partial offload and checkpointing, per GPU (the step model's fastest setting of each that fits):",
        "   technique                       batch  weights  activ.  GiB/GPU   step s     gain",
    ]
    for c in candidates:
        mark = "<- recommended" if c == picked else ""
        gain = "" if c.throughput_gain is None else f"{c.throughput_gain:>+8.0%}"
        lines.append(
            f"   {c.technique:<30}{c.microbatch_factor:>5g}x  {c.weights_fraction:>7.0%}  {c.activations_fraction:>6.0%}  "
            f"{c.gpu_memory_GB * 1e9 / 2**30:>7.1f}  {c.iteration_time_s:>7.3f} {gain:>8}  {mark}".rstrip()
        )
    if not candidates:
        lines.append("   (no setting fits)")
    versus = ("no run fits without offloading, so no gain is quoted" if base is None else
              f"gain: throughput over {training.run_name(base)}, which fits")
    lines.append(f"   legend: Nx: N times today's micro-batch; GiB/GPU: its peak with the allocator's headroom; {versus}")
    lines.extend(f"   {text}" for key, text in legend.items() if key in {c.technique for c in candidates})
    return lines


def training_lines(training: TrainingPlan, picked: _Row | None, blocked: str | None) -> list[str]:
    """Step 7: today's run, the baseline, the fastest settings that fit, the recommended one
    (always a row, marked), the rows the decision rule compared; a legend of the labels; the rule
    when it chose another row than the fastest (``blocked``: offload cannot pay here).

    Example::

        >>> training_lines(result.training, result.training.best, result.search.blocked_reason)
    """
    tokens = training.profiles[0][1].tokens
    ranked = sorted(training.predictions, key=lambda fp: -samples_per_s(fp))
    fitting = [fp for fp in ranked if training.fits(fp)]
    today, base = training.today(), training.baseline()
    rule, compared = ("", [])
    if blocked and picked is not None and fitting[0] != picked:
        rule = "recommended: the fastest row that fits and moves no bytes over the link, since offload cannot pay here (8.)."
    elif picked is not None and fitting[0] != picked:
        rule, compared = _rule(fitting, picked)
    chosen = fitting[:8] + compared + [fp for fp in (picked, base) if fp is not None]
    rows = [today] + [fp for fp in fitting if fp in chosen and fp != today]
    width = max(len(p.config.label) for _, p in rows)
    accumulated = training.grad_accum_steps
    lines = [
        f"7. FSDP2 step model, per GPU (budget {training.capacity_bytes / 2**30:.1f} GiB; "
        f"{training.profiles[0][1].source}{f'; a step accumulates micro-batches, accum=N' if accumulated > 1 else ''}):",
        f"   batch  {'setting':<{width}}  step s  peak GiB/GPU  tokens/s/GPU  fits",
    ]
    for fp in rows:
        factor, p = fp
        marks = ((["today's run"] if fp == today else []) + (["baseline"] if fp == base and fp != today else [])
                 + (["<- recommended"] if fp == picked else []))
        lines.append(
            f"   {factor:>4g}x  {p.config.label:<{width}}  {p.step_s:>6.3f}  {p.peak_gpu_GiB:>12.1f}  "
            f"{samples_per_s(fp) * tokens:>12.0f}  {'yes' if training.fits(fp) else 'no':<4}  {', '.join(marks)}".rstrip()
        )
    kinds = {label_kind(part) for _, p in rows for part in p.config.label.split()}
    lines.append(f"   legend: Nx: N times today's micro-batch; fits: the peak, and the allocator's headroom ({_HEADROOM}), "
                 "within the budget; baseline: the run gains are quoted over")
    lines.extend(f"   {text}" for key, text in LABEL_LEGEND.items() if key in kinds)
    lines.extend(textwrap.wrap(rule, _REPORT_WIDTH, initial_indent="   ", subsequent_indent="   ") if rule else [])
    return lines


def _rule(fitting: list[_Row], picked: _Row) -> tuple[str, list[_Row]]:
    """Why ``picked`` and not the fastest row that fits (``fitting[0]``): the offload margin
    or the tie rule of :func:`~torch_fsdp_offload.planner.search.choose`; and the rows compared."""

    def moved_GB(fp: _Row) -> float:
        return (fp[1].h2d_bytes + fp[1].d2h_bytes) / 1e9

    def name(fp: _Row) -> str:
        return f"{fp[1].config.label} at {fp[0]:g}x"

    fastest = fitting[0]
    head = (
        f"recommended: the fastest row that fits; a row that moves bytes over the link must beat the fastest "
        f"moving none by {OFFLOAD_MARGIN:.0%} (the step model's error against measured steps), and within "
        f"{TIE_MARGIN:.0%} of the fastest the row moving the fewest bytes wins (then: the one without ckpt). "
    )
    if fastest not in offload_that_pays(fitting, throughput=samples_per_s, moves_bytes=lambda fp: moved_GB(fp) > 0):
        staying = max((fp for fp in fitting if moved_GB(fp) == 0), key=samples_per_s)
        return head + (
            f"Here {name(fastest)} is {samples_per_s(fastest) / samples_per_s(staying) - 1:+.1%} faster than "
            f"{name(staying)}, less than the {OFFLOAD_MARGIN:.0%} margin, so the recommendation moves no bytes."
        ), [staying]
    fewer = (
        f"moves {moved_GB(picked):.1f} GB per step, not {moved_GB(fastest):.1f} GB"
        if moved_GB(picked) < moved_GB(fastest) else "does not checkpoint"
    )
    return head + (
        f"Here {name(picked)} is within {TIE_MARGIN:.0%} of {name(fastest)} "
        f"({samples_per_s(picked) / samples_per_s(fastest) - 1:+.1%}) and {fewer}."
    ), []
