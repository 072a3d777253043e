"""The offload planner: should I offload, and how much?

``plan(...)`` follows the decision framework of "Optimizing PyTorch on CPU-GPU Coherent Platforms"
(memory breakdown, the model's DRAM bandwidth, the link bandwidth offloading needs, what a larger
micro-batch gains, partial offload, activation checkpointing) and ends with a ``CoherentOffload``
to use. ``python -m torch_fsdp_offload plan`` is its command line. See docs/planner.md.
"""

from torch_fsdp_offload.planner.api import NothingFitsError, plan, plan_and_shard, predict_per_gpu
from torch_fsdp_offload.planner.profiles import PLATFORM_PROFILES, PlatformProfile, get_profile
from torch_fsdp_offload.planner.report import PlanResult, Recommendation
from torch_fsdp_offload.planner.scenario import Scenario, ScenarioError, load_scenario
from torch_fsdp_offload.planner.step_time import predict_step
from torch_fsdp_offload.planner.training_config import TrainingConfig
from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = [
    "NothingFitsError",
    "PLATFORM_PROFILES",
    "PlanResult",
    "PlatformProfile",
    "Recommendation",
    "Scenario",
    "ScenarioError",
    "TrainingConfig",
    "TrainingProfile",
    "get_profile",
    "load_scenario",
    "plan",
    "plan_and_shard",
    "predict_per_gpu",
    "predict_step",
]
