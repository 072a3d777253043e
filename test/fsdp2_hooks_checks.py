"""Checks run only on a torch with FSDP2's offload hooks (test_fsdp2_offload_hooks.py runs them on a
patched copy of torch, with the parity tests): CoherentOffload runs through the hooks, in every rank,
with no FSDP2 patch point applied, and its data path is the real one (shards and gradients in the
group's host buffers, copy-ins and gradient copies of its own)."""

from __future__ import annotations

import collections
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_utils import run_tests

from common_offload import GlooMultiProcessTestCase, SingleRankGlooTestCase
from test_fsdp2_offload import _batch, _loss, _shard, TiedBlocksModel
from torch_fsdp_offload import _integration, CoherentOffload, fully_shard_with_policy, materialize_sharded, OffloadOptimizer
from torch_fsdp_offload._integration import fsdp2_hooks, fsdp2_sharding
from torch_fsdp_offload.transfer import get_transfer_engine


def _in(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= tensor.data_ptr() < start + flat.numel() * flat.element_size()


class HooksPathTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def test_offload_runs_through_the_hooks(self):
        self.init_gloo()
        self.assertTrue(_integration.uses_fsdp2_hooks())
        # No FSDP2 patch point applied: torch's own classes and methods everywhere.
        self.assertEqual(_fsdp_param_group.FSDPParamGroup.__module__, _fsdp_param_group.__name__)
        self.assertEqual(_fsdp_state.FSDPState.init.__module__, _fsdp_state.__name__)
        calls = collections.Counter()

        def counting(name):
            hook = getattr(CoherentOffload, name)

            def call(*args, **kwargs):
                calls[name] += 1
                return hook(*args, **kwargs)

            return call

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        engine = get_transfer_engine("cpu")
        engine.stats.reset()
        with mock.patch.multiple(CoherentOffload, **{name: counting(name) for name in fsdp2_hooks.HOOKS}):
            model = _shard(TiedBlocksModel(), CoherentOffload(platform="discrete"), init_device_mesh("cpu", (self.world_size,)), mp)
            optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
            for step in range(2):
                optim.zero_grad()
                _loss(model, _batch(step, self.rank)).backward()
                optim.step()
            optim.synchronize()
        groups = [module._get_fsdp_state()._fsdp_param_groups[0] for module in (*model.blocks, model)]
        self.assertEqual({type(group) for group in groups}, {_fsdp_param_group.FSDPParamGroup})
        for group in groups:
            offload = group.offload_state
            self.assertIsInstance(offload, fsdp2_hooks.HookedGroupOffload)
            self.assertTrue(group.offloaded and offload.active)
            for fsdp_param in group.fsdp_params:
                self.assertIs(type(fsdp_param), _fsdp_param.FSDPParam)
                # The shard lives in the policy's one host buffer, and so does its gradient.
                self.assertTrue(_in(fsdp_param.sharded_param._local_tensor, offload.master))
                self.assertTrue(_in(fsdp_param.host_shard, offload.master))
                if fsdp_param.sharded_param.requires_grad:
                    self.assertTrue(_in(fsdp_param.sharded_param.grad._local_tensor, offload.grads))
        # Each hook ran; the copies were the policy's, one per group and pass.
        self.assertEqual(set(calls), set(fsdp2_hooks.HOOKS) - {"on_shard_reset"})
        self.assertGreater(calls["copy_in"], 0)
        self.assertGreater(engine.stats.h2d_copies, 0)
        self.assertGreater(engine.stats.d2h_copies, 0)
        self.assertEqual(calls["on_grads_ready"], 2 * len(groups))


    def test_user_tensors_stay_plain_dtensors(self):
        # Nothing the user holds changes class on the hooks path: parameters, gradients and
        # optimizer state are DTensor itself after backward, the user's clip, step() and zero_grad(),
        # through accumulated micro-batches; step() returns with every host step ended.
        self.init_gloo()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = _shard(TiedBlocksModel(), CoherentOffload(platform="discrete", optimizer=0.5), mesh, mp)
        for refused in ({"step_during_backward": True}, {"overlap_next_forward": True}):
            with self.assertRaisesRegex(ValueError, "offload-policy hooks"):
                OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, **refused)
        optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        self.assertFalse(optim.overlap_next_forward)

        def assert_plain(when):
            tensors = [("param", param) for param in model.parameters()]
            tensors += [("grad", param.grad) for param in model.parameters() if param.grad is not None]
            tensors += [(key, value) for values in optim.state.values() for key, value in values.items() if isinstance(value, DTensor)]
            for what, tensor in tensors:
                self.assertIs(type(tensor), DTensor, f"{when}: a {what} is {type(tensor).__name__}")

        for step in range(3):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                _loss(model, _batch(2 * step + micro, self.rank)).backward()
                assert_plain(f"step {step}, after backward {micro}")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert_plain(f"step {step}, after clip_grad_norm_")
            optim.step()
            self.assertEqual(optim.steps_in_flight(), 0)
            assert_plain(f"step {step}, after step()")
            optim.zero_grad(set_to_none=False)
            assert_plain(f"step {step}, after zero_grad()")
        self.assertGreater(optim.stepped_numel["host"], 0)
        self.assertGreater(optim.stepped_numel["streamed"], 0)


