"""CoherentOffload: knob validation, resolution per platform, clear errors before allocation."""

from __future__ import annotations

import dataclasses
import gc
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_fsdp_offload._integration as fsdp2_integration
from common_offload import SingleRankGlooTestCase
import torch_fsdp_offload.policy as policy_module
from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy
from torch_fsdp_offload.placement import choose_placements, LinkRates
from torch_fsdp_offload.memory import HostMemoryError, memory_stats


class CoherentOffloadKnobsTest(TestCase):
    @parametrize(
        "knobs, message",
        [
            ({"prefetch_depth": -1}, "must be an int >= 0"),
            ({"prefetch_depth": 1.5}, "must be an int >= 0"),
            ({"chunk_bytes": 1024}, ">= 1 MiB"),
            ({"module_fraction": 1.5}, r"in\s+\[0, 1\]"),
            ({"module_fraction": float("nan")}, r"in\s+\[0, 1\]"),
            ({"optimizer": "gpu"}, "is not a placement"),
            ({"optimizer": -0.1}, "is not a placement"),
            ({"optimizer": True}, "is not a placement"),
            ({"cast_on": "gpu"}, "is not a cast placement; use 'auto', 'host'"),
            ({"offload_grads": False}, "needs offload_grads=True"),
            ({"offload_params": False}, "set offload_grads=False"),
            ({"pin_memory": True}, "allocates exact-size pinned memory itself"),
            ({"activations": 1.5}, r"must be True, False or a number in \[0, 1\]"),
            ({"platform": "gh200"}, "is not a platform class"),
        ],
    )
    def test_bad_knob_is_rejected_with_the_fix(self, knobs, message):
        with self.assertRaisesRegex(ValueError, message):
            CoherentOffload(**knobs)

    def test_is_a_cpu_offload_policy(self):
        # FSDP2 only checks isinstance(policy, CPUOffloadPolicy): the subclass is what lets the
        # policy be passed wherever FSDP2 takes an offload policy.
        self.assertIsInstance(CoherentOffload(), CPUOffloadPolicy)

    @parametrize(
        "platform, optimizer, expected",
        [
            ("discrete", "auto", ("pinned", True, "split", 0.5)),
            ("discrete", 0.25, ("pinned", True, "split", 0.25)),
            ("discrete", "stream", ("pinned", True, "stream", 1.0)),
            ("coherent", "auto", ("pinned", True, "stream", 1.0)),
            ("unified", "auto", ("device", False, "host", 0.0)),
            ("host_only", "auto", ("host", False, "host", 0.0)),
        ],
    )
    def test_resolve_per_platform(self, platform, optimizer, expected):
        plan = CoherentOffload(platform=platform, optimizer=optimizer).resolve()
        self.assertEqual((plan.memory, plan.copies, plan.optimizer, plan.optimizer_gpu_fraction), expected)
        self.assertIn(platform, plan.describe())

    def test_auto_placements_come_from_the_machines_rates(self):
        # On a GPU machine "auto" places the cast and the streamed share from the host-step and
        # link rates measured there: two machines, two placements.
        gpu = dataclasses.replace(CoherentOffload(platform="discrete").detect(), device=torch.device("cuda", 0))
        for rates, cast_on, fraction, host_only_cast in (
            (LinkRates(0.52e-9, 0.28e-9, 54.0, 54.0, 97.0), "device", 0.45, "device"),  # a PCIe Gen5 host
            (LinkRates(0.10e-9, 0.03e-9, 25.0, 25.0, 40.0), "host", 0.0, "host"),  # a slower link, a faster host
        ):
            with mock.patch.object(policy_module, "measured_rates", return_value=rates) as measured:
                plan = CoherentOffload(platform="discrete").resolve(gpu)
            measured.assert_called_once_with(gpu.device)
            self.assertEqual((plan.cast_on, plan.optimizer_gpu_fraction), (cast_on, fraction))
            self.assertIn(rates.describe(), plan.describe())
            # Explicit knobs are kept; the other one still follows the rates.
            with mock.patch.object(policy_module, "measured_rates", return_value=rates):
                self.assertEqual(CoherentOffload(platform="discrete", cast_on="host", optimizer="host").resolve(gpu).cast_on, "host")
                self.assertEqual(CoherentOffload(platform="discrete", optimizer="host").resolve(gpu).cast_on, host_only_cast)
                self.assertEqual(CoherentOffload(platform="discrete", cast_on="host").resolve(gpu).optimizer_gpu_fraction,
                                 choose_placements(rates, "host")[1])

    def test_cast_placement_is_in_the_plan(self):
        # Without a GPU there are no rates: a forced copy path casts on the host.
        self.assertEqual(CoherentOffload(platform="discrete").resolve().cast_on, "host")
        plan = CoherentOffload(platform="discrete", cast_on="device").resolve()
        self.assertEqual(plan.cast_on, "device")
        self.assertIn("cast to the compute dtype on the device", plan.describe())

    @parametrize("memory", ["managed", "pinned", "auto"])
    def test_memory_knob_is_removed(self, memory):
        # The platform decides the memory ("auto" and "pinned" resolved alike; "managed" was never
        # built for parameters): the knob is refused, saying so, instead of raising only later.
        with self.assertRaisesRegex(TypeError, "the memory knob was removed.*drop the argument"):
            CoherentOffload(memory=memory)

    @parametrize("placement", [{"optimizer": "stream"}, {"optimizer": "host"}, {"optimizer": 0.5}, {"cast_on": "device"}])
    @parametrize(
        "nothing_offloaded",
        [
            {"offload_params": False, "offload_grads": False, "offload_optimizer_state": False},
            {"module_fraction": 0},
        ],
    )
    def test_placement_with_nothing_offloaded_is_refused_at_construction(self, placement, nothing_offloaded):
        with self.assertRaisesRegex(ValueError, r"but nothing is offloaded .*Drop (optimizer|cast_on)="):
            CoherentOffload(**placement, **nothing_offloaded)

    @parametrize("placement", [{"optimizer": "stream"}, {"optimizer": "host"}, {"optimizer": 0.5}, {"cast_on": "device"}])
    @parametrize("platform", ["unified", "host_only"])
    def test_placement_on_a_platform_that_copies_nothing_is_refused(self, placement, platform):
        policy = CoherentOffload(platform=platform, **placement)
        with self.assertRaisesRegex(ValueError, f"but a {platform} platform copies nothing.*platform='discrete'"):
            policy.resolve()

    @parametrize("platform", ["unified", "host_only"])
    def test_defaults_never_raise_where_nothing_is_copied(self, platform):
        # The same script runs on every machine: with the default knobs the policy is a no-op there.
        self.assertFalse(CoherentOffload(platform=platform).resolve().copies)
        activations_only = CoherentOffload(offload_params=False, offload_grads=False, offload_optimizer_state=False,
                                           activations=True, platform=platform)
        self.assertFalse(activations_only.resolve().copies)

    @parametrize(
        "name, value, message",
        [
            ("prefetch_depth", -1, "must be an int >= 0"),
            ("module_fraction", 2.0, r"in\s+\[0, 1\]"),
            ("offload_grads", False, "needs offload_grads=True"),
            ("optimizer", "gpu", "is not a placement"),
            ("pin_memory", True, "allocates exact-size pinned memory itself"),
        ],
    )
    def test_assignment_is_validated_and_a_refusal_changes_nothing(self, name, value, message):
        policy = CoherentOffload(prefetch_depth=2)
        before = dict(vars(policy))
        with self.assertRaisesRegex(ValueError, message):
            setattr(policy, name, value)
        self.assertEqual(vars(policy), before)

    def test_assignment_of_a_valid_knob_and_of_a_non_knob(self):
        policy = CoherentOffload()
        policy.prefetch_depth = 3
        self.assertEqual(policy.prefetch_depth, 3)
        with self.assertRaisesRegex(AttributeError, "has no knob 'prefetch_dept'"):
            policy.prefetch_dept = 2
        self.assertNotIn("prefetch_dept", vars(policy))

    def test_replace_validates(self):
        self.assertEqual(CoherentOffload().replace(prefetch_depth=2).prefetch_depth, 2)
        with self.assertRaisesRegex(ValueError, "must be an int >= 0"):
            CoherentOffload().replace(prefetch_depth=-1)
        with self.assertRaisesRegex(ValueError, "but nothing is offloaded"):
            CoherentOffload(optimizer="host").replace(module_fraction=0)

    def test_unsupported_torch_is_refused_with_the_range(self):
        with mock.patch.object(torch, "__version__", "2.10.0"):
            with self.assertRaisesRegex(RuntimeError, r"supports torch 2\.11 through 2\.15"):
                fsdp2_integration.check_torch_version()


