"""A real model's memory breakdown, traced on the ``meta`` device (any machine, nothing allocated).

One forward pass and the loss run on ``meta`` tensors under ``saved_tensors_hooks``: every tensor
autograd keeps for backward is seen with its shape and dtype, nothing is computed. Views are
counted once through their base, parameters and buffers never. Attention is counted as a fused
(flash / memory-efficient) kernel saves it, O(batch * heads * seq), not as the math path the meta
device would trace, which would keep the O(seq^2) score matrix. The blocks are those
:func:`~torch_fsdp_offload.models.find_blocks` finds, as ``Recommendation.apply`` shards them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from torch_fsdp_offload import models

__all__ = [
    "ModelBreakdown",
    "block_names",
    "call_model",
    "first_tensor",
    "map_tensors",
    "model_breakdown",
    "plain_value",
    "resolve_model",
]


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
            transformer block's last matmul (the MLP's down projection) is not rerun. It grows
            with the sequence, as attention weighs more.
        block_forward_share (float): the blocks' share of the model's forward FLOPs (the rest:
            embedding, final norm, head, loss); what checkpointing the blocks reruns is this share of
            the forward times ``block_recompute_fraction``.
        loss_transient_bytes (int): what the loss holds beside every saved activation, at the end
            of forward and again at the start of backward: the output in fp32 (the loss reads it
            upcast, and its gradient comes back in fp32) beside two copies in the output's own dtype
            (the output itself or its gradient, and a shifted or reshaped copy). For a language
            model's logits this is the largest transient of the step (8 bytes per logit in bf16).
        loss_fp32_output_bytes (int): the loss's fp32 copy of the output (4 bytes an element), the
            largest single block a step allocates anew.
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
    loss_transient_bytes: int = 0
    loss_fp32_output_bytes: int = 0

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


def resolve_model(model: Any) -> tuple[nn.Module, str]:
    """Turn a model argument into a module on the ``meta`` device and a label.

    Args:
        model: a built-in name (``MODEL_CONFIGS``), a transformers config name (``HF_CONFIGS``, or
            ``"hf:<name, path or hub id>"``), a :class:`~torch_fsdp_offload.models.TransformerConfig`,
            a factory called with no arguments under ``torch.device("meta")``, or an ``nn.Module``
            (its structure deep-copied, its parameters and buffers as ``meta`` tensors).

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
        # Parameters and buffers are copied as meta tensors (ties kept), never their data.
        memo: dict[int, Any] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        return copy.deepcopy(model, memo).to("meta"), type(model).__name__
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
    example_input: Any = None,
    blocks: Sequence[nn.Module | str] | None = None,
) -> ModelBreakdown:
    """Trace one forward pass and the loss on the ``meta`` device and count what backward needs.

    Args:
        model: see :func:`resolve_model`.
        batch_size (int): sequences per micro-batch.
        seq_len (int): tokens per sequence.
        compute_dtype (torch.dtype): dtype of the forward (FSDP's ``param_dtype``).
        vocab_size (int | None): token id range of the dummy input (default: the model's
            ``config.vocab_size``, else 2).
        example_input: what the model is called with instead of ``zeros(batch_size, seq_len)``
            token ids (see :func:`call_model`); its tensors are traced as ``meta`` tensors, floating
            ones in ``compute_dtype``. The loss is then the mean of the output (cross entropy on
            ``logits`` where the input is token ids).
        blocks: the model's blocks in forward order, as modules of ``model`` or qualified names
            (:func:`~torch_fsdp_offload.models.find_blocks`); default: found.

    Returns:
        ModelBreakdown: parameters per block and outside, activation bytes per block.

    Raises:
        ValueError: non-positive sizes, a model without a list of blocks, blocks its forward
            never calls or out of the order the model registers them, or an ``example_input``
            whose floating-point values reach an ``nn.Embedding`` (token ids must be integers).

    Example::

        >>> breakdown = model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048)
        >>> breakdown.n_blocks, breakdown.block_params
        (8, 201342976)
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    names = block_names(model, blocks) if blocks is not None and isinstance(model, nn.Module) else blocks
    module, name = resolve_model(model)
    module = module.to(compute_dtype)
    blocks = models.find_blocks(module, names)
    if names is not None:
        models.check_block_order(module, blocks)
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

    def token_ids(embedding_name: str):
        def hook(_module, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                raise ValueError(
                    f"example_input holds floating-point values where {embedding_name}, an nn.Embedding, takes "
                    "token ids; pass the ids as integers (ids.long())"
                )

        return hook

    handles = [
        embedding.register_forward_pre_hook(token_ids(embedding_name))
        for embedding_name, embedding in module.named_modules() if isinstance(embedding, nn.Embedding)
    ]
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(index), with_kwargs=True))
        handles.append(block.register_forward_hook(leave))
    vocab = vocab_size or getattr(getattr(module, "config", None), "vocab_size", None) or 2
    if example_input is None:
        example_input = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    example_input = map_tensors(example_input, lambda t: t.to(device="meta", dtype=compute_dtype if t.is_floating_point() else None))
    tokens = example_input if isinstance(example_input, torch.Tensor) and not example_input.is_floating_point() else None
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t),
            _FusedAttentionAccounting(recorder),
            counter,
        ):
            output = call_model(module, example_input)
            logits = output.logits if hasattr(output, "logits") else first_tensor(output)
            if tokens is not None and logits.dim() == 3 and logits.shape[:2] == tokens.shape:
                F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten() % vocab)
            else:
                logits.float().mean()
    finally:
        for handle in handles:
            handle.remove()
    if not block_inputs:
        raise ValueError(
            f"{name}'s forward on the example input never called its blocks ({type(blocks[0]).__name__}); "
            "pass blocks= that the forward runs, or an example_input= the model takes"
        )
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
        loss_transient_bytes=logits.numel() * (4 + 2 * logits.element_size()),
        loss_fp32_output_bytes=logits.numel() * 4,
    )


def plain_value(value: Any) -> bool:
    """Whether ``value`` is a tensor, None, a number, a bool or a string, or a tuple or list of
    them: a block argument that can be copied and replayed (a KV cache object cannot)."""
    if isinstance(value, (tuple, list)):
        return all(plain_value(item) for item in value)
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def call_model(module: nn.Module, example_input: Any) -> Any:
    """``module`` called on an example input: a mapping as keyword arguments, a tuple or list as
    positional arguments, anything else (a tensor) as the one argument."""
    if isinstance(example_input, Mapping):
        return module(**example_input)
    if isinstance(example_input, (tuple, list)):
        return module(*example_input)
    return module(example_input)


def block_names(model: nn.Module, blocks: Sequence[nn.Module | str]) -> list[str]:
    """The qualified names in ``model`` of the given blocks (modules or names), checked by
    :func:`~torch_fsdp_offload.models.find_blocks`: the same blocks in a copy of the model."""
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(block)] for block in models.find_blocks(model, blocks)]


def first_tensor(output: Any) -> torch.Tensor:
    """The first tensor of a module's output: itself, the first of a tuple, list or mapping (a
    transformers output's first field).

    Raises:
        TypeError: the output holds no tensor first.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        return first_tensor(output[0])
    if isinstance(output, Mapping) and output:
        return first_tensor(next(iter(output.values())))
    raise TypeError(f"the module returned a {type(output).__name__}, not a tensor to take a loss of")


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, through nested tuples (named ones too),
    lists and mappings (block arguments: a transformers layer's ``(cos, sin)`` pair)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(item, fn) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, fn) for item in value)
    if isinstance(value, Mapping):
        return {key: map_tensors(item, fn) for key, item in value.items()}
    return value


def _checkpoint_flops(block: nn.Module, args: tuple, kwargs: dict) -> tuple[float, int]:
    """(FLOPs a non-reentrant checkpoint of ``block`` recomputes in backward over its forward FLOPs,
    the block's forward FLOPs), counted on the ``meta`` tensors the trace called it with (nothing
    is computed). (1.0, 0) when the meta device cannot run the block's backward."""
    # Tensors detached, nested ones too (a (cos, sin) pair): the trace's graph is not this one.
    # Keyword objects that are neither tensors nor plain values (a transformers KV cache the trace
    # filled) are left out: the count must not append to them.
    kept = {k: v for k, v in kwargs.items() if plain_value(v)}
    detached_args, detached_kwargs = map_tensors((args, kept), torch.Tensor.detach)
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
