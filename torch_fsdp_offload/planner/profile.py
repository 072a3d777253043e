"""Profile a real model: its memory breakdown (analytic, on the ``meta`` device, any machine) and
its timings (one block at several micro-batch sizes, on a GPU).

The breakdown traces one forward pass on ``meta`` tensors with ``saved_tensors_hooks``: every
tensor autograd keeps for backward is seen with its shape and dtype, nothing is allocated or
computed. Views are counted once through their base, parameters and buffers never. Attention is counted as a
fused (flash / memory-efficient) kernel saves it, O(batch * heads * seq), not as the math path the
meta device would trace, which would keep the O(seq^2) score matrix.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from torch_fsdp_offload import models
from torch_fsdp_offload.planner.cost_model import TrainingProfile
from torch_fsdp_offload.planner.profiles import PlatformProfile

__all__ = [
    "BlockTiming",
    "HOST_BYTES_PER_LINK_BUSY_PARAM",
    "HostStepRates",
    "LinkBusy",
    "ModelBreakdown",
    "host_GBps_from_link_busy",
    "measure_block_timings",
    "measure_host_step",
    "model_breakdown",
    "resolve_model",
    "training_profile",
]

# Share of the dense bf16 peak a transformer step reaches; calibrated on our H200 anchor run
# (1.6B params, bs 4 x 2048: 612 TFLOP/s in forward, 543 in backward, of 835).
_ACHIEVED_FLOPS_FRACTION = 0.65
# Fused AdamW on the GPU is bandwidth bound: it reads param, grad and two moments and writes three
# of them (28 bytes per fp32 parameter); our H200 took 0.0377 s for 1.611e9 params (about 1.2 TB/s).
_GPU_ADAMW_BYTES_PER_PARAM = 28
_GPU_ADAMW_DRAM_FRACTION = 0.29
#: Host DRAM bytes per host-stepped parameter that, over the host step's time measured with the
#: link busy both ways (:func:`host_GBps_from_link_busy`), give the step model's host bandwidth.
#: Fitted on six H200 runs of the seventh and eighth sessions (0.44-0.64 ns per parameter with
#: the link busy; docs/planner.md, "Round 7"): 64 reproduces their host-bound steps
#: best. It sits between the host step's own bytes (38) and those plus the DMA's while it is
#: measured (~90): in a training step the link is busy for part of the host step only.
HOST_BYTES_PER_LINK_BUSY_PARAM = 64.0


@dataclass(frozen=True)
class ModelBreakdown:
    """Where a model's training memory goes, per micro-batch, from a meta-device trace.

    Attributes:
        name (str): model label.
        n_blocks (int): repeated blocks (FSDP groups).
        block_params (int): parameters of the largest block.
        other_params (int): parameters outside the blocks.
        batch_size (int), seq_len (int): the micro-batch traced.
        block_activation_bytes (int): bytes the largest block saves for backward.
        block_checkpoint_bytes (int): bytes a checkpointed block keeps (its input).
        other_activation_bytes (int): bytes saved outside the blocks (embedding, head, loss).
        compute_bytes (int): bytes per element of the compute dtype.
        dim (int): hidden size (block input's last dimension).
        block_recompute_fraction (float): FLOPs the backward of a checkpointed block recomputes, as a
            fraction of the block's forward FLOPs, counted on the ``meta`` device. Below 1 because
            non-reentrant checkpointing stops recomputing at the last tensor backward needs: a
            transformer block's last matmul (the MLP's down projection) is not rerun (anchor-1.6b:
            0.69 at 2048 tokens, 0.75 at 8192, where attention weighs more).
        block_forward_share (float): the blocks' share of the model's forward FLOPs (the rest:
            embedding, final norm, head, loss); what checkpointing the blocks reruns is this share of
            the forward times ``block_recompute_fraction``.
    """

    name: str
    n_blocks: int
    block_params: int
    other_params: int
    batch_size: int
    seq_len: int
    block_activation_bytes: int
    block_checkpoint_bytes: int
    other_activation_bytes: int
    compute_bytes: int
    dim: int
    block_recompute_fraction: float = 1.0
    block_forward_share: float = 1.0

    @property
    def total_params(self) -> int:
        return self.n_blocks * self.block_params + self.other_params

    @property
    def activation_bytes(self) -> int:
        return self.n_blocks * self.block_activation_bytes + self.other_activation_bytes

    def training_flops(self) -> float:
        """Forward + backward FLOPs of one step: 6 per parameter per token, plus causal attention."""
        tokens = self.batch_size * self.seq_len
        attention = 6 * self.n_blocks * self.batch_size * self.seq_len**2 * self.dim
        return 6.0 * self.total_params * tokens + attention


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


def resolve_model(model: Any) -> tuple[nn.Module, str]:
    """Turn a model argument into a module on the ``meta`` device and a label.

    Args:
        model: a built-in name (``MODEL_CONFIGS``), a transformers config name (``HF_CONFIGS``, or
            ``"hf:<name, path or hub id>"``), a :class:`~torch_fsdp_offload.models.TransformerConfig`,
            a factory called with no arguments under ``torch.device("meta")``, or an ``nn.Module``
            (deep-copied to ``meta``; pass a factory for models too big to copy).

    Raises:
        ValueError: unknown name.
        TypeError: anything else.
    """
    if isinstance(model, str):
        if model in models.MODEL_CONFIGS:
            return models.build_model(model, device="meta"), model
        hf_name = model[3:] if model.startswith("hf:") else model
        if model.startswith("hf:") or model in models.HF_CONFIGS:
            return models.build_hf_causal_lm(hf_name, device="meta"), model
        raise ValueError(
            f"unknown model {model!r}; use one of {sorted(models.MODEL_CONFIGS)}, "
            f"{sorted(models.HF_CONFIGS)}, 'hf:<config path or hub id>', or pass a module factory"
        )
    if isinstance(model, models.TransformerConfig):
        return models.build_model(model, device="meta"), "custom TransformerConfig"
    if isinstance(model, nn.Module):
        return copy.deepcopy(model).to("meta"), type(model).__name__
    if callable(model):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"the model factory returned {type(built).__name__}, not an nn.Module")
        return built.to("meta"), getattr(model, "__name__", type(built).__name__)
    raise TypeError(
        f"cannot plan for a {type(model).__name__}; pass a model name, a TransformerConfig, a module "
        "factory or an nn.Module"
    )


class _FusedAttentionAccounting(TorchFunctionMode):
    """Replaces SDPA on meta tensors with what a fused kernel keeps: q, k, v, output and logsumexp."""

    def __init__(self, recorder: _SavedTensorRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        batch, heads, seq_len, _ = query.shape
        value_dim = value.shape[-1]
        # Fused kernels write the output as (batch, seq, heads, dim), so the usual
        # transpose(1, 2).reshape afterwards is a view, not a copy.
        output_base = torch.empty(
            batch, seq_len, heads, value_dim, dtype=query.dtype, device=query.device, requires_grad=True
        )
        output = output_base.transpose(1, 2)
        for tensor in (query, key, value, output):
            self.recorder.pack(tensor)
        self.recorder.add_bytes(batch * heads * seq_len * 4)  # fp32 logsumexp
        return output


class _SavedTensorRecorder:
    def __init__(self, state: Sequence[torch.Tensor]) -> None:
        # Parameters and buffers are model state, not activations, even when saved for backward.
        self.state_ids = {id(t) for t in state}
        self.seen: dict[int, torch.Tensor] = {}
        self.bytes_by_owner: dict[int, int] = {}
        self.owner = -1

    def add_bytes(self, nbytes: int) -> None:
        self.bytes_by_owner[self.owner] = self.bytes_by_owner.get(self.owner, 0) + nbytes

    def pack(self, tensor: torch.Tensor) -> None:
        # Nothing is kept: the traced graph is never backwarded, and a saved output kept here
        # would keep its own grad_fn (and the graph) alive through a cycle gc cannot break.
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in self.state_ids or id(tensor) in self.state_ids or id(base) in self.seen:
            return None
        self.seen[id(base)] = base  # keeps the id valid for the whole trace
        self.add_bytes(base.untyped_storage().nbytes())
        return None


def model_breakdown(
    model: Any,
    *,
    batch_size: int,
    seq_len: int,
    compute_dtype: torch.dtype = torch.bfloat16,
    vocab_size: int | None = None,
) -> ModelBreakdown:
    """Trace one forward pass and the loss on the ``meta`` device and count what backward needs.

    Args:
        model: see :func:`resolve_model`.
        batch_size (int): sequences per micro-batch.
        seq_len (int): tokens per sequence.
        compute_dtype (torch.dtype): dtype of the forward (FSDP's ``param_dtype``).
        vocab_size (int | None): token id range of the dummy input (default: the model's
            ``config.vocab_size``, else 2).

    Returns:
        ModelBreakdown: parameters per block and outside, activation bytes per block.

    Raises:
        ValueError: non-positive sizes, or a model without a list of blocks.

    Example::

        >>> breakdown = model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048)
        >>> breakdown.n_blocks, breakdown.block_params
        (8, 201342976)
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    module, name = resolve_model(model)
    module = module.to(compute_dtype)
    blocks = models.find_blocks(module)
    block_params = [sum(p.numel() for p in block.parameters()) for block in blocks]
    total_params = sum(p.numel() for p in module.parameters())
    recorder = _SavedTensorRecorder([*module.parameters(), *module.buffers()])
    block_inputs: dict[int, int] = {}
    # The largest block's call, whose checkpoint recompute is counted after the trace.
    largest = max(range(len(blocks)), key=lambda i: block_params[i])
    largest_call: list[tuple[tuple, dict]] = []
    dims: list[int] = []

    block_flops = [0]
    counter = FlopCounterMode(display=False)

    def enter(index: int):
        def hook(_module, args, kwargs=None):
            block_flops[0] -= counter.get_total_flops()
            recorder.owner = index
            hidden = args[0] if args else next(iter((kwargs or {}).values()))
            block_inputs[index] = hidden.untyped_storage().nbytes()
            if index == largest and not largest_call:
                largest_call.append((args, dict(kwargs or {})))
            dims.append(hidden.shape[-1])

        return hook

    def leave(_module, _args, _output):
        block_flops[0] += counter.get_total_flops()
        recorder.owner = -1

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(index), with_kwargs=True))
        handles.append(block.register_forward_hook(leave))
    vocab = vocab_size or getattr(getattr(module, "config", None), "vocab_size", None) or 2
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t),
            _FusedAttentionAccounting(recorder),
            counter,
        ):
            output = module(tokens)
            logits = output.logits if hasattr(output, "logits") else output
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten() % vocab)
    finally:
        for handle in handles:
            handle.remove()
    block_bytes = [recorder.bytes_by_owner.get(i, 0) for i in range(len(blocks))]
    recompute, block_forward = _checkpoint_flops(blocks[largest], *largest_call[0]) if largest_call else (1.0, 0)
    # The trace counted no attention (SDPA is replaced above): what it counted outside the blocks
    # is the rest of the forward; the blocks' own count, attention included, comes from the block.
    other_forward = max(0, counter.get_total_flops() - block_flops[0])
    share = len(blocks) * block_forward / (len(blocks) * block_forward + other_forward) if block_forward else 1.0
    return ModelBreakdown(
        name=name,
        n_blocks=len(blocks),
        block_params=max(block_params),
        other_params=total_params - sum(block_params),
        batch_size=batch_size,
        seq_len=seq_len,
        block_activation_bytes=max(block_bytes),
        block_checkpoint_bytes=max(block_inputs.values()),
        other_activation_bytes=recorder.bytes_by_owner.get(-1, 0),
        compute_bytes=torch.empty((), dtype=compute_dtype).element_size(),
        dim=dims[0] if dims else 0,
        block_recompute_fraction=recompute,
        block_forward_share=share,
    )


