"""What ``torch.compile`` traces: the modules it compiles (dynamo's ``OptimizedModule`` wrapper, a
module's own ``_compiled_call_impl``) and whether FSDP2's hooks are among it (dynamo's
``skip_fsdp_hooks``), each read without importing dynamo."""

from __future__ import annotations

import sys

import torch.nn as nn

__all__ = ["compiled_regions", "fsdp_hooks_traced"]


def compiled_regions(root: nn.Module) -> list[nn.Module]:
    """The modules of ``root`` (itself included) that dynamo traces each call of, with the calls
    of their submodules inlined: a module compiled in place (``module.compile()``), and the module
    a ``torch.compile(module)`` wrapper calls."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return []  # torch.compile imports dynamo: nothing is compiled yet
    regions = []
    for module in root.modules():
        if isinstance(module, dynamo.eval_frame.OptimizedModule):
            regions.append(module._orig_mod)
        elif getattr(module, "_compiled_call_impl", None) is not None:
            regions.append(module)
    return regions


def fsdp_hooks_traced() -> bool:
    """Whether ``torch.compile`` traces FSDP2's hooks into the compiled graph: on a torch with
    ``torch._dynamo.config.skip_fsdp_hooks`` (2.11), where it is set to False. Elsewhere FSDP2's
    hooks always run outside it, as ``torch.compiler.disable``-d functions."""
    # Without dynamo imported the knob cannot have been set; importing it here would cost the
    # first fully_shard call almost a second.
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and getattr(dynamo.config, "skip_fsdp_hooks", True) is False
