"""The policy on both 2-D layouts of four gloo ranks: tensor parallelism with FSDP, and HSDP.

On a 2 x 2 ``DeviceMesh`` ("dp", "tp"), each block's projections are split by ``parallelize_module``
(``ColwiseParallel`` up, ``RowwiseParallel`` down) over "tp", then sharded by ``fully_shard`` over "dp".
On a 2 x 2 ``DeviceMesh`` ("replicate", "shard"), ``fully_shard`` over the whole mesh replicates across
the first dimension and shards across the second (hybrid sharding). Either way, with
``CoherentOffload(platform="discrete")`` (every shard homed on the host, every copy through the
transfer engine) ``OffloadOptimizer`` with the user's ``clip_grad_norm_`` (its total norm spans both
mesh dimensions) trains bit for bit as fused AdamW over the same mesh without offload, and a DCP
checkpoint saved mid-run resumes as exactly.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module, RowwiseParallel
from torch.testing._internal.common_utils import run_tests

from common_offload import GlooMultiProcessTestCase, ResidualMLPBlocks
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.transfer import get_transfer_engine

STEPS = 3
WIDTH = 16


def _policy(offloaded: bool) -> dict:
    """``fully_shard``'s keyword for the policy, every shard homed on the host; none without offload."""
    return {"offload_policy": CoherentOffload(platform="discrete")} if offloaded else {}


class TwoDimensionalMeshTest(GlooMultiProcessTestCase):
    """Tensor parallelism over "tp", FSDP over "dp"; a subclass trains another layout of the same
    mesh shape by overriding ``MESH_DIM_NAMES``, ``_shard`` and ``_batch_seed``."""

    WORLD_SIZE = 4
    MESH_DIM_NAMES = ("dp", "tp")

    def _batch_seed(self) -> int:
        # The ranks of one "dp" coordinate see the same batch (tensor parallelism splits features).
        return self.rank // 2

    def _shard(self, model: ResidualMLPBlocks, mesh, offloaded: bool) -> ResidualMLPBlocks:
        policy = _policy(offloaded)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"], **policy)
        return fully_shard(model, mesh=mesh["dp"], **policy)

    def _optimizer(self, model: ResidualMLPBlocks, offloaded: bool) -> torch.optim.Optimizer:
        if offloaded:
            return OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def _train(self, model, optimizer, generator, steps: int) -> list[tuple[float, float]]:
        trace = []
        for _ in range(steps):
            x = torch.randn(4, WIDTH, generator=generator)
            loss = model(x).pow(2).mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()
            trace.append((loss.item(), norm.full_tensor().item()))
        return trace

    def test_parity_clipping_and_checkpoint_resume(self):
        self.init_gloo()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=self.MESH_DIM_NAMES)
        torch.manual_seed(0)
        initial = ResidualMLPBlocks(WIDTH, head=False)
        traces, states = {}, {}
        with tempfile.TemporaryDirectory() as scratch:
            shared = [scratch]
            dist.broadcast_object_list(shared, src=0)
            engine = get_transfer_engine("cpu")
            for offloaded in (False, True):
                engine.stats.reset()
                model = self._shard(copy.deepcopy(initial), mesh, offloaded)
                optimizer = self._optimizer(model, offloaded)
                generator = torch.Generator().manual_seed(self._batch_seed())
                trace = self._train(model, optimizer, generator, STEPS)
                path = f"{shared[0]}/{'offloaded' if offloaded else 'plain'}"
                model_state, optimizer_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
                # Resume into a fresh model and optimizer of the same kind; train on.
                resumed = self._shard(ResidualMLPBlocks(WIDTH, head=False), mesh, offloaded)
                resumed_optimizer = self._optimizer(resumed, offloaded)
                model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
                loaded = {"model": model_state, "optimizer": optimizer_state}
                dcp.load(loaded, checkpoint_id=path)
                set_state_dict(resumed, resumed_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
                trace += self._train(resumed, resumed_optimizer, generator, STEPS)
                if offloaded:  # every copy in and out through the engine, as on a GPU
                    resumed_optimizer.synchronize()
                    self.assertGreater(engine.stats.h2d_copies, 0)
                    self.assertGreater(engine.stats.d2h_copies, 0)
                else:
                    self.assertEqual(engine.stats.h2d_copies + engine.stats.d2h_copies, 0)
                traces[offloaded] = trace
                states[offloaded] = [param.full_tensor() for param in resumed.parameters()]
        self.assertGreater(traces[False][0][1], 0.1)  # the clip scales
        self.assertEqual(traces[True], traces[False])
        for offloaded_param, plain_param in zip(states[True], states[False]):
            self.assertEqual(offloaded_param, plain_param, atol=0, rtol=0)


class HybridShardedMeshTest(TwoDimensionalMeshTest):
    """HSDP: ``fully_shard`` over the whole ("replicate", "shard") mesh, each block and the root."""

    MESH_DIM_NAMES = ("replicate", "shard")

    def _batch_seed(self) -> int:
        # Every rank is a data-parallel rank (four ways), each with batches of its own.
        return self.rank

    def _shard(self, model: ResidualMLPBlocks, mesh, offloaded: bool) -> ResidualMLPBlocks:
        policy = _policy(offloaded)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **policy)
        return fully_shard(model, mesh=mesh, **policy)


if __name__ == "__main__":
    run_tests()
