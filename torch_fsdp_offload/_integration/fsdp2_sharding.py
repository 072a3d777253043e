"""What sharding with a :class:`~torch_fsdp_offload.CoherentOffload` decides per model, kept outside
the policy object; the ``FSDPState.init`` wrap through which every ``fully_shard`` call is seen
(applied by :func:`torch_fsdp_offload._integration.install`); and the undoing of a ``fully_shard``
call this package refused.

A policy object is configuration only, so one object can shard any number of models. What a model's
sharding accumulates (its activation offloader, whether its plan was logged) lives in a
:class:`ModelSharding`, one per model and policy object. The policy holds its current one (and the
decision for the group FSDP is building), each module it sharded points back to it weakly, and
nothing is kept in this module: a ``fully_shard`` call finds the models it completes among the
modules it shards. Which groups are offloaded is not among it: every group built with the policy is.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch.nn as nn
from torch.distributed import _composable_state
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state, FSDPState

# The composable-API bookkeeping fully_shard's @contract writes on each module (the package's
# ``contract`` attribute is the decorator, so the module is imported by name).
_contract = importlib.import_module("torch.distributed._composable.contract")


class ModelSharding:
    """One model's sharding with one policy object.

    A ``fully_shard`` call belongs to the model being sharded unless that model is complete: its
    root was sharded (a call on a module containing every other module sharded with the policy,
    and the next call's module does not contain that root in turn), or it ran its first forward,
    or all its modules are gone. A model sharded in one call and not yet run cannot be told from a
    first block, so the next call continues its count.
    """

    def __init__(self) -> None:
        self.modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self.root: "weakref.ReferenceType[nn.Module] | None" = None
        self.ran = False
        self.plan_logged = False
        # The model's activation offloader while its blocks are being sharded (activation_hooks).
        self.activation_model: Any = None

    def continues_with(self, modules: Sequence[nn.Module]) -> bool:
        """Whether a ``fully_shard`` call on ``modules`` shards this model further."""
        if self.ran or not self.modules:
            return False
        if self.root is None:
            return True
        root = self.root()
        return root is not None and any(root in set(module.modules()) for module in modules)

    def add_group(self, modules: Sequence[nn.Module]) -> None:
        """Note a group built for ``modules`` (called once it was built)."""
        for module in modules:
            self.modules.add(module)

    def note_call(self, modules: Sequence[nn.Module], inside: Sequence[set[nn.Module]]) -> None:
        """Note a ``fully_shard`` call on ``modules`` (``inside``: each one's ``modules()``), with
        this policy or not: one containing every module of this model is its root. A root of its
        own parameters builds a group; one without, or sharded without the policy, builds none."""
        for module, contained in zip(modules, inside):
            others = [other for other in self.modules if other is not module]
            if others and all(other in contained for other in others):
                self.root = weakref.ref(module)


# On a policy object: its PolicySharding. On each module a group was built for: its ModelSharding,
# weakly (the policy holds the current one; a completed model's goes with its last module).
_POLICY_ATTRIBUTE = "_torch_fsdp_offload_sharding"
_MODULE_ATTRIBUTE = "_torch_fsdp_offload_model_sharding"


class PolicySharding:
    """What one policy object's ``fully_shard`` calls accumulate: the model it shards now, and what
    it decided for the group FSDP is building (from the ``offloads_group`` hook to ``init_group``)."""

    def __init__(self) -> None:
        self.current: ModelSharding | None = None
        self.building: Any = None


def _policy_sharding(policy: Any) -> PolicySharding | None:
    return vars(policy).get(_POLICY_ATTRIBUTE)


def policy_sharding(policy: Any) -> PolicySharding:
    """``policy``'s :class:`PolicySharding`, made on first use (it bypasses the policy's refusal of
    attributes that are no knob: it is no configuration)."""
    state = _policy_sharding(policy)
    if state is None:
        state = PolicySharding()
        object.__setattr__(policy, _POLICY_ATTRIBUTE, state)
    return state


def model_sharding(policy: Any, modules: Sequence[nn.Module]) -> ModelSharding:
    """The sharding of the model ``modules`` belong to: the policy's current one, or a new one
    (the policy's current once :func:`record_group` records a group built, so a refusal records
    nothing)."""
    state = _policy_sharding(policy)
    current = state.current if state is not None else None
    return current if current is not None and current.continues_with(modules) else ModelSharding()


def record_group(policy: Any, sharding: ModelSharding, modules: Sequence[nn.Module]) -> None:
    """Record that a group was built for ``modules`` in ``sharding``, the policy's current model."""
    sharding.add_group(modules)
    for module in modules:
        module.__dict__[_MODULE_ATTRIBUTE] = weakref.ref(sharding)
    policy_sharding(policy).current = sharding


def has_sharded(policy: Any) -> bool:
    """Whether a group was built with ``policy``: its knobs planned that group, and a change of them
    would not reach it."""
    state = _policy_sharding(policy)
    return state is not None and state.current is not None


def note_fully_shard(modules: Sequence[nn.Module]) -> None:
    """Called by every ``fully_shard`` (from ``FSDPState.init``, before any group is built): tell the
    models whose modules it contains."""
    inside = [set(module.modules()) for module in modules]
    models = {}
    for contained in inside:
        for module in contained:
            ref = module.__dict__.get(_MODULE_ATTRIBUTE)
            model = ref() if ref is not None else None
            if model is not None:
                models[id(model)] = model
    for model in models.values():
        model.note_call(modules, inside)


def _fsdp_state_init(self: Any, modules: Sequence[nn.Module], *args: Any, **kwargs: Any) -> None:
    """``FSDPState.init``, which every ``fully_shard`` call runs once, then
    :func:`note_fully_shard`: a model's root may build no group of this package's."""
    _original_fsdp_state_init(self, modules, *args, **kwargs)
    note_fully_shard(modules)


_original_fsdp_state_init = FSDPState.init


def patches() -> list[tuple[str, Any, str, Any, Any]]:
    """``(site, owner, name, torch's original, replacement)`` of the ``FSDPState.init`` wrap."""
    return [
        ("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState.init", FSDPState, "init",
         _original_fsdp_state_init, _fsdp_state_init),
    ]


def _groups_of(state: Any) -> list[Any]:
    # torch 2.13+ keeps a list of groups per state; 2.11-2.12 one group or None.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def shards_on_host(module: nn.Module) -> bool:
    """Whether FSDP keeps the shards of ``module``'s (first) parameter group on the host: exactly
    when the group's policy is a ``CPUOffloadPolicy`` (``CoherentOffload`` gives the groups it keeps
    where compute runs, on UNIFIED and HOST_ONLY platforms, a plain ``OffloadPolicy``)."""
    state = _get_module_fsdp_state(module)
    groups = _groups_of(state) if state is not None else []
    # FSDP with the offload hooks says so itself (OffloadPolicy.offloads_group).
    return bool(groups) and getattr(groups[0], "offloaded", isinstance(groups[0].offload_policy, CPUOffloadPolicy))


def take_back_refused_call(modules: Sequence[nn.Module], error: BaseException) -> None:
    """Undo what ``fully_shard`` did to ``modules`` before this package refused to build a group.

    By then FSDP has moved the modules' parameters to the mesh's device, registered its state on
    each module (``@contract``'s state and registry entries, the module-to-state map) and its
    forward hooks; no parameter was converted to a DTensor shard yet. Taking those back leaves
    the modules usable as they are, and ``fully_shard`` can be called on them again, with or
    without a policy. Where FSDP already built other groups of the same call (a
    ``shard_placement_fn`` splitting it), their parameters are sharded: ``error`` then gets a note
    saying what to do.
    """
    state = _get_module_fsdp_state(modules[0])
    if state is None:
        return
    built = len(_groups_of(state))
    if built:
        error.add_note(
            f"fully_shard had already built {built} other parameter group(s) of this call (its "
            "shard_placement_fn splits the parameters), so some parameters are sharded: build the "
            "model anew, then shard it with the fix above."
        )
        return
    for module in modules:
        all_state = module.__dict__.get(_contract.STATE_KEY, {})
        registry = module.__dict__.get(_contract.REGISTRY_KEY, {})
        for api in [api for api, api_state in all_state.items() if api_state is state]:
            del all_state[api]
            registry.pop(getattr(api, "__name__", "fully_shard"), None)
        _composable_state._module_state_mapping.pop(module, None)
    handles = (getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None))
    for handle in {id(handle): handle for handle in handles if handle is not None}.values():
        handle.remove()
