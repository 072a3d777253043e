"""The FSDP2 step model: time and peak GPU memory of one training step under an offload setting.

A :class:`~torch_fsdp_offload.planner.training_profile.TrainingProfile` of a real model and a
:class:`~torch_fsdp_offload.planner.training_config.TrainingConfig` (the ``CoherentOffload``
knobs) give the forward, backward and optimizer phases, each the slowest of its compute, its copy
streams and its collectives, the host optimizer step beside them, and the peak of
:func:`~torch_fsdp_offload.planner.peak_memory.phase_peaks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch_fsdp_offload.planner.library_facts import DEFAULT_MAX_INFLIGHT_BYTES
from torch_fsdp_offload.planner.peak_memory import phase_parts
from torch_fsdp_offload.planner.profiles import PlatformProfile
from torch_fsdp_offload.planner.traffic import (
    HOST_NORM_GBPS,
    copy_in_bytes_per_param,
    host_cast_bytes_per_param,
    clip_scaling_seconds_per_param,
    host_step_bytes_per_param,
    host_step_seconds_per_param,
    shared_dram_host_seconds,
)
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = ["FRAGMENTATION_FACTOR", "StepPrediction", "predict_step"]

#: The free memory a plan keeps beside its peak, in multiples of the largest block the step
#: allocates anew (the loss's fp32 copy of the logits). Near a memory cap the caching allocator's
#: free memory lies in pieces: on an H200 under 40 GiB a 4.64 GiB logits block found no piece of
#: its size with 5.47 GiB free in pieces (1.18 blocks) and the run failed; 1.25 blocks clears that
#: (docs/planner.md, "Memory headroom").
FRAGMENTATION_FACTOR = 1.25


@dataclass(frozen=True)
class StepPrediction:
    """Predicted cost of one training step (all bytes per step).

    Attributes:
        config (TrainingConfig): the setting predicted.
        step_s (float): predicted step time; forward_s + backward_s + optimizer_s.
        forward_s, backward_s, optimizer_s (float): the phases, copies overlapped; forward and
            backward of every accumulated micro-batch (``config.grad_accum_steps``).
        peak_gpu_bytes (int): predicted peak of allocated GPU memory.
        h2d_bytes (int), d2h_bytes (int): link traffic.
        host_optimizer_s (float): host optimizer work (beside backward, after it with clipping, and the next forward).
        link_bound (bool): a copy stream, not compute, set the forward or backward time.
        host_bound (bool): the host optimizer step, not the GPU, ends the step.
        peak_phase (str): ``"forward"``, ``"backward"`` or ``"optimizer"``: where the peak is
            (:func:`~torch_fsdp_offload.planner.peak_memory.phase_peaks`).
        allocation_slack_bytes (int): room beside the peak for the largest block the step
            allocates anew, the loss's fp32 copy of the output, at :data:`FRAGMENTATION_FACTOR`
            times its size (see :meth:`fits`).
        peak_parts (dict): ``peak_gpu_bytes`` by kind (``weights``, ``grads``, ``activations``,
            ``loss``, ...; :func:`~torch_fsdp_offload.planner.peak_memory.phase_parts`), and
            ``fixed`` for ``fixed_bytes``.
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
    allocation_slack_bytes: int = 0
    peak_parts: dict[str, float] = field(default_factory=dict)

    @property
    def peak_gpu_GiB(self) -> float:
        return self.peak_gpu_bytes / 2**30

    def fits(self, capacity_bytes: float) -> bool:
        """Whether the step fits ``capacity_bytes``: its peak, and beside it free memory of
        :data:`FRAGMENTATION_FACTOR` times the largest block it allocates anew. Near a memory cap
        the caching allocator's free memory is fragmented, and a large block that finds no free
        segment of its size fails even where the peak fits (docs/planner.md, "Memory headroom")."""
        return self.peak_gpu_bytes + self.allocation_slack_bytes <= capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"] = dataclasses.asdict(self.config)
        data["label"] = self.config.label
        data["peak_gpu_GiB"] = self.peak_gpu_GiB
        return data


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


