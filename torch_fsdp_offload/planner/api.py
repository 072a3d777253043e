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
from torch_fsdp_offload.planner.memory_breakdown import map_tensors, model_breakdown
from torch_fsdp_offload.planner.model_plan import plan_model
from torch_fsdp_offload.planner.profiles import get_profile, measured_profile, PlatformProfile, process_memory_fraction
from torch_fsdp_offload.planner.report import PlanResult, Recommendation, candidate_kwargs, candidate_spread_fraction
from torch_fsdp_offload.planner.scenario import Scenario, load_scenario
from torch_fsdp_offload.planner.search import ScenarioSearch, search_scenario
from torch_fsdp_offload.planner.step_time import predict_step
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import fsdp2_reduce_dtype, training_profile

__all__ = ["NothingFitsError", "plan", "plan_and_shard", "predict_per_gpu"]

# Of the GPU's memory, what a step's peak may allocate: the rest for the CUDA context, NCCL and
# the allocator's fragmentation. A cap of torch.cuda.set_per_process_memory_fraction bounds the
# caching allocator alone (the context and NCCL's buffers live outside it), and the largest block's
# headroom is a part of every prediction: under a cap the whole cap is the budget.
_MEMORY_HEADROOM = 0.9


def _default_capacity_bytes(resolved: PlatformProfile, this_machine: bool, device: torch.device) -> float:
    capped = this_machine and process_memory_fraction(device) < 1.0
    return resolved.gpu_memory_GB * 1e9 * (1.0 if capped else _MEMORY_HEADROOM)


def _resolve_platform(platform: str | PlatformProfile | None) -> PlatformProfile:
    if isinstance(platform, PlatformProfile):
        return platform
    if isinstance(platform, str):
        return get_profile(platform)
    from torch_fsdp_offload.platform import detect_platform

    # This machine; without an accelerator its plan says there is nothing to offload.
    return measured_profile(detect_platform(bandwidth=torch.cuda.is_available()))


def _talk_recommendation(scenario: Scenario, search: ScenarioSearch) -> Recommendation:
    candidate, blocked = search.recommended, search.blocked_reason
    kwargs = candidate_kwargs(candidate)
    k = candidate.microbatch_factor
    base = search.baseline()
    gain = None if base is None else (1 + candidate.throughput_gain) / (1 + base.throughput_gain) - 1
    versus = "" if base is None else f"{gain:+.0%} throughput over {search.run_name(base)}"
    if not candidate.fits:
        bound = any(c.link_bound for c in search.candidates)
        reason = (
            f"nothing fits: today's run needs {candidate.gpu_memory_GB:.1f} GB of {scenario.capacity_GB:.1f} GB and "
            f"{'every plan that fits is link-bound (never recommended)' if bound else 'no plan fits'}; use more GPUs "
            "(shard further) or a smaller micro-batch."
        )
    elif candidate.technique == "none" and k == 1:
        reason = f"do not offload: {blocked}." if blocked else (
            "do not offload: no plan that fits in GPU memory beats today's run without the link becoming the bottleneck."
        )
    elif candidate.technique == "none":
        reason = f"run {k:g}x the micro-batch without offloading: {versus}."
    elif candidate.technique == "checkpointing":
        reason = f"use activation checkpointing per block and run {k:g}x the micro-batch: {versus}, no offload needed."
    else:
        parts = []
        if candidate.weights_fraction:
            parts.append(f"{candidate.weights_fraction:.0%} of the weights")
        if candidate.activations_fraction:
            parts.append(f"{candidate.activations_fraction:.0%} of the activations")
        checkpoint = "use activation checkpointing, " if candidate.checkpointing else ""
        reason = (
            f"{checkpoint}offload {' and '.join(parts)} and run {k:g}x the micro-batch: "
            f"{versus or 'no run fits without offloading, so no gain is quoted'}; the link stays hidden at "
            f"{candidate.required_link_GBps / scenario.link_GBps:.0%} "
            f"({candidate.required_link_GBps:.0f} of {scenario.link_GBps:.0f} GB/s)."
        )
    return Recommendation(
        technique=candidate.technique,
        microbatch_factor=k,
        weights_offload_fraction=candidate.weights_fraction,
        activations_offload_fraction=candidate.activations_fraction,
        checkpointing=candidate.checkpointing,
        throughput_gain=gain,
        kwargs=kwargs,
        reason=reason,
        spread_fraction=candidate_spread_fraction(candidate),
        baseline=None if base is None else search.run_name(base),
        fits=candidate.fits,
    )


def _talk_notes(scenario: Scenario, result_search: ScenarioSearch) -> list[str]:
    notes = []
    recommended = result_search.recommended
    bound = [c for c in result_search.candidates if c.link_bound and c.throughput_gain > recommended.throughput_gain + 1e-6]
    if bound and not result_search.blocked_reason and recommended.fits:
        best = max(bound, key=lambda c: c.throughput_gain)
        faster = (1 + best.throughput_gain) / (1 + recommended.throughput_gain) - 1
        notes.append(
            f"{best.technique} at {best.microbatch_factor:g}x predicts {faster:+.0%} over the recommendation but is "
            f"link-bound (needs {best.required_link_GBps:.0f} GB/s to hide): it pays only if the link really delivers "
            f"{scenario.link_GBps:.0f} GB/s, so it is not recommended"
        )
    return notes


