"""Refusals of the FSDP1 front door ``torch_fsdp_offload.FullyShardedDataParallel``.

Every argument the front door adds or reads is refused, when it cannot be honoured, before FSDP1's
constructor touches the module: the model then shards with plain ``fully_shard`` and trains like a
copy that was never refused. The host-capacity refusal counts, to the byte, what FSDP1 allocates at
the first forward. One rank of gloo on the CPU.
"""

from __future__ import annotations

import functools
import gc
import os
from unittest import mock

import torch
import torch.nn as nn
from common_offload import Blocks, fsdp1_host_bytes, RefusalTestCase
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel as StockFSDP,
    MixedPrecision,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests

from torch_fsdp_offload.fsdp1 import FullyShardedDataParallel
from torch_fsdp_offload.memory import ENV_HOST_MEMORY, HostMemoryError
from torch_fsdp_offload.platform.kinds import ENV_PLATFORM
from torch_fsdp_offload.policy import CoherentOffload

CPU = torch.device("cpu")
DISCRETE = CoherentOffload(platform="discrete")
NO_ACCELERATOR = not torch.accelerator.is_available()


class _UnknownPolicy(OffloadPolicy):
    pass


# (FSDP1 front-door arguments, environment, error, message, whether it needs a machine without an
# accelerator). Arguments default to device_id=cpu and each Linear its own FSDP instance.
_REFUSALS = {
    "host_budget_too_small": (
        dict(offload_policy=DISCRETE), {ENV_HOST_MEMORY: "1KiB"}, HostMemoryError,
        r"Cannot allocate .* FullyShardedDataParallel\(offload_policy=CoherentOffload\(\)\)", False,
    ),
    "host_budget_malformed": (dict(offload_policy=DISCRETE), {ENV_HOST_MEMORY: "lots"}, ValueError, ENV_HOST_MEMORY, False),
    "platform_unknown": (dict(offload_policy=CoherentOffload()), {ENV_PLATFORM: "banana"}, ValueError, "banana", False),
    "cast_where_nothing_is_copied": (
        dict(offload_policy=CoherentOffload(platform="unified", cast_on="device")), {}, ValueError, "copies nothing", False,
    ),
    "optimizer_placement": (dict(offload_policy=CoherentOffload(optimizer="host")), {}, ValueError, "optimizer='host'", False),
    "activations": (dict(offload_policy=CoherentOffload(activations=True)), {}, ValueError, r"offload_activations\(model\)", False),
    "no_prefetch_with_forward_prefetch": (
        dict(offload_policy=CoherentOffload(platform="discrete", prefetch_depth=0), forward_prefetch=True), {},
        ValueError, "prefetch_depth=0 .*forward_prefetch=True", False,
    ),
    "prefetch_without_backward_prefetch": (
        dict(offload_policy=DISCRETE, backward_prefetch=None), {}, ValueError, "prefetch_depth=1 .*backward_prefetch=None", False,
    ),
    "cpu_offload_with_offload_policy": (
        dict(offload_policy=CPUOffloadPolicy(pin_memory=False), cpu_offload=CPUOffload(offload_params=False)), {},
        ValueError, "both cpu_offload= and offload_policy=", False,
    ),
    "cpu_offload_not_a_cpu_offload": (dict(cpu_offload=True), {}, TypeError, "takes FSDP1's CPUOffload or None, got True", False),
    "offload_policy_not_a_policy": (dict(offload_policy="cpu"), {}, TypeError, "takes an OffloadPolicy .*got 'cpu'", False),
    "offload_policy_is_fsdp1_cpu_offload": (
        dict(offload_policy=CPUOffload(offload_params=True)), {}, TypeError, r"its offload_policy is CPUOffloadPolicy\(\)", False,
    ),
    "offload_policy_unknown": (dict(offload_policy=_UnknownPolicy()), {}, TypeError, "cannot honour _UnknownPolicy", False),
    "pinned_policy_without_accelerator": (
        dict(offload_policy=CPUOffloadPolicy()), {}, ValueError,
        r"pinning needs an accelerator.*CPUOffloadPolicy\(pin_memory=False\)", True,
    ),
    "fsdp1_cpu_offload_without_accelerator": (
        dict(cpu_offload=CPUOffload(offload_params=True)), {}, ValueError,
        r"cpu_offload=CPUOffload\(offload_params=True\).*pinning needs an accelerator", True,
    ),
    "no_device_id_without_accelerator": (
        dict(offload_policy=CoherentOffload(), device_id=None), {}, ValueError, r"Pass device_id=torch.device\('cpu'\)", True,
    ),
    "device_id_absent": (
        dict(offload_policy=CoherentOffload(), device_id=torch.device("cuda", 99)), {}, ValueError,
        "names a device this machine does not have", False,
    ),
    "device_id_index_absent": (dict(device_id=99), {}, ValueError, r"device_id=99\) names a device", False),
    "device_id_not_a_device": (dict(device_id=1.5), {}, TypeError, "takes an int or a torch.device, got 1.5", False),
    "sharding_strategy_not_a_strategy": (
        dict(offload_policy=DISCRETE, sharding_strategy="FULL_SHARD"), {}, TypeError, "takes a ShardingStrategy", False,
    ),
    "mixed_precision_not_a_policy": (
        dict(offload_policy=DISCRETE, mixed_precision=torch.bfloat16), {}, TypeError, "takes a MixedPrecision", False,
    ),
    "auto_wrap_policy_not_a_policy": (
        dict(offload_policy=DISCRETE, auto_wrap_policy="blocks"), {}, TypeError, "takes a ModuleWrapPolicy", False,
    ),
    # FSDP1's own refusal, before it wraps: a hybrid strategy wrapped by hand needs its groups.
    "hybrid_shard_without_groups": (
        dict(offload_policy=DISCRETE, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=None), {},
        ValueError, "requires explicit specification of process group or device_mesh", False,
    ),
}


