"""install() / uninstall(): every patch point of the FSDP integration, verified both ways."""

from __future__ import annotations

import gc
import os
import re
import sys
import threading
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.testing._internal.common_utils import run_tests, TestCase

sys.path.insert(0, os.path.dirname(__file__))

import torch_fsdp_offload
from common_offload import SingleRankGlooTestCase
from torch_fsdp_offload import _integration, CoherentOffload, FullyShardedDataParallel, OffloadOptimizer
from torch_fsdp_offload._integration import fsdp1_handles
from torch_fsdp_offload._integration.fsdp2_group_state import GradCapture, GroupPlacement
from torch_fsdp_offload._integration.fsdp2_param_group import CoherentFSDPParamGroup
from test_fsdp2_offload import _batch, _loss, _shard, STEPS, TiedBlocksModel


def _sites() -> list[tuple[str, object, str]]:
    return [(site, owner, name) for site, owner, name, _, _ in _integration._patch_points()]


def _held() -> dict[str, object]:
    return {site: getattr(owner, name) for site, owner, name in _sites()}


class _ProcessGroupTestCase(SingleRankGlooTestCase):
    """A one-rank gloo process group in this process, and the integration reinstalled after."""

    def setUp(self):
        super().setUp()
        self.addCleanup(torch_fsdp_offload.install)


class InstallTest(TestCase):
    def setUp(self):
        super().setUp()
        self.addCleanup(torch_fsdp_offload.install)

    def test_import_installs(self):
        self.assertTrue(_integration.is_installed())
        self.assertIs(_fsdp_param_group.FSDPParamGroup, CoherentFSDPParamGroup)

    def test_round_trip_restores_torch_originals(self):
        installed = _held()
        # Every site holds one of ours, and the FSDP2 group site the subclass.
        for site, value in installed.items():
            self.assertTrue(value.__module__.startswith("torch_fsdp_offload."), site)
        torch_fsdp_offload.uninstall()
        self.assertFalse(_integration.is_installed())
        originals = _held()
        for site, value in originals.items():
            self.assertTrue(value.__module__.startswith("torch."), site)
            self.assertEqual(site.rpartition(".")[2], value.__name__, site)
        self.assertIs(_fsdp_param_group.FSDPParamGroup, CoherentFSDPParamGroup.__mro__[1])
        torch_fsdp_offload.uninstall()  # a no-op when not installed
        self.assertEqual(_held(), originals)
        torch_fsdp_offload.install()
        torch_fsdp_offload.install()  # a no-op when installed
        self.assertTrue(_integration.is_installed())
        for site, value in _held().items():
            self.assertIs(value, installed[site], site)
        torch_fsdp_offload.uninstall()
        for site, value in _held().items():
            self.assertIs(value, originals[site], site)

    def test_unexpected_class_at_a_site_is_refused_and_nothing_is_patched(self):
        torch_fsdp_offload.uninstall()
        originals = _held()
        foreign = type("FSDPParamGroup", (), {"__module__": "another_library"})
        with mock.patch.object(_fsdp_param_group, "FSDPParamGroup", foreign):
            with self.assertRaisesRegex(
                RuntimeError,
                r"cannot patch torch\.distributed\.fsdp\._fully_shard\._fsdp_param_group\.FSDPParamGroup "
                rf"on torch {re.escape(torch.__version__)}: it holds .*another_library",
            ):
                torch_fsdp_offload.install()
            self.assertFalse(_integration.is_installed())
            for site, value in _held().items():
                if not site.endswith("_fsdp_param_group.FSDPParamGroup"):
                    self.assertIs(value, originals[site], site)
        torch_fsdp_offload.install()
        self.assertIs(_fsdp_param_group.FSDPParamGroup, CoherentFSDPParamGroup)

    def test_patched_over_site_is_refused_by_uninstall(self):
        with mock.patch.object(torch.distributed.fsdp._runtime_utils, "_offload_grad", lambda *args: None):
            with self.assertRaisesRegex(RuntimeError, r"cannot patch torch\.distributed\.fsdp\._runtime_utils\._offload_grad"):
                torch_fsdp_offload.uninstall()
            self.assertTrue(_integration.is_installed())
        torch_fsdp_offload.uninstall()
        self.assertFalse(_integration.is_installed())

    def test_unsupported_torch_is_refused_by_install(self):
        torch_fsdp_offload.uninstall()
        with mock.patch.object(torch, "__version__", "2.10.0"):
            with self.assertRaisesRegex(RuntimeError, r"supports torch 2\.11 through 2\.15"):
                torch_fsdp_offload.install()
        self.assertFalse(_integration.is_installed())

    def test_policy_construction_after_uninstall_is_refused(self):
        torch_fsdp_offload.uninstall()
        with self.assertRaisesRegex(
            RuntimeError, r"CoherentOffload\(\) needs .* not installed .*Call torch_fsdp_offload\.install\(\)"
        ):
            CoherentOffload()
        module = nn.Linear(4, 4)
        with self.assertRaisesRegex(RuntimeError, r"FullyShardedDataParallel\(offload_policy=\.\.\.\) needs"):
            FullyShardedDataParallel(module, offload_policy=CPUOffloadPolicy())
        self.assertIs(type(module), nn.Linear)
        torch_fsdp_offload.install()
        CoherentOffload()

    def test_pin_memory_redirect_is_this_thread_only(self):
        # FSDP1's Tensor.pin_memory() calls are redirected on the initialising thread only;
        # another thread calling pin_memory() meanwhile gets torch's own.
        seen = {}

        def other_thread():
            seen["other"] = _redirected()

        def _redirected():
            tensor = torch.ones(2)
            try:
                return tensor.pin_memory() is tensor
            except RuntimeError:  # no accelerator: torch's own cannot pin
                return False

        with fsdp1_handles._PinMemoryAs(False):
            seen["this"] = _redirected()
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        self.assertTrue(seen["this"])
        self.assertFalse(seen["other"])


