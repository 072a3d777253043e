"""``python -m torch_fsdp_offload {platform, plan} ...``.

Each sub-command lives in its own module, which provides ``add_arguments(parser)``, optionally
``check_arguments(parser, args)`` (refuses, through ``parser.error``, combinations argparse cannot
express), and ``run(args) -> int``; this file only dispatches, so the rooms stay independent.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
_SUBCOMMANDS = {
    "platform": ("torch_fsdp_offload.platform.cli", "report this machine's CPU-GPU memory platform"),
    "plan": ("torch_fsdp_offload.planner.cli", "should I offload, and how much?"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_fsdp_offload")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules, parsers = {}, {}
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        modules[name] = importlib.import_module(module_name)
        parsers[name] = subparsers.add_parser(name, help=help_text, description=help_text)
        modules[name].add_arguments(parsers[name])
    args = parser.parse_args(argv)
    module = modules[args.command]
    if hasattr(module, "check_arguments"):
        module.check_arguments(parsers[args.command], args)
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