def _plan_scenario(scenario: Scenario) -> PlanResult:
    search = search_scenario(scenario)
    recommendation = _talk_recommendation(scenario, search)
    return PlanResult(scenario=scenario, search=search, recommended=recommendation, notes=_talk_notes(scenario, search))


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
    grad_accum_steps: int = 1,
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
            model's forward gives it, at ``microbatch_factors`` times the micro-batch, wherever
            the model is (the CPU, a GPU, ``meta``): only a copy of the block moves (see
            :func:`~torch_fsdp_offload.planner.block_timing.measure_block_timings`).
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
            Default: 90% of the platform's memory (the rest for the CUDA context, NCCL and
            fragmentation), or, planning this machine under a cap
            (``torch.cuda.set_per_process_memory_fraction``), the whole cap: it bounds the caching
            allocator alone, and every prediction counts the allocator's headroom.
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
        grad_accum_steps (int): micro-batches the training loop accumulates per optimizer step,
            for a model (``TrainingConfig.grad_accum_steps``: FSDP reducing each micro-batch,
            resident gradients kept on the GPU throughout). The plan keeps the sequences per step:
            a larger micro-batch comes with fewer accumulated (``microbatch_factors`` that do not
            divide it are not tried), and where nothing fits it names a smaller micro-batch with
            more accumulation that does.

    Returns:
        PlanResult: ``.report()`` (text), ``.to_dict()`` (JSON), ``.plot(path)`` (PNG), and
        ``.recommended`` (a :class:`~torch_fsdp_offload.planner.report.Recommendation` with the
        ``CoherentOffload`` keyword arguments, ``.policy``, the ``micro_batch_size`` and
        ``grad_accum_steps`` to run and ``.apply(model)``), and ``.timing``: ``"measured"`` or
        ``"estimated"`` (from FLOPs; ``.timing_reason`` says why, as the report's first lines).

    Raises:
        ValueError: neither or both of ``model`` and ``scenario``; an unknown profile name, or a
            ``platform`` of another type; ``gpu_memory_GiB`` not a finite number above 0 (``inf``
            and ``nan`` included); with a scenario, a model's argument (``batch_size``,
            ``world_size``, ...); ``batch_size``, ``seq_len``, ``world_size`` or
            ``microbatch_factors`` or ``grad_accum_steps`` not ints >= 1, a ``compute_dtype`` /
            ``reduce_dtype`` that is no
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
        >>> print(plan(model, batch_size=4, grad_accum_steps=4, clipping=True, gpu_memory_GiB=24).report())
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
    return plan_model(
        model,
        resolved,
        batch_size=batch_size,
        seq_len=seq_len,
        microbatch_factors=microbatch_factors,
        compute_dtype=compute_dtype,
        reduce_dtype=fsdp2_reduce_dtype(MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)),
        measure=measure,
        not_measured=f"{why} (a plan for {resolved.name}, not this machine)" if why == "platform= given" else why,
        world_size=world_size,
        capacity_bytes=(_default_capacity_bytes(resolved, platform is None, device) if capacity_bytes is None
                        else capacity_bytes),
        example_input=example_input,
        blocks=blocks,
        device=device,
        clipping=clipping,
        grad_accum_steps=grad_accum_steps,
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
        NothingFitsError: the plan found no setting of the loop (``grad_accum_steps``,
            ``clipping``) that fits in GPU memory; the message says what would, and the plan is on
            the error's ``.result`` (a ``ValueError``).
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
    memory, before anything is sharded. Its message says what would fit, as the plan's report
    does (``result.training.what_would_fit``): a smaller micro-batch with more accumulation, or
    else a shorter sequence, more GPUs or more memory.

    Attributes:
        result (PlanResult): the plan: ``result.report()`` lists every setting with its peak.

    Example::

        >>> try:
        ...     plan_and_shard(model, example_input=batch, gpu_memory_GiB=1)
        ... except NothingFitsError as error:
        ...     print(error.result.report())
    """

    def __init__(self, result: PlanResult) -> None:
        training = result.training
        factor, smallest = training.smallest()
        super().__init__(
            f"plan_and_shard: no setting fits in the budget of {training.capacity_bytes / 2**30:.3g} GiB per GPU; the "
            f"smallest needs {training.needed_GiB((factor, smallest)):.3g} GiB: a predicted peak of "
            f"{smallest.peak_gpu_GiB:.3g} GiB and the allocator's headroom ({smallest.config.label} at {factor:g}x the "
            f"micro-batch). Nothing was sharded. What would fit: {training.what_would_fit}; this error's .result "
            "holds the plan (print(error.result.report()))"
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
