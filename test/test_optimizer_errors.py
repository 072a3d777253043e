"""OffloadOptimizer refuses what it cannot do exactly: gradients changed after groups already
stepped during backward.

Offloaded models use the forced ``discrete`` platform on the CPU (see CONTRIBUTING.md), so the
groups really step on the host during backward, as on a GPU machine.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.testing._internal.common_utils import run_tests, TestCase

from common_offload import GlooMultiProcessTestCase
from test_fsdp2_offload import _batch, _loss, _shard, STEPS, TiedBlocksModel
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer

NOTHING_OFFLOADED = "none of its parameters is in a parameter group that CoherentOffload offloads"


class GradientsChangedAfterOverlappedStepTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def _models(self):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (self.world_size,))
        reference = TiedBlocksModel()
        model = copy.deepcopy(reference)
        _shard(reference, None, mesh, MixedPrecisionPolicy())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _shard(model, CoherentOffload(platform="discrete", optimizer="host"), mesh, MixedPrecisionPolicy())
            optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        # Groups are offloaded here: no nothing-offloaded warning.
        self.assertFalse(any(NOTHING_OFFLOADED in str(w.message) for w in caught))
        return reference, model, torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True), optim

    def test_clip_grad_norm_between_backward_and_step_is_exact(self):
        # Clipping with clip_grad_norm_ between backward and step() from the first step on: the
        # first step (after backward) sees the gradients changed, so groups never step during
        # backward and training matches FSDP2 with the same clip. The first clip is a no-op
        # (a norm far above the gradients'): the change of the gradients is seen all the same.
        self.init_gloo()
        reference, model, reference_optim, optim = self._models()
        for step in range(STEPS):
            max_norm = 1e6 if step == 0 else 0.05
            for m, o in ((reference, reference_optim), (model, optim)):
                _loss(m, _batch(step, self.rank)).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
                o.step()
                o.zero_grad()
        self.assertEqual(optim._pending, {})
        for (name, param), (_, reference_param) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(param.full_tensor(), reference_param.full_tensor(), atol=0, rtol=0, msg=name)

    def test_gradients_changed_after_groups_stepped_during_backward_raise(self):
        # Once overlap is on, groups step as their gradients land; any later in-place change of
        # their gradients (or a new gradient tensor) would be silently lost for them: step()
        # refuses, naming max_grad_norm= and overlap=False, and the next step trains normally.
        self.init_gloo()

        def clip(model):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

        def clip_value(model):
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)

        def foreach_mul(model):
            torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], 0.5)

        def last_block(model):
            return model.blocks[-1][0].weight

        def mul(model):
            last_block(model).grad.mul_(0.5)

        def local_mul(model):
            last_block(model).grad._local_tensor.mul_(0.5)

        def rebind(model):
            last_block(model).grad = last_block(model).grad * 0.5

        for change in (clip, clip_value, foreach_mul, mul, local_mul, rebind):
            with self.subTest(change=change.__name__):
                _, model, _, optim = self._models()
                for step in range(2):  # the first step learns that overlap is safe
                    _loss(model, _batch(step, self.rank)).backward()
                    optim.step()
                    optim.zero_grad()
                _loss(model, _batch(2, self.rank)).backward()
                self.assertGreater(len(optim._pending), 0)  # groups stepped during backward
                change(model)
                with self.assertRaisesRegex(
                    RuntimeError,
                    r"gradients changed after some parameter groups had already stepped during backward"
                    r".*OffloadOptimizer\(\.\.\., max_grad_norm=\.\.\.\).*overlap=False",
                ):
                    optim.step()
                optim.zero_grad()
                _loss(model, _batch(3, self.rank)).backward()
                optim.step()
                # The gradients are plain DTensors again once step() ran.
                self.assertTrue(all(type(p.grad).__name__ == "DTensor" for p in model.parameters() if p.grad is not None))
                optim.zero_grad()
                self.assertTrue(all(math.isfinite(p.full_tensor().sum().item()) for p in model.parameters()))

    def test_own_steps_during_backward_are_no_change(self):
        # A parameter without optimizer state yet (here: its state dropped; in models, one whose
        # first gradient comes after overlap is on) makes its group step over the DTensors
        # themselves during backward; the fused kernel declares the gradients it reads as
        # written, which must not read as the user changing them.
        self.init_gloo()
        reference, model, reference_optim, optim = self._models()
        for step in range(4):
            if step == 2:
                for o, m in ((optim, model), (reference_optim, reference)):
                    del o.state[m.blocks[-1][0].weight]
            for m, o in ((reference, reference_optim), (model, optim)):
                _loss(m, _batch(step, self.rank)).backward()
                if o is optim and step >= 2:
                    self.assertGreater(len(optim._pending), 0)  # groups stepped during backward
                o.step()
                o.zero_grad()
        for (name, param), (_, reference_param) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(param.full_tensor(), reference_param.full_tensor(), atol=0, rtol=0, msg=name)


if __name__ == "__main__":
    run_tests()
