"""Tests for torch_fsdp_offload.transfer: the transfer engine and its Transfer handles.

On the CPU the engine's "device" is the CPU (HOST_ONLY, or a platform forced to ``discrete``): every
copy still runs, in chunks, and is counted, so all logic except the streams is tested here. The GPU
tests add the streams, events and the buffer-lifetime rules; they are meant to pass under
``TORCH_CUDA_SANITIZER=1`` too (one of them runs a script under it).
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import textwrap
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

from torch_fsdp_offload import transfer
from torch_fsdp_offload.cpu_copy_stream import (
    CpuAsyncCopies,
    cpu_async_copies,
    misuses_detected,
    parse_cpu_async_copies,
)
from torch_fsdp_offload.memory import memory_stats, pinned_empty
from torch_fsdp_offload.platform import detect_platform
from torch_fsdp_offload.transfer import (
    DEFAULT_CHUNK_BYTES,
    TransferEngine,
    TransferStats,
    get_transfer_engine,
)
from torch_fsdp_offload.transfer_streams import CopyRequest, InFlight

HAS_CUDA = torch.cuda.is_available()
MiB = 1 << 20
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _random_bits(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads and all) of ``dtype``, to check copies are bit-exact."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = numel * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


class TestTransferEngineOnCPU(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.engine = TransferEngine("cpu")
        # Copies may run on worker threads: they land before the next test patches anything.
        self.addCleanup(self.engine.synchronize)

    @parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.bool])
    @parametrize("numel", [0, 1, 7, 8, 9, 64, 1001])
    def test_round_trip_across_chunk_boundaries(self, dtype, numel) -> None:
        chunk_bytes = 8
        src = _random_bits(numel, dtype) if dtype is not torch.bool else torch.rand(numel) > 0.5
        nbytes = numel * dtype.itemsize
        with mock.patch.object(transfer, "_copy_in_chunks", wraps=transfer._copy_in_chunks) as copy:
            on_device = self.engine.h2d(src, chunk_bytes=chunk_bytes).wait()
            back = torch.empty_like(src)
            self.engine.d2h(on_device, back, chunk_bytes=chunk_bytes).synchronize()
        self.assertTrue(_same_bits(on_device, src))
        self.assertTrue(_same_bits(back, src))
        if nbytes == 0:
            copy.assert_not_called()
        for call in copy.call_args_list:  # each direction: chunks tile [0, nbytes) in order
            chunks = call.args[2]
            self.assertEqual(len(chunks), -(-nbytes // chunk_bytes))
            self.assertEqual([c.start for c in chunks], list(range(0, nbytes, chunk_bytes)))
            self.assertEqual(chunks[-1].stop, nbytes)
            self.assertTrue(all(c.stop - c.start <= chunk_bytes for c in chunks))
        self.assertEqual(
            self.engine.stats,
            TransferStats(nbytes, nbytes, int(nbytes > 0), int(nbytes > 0)),
        )

    def test_default_chunk_size_and_override(self) -> None:
        self.assertEqual(self.engine.chunk_bytes, DEFAULT_CHUNK_BYTES)
        src = torch.arange(100, dtype=torch.int32)
        with mock.patch.object(transfer, "_copy_in_chunks", wraps=transfer._copy_in_chunks) as copy:
            self.engine.h2d(src)
            self.engine.h2d(src, chunk_bytes=128)
            self.engine.synchronize()  # the copies may run on a worker thread
        self.assertEqual([len(call.args[2]) for call in copy.call_args_list], [1, 4])

    def test_into_given_destination(self) -> None:
        src = torch.arange(12, dtype=torch.float32).view(3, 4)
        dst = torch.zeros(12, dtype=torch.float32)  # same count, other shape: a flat copy
        result = self.engine.h2d(src, dst)
        self.assertIs(result.tensor, dst)
        self.assertIs(result.wait(), dst)
        self.assertTrue(result.done())
        self.assertEqual(dst, src.reshape(-1))

    @parametrize("numel", [0, 1, 5, 8, 1001])
    def test_cast_on_the_device_in_chunks(self, numel) -> None:
        # dtype=: the source's bytes cross (and are counted), each chunk lands in one buffer of
        # the source's dtype and is cast into the destination: the same values as a host cast.
        src = torch.randn(numel, dtype=torch.float32).view(-1, 1) if numel else torch.empty(0, 1)
        with mock.patch.object(torch, "empty", wraps=torch.empty) as allocated:
            result = self.engine.h2d(src, dtype=torch.bfloat16, chunk_bytes=16)
        landing = [call for call in allocated.call_args_list if call.kwargs.get("dtype") == torch.float32]
        self.assertEqual(len(landing), int(numel > 0))  # one landing buffer, of at most one chunk
        if numel:
            self.assertEqual(landing[0].args[0], min(4, numel))
        out = result.wait()
        self.assertEqual((out.dtype, out.shape), (torch.bfloat16, src.shape))
        self.assertTrue(_same_bits(out, src.to(torch.bfloat16)))
        self.assertEqual(self.engine.stats, TransferStats(4 * numel, 0, int(numel > 0), 0))
        given = torch.full((numel,), 9.0, dtype=torch.bfloat16)
        self.assertIs(self.engine.h2d(src.reshape(-1), given, dtype=torch.bfloat16).wait(), given)
        self.assertTrue(_same_bits(given, src.reshape(-1).to(torch.bfloat16)))
        # The cast's own dtype is a plain copy.
        self.assertTrue(_same_bits(self.engine.h2d(src, dtype=torch.float32).wait(), src))

    def test_zero_dim_tensor(self) -> None:
        src = torch.tensor(3.5, dtype=torch.float64)
        out = self.engine.h2d(src).wait()
        self.assertEqual(out.shape, ())
        self.assertEqual(out.item(), 3.5)

    def test_counters_and_reset(self) -> None:
        self.engine.h2d(torch.ones(10, dtype=torch.float16))
        self.engine.h2d(torch.ones(0))  # nothing crosses: not counted
        self.engine.d2h(torch.ones(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64))
        self.assertEqual(self.engine.stats, TransferStats(h2d_bytes=20, d2h_bytes=24, h2d_copies=1, d2h_copies=1))
        self.engine.stats.reset()
        self.assertEqual(self.engine.stats, TransferStats())

    def test_profiler_labels(self) -> None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            self.engine.h2d(torch.ones(4), label="layer3.weights")
            self.engine.d2h(torch.ones(4), torch.empty(4))
        names = {event.name for event in profile.events()}
        for label in ("layer3.weights", "d2h"):
            self.assertIn(f"torch_fsdp_offload::{label}", names)

    def test_errors_raised_before_copying(self) -> None:
        engine = self.engine
        cases = [
            (lambda: engine.h2d(torch.ones(4, 4).t()), ValueError, "src must be contiguous"),
            (lambda: engine.h2d(torch.ones(4), torch.empty(5)), ValueError, "elements\\); give a dst of that dtype and size$"),
            (lambda: engine.h2d(torch.ones(4), dtype="bfloat16"), TypeError, "dtype must be a torch.dtype"),
            (lambda: engine.h2d(torch.ones(4), torch.empty(4, dtype=torch.float16)), ValueError, "or pass dtype="),
            (
                lambda: engine.h2d(torch.ones(4), torch.empty(4), dtype=torch.bfloat16),
                ValueError,
                "cast to torch.bfloat16; give a dst of that dtype",
            ),
            (lambda: engine.h2d(torch.ones(4), torch.empty(4, device="meta")), ValueError, "dst must be on cpu"),
            (lambda: engine.h2d(torch.ones(4, device="meta")), ValueError, "src must be on cpu"),
            (lambda: engine.h2d([1.0]), TypeError, "src must be a torch.Tensor"),
            (lambda: engine.h2d(torch.ones(4), chunk_bytes=0), ValueError, "chunk_bytes must be a positive int"),
            (lambda: engine.h2d(torch.ones(4), chunk_bytes=True), ValueError, "chunk_bytes must be a positive int"),
            (lambda: engine.d2h(torch.ones(4), torch.empty(2, 2).t()), ValueError, "dst must be contiguous"),
        ]
        for call, error, message in cases:
            with self.subTest(message=message):
                with self.assertRaisesRegex(error, message):
                    call()
        self.assertEqual(engine.stats, TransferStats())

    def test_engine_without_streams(self) -> None:
        self.assertIsNone(self.engine.h2d_stream)
        self.assertIsNone(self.engine.d2h_stream)
        with self.assertRaisesRegex(ValueError, "chunk_bytes must be a positive int"):
            TransferEngine("cpu", chunk_bytes=-1)

    def test_one_engine_per_device(self) -> None:
        engine = get_transfer_engine("cpu")
        self.assertIs(engine, get_transfer_engine(torch.device("cpu")))
        with self.assertRaisesRegex(ValueError, "is not supported"):
            get_transfer_engine("meta")

    def test_forced_discrete_platform_copies_on_the_cpu(self) -> None:
        platform = detect_platform(kind="discrete")
        if platform.device.type != "cpu":
            self.skipTest("a GPU is present: the platform's device is the GPU")
        engine = get_transfer_engine(platform.device)
        before = TransferStats(**vars(engine.stats))
        host = pinned_empty(256, torch.float32)
        engine.h2d(host.fill_(1.0)).wait()
        self.assertEqual(engine.stats.h2d_bytes - before.h2d_bytes, 1024)
        self.assertEqual(engine.stats.h2d_copies - before.h2d_copies, 1)


class _Gate:
    """Holds every asynchronous CPU copy that reaches ``_copy_in_chunks`` until :meth:`open`, so a
    test decides when copies land instead of relying on delays."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.started: list[int] = []  # bytes of each copy, in the order copies ran

    def __call__(self, dst, src, chunks) -> None:
        self._open.wait()
        self.started.append(src.numel())
        _COPY_IN_CHUNKS(dst, src, chunks)

    def open(self) -> None:
        self._open.set()


