"""CoherentOffload's shard memory on a GPU (world size 1): managed shards copied in on a discrete
GPU, and shards the GPU reads in place (managed on a forced COHERENT class, pinned and managed on a
forced UNIFIED one), each trained bit for bit like the pinned copy path.

Every managed allocation here is a few MiB, far below the GPU's free memory: an oversubscribed
managed allocation can hang the GPU, and the policy refuses one before allocating (checked on the
CPU by test_refusal_changes_nothing.py, against the real free memory below).
"""

from __future__ import annotations

import gc
import os
import tempfile
import unittest

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import run_tests, TestCase

from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, OffloadOptimizer
from torch_fsdp_offload.device_memory import managed_device_alias, shared_empty
from torch_fsdp_offload.memory import HostMemoryError, memory_stats, pinned_empty
from torch_fsdp_offload.models import build_model, causal_lm_loss
from torch_fsdp_offload.optimizer.groups import offloaded_group
from torch_fsdp_offload.transfer import get_transfer_engine

try:
    from cuda.bindings import runtime  # noqa: F401

    HAS_CUDA_BINDINGS = True
except ImportError:
    HAS_CUDA_BINDINGS = False


def _offloaded_groups(model):
    """The model's offloaded groups, each once."""
    groups = {id(group): group for group in map(offloaded_group, model.parameters()) if group is not None}
    return list(groups.values())


