"""The row names of ``benchmarks/fsdp_offload.py`` (also read by ``models.py`` and ``multi_gpu.py``):
the baselines ``resident`` and ``stock_cpu_offload+fused_cpu_adamw`` with ``;`` suffixes, and
``coherent(item;...)`` rows that name CoherentOffload's and OffloadOptimizer's knobs."""

from __future__ import annotations

import re

from torch_fsdp_offload import CoherentOffload

# A CoherentOffload row is named by its knobs, "coherent(item;item;...)":
#   host | stream | split=F   the optimizer placement (CoherentOffload(optimizer=...))
#   depth=N                    prefetch_depth (default 2)
#   modules=F                  the policy given per module to a fraction F of the blocks, spread evenly
#                              (fully_shard_with_policy(spread_fraction=F)); the others and the root
#                              keep FSDP's default
#   last=F                     the policy given per module to the last F of the blocks in forward
#                              order only (the others and the root keep FSDP's default); their
#                              gradients land first in backward, so their host steps start early
#                              and can end before the next forward reaches them (the planner's
#                              step model assumes this placement)
#   keep=N                     the last N blocks with reshard_after_forward=False
#                              (fully_shard_with_policy(keep_unsharded_last=N)): their backward
#                              reuses the parameters their forward copied in
#   act=F                      CoherentOffload(activations=F)
#   ac                         activation checkpointing of every block (checkpoint_wrapper)
#   default                    CoherentOffload() and OffloadOptimizer(model, AdamW, lr, fused=True)
#                              with every other knob at the library's default (README's usage);
#                              only the clip items below may join it
#   next-fwd                   OffloadOptimizer(overlap_next_forward=True), else False
#   early                      OffloadOptimizer(step_during_backward=True): host steps during
#                              backward (parameters change before step())
#   clip                       OffloadOptimizer(max_grad_norm=1.0)
#   user-clip                  torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) between
#                              backward and step() (also as a ";user-clip" suffix of the baselines)
#   threads=N                  OffloadOptimizer(host_threads=N)
#   accum=N                    N micro-batches a step (also as an ";accum=N" suffix of the baselines)
#   cast=device                CoherentOffload(cast_on="device"): the copy-ins move the fp32 master
#                              and cast it on the GPU; the host steps without casting
#   units=2                    each block sharded as two FSDP groups, its attention and its
#                              feed-forward (fully_shard on those inside the checkpointed block; the
#                              norms join the root's group); last=F and keep=N still count blocks,
#                              modules=F spreads over the groups.
#                              Groups of a third and two thirds of a block land, step and copy in
#                              sooner, so less of the step waits on one group's gradients or the
#                              next forward on one group's step
_ROW_ITEM = re.compile(
    r"(host|stream|next-fwd|ac|default|early|clip|user-clip)|(split|modules|last|act)=([0-9.]+)|(depth|threads|keep|units|accum)=([0-9]+)|cast=(host|device)"
)


def coherent_row_config(name: str) -> dict:
    """CoherentOffload knobs of a row named ``coherent(...)`` (the grammar above); which blocks get the
    policy is :func:`last_blocks_fraction`'s and :func:`spread_blocks_fraction`'s.

    Raises:
        ValueError: not a ``coherent(...)`` name, an unknown item, no or two optimizer placements,
            both ``modules=`` and ``last=``, or a value ``CoherentOffload`` rejects.
    """
    match = re.fullmatch(r"coherent\((.*)\)", name)
    if match is None:
        raise ValueError(f"{name!r} is not a CoherentOffload row: name it coherent(item;...)")
    items = match.group(1).split(";")
    if "default" in items:
        if not all(item in ("default", "clip", "user-clip") or re.fullmatch(r"accum=\d+", item) for item in items):
            raise ValueError(f"row {name!r}: default takes only clip, user-clip or accum=N beside it")
        return {}
    knobs: dict = {"prefetch_depth": 2}
    for item in items:
        parsed = _ROW_ITEM.fullmatch(item)
        if parsed is None:
            raise ValueError(f"unknown item {item!r} in row {name!r}: use host, stream, split=F, depth=N, "
                             "modules=F, last=F, keep=N, act=F, ac, next-fwd, early, clip, user-clip, threads=N, "
                             "units=2, accum=N or cast=device (or default, alone or with clip / user-clip / accum=N)")
        flag, fraction_key, fraction, count_key, count, cast_on = parsed.groups()
        if cast_on is not None:
            knobs["cast_on"] = cast_on
        elif flag in ("host", "stream") or fraction_key == "split":
            if "optimizer" in knobs:
                raise ValueError(f"row {name!r} names two optimizer placements: keep one of host, stream, split=F")
            knobs["optimizer"] = flag or float(fraction)
        elif fraction_key == "act":
            knobs["activations"] = float(fraction)
        elif count_key == "depth":
            knobs["prefetch_depth"] = int(count)
        elif count_key == "units" and int(count) not in (1, 2):
            raise ValueError(f"row {name!r}: units={count} is not 1 or 2 (a block's attention and feed-forward)")
    if "optimizer" not in knobs:
        raise ValueError(f"row {name!r} names no optimizer placement: add host, stream or split=F")
    if spread_blocks_fraction(name) is not None and last_blocks_fraction(name) is not None:
        raise ValueError(f"row {name!r} has both modules= and last=: choose one")
    spread = spread_blocks_fraction(name)
    if spread is not None and not 0 <= spread <= 1:
        raise ValueError(f"row {name!r}: modules={spread:g} is not a fraction of the blocks in [0, 1]")
    try:
        CoherentOffload(**knobs)  # its own checks of every value (split=1.5, act=2, ...)
    except ValueError as error:
        raise ValueError(f"row {name!r}: {error}") from None
    return knobs