class ShardAfterReinstallTest(_ProcessGroupTestCase):
    def test_fsdp2_model_sharded_after_uninstall_and_install_trains_with_the_policy(self):
        def train(policy):
            torch.manual_seed(0)
            model = _shard(TiedBlocksModel(), policy, None, MixedPrecisionPolicy())
            optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
            losses = []
            for step in range(STEPS):
                loss = _loss(model, _batch(step, 0))
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
            optim.synchronize()
            return model, losses

        _, before = train(CoherentOffload(platform="discrete", optimizer="host"))
        torch_fsdp_offload.uninstall()
        torch_fsdp_offload.install()
        model, after = train(CoherentOffload(platform="discrete", optimizer="host"))
        groups = [module._get_fsdp_state()._fsdp_param_group for module in (*model.blocks, model)]
        self.assertTrue(all(isinstance(group, CoherentFSDPParamGroup) for group in groups))
        self.assertTrue(all(group._offload.active for group in groups))
        self.assertEqual(after, before, atol=0, rtol=0)
        # The group's states are explicit: homed at lazy init, idle between backwards, and a
        # transition out of order is an assertion, not a silently wrong flag.
        offload = groups[0]._offload
        self.assertIs(offload.placement, GroupPlacement.HOMED)
        self.assertIs(offload.grad_capture, GradCapture.IDLE)
        with self.assertRaisesRegex(AssertionError, r"Expected to be in one of \['CAPTURING'\], but got IDLE"):
            offload.end_grad_capture()

    def test_uninstall_is_refused_while_an_fsdp1_offload_model_is_alive(self):
        model = FullyShardedDataParallel(
            nn.Sequential(nn.Linear(8, 8)), device_id=torch.device("cpu"), offload_policy=CPUOffloadPolicy(pin_memory=False)
        )
        with self.assertRaisesRegex(RuntimeError, r"1 FSDP1 handle\(s\) .* are alive .*Delete those models first"):
            torch_fsdp_offload.uninstall()
        self.assertTrue(_integration.is_installed())
        del model
        gc.collect()  # FSDP1 modules hold reference cycles
        torch_fsdp_offload.uninstall()
        self.assertFalse(_integration.is_installed())


if __name__ == "__main__":
    run_tests()
