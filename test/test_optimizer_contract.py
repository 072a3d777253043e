"""OffloadOptimizer keeps torch.optim's contract, bit for bit against plain FSDP2 with the same optimizer.

Between ``backward()`` and ``step()`` the parameters, their gradients and ``state_dict()`` are what
plain FSDP2 shows; right after ``step()`` (its host steps still running, slowed on purpose) every
read sees the stepped values. Clipping by the user or by ``max_grad_norm``, a step skipped for a
non-finite norm, and gradient accumulation train exactly as plain FSDP2 does, at world sizes 1, 2
and 4. On CPU the platform is forced to ``discrete``, so every shard is homed on the host and every
copy runs through the transfer engine.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
import math
import threading
import time
from unittest import mock

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import distribute_tensor, DTensor, Shard
from torch.testing._internal.common_utils import run_tests

import test_fsdp2_offload as parity
from common_offload import GlooMultiProcessTestCase, HostStepGate, set_gradient_sync, SingleRankGlooTestCase
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.data_path import group_offload
from torch_fsdp_offload.optimizer import dtensor_grads
from torch_fsdp_offload.optimizer import streamed_steps

STEPS = 4


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose every step starts late: steps are still running when ``step()`` returns."""

    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


class OffloadOptimizerContractTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def _assert_as_plain(self, model, reference, optim, reference_optim, when: str) -> None:
        for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(param.full_tensor(), ref.full_tensor(), atol=0, rtol=0, msg=f"{when}: {name}")
            self.assertEqual(param.grad is None, ref.grad is None, msg=f"{when}: {name}.grad")
            if ref.grad is not None:
                self.assertEqual(_full(param.grad), _full(ref.grad), atol=0, rtol=0, msg=f"{when}: {name}.grad")
        state, reference_state = optim.state_dict()["state"], reference_optim.state_dict()["state"]
        self.assertEqual(sorted(state), sorted(reference_state), msg=when)
        for index, values in reference_state.items():
            self.assertEqual(sorted(state[index]), sorted(values), msg=when)
            for key, value in values.items():
                self.assertEqual(_full(state[index][key]), _full(value), atol=0, rtol=0, msg=f"{when}: {index}.{key}")

    def _train(
        self,
        *,
        optimizer=0.5,
        user_clip: float | None = None,
        max_grad_norm: float | None = None,
        nonfinite_step: int | None = None,
        grad_accum: int = 1,
        hsdp: bool = False,
        optimizer_class: type = SlowAdamW,
        zero_before_reads: bool = False,
        set_to_none: bool = True,
    ) -> OffloadOptimizer:
        """Train with and without the policy; assert the contract before and right after each step
        (``zero_before_reads``: right after ``step()`` and ``zero_grad()``)."""
        torch.manual_seed(0)
        reference = parity.TiedBlocksModel()
        model = copy.deepcopy(reference)
        if hsdp:
            mesh = init_device_mesh("cpu", (2, self.world_size // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (self.world_size,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        parity._shard(reference, None, mesh, mp_policy)
        parity._shard(model, CoherentOffload(platform="discrete", optimizer=optimizer), mesh, mp_policy)
        reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
        gate = HostStepGate()
        optim = OffloadOptimizer(
            model,
            gate.optimizer_class(optimizer_class),
            lr=1e-2,
            fused=True,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=nonfinite_step is not None,
        )
        for step in range(STEPS):
            for micro in range(grad_accum):
                last = micro == grad_accum - 1
                tokens = parity._batch(step * grad_accum + micro, self.rank)
                set_gradient_sync(model, reference, last)
                for m in (reference, model):
                    loss = parity._loss(m, tokens)
                    (loss * math.inf if step == nonfinite_step and last else loss).backward()
            for early_step in optim._host_steps.during_backward.values():  # a group stepping during backward shows now
                early_step.result()
            self._assert_as_plain(model, reference, optim, reference_optim, f"step {step}, before step()")
            for m in (reference, model):
                if user_clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), user_clip)
            # GradScaler's rule: a step whose gradient norm is not finite is skipped as a whole.
            grads = [p.grad for p in reference.parameters() if p.grad is not None]
            if nonfinite_step is None or math.isfinite(_full(torch.nn.utils.get_total_norm(grads)).item()):
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
                reference_optim.step()
            # Where step() returns before its host steps end (not on FSDP2's offload hooks, whose
            # plain DTensors no read could wait on), the reads below come while they still run.
            if optim.overlap_next_forward:
                gate.close()
            optim.step()
            if step != nonfinite_step and optim.overlap_next_forward:
                self.assertTrue(gate.holds_a_step(), f"step {step}: step() returned after every host step")
            if zero_before_reads:
                for o in (reference_optim, optim):
                    o.zero_grad(set_to_none=set_to_none)
            gate.open()
            self._assert_as_plain(model, reference, optim, reference_optim, f"step {step}, after step()")
            for o in (reference_optim, optim):
                o.zero_grad(set_to_none=set_to_none)
        return optim

    def test_before_and_after_step_as_plain_fsdp2(self):
        self.init_gloo()
        self._train()
        self._train(optimizer="host")

    def test_zero_grad_keeping_the_tensors_while_steps_run(self):
        # zero_grad(set_to_none=False) right after step(), while the (slow) host steps still run:
        # each group's gradients are zeroed once its step ends, and the reads after it see zeros.
        self.init_gloo()
        self._train(optimizer="host", zero_before_reads=True, set_to_none=False)

    def test_clip_grad_norm_by_the_user_is_exact(self):
        self.init_gloo()
        self._train(user_clip=0.05)

    def test_clip_reads_norms_computed_as_gradients_landed(self):
        # clip_grad_norm_ before step() reads the offloaded groups' norms computed in the host-step
        # thread as their gradients landed, and leaves its multiplication to that thread: on the
        # training loop's thread it only combines one number per parameter.
        self.init_gloo()
        served, deferred = [], []

        def landed_norms(*args, **kwargs):
            served.append(real_norms(*args, **kwargs) is not None)
            return real_norms(*args, **kwargs)

        def defer_scale(*args, **kwargs):
            deferred.append(real_defer(*args, **kwargs))
            return deferred[-1]

        real_norms, real_defer = dtensor_grads._landed_norms, dtensor_grads._defer_scale
        with mock.patch.object(dtensor_grads, "_landed_norms", landed_norms), mock.patch.object(
            dtensor_grads, "_defer_scale", defer_scale
        ):
            self._train(user_clip=0.05, optimizer="host")
            self._train(max_grad_norm=0.05, optimizer="host")
        # clip_grad_norm_ reads each gradient's norm and scales each gradient, per tensor or in
        # one foreach op: every read was served and every scale recorded.
        self.assertGreaterEqual(len(served), 2 * STEPS)
        self.assertTrue(all(served), msg=served)
        self.assertGreaterEqual(len(deferred), 2 * STEPS)
        self.assertTrue(all(deferred), msg=deferred)
        # However the norm op is spelt (function or aten overload, defaults given or not), it is served.
        model, optim = self._train_to_last_backward()
        served.clear()
        with mock.patch.object(dtensor_grads, "_landed_norms", landed_norms):
            for param in model.parameters():
                if param.grad is not None:
                    torch.ops.aten.linalg_vector_norm.default(param.grad, 2.0, None, False, dtype=None)
                    torch.ops.aten.linalg_vector_norm.default(param.grad)
                    torch.linalg.vector_norm(param.grad, ord=2, dim=None, keepdim=False, dtype=None)
        self.assertTrue(served and all(served), msg=served)
        optim.step()

    def test_accumulated_micro_batches_cast_no_parameter_again(self):
        # Between the micro-batches of one optimizer step no parameter changes: their forwards
        # copy in the compute-dtype mirror the last step refreshed, and the training thread casts
        # nothing. Only the first step, before the optimizer knows its groups, casts there.
        self.init_gloo()
        training_thread = threading.get_ident()
        casts_here = []
        real_refresh = group_offload.GroupOffload.refresh_mirror

        def counted_refresh(offload):
            if threading.get_ident() == training_thread:
                casts_here.append(offload)
            return real_refresh(offload)

        with mock.patch.object(group_offload.GroupOffload, "refresh_mirror", counted_refresh):
            optim = self._train(grad_accum=4, optimizer="host")
        groups = len(optim._inner.offloaded_groups())
        self.assertGreater(groups, 0)
        # The first forward and the three accumulating ones of the first step, once per group.
        self.assertLessEqual(len(casts_here), 4 * groups)

    def test_clip_within_its_bound_writes_no_gradient(self):
        # Where the norm is within max_norm, clip_grad_norm_ multiplies by exactly 1: the host
        # skips that pass over the gradients (the same bits either way), for both clipping paths.
        self.init_gloo()
        self._train(user_clip=1e6, optimizer="host")
        self._train(max_grad_norm=1e6, optimizer=0.5, optimizer_class=torch.optim.AdamW)
        for clip in ("user", "max_grad_norm"):
            model, optim = self._train_to_last_backward(max_grad_norm=1e6 if clip == "max_grad_norm" else None)
            if clip == "user":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            grads = [param.grad.to_local() for param in model.parameters() if param.grad is not None]
            versions = [grad._version for grad in grads]
            optim.step()
            optim.synchronize()
            self.assertEqual([grad._version for grad in grads], versions, msg=clip)

    def _train_to_last_backward(self, **optimizer_kwargs):
        """An offloaded model and its optimizer, trained two steps, and the third step's backward run."""
        torch.manual_seed(0)
        model = parity.TiedBlocksModel()
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        parity._shard(model, CoherentOffload(platform="discrete", optimizer="host"), init_device_mesh("cpu", (self.world_size,)), mp_policy)
        optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, **optimizer_kwargs)
        for step in range(3):
            parity._loss(model, parity._batch(step, self.rank)).backward()
            if step < 2:
                optim.step()
                optim.zero_grad()
        return model, optim

    def test_clipped_streamed_steps_scale_on_the_device(self):
        # A streamed group's clip multiplies its uploaded gradients on the device; its host
        # gradients are scaled too where they are read after step(), and left once zero_grad()
        # came before the group was back (its pipeline starts late here). One parameter per run:
        # every group steps in several runs, as a large model's do.
        self.init_gloo()
        real_pipeline = streamed_steps.StreamedSteps._run_stream_pipeline

        def late_pipeline(*args):
            time.sleep(0.05)
            return real_pipeline(*args)

        one_per_run = mock.patch.object(streamed_steps, "STREAM_RUN_BYTES", 1)
        one_per_run.start()
        self.addCleanup(one_per_run.stop)
        scaled = self._train(max_grad_norm=0.05, optimizer=0.5, optimizer_class=torch.optim.AdamW)._streamed_steps.scaled_on_device
        self.assertGreater(scaled["host_scaled"], 0)
        self.assertEqual(scaled["host_skipped"], 0)
        with mock.patch.object(streamed_steps.StreamedSteps, "_run_stream_pipeline", late_pipeline):
            optim = self._train(user_clip=0.05, optimizer=0.5, optimizer_class=torch.optim.AdamW, zero_before_reads=True)
        self.assertGreater(optim._streamed_steps.scaled_on_device["host_skipped"], 0)

    def test_a_clipped_host_group_is_scaled_in_one_multiply(self):
        # clip_grad_norm_ gives every gradient one coefficient: a host group whose gradients all
        # lie in its flat host buffer is scaled by one multiply over that buffer, not one per
        # parameter, with the same bits (_train asserts them against plain FSDP2).
        self.init_gloo()
        training_thread, scaled = threading.get_ident(), []
        real_mul = torch._foreach_mul_

        def recorded_mul(tensors, *args, **kwargs):
            if threading.get_ident() != training_thread:
                scaled.extend((t.data_ptr(), t.numel()) for t in tensors)
            return real_mul(tensors, *args, **kwargs)

        with mock.patch.object(torch, "_foreach_mul_", recorded_mul):
            optim = self._train(max_grad_norm=0.05, optimizer="host")
        buffers = {(owner.grads.data_ptr(), owner.grads.numel()) for owner in optim._inner.offloaded_groups()}
        # At most one multiply per group and step (a group with a parameter left without a
        # gradient scales that one alone), most over a whole buffer, none outside one.
        self.assertLessEqual(len(scaled), len(buffers) * STEPS)
        self.assertGreater(sum(1 for target in scaled if target in buffers), len(scaled) // 2)
        self.assertTrue(all(any(b <= ptr < b + n * 4 for b, n in buffers) for ptr, _ in scaled))

    def test_max_grad_norm_is_exact(self):
        self.init_gloo()
        self._train(max_grad_norm=0.05, optimizer="host")

    def test_nonfinite_norm_skips_the_step(self):
        self.init_gloo()
        optim = self._train(nonfinite_step=2, max_grad_norm=0.05)
        self.assertEqual(optim.skipped_steps, 1)

    def test_gradient_accumulation(self):
        self.init_gloo()
        self._train(grad_accum=2, user_clip=0.05)


class GradientsSavedBeforeStepTest(SingleRankGlooTestCase):
    def test_torch_save_of_a_landed_gradient(self):
        # Between backward and step() a landed gradient carries the norm computed as it landed
        # (dtensor_grads): saving it, as with plain FSDP2, saves its values; the norm stays behind.
        grad = distribute_tensor(torch.randn(8), init_device_mesh("cpu", (1,)), [Shard(0)])
        dtensor_grads.watch_grad(grad)
        dtensor_grads.expect_norms([grad])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            dtensor_grads.compute_norms([grad], pool)
        saved = io.BytesIO()
        torch.save(grad, saved)
        saved.seek(0)
        self.assertEqual(_full(torch.load(saved, weights_only=False)), _full(grad), atol=0, rtol=0)
        dtensor_grads.unwatch_grad(grad)


class OffloadOptimizerContractWorldSize1Test(OffloadOptimizerContractTest):
    WORLD_SIZE = 1


class OffloadOptimizerContractWorldSize4Test(OffloadOptimizerContractTest):
    WORLD_SIZE = 4

    def test_hsdp_2d_mesh(self):
        self.init_gloo()
        self._train(hsdp=True, max_grad_norm=0.05, grad_accum=2)


if __name__ == "__main__":
    run_tests()