def _plain_value(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain_value(item) for item in value)
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def _checkpoint_flops(block: nn.Module, args: tuple, kwargs: dict) -> tuple[float, int]:
    """(FLOPs a non-reentrant checkpoint of ``block`` recomputes in backward over its forward FLOPs,
    the block's forward FLOPs), counted on the ``meta`` tensors the trace called it with (nothing
    is computed). (1.0, 0) when the meta device cannot run the block's backward."""
    # Tensors detached, nested ones too (a (cos, sin) pair): the trace's graph is not this one.
    # Keyword objects that are neither tensors nor plain values (a transformers KV cache the trace
    # filled) are left out: the count must not append to them.
    kept = {k: v for k, v in kwargs.items() if _plain_value(v)}
    detached_args, detached_kwargs = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kept))
    # The hidden state is the first positional argument, else the first keyword one.
    hidden_key = None if args else next(iter(kwargs))
    hidden = args[0] if args else kwargs[hidden_key]

    def flops(checkpointed: bool) -> tuple[int, int]:
        leaf = torch.empty_like(hidden, requires_grad=True)
        if hidden_key is None:
            call_args, call_kwargs = (leaf, *detached_args[1:]), detached_kwargs
        else:
            call_args, call_kwargs = (), {**detached_kwargs, hidden_key: leaf}
        with FlopCounterMode(display=False) as counter:
            if checkpointed:
                output = checkpoint(block, *call_args, use_reentrant=False, preserve_rng_state=False, **call_kwargs)
            else:
                output = block(*call_args, **call_kwargs)
            output = output[0] if isinstance(output, (tuple, list)) else output
            forward = counter.get_total_flops()
            output.backward(torch.empty_like(output))
        return forward, counter.get_total_flops()

    try:
        forward, plain = flops(checkpointed=False)
        _, checkpointed = flops(checkpointed=True)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        # A block the meta device cannot run backward through: charge a full forward, the most
        # a checkpointed block can recompute.
        return 1.0, 0
    if forward <= 0:
        return 1.0, 0
    return min(1.0, max(0.0, (checkpointed - plain) / forward)), forward


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


