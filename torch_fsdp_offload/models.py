"""Built-in decoder-only transformers for tests, benchmarks and ``python -m torch_fsdp_offload.train``.

One ``Transformer`` class covers two families, chosen by :class:`TransformerConfig`:

* Llama style: RMSNorm, SwiGLU MLP, rotary position embeddings (RoPE), optional grouped-query attention.
* The benchmark model (``"anchor-1.6b"``, see docs/benchmarks.md): LayerNorm, 4x GELU MLP, no
  position embedding, SDPA causal attention.

Every layer is one entry of ``Transformer.blocks`` (an ``nn.ModuleList``): that is the unit to pass to
``fully_shard`` (or to FSDP1's ``ModuleWrapPolicy({TransformerBlock})``). :func:`find_blocks` finds
that unit in this model and in other layouts (transformers' Llama and GPT-2 models, any
``nn.ModuleList`` of layers): the planner plans, and ``Recommendation.apply`` shards, the blocks it
finds. Models can be built on the ``meta`` device and materialised later with ``to_empty`` + :meth:`Transformer.init_weights`, which is
deterministic for a given seed whatever the device, dtype or sharding of the parameters.

This module imports only torch (``build_hf_causal_lm`` imports transformers lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "BLOCK_LIST_PATHS",
    "HF_CONFIGS",
    "MODEL_CONFIGS",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "build_hf_causal_lm",
    "build_model",
    "causal_lm_loss",
    "check_block_order",
    "find_blocks",
    "load_hf_config",
    "rope_tables",
]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of a built-in decoder-only transformer.

    Attributes:
        vocab_size (int): number of token ids; the embedding and the output head have this many rows.
        dim (int): model width (``d_model``).
        n_layers (int): number of :class:`TransformerBlock` s in ``Transformer.blocks``.
        n_heads (int): attention heads; ``dim`` must be divisible by it.
        ffn_hidden (int): hidden width of the MLP (for SwiGLU, of each of the two input projections).
        max_seq_len (int): longest sequence ``forward`` accepts (sizes the RoPE table).
        norm (str): ``"rms"`` (RMSNorm, Llama) or ``"layer"`` (LayerNorm with bias).
        mlp (str): ``"swiglu"`` (Llama) or ``"gelu"`` (two projections with a GELU between).
        rope (bool): apply rotary position embeddings to queries and keys. Without it the model has no
            position signal other than the causal mask, like the ``anchor-1.6b`` benchmark model.
        n_kv_heads (int | None): key/value heads for grouped-query attention; ``None`` means ``n_heads``.
        norm_eps (float): epsilon of the normalisation layers.
        rope_theta (float): RoPE base frequency.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    max_seq_len: int
    norm: str = "rms"
    mlp: str = "swiglu"
    rope: bool = True
    n_kv_heads: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"TransformerConfig.{field} must be positive, got {getattr(self, field)}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"TransformerConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                "pick n_heads among the divisors of dim"
            )
        if self.rope and (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"RoPE needs an even head dimension, got dim/n_heads = {self.dim // self.n_heads}; "
                "change n_heads or set rope=False"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"TransformerConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                f"({self.n_kv_heads})"
            )
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"TransformerConfig.norm must be 'rms' or 'layer', got {self.norm!r}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"TransformerConfig.mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


MODEL_CONFIGS: dict[str, TransformerConfig] = {
    # Trains a step in milliseconds on a 2-core CPU: CI and the README's first command.
    "tiny": TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=176, max_seq_len=256),
    # About 20M parameters: a quick real-GPU run.
    "small": TransformerConfig(
        vocab_size=8192, dim=512, n_layers=6, n_heads=8, ffn_hidden=1408, max_seq_len=1024
    ),
    # Llama 3.2 1B shapes (GQA 32/8, SwiGLU 8192, vocab 128256) with an untied output head: 1.50B parameters.
    "llama-1b": TransformerConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=2048,
        rope_theta=500000.0,
    ),
    # Llama 3 8B shapes (GQA 32/8, SwiGLU 14336, vocab 128256, untied head): 8.03B parameters. The
    # multi-GPU benchmark's model: too large for one GPU's fp32 AdamW state at any useful micro-batch.
    "llama-8b": TransformerConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # The benchmark model of docs/benchmarks.md: 8 blocks, d_model 4096, SDPA causal attention + 4x
    # GELU MLP, LayerNorm, 1611.0M parameters. Its blocks alone hold 8 x 12 x 4096^2
    # = 1610.6M bias-free projection weights plus 0.13M LayerNorm weights/biases; a 32-token vocabulary
    # (untied embedding and head, 0.26M) brings the total to 1,611,014,144 = 1611.0M, so the time and
    # memory profile is the benchmark's blocks, not a large vocabulary. 32 heads of 128.
    "anchor-1.6b": TransformerConfig(
        vocab_size=32,
        dim=4096,
        n_layers=8,
        n_heads=32,
        ffn_hidden=4 * 4096,
        max_seq_len=2048,
        norm="layer",
        mlp="gelu",
        rope=False,
    ),
}


def _make_norm(config: TransformerConfig) -> nn.Module:
    if config.norm == "rms":
        return nn.RMSNorm(config.dim, eps=config.norm_eps)
    return nn.LayerNorm(config.dim, eps=config.norm_eps)


def rope_tables(config: TransformerConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding tables ``(cos, sin)`` of ``config``, ``(max_seq_len, head_dim // 2)`` in fp32:
    the ``rope`` argument of :class:`TransformerBlock` for a block called on its own.

    Example::

        >>> cos, sin = rope_tables(MODEL_CONFIGS["tiny"])
        >>> TransformerBlock(MODEL_CONFIGS["tiny"])(torch.randn(1, 8, 64), (cos, sin)).shape
        torch.Size([1, 8, 64])
    """
    # Computed in fp32 whatever the model dtype: bf16 angles lose the position signal at long range.
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float32, device=device) / half))
    positions = torch.arange(config.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate the two halves of the head dimension.
    seq_len = x.shape[-2]
    cos = cos[:seq_len].to(x.dtype)
    sin = sin[:seq_len].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Multi-head (optionally grouped-query) causal self-attention through SDPA."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q = _apply_rope(q, *rope)
            k = _apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU (``w2(silu(w1 x) * w3 x)``) or GELU (``w2(gelu(w1 x))``) MLP."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False) if config.mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``; one FSDP unit."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attention_norm = _make_norm(config)
        self.attention = Attention(config)
        self.ffn_norm = _make_norm(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only language model built from a :class:`TransformerConfig`.

    Layout: ``tok_embeddings`` -> ``blocks`` (``nn.ModuleList`` of :class:`TransformerBlock`) -> ``norm``
    -> ``output`` (untied linear head). ``forward(tokens)`` maps ``(batch, seq)`` int64 token ids to
    ``(batch, seq, vocab_size)`` logits.

    Args:
        config (TransformerConfig): the model's shape.
        device (torch.device | str | None): where to create parameters; ``"meta"`` allocates nothing
            (materialise with ``to_empty(device=...)`` then :meth:`init_weights`).

    Example::

        >>> model = Transformer(MODEL_CONFIGS["tiny"])
        >>> tokens = torch.randint(0, 256, (2, 16))
        >>> causal_lm_loss(model(tokens), tokens).backward()
    """

    def __init__(self, config: TransformerConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
            self.norm = _make_norm(config)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
            if config.rope:
                cos, sin = rope_tables(config, None)
                # Not persistent: derived from the config, so checkpoints carry only trained state.
                self.register_buffer("rope_cos", cos, persistent=False)
                self.register_buffer("rope_sin", sin, persistent=False)
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"Transformer.forward expects (batch, seq) token ids, got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.config.max_seq_len}; "
                "use shorter sequences or a config with a larger max_seq_len"
            )
        rope = (self.rope_cos, self.rope_sin) if self.config.rope else None
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h, rope)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministically (re)initialise every parameter and the RoPE tables.

        Each parameter is drawn on the CPU in fp32 from a generator seeded by ``seed`` and the parameter's
        name, then copied into place, so the result does not depend on the device, the dtype, the order
        of initialisation, or whether the parameter is an FSDP2-sharded ``DTensor`` (each rank keeps its
        own shard of the same full tensor). Linear and embedding weights are N(0, 0.02); the projections
        that write into the residual stream (``wo``, ``w2``) are scaled by ``1/sqrt(2 * n_layers)``;
        norm weights are 1 and biases 0. Usable after ``to_empty``.

        Args:
            seed (int): base seed; the same seed gives bit-identical weights.

        Example::

            >>> model = build_model("tiny", device="meta")
            >>> model.to_empty(device="cpu")
            >>> model.init_weights(seed=0)
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            module_name, leaf = name.rsplit(".", 2)[-2:]
            if leaf == "bias":
                full = torch.zeros(param.shape)
            elif param.dim() == 1:
                full = torch.ones(param.shape)
            else:
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = residual_std if module_name in ("wo", "w2") else 0.02
                full = torch.empty(param.shape).normal_(0.0, std, generator=generator)
            _copy_full_into(param, full)
        if self.config.rope:
            cos, sin = rope_tables(self.config, self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def reset_parameters(self) -> None:
        """Same as ``init_weights(seed=0)``; the name ``nn.Module.to_empty`` users and FSDP1's
        ``param_init_fn`` conventions look for."""
        self.init_weights(0)

    def param_count(self) -> int:
        """Number of parameters (global counts for sharded ``DTensor`` parameters; works on ``meta``)."""
        return sum(p.numel() for p in self.parameters())


# Where common layouts keep their layers, looked up in this order: this module's Transformer,
# Llama-like transformers models (``model.model.layers``), plain stacks, GPT-2-like ones.
BLOCK_LIST_PATHS = ("blocks", "model.layers", "layers", "transformer.h")


def find_blocks(model: nn.Module, blocks: Sequence[nn.Module | str] | None = None) -> nn.ModuleList:
    """The transformer blocks of ``model``: the per-layer modules, in forward order, that are sharded
    (one FSDP group each), offloaded and prefetched one by one.

    ``blocks`` given: those modules, checked to be distinct submodules of ``model``, none inside
    another (names are resolved with ``model.get_submodule``, so a plan made on a copy of the model
    finds the same blocks in the model itself). Otherwise the first non-empty ``nn.ModuleList`` at
    one of :data:`BLOCK_LIST_PATHS`; else the longest non-empty ``nn.ModuleList`` that is not inside
    another one (a block's own list, such as the experts of a mixture-of-experts layer, is never
    taken for the blocks).

    Args:
        model (nn.Module): the model, sharded or not, on any device (``meta`` included).
        blocks (Sequence[nn.Module | str] | None): the blocks in forward order, as modules or as
            qualified names (``"model.layers.0"``); None finds them.

    Returns:
        nn.ModuleList: the blocks (a new list holding the given ones when ``blocks`` is given).

    Raises:
        ValueError: no non-empty ``nn.ModuleList``, or two equally long ones not inside one another
            (an encoder and a decoder, say), which leaves the blocks ambiguous; the message says to
            keep the blocks at ``model.blocks`` or pass ``blocks=[...]`` (``Recommendation.apply``
            and ``offload_activations`` take it). Given ``blocks``: an empty list, a name or module
            that is not a submodule of ``model``, the same block twice, or one block inside another.

    Example::

        >>> model = build_model("tiny", device="meta")
        >>> find_blocks(model) is model.blocks
        True
        >>> len(find_blocks(build_hf_causal_lm("llama-tiny", device="meta")))  # its model.layers
        2
        >>> find_blocks(model, blocks=["blocks.1"])[0] is model.blocks[1]
        True
    """
    if blocks is not None:
        return _given_blocks(model, blocks)
    for path in BLOCK_LIST_PATHS:
        owner: Any = model
        for part in path.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, nn.ModuleList) and len(owner) > 0:
            return owner
    outermost: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        # named_modules() lists a parent before its children.
        if not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in outermost):
            outermost.append((name, module))
    if not outermost:
        raise ValueError(
            f"{type(model).__name__} has no non-empty nn.ModuleList of blocks (looked at "
            f"{', '.join(BLOCK_LIST_PATHS)} and every submodule); keep its layers in an nn.ModuleList at "
            "model.blocks, or pass blocks=[...] in forward order where the call takes it"
        )
    longest = max(len(module) for _, module in outermost)
    candidates = [name or "the model itself" for name, module in outermost if len(module) == longest]
    if len(candidates) > 1:
        raise ValueError(
            f"{type(model).__name__} has {len(candidates)} nn.ModuleLists of {longest} modules "
            f"({', '.join(candidates)}), so its blocks are ambiguous; keep the blocks at model.blocks, or pass "
            "blocks=[...] in forward order where the call takes it"
        )
    return next(module for _, module in outermost if len(module) == longest)


def check_block_order(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Refuse ``blocks`` (submodules of ``model``, as :func:`find_blocks` gives them) not in the order
    ``model`` registers them: the forward order in which partial offload and prefetching count blocks.

    Raises:
        ValueError: a block listed before one the model registers earlier, naming both and the fix.

    Example::

        >>> check_block_order(model, list(model.blocks)[::-1])
        Traceback (most recent call last):
        ValueError: blocks must be in forward order ...
    """
    position = {id(module): (index, name) for index, (name, module) in enumerate(model.named_modules())}
    for earlier, later in zip(blocks, list(blocks)[1:]):
        if position[id(later)][0] < position[id(earlier)][0]:
            raise ValueError(
                f"blocks must be in forward order, the order {type(model).__name__} registers them in: "
                f"{position[id(earlier)][1]!r} is listed before {position[id(later)][1]!r}, which the model registers "
                "first. Pass them in that order (list(model.blocks), not reversed): the last blocks, a spread of "
                "them and prefetching count from the first block of the forward")


def _given_blocks(model: nn.Module, blocks: Sequence[nn.Module | str]) -> nn.ModuleList:
    names = {id(module): name for name, module in model.named_modules()}
    resolved: list[tuple[str, nn.Module]] = []
    for block in blocks:
        if isinstance(block, str):
            try:
                module = model.get_submodule(block)
            except AttributeError as exc:
                raise ValueError(f"blocks= names {block!r}, which is no submodule of {type(model).__name__}") from exc
            resolved.append((block, module))
        elif isinstance(block, nn.Module) and id(block) in names:
            resolved.append((names[id(block)], block))
        else:
            raise ValueError(
                f"blocks= holds a {type(block).__name__} that is no submodule of {type(model).__name__}; "
                "pass the model's own block modules (or their qualified names) in forward order"
            )
    if not resolved:
        raise ValueError("blocks= is empty; pass the model's blocks in forward order, or leave it out to find them")
    for index, (name, module) in enumerate(resolved):
        for other_name, other in resolved[index + 1:]:
            if other is module:
                raise ValueError(f"blocks= holds {name or 'the model itself'!r} twice; each block is one FSDP group")
            if name == "" or other_name == "" or other_name.startswith(f"{name}.") or name.startswith(f"{other_name}."):
                raise ValueError(
                    f"blocks= holds {name or 'the model itself'!r} and {other_name or 'the model itself'!r}, one "
                    "inside the other; pass blocks none of which contains another"
                )
    return nn.ModuleList(module for _, module in resolved)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    # An FSDP2 parameter is a DTensor holding one shard: keep the slice of the full tensor that this
    # rank owns, computed by DTensor's own chunking rules (no communication: every rank has `full`).
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def build_model(
    name_or_config: str | TransformerConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Transformer:
    """Build a built-in :class:`Transformer` by name or from a config.

    Args:
        name_or_config (str | TransformerConfig): a key of :data:`MODEL_CONFIGS` (``"tiny"``,
            ``"small"``, ``"llama-1b"``, ``"anchor-1.6b"``) or a config.
        device (torch.device | str | None): where to create the parameters (default: the current
            default device). ``"meta"`` allocates nothing; call ``to_empty`` and ``init_weights`` later.
        dtype (torch.dtype | None): parameter dtype (default fp32). Initial values are the fp32
            values rounded to it.

    Returns:
        Transformer: initialised with ``init_weights(seed=0)`` unless built on ``meta``.

    Raises:
        KeyError: unknown model name (the message lists the known ones).
        TypeError: ``name_or_config`` is neither a name nor a :class:`TransformerConfig`.

    Example::

        >>> model = build_model("anchor-1.6b", device="meta")
        >>> round(model.param_count() / 1e6, 1)
        1611.0
    """
    if isinstance(name_or_config, str):
        if name_or_config not in MODEL_CONFIGS:
            raise KeyError(
                f"unknown model {name_or_config!r}; choose one of {sorted(MODEL_CONFIGS)} "
                "or pass a TransformerConfig"
            )
        config = MODEL_CONFIGS[name_or_config]
    elif isinstance(name_or_config, TransformerConfig):
        config = name_or_config
    else:
        raise TypeError(
            f"build_model expects a model name or a TransformerConfig, got {type(name_or_config).__name__}"
        )
    model = Transformer(config, device=device)
    if dtype is not None:
        # Parameters only: the RoPE tables stay fp32 and are cast per use.
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model


def causal_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: position ``t`` predicts ``tokens[:, t + 1]``; computed in fp32.

    Args:
        logits (torch.Tensor): ``(batch, seq, vocab)`` model output (a ``DTensor`` is not expected).
        tokens (torch.Tensor): ``(batch, seq)`` the input token ids.

    Returns:
        torch.Tensor: scalar mean loss over ``batch * (seq - 1)`` predictions.

    Raises:
        ValueError: shapes do not match or ``seq < 2``.

    Example::

        >>> loss = causal_lm_loss(model(tokens), tokens)
    """
    if logits.shape[:2] != tokens.shape or tokens.shape[1] < 2:
        raise ValueError(
            f"causal_lm_loss needs logits (batch, seq, vocab) matching tokens (batch, seq) with seq >= 2, "
            f"got logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)}"
        )
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )


# transformers configs that need no download: a model_type plus the fields that size the model.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-tiny": {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    },
    "qwen2-tiny": {
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    },
}


def load_hf_config(config: str | Mapping[str, Any] | Any) -> Any:
    """The ``transformers`` config :func:`build_hf_causal_lm` builds from, loaded and checked
    without building anything (``train --hf-config`` refuses a bad one before it starts).

    Args:
        config: a key of :data:`HF_CONFIGS` (no network needed); a dict or a JSON string with
            ``"model_type"`` and the config fields; a ``config.json`` path or a directory holding
            one; a Hugging Face hub id (only its ``config.json`` is fetched: network or a cache);
            or a ``transformers.PretrainedConfig``, returned as it is.

    Returns:
        transformers.PretrainedConfig: the config.

    Raises:
        ImportError: ``transformers`` is not installed (``pip install transformers``).
        ValueError: JSON that does not parse or is no object, no ``model_type`` or one transformers
            does not know, a ``.json`` path that does not exist, or a hub id whose config could not
            be fetched (no network, no such repository, not cached), each with what to pass instead.
        TypeError: anything else.

    Example::

        >>> load_hf_config("llama-tiny").num_hidden_layers
        2
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("building a transformers model needs the transformers package: pip install transformers") from exc

    if isinstance(config, transformers.PretrainedConfig):
        return config
    text = where = None
    if isinstance(config, str) and config in HF_CONFIGS:
        config = HF_CONFIGS[config]
    elif isinstance(config, str) and config.lstrip()[:1] in ("{", "["):
        text, where = config, "the JSON config"
    elif isinstance(config, str) and os.path.isfile(config):
        with open(config, encoding="utf-8") as config_file:
            text, where = config_file.read(), config
    if text is not None:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}; pass a JSON object such as "
                             '\'{"model_type": "llama", "num_hidden_layers": 2}\'') from None
        if not isinstance(config, dict):
            raise ValueError(f"{where} holds a JSON {type(config).__name__}, not an object with 'model_type'")
    if isinstance(config, Mapping):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"a transformers config dict needs 'model_type' (e.g. 'llama'); got keys {sorted(config)}")
        try:
            return transformers.AutoConfig.for_model(model_type, **fields)
        except ValueError as exc:
            raise ValueError(f"transformers {transformers.__version__} has no model_type {model_type!r} "
                             f"({str(exc).split('.')[0]}); use one it knows, such as 'llama' or 'qwen2'") from None
    if not isinstance(config, str):
        raise TypeError(f"expected a transformers config name, dict, JSON string, path or hub id, got {type(config).__name__}")
    if config.endswith(".json"):
        raise ValueError(f"{config}: no such file; pass the path of an existing config.json")
    try:
        return transformers.AutoConfig.from_pretrained(config)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{config!r} is no name of HF_CONFIGS ({', '.join(sorted(HF_CONFIGS))}), no JSON object and no "
            f"config.json path, and no config could be fetched for it as a hub id: {reason} Pass a local "
            "config.json (or a folder holding one), a JSON object with 'model_type', or a hub id this machine "
            "can reach (or one in the local cache, with HF_HUB_OFFLINE=1)"
        ) from None


def build_hf_causal_lm(
    config_name_or_dict: str | Mapping[str, Any] | Any,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build a randomly initialised ``transformers`` causal LM from a config, without downloading weights.

    Args:
        config_name_or_dict: the config, in any form :func:`load_hf_config` takes (a name of
            :data:`HF_CONFIGS`, a dict, JSON, a ``config.json`` path, a hub id, a config object).
        device (torch.device | str | None): where to create the parameters (``"meta"`` allocates nothing).
        dtype (torch.dtype | None): parameter dtype.

    Returns:
        nn.Module: an ``AutoModelForCausalLM`` model; its decoder layers are ``model.model.layers`` for
        Llama-like architectures.

    Raises:
        ImportError, ValueError, TypeError: as :func:`load_hf_config`.

    Example::

        >>> model = build_hf_causal_lm("llama-tiny")
        >>> model(torch.randint(0, 256, (1, 8))).logits.shape
        torch.Size([1, 8, 256])
    """
    config = load_hf_config(config_name_or_dict)
    import transformers

    with torch.device(device) if device is not None else contextlib.nullcontext():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
