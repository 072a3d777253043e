"""``FullyShardedDataParallel(..., offload_policy=)``: FSDP1's front door to :class:`CoherentOffload`.

Design: this is FSDP1 itself (a subclass of ``torch.distributed.fsdp.FullyShardedDataParallel``),
not FSDP2 underneath. What FSDP1 users rely on is FSDP1's ``FlatParameter`` machinery:
``state_dict_type`` with FULL / SHARDED (``ShardedTensor``) / LOCAL state dicts,
``FSDP.optim_state_dict`` and existing checkpoints keyed by it, ``summon_full_params`` (writeback,
``rank0_only``, ``offload_to_cpu``), ``no_sync``, the ``clip_grad_norm_`` method, ``FSDP.fsdp_modules``,
``use_orig_params=False`` (optimizers built over flat parameters) and every ``ShardingStrategy``.
Emulating that surface on FSDP2 would change state-dict layouts and optimizer-state keys and break
existing checkpoints; keeping FSDP1 keeps all of it bit for bit. The offload policy changes only
where a handle's shard lives and how its bytes cross the link, through seven patch points of FSDP1's
internals, all in :mod:`torch_fsdp_offload._integration.fsdp1_handles` (see Note: [FSDP1 patch
points] in docs/design.md); this module calls them through ``torch_fsdp_offload._integration``.

Prefetching is FSDP1's own (``forward_prefetch``, ``backward_prefetch``): an unshard issued early
issues its H2D early. Where shards are offloaded, ``prefetch_depth=N`` sets FSDP1's forward and
backward prefetch limits, so each unshard prefetches the handle ``N`` ahead in the recorded execution
order. Every FSDP instance in the tree, including those ``auto_wrap_policy`` builds with
the base class, gets the policy: it is applied to every handle of ``FSDP.fsdp_modules(root)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel as _FSDP1,
    OffloadPolicy,
    ShardingStrategy,
)

from torch_fsdp_offload import _integration
from torch_fsdp_offload.platform import PlatformKind, detect_platform
from torch_fsdp_offload.policy import CoherentOffload

__all__ = ["FullyShardedDataParallel"]

logger = logging.getLogger(__name__)

class FullyShardedDataParallel(_FSDP1):
    """FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) with an ``offload_policy``.

    Takes FSDP1's constructor unchanged, plus ``offload_policy``. Everything FSDP1 offers works as in
    FSDP1 (state dicts, ``optim_state_dict``, ``summon_full_params``, ``no_sync``,
    ``clip_grad_norm_``, ``fsdp_modules``, all sharding strategies); the policy decides where shards
    live and how they are copied. See the module docstring for why this is FSDP1 and not FSDP2.

    Args:
        module, process_group, sharding_strategy, cpu_offload, auto_wrap_policy, backward_prefetch,
        mixed_precision, ignored_modules, param_init_fn, device_id, sync_module_states,
        forward_prefetch, limit_all_gathers, use_orig_params, ignored_states, device_mesh:
            as for FSDP1.
        offload_policy (OffloadPolicy | None): ``None`` or ``OffloadPolicy()``: no offload (FSDP1's
            ``cpu_offload`` argument applies as usual). ``CPUOffloadPolicy(pin_memory=...)``: FSDP1's
            parameter offload, with the host shard pinned or not as asked. :class:`CoherentOffload`:
            exact-size pinned shards, H2D/D2H on the transfer engine's streams, cast to the compute
            dtype before the copy; ``prefetch_depth=0`` turns FSDP1's prefetching off, ``N >= 1``
            turns on ``forward_prefetch`` as well and prefetches the handle ``N`` ahead in forward
            and backward. Where nothing needs offloading, FSDP1 runs exactly as without offload
            (prefetch arguments as given): on a UNIFIED machine (the GPU's memory is the host's, so
            a copy would move bytes within one memory), without an accelerator (the compute device
            is the host). FSDP1 offloads every handle of the tree alike (its end-of-backward host
            synchronisation and ``clip_grad_norm_`` read the root's ``cpu_offload``): for partial
            offload, shard with FSDP2. The optimizer is yours: FSDP1 never reads the policy's
            ``optimizer`` placement.

    Raises:
        ValueError: before anything is wrapped (the module is left unchanged), for a combination
            this class cannot honour: ``cpu_offload=`` together with ``offload_policy=``; a
            ``CoherentOffload`` with an ``optimizer`` placement other than ``"auto"`` (FSDP1 steps
            with your optimizer; the placement is FSDP2's ``OffloadOptimizer``), or with ``activations`` (call
            :func:`~torch_fsdp_offload.offload_activations` on the wrapped model instead);
            ``prefetch_depth=0`` with ``forward_prefetch=True`` or ``BackwardPrefetch.BACKWARD_POST``,
            or ``prefetch_depth >= 1`` with ``backward_prefetch=None`` (the depth sets both); and
            what :meth:`CoherentOffload.resolve` refuses for the detected platform. Pinned host
            shards (``CPUOffloadPolicy(pin_memory=True)``, ``cpu_offload=CPUOffload(True)``) on a
            machine without an accelerator, where pinning is impossible; a ``device_id`` naming a
            device the machine lacks, or none where it has no accelerator (pass
            ``torch.device("cpu")``).
        HostMemoryError: before anything is wrapped, where the host cannot hold the exact-size
            shards, gradient buffers and mirrors a ``CoherentOffload`` pins for every handle FSDP1
            will build (``auto_wrap_policy``, ``ignored_modules``, sharding strategy and mixed
            precision as given), with what built models allocate at their first forward.
        TypeError: ``offload_policy`` is not an ``OffloadPolicy``, ``cpu_offload`` not a
            ``CPUOffload``, ``device_id`` not an int or device, ``sharding_strategy`` not a
            ``ShardingStrategy``, ``mixed_precision`` not a ``MixedPrecision``, or
            ``auto_wrap_policy`` not a policy.
        RuntimeError: a torch release whose FSDP1 internals were not checked, or the integration
            is not installed (``torch_fsdp_offload.uninstall()`` was called; call
            ``torch_fsdp_offload.install()``).

    Example::

        >>> from torch.distributed.fsdp import MixedPrecision
        >>> from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        >>> from torch_fsdp_offload import CoherentOffload, FullyShardedDataParallel as FSDP
        >>> model = FSDP(
        ...     model,
        ...     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        ...     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        ...     device_id=torch.cuda.current_device(),
        ...     offload_policy=CoherentOffload(),
        ... )
        >>> optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        >>> with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        ...     state = model.state_dict()
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy=None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=None,
        ignored_modules=None,
        param_init_fn=None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh=None,
        *,
        offload_policy: OffloadPolicy | None = None,
    ) -> None:
        # FSDP1 reads these more than once (a generator would be empty the second time), and so does
        # the host-capacity check.
        ignored_modules = list(ignored_modules) if ignored_modules is not None else None
        ignored_states = list(ignored_states) if ignored_states is not None else None
        handle_offload, cpu_offload = _plan(offload_policy, cpu_offload, device_id, forward_prefetch, backward_prefetch)
        device = _compute_device(device_id)  # refuses a device_id this machine cannot compute on
        # The policy's prefetch depth is how far ahead shards are copied in; where nothing is
        # offloaded, FSDP1's own prefetch arguments apply as given.
        prefetch_depth = handle_offload.prefetch_depth if handle_offload is not None else None
        if prefetch_depth == 0:
            backward_prefetch, forward_prefetch = None, False
        elif prefetch_depth is not None:
            forward_prefetch = True
        fsdp1_arguments = dict(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
            device_mesh=device_mesh,
        )
        _integration.check_fsdp1_arguments(fsdp1_arguments)
        if handle_offload is not None and handle_offload.pinned:
            # The shards FSDP1 pins at its first forward, refused here while the module is as it was.
            _integration.check_fsdp1_host_capacity(
                module,
                fsdp1_arguments,
                device,
                cast_on="device" if handle_offload.cast_on_device else "host",
            )
        super().__init__(module, **fsdp1_arguments)
        self.offload_policy = offload_policy if offload_policy is not None else OffloadPolicy()
        if prefetch_depth:
            _integration.set_fsdp1_prefetch_limit(self, prefetch_depth)
        if handle_offload is None:
            return
        _integration.attach_fsdp1_offload(
            self,
            pinned=handle_offload.pinned,
            engine=handle_offload.engine,
            cast_on_device=handle_offload.cast_on_device,
        )


