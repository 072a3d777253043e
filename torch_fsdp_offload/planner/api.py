"""``plan(...)``: should I offload, and how much?"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from torch_fsdp_offload.planner.arguments import (
    check_plan_and_shard_arguments, check_plan_arguments, check_positive_number, is_int,
)
from torch_fsdp_offload.planner.block_timing import measure_block_timings
from torch_fsdp_offload.host_step import host_GBps_from_link_busy, measure_host_step
from torch_fsdp_offload.planner.memory_breakdown import ModelBreakdown, block_names, map_tensors, model_breakdown
from torch_fsdp_offload.planner.profiles import PlatformProfile, get_profile, measured_profile
from torch_fsdp_offload.planner.report import (
    PlanResult, Recommendation, TrainingPlan, candidate_kwargs, candidate_spread_fraction,
)
from torch_fsdp_offload.planner.scenario import Checkpointing, Scenario, load_scenario
from torch_fsdp_offload.planner.scenario_cost import Candidate
from torch_fsdp_offload.planner.search import OFFLOAD_MARGIN, search_scenario, search_training
from torch_fsdp_offload.planner.step_time import predict_step, StepPrediction
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import fsdp2_reduce_dtype, training_profile

__all__ = ["NothingFitsError", "plan", "plan_and_shard", "predict_per_gpu"]

# Peak allocated memory must leave room for the CUDA context, NCCL and allocator fragmentation.
_MEMORY_HEADROOM = 0.9


def _resolve_platform(platform: str | PlatformProfile | None) -> PlatformProfile:
    if isinstance(platform, PlatformProfile):
        return platform
    if isinstance(platform, str):
        return get_profile(platform)
    from torch_fsdp_offload.platform import detect_platform

    # This machine; without an accelerator its plan says there is nothing to offload.
    return measured_profile(detect_platform(bandwidth=torch.cuda.is_available()))


def _talk_recommendation(scenario: Scenario, candidate: Candidate, blocked: str | None) -> Recommendation:
    kwargs = candidate_kwargs(candidate)
    k = candidate.microbatch_factor
    if not candidate.fits:
        reason = (
            f"nothing fits: today's run needs {candidate.gpu_memory_GB:.1f} GB of {scenario.capacity_GB:.1f} GB and no "
            "plan fits with the link hidden; use more GPUs (shard further) or a smaller micro-batch."
        )
    elif candidate.technique == "none" and k == 1:
        reason = f"do not offload: {blocked}." if blocked else (
            "do not offload: no plan that fits in GPU memory beats today's run without the link becoming the bottleneck."
        )
    elif candidate.technique == "none":
        reason = f"run {k:g}x the micro-batch without offloading: {candidate.throughput_gain:+.0%} throughput."
    elif candidate.technique == "checkpointing":
        reason = (
            f"use activation checkpointing per block and run {k:g}x the micro-batch: "
            f"{candidate.throughput_gain:+.0%} throughput, no offload needed."
        )
    else:
        parts = []
        if candidate.weights_fraction:
            parts.append(f"{candidate.weights_fraction:.0%} of the weights")
        if candidate.activations_fraction:
            parts.append(f"{candidate.activations_fraction:.0%} of the activations")
        checkpoint = "use activation checkpointing, " if candidate.checkpointing else ""
        reason = (
            f"{checkpoint}offload {' and '.join(parts)} and run {k:g}x the micro-batch: "
            f"{candidate.throughput_gain:+.0%} throughput; the link stays hidden at "
            f"{candidate.required_link_GBps / scenario.link_GBps:.0%} "
            f"({candidate.required_link_GBps:.0f} of {scenario.link_GBps:.0f} GB/s)."
        )
    return Recommendation(
        technique=candidate.technique,
        microbatch_factor=k,
        weights_offload_fraction=candidate.weights_fraction,
        activations_offload_fraction=candidate.activations_fraction,
        checkpointing=candidate.checkpointing,
        throughput_gain=candidate.throughput_gain,
        kwargs=kwargs,
        reason=reason,
        spread_fraction=candidate_spread_fraction(candidate),
    )


def _talk_notes(scenario: Scenario, result_search) -> list[str]:
    notes = []
    recommended = result_search.recommended
    bound = [c for c in result_search.candidates if c.link_bound and c.throughput_gain > recommended.throughput_gain + 1e-6]
    if bound and not result_search.blocked_reason:
        best = max(bound, key=lambda c: c.throughput_gain)
        notes.append(
            f"{best.technique} at {best.microbatch_factor:g}x predicts {best.throughput_gain:+.0%} but is link-bound "
            f"(needs {best.required_link_GBps:.0f} GB/s to hide): it pays only if the link really delivers "
            f"{scenario.link_GBps:.0f} GB/s, so it is not recommended"
        )
    return notes


def _plan_scenario(scenario: Scenario) -> PlanResult:
    search = search_scenario(scenario)
    recommendation = _talk_recommendation(scenario, search.recommended, search.blocked_reason)
    return PlanResult(scenario=scenario, search=search, recommended=recommendation, notes=_talk_notes(scenario, search))


def _scaled_breakdown(breakdown: ModelBreakdown, factor: int) -> ModelBreakdown:
    return dataclasses.replace(
        breakdown,
        batch_size=breakdown.batch_size * factor,
        block_activation_bytes=breakdown.block_activation_bytes * factor,
        block_checkpoint_bytes=breakdown.block_checkpoint_bytes * factor,
        other_activation_bytes=breakdown.other_activation_bytes * factor,
        loss_transient_bytes=breakdown.loss_transient_bytes * factor,
        loss_fp32_output_bytes=breakdown.loss_fp32_output_bytes * factor,
    )


def _plan_model(
    model: Any,
    platform: PlatformProfile,
    *,
    batch_size: int,
    seq_len: int,
    microbatch_factors: Sequence[int],
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    measure: bool,
    world_size: int,
    capacity_bytes: float | None,
    example_input: Any = None,
    blocks: Sequence[Any] | None = None,
    device: torch.device | None = None,
    clipping: bool = False,
) -> PlanResult:
    notes = []
    if capacity_bytes is None:
        capacity_bytes = platform.gpu_memory_GB * 1e9 * _MEMORY_HEADROOM
    breakdown = model_breakdown(
        model, batch_size=batch_size, seq_len=seq_len, compute_dtype=compute_dtype, example_input=example_input, blocks=blocks
    )
    factors = sorted({1, *microbatch_factors})
    timings = None
    host_GBps = None
    host_rates = None
    not_measured = "" if measure else "no GPU here, or platform= given"
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
        notes.append(
            f"times measured: one block timed on {device} at micro-batch "
            f"{', '.join(str(t.batch_size) for t in timings)}, on the inputs the model's forward gave it"
        )
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
        notes.append(
            f"times are estimated from FLOPs for {platform.name}, not measured: {not_measured}; micro-batch "
            "scaling is assumed linear (no gain); run on the GPU (or give a scenario) to measure it"
        )
        factors = [1]
    profiles = tuple(
        (
            float(f),
            training_profile(
                _scaled_breakdown(breakdown, f),
                platform,
                timing=None if timings is None else timings[i],
                host_GBps=host_GBps,
                host_rates=host_rates,
                reduce_dtype=reduce_dtype,
            ),
        )
        for i, f in enumerate(factors)
    )
    base = profiles[0][1]
    # The talk-level steps see one GPU, as the step model does: FSDP shards the parameters, grads
    # and optimizer state over world_size GPUs, each GPU holds its own micro-batch's activations,
    # and an iteration is the resident setting's predicted step (its shard's optimizer step).
    params = base.total_params / world_size
    resident_steps = [predict_step(p, TrainingConfig(), platform, world_size=world_size).step_s for _, p in profiles]
    unsharded = 2 * base.block_params * base.compute_bytes + base.block_params * (base.compute_bytes + base.reduce_bytes)
    iteration = resident_steps[0]
    activations = base.n_blocks * base.block_activation_bytes + base.other_activation_bytes
    # Checkpointing every block keeps the block inputs, and one block's activations while it is
    # recomputed; it adds the recompute the breakdown counted.
    checkpointed = base.n_blocks * base.block_checkpoint_bytes + base.block_activation_bytes + base.other_activation_bytes
    scenario = Scenario(
        name=f"{breakdown.name}, micro-batch {batch_size} x {seq_len}",
        weights_GB=params * base.param_bytes / 1e9,
        grads_GB=params * base.grad_bytes / 1e9,
        optimizer_state_GB=params * base.optimizer_state_bytes / 1e9,
        activations_GB=activations / 1e9,
        other_GB=unsharded / 1e9,
        capacity_GB=capacity_bytes / 1e9,
        activations_to_dram_GB=activations / 1e9,
        iteration_time_s=iteration,
        microbatch_scaling=tuple((f, step / iteration) for (f, _), step in zip(profiles, resident_steps)),
        gpu_dram_GBps=platform.gpu_dram_GBps,
        link_GBps=platform.link_GBps,
        host_GBps=host_GBps or platform.host_GBps,
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
    search = search_scenario(scenario)
    notes.extend(_talk_notes(scenario, search))
    capacity = capacity_bytes
    names = None
    if blocks is not None:
        names = tuple(block_names(model, blocks)) if isinstance(model, torch.nn.Module) else tuple(blocks)
    if world_size > 1:
        notes.append(
            f"per-GPU predictions for FSDP over {world_size} GPUs of one host (collectives at "
            f"{platform.gpu_interconnect_GBps:g} GB/s, one host DRAM for all host optimizer steps)"
        )
    predictions, best = search_training(profiles, platform, capacity, world_size=world_size, clipping=clipping)
    training = TrainingPlan(
        profiles=profiles, predictions=tuple(predictions), best=best, capacity_bytes=capacity, world_size=world_size
    )
    if search.blocked_reason or best is None:
        recommendation = _talk_recommendation(scenario, search.recommended, search.blocked_reason)
        if best is None:
            notes.append("no setting of the FSDP2 step model fits in GPU memory: use more GPUs or a smaller micro-batch")
    else:
        factor, prediction = best
        config = prediction.config
        resident = [p for f, p in predictions if f == 1 and p.config.module_fraction == 0 and p.config.activations == 0 and not p.config.checkpointing][0]
        gain = factor * resident.step_s / prediction.step_s - 1.0
        kwargs = config.coherent_offload_kwargs()
        what = "do not offload" if config.module_fraction == config.activations == 0 else f"use {config.label}"
        n_blocks = profiles[0][1].n_blocks
        offloaded_blocks = len(config.offloaded_blocks(n_blocks))
        last_blocks = spread_fraction = None
        if offloaded_blocks == 0:
            kwargs = None
        elif offloaded_blocks < n_blocks:
            # Placement is per module: the policy goes on the blocks the step model offloads, the
            # last ones (the fastest placement for host steps) or those spread evenly.
            if config.block_placement == "last":
                last_blocks = (offloaded_blocks, n_blocks)
            else:
                spread_fraction = config.module_fraction
        recommendation = Recommendation(
            technique="fsdp2_step_model",
            microbatch_factor=factor,
            weights_offload_fraction=config.module_fraction,
            activations_offload_fraction=config.activations,
            checkpointing=config.checkpointing,
            throughput_gain=gain,
            kwargs=kwargs,
            reason=(
                f"{what} at {factor:g}x the micro-batch{' with activation checkpointing' if config.checkpointing else ''}: "
                f"predicted {prediction.step_s:.3f} s per step, {prediction.peak_gpu_GiB:.1f} GiB peak per GPU, "
                f"{gain:+.0%} throughput over today's resident run." + _cast_reason(factor, prediction, predictions)
                + _early_reason(factor, prediction, predictions)
            ),
            predicted_step_s=prediction.step_s,
            predicted_peak_gpu_GiB=prediction.peak_gpu_GiB,
            last_blocks=last_blocks,
            spread_fraction=spread_fraction,
            keep_unsharded_last=config.keep_unsharded,
            optimizer_kwargs=config.offload_optimizer_kwargs(),
        )
    recommendation = dataclasses.replace(
        recommendation, micro_batch_size=round(batch_size * recommendation.microbatch_factor), block_names=names
    )
    return PlanResult(
        scenario=scenario, search=search, recommended=recommendation, training=training, notes=notes,
        timing="measured" if timings else "estimated",
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


def plan(
    model: Any = None,
    *,
    scenario: str | os.PathLike | Mapping[str, Any] | Scenario | None = None,
    platform: str | PlatformProfile | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    microbatch_factors: Sequence[int] = (1, 2, 4, 8),
    compute_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    measure: bool | None = None,
    world_size: int = 1,
    gpu_memory_GiB: float | None = None,
    example_input: Any = None,
    blocks: Sequence[Any] | None = None,
    device: torch.device | str | None = None,
    clipping: bool = False,
) -> PlanResult:
    """Decide whether offloading pays, and how much to offload, following the talk's framework:
    memory breakdown, iteration time, the model's own DRAM bandwidth against peak, the link
    bandwidth naive offloading would need, what a larger micro-batch gains, partial offload that
    keeps the link hidden, and activation checkpointing.

    Args:
        model: a real model: an ``nn.Module`` (a transformers model, a module whose blocks sit in
            an ``nn.ModuleList``, a built-in transformer), a built-in name such as
            ``"anchor-1.6b"``, a transformers config name, a
            :class:`~torch_fsdp_offload.models.TransformerConfig`, or a module factory. Its memory
            is broken down on the ``meta`` device; on a GPU one block is timed on the inputs the
            model's forward gives it, at ``microbatch_factors`` times the micro-batch.
        scenario: instead of a model, an analytic scenario (JSON path, mapping or
            :class:`~torch_fsdp_offload.planner.scenario.Scenario`) for a machine not at hand.
        platform: a built-in profile name (``h100-pcie``, ``h100-sxm``, ``h200-pcie``, ``gh200``,
            ``gb200``, ``dgx-spark``) or a :class:`PlatformProfile`. Default: this machine, measured
            (its memory as this process may use it); without an accelerator the plan is "do not
            offload". With a scenario it replaces the scenario's platform kind (explicit scenario
            bandwidths still win).
        batch_size (int | None): today's micro-batch (sequences), for a model (default 1, or the
            first dimension of ``example_input``).
        seq_len (int | None): tokens per sequence, for a model (default 2048, or the second
            dimension of ``example_input``).
        microbatch_factors: micro-batch multiples to time, for a model.
        compute_dtype (torch.dtype): forward dtype (``MixedPrecisionPolicy.param_dtype``), for a model.
        reduce_dtype (torch.dtype | None): ``MixedPrecisionPolicy.reduce_dtype``, for a model: the
            dtype the reduce-scatter moves. None counts what this torch does without one
            (:func:`~torch_fsdp_offload.planner.training_profile.fsdp2_reduce_dtype`: the compute
            dtype through torch 2.14, the fp32 master's from 2.15).
        measure (bool | None): time the block on the GPU (default: when CUDA is available and
            ``platform`` is not given, i.e. the plan is for this machine).
        world_size (int): GPUs of one host FSDP shards over, for a model; every figure of the plan
            is per GPU (sharded state, all-gathers and reduce-scatters, a shared host).
        gpu_memory_GiB (float | None): the GPU memory the step's peak must fit in: a budget below
            the GPU's (room kept for something else, or a smaller GPU than the profile's).
            Default: 90% of the platform's memory, or of this process's cap
            (``torch.cuda.set_per_process_memory_fraction``) when planning this machine (the rest for
            the CUDA context, NCCL and fragmentation).
        example_input: what the model is called with, where it takes no ``(batch, seq)`` token ids:
            a tensor (hidden states ``(batch, seq, dim)``, say), a tuple of arguments or a mapping
            of keyword arguments; the first tensor's first two dimensions are the micro-batch and
            the sequence.
        blocks: the model's blocks in forward order, as modules of ``model`` or qualified names
            (default: :func:`~torch_fsdp_offload.models.find_blocks`); ``.recommended.apply``
            shards the same ones.
        device: where ``measure`` times (default ``"cuda"``; ``"cpu"`` runs the same measurement
            on the CPU, whose times say nothing about a GPU: for tests).
        clipping (bool): the training loop clips the gradients to a global norm
            (``OffloadOptimizer(max_grad_norm=...)`` or ``clip_grad_norm_``), for a model: host
            steps then start after the whole backward (``TrainingConfig.clipping``).

    Returns:
        PlanResult: ``.report()`` (text), ``.to_dict()`` (JSON), ``.plot(path)`` (PNG), and
        ``.recommended`` (a :class:`~torch_fsdp_offload.planner.report.Recommendation` with the
        ``CoherentOffload`` keyword arguments, ``.policy``, the ``micro_batch_size`` to run and
        ``.apply(model)``), and ``.timing``: ``"measured"`` or ``"estimated"`` (from FLOPs; a note
        says why).

    Raises:
        ValueError: neither or both of ``model`` and ``scenario``; an unknown profile name, or a
            ``platform`` of another type; ``gpu_memory_GiB`` not a finite number above 0 (``inf``
            and ``nan`` included); with a scenario, a model's argument (``batch_size``,
            ``world_size``, ...); ``batch_size``, ``seq_len``, ``world_size`` or
            ``microbatch_factors`` not ints >= 1, a ``compute_dtype`` / ``reduce_dtype`` that is no
            floating-point ``torch.dtype``, ``measure`` or ``clipping`` not a bool
            (:func:`~torch_fsdp_offload.planner.arguments.check_plan_arguments`); ``batch_size`` or
            ``seq_len`` other than ``example_input``'s; ``example_input`` holding floating-point
            values where the model takes token ids (an ``nn.Embedding``); ``blocks`` that are not
            the model's, or not in the order it registers them; ``device`` naming no device, or
            given where nothing is measured (``platform=`` given, ``measure=False``, no GPU).
        ScenarioError: a malformed scenario (the message names the key).

    Example::

        >>> result = plan(scenario="docs/examples/talk_gh200.json")
        >>> result.recommended.weights_offload_fraction, round(result.recommended.throughput_gain, 2)
        (0.35, 0.4)
        >>> print(plan("anchor-1.6b", platform="h200-pcie", batch_size=4).report())
        >>> plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=14).recommended.kwargs
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=4))
        >>> plan(model, batch_size=2, seq_len=4096).recommended.apply(model, mp_policy=mp)  # on a GPU
    """
    check_plan_arguments(dict(locals()), {name: p.default for name, p in inspect.signature(plan).parameters.items()})
    capacity_bytes = None if gpu_memory_GiB is None else gpu_memory_GiB * 2**30
    if scenario is not None:
        loaded = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
        if platform is not None:
            loaded = dataclasses.replace(loaded, platform=_resolve_platform(platform))
        if capacity_bytes is not None:
            loaded = dataclasses.replace(loaded, capacity_GB=capacity_bytes / 1e9)
        return _plan_scenario(loaded)
    batch_size, seq_len = _micro_batch(example_input, batch_size, seq_len)
    if batch_size < 1 or seq_len < 1 or any(f < 1 for f in microbatch_factors):
        raise ValueError(
            f"batch_size, seq_len and microbatch_factors must be >= 1, got {batch_size}, {seq_len}, {list(microbatch_factors)}"
        )
    why = "measure=False" if measure is False else "platform= given" if platform is not None else "no CUDA GPU here"
    if measure is None:
        measure = torch.cuda.is_available() and platform is None
    if device is not None and not measure:
        raise ValueError(
            f"device={device!r} says where measure= times, but nothing is measured ({why}): pass measure=True to "
            "time on it, or drop device="
        )
    device = torch.device(device if device is not None else "cuda")
    if measure and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("measure=True needs a CUDA GPU; pass platform= to predict for another machine")
    resolved = _resolve_platform(platform)
    return _plan_model(
        model,
        resolved,
        batch_size=batch_size,
        seq_len=seq_len,
        microbatch_factors=microbatch_factors,
        compute_dtype=compute_dtype,
        reduce_dtype=fsdp2_reduce_dtype(MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)),
        measure=measure,
        world_size=world_size,
        capacity_bytes=capacity_bytes,
        example_input=example_input,
        blocks=blocks,
        device=device,
        clipping=clipping,
    )


#: Tokens per sequence where neither ``seq_len`` nor an example input gives them.
DEFAULT_SEQ_LEN = 2048


def _micro_batch(example_input: Any, batch_size: int | None, seq_len: int | None) -> tuple[int, int]:
    """(batch, sequence): the given ones, or the first two dimensions of the example's first tensor."""
    if example_input is None:
        return (1 if batch_size is None else batch_size), (DEFAULT_SEQ_LEN if seq_len is None else seq_len)
    shapes: list[torch.Size] = []
    map_tensors(example_input, lambda tensor: shapes.append(tensor.shape) or tensor)
    if not shapes or len(shapes[0]) < 1:
        raise ValueError("example_input holds no tensor with a batch dimension; pass the tensor(s) the model is called with")
    shape = shapes[0]
    found = (shape[0], shape[1] if len(shape) > 1 else 1)
    for name, given, value in (("batch_size", batch_size, found[0]), ("seq_len", seq_len, found[1])):
        if given is not None and given != value:
            raise ValueError(
                f"{name}={given} differs from example_input's {value} (its shape is {tuple(shape)}); "
                f"drop {name} or pass an example of that size"
            )
    return found


