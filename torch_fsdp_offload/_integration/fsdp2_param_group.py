"""``CoherentFSDPParamGroup``: the fallback for a torch without FSDP2's offload-policy hooks.

FSDP2's parameter group class is swapped for this subclass, which runs a ``CoherentOffload``
group through the data path (:class:`~torch_fsdp_offload.data_path.group_offload.GroupOffload`,
:class:`~torch_fsdp_offload.data_path.prefetch_schedule.RootSchedule`) at the points the hooks
would be called from, and re-classes each parameter to :class:`CoherentFSDPParam` so that the
all-gather reads the group's coalesced copy-in. Each such site, and the hook that replaces it, is
listed in docs/upstream.md.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_param_group_module
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

from torch_fsdp_offload import optim
from torch_fsdp_offload._integration import fsdp2_sharding as sharding
from torch_fsdp_offload.data_path.group_state import GradCapture, GroupPlacement
from torch_fsdp_offload._integration.fsdp2_group_plan import implements_offload_hooks, plan_group
from torch_fsdp_offload._helpers.tensors import in_backward
from torch_fsdp_offload.activations import _policy_attachment as activation_hooks
from torch_fsdp_offload.data_path.group_offload import GroupOffload
from torch_fsdp_offload.data_path.prefetch_schedule import RootSchedule

logger = logging.getLogger(__name__)

_BaseParamGroup = fsdp_param_group_module.FSDPParamGroup

_base_init_signature = inspect.signature(_BaseParamGroup.__init__)


class CoherentFSDPParam(FSDPParam):
    """An ``FSDPParam`` whose copy-in reads its group's coalesced, prefetched staging buffer."""

    _offload: "SwappedGroupOffload"

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


class SwappedGroupOffload(GroupOffload):
    """The :class:`GroupOffload` of a ``CoherentFSDPParamGroup``: it reads the group's FSDP state
    and moves the shards into its buffer itself (the hooks path has FSDP move them)."""

    # -- placement -------------------------------------------------------------------------
    @torch.no_grad()
    def home(self) -> None:
        """Move every shard of the group into one exact-size buffer in the plan's memory (once, at
        lazy init): the ``ON_HOST`` to ``HOMED`` transition."""
        if self.placement is not GroupPlacement.ON_HOST:
            return
        self.layout()
        first = self.group.fsdp_params[0].sharded_param
        self.master = self._host_empty("master", first.dtype)
        for fsdp_param in self.group.fsdp_params:
            self.rehome_param(fsdp_param)
        self.mark_homed()

    @torch.no_grad()
    def rehome_param(self, fsdp_param: FSDPParam) -> None:
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

    def label(self) -> str:
        return self.group._module_fqn or "root"

    def schedule(self) -> "RootSchedule | None":
        return RootSchedule.find(self.group.comm_ctx)

    def needs_copy_in(self, backward: bool) -> bool:
        return self.group.needs_copy_in(backward)

    def reduce_output_stream(self) -> torch.cuda.Stream | None:
        return self.group.reduce_output_stream()


class CoherentFSDPParamGroup(_BaseParamGroup):
    """FSDPParamGroup that applies a :class:`CoherentOffload` policy; otherwise unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        policy = kwargs["offload_policy"] if "offload_policy" in kwargs else args[-1]
        if not implements_offload_hooks(policy):
            self._offload = None
            super().__init__(*args, **kwargs)
            return
        call = _base_init_signature.bind(self, *args, **kwargs).arguments
        model = sharding.model_sharding(policy, call["modules"])
        try:
            activation_hooks.check_activation_offload(policy, call["modules"])
            plan, offloaded = plan_group(policy, call)
        except Exception as error:
            sharding.take_back_refused_call(call["modules"], error)
            raise
        # FSDP places shards on the host only for a CPUOffloadPolicy; on HOST_ONLY, and on UNIFIED
        # with the default shard_memory, the shards stay where compute runs. The parameters are built
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
        # set_requires_gradient_sync's values, kept while a backward runs with both forced on.
        self._requested_sync: tuple[bool, bool] | None = None
        self._model_sharding = model
        sharding.record_group(policy, model, call["modules"])
        if not model.plan_logged:
            model.plan_logged = True
            logger.info(plan.describe())
        self._offload = SwappedGroupOffload(self, plan, offloaded)
        for fsdp_param in self.fsdp_params:
            fsdp_param.__class__ = CoherentFSDPParam
            fsdp_param._offload = self._offload
        if offloaded:
            self._offload.promise_host_memory(self)
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
        RootSchedule.of_root(self.comm_ctx)

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
            schedule = RootSchedule.of_root(self.comm_ctx)
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

    def pre_backward(self, *args: Any, **kwargs: Any):
        # See Note: [Post-accumulate-grad hooks and accumulation]: the group reduces and offloads
        # every backward's gradients, whatever set_requires_gradient_sync said; from its backward's
        # start, as torch 2.15 then keeps the gradients in the compute dtype, as when it reduces.
        offload = self._offload
        if offload is not None and offload.active and self._requested_sync is None:
            self._requested_sync = self.reduce_grads, self.all_reduce_grads
            self.reduce_grads = self.all_reduce_grads = True
        return super().pre_backward(*args, **kwargs)

    def post_backward(self, *unused: Any):
        offload = self._offload
        if offload is None or not offload.active:
            return super().post_backward(*unused)
        params = self.fsdp_params
        # FSDP would copy each reduced gradient to the host synchronously-ish and allocate a
        # fresh pinned tensor per step; keep them on the device through the reduce, then move
        # them ourselves, coalesced, on the D2H stream, into persistent host buffers.
        previous = {}  # gradients from earlier backwards, accumulated on the host
        hooks = {}
        for p in params:
            p.offload_to_cpu = False
            if p.sharded_param.grad is not None:
                previous[p] = p.sharded_param.grad
                p.sharded_param.grad = None  # FSDP must not add to it: the host does
            param_hooks = getattr(p.sharded_param, "_post_accumulate_grad_hooks", None)
            if param_hooks:
                hooks[p] = param_hooks
                p.sharded_param._post_accumulate_grad_hooks = None
        # A group that ran no pre-backward (not used in forward) is told here.
        requested_sync = self._requested_sync or (self.reduce_grads, self.all_reduce_grads)
        self._requested_sync = None
        self.reduce_grads = self.all_reduce_grads = True
        offload.begin_grad_capture()
        try:
            super().post_backward(*unused)
        finally:
            offload.end_grad_capture()
            self.reduce_grads, self.all_reduce_grads = requested_sync
            for p in params:
                p.offload_to_cpu = True
            for p, param_hooks in hooks.items():
                p.sharded_param._post_accumulate_grad_hooks = param_hooks
        if previous:
            landed = offload.offload_accumulating(self._post_reduce_event, previous)
        else:
            landed = offload.offload_grads(self._post_reduce_event)
        if not landed:
            return
        state = _get_module_fsdp_state(self.modules[0])
        is_last_backward = (state is None or state._state_ctx.is_last_backward) and requested_sync[0]
        offload.after_landing(is_last_backward)
        if hooks:
            # Post-accumulate-grad hooks need the gradient on the host now.
            offload.wait_grads()
            for p, param_hooks in hooks.items():
                for hook in param_hooks.values():
                    hook(p.sharded_param)
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