class LinkBusy:
    """Context manager: a thread copies pinned buffers host-to-device and device-to-host at once,
    back to back, until exit, as the copies of an offloaded training step do.

    Args:
        nbytes (int): bytes of each direction's buffer.

    Attributes:
        gbps (float): after exit, what the thread moved (both directions) per second.

    Raises:
        RuntimeError: no CUDA device.

    Example::

        >>> with LinkBusy() as link:
        ...     optimizer.step()   # host work while the DMA takes its share of host DRAM
        >>> link.gbps
    """

    def __init__(self, nbytes: int = 256 << 20) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("LinkBusy copies over the CPU-GPU link and needs a CUDA device; none is available")
        from torch_fsdp_offload.memory import pinned_empty

        self.source = pinned_empty((nbytes,), torch.uint8)
        self.destination = pinned_empty((nbytes,), torch.uint8)
        self.device_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.device_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stop = threading.Event()
        self.moved = 0
        self.gbps = 0.0

    def _copy_until_stopped(self) -> None:
        h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
        while not self.stop.is_set():
            with torch.cuda.stream(h2d):
                self.device_in.copy_(self.source, non_blocking=True)
            with torch.cuda.stream(d2h):
                self.destination.copy_(self.device_out, non_blocking=True)
            h2d.synchronize()
            d2h.synchronize()
            self.moved += 2 * self.source.numel()

    def __enter__(self) -> "LinkBusy":
        self.thread = threading.Thread(target=self._copy_until_stopped, daemon=True)
        self.started = time.perf_counter()
        self.thread.start()
        time.sleep(0.2)  # both directions running before the caller's work starts
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.gbps = self.moved / (time.perf_counter() - self.started) / 1e9


