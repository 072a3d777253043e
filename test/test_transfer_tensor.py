"""Tests for ``TransferTensor``.

On a machine without a GPU the platform kind is forced: a forced DISCRETE or UNIFIED platform keeps
``device=cpu``, which makes plain CPU tensors that platform's "device tensors", so the copy path
(through the transfer engine's CPU path, counted) and the zero-copy path run for real. A platform
built from a GPU's attributes (``platform_from_attributes``) has home device ``cuda:0`` on any
machine, which drives the host path and the device-mismatch errors. GPU tests repeat the important
cases on the real device.
"""

import copy
import io
import unittest

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    TestCase,
)

from torch_fsdp_offload.memory import memory_stats
from torch_fsdp_offload.platform import detect_platform, platform_from_attributes, PlatformKind
from torch_fsdp_offload.transfer import get_transfer_engine
from torch_fsdp_offload.transfer_tensor import TransferTensor

# An x86 + H200 machine (platforms.md): DISCRETE, home device cuda:0 on any machine.
_H200_ATTRIBUTES = {
    "DeviceCount": 1,
    "Integrated": 0,
    "PageableMemoryAccess": 0,
    "PageableMemoryAccessUsesHostPageTables": 0,
    "HostNativeAtomicSupported": 0,
    "ConcurrentManagedAccess": 1,
    "ManagedMemory": 1,
}

_HAS_GPU = torch.cuda.is_available()


def _cpu_platform(kind):
    """A platform of ``kind`` whose device is the CPU, on any machine: plain CPU tensors are then
    its device tensors, and its copies run (counted) through the CPU transfer engine."""
    return detect_platform("cpu", kind=kind)


def _serving(transfer_tensor, platform):
    """Point a TransferTensor at another platform's GPU: on a CPU machine ``empty`` cannot pin
    memory for a ``cuda:0`` it does not have, but the dispatch only reads the home device."""
    transfer_tensor._host_bytes.platform = platform
    return transfer_tensor


def _engine_stats(device):
    stats = get_transfer_engine(torch.device(device)).stats
    return stats.h2d_copies, stats.d2h_copies


class _EngineCountingTestCase(TestCase):
    def setUp(self):
        super().setUp()
        get_transfer_engine(torch.device("cpu")).stats.reset()
        if _HAS_GPU:
            get_transfer_engine(torch.device("cuda", torch.cuda.current_device())).stats.reset()


