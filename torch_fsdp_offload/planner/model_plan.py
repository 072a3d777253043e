"""Planning a real model: its breakdown, its block timed where it can be, the FSDP2 step model over
the loop it runs (micro-batch, accumulation, clipping), and the recommendation.

One memory model, the step model's (:func:`~torch_fsdp_offload.planner.peak_memory.phase_parts`),
decides what fits everywhere in the plan: the talk-level table of techniques is read off its
predictions (:func:`step_model_search`), and where nothing fits the plan says what would
(:func:`what_would_fit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from torch_fsdp_offload.host_step import host_GBps_from_link_busy, measure_host_step
from torch_fsdp_offload.planner.block_timing import BlockTiming, measure_block_timings
from torch_fsdp_offload.planner.memory_breakdown import ModelBreakdown, block_names, model_breakdown
from torch_fsdp_offload.planner.profiles import PlatformProfile
from torch_fsdp_offload.planner.report import PlanResult, Recommendation
from torch_fsdp_offload.planner.scenario import Checkpointing, Scenario
from torch_fsdp_offload.planner.scenario_cost import TECHNIQUES, Candidate
from torch_fsdp_offload.planner.search import (
    OFFLOAD_MARGIN, ScenarioSearch, choose, offload_blocked_reason, samples_per_s, search_training,
)
from torch_fsdp_offload.planner.step_time import StepPrediction, predict_step
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import training_profile
from torch_fsdp_offload.planner.training_report import TrainingPlan

__all__ = ["plan_model", "step_model_search", "technique_of", "what_would_fit"]


def _scaled_breakdown(breakdown: ModelBreakdown, factor: float) -> ModelBreakdown:
    def scaled(amount: int) -> int:
        return round(amount * factor)

    return dataclasses.replace(
        breakdown,
        batch_size=scaled(breakdown.batch_size),
        block_activation_bytes=scaled(breakdown.block_activation_bytes),
        block_checkpoint_bytes=scaled(breakdown.block_checkpoint_bytes),
        other_activation_bytes=scaled(breakdown.other_activation_bytes),
        loss_transient_bytes=scaled(breakdown.loss_transient_bytes),
        loss_fp32_output_bytes=scaled(breakdown.loss_fp32_output_bytes),
    )


def _scaled_timing(timing: BlockTiming | None, factor: float) -> BlockTiming | None:
    """A timing at ``factor`` times its micro-batch, in proportion (for micro-batches not timed)."""
    if timing is None:
        return None
    return BlockTiming(round(timing.batch_size * factor), timing.forward_s * factor, timing.backward_s * factor,
                       round(timing.activation_bytes * factor),
                       None if timing.recompute_s is None else timing.recompute_s * factor,
                       None if timing.checkpoint_bytes is None else round(timing.checkpoint_bytes * factor))


def technique_of(config: TrainingConfig) -> str:
    """The talk-level technique (:data:`~torch_fsdp_offload.planner.scenario_cost.TECHNIQUES`) a
    step-model setting belongs to: weights offloaded first, then checkpointing, then activations.

    Args:
        config (TrainingConfig): a setting of the step model.

    Returns:
        str: its technique.

    Example::

        >>> technique_of(TrainingConfig(module_fraction=0.5, checkpointing=True))
        'checkpointing+offload_weights'
    """
    weights = config.module_fraction > 0
    if config.checkpointing:
        return "checkpointing+offload_weights" if weights else "checkpointing"
    if weights:
        return "offload_weights"
    return "offload_activations" if config.activations > 0 else "none"


def step_model_search(scenario: Scenario, training: TrainingPlan, recommended: tuple[float, StepPrediction] | None,
                      blocked: str | None) -> ScenarioSearch:
    """The talk's table of techniques read off the step model: per technique and micro-batch, the
    recommended setting or else the fastest that fits, its gain over the plan's baseline run
    (:meth:`~torch_fsdp_offload.planner.training_report.TrainingPlan.baseline`; None without one).

    Args:
        scenario (Scenario): the model's talk-level figures (its link, for the link time).
        training (TrainingPlan): the step model's predictions.
        recommended (tuple | None): the recommended ``(factor, StepPrediction)``; None where
            nothing fits (today's run is then the search's recommended candidate).
        blocked (str | None): why offload cannot pay here, if it cannot.

    Returns:
        ScenarioSearch: one candidate per technique and micro-batch that fits, in
        :data:`~torch_fsdp_offload.planner.scenario_cost.TECHNIQUES` order.

    Example::

        >>> search = step_model_search(result.scenario, result.training, result.training.best, None)
        >>> [c.technique for c in search.candidates]
    """
    base = training.baseline()
    best: dict[tuple[str, float], tuple[float, StepPrediction]] = {}
    for fp in training.predictions:
        key = (technique_of(fp[1].config), fp[0])
        if fp[1].fits(training.capacity_bytes) and (key not in best or samples_per_s(fp) > samples_per_s(best[key])):
            best[key] = fp
    if recommended is not None:
        best[(technique_of(recommended[1].config), recommended[0])] = recommended

    def candidate(fp: tuple[float, StepPrediction]) -> Candidate:
        factor, p = fp
        moved_GB = (p.h2d_bytes + p.d2h_bytes) / 1e9
        return Candidate(
            technique=technique_of(p.config), microbatch_factor=factor, weights_fraction=p.config.module_fraction,
            activations_fraction=p.config.activations, checkpointing=p.config.checkpointing,
            gpu_memory_GB=(p.peak_gpu_bytes + p.allocation_slack_bytes) / 1e9, fits=p.fits(training.capacity_bytes),
            compute_time_s=p.step_s, link_time_s=moved_GB / scenario.link_GBps, required_link_GBps=moved_GB / p.step_s,
            iteration_time_s=p.step_s, link_bound=p.link_bound,
            throughput_gain=None if base is None else samples_per_s(fp) / samples_per_s(base) - 1.0,
        )

    candidates = tuple(candidate(best[key]) for key in sorted(best, key=lambda k: (TECHNIQUES.index(k[0]), k[1])))
    picked = candidate(recommended if recommended is not None else training.today())
    return ScenarioSearch(candidates=candidates, recommended=picked, blocked_reason=blocked)


def what_would_fit(breakdown: ModelBreakdown, platform: PlatformProfile, timing: BlockTiming | None,
                   training: TrainingPlan, **profile_kwargs: Any) -> str:
    """What would fit where no setting of the loop does: the largest smaller micro-batch that fits
    with more accumulation (the same sequences per optimizer step, its time in proportion to the
    timed one), else what is left to change.

    Args:
        breakdown (ModelBreakdown): the model at today's micro-batch.
        platform (PlatformProfile): the machine planned for.
        timing (BlockTiming | None): today's micro-batch timed, if it was.
        training (TrainingPlan): the plan in which nothing fits (its budget and loop).
        **profile_kwargs: passed to :func:`~torch_fsdp_offload.planner.training_profile.training_profile`.

    Returns:
        str: a clause to quote: the micro-batch and ``grad_accum_steps`` to plan, with the setting
        that fits and its memory; else a shorter sequence, more GPUs or more memory.

    Example::

        >>> what_would_fit(model_breakdown(config, batch_size=4, seq_len=2048), platform, None, training)
        'a micro-batch of 2 with 8 accumulated per step fits (batch_size=2, grad_accum_steps=8: ...'
    """
    batch, accumulated = breakdown.batch_size, training.grad_accum_steps
    split = 2
    while batch % split == 0:
        factor = 1 / split
        profile = training_profile(_scaled_breakdown(breakdown, factor), platform,
                                   timing=_scaled_timing(timing, factor), **profile_kwargs)
        _, best = search_training([(factor, profile)], platform, training.capacity_bytes, world_size=training.world_size,
                                  clipping=training.clipping, grad_accum_steps=accumulated)
        if best is not None:
            steps = best[1].config.grad_accum_steps
            return (
                f"a micro-batch of {batch // split} with {steps} accumulated per step fits (batch_size={batch // split}, "
                f"grad_accum_steps={steps}: the same {batch * accumulated} sequences per step): {best[1].config.label} "
                f"needs {training.needed_GiB(best):.1f} GiB with the allocator's headroom, {best[1].step_s:.3f} s per "
                "step predicted"
            )
        split *= 2
    return (
        "no smaller micro-batch of whole sequences fits with more accumulation either: plan a shorter sequence "
        "(seq_len=), shard over more GPUs (world_size=), or give it more GPU memory (a larger gpu_memory_GiB=, or "
        "a platform= with a larger GPU)"
    )


def _cast_reason(factor: float, prediction: StepPrediction, predictions: Sequence[tuple[float, StepPrediction]]) -> str:
    """Why the recommended setting casts on the GPU: its twin casting on the host, compared."""
    config = prediction.config
    if config.cast_on != "device":
        return ""
    twin = next((p for f, p in predictions if f == factor and p.config == dataclasses.replace(config, cast_on="host")), None)
    if twin is None:
        return ""
    return (
        f" cast_on='device': {'the host step binds this plan, and ' if twin.host_bound else ''}"
        f"casting the master on the GPU takes the cast off the host step "
        f"({prediction.host_optimizer_s:.3f} s of host work instead of {twin.host_optimizer_s:.3f}; "
        f"{twin.step_s:.3f} s per step with the cast on the host) for "
        f"{(prediction.h2d_bytes - twin.h2d_bytes) / 1e9:.1f} GB more copied in per step, and no pinned mirror."
    )


def _early_reason(factor: float, prediction: StepPrediction, predictions: Sequence[tuple[float, StepPrediction]]) -> str:
    """Why the recommended setting steps during backward: its twin keeping torch.optim's contract,
    compared."""
    config = prediction.config
    if not config.breaks_contract:
        return ""
    twin = next((p for f, p in predictions if f == factor and p.config == dataclasses.replace(config, step_during_backward=False)), None)
    against = "" if twin is None else f" ({prediction.step_s:.3f} s per step against {twin.step_s:.3f} s keeping it)"
    return (
        f" OffloadOptimizer(step_during_backward=True) is predicted faster by more than {OFFLOAD_MARGIN:.0%}{against}; "
        "it breaks torch.optim's contract: parameters and optimizer state change before step()."
    )


def _recommendation(training: TrainingPlan, picked: tuple[float, StepPrediction] | None,
                    blocked: str | None) -> Recommendation:
    """The recommendation of a real model's plan: ``picked`` (None: nothing fits, and it says what would)."""
    if picked is None:
        return Recommendation(
            technique="none", microbatch_factor=1.0, weights_offload_fraction=0.0, activations_offload_fraction=0.0,
            checkpointing=False, throughput_gain=None, kwargs=None, grad_accum_steps=training.grad_accum_steps,
            fits=False,
            reason=(f"nothing fits: no setting of the FSDP2 step model fits in GPU memory (the "
                    f"{training.capacity_bytes / 2**30:.1f} GiB budget per GPU; the least any needs is "
                    f"{training.needed_GiB(training.smallest()):.1f} GiB, {training.run_name(training.smallest())}); "
                    f"{training.what_would_fit}."),
        )
    factor, prediction = picked
    config = prediction.config
    n_blocks = training.profiles[0][1].n_blocks
    offloaded_blocks = len(config.offloaded_blocks(n_blocks))
    kwargs = config.coherent_offload_kwargs() if offloaded_blocks else None
    last_blocks = spread_fraction = None
    if 0 < offloaded_blocks < n_blocks:
        # Placement is per module: the policy goes on the blocks the step model offloads, the
        # last ones (the fastest placement for host steps) or those spread evenly.
        if config.block_placement == "last":
            last_blocks = (offloaded_blocks, n_blocks)
        else:
            spread_fraction = config.module_fraction
    base = training.baseline()
    what = f"do not offload: {blocked}; run" if blocked else (
        "do not offload: run" if config.module_fraction == config.activations == 0 else "use")
    steps = config.grad_accum_steps
    loop = f"{factor:g}x the micro-batch" + (f", {steps} micro-batches accumulated per step" if steps > 1 else "")
    gain = None if base is None else samples_per_s(picked) / samples_per_s(base) - 1.0
    versus = (f"{gain:+.0%} throughput over {training.run_name(base)}, which fits" if base is not None else
              f"no run fits without offloading ({training.run_name(training.today())} needs "
              f"{training.needed_GiB(training.today()):.1f} GiB), so no gain is quoted")
    predictions = training.predictions
    return Recommendation(
        technique="fsdp2_step_model",
        microbatch_factor=factor,
        weights_offload_fraction=config.module_fraction,
        activations_offload_fraction=config.activations,
        checkpointing=config.checkpointing,
        throughput_gain=gain,
        kwargs=kwargs,
        reason=(
            f"{what} {config.label} at {loop}{' with activation checkpointing' if config.checkpointing else ''}: "
            f"predicted {prediction.step_s:.3f} s per step, {training.needed_GiB(picked):.1f} GiB per GPU with the "
            f"allocator's headroom, within the {training.capacity_bytes / 2**30:.1f} GiB budget; {versus}."
            + _cast_reason(factor, prediction, predictions) + _early_reason(factor, prediction, predictions)
        ),
        predicted_step_s=prediction.step_s,
        predicted_peak_gpu_GiB=prediction.peak_gpu_GiB,
        last_blocks=last_blocks,
        spread_fraction=spread_fraction,
        keep_unsharded_last=config.keep_unsharded,
        optimizer_kwargs=config.offload_optimizer_kwargs(),
        grad_accum_steps=steps,
        baseline=None if base is None else training.run_name(base),
    )


