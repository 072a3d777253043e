"""``CoherentOffload``: the offload policy users pass to FSDP."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Literal, Union

import torch
import torch.nn as nn
import torch.utils.checkpoint

from torch.distributed.fsdp import CPUOffloadPolicy

from torch_fsdp_offload import _integration
from torch_fsdp_offload._integration import fsdp2_hooks
from torch_fsdp_offload.resolved_plan import CastPlacement, ResolvedPlan
from torch_fsdp_offload.placement import choose_placements, measured_rates
from torch_fsdp_offload.platform import detect_platform, Platform, PlatformKind

logger = logging.getLogger(__name__)

OptimizerPlacement = Union[Literal["auto", "host", "stream"], float]

_OPTIMIZER_PLACEMENTS = ("auto", "host", "stream")
CAST_PLACEMENTS = ("host", "device")
_MIN_CHUNK_BYTES = 1 << 20


@dataclass(eq=False)
class CoherentOffload(CPUOffloadPolicy):
    """Offloads FSDP's sharded parameters, gradients and optimizer state to host memory of the
    right kind for the machine, and moves them over the CPU-GPU link on dedicated streams,
    coalesced per parameter group, in the compute dtype, prefetched ahead of use.

    It is a :class:`torch.distributed.fsdp.CPUOffloadPolicy`, so FSDP2's ``fully_shard`` accepts
    it wherever it accepts an offload policy (per module, or as a value of a per-parameter map),
    and FSDP's own CPU-offload checks and gradient placement apply. ``pin_memory`` is managed by
    this policy (it allocates exact-size pinned memory itself) and must be left at its default.

    Where the shards live follows from the detected platform (see :class:`ResolvedPlan`'s
    ``memory``): exact-size page-locked host memory where the GPU has its own memory, the GPU's own
    allocation on UNIFIED machines (the one physical DRAM, read in place), host memory without an
    accelerator.

    The object is configuration only: sharding never writes to it, so one object can shard any
    number of models, each placed as a fresh object would place it. Knobs are validated at
    construction, by :meth:`replace`, and on every assignment (a refused assignment leaves the
    object unchanged); assigning an attribute that is not a knob is refused. What sharding decides
    per model (which groups ``module_fraction`` offloads) is kept outside the object, per model.
    The rule: the count of groups restarts for a new model once the previous one is complete, that
    is once its root was sharded (a ``fully_shard`` call, with or without the policy, on a module
    containing every module sharded with the policy before it; a later call on a module containing
    that root still counts in the same model), once it ran its first forward, or once it is gone.
    A model sharded in a single ``fully_shard`` call cannot be told from a first block until it
    runs: run it (or give the next model its own object) before sharding the next one.

    Attributes:
        offload_params (bool): keep sharded parameters (the fp32 master copy) in host memory.
            Default True. False makes the policy a no-op for parameters (useful with
            ``activations`` alone).
        offload_grads (bool): move reduced gradient shards to persistent pinned host buffers
            on the D2H stream. Default True. Must be True when ``offload_params`` is True: the
            gradients go where the master parameters and the optimizer are.
        offload_optimizer_state (bool): keep optimizer state in host memory. Default True.
            Must be True when ``offload_params`` is True (state is created next to the
            parameters); the ``optimizer`` placement decides where the step runs.
        optimizer (str or float): where the optimizer step of offloaded groups runs, used by
            :class:`torch_fsdp_offload.OffloadOptimizer`. ``"host"``: on the CPU (fused, all
            cores), each group as soon as its gradients landed, overlapping backward.
            ``"stream"``: each group's fp32 parameters, gradients and optimizer state are copied
            to the GPU, stepped there with the same optimizer class, and copied back (with the
            compute-dtype mirror cast on the GPU). A float in [0, 1]: that fraction of the
            offloaded groups is streamed (those that run first in forward, whose gradients
            land last and so cannot overlap backward on the host) while the host steps the
            rest, both at once. ``"auto"`` (default): 1.0 on COHERENT machines (the link is
            cheap); on DISCRETE ones the share at which streamed and host steps take as long,
            from this machine's host-step and link rates measured at the first resolve
            (:mod:`torch_fsdp_offload.placement`; 0.5 where a copy path is forced without a
            GPU); host steps without an accelerator; on UNIFIED memory the shards are device
            memory and the step runs on the GPU in place. Any placement other than ``"auto"``
            where nothing is offloaded (``offload_params=False``, ``module_fraction=0``, or a
            UNIFIED or HOST_ONLY platform) is refused: there is no offloaded step to place.
        cast_on (str): where the fp32 master parameters are cast to the compute dtype
            (``MixedPrecisionPolicy.param_dtype``) for the copy-in. ``"auto"`` (default): where
            it costs less, from the same measured rates (the host cast's time per parameter
            against the extra link time of copying the master in; ``"host"`` without a GPU to
            measure). ``"host"``: after each optimizer step, into a pinned compute-dtype
            mirror, so only compute-dtype bytes cross the link (2 per parameter in bf16). ``"device"``: no mirror; the copy-in moves
            the master's bytes (4 per parameter) and casts them on the GPU as they land, on the
            copy stream. It takes the cast off the host and its mirror out of host memory, for
            twice the copy-in bytes: choose it where host steps, not the link, bound the step
            (``optimizer="host"`` on a PCIe machine whose backward and next forward hide the
            copies; docs/benchmarks.md). Streamed
            steps then bring back only the fp32 master, not its cast. The result is bitwise the
            same: one round-to-nearest cast either way. Without mixed precision there is no cast
            and the knob changes nothing. ``"device"`` where nothing is copied
            (``offload_params=False``, ``module_fraction=0``, or a UNIFIED or HOST_ONLY platform)
            is refused.
        prefetch_depth (int): how many parameter groups ahead the H2D copy is issued, in
            forward and in backward. Default 1. 0 copies each group only when it is needed.
        chunk_bytes (int): size of the pieces a large copy is split into, so copies in both
            directions interleave and completion can be tracked. Default 64 MiB (large enough to reach the
            link's peak bandwidth, docs/benchmarks.md); at least 1 MiB.
        module_fraction (float): fraction of the FSDP parameter groups that are offloaded, in
            [0, 1]. Default 1.0. The offloaded groups are spread evenly over the order in which
            ``fully_shard`` is called with this policy object (0.5 offloads every second group);
            the others stay on the GPU like plain FSDP2 groups; the count restarts per model (see
            above), so models sharded one after the other can share the object.
            With host optimizer steps, giving the policy (``module_fraction=1.0``) per module to
            the *last* blocks instead, and no ``offload_policy`` to the others and the root, is
            faster: their gradients land first in backward, so their host steps can end before
            the next forward needs them (docs/benchmarks.md). ``fully_shard`` decides where a
            group's shards live when it is called, before the number of groups is known, so this
            placement is the caller's:
            :func:`fully_shard_with_policy` with ``last_blocks``.
        activations (bool or float): offload what the ``fully_shard``-ed blocks save for
            backward to pinned host memory, and prefetch it back a block ahead in backward
            (:class:`~torch_fsdp_offload.activations.ActivationOffload`, one per model, on the
            same transfer streams as the parameters). ``True`` offloads every block, a float in
            [0, 1] that fraction of the blocks, counted from the first (the last blocks before
            the loss, needed first in backward, stay). Default False. Blocks are the modules
            ``fully_shard`` is called on that contain no other such module; the module sharded
            last around them (the root) opens each forward and keeps what it saves outside the
            blocks on the device, so it needs parameters of its own. A no-op on UNIFIED and
            HOST_ONLY platforms. Works with ``offload_params=False`` (activations alone).
        platform (str or None): force a platform class (``"unified"``, ``"coherent"``,
            ``"discrete"``, ``"host_only"``) instead of detecting it; the environment variable
            ``TORCH_FSDP_OFFLOAD_PLATFORM`` does the same for every policy.

    Raises:
        ValueError: a knob outside its range or of the wrong type, or an unsupported
            combination (for example ``offload_grads=False`` with ``offload_params=True``, or
            ``optimizer="stream"`` with ``offload_params=False``), at construction or assignment.
            ``fully_shard`` with this policy raises it too for a group whose parameters mix
            dtypes (an offloaded group's shards share one host buffer: shard each dtype's
            submodules as groups of their own first), and for an ``optimizer`` or ``cast_on``
            placement on a platform that copies nothing (UNIFIED, HOST_ONLY).
        HostMemoryError: from ``fully_shard``, when the offloaded groups' host buffers would
            not fit (``MemAvailable``, ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES``, ``ulimit -l``).
        TypeError: ``memory=``, a knob that was removed (the platform decides the memory).
        AttributeError: an assignment to an attribute that is not a knob.
        RuntimeError: at construction, on a torch whose FSDP internals the integration does not
            support, or when another library patched a site the integration needs (constructing
            the first policy installs FSDP2's part of the integration; importing installs nothing).

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
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, overlap_next_forward=True)
    """

    pin_memory: bool = False
    offload_params: bool = True
    offload_grads: bool = True
    offload_optimizer_state: bool = True
    optimizer: OptimizerPlacement = "auto"
    cast_on: CastPlacement = "auto"
    prefetch_depth: int = 1
    chunk_bytes: int = 64 << 20
    module_fraction: float = 1.0
    activations: Union[bool, float] = False
    platform: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "CoherentOffload":
        if "memory" in kwargs:
            raise TypeError(
                f"CoherentOffload(memory={kwargs['memory']!r}): the memory knob was removed. The "
                "platform decides where shards live (exact-size pinned host memory where the GPU "
                "has its own memory, the GPU's allocation on unified memory); drop the argument."
            )
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        knobs = {field.name for field in dataclasses.fields(self)}
        if name not in knobs:
            raise AttributeError(
                f"CoherentOffload has no knob {name!r}; its knobs are {', '.join(sorted(knobs))}."
            )
        if knobs <= vars(self).keys():
            # Constructed: validate the assignment on a copy first, so a refused value leaves
            # this object as it was.
            dataclasses.replace(self, **{name: value})
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        if self.pin_memory:
            raise ValueError(
                "CoherentOffload(pin_memory=True) is not supported: the policy allocates "
                "exact-size pinned memory itself (FSDP's pin_memory path rounds every shard up "
                "to a power of two). Leave pin_memory at its default."
            )
        for name in ("offload_params", "offload_grads", "offload_optimizer_state"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CoherentOffload({name}=...) must be True or False.")
        if self.offload_params and not (self.offload_grads and self.offload_optimizer_state):
            raise ValueError(
                "CoherentOffload(offload_params=True) needs offload_grads=True and "
                "offload_optimizer_state=True: the gradients and the optimizer state live next "
                "to the fp32 master parameters in host memory. To keep a part of the model "
                "(and its optimizer) on the GPU, lower module_fraction instead."
            )
        if not self.offload_params and (self.offload_grads or self.offload_optimizer_state):
            raise ValueError(
                "CoherentOffload(offload_params=False) keeps parameters, gradients and optimizer "
                "state on the GPU; set offload_grads=False and offload_optimizer_state=False too "
                "(or offload_params=True)."
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
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or (
            self.chunk_bytes < _MIN_CHUNK_BYTES
        ):
            raise ValueError(
                f"CoherentOffload(chunk_bytes={self.chunk_bytes!r}) must be an int >= 1 MiB "
                f"({_MIN_CHUNK_BYTES}); smaller copies cannot reach the link's bandwidth."
            )
        if not _is_fraction(self.module_fraction):
            raise ValueError(
                f"CoherentOffload(module_fraction={self.module_fraction!r}) must be a number in "
                "[0, 1]: the fraction of FSDP parameter groups to offload."
            )
        if not (isinstance(self.activations, bool) or _is_fraction(self.activations)):
            raise ValueError(
                f"CoherentOffload(activations={self.activations!r}) must be True, False or a "
                "number in [0, 1]: the fraction of the fully_shard-ed blocks whose saved "
                "activations are offloaded to host memory."
            )
        if self.offload_params is False or self.module_fraction == 0:
            self._check_placements_need_copies(
                "nothing is offloaded (offload_params=False or module_fraction=0)",
                "or offload parameters (offload_params=True, module_fraction > 0).",
            )
        if self.platform is not None and self.platform not in {k.value for k in PlatformKind}:
            raise ValueError(
                f"CoherentOffload(platform={self.platform!r}) is not a platform class; use one "
                f"of {', '.join(repr(k.value) for k in PlatformKind)}, or None to detect it."
            )
        # The integration applies the policy inside FSDP; without it FSDP would run its own CPU
        # offload with this policy, silently. Installed here, on first use, never at import.
        _integration.ensure_installed("fsdp2")

    def _check_placements_need_copies(self, why: str, otherwise: str) -> None:
        """Refuse an ``optimizer`` or ``cast_on`` placement where ``why`` says nothing is copied;
        ``otherwise`` ends the message with the other way out."""
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

    def detect(self) -> Platform:
        """The platform this policy plans for (``platform`` override, env var, or detection)."""
        return detect_platform(kind=self.platform)

    def resolve(self, platform: Platform | None = None) -> ResolvedPlan:
        """Resolve every ``auto`` knob for ``platform`` (default: :meth:`detect`).

        Raises:
            ValueError: an ``optimizer`` other than ``"auto"``, or ``cast_on="device"``, on a
                UNIFIED or HOST_ONLY platform, where nothing is copied (the defaults are a no-op
                there, so one script runs on every machine).
        """
        platform = platform or self.detect()
        kind = platform.kind
        reasons = []
        if kind == PlatformKind.HOST_ONLY:
            memory = "host"
            reasons.append("no accelerator: shards already live where compute runs")
        elif kind == PlatformKind.UNIFIED:
            memory = "device"
            reasons.append("unified memory: the GPU's allocation is the one DRAM, read in place")
        else:
            memory = "pinned"
            reasons.append("pinned memory is the fast DMA source")
        copies = kind in (PlatformKind.DISCRETE, PlatformKind.COHERENT) and self.offload_params
        if not copies:
            self._check_placements_need_copies(
                f"a {kind.value} platform copies nothing",
                "so that one script runs on every machine; platform='discrete' forces the copy path.",
            )
            # UNIFIED: the shards are device memory read in place, so the step runs on the GPU;
            # HOST_ONLY: everything is on the host already.
            optimizer = "host" if kind == PlatformKind.HOST_ONLY or platform.device.type == "cpu" else "device"
            gpu_fraction = 0.0
            cast_on = "host"
        else:
            # The auto placements come from this machine's measured rates; a copy path forced
            # without a GPU has none, and runs both step paths and the host cast.
            auto = self.cast_on == "auto" or (self.optimizer == "auto" and kind == PlatformKind.DISCRETE)
            rates = measured_rates(platform.device) if auto and platform.device.type == "cuda" else None
            fixed = {"host": 0.0, "stream": 1.0}.get(self.optimizer, self.optimizer)
            if self.optimizer == "auto" and kind == PlatformKind.COHERENT:
                fixed = 1.0
            if rates is not None:
                cast_on, gpu_fraction = choose_placements(rates, self.cast_on, None if fixed == "auto" else float(fixed))
                reasons.append(f"measured {rates.describe()}")
            else:
                cast_on = "host" if self.cast_on == "auto" else self.cast_on
                gpu_fraction = 0.5 if fixed == "auto" else float(fixed)
            if self.cast_on == "auto":
                reasons.append(f"cast on the {cast_on}")
            if self.optimizer == "auto":
                reasons.append(f"{gpu_fraction:.2f} of the optimizer streamed through the GPU")
            optimizer = {0.0: "host", 1.0: "stream"}.get(gpu_fraction, "split")
        activations = float(self.activations)
        if activations and kind in (PlatformKind.UNIFIED, PlatformKind.HOST_ONLY):
            activations = 0.0
            reasons.append("activations stay: host and GPU share one memory")
        return ResolvedPlan(
            platform=kind,
            memory=memory,
            copies=copies,
            offload_params=self.offload_params,
            offload_grads=self.offload_grads,
            offload_optimizer_state=self.offload_optimizer_state,
            optimizer=optimizer,
            optimizer_gpu_fraction=gpu_fraction,
            cast_on=cast_on,
            prefetch_depth=self.prefetch_depth,
            chunk_bytes=self.chunk_bytes,
            module_fraction=float(self.module_fraction),
            activations=activations,
            reason="; ".join(reasons) or "as configured",
        )

    def replace(self, **changes) -> "CoherentOffload":
        """A copy with some knobs changed, validated like the constructor.

        Raises:
            ValueError: as the constructor.
            TypeError: a name that is not a knob.

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
    keep_unsharded_last: int = 0,
    activation_checkpointing: bool = False,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` each of ``blocks`` in forward order, then ``model``, with ``policy`` on every
    one of them, or (``last_blocks=k``) on the last ``k`` blocks only.

    With host optimizer steps, the policy on the last blocks is the faster partial offload: their
    gradients land first in backward, so their host steps can end before the next forward needs
    them, where ``CoherentOffload(module_fraction=...)`` spreads the offloaded groups evenly
    (``fully_shard`` places a group's shards when it is called, before the number of groups is
    known). The other blocks and the root then get FSDP's default placement.

    Args:
        model (nn.Module): the model, not yet sharded; sharded last (the root group).
        blocks (Sequence[nn.Module]): its per-layer modules, in forward order.
        policy (CPUOffloadPolicy | None): the offload policy (a :class:`CoherentOffload`, or any
            FSDP2 offload policy); None shards without one.
        last_blocks (int | None): give ``policy`` to the last ``last_blocks`` blocks only (not to
            the root); None gives it to every block and the root.
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
            ``keep_unsharded_last`` not an int in ``[0, len(blocks)]``, or ``keep_unsharded_last``
            together with ``reshard_after_forward``; raised before anything is sharded.

    Example::

        >>> policy = CoherentOffload(optimizer="host")
        >>> fully_shard_with_policy(
        ...     model, model.blocks, policy, last_blocks=4, keep_unsharded_last=2, activation_checkpointing=True,
        ...     mp_policy=mp,
        ... )
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, overlap_next_forward=True)
    """
    from torch.distributed.fsdp import fully_shard

    if "offload_policy" in fully_shard_kwargs:
        raise ValueError("fully_shard_with_policy places policy itself; drop offload_policy= and pass the policy")
    blocks = list(blocks)

    def block_count(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= len(blocks):
            raise ValueError(f"{name} must be an int in [0, {len(blocks)}] (the number of blocks), got {value!r}")
        return value

    if last_blocks is not None:
        block_count("last_blocks", last_blocks)
    if block_count("keep_unsharded_last", keep_unsharded_last) and "reshard_after_forward" in fully_shard_kwargs:
        raise ValueError(
            "keep_unsharded_last sets reshard_after_forward=False on the last blocks itself: "
            "pass one of keep_unsharded_last and reshard_after_forward"
        )
    first_with_policy = 0 if last_blocks is None else len(blocks) - last_blocks
    first_kept = len(blocks) - keep_unsharded_last
    for block in blocks if activation_checkpointing else ():
        if not isinstance(getattr(block, "forward", None), types.MethodType) or block.forward.__func__ is not _checkpointed_forward:
            block.forward = types.MethodType(_checkpointed_forward, block)
    for index, block in enumerate(blocks):
        with_policy = policy is not None and index >= first_with_policy
        kept = {"reshard_after_forward": False} if index >= first_kept else {}
        fully_shard(block, **fully_shard_kwargs, **kept, **({"offload_policy": policy} if with_policy else {}))
    with_policy = policy is not None and last_blocks is None
    fully_shard(model, **fully_shard_kwargs, **({"offload_policy": policy} if with_policy else {}))
    return model


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Bound to the block as an instance attribute: nn.Module.__call__ (FSDP's hooks included) runs
    # as before and calls it; the recompute calls the class's forward. A bound method, so a deep
    # copy of the block binds to the copy.
    forward = functools.partial(type(block).forward, block)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _is_fraction(value) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0.0 <= value <= 1.0
    )
