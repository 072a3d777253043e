"""What the planner's cost model takes from the library, in one place.

The step model must predict what the library does, so it reads the library's own public constants
rather than copies of them.
"""

from torch_fsdp_offload.activations import DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_PREFETCH_BLOCKS
from torch_fsdp_offload.optim import STREAM_RUN_BYTES, STREAM_RUNS_IN_FLIGHT
from torch_fsdp_offload.policy import CAST_PLACEMENTS, spread_block

__all__ = [
    "ACTIVATION_PREFETCH_BLOCKS",
    "CAST_PLACEMENTS",
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "STREAM_RUNS_IN_FLIGHT",
    "STREAM_RUN_BYTES",
    "spread_block",
]

# Blocks ahead of the one in backward whose offloaded activations are reloaded: offload_activations'
# default, which Recommendation.apply uses.
ACTIVATION_PREFETCH_BLOCKS: int = DEFAULT_PREFETCH_BLOCKS
