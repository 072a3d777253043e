"""Tests of torch_fsdp_offload.activations: saved-tensor offload with a pinned pool and block prefetch.

CPU tests force the DISCRETE platform, so every copy, the pool, deduplication and the prefetch order
run for real (synchronously, through the transfer engine); GPU tests add the streams.
"""

from __future__ import annotations

import contextlib
import gc
import unittest
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)
from torch.utils.checkpoint import checkpoint

from torch_fsdp_offload.activations import ActivationOffload, offload_activations
from torch_fsdp_offload.memory import memory_stats
from torch_fsdp_offload.models import build_model, causal_lm_loss, TransformerConfig
from torch_fsdp_offload.transfer import get_transfer_engine

_CONFIG = TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_hidden=64, max_seq_len=32)
_N_BLOCKS = _CONFIG.n_layers


def _step(model: nn.Module, tokens: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    causal_lm_loss(model(tokens), tokens).backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [param.grad.clone() for param in model.parameters()]


class _Checkpointed(nn.Module):
    """A block run under torch.utils.checkpoint: only its input is saved in forward."""

    def __init__(self, block: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.use_reentrant = use_reentrant

    def forward(self, *args: object) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=self.use_reentrant)


def _sin_cos(x: torch.Tensor) -> torch.Tensor:
    # sin saves x; cos saves h; the product saves the view v of h twice: 2 storages, 4 saves.
    h = x.sin()
    v = h[:, 1:]
    return h.cos().sum() + (v * v).sum()


class TestActivationOffload(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.tokens = torch.randint(0, _CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        reference = build_model(_CONFIG)
        _step(reference, cls.tokens)
        cls.expected = _grads(reference)
        model = build_model(_CONFIG)
        all_blocks = offload_activations(model, min_offload_bytes=0, platform="discrete", device="cpu")
        _step(model, cls.tokens)
        cls.all_blocks_copies = (all_blocks.stats.d2h_copies, all_blocks.stats.d2h_bytes)

    def assert_grads_bitwise_equal(self, model: nn.Module) -> None:
        for (name, param), expected in zip(model.named_parameters(), self.expected):
            self.assertTrue(torch.equal(param.grad, expected), f"gradient of {name} differs")

    def offloaded_model(self, **knobs: object) -> tuple[nn.Module, ActivationOffload]:
        model = build_model(_CONFIG)
        knobs = {"min_offload_bytes": 0, "platform": "discrete", "device": "cpu", **knobs}
        return model, offload_activations(model, **knobs)

    @parametrize("keep_last_blocks", [0, 1])
    def test_forward_without_backward_frees_its_graph(self, keep_last_blocks: int) -> None:
        # A forward whose loss is dropped (an evaluation with grad on, a skipped step) must free
        # everything it saved: a saved output kept as is would hold its own grad_fn, a cycle
        # through C++ that not even gc.collect() breaks.
        model, offload = self.offloaded_model(keep_last_blocks=keep_last_blocks)
        outputs: list[weakref.ref] = []

        def remember(module: nn.Module, args: object, output: object) -> None:
            if isinstance(output, torch.Tensor):
                outputs.append(weakref.ref(output))

        handles = [module.register_forward_hook(remember) for module in model.modules()]
        loss = causal_lm_loss(model(self.tokens), self.tokens)
        self.assertGreater(offload.stats.kept_tensors, 0)
        self.assertGreater(offload.stats.d2h_copies, 0)
        del loss
        gc.collect()
        for handle in handles:
            handle.remove()
        self.assertGreater(len(outputs), 10)
        self.assertEqual(sum(ref() is not None for ref in outputs), 0)

    @parametrize(
        "prefetch_blocks, keep_last_blocks, fraction",
        [(1, 0, 1.0), (2, 0, 1.0), (3, 1, 1.0), (1, 0.5, 1.0), (1, 0, 0.5), (2, 1, 0.5)],
    )
    def test_gradients_bitwise_equal(self, prefetch_blocks: int, keep_last_blocks: float, fraction: float) -> None:
        model, offload = self.offloaded_model(
            prefetch_blocks=prefetch_blocks, keep_last_blocks=keep_last_blocks, fraction=fraction
        )
        for _ in range(2):
            offload.stats.reset()
            _step(model, self.tokens)
            self.assert_grads_bitwise_equal(model)
            stats = offload.stats
            self.assertGreater(stats.d2h_copies, 0)
            self.assertEqual(stats.h2d_bytes, stats.d2h_bytes)
            self.assertEqual(stats.on_demand_copies, 0)
            self.assertEqual(stats.prefetched_copies, stats.h2d_copies)

    @parametrize(
        "fraction, keep_last_blocks, offloaded_blocks",
        [(1.0, 0, 4), (0.5, 0, 2), (0.3, 0, 1), (1.0, 1, 3), (1.0, 0.5, 2), (0.75, 2, 2), (0.0, 0, 0), (1.0, 1.0, 0)],
    )
    def test_which_blocks_are_offloaded(self, fraction: float, keep_last_blocks: float, offloaded_blocks: int) -> None:
        model, offload = self.offloaded_model(fraction=fraction, keep_last_blocks=keep_last_blocks)
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        # Every block saves the same tensors, so copies count blocks.
        copies, nbytes = self.all_blocks_copies
        self.assertEqual(offload.stats.d2h_copies * _N_BLOCKS, copies * offloaded_blocks)
        self.assertEqual(offload.stats.d2h_bytes * _N_BLOCKS, nbytes * offloaded_blocks)

    @parametrize("prefetch_blocks", [1, 2])
    def test_prefetch_runs_ahead_of_backward(self, prefetch_blocks: int) -> None:
        model, offload = self.offloaded_model(prefetch_blocks=prefetch_blocks)
        issued_at_block_start: dict[int, int] = {}

        def record_when_grad_reaches(index: int):
            def output_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
                # The output's gradient is ready just before the block's own backward starts.
                output.register_hook(lambda grad: issued_at_block_start.__setitem__(index, offload.stats.h2d_copies))

            return output_hook

        for index, block in enumerate(model.blocks):
            block.register_forward_hook(record_when_grad_reaches(index))
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        per_block = offload.stats.d2h_copies // _N_BLOCKS
        for index in range(_N_BLOCKS):
            # Reaching block i + 1 issued blocks i + 1 - k and up (the loss reached block n - 1).
            lowest = max((index + 1 if index < _N_BLOCKS - 1 else index) - prefetch_blocks, 0)
            self.assertEqual(issued_at_block_start[index], per_block * (_N_BLOCKS - lowest), f"block {index}")
        self.assertEqual(offload.stats.on_demand_copies, 0)

    def test_view_and_base_offload_once(self) -> None:
        x = torch.randn(8, 16, requires_grad=True)
        _sin_cos(x).backward()
        expected = x.grad.clone()
        x.grad = None
        offload = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        with offload:
            loss = _sin_cos(x)
        loss.backward()
        self.assertTrue(torch.equal(x.grad, expected))
        self.assertEqual(offload.stats.d2h_copies, 2)
        self.assertEqual(offload.stats.deduplicated_views, 2)
        self.assertEqual(offload.stats.d2h_bytes, 2 * x.numel() * x.element_size())
        self.assertEqual(offload.stats.h2d_copies, 2)

    def test_pinned_pool_reused_across_steps(self) -> None:
        model, offload = self.offloaded_model()
        _step(model, self.tokens)
        pool_bytes = offload.pinned_bytes
        reserved = memory_stats()["reserved_bytes"]
        self.assertGreater(pool_bytes, 0)
        for _ in range(3):
            _step(model, self.tokens)
            self.assert_grads_bitwise_equal(model)
        self.assertEqual(offload.pinned_bytes, pool_bytes)
        self.assertEqual(memory_stats()["reserved_bytes"], reserved)

    @parametrize("use_reentrant", [False, True])
    def test_checkpoint_inputs_only(self, use_reentrant: bool) -> None:
        model = build_model(_CONFIG)
        for index in range(_N_BLOCKS):
            model.blocks[index] = _Checkpointed(model.blocks[index], use_reentrant)
        offload = offload_activations(model, min_offload_bytes=0, platform="discrete", device="cpu")
        model.zero_grad()
        loss = causal_lm_loss(model(self.tokens), self.tokens)
        # One saved input per block; the recomputation in backward saves more, none of it offloaded.
        self.assertEqual(offload.stats.d2h_copies, _N_BLOCKS)
        loss.backward()
        self.assertEqual(offload.stats.d2h_copies, _N_BLOCKS)
        self.assertEqual(offload.stats.h2d_copies, _N_BLOCKS)
        self.assert_grads_bitwise_equal(model)

    def test_checkpoint_inputs_with_head_units(self) -> None:
        # The final norm's and the head's inputs are saved outside any block; given as units after
        # the blocks, they are offloaded too: then all that checkpointing keeps leaves the device.
        model = build_model(_CONFIG)
        for index in range(_N_BLOCKS):
            model.blocks[index] = _Checkpointed(model.blocks[index], use_reentrant=False)
        offload = offload_activations(
            model, blocks=[*model.blocks, model.norm, model.output], min_offload_bytes=0, platform="discrete", device="cpu"
        )
        model.zero_grad()
        loss = causal_lm_loss(model(self.tokens), self.tokens)
        # Each block's input, and what the norm and the head save: all but the token ids the
        # embedding saves before the first block.
        self.assertGreaterEqual(offload.stats.d2h_copies, _N_BLOCKS + 2)
        self.assertEqual(offload.stats.saved_bytes - offload.stats.d2h_bytes, self.tokens.nbytes)
        loss.backward()
        self.assertEqual(offload.stats.h2d_copies, offload.stats.d2h_copies)
        self.assert_grads_bitwise_equal(model)

    def test_reentrant_checkpoint_backward_inside_context(self) -> None:
        model = build_model(_CONFIG)
        offload = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        offload.register_blocks(model.blocks)
        rope = (model.rope_cos, model.rope_sin)
        with offload:
            h = model.tok_embeddings(self.tokens)
            for block in model.blocks:
                h = checkpoint(block, h, rope, use_reentrant=True)
            loss = causal_lm_loss(model.output(model.norm(h)), self.tokens)
            copies_after_forward = offload.stats.d2h_copies
            # Backward inside the context: the recomputation's saves reach these hooks.
            loss.backward()
        self.assertEqual(offload.stats.d2h_copies, copies_after_forward)
        self.assert_grads_bitwise_equal(model)

    def test_nested_contexts(self) -> None:
        x = torch.randn(8, 16, requires_grad=True)

        def run(outer: ActivationOffload | None, inner: ActivationOffload | None) -> torch.Tensor:
            with outer or contextlib.nullcontext():
                h = x.sin()  # saves x
                with inner or contextlib.nullcontext():
                    g = h.cos()  # saves h
                    with outer or contextlib.nullcontext():
                        e = g.exp()  # saves its result
                return (e * 2).sum()

        run(None, None).backward()
        expected = x.grad.clone()
        x.grad = None
        outer = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        inner = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        run(outer, inner).backward()
        self.assertTrue(torch.equal(x.grad, expected))
        self.assertEqual((outer.stats.d2h_copies, inner.stats.d2h_copies), (2, 1))
        self.assertEqual((outer.stats.h2d_copies, inner.stats.h2d_copies), (2, 1))

    def test_retain_graph_backward_twice(self) -> None:
        model, offload = self.offloaded_model()
        loss = causal_lm_loss(model(self.tokens), self.tokens)
        loss.backward(retain_graph=True)
        self.assert_grads_bitwise_equal(model)
        first = _grads(model)
        model.zero_grad()
        loss.backward()
        for grad, expected in zip(_grads(model), first):
            self.assertTrue(torch.equal(grad, expected))
        self.assertEqual(offload.stats.h2d_bytes, 2 * offload.stats.d2h_bytes)
        self.assertEqual(offload.stats.on_demand_copies, 0)

    def test_mark_block(self) -> None:
        model = build_model(_CONFIG)
        offload = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        rope = (model.rope_cos, model.rope_sin)
        for _ in range(2):
            model.zero_grad()
            with offload:
                h = model.tok_embeddings(self.tokens)
                for block in model.blocks:
                    offload.mark_block()
                    h = block(h, rope)
                loss = causal_lm_loss(model.output(model.norm(h)), self.tokens)
            loss.backward()
            self.assert_grads_bitwise_equal(model)
        self.assertGreater(offload.stats.h2d_copies, 0)
        self.assertEqual(offload.stats.on_demand_copies, 0)
        with self.assertRaisesRegex(RuntimeError, "inside `with offload:`"):
            offload.mark_block()

    def test_parameters_and_buffers_stay_on_device(self) -> None:
        class Scaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(16, 16, bias=False)
                self.register_buffer("scale", torch.randn(16))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return (self.linear(x) * self.scale).sum()

        model = Scaled()
        x = torch.randn(8, 16)
        # The product saves the buffer outside the block, then inside it when the block is the model.
        for blocks in ([model.linear], [model]):
            offload = offload_activations(model, blocks=blocks, min_offload_bytes=0, platform="discrete", device="cpu")
            model(x).backward()
            # Only the linear's input moves: the saved weight.t() views a parameter.
            self.assertEqual(offload.stats.d2h_copies, 1)
            self.assertEqual(offload.stats.d2h_bytes, x.numel() * x.element_size())
            offload.remove()

    def test_small_tensors_stay_on_device(self) -> None:
        model, offload = self.offloaded_model(min_offload_bytes=1 << 20)
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        self.assertEqual(offload.stats.d2h_copies, 0)
        self.assertGreater(offload.stats.kept_tensors, 0)

    @parametrize("platform", ["unified", "host_only"])
    def test_no_copies_where_memory_is_shared(self, platform: str) -> None:
        model = build_model(_CONFIG)
        offload = offload_activations(model, min_offload_bytes=0, platform=platform)
        engine = get_transfer_engine(offload.device)
        before = (engine.stats.d2h_bytes, engine.stats.h2d_bytes)
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        self.assertFalse(offload.active)
        self.assertEqual(offload.stats, type(offload.stats)())
        self.assertEqual((engine.stats.d2h_bytes, engine.stats.h2d_bytes), before)

    @unittest.skipIf(torch.cuda.is_available(), "the default platform has an accelerator here")
    def test_default_platform_without_accelerator_is_noop(self) -> None:
        model = build_model(_CONFIG)
        offload = offload_activations(model, min_offload_bytes=0)
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        self.assertFalse(offload.active)
        self.assertEqual(offload.stats.d2h_copies, 0)

    def test_no_grad_forward_and_remove(self) -> None:
        model, offload = self.offloaded_model()
        with torch.no_grad():
            model(self.tokens)
        self.assertEqual(offload.stats.d2h_copies, 0)
        offload.remove()
        _step(model, self.tokens)
        self.assertEqual(offload.stats.d2h_copies, 0)
        self.assert_grads_bitwise_equal(model)

    @parametrize(
        "knobs, message",
        [
            ({"min_offload_bytes": -1}, "min_offload_bytes must be an int >= 0"),
            ({"min_offload_bytes": 1.5}, "min_offload_bytes must be an int >= 0"),
            ({"prefetch_blocks": 0}, "prefetch_blocks must be an int >= 1"),
            ({"fraction": 1.5}, r"fraction must be a number in \[0, 1\]"),
            ({"fraction": -0.1}, r"fraction must be a number in \[0, 1\]"),
            ({"keep_last_blocks": -1}, "keep_last_blocks must be a block count"),
            ({"keep_last_blocks": 1.5}, "keep_last_blocks must be a block count"),
            ({"max_inflight_bytes": -1}, "max_inflight_bytes must be an int >= 0"),
            ({"max_inflight_bytes": 2.0**30}, "max_inflight_bytes must be an int >= 0"),
            ({"platform": "quantum"}, "quantum"),
        ],
    )
    def test_bad_knobs_raise_before_allocating(self, knobs: dict, message: str) -> None:
        model = build_model(_CONFIG)
        before = memory_stats()
        with self.assertRaisesRegex(ValueError, message):
            offload_activations(model, platform=knobs.pop("platform", "discrete"), device="cpu", **knobs)
        self.assertEqual(memory_stats(), before)
        self.assertEqual(len(model._forward_pre_hooks), 0)
        self.assertTrue(all(len(block._forward_pre_hooks) == 0 for block in model.blocks))

    def test_offloader_does_not_keep_the_model_alive(self) -> None:
        model, offload = self.offloaded_model()
        _step(model, self.tokens)
        model_ref = weakref.ref(model)
        del model
        gc.collect()
        self.assertIsNone(model_ref())
        self.assertGreater(offload.stats.d2h_copies, 0)

    def test_block_outside_a_forward_warns_once(self) -> None:
        model = build_model(_CONFIG)
        offload = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        offload.register_blocks(model.blocks)
        with self.assertWarnsRegex(UserWarning, "outside an offloaded forward"):
            _step(model, self.tokens)
        self.assertEqual(offload.stats.d2h_copies, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _step(model, self.tokens)
            with torch.no_grad():
                model(self.tokens)

    def test_second_offloader_on_one_model_is_refused(self) -> None:
        # A second offloader on a model or a block would offload what it saves twice: refused
        # before anything is hooked, the first keeps working alone, and after its remove() the
        # model takes a new one.
        model, first = self.offloaded_model()
        hooks = [len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules()]
        with self.assertRaisesRegex(
            ValueError,
            r"^offload_activations: Transformer already has its activations offloaded by offload_activations\(\.\.\.\);"
            r" a second offloader on it would copy them twice\. Keep one: call \.remove\(\) on the object "
            r"offload_activations returned first, or keep it and drop this call\.$",
        ):
            offload_activations(model, min_offload_bytes=0, platform="discrete", device="cpu")
        with self.assertRaisesRegex(ValueError, r"^offload_activations: TransformerBlock already has .*\.remove\(\)"):
            offload_activations(nn.Sequential(*model.blocks[:2]), blocks=model.blocks[:2], platform="discrete", device="cpu")
        by_class = ActivationOffload(min_offload_bytes=0, platform="discrete", device="cpu")
        with self.assertRaisesRegex(ValueError, r"^ActivationOffload\.register_blocks: TransformerBlock already has"):
            by_class.register_blocks(model.blocks)
        with self.assertRaisesRegex(ValueError, r"^ActivationOffload\.attach: Transformer already has"):
            by_class.attach(model)
        self.assertEqual([len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules()], hooks)
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        self.assertEqual((first.stats.d2h_copies, first.stats.d2h_bytes), self.all_blocks_copies)
        self.assertEqual(by_class.stats, type(by_class.stats)())
        # An ActivationOffload that has the model names itself in the refusal of the next one.
        first.remove()
        by_class.attach(model)
        by_class.register_blocks(model.blocks)
        with self.assertRaisesRegex(ValueError, r"offloaded by ActivationOffload\.attach/register_blocks; .*call \.remove\(\) on that ActivationOffload"):
            offload_activations(model, platform="discrete", device="cpu")
        by_class.remove()
        second = offload_activations(model, min_offload_bytes=0, platform="discrete", device="cpu")
        _step(model, self.tokens)
        self.assert_grads_bitwise_equal(model)
        self.assertEqual((second.stats.d2h_copies, second.stats.d2h_bytes), self.all_blocks_copies)

    def test_bad_arguments(self) -> None:
        with self.assertRaisesRegex(ValueError, "pass blocks="):
            offload_activations(nn.Linear(2, 2), platform="discrete", device="cpu")
        with self.assertRaisesRegex(TypeError, "nn.Module"):
            offload_activations(nn.Linear(2, 2), blocks=[1], platform="discrete", device="cpu")
        with self.assertRaisesRegex(TypeError, "platform must be"):
            ActivationOffload(platform=3)
        with self.assertRaisesRegex(TypeError, r"^ActivationOffload\.attach expects nn\.Module instances, got int"):
            ActivationOffload(platform="discrete", device="cpu").attach(3)


class _ElementwiseChain(nn.Module):
    """Blocks of large elementwise ops: copies take far longer than compute, exposing stream races."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.tensor(0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) * x * self.weight + x

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.Block() for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
class TestActivationOffloadGPU(TestCase):
    def setUp(self) -> None:
        super().setUp()
        torch.manual_seed(0)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def _chain_grads(self, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward()
        return [param.grad.clone() for param in model.parameters()] + [x.grad.clone()]

    @parametrize("prefetch_blocks", [1, 2])
    def test_transformer_gradients_bitwise_equal(self, prefetch_blocks: int) -> None:
        config = TransformerConfig(vocab_size=512, dim=256, n_layers=6, n_heads=4, ffn_hidden=704, max_seq_len=256)
        tokens = torch.randint(0, config.vocab_size, (4, 256), device=self.device)
        # The math attention kernels are deterministic; the reference is run twice to confirm that
        # the rest is too on this machine, so that offloaded gradients must match bit for bit.
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            reference = build_model(config, device=self.device)
            _step(reference, tokens)
            expected = _grads(reference)
            _step(reference, tokens)
            reproducible = all(torch.equal(grad, first) for grad, first in zip(_grads(reference), expected))
            model = build_model(config, device=self.device)
            offload = offload_activations(model, min_offload_bytes=0, prefetch_blocks=prefetch_blocks, platform="discrete")
            engine_before = get_transfer_engine(self.device).stats.d2h_bytes
            for _ in range(3):
                _step(model, tokens)
                for grad, reference_grad in zip(_grads(model), expected):
                    if reproducible:
                        self.assertTrue(torch.equal(grad, reference_grad))
                    else:
                        self.assertEqual(grad, reference_grad)
        torch.cuda.synchronize()
        self.assertGreater(offload.stats.d2h_bytes, 0)
        self.assertEqual(get_transfer_engine(self.device).stats.d2h_bytes - engine_before, offload.stats.d2h_bytes)
        self.assertEqual(offload.stats.on_demand_copies, 0)
        self.assertGreater(memory_stats()["pinned_bytes"], 0)

    @parametrize("wait_before_backward", [False, True])
    def test_slow_copies_stress(self, wait_before_backward: bool) -> None:
        # 8 blocks x 2 saved storages x 128 MiB: ~2 GiB each way per step, microseconds of compute.
        model = _ElementwiseChain(8).to(self.device)
        x = torch.randn(32 << 20, device=self.device, requires_grad=True)
        expected = self._chain_grads(model, x)
        offload = offload_activations(model, min_offload_bytes=0, platform="discrete")
        pool_bytes = None
        for step in range(3):
            model.zero_grad(set_to_none=True)
            x.grad = None
            loss = model(x)
            if wait_before_backward:
                # Every D2H copy lands and every device copy is released: backward reloads it all
                # while the compute stream races ahead on tiny kernels.
                torch.cuda.synchronize()
                offload._poll()
            loss.backward()
            grads = [param.grad for param in model.parameters()] + [x.grad]
            for grad, reference in zip(grads, expected):
                self.assertTrue(torch.equal(grad, reference), f"step {step}")
            if pool_bytes is None:
                pool_bytes = offload.pinned_bytes
        self.assertEqual(offload.pinned_bytes, pool_bytes)
        if wait_before_backward:
            self.assertEqual(offload.stats.h2d_bytes, offload.stats.d2h_bytes)
            self.assertEqual(offload.stats.reused_device_copies, 0)

    def test_device_memory_released_once_copies_land(self) -> None:
        model = _ElementwiseChain(4).to(self.device)
        x = torch.randn(16 << 20, device=self.device, requires_grad=True)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(self.device)
        loss = model(x)
        resident = torch.cuda.memory_allocated(self.device) - baseline
        loss.backward()
        del loss
        baseline = torch.cuda.memory_allocated(self.device)  # now with x.grad
        offload = offload_activations(model, min_offload_bytes=0, platform="discrete")
        loss = model(x)
        torch.cuda.synchronize()
        offload._poll()
        offloaded = torch.cuda.memory_allocated(self.device) - baseline
        # What stays: the last block's output, saved after the blocks by the loss.
        self.assertLess(offloaded, resident * 0.2)
        loss.backward()

    def _peak_above(self, run: Callable[[], None]) -> int:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(self.device) - baseline

    def test_peak_memory_falls_by_the_offloaded_bytes(self) -> None:
        # 8 blocks x 3 saved storages x 128 MiB = 3 GiB of activations made in microseconds: the
        # link cannot keep up, so only the in-flight bound keeps the copies from piling up.
        model = _ElementwiseChain(8).to(self.device)
        x = torch.randn(32 << 20, device=self.device, requires_grad=True)
        expected = self._chain_grads(model, x)
        resident_peak = self._peak_above(lambda: self._chain_grads(model, x))
        offload = offload_activations(model, min_offload_bytes=0, max_inflight_bytes=256 << 20, platform="discrete")
        self._chain_grads(model, x)  # sizes the pinned pool
        offload.stats.reset()
        grads = []
        offloaded_peak = self._peak_above(lambda: grads.extend(self._chain_grads(model, x)))
        for grad, reference in zip(grads, expected):
            self.assertTrue(torch.equal(grad, reference))
        # (Whether the forward had to wait for the link depends on speed: under
        # TORCH_CUDA_SANITIZER the launches are slow enough that it never does. The peak is the
        # behaviour.) Generous: what stays is the in-flight bound, a block being made, and backward's window.
        self.assertLess(offloaded_peak, resident_peak - offload.stats.d2h_bytes // 3)

    def test_fsdp2_model_gradients_and_peak(self) -> None:
        # One-rank FSDP2 with activations alone offloaded (offload_activations; parameters stay on
        # the GPU).
        created_group = not dist.is_initialized()
        if created_group:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=self.device)
        try:
            # About 1 GiB of activations per block, 8 GiB in all: well above the 1 GiB in-flight bound.
            config = TransformerConfig(vocab_size=512, dim=1024, n_layers=8, n_heads=16, ffn_hidden=4096, max_seq_len=1024)
            tokens = torch.randint(0, config.vocab_size, (8, 1024), device=self.device)
            results = {}
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                for activations in (False, True):
                    torch.manual_seed(0)
                    model = build_model(config, device=self.device)
                    for block in model.blocks:
                        fully_shard(block)
                    fully_shard(model)
                    offload = offload_activations(model, platform="discrete") if activations else None
                    _step(model, tokens)  # first step: lazy init and the pinned pool
                    first = [p.grad.full_tensor() for p in model.parameters()]
                    if offload is not None:
                        offload.stats.reset()
                    peak = self._peak_above(lambda: _step(model, tokens))
                    grads = [p.grad.full_tensor() for p in model.parameters()]
                    results[activations] = (peak, first, grads, offload)
                    del model
            resident_peak, first, expected, _ = results[False]
            offloaded_peak, _, grads, offload = results[True]
            # Bit for bit where this GPU's kernels are run-to-run deterministic (checked on the resident run).
            reproducible = all(torch.equal(a, b) for a, b in zip(first, expected))
            for grad, reference in zip(grads, expected):
                if reproducible:
                    self.assertTrue(torch.equal(grad, reference))
                else:
                    self.assertEqual(grad, reference)
            self.assertGreater(offload.stats.d2h_bytes, 0)
            self.assertEqual(offload.stats.on_demand_copies, 0)
            # Generous: the in-flight bound and backward's two-block window stay on the device.
            self.assertLess(offloaded_peak, resident_peak - offload.stats.d2h_bytes // 3)
        finally:
            if created_group:
                dist.destroy_process_group()

    def test_unified_platform_copies_nothing(self) -> None:
        model = _ElementwiseChain(2).to(self.device)
        x = torch.randn(1 << 20, device=self.device, requires_grad=True)
        expected = self._chain_grads(model, x)
        offload = offload_activations(model, min_offload_bytes=0, platform="unified")
        engine = get_transfer_engine(self.device)
        before = (engine.stats.d2h_copies, engine.stats.h2d_copies)
        for grad, reference in zip(self._chain_grads(model, x), expected):
            self.assertTrue(torch.equal(grad, reference))
        self.assertEqual((engine.stats.d2h_copies, engine.stats.h2d_copies), before)
        self.assertEqual(offload.stats.d2h_copies, 0)

    def test_checkpoint_inside_on_gpu(self) -> None:
        model = _ElementwiseChain(4).to(self.device)
        x = torch.randn(4 << 20, device=self.device, requires_grad=True)
        expected = self._chain_grads(model, x)
        for index in range(4):
            model.blocks[index] = _Checkpointed(model.blocks[index], use_reentrant=False)
        offload = offload_activations(model, min_offload_bytes=0, platform="discrete")
        for grad, reference in zip(self._chain_grads(model, x), expected):
            self.assertTrue(torch.equal(grad, reference))
        self.assertEqual(offload.stats.d2h_copies, 4)


instantiate_parametrized_tests(TestActivationOffload)
instantiate_parametrized_tests(TestActivationOffloadGPU)

if __name__ == "__main__":
    run_tests()
