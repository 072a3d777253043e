"""Which parts of the integration are in effect (``"fsdp2"``, ``"fsdp1"``), and what relies on a
part staying in effect.

Written only by :func:`torch_fsdp_offload._integration.install`, ``ensure_installed`` and
``uninstall`` (and :func:`hold`); read by the FSDP2 hooks, which act only while their part is
installed. The patches are process-wide, so this record is too. It imports nothing of the library.
"""

from __future__ import annotations

import weakref
from typing import Any

installed: set[str] = set()
# Per part, the live objects that run through its patches (FSDP1 handles offloaded by the front
# door): uninstalling the part under them would drop them back to torch's own path.
_holders: dict[str, "weakref.WeakSet[Any]"] = {}


def hold(part: str, holder: Any) -> None:
    """Note that ``holder`` runs through ``part``'s patches for as long as it lives."""
    _holders.setdefault(part, weakref.WeakSet()).add(holder)


def holders(part: str) -> int:
    """How many live objects run through ``part``'s patches."""
    return len(_holders.get(part, ()))
