"""Tests of planning any model and sharding it as planned, in one call: a transformers model, a
module of plain blocks that takes hidden states, blocks passed explicitly. The block is timed on the
inputs the model's forward gives it (on the CPU here: the same code a GPU runs), and
``Recommendation.apply`` applies every part of the plan, activation checkpointing included."""

import dataclasses
import importlib.util
import os
import unittest
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_fsdp_offload import CoherentOffload, offload_activations, OffloadOptimizer, plan_and_shard
from torch_fsdp_offload.models import build_hf_causal_lm, causal_lm_loss
from torch_fsdp_offload.planner import plan
from torch_fsdp_offload.planner.block_timing import capture_block_inputs, measure_block_timings
from torch_fsdp_offload.planner.memory_breakdown import model_breakdown
from torch_fsdp_offload.planner.profiles import get_profile
from torch_fsdp_offload.planner.training_profile import training_profile

from common_offload import SingleRankGlooTestCase

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
DIM = 32


class PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class PlainBlocks(nn.Module):
    """Blocks in an ``nn.ModuleList`` under a name no layout uses; it takes hidden states."""

    def __init__(self, n_blocks: int = 4) -> None:
        super().__init__()
        self.stack = nn.ModuleList(PlainBlock() for _ in range(n_blocks))
        self.spare = nn.ModuleList([PlainBlock()])  # never called: a block the forward does not run
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.stack:
            x = block(x)
        return self.head(x)


@dataclass
class Hidden:
    value: torch.Tensor


class ObjectBlock(PlainBlock):
    """A block whose output is an object, not a tensor: it cannot be timed alone."""

    def forward(self, x: torch.Tensor) -> Hidden:
        return Hidden(super().forward(x))