def host_GBps_from_link_busy(seconds_per_param: float) -> float:
    """The step model's host DRAM bandwidth (``PlatformProfile.host_GBps``) from the host step's
    time per parameter measured while the link copies both ways (:class:`LinkBusy`).

    In a training step the host step shares host DRAM with the link's DMA only part of the time,
    and :func:`~torch_fsdp_offload.planner.cost_model.predict_step` charges the DMA's bytes
    separately, so the model's bandwidth is :data:`HOST_BYTES_PER_LINK_BUSY_PARAM` over that time.

    Args:
        seconds_per_param (float): fused AdamW plus the compute-dtype cast, per parameter, with the
            link busy.

    Returns:
        float: GB/s.

    Raises:
        ValueError: ``seconds_per_param`` not positive.

    Example::

        >>> host_GBps_from_link_busy(0.57e-9)  # our H200 host: 0.57 ns per parameter
        112.28...
    """
    if not seconds_per_param > 0:
        raise ValueError(f"seconds_per_param must be positive, got {seconds_per_param}")
    return HOST_BYTES_PER_LINK_BUSY_PARAM / seconds_per_param / 1e9


@dataclass(frozen=True)
class HostStepRates:
    """How fast the host optimizer step runs on this machine, per parameter (fused AdamW plus the
    cast of the master into the compute-dtype mirror), alone and beside the link's DMA.

    Attributes:
        alone_s_per_param (float): seconds per parameter with nothing else running.
        link_busy_s_per_param (float | None): the same while :class:`LinkBusy` copies both ways
            (None where there is no CUDA device).
        link_GBps_meanwhile (float | None): what the link moved meanwhile, both ways together.
        alone_cast_s_per_param (float | None): the cast's part of ``alone_s_per_param`` (the rest
            is the AdamW step; stock FSDP2 offload casts on the GPU and pays only that rest).
        link_busy_cast_s_per_param (float | None): the cast's part of ``link_busy_s_per_param``.
    """

    alone_s_per_param: float
    link_busy_s_per_param: float | None = None
    link_GBps_meanwhile: float | None = None
    alone_cast_s_per_param: float | None = None
    link_busy_cast_s_per_param: float | None = None


