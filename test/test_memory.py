"""Tests for torch_fsdp_offload.memory (exact-size host memory, the pool, capacity checks) and
torch_fsdp_offload.device_memory (zero-copy device views, managed memory).

The CPU tests drive the real pool (anonymous mappings, page alignment, reuse, release) with
``device="cpu"``, which skips only the pinning call; the GPU tests add pinning, managed memory and
zero-copy views.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import threading
import unittest
from unittest import mock

import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_fsdp_offload import memory
from torch_fsdp_offload.device_memory import device_view, managed_empty
from torch_fsdp_offload.memory import (
    HUGE_PAGE_SIZE,
    PAGE_SIZE,
    HostMemoryError,
    check_host_capacity,
    empty_cache,
    memory_stats,
    pinned_empty,
)

HAS_CUDA = torch.cuda.is_available()
HAS_CUDA_BINDINGS = importlib.util.find_spec("cuda") is not None and (
    importlib.util.find_spec("cuda.bindings") is not None or importlib.util.find_spec("cuda.cudart") is not None
)
MiB = 1 << 20


def _round_up_to_page(nbytes: int) -> int:
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


def _resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class TestPinnedEmptyOnHost(TestCase):
    """The pool's logic, on plain (unpinned) host memory."""

    def setUp(self) -> None:
        super().setUp()
        empty_cache()

    @parametrize(
        "shape,dtype",
        [
            ((1,), torch.uint8),
            ((3, 5), torch.bfloat16),
            ((4097,), torch.uint8),
            ((1 << 20,), torch.float32),  # 4 MiB: 2 MiB aligned
            ((3, 1000003), torch.float16),
            ((2, 3, 7), torch.float64),
            ((), torch.int32),
        ],
    )
    def test_exact_size_and_alignment(self, shape, dtype) -> None:
        before = memory_stats()
        tensor = pinned_empty(shape, dtype, device="cpu")
        nbytes = tensor.numel() * dtype.itemsize
        self.assertEqual(tensor.shape, torch.Size(shape))
        self.assertEqual(tensor.dtype, dtype)
        self.assertTrue(tensor.is_contiguous())
        self.assertFalse(tensor.is_pinned())
        self.assertEqual(tensor.untyped_storage().nbytes(), nbytes)
        self.assertEqual(tensor.data_ptr() % PAGE_SIZE, 0)
        if nbytes >= HUGE_PAGE_SIZE:
            self.assertEqual(tensor.data_ptr() % HUGE_PAGE_SIZE, 0)
        after = memory_stats()
        self.assertEqual(after["host_bytes"] - before["host_bytes"], nbytes)
        self.assertEqual(after["host_count"] - before["host_count"], 1)
        # The memory behind it is the request rounded to whole pages, never to a power of two.
        self.assertEqual(after["reserved_bytes"] - before["reserved_bytes"], _round_up_to_page(nbytes))
        tensor.fill_(1)
        self.assertTrue(bool((tensor == 1).all()))

    def test_zero_elements(self) -> None:
        before = memory_stats()
        tensor = pinned_empty((0, 4), torch.float32, device="cpu")
        self.assertEqual(tensor.shape, (0, 4))
        self.assertEqual(tensor.untyped_storage().nbytes(), 0)
        self.assertEqual(memory_stats(), before)

    def test_pool_reuses_blocks_of_the_same_page_rounded_size(self) -> None:
        first = pinned_empty(5000, torch.uint8, device="cpu")  # 2 pages
        address = first.data_ptr()
        before = memory_stats()
        del first
        freed = memory_stats()
        self.assertEqual(freed["cached_count"] - before["cached_count"], 1)
        self.assertEqual(freed["cached_bytes"] - before["cached_bytes"], 2 * PAGE_SIZE)
        self.assertEqual(freed["host_count"], before["host_count"] - 1)

        same_class = pinned_empty(8000, torch.uint8, device="cpu")  # also 2 pages: the same block
        self.assertEqual(same_class.data_ptr(), address)
        self.assertEqual(same_class.untyped_storage().nbytes(), 8000)
        self.assertEqual(memory_stats()["reserved_bytes"], before["reserved_bytes"])

        larger = pinned_empty(2 * PAGE_SIZE + 1, torch.uint8, device="cpu")  # 3 pages: a new block
        self.assertNotEqual(larger.data_ptr(), address)
        self.assertEqual(memory_stats()["reserved_bytes"], before["reserved_bytes"] + 3 * PAGE_SIZE)

    def test_views_keep_the_block_alive(self) -> None:
        tensor = pinned_empty((4, 1024), torch.float32, device="cpu")
        tensor.copy_(torch.arange(4096, dtype=torch.float32).view(4, 1024))
        row = tensor[2]
        before = memory_stats()
        del tensor
        self.assertEqual(memory_stats(), before)  # still live through ``row``
        self.assertEqual(row[0].item(), 2048.0)
        del row
        self.assertEqual(memory_stats()["host_count"], before["host_count"] - 1)

    def test_free_from_another_thread(self) -> None:
        before = memory_stats()
        tensors = [pinned_empty(PAGE_SIZE, torch.uint8, device="cpu") for _ in range(8)]
        worker = threading.Thread(target=tensors.clear)
        worker.start()
        worker.join()
        after = memory_stats()
        self.assertEqual(after["host_count"], before["host_count"])
        self.assertEqual(after["host_bytes"], before["host_bytes"])

    def test_ten_thousand_cycles_return_to_start(self) -> None:
        before = memory_stats()
        resident_before = _resident_bytes()
        sizes = (16 * PAGE_SIZE, 32 * PAGE_SIZE + 3, 48 * PAGE_SIZE)
        for cycle in range(10_000):
            tensor = pinned_empty(sizes[cycle % len(sizes)], torch.uint8, device="cpu")
            tensor[::PAGE_SIZE].fill_(cycle % 251)  # touch every page, so a leak would show in RSS
            del tensor
            if cycle % 1000 == 999:
                empty_cache()  # exercise unmapping too
        empty_cache()
        self.assertEqual(memory_stats(), before)
        # Leaking every block would add 10,000 x ~128 KiB = 1.2 GiB; allow Python's own noise.
        self.assertLess(_resident_bytes() - resident_before, 32 * MiB)

    def test_empty_cache_returns_free_blocks_only(self) -> None:
        live = pinned_empty(PAGE_SIZE, torch.uint8, device="cpu")
        freed = pinned_empty(3 * PAGE_SIZE, torch.uint8, device="cpu")
        before = memory_stats()
        del freed
        empty_cache()
        after = memory_stats()
        self.assertEqual(after["cached_bytes"], 0)
        self.assertEqual(after["reserved_bytes"], before["reserved_bytes"] - 3 * PAGE_SIZE)
        live.fill_(7)  # the live block is untouched
        self.assertEqual(int(live.sum().item()), 7 * PAGE_SIZE)

    def test_memory_stats_keys(self) -> None:
        self.assertExpectedInline(
            " ".join(memory_stats()),
            """host_bytes host_count pinned_bytes pinned_count cached_bytes cached_count reserved_bytes locked_bytes managed_bytes managed_count""",
        )

    def test_invalid_arguments(self) -> None:
        with self.assertRaisesRegex(ValueError, "shape must be non-negative integers"):
            pinned_empty((2, -1), torch.float32, device="cpu")
        with self.assertRaisesRegex(ValueError, "shape must be non-negative integers"):
            pinned_empty((2.5,), torch.float32, device="cpu")
        with self.assertRaisesRegex(TypeError, "dtype must be a torch.dtype"):
            pinned_empty(4, "float32", device="cpu")
        with self.assertRaisesRegex(ValueError, "is not supported: pass a CUDA device"):
            pinned_empty(4, torch.float32, device="meta")

    @unittest.skipIf(HAS_CUDA, "checks the error without CUDA")
    def test_cuda_device_without_cuda(self) -> None:
        with self.assertRaisesRegex(ValueError, "torch.cuda.is_available\\(\\) is False"):
            pinned_empty(4, torch.float32, device="cuda")
        with self.assertRaisesRegex(ValueError, "torch.cuda.is_available\\(\\) is False"):
            device_view(torch.ones(4), "cuda")
        with self.assertRaisesRegex(ValueError, "torch.cuda.is_available\\(\\) is False"):
            managed_empty(4, torch.float32, "cuda")
        # Without CUDA, device=None means plain host memory.
        self.assertFalse(pinned_empty(4, torch.float32).is_pinned())


