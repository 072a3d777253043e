"""Offload the tensors autograd saves for backward to host memory, and bring them back ahead of need.

:func:`offload_activations` installs ``torch.autograd.graph.saved_tensors_hooks`` around a model's
forward. Each saved tensor of an offloaded block is copied, as soon as it is final, into a reused
pinned host buffer on the transfer engine's D2H stream; its GPU memory is released once the copy has
landed, and the forward waits rather than let more than ``max_inflight_bytes`` of copies pile up (a
forward can make activations several times faster than a link carries them; unbounded, the copies
would land after the peak and save nothing). In backward, when the first tensor of block ``i`` is
needed, the H2D copies of blocks ``i - 1 .. i - prefetch_blocks`` are issued on the H2D stream, so
they land while block ``i`` computes; the compute stream waits on the copy event of exactly the
tensor it unpacks.

How it differs from ``torch.autograd.graph.save_on_cpu``: copies leave the compute stream (save_on_cpu
copies on it and reloads on demand), pinned memory is reused across steps instead of allocated per
tensor, reloads are prefetched block by block, parameters and views of parameters are never copied,
and a view shares its base's copy.

Where it does nothing: on a UNIFIED platform (CPU and GPU share one memory, a copy only duplicates
it) and without an accelerator. A platform kind can be forced (``platform="discrete"``) to run the
whole copy path on the CPU with synchronous copies: that is how CPU tests exercise it.

Sharing the link with parameter offload: activation copies use the streams of
:func:`torch_fsdp_offload.transfer.get_transfer_engine` for the device, the same streams FSDP's
parameter and gradient copies use, so copies are served in the order they are issued on each stream.
The FSDP integration gives parameters priority by issuing a block's parameter prefetch (in its
pre-backward hook) before the block's first saved tensor is unpacked, which is when activation
prefetch is issued; ``prefetch_blocks`` bounds how far activation reloads run ahead.

Two front doors share one offloader class, one registration path and one record of which module is
offloaded by whom: :func:`offload_activations` (any model, after wrapping) and
``CoherentOffload(activations=...)``, attached as ``fully_shard`` builds groups
(:func:`get_activation_offload` finds that offloader).

The rooms: ``_saved_tensors`` (what one forward saved, per storage and per block), ``_copies`` (the
D2H copies and H2D reloads, and the counters), ``_ownership`` (which offloader has each module),
``_offloader`` (:class:`ActivationOffload`: the hooks and what to offload when), ``_policy_attachment``
(the ``fully_shard`` path) and ``_api`` (:func:`offload_activations`).
"""

from torch_fsdp_offload.activations._api import offload_activations
from torch_fsdp_offload.activations._copies import ActivationOffloadStats, DEFAULT_MAX_INFLIGHT_BYTES
from torch_fsdp_offload.activations._offloader import (
    ActivationOffload,
    DEFAULT_MIN_OFFLOAD_BYTES,
    DEFAULT_PREFETCH_BLOCKS,
)
from torch_fsdp_offload.activations._ownership import check_can_hook
from torch_fsdp_offload.activations._policy_attachment import get_activation_offload

__all__ = [
    "ActivationOffload",
    "ActivationOffloadStats",
    "check_can_hook",
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DEFAULT_PREFETCH_BLOCKS",
    "get_activation_offload",
    "offload_activations",
]
