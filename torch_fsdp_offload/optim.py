"""Where the optimizer step of offloaded parameters runs: ``OffloadOptimizer``.

The public module of the optimizer; its parts live in :mod:`torch_fsdp_offload.optimizer`.
"""

from torch_fsdp_offload.optimizer.groups import notify_grads_ready, register_offloaded_group
from torch_fsdp_offload.optimizer.offload_optimizer import OffloadOptimizer
from torch_fsdp_offload.optimizer.streamed_steps import STREAM_RUN_BYTES, STREAM_RUNS_IN_FLIGHT

__all__ = [
    "OffloadOptimizer",
    "STREAM_RUNS_IN_FLIGHT",
    "STREAM_RUN_BYTES",
    "notify_grads_ready",
    "register_offloaded_group",
]
