"""GPU memory of FSDP2 + CoherentOffload training, against FSDP2's own bounds for CPU offload.

FSDP2's training-memory test (PyTorch's ``test_fully_shard_training_memory``), ported to world size 1 with
:class:`~torch_fsdp_offload.CoherentOffload` in place of ``CPUOffloadPolicy``: the same model, the
same input and the same bounds for CPU offload, plus what prefetching adds by design, the staging
buffers of the ``prefetch_depth`` groups whose copy-in is issued ahead. Run on a GPU machine.
"""

from __future__ import annotations

import gc
import os
import tempfile
import unittest

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.transfer import get_transfer_engine

_VOCAB_SIZE = 32
# FSDP2's allowance for fragmentation and activations in forward and backward, and for the sharding
# at init, in MB.
_BUFFER_MB = 16
_INIT_BUFFER_MB = 4


def _active_bytes(kind: str) -> int:
    """Active device memory (``"peak"`` or ``"current"``), as FSDP2's test reads it."""
    return torch.cuda.memory_stats()[f"active_bytes.all.{kind}"]


def _build_model() -> tuple[Transformer, int, int]:
    """FSDP2's test model on the CPU, with its largest group's (a block's) and the non-block
    parameters' numel."""
    torch.manual_seed(42)
    model = Transformer(ModelArgs(vocab_size=_VOCAB_SIZE, n_layers=3, dim=768, n_heads=12, weight_tying=False))
    block_numel = sum(p.numel() for p in model.layers[0].parameters())
    non_block_numel = sum(
        p.numel()
        for module in (model.tok_embeddings, model.pos_embeddings, model.norm, model.output)
        for p in module.parameters()
    )
    return model, block_numel, non_block_numel


def _bounds_mb(
    block_numel: int, non_block_numel: int, prefetch_depth: int, offload_optimizer: bool
) -> dict[str, float]:
    """FSDP2's bounds for CPU offload (fp32, reshard after forward) at world size 1, where a block's
    shard is the whole block, plus the fp32 staging buffers of the ``prefetch_depth`` groups
    copied in ahead (during forward and backward).

    Forward: the current block's unsharded parameters and copy-in, the next block's, and the
    non-block parameters. Backward: one block's unsharded parameters, two blocks' unsharded
    gradients (autograd's, and the reduce-scatter input), and the non-block parameters. The
    optimizer step and zero_grad run on the host: no device memory beyond the buffer, except,
    with ``OffloadOptimizer``, the staging buffer of the next forward's first group (the root's,
    the non-block parameters), whose copy-in it issues right after the step.
    """
    staging_mb = prefetch_depth * block_numel * 4 / 1e6
    compute_mb = (3 * block_numel + non_block_numel) * 4 / 1e6 + _BUFFER_MB + staging_mb
    after_step_mb = non_block_numel * 4 / 1e6 if offload_optimizer else 0
    return {
        "init": 1.5 * block_numel * 4 / 1e6 + _INIT_BUFFER_MB,
        "forward": compute_mb,
        "backward": compute_mb,
        "step": _BUFFER_MB + after_step_mb,
        "zero_grad": after_step_mb,
    }


@unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
class CoherentOffloadTrainingMemoryTest(TestCase):
    @classmethod
    def setUpClass(cls):
        cls._store_file = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=f"file://{cls._store_file}", rank=0, world_size=1
        )
        torch.cuda.set_device(0)
        # cuBLAS allocates its workspaces on first use; their size differs between GPUs. A linear
        # forward (gemm and bias) and backward (gemm) allocate them before anything is measured.
        linear = torch.nn.Linear(768, 768, device="cuda")
        linear(torch.randn(2, 768, device="cuda")).sum().backward()

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()
        os.unlink(cls._store_file)

    def _base_bytes(self) -> int:
        """Active memory before the model, with what earlier models left released."""
        gc.collect()
        get_transfer_engine("cuda").synchronize()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return _active_bytes("peak")

    def _training_memory(
        self, prefetch_depth: int, offload_optimizer: bool, steps: int, step_during_backward: bool = False
    ) -> tuple[list[dict[str, int]], dict[str, float]]:
        """Peak active MB above the base, per phase of each training step (``init`` at the first
        only, after sharding), and the bounds; printed for the record. The difference is rounded,
        not each reading: what earlier tests of the process left allocated must not round it up."""
        base = self._base_bytes()

        def above_base_mb() -> float:
            return round((_active_bytes("peak") - base) / 1e6, 2)

        model, block_numel, non_block_numel = _build_model()
        policy = CoherentOffload(prefetch_depth=prefetch_depth, optimizer="host")
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                fully_shard(module, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        # FSDP2's test: no foreach, whose intermediates would raise the peak.
        if offload_optimizer:
            optim = OffloadOptimizer(
                model, torch.optim.Adam, lr=1e-2, foreach=False, step_during_backward=step_during_backward
            )
        else:
            optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        readings = [{"init": above_base_mb()}]
        # A small input keeps the activations small.
        inp = torch.randint(0, _VOCAB_SIZE, (1, 4), device="cuda")
        for step in range(steps):
            reading = readings[step] if step == 0 else {}
            torch.cuda.reset_peak_memory_stats()
            loss = model(inp)
            reading["forward"] = above_base_mb()
            loss.sum().backward()
            reading["backward"] = above_base_mb()
            del loss
            torch.cuda.reset_peak_memory_stats()
            optim.step()
            reading["step"] = above_base_mb()
            optim.zero_grad()
            if offload_optimizer:
                optim.synchronize()
            torch.cuda.reset_peak_memory_stats()  # after freeing
            reading["zero_grad"] = above_base_mb()
            if step > 0:
                readings.append(reading)
        bounds = _bounds_mb(block_numel, non_block_numel, prefetch_depth, offload_optimizer)
        print(
            f"prefetch_depth={prefetch_depth} offload_optimizer={offload_optimizer}: MB above base "
            f"{readings}; bounds {({phase: round(mb, 1) for phase, mb in bounds.items()})}"
        )
        del model, optim
        return readings, bounds

    def _assert_within(self, readings, bounds) -> None:
        for step, reading in enumerate(readings):
            for phase, mb in reading.items():
                self.assertLessEqual(mb, bounds[phase], msg=f"step {step}, {phase}: {mb} MB > {bounds[phase]:.1f} MB")

    def test_training_memory_within_fsdp2_cpu_offload_bounds(self):
        # A bound is exceeded by a group's buffer (28 MB) if the copy-in window moves with FSDP's
        # backward prefetch (one group more staged), or if a reduced gradient or a staging buffer
        # is marked used on the stream that reads it (record_stream): it then stays allocated
        # until an allocation finds that stream past the read, while the CPU has run on into the
        # next group's backward, or after backward until the next allocation.
        for prefetch_depth in (0, 1, 2):
            with self.subTest(prefetch_depth=prefetch_depth):
                self._assert_within(*self._training_memory(prefetch_depth, offload_optimizer=False, steps=2))

    def test_training_memory_with_host_steps(self):
        # OffloadOptimizer steps the groups on the host after step() returned, under the next
        # forward (the default), or with step_during_backward as their gradients land, from the
        # second step on: the same bounds hold at every step.
        for step_during_backward in (False, True):
            with self.subTest(step_during_backward=step_during_backward):
                self._assert_within(
                    *self._training_memory(1, offload_optimizer=True, steps=3, step_during_backward=step_during_backward)
                )


if __name__ == "__main__":
    run_tests()
