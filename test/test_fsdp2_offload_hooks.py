"""The upstream patch (docs/upstream/fsdp2_offload_hooks.patch, or its port to the running torch
release) against the installed torch: it applies to a scratch copy of this torch, and there the FSDP2
parity tests pass with CoherentOffload running through the hooks, the class swap unused
(fsdp2_hooks_checks.py asserts it in every rank). The installed torch is never written: the scratch
copy links to it except for FSDP2's package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import torch
from torch.testing._internal.common_utils import run_tests, TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The patch for each torch release it is written against: the RFC's against the newest, and the same
# hooks on 2.13 (the CPU torch of this machine), whose foreach_reduce precedes 2.15's restructuring.
PATCHES = {
    (2, 15): os.path.join(ROOT, "docs", "upstream", "fsdp2_offload_hooks.patch"),
    (2, 13): os.path.join(ROOT, "docs", "upstream", "fsdp2_offload_hooks_2.13.patch"),
}
PATCHED_PACKAGE = ("torch", "distributed", "fsdp", "_fully_shard")
# What runs against the patched torch: the hooks-path checks, the parity tests at world sizes 1
# and 2 (checkpoint load included: the shards go back home through the hooks), the optimizer's
# contract with plain DTensors, accumulation summing on the device (the policy's in-place sums,
# FSDP adding nothing), and shards in managed memory or read in place.
CONTRACT = "test/test_optimizer_contract.py::OffloadOptimizerContractTest::"
SUITE = (
    "test/fsdp2_hooks_checks.py",
    *(
        CONTRACT + name
        for name in (
            "test_before_and_after_step_as_plain_fsdp2",
            "test_zero_grad_keeping_the_tensors_while_steps_run",
            "test_clip_grad_norm_by_the_user_is_exact",
            "test_max_grad_norm_is_exact",
            "test_nonfinite_norm_skips_the_step",
            "test_gradient_accumulation",
        )
    ),
    "test/test_fsdp2_offload.py::FSDP2OffloadParityWorldSize1Test",
    "test/test_fsdp2_offload.py::FSDP2OffloadParityTest::test_parity_mixed_precision_uneven_tied_frozen",
    "test/test_fsdp2_offload.py::FSDP2OffloadParityTest::test_parity_grad_accumulation_clipping_partial",
    "test/test_fsdp2_offload.py::FSDP2OffloadParityTest::test_checkpoint_round_trip_and_resume",
    "test/test_fsdp2_offload.py::FSDP2OffloadParityTest::test_shards_in_host_memory_read_in_place_copy_nothing_up",
    "test/test_fsdp2_offload.py::FSDP2OffloadParityTest::test_parity_managed_shards_copied_in",
    "test/test_async_path.py::AsyncPathTest::test_accumulated_gradients_are_summed_where_they_were_reduced",
)


def _link_all_but(source: str, target: str, copied: tuple[str, ...]) -> None:
    """``target`` as ``source`` with links to its entries, except ``copied[0]``, made real (copied
    outright when it is the last of ``copied``)."""
    os.makedirs(target)
    for name in os.listdir(source):
        src, dst = os.path.join(source, name), os.path.join(target, name)
        if name != copied[0]:
            os.symlink(src, dst)
        elif len(copied) == 1:
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            _link_all_but(src, dst, copied[1:])


def _apply(patch: str, directory: str) -> subprocess.CompletedProcess:
    tool = shutil.which("patch")
    command = [tool, "-p1", "-s", "-i", patch] if tool else ["git", "apply", "-p1", patch]
    return subprocess.run(command, cwd=directory, capture_output=True, text=True)


class OffloadHooksPatchTest(TestCase):
    def setUp(self) -> None:
        super().setUp()
        release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        if release not in PATCHES:
            written = ", ".join(f"{major}.{minor}" for major, minor in sorted(PATCHES))
            self.skipTest(f"the patch is written against torch {written}; this is torch {torch.__version__}")
        self.patch = PATCHES[release]

    def test_parity_suite_runs_through_the_hooks_on_a_patched_torch(self):
        site = os.path.dirname(os.path.dirname(torch.__file__))
        with tempfile.TemporaryDirectory() as scratch:
            _link_all_but(os.path.join(site, "torch"), os.path.join(scratch, "torch"), PATCHED_PACKAGE[1:])
            applied = _apply(self.patch, scratch)
            self.assertEqual(applied.returncode, 0, applied.stdout + applied.stderr)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([scratch, ROOT, os.path.join(ROOT, "test")]))
            env.setdefault("OMP_NUM_THREADS", "1")
            run = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *SUITE],
                cwd=ROOT, env=env, capture_output=True, text=True,
            )
        tail = (run.stdout + run.stderr)[-6000:]
        self.assertEqual(run.returncode, 0, tail)
        self.assertIn(" passed", tail)
        self.assertNotIn("skipped", tail)


if __name__ == "__main__":
    run_tests()