@dataclass(frozen=True)
class _Plan:
    pinned: bool | None
    engine: bool
    cast_on_device: bool = False
    prefetch_depth: int | None = None  # CoherentOffload's; None: FSDP1's prefetch arguments as given


def _plan(
    offload_policy: OffloadPolicy | None,
    cpu_offload: CPUOffload | None,
    device_id,
    forward_prefetch: bool = False,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
) -> tuple[_Plan | None, CPUOffload | None]:
    """Validate the policy; return what each handle does and FSDP1's ``cpu_offload`` argument.

    Like every refusal of the front door, these come before FSDP1's constructor touches the module.
    """
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(
            f"FullyShardedDataParallel(cpu_offload=...) takes FSDP1's CPUOffload or None, got {cpu_offload!r}. "
            "Pass offload_policy=CoherentOffload() or offload_policy=CPUOffloadPolicy() instead"
        )
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        if cpu_offload is not None and cpu_offload.offload_params:
            _refuse_pinning(f"cpu_offload={cpu_offload!r}")
        return None, cpu_offload
    if not isinstance(offload_policy, OffloadPolicy):
        hint = " (FSDP1's cpu_offload= argument; its offload_policy is CPUOffloadPolicy())" if isinstance(
            offload_policy, CPUOffload) else ""
        raise TypeError(
            f"FullyShardedDataParallel(offload_policy=...) takes an OffloadPolicy (e.g. CoherentOffload()), "
            f"got {offload_policy!r}{hint}"
        )
    if cpu_offload is not None:
        raise ValueError(
            "FullyShardedDataParallel got both cpu_offload= and offload_policy=; pass only "
            "offload_policy (CPUOffload(offload_params=True) is CPUOffloadPolicy())"
        )
    if not isinstance(offload_policy, CPUOffloadPolicy):
        raise TypeError(
            f"FullyShardedDataParallel cannot honour {type(offload_policy).__name__}: only OffloadPolicy(), "
            "CPUOffloadPolicy and CoherentOffload are understood"
        )
    _integration.check_torch_version()
    _integration.ensure_installed("fsdp1")
    if not isinstance(offload_policy, CoherentOffload):
        if offload_policy.pin_memory:
            _refuse_pinning(f"offload_policy={offload_policy!r}")
        # FSDP1 pins the shard itself (pinned=None) unless asked not to; the handles still carry
        # the plan so that gradient accumulation outside no_sync() is not lost.
        plan = _Plan(pinned=None if offload_policy.pin_memory else False, engine=False)
        return plan, CPUOffload(offload_params=True)
    _refuse_unread_knobs(offload_policy, forward_prefetch, backward_prefetch)
    device = _compute_device(device_id)
    resolved = offload_policy.resolve(detect_platform(device, kind=offload_policy.platform))
    if resolved.memory == "managed" or resolved.reads_in_place:
        raise ValueError(
            f"FullyShardedDataParallel(offload_policy=CoherentOffload(shard_memory="
            f"{offload_policy.shard_memory!r})): FSDP1 keeps its flat shards in pinned host memory and "
            "copies them in; managed shards, and shards the GPU reads in place, are FSDP2's. Drop "
            "shard_memory= here, or shard with FSDP2: fully_shard(module, offload_policy=CoherentOffload("
            f"shard_memory={offload_policy.shard_memory!r}))"
        )
    if resolved.platform is PlatformKind.UNIFIED:
        logger.info("CoherentOffload on a unified-memory machine: FSDP1 keeps shards in the GPU's "
                    "memory, which is the host's, and copies nothing")
        return None, None
    if resolved.platform is PlatformKind.HOST_ONLY:
        # The compute device is the host: the shards already live where they would be offloaded
        # to. As FSDP2's fully_shard with this policy, FSDP1 then runs without offload.
        logger.info("CoherentOffload without an accelerator: FSDP1 keeps shards on the host, where "
                    "compute runs, and copies nothing")
        return None, None
    plan = _Plan(
        pinned=True,
        engine=resolved.copies,
        cast_on_device=resolved.cast_on == "device",
        prefetch_depth=offload_policy.prefetch_depth,
    )
    return plan, CPUOffload(offload_params=True)


