"""``CoherentFSDPParamGroup``: FSDP2's parameter group, with CoherentOffload's data path.

Per offloaded group the shards live in one exact-size host buffer (fp32 master), with a
compute-dtype mirror when mixed precision halves the bytes to move (``cast_on="host"``). Copy-in is
one coalesced H2D copy of that mirror (or, with ``cast_on="device"``, of the master, cast on the
device as it lands) into a device staging buffer, on our H2D stream, issued ``prefetch_depth``
groups ahead in forward and backward order; FSDP's all-gather (or its world-size-1 copy) then reads
the staging buffer. Reduced gradients go down on our D2H stream into persistent host buffers.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import threading
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_param_group_module
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

from torch_fsdp_offload import optim
from torch_fsdp_offload._integration import fsdp2_sharding as sharding
from torch_fsdp_offload._integration.fsdp2_group_state import (
    assert_in_states,
    GradCapture,
    GroupPlacement,
    SourceFreshness,
)
from torch_fsdp_offload._integration.fsdp2_group_plan import host_bytes, plan_group
from torch_fsdp_offload._integration.tensors import in_backward
from torch_fsdp_offload.activations import _policy_attachment as activation_hooks
from torch_fsdp_offload.memory import pinned_empty
from torch_fsdp_offload.policy import CoherentOffload, ResolvedPlan
from torch_fsdp_offload.transfer import get_transfer_engine, Transfer

logger = logging.getLogger(__name__)

_BaseParamGroup = fsdp_param_group_module.FSDPParamGroup

# Every live coherent group, so a root can find its groups at lazy init.
_live_groups: "weakref.WeakSet[CoherentFSDPParamGroup]" = weakref.WeakSet()
_base_init_signature = inspect.signature(_BaseParamGroup.__init__)


class CoherentFSDPParam(FSDPParam):
    """An ``FSDPParam`` whose copy-in reads its group's coalesced, prefetched staging buffer."""

    _offload: "GroupOffload"

    @property
    def all_gather_inputs(self) -> list[torch.Tensor]:
        offload = self._offload
        if (
            not offload.active
            or self.sharded_state != ShardedState.SHARDED
            or hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")
        ):
            offload.wait_update()  # FSDP reads the host shard itself
            return super().all_gather_inputs
        return [offload.take_input(self)]

    def to_sharded_dtensor(self, tensor: torch.Tensor):
        offload = self._offload
        if offload.grad_capture is GradCapture.CAPTURING:
            # FSDP is handing us this parameter's reduced gradient (still on the device). Keep
            # it for the coalesced D2H and give FSDP the host slot it will land in, so the
            # gradient has the parameter's (host) device as torch requires.
            offload.captured_grads[self] = tensor
            return super().to_sharded_dtensor(offload.host_grad_view(self))
        return super().to_sharded_dtensor(tensor)

    def reset_sharded_param(self) -> None:
        super().reset_sharded_param()
        # Module._apply (to_empty, .to) makes new parameter objects: the optimizer must still
        # know them as the group's.
        optim.register_offloaded_group(self._offload)
        # load_state_dict(assign=True) or Module._apply can swap the local tensor out of our
        # host buffer; bring the data home so copies and the optimizer see one layout.
        if self._offload.placement is GroupPlacement.HOMED:
            self._offload.rehome_param(self)
            self._offload.mark_stale()


