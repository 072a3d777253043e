"""PyTorch's FSDP2 training-parity tests that compare before ``step()`` (``test_fully_shard_training.py``:
HSDP training parity, gradient accumulation), run with ``CoherentOffload`` and ``OffloadOptimizer``
at its defaults, overlap on. A replicated reference and the offloaded model train on the same
micro-batches, accumulating (``set_requires_gradient_sync``, ``set_reshard_after_backward``), and
``check_sharded_parity`` compares parameters and gradients before every ``step()`` and after it:
host steps still running after ``step()`` must be invisible (a read waits for them), and nothing
changes before ``step()``.

On CPU with gloo; HSDP at world sizes 2 (2 replicas of 1 shard) and 4 (2 x 2), accumulation at 2.
The platform is forced to ``discrete``: every shard is homed on the host and every copy runs
through the transfer engine.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
import torch.distributed as dist
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


def _each_setting(names: tuple[str, ...], settings, run) -> None:
    """``run(*setting)`` for every setting, a failure naming its setting. Not subTest: a rank that
    went on past a failed setting would wait in collectives the others never join."""
    for setting in settings:
        try:
            run(*setting)
        except AssertionError as error:
            raise AssertionError(f"{dict(zip(names, setting))}: {error}") from None


def _train_in_parity(case, reference, reference_optim, model, optim, *, batch_shape, set_flags,
                     reduce_reference, set_to_none) -> int:
    """Train ``reference`` and ``model`` on the same micro-batches; ``check_sharded_parity`` before
    and after every ``step()``. ``set_flags(last)`` sets the accumulation flags before each
    micro-batch, ``reduce_reference`` averages the reference's gradients over the ranks (one not
    replicated by DDP), ``set_to_none(iteration)`` is ``zero_grad``'s argument. Returns how many
    host steps were still running when ``step()`` returned."""
    torch.manual_seed(42 + case.rank + 1)
    overlapped = 0
    for iteration in range(ITERATIONS):
        for micro in range(MICRO_BATCHES):
            set_flags(micro == MICRO_BATCHES - 1)
            batch = torch.randn(batch_shape)
            losses = [m(batch).sum() for m in (reference, model)]
            for loss in losses:
                loss.backward()
            case.assertEqual(losses[0], losses[1])
        if reduce_reference:
            for param in reference.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        check_sharded_parity(case, reference, model)  # before step(): nothing stepped early
        for o in (reference_optim, optim):
            o.step()
        overlapped += len(optim._finishing_steps.pending)
        for o in (reference_optim, optim):
            o.zero_grad(set_to_none=set_to_none(iteration))
        check_sharded_parity(case, reference, model)  # after step(): the reads wait for the steps
    optim.synchronize()
    return overlapped


class HSDPTrainingParityTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 4

    def test_train_parity_hsdp(self):
        self.init_gloo()
        shard_size = 2 if self.world_size > 2 else 1
        mesh = init_device_mesh("cpu", (self.world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
        names = ("reshard_after_forward", "checkpointing", "mlp_dim", "sync_at_last")
        settings = itertools.product((True, False), (False, True), (3, 17), (True, False))
        _each_setting(names, settings, functools.partial(self._train_parity_hsdp, mesh))

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

        def set_flags(last: bool) -> None:
            if sync_at_last:
                model.set_requires_gradient_sync(last)

        overlapped = _train_in_parity(self, reference, reference_optim, model, optim, batch_shape=(8, mlp_dim),
                                      set_flags=set_flags, reduce_reference=False,
                                      set_to_none=lambda iteration: iteration % 2 == 0)
        # The host steps did outlive step(): the reads above are the ones the contract is about.
        self.assertGreater(overlapped, 0)


class HSDPTrainingParityWorldSize2Test(HSDPTrainingParityTest):
    WORLD_SIZE = 2


class GradientAccumulationParityTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def test_gradient_accumulation(self):
        # Which modules skip the reduction for all but the last micro-batch: every one, the first
        # two MLPs, or the root alone; each also keeping its gradients unsharded in between.
        self.init_gloo()
        mesh = init_device_mesh("cpu", (self.world_size,))
        settings = itertools.product(("all", "some_mlps", "root_only"), (True, False))
        _each_setting(("mode", "reshard_after_backward"), settings, functools.partial(self._accumulate, mesh))

    def _accumulate(self, mesh, mode: str, reshard_after_backward: bool) -> None:
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(32, 32), *(MLP(32) for _ in range(3)))
        reference = copy.deepcopy(model)
        shard = functools.partial(fully_shard, mesh=mesh, offload_policy=CoherentOffload(platform="discrete"))
        for mlp in model[1:]:
            shard(mlp)
        shard(model)  # the root holds the first linear
        reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
        optim = OffloadOptimizer(model, torch.optim.Adam, lr=1e-2)
        targets = {"all": [(model, True)], "some_mlps": [(mlp, True) for mlp in model[1:3]], "root_only": [(model, False)]}

        def set_flags(last: bool) -> None:
            for module, recurse in targets[mode]:
                module.set_requires_gradient_sync(last, recurse=recurse)
                if not reshard_after_backward:
                    module.set_reshard_after_backward(last, recurse=recurse)

        # set_to_none=False at even iterations mixes accumulation with and without the reduction.
        _train_in_parity(self, reference, reference_optim, model, optim, batch_shape=(2, 32), set_flags=set_flags,
                         reduce_reference=True, set_to_none=lambda iteration: bool(iteration % 2))


if __name__ == "__main__":
    run_tests()
