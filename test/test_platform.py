"""Tests for platform detection and bandwidth measurement (torch_fsdp_offload.platform and the
kinds, readers and bandwidth modules it is built from)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import sys
import types
import unittest
from unittest import mock

import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_fsdp_offload import platform as platform_module
from torch_fsdp_offload.platform import readers as platform_readers
from torch_fsdp_offload.platform import (
    CUDA_DEVICE_ATTRIBUTES,
    ENV_PLATFORM,
    BandwidthReport,
    BandwidthRow,
    PlatformKind,
    classify,
    detect_platform,
    interpret_link_ratio,
    measure_bandwidth,
    platform_from_attributes,
)

HAS_CUDA = torch.cuda.is_available()
MiB = 1 << 20

# Attribute sets of real machines, as their drivers report them; keys left out are not known for
# that machine, so they stay unknown.
X86_H200 = {  # read on an x86 + H200 over PCIe (driver 580, CUDA 13)
    "DeviceCount": 1,
    "Integrated": 0,
    "CanMapHostMemory": 1,
    "AsyncEngineCount": 3,
    "UnifiedAddressing": 1,
    "ManagedMemory": 1,
    "HostNativeAtomicSupported": 0,
    "PageableMemoryAccess": 0,
    "ConcurrentManagedAccess": 1,
    "CanUseHostPointerForRegisteredMem": 1,
    "HostRegisterSupported": 1,
    "PageableMemoryAccessUsesHostPageTables": 0,
    "DirectManagedMemAccessFromHost": 0,
    "NumaConfig": 0,
    "NumaId": -1,
    "HostNumaId": 0,
    "TorchIsIntegrated": 0,
    "NvmlC2cEnabled": 0,
    "NvmlAddressingMode": 0,
}
# The same PCIe machine with HMM (open driver, kernel >= 6.1.24): pageable access by software page
# faulting, not coherence. Values this machine is not known to report are unknown.
X86_H100_HMM = {
    **X86_H200,
    "DeviceCount": 8,
    "AsyncEngineCount": None,
    "UnifiedAddressing": None,
    "ManagedMemory": None,
    "TorchIsIntegrated": None,
    "NvmlC2cEnabled": None,
    "PageableMemoryAccess": 1,
    "NvmlAddressingMode": 1,
}
GH200_NUMA = {
    "DeviceCount": 1,
    "Integrated": 0,
    "CanMapHostMemory": 1,
    "AsyncEngineCount": 2,
    "HostNativeAtomicSupported": 1,
    "PageableMemoryAccess": 1,
    "ConcurrentManagedAccess": 1,
    "CanUseHostPointerForRegisteredMem": 1,
    "HostRegisterSupported": 1,
    "PageableMemoryAccessUsesHostPageTables": 1,
    "DirectManagedMemAccessFromHost": 1,
    "NumaConfig": 1,
    "NumaId": 1,
    "HostNumaId": 0,
    "NvmlC2cEnabled": 1,
    "NvmlAddressingMode": 2,
}
# CDMM (driver R580+): the HBM is no NUMA node, the link is as coherent as ever.
GH200_CDMM = {**GH200_NUMA, "NumaConfig": 0, "NumaId": -1}
GB200 = {**GH200_NUMA, "DeviceCount": 2, "NumaId": 2}
DGX_SPARK = {
    "DeviceCount": 1,
    "Integrated": 1,
    "CanMapHostMemory": 1,
    "AsyncEngineCount": 2,
    "PageableMemoryAccess": 1,
    "ConcurrentManagedAccess": 1,
    "HostRegisterSupported": 1,
    "PageableMemoryAccessUsesHostPageTables": 1,
    "NumaConfig": 0,
    "NvmlAddressingMode": 2,
}
JETSON_THOR = {
    "DeviceCount": 1,
    "Integrated": 1,
    "CanMapHostMemory": 1,
    "PageableMemoryAccess": 1,
    "ConcurrentManagedAccess": 1,
    "HostRegisterSupported": 1,
    "PageableMemoryAccessUsesHostPageTables": 1,
}
JETSON_ORIN = {
    "DeviceCount": 1,
    "Integrated": 1,
    "CanMapHostMemory": 1,
    "PageableMemoryAccess": 0,
    "ConcurrentManagedAccess": 0,
    "HostRegisterSupported": 1,
    "PageableMemoryAccessUsesHostPageTables": 0,
}
NO_ACCELERATOR = {"DeviceCount": 0}

MACHINES = {
    "x86_h200": (X86_H200, PlatformKind.DISCRETE, "PageableMemoryAccessUsesHostPageTables=0"),
    "x86_h100_hmm": (X86_H100_HMM, PlatformKind.DISCRETE, "is HMM"),
    "gh200_numa": (GH200_NUMA, PlatformKind.COHERENT, "PageableMemoryAccessUsesHostPageTables=1"),
    "gh200_cdmm": (GH200_CDMM, PlatformKind.COHERENT, "PageableMemoryAccessUsesHostPageTables=1"),
    "gb200": (GB200, PlatformKind.COHERENT, "NvmlC2cEnabled=1"),
    "dgx_spark": (DGX_SPARK, PlatformKind.UNIFIED, "Integrated=1"),
    "jetson_thor": (JETSON_THOR, PlatformKind.UNIFIED, "Integrated=1"),
    "jetson_orin": (JETSON_ORIN, PlatformKind.UNIFIED, "Integrated=1"),
    "no_accelerator": (NO_ACCELERATOR, PlatformKind.HOST_ONLY, "DeviceCount=0"),
    # Single pieces of evidence, each enough on its own.
    "torch_is_integrated_only": ({"DeviceCount": 1, "TorchIsIntegrated": 1}, PlatformKind.UNIFIED, "is_integrated=1"),
    "host_native_atomics_only": (
        {"DeviceCount": 1, "Integrated": 0, "HostNativeAtomicSupported": 1},
        PlatformKind.COHERENT,
        "HostNativeAtomicSupported=1",
    ),
    "nvml_c2c_only": ({"DeviceCount": 1, "NvmlC2cEnabled": 1}, PlatformKind.COHERENT, "NvmlC2cEnabled=1"),
    "gpu_nothing_readable": ({"DeviceCount": 1}, PlatformKind.DISCRETE, "could not read Integrated"),
    "nothing_known": ({}, PlatformKind.HOST_ONLY, "no device attribute is known"),
}


def _fake_props(**overrides: object) -> types.SimpleNamespace:
    props = {"pci_domain_id": 0, "pci_bus_id": 0, "pci_device_id": 6, "is_integrated": 0, "name": "Fake GPU"}
    return types.SimpleNamespace(**{**props, **overrides})


class PlatformTestCase(TestCase):
    """Clears the detection cache and the override variable around each test."""

    def setUp(self) -> None:
        super().setUp()
        platform_module._clear_caches()
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop(ENV_PLATFORM, None)
        self.addCleanup(platform_module._clear_caches)


class TestClassify(PlatformTestCase):
    @parametrize("machine", list(MACHINES))
    def test_machine(self, machine: str) -> None:
        attributes, expected_kind, reason_part = MACHINES[machine]
        classification = classify(attributes)
        self.assertEqual(classification.kind, expected_kind)
        self.assertIn(reason_part, classification.reason)

    def test_rule_order_integrated_beats_coherence(self) -> None:
        # DGX Spark reports the ATS attribute too; one DRAM decides first.
        self.assertEqual(DGX_SPARK["PageableMemoryAccessUsesHostPageTables"], 1)
        self.assertEqual(classify(DGX_SPARK).kind, PlatformKind.UNIFIED)

    def test_unknown_is_not_evidence(self) -> None:
        attributes = {**GH200_NUMA, "PageableMemoryAccessUsesHostPageTables": None,
                      "HostNativeAtomicSupported": None, "NvmlC2cEnabled": None}
        classification = classify(attributes)
        self.assertEqual(classification.kind, PlatformKind.DISCRETE)
        self.assertIn("PageableMemoryAccessUsesHostPageTables=unknown", classification.reason)
        self.assertIn(ENV_PLATFORM, classification.reason)

    def test_rejects_non_integer_values(self) -> None:
        with self.assertRaisesRegex(TypeError, "'Integrated' has value '1'.*int, or None"):
            classify({"Integrated": "1"})

    def test_rejects_attributes_that_are_not_a_mapping(self) -> None:
        for call in (classify, platform_from_attributes):
            with self.assertRaisesRegex(TypeError, "attributes must be a mapping of attribute name to int or None, got str"):
                call("Integrated=1")


class TestPlatformProperties(PlatformTestCase):
    @parametrize("machine", ["x86_h200", "gh200_numa", "dgx_spark", "jetson_orin", "no_accelerator"])
    def test_derived(self, machine: str) -> None:
        attributes, kind, _ = MACHINES[machine]
        platform = platform_from_attributes(attributes)
        self.assertEqual(platform.kind, kind)
        self.assertEqual(platform.source, "attributes")
        self.assertEqual(platform.copies_needed, kind in (PlatformKind.DISCRETE, PlatformKind.COHERENT))
        self.assertEqual(platform.device.type, "cpu" if kind is PlatformKind.HOST_ONLY else "cuda")
        # Jetson Orin cannot share managed memory concurrently; no GPU has none at all.
        self.assertEqual(platform.supports_managed_memory, machine not in ("jetson_orin", "no_accelerator"))
        self.assertEqual(platform.preferred_memory, "pinned")
        self.assertTrue(platform.strategy)
        json.dumps(platform.to_dict())

    def test_managed_preferred_when_unified_gpu_cannot_map_pinned_memory(self) -> None:
        platform = platform_from_attributes({**DGX_SPARK, "CanMapHostMemory": 0})
        self.assertEqual(platform.preferred_memory, "managed")

    def test_usable_device_bytes(self) -> None:
        capacities = {"gpu_free_bytes": 10, "gpu_total_bytes": 20, "host_available_bytes": 100}
        unified = dataclasses.replace(platform_from_attributes(DGX_SPARK), **capacities)
        discrete = dataclasses.replace(platform_from_attributes(X86_H200), **capacities)
        self.assertEqual(unified.usable_device_bytes, 100)  # MemAvailable, not cudaMemGetInfo
        self.assertEqual(discrete.usable_device_bytes, 10)

    def test_attribute_sets_refuse_unknown_names_and_impossible_values(self) -> None:
        # A misspelt name would otherwise read as "unknown" and an impossible value as plain
        # evidence: both classified silently. Every name a Platform records is accepted.
        for attributes, _, _ in MACHINES.values():
            platform_from_attributes(attributes)
        cases = {
            "PageableMemoryAcessUsesHostPageTables": (
                1, "'PageableMemoryAcessUsesHostPageTables' is not a known attribute (did you mean "
                "'PageableMemoryAccessUsesHostPageTables'?); the known attributes are DeviceCount, ",
            ),
            "Integrated": (2, "attribute Integrated=2 is out of range: Integrated takes an integer in [0, 1]"),
            "DeviceCount": (-1, "DeviceCount=-1 is out of range: DeviceCount takes an integer >= 0"),
            "NumaId": (-2, "NumaId=-2 is out of range: NumaId takes an integer >= -1"),
            "NvmlAddressingMode": (3, "NvmlAddressingMode takes an integer in [0, 2], or null for unknown"),
        }
        for name, (value, message) in cases.items():
            with self.assertRaisesRegex(ValueError, re.escape(message)):
                platform_from_attributes({**X86_H200, name: value})

    def test_forced_kind_on_attributes(self) -> None:
        platform = platform_from_attributes(X86_H200, kind="coherent")
        self.assertEqual(platform.kind, PlatformKind.COHERENT)
        self.assertEqual(platform.source, "argument")
        self.assertIn("the attributes say discrete", platform.reason)


class TestOverrides(PlatformTestCase):
    def test_argument_beats_environment_beats_detection(self) -> None:
        detected = detect_platform()
        self.assertEqual(detected.source, "detected")
        os.environ[ENV_PLATFORM] = "coherent"
        from_env = detect_platform()
        self.assertEqual((from_env.kind, from_env.source), (PlatformKind.COHERENT, "environment"))
        self.assertIn(f"{ENV_PLATFORM}='coherent'", from_env.reason)
        from_arg = detect_platform(kind=PlatformKind.UNIFIED)
        self.assertEqual((from_arg.kind, from_arg.source), (PlatformKind.UNIFIED, "argument"))
        self.assertIn(f"detection says {detected.kind.value}", from_arg.reason)

    def test_auto_detects(self) -> None:
        os.environ[ENV_PLATFORM] = "auto"
        self.assertEqual(detect_platform().source, "detected")
        self.assertEqual(detect_platform(kind="auto").source, "detected")

    def test_spelling_is_forgiving(self) -> None:
        self.assertEqual(detect_platform(kind="Host-Only").kind, PlatformKind.HOST_ONLY)

    def test_invalid_argument(self) -> None:
        with self.assertRaisesRegex(ValueError, r"kind='gpu' is not a platform kind; valid kinds: "
                                    r"unified, coherent, discrete, host_only"):
            detect_platform(kind="gpu")

    def test_invalid_environment(self) -> None:
        os.environ[ENV_PLATFORM] = "nvlink"
        with self.assertRaisesRegex(ValueError, f"{ENV_PLATFORM}='nvlink' is not a platform kind; valid kinds"):
            detect_platform()
        # The argument wins, so the variable is not consulted.
        self.assertEqual(detect_platform(kind="discrete").kind, PlatformKind.DISCRETE)

    def test_forced_host_only_means_cpu(self) -> None:
        platform = detect_platform(kind="host_only")
        self.assertEqual(platform.device, torch.device("cpu"))
        self.assertFalse(platform.copies_needed)
        self.assertIsNone(platform.gpu_total_bytes)

    @unittest.skipIf(HAS_CUDA, "checks a machine without a GPU")
    def test_forced_kind_without_gpu_keeps_cpu(self) -> None:
        for kind in (PlatformKind.DISCRETE, PlatformKind.COHERENT, PlatformKind.UNIFIED):
            platform = detect_platform(kind=kind)
            self.assertEqual((platform.kind, platform.device), (kind, torch.device("cpu")))
            self.assertFalse(platform.has_accelerator)
        self.assertTrue(detect_platform(kind="discrete").copies_needed)
        self.assertFalse(detect_platform(kind="unified").copies_needed)


class TestDetection(PlatformTestCase):
    @unittest.skipIf(HAS_CUDA, "checks a machine without a GPU")
    def test_no_accelerator(self) -> None:
        platform = detect_platform()
        self.assertEqual(platform.kind, PlatformKind.HOST_ONLY)
        self.assertEqual(platform.device, torch.device("cpu"))
        self.assertEqual(dict(platform.attributes), {"DeviceCount": 0})
        self.assertIn("no accelerator", platform.reason)
        self.assertIsNone(platform.gpu_total_bytes)
        self.assertIsNone(detect_platform(bandwidth=True).bandwidth)

    @unittest.skipIf(HAS_CUDA, "checks a machine without a GPU")
    def test_cuda_device_without_gpu_is_an_error(self) -> None:
        with self.assertRaisesRegex(ValueError, "torch.cuda.is_available\\(\\) is False"):
            detect_platform("cuda:0")

    def test_unsupported_device_type(self) -> None:
        with self.assertRaisesRegex(ValueError, "'meta' is not supported"):
            detect_platform("meta")

    def test_not_a_device(self) -> None:
        for device in ("banana", "cuda:x", "", 1.5):
            with self.assertRaisesRegex(
                ValueError, re.escape(f"device {device!r} is not a device: pass a CUDA device as cuda:N or its index N")
            ):
                detect_platform(device)

    def test_attributes_cached_capacities_fresh(self) -> None:
        with mock.patch.object(torch.cuda, "device_count", wraps=torch.cuda.device_count) as count, \
                mock.patch.object(platform_module, "read_host_available_bytes", side_effect=[1 << 30, 2 << 30]):
            first = detect_platform("cpu")
            second = detect_platform("cpu", kind="discrete")
        self.assertEqual(count.call_count, 1)
        self.assertIs(first.attributes, second.attributes)
        self.assertEqual((first.host_available_bytes, second.host_available_bytes), (1 << 30, 2 << 30))

    def test_capacities(self) -> None:
        with mock.patch.object(platform_module, "read_locked_memory_limit_bytes", return_value=None):
            platform = detect_platform("cpu")
        self.assertIsNone(platform.locked_memory_limit_bytes)  # unlimited
        self.assertGreater(platform.host_available_bytes, 0)
        import resource

        for soft, expected in ((resource.RLIM_INFINITY, None), (64 << 10, 64 << 10), (0, 0)):
            with mock.patch.object(resource, "getrlimit", return_value=(soft, resource.RLIM_INFINITY)):
                self.assertEqual(platform_module.read_locked_memory_limit_bytes(), expected)


class TestAttributeReaders(PlatformTestCase):
    def _all_cuda_unknown(self, attributes: dict) -> None:
        for name in CUDA_DEVICE_ATTRIBUTES:
            self.assertIsNone(attributes[name], name)

    def test_readers_raising_give_unknown_never_zero(self) -> None:
        no_driver = RuntimeError("no driver")
        with mock.patch.object(platform_readers, "_read_attributes_cuda_bindings", side_effect=no_driver), \
                mock.patch.object(platform_readers, "_read_attributes_libcuda", side_effect=OSError("no libcuda")), \
                mock.patch.object(torch.cuda, "device_count", return_value=1), \
                mock.patch.object(torch.cuda, "get_device_properties", side_effect=RuntimeError("no GPU")):
            attributes, reader, name = platform_readers.read_device_attributes(0)
        self._all_cuda_unknown(attributes)
        self.assertIsNone(attributes["TorchIsIntegrated"])
        self.assertEqual((reader, name, attributes["DeviceCount"]), (None, None, 1))
        classification = classify(attributes)
        self.assertEqual(classification.kind, PlatformKind.DISCRETE)
        self.assertIn("could not read Integrated", classification.reason)

    def test_falls_back_to_libcuda(self) -> None:
        values = {name: 0 for name in CUDA_DEVICE_ATTRIBUTES}
        with mock.patch.object(platform_readers, "_read_attributes_cuda_bindings", side_effect=ImportError("cuda")), \
                mock.patch.object(platform_readers, "_read_attributes_libcuda", return_value=values):
            self.assertEqual(platform_readers._read_cuda_attributes(0), (values, "libcuda"))
        # A reader that knows nothing does not win either.
        unknown = dict.fromkeys(CUDA_DEVICE_ATTRIBUTES)
        with mock.patch.object(platform_readers, "_read_attributes_cuda_bindings", return_value=unknown), \
                mock.patch.object(platform_readers, "_read_attributes_libcuda", return_value=values):
            self.assertEqual(platform_readers._read_cuda_attributes(0)[1], "libcuda")

    @unittest.skipIf(HAS_CUDA, "checks a machine without a GPU")
    def test_real_readers_without_gpu(self) -> None:
        attributes, reader = platform_readers._read_cuda_attributes(0)
        self.assertIsNone(reader)
        self._all_cuda_unknown(attributes)

    def test_libcuda_reader_unknown_id_is_none(self) -> None:
        calls = []

        class FakeLibcuda:
            def cuInit(self, flags: int) -> int:
                return 0

            def cuDeviceGet(self, device_ref, ordinal) -> int:
                device_ref._obj.value = ordinal.value
                return 0

            def cuDeviceGetAttribute(self, value_ref, attribute_id, device) -> int:
                calls.append(device.value)
                if attribute_id.value == CUDA_DEVICE_ATTRIBUTES["HostNumaId"]:
                    return 1  # CUDA_ERROR_INVALID_VALUE: a driver older than the attribute
                value_ref._obj.value = attribute_id.value
                return 0

        with mock.patch.object(ctypes, "CDLL", return_value=FakeLibcuda()):
            values = platform_readers._read_attributes_libcuda(3)
        self.assertIsNone(values["HostNumaId"])
        self.assertEqual(values["Integrated"], 18)
        self.assertEqual(set(calls), {3})

    def test_libcuda_init_failure_raises_for_fallback(self) -> None:
        fake = types.SimpleNamespace(cuInit=lambda flags: 100)  # CUDA_ERROR_NO_DEVICE
        with mock.patch.object(ctypes, "CDLL", return_value=fake):
            with self.assertRaisesRegex(OSError, "cuInit failed with CUresult 100"):
                platform_readers._read_attributes_libcuda(0)

    def _fake_cuda_bindings(self, missing_id: int, failing_id: int) -> dict[str, types.ModuleType]:
        runtime = types.ModuleType("cuda.bindings.runtime")

        def cuda_device_attr(attribute_id: int) -> int:
            if attribute_id == missing_id:
                raise ValueError(f"{attribute_id} is not a valid cudaDeviceAttr")
            return attribute_id

        runtime.cudaDeviceAttr = cuda_device_attr
        runtime.cudaError_t = types.SimpleNamespace(cudaSuccess=0)
        runtime.cudaDeviceGetAttribute = lambda attribute, device: (
            (1, 0) if attribute == failing_id else (0, attribute + 1000 * device)
        )
        bindings = types.ModuleType("cuda.bindings")
        bindings.runtime = runtime
        cuda = types.ModuleType("cuda")
        cuda.bindings = bindings
        return {"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": runtime}

    def test_cuda_bindings_reader(self) -> None:
        fake = self._fake_cuda_bindings(CUDA_DEVICE_ATTRIBUTES["HostNumaId"], CUDA_DEVICE_ATTRIBUTES["NumaId"])
        with mock.patch.dict(sys.modules, fake):
            values = platform_readers._read_attributes_cuda_bindings(1)
        self.assertIsNone(values["HostNumaId"])  # bindings too old to name it
        self.assertIsNone(values["NumaId"])  # the call failed: unknown, not the 0 it returned
        self.assertEqual(values["PageableMemoryAccess"], 1088)

    def test_nvml_reader(self) -> None:
        nvml = types.ModuleType("pynvml")
        nvml.nvmlInit = mock.Mock()
        nvml.nvmlShutdown = mock.Mock()
        nvml.nvmlDeviceGetHandleByPciBusId = mock.Mock(return_value="handle")
        nvml.nvmlDeviceGetC2cModeInfoV = mock.Mock(return_value=types.SimpleNamespace(isC2cEnabled=1))
        nvml.nvmlDeviceGetAddressingMode = mock.Mock(side_effect=RuntimeError("NVML_ERROR_NOT_SUPPORTED"))
        with mock.patch.dict(sys.modules, {"pynvml": nvml}), \
                mock.patch.object(torch.cuda, "get_device_properties", return_value=_fake_props()):
            values = platform_readers._read_nvml_attributes(0)
        self.assertEqual(values, {"NvmlC2cEnabled": 1, "NvmlAddressingMode": None})
        nvml.nvmlDeviceGetHandleByPciBusId.assert_called_once_with("00000000:00:06.0")
        nvml.nvmlShutdown.assert_called_once()

    def test_nvml_init_failure(self) -> None:
        nvml = types.ModuleType("pynvml")
        nvml.nvmlInit = mock.Mock(side_effect=RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED"))
        with mock.patch.dict(sys.modules, {"pynvml": nvml}):
            values = platform_readers._read_nvml_attributes(0)
        self.assertEqual(values, {"NvmlC2cEnabled": None, "NvmlAddressingMode": None})


def _h200_report() -> BandwidthReport:
    row = BandwidthRow(64 * MiB, 54.2, 55.0, 83.6, 7.2, 13.2)
    return BandwidthReport("cuda:0", "NVIDIA H200", 256 * MiB, 5, (row,), 4212.3, "2.11.0")


class TestBandwidth(PlatformTestCase):
    def test_link_ratio_meaning(self) -> None:
        self.assertIn("never copy", interpret_link_ratio(1.0))
        self.assertIn("often pays", interpret_link_ratio(10.0))
        self.assertIn("planner", interpret_link_ratio(80.0))
        with self.assertRaisesRegex(ValueError, "must be positive"):
            interpret_link_ratio(0.0)

    def test_report_derived_figures(self) -> None:
        report = _h200_report()
        self.assertEqual(report.link_gbps, 55.0)
        self.assertAlmostEqual(report.dram_to_link_ratio, 4212.3 / 55.0)
        self.assertIn("discrete-class", report.ratio_meaning)
        as_dict = json.loads(json.dumps(report.to_dict()))
        self.assertEqual(as_dict["rows"][0]["chunk_bytes"], 64 * MiB)
        self.assertEqual(as_dict["bidirectional_gbps"], 83.6)

    def test_bad_arguments(self) -> None:
        with self.assertRaisesRegex(ValueError, "sizes must be a non-empty sequence of positive"):
            measure_bandwidth(sizes=[])
        with self.assertRaisesRegex(ValueError, "sizes must be"):
            measure_bandwidth(sizes=[MiB, 0])
        with self.assertRaisesRegex(ValueError, "repeats must be an int >= 1"):
            measure_bandwidth(repeats=0)

    def test_cpu_device_has_no_link(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "measure_bandwidth needs a CUDA device"):
            measure_bandwidth("cpu")

    @unittest.skipIf(HAS_CUDA, "checks a machine without a GPU")
    def test_no_gpu(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "no CPU-GPU link to measure"):
            measure_bandwidth()


@unittest.skipIf(not HAS_CUDA, "needs a GPU")
class TestOnGPU(PlatformTestCase):
    def test_detect(self) -> None:
        platform = detect_platform()
        self.assertEqual(platform.device, torch.device("cuda", torch.cuda.current_device()))
        self.assertNotEqual(platform.kind, PlatformKind.HOST_ONLY)
        self.assertIsNotNone(platform.attribute_reader)
        self.assertIsNotNone(platform.attributes["Integrated"])
        self.assertGreater(platform.gpu_total_bytes, 0)
        self.assertGreater(platform.gpu_free_bytes, 0)
        self.assertEqual(platform.device_name, torch.cuda.get_device_name())
        if "H200" in platform.device_name and not torch.cuda.get_device_properties(0).is_integrated:
            # An x86 + H200 over PCIe reports the values X86_H200 holds.
            self.assertEqual(platform.kind, PlatformKind.DISCRETE)
            for name in ("Integrated", "PageableMemoryAccessUsesHostPageTables", "HostNativeAtomicSupported"):
                self.assertEqual(platform.attributes[name], X86_H200[name], name)
            self.assertEqual(platform.attributes["ConcurrentManagedAccess"], 1)
            self.assertTrue(platform.supports_managed_memory)

    def test_libcuda_agrees_with_cuda_bindings(self) -> None:
        try:
            from_bindings = platform_readers._read_attributes_cuda_bindings(0)
        except ImportError:
            self.skipTest("cuda.bindings is not installed")
        from_libcuda = platform_readers._read_attributes_libcuda(0)
        for name in ("Integrated", "PageableMemoryAccess", "PageableMemoryAccessUsesHostPageTables",
                     "HostNativeAtomicSupported", "ConcurrentManagedAccess"):
            self.assertIsNotNone(from_libcuda[name], name)
        for name, value in from_bindings.items():
            if value is not None and from_libcuda[name] is not None:
                self.assertEqual(from_libcuda[name], value, name)

    def test_measure_bandwidth(self) -> None:
        report = measure_bandwidth(sizes=(4 * MiB, 64 * MiB), repeats=2)
        self.assertEqual([row.chunk_bytes for row in report.rows], [4 * MiB, 64 * MiB])
        for row in report.rows:
            for field in dataclasses.fields(row):
                if field.name != "chunk_bytes":
                    self.assertGreater(getattr(row, field.name), 1.0, field.name)
        self.assertGreater(report.device_copy_gbps, 1.0)
        self.assertGreater(report.dram_to_link_ratio, 0.0)
        self.assertIs(measure_bandwidth(sizes=(64 * MiB, 4 * MiB), repeats=2), report)  # cached


instantiate_parametrized_tests(TestClassify)
instantiate_parametrized_tests(TestPlatformProperties)

if __name__ == "__main__":
    run_tests()