class CoherentOffloadCapacityTest(SingleRankGlooTestCase):

    def test_not_enough_host_memory_fails_before_allocating(self):
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        policy = CoherentOffload(platform="discrete")
        before = memory_stats()
        with mock.patch("torch_fsdp_offload.memory.read_host_available_bytes", return_value=4096):
            with self.assertRaisesRegex(HostMemoryError, "MemAvailable"):
                fully_shard(model[0], offload_policy=policy)
        self.assertEqual(memory_stats()["host_bytes"], before["host_bytes"])

    def test_a_group_mixing_dtypes_is_refused_before_sharding(self):
        # One flat host buffer per group: a bf16 layer beside an fp32 one would be converted.
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
        before = memory_stats()
        with self.assertRaisesRegex(ValueError, r"mix torch.bfloat16, torch.float32\. Cast them to one dtype"):
            fully_shard(model, offload_policy=CoherentOffload(platform="discrete"))
        self.assertEqual(memory_stats()["host_bytes"], before["host_bytes"])
        self.assertEqual(model[1].weight.dtype, torch.bfloat16)
        self.assertNotIsInstance(model[0].weight, DTensor)
        # Each dtype in its own group works (on a fresh model: FSDP marks a module it was applied
        # to, even when that failed).
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
        fully_shard(model[1], offload_policy=CoherentOffload(platform="discrete"))
        fully_shard(model, offload_policy=CoherentOffload(platform="discrete"))
        self.assertEqual((model[0].weight.dtype, model[1].weight.dtype), (torch.float32, torch.bfloat16))

    def test_capacity_counts_the_mirror_only_where_one_is_made(self):
        # 2 x 256 x 256 + 2 x 256 fp32 parameters: master and gradient buffer 8 bytes each, the
        # bf16 mirror 2 more with cast_on="host"; no mirror with "device" or without mixed precision.
        numel = 2 * 256 * 256 + 2 * 256
        asked = {}
        for name, cast_on, mp_policy in (
            ("host", "host", MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
            ("device", "device", MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
            ("fp32", "host", MixedPrecisionPolicy()),
        ):
            gc.collect()  # the previous model's group, never homed, would be counted too
            with mock.patch("torch_fsdp_offload._integration.fsdp2_group_plan.check_host_capacity") as check:
                fully_shard(
                    nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)),
                    mp_policy=mp_policy,
                    offload_policy=CoherentOffload(platform="discrete", cast_on=cast_on),
                )
            asked[name] = check.call_args.args[0]
        self.assertEqual(asked, {"host": 10 * numel, "device": 8 * numel, "fp32": 8 * numel})


