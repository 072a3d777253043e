"""Whether the integration's patches are in place, for the code that must refuse to run without them.

Written only by :func:`torch_fsdp_offload._integration.install` and ``uninstall``; read by
``CoherentOffload`` and the FSDP1 front door through :func:`require_installed`. It imports nothing of
the library, so the policy can ask without importing the integration (which imports the policy).
"""

from __future__ import annotations

installed = False
# Why the integration is not installed, for the error; set by install() and uninstall().
reason = "torch_fsdp_offload.uninstall() was called"


def require_installed(what: str) -> None:
    """Raise a clear RuntimeError unless the integration is installed.

    Raises:
        RuntimeError: naming ``what`` needs it, why it is not installed, and
            ``torch_fsdp_offload.install()``.
    """
    if not installed:
        raise RuntimeError(
            f"{what} needs torch_fsdp_offload's FSDP integration, which is not installed ({reason}). "
            "Call torch_fsdp_offload.install() first; importing torch_fsdp_offload installs it on a "
            "supported torch."
        )
