"""The scenario-level cost model: GPU memory, compute time and link time of one offload plan.

A :class:`~torch_fsdp_offload.planner.scenario.Scenario` (a workload measured as a whole: its memory
breakdown, iteration time and micro-batch scaling) and one candidate (micro-batch factor, fraction
of weights or activations offloaded, checkpointing) give the GPU memory the plan needs, its
compute and link times and the throughput gain. The principle is FlexGen's: the time is the
slowest of the overlapped streams; the memory is what stays resident.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch_fsdp_offload.planner.scenario import Scenario

__all__ = [
    "Candidate",
    "TECHNIQUES",
    "evaluate",
    "model_dram_bandwidth_GBps",
    "naive_offload_GB",
    "offload_window",
    "time_factor",
]

# Offload techniques in order of preference when two give the same throughput: weights move in a
# known order and can be prefetched far ahead; activations must go down during forward.
TECHNIQUES = ("none", "offload_weights", "offload_activations", "checkpointing", "checkpointing+offload_weights")
_OFFLOADING = {"offload_weights": "weights", "offload_activations": "activations", "checkpointing+offload_weights": "weights"}


@dataclass(frozen=True)
class Candidate:
    """One evaluated plan of the talk-level model.

    Attributes:
        technique (str): one of :data:`TECHNIQUES`.
        microbatch_factor (float): micro-batch relative to today's.
        weights_fraction (float): fraction of the weights (with their grads and optimizer state)
            kept in host memory.
        activations_fraction (float): fraction of the activations kept in host memory.
        checkpointing (bool): activation checkpointing on.
        gpu_memory_GB (float): GPU memory the plan needs.
        fits (bool): ``gpu_memory_GB`` is within the capacity.
        compute_time_s (float): iteration time on the GPU alone.
        link_time_s (float): time the link needs for the offload traffic of one iteration.
        required_link_GBps (float): link bandwidth that would hide the traffic completely.
        iteration_time_s (float): ``max(compute_time_s, link_time_s)``.
        throughput_gain (float | None): samples per second relative to today's run, minus 1 (for
            a real model's plan, to its baseline run; None without one: see
            :func:`~torch_fsdp_offload.planner.model_plan.step_model_search`).
        link_bound (bool): the link, not the GPU, sets the iteration time.
    """

    technique: str
    microbatch_factor: float
    weights_fraction: float
    activations_fraction: float
    checkpointing: bool
    gpu_memory_GB: float
    fits: bool
    compute_time_s: float
    link_time_s: float
    required_link_GBps: float
    iteration_time_s: float
    throughput_gain: float | None
    link_bound: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def time_factor(scenario: Scenario, factor: float) -> float:
    """Iteration-time multiplier at ``factor`` times the micro-batch.

    Between measured points the time is interpolated linearly; beyond the largest it grows in
    proportion to the micro-batch (no further efficiency gain is assumed).
    """
    points = scenario.microbatch_scaling
    if factor <= points[0][0]:
        return points[0][1] * factor / points[0][0]
    for (f0, t0), (f1, t1) in zip(points, points[1:]):
        if factor <= f1:
            return t0 + (t1 - t0) * (factor - f0) / (f1 - f0)
    last_factor, last_time = points[-1]
    return last_time * factor / last_factor


def model_dram_bandwidth_GBps(scenario: Scenario) -> float:
    """GPU DRAM bandwidth the model itself uses: the measured figure if the scenario has one, else
    ``(weights + 2 * activations_to_dram + 2 * grads + 2 * optimizer_state) / iteration_time``
    (weights read once, activations written and read back, grads and optimizer state read and
    written once by the optimizer)."""
    if scenario.model_dram_GBps is not None:
        return scenario.model_dram_GBps
    traffic = (
        scenario.weights_GB
        + 2 * scenario.activations_to_dram_GB
        + 2 * scenario.grads_GB
        + 2 * scenario.optimizer_state_GB
    )
    return traffic / scenario.iteration_time_s


def naive_offload_GB(scenario: Scenario) -> float:
    """Link traffic per iteration if every weight (with its grad and optimizer state) lived on the host."""
    crossings = scenario.crossings
    return (
        crossings["weights"] * scenario.weights_GB
        + crossings["grads"] * scenario.grads_GB
        + crossings["optimizer_state"] * scenario.optimizer_state_GB
    )


def _module_state_GB(scenario: Scenario) -> float:
    return scenario.weights_GB + scenario.grads_GB + scenario.optimizer_state_GB


def _activation_GB(scenario: Scenario, factor: float, checkpointing: bool) -> float:
    kept = scenario.checkpointing.activation_memory_fraction if checkpointing else 1.0
    return scenario.activations_GB * factor * kept


def _compute_time(scenario: Scenario, factor: float, checkpointing: bool) -> float:
    recompute = scenario.checkpointing.recompute_time_fraction if checkpointing else 0.0
    return scenario.iteration_time_s * time_factor(scenario, factor) * (1.0 + recompute)


def evaluate(
    scenario: Scenario,
    technique: str,
    microbatch_factor: float,
    *,
    weights_fraction: float = 0.0,
    activations_fraction: float = 0.0,
) -> Candidate:
    """Evaluate one plan with the talk-level model.

    Args:
        scenario (Scenario): the workload and machine.
        technique (str): one of :data:`TECHNIQUES` (``"checkpointing..."`` turns checkpointing on).
        microbatch_factor (float): micro-batch relative to today's.
        weights_fraction (float): fraction of weights (and their grads / optimizer state) offloaded.
        activations_fraction (float): fraction of activations offloaded.

    Returns:
        Candidate: memory, times and the throughput gain over today's run.

    Raises:
        ValueError: unknown technique, or a fraction outside [0, 1].

    Example::

        >>> evaluate(scenario, "offload_weights", 2, weights_fraction=0.35).throughput_gain
    """
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; choose one of {TECHNIQUES}")
    for name, value in (("weights_fraction", weights_fraction), ("activations_fraction", activations_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    checkpointing = technique.startswith("checkpointing")
    activations = _activation_GB(scenario, microbatch_factor, checkpointing)
    memory = (
        _module_state_GB(scenario) * (1.0 - weights_fraction)
        + activations * (1.0 - activations_fraction)
        + scenario.other_GB
    )
    compute = _compute_time(scenario, microbatch_factor, checkpointing)
    traffic = weights_fraction * naive_offload_GB(scenario) + (
        activations_fraction * scenario.crossings["activations"] * activations
    )
    link_time = traffic / scenario.link_GBps
    iteration = max(compute, link_time)
    return Candidate(
        technique=technique,
        microbatch_factor=microbatch_factor,
        weights_fraction=weights_fraction,
        activations_fraction=activations_fraction,
        checkpointing=checkpointing,
        gpu_memory_GB=memory,
        fits=memory <= scenario.capacity_GB * (1 + 1e-9),
        compute_time_s=compute,
        link_time_s=link_time,
        required_link_GBps=traffic / compute,
        iteration_time_s=iteration,
        throughput_gain=microbatch_factor * scenario.iteration_time_s / iteration - 1.0,
        link_bound=link_time > compute * (1 + 1e-9),
    )


def offload_window(scenario: Scenario, technique: str, microbatch_factor: float) -> tuple[float, float]:
    """The offloaded fractions that work for ``technique`` at ``microbatch_factor``.

    Returns:
        ``(lowest, highest)``: offloading less than ``lowest`` does not fit in GPU memory; more than
        ``highest`` makes the link the bottleneck. ``lowest > highest`` means every plan that fits
        is link-bound; ``lowest > 1`` means nothing fits.
    """
    checkpointing = technique.startswith("checkpointing")
    activations = _activation_GB(scenario, microbatch_factor, checkpointing)
    kind = _OFFLOADING[technique]
    if kind == "weights":
        movable, fixed = _module_state_GB(scenario), activations + scenario.other_GB
        traffic_per_unit = naive_offload_GB(scenario)
    else:
        movable, fixed = activations, _module_state_GB(scenario) + scenario.other_GB
        traffic_per_unit = scenario.crossings["activations"] * activations
    excess = movable + fixed - scenario.capacity_GB
    lowest = 0.0 if excess <= 0 else (math.inf if movable == 0 else excess / movable)
    budget = scenario.link_GBps * _compute_time(scenario, microbatch_factor, checkpointing)
    highest = 1.0 if traffic_per_unit == 0 else min(1.0, budget / traffic_per_unit)
    return lowest, highest