def measure_host_step(
    numel: int = 1 << 25, *, threads: int | None = None, repeats: int = 3, link_busy: bool | None = None
) -> HostStepRates:
    """Time CoherentOffload's host step on this machine, alone and (``link_busy``) beside the DMA.

    Steps ``numel`` fp32 parameters (512 MiB of parameter, gradient and moments by default) with
    fused AdamW, then casts the master into a bf16 mirror; the step and the cast each the fastest of
    ``repeats``. With ``link_busy`` (the default where CUDA is available) it times the same again
    while :class:`LinkBusy` copies both ways: host DRAM serves the DMA and the step at once, and how much
    the DMA slows the step differs between hosts and even between runs on one host (0.44-0.70 ns
    per parameter on our H200 machines for 0.29-0.44 alone).

    Args:
        numel (int): parameters to step; large enough that they do not fit in the CPU caches.
        threads (int | None): intra-op threads during the measurement (default: torch's count minus
            one when a GPU is present, as ``OffloadOptimizer`` leaves a core to the GPU's thread).
        repeats (int): timed steps after one warm-up step.
        link_busy (bool | None): also time it with the link copying both ways (default: where CUDA
            is available).

    Returns:
        HostStepRates: seconds per parameter alone and with the link busy (each with the cast's part
            on its own), and the link's rate then.

    Raises:
        ValueError: ``numel``, ``threads`` or ``repeats`` below 1, or ``link_busy=True`` without a
            CUDA device.

    Example::

        >>> measure_host_step()  # HostStepRates(alone_s_per_param=3.2e-10, link_busy_s_per_param=5.5e-10, ...)
    """
    if numel < 1 or repeats < 1 or (threads is not None and threads < 1):
        raise ValueError(f"numel, repeats and threads must be >= 1, got {numel}, {repeats}, {threads}")
    if link_busy is None:
        link_busy = torch.cuda.is_available()
    if link_busy and not torch.cuda.is_available():
        raise ValueError("link_busy=True copies over the CPU-GPU link and needs a CUDA device; pass link_busy=False")
    if threads is None:
        threads = max(1, torch.get_num_threads() - (1 if torch.cuda.is_available() else 0))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        param = torch.zeros(numel, requires_grad=True)
        param.grad = torch.full((numel,), 1e-3)
        mirror = torch.empty(numel, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)

        def fastest_step() -> tuple[float, float]:
            """Seconds per parameter of the step with its cast, and of the cast: each the fastest."""
            step_s, cast_s = float("inf"), float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                optimizer.step()
                stepped = time.perf_counter()
                with torch.no_grad():
                    mirror.copy_(param)
                step_s = min(step_s, stepped - start)
                cast_s = min(cast_s, time.perf_counter() - stepped)
            return (step_s + cast_s) / numel, cast_s / numel

        optimizer.step()  # the first step allocates the moments
        alone, alone_cast = fastest_step()
        if not link_busy:
            return HostStepRates(alone, alone_cast_s_per_param=alone_cast)
        with LinkBusy() as link:
            busy, busy_cast = fastest_step()
    finally:
        torch.set_num_threads(previous)
    return HostStepRates(alone, busy, link.gbps, alone_cast, busy_cast)


