"""OffloadOptimizer refuses what it cannot do exactly: bad arguments at construction, gradients
changed after groups already stepped during backward, optimizer state of another class or shape;
and says so once when it has nothing to offload.

Offloaded models use the forced ``discrete`` platform on the CPU (see CONTRIBUTING.md), so the
groups really step on the host during backward, as on a GPU machine.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import math
import os
import re
import warnings
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from common_offload import GlooMultiProcessTestCase, HostStepGate, RefusalTestCase, SingleRankGlooTestCase
from test_fsdp2_offload import _batch, _loss, _shard, REPO_ROOT, STEPS, TiedBlocksModel
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
from torch_fsdp_offload.optimizer import host_steps
from torch_fsdp_offload.optimizer.pending_updates import PendingUpdate

NOTHING_OFFLOADED = "none of its parameters was sharded with CoherentOffload"


def _plain_optimizer(model: nn.Module, *args, **kwargs) -> OffloadOptimizer:
    """An OffloadOptimizer over a model without offload (its warning expected and silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f".*{NOTHING_OFFLOADED}")
        return OffloadOptimizer(model, *args, **kwargs)


class OffloadOptimizerArgumentTest(TestCase):
    def test_bad_arguments_are_refused_at_construction(self):
        model = nn.Linear(4, 3)
        nan, inf = float("nan"), float("inf")
        cases = [
            ({"lr": "x"}, TypeError, r"lr='x'\) must be a real number or a one-element tensor"),
            ({"lr": True}, TypeError, r"lr=True\) must be a real number"),
            ({"lr": inf}, ValueError, r"lr=inf\) must be finite and >= 0"),
            ({"lr": nan}, ValueError, r"lr=nan\) must be finite and >= 0"),
            ({"lr": -1e-3}, ValueError, r"lr=-0.001\) must be finite and >= 0"),
            ({"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"lr=tensor\(\[.*\]\)\) must be a one-element tensor"),
            ({"lr": torch.tensor(inf)}, ValueError, r"lr=tensor\(inf\)\) must be finite and >= 0"),
            ({"max_grad_norm": "1"}, TypeError, r"max_grad_norm='1'\) must be a real number > 0 or None"),
            ({"max_grad_norm": True}, TypeError, r"max_grad_norm=True\) must be a real number > 0 or None"),
            ({"max_grad_norm": 0}, ValueError, r"max_grad_norm=0\) must be finite and > 0"),
            ({"max_grad_norm": -1.0}, ValueError, r"max_grad_norm=-1.0\) must be finite and > 0"),
            ({"max_grad_norm": nan}, ValueError, r"max_grad_norm=nan\) must be finite and > 0"),
            ({"max_grad_norm": inf}, ValueError, r"max_grad_norm=inf\) must be finite and > 0"),
            ({"host_threads": 1.5}, TypeError, r"host_threads=1.5\) must be an int >= 1 or None"),
            ({"host_threads": "4"}, TypeError, r"host_threads='4'\) must be an int >= 1 or None"),
            ({"host_threads": True}, TypeError, r"host_threads=True\) must be an int >= 1 or None"),
            ({"host_threads": 0}, ValueError, r"host_threads=0\) must be an int >= 1 or None"),
            ({"host_threads": -1}, ValueError, r"host_threads=-1\) must be an int >= 1 or None"),
            ({"step_during_backward": "no"}, TypeError, r"step_during_backward='no'\) must be True or False"),
            ({"skip_nonfinite": None}, TypeError, r"skip_nonfinite=None\) must be True or False"),
            (
                {"skip_nonfinite": True, "step_during_backward": True},
                ValueError,
                r"skip_nonfinite=True, step_during_backward=True\).*cannot be undone",
            ),
            ({"overlap_next_forward": 1}, TypeError, r"overlap_next_forward=1\) must be True, False or None"),
            ({"betaz": (0.9, 0.99)}, TypeError, r"AdamW\(.*\) refused the optimizer arguments: .*betaz"),
            ({"betas": (0.9, 2.0)}, ValueError, r"AdamW\(.*\) refused the optimizer arguments: .*beta"),
        ]
        for kwargs, error, message in cases:
            with self.subTest(kwargs=kwargs), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with self.assertRaisesRegex(error, message):
                    OffloadOptimizer(model, torch.optim.AdamW, **kwargs)
                # Refused before anything was built: not even the nothing-offloaded warning.
                self.assertEqual([str(w.message) for w in caught], [])
        # A learning rate per parameter group is held to the same rule, when it is given.
        with self.assertRaisesRegex(ValueError, r"param_groups\[1\]\['lr'\]=inf\) must be finite and >= 0"):
            OffloadOptimizer([{"params": [model.weight]}, {"params": [model.bias], "lr": inf}], torch.optim.AdamW)
        with self.assertRaisesRegex(TypeError, r"got an instance of AdamW: pass the class itself, not an instance"):
            OffloadOptimizer(model, torch.optim.AdamW(model.parameters()))
        with self.assertRaisesRegex(TypeError, r"optimizer_class=OffloadOptimizer\) cannot wrap itself"):
            OffloadOptimizer(model, OffloadOptimizer)
        # What torch.optim accepts stays accepted: a tensor lr, an lr of 0, ints.
        for kwargs in ({"lr": torch.tensor(1e-3)}, {"lr": 0.0}, {"lr": 1}, {"max_grad_norm": 1}, {"host_threads": 2}):
            with self.subTest(kwargs=kwargs):
                _plain_optimizer(model, torch.optim.AdamW, **kwargs)

    def test_fused_by_default_where_it_runs_on_every_tensor(self):
        # The fused CPU kernel steps host groups several times faster: it is the default where it
        # also runs on DTensors (Adam, AdamW: the parameters no group offloads, and plain FSDP2's),
        # unless the caller chose an implementation, or a step the fused kernels refuse.
        model = nn.Linear(4, 3)
        self.assertIs(_plain_optimizer(model, torch.optim.AdamW, lr=1e-3).defaults["fused"], True)
        self.assertIs(_plain_optimizer(model, torch.optim.Adam, lr=1e-3).defaults["fused"], True)
        # SGD's and Adagrad's fused kernels have no DTensor rule: their default implementation.
        self.assertIsNone(_plain_optimizer(model, torch.optim.SGD, lr=1e-3).defaults["fused"])
        self.assertIsNone(_plain_optimizer(model, torch.optim.Adagrad, lr=1e-3).defaults["fused"])
        self.assertIs(_plain_optimizer(model, torch.optim.SGD, lr=1e-3, fused=True).defaults["fused"], True)
        self.assertIs(_plain_optimizer(model, torch.optim.AdamW, lr=1e-3, fused=False).defaults["fused"], False)
        self.assertIn(_plain_optimizer(model, torch.optim.AdamW, lr=1e-3, foreach=True).defaults["fused"], (None, False))
        self.assertIn(_plain_optimizer(model, torch.optim.AdamW, lr=1e-3, differentiable=True).defaults["fused"], (None, False))
        self.assertNotIn("fused", _plain_optimizer(model, torch.optim.Adadelta, lr=1e-3).defaults)
        # Not for a complex parameter, which the fused kernels refuse.
        self.assertIsNone(_plain_optimizer([nn.Parameter(torch.zeros(2, dtype=torch.complex64))], torch.optim.AdamW).defaults["fused"])

    def test_no_offloaded_group_warns_once(self):
        model = nn.Linear(4, 3)
        with self.assertWarnsRegex(UserWarning, rf"{NOTHING_OFFLOADED}.*steps them as AdamW alone would"):
            optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                optim.step()
                optim.zero_grad()
        self.assertEqual([str(w.message) for w in caught], [])

    def test_state_of_another_class_or_shape_is_refused_and_changes_nothing(self):
        def trained(model, optimizer_class, **kwargs):
            optim = _plain_optimizer(model, optimizer_class, lr=1e-2, **kwargs)
            model(torch.ones(2, next(model.parameters()).shape[1])).sum().backward()
            optim.step()
            optim.zero_grad()
            return optim

        optim = trained(nn.Linear(4, 3), torch.optim.AdamW)
        before = copy.deepcopy(optim.state_dict())
        cases = [
            (trained(nn.Linear(4, 3), torch.optim.SGD, momentum=0.9).state_dict(),
             r"saved by another optimizer class than AdamW: its parameter groups lack betas, eps \(and have "
             r"dampening, momentum, nesterov\)\. Load a checkpoint of AdamW"),
            (trained(nn.Linear(5, 3), torch.optim.AdamW).state_dict(),
             r"parameter 'weight' \(index 0\): the saved state 'exp_avg' has shape \(3, 5\), "
             r"this parameter has shape \(3, 4\).*same model configuration"),
            (trained(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3)), torch.optim.AdamW).state_dict(),
             r"saved parameter group 0 holds 4 parameters, this optimizer's holds 2\. Load the state saved from this model"),
        ]
        for state_dict, message in cases:
            with self.subTest(message=message):
                with self.assertRaisesRegex(ValueError, message):
                    optim.load_state_dict(state_dict)
                self.assertEqual(optim.state_dict(), before)
        # A second parameter group where the model had one.
        two_groups = copy.deepcopy(before)
        two_groups["param_groups"].append({**two_groups["param_groups"][0], "params": []})
        with self.assertRaisesRegex(ValueError, r"holds 2 parameter groups, this optimizer has 1"):
            optim.load_state_dict(two_groups)
        # The optimizer's own state, and a plain AdamW's, still load.
        optim.load_state_dict(before)
        model = nn.Linear(4, 3)
        plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 4)).sum().backward()
        plain.step()
        optim.load_state_dict(plain.state_dict())

    def test_the_documented_bool_refusals_are_what_happens(self):
        # docs/usage.md's refusal table names the arguments that "must be True or False": each,
        # spelt as the table spells it, raises that TypeError (an argument OffloadOptimizer does
        # not have would reach the wrapped class instead, with its own error).
        with open(os.path.join(REPO_ROOT, "docs", "usage.md")) as doc:
            row = next(line for line in doc if '"must be True or False"' in line)
        spelt = re.findall(r"`(\w+)=([^`]+)`", row.split("|")[1])
        self.assertGreaterEqual(len(spelt), 2, row)
        for name, value in spelt:
            with self.subTest(name=name), self.assertRaisesRegex(TypeError, rf"OffloadOptimizer\({name}=.*\) must be True or False"):
                OffloadOptimizer(nn.Linear(4, 3), torch.optim.AdamW, **{name: ast.literal_eval(value)})


