"""A dropped model and its ``OffloadOptimizer`` give back all their host memory.

A process that builds several models (evaluation, sweeps, benchmarks) must get each one's pinned
buffers back: nothing of ours may keep a dropped model alive. Besides the steps, the optimizer runs
work of its own in threads: as each group's gradients land the host computes their 2-norms (for
``clip_grad_norm_``) in a thread pool, which nobody waits for unless a clip reads them. On a busy
machine the pool lags behind the training loop, and a norm still queued reads its gradient's pinned
buffer after ``step()`` returned: ``synchronize()`` waits for the norms too, and a norm holds the
buffer only until it ran.
"""

from __future__ import annotations

import gc
import threading
import weakref
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.testing._internal.common_utils import run_tests

from common_offload import GlooMultiProcessTestCase, HostStepGate
from test_fsdp2_offload import _batch, _loss, _shard, TiedBlocksModel
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.memory import empty_cache, memory_stats
from torch_fsdp_offload.optimizer import dtensor_grads
from torch_fsdp_offload.transfer import get_transfer_engine

# How long a held norm waits for synchronize() before it runs anyway (a failure, not a hang).
_HOLD_TIMEOUT_S = 30.0


class DroppedOptimizerFreesHostMemoryTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 1

    def _build(self, placement="host", optimizer_class: type = torch.optim.AdamW, **kwargs) -> tuple[nn.Module, OffloadOptimizer]:
        model = _shard(TiedBlocksModel(), CoherentOffload(platform="discrete", optimizer=placement), None, MixedPrecisionPolicy())
        return model, OffloadOptimizer(model, optimizer_class, lr=1e-2, **kwargs)

    def _assert_freed(self, model_ref: weakref.ref, optim_ref: weakref.ref) -> None:
        """The dropped model and optimizer are gone after a collection, and so is their host memory."""
        gc.collect()
        self.assertIsNone(model_ref())
        self.assertIsNone(optim_ref())
        get_transfer_engine("cpu").synchronize()  # a copy in flight (the next forward's prefetch) holds its buffer
        empty_cache()
        self.assertEqual(memory_stats()["host_bytes"], 0)

    def test_dropped_model_and_optimizer_free_their_host_memory(self):
        # After synchronize(), and while a host step still runs: the host-step thread and the
        # gradient-norm threads end with the optimizer.
        self.init_gloo()
        engine = get_transfer_engine("cpu")
        engine.h2d(torch.ones(1)).wait()  # its copy threads, if any, live with the process's engine
        threads_before = {thread.ident for thread in threading.enumerate()}
        for placement, overlap_next_forward in (("host", False), ("host", True), (0.5, True)):
            model, optim = self._build(placement, overlap_next_forward=overlap_next_forward)
            for step in range(2):
                _loss(model, _batch(step, 0)).backward()
                optim.step()
                optim.zero_grad()
            optim.synchronize()
            self.assertGreater(memory_stats()["host_bytes"], 0)
            refs = weakref.ref(model), weakref.ref(optim)
            del model, optim
            self._assert_freed(*refs)
        # Dropped while a host step still runs (no synchronize()): the optimizer goes by reference
        # count at once, while the step holds the parts it runs (inner optimizers, state) until it
        # ends; then nothing may keep the model alive past the next collection.
        gate = HostStepGate()
        model, optim = self._build(optimizer_class=gate.optimizer_class(torch.optim.AdamW), overlap_next_forward=True)
        for step in range(3):
            _loss(model, _batch(step, 0)).backward()
            if step == 2:
                gate.close()
            optim.step()
            optim.zero_grad()
        still_running = gate.holds_a_step()
        refs = weakref.ref(model), weakref.ref(optim)
        del model, optim
        self.assertTrue(still_running)
        self.assertIsNone(refs[1]())
        gate.open()
        # The parts are freed on the step's thread (the step held the last reference), which ends
        # once that is done and the thread is idle; so do the gradient-norm threads.
        for thread in threading.enumerate():
            if thread.ident not in threads_before:
                thread.join(timeout=10)
                self.assertFalse(thread.is_alive(), thread.name)
        self._assert_freed(*refs)

    def test_synchronize_waits_for_the_norms_computed_as_gradients_land(self):
        # The pool's norms are held until synchronize() is called, as on a machine too busy to run
        # them before: when synchronize() returns every norm has ended, and the model and the
        # optimizer dropped then free all their host memory.
        self.init_gloo()
        synchronizing = threading.Event()
        ended = []
        compute = dtensor_grads._local_norm

        def held_norm(entry):
            synchronizing.wait(_HOLD_TIMEOUT_S)
            compute(entry)
            ended.append(entry)

        model, optim = self._build(overlap_next_forward=False)
        _loss(model, _batch(0, 0)).backward()
        optim.step()  # the first step() attaches the optimizer to the groups: norms from the next on
        optim.zero_grad()
        optim.synchronize()
        with mock.patch.object(dtensor_grads, "_local_norm", held_norm):
            _loss(model, _batch(1, 0)).backward()
            landed = sum(param.grad is not None for param in model.parameters())
            optim.step()
            optim.zero_grad()
            self.assertEqual(ended, [])
            synchronizing.set()
            optim.synchronize()
            self.assertGreater(landed, 0)
            self.assertEqual(len(ended), landed)
        refs = weakref.ref(model), weakref.ref(optim)
        del model, optim
        self._assert_freed(*refs)


if __name__ == "__main__":
    run_tests()
