"""Every use of torch's private internals in torch_fsdp_offload lives in this package.

The rest of the library uses public torch API, and reaches these internals only through the small
functions exported here and in its ``tensors``, ``dtensor_grads`` and ``installation`` modules.

Modules, named by what they patch or read:

* ``fsdp2_hooks``: CoherentOffload as FSDP2's offload-policy hooks, on a torch that has them
  (docs/upstream/fsdp2_offload_hooks.patch): then nothing of FSDP2 is patched;
* ``fsdp2_param_group``: otherwise ``CoherentFSDPParamGroup``, the ``FSDPParamGroup`` subclass
  installed at the sites FSDP2 constructs it, and the ``FSDPParam`` subclass its parameters are
  re-classed to (the data path both share is its ``GroupOffload``);
* ``fsdp2_group_state``: the states of an offloaded group, with asserted transitions;
* ``fsdp2_sharding``: the ``FSDPState.init`` wrap that sees every ``fully_shard`` call, and the
  undoing of a call the policy refused;
* ``fsdp1_handles``: the seven FSDP1 ``FlatParamHandle`` / ``_runtime_utils`` patch points;
* ``tensors``: DTensor, autograd and allocator internals, each behind one function;
* ``dtensor_grads``: watching a gradient DTensor for in-place changes (the optimizer's);
* ``installation``: whether :func:`install` is in effect, for the code that must refuse without it.

``import torch_fsdp_offload`` calls :func:`install` once (see Note: [Installing the integration] in
docs/design.md).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_fsdp_offload._integration import installation
from torch_fsdp_offload._integration.installation import require_installed

__all__ = [
    "attach_fsdp1_offload",
    "check_torch_version",
    "fsdp2_shards_on_host",
    "install",
    "is_installed",
    "require_installed",
    "set_fsdp1_prefetch_limit",
    "SUPPORTED_TORCH",
    "torch_version",
    "uninstall",
    "uses_fsdp2_hooks",
]

# The torch releases whose FSDP2 and FSDP1 internals the patch points were read against
# (docs/design.md, "Patch points per torch version"), lowest and highest (major, minor).
SUPPORTED_TORCH = ((2, 11), (2, 14))

# (site, owner, name, torch's original, replacement) of every patch point, while installed.
_applied: list[tuple[str, Any, str, Any, Any]] = []
# Whether install() took FSDP2's offload-policy hooks instead of patching FSDP2.
_fsdp2_hooks = False


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


def _patch_points(fsdp2_hooks: bool | None = None) -> list[tuple[str, Any, str, Any, Any]]:
    """Every patch point of the path ``fsdp2_hooks`` chooses (default: the path in use)."""
    from torch_fsdp_offload._integration import fsdp1_handles

    if fsdp2_hooks if fsdp2_hooks is not None else _fsdp2_hooks:
        return fsdp1_handles.patches()
    from torch_fsdp_offload._integration import fsdp2_param_group, fsdp2_sharding

    return [*fsdp2_param_group.patches(), *fsdp2_sharding.patches(), *fsdp1_handles.patches()]


def _site_error(site: str, holds: Any, expected: str) -> RuntimeError:
    return RuntimeError(
        f"torch_fsdp_offload cannot patch {site} on torch {torch.__version__}: it holds {holds!r} "
        f"({getattr(holds, '__module__', '?')}), not {expected}. Another library may have patched "
        "it, or this torch changed it: import torch_fsdp_offload before that library, or use a "
        "supported torch."
    )


def _is_torch_own(value: Any) -> bool:
    return getattr(value, "__module__", "").startswith("torch.")


def install() -> None:
    """Apply every patch point (FSDP2 and FSDP1), each verified, once per process. On a torch whose
    ``OffloadPolicy`` has the offload hooks (docs/upstream/fsdp2_offload_hooks.patch), FSDP2 is
    not patched: ``CoherentOffload`` implements the hooks (:func:`uses_fsdp2_hooks`).

    Before patching, each site must hold torch's own object, the one the replacement subclasses or
    delegates to; after patching, each site is read back. Nothing stays patched when a check fails.
    Calling it again while installed does nothing.

    Raises:
        RuntimeError: on an unsupported torch (see :func:`check_torch_version`), or naming the
            patch site and torch version when a site holds something else than expected.

    Example::

        >>> import torch_fsdp_offload
        >>> torch_fsdp_offload.uninstall()
        >>> torch_fsdp_offload.install()
    """
    global _fsdp2_hooks
    if installation.installed:
        return
    check_torch_version()
    from torch_fsdp_offload._integration import fsdp2_hooks

    hooks = fsdp2_hooks.available()
    points = _patch_points(hooks)
    for site, owner, name, original, _ in points:
        current = getattr(owner, name, None)
        if current is not original or not _is_torch_own(original):
            raise _site_error(site, current, f"torch's own {getattr(original, '__qualname__', original)}")
    try:
        for point in points:
            site, owner, name, _, replacement = point
            setattr(owner, name, replacement)
            _applied.append(point)
            if getattr(owner, name, None) is not replacement:
                raise _site_error(site, getattr(owner, name, None), "torch_fsdp_offload's replacement after patching")
    except BaseException:
        _restore()
        raise
    if hooks:
        fsdp2_hooks.attach()
    _fsdp2_hooks = hooks
    installation.installed = True


def _restore() -> None:
    while _applied:
        _, owner, name, original, _ = _applied.pop()
        setattr(owner, name, original)


def uninstall() -> None:
    """Restore torch's original at every patch point, each verified; a no-op when not installed.

    FSDP2 models already sharded with a ``CoherentOffload`` keep their offload (their groups were
    built as ``CoherentFSDPParamGroup``); new policies and FSDP1 front doors with an offload policy
    are refused until :func:`install` is called again.

    Raises:
        RuntimeError: a live FSDP1 front-door model offloads through the patches (it would fall
            back to stock FSDP1 offload; delete it first), or a patch site no longer holds our
            replacement (another library patched over it), naming the site. Nothing is restored then.
    """
    if not installation.installed:
        return
    from torch_fsdp_offload._integration import fsdp1_handles

    live = fsdp1_handles.live_offloaded_handles()
    if live:
        raise RuntimeError(
            f"torch_fsdp_offload.uninstall(): {live} FSDP1 handle(s) of FullyShardedDataParallel("
            "offload_policy=...) models are alive and offload through the patches, which would fall "
            "back to stock FSDP1 offload. Delete those models first. Nothing was restored."
        )
    for site, owner, name, _, replacement in _applied:
        current = getattr(owner, name, None)
        if current is not replacement:
            raise _site_error(site, current, "torch_fsdp_offload's replacement (it was patched over)")
    points = list(_applied)
    _restore()
    for site, owner, name, original, _ in points:
        if getattr(owner, name, None) is not original:
            raise _site_error(site, getattr(owner, name, None), f"torch's own {original!r} after restoring")
    installation.installed = False
    installation.reason = "torch_fsdp_offload.uninstall() was called"


def uses_fsdp2_hooks() -> bool:
    """Whether :func:`install` took FSDP2's offload-policy hooks (no FSDP2 patch point applied)
    rather than the ``FSDPParamGroup`` class swap."""
    return _fsdp2_hooks


def is_installed() -> bool:
    """Whether :func:`install` has applied every patch point (and :func:`uninstall` has not
    restored them)."""
    return installation.installed


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

    require_installed("FullyShardedDataParallel(offload_policy=...)")
    fsdp1_handles.attach_handle_offload(root, pinned, engine, cast_on_device)


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


def install_on_import() -> None:
    """:func:`install`, as ``import torch_fsdp_offload`` calls it: where it fails (an unsupported
    torch, a site patched by another library), the package still imports, and the error is what
    ``CoherentOffload()`` and the FSDP1 front door raise."""
    try:
        install()
    except RuntimeError as error:
        installation.reason = f"install() failed: {error}"
