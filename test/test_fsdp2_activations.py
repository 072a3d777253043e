"""FSDP2 + ``CoherentOffload(activations=...)``: activation offload attached by ``fully_shard``.

On CPU the platform is forced to ``discrete``, so every saved activation of an offloaded block is
copied to host memory and back through the transfer engine (counted), and gradients are compared bit
for bit with the same model sharded without activation offload, under gloo at world size 2.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from common_offload import GlooMultiProcessTestCase
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.activations import _policy_attachment, ActivationOffload, get_activation_offload, offload_activations
from torch_fsdp_offload.models import build_model, causal_lm_loss, TransformerConfig
from torch_fsdp_offload.platform import PlatformKind
from torch_fsdp_offload.transfer import get_transfer_engine

_CONFIG = TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_hidden=64, max_seq_len=32)
_STEPS = 2


def _offload_small_tensors() -> contextlib.AbstractContextManager:
    """Offload every saved activation: the tiny model's are far below the default 1 MiB threshold."""
    return mock.patch.object(
        _policy_attachment, "ActivationOffload", functools.partial(ActivationOffload, min_offload_bytes=0)
    )


def _batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, _CONFIG.vocab_size, (2, 16), generator=generator)


def _shard(model: nn.Module, policy: CoherentOffload, mesh, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=policy)
    return model


