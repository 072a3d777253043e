"""Cost models: how long an iteration takes and how much GPU memory it needs under an offload plan.

Two levels, one principle (FlexGen's: time = the slowest of the overlapped streams plus what
cannot be hidden; memory = what stays resident plus what is in flight):

* the talk level (:func:`evaluate`): a :class:`~torch_fsdp_offload.planner.scenario.Scenario`
  and one candidate (micro-batch factor, fraction of weights / activations offloaded,
  checkpointing) give GPU memory, compute time, link time and the throughput gain;
* the FSDP2 training level (:func:`predict_step`): a :class:`TrainingProfile` of a real model and
  a :class:`TrainingConfig` (the ``CoherentOffload`` knobs) give the step time and peak GPU memory,
  with forward, backward and optimizer phases and their copy streams modelled separately.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch_fsdp_offload.activations import DEFAULT_MAX_INFLIGHT_BYTES
from torch_fsdp_offload.optim import _STREAM_RUN_BYTES, _STREAM_RUNS_IN_FLIGHT
from torch_fsdp_offload.planner.profiles import PlatformProfile
from torch_fsdp_offload.planner.scenario import Scenario
from torch_fsdp_offload.policy import _CAST_PLACEMENTS, spread_group_offloaded

__all__ = [
    "Candidate",
    "StepPrediction",
    "TECHNIQUES",
    "TrainingConfig",
    "TrainingProfile",
    "copy_in_bytes_per_param",
    "evaluate",
    "host_step_bytes_per_param",
    "host_step_seconds_per_param",
    "model_dram_bandwidth_GBps",
    "naive_offload_GB",
    "offload_window",
    "phase_peaks",
    "predict_step",
    "shared_dram_host_seconds",
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
        throughput_gain (float): samples per second relative to today's run, minus 1.
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
    throughput_gain: float
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


# --------------------------------------------------------------------------------------------
# FSDP2 training level
# --------------------------------------------------------------------------------------------

# ``offload_activations``' default: backward reloads this many blocks ahead of the one it is in.
_ACTIVATION_PREFETCH_BLOCKS = 1


@dataclass(frozen=True)
class TrainingProfile:
    """What the training-level model knows about a model at one micro-batch.

    Attributes:
        name (str): model label.
        n_blocks (int): FSDP parameter groups (transformer blocks).
        block_params (int): parameters per block.
        other_params (int): parameters outside the blocks (embeddings, head, final norm); they stay
            on the GPU, as ``CoherentOffload(module_fraction<1)`` keeps the first groups.
        tokens (int): tokens per micro-batch.
        block_activation_bytes (int): bytes one block saves for backward.
        block_checkpoint_bytes (int): bytes one block keeps with checkpointing (its input).
        other_activation_bytes (int): activations outside the blocks (embeddings, logits, loss).
        forward_s (float), backward_s (float): GPU-resident forward and backward time.
        gpu_optimizer_s (float): fused AdamW on the GPU for all parameters.
        host_GBps (float): effective host DRAM bandwidth of the host optimizer step (see
            :attr:`PlatformProfile.host_GBps`).
        param_bytes (int): bytes per sharded (master) parameter, 4 for fp32.
        compute_bytes (int): bytes per parameter in the compute dtype, 2 for bf16.
        reduce_bytes (int): bytes per gradient element in the reduce dtype.
        optimizer_state_bytes (int): optimizer state bytes per parameter (8 for AdamW).
        fixed_bytes (int): GPU memory that does not depend on the plan (workspaces, allocator
            slack; the calibration residual of a measured resident peak, may be negative).
        source (str): where the figures come from (``"analytic"``, ``"measured"``, ``"calibrated"``).
        host_step_s_per_param (float | None): seconds per host-stepped parameter of the host step
            (AdamW plus the compute-dtype cast) measured while the link copies both ways, as it
            does during an offloaded step (``fsdp_offload.py``'s ``host_optimizer_measured
            ["link_busy"]``). When set it replaces the ``host_GBps`` model: the DMA's share of
            host DRAM and the copy thread's core are already in the measurement.
        recompute_fraction (float): what activation checkpointing every block adds to the
            backward, as a fraction of ``forward_s``: the blocks' share of the forward times the
            share of a block's forward that non-reentrant checkpointing reruns (it stops at the
            last tensor backward needs). 1.0, a whole forward, when unknown.
        host_alone_s_per_param (float | None): the same host step per parameter timed alone.
        host_busy_link_GBps (float | None): what the link moved, both ways together, while
            ``host_step_s_per_param`` was measured. With these two and ``host_step_s_per_param``
            the host step follows the shared-DRAM model of :func:`predict_step`
            (:func:`~torch_fsdp_offload.planner.profile.measure_host_step` measures all three).
        host_alone_cast_s_per_param (float | None): the compute-dtype cast's part of
            ``host_alone_s_per_param``: what ``TrainingConfig(cast_on="device")`` takes off each
            host-stepped parameter (:func:`host_step_seconds_per_param`). None: unknown; the
            cast's share of the host step's bytes is taken instead.
        host_link_busy_cast_s_per_param (float | None): the cast's part of ``host_step_s_per_param``.
    """

    name: str
    n_blocks: int
    block_params: int
    other_params: int
    tokens: int
    block_activation_bytes: int
    block_checkpoint_bytes: int
    other_activation_bytes: int
    forward_s: float
    backward_s: float
    gpu_optimizer_s: float
    host_GBps: float
    param_bytes: int = 4
    compute_bytes: int = 2
    reduce_bytes: int = 4
    optimizer_state_bytes: int = 8
    fixed_bytes: int = 0
    source: str = "analytic"
    host_step_s_per_param: float | None = None
    recompute_fraction: float = 1.0
    host_alone_s_per_param: float | None = None
    host_busy_link_GBps: float | None = None
    host_alone_cast_s_per_param: float | None = None
    host_link_busy_cast_s_per_param: float | None = None

    @property
    def total_params(self) -> int:
        return self.n_blocks * self.block_params + self.other_params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TrainingConfig:
    """One setting of the ``CoherentOffload`` knobs the training-level model predicts.

    Attributes:
        module_fraction (float): fraction of the blocks whose params, grads and optimizer state are
            offloaded, placed as ``block_placement`` says.
        optimizer (str | float): ``"host"``, ``"stream"``, or the fraction of offloaded groups
            stepped on the GPU (``CoherentOffload.optimizer``).
        activations (float): fraction of the blocks whose saved activations are offloaded.
        checkpointing (bool): activation checkpointing per block.
        prefetch_depth (int): groups copied ahead (0 = each copy waits for its use).
        block_placement (str): which blocks are offloaded. ``"last"``: the last
            ``round(module_fraction * n)`` in forward order (the policy given per module to them,
            as :meth:`Recommendation.apply` does); ``"spread"``: spread evenly, as
            ``CoherentOffload(module_fraction=...)`` on every block places them.
        keep_unsharded (int): the last ``keep_unsharded`` blocks are not resharded after forward
            (``fully_shard_with_policy(keep_unsharded_last=...)``): the offloaded ones among them
            copy their parameters in once per step, and every one holds its unsharded parameters
            from its forward to its backward.
        cast_on (str): where the fp32 master is cast to the compute dtype for the copy-in
            (``CoherentOffload.cast_on``). ``"host"``: into a pinned mirror after each host step
            (the cast is host work; compute-dtype bytes cross the link; a streamed step brings the
            mirror back too). ``"device"``: the master's bytes cross the link and are cast on the
            GPU as they land (no cast on the host, twice the copy-in bytes, no mirror to bring back).

    Raises:
        ValueError: a knob outside its range, naming the knob and what it accepts.

    Example::

        >>> TrainingConfig(module_fraction=0.5, cast_on="device").coherent_offload_kwargs()
        {'module_fraction': 0.5, 'optimizer': 'host', 'cast_on': 'device'}
    """

    module_fraction: float = 0.0
    optimizer: str | float = "host"
    activations: float = 0.0
    checkpointing: bool = False
    prefetch_depth: int = 1
    block_placement: str = "last"
    keep_unsharded: int = 0
    cast_on: str = "host"

    def __post_init__(self) -> None:
        for name in ("module_fraction", "activations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"TrainingConfig.{name} must be a fraction in [0, 1], got {value!r}")
        if not (self.optimizer in ("host", "stream") or (
            isinstance(self.optimizer, (int, float)) and not isinstance(self.optimizer, bool)
            and 0.0 <= self.optimizer <= 1.0
        )):
            raise ValueError(
                f"TrainingConfig.optimizer must be 'host', 'stream' or a GPU fraction in [0, 1], got {self.optimizer!r}"
            )
        if self.prefetch_depth < 0:
            raise ValueError(f"TrainingConfig.prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.block_placement not in ("last", "spread"):
            raise ValueError(f"TrainingConfig.block_placement must be 'last' or 'spread', got {self.block_placement!r}")
        if isinstance(self.keep_unsharded, bool) or not isinstance(self.keep_unsharded, int) or self.keep_unsharded < 0:
            raise ValueError(f"TrainingConfig.keep_unsharded must be an int >= 0, got {self.keep_unsharded!r}")
        if self.cast_on not in _CAST_PLACEMENTS:
            raise ValueError(
                f"TrainingConfig.cast_on must be 'host' (the master cast into a pinned mirror on the host) or "
                f"'device' (the master copied in and cast on the GPU), got {self.cast_on!r}"
            )

    def kept_blocks(self, n_blocks: int) -> range:
        """Indices (forward order) of the blocks kept unsharded after forward, out of ``n_blocks``.

        Raises:
            ValueError: ``keep_unsharded`` above ``n_blocks``.
        """
        if self.keep_unsharded > n_blocks:
            raise ValueError(f"TrainingConfig.keep_unsharded={self.keep_unsharded} exceeds the model's {n_blocks} blocks")
        return range(n_blocks - self.keep_unsharded, n_blocks)

    def offloaded_blocks(self, n_blocks: int) -> list[int]:
        """Indices (forward order) of the blocks this setting offloads, out of ``n_blocks``."""
        if self.block_placement == "last":
            return list(range(n_blocks - round(self.module_fraction * n_blocks), n_blocks))
        return [i for i in range(n_blocks) if spread_group_offloaded(i, self.module_fraction)]

    @property
    def optimizer_gpu_fraction(self) -> float:
        return {"host": 0.0, "stream": 1.0}.get(self.optimizer, self.optimizer)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        optimizer = self.optimizer if isinstance(self.optimizer, str) else f"split{self.optimizer:.2f}"
        parts = [f"modules={self.module_fraction:.2f}"]
        if self.module_fraction > 0:
            parts.append(f"opt={optimizer}")
        if self.activations > 0:
            parts.append(f"act={self.activations:.2f}")
        if self.checkpointing:
            parts.append("ckpt")
        if self.prefetch_depth != 1:
            parts.append(f"depth={self.prefetch_depth}")
        if self.block_placement != "last" and 0 < self.module_fraction < 1:
            parts.append(self.block_placement)
        if self.keep_unsharded:
            parts.append(f"keep={self.keep_unsharded}")
        if self.cast_on != "host" and self.module_fraction > 0:
            parts.append(f"cast={self.cast_on}")
        return " ".join(parts)

    def coherent_offload_kwargs(self) -> dict[str, Any] | None:
        """The ``CoherentOffload(...)`` keyword arguments of this setting (None: no offload at all)."""
        if self.module_fraction == 0 and self.activations == 0:
            return None
        kwargs: dict[str, Any] = {}
        if self.module_fraction == 0:
            kwargs.update(offload_params=False, offload_grads=False, offload_optimizer_state=False)
        else:
            kwargs["module_fraction"] = round(self.module_fraction, 4)
            # Explicit even for "host": CoherentOffload's default ("auto") streams half the groups
            # on a discrete GPU, which is not what this setting predicted.
            kwargs["optimizer"] = self.optimizer
            if self.cast_on != "host":
                kwargs["cast_on"] = self.cast_on
        if self.prefetch_depth != 1:
            kwargs["prefetch_depth"] = self.prefetch_depth
        return kwargs


@dataclass(frozen=True)
class StepPrediction:
    """Predicted cost of one training step (all bytes per step).

    Attributes:
        config (TrainingConfig): the setting predicted.
        step_s (float): predicted step time; forward_s + backward_s + optimizer_s.
        forward_s, backward_s, optimizer_s (float): the phases, copies overlapped.
        peak_gpu_bytes (int): predicted peak of allocated GPU memory.
        h2d_bytes (int), d2h_bytes (int): link traffic.
        host_optimizer_s (float): host optimizer work (overlapped with backward).
        link_bound (bool): a copy stream, not compute, set the forward or backward time.
        host_bound (bool): the host optimizer step, not the GPU, ends the step.
        peak_phase (str): ``"forward"``, ``"backward"`` or ``"optimizer"``: where the peak is
            (:func:`phase_peaks`).
    """

    config: TrainingConfig
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    peak_gpu_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    host_optimizer_s: float
    link_bound: bool
    host_bound: bool = False
    peak_phase: str = "backward"

    @property
    def peak_gpu_GiB(self) -> float:
        return self.peak_gpu_bytes / 2**30

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"] = dataclasses.asdict(self.config)
        data["label"] = self.config.label
        data["peak_gpu_GiB"] = self.peak_gpu_GiB
        return data


def _adamw_bytes(profile: TrainingProfile) -> int:
    # Fused AdamW reads the parameter, gradient and both moments and writes parameter and moments.
    return 2 * profile.param_bytes + profile.reduce_bytes + 2 * profile.optimizer_state_bytes


def _host_cast_bytes(profile: TrainingProfile, cast_on: str) -> int:
    # The cast into the compute-dtype mirror reads the master and writes the mirror; there is none
    # with cast_on="device", nor when the compute dtype is the master's.
    if cast_on != "host" or profile.compute_bytes == profile.param_bytes:
        return 0
    return profile.param_bytes + profile.compute_bytes


def host_step_bytes_per_param(profile: TrainingProfile, cast_on: str = "host") -> int:
    """Host DRAM bytes one host-stepped parameter moves per step.

    Fused AdamW reads the parameter, gradient and both moments and writes the parameter and
    moments; with ``cast_on="host"`` the compute-dtype mirror the next copy-in reads is cast from
    the fp32 master (read the master, write the mirror); and the gradient's D2H copy writes into
    host DRAM during the same window. 38 bytes for fp32 master, fp32 gradient, bf16 compute, AdamW;
    32 with ``cast_on="device"`` (the copy-in's DMA then reads the 4-byte master instead of the
    2-byte mirror: link bytes, counted with the link's, see :func:`copy_in_bytes_per_param`).

    Example::

        >>> host_step_bytes_per_param(profile), host_step_bytes_per_param(profile, cast_on="device")
        (38, 32)
    """
    return _adamw_bytes(profile) + _host_cast_bytes(profile, cast_on) + profile.reduce_bytes


def copy_in_bytes_per_param(profile: TrainingProfile, cast_on: str = "host") -> int:
    """Bytes one offloaded parameter moves over the link per copy-in (forward, backward re-gather):
    the compute dtype's with ``cast_on="host"`` (the host's mirror), the master's with ``"device"``
    (cast on the GPU as it lands).

    Example::

        >>> copy_in_bytes_per_param(profile), copy_in_bytes_per_param(profile, cast_on="device")
        (2, 4)
    """
    return profile.param_bytes if cast_on == "device" else profile.compute_bytes


def host_step_seconds_per_param(profile: TrainingProfile, cast_on: str = "host") -> tuple[float | None, float | None]:
    """The measured host step per host-stepped parameter, ``(alone, link busy)``, as the step model
    uses it for ``cast_on``: ``profile.host_alone_s_per_param`` and ``profile.host_step_s_per_param``
    (AdamW plus the compute-dtype cast), less the cast's part with ``cast_on="device"``.

    The cast's part is ``profile.host_alone_cast_s_per_param`` /
    ``host_link_busy_cast_s_per_param`` where known (measured, or the platform profile's); else
    (older profiles and JSON) the cast's share of the host step's bytes (6 of 34 for fp32 AdamW with
    a bf16 mirror), which understates it: on our H200 host the cast took 25% of the step's time
    alone and 38% with the link busy.

    Returns:
        tuple: seconds per parameter alone and with the link busy, each None where not measured.

    Example::

        >>> host_step_seconds_per_param(dataclasses.replace(profile, host_alone_s_per_param=0.31e-9,
        ...     host_step_s_per_param=0.59e-9, host_alone_cast_s_per_param=0.08e-9,
        ...     host_link_busy_cast_s_per_param=0.22e-9), cast_on="device")  # (0.23e-9, 0.37e-9)
    """
    alone, busy = profile.host_alone_s_per_param, profile.host_step_s_per_param
    cast_bytes = _host_cast_bytes(profile, "host")
    if cast_on == "host" or not cast_bytes:
        return alone, busy
    share = cast_bytes / (_adamw_bytes(profile) + cast_bytes)

    def without_cast(rate: float | None, cast: float | None) -> float | None:
        if rate is None:
            return None
        return max(0.0, rate - (rate * share if cast is None else cast))

    return (without_cast(alone, profile.host_alone_cast_s_per_param),
            without_cast(busy, profile.host_link_busy_cast_s_per_param))


def shared_dram_host_seconds(alone_s: float, busy_s: float, dma_s: float) -> float:
    """Host optimizer work that takes ``alone_s`` with nothing beside it and ``busy_s`` while the
    link copies both ways, when the link's DMA keeps host DRAM busy for ``dma_s`` meanwhile:
    every second of DMA beside the host step costs it ``1 - alone_s / busy_s`` seconds of work, up
    to the whole step running at the busy rate.

        alone_s + min(dma_s, busy_s) * (1 - alone_s / busy_s)

    A ``busy_s`` below ``alone_s`` (noise) counts as ``alone_s``.

    Example::

        >>> round(shared_dram_host_seconds(0.30, 0.50, 0.10), 3)  # 0.30 + 0.10 * 0.4
        0.34
    """
    busy_s = max(alone_s, busy_s)
    if busy_s <= 0:
        return alone_s
    return alone_s + min(dma_s, busy_s) * (1 - alone_s / busy_s)


def _copy_time(h2d_bytes: float, d2h_bytes: float, platform: PlatformProfile) -> float:
    # Each direction has its own copy engine, but both share the link's total.
    return max(
        h2d_bytes / (platform.h2d_GBps * 1e9),
        d2h_bytes / (platform.d2h_GBps * 1e9),
        (h2d_bytes + d2h_bytes) / (platform.bidirectional_GBps * 1e9),
    )


def _activation_traffic(profile: TrainingProfile, activation_blocks: int, per_block: int) -> tuple[float, float, float]:
    """``(bytes sent down in forward, bytes still in flight when backward starts, bytes reloaded)``.

    Blocks are offloaded from the first; the forward waits rather than let more than
    ``DEFAULT_MAX_INFLIGHT_BYTES`` of copies pile up, so the copies down are on the forward's
    critical path except the last in-flight window, which drains during backward. When every
    block is offloaded, backward starts with the last block and uses its device copy in place.
    """
    down = activation_blocks * per_block
    in_flight = min(down, DEFAULT_MAX_INFLIGHT_BYTES)
    kept_on_device = 1 if activation_blocks == profile.n_blocks else 0
    return down - in_flight, in_flight, (activation_blocks - kept_on_device) * per_block


def predict_step(
    profile: TrainingProfile, config: TrainingConfig, platform: PlatformProfile, *, world_size: int = 1
) -> StepPrediction:
    """Predict one FSDP2 training step per GPU under ``config`` on ``platform``.

    Per step the offloaded blocks' parameter shards cross host-to-device twice in the compute
    dtype (forward and the backward re-gather; once for blocks kept unsharded after forward,
    ``config.keep_unsharded``), or in the master's dtype with ``config.cast_on="device"``;
    gradients of offloaded groups cross device-to-host in the reduce dtype; streamed parameters
    then move their fp32 parameter, gradient and moments up and parameter, moments and (with
    ``cast_on="host"``) mirror down as one pipeline over runs of parameters, both directions at
    once, after one run's upload fills it. Offloaded activations go down in forward
    with at most ``DEFAULT_MAX_INFLIGHT_BYTES`` in flight (the forward waits for the link beyond
    that) and are reloaded in backward. Each phase takes the longest of its compute and its copy
    streams (their sum with ``prefetch_depth=0``); at ``world_size > 1`` FSDP's all-gathers and
    reduce-scatters over ``platform.gpu_interconnect_GBps`` are one more overlapped stream.

    The host optimizer is bound by host DRAM bandwidth (:func:`host_step_bytes_per_param` bytes per
    parameter at ``profile.host_GBps``, shared with the link's copies; one host DRAM serves all
    ``world_size`` GPUs). With ``cast_on="device"`` the host step is AdamW alone: the cast's bytes
    (or, with measured rates, its measured time, :func:`host_step_seconds_per_param`) leave the
    host step; the device memory of its one landing chunk (``chunk_bytes``, 64 MiB) is not counted.
    Host-stepped groups are the last in forward order, so their gradients land
    first in backward; host steps start when the first of them landed, run beside the streamed
    steps, and must end before the next forward reaches the host groups (with or without
    ``overlap_next_forward``). What outlasts the GPU work is exposed.

    Host DRAM serves the host step and the link's DMA at once (parameters copied in, gradients
    down, streamed state, activations), so link traffic slows the host step. When the profile has
    the host step timed alone and beside a busy link (``host_alone_s_per_param``,
    ``host_step_s_per_param``, ``host_busy_link_GBps``), the host work of P parameters takes

        P * alone + min(T_dma, P * busy) * (1 - alone / busy)

    with T_dma the step's link bytes (of every GPU of the host) at ``host_busy_link_GBps``: every
    second the DMA runs beside the host step costs it ``1 - alone / busy`` seconds of work, up to
    the whole step running at the busy rate. With only ``host_step_s_per_param`` the whole host
    work runs at that rate; with neither, the host step's and the DMA's bytes share
    ``profile.host_GBps``.

    Peak GPU memory is the largest of the phase peaks of :func:`phase_peaks` (forward end, each
    block's backward, the optimizer phase) plus ``fixed_bytes``.

    Args:
        profile (TrainingProfile): the model at one micro-batch (per GPU).
        config (TrainingConfig): the knobs.
        platform (PlatformProfile): link bandwidths and kind (no copies on UNIFIED).
        world_size (int): GPUs the parameters are sharded over (one host).

    Returns:
        StepPrediction: step time, phases, peak GPU memory and link traffic per GPU.

    Raises:
        ValueError: ``world_size < 1``.

    Example::

        >>> predict_step(profile, TrainingConfig(module_fraction=1.0), get_profile("h200-pcie")).step_s
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n_blocks = profile.n_blocks
    offloaded = config.offloaded_blocks(n_blocks)
    offloaded_blocks = len(offloaded)
    # Blocks kept unsharded after forward are not gathered (nor copied in) again in backward.
    kept = config.kept_blocks(n_blocks)
    regathered_offloaded = sum(1 for index in offloaded if index not in kept)
    activation_blocks = round(config.activations * n_blocks)
    # OffloadOptimizer streams whole groups, the first round(fraction * offloaded) in forward order.
    streamed_blocks = round(config.optimizer_gpu_fraction * offloaded_blocks)
    host_indices = offloaded[streamed_blocks:]
    host_blocks = len(host_indices)
    shard = profile.block_params / world_size
    per_block_saved = profile.block_checkpoint_bytes if config.checkpointing else profile.block_activation_bytes
    # On one physical memory the offloaded state is read in place: nothing crosses a link.
    copies = 0.0 if platform.kind in ("unified", "host_only") else 1.0

    copy_in = copy_in_bytes_per_param(profile, config.cast_on)
    weight_bytes = offloaded_blocks * shard * copy_in * copies
    backward_weight_bytes = regathered_offloaded * shard * copy_in * copies
    grad_down = offloaded_blocks * shard * profile.reduce_bytes * copies
    stream_up = streamed_blocks * shard * (profile.param_bytes + profile.reduce_bytes + profile.optimizer_state_bytes) * copies
    # The streamed step brings back the master and moments, and with cast_on="host" the mirror.
    mirror_down = profile.compute_bytes if _host_cast_bytes(profile, config.cast_on) else 0
    stream_down = streamed_blocks * shard * (profile.param_bytes + profile.optimizer_state_bytes + mirror_down) * copies
    act_forward, act_in_flight, reloaded = (
        _activation_traffic(profile, activation_blocks, per_block_saved) if activation_blocks and copies else (0, 0, 0)
    )

    gather_s = reduce_s = backward_gather_s = 0.0
    if world_size > 1:
        wire = (world_size - 1) / world_size * profile.total_params / (platform.gpu_interconnect_GBps * 1e9)
        gather_s, reduce_s = wire * profile.compute_bytes, wire * profile.reduce_bytes
        backward_gather_s = gather_s * (n_blocks - len(kept)) / n_blocks

    def phase(compute: float, h2d: float, d2h: float, collectives: float) -> tuple[float, bool]:
        link = _copy_time(h2d, d2h, platform)
        if config.prefetch_depth == 0:
            return compute + link + collectives, link > 0
        return max(compute, link, collectives), link > max(compute, collectives)

    backward_compute = profile.backward_s + (profile.forward_s * profile.recompute_fraction if config.checkpointing else 0.0)
    forward, forward_bound = phase(profile.forward_s, weight_bytes, act_forward, gather_s)
    if offloaded_blocks == n_blocks and copies and config.prefetch_depth > 0:
        # The first group's copy has nothing to hide behind.
        forward += shard * copy_in / (platform.h2d_GBps * 1e9)
    backward, backward_bound = phase(
        backward_compute, backward_weight_bytes + reloaded, grad_down + act_in_flight, backward_gather_s + reduce_s
    )
    if act_forward:
        # The copies start after the first block's forward and must be down (but for the in-flight
        # window) before the last offloaded block's forward ends; the reloads, one block ahead,
        # cannot start before backward does.
        forward = max(forward, profile.forward_s / n_blocks + act_forward / (platform.d2h_GBps * 1e9)
                      + profile.forward_s * (n_blocks - activation_blocks) / n_blocks)
        backward = max(backward, backward_compute / n_blocks + (backward_weight_bytes + reloaded) / (platform.h2d_GBps * 1e9))

    params_offloaded = offloaded_blocks * profile.block_params
    gpu_optimizer = profile.gpu_optimizer_s * (profile.total_params - params_offloaded) / profile.total_params / world_size
    stream_time = 0.0
    if streamed_blocks:
        # One pipeline over parameter runs, both link directions at once; the first run's copy up
        # fills it.
        run_up = stream_up / max(1.0, streamed_blocks)
        stream_time = max(
            profile.gpu_optimizer_s * streamed_blocks * profile.block_params / profile.total_params / world_size,
            run_up / (platform.h2d_GBps * 1e9) + _copy_time(stream_up, stream_down, platform),
        )
    gpu_path_optimizer = max(gpu_optimizer, stream_time)

    # The host steps run beside everything else, on one host DRAM shared by all GPUs of the host
    # and by the link's DMA. They start when the first host group's gradients have landed (host
    # groups are the last in forward order, so the first in backward) and must end before the
    # next forward reaches the host groups (with or without overlap_next_forward).
    h2d_bytes = weight_bytes + backward_weight_bytes + reloaded + stream_up
    d2h_bytes = grad_down + act_forward + act_in_flight + stream_down
    host_params = host_blocks * shard * world_size
    # With cast_on="device" the host work is AdamW alone (the cast runs on the GPU).
    host_alone, host_busy = host_step_seconds_per_param(profile, config.cast_on)
    if not host_blocks:
        host_time = 0.0
    elif host_alone is not None and host_busy is not None and profile.host_busy_link_GBps:
        # Shared host DRAM (see the docstring); one host DRAM serves the DMA of every GPU of the host.
        host_time = shared_dram_host_seconds(
            host_params * host_alone,
            host_params * host_busy,
            (h2d_bytes + d2h_bytes) * world_size / (profile.host_busy_link_GBps * 1e9),
        )
    elif host_busy is not None:
        host_time = host_params * host_busy
    else:
        # One bandwidth for the host step's bytes and the DMA's: the parameters' copies in, the
        # streamed state and the activations both ways (the host groups' gradients landing are
        # already in host_step_bytes_per_param).
        streamed_grads_down = streamed_blocks * shard * profile.reduce_bytes * copies
        link_dram_bytes = (weight_bytes + backward_weight_bytes + streamed_grads_down + stream_up + stream_down
                           + act_forward + act_in_flight + reloaded)
        host_bytes = host_blocks * shard * host_step_bytes_per_param(profile, config.cast_on) + link_dram_bytes
        host_time = host_bytes * world_size / (profile.host_GBps * 1e9)
    host_tail = 0.0
    if host_blocks:
        # From the start of backward: block i's gradients land after the backward of the blocks
        # behind it; one worker steps the host groups in landing order (the reverse of forward).
        grad_copy = shard * profile.reduce_bytes / (platform.d2h_GBps * 1e9) if copies else 0.0
        done = 0.0
        for index in reversed(host_indices):
            done = max(done, backward * (n_blocks - index) / n_blocks + grad_copy) + host_time / host_blocks
        # The next forward needs the first host group in forward order, whose step ends last.
        needed = backward + gpu_path_optimizer + forward * host_indices[0] / n_blocks
        host_tail = max(0.0, done - needed)
    optimizer = gpu_path_optimizer + host_tail

    peaks = phase_peaks(profile, config, offloaded_blocks=offloaded_blocks, streamed_blocks=streamed_blocks,
                        activation_blocks=activation_blocks, world_size=world_size, copies=bool(copies))
    peak = max(peaks.values()) + profile.fixed_bytes
    return StepPrediction(
        config=config,
        step_s=forward + backward + optimizer,
        forward_s=forward,
        backward_s=backward,
        optimizer_s=optimizer,
        peak_gpu_bytes=int(peak),
        peak_phase=max(peaks, key=peaks.__getitem__),
        h2d_bytes=int(h2d_bytes),
        d2h_bytes=int(d2h_bytes),
        host_optimizer_s=host_time,
        link_bound=forward_bound or backward_bound,
        host_bound=host_tail > 0,
    )


def phase_peaks(
    profile: TrainingProfile,
    config: TrainingConfig,
    *,
    offloaded_blocks: int,
    streamed_blocks: int,
    activation_blocks: int,
    world_size: int = 1,
    copies: bool = True,
) -> dict[str, float]:
    """Peak GPU bytes of each phase of one step: what is live when, before ``fixed_bytes``.

    * forward: resident state, the saved activations of the blocks not offloaded, the copies to
      the host still in flight (at most ``DEFAULT_MAX_INFLIGHT_BYTES``), the unsharded groups.
    * backward: the largest of the moments just before each block's backward (last block
      first). Resident blocks' activations live until their block's backward; an offloaded block's
      reload lives from when backward reaches the block ``prefetch`` blocks after it until its own
      backward has unpacked it. (How far the CPU runs ahead of the GPU does not count: allocated
      bytes are freed when the host drops them, and the copy stream keeps their memory until
      used.) Gradients of resident groups accumulate on the GPU; an offloaded group's gradient
      (host-stepped or streamed) goes down from FSDP's reduce output and is on its way down while
      the next block runs. A checkpointed block re-creates its full activations once. The backward peak is therefore not
      always at its start: with activations offloaded it comes when gradients have piled up
      beside the reloads.
    * optimizer: resident state and gradients, and the streamed runs on the device: of the
      ``_STREAM_RUNS_IN_FLIGHT`` runs of ``_STREAM_RUN_BYTES`` in transit (each run uploads
      parameters, gradients and state), the one being stepped and the next one's upload; the run
      still copying down was freed by the host, and the allocator keeps its memory (reserved)
      without counting it as allocated, which is what peaks are measured in.

    Every offloaded group's compute-dtype shard is copied into a staging buffer before its
    all-gather: ``prefetch_depth`` of them live beside the unsharded groups. Blocks kept unsharded
    after forward (``config.keep_unsharded``) hold their unsharded parameters from their forward
    to their backward: at the end of forward and before each block's backward, those of them
    beyond the groups counted as unsharded anyway.

    Args:
        profile (TrainingProfile): the model at one micro-batch (per GPU).
        config (TrainingConfig): the knobs (prefetch depth, checkpointing).
        offloaded_blocks (int): blocks whose state lives on the host (the last in forward order).
        streamed_blocks (int): offloaded blocks stepped on the GPU (the first offloaded ones;
            ``OffloadOptimizer`` streams whole groups).
        activation_blocks (int): blocks whose activations are offloaded (the first ones).
        world_size (int): GPUs the parameters are sharded over.
        copies (bool): offloaded state crosses a link (False on UNIFIED: read in place).

    Returns:
        dict[str, float]: ``{"forward", "backward", "optimizer"}`` peak bytes.

    Example::

        >>> phase_peaks(profile, TrainingConfig(activations=1.0), offloaded_blocks=0,
        ...             streamed_blocks=0, activation_blocks=8)["backward"]
    """
    n_blocks = profile.n_blocks
    shard = profile.block_params / world_size
    grad_shard = shard * profile.reduce_bytes
    resident_blocks = n_blocks - offloaded_blocks
    resident_params = (profile.total_params - offloaded_blocks * profile.block_params) / world_size
    resident_state = resident_params * (profile.param_bytes + profile.optimizer_state_bytes)
    live_groups = 1 + max(config.prefetch_depth, 1)
    unsharded = live_groups * profile.block_params * profile.compute_bytes
    staging = min(config.prefetch_depth, offloaded_blocks) * shard * profile.compute_bytes if copies else 0.0
    saved = profile.block_checkpoint_bytes if config.checkpointing else profile.block_activation_bytes
    offloaded_acts = activation_blocks if copies else 0

    kept = config.kept_blocks(n_blocks)
    block_unsharded = profile.block_params * profile.compute_bytes

    in_flight = min(offloaded_acts * saved, DEFAULT_MAX_INFLIGHT_BYTES)
    forward = (resident_state + unsharded + staging + (n_blocks - offloaded_acts) * saved + in_flight
               + profile.other_activation_bytes + max(0, len(kept) - live_groups) * block_unsharded)

    # Blocks 0 .. offloaded_acts-1 have offloaded activations; blocks resident_blocks .. n-1 have
    # offloaded state; of those, the first streamed_blocks are stepped on the GPU.
    reload_window = 1 + _ACTIVATION_PREFETCH_BLOCKS
    backward = 0.0
    for block in range(n_blocks - 1, -1, -1):
        saved_here = sum(saved for j in range(offloaded_acts, block + 1))
        reloaded = saved * sum(1 for j in range(max(0, block - reload_window + 1), min(block, offloaded_acts - 1) + 1))
        later = range(block + 1, n_blocks)
        on_device = [j for j in later if j < resident_blocks or not copies]
        grads = grad_shard * len(on_device)
        if block + 1 < n_blocks and block + 1 not in on_device:
            grads += grad_shard  # the offloaded group just finished: its gradient on its way down
        recompute = profile.block_activation_bytes if config.checkpointing else 0.0
        # Kept blocks before this one, beyond the prefetched groups counted in `unsharded`.
        kept_params = max(0, sum(1 for j in kept if j < block) - (live_groups - 1)) * block_unsharded
        backward = max(backward, saved_here + reloaded + grads + recompute + kept_params)
    backward += resident_state + unsharded + staging + profile.other_activation_bytes

    resident_grads = resident_params * profile.reduce_bytes
    optimizer = resident_state + resident_grads
    if streamed_blocks and copies:
        # Streamed gradients went down in backward like the host groups'; each run uploads its
        # parameters, gradients and optimizer state.
        run_bytes = shard * (profile.param_bytes + profile.reduce_bytes + profile.optimizer_state_bytes)
        optimizer += min(streamed_blocks * run_bytes, (_STREAM_RUNS_IN_FLIGHT - 1) * _STREAM_RUN_BYTES)
    elif streamed_blocks:
        optimizer += streamed_blocks * grad_shard
    return {"forward": forward, "backward": backward, "optimizer": optimizer}
