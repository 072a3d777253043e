"""FSDP2 + CoherentOffload on a GPU (world size 1): parity with GPU-resident FSDP2, flat memory.

Run on a GPU machine, also under ``TORCH_CUDA_SANITIZER=1``.
"""

from __future__ import annotations

import copy
import gc
import os
import tempfile
import unittest
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.testing._internal.common_utils import run_tests, TestCase

from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, OffloadOptimizer
from torch_fsdp_offload.memory import memory_stats
from torch_fsdp_offload.models import build_model, causal_lm_loss
from torch_fsdp_offload.optimizer import streamed_steps
from torch_fsdp_offload.optimizer.overlap import OverlapState
from torch_fsdp_offload.transfer import get_transfer_engine


def _shard(
    model, policy, activation_checkpointing=False, last_blocks=None, keep_unsharded_last=0, layer_groups=False,
    spread_fraction=None,
):
    """``policy`` on every block and the root, or (``last_blocks``, ``spread_fraction``) on some
    blocks only.
    ``layer_groups``: each block's attention and feed-forward are the groups (inside its
    checkpoint wrapper); ``last_blocks`` and ``keep_unsharded_last`` then count those groups."""
    groups = [unit for block in model.blocks for unit in (block.attention, block.feed_forward)] if layer_groups else None
    if activation_checkpointing:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fully_shard_with_policy(
        model,
        groups or model.blocks,
        policy,
        last_blocks=last_blocks,
        spread_fraction=spread_fraction,
        keep_unsharded_last=keep_unsharded_last,
        mp_policy=mp_policy,
    )