def plan_and_shard(
    model: torch.nn.Module,
    *,
    example_input: Any = None,
    blocks: Sequence[Any] | None = None,
    fully_shard_kwargs: Mapping[str, Any] | None = None,
    **plan_kwargs: Any,
) -> PlanResult:
    """Plan ``model`` and shard it as planned, in one call: :func:`plan`, then
    ``.recommended.apply(model)`` (offloaded and unsharded blocks, the policy's cast and optimizer
    placement, activation offload and activation checkpointing).

    Args:
        model (nn.Module): the model, not yet sharded.
        example_input: what the model is called with (see :func:`plan`).
        blocks: its blocks in forward order (default: found).
        fully_shard_kwargs (Mapping | None): passed to every ``fully_shard`` call (``mesh``,
            ``mp_policy``, ...), never ``offload_policy``. Its ``mp_policy`` gives the plan's
            ``compute_dtype`` and ``reduce_dtype`` where ``plan_kwargs`` do not.
        **plan_kwargs: :func:`plan`'s other arguments (``platform``, ``batch_size``, ``seq_len``,
            ``gpu_memory_GiB``, ...).

    Returns:
        PlanResult: the plan; ``model`` is sharded, and ``.recommended.micro_batch_size`` is the
        micro-batch to train with.

    Raises:
        NothingFitsError: the plan found no setting that fits in GPU memory; it is on the error's
            ``.result`` (a ``ValueError``).
        ValueError: as :func:`plan` (a ``gpu_memory_GiB``, ``batch_size``, ``microbatch_factors``
            or ``compute_dtype`` of the wrong type or out of range, ``example_input`` holding
            floating-point values where the model takes token ids, ``blocks`` out of forward order)
            and :meth:`~torch_fsdp_offload.planner.report.Recommendation.apply`; a model that is
            already sharded (or one of its modules); ``offload_policy`` in ``fully_shard_kwargs``.
        TypeError: ``model`` is no ``nn.Module``; ``fully_shard_kwargs`` is no mapping, or holds a
            name ``fully_shard`` does not take (a typo is refused with the closest name) or a
            ``mesh`` / ``mp_policy`` of another type.

        Every refusal comes before anything is sharded: the model is left as it was.

    Example::

        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=4))
        >>> result = plan_and_shard(model, batch_size=2, seq_len=4096, fully_shard_kwargs={"mp_policy": mp})
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
        >>> result.recommended.micro_batch_size
    """
    check_plan_and_shard_arguments(model, fully_shard_kwargs)
    mp_policy = (fully_shard_kwargs or {}).get("mp_policy")
    if mp_policy is not None:
        # Plan what FSDP will run: its compute dtype and the dtype it reduces in on this torch.
        plan_kwargs.setdefault("compute_dtype", mp_policy.param_dtype or torch.float32)
        plan_kwargs.setdefault("reduce_dtype", fsdp2_reduce_dtype(mp_policy))
    result = plan(model, example_input=example_input, blocks=blocks, **plan_kwargs)
    if result.training is not None and result.training.best is None:
        raise NothingFitsError(result)
    result.recommended.apply(model, blocks=blocks, **dict(fully_shard_kwargs or {}))
    return result


