"""FSDP2 + CoherentOffload on a GPU (world size 1): parity with GPU-resident FSDP2, flat memory.

Run on a GPU machine, also under ``TORCH_CUDA_SANITIZER=1``.
"""

from __future__ import annotations

import copy
import os
import tempfile
import unittest

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.testing._internal.common_utils import run_tests, TestCase

from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.memory import memory_stats
from torch_fsdp_offload.models import build_model, causal_lm_loss
from torch_fsdp_offload.transfer import get_transfer_engine


def _shard(model, policy):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mp_policy": mp} if policy is None else {"mp_policy": mp, "offload_policy": policy}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
class CoherentOffloadGPUTest(TestCase):
    @classmethod
    def setUpClass(cls):
        cls._store_file = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=f"file://{cls._store_file}", rank=0, world_size=1
        )
        torch.cuda.set_device(0)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()
        os.unlink(cls._store_file)

    def _pair(self, prefetch_depth=1, module_fraction=1.0):
        torch.manual_seed(0)
        reference = build_model("small", device="cuda")
        model = copy.deepcopy(reference)
        _shard(reference, None)
        _shard(model, CoherentOffload(prefetch_depth=prefetch_depth, module_fraction=module_fraction))
        return (
            reference,
            torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True),
            model,
            OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True),
        )

    def test_parity_with_resident(self):
        for depth, fraction in ((1, 1.0), (2, 0.5)):
            reference, reference_optim, model, optim = self._pair(depth, fraction)
            for step in range(10):
                tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                for m, o in ((reference, reference_optim), (model, optim)):
                    loss = causal_lm_loss(m(tokens), tokens)
                    loss.backward()
                    o.step()
                    o.zero_grad()
                    if m is reference:
                        reference_loss = loss.detach()
                self.assertEqual(loss.detach(), reference_loss, atol=0, rtol=1e-6)
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                self.assertEqual(p.full_tensor().cuda(), q.full_tensor(), atol=1e-6, rtol=1e-6, msg=name)
            self.assertTrue(optim._overlap_learned)

    def test_memory_flat_over_300_steps(self):
        _, _, model, optim = self._pair()
        engine = get_transfer_engine("cuda")
        readings = []
        for step in range(300):
            tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            causal_lm_loss(model(tokens), tokens).backward()
            optim.step()
            optim.zero_grad()
            if step in (10, 299):
                torch.cuda.synchronize()
                readings.append((torch.cuda.memory_allocated(), memory_stats()["pinned_bytes"]))
        self.assertEqual(readings[0], readings[1])
        self.assertGreater(engine.stats.h2d_copies, 0)


if __name__ == "__main__":
    run_tests()
