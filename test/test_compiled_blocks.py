"""``torch.compile`` with ``CoherentOffload``, ``OffloadOptimizer`` and activation offload: bit for
bit as the same compiled model without offload, no graph break of the offload's own, and nothing
compiled again after the first step.

* Per-block compile (each block compiled before ``fully_shard``, as torchtitan does): no graph
  break at all, with parameter offload and with activation offload (``CoherentOffload(activations=
  True)`` or ``offload_activations``), whose hooks run outside the compiled blocks.
* Whole-model compile (``torch.compile`` of the sharded model): FSDP2's hooks break the graph at
  each block and the model's own code runs eagerly between them, with or without the policy; the
  offload adds no graph break and no frame to that.
* Refused when set up: the policy where ``torch.compile`` traces FSDP2's hooks (``skip_fsdp_hooks=
  False``), and activation offload of blocks inside a model compiled as a whole without FSDP2.

The CPU runs the blocks through dynamo and AOTAutograd with the ``aot_eager`` backend (inductor's
C++ build takes half a minute per block on two cores here; its kernels are not what this checks). A
``CoherentOffload(platform="discrete")`` homes every shard on the host and copies through the
transfer engine, so the compiled blocks run on what the policy copied in; activation offload copies
every saved tensor of a block (``min_offload_bytes=0``: this model's are far below the default).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from unittest import mock

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests

from common_offload import RefusalTestCase, ResidualMLPBlocks
from torch_fsdp_offload import CoherentOffload, offload_activations, OffloadOptimizer
from torch_fsdp_offload._integration import fsdp2_group_plan
from torch_fsdp_offload.activations import _policy_attachment, ActivationOffload, ActivationOffloadStats, get_activation_offload
from torch_fsdp_offload.transfer import get_transfer_engine

STEPS = 4
WIDTH = 16


@dataclasses.dataclass
class Run:
    losses: list[float]
    params: list[torch.Tensor]
    frames: list[int]  # frames dynamo tried to compile in each step
    graph_breaks: dict[str, int]  # graph breaks, and frames dynamo gave up on, by reason
    activations: ActivationOffloadStats | None  # what activation offload copied, where it ran


def _fsdp_hooks_traced() -> contextlib.AbstractContextManager:
    """``torch.compile`` tracing FSDP2's hooks: dynamo's knob where this torch has it (2.11); elsewhere
    FSDP2 never has them traced, and the integration's reading of the knob answers as that knob would."""
    if hasattr(torch._dynamo.config, "skip_fsdp_hooks"):
        return torch._dynamo.config.patch(skip_fsdp_hooks=False)
    return mock.patch.object(fsdp2_group_plan, "fsdp_hooks_traced", return_value=True)


