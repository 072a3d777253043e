"""Tests for ``python -m torch_fsdp_offload platform`` (torch_fsdp_offload.platform.cli)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import tempfile
import unittest
from unittest import mock

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_offload import platform as platform_module
from torch_fsdp_offload.platform import cli as platform_cli
from torch_fsdp_offload.platform import ENV_PLATFORM, BandwidthReport, BandwidthRow

HAS_CUDA = torch.cuda.is_available()
HAS_DISPATCHER = importlib.util.find_spec("torch_fsdp_offload.planner.cli") is not None
MiB = 1 << 20

GH200_ATTRIBUTES = {
    "Integrated": 0,
    "CanMapHostMemory": 1,
    "AsyncEngineCount": 2,
    "cudaDevAttrHostNativeAtomicSupported": 1,
    "PageableMemoryAccess": 1,
    "ConcurrentManagedAccess": 1,
    "PageableMemoryAccessUsesHostPageTables": 1,
    "NumaConfig": 1,
    "NumaId": 1,
    "HostNumaId": None,
}


class TestPlatformCLI(TestCase):
    def setUp(self) -> None:
        super().setUp()
        platform_module._clear_caches()
        self.addCleanup(platform_module._clear_caches)
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop(ENV_PLATFORM, None)
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.directory = directory.name

    def _write_json(self, name: str, content: object) -> str:
        path = os.path.join(self.directory, name)
        with open(path, "w", encoding="utf-8") as json_file:
            json.dump(content, json_file)
        return path

    def _run(self, *argv: str) -> tuple[int, str, str]:
        parser = argparse.ArgumentParser()
        platform_cli.add_arguments(parser)
        args = parser.parse_args(argv)
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = platform_cli.run(args)
        return status, stdout.getvalue(), stderr.getvalue()

    def _run_with_fixed_capacities(self, *argv: str) -> tuple[int, str, str]:
        with mock.patch.object(platform_module, "read_host_available_bytes", return_value=96 << 30), \
                mock.patch.object(platform_module, "read_locked_memory_limit_bytes", return_value=None):
            return self._run(*argv)

    def test_report_of_attribute_file(self) -> None:
        path = self._write_json("gh200.json", GH200_ATTRIBUTES)
        status, out, err = self._run("--attributes", path)
        self.assertEqual((status, err), (0, ""))
        self.assertExpectedInline(out.replace(path, "gh200.json"), """\
platform: coherent
device: cuda:0
why: PageableMemoryAccessUsesHostPageTables=1, HostNativeAtomicSupported=1: separate GPU memory, hardware-coherent with the CPU's (NVLink-C2C / ATS)
source: attributes
what the library does: pinned host memory, big chunks; offloading weights, grads, optimizer state and activations pays often; the optimizer step is streamed through the GPU
derived: copies_needed=True, supports_managed_memory=True, preferred_memory=pinned

attributes (from gh200.json; 9 of 10 known):
  Integrated (18)                                     0
  CanMapHostMemory (19)                               1
  AsyncEngineCount (40)                               2
  HostNativeAtomicSupported (86)                      1
  PageableMemoryAccess (88)                           1
  ConcurrentManagedAccess (89)                        1
  PageableMemoryAccessUsesHostPageTables (100)        1
  NumaConfig (130)                                    1
  NumaId (131)                                        1
  HostNumaId (134)                              unknown

capacities: not read (the attributes describe another machine)
""")

    @unittest.skipIf(HAS_CUDA, "checks a machine without a GPU")
    def test_report_host_only(self) -> None:
        status, out, err = self._run_with_fixed_capacities("--bandwidth")
        self.assertEqual((status, err), (0, ""))
        self.assertExpectedInline(out, """\
platform: host_only
device: cpu
why: no accelerator (DeviceCount=0): the CPU is the compute device
source: detected
what the library does: the CPU is the compute device: shards already live where compute happens; the policy still applies, with no streams
derived: copies_needed=False, supports_managed_memory=False, preferred_memory=pinned

attributes (no GPU to read; 1 of 1 known):
  DeviceCount        0

capacities:
  GPU memory           none (no accelerator)
  host MemAvailable    96.0 GiB
  locked-memory limit  unlimited (ulimit -l)

bandwidth: not measured: no accelerator on device cpu, so there is no CPU-GPU link to measure
""")

    def test_bandwidth_table(self) -> None:
        rows = (
            BandwidthRow(1 * MiB, 32.09, 39.53, 61.0, 9.17, 7.86),
            BandwidthRow(64 * MiB, 54.23, 55.0, 83.58, 7.15, 13.2),
        )
        report = BandwidthReport("cuda:0", "NVIDIA H200", 256 * MiB, 5, rows, 4212.3, "2.11.0+cu130")
        self.assertExpectedInline(platform_cli.format_bandwidth(report), """\
