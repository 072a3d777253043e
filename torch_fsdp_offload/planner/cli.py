"""``python -m torch_fsdp_offload plan``: should I offload, and how much?

Examples::

    python -m torch_fsdp_offload plan --scenario docs/examples/talk_gh200.json
    python -m torch_fsdp_offload plan --scenario docs/examples/talk_gh200.json --json --plot plan.png
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4 --seq-len 2048 --platform h200-pcie
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4   # on a GPU: measured
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4 --platform h200-pcie --gpu-memory-GiB 14
    python -m torch_fsdp_offload plan --model anchor-1.6b --batch-size 4 --grad-accum-steps 4 --clipping --platform h200-pcie
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from torch_fsdp_offload.models import HF_CONFIGS, MODEL_CONFIGS
from torch_fsdp_offload.planner.api import DEFAULT_SEQ_LEN, plan
from torch_fsdp_offload.planner.profiles import PLATFORM_PROFILES
from torch_fsdp_offload.planner.scenario import ScenarioError

__all__ = ["add_arguments", "check_arguments", "cli_spelling", "run"]

# Flags that describe a --model run; a --scenario file holds its own figures instead.
_MODEL_ONLY_FLAGS = ("batch_size", "seq_len", "world_size", "microbatch_factors", "clipping", "grad_accum_steps")
# plan()'s keyword arguments that a flag sets (the flag is the name with dashes): plan()'s errors
# name the keywords, the command line's name the flags.
_PLAN_KEYWORDS = ("platform", "gpu_memory_GiB", *_MODEL_ONLY_FLAGS)
# plan()'s default sequence length, which a run without --seq-len gets.
_DEFAULT_SEQ_LEN = DEFAULT_SEQ_LEN


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def cli_spelling(message: str) -> str:
    """``message``, an error :func:`~torch_fsdp_offload.planner.plan` raised, with its keyword
    arguments spelled as the flags that set them (``platform=`` -> ``--platform``).

    Args:
        message (str): the error's text, in the Python API's spelling.

    Returns:
        str: the same text in the command line's spelling.

    Example::

        >>> cli_spelling("world_size must be >= 1, got 0; or pass platform= to predict")
        '--world-size must be >= 1, got 0; or pass --platform to predict'
        >>> cli_spelling("with platform=h200-pcie")
        'with --platform=h200-pcie'
    """
    for name in _PLAN_KEYWORDS:
        # A bare word ("platform") is English; only a keyword ("platform=") or an identifier
        # ("world_size") spells the argument. A keyword's "=" goes where no value follows it.
        spelled = rf"\b{name}\b" if "_" in name else rf"\b{name}(?==)"
        message = re.sub(spelled + r"(?:=(?=[\s,;.)]|$))?", _flag(name), message)
    return message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` sub-command's options to ``parser``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", metavar="FILE.json", help="analytic scenario (see docs/planner.md)")
    source.add_argument(
        "--model",
        help=(
            f"a built-in model ({', '.join(sorted(MODEL_CONFIGS))}), a transformers config "
            f"({', '.join(sorted(HF_CONFIGS))}; needs transformers), or hf:<config path or hub id>"
        ),
    )
    parser.add_argument(
        "--platform",
        choices=sorted(PLATFORM_PROFILES),
        help="plan for this built-in profile instead of measuring this machine",
    )
    parser.add_argument("--batch-size", type=int, help="today's micro-batch in sequences (model only; default 1)")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (model only; default {_DEFAULT_SEQ_LEN})")
    parser.add_argument(
        "--world-size", type=int, help="GPUs of one host FSDP shards over; the report is per GPU (model only; default 1)"
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
    parser.add_argument(
        "--clipping", action="store_const", const=True,
        help="the training loop clips the gradients (max_grad_norm or clip_grad_norm_): host steps start after backward "
        "(model only)",
    )
    parser.add_argument(
        "--grad-accum-steps", type=int,
        help="micro-batches the training loop accumulates per optimizer step (model only; default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    parser.add_argument("--plot", metavar="FILE.png", help="write throughput against offloaded fraction (needs matplotlib)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, through ``parser.error``, model-only flags given with ``--scenario``, which would ignore them.

    Args:
        parser: the ``plan`` sub-command's parser (its usage heads the error).
        args: what ``parser`` parsed.

    Raises:
        SystemExit: (status 2) naming the flags and the fix: model-only flags with ``--scenario``, a
            ``--seq-len`` (given or the default) longer than a built-in ``--model`` takes.

    Example::

        >>> check_arguments(parser, parser.parse_args(["--model", "tiny", "--seq-len", "4096"]))
        Traceback (most recent call last):
        SystemExit: 2
    """
    given = [_flag(name) for name in _MODEL_ONLY_FLAGS if getattr(args, name) is not None]
    if args.scenario is not None and given:
        parser.error(
            f"{', '.join(given)} only apply to --model; --scenario {args.scenario} takes the micro-batch, "
            "sequence and timings from the file (memory_GB, iteration_time_s, microbatch_scaling): drop "
            f"{', '.join(given)}, or plan with --model"
        )
    config = MODEL_CONFIGS.get(args.model)
    seq_len = _DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
    if config is not None and config.max_seq_len is not None and seq_len > config.max_seq_len:
        parser.error(
            f"--seq-len {seq_len}{' (the default)' if args.seq_len is None else ''} exceeds the "
            f"{config.max_seq_len} tokens of --model {args.model}: pass --seq-len {config.max_seq_len} or less"
        )


def run(args: argparse.Namespace) -> int:
    """Run the planner; print the report (or JSON); return the exit status."""
    model_options = {
        name: getattr(args, name) for name in ("batch_size", "seq_len", "world_size", "clipping", "grad_accum_steps")
        if getattr(args, name) is not None
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
        print(f"error: {cli_spelling(str(exc))}", file=sys.stderr)
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
        # The report quotes plan()'s arguments where it says what to pass: here they are flags.
        print(cli_spelling(result.report()), end="")
    return 0