class SharedPolicyTest(SingleRankGlooTestCase):
    """One policy object shards any number of models, each as a fresh object would, and is not
    written to by sharding."""


    @staticmethod
    def _blocks_model() -> nn.Module:
        return nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))

    @staticmethod
    def _offloaded(modules: list[nn.Module]) -> list[bool]:
        return [module._get_fsdp_state()._fsdp_param_group._offload.offloaded for module in modules]

    def _shard(self, model: nn.Module, policy: CoherentOffload) -> list[bool]:
        """Shard each block, then the root (no parameters of its own, so no group); which of the
        blocks' groups are offloaded, in order."""
        for block in model:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        return self._offloaded(list(model))

    def test_sharding_leaves_the_policy_unchanged(self):
        policy = CoherentOffload(platform="discrete", module_fraction=0.5, activations=True)
        before = dict(vars(policy))
        self._shard(self._blocks_model(), policy)
        self.assertEqual(vars(policy), before)

    def test_shared_policy_places_each_model_like_a_fresh_one(self):
        shared = CoherentOffload(platform="discrete", module_fraction=0.5)
        fresh = self._shard(self._blocks_model(), shared.replace())
        # Three groups a model: a count carried over would place the next model's True, False, True.
        self.assertEqual(fresh, [False, True, False])
        models = [self._blocks_model() for _ in range(3)]  # kept alive: each is a model of its own
        for model in models:
            self.assertEqual(self._shard(model, shared), fresh)

    def test_models_sharded_in_one_call_each_and_run_place_like_fresh_ones(self):
        shared = CoherentOffload(platform="discrete", module_fraction=0.5)
        placements = []
        models = []
        for _ in range(2):
            model = nn.Linear(8, 8)
            fully_shard(model, offload_policy=shared)
            model(torch.randn(2, 8))  # its first forward completes the model
            placements.extend(self._offloaded([model]))
            models.append(model)
        self.assertEqual(placements, [False, False])

    def test_outer_wrapper_of_a_sharded_root_continues_its_model(self):
        # Blocks, an inner root (the encoder, no group), then the model containing it (a head of
        # its own): one model of 3 groups, the head the third (index 2, offloaded under 0.75), not a
        # new model's first (resident); then a second model like it is placed the same.
        policy = CoherentOffload(platform="discrete", module_fraction=0.75)
        placements, models = [], []
        for _ in range(2):
            encoder = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            model = nn.Sequential(encoder, nn.Linear(8, 8))
            for block in encoder:
                fully_shard(block, offload_policy=policy)
            fully_shard(encoder, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            placements.append(self._offloaded([*encoder, model]))
            models.append(model)
        self.assertEqual(placements, [[False, True, True]] * 2)


class ActivationCheckpointingTest(SingleRankGlooTestCase):
    def test_blocks_recompute_in_backward_with_the_same_gradients_and_names(self):
        def build() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3)))

        reference, model = build(), build()
        keys = list(model.state_dict())
        fully_shard_with_policy(
            model, list(model), CoherentOffload(platform="discrete", optimizer="host"), last_blocks=2,
            activation_checkpointing=True, mesh=init_device_mesh("cpu", (1,)),
        )
        self.assertEqual(list(model.state_dict()), keys)
        calls = []
        for block in model:
            block[0].register_forward_hook(lambda *_: calls.append(1))
        batch = torch.randn(4, 8)
        model(batch).square().sum().backward()
        # Each block's first layer ran in forward and again in backward.
        self.assertEqual(len(calls), 6)
        reference(batch).square().sum().backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            self.assertEqual(param.grad.full_tensor(), expected.grad, msg=name)


instantiate_parametrized_tests(CoherentOffloadKnobsTest)

if __name__ == "__main__":
    run_tests()
