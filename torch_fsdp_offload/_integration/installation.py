"""Which parts of the integration are in effect (``"fsdp2"``, ``"fsdp1"``).

Written only by :func:`torch_fsdp_offload._integration.install`, ``ensure_installed`` and
``uninstall``; read by the FSDP2 hooks, which act only while their part is installed. It imports
nothing of the library.
"""

from __future__ import annotations

installed: set[str] = set()
