"""The planner's result: the talk's steps as a table, JSON, and a throughput plot."""

from __future__ import annotations

import dataclasses
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
from torch_fsdp_offload.planner.search import ScenarioSearch, throughput_curves
from torch_fsdp_offload.planner.training_report import (
    TrainingPlan,
    fits_all_offloaded,
    memory_lines,
    technique_lines,
    training_lines,
    without_offload,
)

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
        throughput_gain (float | None): expected samples per second over :attr:`baseline`'s, minus
            1; None where no run fits without offloading (nothing to compare with).
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
            predicted faster by :data:`~torch_fsdp_offload.planner.search.OFFLOAD_MARGIN` (it
            breaks the contract).
        grad_accum_steps (int): micro-batches of :attr:`micro_batch_size` to accumulate per
            optimizer step (the loop's sequences per step kept).
        baseline (str | None): the run :attr:`throughput_gain` is over, one that fits: today's
            where it fits, else the fastest that fits without offloading.
        fits (bool): the recommended run fits the budget; False where nothing does (:attr:`reason`
            says what would, and :meth:`apply` refuses).
    """

    technique: str
    microbatch_factor: float
    weights_offload_fraction: float
    activations_offload_fraction: float
    checkpointing: bool
    throughput_gain: float | None
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
    grad_accum_steps: int = 1
    baseline: str | None = None
    fits: bool = True

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
            ValueError: a plan that found nothing that fits (:attr:`fits` False: its :attr:`reason`
                says what would); ``offload_policy`` among ``fully_shard_kwargs`` (or ``reshard_after_forward``
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

        if not self.fits:
            raise ValueError(f"this plan has nothing to apply: {self.reason} Nothing was sharded: plan again as it says")
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
        if not self.fits:
            return "nothing to apply: no setting fits (see the recommendation for what would)"
        if self.kwargs is None:
            code = "offload_policy: none (do not pass CoherentOffload)" + self._activations_code()
            return (code + "; checkpoint each block instead" if self.checkpointing else code) + self._loop_code()
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
        code = code + "; activation checkpointing per block" if self.checkpointing else code
        return code + self._loop_code()

    def _loop_code(self) -> str:
        if self.grad_accum_steps == 1:
            return ""
        return f"; accumulate {self.grad_accum_steps} micro-batches of {self.micro_batch_size} per optimizer step"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["throughput_gain_percent"] = None if self.throughput_gain is None else round(100 * self.throughput_gain, 1)
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


@dataclass
class PlanResult:
    """Everything :func:`~torch_fsdp_offload.planner.plan` found.

    Attributes:
        scenario (Scenario): the talk-level input (given, or derived from the real model).
        search (ScenarioSearch): the talk-level candidates and choice; for a real model, the step
            model's fastest setting of each technique (one memory model for the whole plan).
        recommended (Recommendation): the final recommendation.
        training (TrainingPlan | None): the FSDP2 step model's predictions (real models only).
        notes (list[str]): caveats.
        timing (str | None): for a real model, ``"measured"`` (a block and the host step timed
            here) or ``"estimated"`` (from FLOPs); None for a scenario.
        timing_reason (str | None): why the times are estimated (None where measured): a reason
            the planner cannot fix (no GPU, ``platform=`` given, a block that cannot run alone).
        timing_detail (str | None): what was timed, or why not: the report's ``Times:`` line.
    """

    scenario: Scenario
    search: ScenarioSearch
    recommended: Recommendation
    training: TrainingPlan | None = None
    notes: list[str] = field(default_factory=list)
    timing: str | None = None
    timing_reason: str | None = None
    timing_detail: str | None = None

    # -- the talk's numbers --------------------------------------------------------------------
    def scaled_factor(self) -> float | None:
        """Largest measured micro-batch factor that fits with all weights offloaded (for a real
        model, by the step model); None where none does."""
        s = self.scenario
        if self.training is not None:
            fitting = [f for f, _ in s.microbatch_scaling if fits_all_offloaded(self.training, f)]
        else:
            fitting = [f for f, _ in s.microbatch_scaling if s.activations_GB * f + s.other_GB <= s.capacity_GB]
        return max(fitting, default=None)

    def naive_offload_bandwidth_GBps(self) -> float:
        return naive_offload_GB(self.scenario) / self.scenario.iteration_time_s

    def scaled_offload_bandwidth_GBps(self) -> float:
        """The naive offload bandwidth at :meth:`scaled_factor` (at 1x where nothing fits)."""
        factor = self.scaled_factor() or 1.0
        return naive_offload_GB(self.scenario) / (self.scenario.iteration_time_s * time_factor(self.scenario, factor))

    def _without_offload(self, factor: float) -> tuple[str, bool]:
        """Step 5's memory without offload at ``factor``: the text and whether it fits, by the
        plan's one memory model."""
        if self.training is not None:
            need, fits = without_offload(self.training, factor)
            return f"{need:>7.1f} GiB", fits
        need = evaluate(self.scenario, "none", factor).gpu_memory_GB
        return f"{need:>7.1f} GB", need <= self.scenario.capacity_GB * (1 + 1e-9)

    def _memory_breakdown_GB(self) -> dict[str, float]:
        s = self.scenario
        if self.training is not None:
            today = self.training.today()[1]
            parts = {part: amount / 1e9 for part, amount in today.peak_parts.items()}
            need = (today.peak_gpu_bytes + today.allocation_slack_bytes) / 1e9
            return {**parts, "headroom": today.allocation_slack_bytes / 1e9, "total": need,
                    "unused": max(0.0, s.capacity_GB - need), "over_budget": max(0.0, need - s.capacity_GB)}
        return {"weights": s.weights_GB, "grads": s.grads_GB, "optimizer_state": s.optimizer_state_GB,
                "activations": s.activations_GB, "other": s.other_GB, "unused": max(0.0, s.unused_GB),
                "over_budget": max(0.0, -s.unused_GB)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready result; the top-level keys are documented in docs/planner.md."""
        s = self.scenario
        model_bandwidth = model_dram_bandwidth_GBps(s)
        data: dict[str, Any] = {
            "name": s.name,
            "platform": None if s.platform is None else dataclasses.asdict(s.platform),
            "platform_kind": s.kind,
            "memory_breakdown_GB": self._memory_breakdown_GB(),
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
                    "fits_without_offload": self._without_offload(factor)[1],
                }
                for factor, tf in s.microbatch_scaling
            ],
            "offload_blocked_reason": self.search.blocked_reason,
            "candidates": [c.to_dict() for c in self.search.candidates],
            "recommended": self.recommended.to_dict(),
            "scenario": s.to_dict(),
            "notes": list(self.notes),
            "timing": self.timing,
            "timing_reason": self.timing_reason,
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
        label explained under its table, the recommended row marked in its table. For a real
        model every memory figure comes from the step model, and where its times are estimated,
        why is said at the top.

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
        if self.timing is not None:
            lines.append(f"Times: {self.timing}{' ' if self.timing_reason else ', '}{self.timing_detail}")
        if world_size > 1:
            lines.append(
                f"Every figure is per GPU: FSDP over {world_size} GPUs of one host, each GPU with its own micro-batch "
                f"and 1/{world_size} of the weights, grads and optimizer state."
            )
        else:
            lines.append("Every figure is per GPU (one GPU, nothing sharded).")
        lines.append("")
        lines.extend(self._breakdown_lines() if self.training is None else memory_lines(self.training))
        lines.append(f"2. Iteration time: {s.iteration_time_s:.3f} s per step{self._loop_time()}")

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

        unit = "GB" if self.training is None else "GiB"
        lines.append("5. What can be gained (micro-batch scaling):")
        lines.append(f"   micro-batch   time   throughput   {unit} per GPU without offload")
        for factor, tf in s.microbatch_scaling:
            need, fits = self._without_offload(factor)
            lines.append(f"   {factor:>10g}x  {tf:>5.2f}x  {factor / tf - 1:>+10.0%}   {need} "
                         f"({'fits' if fits else 'does not fit'})")
        factor = self.scaled_factor()
        at = (f"At {factor:g}x (the largest that fits with all weights offloaded)" if factor is not None else
              "No micro-batch fits even with all weights offloaded; at 1x")
        lines.append(
            f"   {at} the naive offload needs {traffic} GB / {s.iteration_time_s * time_factor(s, factor or 1.0):.3f} s = "
            f"{self.scaled_offload_bandwidth_GBps():.0f} GB/s"
        )
        if self.training is None:
            lines.extend(self._candidate_lines())
        else:
            picked = self.search.recommended if self.training.best is not None else None
            lines.extend(technique_lines(self.search.candidates, self.training, picked, TECHNIQUE_LEGEND))
            lines.extend(training_lines(self.training, self.training.best, self.search.blocked_reason))

        r = self.recommended
        lines.append(f"{8 if self.training is not None else 7}. Recommendation: {r.reason}")
        for note in self.notes:
            lines.append(f"   Note: {note}")
        lines.append(f"   {r.code()}")
        return "\n".join(lines) + "\n"

    def _breakdown_lines(self) -> list[str]:
        """Step 1 of a scenario: its breakdown against the budget; what is unused, or by how
        much it is over."""
        s = self.scenario
        lines = [f"1. Memory breakdown per GPU (budget {s.capacity_GB:.1f} GB = {s.capacity_GB * 1e9 / 2**30:.1f} GiB)"]
        rows = [
            ("weights", s.weights_GB, ""),
            ("grads", s.grads_GB, ""),
            ("optimizer state", s.optimizer_state_GB, ""),
            ("activations", s.activations_GB, f"  ({s.activations_to_dram_GB:.1f} GB reach DRAM)"),
            ("other", s.other_GB, ""),
            ("unused", s.unused_GB, "") if s.unused_GB >= 0 else ("over budget", -s.unused_GB, "  (does not fit)"),
        ]
        for label, amount, extra in rows:
            if amount or label in ("weights", "activations", "unused"):
                lines.append(f"   {label:<16}{amount:>8.1f} GB {100 * amount / s.capacity_GB:>6.1f}%{extra}")
        return lines

    def _loop_time(self) -> str:
        """Step 2's words: today's run, for a real model with its accumulation and whether it fits."""
        if self.training is None:
            return " (today's run)"
        today = self.training.today()
        accumulated = self.training.grad_accum_steps
        loop = (f" of one micro-batch (today's run: {today[1].step_s:.3f} s with its {accumulated} accumulated"
                if accumulated > 1 else " (today's run")
        return loop + ("" if self.training.fits(today) else "; predicted, it does not fit the budget") + ")"

    def _naive_formula(self) -> str:
        s = self.scenario
        terms = [
            f"{s.crossings[key]:g} x {amount:.1f}"
            for key, amount in (("weights", s.weights_GB), ("grads", s.grads_GB), ("optimizer_state", s.optimizer_state_GB))
            if amount and s.crossings[key]
        ]
        return f"({' + '.join(terms)})" if terms else "0"

    def _candidate_lines(self) -> list[str]:
        """Step 6 of a scenario: the talk-level plans that fit, the recommended one marked (a row
        even where nothing fits), gains over the baseline run (none quoted without one), and the
        legend."""
        candidates = list(self.search.candidates)
        picked = self.search.recommended
        if picked not in candidates:
            candidates.append(picked)
        base = self.search.baseline()
        lines = [
            "6. Partial offload and checkpointing, per GPU (plans that fit):",
            "   technique                       batch  weights  activ.  GB/GPU  link GB/s     gain",
        ]
        for c in candidates:
            marks = (["link-bound"] if c.link_bound else []) + (["does not fit"] if not c.fits else [])
            if c == picked:
                # Where nothing fits, the row is today's run, not a recommendation.
                marks.append("<- recommended" if c.fits else "today's run")
            gain = "" if base is None else f"{(1 + c.throughput_gain) / (1 + base.throughput_gain) - 1:>+7.0%}"
            lines.append(
                f"   {c.technique:<30}{c.microbatch_factor:>5g}x  {c.weights_fraction:>7.0%}  "
                f"{c.activations_fraction:>6.0%}  {c.gpu_memory_GB:>6.1f}  {c.required_link_GBps:>9.0f}  "
                f"{gain:>7}  {', '.join(marks)}".rstrip()
            )
        used = {c.technique for c in candidates} | ({"link-bound"} if any(c.link_bound for c in candidates) else set())
        versus = ("no run fits without offloading, so no gain is quoted" if base is None else
                  f"gain: throughput over {self.search.run_name(base)}")
        lines.append(f"   legend: Nx: N times today's micro-batch; link GB/s: what the copies need to stay hidden; {versus}")
        lines.extend(f"   {text}" for key, text in TECHNIQUE_LEGEND.items() if key in used)
        return lines

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
        if r.throughput_gain is not None:
            axes.plot([fraction], [1.0 + r.throughput_gain], marker="*", markersize=14, color="black", label="recommended")
        axes.set_xlabel("offloaded fraction")
        axes.set_ylabel("throughput relative to today")
        axes.set_title(self.scenario.name[:80])
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
