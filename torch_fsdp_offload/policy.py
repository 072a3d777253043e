"""``CoherentOffload``: the offload policy users pass to FSDP."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import math
import types
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Union

import torch
import torch.nn as nn
import torch.utils.checkpoint

from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from torch_fsdp_offload import _integration
from torch_fsdp_offload._integration import fsdp2_hooks, fsdp2_sharding
from torch_fsdp_offload.models import check_block_order, find_blocks
from torch_fsdp_offload.resolved_plan import CastPlacement, ResolvedPlan
from torch_fsdp_offload.platform import detect_platform, Platform, PlatformKind

logger = logging.getLogger(__name__)

OptimizerPlacement = Union[Literal["auto", "host", "stream"], float]

_OPTIMIZER_PLACEMENTS = ("auto", "host", "stream")
SHARD_MEMORIES = ("auto", "pinned", "managed")
_PLATFORM_KINDS = {kind.value for kind in PlatformKind}
CAST_PLACEMENTS = ("host", "device")


# What "auto" streams of the offloaded groups' optimizer step on each platform that copies (see
# Note: [Automatic placements] in docs/design.md). COHERENT: the link is cheap, so every group is
# stepped on the GPU. DISCRETE (PCIe): half the groups streamed (the first in forward, whose
# gradients land last) while the host steps the others, both at once: of the placements of every
# block's step in docs/benchmarks.md's default rows the fastest, and the share measured placement
# found on that machine (0.45 to 0.55).
AUTO_STREAMED_FRACTION = {PlatformKind.COHERENT: 1.0, PlatformKind.DISCRETE: 0.5}
# What "auto" casts on where parameters cross a link: the host, so that the copy-ins move the
# compute dtype's bytes (half the master's). measure_placement() says where the device cast pays.
AUTO_CAST_ON = "host"

# Knobs CoherentOffload no longer has, and what replaces each (raised as TypeError when passed).
_REMOVED_KNOBS = {
    "memory": (
        "the knob was removed and renamed shard_memory: 'auto' (default: pinned host memory where the GPU "
        "has its own memory, the GPU's allocation on unified memory), 'pinned' or 'managed'."
    ),
    **dict.fromkeys(("offload_params", "offload_grads", "offload_optimizer_state"), (
        "the knob was removed: a module given CoherentOffload has its parameters, gradients and optimizer "
        "state offloaded together. Keep a module on the GPU by giving it no offload_policy (or "
        "OffloadPolicy()); offload activations alone with torch_fsdp_offload.offload_activations(model)."
    )),
    "chunk_bytes": (
        "the knob was removed: the copy engine splits copies into chunks of "
        "torch_fsdp_offload.transfer.DEFAULT_CHUNK_BYTES (64 MiB, enough for the link's peak bandwidth); "
        "drop the argument."
    ),
    "module_fraction": (
        "the knob was removed: partial offload is per module. Give the policy to the modules to offload and "
        "no offload_policy to the others, e.g. fully_shard_with_policy(model, blocks, policy, last_blocks=k) "
        "(the last k blocks) or spread_fraction=f (a fraction f of the blocks, spread evenly)."
    ),
}


@dataclass(eq=False)
class CoherentOffload(CPUOffloadPolicy):
    """Offloads FSDP's sharded parameters, gradients and optimizer state to host memory of the
    right kind for the machine, and moves them over the CPU-GPU link on dedicated streams,
    coalesced per parameter group, in the compute dtype, prefetched ahead of use.

    It is a :class:`torch.distributed.fsdp.CPUOffloadPolicy`, so FSDP2's ``fully_shard`` accepts
    it wherever it accepts an offload policy: per module, or as a value of a per-parameter map.
    Placement is per module: a module sharded with the policy has its group offloaded, one sharded
    without it stays on the GPU, as with FSDP's own policies. To offload part of a model, give the
    policy to some of its blocks only (:func:`fully_shard_with_policy` with ``last_blocks`` or
    ``spread_fraction``).

    Where the shards live follows from the platform (see :class:`ResolvedPlan`'s ``memory``):
    exact-size page-locked host memory where the GPU has its own memory, the GPU's own allocation
    on UNIFIED machines (the one physical DRAM, read in place), host memory without an
    accelerator. Every ``auto`` is decided from the platform class and the knobs alone, the same
    on every run and every rank; nothing is measured. :func:`~torch_fsdp_offload.measure_placement`
    measures this machine's host and link, when asked, and says which ``optimizer`` and
    ``cast_on`` to pass instead.

    The object is configuration only: sharding never writes to it, so one object can shard any
    number of models. Knobs are validated at construction, by :meth:`replace`, and on every
    assignment (a refused assignment leaves the object unchanged); assigning an attribute that is
    not a knob is refused. Once a module was sharded with it, its knobs are fixed: the groups were
    planned with them as they were and would not see a change, so an assignment is refused too;
    :meth:`replace` builds another policy for the modules to shard next.

    Attributes:
        pin_memory (bool): the base class's knob, kept at its default True: offloaded shards,
            gradients and compute-dtype mirrors live in page-locked host memory, allocated by this
            policy at its exact size (FSDP's own ``pin_memory()`` rounds each shard up to a power
            of two) and pinned only where a GPU copies it. False is refused: the copies run
            asynchronously on their own streams and, on COHERENT machines, the GPU reads the
            shards in place, which pageable memory does not allow.
        optimizer (str or float): where the optimizer step of offloaded groups runs, used by
            :class:`torch_fsdp_offload.OffloadOptimizer`. ``"host"``: on the CPU (fused, all
            cores), each group as soon as its gradients landed, overlapping backward.
            ``"stream"``: each group's fp32 parameters, gradients and optimizer state are copied
            to the GPU, stepped there with the same optimizer class, and copied back (with the
            compute-dtype mirror cast on the GPU). A float in [0, 1]: that fraction of the
            offloaded groups is streamed (those that run first in forward, whose gradients
            land last and so cannot overlap backward on the host) while the host steps the
            rest, both at once. ``"auto"`` (default): 1.0 on COHERENT machines (the link is
            cheap); 0.5 on DISCRETE ones (the fastest placement of every block's step measured
            on a PCIe H200, docs/benchmarks.md); host steps without an accelerator; on UNIFIED
            memory the shards are device memory and the step runs on the GPU in place. Any
            placement other than ``"auto"`` on a UNIFIED or HOST_ONLY platform is refused by
            :meth:`resolve`: there is no offloaded step to place.
        cast_on (str): where the fp32 master parameters are cast to the compute dtype
            (``MixedPrecisionPolicy.param_dtype``) for the copy-in. ``"host"``: after each
            optimizer step, into a pinned compute-dtype mirror, so only compute-dtype bytes cross
            the link (2 per parameter in bf16). ``"device"``: no mirror; the copy-in moves the
            master's bytes (4 per parameter) and casts them on the GPU as they land, on the copy
            stream. It takes the cast off the host and its mirror out of host memory, for twice
            the copy-in bytes: choose it where host steps, not the link, bound the step
            (``optimizer="host"`` on a PCIe machine whose backward and next forward hide the
            copies; docs/benchmarks.md). Streamed steps then bring back only the fp32 master, not
            its cast. ``"auto"`` (default): ``"host"`` (half the copy-in bytes) wherever
            parameters cross a link. The result is bitwise the same: one round-to-nearest cast
            either way. Without mixed precision there is no cast and the knob changes nothing.
            ``"device"`` on a UNIFIED or HOST_ONLY platform is refused by :meth:`resolve`.
        prefetch_depth (int): how many parameter groups ahead the H2D copy is issued, in
            forward and in backward. Default 1: the next group's copy runs under this one's
            compute. 0 copies each group only when it is needed.
        activations (bool or float): offload what the ``fully_shard``-ed blocks save for
            backward to pinned host memory, and prefetch it back a block ahead in backward
            (:class:`~torch_fsdp_offload.activations.ActivationOffload`, one per model, on the
            same transfer streams as the parameters). ``True`` offloads every block, a float in
            [0, 1] that fraction of the blocks, counted from the first (the last blocks before
            the loss, needed first in backward, stay). Default False: activations cost GPU memory
            only with large micro-batches. Blocks are the modules ``fully_shard`` is called on
            with this policy that contain no other such module; the module sharded last around
            them (the root) opens each forward and keeps what it saves outside the blocks on the
            device, so it needs parameters of its own. A no-op on UNIFIED and HOST_ONLY
            platforms. For activations alone, with parameters on the GPU, use
            :func:`~torch_fsdp_offload.offload_activations`.
        platform (str or None): force a platform class (``"unified"``, ``"coherent"``,
            ``"discrete"``, ``"host_only"``) instead of detecting it; the environment variable
            ``TORCH_FSDP_OFFLOAD_PLATFORM`` does the same for every policy. Default None: detect.
        shard_memory (str): the memory offloaded shards, gradients and compute-dtype mirrors live
            in. ``"pinned"``: exact-size page-locked host memory. ``"managed"``: ``cudaMallocManaged``
            memory advised to stay on the host and be read by the GPU there (preferred location
            the host, accessed by the GPU): coherent and cached in the GPU's L2 where the GPU reads
            host memory itself. Where the GPU reads each kind: on DISCRETE machines both are copied
            in ahead of use on the copy stream (managed memory copies slower over PCIe,
            docs/benchmarks.md); on COHERENT machines pinned shards are copied and managed ones
            read in place; on UNIFIED machines both are read in place, nothing copied. The host
            steps them in place. ``"auto"`` (default): pinned on DISCRETE and COHERENT machines;
            on UNIFIED ones the GPU's own allocation (nothing offloaded: it is the one DRAM). The
            managed bytes must fit in the GPU's free memory (checked at ``fully_shard``).

    Raises:
        ValueError: a knob outside its range or of the wrong type, or ``pin_memory=False``, at
            construction or assignment. ``fully_shard`` with this policy raises it too for a
            group whose parameters mix dtypes (an offloaded group's shards share one host buffer:
            shard each dtype's submodules as groups of their own first), and for an ``optimizer``
            or ``cast_on`` placement on a platform that copies nothing (UNIFIED, HOST_ONLY, or
            shards read in place), and ``shard_memory`` other than ``"auto"`` without an
            accelerator or ``"managed"`` on a GPU that cannot share managed memory.
        HostMemoryError: from ``fully_shard``, when the offloaded groups' host buffers would
            not fit (``MemAvailable``, ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES``, ``ulimit -l``), or
            with ``shard_memory="managed"`` would exceed the GPU's free memory (an oversubscribed
            managed allocation can stall the GPU).
        TypeError: a knob that was removed (``memory``, ``offload_params``, ``offload_grads``,
            ``offload_optimizer_state``, ``chunk_bytes``, ``module_fraction``), naming what
            replaces it.
        AttributeError: an assignment to an attribute that is not a knob; a deletion.
        dataclasses.FrozenInstanceError: an assignment to a knob (an AttributeError) once a module
            was sharded with the policy, naming the :meth:`replace` call that builds another.
        RuntimeError: at construction, on a torch whose FSDP internals the integration does not
            support, or when another library patched a site the integration needs (constructing
            the first policy installs FSDP2's part of the integration; importing installs nothing).
            From ``fully_shard``, for a group it offloads while ``torch.compile`` traces FSDP2's
            hooks (dynamo's ``skip_fsdp_hooks=False``, torch 2.11).

    Every refusal by ``fully_shard`` comes before any parameter is converted and leaves the
    module as it was: it can be sharded again, with or without a policy, or run as it is.

    Example::

        >>> from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        >>> from torch_fsdp_offload import CoherentOffload, OffloadOptimizer
        >>> policy = CoherentOffload(prefetch_depth=2)
        >>> mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> for block in model.blocks:
        ...     fully_shard(block, mp_policy=mp, offload_policy=policy)
        >>> fully_shard(model, mp_policy=mp, offload_policy=policy)
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4)
        >>> policy.resolve().describe()
        >>> # Partial offload with host steps: the policy on the last half of the blocks only.
        >>> policy = CoherentOffload(optimizer="host")
        >>> fully_shard_with_policy(model, model.blocks, policy, last_blocks=len(model.blocks) // 2, mp_policy=mp)
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    """

    pin_memory: bool = True
    optimizer: OptimizerPlacement = "auto"
    cast_on: CastPlacement = "auto"
    prefetch_depth: int = 1
    activations: Union[bool, float] = False
    platform: str | None = None
    shard_memory: str = "auto"

    # On a torch with the offload-policy hooks: place_shards gives exact-size pinned buffers, so
    # FSDP's own pin_memory() (rounded up to a power of two) must not run (docs/upstream.md).
    places_shards: ClassVar[bool] = True
    # An offloaded group keeps no unsharded gradient on the GPU: it reduces and lands every
    # backward's, also under set_requires_gradient_sync(False) (Note: [Post-accumulate-grad
    # hooks and accumulation] in docs/design.md).
    reduces_every_backward: ClassVar[bool] = True

    def __new__(cls, *args: Any, **kwargs: Any) -> "CoherentOffload":
        removed = next((name for name in kwargs if name in _REMOVED_KNOBS), None)
        if removed is not None:
            raise TypeError(f"CoherentOffload({removed}={kwargs[removed]!r}): {_REMOVED_KNOBS[removed]}")
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        knobs = {field.name for field in dataclasses.fields(self)}
        if name in _REMOVED_KNOBS:
            raise AttributeError(f"CoherentOffload.{name}: {_REMOVED_KNOBS[name]}")
        if name not in knobs:
            raise AttributeError(
                f"CoherentOffload has no knob {name!r}; its knobs are {', '.join(sorted(knobs))}."
            )
        if knobs <= vars(self).keys():
            self._refuse_once_sharded(f"CoherentOffload.{name} = {value!r}", f"policy.replace({name}={value!r})")
            # Constructed: validate the assignment on a copy first, so a refused value leaves
            # this object as it was.
            dataclasses.replace(self, **{name: value})
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        # A copy or a pickle carries the knobs only: what this object's fully_shard calls
        # accumulated (the model it shards, its frozen knobs) stays with this object.
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def __delattr__(self, name: str) -> None:
        self._refuse_once_sharded(f"del CoherentOffload.{name}", "CoherentOffload(...)")
        raise AttributeError(f"CoherentOffload.{name} cannot be deleted: assign a knob's default instead.")

    def _refuse_once_sharded(self, change: str, instead: str) -> None:
        """Refuse ``change`` of a policy that already sharded modules: their groups were planned with
        its knobs as they were, and would ignore it."""
        if fsdp2_sharding.has_sharded(self):
            raise dataclasses.FrozenInstanceError(
                f"{change}: this policy already sharded modules (fully_shard(..., offload_policy=policy)), "
                "whose groups were planned with its knobs as they were and would not see the change. Build "
                f"a new policy for the modules to shard next: {instead}."
            )

    def __post_init__(self) -> None:
        if self.pin_memory is not True:
            raise ValueError(
                f"CoherentOffload(pin_memory={self.pin_memory!r}) is not supported: the policy keeps "
                "offloaded shards in exact-size page-locked host memory, which its asynchronous copies "
                "(and, on coherent machines, the GPU's in-place reads) need. Leave pin_memory at its "
                "default True; for pageable host memory, use torch's CPUOffloadPolicy(pin_memory=False)."
            )
        if not (
            self.optimizer in _OPTIMIZER_PLACEMENTS
            or (not isinstance(self.optimizer, (bool, str)) and _is_fraction(self.optimizer))
        ):
            raise ValueError(
                f"CoherentOffload(optimizer={self.optimizer!r}) is not a placement; use 'auto', "
                "'host', 'stream', or a float in [0, 1]: the fraction of offloaded groups whose "
                "step is streamed through the GPU."
            )
        if self.cast_on != "auto" and self.cast_on not in CAST_PLACEMENTS:
            raise ValueError(
                f"CoherentOffload(cast_on={self.cast_on!r}) is not a cast placement; use 'auto', 'host' "
                "(compute-dtype bytes cross the link) or 'device' (the fp32 master crosses and is "
                "cast on the GPU)."
            )
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or (
            self.prefetch_depth < 0
        ):
            raise ValueError(
                f"CoherentOffload(prefetch_depth={self.prefetch_depth!r}) must be an int >= 0 "
                "(0 = copy each group only when it is needed)."
            )
        if not (isinstance(self.activations, bool) or _is_fraction(self.activations)):
            raise ValueError(
                f"CoherentOffload(activations={self.activations!r}) must be True, False or a "
                "number in [0, 1]: the fraction of the fully_shard-ed blocks whose saved "
                "activations are offloaded to host memory."
            )
        if self.shard_memory not in SHARD_MEMORIES:
            raise ValueError(
                f"CoherentOffload(shard_memory={self.shard_memory!r}) is not a memory kind; use 'auto' "
                "(the platform's), 'pinned' (page-locked host memory) or 'managed' (cudaMallocManaged "
                "memory kept on the host, read by the GPU)."
            )
        if self.platform is not None and self.platform not in _PLATFORM_KINDS:
            raise ValueError(
                f"CoherentOffload(platform={self.platform!r}) is not a platform class; use one "
                f"of {', '.join(repr(k.value) for k in PlatformKind)}, or None to detect it."
            )
        # The integration applies the policy inside FSDP; without it FSDP would run its own CPU
        # offload with this policy, silently. Installed here, on first use, never at import.
        _integration.ensure_installed("fsdp2")

    def detect(self) -> Platform:
        """The platform this policy plans for (``platform`` override, env var, or detection)."""
        return detect_platform(kind=self.platform)

    def resolve(self, platform: Platform | None = None) -> ResolvedPlan:
        """Resolve every ``auto`` knob for ``platform`` (default: :meth:`detect`), from its class
        alone: the same plan on every run and every rank, with nothing measured.

        Args:
            platform (Platform | None): the platform to plan for; None detects it.

        Returns:
            ResolvedPlan: what the policy does there.

        Raises:
            ValueError: an ``optimizer`` other than ``"auto"``, or ``cast_on="device"``, where
                nothing is copied: a UNIFIED or HOST_ONLY platform, or shards the GPU reads in place
                (the defaults are a no-op there, so one script runs on every machine);
                ``shard_memory`` other than ``"auto"`` without an accelerator, or ``"managed"`` on a
                GPU that cannot share managed memory with the CPU.

        Example::

            >>> CoherentOffload(platform="discrete").resolve().optimizer_gpu_fraction
            0.5
        """
        platform = platform or self.detect()
        kind = platform.kind
        memory, reads_in_place, reasons = self._shard_memory(platform)
        copies = kind in (PlatformKind.DISCRETE, PlatformKind.COHERENT) and not reads_in_place
        if not copies:
            self._check_placements_need_copies(
                "the GPU reads the shards in place" if reads_in_place else f"a {kind.value} platform copies nothing"
            )
            # Read in place: the host steps the shards where they live. UNIFIED, nothing offloaded:
            # the shards are device memory, so the step runs on the GPU; HOST_ONLY: everything is
            # on the host already.
            on_host = reads_in_place or kind == PlatformKind.HOST_ONLY or platform.device.type == "cpu"
            optimizer = "host" if on_host else "device"
            gpu_fraction = 0.0
            cast_on = "host"
        else:
            cast_on = AUTO_CAST_ON if self.cast_on == "auto" else self.cast_on
            if self.optimizer == "auto":
                gpu_fraction = AUTO_STREAMED_FRACTION[kind]
                reasons.append(f"{gpu_fraction:.2f} of the optimizer streamed through the GPU on {kind.value}")
            else:
                gpu_fraction = float({"host": 0.0, "stream": 1.0}.get(self.optimizer, self.optimizer))
            if self.cast_on == "auto":
                reasons.append(f"cast on the {cast_on}: the compute dtype's bytes cross the link")
            optimizer = {0.0: "host", 1.0: "stream"}.get(gpu_fraction, "split")
        activations = float(self.activations)
        if activations and kind in (PlatformKind.UNIFIED, PlatformKind.HOST_ONLY):
            activations = 0.0
            reasons.append("activations stay: host and GPU share one memory")
        return ResolvedPlan(
            platform=kind,
            memory=memory,
            copies=copies,
            optimizer=optimizer,
            optimizer_gpu_fraction=gpu_fraction,
            cast_on=cast_on,
            prefetch_depth=self.prefetch_depth,
            activations=activations,
            reason="; ".join(reasons) or "as configured",
            reads_in_place=reads_in_place,
        )

    def _shard_memory(self, platform: Platform) -> tuple[str, bool, list[str]]:
        """Where ``platform``'s offloaded shards live, whether the GPU reads them in place, and
        why; refuses a ``shard_memory`` the platform cannot give (see Note: [Shard memory] in
        docs/design.md)."""
        kind, asked = platform.kind, self.shard_memory
        if kind == PlatformKind.HOST_ONLY:
            if asked != "auto":
                raise ValueError(
                    f"CoherentOffload(shard_memory={asked!r}) places shards in memory a GPU reads, but this "
                    "machine has no accelerator: the shards already live in host memory, where compute runs. "
                    "Drop shard_memory= (the default is correct on every platform)."
                )
            return "host", False, ["no accelerator: shards already live where compute runs"]
        if asked == "managed" and platform.has_accelerator and not platform.supports_managed_memory:
            found = {name: platform.attributes.get(name) for name in ("ManagedMemory", "ConcurrentManagedAccess")}
            raise ValueError(
                f"CoherentOffload(shard_memory='managed'): {platform.device} cannot share managed memory "
                f"with the CPU at the same time (needs ManagedMemory=1 and ConcurrentManagedAccess=1, read "
                f"{found}). Use shard_memory='pinned' or 'auto'."
            )
        if kind == PlatformKind.UNIFIED:
            if asked == "auto":
                return "device", False, ["unified memory: the GPU's allocation is the one DRAM, read in place"]
            return asked, True, [f"unified memory: the GPU reads the {asked} shards in place, nothing is copied"]
        if asked == "managed" and kind == PlatformKind.COHERENT:
            return "managed", True, ["coherent link: the GPU reads the managed shards in place, cached in its L2"]
        if asked == "managed":
            return "managed", False, ["managed shards, copied in ahead of use as pinned ones are"]
        return "pinned", False, ["pinned memory is the fast DMA source"]

    def _check_placements_need_copies(self, why: str) -> None:
        """Refuse an ``optimizer`` or ``cast_on`` placement where ``why`` says nothing is copied."""
        otherwise = "so that one script runs on every machine; platform='discrete' forces the copy path."
        if self.optimizer != "auto":
            raise ValueError(
                f"CoherentOffload(optimizer={self.optimizer!r}) places the step of offloaded groups, "
                f"but {why}: there is no such step. Drop optimizer= (or pass 'auto', which is "
                "correct on every platform), " + otherwise
            )
        if self.cast_on not in ("auto", "host"):
            raise ValueError(
                f"CoherentOffload(cast_on={self.cast_on!r}) places the cast of copied parameters, "
                f"but {why}: nothing is copied or cast. Drop cast_on= (the default is correct on "
                "every platform), " + otherwise
            )

    def replace(self, **changes) -> "CoherentOffload":
        """A copy with some knobs changed, validated like the constructor.

        Raises:
            ValueError: as the constructor.
            TypeError: a name that is not a knob (a removed one names its replacement).

        Example::

            >>> CoherentOffload().replace(prefetch_depth=2).prefetch_depth
            2
        """
        return dataclasses.replace(self, **changes)

    # FSDP2's offload-policy hooks (docs/upstream/fsdp2_offload_hooks.patch, docs/upstream.md): FSDP
    # calls them on a torch that has them, never on one without; the integration implements each.
    def offloads_group(self, params, modules, mesh_info, mp_policy, shard_placement_fn) -> bool:
        return fsdp2_hooks.offloads_group(self, params, modules, mesh_info, mp_policy, shard_placement_fn)

    def init_group(self, group: Any) -> Any:
        return fsdp2_hooks.init_group(self, group)

    def place_shards(self, group: Any) -> list[torch.Tensor] | None:
        return fsdp2_hooks.place_shards(self, group)

    def on_shard_reset(self, fsdp_param: Any) -> None:
        fsdp2_hooks.on_shard_reset(self, fsdp_param)

    def copy_in(self, fsdp_param: Any, stream: Any) -> tuple[torch.Tensor, None] | None:
        return fsdp2_hooks.copy_in(self, fsdp_param, stream)

    def on_copy_in_read(self, group: Any) -> None:
        fsdp2_hooks.on_copy_in_read(self, group)

    def before_compute(self, group: Any, backward: bool) -> None:
        fsdp2_hooks.before_compute(self, group, backward)

    def copy_out_grads(self, fsdp_params: list[Any], grads: list[torch.Tensor], stream: Any) -> Any:
        return fsdp2_hooks.copy_out_grads(self, fsdp_params, grads, stream)

    def on_grads_ready(self, group: Any, is_last_backward: bool) -> None:
        fsdp2_hooks.on_grads_ready(self, group, is_last_backward)


def fully_shard_with_policy(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    policy: CPUOffloadPolicy | None,
    *,
    last_blocks: int | None = None,
    spread_fraction: float | None = None,
    keep_unsharded_last: int = 0,
    activation_checkpointing: bool = False,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` each of ``blocks`` in forward order, then ``model``, with ``policy`` on every
    one of them, or on some of the blocks only: the last ``last_blocks``, or a ``spread_fraction``
    of them spread evenly.

    Placement is per module: a block given the policy has its group offloaded, the other blocks
    and the root get FSDP's default placement. With host optimizer steps, the policy on the last
    blocks is the faster partial offload: their gradients land first in backward, so their host
    steps can end before the next forward needs them.

    Args:
        model (nn.Module): the model, not yet sharded; sharded last (the root group).
        blocks (Sequence[nn.Module]): its per-layer modules, in forward order.
        policy (CPUOffloadPolicy | None): the offload policy (a :class:`CoherentOffload`, or any
            FSDP2 offload policy); None shards without one.
        last_blocks (int | None): give ``policy`` to the last ``last_blocks`` blocks only (not to
            the root); None gives it to every block and the root.
        spread_fraction (float | None): give ``policy`` to this fraction of the blocks, spread
            evenly: block ``i`` (from 0, in forward order) gets it when
            ``floor((i + 1) * f) > floor(i * f)`` (0.5 gives it to blocks 1, 3, 5, ...; 0.625 of 8
            to blocks 1, 3, 4, 6, 7); the root gets it only at 1.0 (every block). None: as
            ``last_blocks`` says.
        keep_unsharded_last (int): shard the last ``keep_unsharded_last`` blocks with
            ``reshard_after_forward=False``: their backward reuses the compute-dtype parameters
            their forward gathered, so an offloaded block copies its parameters in once per step
            instead of twice (half its host-to-device bytes), at the cost of holding them on the
            device from its forward to its backward (2 bytes per parameter in bf16, for all of
            these blocks at the start of backward). The last block's are needed again at once, so
            keeping it costs almost nothing. 0 (the default) leaves ``reshard_after_forward`` to
            ``fully_shard_kwargs`` or FSDP's default.
        activation_checkpointing (bool): run each block's forward under non-reentrant
            ``torch.utils.checkpoint`` (set before sharding; module names, state-dict keys and
            hooks stay as they were): backward recomputes it from the block's input, reading the
            parameters already copied in for backward.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (``mesh``, ``mp_policy``, ...),
            never ``offload_policy``.

    Returns:
        nn.Module: ``model``, sharded.

    Raises:
        ValueError: ``offload_policy`` among ``fully_shard_kwargs``, ``last_blocks`` or
            ``keep_unsharded_last`` not an int in ``[0, len(blocks)]``, ``spread_fraction`` not a
            number in [0, 1], both ``last_blocks`` and ``spread_fraction``,
            ``keep_unsharded_last`` together with ``reshard_after_forward``,
            ``activation_checkpointing`` not a bool; blocks that are not submodules of ``model``,
            one block twice, one inside another, the model itself, or blocks out of the order the
            model registers them (:func:`~torch_fsdp_offload.models.check_block_order`); a model
            or block already sharded.
        TypeError: ``policy`` not an ``OffloadPolicy`` or None (a platform name such as
            ``"coherent"`` is refused with ``CoherentOffload(platform=...)`` as the fix), ``model``
            not an ``nn.Module``, ``blocks`` one module instead of a sequence, or a
            ``fully_shard_kwargs`` name ``fully_shard`` does not take (a typo is refused with the
            closest name) or a ``mesh`` / ``mp_policy`` of another type.

        Every refusal comes before anything is sharded or changed.

    Example::

        >>> policy = CoherentOffload(optimizer="host")
        >>> fully_shard_with_policy(
        ...     model, model.blocks, policy, last_blocks=4, keep_unsharded_last=2, activation_checkpointing=True,
        ...     mp_policy=mp,
        ... )
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
    """
    from torch.distributed.fsdp import fully_shard

    if not isinstance(model, nn.Module):
        raise TypeError(f"fully_shard_with_policy shards an nn.Module, got {type(model).__name__}")
    if policy is not None and not isinstance(policy, OffloadPolicy):
        named_kind = isinstance(policy, str) and policy in _PLATFORM_KINDS
        kind = f" (a platform class: CoherentOffload(platform={policy!r}) forces it)" if named_kind else ""
        raise TypeError(
            f"fully_shard_with_policy(policy={policy!r}) is no offload policy{kind}; pass a CoherentOffload, "
            "another torch.distributed.fsdp OffloadPolicy, or None to shard without one"
        )
    if not isinstance(activation_checkpointing, bool):
        raise ValueError(
            f"activation_checkpointing must be True or False, got {activation_checkpointing!r}: True reruns "
            "each block's forward in backward"
        )
    if "offload_policy" in fully_shard_kwargs:
        raise ValueError("fully_shard_with_policy places policy itself; drop offload_policy= and pass the policy")
    check_fully_shard_kwargs(fully_shard_kwargs, "fully_shard_with_policy")
    if isinstance(blocks, (str, nn.Module)) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"blocks is one {type(blocks).__name__}; pass a sequence of the model's blocks in forward order "
            "(model.blocks, or [block] for one)"
        )
    blocks = list(blocks)
    if blocks:
        # Submodules of model, each once, none inside another, in the order the model registers them.
        blocks = list(find_blocks(model, blocks))
        check_block_order(model, blocks)
        if any(block is model for block in blocks):
            raise ValueError("blocks holds the model itself, which fully_shard_with_policy shards last (the root); "
                             "pass its per-layer modules")
    sharded = [name for name, module in (("the model", model), *((f"block {i}", b) for i, b in enumerate(blocks)))
               if isinstance(module, FSDPModule)]
    if sharded:
        named = sharded[0] if len(sharded) == 1 else f"{', '.join(sharded[:-1])} and {sharded[-1]}"
        raise ValueError(
            f"{named} {'is' if len(sharded) == 1 else 'are'} already sharded (fully_shard ran on "
            f"{'it' if len(sharded) == 1 else 'them'}); fully_shard_with_policy shards a model that is not: build "
            "the model anew and call it once"
        )

    def block_count(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= len(blocks):
            raise ValueError(f"{name} must be an int in [0, {len(blocks)}] (the number of blocks), got {value!r}")
        return value

    if last_blocks is not None:
        block_count("last_blocks", last_blocks)
    if spread_fraction is not None:
        if last_blocks is not None:
            raise ValueError("last_blocks and spread_fraction both choose the blocks given the policy: pass one")
        if not _is_fraction(spread_fraction):
            raise ValueError(f"spread_fraction must be a number in [0, 1] (a share of the blocks), got {spread_fraction!r}")
    if block_count("keep_unsharded_last", keep_unsharded_last) and "reshard_after_forward" in fully_shard_kwargs:
        raise ValueError(
            "keep_unsharded_last sets reshard_after_forward=False on the last blocks itself: "
            "pass one of keep_unsharded_last and reshard_after_forward"
        )
    if spread_fraction is not None:
        with_policy = [spread_block(index, spread_fraction) for index in range(len(blocks))]
    else:
        first = 0 if last_blocks is None else len(blocks) - last_blocks
        with_policy = [index >= first for index in range(len(blocks))]
    root_with_policy = last_blocks is None and (spread_fraction is None or spread_fraction == 1)
    first_kept = len(blocks) - keep_unsharded_last
    for block in blocks if activation_checkpointing else ():
        if not isinstance(getattr(block, "forward", None), types.MethodType) or block.forward.__func__ is not _checkpointed_forward:
            block.forward = types.MethodType(_checkpointed_forward, block)
    for index, block in enumerate(blocks):
        kept = {"reshard_after_forward": False} if index >= first_kept else {}
        given = {"offload_policy": policy} if policy is not None and with_policy[index] else {}
        fully_shard(block, **fully_shard_kwargs, **kept, **given)
    given = {"offload_policy": policy} if policy is not None and root_with_policy else {}
    fully_shard(model, **fully_shard_kwargs, **given)
    return model


def check_fully_shard_kwargs(kwargs: Any, caller: str) -> None:
    """Refuse keyword arguments for ``fully_shard`` that it would refuse only after marking the
    module it was given as sharded (the module could then not be sharded again).

    Args:
        kwargs: what ``caller`` passes to every ``fully_shard`` call.
        caller (str): the function named in the message.

    Raises:
        TypeError: ``kwargs`` is no mapping, or holds a name ``fully_shard`` does not take (the
            closest one it takes is named), or a ``mesh`` or ``mp_policy`` of another type.

    Example::

        >>> check_fully_shard_kwargs({"mp_polcy": mp}, "plan_and_shard")
        Traceback (most recent call last):
        TypeError: plan_and_shard: fully_shard takes no argument 'mp_polcy' (did you mean 'mp_policy'?); ...
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

    if not isinstance(kwargs, Mapping):
        raise TypeError(
            f"{caller}: the fully_shard keyword arguments must be a mapping such as {{'mp_policy': mp}}, "
            f"got {type(kwargs).__name__}"
        )
    taken = [name for name, p in inspect.signature(fully_shard).parameters.items() if p.kind is p.KEYWORD_ONLY]
    for name in kwargs:
        if name not in taken:
            close = difflib.get_close_matches(str(name), taken, n=1)
            raise TypeError(
                f"{caller}: fully_shard takes no argument {name!r}"
                f"{f' (did you mean {close[0]!r}?)' if close else ''}; it takes {', '.join(taken)}"
            )
    for name, kind in (("mesh", DeviceMesh), ("mp_policy", MixedPrecisionPolicy)):
        if kwargs.get(name) is not None and not isinstance(kwargs[name], kind):
            raise TypeError(f"{caller}: fully_shard's {name} must be a {kind.__name__}, got {type(kwargs[name]).__name__}")


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Bound to the block as an instance attribute: nn.Module.__call__ (FSDP's hooks included) runs
    # as before and calls it; the recompute calls the class's forward. A bound method, so a deep
    # copy of the block binds to the copy.
    forward = functools.partial(type(block).forward, block)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def spread_block(index: int, fraction: float) -> bool:
    """Whether block ``index`` (from 0, in forward order) gets the policy under
    ``fully_shard_with_policy(spread_fraction=fraction)``: the chosen blocks are spread evenly
    (0.5 chooses blocks 1, 3, 5, ...; 0.625 of 8 chooses 1, 3, 4, 6, 7)."""
    return math.floor((index + 1) * fraction + 1e-9) > math.floor(index * fraction + 1e-9)


def _is_fraction(value) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0.0 <= value <= 1.0
    )
