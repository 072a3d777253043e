"""Per-block ``torch.compile`` (each block compiled before ``fully_shard``, as torchtitan does) with
``CoherentOffload`` and ``OffloadOptimizer``: bit for bit as the same compiled model without offload,
no graph break, and nothing compiled again after the first step.

The CPU runs the blocks through dynamo and AOTAutograd with the ``aot_eager`` backend (inductor's
C++ build takes half a minute per block on two cores here; its kernels are not what this checks). A
``CoherentOffload(platform="discrete")`` homes every shard on the host and copies through the
transfer engine, so the compiled blocks run on what the policy copied in.
"""

from __future__ import annotations

import copy

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.testing._internal.common_utils import run_tests

from common_offload import ResidualMLPBlocks, SingleRankGlooTestCase
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.transfer import get_transfer_engine

STEPS = 4
WIDTH = 16


class CompiledBlocksTest(SingleRankGlooTestCase):
    def _run(self, model: ResidualMLPBlocks, offloaded: bool) -> tuple[list[float], list[int], dict]:
        """Compile each block, shard, train; return the losses, the frames dynamo compiled in each
        step, and the graph breaks it counted."""
        torch._dynamo.reset()
        counters.clear()
        mesh = init_device_mesh("cpu", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = {"offload_policy": CoherentOffload(platform="discrete")} if offloaded else {}
        for block in model.blocks:
            block.compile(backend="aot_eager")
            fully_shard(block, mesh=mesh, mp_policy=mp, **policy)
        fully_shard(model, mesh=mesh, mp_policy=mp, **policy)
        if offloaded:
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        generator = torch.Generator().manual_seed(0)
        losses, compiled = [], []
        for _ in range(STEPS):
            frames = counters["frames"]["ok"]
            x = torch.randn(8, WIDTH, generator=generator)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            compiled.append(counters["frames"]["ok"] - frames)
        if offloaded:
            optimizer.synchronize()
        return losses, compiled, dict(counters["graph_break"])

    def test_exact_without_graph_breaks_or_recompiles(self):
        torch.manual_seed(0)
        initial = ResidualMLPBlocks(WIDTH, head=True)
        engine = get_transfer_engine("cpu")
        plain = copy.deepcopy(initial)
        plain_losses, _, _ = self._run(plain, offloaded=False)
        engine.stats.reset()
        model = copy.deepcopy(initial)
        losses, compiled, graph_breaks = self._run(model, offloaded=True)
        self.assertGreater(engine.stats.h2d_copies, 0)  # the compiled blocks ran on copied-in shards
        self.assertEqual(losses, plain_losses)
        for param, plain_param in zip(model.parameters(), plain.parameters()):
            self.assertEqual(param.full_tensor(), plain_param.full_tensor(), atol=0, rtol=0)
        self.assertEqual(graph_breaks, {})
        self.assertGreater(compiled[0], 0)  # the blocks compiled in the first step, never again
        self.assertEqual(compiled[1:], [0] * (STEPS - 1))


if __name__ == "__main__":
    run_tests()