class GroupOffload:
    """Host buffers, copies and gradient offload of one FSDP parameter group."""

    def __init__(
        self, group: "CoherentFSDPParamGroup", plan: ResolvedPlan, offloaded: bool
    ):
        self.group = weakref.proxy(group)
        self.plan = plan
        self.device = group.device
        self.engine = get_transfer_engine(group.device)
        # See fsdp2_group_state for the three states and their transitions.
        self.placement = GroupPlacement.ON_HOST if offloaded else GroupPlacement.RESIDENT
        self.freshness = SourceFreshness.STALE
        self.grad_capture = GradCapture.IDLE
        self.master: torch.Tensor | None = None  # orig-dtype shards, exact size
        self.mirror: torch.Tensor | None = None  # param-dtype copy of master (mixed precision)
        self.lock = threading.Lock()
        self.grads: torch.Tensor | None = None  # reduced gradient shards, orig dtype
        self.offsets: dict[CoherentFSDPParam, tuple[int, int]] = {}
        self.numel = 0
        self._inflight: Transfer | None = None
        self._inputs_left: set[CoherentFSDPParam] = set()
        # Streams that read views of the staging buffer without marking it used (record_stream):
        # the H2D stream waits for them before the buffer is dropped (_drop_staging).
        self._staging_readers: list[torch.cuda.Stream] = []
        self.grad_transfer: Transfer | None = None
        self.captured_grads: dict[CoherentFSDPParam, torch.Tensor] = {}
        # The group's host optimizer step when it may still be running after step() returned
        # (OffloadOptimizer(overlap_next_forward=True)); copy-in waits for it.
        self.update_pending: Any = None

    @property
    def offloaded(self) -> bool:
        """Whether the group is offloaded through FSDP's CPU-offload path."""
        return self.placement is not GroupPlacement.RESIDENT

    @property
    def active(self) -> bool:
        return self.placement is GroupPlacement.HOMED and self.plan.copies

    def layout(self) -> None:
        offset = 0
        for fsdp_param in self.group.fsdp_params:
            numel = fsdp_param.padded_sharded_param_size.numel()
            self.offsets[fsdp_param] = (offset, numel)
            offset += numel
        self.numel = offset

    def host_bytes(self) -> int:
        """Host bytes this group will pin (see :func:`~torch_fsdp_offload._integration.fsdp2_group_plan.host_bytes`)."""
        master_dtype = self.group.fsdp_params[0].sharded_param.dtype
        # Read from the policy: FSDPParam.param_dtype is set only at lazy init.
        return host_bytes(self.numel, master_dtype, self.group.mp_policy.param_dtype, self.plan.cast_on)

    def _param_dtype_to_cast(self) -> torch.dtype | None:
        """The compute dtype the master is cast to for the copy-in, None if it needs no cast."""
        param_dtype = self.group.fsdp_params[0].param_dtype
        return param_dtype if param_dtype is not None and param_dtype != self.master.dtype else None

    def _mirror_to_write(self) -> torch.Tensor | None:
        """The pinned compute-dtype mirror the copy-in reads, allocated on first use; None (and no
        mirror kept) where the copy-in reads the master: no cast, or ``cast_on="device"``."""
        param_dtype = self._param_dtype_to_cast()
        if param_dtype is None or self.plan.cast_on != "host":
            self.mirror = None
        elif self.mirror is None or self.mirror.dtype != param_dtype:
            self.mirror = pinned_empty((self.numel,), param_dtype)
        return self.mirror

    # -- placement -------------------------------------------------------------------------
    @torch.no_grad()
    def home(self) -> None:
        """Move every shard of the group into one exact-size host buffer (once, at lazy init):
        the ``ON_HOST`` to ``HOMED`` transition."""
        if self.placement is not GroupPlacement.ON_HOST:
            return
        self.layout()
        first = self.group.fsdp_params[0].sharded_param
        self.master = pinned_empty((self.numel,), first.dtype)
        for fsdp_param in self.group.fsdp_params:
            self.rehome_param(fsdp_param)
        self.placement = GroupPlacement.HOMED

    @torch.no_grad()
    def rehome_param(self, fsdp_param: CoherentFSDPParam) -> None:
        offset, numel = self.offsets[fsdp_param]
        slot = self.master[offset : offset + numel]
        data = fsdp_param._sharded_param_data
        if data.data_ptr() == slot.data_ptr() and data.numel() == numel:
            return
        slot.copy_(data.reshape(-1))
        fsdp_param._sharded_param_data = slot
        shard_dim = fsdp_param.fsdp_placement.dim
        length = fsdp_param.sharded_size[shard_dim] if fsdp_param.sharded_size.numel() > 0 else 0
        fsdp_param.sharded_param._local_tensor = slot.view(
            fsdp_param.padded_sharded_param_size
        ).narrow(shard_dim, 0, length)

    # -- copy-in ---------------------------------------------------------------------------
    def mark_stale(self) -> None:
        """The parameters may change (gradients landed, or shards were reset/loaded): the
        transition to ``STALE``, dropping any copy-in made from the older source."""
        with self.lock:
            assert_in_states(self.freshness, SourceFreshness.STALE, SourceFreshness.CURRENT)
            self.freshness = SourceFreshness.STALE
            self._drop_staging()

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
            self._inflight = self.engine.h2d(
                source,
                # cast_on="device": the master crosses and is cast to the compute dtype on arrival.
                dtype=self._param_dtype_to_cast() if self.mirror is None else None,
                label=f"params_h2d:{self.label()}",
            )
            self._inputs_left = set(self.group.fsdp_params)

    def take_input(self, fsdp_param: CoherentFSDPParam) -> torch.Tensor:
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

    def host_grad_view(self, fsdp_param: CoherentFSDPParam) -> torch.Tensor:
        """``fsdp_param``'s slot in the persistent host gradient buffer."""
        if self.grads is None:
            self.grads = pinned_empty((self.numel,), self.master.dtype)
        return self._padded_view(self.grads, fsdp_param)

    @torch.no_grad()
    def offload_grads(self, post_reduce_event: Any, into: torch.Tensor | None = None) -> bool:
        """Copy the captured reduced gradient shards into the persistent host buffer (or ``into``,
        laid out alike), as one coalesced D2H on the D2H stream once the reduction finished.

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
                    torch._foreach_copy_([self._padded_view(flat, p) for p in captured], list(captured.values()))
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

    def _reduce_output_as_flat(self, captured: dict[CoherentFSDPParam, torch.Tensor]) -> torch.Tensor | None:
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

    def _padded_view(self, flat: torch.Tensor, fsdp_param: CoherentFSDPParam) -> torch.Tensor:
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

    # -- what the group's FSDP path tells (the hooks path, fsdp2_hooks, answers these itself) ---
    def label(self) -> str:
        return self.group._module_fqn or "root"

    def schedule(self) -> "RootSchedule | None":
        return getattr(self.group.comm_ctx, "coherent_schedule", None)

    def needs_copy_in(self, backward: bool) -> bool:
        return self.group.needs_copy_in(backward)

    def reduce_output_stream(self) -> torch.cuda.Stream | None:
        return self.group.reduce_output_stream()

    def forward_index(self) -> int:
        """Position of this group in the learned forward order (unseen groups last)."""
        schedule = self.schedule()
        if schedule is None or self not in schedule.order:
            return len(_live_groups)
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


def _is_host_grad(offload: GroupOffload, fsdp_param: FSDPParam) -> bool:
    if offload.grads is None:
        return False
    ptr = fsdp_param.sharded_param.grad._local_tensor.data_ptr()
    base = offload.grads.data_ptr()
    return base <= ptr < base + offload.grads.numel() * offload.grads.element_size()


class RootSchedule:
    """Forward order of a root's offloaded groups, learned in the first forward, for prefetch."""

    def __init__(self) -> None:
        self.order: list[GroupOffload] = []
        self.learning = True

    def on_compute(self, offload: GroupOffload, backward: bool, depth: int) -> None:
        """``offload``'s group is about to compute: start the copy-ins of the ``depth`` groups that
        compute after it. The window is anchored at the computing group, not at each unshard:
        FSDP's backward prefetch unshards the next group early, and a window moved by that
        unshard stages one group more than ``depth`` (one group ahead with ``depth=0``)."""
        if backward:
            self.learning = False
        elif self.learning and offload not in self.order:
            self.order.append(offload)
        if offload not in self.order or depth == 0:
            return
        index = self.order.index(offload)
        ahead = (
            self.order[max(0, index - depth) : index][::-1]
            if backward
            else self.order[index + 1 : index + 1 + depth]
        )
        for neighbour in ahead:
            if neighbour.active and neighbour.needs_copy_in(backward):
                neighbour.issue_h2d(block=False)

    def prefetch_first(self, depth: int) -> None:
        """Start the next forward's first copies (called after the optimizer step)."""
        for offload in self.order[: max(depth, 1)]:
            if offload.active:
                offload.issue_h2d(block=False)


