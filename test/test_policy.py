"""CoherentOffload: knob validation, resolution per platform, clear errors before allocation."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_fsdp_offload._integration as fsdp2_integration
import torch_fsdp_offload.placement as placement_module
from common_offload import SingleRankGlooTestCase
from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, measure_placement, OffloadOptimizer
from torch_fsdp_offload.host_step import HostStepRates
from torch_fsdp_offload.placement import choose_placements
from torch_fsdp_offload.memory import HostMemoryError, memory_stats


class CoherentOffloadKnobsTest(TestCase):
    @parametrize(
        "knobs, message",
        [
            ({"prefetch_depth": -1}, "must be an int >= 0"),
            ({"prefetch_depth": 1.5}, "must be an int >= 0"),
            ({"optimizer": "gpu"}, "is not a placement"),
            ({"optimizer": -0.1}, "is not a placement"),
            ({"optimizer": True}, "is not a placement"),
            ({"cast_on": "gpu"}, "is not a cast placement; use 'auto', 'host'"),
            ({"pin_memory": False}, r"pin_memory=False\) is not supported.*CPUOffloadPolicy\(pin_memory=False\)"),
            ({"activations": 1.5}, r"must be True, False or a number in \[0, 1\]"),
            ({"platform": "gh200"}, "is not a platform class"),
            ({"shard_memory": "host"}, "is not a memory kind; use 'auto'"),
        ],
    )
    def test_bad_knob_is_rejected_with_the_fix(self, knobs, message):
        with self.assertRaisesRegex(ValueError, message):
            CoherentOffload(**knobs)

    def test_is_a_cpu_offload_policy(self):
        # FSDP2 only checks isinstance(policy, CPUOffloadPolicy): the subclass is what lets the
        # policy be passed wherever FSDP2 takes an offload policy. Its pin_memory is the base
        # class's default: the shards are pinned.
        self.assertIsInstance(CoherentOffload(), CPUOffloadPolicy)
        self.assertIs(CoherentOffload().pin_memory, CPUOffloadPolicy().pin_memory)
        self.assertIs(CoherentOffload(pin_memory=True).pin_memory, True)

    def test_the_seven_knobs(self):
        # Each knob's measured reason is in docs/ (a knob exists only where no default is right).
        self.assertEqual(
            [field.name for field in dataclasses.fields(CoherentOffload)],
            ["pin_memory", "optimizer", "cast_on", "prefetch_depth", "activations", "platform", "shard_memory"],
        )

    @parametrize(
        "platform, optimizer, expected",
        [
            ("discrete", "auto", ("pinned", True, "split", 0.5)),
            ("discrete", 0.25, ("pinned", True, "split", 0.25)),
            ("discrete", "stream", ("pinned", True, "stream", 1.0)),
            ("coherent", "auto", ("pinned", True, "stream", 1.0)),
            ("unified", "auto", ("device", False, "device", 0.0)),
            ("host_only", "auto", ("host", False, "host", 0.0)),
        ],
    )
    def test_resolve_per_platform(self, platform, optimizer, expected):
        # The plan for a GPU's platform, on any machine: the detected platform's device is this
        # machine's, which is the CPU where no GPU is.
        policy = CoherentOffload(platform=platform, optimizer=optimizer)
        gpu = dataclasses.replace(policy.detect(), device=torch.device("cuda", 0))
        plan = policy.resolve(gpu if platform != "host_only" else None)
        self.assertEqual((plan.memory, plan.copies, plan.optimizer, plan.optimizer_gpu_fraction), expected)
        self.assertIn(platform, plan.describe())

    @parametrize(
        "platform, shard_memory, expected",
        [
            ("discrete", "auto", ("pinned", True, False, "split")),
            ("discrete", "pinned", ("pinned", True, False, "split")),
            ("discrete", "managed", ("managed", True, False, "split")),
            ("coherent", "auto", ("pinned", True, False, "stream")),
            ("coherent", "managed", ("managed", False, True, "host")),
            ("unified", "auto", ("device", False, False, "device")),
            ("unified", "pinned", ("pinned", False, True, "host")),
            ("unified", "managed", ("managed", False, True, "host")),
        ],
    )
    def test_shard_memory_per_platform(self, platform, shard_memory, expected):
        # (memory, copies, read in place, optimizer step): a discrete GPU copies managed shards in
        # as pinned ones; a coherent one reads managed shards in place; a unified one reads either
        # in place, and by default offloads nothing. Where the GPU reads in place, the host steps.
        policy = CoherentOffload(platform=platform, shard_memory=shard_memory)
        gpu = dataclasses.replace(
            policy.detect(), device=torch.device("cuda", 0),
            attributes={"ManagedMemory": 1, "ConcurrentManagedAccess": 1},
        )
        plan = policy.resolve(gpu)
        self.assertEqual((plan.memory, plan.copies, plan.reads_in_place, plan.optimizer), expected)
        self.assertEqual(plan.offloads, plan.memory in ("pinned", "managed"))

    def test_shard_memory_the_platform_cannot_give_is_refused(self):
        no_managed = dataclasses.replace(
            CoherentOffload(platform="discrete").detect(), device=torch.device("cuda", 0),
            attributes={"ManagedMemory": 1, "ConcurrentManagedAccess": 0},
        )
        with self.assertRaisesRegex(ValueError, r"cannot share managed memory.*ConcurrentManagedAccess': 0.*'pinned'"):
            CoherentOffload(platform="discrete", shard_memory="managed").resolve(no_managed)
        with self.assertRaisesRegex(ValueError, "no accelerator.*Drop shard_memory="):
            CoherentOffload(platform="host_only", shard_memory="pinned").resolve()
        with self.assertRaisesRegex(ValueError, "optimizer='stream'.*the GPU reads the shards in place"):
            CoherentOffload(platform="unified", shard_memory="managed", optimizer="stream").resolve()

    def test_unified_platform_steps_where_the_shards_are(self):
        # One DRAM: the shards are the GPU's allocation, stepped there in place; without a GPU
        # (a forced kind on a CPU machine) they are the host's, stepped on the host.
        policy = CoherentOffload(platform="unified")
        for device, optimizer in (("cuda", "device"), ("cpu", "host")):
            plan = policy.resolve(dataclasses.replace(policy.detect(), device=torch.device(device)))
            self.assertEqual((plan.memory, plan.copies, plan.optimizer), ("device", False, optimizer), device)

    @parametrize("platform, fraction", [("discrete", 0.5), ("coherent", 1.0)])
    def test_auto_is_decided_from_the_platform_without_measuring(self, platform, fraction):
        # On a GPU machine too "auto" comes from the platform class alone: the same plan on every
        # run and rank, with no timing inside resolve() (or fully_shard, which calls it).
        gpu = dataclasses.replace(CoherentOffload(platform=platform).detect(), device=torch.device("cuda", 0))
        timing = AssertionError("resolve() ran a measurement")
        with mock.patch.object(placement_module, "measure_host_step", side_effect=timing), \
                mock.patch.object(placement_module, "measure_bandwidth", side_effect=timing):
            plans = [CoherentOffload(platform=platform).resolve(gpu) for _ in range(2)]
            # An explicit knob is kept; "auto" beside it is decided alike.
            host_stepped = CoherentOffload(platform=platform, optimizer="host").resolve(gpu)
            device_cast = CoherentOffload(platform=platform, cast_on="device").resolve(gpu)
        self.assertEqual(plans[0], plans[1])
        self.assertEqual((plans[0].optimizer_gpu_fraction, plans[0].cast_on), (fraction, "host"))
        self.assertEqual((host_stepped.optimizer_gpu_fraction, host_stepped.cast_on), (0.0, "host"))
        self.assertEqual((device_cast.optimizer_gpu_fraction, device_cast.cast_on), (fraction, "device"))

    def test_measure_placement_is_an_explicit_call(self):
        # Without a GPU there is no link to measure.
        with self.assertRaisesRegex(ValueError, "measure_placement needs a CUDA device, got cpu"):
            measure_placement("cpu")
        # On a GPU it advises what choose_placements picks from the rates it measured (the
        # measurements themselves stand in here: timing never runs in a test).
        host = HostStepRates(
            alone_s_per_param=0.3e-9, link_busy_s_per_param=0.8e-9, link_GBps_meanwhile=50.0,
            alone_cast_s_per_param=0.1e-9, link_busy_cast_s_per_param=0.28e-9,
        )
        link = mock.Mock(h2d_gbps=54.0, d2h_gbps=54.0, bidirectional_gbps=97.0)
        with mock.patch.object(placement_module, "resolve_device", return_value=torch.device("cuda", 0)), \
                mock.patch.object(placement_module.torch.cuda, "device", return_value=contextlib.nullcontext()), \
                mock.patch.object(placement_module, "measure_host_step", return_value=host), \
                mock.patch.object(placement_module, "measure_bandwidth", return_value=link) as measured:
            advice = measure_placement(0)
        measured.assert_called_once()
        self.assertEqual((advice.rates.adamw_s_per_param, advice.rates.cast_s_per_param), (0.8e-9 - 0.28e-9, 0.28e-9))
        self.assertEqual((advice.rates.h2d_GBps, advice.rates.both_GBps), (54.0, 97.0))
        self.assertEqual((advice.cast_on, advice.optimizer), choose_placements(advice.rates))
        self.assertEqual(CoherentOffload(platform="discrete", **advice.policy_kwargs()).resolve().cast_on, advice.cast_on)

    def test_cast_placement_is_in_the_plan(self):
        self.assertEqual(CoherentOffload(platform="discrete").resolve().cast_on, "host")
        plan = CoherentOffload(platform="discrete", cast_on="device").resolve()
        self.assertEqual(plan.cast_on, "device")
        self.assertIn("cast to the compute dtype on the device", plan.describe())

    @parametrize(
        "knob, value, replacement",
        [
            ("memory", "managed", "renamed shard_memory: .auto.*.pinned. or .managed."),
            ("offload_params", False, "no offload_policy.*offload_activations"),
            ("offload_grads", True, "no offload_policy.*offload_activations"),
            ("offload_optimizer_state", True, "no offload_policy.*offload_activations"),
            ("chunk_bytes", 64 << 20, "DEFAULT_CHUNK_BYTES \\(64 MiB"),
            ("module_fraction", 0.5, r"per module.*fully_shard_with_policy\(.*last_blocks=k\).*spread_fraction=f"),
        ],
    )
    def test_removed_knob_names_its_replacement(self, knob, value, replacement):
        # Refused at construction, by replace() and on assignment, saying what to do instead.
        with self.assertRaisesRegex(TypeError, f"CoherentOffload\\({knob}=.*was removed.*{replacement}"):
            CoherentOffload(**{knob: value})
        with self.assertRaisesRegex(TypeError, f"{knob}=.*{replacement}"):
            CoherentOffload().replace(**{knob: value})
        policy = CoherentOffload()
        with self.assertRaisesRegex(AttributeError, f"CoherentOffload.{knob}: .*{replacement}"):
            setattr(policy, knob, value)
        self.assertNotIn(knob, vars(policy))

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
        self.assertFalse(CoherentOffload(activations=True, platform=platform).resolve().copies)

    @parametrize(
        "name, value, message",
        [
            ("prefetch_depth", -1, "must be an int >= 0"),
            ("activations", 2.0, r"in \[0, 1\]"),
            ("optimizer", "gpu", "is not a placement"),
            ("pin_memory", False, "is not supported"),
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
        with self.assertRaisesRegex(TypeError, "partial offload is per module"):
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


class PerModulePlacementTest(SingleRankGlooTestCase):
    """Placement is per module: a module sharded with the policy is offloaded, one sharded without
    it is not; one policy object shards any number of models alike, its knobs unchanged."""

    @staticmethod
    def _blocks_model(n_blocks: int = 3) -> nn.Module:
        return nn.Sequential(*(nn.Linear(8, 8) for _ in range(n_blocks)))

    @staticmethod
    def _offloaded(modules: list[nn.Module]) -> list[bool]:
        return [fsdp2_integration.fsdp2_shards_on_host(module) for module in modules]

    def test_sharding_leaves_the_policy_unchanged(self):
        policy = CoherentOffload(platform="discrete", activations=True)
        before = dataclasses.asdict(policy)
        model = self._blocks_model()
        fully_shard_with_policy(model, list(model), None)
        model = self._blocks_model()
        fully_shard_with_policy(model, list(model), policy, spread_fraction=0.5)
        self.assertEqual(dataclasses.asdict(policy), before)
        # A copy carries the knobs, not what this object's calls accumulated: it is not frozen.
        copy.copy(policy).prefetch_depth = 2

    def test_the_modules_given_the_policy_are_offloaded(self):
        shared = CoherentOffload(platform="discrete")
        # Given to blocks 0 and 2 only: those two are offloaded, whatever the order of the calls.
        model = self._blocks_model()
        for index, block in enumerate(model):
            fully_shard(block, offload_policy=shared if index != 1 else OffloadPolicy())
        fully_shard(model)
        self.assertEqual(self._offloaded(list(model)), [True, False, True])
        # Every model given the same object is placed alike: nothing is counted across models.
        models = [self._blocks_model() for _ in range(3)]
        for model in models:
            fully_shard(model[1], offload_policy=shared)
            fully_shard(model, offload_policy=shared)
            self.assertEqual(self._offloaded(list(model)), [False, True, False])

    @parametrize(
        "placement, expected",
        [
            ({}, [True] * 8),
            ({"last_blocks": 3}, [False] * 5 + [True] * 3),
            ({"spread_fraction": 0.5}, [False, True] * 4),
            ({"spread_fraction": 0.625}, [False, True, False, True, True, False, True, True]),
            ({"spread_fraction": 0.0}, [False] * 8),
        ],
    )
    def test_fully_shard_with_policy_chooses_the_blocks(self, placement, expected):
        # The blocks its docstring names; the root only where every block has the policy. A model
        # whose root holds parameters of its own (a head) shows the root's placement.
        model = nn.Sequential(self._blocks_model(8), nn.Linear(8, 8))
        blocks = list(model[0])
        fully_shard_with_policy(model, blocks, CoherentOffload(platform="discrete"), **placement)
        self.assertEqual(self._offloaded(blocks), expected)
        self.assertEqual(self._offloaded([model]), [not placement])

    def test_fully_shard_with_policy_refuses_two_choices_of_blocks(self):
        model = self._blocks_model()
        for kwargs, message in (
            ({"last_blocks": 1, "spread_fraction": 0.5}, "pass one"),
            ({"spread_fraction": 1.5}, r"spread_fraction must be a number in \[0, 1\]"),
            ({"spread_fraction": True}, r"spread_fraction must be a number in \[0, 1\]"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                fully_shard_with_policy(model, list(model), CoherentOffload(), **kwargs)
        self.assertEqual(self._offloaded(list(model)), [False] * 3)

    def test_default_pin_memory_shards_and_trains(self):
        # pin_memory=True (the base class's default) is the policy's own exact-size buffers:
        # FSDP's pin_memory() (impossible without an accelerator, as here) never runs.
        model = self._blocks_model()
        fully_shard_with_policy(model, list(model), CoherentOffload(platform="discrete"))
        self.assertEqual(self._offloaded(list(model)), [True] * 3)
        optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        before = [param.full_tensor().clone() for param in model.parameters()]
        model(torch.randn(2, 8)).square().sum().backward()
        optim.step()
        optim.synchronize()
        self.assertTrue(all(not torch.equal(param.full_tensor(), old) for param, old in zip(model.parameters(), before)))


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
instantiate_parametrized_tests(PerModulePlacementTest)

if __name__ == "__main__":
    run_tests()
