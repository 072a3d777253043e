"""``CoherentOffload`` through FSDP2's offload-policy hooks, where torch has them.

``docs/upstream/fsdp2_offload_hooks.patch`` gives ``OffloadPolicy`` the hooks of the RFC
(docs/upstream.md). On a torch with them, ``CoherentOffload``'s hook methods call the functions
here, and the integration patches nothing of FSDP2: FSDP calls the policy, and the policy runs the same
data path as ``CoherentFSDPParamGroup`` (its :class:`GroupOffload` and :class:`RootSchedule`):
shards in one exact-size pinned buffer per group, one coalesced copy-in on the transfer engine's
stream, prefetched ``prefetch_depth`` groups ahead, reduced gradients going down coalesced into
persistent host buffers, and the optimizer told per group when they land.

Nothing private of FSDP2 is read either: a refused ``fully_shard`` call (a hook raising) is undone
by ``fully_shard`` itself, and ``FSDPModule.is_offloaded()`` answers ``fsdp2_shards_on_host``.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Any

import torch
from torch.distributed.fsdp import OffloadPolicy

from torch_fsdp_offload import optim
from torch_fsdp_offload._integration import fsdp2_sharding as sharding
from torch_fsdp_offload._integration import installation
from torch_fsdp_offload._integration.fsdp2_group_plan import HOOKS, plan_group
from torch_fsdp_offload.data_path.group_state import GroupPlacement
from torch_fsdp_offload.data_path.group_offload import GroupOffload, is_host_grad
from torch_fsdp_offload.data_path.prefetch_schedule import RootSchedule
from torch_fsdp_offload._helpers.tensors import in_backward, local_tensor
from torch_fsdp_offload.activations import _policy_attachment as activation_hooks

logger = logging.getLogger(__name__)



def available() -> bool:
    """Whether this torch's ``OffloadPolicy`` has every hook (a torch with the patch applied)."""
    return all(callable(getattr(OffloadPolicy, name, None)) for name in HOOKS)


class HookedGroupOffload(GroupOffload):
    """A :class:`GroupOffload` whose group is FSDP's own: what ``CoherentFSDPParamGroup`` would
    tell, it answers from public group state and the hooks it saw. The tensors the user holds stay
    plain DTensors (docs/upstream.md)."""

    reclasses_user_tensors = False

    def __init__(self, group: Any, plan: Any, offloaded: bool) -> None:
        super().__init__(group, plan, offloaded)
        # Gone with its group where fully_shard undid a refused call after building it.
        self.group_ref = weakref.ref(group)
        # An all-gather read this group's copy-in and the group is not unsharded yet.
        self.copy_in_read = False
        self.model_sharding: Any = None  # set by init_group
        self.root_schedule: RootSchedule | None = None  # set at lazy init (place_shards)

    def label(self) -> str:
        return type(self.group.modules[0]).__name__

    def schedule(self) -> RootSchedule | None:
        return self.root_schedule

    def needs_copy_in(self, backward: bool) -> bool:
        group = self.group
        if group.is_unsharded or not group.is_sharded or (backward and not group.unshard_in_backward):
            return False
        return not self.copy_in_read

    def reduce_output_stream(self) -> None:
        return None  # FSDP does not say which stream allocated the reduce output: mark it used

    @torch.no_grad()
    def host_shards(self) -> list[torch.Tensor] | None:
        """The ``ON_HOST`` to ``HOMED`` transition: one exact-size buffer in the plan's memory, and
        each parameter's slot in it for FSDP to move the shard into."""
        if self.placement is not GroupPlacement.ON_HOST:
            return None
        self.layout()
        self.master = self._host_empty("master", self.group.fsdp_params[0].sharded_param.dtype)
        self.mark_homed()
        return [self.master[offset : offset + numel] for offset, numel in self.param_ranges()]


def _active(offload: HookedGroupOffload | None) -> bool:
    return offload is not None and offload.active


def offloads_group(policy: Any, params, modules, mesh_info, mp_policy, shard_placement_fn) -> bool:
    if "fsdp2" not in installation.installed:
        return True  # as CPUOffloadPolicy, the way FSDP2 runs it without the integration
    sharding.note_fully_shard(modules)
    model = sharding.model_sharding(policy, modules)
    call = {"params": params, "modules": modules, "mesh_info": mesh_info, "mp_policy": mp_policy,
            "shard_placement_fn": shard_placement_fn}
    # A refusal raises: fully_shard then leaves the modules as they were.
    activation_hooks.check_activation_offload(policy, modules)
    plan, offloaded = plan_group(policy, call)
    sharding.policy_sharding(policy).building = (modules, model, plan, offloaded)
    return offloaded


