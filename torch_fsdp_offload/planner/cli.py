"""``python -m torch_fsdp_offload plan``: should I offload, and how much?

Examples::

    python -m torch_fsdp_offload plan --scenario docs/examples/talk_gh200.json
    python -m torch_fsdp_offload plan --scenario docs/examples/talk_gh200.json --json --plot plan.png
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4 --seq-len 2048 --platform h200-pcie
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4   # on a GPU: measured
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4 --platform h200-pcie --gpu-memory-GiB 14
"""

from __future__ import annotations

import argparse
import json
import sys

from torch_fsdp_offload.planner.api import plan
from torch_fsdp_offload.planner.profiles import PLATFORM_PROFILES
from torch_fsdp_offload.planner.scenario import ScenarioError

__all__ = ["add_arguments", "check_arguments", "run"]

# Flags that describe a --model run; a --scenario file holds its own figures instead.
_MODEL_ONLY_FLAGS = ("batch_size", "seq_len", "world_size", "microbatch_factors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` sub-command's options to ``parser``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", metavar="FILE.json", help="analytic scenario (see docs/planner.md)")
    source.add_argument(
        "--model",
        help="built-in model name (tiny, small, llama-1b, anchor-1.6b), a transformers config name, or hf:<path or hub id>",
    )
    parser.add_argument(
        "--platform",
        choices=sorted(PLATFORM_PROFILES),
        help="plan for this built-in profile instead of measuring this machine",
    )
    parser.add_argument("--batch-size", type=int, help="today's micro-batch in sequences (model only; default 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (model only; default 2048)")
    parser.add_argument(
        "--world-size", type=int, help="GPUs of one host FSDP shards over; per-GPU predictions (model only; default 1)"
    )
    parser.add_argument(
        "--microbatch-factors",
        help="comma-separated micro-batch multiples to time on the GPU (model only; default 1,2,4,8)",
    )
    parser.add_argument(
        "--gpu-memory-GiB",
        type=float,
        default=None,
        help="GPU memory the peak must fit in (a budget, or a smaller GPU); default 90%% of the platform's",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    parser.add_argument("--plot", metavar="FILE.png", help="write throughput against offloaded fraction (needs matplotlib)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, through ``parser.error``, model-only flags given with ``--scenario``, which would ignore them.

    Args:
        parser: the ``plan`` sub-command's parser (its usage heads the error).
        args: what ``parser`` parsed.

    Raises:
        SystemExit: (status 2) naming the flags and the fix.
    """
    given = [f"--{name.replace('_', '-')}" for name in _MODEL_ONLY_FLAGS if getattr(args, name) is not None]
    if args.scenario is not None and given:
        parser.error(
            f"{', '.join(given)} only apply to --model; --scenario {args.scenario} takes the micro-batch, "
            "sequence and timings from the file (memory_GB, iteration_time_s, microbatch_scaling): drop "
            f"{', '.join(given)}, or plan with --model"
        )


def run(args: argparse.Namespace) -> int:
    """Run the planner; print the report (or JSON); return the exit status."""
    model_options = {
        name: getattr(args, name) for name in ("batch_size", "seq_len", "world_size") if getattr(args, name) is not None
    }
    if args.microbatch_factors is not None:
        try:
            model_options["microbatch_factors"] = [
                int(part) for part in args.microbatch_factors.split(",") if part.strip()
            ]
        except ValueError:
            print(f"error: --microbatch-factors must be integers separated by commas, got {args.microbatch_factors!r}", file=sys.stderr)
            return 2
    try:
        if args.scenario:
            result = plan(scenario=args.scenario, platform=args.platform, gpu_memory_GiB=args.gpu_memory_GiB)
        else:
            result = plan(args.model, platform=args.platform, gpu_memory_GiB=args.gpu_memory_GiB, **model_options)
    except (ScenarioError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            result.plot(args.plot)
        except ImportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.report(), end="")
    return 0