class TestCapacityChecks(TestCase):
    def setUp(self) -> None:
        super().setUp()
        empty_cache()

    def test_host_capacity_message(self) -> None:
        with mock.patch.object(memory, "read_host_available_bytes", return_value=1 << 30):
            with self.assertRaises(HostMemoryError) as caught:
                check_host_capacity(3 << 30, pinned=False, what="parameter shards")
        self.assertExpectedInline(
            str(caught.exception),
            """Cannot allocate 3.0 GiB of host memory for parameter shards: only 1.0 GiB is available (MemAvailable in /proc/meminfo). Offload less (lower the offload fraction, or keep gradients/optimizer state on the GPU), free host memory, or use a machine with more host RAM. If this machine can give more than MemAvailable says (memory hot-plugged as it is used), set TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES to the host memory to allow, e.g. 256GiB.""",
        )

    def test_locked_memory_message(self) -> None:
        with (
            mock.patch.object(memory, "_locked_memory_limit_bytes", return_value=64 << 10),
            mock.patch.object(memory._pinned_pool, "locked_bytes", return_value=32 << 10),
        ):
            with self.assertRaises(HostMemoryError) as caught:
                check_host_capacity(1 << 20, pinned=True, what="gradients")
            check_host_capacity(1 << 20, pinned=False, what="gradients")  # not locked: no limit
            check_host_capacity(32 << 10, pinned=True, what="gradients")  # exactly fits
        self.assertExpectedInline(
            str(caught.exception),
            """Cannot pin 1.0 MiB of host memory for gradients: the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK) is 64.0 KiB and torch_fsdp_offload already holds 32.0 KiB pinned. Raise the limit (`ulimit -l unlimited`; in docker `--ulimit memlock=-1`) or lower the offload fraction.""",
        )

    def test_unknown_or_unlimited_means_no_limit(self) -> None:
        with (
            mock.patch.object(memory, "read_host_available_bytes", return_value=None),
            mock.patch.object(memory, "_locked_memory_limit_bytes", return_value=None),
        ):
            check_host_capacity(1 << 50, pinned=True, what="everything")

    def test_negative_request(self) -> None:
        with self.assertRaisesRegex(ValueError, "nbytes must be >= 0"):
            check_host_capacity(-1, pinned=False, what="x")

    def test_raised_before_anything_is_allocated(self) -> None:
        before = memory_stats()
        with mock.patch.object(memory, "read_host_available_bytes", return_value=MiB):
            with self.assertRaisesRegex(HostMemoryError, "Cannot allocate 2.0 MiB of host memory for a 2.0 MiB host buffer"):
                pinned_empty(2 * MiB, torch.uint8, device="cpu")
        self.assertEqual(memory_stats(), before)

    def test_cached_blocks_are_released_to_make_room(self) -> None:
        start = memory_stats()["reserved_bytes"]
        budget = 8 * MiB

        def available() -> int:  # a machine with 8 MiB, of which the pool holds some
            return budget - (memory_stats()["reserved_bytes"] - start)

        with mock.patch.object(memory, "read_host_available_bytes", side_effect=available):
            cached = pinned_empty(4 * MiB, torch.uint8, device="cpu")
            del cached
            self.assertEqual(memory_stats()["cached_bytes"], 4 * MiB)
            larger = pinned_empty(6 * MiB, torch.uint8, device="cpu")  # fits only once 4 MiB is released
            self.assertEqual(larger.untyped_storage().nbytes(), 6 * MiB)
            self.assertEqual(memory_stats()["cached_bytes"], 0)
            del larger
            # Still too large with the cache released: the error reports what is left then.
            with self.assertRaisesRegex(HostMemoryError, "only 8.0 MiB is available"):
                pinned_empty(9 * MiB, torch.uint8, device="cpu")
            self.assertEqual(memory_stats()["reserved_bytes"], start)