_COPY_IN_CHUNKS = transfer._copy_in_chunks


class TestAsyncCopiesOnCPU(TestCase):
    """The CPU engine's asynchronous mode (TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES, which the suite sets)."""

    def setUp(self) -> None:
        super().setUp()
        self.engine = TransferEngine("cpu")
        self.enterContext(cpu_async_copies(max_delay_ms=1.0, seed=3))
        self.gate = _Gate()
        self.enterContext(mock.patch.object(transfer, "_copy_in_chunks", self.gate))
        self.addCleanup(self.gate.open)  # a failing test must not leave a worker blocked

    def _misuses_found(self, before: int) -> list[str]:
        found = misuses_detected[before:]
        del misuses_detected[before:]  # expected here: not a failure of this test
        return found

    def test_copies_land_late_on_a_worker_thread(self) -> None:
        src = torch.arange(6, dtype=torch.float32)
        up = self.engine.h2d(src)
        dst = torch.zeros(6)
        down = self.engine.d2h(torch.ones(6), dst)
        # Nothing landed yet: destinations hold poison (NaN), the handles say not done.
        self.assertFalse(up.done())
        self.assertFalse(down.done())
        self.assertTrue(up.tensor.isnan().all())
        self.assertTrue(dst.isnan().all())
        self.gate.open()
        self.assertEqual(up.wait(), src)  # wait() blocks the consumer until the copy landed
        self.assertTrue(up.done())
        self.assertIs(down.wait(), dst)
        self.assertEqual(dst, torch.ones(6))
        self.assertEqual(self.engine.stats, TransferStats(24, 24, 1, 1))

    def test_destination_versioned_at_issue_not_when_it_lands(self) -> None:
        # As a CUDA copy's copy_ does on the issuing thread: the optimizer compares gradient
        # versions taken right after the gradient copy was issued with those at step().
        dst = torch.zeros(4)
        before = dst._version
        down = self.engine.d2h(torch.ones(4), dst)
        self.assertEqual(dst._version, before + 1)
        self.gate.open()
        down.synchronize()
        self.assertEqual(dst._version, before + 1)
        self.assertEqual(dst, torch.ones(4))

    def test_each_direction_runs_in_issue_order(self) -> None:
        sizes = [5, 1, 9, 3, 7, 2]
        ups = [self.engine.h2d(torch.full((n,), float(n))) for n in sizes]
        self.gate.open()
        for up, n in zip(ups, sizes):
            self.assertEqual(up.wait(), torch.full((n,), float(n)))
        self.assertEqual(self.gate.started, [4 * n for n in sizes])

    def test_a_copy_waits_for_an_unfinished_copy_of_its_memory_on_the_other_stream(self) -> None:
        host = torch.zeros(8)
        self.engine.d2h(torch.full((8,), 4.0), host)  # held by the gate
        up = self.engine.h2d(host)  # reads what the download writes: must run after it
        self.gate.open()
        self.assertEqual(up.wait(), torch.full((8,), 4.0))
        self.assertEqual(self.gate.started, [32, 32])

    def test_source_changed_in_flight_is_raised(self) -> None:
        before = len(misuses_detected)
        src = torch.ones(4)
        up = self.engine.h2d(src, label="weights")
        src.add_(1)  # reused before the copy finished
        self.gate.open()
        with self.assertRaisesRegex(RuntimeError, "torch_fsdp_offload::weights: the source changed while the copy"):
            up.wait()
        with self.assertRaisesRegex(RuntimeError, "the source changed"):
            self.engine.synchronize()
        self.assertEqual(len(self._misuses_found(before)), 1)

    def test_destination_written_in_flight_is_raised(self) -> None:
        before = len(misuses_detected)
        dst = torch.zeros(4)
        down = self.engine.d2h(torch.ones(4), dst, label="grads")
        dst[0] = 2.0  # written before the copy landed
        self.gate.open()
        with self.assertRaisesRegex(RuntimeError, "torch_fsdp_offload::grads: the destination was written"):
            down.synchronize()
        self.assertEqual(len(self._misuses_found(before)), 1)

    def test_no_poison_where_an_unfinished_copy_reads_the_destination(self) -> None:
        # Write after read on the other stream: poisoning the destination now would corrupt the
        # earlier copy's source; the download is ordered after the upload instead.
        host = torch.full((4,), 3.0)
        up = self.engine.h2d(host)
        self.engine.d2h(torch.ones(4), host)  # issued, not waited on
        self.assertEqual(host, torch.full((4,), 3.0))
        self.gate.open()
        self.assertEqual(up.wait(), torch.full((4,), 3.0))
        self.engine.synchronize()
        self.assertEqual(host, torch.ones(4))

    def test_copy_onto_its_own_source(self) -> None:
        # On a CPU "device" a gradient and its host slot can be one tensor: no poison then.
        both = torch.full((4,), 5.0)
        down = self.engine.d2h(both, both)
        self.assertEqual(both, torch.full((4,), 5.0))
        self.gate.open()
        down.synchronize()
        self.assertEqual(both, torch.full((4,), 5.0))

    def test_synchronous_inside_enabled_false(self) -> None:
        self.gate.open()
        with cpu_async_copies(enabled=False):
            up = self.engine.h2d(torch.ones(3))
            self.assertTrue(up.done())  # copied before h2d returned
            self.assertEqual(up.tensor, torch.ones(3))

    def test_refused_settings(self) -> None:
        cases = [
            ("banana", "is not valid: give '<max delay in ms>' or '<max delay in ms>:<seed>'"),
            ("-1", "max_delay_ms must be a finite number >= 0"),
            ("nan", "max_delay_ms must be a finite number >= 0"),
            ("2:x", "is not valid"),
        ]
        for value, message in cases:
            with self.subTest(value=value), self.assertRaisesRegex(ValueError, message):
                parse_cpu_async_copies(value)
        self.assertIsNone(parse_cpu_async_copies("off"))
        self.assertEqual(parse_cpu_async_copies("2:5"), CpuAsyncCopies(2.0, 5))
        for kwargs, message in (({"max_delay_ms": -0.5}, "finite number >= 0"), ({"seed": 1.5}, "seed must be an int")):
            with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, message):
                with cpu_async_copies(**kwargs):
                    pass
        self.gate.open()


