"""``python -m torch_fsdp_offload.train``: train a model with FSDP2 + :class:`CoherentOffload`.

Runs as one process or under ``torchrun`` (any number of nodes), on the CPU (gloo) or on GPUs
(``cpu:gloo,cuda:nccl``, so gradient clipping works on host-resident gradients). The model is a
built-in transformer (``--model``, see :data:`torch_fsdp_offload.models.MODEL_CONFIGS`) or a
``transformers`` causal LM built from a config, without downloading weights (``--model`` with a name
of :data:`torch_fsdp_offload.models.HF_CONFIGS`, or ``--hf-config`` for any config). Each block, then the root, is
sharded with ``fully_shard`` (the policy on the blocks ``--module-fraction`` chooses); ``--hsdp R`` shards over a 2D ``(R replicas) x (world / R shards)``
mesh. The data is a seeded synthetic token stream whose every sample is a function of
``(seed, rank, sample index)``, so a resumed run sees the same batches as an uninterrupted one.

Checkpoints (``--checkpoint-dir``) hold the model, the optimizer, the step and the data position,
written with ``torch.distributed.checkpoint``; ``--resume`` continues from the latest one (and
starts from scratch, with a warning, when there is none, so a job restarted by
``torchrun --max-restarts`` uses the same command line).

Examples::

    python -m torch_fsdp_offload.train                       # tiny model, CPU or GPU, seconds
    torchrun --nproc_per_node 8 -m torch_fsdp_offload.train --model llama-1b \\
        --batch-size 4 --seq-len 2048 --offload-optimizer auto --checkpoint-dir ckpt --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from torch_fsdp_offload.models import (
    HF_CONFIGS,
    MODEL_CONFIGS,
    build_hf_causal_lm,
    build_model,
    causal_lm_loss,
    find_blocks,
    load_hf_config,
)
from torch_fsdp_offload.activations import offload_activations
from torch_fsdp_offload.materialize import materialize_sharded
from torch_fsdp_offload.optim import OffloadOptimizer
from torch_fsdp_offload.platform import detect_platform
from torch_fsdp_offload.policy import CoherentOffload, fully_shard_with_policy
from torch_fsdp_offload.timeline import draw_timeline, load_trace, step_profiler, timeline_lanes
from torch_fsdp_offload.transfer import get_transfer_engine

# Written last, after every rank finished saving: a checkpoint named here is complete.
LATEST_FILE = "latest"
_GIB = float(1 << 30)
_MIB = float(1 << 20)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_fsdp_offload.train",
        description="Train a transformer with FSDP2 and CoherentOffload on synthetic data.",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, choices=sorted(MODEL_CONFIGS) + sorted(HF_CONFIGS),
                       help=f"built-in model (default: tiny), or a transformers causal LM built from one of "
                       f"the configs {', '.join(sorted(HF_CONFIGS))} (needs transformers, downloads nothing)")
    model.add_argument("--hf-config", default=None, metavar="NAME_OR_JSON",
                       help="train a transformers causal LM built from this config instead: a name of "
                       "models.HF_CONFIGS (e.g. llama-tiny), a JSON string, a config.json path or a hub id")
    model.add_argument("--seed", type=int, default=0, help="initialisation and data seed")

    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=20, help="optimizer steps to reach (default 20)")
    run.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    run.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    run.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    run.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX_NORM",
                     help="clip the global gradient norm to MAX_NORM")
    run.add_argument("--mixed-precision", choices=("bf16", "fp32"), default=None,
                     help="compute dtype (default: bf16 on GPU, fp32 on CPU); reductions stay fp32")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto: cuda when available")
    run.add_argument("--hsdp", type=int, default=None, metavar="R",
                     help="hybrid sharding: R replicas x (world size / R) shards")

    offload = parser.add_argument_group("offload (CoherentOffload knobs)")
    offload.add_argument("--offload", choices=("on", "off"), default="on",
                         help="shard with CoherentOffload (on, default) or keep everything on the device")
    offload.add_argument("--offload-optimizer", default=None, metavar="host|stream|auto|FRACTION",
                         type=_optimizer_placement, help="where the optimizer step runs")
    offload.add_argument("--cast-on", choices=("host", "device"), default=None,
                         help="where the fp32 master is cast to the compute dtype for the copy-in "
                         "(host: a bf16 mirror, half the bytes; device: for a host-bound optimizer)")
    offload.add_argument("--prefetch-depth", type=int, default=None)
    offload.add_argument("--module-fraction", type=float, default=None,
                         help="fraction of the blocks offloaded, spread evenly (every block and the root at 1, "
                         "the default); the others stay on the device")
    offload.add_argument("--offload-activations", type=float, default=None, metavar="FRACTION",
                         help="fraction of blocks whose activations are offloaded")
    offload.add_argument("--platform", choices=("unified", "coherent", "discrete", "host_only"),
                         default=None, help="force a platform class instead of detecting it")

    io = parser.add_argument_group("checkpoints and logs")
    io.add_argument("--checkpoint-dir", default=None)
    io.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                    help="save every N steps (and at the end); needs --checkpoint-dir")
    io.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint in --checkpoint-dir; with none there, warn "
                    "and start from scratch")
    io.add_argument("--json-log", default=None, metavar="FILE",
                    help="append one JSON record per step to FILE (rank 0)")
    io.add_argument("--profile", default=None, metavar="DIR",
                    help="profile one step (the second this run takes, or its only one) and write its chrome "
                    "trace (trace_rank<R>.json) and, on rank 0 with matplotlib, its stream timeline (timeline.png)")
    io.add_argument("--fail-at-step", type=int, default=None, metavar="N",
                    help=argparse.SUPPRESS)  # fault-injection for tests: see _maybe_inject_failure
    return parser


def _optimizer_placement(text: str) -> str | float:
    if text in ("host", "stream", "auto"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not host, stream, auto or a fraction in [0, 1]"
        ) from None


_OFFLOAD_KNOBS = ("offload_optimizer", "cast_on", "prefetch_depth", "module_fraction", "offload_activations",
                  "platform")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line; every error is raised before anything is allocated.

    Raises:
        SystemExit: (through ``argparse``) with a message naming the bad flag and the fix.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("steps", "batch_size", "grad_accum"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.seq_len < 2:
        parser.error(f"--seq-len must be >= 2 (the loss predicts token t+1 from t), got {args.seq_len}")
    if not 0 < args.lr < math.inf:
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.clip_grad_norm is not None and not 0 < args.clip_grad_norm < math.inf:
        parser.error(
            f"--clip-grad-norm must be a finite number > 0, got {args.clip_grad_norm} (leave it out to not clip)"
        )
    if args.module_fraction is not None and not 0 <= args.module_fraction <= 1:
        parser.error(
            f"--module-fraction is the fraction of the blocks offloaded: a number in [0, 1], got {args.module_fraction}"
        )
    if args.offload_activations is not None and not 0 <= args.offload_activations <= 1:
        parser.error(
            f"--offload-activations is the fraction of blocks whose activations are offloaded: a number in "
            f"[0, 1], got {args.offload_activations}"
        )
    if args.model is not None and args.hf_config is not None:
        parser.error("--model and --hf-config are alternatives: pass one of them")
    hf_flag = "--model" if args.model in HF_CONFIGS else "--hf-config"
    if args.model in HF_CONFIGS:
        args.hf_config, args.model = args.model, None
    if args.hf_config is None:
        args.model = args.model or "tiny"
        max_seq_len = MODEL_CONFIGS[args.model].max_seq_len
        if args.seq_len > max_seq_len:
            parser.error(f"--seq-len {args.seq_len} exceeds {args.model}'s max_seq_len {max_seq_len}")
    else:
        # Loaded (a hub id fetched) now: a bad config fails before the process group and the model.
        try:
            args.hf_model_config = load_hf_config(args.hf_config)
        except (ImportError, ValueError) as exc:
            parser.error(f"{hf_flag}: {exc}")
    if (args.checkpoint_every is not None or args.resume) and args.checkpoint_dir is None:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    # Both are opened only after the process group and the model exist.
    if args.checkpoint_dir is not None and os.path.isfile(args.checkpoint_dir):
        parser.error(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a folder: pass a folder (created if missing)")
    log_folder = None if args.json_log is None else os.path.dirname(os.path.abspath(args.json_log))
    if log_folder is not None and not os.path.isdir(log_folder):
        parser.error(f"--json-log {args.json_log}: the folder {log_folder} does not exist; create it or log elsewhere")
    if args.profile is not None and os.path.isfile(args.profile):
        parser.error(f"--profile {args.profile} is a file, not a folder: pass a folder (created if missing)")
    args.resume_from = None
    if args.resume:
        try:
            args.resume_from = _latest_checkpoint(args.checkpoint_dir)
        except FileNotFoundError as exc:
            parser.error(str(exc))
        if args.resume_from is None and int(os.environ.get("RANK", "0")) == 0:
            warnings.warn(
                f"--resume: no checkpoint found in {args.checkpoint_dir} (no {LATEST_FILE!r} file there): "
                "training starts from scratch",
                stacklevel=2,
            )
    if args.offload == "off":
        given = [f"--{name.replace('_', '-')}" for name in _OFFLOAD_KNOBS if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)} configure offloading: drop them or use --offload on")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; use --device cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.hsdp is not None and (args.hsdp < 1 or world_size % args.hsdp):
        parser.error(
            f"--hsdp {args.hsdp} must divide the world size ({world_size}) into replicas of equal size"
        )
    if args.offload == "on":
        # Builds (and so validates) the policy now: a bad knob fails before the process group.
        args.policy = _offload_policy(args)
    else:
        args.policy = OffloadPolicy()
    return args


def _offload_policy(args: argparse.Namespace) -> CoherentOffload:
    knobs = {
        "optimizer": args.offload_optimizer,
        "cast_on": args.cast_on,
        "prefetch_depth": args.prefetch_depth,
        "platform": args.platform,
    }
    try:
        return CoherentOffload(**{name: value for name, value in knobs.items() if value is not None})
    except ValueError as exc:
        build_parser().error(str(exc))


@dataclass
class _Distributed:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    owns_process_group: bool


def _init_distributed(args: argparse.Namespace) -> _Distributed:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # Gloo for CPU tensors: clip_grad_norm_ all-reduces host-resident gradient norms.
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # torchrun shares one TCPStore across restarts, so a restarted gloo group would read the
            # addresses its dead predecessors published and fail to connect; a per-attempt prefix
            # keeps each attempt's keys apart.
            store, rank, world_size = next(dist.rendezvous("env://"))
            attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
            store = dist.PrefixStore(f"torch_fsdp_offload/attempt_{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        elif "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    if args.hsdp is None:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(
            device.type, (args.hsdp, world_size // args.hsdp), mesh_dim_names=("replicate", "shard")
        )
    return _Distributed(dist.get_rank(), world_size, device, mesh, owns_process_group)


def build_sharded_model(args: argparse.Namespace, dist_env: _Distributed) -> nn.Module:
    """Build the model and shard each block, then the root, with ``args.policy`` (on the blocks
    ``--module-fraction`` chooses, spread evenly, when it is below 1).

    Built-in models are created on the meta device and materialised shard by shard
    (:func:`materialize_sharded`: offloaded groups on the host, resident ones on the device), so no
    rank ever holds the whole model. transformers models are built on the CPU (their initialisation
    of non-persistent buffers does not survive ``to_empty``) and moved to the device one block
    at a time by ``fully_shard``.
    """
    compute_dtype = _compute_dtype(args, dist_env.device)
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if args.hf_config is not None:
        torch.manual_seed(args.seed)
        model = build_hf_causal_lm(args.hf_model_config)
    else:
        model = build_model(args.model, device="meta")
    fully_shard_with_policy(
        model, find_blocks(model), args.policy, spread_fraction=args.module_fraction, mesh=dist_env.mesh,
        mp_policy=mp_policy,
    )
    if args.hf_config is None:
        materialize_sharded(model, dist_env.device)
        model.init_weights(seed=args.seed)
    if args.offload_activations:
        # Kept alive by the hooks it registers on the model.
        offload_activations(model, fraction=args.offload_activations)
    return model


def _compute_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    precision = args.mixed_precision or ("bf16" if device.type == "cuda" else "fp32")
    return torch.bfloat16 if precision == "bf16" else torch.float32


class SyntheticTokens:
    """A seeded stream of learnable token sequences, one stream per data-parallel rank.

    Sample ``i`` of rank ``r`` is ``(start + stride * t) % vocab_size`` for ``t < seq_len``, with
    ``start`` and ``stride`` drawn from a generator seeded by ``(seed, r, i)``: the stream does not
    depend on batch size, step or restarts, only on the position (samples consumed so far), which
    checkpoints save.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int, rank: int, position: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.position = position

    def next_batch(self, batch_size: int) -> torch.Tensor:
        steps = torch.arange(self.seq_len)
        rows = []
        for index in range(self.position, self.position + batch_size):
            generator = torch.Generator().manual_seed(hash((self.seed, self.rank, index)) & (2**63 - 1))
            start = torch.randint(self.vocab_size, (1,), generator=generator)
            stride = torch.randint(1, 8, (1,), generator=generator)
            rows.append((start + stride * steps) % self.vocab_size)
        self.position += batch_size
        return torch.stack(rows)