class ObjectBlocks(PlainBlocks):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList(ObjectBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.stack:
            x = block(x).value
        return self.head(x)


def tiny_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def record_calls(block: nn.Module) -> list[tuple[torch.Size, tuple[str, ...]]]:
    """(hidden shape, keyword names) of every call of ``block``, and of every deep copy of it."""
    calls: list[tuple[torch.Size, tuple[str, ...]]] = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        calls.append((hidden.shape, tuple(sorted(kwargs))))

    block.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


class TestMeasureAnyBlock(TestCase):
    @unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers")
    def test_captures_a_transformers_layers_keyword_inputs_and_stops(self):
        model = tiny_llama()
        later = record_calls(model.model.layers[1])
        args, kwargs = capture_block_inputs(model, model.model.layers[0], torch.zeros(3, 16, dtype=torch.long))
        self.assertEqual(args[0].shape, (3, 16, 64))
        cos, sin = kwargs["position_embeddings"]
        self.assertEqual((cos.shape[-2], sin.shape[-2]), (16, 16))
        self.assertIn("position_ids", kwargs)
        # The KV cache object the forward made is left out; the forward stopped at the block.
        self.assertNotIn("cache", kwargs)
        self.assertEqual(later, [])

    @unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers")
    def test_times_a_transformers_layer_at_scaled_micro_batches(self):
        model = tiny_llama()
        calls = record_calls(model.model.layers[0])  # deep copies carry the hook
        timings = measure_block_timings(model, [1, 2], batch_size=2, seq_len=16, device="cpu", repeats=1)
        self.assertEqual([t.batch_size for t in timings], [2, 4])
        self.assertGreater(timings[1].activation_bytes, timings[0].activation_bytes)
        # The capture at batch 2, then the timed copy at 2 and 4, each with the layer's keywords.
        self.assertEqual({shape[0] for shape, _ in calls}, {2, 4})
        self.assertTrue(all("position_embeddings" in names for _, names in calls))
        # The model itself is untouched: its own parameters keep their dtype and received no grad.
        self.assertTrue(all(p.dtype == torch.float32 and p.grad is None for p in model.parameters()))

    def test_plan_of_plain_blocks_on_hidden_states_is_measured(self):
        model = PlainBlocks()
        result = plan(model, example_input=torch.randn(2, 16, DIM), platform="h200-pcie", measure=True,
                      device="cpu", microbatch_factors=(1, 2))
        self.assertEqual(result.timing, "measured")
        self.assertEqual(result.to_dict()["timing"], "measured")
        profile = result.training.profiles[0][1]
        self.assertEqual((profile.source, profile.n_blocks, profile.tokens), ("measured block", 4, 32))
        self.assertEqual([f for f, _ in result.scenario.microbatch_scaling], [1.0, 2.0])
        self.assertIn("Times: measured, one block timed on cpu at micro-batch 2, 4", result.report().splitlines()[2])
        self.assertEqual(result.recommended.micro_batch_size, round(2 * result.recommended.microbatch_factor))

    def test_checkpointing_recompute_is_the_timed_blocks(self):
        # A timed block's recompute (its checkpointed forward and backward less its plain ones)
        # prices checkpointing, not the FLOP count of what it reruns.
        model = PlainBlocks()
        timing = measure_block_timings(model, [1], example_input=torch.randn(2, 16, DIM), device="cpu", repeats=1)[0]
        self.assertIsNotNone(timing.recompute_s)
        self.assertGreaterEqual(timing.recompute_s, 0.0)
        breakdown = model_breakdown(model, batch_size=2, seq_len=16, example_input=torch.randn(2, 16, DIM))
        platform = get_profile("h200-pcie")
        timed = dataclasses.replace(timing, forward_s=0.01, recompute_s=0.015)
        profile = training_profile(breakdown, platform, timing=timed)
        # The profile's forward is the whole model's (the blocks over their FLOP share); the rerun
        # is the blocks' alone: 1.5 times each block's forward, every block.
        share = breakdown.block_forward_share
        self.assertLess(share, 1.0)
        self.assertAlmostEqual(profile.forward_s, 0.01 * breakdown.n_blocks / share)
        self.assertAlmostEqual(profile.forward_s * profile.recompute_fraction, 0.015 * breakdown.n_blocks)
        untimed = dataclasses.replace(timed, recompute_s=None)
        self.assertAlmostEqual(training_profile(breakdown, platform, timing=untimed).recompute_fraction,
                               breakdown.block_recompute_fraction * share)
        # What a checkpointed block keeps is measured on a GPU only (on the CPU autograd saves
        # nothing under checkpointing to count): the breakdown's input size stands in here.
        self.assertIsNone(timing.checkpoint_bytes)
        self.assertEqual(profile.block_checkpoint_bytes, breakdown.block_checkpoint_bytes)
        kept = dataclasses.replace(timed, checkpoint_bytes=3 * breakdown.block_checkpoint_bytes)
        self.assertEqual(training_profile(breakdown, platform, timing=kept).block_checkpoint_bytes,
                         3 * breakdown.block_checkpoint_bytes)

    def test_estimated_without_a_device_and_where_the_block_cannot_be_timed(self):
        analytic = plan(PlainBlocks(), example_input=torch.randn(2, 16, DIM), platform="h200-pcie")
        self.assertEqual(analytic.timing, "estimated")
        self.assertEqual(analytic.training.profiles[0][1].source[:8], "analytic")
        fallback = plan(ObjectBlocks(), example_input=torch.randn(2, 16, DIM), platform="h200-pcie", measure=True,
                        device="cpu")
        self.assertEqual(fallback.timing, "estimated")
        self.assertIn("timing one block failed (TypeError: the module returned a Hidden", fallback.report())

    def test_explicit_blocks_and_the_example_sets_the_micro_batch(self):
        model = PlainBlocks()
        result = plan(model, blocks=list(model.stack[:2]), example_input=torch.randn(3, 8, DIM), platform="h200-pcie")
        self.assertEqual(result.training.profiles[0][1].n_blocks, 2)
        self.assertEqual(result.recommended.block_names, ("stack.0", "stack.1"))
        self.assertEqual(result.scenario.name, "PlainBlocks, micro-batch 3 x 8")
        with self.assertRaisesRegex(ValueError, "batch_size=4 differs from example_input's 3"):
            plan(model, example_input=torch.randn(3, 8, DIM), batch_size=4, platform="h200-pcie")
        with self.assertRaisesRegex(ValueError, "never called its blocks"):
            plan(model, blocks=list(model.spare), example_input=torch.randn(3, 8, DIM), platform="h200-pcie")
        with self.assertRaisesRegex(ValueError, "no submodule of PlainBlocks"):
            plan(model, blocks=[PlainBlock()], example_input=torch.randn(3, 8, DIM), platform="h200-pcie")

    @unittest.skipIf(not HAS_TRANSFORMERS or not torch.cuda.is_available(), "needs transformers and a GPU")
    def test_plan_of_a_transformers_model_is_measured_on_the_gpu(self):
        result = plan(tiny_llama(), batch_size=2, seq_len=64, microbatch_factors=(1, 2))
        self.assertEqual(result.timing, "measured")
        profile = result.training.profiles[0][1]
        self.assertEqual(profile.source, "measured block")
        # A checkpointed block keeps at least its output, the next block's input (bf16).
        self.assertGreaterEqual(profile.block_checkpoint_bytes, 2 * 64 * tiny_llama().config.hidden_size * 2)
        self.assertLess(profile.block_checkpoint_bytes, profile.block_activation_bytes)
        self.assertIn("with the link copying both ways", result.report())


def train_one_step(model, blocks, recommended, batch, loss_of) -> tuple[torch.Tensor, OffloadOptimizer]:
    """One step of ``model`` sharded by ``recommended.apply``, checking on the way that every part of
    the plan was applied: the policy on the blocks it names, the blocks kept unsharded after
    forward, and each block's forward rerun in backward exactly when checkpointing was recommended."""
    offloaded = [isinstance(block._get_fsdp_state()._fsdp_param_group.offload_policy, CoherentOffload)
                 for block in blocks]
    n_offloaded = 0 if recommended.kwargs is None else (recommended.last_blocks or (len(blocks),))[0]
    assert offloaded == [False] * (len(blocks) - n_offloaded) + [True] * n_offloaded, offloaded
    calls = []
    for block in blocks:
        block.register_forward_hook(lambda *_: calls.append(1))
        next(block.children()).register_forward_hook(lambda *_: calls.append(2))
    optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    output = model(batch)
    kept = [not isinstance(next(block.parameters()), DTensor) for block in blocks]
    n_kept = recommended.keep_unsharded_last
    assert kept == [False] * (len(blocks) - n_kept) + [True] * n_kept, kept
    loss = loss_of(output)
    loss.backward()
    # The block's own forward runs once; its first child's once more per block in backward when checkpointed.
    assert calls.count(1) == len(blocks) and calls.count(2) == len(blocks) * (2 if recommended.checkpointing else 1)
    optim.step()
    optim.synchronize()
    return loss, optim


@instantiate_parametrized_tests
class TestApplyEverything(SingleRankGlooTestCase):
    def mesh(self):
        return init_device_mesh("cpu", (1,))

    @parametrize("checkpointing", [True, False])
    def test_apply_places_offload_keeps_checkpoints_and_offloads_activations(self, checkpointing):
        torch.manual_seed(0)
        model = PlainBlocks()
        planned = plan(model, example_input=torch.randn(2, 16, DIM), platform="h200-pcie").recommended
        recommended = dataclasses.replace(
            planned, kwargs={"optimizer": "host", "platform": "discrete"}, last_blocks=(2, 4), keep_unsharded_last=1,
            checkpointing=checkpointing, activations_offload_fraction=0.5,
        )
        with mock.patch("torch_fsdp_offload.activations.offload_activations", wraps=offload_activations) as attach:
            recommended.apply(model, mesh=self.mesh())
        self.assertIsInstance(model, FSDPModule)
        self.assertEqual(attach.call_args.kwargs["fraction"], 0.5)
        self.assertEqual(list(attach.call_args.kwargs["blocks"]), list(model.stack))
        offloaded = [isinstance(block._get_fsdp_state()._fsdp_param_group.offload_policy, CoherentOffload)
                     for block in model.stack]
        self.assertEqual(offloaded, [False, False, True, True])
        up_calls = []
        for block in model.stack:
            block.up.register_forward_hook(lambda *_: up_calls.append(1))
        output = model(torch.randn(2, 16, DIM))
        # The last block kept its unsharded parameters after forward; the others resharded.
        self.assertFalse(isinstance(model.stack[3].up.weight, DTensor))
        self.assertTrue(isinstance(model.stack[2].up.weight, DTensor))
        self.assertEqual(len(up_calls), 4)
        output.square().mean().backward()
        # A checkpointed block reruns its forward in backward.
        self.assertEqual(len(up_calls), 8 if checkpointing else 4)
        # The plain-blocks model's own train_one_step checks agree.
        train_one_step(model, list(model.stack), recommended, torch.randn(2, 16, DIM), lambda out: out.square().mean())

    @unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers")
    def test_one_call_shards_a_transformers_model_that_trains(self):
        model = tiny_llama()
        reference = {name: p.detach().clone() for name, p in model.named_parameters()}
        with mock.patch.dict(os.environ, {"TORCH_FSDP_OFFLOAD_PLATFORM": "discrete"}):
            result = plan_and_shard(
                model, batch_size=2, seq_len=16, platform="h200-pcie", gpu_memory_GiB=0.001, measure=True,
                device="cpu", microbatch_factors=(1, 2), fully_shard_kwargs={"mesh": self.mesh()},
            )
            recommended = result.recommended
            self.assertEqual(result.timing, "measured")
            self.assertIsInstance(model, FSDPModule)
            self.assertTrue(all(isinstance(layer, FSDPModule) for layer in model.model.layers))
            # Below the resident peak: the plan offloads or checkpoints, and what it says is applied.
            self.assertTrue(recommended.kwargs is not None or recommended.checkpointing)
            batch = torch.randint(0, 128, (recommended.micro_batch_size, 16))
            loss, optim = train_one_step(model, list(model.model.layers), recommended, batch,
                                         lambda output: causal_lm_loss(output.logits, batch))
        self.assertTrue(torch.isfinite(loss))
        self.assertTrue(any(not torch.equal(p.full_tensor(), reference[name]) for name, p in model.named_parameters()))
        if recommended.kwargs is not None:
            self.assertGreater(optim.stepped_numel["host"] + optim.stepped_numel["streamed"], 0)

    def test_one_call_shards_plain_blocks_on_hidden_states_that_train(self):
        torch.manual_seed(0)
        model = PlainBlocks()
        with mock.patch.dict(os.environ, {"TORCH_FSDP_OFFLOAD_PLATFORM": "discrete"}):
            result = plan_and_shard(
                model, example_input=torch.randn(2, 16, DIM), platform="h200-pcie", gpu_memory_GiB=3e-4,
                measure=True, device="cpu", microbatch_factors=(1, 2), fully_shard_kwargs={"mesh": self.mesh()},
            )
            self.assertTrue(result.recommended.kwargs is not None or result.recommended.checkpointing)
            loss, _ = train_one_step(model, list(model.stack), result.recommended,
                                     torch.randn(result.recommended.micro_batch_size, 16, DIM),
                                     lambda output: output.square().mean())
        self.assertTrue(torch.isfinite(loss))


@instantiate_parametrized_tests
class TestReducedBytesCounted(SingleRankGlooTestCase):
    """The plan counts the bytes FSDP2 of this torch reduces gradients in, and those a reduced
    gradient keeps: ``MixedPrecisionPolicy(reduce_dtype=None)`` reduces bf16 compute in bf16
    through torch 2.14 and in the fp32 master's dtype from 2.15."""

    @parametrize("reduce_dtype", [None, torch.float32, torch.bfloat16])
    def test_plan_and_shard_counts_the_reduce_dtype_fsdp_runs(self, reduce_dtype):
        torch.manual_seed(0)
        model = PlainBlocks()
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        result = plan_and_shard(
            model, example_input=torch.randn(2, 16, DIM), platform="h200-pcie", measure=False,
            fully_shard_kwargs={"mesh": init_device_mesh("cpu", (1,)), "mp_policy": mp_policy},
        )
        self.assertIsNone(result.recommended.kwargs)  # plain FSDP2: what it reduces in is torch's own
        reduced = []
        # The root's group (the head): the hook sees the reduce-scatter's output, in the reduce dtype.
        model.set_all_reduce_hook(lambda output: reduced.append(output.dtype))
        model(torch.randn(2, 16, DIM)).float().square().mean().backward()
        profile = result.training.profiles[0][1]
        self.assertEqual(len(reduced), 1)
        self.assertEqual(profile.reduce_bytes, reduced[0].itemsize)
        self.assertEqual(profile.grad_bytes, model.head.weight.grad.to_local().element_size())


if __name__ == "__main__":
    run_tests()
