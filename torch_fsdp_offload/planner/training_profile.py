"""The training profile: what the FSDP2 step model knows about a model at one micro-batch.

A :class:`TrainingProfile` holds the model's parameters and activations per block (from its
memory breakdown), its GPU forward, backward and optimizer times (timed, or estimated from the
FLOP count and the platform's peaks), and the host optimizer step's rates (measured, or the
platform profile's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from torch_fsdp_offload.planner.block_timing import BlockTiming
from torch_fsdp_offload.host_step import HostStepRates
from torch_fsdp_offload.planner.memory_breakdown import ModelBreakdown
from torch_fsdp_offload.planner.profiles import PlatformProfile

__all__ = ["fsdp2_reduce_dtype", "TrainingProfile", "training_profile"]

# Used only where no block was timed on the GPU. Share of the dense bf16 peak a transformer step
# reaches (measured on an H200, see docs/planner.md, "Calibration").
_ACHIEVED_FLOPS_FRACTION = 0.65
# Fused AdamW on the GPU is bandwidth bound: it reads param, grad and two moments and writes three
# of them (28 bytes per fp32 parameter), at this share of the DRAM peak (measured on an H200, see
# docs/planner.md, "Calibration").
_GPU_ADAMW_BYTES_PER_PARAM = 28
_GPU_ADAMW_DRAM_FRACTION = 0.29


@dataclass(frozen=True)
class TrainingProfile:
    """What the training-level model knows about a model at one micro-batch.

    Attributes:
        name (str): model label.
        n_blocks (int): FSDP parameter groups (transformer blocks).
        block_params (int): parameters per block.
        other_params (int): parameters outside the blocks (embeddings, head, final norm): the root
            group, on the GPU when only some blocks are given the policy, offloaded with them when
            every block is (:meth:`TrainingConfig.root_placement`).
        tokens (int): tokens per micro-batch.
        block_activation_bytes (int): bytes one block saves for backward.
        block_checkpoint_bytes (int): bytes one block keeps with checkpointing: its input (measured
            on a GPU with what checkpointing holds beside it, ``BlockTiming.checkpoint_bytes``).
        other_activation_bytes (int): activations outside the blocks (embeddings, logits, loss).
        loss_transient_bytes (int): the loss's transient at the end of forward and the start of backward
            (:class:`~torch_fsdp_offload.planner.memory_breakdown.ModelBreakdown`).
        loss_fp32_output_bytes (int): the loss's fp32 copy of the output, the largest block a step
            allocates anew (the same).
        forward_s (float), backward_s (float): GPU-resident forward and backward time.
        gpu_optimizer_s (float): fused AdamW on the GPU for all parameters.
        host_GBps (float): effective host DRAM bandwidth of the host optimizer step (see
            :attr:`~torch_fsdp_offload.planner.profiles.PlatformProfile.host_GBps`).
        param_bytes (int): bytes per sharded (master) parameter, 4 for fp32.
        compute_bytes (int): bytes per parameter in the compute dtype, 2 for bf16.
        reduce_bytes (int): bytes per gradient element in the dtype FSDP reduces in: what a
            reduce-scatter moves per element and its buffers hold (:func:`fsdp2_reduce_dtype`).
            The reduced shard is then cast to the parameter's dtype: :attr:`grad_bytes`.
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
            backward, as a fraction of ``forward_s``: with a timed block, its measured
            ``recompute_s`` over its forward; else the blocks' share of the forward times the
            share of a block's forward FLOPs that non-reentrant checkpointing reruns (it stops at
            the last tensor backward needs). 1.0, a whole forward, when unknown.
        host_alone_s_per_param (float | None): the same host step per parameter timed alone.
        host_busy_link_GBps (float | None): what the link moved, both ways together, while
            ``host_step_s_per_param`` was measured. With these two and ``host_step_s_per_param``
            the host step follows the shared-DRAM model of
            :func:`~torch_fsdp_offload.planner.step_time.predict_step`
            (:func:`~torch_fsdp_offload.host_step.measure_host_step` measures all three).
        host_alone_cast_s_per_param (float | None): the compute-dtype cast's part of
            ``host_alone_s_per_param``: what ``TrainingConfig(cast_on="device")`` takes off each
            host-stepped parameter
            (:func:`~torch_fsdp_offload.planner.traffic.host_step_seconds_per_param`). None:
            unknown; the cast's share of the host step's bytes is taken instead.
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
    loss_transient_bytes: int = 0
    loss_fp32_output_bytes: int = 0
    host_alone_s_per_param: float | None = None
    host_busy_link_GBps: float | None = None
    host_alone_cast_s_per_param: float | None = None
    host_link_busy_cast_s_per_param: float | None = None

    @property
    def total_params(self) -> int:
        return self.n_blocks * self.block_params + self.other_params

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of a reduced gradient shard, on the GPU or on its way to the host:
        FSDP casts the reduce output to the parameter's (the master's) dtype, whatever it reduced in."""
        return self.param_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fsdp2_reduce_dtype(mp_policy: MixedPrecisionPolicy, param_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype FSDP2 of the running torch reduces the gradients of ``param_dtype`` parameters in
    under ``mp_policy``: its ``reduce_dtype`` when set. With ``reduce_dtype=None``, torch 2.11
    through 2.14 reduce in ``mp_policy.param_dtype`` (the compute dtype, bf16 for a bf16 run);
    from 2.15 the reduction follows the parameter's ``grad_dtype``, its own dtype unless set, so an
    fp32 master reduces in fp32 (twice the bytes of a bf16 reduce-scatter).

    Args:
        mp_policy (MixedPrecisionPolicy): the policy passed to ``fully_shard``.
        param_dtype (torch.dtype): the sharded (master) parameters' dtype.

    Returns:
        torch.dtype: the reduce-scatter's dtype.

    Example::

        >>> fsdp2_reduce_dtype(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        torch.float32
        >>> fsdp2_reduce_dtype(MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # torch 2.15
        torch.float32
    """
    if mp_policy.reduce_dtype is not None:
        return mp_policy.reduce_dtype
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release >= (2, 15):
        return param_dtype
    return mp_policy.param_dtype or param_dtype