def _host_step_ends(landed: dict[int, float], per_group: dict[int, float], *, from_step: float | None) -> dict[int, float]:
    """When each host group's step ends, from when its gradients landed (``landed``, by forward
    index; the root is -1), one worker taking ``per_group[index]`` seconds on each group.

    With ``from_step`` (when the training loop reaches ``step()``) no group steps before then, nor
    before every host group's gradients landed; ``step()`` submits them together and the worker
    takes the newest submission first, which after backward is forward order. Without it
    (``step_during_backward``) a group steps once its gradients have landed, in landing order (the
    reverse of forward).
    """
    if from_step is not None:
        done = max(from_step, *landed.values())
        ends = {}
        for index in sorted(landed):
            done += per_group[index]
            ends[index] = done
        return ends
    done, ends = 0.0, {}
    for index in sorted(landed, key=landed.__getitem__):
        done = max(done, landed[index]) + per_group[index]
        ends[index] = done
    return ends


def predict_step(
    profile: TrainingProfile, config: TrainingConfig, platform: PlatformProfile, *, world_size: int = 1
) -> StepPrediction:
    """Predict one FSDP2 training step per GPU under ``config`` on ``platform``.

    Per step the offloaded blocks' parameter shards cross host-to-device twice in the compute
    dtype (forward and the backward re-gather; once for blocks kept unsharded after forward,
    ``config.keep_unsharded``), or in the master's dtype with ``config.cast_on="device"``;
    gradients of offloaded groups cross device-to-host in the parameter's dtype (FSDP casts the
    reduce output to it; the reduce-scatter moves ``reduce_bytes``); streamed parameters
    then move their fp32 parameter, gradient and moments up and parameter, moments and (with
    ``cast_on="host"``) mirror down as one pipeline over runs of parameters, which takes the
    two directions' times added (as measured). Where every block is offloaded the root group is
    too (:meth:`TrainingConfig.root_placement`): first in forward order, so streamed first, copied
    in once per step (FSDP2 keeps the root gathered from forward to backward), its gradients last
    down. Offloaded activations go down in forward with at most ``DEFAULT_MAX_INFLIGHT_BYTES`` in
    flight (the forward waits for the link beyond
    that) and are reloaded in backward. Each phase takes the longest of its compute and its copy
    streams (their sum with ``prefetch_depth=0``); at ``world_size > 1`` FSDP's all-gathers and
    reduce-scatters over ``platform.gpu_interconnect_GBps`` are one more overlapped stream.

    The host optimizer is bound by host DRAM bandwidth
    (:func:`~torch_fsdp_offload.planner.traffic.host_step_bytes_per_param` bytes per parameter at
    ``profile.host_GBps``, shared with the link's copies; one host DRAM serves all ``world_size``
    GPUs). With ``cast_on="device"`` the host step is AdamW alone: the cast's bytes (or, with
    measured rates, its measured time,
    :func:`~torch_fsdp_offload.planner.traffic.host_step_seconds_per_param`) leave the host step;
    the device memory of its one landing chunk (the copy engine's 64 MiB) is not counted. Host-stepped
    groups are the last in forward order, so their gradients land first in backward. By default
    (and always with ``clipping``) no group steps before ``step()``, which the training loop
    reaches once the CPU has launched backward, about when the GPU ends it (the CPU launches
    backward about as fast as the GPU runs it; docs/planner.md), and the host steps run from then
    on in forward order. With ``step_during_backward`` (without clipping) each host group steps
    once its gradients landed, in landing order, under the rest of backward. The host steps run beside the streamed steps and
    on into the next forward, which copies each host group in, in forward order, once its step has
    ended. What outlasts the GPU work is exposed.

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

    With ``config.grad_accum_steps`` = N the loop runs N forwards and backwards, each with its
    copies (offloaded groups' parameters in, their gradients down), then one optimizer step: host
    steps start after the last backward and run into the next forward as without accumulation;
    streamed groups step once. In every backward but the first the offloaded groups' running sums
    also come up, to be added to on the device and sent down (their gradients' bytes up).

    Peak GPU memory is the largest of the phase peaks of
    :func:`~torch_fsdp_offload.planner.peak_memory.phase_peaks` (forward end, each block's
    backward, the optimizer phase) plus ``fixed_bytes``.

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
    # Where every block is offloaded the root is too: the first group in forward order, gathered
    # once per step (FSDP2 keeps the root unsharded after forward), its gradients landing last.
    placement = config.root_placement(n_blocks, profile.other_params)
    root, root_streamed, root_on_host = placement != "resident", placement == "streamed", placement == "host"
    # OffloadOptimizer streams whole groups, the first round(fraction * offloaded groups) in forward
    # order: the root first.
    streamed_groups = round(config.optimizer_gpu_fraction * (offloaded_blocks + root))
    streamed_blocks = streamed_groups - root_streamed
    host_indices = offloaded[streamed_blocks:]
    host_blocks = len(host_indices)
    shard = profile.block_params / world_size
    root_shard = profile.other_params / world_size if root else 0.0
    per_block_saved = profile.block_checkpoint_bytes if config.checkpointing else profile.block_activation_bytes
    # On one physical memory the offloaded state is read in place: nothing crosses a link.
    copies = 0.0 if platform.kind in ("unified", "host_only") else 1.0

    copy_in = copy_in_bytes_per_param(profile, config.cast_on)
    weight_bytes = (offloaded_blocks * shard + root_shard) * copy_in * copies
    backward_weight_bytes = regathered_offloaded * shard * copy_in * copies
    grad_down = (offloaded_blocks * shard + root_shard) * profile.grad_bytes * copies
    streamed_params = streamed_blocks * shard + (root_shard if root_streamed else 0.0)
    stream_up = streamed_params * (profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes) * copies
    # The streamed step brings back the master and moments, and with cast_on="host" the mirror.
    mirror_down = profile.compute_bytes if host_cast_bytes_per_param(profile, config.cast_on) else 0
    stream_down = streamed_params * (profile.param_bytes + profile.optimizer_state_bytes + mirror_down) * copies
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
        # The first group's copy (the root's, where it is offloaded) has nothing to hide behind.
        forward += (root_shard or shard) * copy_in / (platform.h2d_GBps * 1e9)
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

    # Accumulating, each later backward brings the offloaded groups' running sums up too.
    sums_up = grad_down if config.grad_accum_steps > 1 else 0.0
    accumulating_backward = max(backward, phase(
        backward_compute, backward_weight_bytes + reloaded + sums_up, grad_down + act_in_flight, backward_gather_s + reduce_s
    )[0])

    params_offloaded = offloaded_blocks * profile.block_params + root_shard * world_size
    gpu_optimizer = profile.gpu_optimizer_s * (profile.total_params - params_offloaded) / profile.total_params / world_size
    stream_time = 0.0
    if streamed_groups:
        # One pipeline over parameter runs. Its uploads and downloads overlap little in practice:
        # on the H200 (3B model, 1.62B parameters streamed, 25.9 GB up and 19.4 down) it took
        # 0.85 s, the two directions' times added (0.83 s), not the longer of them (0.47 s).
        stream_time = max(
            profile.gpu_optimizer_s * streamed_params / profile.total_params,
            stream_up / (platform.h2d_GBps * 1e9) + stream_down / (platform.d2h_GBps * 1e9),
        )
    gpu_path_optimizer = max(gpu_optimizer, stream_time)

    # The host steps run beside everything else, on one host DRAM shared by all GPUs of the host
    # and by the link's DMA; each must end before the next forward copies its group in.
    h2d_bytes = weight_bytes + backward_weight_bytes + reloaded + stream_up
    d2h_bytes = grad_down + act_forward + act_in_flight + stream_down
    host_params = (host_blocks * shard + (root_shard if root_on_host else 0.0)) * world_size
    # With cast_on="device" the host work is AdamW alone (the cast runs on the GPU).
    host_alone, host_busy = host_step_seconds_per_param(profile, config.cast_on)
    adamw_alone, adamw_busy = host_step_seconds_per_param(profile, "device")
    if config.clipping:
        # Clipping adds a scaling pass over every host gradient before its group steps.
        if host_alone is not None:
            host_alone += clip_scaling_seconds_per_param(profile, adamw_alone)
        if host_busy is not None:
            host_busy += clip_scaling_seconds_per_param(profile, adamw_busy)
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
        streamed_grads_down = streamed_params * profile.grad_bytes * copies
        link_dram_bytes = (weight_bytes + backward_weight_bytes + streamed_grads_down + stream_up + stream_down
                           + act_forward + act_in_flight + reloaded)
        host_bytes = (host_params / world_size) * host_step_bytes_per_param(profile, config.cast_on, config.clipping) + link_dram_bytes
        host_time = host_bytes * world_size / (profile.host_GBps * 1e9)
    grad_copy = shard * profile.grad_bytes / (platform.d2h_GBps * 1e9) if copies else 0.0

    def landed_at(index: int) -> float:
        # From the start of backward: block i's gradients land after the backward of the blocks
        # behind it, and their copy down.
        return backward * (n_blocks - index) / n_blocks + grad_copy

    host_tail = 0.0
    if host_blocks or root_on_host:
        # One worker steps the host groups (see the docstring for the order); the root's
        # gradients land last (after the whole backward), and its step takes its share of the
        # host's work.
        landed = {index: landed_at(index) for index in host_indices}
        per_param = host_time / host_params * world_size
        per_group = {index: shard * per_param for index in host_indices}
        if root_on_host:
            landed[-1] = backward + root_shard * profile.grad_bytes / (platform.d2h_GBps * 1e9) * copies
            per_group[-1] = root_shard * per_param
        done = _host_step_ends(landed, per_group, from_step=None if config.steps_early else backward)
        # The next forward copies each host group in, in forward order, once its step has ended:
        # the root's first.
        start = backward + gpu_path_optimizer
        reach, previous = max(start, done.get(-1, start)), 0
        for index in host_indices:
            reach = max(reach + forward * (index - previous) / n_blocks, done[index])
            previous = index
        host_tail = reach - (start + forward * (host_indices[-1] if host_indices else 0) / n_blocks)
    # Clipping: step() comes once clip_grad_norm_ has every gradient's norm. The root's gradients
    # land last and their norm runs on one core after backward (0.12-0.16 s measured for the 3B
    # model's 1.24 GB tied embedding); every step after it starts that much later.
    clip_wait = root_shard * profile.grad_bytes / (HOST_NORM_GBPS * 1e9) if config.clipping and copies else 0.0
    optimizer = clip_wait + gpu_path_optimizer + host_tail

    parts = phase_parts(profile, config, offloaded_blocks=offloaded_blocks, streamed_blocks=streamed_blocks,
                        activation_blocks=activation_blocks, world_size=world_size, copies=bool(copies))
    peak_phase = max(parts, key=lambda phase: sum(parts[phase].values()))
    peak_parts = {**parts[peak_phase], **({"fixed": profile.fixed_bytes} if profile.fixed_bytes else {})}
    # Every accumulated micro-batch runs forward and backward with its copies; the optimizer (and
    # the host steps it waits for) once, after the last.
    micro_batches = config.grad_accum_steps
    later_backwards = (micro_batches - 1) * accumulating_backward
    return StepPrediction(
        config=config,
        step_s=micro_batches * forward + backward + later_backwards + optimizer,
        forward_s=micro_batches * forward,
        backward_s=backward + later_backwards,
        optimizer_s=optimizer,
        peak_gpu_bytes=int(sum(peak_parts.values())),
        peak_phase=peak_phase,
        h2d_bytes=int(micro_batches * (h2d_bytes - stream_up) + stream_up + (micro_batches - 1) * sums_up),
        d2h_bytes=int(micro_batches * (d2h_bytes - stream_down) + stream_down),
        host_optimizer_s=host_time,
        link_bound=forward_bound or backward_bound,
        host_bound=host_tail > 0,
        peak_parts=peak_parts,
        allocation_slack_bytes=int(FRAGMENTATION_FACTOR * profile.loss_fp32_output_bytes),
    )
