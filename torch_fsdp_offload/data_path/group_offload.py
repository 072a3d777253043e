"""``GroupOffload``: one FSDP parameter group's offload, the data path both FSDP2 paths share.

Per offloaded group the shards live in one exact-size host buffer (fp32 master), with a
compute-dtype mirror when mixed precision halves the bytes to move (``cast_on="host"``), pinned or
managed as the plan's ``memory`` says; where the plan reads them in place the GPU's all-gather
reads them through their device view and no copy is made (Note: [Shard memory]). Copy-in is
one coalesced H2D copy of that mirror (or, with ``cast_on="device"``, of the master, cast on the
device as it lands) into a device staging buffer, on the transfer engine's H2D stream, issued
``prefetch_depth`` groups ahead in forward and backward order (:mod:`.prefetch_schedule`); FSDP's
all-gather (or its world-size-1 copy) then reads the staging buffer. Reduced gradients go down on
the D2H stream into persistent host buffers. What only FSDP's group can tell (its name, whether it
needs a copy-in, its root's schedule) each FSDP path answers in a subclass: the hooks path
(``_integration.fsdp2_hooks``) and the fallback class swap (``_integration.fsdp2_param_group``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch
import torch.nn as nn

from torch_fsdp_offload._helpers.tensors import foreach_add_, foreach_copy_, local_tensor, unversioned_alias
from torch_fsdp_offload.data_path.group_state import assert_in_states, GradCapture, GroupPlacement, SourceFreshness
from torch_fsdp_offload.device_memory import shared_empty
from torch_fsdp_offload.memory import HostPromise, pinned_empty, promise_host_bytes
from torch_fsdp_offload.resolved_plan import ResolvedPlan
from torch_fsdp_offload.transfer import get_transfer_engine, Transfer

__all__ = ["GroupOffload", "host_bytes", "is_host_grad"]


def host_bytes(numel: int, master_dtype: torch.dtype, param_dtype: torch.dtype | None, cast_on: str) -> int:
    """Host bytes an offloaded group of ``numel`` padded shard elements pins: master, gradient
    buffer and, when the copy-in reads one (``cast_on="host"`` with a compute dtype other than the
    master's), a mirror."""
    mirrored = cast_on == "host" and param_dtype is not None and param_dtype != master_dtype
    return numel * master_dtype.itemsize * 2 + (numel * param_dtype.itemsize if mirrored else 0)


class GroupOffload:
    """Host buffers, copies and gradient offload of one FSDP parameter group."""

    #: Whether the optimizer may re-class the group's parameters and gradients (DTensor subclasses
    #: that guard reads while a step runs and see in-place changes of a gradient). True on the
    #: fallback for a torch without FSDP2's offload hooks; the hooks path keeps them plain DTensors.
    reclasses_user_tensors = True

    def __init__(
        self, group: Any, plan: ResolvedPlan, offloaded: bool
    ):
        self.group = weakref.proxy(group)
        self.plan = plan
        self.device = group.device
        self.engine = get_transfer_engine(group.device)
        # See group_state for the three states and their transitions.
        self.placement = GroupPlacement.ON_HOST if offloaded else GroupPlacement.RESIDENT
        self.freshness = SourceFreshness.STALE
        self.grad_capture = GradCapture.IDLE
        self.master: torch.Tensor | None = None  # orig-dtype shards, exact size
        self.mirror: torch.Tensor | None = None  # param-dtype copy of master (mixed precision)
        # The GPU's views of the buffers named "master", "mirror" and "grads", where it reads them
        # in place (_host_empty).
        self.device_views: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()
        self.grads: torch.Tensor | None = None  # reduced gradient shards, orig dtype
        self.offsets: dict[Any, tuple[int, int]] = {}
        self.numel = 0
        self._inflight: Transfer | None = None
        self._inputs_left: set[Any] = set()
        # Streams that read views of the staging buffer without marking it used (record_stream):
        # the H2D stream waits for them before the buffer is dropped (_drop_staging).
        self._staging_readers: list[torch.cuda.Stream] = []
        # The last gradient copy down, until waited for.
        self.grad_transfer: Transfer | None = None
        self.captured_grads: dict[Any, torch.Tensor] = {}
        # The group's host optimizer step when it may still be running after step() returned
        # (OffloadOptimizer(overlap_next_forward=True)); copy-in waits for it.
        self.update_pending: Any = None
        # The OffloadOptimizer stepping the group, weakly (optimizer.groups.attach_optimizer).
        self.optimizer_ref: weakref.ref | None = None
        # The host memory an offloaded group's buffers take, promised until it is homed.
        self.host_promise: HostPromise | None = None

    @property
    def offloaded(self) -> bool:
        """Whether the group is offloaded through FSDP's CPU-offload path."""
        return self.placement is not GroupPlacement.RESIDENT

    @property
    def active(self) -> bool:
        return self.placement is GroupPlacement.HOMED and self.plan.offloads

    def layout(self) -> None:
        offset = 0
        for fsdp_param in self.group.fsdp_params:
            numel = fsdp_param.padded_sharded_param_size.numel()
            self.offsets[fsdp_param] = (offset, numel)
            offset += numel
        self.numel = offset

    def promise_host_memory(self, group: Any) -> None:
        """Lay ``group`` (this offload's) out and promise the host memory its buffers take when it is
        homed (at lazy init), so a later group's capacity check counts it; the promise ends with the
        group."""
        self.layout()
        self.host_promise = promise_host_bytes(self.host_bytes(), group, managed=self.plan.memory == "managed")

    def mark_homed(self) -> None:
        """The ``ON_HOST`` to ``HOMED`` transition: the shards are in the group's host buffer."""
        assert_in_states(self.placement, GroupPlacement.ON_HOST)
        self.placement = GroupPlacement.HOMED
        if self.host_promise is not None:
            self.host_promise.fulfil()

    def host_bytes(self) -> int:
        """Host bytes this group will pin (see :func:`host_bytes`)."""
        first = self.group.fsdp_params[0]
        # Read from the parameter's policy: FSDPParam.param_dtype is set only at lazy init (the
        # group keeps no policy on torch 2.15, where each parameter has its own, resolved).
        return host_bytes(self.numel, first.sharded_param.dtype, first.mp_policy.param_dtype, self.plan.cast_on)

    def _param_dtype_to_cast(self) -> torch.dtype | None:
        """The compute dtype the master is cast to for the copy-in, None if it needs no cast."""
        param_dtype = self.group.fsdp_params[0].param_dtype
        return param_dtype if param_dtype is not None and param_dtype != self.master.dtype else None

    def _host_empty(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer of the group's ``numel`` in the plan's ``memory``, the group's buffer
        ``name``; where the GPU reads it in place, its device view is kept in :attr:`device_views`.
        (The engine copies managed memory through its CUDA view by itself.)"""
        self.device_views.pop(name, None)
        if self.plan.memory == "pinned" and not self.plan.reads_in_place:
            return pinned_empty((self.numel,), dtype)
        buffer = shared_empty((self.numel,), dtype, self.plan.memory, self.device)
        if self.plan.reads_in_place:
            self.device_views[name] = buffer.device_tensor
        return buffer.host_view

    def _mirror_to_write(self) -> torch.Tensor | None:
        """The compute-dtype mirror the copy-in reads, allocated on first use; None (and no
        mirror kept) where the copy-in reads the master: no cast, or ``cast_on="device"``."""
        param_dtype = self._param_dtype_to_cast()
        if param_dtype is None or self.plan.cast_on != "host":
            self.mirror = None
            self.device_views.pop("mirror", None)
        elif self.mirror is None or self.mirror.dtype != param_dtype:
            self.mirror = self._host_empty("mirror", param_dtype)
        return self.mirror

    # -- copy-in ---------------------------------------------------------------------------
    def mark_stale(self) -> None:
        """The parameters may change (gradients landed, or shards were reset/loaded): the
        transition to ``STALE``, dropping any copy-in made from the older source."""
        with self.lock:
            assert_in_states(self.freshness, SourceFreshness.STALE, SourceFreshness.CURRENT)
            self.freshness = SourceFreshness.STALE
            self._drop_staging()

    def after_landing(self, is_last_backward: bool) -> None:
        """Gradients landed: an optimizer step may change the parameters before the next copy-in,
        so the source is ``STALE``. Not after an earlier micro-batch of accumulation
        (``is_last_backward=False``) of a group an ``OffloadOptimizer`` steps: that optimizer
        refreshes what it steps, and the micro-batches between change no parameter, so their
        forwards copy in the source as it is instead of casting it again on the training thread."""
        optimizer = self.optimizer_ref() if self.optimizer_ref is not None else None
        if is_last_backward or optimizer is None:
            self.mark_stale()

    def mark_current(self) -> None:
        """The copy-in source was just made from the parameters (the caller holds ``lock``): the
        transition to ``CURRENT``, dropping any copy-in made from the older source."""
        assert_in_states(self.placement, GroupPlacement.HOMED)
        self.freshness = SourceFreshness.CURRENT
        self._drop_staging()

    @torch.no_grad()
    def refresh_mirror(self) -> None:
        """Make the copy-in source current: cast the master into the compute-dtype mirror
        (``cast_on="host"``; with ``"device"`` the copy-in reads the master itself).

        :class:`~torch_fsdp_offload.OffloadOptimizer` calls this right after stepping the group
        (in its worker thread); otherwise the first copy-in after a change does it.
        """
        if self.placement is not GroupPlacement.HOMED:
            return  # before lazy init: the first copy-in refreshes
        with self.lock:
            mirror = self._mirror_to_write()
            if mirror is not None:
                with torch.profiler.record_function("torch_fsdp_offload::cast_master_to_mirror"):
                    mirror.copy_(self.master)
            self.mark_current()

    def wait_update(self, block: bool = True) -> bool:
        """Whether the group's optimizer step has finished, waiting for it unless ``block`` is
        False; re-raises an error the step raised."""
        pending = self.update_pending
        if pending is not None:
            if not block and not pending.done():
                return False
            pending.result()
            self.update_pending = None
        return True

    def issue_h2d(self, block: bool = True) -> None:
        """Start this group's coalesced copy-in unless a current one is in flight.

        With ``block=False`` (a prefetch) nothing is started while the group's optimizer step
        is still running; its own unshard starts the copy then."""
        if not self.wait_update(block):
            return
        if self.freshness is SourceFreshness.STALE:
            self.refresh_mirror()
        with self.lock:
            if self._inflight is not None:
                return
            source = self.mirror if self.mirror is not None else self.master
            if self.plan.reads_in_place:
                # The GPU reads the host buffer where it lives: no copy crosses (or is counted).
                self._inflight = Transfer(
                    self.device_views["mirror" if self.mirror is not None else "master"],
                    label=f"params_in_place:{self.label()}",
                    nbytes=0,
                )
            else:
                self._inflight = self.engine.h2d(
                    source,
                    # cast_on="device": the master crosses and is cast to the compute dtype on arrival.
                    dtype=self._param_dtype_to_cast() if self.mirror is None else None,
                    label=f"params_h2d:{self.label()}",
                )
            self._inputs_left = set(self.group.fsdp_params)

    def take_input(self, fsdp_param: Any) -> torch.Tensor:
        """``fsdp_param``'s padded shard on the device, in param dtype, ready on this stream."""
        self.release_staging()  # a copy whose every view was taken served an earlier unshard
        self.issue_h2d()  # no-op when prefetched and still current
        with self.lock:
            staging = self._inflight.wait_unmarked()
            if self.engine.h2d_stream is not None:
                reader = torch.cuda.current_stream(self.device)
                if reader not in self._staging_readers:
                    self._staging_readers.append(reader)
            self._inputs_left.discard(fsdp_param)
        offset, numel = self.offsets[fsdp_param]
        return staging[offset : offset + numel]

    def release_staging(self) -> None:
        """Free the staging buffer once every parameter took its view and FSDP queued its reads
        (called after FSDP's unshard and its wait for it)."""
        with self.lock:
            if self._inflight is not None and not self._inputs_left:
                self._drop_staging()

    def _drop_staging(self) -> None:
        """Forget the staging buffer (the caller holds ``lock``). The H2D stream first waits for
        the streams that read it, so the buffer is free at once, for that stream's later copies
        only, with no host sync; marked used with ``record_stream`` it would stay allocated until
        an allocation found the GPU past the reads, while the CPU has run ahead to the next
        group's backward (a group's bytes over FSDP2's peak)."""
        for reader in self._staging_readers:
            self.engine.h2d_stream.wait_stream(reader)
        self._staging_readers = []
        self._inflight = None

    # -- gradients -------------------------------------------------------------------------
    def begin_grad_capture(self) -> None:
        """FSDP's ``post_backward`` is about to hand over the reduced gradients: ``IDLE`` to
        ``CAPTURING``."""
        assert_in_states(self.grad_capture, GradCapture.IDLE)
        self.grad_capture = GradCapture.CAPTURING

    def end_grad_capture(self) -> None:
        """FSDP's ``post_backward`` returned: ``CAPTURING`` to ``IDLE``."""
        assert_in_states(self.grad_capture, GradCapture.CAPTURING)
        self.grad_capture = GradCapture.IDLE

    def host_grad_view(self, fsdp_param: Any) -> torch.Tensor:
        """``fsdp_param``'s slot in the persistent host gradient buffer."""
        if self.grads is None:
            self.grads = self._host_empty("grads", self.master.dtype)
        return self._padded_view(self.grads, fsdp_param)

    @torch.no_grad()
    def offload_grads(
        self, post_reduce_event: Any, into: torch.Tensor | None = None, onto: tuple[Transfer, set[Any]] | None = None
    ) -> bool:
        """Copy the captured reduced gradient shards into the persistent host buffer (or ``into``,
        laid out alike), as one coalesced D2H on the D2H stream once the reduction finished.

        With ``onto`` (the running sums brought up to the device, and the parameters that have
        one) the shards are first added to their sums (copied, for a parameter without one), on
        that stream, and the sums go down.

        Returns whether any gradient was copied."""
        captured, self.captured_grads = self.captured_grads, {}
        if not captured:
            return False
        copy_stream = self.engine.d2h_stream
        # The stream FSDP allocated the reduced gradients on, when known: it then waits for our
        # copy, and they are free as soon as dropped (below). Marked used on the copy stream
        # instead, they would stay allocated until an allocation found the copy finished, while
        # the CPU has run ahead into the next group's backward (a group's bytes over FSDP2's peak).
        producer = self.reduce_output_stream() if copy_stream is not None else None
        with torch.profiler.record_function("torch_fsdp_offload::grads_coalesce"):
            if copy_stream is not None:
                if post_reduce_event is not None:
                    copy_stream.wait_event(post_reduce_event)
                else:
                    copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                if producer is None:
                    for grad in captured.values():
                        grad.record_stream(copy_stream)
            with torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext():
                flat = self._reduce_output_as_flat(captured)
                if flat is None:
                    flat = torch.empty(self.numel, dtype=self.master.dtype, device=self.device)
                    foreach_copy_([self._padded_view(flat, p) for p in captured], list(captured.values()))
                if onto is not None:
                    flat = self._add_to_sums(flat, captured, *onto, copy_stream)
                self.grad_transfer = self.engine.d2h(
                    flat,
                    self.grads if into is None else into,
                    label=f"grads_d2h:{self.label()}",
                        mark_src_used=producer is None,
                )
            if producer is not None:
                self.grad_transfer.wait(producer)
        for p in captured:
            # FSDP's finalize_backward calls .synchronize() on it: plain torch.optim users are safe.
            p.grad_offload_event = self.grad_transfer
        return True

    @torch.no_grad()
    def offload_accumulating(self, post_reduce_event: Any, previous: dict[Any, torch.Tensor]) -> bool:
        """:meth:`offload_grads` for a backward after which the group's gradients accumulate:
        ``previous`` holds each parameter's gradient from before it (a DTensor, taken off the
        parameter so that FSDP did not add to it).

        See Note: [Post-accumulate-grad hooks and accumulation] in docs/design.md: the running sums
        (the persistent host buffer) come up on the H2D stream, the new shards are added to them
        where they were reduced, and the sums go down into the same buffer; :meth:`wait_grads` (and
        FSDP's wait at the end of backward) waits for them. Each parameter ends with its summed
        gradient, also one that got none in this backward (its sum goes up and down unchanged).

        Returns whether any gradient was copied."""
        for fsdp_param, grad in previous.items():
            if not is_host_grad_tensor(self, grad):  # set by the user: the sum lives in the buffer
                slot = self.host_grad_view(fsdp_param)
                slot.copy_(local_tensor(grad))
                previous[fsdp_param] = fsdp_param.to_sharded_dtensor(slot)
        copied = False
        if self.captured_grads:
            # Completing the sum is part of the landing, not a change of a gradient the user sees
            # (the optimizer compares version counters from the landing on).
            if self.plan.reads_in_place:
                # The GPU reads the sums where they live: nothing comes up.
                sums = Transfer(self.device_views["grads"], label=f"grads_sum_in_place:{self.label()}", nbytes=0)
            else:
                sums = self.engine.h2d(self.grads, label=f"grads_sum_h2d:{self.label()}")
            copied = self.offload_grads(post_reduce_event, into=unversioned_alias(self.grads), onto=(sums, set(previous)))
        for fsdp_param, grad in previous.items():
            # The same gradient tensor as before this backward (FSDP's own accumulation keeps it),
            # whose memory holds the sum.
            fsdp_param.sharded_param.grad = grad
        return copied

    def _add_to_sums(
        self, flat: torch.Tensor, captured: dict[Any, torch.Tensor], sums: Transfer, summed: set[Any], stream: Any
    ) -> torch.Tensor:
        """Add the reduced shards in ``flat`` to the running sums ``sums`` brings up (a parameter
        without one, not in ``summed``, takes its shard), on ``stream``; return the sums. An fp32
        add rounds alike on the host and the GPU: the sums are plain FSDP2's, bit for bit."""
        totals = sums.wait(stream)
        added = [p for p in captured if p in summed]
        with torch.profiler.record_function(f"torch_fsdp_offload::grads_accumulate:{self.label()}"):
            if self.plan.reads_in_place:
                # ``totals`` is the host buffer itself, read in place: the shards take the sums
                # added to them (an IEEE add is commutative, so the bits are the same) and go down
                # as the new sums.
                if added:
                    foreach_add_([self._padded_view(flat, p) for p in added], [self._padded_view(totals, p) for p in added])
                return flat
            if added:
                foreach_add_([self._padded_view(totals, p) for p in added], [self._padded_view(flat, p) for p in added])
            fresh = [p for p in captured if p not in summed]
            if fresh:
                foreach_copy_([self._padded_view(totals, p) for p in fresh], [self._padded_view(flat, p) for p in fresh])
        return totals

    def _reduce_output_as_flat(self, captured: dict[Any, torch.Tensor]) -> torch.Tensor | None:
        """FSDP's reduce output itself, when it holds every parameter's reduced shard at the
        padded offset our host buffer uses (the usual case: FSDP lays both out the same way).
        It then goes down in one copy, with no device staging copy and no extra memory; None
        when the layouts differ (e.g. a frozen parameter left out of the reduction)."""
        if len(captured) != len(self.offsets):
            return None
        first = next(iter(captured.values()))
        storage = first.untyped_storage()
        base = None
        for fsdp_param, grad in captured.items():
            if (
                grad.dtype != self.master.dtype
                or not grad.is_contiguous()
                or grad.untyped_storage().data_ptr() != storage.data_ptr()
            ):
                return None
            offset = grad.storage_offset() - self.offsets[fsdp_param][0]
            if base is None:
                base = offset
            elif offset != base:
                return None
        if base < 0 or (base + self.numel) * first.element_size() > storage.nbytes():
            return None
        # A view, not new_empty(0).set_(...): the stream sanitizer keys a zero-size tensor by its
        # Python id, so writing one on the D2H stream reads as a race with whatever zero-size
        # tensor later reuses that id on another stream.
        return first.as_strided((self.numel,), (1,), base)

    def _padded_view(self, flat: torch.Tensor, fsdp_param: Any) -> torch.Tensor:
        offset, _ = self.offsets[fsdp_param]
        return flat[offset : offset + fsdp_param.sharded_size.numel()].view(fsdp_param.sharded_size)

    def grads_landed(self) -> bool:
        """Whether this group's gradient copy has landed (or none is in flight), without blocking."""
        transfer = self.grad_transfer
        return transfer is None or transfer.done()

    def wait_grads(self) -> None:
        """Block the host until this group's gradient copy has landed."""
        if self.grad_transfer is not None:
            self.grad_transfer.synchronize()
            self.grad_transfer = None
            for p in self.group.fsdp_params:
                p.grad_offload_event = None

    @property
    def params(self) -> list[nn.Parameter]:
        return [p.sharded_param for p in self.group.fsdp_params]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's (unpadded) shard inside a flat buffer laid out like the master."""
        return [self._padded_view(flat, p) for p in self.group.fsdp_params]

    def as_param_dtensor(self, index: int, local: torch.Tensor):
        """``local`` as a DTensor sharded like parameter ``index`` (for optimizer state)."""
        return self.group.fsdp_params[index].to_sharded_dtensor(local)

    # -- what the group's FSDP path tells: each path (the class swap, the hooks) answers -------
    def label(self) -> str:
        """The group's name in traces and logs."""
        raise NotImplementedError

    def schedule(self) -> Any:
        """The prefetch schedule of the group's root, once its lazy init made it."""
        raise NotImplementedError

    def needs_copy_in(self, backward: bool) -> bool:
        """Whether the group's next unshard in this pass reads a copy-in not issued yet."""
        raise NotImplementedError

    def reduce_output_stream(self) -> torch.cuda.Stream | None:
        """The stream that allocated the reduce output (None: mark it used on the copy stream)."""
        raise NotImplementedError

    def forward_index(self) -> int:
        """Position of this group in the learned forward order (unseen groups last)."""
        schedule = self.schedule()
        if schedule is None or self not in schedule.order:
            return len(schedule.order) if schedule is not None else 0
        return schedule.order.index(self)

    def param_ranges(self) -> list[tuple[int, int]]:
        """``(offset, padded numel)`` of each parameter's shard in the group's flat buffers."""
        return [self.offsets[p] for p in self.group.fsdp_params]

    @torch.no_grad()
    def write_back(self, master_on_device: torch.Tensor, start: int = 0) -> list[Transfer]:
        """After a step on the device: copy the master (elements ``start:`` onwards, as many as
        ``master_on_device`` holds) and, with ``cast_on="host"``, its compute-dtype cast, made on
        the device, back into host memory. The caller synchronizes the returned transfers."""
        stop = start + master_on_device.numel()
        with self.lock:
            transfers = [
                self.engine.d2h(master_on_device, self.master[start:stop], label="optimizer_d2h_params")
            ]
            mirror = self._mirror_to_write()
            if mirror is not None:
                transfers.append(
                    self.engine.d2h(master_on_device.to(mirror.dtype), mirror[start:stop], label="optimizer_d2h_mirror")
                )
            self.mark_current()
        return transfers

    def prefetch_next_forward(self) -> None:
        """Start the copies the next forward needs first (after the optimizer stepped)."""
        schedule = self.schedule()
        if schedule is not None:
            schedule.prefetch_first(self.plan.prefetch_depth)


def is_host_grad(offload: GroupOffload, fsdp_param: Any) -> bool:
    """Whether the gradient FSDP holds for ``fsdp_param`` is a view of the group's host buffer."""
    return is_host_grad_tensor(offload, fsdp_param.sharded_param.grad)


def is_host_grad_tensor(offload: GroupOffload, grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a view of ``offload``'s host gradient buffer."""
    if offload.grads is None:
        return False
    ptr = local_tensor(grad).data_ptr()
    base = offload.grads.data_ptr()
    return base <= ptr < base + offload.grads.numel() * offload.grads.element_size()