class TestHostMemoryOverride(TestCase):
    """``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES`` replaces MemAvailable (hot-plugged VM memory)."""

    def _env(self, value: str | None):
        environ = {} if value is None else {memory.ENV_HOST_MEMORY: value}
        return mock.patch.dict(os.environ, environ, clear=value is None)

    def test_override_replaces_mem_available(self) -> None:
        # A VM that reads 31 GiB at start but grows to 255 GiB: 70 GiB is refused, then allowed.
        with mock.patch.object(memory, "read_host_available_bytes", return_value=31 << 30):
            with self._env(None):
                with self.assertRaisesRegex(HostMemoryError, "set TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES"):
                    check_host_capacity(70 << 30, pinned=False, what="optimizer state")
            with self._env("256GiB"):
                check_host_capacity(70 << 30, pinned=False, what="optimizer state")
            # It also lowers the figure: the override is the capacity, not a floor.
            with self._env(str(8 << 30)):
                with self.assertRaisesRegex(
                    HostMemoryError, r"only 8.0 GiB is available \(TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES=8589934592\)"
                ):
                    check_host_capacity(9 << 30, pinned=False, what="optimizer state")

    @parametrize(
        "text, expected",
        [
            ("274877906944", 256 << 30),
            ("256GiB", 256 << 30),
            (" 1.5 gib ", 3 << 29),
            ("200GB", 200 * 10**9),
            ("64 MiB", 64 << 20),
            ("4096B", 4096),
        ],
    )
    def test_parse(self, text: str, expected: int) -> None:
        with self._env(text):
            self.assertEqual(memory.host_capacity_bytes(), (expected, f"TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES={text.strip()}"))

    def test_unset_reads_mem_available(self) -> None:
        with self._env(None), mock.patch.object(memory, "read_host_available_bytes", return_value=123):
            self.assertEqual(memory.host_capacity_bytes(), (123, "MemAvailable in /proc/meminfo"))

    @parametrize("text", ["lots", "256 GiBs", "-1", "1e9", "5PB"])
    def test_bad_value_raises_before_allocating(self, text: str) -> None:
        before = memory_stats()
        with self._env(text):
            with self.assertRaisesRegex(ValueError, "is not a byte size: give plain bytes"):
                pinned_empty(MiB, torch.uint8, device="cpu")
        self.assertEqual(memory_stats(), before)