def training_profile(
    breakdown: ModelBreakdown,
    platform: PlatformProfile,
    *,
    timing: BlockTiming | None = None,
    host_GBps: float | None = None,
    host_rates: HostStepRates | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> TrainingProfile:
    """Build the training-level model input from a breakdown and, if available, a block timing.

    With a timing, forward and backward are the timed block's times the blocks, over the blocks'
    share of the forward FLOPs (the embedding, head and loss at the block's measured rate); without
    one, from the FLOP count at a fixed share of ``platform.gpu_bf16_TFLOPS`` (forward one third).
    Checkpointing's recompute is the timed block's (``recompute_s``), else the breakdown's FLOP
    count (``block_recompute_fraction``), times the blocks' share of the forward. The GPU optimizer is bandwidth bound (28 bytes per
    parameter at a fixed share of ``platform.gpu_dram_GBps``). ``host_GBps`` (default: the
    platform's) sets the host optimizer's speed; ``host_rates`` measured with the link busy
    (:func:`~torch_fsdp_offload.host_step.measure_host_step`) replace it with the
    shared-DRAM model of :func:`~torch_fsdp_offload.planner.step_time.predict_step`. The cast's
    part of the host step
    (what ``cast_on="device"`` takes off it) comes with those rates when they time it on its own,
    else from the platform profile (``host_alone_cast_s_per_param``,
    ``host_link_busy_cast_s_per_param``; None for a profile without them). ``reduce_dtype`` is the
    dtype FSDP reduces gradients in (:func:`fsdp2_reduce_dtype`).
    """
    # A checkpointed backward reruns each block's forward up to its last saved tensor: timed where
    # the block was (a checkpointed step pays the rerun's memory-bound ops and checkpointing's own
    # bookkeeping, which a FLOP count leaves out), else counted in FLOPs.
    # Checkpointing reruns the blocks alone: a fraction of the blocks' share of the forward.
    recompute = breakdown.block_recompute_fraction
    block_checkpoint = breakdown.block_checkpoint_bytes
    if timing is not None:
        if timing.recompute_s is not None and timing.forward_s > 0:
            recompute = timing.recompute_s / timing.forward_s
        # The timed block runs the blocks' share of the FLOPs; the rest (embedding, head, loss: a
        # tenth of a 3B model's forward at a 150k vocabulary) at the same measured rate.
        forward = timing.forward_s * breakdown.n_blocks / breakdown.block_forward_share
        backward = timing.backward_s * breakdown.n_blocks / breakdown.block_forward_share
        block_activation = timing.activation_bytes
        if timing.checkpoint_bytes is not None:
            block_checkpoint = timing.checkpoint_bytes
        source = "measured block"
    recompute *= breakdown.block_forward_share
    if timing is None:
        total = breakdown.training_flops() / (platform.gpu_bf16_TFLOPS * 1e12 * _ACHIEVED_FLOPS_FRACTION)
        forward, backward = total / 3, 2 * total / 3
        block_activation = breakdown.block_activation_bytes
        source = f"analytic (FLOPs at {_ACHIEVED_FLOPS_FRACTION:.0%} of {platform.name} peak)"
    params = breakdown.total_params
    return TrainingProfile(
        name=breakdown.name,
        n_blocks=breakdown.n_blocks,
        block_params=breakdown.block_params,
        other_params=breakdown.other_params,
        tokens=breakdown.batch_size * breakdown.seq_len,
        block_activation_bytes=block_activation,
        block_checkpoint_bytes=block_checkpoint,
        other_activation_bytes=breakdown.other_activation_bytes,
        loss_transient_bytes=breakdown.loss_transient_bytes,
        loss_fp32_output_bytes=breakdown.loss_fp32_output_bytes,
        forward_s=forward,
        backward_s=backward,
        gpu_optimizer_s=params * _GPU_ADAMW_BYTES_PER_PARAM / (platform.gpu_dram_GBps * 1e9 * _GPU_ADAMW_DRAM_FRACTION),
        host_GBps=host_GBps or platform.host_GBps,
        compute_bytes=breakdown.compute_bytes,
        reduce_bytes=reduce_dtype.itemsize,
        source=source,
        recompute_fraction=recompute,
        **(
            {
                "host_alone_s_per_param": host_rates.alone_s_per_param,
                "host_step_s_per_param": host_rates.link_busy_s_per_param,
                "host_busy_link_GBps": host_rates.link_GBps_meanwhile,
            }
            if host_rates is not None and host_rates.link_busy_s_per_param is not None
            else {}
        ),
        **_host_cast_rates(platform, host_rates),
    )


def _host_cast_rates(platform: PlatformProfile, host_rates: HostStepRates | None) -> dict[str, float | None]:
    """The cast's part of the host step, alone and link-busy, for a TrainingProfile: measured with
    the step's rates when they were; unknown (None: the step model splits the step by bytes) when
    the step was measured without its cast apart, since the platform profile's figures are another
    host's; the platform profile's when nothing was measured (its host step is the profile's too)."""
    if host_rates is not None and host_rates.link_busy_s_per_param is not None:
        return {"host_alone_cast_s_per_param": host_rates.alone_cast_s_per_param,
                "host_link_busy_cast_s_per_param": host_rates.link_busy_cast_s_per_param}
    return {"host_alone_cast_s_per_param": platform.host_alone_cast_s_per_param,
            "host_link_busy_cast_s_per_param": platform.host_link_busy_cast_s_per_param}
