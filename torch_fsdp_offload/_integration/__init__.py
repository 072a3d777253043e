"""Every use of torch's private internals in torch_fsdp_offload lives in this package.

The rest of the library uses public torch API, and reaches these internals only through the small
functions exported here and in its ``tensors``, ``dtensor_grads`` and ``installation`` modules.

Modules, named by what they patch or read:

* ``fsdp2_hooks``: CoherentOffload as FSDP2's offload-policy hooks, on a torch that has them
  (docs/upstream/fsdp2_offload_hooks.patch): then nothing of FSDP2 is patched;
* ``fsdp2_param_group``: otherwise ``CoherentFSDPParamGroup``, the ``FSDPParamGroup`` subclass
  installed at the sites FSDP2 constructs it, and the ``FSDPParam`` subclass its parameters are
  re-classed to (the data path both share is its ``GroupOffload``);
* ``group_state``: the states of an offloaded group, with asserted transitions;
* ``fsdp2_sharding``: the ``FSDPState.init`` wrap that sees every ``fully_shard`` call, and the
  undoing of a call the policy refused;
* ``fsdp1_handles``: the seven FSDP1 ``FlatParamHandle`` / ``_runtime_utils`` patch points;
* ``fsdp1_handle_plan``: the handles FSDP1 will build, read from its wrap policy before it wraps;
* ``tensors``: DTensor, autograd and allocator internals, each behind one function;
* ``dtensor_grads``: watching a gradient DTensor for in-place changes (the optimizer's);
* ``installation``: which parts of the integration are in effect.

Importing the package patches nothing: each part installs itself when first needed (see Note:
[Installing the integration] in docs/design.md).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_fsdp_offload._integration import installation

__all__ = [
    "attach_fsdp1_offload",
    "check_fsdp1_arguments",
    "check_fsdp1_host_capacity",
    "check_torch_version",
    "ensure_installed",
    "fsdp2_shards_on_host",
    "install",
    "is_installed",
    "set_fsdp1_prefetch_limit",
    "SUPPORTED_TORCH",
    "torch_version",
    "uninstall",
    "uses_fsdp2_hooks",
]

# The torch releases whose FSDP2 and FSDP1 internals the patch points were read against
# (docs/design.md, "Patch points per torch version"), lowest and highest (major, minor).
SUPPORTED_TORCH = ((2, 11), (2, 15))

# The integration's parts, each installed on its own when first needed: FSDP2's (the policy) and
# FSDP1's (the front door).
PARTS = ("fsdp2", "fsdp1")
# (site, owner, name, torch's original, replacement) of every patch point applied, per part.
_applied: dict[str, list[tuple[str, Any, str, Any, Any]]] = {part: [] for part in PARTS}


def torch_version() -> tuple[int, int]:
    """The running torch's ``(major, minor)``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    """Raise a clear error on a torch whose FSDP internals this package was not written for.

    Raises:
        RuntimeError: naming the supported range and this torch.
    """
    low, high = SUPPORTED_TORCH
    if not (low <= torch_version() <= high):
        raise RuntimeError(
            f"torch_fsdp_offload supports torch {low[0]}.{low[1]} through {high[0]}.{high[1]}; "
            f"this is torch {torch.__version__}. CoherentOffload and the FSDP1 front door patch FSDP "
            "internals that change between releases: install a supported torch, or use FSDP's own "
            "CPUOffloadPolicy (FSDP2) or cpu_offload= (FSDP1) on this one."
        )


def _patch_points(part: str) -> list[tuple[str, Any, str, Any, Any]]:
    """Every patch point of ``part`` on this torch: none of FSDP2's on a torch with the
    offload-policy hooks."""
    if part == "fsdp1":
        from torch_fsdp_offload._integration import fsdp1_handles

        return fsdp1_handles.patches()
    if uses_fsdp2_hooks():
        return []
    from torch_fsdp_offload._integration import fsdp2_param_group, fsdp2_sharding

    return [*fsdp2_param_group.patches(), *fsdp2_sharding.patches()]


def _site_error(site: str, holds: Any, expected: str) -> RuntimeError:
    return RuntimeError(
        f"torch_fsdp_offload cannot patch {site} on torch {torch.__version__}: it holds {holds!r} "
        f"({getattr(holds, '__module__', '?')}), not {expected}. Another library may have patched "
        "it, or this torch changed it: import torch_fsdp_offload before that library, or use a "
        "supported torch."
    )


def _is_torch_own(value: Any) -> bool:
    return getattr(value, "__module__", "").startswith("torch.")


def ensure_installed(part: str) -> None:
    """Install ``part`` (``"fsdp2"`` or ``"fsdp1"``) of the integration unless it is in effect: its
    patch points applied, each verified, all or none. A policy or the FSDP1 front door calls it when
    first used, so that a process that never builds one runs torch unchanged.

    Raises:
        RuntimeError: as :func:`install`.
    """
    if part in installation.installed:
        return
    check_torch_version()
    points = _patch_points(part)
    for site, owner, name, original, _ in points:
        current = getattr(owner, name, None)
        if current is not original or not _is_torch_own(original):
            raise _site_error(site, current, f"torch's own {getattr(original, '__qualname__', original)}")
    applied = _applied[part]
    try:
        for point in points:
            site, owner, name, _, replacement = point
            setattr(owner, name, replacement)
            applied.append(point)
            if getattr(owner, name, None) is not replacement:
                raise _site_error(site, getattr(owner, name, None), "torch_fsdp_offload's replacement after patching")
    except BaseException:
        _restore(part)
        raise
    installation.installed.add(part)


def install() -> None:
    """Apply every patch point this torch needs, FSDP2's and FSDP1's, each verified; a no-op for a
    part already installed. It is called for you: constructing a ``CoherentOffload`` installs
    FSDP2's part, the FSDP1 front door FSDP1's; importing the package installs nothing.

    On a torch whose ``OffloadPolicy`` has the offload hooks (docs/upstream/fsdp2_offload_hooks.patch)
    FSDP2 is not patched at all: FSDP calls ``CoherentOffload``'s hooks (:func:`uses_fsdp2_hooks`).
    Before patching, each site must hold torch's own object, the one the replacement subclasses or
    delegates to; after patching, each site is read back. Nothing of a part stays patched when one
    of its checks fails.

    Raises:
        RuntimeError: on an unsupported torch (see :func:`check_torch_version`), or naming the
            patch site and torch version when a site holds something else than expected.

    Example::

        >>> import torch_fsdp_offload
        >>> torch_fsdp_offload.install()
        >>> torch_fsdp_offload.uninstall()  # torch's FSDP modules are as they were
    """
    for part in PARTS:
        ensure_installed(part)


def _restore(part: str) -> None:
    applied = _applied[part]
    while applied:
        _, owner, name, original, _ = applied.pop()
        setattr(owner, name, original)


def uninstall() -> None:
    """Restore torch's original at every patch point, each verified, so that torch's FSDP modules
    hold exactly what they held before; a no-op for a part not installed.

    FSDP2 models already sharded with a ``CoherentOffload`` keep their offload (their groups were
    built as ``CoherentFSDPParamGroup``). A ``CoherentOffload`` or FSDP1 front door constructed
    later installs its part again.

    Raises:
        RuntimeError: a live FSDP1 front-door model offloads through the patches (it would fall
            back to stock FSDP1 offload; delete it first), or a patch site no longer holds our
            replacement (another library patched over it), naming the site. Nothing is restored then.

    Example::

        >>> import torch_fsdp_offload
        >>> policy = torch_fsdp_offload.CoherentOffload()  # installs FSDP2's part
        >>> torch_fsdp_offload.uninstall()
    """
    if "fsdp1" in installation.installed:
        live = installation.holders("fsdp1")
        if live:
            raise RuntimeError(
                f"torch_fsdp_offload.uninstall(): {live} FSDP1 handle(s) of FullyShardedDataParallel("
                "offload_policy=...) models are alive and offload through the patches, which would fall "
                "back to stock FSDP1 offload. Delete those models first. Nothing was restored."
            )
    for part in PARTS:
        for site, owner, name, _, replacement in _applied[part]:
            current = getattr(owner, name, None)
            if current is not replacement:
                raise _site_error(site, current, "torch_fsdp_offload's replacement (it was patched over)")
    for part in PARTS:
        points = list(_applied[part])
        _restore(part)
        for site, owner, name, original, _ in points:
            if getattr(owner, name, None) is not original:
                raise _site_error(site, getattr(owner, name, None), f"torch's own {original!r} after restoring")
        installation.installed.discard(part)


def uses_fsdp2_hooks() -> bool:
    """Whether FSDP2's part of the integration runs through FSDP2's offload-policy hooks on this
    torch (it then applies no FSDP2 patch point) rather than the ``FSDPParamGroup`` class swap."""
    from torch_fsdp_offload._integration import fsdp2_hooks

    return fsdp2_hooks.available()


def is_installed(part: str | None = None) -> bool:
    """Whether ``part`` of the integration (every part when None) is in effect: installed and not
    restored by :func:`uninstall` since."""
    return set(PARTS if part is None else (part,)) <= installation.installed


def attach_fsdp1_offload(
    root: Any, *, pinned: bool | None, engine: bool, cast_on_device: bool
) -> None:
    """Make every handle of the FSDP1 tree under ``root`` offload as given (the FSDP1 front door).

    Args:
        root: the FSDP1 root module.
        pinned: host shard in exact-size pinned memory (True), plain host memory (False), or
            FSDP1's own ``pin_memory()`` (None).
        engine: copies through the transfer engine's streams (else FSDP1's own copies).
        cast_on_device: copy the fp32 shard and cast it on the device (no host mirror).
    """
    from torch_fsdp_offload._integration import fsdp1_handles

    ensure_installed("fsdp1")
    fsdp1_handles.attach_handle_offload(root, pinned, engine, cast_on_device)


def check_fsdp1_arguments(call: dict[str, Any]) -> None:
    """Raise TypeError for FSDP1 constructor arguments (``call``) of a type FSDP1 does not take:
    ``sharding_strategy``, ``mixed_precision``, ``auto_wrap_policy``."""
    from torch_fsdp_offload._integration import fsdp1_handle_plan

    fsdp1_handle_plan.check_arguments(call)


def check_fsdp1_host_capacity(module: Any, call: dict[str, Any], device: torch.device, *, cast_on: str) -> None:
    """Refuse, before FSDP1 wraps ``module``, host memory that cannot hold the exact-size shards,
    gradient buffers and mirrors of the handles FSDP1 will build from its constructor's ``call``.

    Raises:
        HostMemoryError: the host's budget (``MemAvailable``, ``ulimit -l`` where CUDA pins, or
            ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES``) cannot hold them.
        ValueError: ``TORCH_FSDP_OFFLOAD_HOST_MEMORY_BYTES`` is not a byte size.
    """
    from torch_fsdp_offload._integration import fsdp1_handle_plan

    fsdp1_handle_plan.check_capacity(module, call, device, cast_on=cast_on)


def fsdp2_shards_on_host(module: Any) -> bool:
    """Whether FSDP2 keeps the shards of ``module``'s parameter group (``fully_shard``-ed) on the
    host, where a model built on ``meta`` must allocate them."""
    from torch_fsdp_offload._integration import fsdp2_hooks, fsdp2_sharding

    if fsdp2_hooks.available():
        return module.is_offloaded()  # FSDPModule's, on a torch with the hooks
    return fsdp2_sharding.shards_on_host(module)


def set_fsdp1_prefetch_limit(root: Any, depth: int) -> None:
    """Make the FSDP1 tree under ``root`` prefetch the handle ``depth`` places ahead."""
    from torch_fsdp_offload._integration import fsdp1_handles

    fsdp1_handles.set_prefetch_limit(root, depth)