def plan_model(
    model: Any,
    platform: PlatformProfile,
    *,
    batch_size: int,
    seq_len: int,
    microbatch_factors: Sequence[int],
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    measure: bool,
    not_measured: str,
    world_size: int,
    capacity_bytes: float,
    example_input: Any = None,
    blocks: Sequence[Any] | None = None,
    device: torch.device | None = None,
    clipping: bool = False,
    grad_accum_steps: int = 1,
) -> PlanResult:
    """:func:`~torch_fsdp_offload.planner.plan` of a real model: its memory broken down, its block
    timed where the model is (or its times estimated), the step model's grid searched over the
    user's loop, the recommendation, and where nothing fits what would.

    Args:
        model, platform, batch_size, seq_len, microbatch_factors, compute_dtype, reduce_dtype,
        world_size, example_input, blocks, device, clipping, grad_accum_steps: as
            :func:`~torch_fsdp_offload.planner.plan` (checked there); ``platform`` resolved,
            ``reduce_dtype`` the one FSDP reduces in, ``device`` a ``torch.device``.
        measure (bool): time the block on ``device``.
        not_measured (str): why nothing is timed where ``measure`` is False (the report's top).
        capacity_bytes (float): the budget per GPU.

    Returns:
        PlanResult: the plan.

    Raises:
        ValueError: one block at today's micro-batch does not fit in half of the free GPU memory;
            as :func:`~torch_fsdp_offload.planner.memory_breakdown.model_breakdown`.

    Example::

        >>> plan_model("anchor-1.6b", get_profile("h200-pcie"), batch_size=4, seq_len=2048, microbatch_factors=(1,),
        ...            compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, measure=False,
        ...            not_measured="platform= given", world_size=1, capacity_bytes=14 * 2**30).recommended.fits
        True
    """
    notes = []
    breakdown = model_breakdown(
        model, batch_size=batch_size, seq_len=seq_len, compute_dtype=compute_dtype, example_input=example_input, blocks=blocks
    )
    # With accumulation a larger micro-batch keeps the sequences per step: it must divide the count.
    factors = sorted({1, *(f for f in microbatch_factors if grad_accum_steps == 1 or grad_accum_steps % f == 0)})
    timings = None
    host_GBps = None
    host_rates = None
    if measure:
        try:
            timings = measure_block_timings(
                model, factors, example_input=example_input, batch_size=batch_size, seq_len=seq_len, blocks=blocks,
                device=device, compute_dtype=compute_dtype,
            )
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            # A block that cannot be run alone on the captured inputs: the FLOP count still can.
            not_measured = f"timing one block failed ({type(exc).__name__}: {exc})"
        if timings is not None and not timings:
            raise ValueError(
                f"one block at micro-batch {batch_size} x {seq_len} does not fit in half of the free GPU memory; "
                "plan a smaller micro-batch or pass platform= to predict analytically"
            )
    if timings:
        factors = factors[: len(timings)]
        timing_detail = (f"one block timed on {device} at micro-batch {', '.join(str(t.batch_size) for t in timings)}, "
                         "on the inputs the model's forward gave it")
        # The link can be kept busy only where there is one.
        host_rates = measure_host_step(link_busy=device.type == "cuda")
        if host_rates.link_busy_s_per_param is not None:
            host_GBps = host_GBps_from_link_busy(host_rates.link_busy_s_per_param)
            notes.append(
                f"host optimizer step measured here: {host_rates.alone_s_per_param * 1e9:.2f} ns per parameter alone, "
                f"{host_rates.link_busy_s_per_param * 1e9:.2f} with the link copying both ways "
                f"({host_rates.link_GBps_meanwhile:.0f} GB/s)"
            )
        else:
            notes.append(
                f"host optimizer step measured here: {host_rates.alone_s_per_param * 1e9:.2f} ns per parameter alone; "
                f"without a link to keep busy the step model keeps {platform.name}'s host rates"
            )
    else:
        timing_detail = (f"from FLOPs for {platform.name}, not measured: {not_measured}; micro-batch scaling is "
                         "assumed linear (no gain)")
        factors = [1]
    profile_kwargs = {"host_GBps": host_GBps, "host_rates": host_rates, "reduce_dtype": reduce_dtype}
    profiles = tuple(
        (float(f), training_profile(_scaled_breakdown(breakdown, f), platform,
                                    timing=None if timings is None else timings[i], **profile_kwargs))
        for i, f in enumerate(factors)
    )
    if world_size > 1:
        notes.append(
            f"per-GPU predictions for FSDP over {world_size} GPUs of one host (collectives at "
            f"{platform.gpu_interconnect_GBps:g} GB/s, one host DRAM for all host optimizer steps)"
        )
    if grad_accum_steps > 1:
        notes.append(
            f"{grad_accum_steps} micro-batches accumulated per step with FSDP's default, reducing each; "
            "set_requires_gradient_sync(False) would hold every block's unsharded gradients on the GPU "
            f"({breakdown.total_params * reduce_dtype.itemsize / 2**30:.1f} GiB more), which this plan does not count"
        )
    predictions, best = search_training(profiles, platform, capacity_bytes, world_size=world_size, clipping=clipping,
                                        grad_accum_steps=grad_accum_steps)
    training = TrainingPlan(
        profiles=profiles, predictions=tuple(predictions), best=best, capacity_bytes=capacity_bytes,
        world_size=world_size, grad_accum_steps=grad_accum_steps, clipping=clipping,
    )
    scenario = _talk_scenario(breakdown, platform, training, batch_size, seq_len)
    blocked = offload_blocked_reason(scenario)
    if blocked:
        # Where offload cannot pay, the fastest setting that fits without moving a byte.
        staying = [fp for fp in predictions if fp[1].fits(capacity_bytes) and fp[1].h2d_bytes + fp[1].d2h_bytes == 0]
        best = None if not staying else choose(staying, throughput=samples_per_s, bytes_moved=lambda fp: 0,
                                               checkpointing=lambda fp: fp[1].config.checkpointing)
        training = dataclasses.replace(training, best=best)
    if best is None:
        training = dataclasses.replace(
            training, what_would_fit=what_would_fit(breakdown, platform, None if timings is None else timings[0],
                                                    training, **profile_kwargs))
    recommendation = _recommendation(training, best, blocked)
    names = None
    if blocks is not None:
        names = tuple(block_names(model, blocks)) if isinstance(model, torch.nn.Module) else tuple(blocks)
    recommendation = dataclasses.replace(
        recommendation, micro_batch_size=round(batch_size * recommendation.microbatch_factor), block_names=names
    )
    return PlanResult(
        scenario=scenario, search=step_model_search(scenario, training, best, blocked), recommended=recommendation,
        training=training, notes=notes, timing="measured" if timings else "estimated",
        timing_reason=None if timings else not_measured, timing_detail=timing_detail,
    )