class CompiledBlocksTest(RefusalTestCase):
    def _run(self, model: ResidualMLPBlocks, offload: str | None, compile_whole: bool) -> Run:
        """Compile each block (or, with ``compile_whole``, the sharded model), shard, train.

        ``offload``: None (plain FSDP2 and fused AdamW), ``"params"`` (the policy and
        OffloadOptimizer), ``"activations"`` (the same, and the policy's activation offload) or
        ``"offload_activations"`` (plain FSDP2 and fused AdamW, and ``offload_activations``).
        """
        torch._dynamo.reset()
        counters.clear()
        mesh = init_device_mesh("cpu", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = {}
        if offload in ("params", "activations"):
            policy["offload_policy"] = CoherentOffload(platform="discrete", activations=offload == "activations")
        every_saved_tensor = functools.partial(ActivationOffload, min_offload_bytes=0)
        with mock.patch.object(_policy_attachment, "ActivationOffload", every_saved_tensor):
            for block in model.blocks:
                if not compile_whole:
                    block.compile(backend="aot_eager")
                fully_shard(block, mesh=mesh, mp_policy=mp, **policy)
            fully_shard(model, mesh=mesh, mp_policy=mp, **policy)
        activations = get_activation_offload(model)
        if offload == "offload_activations":
            activations = offload_activations(model, min_offload_bytes=0, platform="discrete")
        if policy:
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        forward = torch.compile(model, backend="aot_eager") if compile_whole else model
        generator = torch.Generator().manual_seed(0)
        losses, frames = [], []
        for _ in range(STEPS):
            tried = counters["frames"]["total"]
            x = torch.randn(8, WIDTH, generator=generator)
            loss = forward(x).float().pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            frames.append(counters["frames"]["total"] - tried)
        if policy:
            optimizer.synchronize()
        return Run(
            losses=losses,
            params=[param.full_tensor() for param in model.parameters()],
            frames=frames,
            graph_breaks={**counters["graph_break"], **counters["unimplemented"]},
            activations=None if activations is None else activations.stats,
        )

    def _compare(self, offload: str, compile_whole: bool) -> tuple[Run, Run]:
        """The plain run and the ``offload`` run of one model, checked bit for bit equal."""
        torch.manual_seed(0)
        initial = ResidualMLPBlocks(WIDTH, head=True)
        plain = self._run(copy.deepcopy(initial), None, compile_whole)
        run = self._run(copy.deepcopy(initial), offload, compile_whole)
        self.assertEqual(run.losses, plain.losses)
        self.assertEqual(run.params, plain.params, atol=0, rtol=0)
        self.assertGreater(run.frames[0], 0)  # compiled in the first step, never again
        self.assertEqual(run.frames[1:], [0] * (STEPS - 1))
        return plain, run

    def assertActivationsOffloaded(self, run: Run) -> None:
        # Every step offloaded the blocks' saved tensors and brought back each byte it offloaded.
        self.assertIsNotNone(run.activations)
        self.assertGreaterEqual(run.activations.d2h_copies, STEPS * len(ResidualMLPBlocks().blocks))
        self.assertEqual(run.activations.h2d_bytes, run.activations.d2h_bytes)

    def test_exact_without_graph_breaks_or_recompiles(self):
        engine = get_transfer_engine("cpu")
        engine.stats.reset()
        _, run = self._compare("params", compile_whole=False)
        self.assertGreater(engine.stats.h2d_copies, 0)  # the compiled blocks ran on copied-in shards
        self.assertEqual(run.graph_breaks, {})

    @parametrize("offload", ["activations", "offload_activations"])
    def test_activation_offload_exact_without_graph_breaks_or_recompiles(self, offload: str):
        _, run = self._compare(offload, compile_whole=False)
        self.assertActivationsOffloaded(run)
        self.assertEqual(run.graph_breaks, {})

    @parametrize("offload", ["params", "activations"])
    def test_whole_model_compile_exact_with_fsdp2s_graph_breaks_only(self, offload: str):
        plain, run = self._compare(offload, compile_whole=True)
        self.assertEqual(run.graph_breaks, plain.graph_breaks)
        self.assertEqual(run.frames, plain.frames)
        if offload == "activations":
            self.assertActivationsOffloaded(run)

    def test_policy_refused_where_compile_traces_fsdp2_hooks(self):
        def shard_with_policy(model: ResidualMLPBlocks) -> None:
            policy = CoherentOffload(platform="discrete")
            with _fsdp_hooks_traced():
                for block in model.blocks:
                    fully_shard(block, offload_policy=policy)
                fully_shard(model, offload_policy=policy)

        self.assertRefusalLeavesModelTrainable(
            shard_with_policy, RuntimeError, "skip_fsdp_hooks=False", lambda: ResidualMLPBlocks(WIDTH, head=True)
        )

    def test_activation_offload_refused_inside_a_model_compiled_whole(self):
        def offload_compiled(model: ResidualMLPBlocks) -> None:
            offload_activations(torch.compile(model, backend="aot_eager"), platform="discrete")

        self.assertRefusalLeavesModelTrainable(
            offload_compiled, ValueError, "Compile each block instead", lambda: ResidualMLPBlocks(WIDTH, head=True)
        )
        model = ResidualMLPBlocks(WIDTH, head=True)
        model.compile(backend="aot_eager")  # compiled in place: its blocks run inside its graph
        with self.assertRaisesRegex(ValueError, "ResidualMLPBlocks is torch.compile'd as a whole"):
            offload_activations(model, platform="discrete")
        offload = ActivationOffload(platform="discrete")
        offload.attach(model)
        with self.assertRaisesRegex(ValueError, "Compile each block instead"):
            offload.register_blocks(model.blocks)


instantiate_parametrized_tests(CompiledBlocksTest)


if __name__ == "__main__":
    run_tests()