class _FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records registrations, fails on request."""

    def __init__(self, register_result: int = 0) -> None:
        self.register_result = register_result
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.register_result == 0:
            self.registered[ptr] = nbytes
        return self.register_result

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0

    def cudaGetErrorString(self, result: int) -> str:
        return "out of memory"


@unittest.skipIf(HAS_CUDA, "the GPU tests pin for real; a fake runtime there could meet real blocks")
class TestPinningBookkeeping(TestCase):
    """The pinned path's accounting on the CPU, with the CUDA runtime replaced by a recorder."""

    def setUp(self) -> None:
        super().setUp()
        empty_cache()
        self.cudart = _FakeCudart()
        for patch in (
            mock.patch.object(memory, "_resolve_pin_device", return_value=torch.device("cuda", 0)),
            mock.patch.object(torch.cuda, "device", return_value=contextlib.nullcontext()),
            mock.patch.object(torch.cuda, "cudart", return_value=self.cudart),
        ):
            patch.start()
            self.addCleanup(patch.stop)
        self.addCleanup(empty_cache)  # runs first: unpins cached blocks through the fake

    def test_registers_exact_pages_and_unregisters_on_release(self) -> None:
        before = memory_stats()
        tensor = pinned_empty(3 * PAGE_SIZE + 5, torch.uint8)
        self.assertEqual(self.cudart.registered, {tensor.data_ptr(): 4 * PAGE_SIZE})
        after = memory_stats()
        self.assertEqual(after["pinned_bytes"] - before["pinned_bytes"], 3 * PAGE_SIZE + 5)
        self.assertEqual(after["pinned_count"] - before["pinned_count"], 1)
        self.assertEqual(after["locked_bytes"] - before["locked_bytes"], 4 * PAGE_SIZE)
        del tensor
        self.assertEqual(len(self.cudart.registered), 1)  # cached, still pinned for reuse
        empty_cache()
        self.assertEqual(self.cudart.registered, {})
        self.assertEqual(memory_stats(), before)

    def test_locked_memory_limit_counts_what_is_pinned(self) -> None:
        with mock.patch.object(memory, "_locked_memory_limit_bytes", return_value=3 * PAGE_SIZE):
            first = pinned_empty(2 * PAGE_SIZE, torch.uint8)
            with self.assertRaisesRegex(HostMemoryError, "already holds 8.0 KiB pinned"):
                pinned_empty(2 * PAGE_SIZE, torch.uint8)
            self.assertEqual(len(self.cudart.registered), 1)
            address = first.data_ptr()
            del first
            reused = pinned_empty(2 * PAGE_SIZE - 1, torch.uint8)  # the cached block: no new pinning
            self.assertEqual(reused.data_ptr(), address)
            del reused
            third = pinned_empty(3 * PAGE_SIZE, torch.uint8)  # fits once the cached block is unpinned
            self.assertEqual(list(self.cudart.registered.values()), [3 * PAGE_SIZE])
            del third

    def test_registration_failure_leaves_nothing_behind(self) -> None:
        self.cudart.register_result = 2
        # A failed allocation releases cached blocks before it retries: start with none, and with
        # no garbage of earlier tests left to return blocks to the pool mid-test.
        gc.collect()
        empty_cache()
        before = memory_stats()
        with self.assertRaises(HostMemoryError) as caught:
            pinned_empty(2 * PAGE_SIZE, torch.uint8)
        self.assertExpectedInline(
            str(caught.exception),
            """cudaHostRegister of 8.0 KiB failed: out of memory (error 2). Check `ulimit -l` or lower the offload fraction.""",
        )
        self.assertEqual(memory_stats(), before)