# What OffloadOptimizer refuses of the wrapped class's arguments, whatever the model: the error, and
# what it says (the argument it names).
_REFUSED_OPTIMIZER_ARGUMENTS = [
    (torch.optim.AdamW, {"betas": (0.9,)}, ValueError, r"AdamW\(betas=\(0.9,\)\) must be a tuple of 2 values, like its default betas=\(0.9, 0.999\)"),
    (torch.optim.AdamW, {"betas": 0.9}, TypeError, r"AdamW\(betas=0.9\) must be a tuple of 2 values"),
    (torch.optim.AdamW, {"betas": (0.9, 0.99, 0.5)}, ValueError, r"AdamW\(betas=\(0.9, 0.99, 0.5\)\) must be a tuple of 2"),
    (torch.optim.Rprop, {"etas": (0.5,)}, ValueError, r"Rprop\(etas=\(0.5,\)\) must be a tuple of 2 values"),
    # Only the argument the class refuses is named, not those it takes.
    (torch.optim.AdamW, {"lr": 1e-3, "eps": "x"}, TypeError, r"AdamW\(eps='x'\) refused the optimizer arguments"),
    (torch.optim.AdamW, {"betas": (0.9, "x")}, TypeError, r"AdamW\(betas=\(0.9, 'x'\)\) refused the optimizer arguments"),
    (torch.optim.AdamW, {"fused": True, "foreach": True}, ValueError, r"AdamW\(fused=True, foreach=True\) refused the optimizer arguments"),
    # A keyword no class takes names OffloadOptimizer's own.
    (torch.optim.AdamW, {"overlap": True}, TypeError, r"AdamW\(overlap=True\) refused .*OffloadOptimizer's own arguments are "
     r"step_during_backward, max_grad_norm, skip_nonfinite, host_threads, overlap_next_forward"),
    (torch.optim.LBFGS, {}, TypeError, r"optimizer_class=LBFGS\) cannot run it: LBFGS re-evaluates the model through its closure"),
]