def _full_or_none(grad):
    return None if grad is None else grad.full_tensor().cuda()


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

    def _pair(
        self,
        prefetch_depth=1,
        spread_fraction=None,
        reference_policy=None,
        optimizer="host",
        overlap_next_forward=False,
        activation_checkpointing=False,
        last_blocks=None,
        keep_unsharded_last=0,
        layer_groups=False,
        max_grad_norm=None,
    ):
        # The reference steps with the same fused CPU AdamW kernel (stock CPUOffloadPolicy): a
        # GPU-resident reference differs only by the optimizer kernel's rounding.
        torch.manual_seed(0)
        reference = build_model("small", device="cuda")
        model = copy.deepcopy(reference)
        _shard(
            reference,
            reference_policy or CPUOffloadPolicy(pin_memory=True),
            activation_checkpointing,
            last_blocks,
            keep_unsharded_last,
            layer_groups,
        )
        _shard(
            model,
            CoherentOffload(prefetch_depth=prefetch_depth, optimizer=optimizer),
            activation_checkpointing,
            last_blocks,
            keep_unsharded_last,
            layer_groups,
            spread_fraction,
        )
        return (
            reference,
            torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True),
            model,
            OffloadOptimizer(
                model, torch.optim.AdamW, lr=1e-3, fused=True, overlap_next_forward=overlap_next_forward, max_grad_norm=max_grad_norm
            ),
        )

    @staticmethod
    def _train_step(model, optim, step):
        """One optimizer step on batch ``step`` (the same batch for every model); its loss."""
        tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    def _train_both(self, reference, reference_optim, model, optim, *, rtol):
        """10 steps of each model on the same batches; losses compared at every step."""
        for step in range(10):
            reference_loss = self._train_step(reference, reference_optim, step)
            self.assertEqual(self._train_step(model, optim, step), reference_loss, atol=0, rtol=rtol)

    def _assert_params_close(self, model, reference):
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(p.full_tensor().cuda(), q.full_tensor().cuda(), atol=1e-6, rtol=1e-6, msg=name)

    def test_parity_with_stock_offload(self):
        # Host steps overlapping backward; with overlap_next_forward also the next forward.
        for depth, overlap_next_forward in ((1, False), (2, False), (2, True)):
            reference, reference_optim, model, optim = self._pair(depth, overlap_next_forward=overlap_next_forward)
            self._train_both(reference, reference_optim, model, optim, rtol=1e-6)
            optim.synchronize()
            self._assert_params_close(model, reference)
            self.assertIs(optim._overlap.state, OverlapState.ON)

    def _train_both_by_step(self, reference, reference_optim, model, optim, backward, steps=10):
        """Each step ``backward(net, step)`` (its last loss) for the reference, then the model, each
        followed by its optimizer's step and zero_grad: losses within 1e-6 every step, parameters
        close at the end."""
        for step in range(steps):
            losses = []
            for net, net_optim in ((reference, reference_optim), (model, optim)):
                losses.append(backward(net, step))
                net_optim.step()
                net_optim.zero_grad()
            self.assertEqual(losses[1], losses[0], atol=0, rtol=1e-6)
        optim.synchronize()
        self._assert_params_close(model, reference)

    def test_clipping_both_ways_matches_stock_offload(self):
        # A clip tight enough to scale every step, by max_grad_norm= and by the user's own
        # clip_grad_norm_ between backward and step(): stock offload's clipped training within
        # 1e-6, every norm served from the norms computed as the gradients landed.
        for user_clip in (True, False):
            reference, reference_optim, model, optim = self._pair(2, overlap_next_forward=True, max_grad_norm=None if user_clip else 0.05)
            before = optim.norm_reads

            def backward(net, step):
                tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                loss = causal_lm_loss(net(tokens), tokens)
                loss.backward()
                if net is reference or user_clip:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
                return loss.detach()

            self._train_both_by_step(reference, reference_optim, model, optim, backward)
            reads = {key: count - before[key] for key, count in optim.norm_reads.items()}
            self.assertGreater(reads["served"], 0, msg=f"user_clip={user_clip}")
            self.assertEqual(reads["computed"], 0, msg=f"user_clip={user_clip}")

    def test_accumulation_matches_stock_offload(self):
        # Three micro-batches per step, each reduced: the running sums come up, are added to on the
        # GPU and go down (stock offload adds on the host); an fp32 add rounds alike on both, so
        # the summed gradients are stock offload's, bit for bit.
        reference, reference_optim, model, optim = self._pair(2, overlap_next_forward=True)
        reference_grads = []

        def backward(net, step):
            for micro in range(3):
                tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(10 * step + micro))
                loss = causal_lm_loss(net(tokens), tokens)
                loss.backward()
            # The reference steps (and zeroes its gradients) before the model's backward runs.
            grads = [_full_or_none(param.grad) for param in net.parameters()]
            if net is reference:
                reference_grads[:] = grads
            else:
                for grad, reference_grad in zip(grads, reference_grads, strict=True):
                    self.assertEqual(grad, reference_grad, atol=0, rtol=0)
            return loss.detach()

        self._train_both_by_step(reference, reference_optim, model, optim, backward, steps=5)

    def test_parity_with_activation_checkpointing(self):
        # Checkpointed blocks recompute their forward inside backward, after our copy-in for
        # backward: same losses and parameters as stock offload with the same checkpointing.
        reference, reference_optim, model, optim = self._pair(
            2, overlap_next_forward=True, activation_checkpointing=True
        )
        self._train_both(reference, reference_optim, model, optim, rtol=1e-6)
        optim.synchronize()
        self._assert_params_close(model, reference)

    def test_parity_with_stock_offload_on_the_last_blocks(self):
        # The policy on the last blocks only (the planner's placement), stock offload on the same
        # blocks: offloaded groups step with the fused CPU AdamW kernel in both, the first blocks
        # and the root with the CUDA one, so losses and parameters agree.
        n_blocks = len(build_model("small", device="meta").blocks)
        reference, reference_optim, model, optim = self._pair(
            1, overlap_next_forward=True, activation_checkpointing=True, last_blocks=n_blocks // 2
        )
        offloaded = [p for p in model.parameters() if p.to_local().device.type == "cpu"]
        self.assertTrue(0 < len(offloaded) < len(list(model.parameters())))
        self._train_both(reference, reference_optim, model, optim, rtol=1e-6)
        optim.synchronize()
        self._assert_params_close(model, reference)

    def test_parity_with_blocks_not_resharded_after_forward(self):
        # The offloaded last blocks kept unsharded from forward to backward: their backward (and
        # its recompute) reads the parameters forward copied in, on the device, so each copies in
        # once per step instead of twice; losses and parameters still match stock offload.
        n_blocks = len(build_model("small", device="meta").blocks)
        engine = get_transfer_engine("cuda")
        copied = []
        for keep in (0, n_blocks // 2):
            reference, reference_optim, model, optim = self._pair(
                1,
                overlap_next_forward=True,
                activation_checkpointing=True,
                last_blocks=n_blocks // 2,
                keep_unsharded_last=keep,
            )
            engine.stats.reset()
            self._train_both(reference, reference_optim, model, optim, rtol=1e-6)
            optim.synchronize()
            copied.append(engine.stats.h2d_bytes)
            self._assert_params_close(model, reference)
        self.assertLess(copied[1], 0.75 * copied[0])

    def test_parity_with_groups_smaller_than_a_checkpointed_block(self):
        # Each block's attention and feed-forward as groups of their own inside the checkpoint
        # wrapper (the benchmark's units=2), on the last blocks, the last block's two kept
        # unsharded: losses and parameters match stock offload with the same groups.
        n_blocks = len(build_model("small", device="meta").blocks)
        reference, reference_optim, model, optim = self._pair(
            1,
            overlap_next_forward=True,
            activation_checkpointing=True,
            last_blocks=n_blocks,
            keep_unsharded_last=2,
            layer_groups=True,
        )
        # The last n_blocks of the 2 * n_blocks groups: the second half of the blocks' attention
        # and feed-forward, not their norms (those join the root's group).
        last_half = [block._checkpoint_wrapped_module for block in model.blocks[n_blocks // 2 :]]
        expected = {id(p) for block in last_half for unit in (block.attention, block.feed_forward) for p in unit.parameters()}
        self.assertEqual({id(p) for p in model.parameters() if p.to_local().device.type == "cpu"}, expected)
        self._train_both(reference, reference_optim, model, optim, rtol=1e-6)
        optim.synchronize()
        self._assert_params_close(model, reference)

    def test_cast_on_the_device_matches_the_host_cast(self):
        # cast_on="device": the fp32 master crosses and is cast on the H2D stream as it lands;
        # with host steps and with half the groups streamed, losses and parameters are bitwise
        # those of the host's cast (one round-to-nearest cast either way), the copy-ins carry
        # twice the bytes, and no host mirror is made.
        n_blocks = len(build_model("small", device="meta").blocks)
        engine = get_transfer_engine("cuda")
        for optimizer in ("host", 0.5):
            trained = {}
            for cast_on in ("host", "device"):
                torch.manual_seed(0)
                model = build_model("small", device="cuda")
                _shard(
                    model,
                    CoherentOffload(prefetch_depth=1, optimizer=optimizer, cast_on=cast_on),
                    activation_checkpointing=True,
                    last_blocks=n_blocks // 2,
                    keep_unsharded_last=1,
                )
                optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True, overlap_next_forward=True)
                engine.synchronize()
                engine.stats.reset()
                losses = [self._train_step(model, optim, step) for step in range(10)]
                optim.synchronize()
                mirrors = [owner.mirror for owner in optim._inner.offloaded_groups()]
                trained[cast_on] = (model, torch.stack(losses), engine.stats.h2d_bytes, mirrors)
            (host_model, host_losses, host_h2d, _), (model, losses, h2d, mirrors) = trained["host"], trained["device"]
            self.assertEqual(losses, host_losses, atol=0, rtol=0)
            for (name, p), (_, q) in zip(model.named_parameters(), host_model.named_parameters()):
                self.assertEqual(p.full_tensor(), q.full_tensor(), atol=0, rtol=0, msg=name)
            self.assertGreater(len(mirrors), 0)
            self.assertTrue(all(mirror is None for mirror in mirrors))
            if optimizer == "host":
                self.assertGreater(h2d, 1.8 * host_h2d)

    def test_steps_finishing_in_next_forward_with_streamed_groups(self):
        # Half the groups streamed, the other half finishing on the host during the forward.
        pair = self._pair(2, reference_policy=CPUOffloadPolicy(pin_memory=True), optimizer=0.5, overlap_next_forward=True)
        self._train_both(*pair, rtol=1e-3)
        pair[3].synchronize()

    def test_streamed_optimizer_matches_resident(self):
        # Streamed steps run the same CUDA fused AdamW kernel as GPU-resident FSDP2, whether a
        # group goes up in one run or one parameter per run (uploads overlapping steps).
        for run_bytes in (streamed_steps.STREAM_RUN_BYTES, 1):
            with mock.patch.object(streamed_steps, "STREAM_RUN_BYTES", run_bytes):
                pair = self._pair(2, reference_policy=OffloadPolicy(), optimizer="stream")
                self._train_both(*pair, rtol=1e-6)
                self._assert_params_close(pair[2], pair[0])

    def test_streamed_steps_on_kept_last_blocks_match_resident(self):
        # Every offloaded group streamed and running on into the next forward, on the last
        # blocks, kept unsharded and checkpointed, as the benchmark's stream rows are. Streamed
        # steps run the CUDA kernel, so the reference is GPU-resident with the same sharding.
        n_blocks = len(build_model("small", device="meta").blocks)
        pair = self._pair(
            1,
            reference_policy=OffloadPolicy(),
            optimizer="stream",
            overlap_next_forward=True,
            activation_checkpointing=True,
            last_blocks=n_blocks // 2,
            keep_unsharded_last=n_blocks // 2,
        )
        self._train_both(*pair, rtol=1e-6)
        pair[3].synchronize()
        self._assert_params_close(pair[2], pair[0])

    def test_partial_offload_close_to_resident(self):
        # Offloaded groups step with the CPU AdamW kernel (half of them streamed: the GPU
        # kernel), resident ones on the GPU: close, not equal.
        self._train_both(*self._pair(1, 0.5, reference_policy=OffloadPolicy(), optimizer=0.5), rtol=1e-3)

    def test_memory_flat_over_300_steps(self):
        # Half the groups streamed, half stepped on the host, both at once; with
        # overlap_next_forward both also run on into the next forward.
        for overlap_next_forward in (False, True):
            _, _, model, optim = self._pair(optimizer=0.5, overlap_next_forward=overlap_next_forward)
            engine = get_transfer_engine("cuda")
            readings = []
            for step in range(300):
                tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                causal_lm_loss(model(tokens), tokens).backward()
                optim.step()
                optim.zero_grad()
                if step in (10, 299):
                    optim.synchronize()
                    # Earlier tests of this process may leave garbage holding pinned memory (an
                    # activation pool in a reference cycle): collect it so that only this model counts.
                    gc.collect()
                    torch.cuda.synchronize()
                    readings.append((torch.cuda.memory_allocated(), memory_stats()["pinned_bytes"]))
            # Pinned memory is allocated once; GPU memory may vary by blocks the caching
            # allocator has not yet taken back from a copy stream, never grow.
            self.assertEqual(readings[0][1], readings[1][1])
            self.assertLess(abs(readings[1][0] - readings[0][0]), 1 << 20)
            self.assertGreater(engine.stats.h2d_copies, 0)
            del model, optim


if __name__ == "__main__":
    run_tests()