def _refuse_unread_knobs(
    policy: CoherentOffload, forward_prefetch: bool, backward_prefetch: BackwardPrefetch | None
) -> None:
    """Raise ValueError for every knob of ``policy`` FSDP1 would not honour (it never reads them),
    and for prefetch arguments the policy's ``prefetch_depth`` would override."""
    # getattr: knobs a policy version may not have count as left at their defaults.
    optimizer = getattr(policy, "optimizer", "auto")
    activations = getattr(policy, "activations", False)
    prefetch_depth = getattr(policy, "prefetch_depth", 1)
    problems = []
    if not (isinstance(optimizer, str) and optimizer == "auto"):
        problems.append(
            f"optimizer={optimizer!r}: FSDP1 steps with your own optimizer over model.parameters(), "
            "which never reads a placement (placing the step on the host or the GPU is FSDP2's "
            "OffloadOptimizer). Leave optimizer at 'auto', or shard with FSDP2 fully_shard("
            "offload_policy=...) and step with torch_fsdp_offload.OffloadOptimizer"
        )
    if activations:
        problems.append(
            f"activations={activations!r}: FSDP1 has no per-block hook for it. Leave activations at "
            "False and call torch_fsdp_offload.offload_activations(model) on the wrapped model, or "
            "shard with FSDP2 fully_shard(offload_policy=...)"
        )
    if prefetch_depth == 0 and (forward_prefetch or backward_prefetch is BackwardPrefetch.BACKWARD_POST):
        problems.append(
            f"prefetch_depth=0 turns FSDP1's prefetching off, but forward_prefetch={forward_prefetch!r}, "
            f"backward_prefetch={backward_prefetch} ask for it. Drop those arguments, or give "
            "prefetch_depth >= 1 (it sets FSDP1's forward and backward prefetch)"
        )
    if prefetch_depth and backward_prefetch is None:
        problems.append(
            f"prefetch_depth={prefetch_depth!r} prefetches in backward too, but backward_prefetch=None "
            "turns that off. Drop backward_prefetch=None, or give prefetch_depth=0 (no prefetching)"
        )
    if problems:
        raise ValueError(
            "FullyShardedDataParallel(offload_policy=CoherentOffload(...)) cannot honour "
            + "; ".join(problems)
            + ". Nothing was wrapped: the module is unchanged."
        )