@instantiate_parametrized_tests
class OptimizerArgumentRefusalTest(RefusalTestCase):
    @parametrize("optimizer_class, kwargs, error, message", _REFUSED_OPTIMIZER_ARGUMENTS)
    def test_refused_before_anything_changes(self, optimizer_class, kwargs, error, message):
        self.assertRefusalLeavesModelTrainable(lambda model: OffloadOptimizer(model, optimizer_class, **kwargs), error, message)


def _trained(model: nn.Module, make_optimizer, steps: int = 2) -> list[torch.Tensor]:
    """``model``'s parameters after ``steps`` steps of ``make_optimizer(model.parameters())``."""
    optim = make_optimizer(model.parameters())
    for step in range(steps):
        _loss(model, _batch(step, 0)).backward()
        optim.step()
        optim.zero_grad()
    return [param.full_tensor() for param in model.parameters()]


def _assert_trains_alike(test: TestCase, model: nn.Module, reference: nn.Module) -> None:
    """``model`` (a refusal's) trains exactly like ``reference`` (never refused) with OffloadOptimizer."""

    def offload_optimizer(params):
        return OffloadOptimizer(params, torch.optim.AdamW, lr=1e-2)

    test.assertEqual(_trained(model, offload_optimizer), _trained(reference, offload_optimizer), atol=0, rtol=0)