class _HeldEvent:
    """A :class:`_HeldStream`'s event: the copy lands when the test runs the stream."""

    def __init__(self, stream: "_HeldStream") -> None:
        self.stream = stream
        self.is_landed = False
        self.synchronized = 0

    def query(self) -> bool:
        return self.is_landed

    def landed(self) -> bool:
        return self.is_landed

    def synchronize(self) -> None:
        self.synchronized += 1
        self.stream.run()


class _HeldStream:
    """A stream of the engine's interface that records what the engine asks of it and holds every
    copy until :meth:`run`."""

    def __init__(self) -> None:
        self.issued: list[CopyRequest] = []
        self.events: list[_HeldEvent] = []  # of each issued copy
        self.handed_over: list[tuple] = []  # (event, destination, consumer, mark_used)
        self.entered = 0  # times the engine ran something on the stream (allocations)
        self._held: list[tuple] = []  # (run, event) of each copy not run yet

    @contextlib.contextmanager
    def as_current(self):
        self.entered += 1
        yield

    def at_issue(self, tensors, *, written):
        return list(tensors)

    def issue(self, copy: CopyRequest) -> _HeldEvent:
        event = _HeldEvent(self)
        self.issued.append(copy)
        self.events.append(event)
        self._held.append((copy.run, event))
        return event

    def hand_over(self, event, destination, consumer, *, mark_used):
        self.handed_over.append((event, destination, consumer, mark_used))
        self.run()

    def run(self) -> None:
        """Land every held copy, in issue order."""
        for run, event in self._held:
            run()
            event.is_landed = True
        self._held = []