def training_profile(
    breakdown: ModelBreakdown,
    platform: PlatformProfile,
    *,
    timing: BlockTiming | None = None,
    host_GBps: float | None = None,
    host_rates: HostStepRates | None = None,
) -> TrainingProfile:
    """Build the training-level model input from a breakdown and, if available, a block timing.

    Without a timing, forward and backward come from the FLOP count at
    ``0.65 * platform.gpu_bf16_TFLOPS`` (forward one third). Checkpointing's recompute is the
    breakdown's FLOP count (``block_recompute_fraction``, times the blocks' share of the forward
    when the forward includes the head). The GPU optimizer is bandwidth bound
    (28 bytes per parameter at 29% of the DRAM peak, as measured on our H200). ``host_GBps``
    (default: the platform's) sets the host optimizer's speed; ``host_rates`` measured with the
    link busy (:func:`measure_host_step`) replace it with the shared-DRAM model of
    :func:`~torch_fsdp_offload.planner.cost_model.predict_step`. The cast's part of the host step
    (what ``cast_on="device"`` takes off it) comes with those rates when they time it on its own,
    else from the platform profile (``host_alone_cast_s_per_param``,
    ``host_link_busy_cast_s_per_param``; None for a profile without them).
    """
    # A checkpointed backward reruns each block's forward up to its last saved tensor, counted in
    # FLOPs: one block timed alone with and without checkpointing gave 0.55-0.92 of its forward on
    # our H200 (anchor-1.6b, bs 4-16), noisier than the count (0.69) against the whole model's
    # measured 0.63-0.75 (benchmarks/results/recompute_probe.json, docs/planner.md).
    recompute = breakdown.block_recompute_fraction
    if timing is not None:
        # The timed forward is the blocks' alone.
        forward = timing.forward_s * breakdown.n_blocks
        backward = timing.backward_s * breakdown.n_blocks
        block_activation = timing.activation_bytes
        source = "measured block"
    else:
        recompute *= breakdown.block_forward_share
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
        block_checkpoint_bytes=breakdown.block_checkpoint_bytes,
        other_activation_bytes=breakdown.other_activation_bytes,
        forward_s=forward,
        backward_s=backward,
        gpu_optimizer_s=params * _GPU_ADAMW_BYTES_PER_PARAM / (platform.gpu_dram_GBps * 1e9 * _GPU_ADAMW_DRAM_FRACTION),
        host_GBps=host_GBps or platform.host_GBps,
        compute_bytes=breakdown.compute_bytes,
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