# fsdp_offload.py's default run: the baselines (each also with ";ac", activation checkpointing of every block)
# and one row per optimizer placement plus the measured best at <= 50% of resident memory with
# each cast placement, about 25 s a row on our H200; --rows takes any coherent(...) row of the
# grammar above.
DEFAULT_ROWS = (
    "resident",
    "resident;ac",
    "stock_cpu_offload+fused_cpu_adamw",
    "stock_cpu_offload+fused_cpu_adamw;ac",
    "coherent(host;next-fwd)",
    "coherent(split=0.5;next-fwd)",
    "coherent(stream)",
    "coherent(host;next-fwd;modules=0.5)",
    "coherent(split=0.4;next-fwd;last=0.625;keep=5;ac;depth=1)",
    "coherent(host;next-fwd;last=0.5;keep=1;ac;depth=1;units=2;cast=device)",
)


def row_items(name: str) -> list[str]:
    """The items of a ``coherent(...)`` row, or the ``;`` suffixes of a baseline row."""
    match = re.fullmatch(r"coherent\((.*)\)", name)
    return match.group(1).split(";") if match else name.split(";")[1:]


def user_clips(name: str) -> bool:
    """Rows named ``user-clip`` call ``clip_grad_norm_(model.parameters(), 1.0)`` before ``step()``."""
    return "user-clip" in row_items(name)


def baseline(name: str) -> str:
    """A baseline row's system (``resident`` or ``stock_cpu_offload+fused_cpu_adamw``)."""
    return name.split(";")[0]


def known_row(name: str) -> bool:
    """Whether ``run_row`` can run a row of this name."""
    if baseline(name) in ("resident", "stock_cpu_offload+fused_cpu_adamw") and all(
        item in ("ac", "user-clip") or re.fullmatch(r"accum=\d+", item) for item in row_items(name)
    ):
        return True
    try:
        coherent_row_config(name)
    except ValueError:
        return False
    return True


def accumulated_micro_batches(name: str) -> int:
    """Rows named ``accum=N`` accumulate N micro-batches a step: the first N - 1 backward passes
    under ``set_requires_gradient_sync(False)``, the last one reducing (1 when not named)."""
    match = re.search(r"accum=(\d+)", name)
    return int(match.group(1)) if match else 1


def checkpointed(name: str) -> bool:
    """Rows named ``;ac`` checkpoint every block (``checkpoint_wrapper``, non-reentrant)."""
    return "ac" in row_items(name)


def optimizer_kwargs(name: str) -> dict:
    """OffloadOptimizer arguments of a CoherentOffload row: the library's defaults for
    ``default`` rows; otherwise rows named ``next-fwd`` let host steps finish during the next
    forward (``overlap_next_forward=True``), ``early`` step during backward, ``threads=N`` step
    with N host threads; ``clip`` clips to a global norm of 1.0."""
    items = row_items(name)
    kwargs: dict = {"lr": 1e-4, "fused": True}
    if "clip" in items:
        kwargs["max_grad_norm"] = 1.0
    if "default" in items:
        return kwargs
    kwargs.update(overlap_next_forward="next-fwd" in items, step_during_backward="early" in items)
    threads = re.search(r"threads=(\d+)", name)
    if threads is not None:
        kwargs["host_threads"] = int(threads.group(1))
    return kwargs


def last_blocks_fraction(name: str) -> float | None:
    """The F of a row named ``last=F`` (the policy on the last F of the blocks only), else None."""
    last = re.search(r"last=([0-9.]+)", name)
    return float(last.group(1)) if last is not None else None


def spread_blocks_fraction(name: str) -> float | None:
    """The F of a row named ``modules=F`` (the policy on a fraction F of the blocks, spread evenly),
    else None."""
    spread = re.search(r"modules=([0-9.]+)", name)
    return float(spread.group(1)) if spread is not None else None


def kept_unsharded_blocks(name: str) -> int:
    """The N of a row named ``keep=N`` (the last N blocks not resharded after forward), else 0."""
    keep = re.search(r"keep=(\d+)", name)
    return int(keep.group(1)) if keep is not None else 0


def units_per_block(name: str) -> int:
    """The N of a row named ``units=N`` (FSDP groups per block), else 1."""
    units = re.search(r"units=(\d+)", name)
    return int(units.group(1)) if units is not None else 1