class NothingFitsError(ValueError):
    """Raised by :func:`plan_and_shard` when its plan found no setting whose step fits in GPU
    memory, before anything is sharded.

    Attributes:
        result (PlanResult): the plan: ``result.report()`` lists every setting with its peak.

    Example::

        >>> try:
        ...     plan_and_shard(model, example_input=batch, gpu_memory_GiB=1)
        ... except NothingFitsError as error:
        ...     print(error.result.report())
    """

    def __init__(self, result: PlanResult) -> None:
        factor, smallest = min(result.training.predictions, key=lambda prediction: prediction[1].peak_gpu_GiB)
        super().__init__(
            f"plan_and_shard: no setting fits in the budget of {result.training.capacity_bytes / 2**30:.3g} GiB per "
            f"GPU; the smallest predicted peak is {smallest.peak_gpu_GiB:.3g} GiB ({smallest.config.label} at "
            f"{factor:g}x the micro-batch). Nothing was sharded. Plan a smaller micro-batch (batch_size=, seq_len=), "
            "shard over more GPUs (world_size=), or give it more GPU memory (a larger gpu_memory_GiB=, or a "
            "platform= with a larger GPU); this error's .result holds the plan (print(error.result.report()))"
        )
        self.result = result


def _offload_config(offload: bool | float | TrainingConfig | None) -> TrainingConfig:
    if isinstance(offload, TrainingConfig):
        return offload
    if offload is None or offload is False:
        return TrainingConfig()
    if offload is True:
        return TrainingConfig(module_fraction=1.0, prefetch_depth=2)
    if isinstance(offload, (int, float)):
        return TrainingConfig(module_fraction=float(offload), prefetch_depth=2)
    raise TypeError(f"offload must be a bool, a module fraction or a TrainingConfig, got {type(offload).__name__}")


