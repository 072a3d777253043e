"""Bad inputs to the entry points that shard a model (``fully_shard_with_policy``, ``plan_and_shard``,
``plan``) and resume one (``load_checkpoint``): each is refused with a message naming the problem
and the fix, before anything is sharded or loaded, and the model then shards with plain
``fully_shard`` and trains like a model that was never refused."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import tempfile

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests

from common_offload import Blocks, RefusalTestCase, SingleRankGlooTestCase
from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, offload_activations
from torch_fsdp_offload.planner import NothingFitsError, plan, plan_and_shard
from torch_fsdp_offload.train import load_checkpoint, save_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TALK = os.path.join(REPO_ROOT, "docs", "examples", "talk_gh200.json")
VOCAB = 32
# Blocks takes hidden states of width 16: four of them are the micro-batch the planner traces.
BATCH = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class TokenBlocks(Blocks):
    """Blocks behind an ``nn.Embedding``: the model takes token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(self.embed(ids))


class _AsTokenIds(nn.Module):
    """Turns the float batch the harness trains with into the token ids a :class:`TokenBlocks` takes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x.abs() * 1000).long() % VOCAB)


def _planned(model: nn.Module, **kwargs) -> object:
    """``plan_and_shard`` of ``model`` for an H200 on PCIe (nothing timed), on ``BATCH``."""
    return plan_and_shard(model, example_input=BATCH, **{"platform": "h200-pcie", **kwargs})


# name -> (policy, message): what fully_shard_with_policy is given where a policy goes.
_POLICIES = {
    "platform_name": ("coherent", r"policy='coherent'\) is no offload policy \(a platform class: "
                                  r"CoherentOffload\(platform='coherent'\) forces it\); pass a CoherentOffload"),
    "policy_class": (CoherentOffload, r"is no offload policy; pass a CoherentOffload, another "
                                      r"torch.distributed.fsdp OffloadPolicy, or None"),
    "knobs_dict": ({"optimizer": "host"}, r"policy=\{'optimizer': 'host'\}\) is no offload policy"),
}
# name -> (blocks of the model, error, message).
_BLOCKS = {
    "reversed": (
        lambda model: list(model.blocks)[::-1], ValueError,
        r"blocks must be in forward order, the order Blocks registers them in: 'blocks.1' is listed before "
        r"'blocks.0', which the model registers first. Pass them in that order \(list\(model.blocks\)",
    ),
    "head_between": (lambda model: [model.blocks[0], model.head, model.blocks[1]], ValueError,
                     "'head' is listed before 'blocks.1'"),
    "foreign": (lambda model: [nn.Linear(16, 16)], ValueError,
                "blocks= holds a Linear that is no submodule of Blocks; pass the model's own block modules"),
    "duplicate": (lambda model: [model.blocks[0], model.blocks[0]], ValueError, "blocks= holds 'blocks.0' twice"),
    "nested": (lambda model: [model.blocks[0], model.blocks], ValueError, "one inside the other"),
    "the_model": (lambda model: [model], ValueError,
                  "blocks holds the model itself, which fully_shard_with_policy shards last"),
    "one_module": (lambda model: model.blocks[0], TypeError,
                   r"blocks is one Linear; pass a sequence of the model's blocks"),
    "one_name": (lambda model: "blocks", TypeError, "blocks is one str"),
}
# name -> (keyword arguments, error, message).
_KEYWORDS = {
    "typo": ({"mp_polcy": MP}, TypeError,
             r"fully_shard_with_policy: fully_shard takes no argument 'mp_polcy' \(did you mean 'mp_policy'\?\); "
             r"it takes mesh, reshard_after_forward, .*mp_policy"),
    "mp_policy_dtype": ({"mp_policy": torch.bfloat16}, TypeError,
                        "fully_shard's mp_policy must be a MixedPrecisionPolicy, got dtype"),
    "mesh_str": ({"mesh": "cpu"}, TypeError, "fully_shard's mesh must be a DeviceMesh, got str"),
    "offload_policy": ({"offload_policy": CoherentOffload()}, ValueError, "places policy itself; drop offload_policy="),
    "last_blocks_above": ({"last_blocks": 3}, ValueError,
                          r"last_blocks must be an int in \[0, 2\] \(the number of blocks\), got 3"),
    "last_blocks_float": ({"last_blocks": 1.0}, ValueError, r"last_blocks must be an int in \[0, 2\]"),
    "last_blocks_bool": ({"last_blocks": True}, ValueError, r"last_blocks must be an int in \[0, 2\]"),
    "keep_unsharded_last_negative": ({"keep_unsharded_last": -1}, ValueError,
                                     r"keep_unsharded_last must be an int in \[0, 2\]"),
    "keep_unsharded_last_and_reshard": ({"keep_unsharded_last": 1, "reshard_after_forward": True}, ValueError,
                                        "pass one of keep_unsharded_last and reshard_after_forward"),
    "spread_fraction_nan": ({"spread_fraction": math.nan}, ValueError, r"spread_fraction must be a number in \[0, 1\]"),
    "spread_fraction_and_last_blocks": ({"spread_fraction": 0.5, "last_blocks": 1}, ValueError,
                                        "both choose the blocks given the policy: pass one"),
}
# name -> (fully_shard_kwargs given to plan_and_shard, error, message).
_FULLY_SHARD_KWARGS = {
    "typo": ({"mp_polcy": MP}, TypeError,
             r"plan_and_shard: fully_shard takes no argument 'mp_polcy' \(did you mean 'mp_policy'\?\)"),
    "not_a_mapping": ([("mp_policy", MP)], TypeError, r"plan_and_shard: the fully_shard keyword arguments must be a "
                                                      r"mapping such as \{'mp_policy': mp\}, got list"),
    "mp_policy_str": ({"mp_policy": "bf16"}, TypeError, "fully_shard's mp_policy must be a MixedPrecisionPolicy, got str"),
    "offload_policy": ({"offload_policy": CoherentOffload()}, ValueError,
                       "plan_and_shard places the plan's offload policy itself: drop offload_policy from "
                       "fully_shard_kwargs"),
}
# name -> (plan keyword arguments given to plan_and_shard, message of the ValueError).
_PLAN_ARGUMENTS = {
    "gpu_memory_inf": ({"gpu_memory_GiB": math.inf},
                       "gpu_memory_GiB must be a positive number of GiB, got inf: pass the finite"),
    "gpu_memory_nan": ({"gpu_memory_GiB": math.nan}, "gpu_memory_GiB must be a positive number of GiB, got nan"),
    "gpu_memory_str": ({"gpu_memory_GiB": "14"}, "gpu_memory_GiB must be a positive number of GiB, got '14'"),
    "gpu_memory_bool": ({"gpu_memory_GiB": True}, "gpu_memory_GiB must be a positive number of GiB, got True"),
    "batch_size_str": ({"batch_size": "4"}, "batch_size must be an int >= 1 or None, got '4'"),
    "batch_size_float": ({"batch_size": 4.0}, "batch_size must be an int >= 1 or None, got 4.0"),
    "seq_len_str": ({"seq_len": "16"}, "seq_len must be an int >= 1 or None, got '16'"),
    "microbatch_factors_str": ({"microbatch_factors": "1,2"},
                               r"microbatch_factors must be a sequence of ints >= 1 .*, got '1,2'"),
    "microbatch_factors_int": ({"microbatch_factors": 2}, "microbatch_factors must be a sequence of ints >= 1"),
    "microbatch_factors_float": ({"microbatch_factors": (1, 2.5)}, "microbatch_factors must be a sequence of ints"),
    "microbatch_factors_zero": ({"microbatch_factors": (0, 1)}, "microbatch_factors must be >= 1"),
    "compute_dtype_str": ({"compute_dtype": "bf16"}, r"compute_dtype must be a floating-point torch.dtype \("
                                                     r"torch.bfloat16, torch.float16 or torch.float32\), got 'bf16'"),
    "compute_dtype_int": ({"compute_dtype": torch.int64}, "compute_dtype must be a floating-point torch.dtype"),
    "reduce_dtype_str": ({"reduce_dtype": "fp32"}, r"reduce_dtype must be a floating-point torch.dtype .* or None"),
    "world_size_float": ({"world_size": 2.0}, "world_size must be an int .*, got 2.0"),
    "world_size_zero": ({"world_size": 0}, "world_size must be >= 1, got 0"),
    "clipping_str": ({"clipping": "yes"}, "clipping must be True or False, got 'yes'"),
    "measure_str": ({"measure": "yes"}, r"measure must be True or False \(or None\), got 'yes'"),
    "platform_int": ({"platform": 5}, "platform must be a profile name .*, a PlatformProfile, or None"),
    "platform_unknown": ({"platform": "h300"}, "unknown platform profile 'h300'"),
    "device_unmeasured": ({"device": "cpu"}, r"device='cpu' says where measure= times, but nothing is measured "
                                             r"\(platform= given\): pass measure=True"),
    "device_unknown": ({"device": "banana", "measure": True}, "device='banana' names no device"),
    "blocks_one_name": ({"blocks": "blocks.0"}, r"blocks='blocks.0' is one name; pass a sequence"),
    "blocks_names_reversed": ({"blocks": ["blocks.1", "blocks.0"]}, "blocks must be in forward order"),
    "blocks_unknown_name": ({"blocks": ["blocks.0", "blocks.7"]},
                            "blocks= names 'blocks.7', which is no submodule of Blocks"),
    "scenario_too": ({"scenario": TALK}, r"plan\(\) needs exactly one of a model or scenario="),
}


@instantiate_parametrized_tests
class FullyShardWithPolicyRefusalTest(RefusalTestCase):
    @parametrize("case", list(_POLICIES))
    def test_policy_that_is_no_offload_policy(self, case) -> None:
        policy, message = _POLICIES[case]
        self.assertRefusalLeavesModelTrainable(
            lambda model: fully_shard_with_policy(model, model.blocks, policy), TypeError, message
        )

    @parametrize("value", ["no", 1, None])
    def test_activation_checkpointing_not_a_bool(self, value) -> None:
        self.assertRefusalLeavesModelTrainable(
            lambda model: fully_shard_with_policy(model, model.blocks, None, activation_checkpointing=value),
            ValueError, f"activation_checkpointing must be True or False, got {re.escape(repr(value))}",
        )

    @parametrize("case", list(_BLOCKS))
    def test_blocks(self, case) -> None:
        choose, error, message = _BLOCKS[case]
        policy = CoherentOffload(platform="discrete")
        self.assertRefusalLeavesModelTrainable(
            lambda model: fully_shard_with_policy(model, choose(model), policy, last_blocks=1), error, message
        )

    @parametrize("case", list(_KEYWORDS))
    def test_keywords(self, case) -> None:
        kwargs, error, message = _KEYWORDS[case]
        policy = CoherentOffload(platform="discrete")
        self.assertRefusalLeavesModelTrainable(
            lambda model: fully_shard_with_policy(model, model.blocks, policy, **kwargs), error, message
        )

    def test_model_that_is_no_module(self) -> None:
        with self.assertRaisesRegex(TypeError, "fully_shard_with_policy shards an nn.Module, got str"):
            fully_shard_with_policy("model", [], None)


@instantiate_parametrized_tests
class PlanAndShardRefusalTest(RefusalTestCase):
    @staticmethod
    def train_step(model: nn.Module) -> list[torch.Tensor]:
        return RefusalTestCase.train_step(_AsTokenIds(model) if isinstance(model, TokenBlocks) else model)

    @parametrize("case", list(_FULLY_SHARD_KWARGS))
    def test_fully_shard_kwargs(self, case) -> None:
        fully_shard_kwargs, error, message = _FULLY_SHARD_KWARGS[case]
        self.assertRefusalLeavesModelTrainable(
            lambda model: _planned(model, fully_shard_kwargs=fully_shard_kwargs), error, message
        )

    @parametrize("case", list(_PLAN_ARGUMENTS))
    def test_plan_arguments(self, case) -> None:
        kwargs, message = _PLAN_ARGUMENTS[case]
        self.assertRefusalLeavesModelTrainable(lambda model: _planned(model, **kwargs), ValueError, message)

    def test_floating_point_token_ids(self) -> None:
        self.assertRefusalLeavesModelTrainable(
            lambda model: plan_and_shard(model, example_input=torch.rand(4, 8) * VOCAB, platform="h200-pcie"),
            ValueError,
            r"example_input holds floating-point values where embed, an nn.Embedding, takes token ids; pass the ids "
            r"as integers \(ids.long\(\)\)",
            make_model=TokenBlocks,
        )
        # The same ids as integers are planned and shard the model.
        model = TokenBlocks()
        plan_and_shard(model, example_input=torch.randint(VOCAB, (4, 8)), platform="h200-pcie")
        self.assertIsInstance(model.blocks[0].weight, DTensor)

    def test_nothing_fits(self) -> None:
        raised = []

        def refuse(model: nn.Module) -> None:
            try:
                _planned(model, gpu_memory_GiB=1e-7)
            except NothingFitsError as error:
                raised.append(error)
                raise

        self.assertRefusalLeavesModelTrainable(
            refuse, NothingFitsError,
            r"plan_and_shard: no setting fits in the budget of 1e-07 GiB per GPU; the smallest needs .* GiB: a "
            r"predicted peak of .* GiB and the allocator's headroom \(modules=1.00 .* at 1x the micro-batch\). Nothing was sharded. What would fit: no smaller "
            r"micro-batch of whole sequences fits with more accumulation either: plan a shorter sequence \(seq_len=\), "
            r"shard over more GPUs \(world_size=\), or give it more GPU memory",
        )
        # The plan is on the error, as plan() returns it; it says what it found.
        result = raised[0].result
        self.assertIsNone(result.training.best)
        self.assertIsInstance(raised[0], ValueError)
        self.assertIn("no setting of the FSDP2 step model fits in GPU memory", result.report())
        self.assertEqual(result.to_dict()["recommended"], plan(Blocks(), example_input=BATCH, platform="h200-pcie",
                                                               gpu_memory_GiB=1e-7).to_dict()["recommended"])

    def test_activation_offload_refused_before_sharding(self) -> None:
        # A plan that offloads activations, applied to a model another offloader already hooks:
        # offload_activations' refusal comes before fully_shard touched a block.
        model = Blocks()
        recommended = dataclasses.replace(_planned(Blocks()).recommended, activations_offload_fraction=0.5)
        offloader = offload_activations(model, blocks=list(model.blocks))
        with self.assertRaisesRegex(ValueError, "already has its activations offloaded by offload_activations"):
            recommended.apply(model)
        self.assertFalse(any(isinstance(p, DTensor) for p in model.parameters()))
        self.assertNotIsInstance(model, FSDPModule)
        offloader.remove()
        recommended.apply(model)
        self.assertIsInstance(model, FSDPModule)

    def test_model_that_is_no_module(self) -> None:
        with self.assertRaisesRegex(TypeError, r"plan_and_shard shards the model itself: pass the nn.Module, got str \("
                                               r"plan\(\) takes model names and configs\)"):
            plan_and_shard("tiny", platform="h200-pcie")

    def test_blocks_given_as_names(self) -> None:
        # Names plan and shard the same blocks as the modules do.
        by_name = Blocks()
        result = _planned(by_name, blocks=["blocks.0", "blocks.1"])
        by_module = Blocks()
        self.assertEqual(result.to_dict(), _planned(by_module, blocks=list(by_module.blocks)).to_dict())
        self.assertEqual(result.recommended.block_names, ("blocks.0", "blocks.1"))
        self.assertTrue(all(isinstance(block.weight, DTensor) for block in by_name.blocks))

    def test_plan_refuses_blocks_out_of_order(self) -> None:
        # plan() alone (it shards nothing) refuses them too, as modules or as names, before tracing.
        model = Blocks()
        for blocks in (["blocks.1", "blocks.0"], list(model.blocks)[::-1]):
            with self.assertRaisesRegex(ValueError, "'blocks.1' is listed before 'blocks.0', which the model registers"):
                plan(model, example_input=BATCH, platform="h200-pcie", blocks=blocks)


class AlreadyShardedRefusalTest(SingleRankGlooTestCase):
    """A model that is already sharded cannot go through the harness (it shards the refused model
    again): here the refused model keeps training exactly like a sharded copy never refused."""

    def assertRefusalKeepsShardedModel(self, refuse, message: str, shard_first) -> None:
        torch.manual_seed(0)
        model = Blocks()
        reference = copy.deepcopy(model)
        for target in (model, reference):
            shard_first(target)
        with self.assertRaisesRegex(ValueError, message):
            refuse(model)
        self.assertEqual(RefusalTestCase.train_step(model), RefusalTestCase.train_step(reference), atol=0, rtol=0)

    def test_fully_shard_with_policy(self) -> None:
        self.assertRefusalKeepsShardedModel(
            lambda model: fully_shard_with_policy(model, model.blocks, CoherentOffload(platform="discrete")),
            "block 0 is already sharded \\(fully_shard ran on it\\); fully_shard_with_policy shards a model that is "
            "not: build the model anew",
            lambda model: fully_shard(model.blocks[0]),
        )
        self.assertRefusalKeepsShardedModel(
            lambda model: fully_shard_with_policy(model, model.blocks, None),
            "the model, block 0 and block 1 are already sharded \\(fully_shard ran on them\\)",
            lambda model: [fully_shard(module) for module in (*model.blocks, model)],
        )

    def test_plan_and_shard(self) -> None:
        self.assertRefusalKeepsShardedModel(
            _planned,
            "'blocks.1' is already sharded \\(fully_shard ran on it\\); plan_and_shard plans and shards a model that "
            "is not: build the model anew, or plan\\(\\) it and shard it yourself",
            lambda model: fully_shard(model.blocks[1]),
        )


class PlanScenarioRefusalTest(RefusalTestCase):
    def test_model_arguments_with_a_scenario(self) -> None:
        # A scenario carries its own micro-batch and timings: these were ignored.
        with self.assertRaisesRegex(
            ValueError, re.escape("batch_size, world_size, clipping only apply to a model; scenario= takes the "
                                  "micro-batch, sequence and timings from the scenario: drop batch_size=, "
                                  "world_size=, clipping=, or plan a model")
        ):
            plan(scenario=TALK, batch_size=4, world_size=2, clipping=True)
        # Their defaults, spelled out, are no arguments given.
        self.assertEqual(plan(scenario=TALK, microbatch_factors=[1, 2, 4, 8], world_size=1).to_dict(),
                         plan(scenario=TALK).to_dict())


class ResumeRefusalTest(SingleRankGlooTestCase):
    """``load_checkpoint`` of a checkpoint that lacks what this run loads names the entries, before
    anything is loaded."""

    def _trained(self, optimizer_class=torch.optim.AdamW, **optimizer_kwargs):
        torch.manual_seed(0)
        model = Blocks()
        for module in (*model.blocks, model):
            fully_shard(module)
        optim = optimizer_class(model.parameters(), lr=1e-2, **optimizer_kwargs)
        model(BATCH).square().mean().backward()
        optim.step()
        return model, optim

    def _assertRefusedUnchanged(self, path: str, message: str) -> None:
        model, optim = self._trained()
        before = [param.full_tensor().clone() for param in model.parameters()]
        state = copy.deepcopy(optim.state_dict())
        with self.assertRaisesRegex(ValueError, message):
            load_checkpoint(path, model, optim)
        self.assertEqual([param.full_tensor() for param in model.parameters()], before, atol=0, rtol=0)
        self.assertEqual(optim.state_dict(), state, atol=0, rtol=0)

    def test_checkpoint_without_optimizer_state(self) -> None:
        # The model's own entries only, as a script of one's own saves them with DCP.
        model, optim = self._trained()
        with tempfile.TemporaryDirectory() as folder:
            dcp.save({"model": get_state_dict(model, optim)[0]}, checkpoint_id=folder)
            self._assertRefusedUnchanged(
                folder,
                f"the checkpoint {re.escape(folder)} holds this model's weights but not the optimizer state and training "
                r"position this run loads: \d+ of this run's entries are missing from it: optim.state.blocks.0.weight.step, "
                r"optim.state.blocks.0.weight.exp_avg, .* and \d+ more. It was not written by save_checkpoint \(train "
                r"--checkpoint-dir\) with this optimizer: point latest at a checkpoint train wrote",
            )

    def test_checkpoint_of_another_optimizer(self) -> None:
        model, optim = self._trained(torch.optim.SGD, momentum=0.9)
        with tempfile.TemporaryDirectory() as folder:
            path = save_checkpoint(folder, model, optim, step=1, data_position=4)
            self._assertRefusedUnchanged(
                path, r"\d+ of this run's entries are missing from it: optim.state.blocks.0.weight.step, "
                r"optim.state.blocks.0.weight.exp_avg, ",
            )
            # The run it was written for resumes from it.
            model, optim = self._trained(torch.optim.SGD, momentum=0.9)
            self.assertEqual(load_checkpoint(path, model, optim), (1, 4))


if __name__ == "__main__":
    run_tests()