class FSDP2ActivationOffloadTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def _train(self, policy: CoherentOffload) -> tuple[nn.Module, list[list[torch.Tensor]], tuple[int, int]]:
        """Shard a fresh model with ``policy`` (bf16 compute), run ``_STEPS`` steps; return it, each
        step's full gradients, and the engine's (d2h_bytes, h2d_bytes) over the steps."""
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (self.world_size,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with _offload_small_tensors():
            model = _shard(build_model(_CONFIG), policy, mesh, mp_policy)
        optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        engine = get_transfer_engine("cpu")
        engine.stats.reset()
        grads = []
        for step in range(_STEPS):
            tokens = _batch(step, self.rank)
            causal_lm_loss(model(tokens), tokens).backward()
            grads.append([param.grad.full_tensor() for param in model.parameters()])
            optim.step()
            optim.zero_grad()
        optim.synchronize()  # the last step's host and streamed steps copy too
        return model, grads, (engine.stats.d2h_bytes, engine.stats.h2d_bytes)

    def assert_bitwise_equal(self, grads: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
        for step, (step_grads, step_expected) in enumerate(zip(grads, expected)):
            for index, (grad, reference) in enumerate(zip(step_grads, step_expected)):
                self.assertTrue(torch.equal(grad, reference), f"step {step}, gradient {index} differs")

    def test_gradients_bitwise_equal_all_blocks_and_a_fraction(self) -> None:
        self.init_gloo()
        _, expected, (reference_d2h, reference_h2d) = self._train(CoherentOffload(platform="discrete"))
        copies_per_fraction = {}
        for activations in (True, 0.5):
            model, grads, (d2h, h2d) = self._train(CoherentOffload(platform="discrete", activations=activations))
            self.assert_bitwise_equal(grads, expected)
            offload = get_activation_offload(model)
            # One offloader per model, shared by the blocks and the root.
            self.assertTrue(all(get_activation_offload(block) is offload for block in model.blocks))
            stats = offload.stats
            self.assertGreater(stats.d2h_bytes, 0)
            self.assertEqual(stats.h2d_bytes, stats.d2h_bytes)
            self.assertEqual(stats.prefetched_copies, stats.h2d_copies)
            self.assertEqual(stats.on_demand_copies, 0)
            # Activation copies went through the engine that moves the parameters and gradients.
            self.assertEqual((d2h - reference_d2h, h2d - reference_h2d), (stats.d2h_bytes, stats.h2d_bytes))
            copies_per_fraction[activations] = stats.d2h_copies
        # Every block saves the same tensors: 0.5 offloads the first 2 of the 4 blocks.
        self.assertEqual(2 * copies_per_fraction[0.5], copies_per_fraction[True])

    def test_unified_platform_copies_nothing(self) -> None:
        self.init_gloo()
        _, expected, _ = self._train(CoherentOffload(platform="unified"))
        model, grads, (d2h, h2d) = self._train(CoherentOffload(platform="unified", activations=True))
        self.assert_bitwise_equal(grads, expected)
        offload = get_activation_offload(model)
        self.assertFalse(offload.active)
        self.assertEqual(offload.stats, type(offload.stats)())
        self.assertEqual((d2h, h2d), (0, 0))

    def test_one_offloader_per_model_with_parameters_offloaded(self) -> None:
        self.init_gloo()
        mesh = init_device_mesh("cpu", (self.world_size,))
        # Activations and parameters offloaded by one policy object shared by two models.
        policy = CoherentOffload(platform="discrete", activations=True)
        torch.manual_seed(0)
        first = build_model(_CONFIG)
        second = copy.deepcopy(first)
        reference = copy.deepcopy(first)
        with _offload_small_tensors():
            for model in (first, second):
                _shard(model, policy, mesh, MixedPrecisionPolicy())
        fully_shard(reference, mesh=mesh)
        self.assertIsNot(get_activation_offload(first), get_activation_offload(second))
        self.assertIsNone(get_activation_offload(reference))
        with self.assertRaisesRegex(TypeError, "expects the nn.Module fully_shard was called on, got str"):
            get_activation_offload("model")
        tokens = _batch(0, self.rank)
        for model in (reference, first, second):
            causal_lm_loss(model(tokens), tokens).backward()
        for model in (first, second):
            self.assertGreater(get_activation_offload(model).stats.d2h_copies, 0)
            for param, expected in zip(model.parameters(), reference.parameters()):
                self.assertTrue(torch.equal(param.grad.full_tensor(), expected.grad.full_tensor()))


class FSDP2ActivationOffloadTwiceTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def test_policy_and_offload_activations_on_one_model_are_refused(self) -> None:
        # Either order would offload the model's activations twice.
        self.init_gloo()
        mesh = init_device_mesh("cpu", (self.world_size,))
        policy = CoherentOffload(platform="discrete", activations=True)
        torch.manual_seed(0)
        sharded = _shard(build_model(_CONFIG), policy, mesh, MixedPrecisionPolicy())
        hooks = [len(module._forward_pre_hooks) for module in sharded.modules()]
        with self.assertRaisesRegex(
            ValueError,
            r"^offload_activations: FSDPTransformer already has its activations offloaded by fully_shard\(\.\.\., "
            r"offload_policy=CoherentOffload\(activations=\.\.\.\)\); a second offloader on it would copy them "
            r"twice\. Keep one: drop this call .*or shard with activations=False and use offload_activations alone\.$",
        ):
            offload_activations(sharded, platform="discrete", device="cpu")
        self.assertEqual([len(module._forward_pre_hooks) for module in sharded.modules()], hooks)
        self.assertIs(get_activation_offload(sharded.blocks[0]), get_activation_offload(sharded))

        # offload_activations first: the policy refuses the block before any parameter is converted.
        model = build_model(_CONFIG)
        offload = offload_activations(model, platform="discrete", device="cpu")
        with self.assertRaisesRegex(
            ValueError,
            r"^fully_shard\(\.\.\., offload_policy=CoherentOffload\(activations=\.\.\.\)\): TransformerBlock already "
            r"has its activations offloaded by offload_activations\(\.\.\.\);.* call \.remove\(\) on the object "
            r"offload_activations returned first",
        ):
            fully_shard(model.blocks[0], mesh=mesh, offload_policy=policy)
        self.assertTrue(all(type(param) is nn.Parameter for param in model.parameters()))
        self.assertIsNone(get_activation_offload(model.blocks[0]))
        self.assertEqual(offload.stats, type(offload.stats)())


class CoherentOffloadActivationsKnobTest(TestCase):
    @parametrize("value", [1.5, -0.1, float("nan"), "yes", None])
    def test_bad_value_is_rejected_with_the_fix(self, value: object) -> None:
        with self.assertRaisesRegex(ValueError, r"must be True, False or a number in \[0, 1\]"):
            CoherentOffload(activations=value)

    @parametrize(
        "platform, activations, expected",
        [
            ("discrete", True, 1.0),
            ("coherent", 0.25, 0.25),
            ("discrete", False, 0.0),
            ("unified", True, 0.0),
            ("host_only", 0.5, 0.0),
        ],
    )
    def test_resolved_fraction(self, platform: str, activations: object, expected: float) -> None:
        plan = CoherentOffload(platform=platform, activations=activations).resolve()
        self.assertEqual(plan.activations, expected)
        self.assertIn(f"activations offloaded={expected:.2f}", plan.describe())
        if activations and PlatformKind(platform) in (PlatformKind.UNIFIED, PlatformKind.HOST_ONLY):
            self.assertIn("activations stay", plan.reason)
        self.assertFalse(math.isnan(plan.activations))


instantiate_parametrized_tests(CoherentOffloadActivationsKnobTest)

if __name__ == "__main__":
    run_tests()
