""":func:`offload_activations`: the front door that attaches an :class:`ActivationOffload` to a model."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from torch_fsdp_offload.activations._ownership import MadeBy, check_can_hook
from torch_fsdp_offload.activations._copies import DEFAULT_MAX_INFLIGHT_BYTES
from torch_fsdp_offload.activations._offloader import (
    ActivationOffload,
    check_knobs,
    check_outside_compiled_regions,
    DEFAULT_MIN_OFFLOAD_BYTES,
    DEFAULT_PREFETCH_BLOCKS,
)
from torch_fsdp_offload.models import find_blocks
from torch_fsdp_offload.platform import Platform, PlatformKind

__all__ = ["offload_activations"]


def offload_activations(
    module: nn.Module | None = None,
    *,
    blocks: Iterable[nn.Module] | None = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    prefetch_blocks: int = DEFAULT_PREFETCH_BLOCKS,
    keep_last_blocks: int | float = 0,
    fraction: float = 1.0,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    platform: Platform | PlatformKind | str | None = None,
    device: torch.device | str | int | None = None,
) -> ActivationOffload:
    """Offload the activations of ``module`` (every forward) or of a ``with`` block to host memory.

    With a module, its forward enters the returned :class:`ActivationOffload` automatically and its
    blocks (``blocks``, or :func:`torch_fsdp_offload.models.find_blocks` of ``module``) are the
    offload and prefetch units; parameters and buffers of the module are never copied. Works on
    plain modules and on FSDP1/FSDP2-wrapped ones (call it after wrapping). Without a module, use
    the result as a context manager around forward.

    Args:
        module (nn.Module | None): the model to attach to; None for a bare context manager.
        blocks (Iterable[nn.Module] | None): the block modules, in forward order.
        min_offload_bytes, prefetch_blocks, keep_last_blocks, fraction, max_inflight_bytes, platform,
            device: see :class:`ActivationOffload`.

    Returns:
        ActivationOffload: the offloader; ``.stats`` counts copies, ``.remove()`` detaches it.

    Raises:
        ValueError: a knob out of range (see :class:`ActivationOffload`), ``module`` given without
            ``blocks`` and no block list found, or ``module`` or a block already offloaded by another
            offloader (an earlier ``offload_activations`` not ``.remove()``-d, or ``fully_shard`` with
            ``CoherentOffload(activations=...)``), or a block called from inside a module
            ``torch.compile``-d as a whole (compile each block instead); raised before anything is
            allocated or hooked.
        TypeError: ``module`` is not an ``nn.Module`` or a block is not one.

    Example::

        >>> model = build_model("anchor-1.6b", device="cuda", dtype=torch.bfloat16)
        >>> offload = offload_activations(model, prefetch_blocks=1, keep_last_blocks=1)
        >>> loss = causal_lm_loss(model(tokens), tokens)
        >>> loss.backward()
        >>> offload.stats.d2h_bytes > 0
        True
    """
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"offload_activations expects an nn.Module or None, got {type(module).__name__}")
    check_knobs(min_offload_bytes, prefetch_blocks, keep_last_blocks, fraction, max_inflight_bytes)
    if module is not None and blocks is None:
        blocks = find_blocks(module)
    block_list = list(blocks) if blocks is not None else []
    # Refused here, before the offloader (and its transfer engine) exists; its own hooking checks
    # both again.
    hooked = [*([module] if module is not None else []), *block_list]
    check_can_hook(hooked, None, "offload_activations")
    check_outside_compiled_regions(hooked, "offload_activations")
    offload = ActivationOffload(
        min_offload_bytes=min_offload_bytes,
        prefetch_blocks=prefetch_blocks,
        keep_last_blocks=keep_last_blocks,
        fraction=fraction,
        max_inflight_bytes=max_inflight_bytes,
        platform=platform,
        device=device,
    )
    offload._made_by = MadeBy.CALL
    # The module's hooks go first: its forward must open the pass before a block can start.
    if module is not None:
        offload.attach(module)
    if block_list:
        offload.register_blocks(block_list)
    return offload