class _HeldStreams:
    def __init__(self) -> None:
        self.h2d, self.d2h = _HeldStream(), _HeldStream()

    def stream(self, to_device: bool) -> _HeldStream:
        return self.h2d if to_device else self.d2h


class TestTransferEngineOnAnyStreams(TestCase):
    """The engine reaches its streams through transfer_streams' interface only: on streams of the
    test's own, the same calls order, keep alive, hand over and count copies."""

    def setUp(self) -> None:
        super().setUp()
        self.engine = TransferEngine("cpu")
        self.streams = self.engine._streams = _HeldStreams()

    def test_copies_run_on_the_direction_stream_and_are_handed_over(self) -> None:
        host = torch.arange(4, dtype=torch.float32)
        up = self.engine.h2d(host, label="up")
        back = torch.zeros(4)
        down = self.engine.d2h(torch.ones(4), back, label="down", mark_src_used=False)
        self.assertEqual([c.label for c in self.streams.h2d.issued], ["up"])
        self.assertEqual([c.label for c in self.streams.d2h.issued], ["down"])
        self.assertEqual(self.streams.h2d.entered, 1)  # the engine allocated the destination there
        self.assertFalse(up.done())  # held by the stream: not landed, whatever the CPU did
        self.assertEqual(self.engine.stats, TransferStats(16, 16, 1, 1))

        (uploaded,), (downloaded,) = self.streams.h2d.issued, self.streams.d2h.issued
        self.assertIsNone(uploaded.device_tensor)  # allocated for the copy: nothing to wait for
        self.assertTrue(len(uploaded.keep_alive) == 1 and uploaded.keep_alive[0] is host)
        self.assertEqual(downloaded.device_tensor, torch.ones(4))  # the caller's: ordered after its producer
        self.assertFalse(downloaded.mark_used)

        consumer = object()  # passed through to the stream untouched
        self.assertEqual(up.wait(consumer), host)
        self.assertEqual(self.streams.h2d.handed_over, [(self.streams.h2d.events[0], up.tensor, consumer, True)])
        self.assertTrue(up.done())
        self.assertIs(down.wait_unmarked(), back)
        self.assertEqual(self.streams.d2h.handed_over, [(self.streams.d2h.events[0], back, None, False)])
        self.assertEqual(back, torch.ones(4))

    def test_a_copy_follows_the_unfinished_copies_of_its_memory_on_other_streams(self) -> None:
        host = torch.full((4,), 2.0)
        self.engine.h2d(host)
        self.engine.h2d(host)  # same stream, reads only: no conflict
        self.engine.d2h(torch.ones(4), host)  # writes what both uploads read
        self.engine.h2d(host)  # reads what the download writes
        (first, second, third), (download,) = self.streams.h2d.events, self.streams.d2h.events
        uploads, (downloaded,) = self.streams.h2d.issued, self.streams.d2h.issued
        self.assertEqual(uploads[1].in_flight, InFlight([], False, False))
        self.assertEqual(downloaded.in_flight, InFlight([first, second], True, False))
        self.assertEqual(uploads[2].in_flight, InFlight([download], False, True))
        self.streams.h2d.run()
        self.streams.d2h.run()
        self.engine.h2d(host)  # landed copies are forgotten: nothing to follow
        self.assertEqual(self.streams.h2d.issued[-1].in_flight, InFlight([], False, False))

    def test_synchronize_waits_on_every_unfinished_event(self) -> None:
        transfers = [self.engine.h2d(torch.full((2,), float(n))) for n in range(3)]
        transfers.append(self.engine.d2h(torch.ones(2), torch.zeros(2)))
        self.engine.synchronize()
        events = self.streams.h2d.events + self.streams.d2h.events
        self.assertEqual([e.synchronized for e in events], [1, 1, 1, 1])
        self.assertTrue(all(t.done() for t in transfers))
        self.engine.synchronize()  # forgotten once waited on
        self.assertEqual([e.synchronized for e in events], [1, 1, 1, 1])
        self.engine.h2d(torch.ones(2))
        self.streams.h2d.run()
        self.engine.h2d(torch.ones(2))  # the landed copy is forgotten here
        self.engine.synchronize()
        self.assertEqual([e.synchronized for e in self.streams.h2d.events[-2:]], [0, 1])

    def test_engine_modules_check_no_stream_or_event_type(self) -> None:
        # transfer_streams' implementations answer for themselves: the engine never asks which it holds.
        for name in ("transfer.py", "transfer_bookkeeping.py"):
            path = os.path.join(REPO_ROOT, "torch_fsdp_offload", name)
            with open(path, encoding="utf-8") as source:
                tree = ast.parse(source.read())
            checks = [
                ast.unparse(node)
                for node in ast.walk(tree)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass", "type")
                and any(
                    (n.id if isinstance(n, ast.Name) else n.attr).endswith(("Stream", "Streams", "Event"))
                    for n in ast.walk(node)
                    if isinstance(n, (ast.Name, ast.Attribute))
                )
            ]
            self.assertEqual(checks, [], msg=name)


