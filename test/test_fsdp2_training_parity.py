"""PyTorch's FSDP2 HSDP training-parity test (``test_fully_shard_training.py``'s
``_test_train_parity_hsdp``), run with ``CoherentOffload`` and ``OffloadOptimizer`` at its defaults,
overlap on: a replicated reference and the offloaded model train on the same micro-batches, with
gradient accumulation (``set_requires_gradient_sync``), and ``check_sharded_parity`` compares
parameters and gradients before every ``step()`` and after it. Host steps still running after
``step()`` (``overlap_next_forward``) must be invisible: a read waits for them, and nothing has
changed before ``step()``.

On CPU with gloo, at world sizes 2 (2 replicas of 1 shard) and 4 (2 x 2); the platform is forced to
``discrete``, so every shard is homed on the host and every copy runs through the transfer engine.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint, replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_fsdp import check_sharded_parity, MLP
from torch.testing._internal.common_utils import run_tests

from common_offload import GlooMultiProcessTestCase
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer

ITERATIONS = 4
MICRO_BATCHES = 3


class HSDPTrainingParityTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 4

    def test_train_parity_hsdp(self):
        self.init_gloo()
        shard_size = 2 if self.world_size > 2 else 1
        mesh = init_device_mesh("cpu", (self.world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
        settings = itertools.product((True, False), (False, True), (3, 17), (True, False))
        for setting in settings:
            # Not subTest: a rank that went on past a failed setting would wait in collectives the
            # others never join.
            try:
                self._train_parity_hsdp(mesh, *setting)
            except AssertionError as error:
                names = ("reshard_after_forward", "checkpointing", "mlp_dim", "sync_at_last")
                raise AssertionError(f"{dict(zip(names, setting))}: {error}") from None

    def _train_parity_hsdp(self, mesh, reshard_after_forward: bool, checkpointing: bool, mlp_dim: int,
                           sync_at_last: bool) -> None:
        torch.manual_seed(42)
        model = nn.Sequential(
            nn.LayerNorm(mlp_dim, bias=False),
            MLP(mlp_dim, dim_multiplier=3),
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        )
        reference = copy.deepcopy(model)
        replicate(reference)
        reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
        shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward,
                                  offload_policy=CoherentOffload(platform="discrete"))
        for mlp in model[1:]:
            if checkpointing:
                checkpoint(mlp)
            shard(mlp)
        shard(model)
        optim = OffloadOptimizer(model, torch.optim.Adam, lr=1e-2)
        check_sharded_parity(self, reference, model)
        torch.manual_seed(42 + self.rank + 1)
        overlapped = 0
        for iteration in range(ITERATIONS):
            for micro in range(MICRO_BATCHES):
                if sync_at_last:
                    model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
                batch = torch.randn((8, mlp_dim))
                losses = [m(batch).sum() for m in (reference, model)]
                for loss in losses:
                    loss.backward()
                self.assertEqual(losses[0], losses[1])
            check_sharded_parity(self, reference, model)  # before step(): nothing stepped early
            for o in (reference_optim, optim):
                o.step()
            overlapped += len(optim._finishing)
            for o in (reference_optim, optim):
                o.zero_grad(set_to_none=(iteration % 2 == 0))
            check_sharded_parity(self, reference, model)  # after step(): the reads wait for the steps
        optim.synchronize()
        # The host steps did outlive step(): the reads above are the ones the contract is about.
        self.assertGreater(overlapped, 0)


class HSDPTrainingParityWorldSize2Test(HSDPTrainingParityTest):
    WORLD_SIZE = 2


if __name__ == "__main__":
    run_tests()