class HooksPathWorldSize1Test(HooksPathTest):
    WORLD_SIZE = 1


def _raises(name):
    return mock.Mock(side_effect=AssertionError(f"the hooks path called {name}"))


class HooksPathPublicStateTest(SingleRankGlooTestCase):
    """What the hooks path needs of FSDP2 beyond the hooks, it asks through public state."""

    @mock.patch.object(fsdp2_sharding, "take_back_refused_call", _raises("take_back_refused_call"))
    def test_a_refused_call_leaves_the_modules_as_they_were(self):
        # A group mixing dtypes is refused; the other group of the same call (its own process
        # group, by shard_placement_fn) was already built, its parameters sharded: all undone.
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
        params = list(model.parameters())
        first = set(model[0].parameters())
        other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu"), shard_mesh_dim=0)

        def placement(param):
            return None if param in first else ShardPlacementResult(Shard(0), other)

        policy = CoherentOffload(platform="discrete")
        with self.assertRaisesRegex(ValueError, r"mix torch.bfloat16, torch.float32"):
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)), offload_policy=policy, shard_placement_fn=placement)
        self.assertNotIsInstance(model, FSDPModule)
        self.assertTrue(all(a is b for a, b in zip(model.parameters(), params, strict=True)))
        self.assertFalse(any(isinstance(param, DTensor) for param in model.parameters()))
        self.assertFalse(model._forward_pre_hooks or model._forward_hooks)
        # Usable as it is, and free to be sharded again: each dtype in its own group.
        model[1].float()
        self.assertEqual(model(torch.ones(2, 8)).shape, (2, 8))
        fully_shard(model[1], offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        self.assertTrue(all(isinstance(param, DTensor) for param in model.parameters()))
        model(torch.ones(2, 8)).sum().backward()

    @mock.patch.object(fsdp2_sharding, "shards_on_host", _raises("fsdp2_sharding.shards_on_host"))
    @mock.patch.object(fsdp2_sharding, "_get_module_fsdp_state", _raises("_get_module_fsdp_state"))
    def test_materialize_sharded_asks_fsdp_module_where_shards_live(self):
        # "meta" stands in for the compute device: offloaded groups land on the host.
        with torch.device("meta"):
            model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        fully_shard_with_policy(model, list(model), CoherentOffload(platform="discrete"), spread_fraction=0.5)
        materialize_sharded(model, "meta")
        offloaded = [layer._get_fsdp_state()._fsdp_param_groups[0].offloaded for layer in model]
        self.assertIn(True, offloaded)
        self.assertIn(False, offloaded)
        for layer, on_host in zip(model, offloaded):
            self.assertEqual(layer.is_offloaded(), on_host)
            for param in layer.parameters():
                self.assertEqual(param.to_local().device.type, "cpu" if on_host else "meta")


if __name__ == "__main__":
    run_tests()
