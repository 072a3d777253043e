"""The planner's result: the talk's steps as a table, JSON, and a throughput plot."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field
from typing import Any

from torch_fsdp_offload.planner.scenario import Scenario
from torch_fsdp_offload.planner.scenario_cost import (
    Candidate,
    evaluate,
    model_dram_bandwidth_GBps,
    naive_offload_GB,
    time_factor,
)
from torch_fsdp_offload.planner.search import (
    OFFLOAD_MARGIN,
    offload_that_pays,
    ScenarioSearch,
    throughput_curves,
    TIE_MARGIN,
)
from torch_fsdp_offload.planner.step_time import StepPrediction
from torch_fsdp_offload.planner.training_config import LABEL_LEGEND, label_kind
from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = ["PlanResult", "Recommendation", "TECHNIQUE_LEGEND", "TrainingPlan"]

# One line per row label of the talk-level table (its techniques and its link-bound flag).
TECHNIQUE_LEGEND: dict[str, str] = {
    "none": "none: nothing offloaded",
    "offload_weights": "offload_weights: the `weights` share of the weights offloaded, with their grads and optimizer state",
    "offload_activations": "offload_activations: the `activ.` share of the activations offloaded",
    "checkpointing": "checkpointing: activation checkpointing per block (its forward recomputed in backward)",
    "checkpointing+offload_weights": "checkpointing+offload_weights: both",
    "link-bound": "link-bound: its copies need more than the link carries while compute runs: listed, never recommended",
}
_REPORT_WIDTH = 120


@dataclass(frozen=True)
class Recommendation:
    """What the planner recommends.

    Attributes:
        technique (str): ``"none"``, ``"offload_weights"``, ``"offload_activations"``,
            ``"checkpointing"``, ``"checkpointing+offload_weights"``, or ``"fsdp2_step_model"``
            when the training-level model chose it.
        microbatch_factor (float): micro-batch to run, relative to today's.
        weights_offload_fraction (float): fraction of the weights (blocks) offloaded.
        activations_offload_fraction (float): fraction of the activations (blocks) offloaded.
        checkpointing (bool): use activation checkpointing per block.
        throughput_gain (float): expected samples per second over today's run, minus 1.
        kwargs (dict | None): ``CoherentOffload(**kwargs)``, the policy of the offloaded blocks
            (every block and the root unless :attr:`last_blocks` or :attr:`spread_fraction` says
            which); None means pass no offload policy. Activation offload is applied separately,
            with ``offload_activations(model, fraction=activations_offload_fraction)``.
        reason (str): one sentence saying why.
        predicted_step_s (float | None), predicted_peak_gpu_GiB (float | None): from the FSDP2
            step model, when a real model was planned.
        last_blocks (tuple | None): ``(k, n)`` when a real model's blocks are offloaded in part:
            give :attr:`policy` to the last ``k`` of its ``n`` blocks in forward order and no
            ``offload_policy`` to the other blocks and the root (their gradients land first in
            backward, so their host steps end under it: the placement the step model predicts).
        spread_fraction (float | None): give :attr:`policy` to this fraction of the blocks, spread
            evenly (``fully_shard_with_policy(spread_fraction=...)``), and none to the root, when
            the weights are offloaded in part by a plan that does not place them last (a setting
            placed ``"spread"``, or the talk-level model, which does not say which blocks).
        keep_unsharded_last (int): shard the last this many blocks with
            ``reshard_after_forward=False`` (``fully_shard_with_policy(keep_unsharded_last=...)``):
            the offloaded ones copy their parameters in once per step instead of twice.
        micro_batch_size (int | None): the micro-batch to run, in sequences (today's times
            ``microbatch_factor``), for a real model: its predicted peak fits the memory budget.
        block_names (tuple | None): the qualified names of the blocks planned, when the plan was
            given ``blocks=``; :meth:`apply` shards those.
        optimizer_kwargs (dict): the ``OffloadOptimizer`` timing arguments the step was predicted
            with (:meth:`optimizer` passes them): empty for its defaults, which keep
            ``torch.optim``'s contract; ``{"step_during_backward": True}`` only where that was
            predicted faster by :data:`OFFLOAD_MARGIN` (it breaks the contract).
    """

    technique: str
    microbatch_factor: float
    weights_offload_fraction: float
    activations_offload_fraction: float
    checkpointing: bool
    throughput_gain: float
    kwargs: dict[str, Any] | None
    reason: str
    predicted_step_s: float | None = None
    predicted_peak_gpu_GiB: float | None = None
    last_blocks: tuple[int, int] | None = None
    spread_fraction: float | None = None
    keep_unsharded_last: int = 0
    micro_batch_size: int | None = None
    block_names: tuple[str, ...] | None = None
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def policy(self):
        """The recommended :class:`~torch_fsdp_offload.policy.CoherentOffload`, or None (no offload).
        With :attr:`last_blocks` or :attr:`spread_fraction` set it belongs on those blocks only:
        :meth:`apply` places it."""
        if self.kwargs is None:
            return None
        from torch_fsdp_offload.policy import CoherentOffload

        return CoherentOffload(**self.kwargs)

    def apply(self, model: Any, *, blocks: Any = None, **fully_shard_kwargs: Any) -> Any:
        """Shard ``model`` as recommended: ``fully_shard`` on each block in forward order, then on
        the model, with :attr:`policy` (its cast and optimizer placement) where it belongs (every
        module, or the blocks of :attr:`last_blocks` or :attr:`spread_fraction`), the last
        :attr:`keep_unsharded_last` blocks with ``reshard_after_forward=False``, each block's forward checkpointed when
        :attr:`checkpointing` (``fully_shard_with_policy(activation_checkpointing=True)``), and
        ``offload_activations`` when activations are to be offloaded. Train it at
        :attr:`micro_batch_size`.

        Args:
            model (nn.Module): the model, not yet sharded.
            blocks (Sequence[nn.Module | str] | None): the per-layer modules (or their names) in
                forward order. Default: :attr:`block_names`, else
                :func:`~torch_fsdp_offload.models.find_blocks`: the blocks the planner planned.
            **fully_shard_kwargs: passed to every ``fully_shard`` call (``mesh``, ``mp_policy``,
                ...), never ``offload_policy``.

        Returns:
            nn.Module: ``model``, sharded.

        Raises:
            ValueError: ``offload_policy`` among ``fully_shard_kwargs`` (or ``reshard_after_forward``
                with a :attr:`keep_unsharded_last`), a model whose number of blocks differs from
                the planned one, or, without ``blocks``, a model whose blocks
                :func:`~torch_fsdp_offload.models.find_blocks` cannot tell, or, where the plan
                offloads activations, a model another offloader already hooks; raised before
                anything is sharded.

        Example::

            >>> rec = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=14).recommended
            >>> rec.last_blocks
            (4, 8)
            >>> rec.apply(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            >>> optim = rec.optimizer(model, lr=1e-4, fused=True)
        """
        from torch_fsdp_offload.activations import check_can_hook, offload_activations
        from torch_fsdp_offload.models import find_blocks
        from torch_fsdp_offload.policy import fully_shard_with_policy

        blocks = list(find_blocks(model, self.block_names if blocks is None else blocks))
        if self.last_blocks is not None and self.last_blocks[1] != len(blocks):
            raise ValueError(
                f"the plan is for a model of {self.last_blocks[1]} blocks, this one has {len(blocks)}: "
                "plan this model, or pass its blocks= in forward order"
            )
        if self.activations_offload_fraction > 0:
            # offload_activations' own refusal, before anything is sharded.
            check_can_hook([model, *blocks], None, "offload_activations")
        fully_shard_with_policy(
            model,
            blocks,
            self.policy,
            last_blocks=None if self.last_blocks is None else self.last_blocks[0],
            spread_fraction=self.spread_fraction,
            keep_unsharded_last=self.keep_unsharded_last,
            activation_checkpointing=self.checkpointing,
            **fully_shard_kwargs,
        )
        if self.activations_offload_fraction > 0:
            # Kept alive by the hooks it registers on the model.
            offload_activations(model, blocks=blocks, fraction=self.activations_offload_fraction)
        return model

    def optimizer(self, model: Any, optimizer_class: Any = None, **optimizer_kwargs: Any) -> Any:
        """The ``OffloadOptimizer`` over ``model`` (sharded by :meth:`apply`) in the timing mode the
        step was predicted with (:attr:`optimizer_kwargs`). Where the plan offloads nothing it steps
        as ``optimizer_class`` alone would, with the same interface (``synchronize()``,
        ``max_grad_norm``) and without the warning of an ``OffloadOptimizer`` over nothing offloaded.

        Args:
            model (nn.Module): the sharded model.
            optimizer_class (type | None): the ``torch.optim`` class to run (default ``AdamW``).
            **optimizer_kwargs: passed to ``OffloadOptimizer`` (``lr``, ``fused``, ``max_grad_norm``, ...).

        Returns:
            OffloadOptimizer: the optimizer.

        Example::

            >>> optim = plan("anchor-1.6b", platform="h200-pcie", batch_size=4).recommended.optimizer(model, lr=1e-4)
        """
        import warnings

        import torch

        from torch_fsdp_offload.optim import OffloadOptimizer

        with warnings.catch_warnings():
            if self.kwargs is None:
                # The plan offloads nothing: the optimizer steps as the class alone would, which is
                # the plan's decision, not a mistake to warn of; the interface stays the same.
                warnings.filterwarnings("ignore", "OffloadOptimizer: none of its parameters", UserWarning)
            return OffloadOptimizer(model, optimizer_class or torch.optim.AdamW, **{**self.optimizer_kwargs, **optimizer_kwargs})

    def _optimizer_code(self) -> str:
        if not self.optimizer_kwargs:
            return ""
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.optimizer_kwargs.items())
        return (f"; OffloadOptimizer(model, torch.optim.AdamW, {arguments}, ...): breaks torch.optim's contract "
                "(parameters and optimizer state change before step())")

    def _activations_code(self) -> str:
        if self.activations_offload_fraction <= 0:
            return ""
        return f"; offload_activations(model, fraction={round(self.activations_offload_fraction, 4)!r})"

    def code(self) -> str:
        """The recommendation as a line to paste."""
        if self.kwargs is None:
            code = "offload_policy: none (do not pass CoherentOffload)" + self._activations_code()
            return code + "; checkpoint each block instead" if self.checkpointing else code
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        code = f"CoherentOffload({arguments})"
        if self.last_blocks is not None:
            offloaded, n_blocks = self.last_blocks
            code = (
                f"policy = {code} on the last {offloaded} of the {n_blocks} blocks: fully_shard(block, "
                f"offload_policy=policy) for block in blocks[{n_blocks - offloaded}:], no offload_policy for "
                "the other blocks and the root"
            )
        elif self.spread_fraction is not None:
            code = (
                f"policy = {code} on {self.spread_fraction:g} of the blocks, spread evenly: "
                f"fully_shard_with_policy(model, blocks, policy, spread_fraction={self.spread_fraction!r})"
            )
        if self.keep_unsharded_last:
            code += f"; reshard_after_forward=False for the last {self.keep_unsharded_last} blocks"
        code += self._activations_code() + self._optimizer_code()
        return code + "; activation checkpointing per block" if self.checkpointing else code

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["throughput_gain_percent"] = round(100 * self.throughput_gain, 1)
        data["coherent_offload"] = self.code()
        return data


def candidate_kwargs(candidate: Candidate) -> dict[str, Any] | None:
    """``CoherentOffload`` keyword arguments for a talk-level candidate's offloaded blocks (None: it
    offloads no weights; activations are offloaded by ``offload_activations(model, fraction=...)``,
    not the policy)."""
    return {} if candidate.weights_fraction > 0 else None


def candidate_spread_fraction(candidate: Candidate) -> float | None:
    """The fraction of the blocks a talk-level candidate gives the policy, spread evenly (the
    talk-level model does not say which); None for all of them, or none."""
    return round(candidate.weights_fraction, 4) if 0 < candidate.weights_fraction < 1 else None


@dataclass(frozen=True)
class TrainingPlan:
    """The FSDP2 step model's part of a plan for a real model.

    Attributes:
        profiles (tuple): ``(microbatch_factor, TrainingProfile)`` pairs predicted.
        predictions (tuple): ``(microbatch_factor, StepPrediction)`` for every setting tried.
        best (tuple | None): the chosen ``(microbatch_factor, StepPrediction)``.
        capacity_bytes (float): GPU memory budget (per GPU) the peaks were checked against.
        world_size (int): GPUs of one host FSDP shards over; every prediction is per GPU.
    """

    profiles: tuple[tuple[float, TrainingProfile], ...]
    predictions: tuple[tuple[float, StepPrediction], ...]
    best: tuple[float, StepPrediction] | None
    capacity_bytes: float
    world_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_GB": self.capacity_bytes / 1e9,
            "world_size": self.world_size,
            "profiles": [{"microbatch_factor": f, **p.to_dict()} for f, p in self.profiles],
            "predictions": [{"microbatch_factor": f, **p.to_dict()} for f, p in self.predictions],
            "best": None if self.best is None else {"microbatch_factor": self.best[0], **self.best[1].to_dict()},
        }


@dataclass
class PlanResult:
    """Everything :func:`~torch_fsdp_offload.planner.plan` found.

    Attributes:
        scenario (Scenario): the talk-level input (given, or derived from the real model).
        search (ScenarioSearch): the talk-level candidates and choice.
        recommended (Recommendation): the final recommendation.
        training (TrainingPlan | None): the FSDP2 step model's predictions (real models only).
        notes (list[str]): caveats (what was estimated instead of measured).
        timing (str | None): for a real model, ``"measured"`` (a block and the host step timed
            here) or ``"estimated"`` (from FLOPs; a note says why); None for a scenario.
    """

    scenario: Scenario
    search: ScenarioSearch
    recommended: Recommendation
    training: TrainingPlan | None = None
    notes: list[str] = field(default_factory=list)
    timing: str | None = None

    # -- the talk's numbers --------------------------------------------------------------------
    def scaled_factor(self) -> float:
        """Largest measured micro-batch factor whose activations fit with all weights offloaded."""
        s = self.scenario
        fitting = [f for f, _ in s.microbatch_scaling if s.activations_GB * f + s.other_GB <= s.capacity_GB]
        return max(fitting, default=1.0)

    def naive_offload_bandwidth_GBps(self) -> float:
        return naive_offload_GB(self.scenario) / self.scenario.iteration_time_s

    def scaled_offload_bandwidth_GBps(self) -> float:
        factor = self.scaled_factor()
        return naive_offload_GB(self.scenario) / (self.scenario.iteration_time_s * time_factor(self.scenario, factor))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready result; the top-level keys are documented in docs/planner.md."""
        s = self.scenario
        model_bandwidth = model_dram_bandwidth_GBps(s)
        data: dict[str, Any] = {
            "name": s.name,
            "platform": None if s.platform is None else dataclasses.asdict(s.platform),
            "platform_kind": s.kind,
            "memory_breakdown_GB": {
                "weights": s.weights_GB,
                "grads": s.grads_GB,
                "optimizer_state": s.optimizer_state_GB,
                "activations": s.activations_GB,
                "other": s.other_GB,
                "unused": s.unused_GB,
            },
            "capacity_GB": s.capacity_GB,
            "iteration_time_s": s.iteration_time_s,
            "model_dram_bandwidth_GBps": model_bandwidth,
            "model_dram_utilization": model_bandwidth / s.gpu_dram_GBps,
            "gpu_dram_peak_GBps": s.gpu_dram_GBps,
            "link_GBps": s.link_GBps,
            "naive_offload_bandwidth_GBps": self.naive_offload_bandwidth_GBps(),
            "scaled_offload_bandwidth_GBps": self.scaled_offload_bandwidth_GBps(),
            "scaled_microbatch_factor": self.scaled_factor(),
            "microbatch_scaling": [
                {
                    "factor": factor,
                    "time_factor": tf,
                    "throughput_gain": factor / tf - 1.0,
                    "gpu_memory_GB_without_offload": evaluate(s, "none", factor).gpu_memory_GB,
                }
                for factor, tf in s.microbatch_scaling
            ],
            "offload_blocked_reason": self.search.blocked_reason,
            "candidates": [c.to_dict() for c in self.search.candidates],
            "recommended": self.recommended.to_dict(),
            "scenario": s.to_dict(),
            "notes": list(self.notes),
            "timing": self.timing,
        }
        if self.training is not None:
            data["training"] = self.training.to_dict()
        return data

    # -- human report ---------------------------------------------------------------------------
    def __str__(self) -> str:
        # print(result) shows the report, as the command line does.
        return self.report()

    def report(self) -> str:
        """The talk's decision framework, step by step, as text: every figure per GPU, every row
        label explained under its table, the recommended row marked in its table.

        Returns:
            str: the report's lines, each ending in a newline.

        Example::

            >>> print(plan(scenario="docs/examples/talk_gh200.json").report())
        """
        s = self.scenario
        world_size = 1 if self.training is None else self.training.world_size
        lines = [f"Offload plan: {s.name}"]
        if s.platform is not None:
            lines.append(
                f"Platform: {s.platform.name} ({s.kind}); per GPU: {s.platform.gpu_memory_GB:.1f} GB memory, "
                f"{s.gpu_dram_GBps:.0f} GB/s DRAM, {s.link_GBps:.0f} GB/s link"
            )
        if world_size > 1:
            lines.append(
                f"Every figure is per GPU: FSDP over {world_size} GPUs of one host, each GPU with its own micro-batch "
                f"and 1/{world_size} of the weights, grads and optimizer state."
            )
        else:
            lines.append("Every figure is per GPU (one GPU, nothing sharded).")
        lines.append("")
        lines.append(
            f"1. Memory breakdown per GPU (budget {s.capacity_GB:.1f} GB = {s.capacity_GB * 1e9 / 2**30:.1f} GiB)"
        )
        sharded = f"  (1/{world_size} of the model's {{:.1f}} GB)" if world_size > 1 else ""
        rows = [
            ("weights", s.weights_GB, sharded.format(s.weights_GB * world_size)),
            ("grads", s.grads_GB, sharded.format(s.grads_GB * world_size)),
            ("optimizer state", s.optimizer_state_GB, sharded.format(s.optimizer_state_GB * world_size)),
            ("activations", s.activations_GB, f"  ({s.activations_to_dram_GB:.1f} GB reach DRAM)"),
            ("other", s.other_GB, ""),
            ("unused", s.unused_GB, ""),
        ]
        for label, amount, extra in rows:
            if amount or label in ("weights", "activations", "unused"):
                lines.append(f"   {label:<16}{amount:>8.1f} GB {100 * amount / s.capacity_GB:>6.1f}%{extra}")
        lines.append(f"2. Iteration time: {s.iteration_time_s:.3f} s per step (today's run)")

        model_bandwidth = model_dram_bandwidth_GBps(s)
        utilization = model_bandwidth / s.gpu_dram_GBps
        if s.model_dram_GBps is not None:
            formula = "measured"
        else:
            terms = [f"{s.weights_GB:.1f}", f"2 x {s.activations_to_dram_GB:.1f}"]
            terms += [f"2 x {v:.1f}" for v in (s.grads_GB, s.optimizer_state_GB) if v]
            formula = f"({' + '.join(terms)}) GB / {s.iteration_time_s:.3f} s"
        verdict = (
            "near peak: offload traffic would compete for the same DRAM"
            if utilization > 0.85
            else "room for offload traffic"
        )
        lines.append(
            f"3. Model DRAM bandwidth per GPU: {formula} = {model_bandwidth:.0f} GB/s, "
            f"{utilization:.0%} of the {s.gpu_dram_GBps:.0f} GB/s peak: {verdict}"
        )

        naive = self.naive_offload_bandwidth_GBps()
        ratio = naive / s.link_GBps
        traffic = self._naive_formula()
        lines.append(
            f"4. Naive offload per GPU (all weights): {traffic} GB / {s.iteration_time_s:.3f} s = {naive:.0f} GB/s "
            f"vs a {s.link_GBps:.0f} GB/s link"
            + (f": {ratio:.1f}x more than it carries" if ratio > 1 else ": the link keeps up")
        )

        lines.append("5. What can be gained (micro-batch scaling):")
        lines.append("   micro-batch   time   throughput   GB per GPU without offload")
        for factor, tf in s.microbatch_scaling:
            need = evaluate(s, "none", factor).gpu_memory_GB
            fits = "fits" if need <= s.capacity_GB * (1 + 1e-9) else "does not fit"
            lines.append(f"   {factor:>10g}x  {tf:>5.2f}x  {factor / tf - 1:>+10.0%}   {need:>7.1f} GB ({fits})")
        factor = self.scaled_factor()
        lines.append(
            f"   At {factor:g}x (the largest that fits with all weights offloaded) the naive offload needs "
            f"{traffic} GB / {s.iteration_time_s * time_factor(s, factor):.3f} s = "
            f"{self.scaled_offload_bandwidth_GBps():.0f} GB/s"
        )
        lines.extend(self._candidate_lines())

        if self.training is not None:
            lines.extend(self._training_lines())

        r = self.recommended
        lines.append(f"{8 if self.training is not None else 7}. Recommendation: {r.reason}")
        for note in self.notes:
            lines.append(f"   Note: {note}")
        lines.append(f"   {r.code()}")
        return "\n".join(lines) + "\n"

    def _naive_formula(self) -> str:
        s = self.scenario
        terms = [
            f"{s.crossings[key]:g} x {amount:.1f}"
            for key, amount in (("weights", s.weights_GB), ("grads", s.grads_GB), ("optimizer_state", s.optimizer_state_GB))
            if amount and s.crossings[key]
        ]
        return f"({' + '.join(terms)})" if terms else "0"

    def _candidate_lines(self) -> list[str]:
        """Step 6: the talk-level plans that fit, the recommended one marked when the
        recommendation is the talk-level one (a row even where nothing fits), and the legend."""
        candidates = list(self.search.candidates)
        picked = self.search.recommended if self.recommended.technique != "fsdp2_step_model" else None
        if picked is not None and picked not in candidates:
            candidates.append(picked)
        lines = [
            "6. Partial offload and checkpointing, per GPU (plans that fit):",
            "   technique                       batch  weights  activ.  GB/GPU  link GB/s     gain",
        ]
        for c in candidates:
            marks = (["link-bound"] if c.link_bound else []) + (["does not fit"] if not c.fits else [])
            if c == picked:
                marks.append("<- recommended")
            lines.append(
                f"   {c.technique:<30}{c.microbatch_factor:>5g}x  {c.weights_fraction:>7.0%}  "
                f"{c.activations_fraction:>6.0%}  {c.gpu_memory_GB:>6.1f}  {c.required_link_GBps:>9.0f}  "
                f"{c.throughput_gain:>+7.0%}  {', '.join(marks)}".rstrip()
            )
        used = {c.technique for c in candidates} | ({"link-bound"} if any(c.link_bound for c in candidates) else set())
        lines.append("   legend: Nx: N times today's micro-batch; link GB/s: what the copies need to stay hidden; gain: throughput over today's run")
        lines.extend(f"   {text}" for key, text in TECHNIQUE_LEGEND.items() if key in used)
        return lines

    def _training_lines(self) -> list[str]:
        """Step 7: today's run, the fastest settings that fit, the recommended one (always a row,
        marked), the rows the decision rule compared; a legend of the labels; the rule when it
        chose another row than the fastest."""
        training = self.training
        tokens = training.profiles[0][1].tokens

        def speed(fp: tuple[float, StepPrediction]) -> float:
            return fp[0] / fp[1].step_s

        ranked = sorted(training.predictions, key=lambda fp: -speed(fp))
        fitting = [fp for fp in ranked if fp[1].fits(training.capacity_bytes)]
        resident = [fp for fp in training.predictions if fp[0] == 1 and fp[1].config.module_fraction == 0
                    and fp[1].config.activations == 0 and not fp[1].config.checkpointing]
        picked = training.best if self.recommended.technique == "fsdp2_step_model" else None
        rule, compared = self._rule(fitting, picked) if picked is not None and fitting[0] != picked else ([], [])
        chosen = fitting[:8] + compared + ([picked] if picked is not None else [])
        rows = resident + [fp for fp in fitting if fp in chosen and fp not in resident]
        width = max(len(p.config.label) for _, p in rows)
        lines = [
            f"7. FSDP2 step model, per GPU (budget {training.capacity_bytes / 2**30:.1f} GiB; "
            f"{training.profiles[0][1].source}):",
            f"   batch  {'setting':<{width}}  step s  peak GiB/GPU  tokens/s/GPU  fits",
        ]
        for fp in rows:
            factor, p = fp
            marks = (["today's run"] if fp in resident else []) + (["<- recommended"] if fp == picked else [])
            fits = "yes" if p.fits(training.capacity_bytes) else "no"
            lines.append(
                f"   {factor:>4g}x  {p.config.label:<{width}}  {p.step_s:>6.3f}  {p.peak_gpu_GiB:>12.1f}  "
                f"{factor * tokens / p.step_s:>12.0f}  {fits:<4}  {', '.join(marks)}".rstrip()
            )
        kinds = {label_kind(part) for _, p in rows for part in p.config.label.split()}
        lines.append("   legend: Nx: N times today's micro-batch; fits: the peak, and a free block for the loss's fp32 output, within the budget")
        lines.extend(f"   {text}" for key, text in LABEL_LEGEND.items() if key in kinds)
        lines.extend(textwrap.wrap(rule, _REPORT_WIDTH, initial_indent="   ", subsequent_indent="   ") if rule else [])
        return lines

    @staticmethod
    def _rule(
        fitting: list[tuple[float, StepPrediction]], picked: tuple[float, StepPrediction]
    ) -> tuple[str, list[tuple[float, StepPrediction]]]:
        """Why ``picked`` and not the fastest row that fits (``fitting[0]``): the offload margin
        or the tie rule of :func:`~torch_fsdp_offload.planner.search.choose`; and the rows compared."""

        def speed(fp: tuple[float, StepPrediction]) -> float:
            return fp[0] / fp[1].step_s

        def moved_GB(fp: tuple[float, StepPrediction]) -> float:
            return (fp[1].h2d_bytes + fp[1].d2h_bytes) / 1e9

        def name(fp: tuple[float, StepPrediction]) -> str:
            return f"{fp[1].config.label} at {fp[0]:g}x"

        fastest = fitting[0]
        head = (
            f"recommended: the fastest row that fits; a row that moves bytes over the link must beat the fastest "
            f"moving none by {OFFLOAD_MARGIN:.0%} (the step model's error against measured steps), and within "
            f"{TIE_MARGIN:.0%} of the fastest the row moving the fewest bytes wins (then: the one without ckpt). "
        )
        if fastest not in offload_that_pays(fitting, throughput=speed, moves_bytes=lambda fp: moved_GB(fp) > 0):
            staying = max((fp for fp in fitting if moved_GB(fp) == 0), key=speed)
            return head + (
                f"Here {name(fastest)} is {speed(fastest) / speed(staying) - 1:+.1%} faster than {name(staying)}, "
                f"less than the {OFFLOAD_MARGIN:.0%} margin, so the recommendation moves no bytes."
            ), [staying]
        fewer = (
            f"moves {moved_GB(picked):.1f} GB per step, not {moved_GB(fastest):.1f} GB"
            if moved_GB(picked) < moved_GB(fastest) else "does not checkpoint"
        )
        return head + (
            f"Here {name(picked)} is within {TIE_MARGIN:.0%} of {name(fastest)} "
            f"({speed(picked) / speed(fastest) - 1:+.1%}) and {fewer}."
        ), []

    # -- plot ---------------------------------------------------------------------------------
    def plot(self, path: str) -> None:
        """Write a PNG of throughput against the offloaded fraction, one line per technique.

        Raises:
            ImportError: matplotlib is not installed (``pip install torch-fsdp-offload[plot]``).
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "the plot needs matplotlib: pip install 'torch-fsdp-offload[plot]' (or pip install matplotlib)"
            ) from exc
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for technique, curve in throughput_curves(self.scenario).items():
            xs = [x for x, gain in curve]
            ys = [None if gain is None else 1.0 + gain for _, gain in curve]
            axes.plot(xs, [float("nan") if y is None else y for y in ys], label=technique)
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        r = self.recommended
        fraction = max(r.weights_offload_fraction, r.activations_offload_fraction)
        axes.plot([fraction], [1.0 + r.throughput_gain], marker="*", markersize=14, color="black", label="recommended")
        axes.set_xlabel("offloaded fraction")
        axes.set_ylabel("throughput relative to today")
        axes.set_title(self.scenario.name[:80])
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