def _refuse_pinning(what: str) -> None:
    """Raise ValueError for host shards pinned on a machine without an accelerator, where FSDP1's
    ``pin_memory()`` fails at the first forward, after the module was wrapped."""
    if torch.accelerator.is_available():
        return
    raise ValueError(
        f"FullyShardedDataParallel got {what}, which pins the host shards, and pinning needs an "
        "accelerator; this machine has none. Pass offload_policy=CPUOffloadPolicy(pin_memory=False) "
        "(shards in plain host memory), or offload_policy=CoherentOffload() (without an accelerator "
        "the shards stay where compute runs). Nothing was wrapped: the module is unchanged."
    )


def _compute_device(device_id) -> torch.device:
    """The device FSDP1 computes on. Raises, before FSDP1 wraps anything, for a ``device_id`` this
    machine cannot compute on: FSDP1 finds out only while wrapping (a CUDA device on a CPU-only
    machine), or says only that it needs an accelerator (no ``device_id`` on a machine without one)."""
    has_accelerator = torch.accelerator.is_available()
    if device_id is None:
        if not has_accelerator:
            raise ValueError(
                "FullyShardedDataParallel without device_id computes on the current accelerator, and this "
                "machine has none. Pass device_id=torch.device('cpu') to compute on the host."
            )
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(f"FullyShardedDataParallel(device_id=...) takes an int or a torch.device, got {device_id!r}")
    accelerator = torch.accelerator.current_accelerator() if has_accelerator else None
    if isinstance(device_id, int):  # an index on the current accelerator, as in FSDP1
        device = torch.device(accelerator.type if accelerator is not None else "cuda", device_id)
    else:
        device = torch.device(device_id)
    if device.type == "cpu":
        return device
    if accelerator is None or device.type != accelerator.type or (device.index or 0) >= torch.accelerator.device_count():
        has = "no accelerator" if accelerator is None else f"{torch.accelerator.device_count()} {accelerator.type} device(s)"
        raise ValueError(
            f"FullyShardedDataParallel(device_id={device_id!r}) names a device this machine does not have "
            f"(it has {has}). Pass device_id=torch.device('cpu') to compute on the host, or a device it has."
        )
    return device if device.index is not None else torch.device(device.type, torch.accelerator.current_device_index())
