"""The copies of offloaded storages between the device and pinned host memory, and their counters.

A storage is copied to the host on the transfer engine's D2H stream as soon as it is saved; its device
memory is released once that copy is seen landed, and the forward waits rather than let more than
``max_inflight_bytes`` of copies be in flight. Reloads go through the engine's H2D stream. On a
platform forced to ``"discrete"`` without an accelerator, every copy is synchronous on the CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref

import torch
from torch.profiler import record_function

from torch_fsdp_offload.activations._saved_tensors import ForwardPass, StoredStorage
from torch_fsdp_offload.memory import PinnedFreeList
from torch_fsdp_offload.transfer import get_transfer_engine

__all__ = ["ActivationOffloadStats", "DEFAULT_MAX_INFLIGHT_BYTES", "StorageCopies"]

_D2H_LABEL = "torch_fsdp_offload::activations_d2h"
_H2D_LABEL = "activations_h2d"  # the engine adds the torch_fsdp_offload:: prefix
# Device bytes whose copy to the host may be in flight at once. A forward can make activations
# several times faster than a PCIe link carries them, so without a bound the copies fall behind,
# nothing is freed before backward, and the peak does not fall. 1 GiB keeps a few of the largest
# saved tensors of a billion-parameter transformer (its MLP hidden states) queued, enough to keep
# the link busy.
DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30


@dataclasses.dataclass
class ActivationOffloadStats:
    """Counters of what :class:`~torch_fsdp_offload.activations.ActivationOffload` did since it was
    created or last :meth:`reset`.

    Attributes:
        saved_bytes (int): bytes of distinct storages autograd saved on the device during offloading
            passes, parameters excluded (the activation footprint the hooks saw).
        offloaded_bytes (int): the part of ``saved_bytes`` copied to host memory (= ``d2h_bytes``).
        d2h_copies (int), d2h_bytes (int): device-to-host copies issued and their bytes.
        h2d_copies (int), h2d_bytes (int): host-to-device reloads issued and their bytes.
        prefetched_copies (int): reloads issued ahead of need, when an earlier block was reached.
        on_demand_copies (int): reloads issued when the tensor itself was unpacked (out-of-order
            backward, or a second backward through a retained graph).
        reused_device_copies (int): reloads skipped because the tensor's device copy had not been
            released yet (its D2H copy had not landed when backward came close to it).
        deduplicated_views (int): saved tensors that shared an already offloaded storage.
        kept_tensors (int): saved tensors left on the device (small, parameter, buffer, or in a
            block that is not offloaded).
        inflight_waits (int): times the forward waited for the oldest copy to the host to land,
            because ``max_inflight_bytes`` were in flight (the link was slower than the forward).
    """

    saved_bytes: int = 0
    offloaded_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    prefetched_copies: int = 0
    on_demand_copies: int = 0
    reused_device_copies: int = 0
    deduplicated_views: int = 0
    kept_tensors: int = 0
    inflight_waits: int = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


class StorageCopies:
    """The D2H copies and H2D reloads of one offloader's storages, on ``device``'s transfer engine.

    ``asynchronous`` is True on a CUDA device: copies run on the engine's streams and are tracked by
    events. Otherwise every copy completes before it returns.
    """

    def __init__(
        self, device: torch.device, *, max_inflight_bytes: int, stats: ActivationOffloadStats, asynchronous: bool
    ) -> None:
        self.device = device
        self.asynchronous = asynchronous
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = stats
        self.engine = get_transfer_engine(device)
        self._d2h_stream = self.engine.d2h_stream if asynchronous else None
        self.free_list = PinnedFreeList(device)
        self._lock = threading.Lock()
        self._pending: collections.deque[StoredStorage] = collections.deque()  # D2H copies not seen landed
        self._pending_bytes = 0

    def copy_out(self, tensor: torch.Tensor, pass_: ForwardPass) -> StoredStorage:
        """Start the copy of ``tensor``'s storage to the host, as part of ``pass_``'s current block."""
        stored = StoredStorage(pass_, pass_.block, tensor, self.free_list)
        # Not TransferEngine.d2h: it record_stream()s the source on the D2H stream, and the allocator
        # then holds freed memory until that stream drains everything queued at the time of the free,
        # which, with copies lagging compute, is long after this copy landed. Here the original stays
        # referenced until its own event is seen complete (poll), then is freed for immediate reuse.
        with record_function(_D2H_LABEL):
            if self.asynchronous:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                self._d2h_stream.wait_event(ready)
                if stored.host_read_done is not None:
                    self._d2h_stream.wait_event(stored.host_read_done)
                    stored.host_read_done = None
                with torch.cuda.stream(self._d2h_stream):
                    stored.host.copy_(stored.device_data, non_blocking=True)
                stored.d2h_done = torch.cuda.Event()
                stored.d2h_done.record(self._d2h_stream)
                with self._lock:
                    self._pending.append(stored)
                    self._pending_bytes += stored.nbytes
            else:
                stored.host.copy_(stored.device_data)
                stored.device_data = None
                stored.is_original = False
        pass_.blocks[stored.block].append(weakref.ref(stored))
        # Counted in the engine too: its counters are the process's record of what crossed the link.
        for stats in (self.stats, self.engine.stats):
            stats.d2h_copies += 1
            stats.d2h_bytes += stored.nbytes
        self.stats.offloaded_bytes += stored.nbytes
        self._bound_inflight()
        return stored

    def poll(self) -> None:
        """Release the device copies whose D2H copy has landed (oldest first: one stream, in order)."""
        if not self.asynchronous:
            return
        with self._lock:
            while self._pending and self._pending[0].d2h_done.query():
                self._landed(self._pending.popleft())

    def drain(self) -> None:
        """Wait for every D2H copy in flight, and release the device copies they read."""
        with self._lock:
            for stored in self._pending:
                stored.d2h_done.synchronize()
        self.poll()

    def _bound_inflight(self) -> None:
        """Wait, oldest first, until at most ``max_inflight_bytes`` of device copies are in flight.

        Waiting here makes the forward run at the link's pace where it outruns the link, instead of
        holding every activation on the device until its copy lands after the forward (or not before
        backward needs it, so that nothing is freed at all).
        """
        if not self.asynchronous:
            return
        with self._lock:
            while self._pending and self._pending_bytes > self.max_inflight_bytes:
                stored = self._pending.popleft()
                self.stats.inflight_waits += 1
                stored.d2h_done.synchronize()
                self._landed(stored)

    def _landed(self, stored: StoredStorage) -> None:
        self._pending_bytes -= stored.nbytes
        if stored.is_original and not stored.retained:
            stored.device_data = None
            stored.is_original = False

    def load(self, stored: StoredStorage, *, ahead: bool) -> None:
        """Make ``stored``'s device copy available: the original if still alive, else a reload."""
        if stored.device_data is not None:
            if stored.is_original and not stored.retained:
                stored.retained = True
                self.stats.reused_device_copies += 1
            return
        if self.asynchronous:
            self.engine.h2d_stream.wait_event(stored.d2h_done)
        stored.h2d = self.engine.h2d(stored.host, label=_H2D_LABEL)
        stored.device_data = stored.h2d.tensor
        if self.asynchronous:
            stored.host_read_done = torch.cuda.Event()
            stored.host_read_done.record(self.engine.h2d_stream)
        self.stats.h2d_copies += 1
        self.stats.h2d_bytes += stored.nbytes
        if ahead:
            self.stats.prefetched_copies += 1
        else:
            self.stats.on_demand_copies += 1

    def wait_for_reload(self, stored: StoredStorage) -> None:
        """Make the current stream wait for ``stored``'s reload (if any), and mark its buffer used there."""
        if stored.h2d is not None:
            stored.h2d.wait(torch.cuda.current_stream(self.device) if self.asynchronous else None)

    def release_device_copy(self, stored: StoredStorage) -> None:
        """Drop ``stored``'s device copy: every saved tensor that views it was unpacked."""
        if stored.is_original and self.asynchronous and not stored.d2h_done.query():
            # Its D2H copy still reads it: the allocator must not hand the memory out before that lands.
            stored.device_data.record_stream(self._d2h_stream)
        stored.device_data = None
        stored.h2d = None
        stored.is_original = False