class _TiedNet(nn.Module):
    """Odd sizes (padding), batch norms, and an embedding tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(13, 7)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Linear(5, 7)) for _ in range(2)]
        )
        self.output = nn.Linear(7, 13, bias=False)
        self.output.weight = self.embedding.weight
        self.extra = nn.Linear(3, 3)


def _front_door(model: nn.Module, **kwargs) -> FullyShardedDataParallel:
    kwargs = {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear}), "device_id": CPU, **kwargs}
    return FullyShardedDataParallel(model, **kwargs)


class FSDP1RefusalTest(RefusalTestCase):
    def tearDown(self) -> None:
        # FSDP1 models live in reference cycles: their offloaded handles would keep counting
        # against later budgets, and make uninstall() refuse, until collected.
        gc.collect()
        super().tearDown()

    @parametrize("refusal", list(_REFUSALS))
    def test_refused_model_shards_and_trains(self, refusal: str) -> None:
        kwargs, environ, error, message, needs_no_accelerator = _REFUSALS[refusal]
        if needs_no_accelerator and not NO_ACCELERATOR:
            self.skipTest("refused only on a machine without an accelerator")

        def refuse(model: nn.Module) -> None:
            with mock.patch.dict(os.environ, environ):
                _front_door(model, **kwargs)

        self.assertRefusalLeavesModelTrainable(refuse, error, message)
        # Plain FSDP1 wraps the refused model as well.
        torch.manual_seed(0)
        model = Blocks()
        with self.assertRaisesRegex(error, message), mock.patch.dict(os.environ, environ):
            _front_door(model, **kwargs)
        self.assertEqual(len(StockFSDP.fsdp_modules(StockFSDP(model, device_id=CPU, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})))), 4)

    def test_host_budget_is_what_the_first_forward_allocates(self) -> None:
        # use_orig_params pads each parameter to 16 bytes of bf16 (15 x 15 weights), and mixed
        # precision adds a pinned bf16 mirror per handle: the refusal, at construction, counts
        # exactly what FSDP1's lazy init and first unshard allocate.
        gc.collect()  # models of other tests never run forward would count against the budget
        kwargs = dict(offload_policy=DISCRETE, use_orig_params=True,
                      mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        model = _front_door(Blocks(15), **kwargs)
        model(torch.randn(2, 15)).sum().backward()
        needed = fsdp1_host_bytes(model)
        self.assertGreater(needed, 2 * 4 * sum(p.numel() for p in Blocks(15).parameters()))  # padding and mirrors

        def refuse(model: nn.Module) -> None:
            with mock.patch.dict(os.environ, {ENV_HOST_MEMORY: str(needed - 1)}):
                _front_door(model, **kwargs)

        self.assertRefusalLeavesModelTrainable(refuse, HostMemoryError, "Cannot allocate", make_model=lambda: Blocks(15))
        with mock.patch.dict(os.environ, {ENV_HOST_MEMORY: str(needed)}):
            fits = _front_door(Blocks(15), **kwargs)
            fits(torch.randn(2, 15)).sum().backward()
            self.assertEqual(fsdp1_host_bytes(fits), needed)
            # Where nothing is offloaded (no accelerator), nothing is counted.
            _front_door(Blocks(15), offload_policy=CoherentOffload(platform="host_only"))
            # Built models not yet run forward count against the budget too.
            pending = _front_door(Blocks(15), **kwargs)
            with self.assertRaisesRegex(HostMemoryError, "Cannot allocate"):
                _front_door(Blocks(15), **kwargs)
        self.assertEqual(len(StockFSDP.fsdp_modules(pending)), 4)

    @parametrize("use_orig_params", [False, True])
    def test_planned_shards_are_the_handles_fsdp1_builds(self, use_orig_params: bool) -> None:
        # The host-capacity check reads the handles FSDP1 will build from its wrap policy: every
        # policy kind, ignored modules and parameters, mixed precision (batch norms wrapped apart,
        # in full precision) and a weight tied across two wrapped modules (with use_orig_params=False
        # FSDP1 flattens it into both; with True only into the first).
        from torch_fsdp_offload._integration.fsdp1_handle_plan import planned_shards

        size_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=40)
        cases = {
            "root only": {},
            "module classes": dict(auto_wrap_policy=ModuleWrapPolicy({nn.Sequential})),
            "every linear": dict(auto_wrap_policy=ModuleWrapPolicy({nn.Linear})),
            "policy function": dict(auto_wrap_policy=size_policy),
            "custom with overrides": dict(auto_wrap_policy=CustomPolicy(
                lambda m: {"cpu_offload": CPUOffload(False)} if isinstance(m, nn.Sequential) else isinstance(m, nn.Embedding)
            )),
            "ignored module": dict(auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), ignored_modules="extra"),
            "ignored parameter": dict(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), ignored_states="blocks.1.0.weight"),
            "mixed precision": dict(auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
            "mixed precision, policy function": dict(auto_wrap_policy=size_policy,
                                                     mixed_precision=MixedPrecision(param_dtype=torch.float16)),
        }
        for name, kwargs in cases.items():
            model = _TiedNet()
            if "ignored_modules" in kwargs:
                kwargs["ignored_modules"] = [model.get_submodule(kwargs["ignored_modules"])]
            if "ignored_states" in kwargs:
                kwargs["ignored_states"] = [model.get_parameter(kwargs["ignored_states"])]
            call = {"process_group": None, "sharding_strategy": None, "cpu_offload": CPUOffload(True),
                    "auto_wrap_policy": None, "mixed_precision": None, "ignored_modules": None,
                    "use_orig_params": use_orig_params, "ignored_states": None, "device_mesh": None, **kwargs}
            planned = planned_shards(model, call, CPU)
            wrapped = _front_door(model, offload_policy=CPUOffloadPolicy(pin_memory=False),
                                  use_orig_params=use_orig_params, **{"auto_wrap_policy": None, **kwargs})
            built = [(handle.flat_param.numel(), handle.flat_param.dtype, handle._fwd_bwd_param_dtype)
                     for handle in (state._handle for state in StockFSDP.fsdp_modules(wrapped)) if handle is not None
                     and handle._offload_params]
            self.assertEqual(sorted(map(str, built)),
                             sorted(str((s.numel, s.dtype, s.param_dtype or s.dtype)) for s in planned), msg=name)

    def test_ignored_modules_from_a_generator_are_ignored(self) -> None:
        # FSDP1 reads ignored_modules twice, a generator only once; the front door reads a list.
        model = Blocks()
        wrapped = _front_door(model, ignored_modules=(m for m in [model.head]))
        self.assertEqual(len(StockFSDP.fsdp_modules(wrapped)), 3)  # the root and two blocks, not the head
        self.assertIs(type(model.head._parameters["weight"]), nn.Parameter)


instantiate_parametrized_tests(FSDP1RefusalTest)

if __name__ == "__main__":
    run_tests()