def _latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The step folder ``checkpoint_dir``'s ``latest`` names, or None when there is no ``latest``.

    Raises:
        FileNotFoundError: ``latest`` names a folder that does not exist (deleted, or moved).
    """
    try:
        with open(os.path.join(checkpoint_dir, LATEST_FILE), encoding="utf-8") as latest:
            name = latest.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(checkpoint_dir, name)
    if name and os.path.isdir(path):
        return path
    steps = sorted(entry for entry in os.listdir(checkpoint_dir) if entry.startswith("step_"))
    raise FileNotFoundError(
        f"{os.path.join(checkpoint_dir, LATEST_FILE)} names the checkpoint {name!r}, but {path} does not exist "
        f"(deleted?); the step folders there: {', '.join(steps) or 'none'}. Write the name of an existing one "
        f"into {LATEST_FILE}, or delete {LATEST_FILE} to train from scratch"
    )


def save_checkpoint(
    checkpoint_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data_position: int
) -> str:
    """Save model, optimizer, step and data position with DCP, then point ``latest`` at it."""
    model_state, optim_state = get_state_dict(model, optimizer)
    name = f"step_{step:08d}"
    path = os.path.join(checkpoint_dir, name)
    train_state = {"step": torch.tensor(step), "data_position": torch.tensor(data_position)}
    dcp.save({"model": model_state, "optim": optim_state, "train": train_state}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(checkpoint_dir, LATEST_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as latest:
            latest.write(name)
        os.replace(tmp, os.path.join(checkpoint_dir, LATEST_FILE))
    dist.barrier()
    return path


def _listed(names: Sequence[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_checkpoint_fits(path: str, state: dict) -> None:
    """Refuse a checkpoint that lacks an entry of ``state`` (``{"model": ..., "optim": ...,
    "train": ...}``, as :func:`load_checkpoint` loads it) or holds one of another shape, and one whose
    model entries are another model's."""
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} holds no checkpoint (no DCP metadata): point {LATEST_FILE} at a folder written by "
            "save_checkpoint, or drop --resume to train from scratch"
        ) from None
    # The entries dcp.load asks for, named as the checkpoint names them (nested keys joined by dots).
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner(state, None, True)
    wanted = planner.state_dict
    model_wanted = {key.removeprefix("model."): value for key, value in wanted.items() if key.startswith("model.")}
    model_saved = {key.removeprefix("model."): entry for key, entry in saved.items() if key.startswith("model.")}
    mismatches = _mismatches(model_wanted, model_saved, "this model")
    unexpected = [name for name in model_saved if name not in model_wanted]
    if unexpected:
        mismatches.append(f"{len(unexpected)} of its entries are not in this model: {_listed(unexpected)}")
    if mismatches:
        raise ValueError(
            f"the checkpoint {path} was written by another model: {'; '.join(mismatches)}. Resume with the "
            "--model or --hf-config that wrote it, or give this model another --checkpoint-dir (or drop "
            "--resume) to train it from scratch"
        )
    mismatches = _mismatches({key: value for key, value in wanted.items() if not key.startswith("model.")}, saved, "this run")
    if mismatches:
        raise ValueError(
            f"the checkpoint {path} holds this model's weights but not the optimizer state and training position "
            f"this run loads: {'; '.join(mismatches)}. It was not written by save_checkpoint (train "
            "--checkpoint-dir) with this optimizer: point latest at a checkpoint train wrote, or give this run "
            "another --checkpoint-dir (or drop --resume) to train from scratch"
        )