class TestTransferTensorCPU(_EngineCountingTestCase):
    def test_empty_is_exact_size_host_memory(self):
        before = memory_stats()["host_count"]
        t = TransferTensor.empty((3, 5), torch.float16)
        self.assertIsInstance(t, TransferTensor)
        self.assertEqual(t.shape, (3, 5))
        self.assertEqual(t.dtype, torch.float16)
        self.assertEqual(t.device, torch.device("cpu"))
        self.assertEqual(t.memory, "pinned")
        self.assertEqual(t.is_pinned(), _HAS_GPU)
        self.assertEqual(memory_stats()["host_count"], before + 1)

    @parametrize("kind", ["discrete", "unified", "coherent", "host_only"])
    def test_talk_example(self, kind):
        n = 1000
        x, y, z = torch.randn(n), torch.randn(n), torch.randn(n)
        t = TransferTensor.empty(n, platform=_cpu_platform(kind))
        result = torch.add(x, y, out=t)
        self.assertIs(result, t)
        out = torch.add(t, z)
        self.assertIs(type(out), torch.Tensor)
        self.assertEqual(out, torch.add(x + y, z), atol=0, rtol=0)
        h2d, d2h = _engine_stats("cpu")
        if kind == "discrete":
            # out= computed on the "device" and written back, then one copy up for the read.
            self.assertEqual((h2d, d2h), (1, 1))
        else:
            self.assertEqual((h2d, d2h), (0, 0))

    def test_host_op_on_gpu_platform_writes_host_memory_without_copies(self):
        platform = platform_from_attributes(_H200_ATTRIBUTES)
        self.assertEqual(platform.kind, PlatformKind.DISCRETE)
        t = _serving(TransferTensor.empty(4, platform=_cpu_platform("discrete")), platform)
        x, y = torch.arange(4.0), torch.ones(4)
        self.assertIs(torch.add(x, y, out=t), t)
        doubled = t * 2
        self.assertIs(type(doubled), torch.Tensor)
        self.assertEqual(doubled, torch.tensor([2.0, 4.0, 6.0, 8.0]))
        self.assertEqual(_engine_stats("cpu"), (0, 0))

    @parametrize("kind", ["discrete", "unified"])
    def test_gradcheck_through_the_move(self, kind):
        t = TransferTensor.from_tensor(
            torch.randn(4, 3, dtype=torch.double), platform=_cpu_platform(kind), requires_grad=True
        )
        w = torch.randn(3, 2, dtype=torch.double, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(lambda t, w: torch.tanh(t @ w), (t, w)))
        h2d, d2h = _engine_stats("cpu")
        if kind == "discrete":
            self.assertGreater(h2d, 0)
            self.assertGreater(d2h, 0)  # the backward's gradient moves down
        else:
            self.assertEqual((h2d, d2h), (0, 0))

    @parametrize("kind", ["discrete", "unified"])
    def test_leaf_gets_host_grad(self, kind):
        t = TransferTensor.from_tensor(
            torch.arange(3.0), platform=_cpu_platform(kind), requires_grad=True
        )
        w = torch.tensor([1.0, 2.0, 3.0])
        (t * w).sum().backward()
        self.assertIs(type(t.grad), torch.Tensor)
        self.assertEqual(t.grad.device, torch.device("cpu"))
        self.assertEqual(t.grad, w)
        self.assertEqual(_engine_stats("cpu"), (1, 1) if kind == "discrete" else (0, 0))

    def test_inplace_and_setitem_write_back_on_copy_path(self):
        t = TransferTensor.from_tensor(torch.zeros(4), platform=_cpu_platform("discrete"))
        result = t.add_(torch.ones(4))
        self.assertIs(result, t)
        self.assertEqual(_engine_stats("cpu"), (1, 1))
        t[1:3] = torch.full((2,), 5.0)
        self.assertEqual(t.cpu(), torch.tensor([1.0, 5.0, 5.0, 1.0]))
        t += torch.ones(4)
        self.assertIsInstance(t, TransferTensor)
        self.assertEqual(t.cpu(), torch.tensor([2.0, 6.0, 6.0, 2.0]))

    def test_foreach_inplace_writes_back(self):
        params = [
            TransferTensor.from_tensor(torch.zeros(2), platform=_cpu_platform("discrete"))
            for _ in range(2)
        ]
        torch._foreach_add_(params, [torch.ones(2), torch.full((2,), 2.0)])
        self.assertEqual([param.cpu() for param in params], [torch.ones(2), torch.full((2,), 2.0)])
        self.assertEqual(_engine_stats("cpu"), (2, 2))

    def test_write_into_leaf_requiring_grad_is_refused(self):
        t = TransferTensor.from_tensor(
            torch.zeros(2), platform=_cpu_platform("discrete"), requires_grad=True
        )
        with self.assertRaisesRegex(RuntimeError, "requires grad .* torch.no_grad"):
            torch.add(torch.ones(2), torch.ones(2), out=t)
        self.assertEqual(_engine_stats("cpu"), (0, 0))
        with torch.no_grad():
            torch.add(torch.ones(2), torch.ones(2), out=t)
        self.assertEqual(t.detach(), torch.full((2,), 2.0))

    def test_to_and_cpu_return_plain_host_tensors(self):
        t = TransferTensor.from_tensor(
            torch.arange(3.0), platform=_cpu_platform("discrete"), requires_grad=True
        )
        host = t.cpu()
        self.assertIs(type(host), torch.Tensor)
        self.assertEqual(host.data_ptr(), t.data_ptr())
        self.assertIs(type(t.to("cpu")), torch.Tensor)
        as_double = t.to(torch.double)
        self.assertIs(type(as_double), torch.Tensor)
        self.assertEqual(as_double.dtype, torch.double)
        (as_double.sum() + host.sum()).backward()
        self.assertEqual(t.grad, torch.full((3,), 2.0))
        self.assertEqual(_engine_stats("cpu"), (0, 0))

    def test_parameter_of_a_module(self):
        linear = torch.nn.Linear(3, 2, bias=False)
        expected_weight = linear.weight.detach().clone()
        host_weight = TransferTensor.from_tensor(expected_weight, platform=_cpu_platform("discrete"))
        linear.weight = torch.nn.Parameter(host_weight)
        self.assertIsInstance(linear.weight, TransferTensor)
        self.assertIsInstance(linear.weight, torch.nn.Parameter)
        self.assertEqual(linear.weight.data_ptr(), host_weight.data_ptr())
        x = torch.randn(5, 3)
        linear(x).sum().backward()
        self.assertEqual(linear.weight.grad, torch.ones(5, 2).T @ x)
        self.assertEqual(_engine_stats("cpu"), (1, 1))
        copied = copy.deepcopy(linear)
        self.assertIsInstance(copied.weight, TransferTensor)
        self.assertIsInstance(copied.weight, torch.nn.Parameter)
        self.assertNotEqual(copied.weight.data_ptr(), linear.weight.data_ptr())

    def test_detach_shares_host_bytes(self):
        t = TransferTensor.from_tensor(torch.zeros(3), platform=_cpu_platform("discrete"))
        detached = t.detach()
        self.assertIsInstance(detached, TransferTensor)
        self.assertEqual(detached.memory, "pinned")
        detached.fill_(1.0)
        self.assertEqual(t.cpu(), torch.ones(3))

    def test_repr_shows_data_and_memory_kind(self):
        t = TransferTensor.from_tensor(torch.arange(3.0), platform=_cpu_platform("discrete"))
        self.assertExpectedInline(
            repr(t), """TransferTensor([0., 1., 2.], memory='pinned', platform='discrete')"""
        )
        grid = TransferTensor.from_tensor(
            torch.arange(4.0).view(2, 2), platform=_cpu_platform("unified"), requires_grad=True
        )
        self.assertExpectedInline(
            str(grid),
            """\
TransferTensor([[0., 1.],
                [2., 3.]], requires_grad=True, memory='pinned', platform='unified')""",
        )

    @parametrize("weights_only", [True, False])
    def test_save_load_round_trip(self, weights_only):
        t = TransferTensor.from_tensor(
            torch.randn(5, 2), platform=_cpu_platform("discrete"), requires_grad=True
        )
        buffer = io.BytesIO()
        torch.save({"t": t}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=weights_only)["t"]
        self.assertIsInstance(loaded, TransferTensor)
        self.assertEqual(loaded.memory, "pinned")
        self.assertEqual(loaded.is_pinned(), _HAS_GPU)
        self.assertTrue(loaded.requires_grad)
        self.assertEqual(loaded.detach(), t.detach(), atol=0, rtol=0)
        # Reloaded on the platform found at load time, not the one it was saved from.
        self.assertEqual(loaded.platform.kind, detect_platform().kind)

    def test_deepcopy_keeps_memory_kind(self):
        t = TransferTensor.from_tensor(torch.arange(3.0), platform=_cpu_platform("discrete"))
        clone = copy.deepcopy(t)
        self.assertIsInstance(clone, TransferTensor)
        self.assertEqual(clone.memory, "pinned")
        self.assertNotEqual(clone.data_ptr(), t.data_ptr())
        self.assertEqual(clone.cpu(), t.cpu())

    def test_unknown_memory_kind_is_refused_before_allocation(self):
        before = memory_stats()
        with self.assertRaisesRegex(ValueError, "unknown memory kind 'shared'.*'pinned'"):
            TransferTensor.empty(4, memory="shared")
        self.assertEqual(memory_stats(), before)

    def test_managed_without_support_is_refused_before_allocation(self):
        before = memory_stats()
        attributes = dict(_H200_ATTRIBUTES, ConcurrentManagedAccess=0)
        for platform in (_cpu_platform("discrete"), platform_from_attributes(attributes)):
            with self.assertRaisesRegex(ValueError, "memory='managed' needs .*memory='pinned'"):
                TransferTensor.empty(4, memory="managed", platform=platform)
        self.assertEqual(memory_stats(), before)

    def test_op_on_another_device_is_refused_before_copying(self):
        t = _serving(TransferTensor.empty(4), platform_from_attributes(_H200_ATTRIBUTES))
        other_device = torch.empty(4, device="meta")
        with self.assertRaisesRegex(RuntimeError, "on meta got a TransferTensor that serves"):
            torch.add(t, other_device)
        self.assertEqual(_engine_stats("cpu"), (0, 0))

    @parametrize(
        "size, error, message",
        [
            subtest(((2.5, 3), TypeError, r"size=\(2\.5, 3\)\) takes an int or a sequence of ints.*entry 2\.5 is a float"),
                    name="float_entry"),
            subtest(("4", TypeError, r"size=\.\.\.\) takes an int or a sequence of ints.*got str '4'"), name="str"),
            subtest((True, TypeError, r"size=\.\.\.\) takes an int or a sequence of ints.*got bool True"), name="bool"),
            subtest(((2, True), TypeError, r"size=\(2, True\)\).*entry True is a bool"), name="bool_entry"),
            subtest((4.0, TypeError, r"size=\.\.\.\).*got float 4\.0"), name="float"),
            subtest((None, TypeError, r"size=\.\.\.\).*got NoneType None"), name="none"),
            subtest(((2, -3), ValueError, r"size=\(2, -3\)\) takes an int or a sequence of ints >= 0.*entry -3 is negative"),
                    name="negative_entry"),
        ],
    )
    def test_bad_size_is_refused_before_allocation(self, size, error, message):
        before = memory_stats()
        with self.assertRaisesRegex(error, r"TransferTensor\.empty\(" + message):
            TransferTensor.empty(size)
        self.assertEqual(memory_stats(), before)

    def test_integer_sizes_are_accepted(self):
        for size, shape in ((3, (3,)), ([2, 3], (2, 3)), (torch.Size([2, 3]), (2, 3)), ((torch.tensor(2), 3), (2, 3))):
            self.assertEqual(TransferTensor.empty(size).shape, shape)

    @parametrize(
        "source",
        [subtest([1.0, 2.0], name="list"), subtest(3, name="int"), subtest(None, name="none"), subtest("x", name="str")],
    )
    def test_non_tensor_source_is_refused_before_allocation(self, source):
        before = memory_stats()
        with self.assertRaisesRegex(
            TypeError, rf"TransferTensor\.from_tensor\(tensor=\.\.\.\) copies a torch\.Tensor, got {type(source).__name__} .*torch\.as_tensor"
        ):
            TransferTensor.from_tensor(source)
        self.assertEqual(memory_stats(), before)

    def test_bad_dtype_and_requires_grad_are_refused(self):
        with self.assertRaisesRegex(TypeError, r"TransferTensor\.empty\(dtype=\.\.\.\) takes a torch\.dtype.*got 'float'"):
            TransferTensor.empty(4, "float")
        with self.assertRaisesRegex(TypeError, r"requires_grad takes True or False, got 'yes'"):
            TransferTensor.from_tensor(torch.ones(2), requires_grad="yes")

    def test_direct_construction_is_refused(self):
        with self.assertRaisesRegex(TypeError, "TransferTensor.empty"):
            TransferTensor([1.0, 2.0])