class RefusedOverShardedParametersTest(SingleRankGlooTestCase):
    """What OffloadOptimizer cannot run over FSDP2's parameters is refused at construction; the
    model then trains exactly like one that was never refused."""

    def _assert_refusal_leaves_model_trainable(self, refuse, error, message, **shard_kwargs):
        torch.manual_seed(0)
        model = TiedBlocksModel()
        reference = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (1,))
        for m in (model, reference):
            _shard(m, CoherentOffload(platform="discrete", optimizer=0.5), mesh, MixedPrecisionPolicy(), **shard_kwargs)
        with self.assertRaisesRegex(error, message):
            refuse(model)
        _assert_trains_alike(self, model, reference)

    def test_classes_that_cannot_step_shards(self):
        for optimizer_class, message in (
            (torch.optim.SparseAdam, r"optimizer_class=SparseAdam\) cannot step FSDP2's sharded parameters: it steps sparse gradients only"),
            (torch.optim.Adafactor, r"optimizer_class=Adafactor\) cannot step FSDP2's sharded parameters: Adafactor's step is not elementwise"),
            (torch.optim.Muon, r"optimizer_class=Muon\) cannot step FSDP2's sharded parameters: Muon's step is not elementwise"),
        ):
            with self.subTest(optimizer_class=optimizer_class.__name__):
                self._assert_refusal_leaves_model_trainable(lambda model: OffloadOptimizer(model, optimizer_class), TypeError, message)

    def test_fused_true_where_parameters_step_as_dtensors(self):
        # SGD's and Adagrad's fused kernels have no DTensor rule: the groups no policy offloads
        # (here all but the last block) would fail at the first step() deep inside torch.
        for optimizer_class in (torch.optim.SGD, torch.optim.Adagrad):
            with self.subTest(optimizer_class=optimizer_class.__name__):
                self._assert_refusal_leaves_model_trainable(
                    lambda model: OffloadOptimizer(model, optimizer_class, fused=True),
                    ValueError,
                    rf"OffloadOptimizer\({optimizer_class.__name__}, fused=True\): {optimizer_class.__name__}'s fused kernel "
                    r"does not run on DTensors .* 11 of these FSDP2 parameters would step as DTensors.* Drop fused=True",
                    last_blocks=1,
                )
        # Where every parameter is offloaded, each step runs on plain shards: fused=True runs.
        model = _shard(TiedBlocksModel(), CoherentOffload(platform="discrete", optimizer="host"), None, MixedPrecisionPolicy())
        optim = OffloadOptimizer(model, torch.optim.SGD, fused=True)
        _loss(model, _batch(0, 0)).backward()
        optim.step()
        optim.synchronize()