def _talk_scenario(breakdown: ModelBreakdown, platform: PlatformProfile, training: TrainingPlan, batch_size: int,
                   seq_len: int) -> Scenario:
    """The talk-level figures of a real model (its traffic and scaling, for steps 2-5), per GPU.

    Its memory terms hold what the step model counts: the gathered groups, the loss's transient and
    the allocator's headroom are in ``other``, so the scenario, reloaded, plans close to it."""
    base = training.profiles[0][1]
    world_size = training.world_size
    # The talk-level steps see one GPU, as the step model does: FSDP shards the parameters, grads
    # and optimizer state over world_size GPUs, each GPU holds its own micro-batch's activations,
    # and an iteration is the resident setting's predicted step (its shard's optimizer step).
    params = base.total_params / world_size
    resident_steps = [predict_step(p, TrainingConfig(), platform, world_size=world_size).step_s
                      for _, p in training.profiles]
    unsharded = 2 * base.block_params * base.compute_bytes + base.block_params * (base.compute_bytes + base.reduce_bytes)
    iteration = resident_steps[0]
    activations = base.n_blocks * base.block_activation_bytes + base.other_activation_bytes
    # Checkpointing every block keeps the block inputs, and one block's activations while it is
    # recomputed; it adds the recompute the breakdown counted.
    checkpointed = base.n_blocks * base.block_checkpoint_bytes + base.block_activation_bytes + base.other_activation_bytes
    accumulated = f", {training.grad_accum_steps} accumulated per step" if training.grad_accum_steps > 1 else ""
    return Scenario(
        name=f"{breakdown.name}, micro-batch {batch_size} x {seq_len}{accumulated}",
        weights_GB=params * base.param_bytes / 1e9,
        grads_GB=params * base.grad_bytes / 1e9,
        optimizer_state_GB=params * base.optimizer_state_bytes / 1e9,
        activations_GB=activations / 1e9,
        other_GB=(unsharded + base.loss_transient_bytes + base.loss_fp32_output_bytes) / 1e9,
        capacity_GB=training.capacity_bytes / 1e9,
        activations_to_dram_GB=activations / 1e9,
        iteration_time_s=iteration,
        microbatch_scaling=tuple((f, step / iteration) for (f, _), step in zip(training.profiles, resident_steps)),
        gpu_dram_GBps=platform.gpu_dram_GBps,
        link_GBps=platform.link_GBps,
        host_GBps=base.host_GBps,
        # Weights cross twice in the compute dtype (half the fp32 bytes); the optimizer runs where
        # its state lives, so the state itself does not cross.
        crossings={
            "weights": 2.0 * base.compute_bytes / base.param_bytes,
            "grads": 1.0,
            "optimizer_state": 0.0,
            "activations": 2.0,
        },
        n_blocks=base.n_blocks,
        platform=platform,
        checkpointing=Checkpointing(
            recompute_time_fraction=min(1.0, base.forward_s * base.recompute_fraction / iteration),
            activation_memory_fraction=min(1.0, checkpointed / activations),
        ),
    )
