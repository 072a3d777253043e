"""One block of any model timed at several micro-batch sizes, on the inputs the model gives it.

A forward pre-hook captures the block's real inputs (positional and keyword: the hidden states,
and for a transformers layer its position embeddings, attention mask and position ids) during one
short forward of the model, which stops as soon as the block is reached. The block is then timed
alone on copies of those inputs whose batch dimension is scaled. One block needs little memory,
so micro-batches far beyond what the whole model fits can be timed; the step model scales the
block's times to the model.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from torch_fsdp_offload import models
from torch_fsdp_offload.planner.profiles import process_memory_fraction
from torch_fsdp_offload.planner.memory_breakdown import (
    block_names,
    call_model,
    first_tensor,
    map_tensors,
    plain_value,
    resolve_model,
)

__all__ = ["BlockTiming", "capture_block_inputs", "measure_block_timings"]


@dataclass(frozen=True)
class BlockTiming:
    """One block measured at one micro-batch.

    Attributes:
        batch_size (int): micro-batch of the measurement.
        forward_s (float), backward_s (float): median times of the block alone.
        activation_bytes (int): memory the forward left for backward (on a GPU, what it left
            allocated; elsewhere the storages autograd saved, parameters excluded).
        recompute_s (float | None): what non-reentrant activation checkpointing adds to the
            block's forward and backward (median of each, the difference; None where not timed).
        checkpoint_bytes (int | None): on a GPU, what the checkpointed forward left allocated: the
            output the next block keeps as its input, and what checkpointing itself holds (None
            elsewhere: autograd saves nothing there to count).
    """

    batch_size: int
    forward_s: float
    backward_s: float
    activation_bytes: int
    recompute_s: float | None = None
    checkpoint_bytes: int | None = None


class _Reached(Exception):
    """Raised by the capture hook: the rest of the model's forward is not needed."""


def capture_block_inputs(module: nn.Module, block: nn.Module, example_input: Any) -> tuple[tuple, dict]:
    """The positional and keyword arguments ``module``'s forward on ``example_input`` calls
    ``block`` with, detached; the forward stops when it reaches the block.

    Keyword values that are neither tensors nor plain values (a transformers KV cache the forward
    made) are left out, so the block runs without them as in training.

    Args:
        module (nn.Module): the model, with real (not ``meta``) tensors up to the block.
        block (nn.Module): one of its blocks.
        example_input: what the model is called with (see
            :func:`~torch_fsdp_offload.planner.memory_breakdown.call_model`).

    Returns:
        tuple[tuple, dict]: the block's args and kwargs.

    Raises:
        ValueError: the forward finished without calling ``block``.

    Example::

        >>> model = build_hf_causal_lm("llama-tiny")
        >>> args, kwargs = capture_block_inputs(model, model.model.layers[0], torch.zeros(1, 8, dtype=torch.long))
        >>> sorted(kwargs)  # ['attention_mask', 'position_embeddings', 'position_ids', 'use_cache']
    """
    captured: list[tuple[tuple, dict]] = []

    def hook(_block: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args, kwargs))
        raise _Reached

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            call_model(module, example_input)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError(
            f"the model's forward on the example input never called the block ({type(block).__name__}); "
            "pass blocks= that the forward runs, or an example_input= the model takes"
        )
    args, kwargs = captured[0]
    kept = {key: value for key, value in kwargs.items() if plain_value(value)}
    return map_tensors((args, kept), torch.Tensor.detach)


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _materialized(model: Any, blocks: Sequence[nn.Module | str] | None, device: torch.device,
                  dtype: torch.dtype) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(the model to run the short forward on, the block to capture at, the block to time).

    A module with real tensors runs where it is (the CPU, a GPU) and the timed block is a copy of
    its largest block on ``device``: nothing of the model moves. Anything else (a name, a config,
    a factory, a ``meta`` module) is built on ``meta`` and everything up to its largest block is
    materialised on ``device`` (``to_empty``, then initialised with finite random values: the
    values do not change the times).
    """
    if isinstance(model, nn.Module) and not _has_meta_tensors(model):
        found = models.find_blocks(model, blocks)
        sizes = [sum(p.numel() for p in block.parameters()) for block in found]
        block = found[sizes.index(max(sizes))]
        return model, block, copy.deepcopy(block).to(device=device, dtype=dtype)
    names = block_names(model, blocks) if blocks is not None and isinstance(model, nn.Module) else blocks
    module = resolve_model(model)[0].to(dtype)
    found = models.find_blocks(module, names)
    sizes = [sum(p.numel() for p in block.parameters()) for block in found]
    index = sizes.index(max(sizes))
    later = {id(m) for block in found[index + 1:] for m in block.modules()}
    with torch.no_grad():
        for submodule in module.modules():
            if id(submodule) in later:
                continue
            submodule.to_empty(device=device, recurse=False)
            for tensor in (*submodule.parameters(recurse=False), *submodule.buffers(recurse=False)):
                if tensor.is_floating_point():
                    tensor.uniform_(-0.02, 0.02)
                else:
                    tensor.zero_()
    return module, found[index], found[index]


def _example_on(example_input: Any, device: torch.device) -> Any:
    """``example_input`` on ``device``, where the model it is for runs. A ``meta`` tensor gives
    only a shape: it becomes zeros (token ids, positions), ones (a bool mask) or random values."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return tensor.to(device)
        if tensor.is_floating_point():
            return torch.randn(tensor.shape, dtype=tensor.dtype, device=device)
        fill = torch.ones if tensor.dtype == torch.bool else torch.zeros
        return fill(tensor.shape, dtype=tensor.dtype, device=device)

    return map_tensors(example_input, move)