def _mismatches(wanted: dict, saved: dict, owner: str) -> list[str]:
    """What keeps ``saved`` (DCP metadata by name) from loading ``wanted``: other shapes, missing names."""
    resized = [
        f"{name} (checkpoint {list(saved[name].size)}, {owner} {list(value.shape)})"
        for name, value in wanted.items()
        if name in saved and isinstance(value, torch.Tensor) and tuple(getattr(saved[name], "size", ())) != tuple(value.shape)
    ]
    missing = [name for name in wanted if name not in saved]
    return ([f"{len(resized)} shape(s) differ: {_listed(resized)}"] if resized else []) + (
        [f"{len(missing)} of {owner}'s entries are missing from it: {_listed(missing)}"] if missing else []
    )


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load a checkpoint written by :func:`save_checkpoint`; returns ``(step, data_position)``.

    Args:
        path (str): the step folder (``<checkpoint-dir>/step_N``).
        model (nn.Module): the sharded model to load into.
        optimizer (torch.optim.Optimizer): its optimizer.

    Returns:
        tuple[int, int]: the step reached and the data position, to continue from.

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint.
        ValueError: the checkpoint was written by another model (the message names the model
            entries whose names or shapes differ), or lacks the optimizer state or training
            position this run loads (written by another program, or with another optimizer: the
            message names the missing entries); raised before anything is loaded.

    Example::

        >>> step, data_position = load_checkpoint("ckpt/step_00000010", model, optimizer)
    """
    model_state, optim_state = get_state_dict(model, optimizer)
    train_state = {"step": torch.tensor(0), "data_position": torch.tensor(0)}
    state = {"model": model_state, "optim": optim_state, "train": train_state}
    _check_checkpoint_fits(path, state)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["train"]["step"]), int(state["train"]["data_position"])


def _maybe_inject_failure(args: argparse.Namespace, step: int, dist_env: _Distributed) -> None:
    # Test hook for fault tolerance: the last rank dies once, on the first attempt only, as a node
    # or process failure would; torchrun --max-restarts then restarts the job, which resumes.
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.fail_at_step == step and first_attempt and dist_env.rank == dist_env.world_size - 1:
        print(f"[rank {dist_env.rank}] --fail-at-step {step}: exiting to simulate a failure", flush=True)
        os._exit(1)


def _host_rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Progress:
    """tqdm when installed, else one plain line per step."""

    def __init__(self, start: int, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def step(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(args: argparse.Namespace, dist_env: _Distributed) -> list[dict]:
    """Run the training loop; returns the per-step records (also printed and logged on rank 0)."""
    is_rank0 = dist_env.rank == 0
    platform = detect_platform(dist_env.device, kind=args.platform)
    if is_rank0:
        name = f" ({platform.device_name})" if platform.device_name else ""
        print(f"platform: {platform.kind.value} on {platform.device}{name}: {platform.reason}", flush=True)
        print(f"strategy: {platform.strategy}", flush=True)
        if isinstance(args.policy, CoherentOffload):
            print(args.policy.resolve(platform).describe(), flush=True)
        else:
            print("offload: off (FSDP2 without an offload policy)", flush=True)

    model = build_sharded_model(args, dist_env)
    offloading = isinstance(args.policy, CoherentOffload)
    if offloading:
        # Steps each offloaded group as soon as its gradients land; clipping must happen inside it
        # (before any group steps), not with clip_grad_norm_ between backward and step().
        optimizer = OffloadOptimizer(
            model, torch.optim.AdamW, lr=args.lr, fused=True, max_grad_norm=args.clip_grad_norm
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    vocab_size = model.config.vocab_size
    start_step, data_position = 0, 0
    if args.checkpoint_dir is not None:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        if args.resume_from is not None:
            try:
                start_step, data_position = load_checkpoint(args.resume_from, model, optimizer)
            except (ValueError, FileNotFoundError) as exc:  # refused before anything was loaded
                build_parser().error(f"--resume: {exc}")
            if is_rank0:
                print(f"resumed from {args.resume_from}: step {start_step}, data position {data_position}", flush=True)
    data = SyntheticTokens(vocab_size, args.seq_len, seed=args.seed, rank=dist_env.rank, position=data_position)
    engine = get_transfer_engine(dist_env.device)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * dist_env.world_size
    if is_rank0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {args.hf_config or args.model}, {n_params / 1e6:.2f}M parameters, world size "
              f"{dist_env.world_size}, mesh {tuple(dist_env.mesh.shape)}, {tokens_per_step} tokens/step",
              flush=True)

    progress = _Progress(start_step, args.steps, enabled=is_rank0)
    log_file = open(args.json_log, "a", encoding="utf-8") if (args.json_log and is_rank0) else None
    records = []
    profiled_step = min(start_step + 1, args.steps - 1) if args.profile is not None else None
    try:
        for step in range(start_step, args.steps):
            _maybe_inject_failure(args, step, dist_env)
            profiler = _start_profiler(dist_env.device) if step == profiled_step else None
            if dist_env.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dist_env.device)
            h2d_before, d2h_before = engine.stats.h2d_bytes, engine.stats.d2h_bytes
            started = time.perf_counter()
            loss_sum = torch.zeros((), device=dist_env.device)
            for _ in range(args.grad_accum):
                tokens = data.next_batch(args.batch_size).to(dist_env.device)
                output = model(tokens)
                logits = output.logits if hasattr(output, "logits") else output
                loss = causal_lm_loss(logits, tokens) / args.grad_accum
                loss.backward()
                loss_sum += loss.detach()
            grad_norm = None
            if args.clip_grad_norm is not None and not offloading:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss_sum)  # SUM: gloo has no AVG
            loss_value = loss_sum.item() / dist_env.world_size  # .item() also waits for the step
            elapsed = time.perf_counter() - started
            if profiler is not None:
                _write_profile(profiler, args.profile, dist_env.rank, step + 1)
            record = {
                "step": step + 1,
                "loss": loss_value,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "step_time_s": elapsed,
                "tokens_per_s": tokens_per_step / elapsed,
                "gpu_peak_bytes": torch.cuda.max_memory_allocated(dist_env.device)
                if dist_env.device.type == "cuda" else None,
                "host_rss_bytes": _host_rss_bytes(),
                "h2d_bytes": engine.stats.h2d_bytes - h2d_before,
                "d2h_bytes": engine.stats.d2h_bytes - d2h_before,
                "data_position": data.position,
            }
            records.append(record)
            progress.step(_format_record(record, args.steps))
            if log_file is not None:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step + 1}; lower --lr")
            every = args.checkpoint_every
            if args.checkpoint_dir is not None and (
                (every is not None and (step + 1) % every == 0) or step + 1 == args.steps
            ):
                save_checkpoint(args.checkpoint_dir, model, optimizer, step + 1, data.position)
    finally:
        progress.close()
        if log_file is not None:
            log_file.close()
    return records


def _start_profiler(device: torch.device):
    profiler = step_profiler(device)
    profiler.__enter__()
    return profiler


def _write_profile(profiler, directory: str, rank: int, step: int) -> None:
    """Stop ``profiler`` and write its chrome trace; rank 0 also draws the stream timeline."""
    profiler.__exit__(None, None, None)
    os.makedirs(directory, exist_ok=True)
    trace = os.path.join(directory, f"trace_rank{rank}.json")
    profiler.export_chrome_trace(trace)
    if rank != 0:
        return
    message = f"profile of step {step}: {trace}"
    try:
        lanes = timeline_lanes(load_trace(trace))
        png = os.path.join(directory, "timeline.png")
        draw_timeline(lanes, png, title=f"step {step}")
        message += f", {png} ({len(lanes)} lanes)"
    except (ImportError, ValueError) as error:  # no matplotlib, or nothing to draw (a CPU run)
        message += f" (no timeline: {error})"
    print(message, flush=True)


def _format_record(record: dict, total_steps: int) -> str:
    gpu = "" if record["gpu_peak_bytes"] is None else f" | gpu peak {record['gpu_peak_bytes'] / _GIB:.2f} GiB"
    return (
        f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | "
        f"{record['tokens_per_s']:,.0f} tok/s{gpu} | host rss {record['host_rss_bytes'] / _GIB:.2f} GiB | "
        f"h2d {record['h2d_bytes'] / _MIB:.1f} MiB | d2h {record['d2h_bytes'] / _MIB:.1f} MiB"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, train, and return the process exit code (0 on success).

    Example::

        >>> from torch_fsdp_offload.train import main
        >>> main(["--model", "tiny", "--steps", "5"])
        0
    """
    args = parse_args(argv)
    dist_env = _init_distributed(args)
    try:
        train(args, dist_env)
    finally:
        if dist_env.owns_process_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        exit_code = main()
    except SystemExit as exc:  # argparse errors
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it on torch 2.13 CPU.
    os._exit(exit_code)
