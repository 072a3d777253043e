"""Peak GPU memory of one FSDP2 training step under an offload setting, phase by phase."""

from __future__ import annotations

from typing import Any

from torch_fsdp_offload.planner.library_facts import (
    ACTIVATION_PREFETCH_BLOCKS,
    DEFAULT_MAX_INFLIGHT_BYTES,
    STREAM_RUN_BYTES,
    STREAM_RUNS_IN_FLIGHT,
)
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = ["phase_parts", "phase_peaks"]


def phase_peaks(profile: TrainingProfile, config: TrainingConfig, **placement: Any) -> dict[str, float]:
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
      ``STREAM_RUNS_IN_FLIGHT`` runs of ``STREAM_RUN_BYTES`` in transit (each run uploads
      parameters, gradients and state), the one being stepped and the next one's upload; the run
      still copying down was freed by the host, and the allocator keeps its memory (reserved)
      without counting it as allocated, which is what peaks are measured in.

    With gradient accumulation (``config.grad_accum_steps``) the resident groups' gradients are live
    in every phase (:func:`phase_parts`, which gives each phase's peak by kind).

    Every offloaded group's compute-dtype shard is copied into a staging buffer before its
    all-gather: ``prefetch_depth`` of them live beside the unsharded groups. Blocks kept unsharded
    after forward (``config.keep_unsharded``) hold their unsharded parameters from their forward
    to their backward: at the end of forward and before each block's backward, those of them
    beyond the groups counted as unsharded anyway.

    Args:
        profile (TrainingProfile): the model at one micro-batch (per GPU).
        config (TrainingConfig): the knobs (prefetch depth, checkpointing, accumulation).
        **placement: what is where (:func:`phase_parts`'s ``offloaded_blocks``,
            ``streamed_blocks``, ``activation_blocks``, ``world_size``, ``copies``).

    Returns:
        dict[str, float]: ``{"forward", "backward", "optimizer"}`` peak bytes.

    Example::

        >>> phase_peaks(profile, TrainingConfig(activations=1.0), offloaded_blocks=0,
        ...             streamed_blocks=0, activation_blocks=8)["backward"]
    """
    return {phase: sum(parts.values()) for phase, parts in phase_parts(profile, config, **placement).items()}


def phase_parts(
    profile: TrainingProfile,
    config: TrainingConfig,
    *,
    offloaded_blocks: int,
    streamed_blocks: int,
    activation_blocks: int,
    world_size: int = 1,
    copies: bool = True,
) -> dict[str, dict[str, float]]:
    """What :func:`phase_peaks` adds up, by kind, at each phase's peak: ``{phase: {part: bytes}}``
    with the parts ``weights`` (resident fp32 masters), ``optimizer_state``, ``grads``,
    ``unsharded`` (gathered groups, copy-in staging, blocks kept unsharded), ``activations``
    (saved, reloaded, in flight, recomputed, outside the blocks), ``loss`` (its transient) and
    ``streamed`` (optimizer runs in transit), each present where it is not zero.

    With ``config.grad_accum_steps > 1`` the resident groups' sharded gradients (the root's too)
    are live from the first micro-batch on: through every later forward and backward, beside a
    freshly reduced shard being added to them. An offloaded group's running sums come up beside
    its reduced shard, are added to, and go down.

    Args:
        profile (TrainingProfile): the model at one micro-batch (per GPU).
        config (TrainingConfig): the knobs (prefetch depth, checkpointing, accumulation).
        offloaded_blocks (int): blocks whose state lives on the host (the last in forward order).
        streamed_blocks (int): offloaded blocks stepped on the GPU (the first offloaded ones;
            ``OffloadOptimizer`` streams whole groups).
        activation_blocks (int): blocks whose activations are offloaded (the first ones).
        world_size (int): GPUs the parameters are sharded over.
        copies (bool): offloaded state crosses a link (False on UNIFIED: read in place).

    Returns:
        dict[str, dict[str, float]]: per phase, its peak's bytes by part.

    Example::

        >>> phase_parts(profile, TrainingConfig(grad_accum_steps=4), offloaded_blocks=0,
        ...             streamed_blocks=0, activation_blocks=0)["forward"]["grads"]
    """
    n_blocks = profile.n_blocks
    shard = profile.block_params / world_size
    grad_shard = shard * profile.grad_bytes
    resident_blocks = n_blocks - offloaded_blocks
    root = config.root_placement(n_blocks, profile.other_params)
    root_offloaded, root_streamed = root != "resident", root == "streamed"
    offloaded_params = offloaded_blocks * profile.block_params + (profile.other_params if root_offloaded else 0)
    resident_params = (profile.total_params - offloaded_params) / world_size
    weights = resident_params * profile.param_bytes
    optimizer_state = resident_params * profile.optimizer_state_bytes
    resident_grads = resident_params * profile.grad_bytes
    accumulating = config.grad_accum_steps > 1
    live_groups = 1 + max(config.prefetch_depth, 1)
    # The root group is gathered first and resharded only after backward (FSDP2 keeps the root
    # unsharded after forward), offloaded or not: its compute-dtype parameters live all step.
    unsharded = (live_groups * profile.block_params + profile.other_params) * profile.compute_bytes
    staging = min(config.prefetch_depth, offloaded_blocks) * shard * profile.compute_bytes if copies else 0.0
    saved = profile.block_checkpoint_bytes if config.checkpointing else profile.block_activation_bytes
    offloaded_acts = activation_blocks if copies else 0

    kept = config.kept_blocks(n_blocks)
    block_unsharded = profile.block_params * profile.compute_bytes

    in_flight = min(offloaded_acts * saved, DEFAULT_MAX_INFLIGHT_BYTES)
    # Forward ends with the loss, its transient beside every block's activations.
    forward = {
        "weights": weights, "optimizer_state": optimizer_state, "grads": resident_grads if accumulating else 0.0,
        "unsharded": unsharded + staging + max(0, len(kept) - live_groups) * block_unsharded,
        "activations": (n_blocks - offloaded_acts) * saved + in_flight + profile.other_activation_bytes,
        "loss": profile.loss_transient_bytes,
    }

    # Blocks 0 .. offloaded_acts-1 have offloaded activations; blocks resident_blocks .. n-1 have
    # offloaded state; of those, the first streamed_blocks are stepped on the GPU.
    reload_window = 1 + ACTIVATION_PREFETCH_BLOCKS
    # Backward opens with the loss's: every block's activations still saved, beside the output's
    # gradient (the same transient).
    moments = [{"activations": (n_blocks - offloaded_acts) * saved, "loss": profile.loss_transient_bytes,
                "grads": resident_grads if accumulating else 0.0}]
    for block in range(n_blocks - 1, -1, -1):
        saved_here = sum(saved for j in range(offloaded_acts, block + 1))
        reloaded = saved * sum(1 for j in range(max(0, block - reload_window + 1), min(block, offloaded_acts - 1) + 1))
        later = range(block + 1, n_blocks)
        on_device = [j for j in later if j < resident_blocks or not copies]
        # Accumulating, every resident group's gradient is live, and a fresh shard is added to one.
        grads = resident_grads + grad_shard if accumulating else grad_shard * len(on_device)
        if block + 1 < n_blocks and block + 1 not in on_device:
            # The offloaded group just finished: its gradient on its way down, and accumulating,
            # its running sum brought up to be added to.
            grads += grad_shard * (2 if accumulating else 1)
        recompute = profile.block_activation_bytes if config.checkpointing else 0.0
        # Kept blocks before this one, beyond the prefetched groups counted in `unsharded`.
        kept_params = max(0, sum(1 for j in kept if j < block) - (live_groups - 1)) * block_unsharded
        moments.append({"activations": saved_here + reloaded + recompute, "grads": grads, "unsharded": kept_params})
    backward = max(moments, key=lambda parts: sum(parts.values()))
    backward = {
        "weights": weights, "optimizer_state": optimizer_state, "grads": backward.get("grads", 0.0),
        "unsharded": unsharded + staging + backward.get("unsharded", 0.0),
        "activations": backward["activations"] + profile.other_activation_bytes, "loss": backward.get("loss", 0.0),
    }

    optimizer = {"weights": weights, "optimizer_state": optimizer_state, "grads": resident_grads}
    per_param_up = profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes
    if (streamed_blocks or root_streamed) and copies:
        # Streamed gradients went down in backward like the host groups'; each run uploads its
        # parameters, gradients and optimizer state. A run holds whole parameters, so one of the
        # root's (an embedding) can make a run larger than the usual.
        in_transit = min(streamed_blocks * shard * per_param_up, (STREAM_RUNS_IN_FLIGHT - 1) * STREAM_RUN_BYTES)
        root_run = profile.other_params / world_size * per_param_up if root_streamed else 0.0
        optimizer["streamed"] = max(in_transit, root_run)
    elif streamed_blocks or root_streamed:
        root_grads = profile.other_params / world_size * profile.grad_bytes if root_streamed else 0.0
        optimizer["grads"] += streamed_blocks * grad_shard + root_grads
    return {phase: {part: amount for part, amount in parts.items() if amount}
            for phase, parts in (("forward", forward), ("backward", backward), ("optimizer", optimizer))}