@unittest.skipIf(not HAS_CUDA, "needs a GPU")
class TestPinnedOnGPU(TestCase):
    def setUp(self) -> None:
        super().setUp()
        empty_cache()

    def test_pinned_exact_size_where_torch_rounds_up(self) -> None:
        nbytes = 96 * MiB + PAGE_SIZE + 3
        before = memory_stats()
        ours = pinned_empty(nbytes, torch.uint8)
        self.assertTrue(ours.is_pinned())
        self.assertEqual(ours.untyped_storage().nbytes(), nbytes)
        after = memory_stats()
        self.assertEqual(after["pinned_bytes"] - before["pinned_bytes"], nbytes)
        self.assertEqual(after["locked_bytes"] - before["locked_bytes"], _round_up_to_page(nbytes))

        # torch's caching host allocator pins the next power of two (128 MiB) for the same request.
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()
        host_memory_stats = getattr(torch.cuda, "host_memory_stats", dict)
        key = "allocated_bytes.current"
        torch_before = host_memory_stats().get(key)
        theirs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        torch_after = host_memory_stats().get(key)
        self.assertTrue(theirs.is_pinned())
        if torch_before is not None and torch_after is not None and torch_after != torch_before:
            # (No change would mean torch reused a cached block: nothing to compare then.)
            self.assertGreaterEqual(torch_after - torch_before, 1 << (nbytes - 1).bit_length())

    def test_async_h2d_from_pinned(self) -> None:
        host = pinned_empty((1024, 1025), torch.float32)
        host.copy_(torch.arange(host.numel(), dtype=torch.float32).view(host.shape))
        side_stream = torch.cuda.Stream()
        with torch.cuda.stream(side_stream):
            device = torch.empty(host.shape, dtype=host.dtype, device="cuda")
            device.copy_(host, non_blocking=True)
        side_stream.synchronize()
        self.assertEqual(device.cpu(), host)

    def test_pinned_on_named_device(self) -> None:
        tensor = pinned_empty(1000, torch.float16, device=torch.device("cuda", torch.cuda.current_device()))
        self.assertTrue(tensor.is_pinned())

    def test_device_view_reads_and_writes_host_memory(self) -> None:
        host = pinned_empty((512, 256), torch.float32)
        host.copy_(torch.randn(host.shape))
        expected = host.clone()
        view = device_view(host, "cuda")
        self.assertTrue(view.is_cuda)
        self.assertEqual(view.data_ptr(), host.data_ptr())
        self.assertEqual(view.sum().item(), expected.sum().item(), atol=1e-2, rtol=1e-4)
        view.mul_(2)
        torch.cuda.synchronize()
        self.assertEqual(host, expected * 2)
        transposed = device_view(host.t(), "cuda")
        self.assertEqual(transposed.stride(), host.t().stride())
        self.assertEqual(transposed.cpu(), host.t())
        del host, view, transposed  # the views kept it alive until here

    def test_device_view_refuses_pageable_memory(self) -> None:
        with self.assertRaisesRegex(ValueError, "host_tensor is pageable"):
            device_view(torch.ones(16), "cuda")
        with self.assertRaisesRegex(ValueError, "must be a CPU tensor"):
            device_view(torch.ones(16, device="cuda"), "cuda")

    def test_ten_thousand_pinned_cycles_return_to_start(self) -> None:
        before = memory_stats()
        for cycle in range(10_000):
            tensor = pinned_empty(4 * PAGE_SIZE + cycle % 3, torch.uint8)
            del tensor
            if cycle % 1000 == 999:
                empty_cache()  # unpin as well as pin, ten times
        empty_cache()
        self.assertEqual(memory_stats(), before)


