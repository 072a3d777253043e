"""Search: which plan to recommend.

Talk level (:func:`search_scenario`): for every measured micro-batch factor and technique, find
the window of offloaded fractions that both fits in GPU memory and keeps the link hidden, and
recommend the highest throughput gain. Inside a window the centre is chosen, so that an
underestimated activation size (memory side) and an overestimated link speed (link side) have
the same slack. Link-bound plans are listed but not recommended: their gain is only as good as
the link's achieved bandwidth.

Training level (:func:`search_training`): predict every ``CoherentOffload`` setting of a grid with
the FSDP2 step model and pick the fastest that fits (tokens per second when several micro-batches
are compared).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from torch_fsdp_offload.planner.profiles import PlatformProfile
from torch_fsdp_offload.planner.scenario import Scenario
from torch_fsdp_offload.planner.scenario_cost import (
    Candidate,
    evaluate,
    model_dram_bandwidth_GBps,
    offload_window,
    TECHNIQUES,
)
from torch_fsdp_offload.planner.step_time import predict_step, StepPrediction
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = [
    "DRAM_BOUND_UTILIZATION",
    "OFFLOAD_MARGIN",
    "TIE_MARGIN",
    "choose",
    "ScenarioSearch",
    "default_training_configs",
    "micro_batches_at",
    "offload_blocked_reason",
    "offload_that_pays",
    "samples_per_s",
    "search_scenario",
    "search_training",
    "throughput_curves",
]

# Above this share of peak GPU DRAM bandwidth the model leaves no room for offload traffic (the
# talk: "above 80% or 90% of your peak bandwidth, offloading is likely not beneficial").
DRAM_BOUND_UTILIZATION = 0.85
# Predictions closer than this are treated as equal; the plan that moves fewer bytes wins.
TIE_MARGIN = 0.02
# A plan that offloads must beat a fitting plan that moves nothing by this much to be recommended:
# the step model's own error against measured steps (see docs/planner.md); offload pays only when
# it buys something.
OFFLOAD_MARGIN = 0.10
_T = TypeVar("_T")


@dataclass(frozen=True)
class ScenarioSearch:
    """Result of :func:`search_scenario`.

    Attributes:
        candidates (tuple[Candidate, ...]): every plan that fits, in technique then factor order.
        recommended (Candidate): the plan to use.
        blocked_reason (str | None): why offloading was ruled out altogether, if it was.
    """

    candidates: tuple[Candidate, ...]
    recommended: Candidate
    blocked_reason: str | None

    def baseline(self) -> Candidate | None:
        """The run gains are quoted over: today's run where it fits, else the fastest that fits
        without offloading anything; None where none does."""
        staying = [c for c in self.candidates if c.fits and c.weights_fraction == c.activations_fraction == 0]
        today = [c for c in staying if c.technique == "none" and c.microbatch_factor == 1]
        return today[0] if today else max(staying, key=lambda c: c.throughput_gain, default=None)

    @staticmethod
    def run_name(candidate: Candidate) -> str:
        """How the report names a talk-level run."""
        if candidate.technique == "none" and candidate.microbatch_factor == 1:
            return "today's run"
        return f"{candidate.technique} at {candidate.microbatch_factor:g}x"


def offload_blocked_reason(scenario: Scenario) -> str | None:
    """Why offloading cannot pay on this scenario at all, or None if it may."""
    if scenario.kind == "host_only":
        return (
            "this machine has no accelerator: parameters, gradients and optimizer state already live in "
            "the host memory compute runs in (to plan for a GPU machine, pass platform=)"
        )
    if scenario.kind == "unified":
        return (
            "this is a unified-memory platform: CPU and GPU share one physical memory, so "
            "offloading cannot add capacity, it only duplicates tensors in the same DRAM and spends "
            "its bandwidth on copies"
        )
    utilization = model_dram_bandwidth_GBps(scenario) / scenario.gpu_dram_GBps
    if utilization > DRAM_BOUND_UTILIZATION:
        return (
            f"the model already uses {utilization:.0%} of the GPU's peak DRAM bandwidth (more than "
            f"{DRAM_BOUND_UTILIZATION:.0%}): offload traffic would compete with it for the same DRAM"
        )
    return None


def _round_into(value: float, lowest: float, highest: float, n_blocks: int | None) -> float:
    # Whole blocks when the block count is known, else two decimals, staying inside the window.
    if n_blocks:
        blocks = min(
            range(math.ceil(lowest * n_blocks - 1e-9), math.floor(highest * n_blocks + 1e-9) + 1),
            key=lambda count: abs(count - value * n_blocks),
            default=math.ceil(lowest * n_blocks - 1e-9),
        )
        return blocks / n_blocks
    rounded = round(value, 2)
    return rounded if lowest <= rounded <= highest else value


def _plan_at(scenario: Scenario, technique: str, factor: float) -> Candidate | None:
    if technique in ("none", "checkpointing"):
        candidate = evaluate(scenario, technique, factor)
        return candidate if candidate.fits else None
    lowest, highest = offload_window(scenario, technique, factor)
    if lowest > 1.0:
        return None
    if lowest == 0.0:
        # Fits without offloading anything: the "none" / "checkpointing" plan covers it.
        return None
    fraction = (lowest + highest) / 2 if lowest <= highest else lowest
    fraction = min(1.0, _round_into(fraction, lowest, max(lowest, highest), scenario.n_blocks))
    key = "activations_fraction" if technique == "offload_activations" else "weights_fraction"
    candidate = evaluate(scenario, technique, factor, **{key: fraction})
    return candidate if candidate.fits else None


def search_scenario(scenario: Scenario) -> ScenarioSearch:
    """Evaluate the talk's techniques at every measured micro-batch factor and pick one.

    Args:
        scenario (Scenario): validated input.

    Returns:
        ScenarioSearch: the fitting candidates and the recommendation (today's run when nothing
        gains; check ``recommended.fits`` when today's run may not fit).

    Example::

        >>> search_scenario(load_scenario("docs/examples/talk_gh200.json")).recommended.weights_fraction
        0.35
    """
    blocked = offload_blocked_reason(scenario)
    techniques = [t for t in TECHNIQUES if scenario.checkpointing is not None or not t.startswith("checkpointing")]
    candidates = []
    for technique in techniques:
        for factor, _ in scenario.microbatch_scaling:
            candidate = _plan_at(scenario, technique, factor)
            if candidate is not None:
                candidates.append(candidate)
    best = None
    for candidate in candidates:
        offloads = candidate.weights_fraction > 0 or candidate.activations_fraction > 0
        if candidate.link_bound or (offloads and blocked):
            continue
        if best is None or candidate.throughput_gain > best.throughput_gain + 1e-6:
            best = candidate
    if best is None:
        # Nothing fits with the link hidden: today's run is reported as it is (it does not fit).
        best = evaluate(scenario, "none", 1.0)
    return ScenarioSearch(candidates=tuple(candidates), recommended=best, blocked_reason=blocked)


def throughput_curves(scenario: Scenario, points: int = 101) -> dict[str, list[tuple[float, float | None]]]:
    """Throughput gain against the offloaded fraction, one curve per offload technique.

    Each point is the best gain over the measured micro-batch factors that fit at that fraction
    (link-bound plans included, so the curves show where the link takes over); ``None`` where no
    factor fits. Checkpointing alone is a constant (fraction 0) and appears as one flat curve.
    """
    curves: dict[str, list[tuple[float, float | None]]] = {}
    techniques = [t for t in TECHNIQUES[1:] if scenario.checkpointing is not None or not t.startswith("checkpointing")]
    for technique in techniques:
        curve = []
        for index in range(points):
            fraction = index / (points - 1)
            if technique == "checkpointing":
                kwargs = {}
            elif technique == "offload_activations":
                kwargs = {"activations_fraction": fraction}
            else:
                kwargs = {"weights_fraction": fraction}
            gains = [
                c.throughput_gain
                for c in (evaluate(scenario, technique, factor, **kwargs) for factor, _ in scenario.microbatch_scaling)
                if c.fits
            ]
            curve.append((fraction, max(gains) if gains else None))
        curves[technique] = curve
    return curves


# Optimizer placements of the offloaded groups the default grid tries: all on the host, or a
# quarter or half of the groups streamed through the GPU (the best placements measured on an H200,
# where streaming every group was slower than either; see docs/benchmarks.md).
_DEFAULT_PLACEMENTS: tuple[str | float, ...] = ("host", 0.25, 0.5)


def default_training_configs(
    n_blocks: int, *, checkpointing: bool = True, clipping: bool = False, grad_accum_steps: int = 1
) -> list[TrainingConfig]:
    """The grid :func:`search_training` explores: module fractions in whole blocks (at most 9
    values), the offloaded groups' optimizer on the host or a quarter or half of them streamed
    through the GPU, the offloaded (last) blocks resharded after forward or not (``keep_unsharded``:
    one copy-in per step instead of two, their parameters held through backward), where settings
    with host-stepped groups cast the master to the compute dtype (``cast_on``: on the host, or on
    the GPU for twice the copy-in bytes), activations offloaded for none, half or all blocks, with
    and without checkpointing, every one with ``OffloadOptimizer``'s defaults (nothing steps before
    ``step()``), and ``clipping`` and ``grad_accum_steps`` as given. Pass configs with ``optimizer="stream"`` or
    ``step_during_backward=True`` to predict those too (without clipping the step model prices
    ``step_during_backward`` as the default; with it the optimizer never steps early).

    Example::

        >>> len(default_training_configs(8)), default_training_configs(8)[-1].label
        (582, 'modules=1.00 opt=split0.50 act=1.00 ckpt keep=8 cast=device')
    """
    steps = sorted({round(n_blocks * i / 8) / n_blocks for i in range(9)})
    configs = []
    for checkpoint in (False, True) if checkpointing else (False,):
        for activations in (0.0, 0.5, 1.0):
            for fraction in steps:
                offloaded = round(fraction * n_blocks)
                for placement in _DEFAULT_PLACEMENTS if fraction > 0 else ("host",):
                    # Only a host step casts on the host: cast_on="device" takes the cast off it. An
                    # all-streamed setting is not tried with it: its streamed steps cast on the GPU
                    # already, so it would only double the copy-ins of link-bound steps (it saves
                    # the mirror's 2 bytes down per parameter).
                    host_stepped = offloaded - round(TrainingConfig(optimizer=placement).optimizer_gpu_fraction * offloaded)
                    for keep in (0, offloaded) if offloaded else (0,):
                        for cast_on in ("host", "device") if host_stepped else ("host",):
                            configs.append(
                                TrainingConfig(
                                    module_fraction=fraction,
                                    optimizer=placement,
                                    activations=activations,
                                    checkpointing=checkpoint,
                                    keep_unsharded=keep,
                                    cast_on=cast_on,
                                    clipping=clipping,
                                    grad_accum_steps=grad_accum_steps,
                                )
                            )
    return configs


def offload_that_pays(
    candidates: Sequence[_T], *, throughput: Callable[[_T], float], moves_bytes: Callable[[_T], bool]
) -> list[_T]:
    """The candidates a recommendation may come from: every one that moves nothing, and those that
    move bytes only if their throughput beats the best that moves nothing by
    :data:`OFFLOAD_MARGIN`: offload pays only when it buys more than the step model's own error.

    Args:
        candidates: plans, predicted or measured.
        throughput (Callable): a candidate's samples per second (or any higher-is-faster measure).
        moves_bytes (Callable): whether a candidate moves bytes over the link.

    Returns:
        list: the candidates that remain, in their order (all of them if none moves nothing).

    Example::

        >>> offload_that_pays([(1, 0.35), (1, 0.34)], throughput=lambda c: c[0] / c[1],
        ...                   moves_bytes=lambda c: c[1] < 0.345)
        [(1, 0.35)]
    """
    staying = [throughput(c) for c in candidates if not moves_bytes(c)]
    if not staying:
        return list(candidates)
    bar = max(staying) * (1 + OFFLOAD_MARGIN)
    return [c for c in candidates if not moves_bytes(c) or throughput(c) >= bar]


def choose(
    candidates: Sequence[_T],
    *,
    throughput: Callable[[_T], float],
    bytes_moved: Callable[[_T], float],
    checkpointing: Callable[[_T], bool],
    breaks_contract: Callable[[_T], bool] | None = None,
) -> _T:
    """The planner's decision among candidates that fit: of :func:`offload_that_pays`, the most
    throughput; within :data:`TIE_MARGIN` (2%) of it, the one that moves the fewest bytes over the
    link, then the one without activation checkpointing, then the faster. A candidate that breaks
    ``torch.optim``'s contract (``step_during_backward``) stays only if it beats the fastest that
    keeps it by :data:`OFFLOAD_MARGIN`, as offload must beat moving nothing.

    Args:
        candidates: plans, predicted or measured (at least one).
        throughput (Callable): a candidate's samples per second.
        bytes_moved (Callable): bytes a candidate moves over the link per step.
        checkpointing (Callable): whether a candidate checkpoints activations.
        breaks_contract (Callable | None): whether a candidate changes parameters before
            ``step()`` (None: none does).

    Returns:
        The chosen candidate.

    Raises:
        ValueError: no candidates.

    Example::

        >>> choose([(1.00, 0), (1.01, 9e9)], throughput=lambda c: c[0], bytes_moved=lambda c: c[1],
        ...        checkpointing=lambda c: False)
        (1.0, 0)
    """
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    if breaks_contract is not None:
        candidates = offload_that_pays(candidates, throughput=throughput, moves_bytes=breaks_contract)
    paying = offload_that_pays(candidates, throughput=throughput, moves_bytes=lambda c: bytes_moved(c) > 0)
    top = max(throughput(c) for c in paying)
    close = [c for c in paying if throughput(c) >= top * (1 - TIE_MARGIN)]
    return min(close, key=lambda c: (bytes_moved(c), checkpointing(c), -throughput(c)))


def micro_batches_at(factor: float, grad_accum_steps: int) -> int:
    """Micro-batches accumulated per step at ``factor`` times the micro-batch, for a loop that
    accumulates ``grad_accum_steps`` at factor 1: one without accumulation runs the larger
    micro-batch alone (its step grows); one with accumulation keeps the sequences per step.

    Raises:
        ValueError: ``factor`` does not divide a loop's accumulation into whole micro-batches.

    Example::

        >>> micro_batches_at(2, 1), micro_batches_at(2, 4), micro_batches_at(0.5, 4)
        (1, 2, 8)
    """
    if grad_accum_steps == 1 and factor >= 1:
        return 1
    count = grad_accum_steps / factor
    if count < 1 or abs(count - round(count)) > 1e-9:
        raise ValueError(f"{factor:g}x the micro-batch does not divide {grad_accum_steps} accumulated micro-batches")
    return round(count)


def samples_per_s(prediction: tuple[float, StepPrediction]) -> float:
    """Sequences per second of a ``(microbatch_factor, StepPrediction)``, relative to today's
    micro-batch: the factor times the micro-batches of a step, over the step's time.

    Example::

        >>> samples_per_s((2.0, predict_step(profile, TrainingConfig(grad_accum_steps=2), platform)))
    """
    factor, step = prediction
    return factor * step.config.grad_accum_steps / step.step_s


def search_training(
    profiles: Sequence[tuple[float, TrainingProfile]],
    platform: PlatformProfile,
    capacity_bytes: float,
    configs: Sequence[TrainingConfig] | None = None,
    *,
    world_size: int = 1,
    clipping: bool = False,
    grad_accum_steps: int = 1,
) -> tuple[list[tuple[float, StepPrediction]], tuple[float, StepPrediction] | None]:
    """Predict every config at every micro-batch factor and pick the highest throughput that fits.

    Args:
        profiles: ``(microbatch_factor, TrainingProfile)`` pairs (factor 1 = today's micro-batch).
        platform (PlatformProfile): link bandwidths.
        capacity_bytes (float): GPU memory the peak must stay within.
        configs: settings to predict (default :func:`default_training_configs`).
        world_size (int): GPUs the parameters are sharded over; predictions are per GPU.
        clipping (bool): the loop clips the gradients (the default grid's ``clipping``).
        grad_accum_steps (int): micro-batches the loop accumulates per step at factor 1; the
            default grid's at each factor come from :func:`micro_batches_at`.

    Returns:
        ``(predictions, best)``: every ``(factor, prediction)``, and the fitting one with the most
        samples per second (:func:`samples_per_s`; within 2%, the one that moves the fewest
        bytes), or None if none fits.
        A plan that offloads is picked over a fitting plan that moves nothing only if it is faster
        by :data:`OFFLOAD_MARGIN` (the step model's error against measured steps), and one that
        breaks ``torch.optim``'s contract over the fastest that keeps it by the same margin.

    Raises:
        ValueError: a factor that does not divide ``grad_accum_steps`` (:func:`micro_batches_at`).

    Example::

        >>> predictions, (factor, best) = search_training([(1, profile)], get_profile("h200-pcie"), 140e9)
    """
    predictions = []
    for factor, profile in profiles:
        grid = configs if configs is not None else default_training_configs(
            profile.n_blocks, clipping=clipping, grad_accum_steps=micro_batches_at(factor, grad_accum_steps))
        for config in grid:
            predictions.append((factor, predict_step(profile, config, platform, world_size=world_size)))
    fitting = [(f, p) for f, p in predictions if p.fits(capacity_bytes)]
    if not fitting:
        return predictions, None
    best = choose(
        fitting,
        throughput=samples_per_s,
        bytes_moved=lambda fp: fp[1].h2d_bytes + fp[1].d2h_bytes,
        checkpointing=lambda fp: fp[1].config.checkpointing,
        breaks_contract=lambda fp: fp[1].config.breaks_contract,
    )
    return predictions, best
