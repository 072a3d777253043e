"""One transformer block timed on the GPU at several micro-batch sizes.

One block needs little memory, so micro-batches far beyond what the whole model fits can be timed;
the step model scales the block's times to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_fsdp_offload import models

__all__ = ["BlockTiming", "measure_block_timings"]


@dataclass(frozen=True)
class BlockTiming:
    """One block measured on the GPU at one micro-batch.

    Attributes:
        batch_size (int): micro-batch of the measurement.
        forward_s (float), backward_s (float): median times of the block alone.
        activation_bytes (int): GPU memory the forward left allocated for backward.
    """

    batch_size: int
    forward_s: float
    backward_s: float
    activation_bytes: int


def _cuda_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_block_timings(
    model: Any,
    batch_sizes: Sequence[int],
    seq_len: int,
    *,
    device: torch.device | str = "cuda",
    compute_dtype: torch.dtype = torch.bfloat16,
    repeats: int = 5,
    memory_fraction: float = 0.5,
) -> list[BlockTiming]:
    """Time one block's forward and backward at several micro-batch sizes on the GPU.

    One block needs little memory, so micro-batches far beyond what the whole model fits can be
    timed (the talk's method); sizes whose activations would exceed ``memory_fraction`` of the
    free GPU memory are skipped.

    Args:
        model: a built-in model name or :class:`~torch_fsdp_offload.models.TransformerConfig`
            (blocks are called as ``block(x, rope)``).
        batch_sizes: micro-batch sizes, smallest first.
        seq_len (int): tokens per sequence.
        device: a CUDA device.
        compute_dtype (torch.dtype): block dtype.
        repeats (int): timed repetitions per size (median), after one warm-up.
        memory_fraction (float): share of free GPU memory one size may use.

    Returns:
        list[BlockTiming]: one per size that fitted.

    Raises:
        RuntimeError: no CUDA device.
        TypeError: a model that is not a built-in transformer.

    Example::

        >>> [t.forward_s for t in measure_block_timings("anchor-1.6b", [1, 2, 4, 8], 2048)]
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measure_block_timings needs a CUDA GPU; on CPU use a platform profile or a scenario")
    config = models.MODEL_CONFIGS[model] if isinstance(model, str) else model
    if not isinstance(config, models.TransformerConfig):
        raise TypeError("measure_block_timings times built-in transformer blocks; pass a name or TransformerConfig")
    device = torch.device(device)
    block = models.TransformerBlock(config).to(device=device, dtype=compute_dtype)
    rope = None
    if config.rope:
        rope = tuple(t.to(device) for t in models.rope_tables(config))
    timings = []
    for batch_size in batch_sizes:
        estimate = 40 * batch_size * seq_len * config.dim * 2
        free, _ = torch.cuda.mem_get_info(device)
        if estimate > memory_fraction * free:
            break
        x = torch.randn(batch_size, seq_len, config.dim, device=device, dtype=compute_dtype, requires_grad=True)
        grad = torch.randn_like(x)
        block(x, rope).backward(grad)  # warm-up: kernels chosen, workspaces allocated
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        output = block(x, rope)
        activation_bytes = torch.cuda.memory_allocated(device) - before
        del output
        forward_s = _cuda_time(lambda: block(x, rope), repeats)
        total_s = _cuda_time(lambda: block(x, rope).backward(grad), repeats)
        timings.append(BlockTiming(batch_size, forward_s, max(total_s - forward_s, 0.0), activation_bytes))
        del x, grad
    return timings