class CoherentFSDPParamGroup(_BaseParamGroup):
    """FSDPParamGroup that applies a :class:`CoherentOffload` policy; otherwise unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        policy = kwargs["offload_policy"] if "offload_policy" in kwargs else args[-1]
        if not isinstance(policy, CoherentOffload):
            self._offload = None
            super().__init__(*args, **kwargs)
            return
        call = _base_init_signature.bind(self, *args, **kwargs).arguments
        model = sharding.model_sharding(policy, call["modules"])
        try:
            activation_hooks.check_activation_offload(policy, call["modules"])
            pending = sum(g._offload.host_bytes() for g in _live_groups if g._offload.placement is GroupPlacement.ON_HOST)
            plan, offloaded = plan_group(policy, call, pending_host_bytes=pending)
        except Exception as error:
            sharding.take_back_refused_call(call["modules"], error)
            raise
        # FSDP places shards on the host only for a CPUOffloadPolicy; on UNIFIED and HOST_ONLY
        # the shards stay where compute runs, and nothing crosses a link. The parameters are built
        # with pin_memory=False: the policy pins its exact-size buffers itself, and FSDP's own
        # pin_memory() would round each shard up to a power of two. The group keeps the policy.
        fsdp_policy = CPUOffloadPolicy(pin_memory=False) if offloaded else OffloadPolicy()
        if "offload_policy" in kwargs:
            kwargs["offload_policy"] = fsdp_policy
        else:
            args = (*args[:-1], fsdp_policy)
        super().__init__(*args, **kwargs)
        self.offload_policy = policy if offloaded else fsdp_policy
        self.coherent_policy = policy
        self._model_sharding = model
        sharding.record_group(policy, model, call["modules"])
        if not model.plan_logged:
            model.plan_logged = True
            logger.info(plan.describe())
        self._offload = GroupOffload(self, plan, offloaded)
        for fsdp_param in self.fsdp_params:
            fsdp_param.__class__ = CoherentFSDPParam
            fsdp_param._offload = self._offload
        if offloaded:
            self._offload.layout()
        _live_groups.add(self)
        optim.register_offloaded_group(self._offload)
        activation_hooks.attach_activation_offload(self)

    # -- lazy init ---------------------------------------------------------------------
    def lazy_init(self) -> None:
        if self._offload is not None:
            self._model_sharding.ran = True  # the model is complete: the policy's next call starts another
            self._ensure_schedule()
        super().lazy_init()
        if self._offload is not None:
            self._offload.home()

    def _ensure_schedule(self) -> None:
        if getattr(self.comm_ctx, "coherent_schedule", None) is None:
            self.comm_ctx.coherent_schedule = RootSchedule()

    # -- runtime -----------------------------------------------------------------------
    def unshard(self, async_op: bool = False):
        result = super().unshard(async_op)
        if self._offload is not None:
            # World size > 1: the all-gather's copy-in has read the staging buffer.
            self._offload.release_staging()
        return result

    def wait_for_unshard(self):
        result = super().wait_for_unshard()
        offload = self._offload
        if offload is not None and offload.active:
            schedule: RootSchedule = self.comm_ctx.coherent_schedule
            # A checkpointed block's forward recomputed in backward is a FORWARD to FSDP, but the
            # groups that compute next are those of backward order.
            schedule.on_compute(
                offload,
                backward=self._training_state == TrainingState.PRE_BACKWARD or in_backward(),
                depth=offload.plan.prefetch_depth,
            )
            # World size 1: FSDP copied the staging buffer into the parameters just now.
            # Released after the prefetches, so that their copies need not wait for that read.
            offload.release_staging()
        return result

    def reduce_output_stream(self) -> torch.cuda.Stream | None:
        """The stream FSDP allocates the reduced gradients on: its reduce-scatter stream, unless an
        all-reduce (HSDP) or an all-reduce hook follows the reduce-scatter, whose cast to the
        original dtype may allocate them on another stream (None then)."""
        if self._all_reduce_hook is not None or getattr(self.mesh_info, "replicate_mesh_dim", None) is not None:
            return None
        return self.comm_ctx.reduce_scatter_stream

    def needs_copy_in(self, backward: bool) -> bool:
        """Whether this group's next unshard still reads its shards: it is not unsharded (the
        root stays so after forward), it is unsharded in this pass, and no all-gather has read
        them yet (at world size 1 FSDP's unshard only marks the group; the copy runs when it
        waits for the unshard)."""
        if self.is_unsharded or not self.sharded_state_is_sharded():
            return False
        if backward and not self.unshard_in_backward:
            return False
        result = self._all_gather_result
        return result is None or not result.all_gather_input_split_sizes

    def sharded_state_is_sharded(self) -> bool:
        return self.is_sharded and not self.is_sharded_post_forward

    def post_backward(self, *unused: Any):
        offload = self._offload
        if offload is None or not offload.active:
            return super().post_backward(*unused)
        params = self.fsdp_params
        # FSDP would copy each reduced gradient to the host synchronously-ish and allocate a
        # fresh pinned tensor per step; keep them on the device through the reduce, then move
        # them ourselves, coalesced, on the D2H stream, into persistent host buffers.
        accumulated = {}
        hooks = {}
        for p in params:
            p.offload_to_cpu = False
            grad = p.sharded_param.grad
            if grad is not None:
                # The next D2H lands in the same host buffer: keep a copy to add back.
                local = grad._local_tensor
                accumulated[p] = local.clone() if _is_host_grad(offload, p) else local
                p.sharded_param.grad = None
            param_hooks = getattr(p.sharded_param, "_post_accumulate_grad_hooks", None)
            if param_hooks:
                hooks[p] = param_hooks
                p.sharded_param._post_accumulate_grad_hooks = None
        offload.begin_grad_capture()
        try:
            super().post_backward(*unused)
        finally:
            offload.end_grad_capture()
            for p in params:
                p.offload_to_cpu = True
            for p, param_hooks in hooks.items():
                p.sharded_param._post_accumulate_grad_hooks = param_hooks
        if not offload.offload_grads(self._post_reduce_event):
            return
        offload.mark_stale()
        if accumulated or hooks:
            # Accumulating across reduce-scatters, and post-accumulate-grad hooks, need the
            # gradient on the host now.
            offload.wait_grads()
            for p, previous in accumulated.items():
                if p.sharded_param.grad is not None:
                    p.sharded_param.grad._local_tensor.add_(previous.to(offload.grads.device))
                else:
                    p.sharded_param.grad = p.to_sharded_dtensor(previous)
            for p, param_hooks in hooks.items():
                for hook in param_hooks.values():
                    hook(p.sharded_param)
        state = _get_module_fsdp_state(self.modules[0])
        is_last_backward = state is None or state._state_ctx.is_last_backward
        optim.notify_grads_ready(offload, is_last_backward=is_last_backward)




# The modules of ``_fully_shard`` that may bind ``FSDPParamGroup`` at module level and construct
# it: ``_fsdp_param_group`` always does; ``_fully_shard`` and ``_fsdp_init`` did in torch 2.11 and
# 2.12, while later releases import it from ``_fsdp_param_group`` when they construct it.
_PARAM_GROUP_SITES = ("_fsdp_param_group", "_fully_shard", "_fsdp_init")


def patches() -> list[tuple[str, Any, str, Any, Any]]:
    """``(site, owner, name, torch's original, replacement)`` for each module that binds
    ``FSDPParamGroup``: every binding must be the class :class:`CoherentFSDPParamGroup`
    subclasses, or install() refuses."""
    result = []
    for module_name in _PARAM_GROUP_SITES:
        module = importlib.import_module(f"torch.distributed.fsdp._fully_shard.{module_name}")
        if module_name == "_fsdp_param_group" or "FSDPParamGroup" in vars(module):
            result.append(
                (f"{module.__name__}.FSDPParamGroup", module, "FSDPParamGroup", _BaseParamGroup, CoherentFSDPParamGroup)
            )
    return result