def init_group(policy: Any, group: Any) -> HookedGroupOffload | None:
    state = sharding.policy_sharding(policy)
    building, state.building = state.building, None
    if building is None or building[0] is not group.modules:
        return None  # built without the integration
    _, model, plan, offloaded = building
    sharding.record_group(policy, model, group.modules)
    if not model.plan_logged:
        model.plan_logged = True
        logger.info(plan.describe())
    offload = HookedGroupOffload(group, plan, offloaded)
    if offloaded:
        offload.promise_host_memory(group)
    optim.register_offloaded_group(offload)
    activation_hooks.attach_activation_offload(types.SimpleNamespace(
        modules=group.modules, device=group.device, coherent_policy=policy, _offload=offload, _model_sharding=model,
    ))
    offload.model_sharding = model
    return offload


def place_shards(policy: Any, group: Any) -> list[torch.Tensor] | None:
    offload = group.offload_state
    if offload is None:
        return None
    offload.model_sharding.ran = True  # the model is complete: the policy's next call starts another
    offload.root_schedule = RootSchedule.of_root(group.comm_ctx)
    return offload.host_shards()


def on_shard_reset(policy: Any, fsdp_param: Any) -> None:
    offload = fsdp_param.offload_state
    if offload is not None:
        # Module._apply (to_empty, .to) makes new parameter objects: still the group's.
        optim.register_offloaded_group(offload)
    if offload is not None and offload.placement is GroupPlacement.HOMED:
        offload.mark_stale()


def copy_in(policy: Any, fsdp_param: Any, stream: Any) -> tuple[torch.Tensor, None] | None:
    offload = fsdp_param.offload_state
    if offload is None:
        return None
    if not offload.active:
        offload.wait_update()  # FSDP reads the host shard itself
        return None
    return offload.take_input(fsdp_param), None  # take_input made the current stream wait


def on_copy_in_read(policy: Any, group: Any) -> None:
    offload = group.offload_state
    if _active(offload):
        offload.copy_in_read = not group.is_unsharded
        offload.release_staging()


def before_compute(policy: Any, group: Any, backward: bool) -> None:
    offload = group.offload_state
    if not _active(offload):
        return
    offload.copy_in_read = False
    schedule = offload.schedule()
    if schedule is not None:
        # A checkpointed block's forward recomputed in backward computes in backward order.
        schedule.on_compute(offload, backward=backward or in_backward(), depth=offload.plan.prefetch_depth)


def copy_out_grads(policy: Any, fsdp_params: list[Any], grads: list[torch.Tensor], stream: Any):
    offload = fsdp_params[0].offload_state
    if not _active(offload):
        return None
    offload.host_grad_view(fsdp_params[0])  # the persistent buffer, allocated on first use
    offload.captured_grads = dict(zip(fsdp_params, grads))
    previous = {p: p.sharded_param.grad for p in fsdp_params if p.sharded_param.grad is not None}
    landed = [offload._padded_view(offload.grads, p) for p in fsdp_params]
    if previous:
        # Accumulating: the running sums are added to on the device and land in the gradients'
        # own memory (Note: [Post-accumulate-grad hooks and accumulation]); FSDP adds nothing.
        offload.offload_accumulating(None, previous)
        return landed, offload.grad_transfer, True
    offload.offload_grads(None)
    return landed, offload.grad_transfer


@torch.no_grad()
def on_grads_ready(policy: Any, group: Any, is_last_backward: bool) -> None:
    offload = group.offload_state
    if not _active(offload):
        return
    for fsdp_param in group.fsdp_params:
        grad = fsdp_param.sharded_param.grad
        if grad is not None and not is_host_grad(offload, fsdp_param):
            # Landed outside the persistent buffer (a parameter first given a gradient in a later
            # micro-batch): FSDP waited for it; the optimizer reads the buffer.
            slot = offload.host_grad_view(fsdp_param)
            slot.copy_(local_tensor(grad))
            fsdp_param.sharded_param.grad = fsdp_param.to_sharded_dtensor(slot)
    offload.after_landing(is_last_backward)
    optim.notify_grads_ready(offload, is_last_backward=is_last_backward)