def predict_per_gpu(
    model: Any,
    *,
    world_size: int = 1,
    batch_size: int = 1,
    seq_len: int = 2048,
    offload: bool | float | TrainingConfig | None = False,
    platform: str | PlatformProfile = "h200-pcie",
    host_GBps: float | None = None,
    gpu_memory_GiB: float | None = None,
) -> dict[str, Any]:
    """Predict one FSDP2 training step per GPU, analytically (no GPU needed).

    For benchmarks that compare resident and offloaded training at a growing micro-batch
    (``benchmarks/multi_gpu.py``): call it for each ``(batch_size, offload)`` and keep the fastest
    that fits. Times come from the model's FLOPs at the platform's bf16 peak (65% achieved), sizes
    from its meta-device breakdown, the host optimizer from ``host_GBps``.

    Args:
        model: a built-in model name, a :class:`~torch_fsdp_offload.models.TransformerConfig`, a
            transformers config name, or a module factory (see :func:`plan`).
        world_size (int): GPUs of one host that FSDP shards over.
        batch_size (int): sequences per GPU per step.
        seq_len (int): tokens per sequence.
        offload: ``False``/``None`` (resident), ``True`` (every block offloaded, host optimizer,
            ``prefetch_depth=2``), a module fraction, or a :class:`TrainingConfig`.
        platform: a profile name or :class:`PlatformProfile` (measured figures replace a profile's
            with ``dataclasses.replace``).
        host_GBps (float | None): host optimizer bandwidth (default: the platform's).
        gpu_memory_GiB (float | None): memory the peak must fit in (default: 90% of the platform's).

    Returns:
        dict: ``step_s``, ``tokens_per_s_per_gpu``, ``peak_gpu_GiB``, ``fits``, ``link_bound``,
        ``host_bound``, ``forward_s``, ``backward_s``, ``optimizer_s``, ``h2d_GB``, ``d2h_GB``,
        ``config`` (label), ``batch_size``, ``world_size``, ``platform``.

    Raises:
        ValueError: ``world_size``, ``batch_size`` or ``seq_len`` not an int >= 1; ``host_GBps``
            or ``gpu_memory_GiB`` not a finite number above 0; an unknown profile.
        TypeError: an ``offload`` of another type.

    Example::

        >>> from torch_fsdp_offload.models import TransformerConfig
        >>> llama_8b = TransformerConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ...                              ffn_hidden=14336, max_seq_len=8192, rope_theta=500000.0)
        >>> predict_per_gpu(llama_8b, world_size=2, batch_size=4, offload=True)["tokens_per_s_per_gpu"]
    """
    for name, value in (("world_size", world_size), ("batch_size", batch_size), ("seq_len", seq_len)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_positive_number("host_GBps", host_GBps, "the host optimizer's bandwidth in GB/s")
    check_positive_number("gpu_memory_GiB", gpu_memory_GiB, "the GiB the step's peak must fit in")
    config = _offload_config(offload)
    resolved = _resolve_platform(platform)
    breakdown = model_breakdown(model, batch_size=batch_size, seq_len=seq_len)
    profile = training_profile(breakdown, resolved, host_GBps=host_GBps)
    prediction = predict_step(profile, config, resolved, world_size=world_size)
    capacity = gpu_memory_GiB * 2**30 if gpu_memory_GiB is not None else resolved.gpu_memory_GB * 1e9 * _MEMORY_HEADROOM
    return {
        "config": config.label,
        "batch_size": batch_size,
        "world_size": world_size,
        "platform": resolved.name,
        "step_s": prediction.step_s,
        "forward_s": prediction.forward_s,
        "backward_s": prediction.backward_s,
        "optimizer_s": prediction.optimizer_s,
        "tokens_per_s_per_gpu": batch_size * seq_len / prediction.step_s,
        "peak_gpu_GiB": prediction.peak_gpu_GiB,
        "fits": prediction.fits(capacity),
        "link_bound": prediction.link_bound,
        "host_bound": prediction.host_bound,
        "h2d_GB": prediction.h2d_bytes / 1e9,
        "d2h_GB": prediction.d2h_bytes / 1e9,
    }