@unittest.skipIf(not torch.cuda.is_available() or not HAS_CUDA_BINDINGS, "needs a GPU and cuda.bindings")
class ShardMemoryGPUTest(TestCase):
    @classmethod
    def setUpClass(cls):
        cls._store_file = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{cls._store_file}", rank=0, world_size=1)
        torch.cuda.set_device(0)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()
        os.unlink(cls._store_file)

    def tearDown(self):
        # The models' reference cycles hold their managed buffers until collected: free them here,
        # not inside a later test that counts managed allocations.
        gc.collect()
        torch.cuda.synchronize()

    def _train(self, policy: CoherentOffload, steps: int = 6, accum: int = 2):
        """``steps`` optimizer steps of ``accum`` micro-batches each; the losses, the parameters
        after them, the engine's counters and the managed bytes the model allocated."""
        gc.collect()
        managed_before = memory_stats()["managed_bytes"]
        torch.manual_seed(0)
        model = build_model("small", device="cuda")
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard_with_policy(model, model.blocks, policy, mp_policy=mp_policy)
        optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
        engine = get_transfer_engine("cuda")
        engine.stats.reset()
        losses = []
        for step in range(steps):
            for micro in range(accum):
                model.set_requires_gradient_sync(micro == accum - 1)
                seed = accum * step + micro
                tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
                loss = causal_lm_loss(model(tokens), tokens)
                loss.backward()
                losses.append(loss.detach())
            optim.step()
            optim.zero_grad()
        optim.synchronize()
        torch.cuda.synchronize()
        params = [param.full_tensor().cuda() for param in model.parameters()]
        stats = (engine.stats.h2d_copies, engine.stats.h2d_bytes, engine.stats.d2h_copies)
        managed = memory_stats()["managed_bytes"] - managed_before
        return losses, params, stats, managed, model

    def _assert_same_training(self, got, expected):
        for loss, reference in zip(got[0], expected[0], strict=True):
            self.assertEqual(loss, reference, atol=0, rtol=0)
        for param, reference in zip(got[1], expected[1], strict=True):
            self.assertEqual(param, reference, atol=0, rtol=0)

    def test_managed_shards_copied_in_on_a_discrete_gpu(self):
        pinned = self._train(CoherentOffload(platform="discrete", optimizer="host"))
        managed = self._train(CoherentOffload(platform="discrete", optimizer="host", shard_memory="managed"))
        self._assert_same_training(managed, pinned)
        # Copied in ahead of use as the pinned shards are: the same copies and bytes.
        self.assertEqual(managed[2], pinned[2])
        self.assertGreater(managed[2][0], 0)
        # Master, gradient buffer and bf16 mirror of every offloaded group, all managed.
        groups = _offloaded_groups(managed[4])
        self.assertTrue(groups)
        self.assertEqual(managed[3], sum(offload.host_bytes() for offload in groups))
        self.assertEqual(pinned[3], 0)
        device = torch.device("cuda", torch.cuda.current_device())
        for offload in groups:
            for buffer in (offload.master, offload.mirror, offload.grads):
                self.assertIsNotNone(managed_device_alias(buffer, device))

    def test_shards_read_in_place_copy_nothing_up(self):
        # COHERENT with managed shards, UNIFIED with pinned or managed ones, forced on this PCIe
        # machine: the GPU reads the host buffers through their device views, the host steps them,
        # accumulation adds to the host sums where they are.
        reference = self._train(CoherentOffload(platform="discrete", optimizer="host"))
        for platform, memory in (("coherent", "managed"), ("unified", "pinned"), ("unified", "managed")):
            with self.subTest(platform=platform, memory=memory):
                got = self._train(CoherentOffload(platform=platform, shard_memory=memory))
                self._assert_same_training(got, reference)
                h2d_copies, h2d_bytes, d2h_copies = got[2]
                self.assertEqual((h2d_copies, h2d_bytes), (0, 0))
                self.assertGreater(d2h_copies, 0)  # the reduced gradients go down
                self.assertEqual(got[3] > 0, memory == "managed")

    def test_engine_copies_managed_memory_through_its_device_view(self):
        # torch copies the CPU view of managed memory as pageable memory (a sixth of the link or less);
        # the engine copies its CUDA view instead, device to device, each way and with a cast.
        device = torch.device("cuda", torch.cuda.current_device())
        buffer = shared_empty((4, 1024), torch.float32, "managed", device)
        buffer.host_view.copy_(torch.arange(4096.0).view(4, 1024))
        part = buffer.host_view[1:3]
        alias = managed_device_alias(part, device)
        self.assertTrue(alias.is_cuda)
        self.assertEqual(alias.data_ptr(), part.data_ptr())
        self.assertIsNone(managed_device_alias(pinned_empty(16, torch.float32), device))
        engine = get_transfer_engine(device)
        expected = part.clone()
        down = torch.randn(2, 1024, device=device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            up = engine.h2d(part).wait()
            up16 = engine.h2d(part, dtype=torch.bfloat16).wait()
            engine.d2h(down, part).synchronize()
        self.assertEqual(up.cpu(), expected, atol=0, rtol=0)
        self.assertEqual(up16.cpu(), expected.to(torch.bfloat16), atol=0, rtol=0)
        self.assertEqual(buffer.host_view[1:3], down.cpu(), atol=0, rtol=0)
        copies = [event.name for event in profile.events() if event.name.startswith("Memcpy")]
        self.assertTrue(copies and all("DtoD" in name for name in copies), copies)

    def test_managed_shards_over_free_memory_refused_before_allocating(self):
        # The refusal against this GPU's real free memory: with all but 2 GiB taken by a tensor, a
        # group whose managed buffers need 3 GiB is refused at fully_shard, before anything is
        # allocated; the same group in pinned memory is sharded.
        free, _ = torch.cuda.mem_get_info()
        taken = torch.empty(free - (2 << 30), dtype=torch.uint8, device="cuda")
        try:
            rows = (3 << 30) // 8 // 1024  # fp32 master and gradient buffer: 8 bytes an element
            before = memory_stats()
            big = torch.nn.Linear(1024, rows, bias=False, device="meta")
            with self.assertRaisesRegex(HostMemoryError, r"managed CoherentOffload shards.*oversubscribing managed memory can stall the GPU"):
                fully_shard(big, offload_policy=CoherentOffload(shard_memory="managed", optimizer="host"))
            self.assertEqual(memory_stats(), before)
            self.assertNotIsInstance(big.weight, DTensor)
            fully_shard(big, offload_policy=CoherentOffload(optimizer="host"))
        finally:
            del taken
            torch.cuda.empty_cache()

if __name__ == "__main__":
    run_tests()