@unittest.skipIf(not HAS_CUDA, "needs a GPU")
class TestTransferEngineOnGPU(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.engine = get_transfer_engine(torch.cuda.current_device())
        self.engine.synchronize()
        self.engine.stats.reset()

    def test_streams(self) -> None:
        self.assertIsInstance(self.engine.h2d_stream, torch.cuda.Stream)
        self.assertIsInstance(self.engine.d2h_stream, torch.cuda.Stream)
        self.assertNotEqual(self.engine.h2d_stream, self.engine.d2h_stream)
        self.assertNotEqual(self.engine.h2d_stream, torch.cuda.current_stream())

    def test_async_round_trip_in_chunks(self) -> None:
        numel = 10 * MiB // 4 + 3
        host = pinned_empty(numel, torch.float32)
        host.copy_(_random_bits(numel, torch.float32))
        on_device = self.engine.h2d(host, chunk_bytes=MiB).wait()
        self.assertTrue(on_device.is_cuda)
        back = pinned_empty(numel, torch.float32)
        self.engine.d2h(on_device, back, chunk_bytes=MiB).synchronize()
        self.assertTrue(_same_bits(back, host))
        self.assertEqual(self.engine.stats, TransferStats(4 * numel, 4 * numel, 1, 1))

    def test_consumer_sees_finished_data(self) -> None:
        numel = 64 * MiB  # 256 MiB of float32: several milliseconds on the link
        host = pinned_empty(numel, torch.float32).fill_(2.0)
        weights = self.engine.h2d(host).wait()  # the current stream waits for this copy
        self.assertEqual(weights.sum().item(), 2.0 * numel)

        produced = torch.full((numel,), 7.0, device="cuda") * 3  # queued on the current stream
        landed = pinned_empty(numel, torch.float32)
        copy = self.engine.d2h(produced, landed)  # must wait for the multiplication
        del produced  # the copy still reads it: its memory must not be handed out again
        overwrite = torch.zeros(numel, device="cuda")
        overwrite.fill_(-1.0)
        copy.wait()
        self.assertTrue(bool((landed == 21.0).all()))

    def test_host_buffers_live_until_the_copy_finished(self) -> None:
        before = memory_stats()
        target = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(500_000_000)  # a quarter second or so: the copy below waits behind it
        host = pinned_empty(MiB, torch.uint8).fill_(5)
        self.engine.h2d(host, target)  # a given destination: ordered after the current stream
        del host  # and the Transfer is dropped too
        self.assertEqual(memory_stats()["pinned_count"], before["pinned_count"] + 1)
        self.engine.synchronize()
        self.assertEqual(memory_stats()["pinned_count"], before["pinned_count"])
        self.assertTrue(bool((target == 5).all()))

    def test_device_buffers_live_as_long_as_their_holder(self) -> None:
        # The engine keeps host buffers until their copy ends, never the device destination: a
        # copied-in buffer (a block's parameters, a reloaded activation) whose holder dropped it
        # is freed at once, not when some later copy happens to be issued.
        host = pinned_empty(16 * MiB, torch.uint8).fill_(3)
        transfer = self.engine.h2d(host)
        transfer.wait()
        torch.cuda.current_stream().synchronize()
        before = torch.cuda.memory_allocated()
        del transfer
        self.assertEqual(torch.cuda.memory_allocated(), before - 16 * MiB)

    def test_upload_waits_for_download_of_the_same_host_buffer(self) -> None:
        staging = pinned_empty(16 * MiB, torch.uint8).fill_(0)
        source = torch.full((16 * MiB,), 9, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)  # delays the download, which waits for the current stream
        self.engine.d2h(source, staging)
        uploaded = self.engine.h2d(staging).wait()  # reads what the download writes: must follow it
        self.assertTrue(bool((uploaded == 9).all()))

    def test_wait_on_a_side_stream(self) -> None:
        host = pinned_empty(MiB, torch.float32).fill_(3.0)
        consumer = torch.cuda.Stream()
        result = self.engine.h2d(host)
        with torch.cuda.stream(consumer):
            total = result.wait(consumer).sum()
        consumer.synchronize()
        self.assertEqual(total.item(), 3.0 * MiB)
        self.assertTrue(result.done())

    def test_cast_on_the_device_after_the_link(self) -> None:
        # The fp32 bytes cross on the H2D stream, chunk after chunk through one landing buffer,
        # and are cast there: the consumer sees bf16 equal to the host's cast, bit for bit.
        numel = 10 * MiB // 4 + 3
        host = pinned_empty(numel, torch.float32)
        host.copy_(torch.randn(numel))
        weights = self.engine.h2d(host, dtype=torch.bfloat16, chunk_bytes=MiB).wait()
        self.assertEqual(weights.dtype, torch.bfloat16)
        self.assertTrue(_same_bits(weights.cpu(), host.to(torch.bfloat16)))
        self.assertEqual(self.engine.stats, TransferStats(4 * numel, 0, 1, 0))

    def test_device_errors(self) -> None:
        with self.assertRaisesRegex(ValueError, "src must be on cpu"):
            self.engine.h2d(torch.ones(4, device="cuda"))
        with self.assertRaisesRegex(ValueError, "src must be on cuda"):
            self.engine.d2h(torch.ones(4), torch.empty(4))
        with self.assertRaisesRegex(ValueError, "dst must be on cpu"):
            self.engine.d2h(torch.ones(4, device="cuda"), torch.empty(4, device="cuda"))

    def test_clean_under_the_cuda_sanitizer(self) -> None:
        script = textwrap.dedent(
            """
            import torch
            from torch.cuda._sanitizer import CUDASanitizerErrors
            from torch_fsdp_offload.memory import pinned_empty
            from torch_fsdp_offload.transfer import get_transfer_engine

            engine = get_transfer_engine(torch.cuda.current_device())
            host = pinned_empty((1024, 1024), torch.float32).fill_(1.0)
            weights = engine.h2d(host, chunk_bytes=1 << 20).wait()
            grads = weights * 2
            out = pinned_empty((1024, 1024), torch.float32)
            engine.d2h(grads, out, chunk_bytes=1 << 20).wait()
            cast = engine.h2d(host, dtype=torch.bfloat16, chunk_bytes=1 << 20).wait()
            assert bool((cast == 1.0).all())
            engine.synchronize()
            assert bool((out == 2.0).all())
            try:  # a consumer that skips Transfer.wait must be caught: proves the sanitizer is on
                engine.h2d(host).tensor.sum()
            except CUDASanitizerErrors:
                print("race detected as expected")
            """
        )
        env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        self.assertEqual(result.returncode, 0, msg=result.stderr[-4000:])
        self.assertIn("race detected as expected", result.stdout, msg=result.stderr[-4000:])


instantiate_parametrized_tests(TestTransferEngineOnCPU)

if __name__ == "__main__":
    run_tests()
