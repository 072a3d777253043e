"""A ``fully_shard`` that CoherentOffload refuses leaves the model as it was.

Every check the policy makes at sharding time (host capacity and its environment override, one
dtype and one compute dtype per offloaded group, platform resolution, placements on a platform that
copies nothing) runs before FSDP converts a parameter, and FSDP's marks on the module are taken
back: the model then runs as it is, or is sharded again, with or without the policy, and trains like
a model that was never refused.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from common_offload import RefusalTestCase
from torch_fsdp_offload import CoherentOffload
from torch_fsdp_offload._integration import fsdp2_shards_on_host
from torch_fsdp_offload.memory import ENV_HOST_MEMORY, HostMemoryError, memory_stats


class _Blocks(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x.to(self.head.weight.dtype)).float()


# (what is refused, the policy, the environment, the error) for a fully_shard of the whole model.
_REFUSALS = {
    "host_budget_too_small": (
        CoherentOffload(platform="discrete"), {ENV_HOST_MEMORY: "1KiB"}, HostMemoryError, "Cannot allocate"
    ),
    "host_budget_malformed": (
        CoherentOffload(platform="discrete"), {ENV_HOST_MEMORY: "lots"}, ValueError, ENV_HOST_MEMORY
    ),
    "platform_unknown": (
        CoherentOffload(), {"TORCH_FSDP_OFFLOAD_PLATFORM": "banana"}, ValueError, "banana"
    ),
    "placement_where_nothing_is_copied": (
        CoherentOffload(platform="host_only", optimizer="stream"), {}, ValueError, "copies nothing"
    ),
}


class RefusalChangesNothingTest(RefusalTestCase):

    @parametrize("refusal", list(_REFUSALS))
    def test_refused_model_runs_and_shards_again(self, refusal: str) -> None:
        policy, environ, error, message = _REFUSALS[refusal]

        def refuse(model: nn.Module) -> None:
            with mock.patch.dict(os.environ, environ):
                fully_shard(model, offload_policy=policy)

        self.assertRefusalLeavesModelTrainable(refuse, error, message, make_model=_Blocks)

    def _assert_untouched(self, model: nn.Module, reference: nn.Module) -> None:
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            self.assertNotIsInstance(param, DTensor, name)
            self.assertEqual(param, expected, msg=name)

    def test_refused_mixed_dtype_group_shards_with_the_fix_on_the_same_model(self) -> None:
        torch.manual_seed(0)
        model = _Blocks(dtype=torch.bfloat16)
        reference = copy.deepcopy(model)
        policy = CoherentOffload(platform="discrete")
        with self.assertRaisesRegex(ValueError, "mix torch.bfloat16, torch.float32"):
            fully_shard(model, offload_policy=policy)
        self._assert_untouched(model, reference)
        # The fix the message gives, on the same model: each dtype its own group.
        fully_shard(model.head, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        plain = copy.deepcopy(reference)
        fully_shard(plain.head)
        fully_shard(plain)
        self.assertEqual(self.train_step(model), self.train_step(plain))

    def test_refused_group_of_two_compute_dtypes_shards_with_one(self) -> None:
        if not hasattr(MixedPrecisionPolicy, "param_dtype_override_fn"):
            self.skipTest(f"per-parameter compute dtypes came with torch 2.15; this is torch {torch.__version__}")
        torch.manual_seed(0)
        model = _Blocks()
        reference = copy.deepcopy(model)
        policy = CoherentOffload(platform="discrete")
        head = {id(param) for param in model.head.parameters()}
        fp32_head = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float32 if id(p) in head else None
        )
        with self.assertRaisesRegex(ValueError, "param_dtype_override_fn gives this group's parameters torch.bfloat16, torch.float32"):
            fully_shard(model, mp_policy=fp32_head, offload_policy=policy)
        self._assert_untouched(model, reference)
        # The fix the message gives: one compute dtype for every parameter of the group.
        one_dtype = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: None)
        fully_shard(model, mp_policy=one_dtype, offload_policy=policy)
        plain = copy.deepcopy(reference)
        fully_shard(plain, mp_policy=one_dtype)
        self.assertEqual(self.train_step(model), self.train_step(plain))

    def test_root_refused_after_its_blocks_were_sharded(self) -> None:
        # The budget holds the two blocks' groups (16 x 16 + 16 fp32 parameters each: master and
        # gradient buffer, 2176 bytes) but not the root's on top of them: the root's fully_shard is
        # refused, the blocks stay sharded with the policy, and the root shards without it.
        gc.collect()  # other tests' groups, never homed, would count against the budget too
        torch.manual_seed(0)
        model = _Blocks()
        reference = copy.deepcopy(model)
        policy = CoherentOffload(platform="discrete", optimizer="host")
        with mock.patch.dict(os.environ, {ENV_HOST_MEMORY: str(2 * 2176 + 100)}):
            for block in model.blocks:
                fully_shard(block, offload_policy=policy)
            with self.assertRaisesRegex(HostMemoryError, "Cannot allocate"):
                fully_shard(model, offload_policy=policy)
        self._assert_root_shards_plainly(model, reference)

    def test_managed_shards_over_the_gpus_free_memory_refused_before_allocating(self) -> None:
        # The blocks' managed buffers (2176 bytes each) fit in what the GPU has free; the root's on
        # top of them would not: refused at its fully_shard, before anything is allocated (an
        # oversubscribed managed allocation can hang the GPU), the blocks staying offloaded.
        gc.collect()  # other tests' groups, never homed, would count as promised too
        torch.manual_seed(0)
        model = _Blocks()
        reference = copy.deepcopy(model)
        policy = CoherentOffload(platform="discrete", shard_memory="managed", optimizer="host")
        gpu = dataclasses.replace(
            policy.detect(), device=torch.device("cuda", 0), attributes={"ManagedMemory": 1, "ConcurrentManagedAccess": 1}
        )
        before = memory_stats()
        with mock.patch.object(CoherentOffload, "detect", return_value=gpu), \
                mock.patch("torch.cuda.mem_get_info", return_value=(2 * 2176 + 100, 1 << 30)):
            for block in model.blocks:
                fully_shard(block, offload_policy=policy)
            with self.assertRaisesRegex(HostMemoryError, r"managed CoherentOffload shards.*free.*oversubscribing managed memory can stall the GPU.*shard_memory=.pinned."):
                fully_shard(model, offload_policy=policy)
        self.assertEqual(memory_stats(), before)
        self.assertTrue(all(fsdp2_shards_on_host(block) for block in model.blocks))
        self._assert_root_shards_plainly(model, reference)

    def _assert_root_shards_plainly(self, model: nn.Module, reference: nn.Module) -> None:
        """The root whose sharding was refused is untouched; sharded without the policy, the model
        (its blocks still sharded with it) trains like a plain copy of ``reference``."""
        self.assertNotIsInstance(model.head.weight, DTensor)
        fully_shard(model)
        plain = copy.deepcopy(reference)
        for block in plain.blocks:
            fully_shard(block)
        fully_shard(plain)
        self.assertEqual(self.train_step(model), self.train_step(plain))


instantiate_parametrized_tests(RefusalChangesNothingTest)

if __name__ == "__main__":
    run_tests()