@unittest.skipIf(not _HAS_GPU, "needs a GPU")
class TestTransferTensorGPU(_EngineCountingTestCase):
    def _device(self):
        return torch.device("cuda", torch.cuda.current_device())

    @parametrize("kind", ["discrete", "unified", "coherent"])
    def test_talk_example_bit_equal_to_explicit_copy(self, kind):
        n = 1 << 20
        x, y = torch.randn(n), torch.randn(n)
        t = TransferTensor.empty(n, platform=kind)
        torch.add(x, y, out=t)
        z = torch.randn(n, device="cuda")
        out = torch.add(t, z)
        expected = torch.add((x + y).pin_memory().cuda(non_blocking=True), z)
        self.assertIs(type(out), torch.Tensor)
        self.assertEqual(out.device, self._device())
        self.assertEqual(out, expected, atol=0, rtol=0)
        # The CPU op ran on the host bytes; only the GPU op's read may cross the link.
        self.assertEqual(_engine_stats(self._device()), (1, 0) if kind == "discrete" else (0, 0))

    @parametrize("kind", ["discrete", "unified"])
    def test_gradcheck_on_gpu(self, kind):
        t = TransferTensor.from_tensor(
            torch.randn(4, 3, dtype=torch.double), platform=kind, requires_grad=True
        )
        w = torch.randn(3, 2, dtype=torch.double, device="cuda", requires_grad=True)
        def forward(t, w):
            out = torch.tanh(t @ w)
            # gradcheck perturbs t through t.data, a plain alias TransferTensor cannot order
            # against GPU work still reading the host bytes.
            torch.cuda.synchronize()
            return out

        self.assertTrue(torch.autograd.gradcheck(forward, (t, w)))
        self.assertEqual(t.grad, None)
        (t @ w).sum().backward()
        self.assertEqual(t.grad.device, torch.device("cpu"))
        self.assertEqual(t.grad, w.detach().sum(1).cpu().expand(4, 3))

    def test_mixed_ops_discrete(self):
        device = self._device()
        host = torch.randn(64, 32)
        t = TransferTensor.from_tensor(host, platform="discrete")
        w = torch.randn(32, 16, device=device)
        self.assertEqual(t @ w, host.to(device) @ w)
        zeros = torch.zeros(1, 32)
        self.assertEqual(torch.cat([t, zeros.to(device)]), torch.cat([host, zeros]).to(device))
        # Writes from the GPU land in host memory before the call returns.
        bias = torch.randn(64, 32, device=device)
        self.assertIs(t.add_(bias), t)
        self.assertEqual(t.cpu(), host + bias.cpu())
        out = TransferTensor.empty((64, 16), platform="discrete")
        self.assertIs(torch.matmul(host.to(device), w, out=out), out)
        self.assertEqual(out.cpu(), (host.to(device) @ w).cpu())
        self.assertIs(t.copy_(bias), t)
        self.assertEqual(t.cpu(), bias.cpu())

    @parametrize("kind", ["discrete", "unified"])
    def test_to_and_cuda_return_plain_device_tensors(self, kind):
        device = self._device()
        t = TransferTensor.from_tensor(torch.arange(4.0), platform=kind)
        for moved in (t.cuda(), t.to("cuda"), t.to(device, torch.double), t.to("cuda", copy=True)):
            self.assertIs(type(moved), torch.Tensor)
            self.assertEqual(moved.device, device)
            self.assertEqual(moved.cpu(), torch.arange(4.0), exact_dtype=False)
        aliases = t.cuda().data_ptr() == t.data_ptr()
        self.assertEqual(aliases, kind == "unified")
        self.assertNotEqual(t.to("cuda", copy=True).data_ptr(), t.data_ptr())

    @parametrize("kind", ["discrete", "unified"])
    def test_managed_memory(self, kind):
        platform = detect_platform(kind=kind)
        if not platform.supports_managed_memory:
            self.skipTest("this GPU has no concurrent managed memory")
        before = memory_stats()["managed_count"]
        t = TransferTensor.from_tensor(torch.arange(8.0), memory="managed", platform=platform)
        self.assertEqual(t.memory, "managed")
        self.assertEqual(memory_stats()["managed_count"], before + 1)
        z = torch.ones(8, device="cuda")
        self.assertEqual(t + z, torch.arange(1.0, 9.0, device="cuda"))
        self.assertEqual(_engine_stats(self._device()), (1, 0) if kind == "discrete" else (0, 0))

    @parametrize("kind", ["discrete", "unified"])
    def test_host_write_waits_for_device_read(self, kind):
        # 256 MiB: the GPU still reads (a copy over PCIe, or a kernel through the alias) when the
        # host starts overwriting, unless the write waits.
        n = 64 << 20
        t = TransferTensor.from_tensor(torch.ones(n), platform=kind)
        z = torch.zeros(n, device="cuda")
        out = t + z
        t.fill_(2.0)
        self.assertEqual(out, torch.ones(n, device="cuda"), atol=0, rtol=0)
        self.assertEqual(t.cpu(), torch.full((n,), 2.0), atol=0, rtol=0)

    def test_save_load_reloads_pinned(self):
        t = TransferTensor.from_tensor(torch.randn(8), memory="pinned")
        buffer = io.BytesIO()
        torch.save(t, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
        self.assertIsInstance(loaded, TransferTensor)
        self.assertTrue(loaded.is_pinned())
        self.assertEqual(loaded.cpu(), t.cpu(), atol=0, rtol=0)

    @unittest.skipIf(torch.cuda.device_count() < 2, "needs two GPUs")
    def test_mixing_two_cuda_devices_is_refused(self):
        t = TransferTensor.empty(4, platform=detect_platform("cuda:0"))
        with self.assertRaisesRegex(RuntimeError, "on cuda:1 got a TransferTensor that serves"):
            torch.add(t, torch.ones(4, device="cuda:1"))
        self.assertEqual(_engine_stats("cuda:0"), (0, 0))


instantiate_parametrized_tests(TestTransferTensorCPU)
instantiate_parametrized_tests(TestTransferTensorGPU)

if __name__ == "__main__":
    run_tests()