bandwidth on cuda:0 (NVIDIA H200), GB/s = 1e9 bytes/s, median of 5 passes over 256 MiB in chunks of:
  chunk       H2D pinned    D2H pinned   both pinned  H2D pageable  D2H pageable
  1 MiB             32.1          39.5          61.0           9.2           7.9
  64 MiB            54.2          55.0          83.6           7.2          13.2
  ('both pinned' counts the bytes of both ways, copied at once on two streams)
GPU device-to-device copy: 4212.3 GB/s (read + write)
link, best one-way pinned: 55.0 GB/s (H2D 54.2, D2H 55.0, both at once 83.6)
GPU-DRAM : link ratio: 77 -> ~80 (discrete-class link): offload only what the planner says pays""")

    def test_json(self) -> None:
        status, out, _ = self._run("--json")
        self.assertEqual(status, 0)
        result = json.loads(out)
        self.assertEqual(result["kind"] == "host_only", not HAS_CUDA)
        self.assertEqual(result["source"], "detected")
        self.assertIn("DeviceCount", result["attributes"])
        self.assertGreater(result["host_available_bytes"], 0)

    def test_json_round_trips_through_attributes(self) -> None:
        path = self._write_json("gh200.json", GH200_ATTRIBUTES)
        status, out, _ = self._run("--attributes", path, "--json")
        self.assertEqual(status, 0)
        result = json.loads(out)
        self.assertEqual((result["kind"], result["source"]), ("coherent", "attributes"))
        self.assertEqual(result["attributes"]["HostNativeAtomicSupported"], 1)  # prefix stripped
        self.assertIsNone(result["attributes"]["HostNumaId"])
        again = self._write_json("again.json", result)
        status, out, _ = self._run("--attributes", again, "--json")
        self.assertEqual(json.loads(out)["kind"], "coherent")

    def test_kind_override(self) -> None:
        status, out, _ = self._run("--kind", "discrete", "--json")
        result = json.loads(out)
        self.assertEqual((status, result["kind"], result["source"]), (0, "discrete", "argument"))
        self.assertTrue(result["copies_needed"])
        path = self._write_json("gh200.json", GH200_ATTRIBUTES)
        status, out, _ = self._run("--attributes", path, "--kind", "unified", "--json")
        self.assertEqual(json.loads(out)["kind"], "unified")

    def test_invalid_environment(self) -> None:
        os.environ[ENV_PLATFORM] = "pcie"
        status, out, err = self._run()
        self.assertEqual((status, out), (2, ""))
        self.assertIn("'pcie' is not a platform kind; valid kinds: unified, coherent, discrete, host_only", err)

    def test_bad_attribute_files(self) -> None:
        cases = {
            os.path.join(self.directory, "missing.json"): "cannot read attributes from",
            self._write_json("list.json", [1, 2]): "must hold a JSON object",
            self._write_json("string.json", {"Integrated": "yes"}): "'Integrated' is 'yes'; values must be integers",
            self._write_json("unknown.json", {**GH200_ATTRIBUTES, "Bogus": 1}): (
                "unknown.json: attribute 'Bogus' is not a known attribute; the known attributes are DeviceCount, "
            ),
            self._write_json("range.json", {**GH200_ATTRIBUTES, "NumaConfig": 7}): (
                "range.json: attribute NumaConfig=7 is out of range: NumaConfig takes an integer in [0, 1]"
            ),
        }
        for path, message in cases.items():
            status, out, err = self._run("--attributes", path)
            self.assertEqual((status, out), (2, ""), path)
            self.assertIn(message, err)

    def test_bad_device(self) -> None:
        for device in ("banana", "cuda:x", "-1"):
            status, out, err = self._run("--device", device)
            self.assertEqual((status, out), (2, ""), device)
            self.assertIn(
                f"error: device {device!r} is not a device: pass a CUDA device as cuda:N or its index N (N >= 0), "
                "or 'cpu'", err,
            )

    def test_bandwidth_needs_this_machine(self) -> None:
        path = self._write_json("gh200.json", GH200_ATTRIBUTES)
        status, _, err = self._run("--attributes", path, "--bandwidth")
        self.assertEqual(status, 2)
        self.assertIn("cannot be combined with --attributes", err)

    @unittest.skipUnless(HAS_DISPATCHER, "the dispatcher also imports torch_fsdp_offload.planner.cli")
    def test_dispatcher(self) -> None:
        from torch_fsdp_offload.__main__ import main

        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            status = main(["platform", "--json", "--kind", "coherent"])
        self.assertEqual((status, json.loads(stdout.getvalue())["kind"]), (0, "coherent"))

    @unittest.skipIf(not HAS_CUDA, "needs a GPU")
    def test_report_on_gpu_with_bandwidth(self) -> None:
        status, out, err = self._run("--bandwidth")
        self.assertEqual((status, err), (0, ""))
        self.assertIn(f"device: cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})", out)
        self.assertIn("GPU-DRAM : link ratio:", out)
        self.assertNotIn("no reader worked", out)


if __name__ == "__main__":
    run_tests()