@unittest.skipIf(not HAS_CUDA or not HAS_CUDA_BINDINGS, "needs a GPU and cuda.bindings")
class TestManagedOnGPU(TestCase):
    def test_device_and_host_views_share_bytes(self) -> None:
        before = memory_stats()
        buffer = managed_empty((1024, 1024), torch.float32, "cuda")
        self.assertEqual(buffer.nbytes, 4 * MiB)
        self.assertTrue(buffer.device_tensor.is_cuda)
        self.assertEqual(buffer.host_view.device.type, "cpu")
        self.assertEqual(buffer.device_tensor.data_ptr(), buffer.host_view.data_ptr())
        self.assertEqual(memory_stats()["managed_bytes"] - before["managed_bytes"], 4 * MiB)

        buffer.device_tensor.fill_(3.0)
        torch.cuda.synchronize()
        self.assertTrue(bool((buffer.host_view == 3.0).all()))  # the CPU sees the GPU's writes
        buffer.host_view[0].fill_(5.0)
        self.assertEqual(buffer.device_tensor[0].sum().item(), 5.0 * 1024)  # and the reverse

        self.assertEqual(buffer.device_tensor[1].sum().item(), 3.0 * 1024)

        del buffer
        gc.collect()
        self.assertEqual(memory_stats()["managed_count"], before["managed_count"])
        self.assertEqual(memory_stats()["managed_bytes"], before["managed_bytes"])

    def test_freed_only_when_both_views_die(self) -> None:
        before = memory_stats()
        buffer = managed_empty(4096, torch.int32, "cuda")
        host_view = buffer.host_view
        del buffer
        gc.collect()
        self.assertEqual(memory_stats()["managed_count"], before["managed_count"] + 1)
        host_view.fill_(1)
        del host_view
        gc.collect()
        self.assertEqual(memory_stats()["managed_count"], before["managed_count"])

    def test_more_than_free_gpu_memory_is_refused_before_allocating(self) -> None:
        free_bytes, _ = torch.cuda.mem_get_info()
        before = memory_stats()
        with self.assertRaisesRegex(HostMemoryError, "oversubscribing managed memory can stall the GPU"):
            managed_empty(free_bytes + (1 << 30), torch.uint8, "cuda")
        self.assertEqual(memory_stats(), before)

    def test_ten_thousand_managed_cycles_return_to_start(self) -> None:
        before = memory_stats()
        for cycle in range(10_000):
            buffer = managed_empty(1024, torch.float32, "cuda")
            if cycle % 100 == 0:
                buffer.device_tensor.fill_(1.0)
            del buffer
        gc.collect()
        torch.cuda.synchronize()
        self.assertEqual(memory_stats()["managed_count"], before["managed_count"])
        self.assertEqual(memory_stats()["managed_bytes"], before["managed_bytes"])


instantiate_parametrized_tests(TestPinnedEmptyOnHost)
instantiate_parametrized_tests(TestHostMemoryOverride)

if __name__ == "__main__":
    run_tests()