def _scaled(value: Any, batch: int, factor: int) -> Any:
    """Tensors whose first dimension is the captured batch repeated ``factor`` times along it."""

    def scale(tensor: torch.Tensor) -> torch.Tensor:
        if factor == 1 or tensor.dim() == 0 or tensor.shape[0] != batch:
            return tensor
        return tensor.repeat(factor, *([1] * (tensor.dim() - 1)))

    return map_tensors(value, scale)


def _elapsed(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn``: CUDA events on a GPU, the wall clock elsewhere."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return sorted(times)[len(times) // 2]


def _activation_bytes(block: nn.Module, run: Callable[[], Any], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        output = run()
        after = torch.cuda.memory_allocated(device)
        del output
        return after - before
    # Parameters (and views of them, such as a transposed weight) are state, not activations.
    state = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    del output
    return sum(storages.values())


def measure_block_timings(
    model: Any,
    factors: Sequence[int] = (1, 2, 4, 8),
    *,
    example_input: Any = None,
    batch_size: int = 1,
    seq_len: int = 2048,
    blocks: Sequence[nn.Module | str] | None = None,
    device: torch.device | str = "cuda",
    compute_dtype: torch.dtype = torch.bfloat16,
    repeats: int = 5,
    memory_fraction: float = 0.5,
) -> list[BlockTiming]:
    """Time one block's forward and backward at several micro-batch sizes, on the inputs the model
    gives it.

    The model's largest block (of ``blocks``, or those
    :func:`~torch_fsdp_offload.models.find_blocks` finds) has its inputs captured during one short
    forward on ``example_input`` (:func:`capture_block_inputs`) where the model is: a model on the
    CPU or a GPU runs there, with the example moved to it, and stays there; only a copy of the
    block goes to ``device``. The inputs are cast to ``compute_dtype`` and moved to ``device``; the
    block is timed on them with every tensor whose first dimension is
    the captured batch repeated ``factor`` times. On a GPU, sizes whose activations would exceed
    ``memory_fraction`` of the free memory are skipped, with every size after them, and the memory
    the timing cached is given back to the device when it ends.

    Args:
        model: an ``nn.Module`` on any device (a transformers model, a module of blocks in an
            ``nn.ModuleList``, a built-in transformer), or anything
            :func:`~torch_fsdp_offload.planner.memory_breakdown.resolve_model` takes; a ``meta``
            one is built on ``meta`` and materialised on ``device`` up to the block with random values.
        factors: micro-batch multiples of the captured batch, smallest first.
        example_input: what the model is called with (a tensor, a tuple of arguments, or a mapping
            of keyword arguments), on any device (a ``meta`` tensor gives its shape); default
            ``zeros(batch_size, seq_len)`` token ids.
        batch_size (int), seq_len (int): the default example's shape.
        blocks: the model's blocks in forward order (modules or qualified names).
        device: where to time (a CUDA device; the CPU runs the same code, for tests).
        compute_dtype (torch.dtype): the block's dtype, and its floating-point inputs'.
        repeats (int): timed repetitions per size (median), after one warm-up.
        memory_fraction (float): share of free GPU memory one size may use.

    Returns:
        list[BlockTiming]: one per size that fitted, ``batch_size`` the captured batch times the
        factor.

    Raises:
        ValueError: the forward never reached the block, or no block found (see
            :func:`~torch_fsdp_offload.models.find_blocks`).
        TypeError: the block returned no tensor.

    Example::

        >>> model = build_hf_causal_lm("llama-tiny")
        >>> [t.batch_size for t in measure_block_timings(model, [1, 2], batch_size=2, seq_len=64, device="cpu")]
        [2, 4]
    """
    device = torch.device(device)
    source, capture_at, block = _materialized(model, blocks, device, compute_dtype)
    # The short forward runs where the model's tensors are; the example goes there.
    state = next(iter((*source.parameters(), *source.buffers())), None)
    where = state.device if state is not None else device
    if example_input is None:
        example_input = torch.zeros(batch_size, seq_len, dtype=torch.long)
    args, kwargs = capture_block_inputs(source, capture_at, _example_on(example_input, where))
    del source, capture_at

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=compute_dtype if tensor.is_floating_point() else None)

    args, kwargs = map_tensors((args, kwargs), to_device)
    timings = _time_sizes(block, args, kwargs, factors, device, repeats, memory_fraction)
    if device.type == "cuda":
        # The timed sizes' activations, left cached, fragment the memory training allocates from:
        # under a cap the allocator then empties its cache and retries mid-step, every step.
        del block, args, kwargs
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    return timings


def _time_sizes(block: nn.Module, args: tuple, kwargs: dict, factors: Sequence[int], device: torch.device,
                repeats: int, memory_fraction: float) -> list[BlockTiming]:
    """``block`` timed on ``args`` and ``kwargs`` with the batch scaled by each factor (see
    :func:`measure_block_timings`)."""
    hidden_key = None if args else next(iter(kwargs))
    hidden = args[0] if args else kwargs[hidden_key]
    captured_batch = hidden.shape[0]
    timings: list[BlockTiming] = []
    for factor in factors:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            # A cap of torch.cuda.set_per_process_memory_fraction bounds this process below the device.
            free = min(free, total * process_memory_fraction(device) - torch.cuda.memory_reserved(device))
            per_sample = timings[0].activation_bytes / timings[0].batch_size if timings else 40 * hidden[:1].nbytes
            if (per_sample + 3 * hidden[:1].nbytes) * captured_batch * factor > memory_fraction * free:
                break
        call_args, call_kwargs = _scaled((args, kwargs), captured_batch, factor)
        leaf = (call_args[0] if hidden_key is None else call_kwargs[hidden_key]).detach().requires_grad_(True)
        if hidden_key is None:
            call_args = (leaf, *call_args[1:])
        else:
            call_kwargs = {**call_kwargs, hidden_key: leaf}

        def forward() -> torch.Tensor:
            return first_tensor(block(*call_args, **call_kwargs))

        def checkpointed() -> torch.Tensor:
            # As apply() checkpoints a block (policy._checkpointed_forward).
            return first_tensor(torch.utils.checkpoint.checkpoint(block, *call_args, use_reentrant=False, **call_kwargs))

        grad = torch.randn_like(forward())
        forward().backward(grad)  # warm-up: kernels chosen, workspaces allocated
        checkpointed().backward(grad)
        activation_bytes = _activation_bytes(block, forward, device)
        checkpoint_bytes = _activation_bytes(block, checkpointed, device) if device.type == "cuda" else None
        forward_s = _elapsed(forward, repeats, device)
        total_s = _elapsed(lambda: forward().backward(grad), repeats, device)
        checkpointed_s = _elapsed(lambda: checkpointed().backward(grad), repeats, device)
        timings.append(BlockTiming(captured_batch * factor, forward_s, max(total_s - forward_s, 0.0), activation_bytes,
                                   recompute_s=max(checkpointed_s - total_s, 0.0), checkpoint_bytes=checkpoint_bytes))
        del leaf, grad, call_args, call_kwargs
    return timings