def _optimizer_classes() -> list[type]:
    """Every optimizer class of this torch's ``torch.optim``."""
    return [
        value for value in vars(torch.optim).values()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    ]


# The classes OffloadOptimizer refuses over FSDP2's parameters, with what the refusal says.
_REFUSED_CLASSES = {
    torch.optim.LBFGS: "closure several times",
    torch.optim.SparseAdam: "sparse gradients only",
    torch.optim.Adafactor: "not elementwise",
    torch.optim.Muon: "not elementwise",
}


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _full_state(optim: torch.optim.Optimizer) -> dict:
    """``optim``'s state, its DTensors as full tensors (to compare with another sharding's), gathered
    in parameter order on every rank (OffloadOptimizer's groups first step in the order their
    gradients land, which may differ between ranks)."""
    state = optim.state_dict()["state"]
    return {index: {key: _full(value) for key, value in state[index].items()} for index in sorted(state)}


class _EveryOptimizerClass(GlooMultiProcessTestCase):
    """Every ``torch.optim`` class with OffloadOptimizer's defaults (no argument at all): it
    constructs, steps and trains bit for bit as the class itself (parameters and state), or is
    refused at construction. Half the groups are streamed and half stepped on the host, so both
    paths run; the tests run in processes of their own, where a crash in a kernel fails the test."""

    def _train(self, model, optim, steps: int = 3) -> tuple[list[torch.Tensor], dict]:
        for step in range(steps):
            _loss(model, _batch(step, self.rank)).backward()
            optim.step()
            optim.zero_grad()
        return [_full(param.detach()) for param in model.parameters()], _full_state(optim)

    def _compare(self, reference_mesh) -> list[type]:
        """Each class against itself over ``reference_mesh``'s plain FSDP2 (None: the unsharded
        model); returns the classes torch's DTensor could not step in that reference."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        reference_failed = []
        for optimizer_class in _optimizer_classes():
            with self.subTest(optimizer_class=optimizer_class.__name__):
                torch.manual_seed(0)
                reference = TiedBlocksModel()
                model = copy.deepcopy(reference)
                _shard(model, CoherentOffload(platform="discrete", optimizer=0.5), mesh, MixedPrecisionPolicy())
                if optimizer_class in _REFUSED_CLASSES:
                    with self.assertRaisesRegex(TypeError, _REFUSED_CLASSES[optimizer_class]):
                        OffloadOptimizer(model, optimizer_class)
                    continue
                optim = OffloadOptimizer(model, optimizer_class)
                fused = optim.optimizer_kwargs.get("fused")
                self.assertIs(fused, True if optimizer_class in (torch.optim.Adam, torch.optim.AdamW) else None)
                if reference_mesh is not None:
                    _shard(reference, None, reference_mesh, MixedPrecisionPolicy())
                reference_optim = optimizer_class(reference.parameters(), **optim.optimizer_kwargs)
                # As the class keeps it from construction on (Adagrad's is made there).
                self.assertEqual(_full_state(optim), _full_state(reference_optim), atol=0, rtol=0)
                trained = self._train(model, optim)
                self.assertTrue(all(torch.isfinite(param).all() for param in trained[0]))
                try:
                    expected = self._train(reference, reference_optim)
                except (RuntimeError, NotImplementedError):  # torch's DTensor has no rule for one of its ops
                    reference_failed.append(optimizer_class)
                    continue
                self.assertEqual(trained, expected, atol=0, rtol=0)
        return reference_failed


class EveryOptimizerClassTest(_EveryOptimizerClass):
    WORLD_SIZE = 2

    def test_every_class_as_over_plain_fsdp2(self):
        self.init_gloo()
        reference_failed = self._compare(init_device_mesh("cpu", (self.world_size,)))
        # Rprop's in-place indexing has no DTensor rule before torch 2.15, so plain FSDP2 cannot
        # step it there; OffloadOptimizer steps plain shards, exact (the world size 1 test).
        self.assertLessEqual(set(reference_failed), {torch.optim.Rprop})


class EveryOptimizerClassWorldSize1Test(_EveryOptimizerClass):
    WORLD_SIZE = 1

    def test_every_class_as_over_the_unsharded_model(self):
        # On one rank a parameter's shard is all of it: the class over the unsharded model is the
        # reference for every class, those plain FSDP2 cannot step included.
        self.init_gloo()
        self.assertEqual(self._compare(None), [])

    def test_state_made_at_construction_and_a_group_added_later(self):
        # Adagrad makes its state at construction, for the groups it was built with only: a group
        # added later gets its state at its first step (torch >= 2.12; before, the class raises
        # KeyError there, and so does the wrapper), also where the GPU's copy of the class (built
        # over placeholders, whose own state must not be stepped) streams it.
        self.init_gloo()
        torch.manual_seed(0)
        reference = TiedBlocksModel()
        model = copy.deepcopy(reference)
        _shard(model, CoherentOffload(platform="discrete", optimizer="stream"), None, MixedPrecisionPolicy())
        trained = []
        for m, optimizer_class in ((reference, torch.optim.Adagrad), (model, functools.partial(OffloadOptimizer, optimizer_class=torch.optim.Adagrad))):
            params = list(m.parameters())
            optim = optimizer_class(params[:1], fused=True)
            optim.add_param_group({"params": params[1:]})
            try:
                trained.append(self._train(m, optim))
            except KeyError as error:
                trained.append(repr(error))
        self.assertEqual(trained[1], trained[0], atol=0, rtol=0)


class PolicyFixedOnceItShardedTest(SingleRankGlooTestCase):
    """A ``CoherentOffload`` that sharded modules planned their groups (and the optimizer's
    placement, the activation offloader) with its knobs: a later change would not reach them, so
    every knob is fixed from then on, and the model trains as sharded."""

    # A valid value of every knob (pin_memory's only one).
    CHANGES = {"pin_memory": True, "optimizer": "host", "cast_on": "device", "prefetch_depth": 2, "activations": True, "platform": "host_only",
               "shard_memory": "managed"}

    def test_every_knob_is_fixed_once_the_policy_sharded_a_module(self):
        self.assertEqual(set(self.CHANGES), {field.name for field in dataclasses.fields(CoherentOffload)})
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = TiedBlocksModel()
        reference = copy.deepcopy(model)
        policy = CoherentOffload(platform="discrete", optimizer=0.5)
        for name, value in self.CHANGES.items():  # free until it shards
            unchanged = getattr(policy, name)
            setattr(policy, name, value)
            setattr(policy, name, unchanged)
        _shard(model, policy, mesh, MixedPrecisionPolicy())
        _shard(reference, CoherentOffload(platform="discrete", optimizer=0.5), mesh, MixedPrecisionPolicy())
        before = dict(vars(policy))
        for name, value in self.CHANGES.items():
            with self.subTest(knob=name), self.assertRaisesRegex(
                dataclasses.FrozenInstanceError,
                rf"CoherentOffload\.{name} = {re.escape(repr(value))}: this policy already sharded modules.*would not see "
                rf"the change\. Build a new policy for the modules to shard next: policy\.replace\({name}={re.escape(repr(value))}\)",
            ):
                setattr(policy, name, value)
        with self.assertRaisesRegex(dataclasses.FrozenInstanceError, r"del CoherentOffload\.activations: this policy already sharded"):
            del policy.activations
        self.assertEqual(vars(policy), before)
        # replace() builds another policy, free until it shards in turn.
        other = policy.replace(optimizer="host")
        other.prefetch_depth = 2
        self.assertEqual((other.optimizer, other.prefetch_depth, policy.optimizer, policy.prefetch_depth), ("host", 2, 0.5, 1))
        _assert_trains_alike(self, model, reference)

    def test_a_refused_fully_shard_leaves_the_policy_free(self):
        # A refusal shards nothing: the policy planned no group, and stays free to change.
        policy = CoherentOffload(platform="discrete")
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, dtype=torch.float64))
        with self.assertRaisesRegex(ValueError, "mix"):
            fully_shard(model, offload_policy=policy)
        policy.prefetch_depth = 2
        self.assertEqual(policy.prefetch_depth, 2)


class PlainOptimizerOnOffloadedModelTest(SingleRankGlooTestCase):
    def test_plain_optimizer_steps_offloaded_parameters_exactly(self):
        # A plain torch.optim optimizer over offloaded parameters steps them on the training
        # thread after backward: slower than OffloadOptimizer, and the same training.
        mesh = init_device_mesh("cpu", (1,))
        trained = []
        for optimizer in (torch.optim.AdamW, lambda params, **kwargs: OffloadOptimizer(params, torch.optim.AdamW, **kwargs)):
            torch.manual_seed(0)
            model = _shard(TiedBlocksModel(), CoherentOffload(platform="discrete", optimizer="host"), mesh, MixedPrecisionPolicy())
            trained.append(_trained(model, lambda params: optimizer(params, lr=1e-2, fused=True), steps=3))
        self.assertEqual(trained[0], trained[1], atol=0, rtol=0)


class GradientsChangedAfterOverlappedStepTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def _models(self, step_during_backward: bool = False, gate: HostStepGate | None = None):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (self.world_size,))
        reference = TiedBlocksModel()
        model = copy.deepcopy(reference)
        _shard(reference, None, mesh, MixedPrecisionPolicy())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _shard(model, CoherentOffload(platform="discrete", optimizer="host"), mesh, MixedPrecisionPolicy())
            optimizer_class = torch.optim.AdamW if gate is None else gate.optimizer_class(torch.optim.AdamW)
            optim = OffloadOptimizer(
                model, optimizer_class, lr=1e-2, fused=True, step_during_backward=step_during_backward
            )
        # Groups are offloaded here: no nothing-offloaded warning.
        self.assertFalse(any(NOTHING_OFFLOADED in str(w.message) for w in caught))
        return reference, model, torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True), optim

    def _stepping_during_backward(self, gate: HostStepGate | None = None):
        """``_models(step_during_backward=True)`` trained until overlap is on, and a third backward
        run, in which groups stepped (or, with ``gate`` closed, started their steps)."""
        reference, model, reference_optim, optim = self._models(step_during_backward=True, gate=gate)
        for step in range(2):  # the first step learns that overlap is safe
            _loss(model, _batch(step, self.rank)).backward()
            optim.step()
            optim.zero_grad()
        if gate is not None:
            optim.synchronize()  # the last step()'s steps end before the gate holds the next
            gate.close()
        _loss(model, _batch(2, self.rank)).backward()
        self.assertGreater(len(optim._host_steps.during_backward), 0)  # groups stepped during backward
        return reference, model, reference_optim, optim

    def test_clip_grad_norm_between_backward_and_step_is_exact(self):
        # Clipping with clip_grad_norm_ between backward and step(): nothing steps before step()
        # (the default), so training matches FSDP2 with the same clip, and the groups' steps
        # still run after step() returned (finishing under the next forward).
        self.init_gloo()
        gate = HostStepGate()
        reference, model, reference_optim, optim = self._models(gate=gate)
        for step in range(STEPS):
            max_norm = 1e6 if step == 0 else 0.05
            for m in (reference, model):
                _loss(m, _batch(step, self.rank)).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            self.assertEqual(optim._host_steps.during_backward, {})
            reference_optim.step()
            reference_optim.zero_grad()
            gate.close()
            optim.step()
            self.assertTrue(gate.holds_a_step(), f"step {step}: step() returned after every host step")
            optim.zero_grad()
            gate.open()
        for (name, param), (_, reference_param) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(param.full_tensor(), reference_param.full_tensor(), atol=0, rtol=0, msg=name)

    def test_gradients_changed_after_groups_stepped_during_backward_raise(self):
        # With step_during_backward, groups step as their gradients land once that is learned
        # safe; any later in-place change of their gradients (or a new gradient tensor) would be
        # silently lost for them: step() refuses, naming max_grad_norm= and
        # step_during_backward=False, and the next step trains normally.
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
                _, model, _, optim = self._stepping_during_backward()
                change(model)
                with self.assertRaisesRegex(
                    RuntimeError,
                    r"gradients changed after some parameter groups had already stepped during backward"
                    r".*OffloadOptimizer\(\.\.\., max_grad_norm=\.\.\.\).*step_during_backward=False",
                ):
                    optim.step()
                optim.zero_grad()
                _loss(model, _batch(3, self.rank)).backward()
                optim.step()
                # The gradients are no longer watched once step() ran.
                self.assertTrue(all(type(p.grad).__name__ != "_WatchedGrad" for p in model.parameters() if p.grad is not None))
                optim.zero_grad()
                self.assertTrue(all(math.isfinite(p.full_tensor().sum().item()) for p in model.parameters()))

    def test_second_backward_before_step_is_refused_once(self):
        # With step_during_backward, a second backward before step() gives groups that already
        # stepped during backward a second gradient: nothing raises inside backward (FSDP's backward
        # runs to its end), step() refuses once, naming the knob and the fix, and training goes on
        # from there exactly as the class over plain FSDP2 would.
        self.init_gloo()
        reference, model, reference_optim, optim = self._stepping_during_backward()
        _loss(model, _batch(3, self.rank)).backward()
        with self.assertRaisesRegex(
            RuntimeError,
            r"OffloadOptimizer\(step_during_backward=True\): a parameter group received a second gradient before "
            r"step\(\).*Call zero_grad\(\) and train on.*set_requires_gradient_sync\(False\).*step_during_backward=False",
        ):
            optim.step()
        optim.zero_grad()
        reference.load_state_dict(model.state_dict())
        reference_optim.load_state_dict(copy.deepcopy(optim.state_dict()))  # it would share the tensors
        for step in range(4, 7):
            for m, o in ((reference, reference_optim), (model, optim)):
                _loss(m, _batch(step, self.rank)).backward()
                if o is optim:
                    self.assertGreater(len(optim._host_steps.during_backward), 0)  # overlap stays on
                o.step()
                o.zero_grad()
        for (name, param), (_, reference_param) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(param.full_tensor(), reference_param.full_tensor(), atol=0, rtol=0, msg=name)

    def test_a_forward_before_step_reads_the_steps_taken_during_backward(self):
        # A forward before step() (here a second micro-batch's) copies each group in after the
        # step it started during backward: the steps are held until the copy-in waits for them,
        # and the forward computes with the stepped parameters, as the next one does.
        self.init_gloo()
        gate = HostStepGate()

        class OpensTheGate(PendingUpdate):
            def result(self):
                gate.open()
                return super().result()

        with mock.patch.object(host_steps, "PendingUpdate", OpensTheGate):
            _, model, _, optim = self._stepping_during_backward(gate)
        self.assertTrue(gate.holds_a_step())
        tokens = _batch(3, self.rank)[:, :-1]
        with torch.no_grad():
            during = model(tokens)
            gate.open()
            for future in optim._host_steps.during_backward.values():
                future.result()
            after = model(tokens)
        self.assertEqual(during, after, atol=0, rtol=0)
        optim.step()  # nothing more to step: each group received one gradient
        optim.zero_grad()

    def test_own_steps_during_backward_are_no_change(self):
        # A parameter without optimizer state yet (here: its state dropped; in models, one whose
        # first gradient comes after overlap is on) makes its group step over the DTensors
        # themselves during backward; the fused kernel declares the gradients it reads as
        # written, which must not read as the user changing them.
        self.init_gloo()
        reference, model, reference_optim, optim = self._models(step_during_backward=True)
        for step in range(4):
            if step == 2:
                for o, m in ((optim, model), (reference_optim, reference)):
                    del o.state[m.blocks[-1][0].weight]
            for m, o in ((reference, reference_optim), (model, optim)):
                _loss(m, _batch(step, self.rank)).backward()
                if o is optim and step >= 2:
                    self.assertGreater(len(optim._host_steps.during_backward), 0)  # groups stepped during backward
                o.step()
                o.zero_grad()
        for (name, param), (_, reference_param) in zip(model.named_parameters(), reference.named_parameters()):
            self.assertEqual(param.full_tensor(), reference_param.full_tensor(), atol=0, rtol=0, msg=name)


if __name__ == "__main__":
    run_tests()
