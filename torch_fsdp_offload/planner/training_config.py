"""The ``CoherentOffload`` setting the FSDP2 step model predicts: which blocks are offloaded, where
their optimizer steps, which activations go to the host, and the copy knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_fsdp_offload.planner.library_facts import CAST_PLACEMENTS, spread_block

__all__ = ["LABEL_LEGEND", "TrainingConfig", "label_kind"]

# One line per kind of part of :attr:`TrainingConfig.label`, in the label's order: the report's
# legend under the step model's table.
LABEL_LEGEND: dict[str, str] = {
    "modules": "modules=F: fraction F of the blocks offloaded (params, grads, optimizer state), the last in forward order",
    "opt": "opt=: where the offloaded blocks' optimizer steps: host; splitF: fraction F of them streamed through the GPU; stream: all",
    "act": "act=F: activations of fraction F of the blocks offloaded to the host",
    "ckpt": "ckpt: activation checkpointing per block (its forward recomputed in backward)",
    "depth": "depth=N: N groups copied in ahead of their use",
    "spread": "spread: the offloaded blocks spread evenly, as fully_shard_with_policy(spread_fraction=...) places them",
    "keep": "keep=N: the last N blocks stay unsharded from forward to backward (one copy-in per step instead of two)",
    "cast": "cast=device: the fp32 master copied in and cast on the GPU (no cast on the host, twice the copy-in bytes)",
    "early": "early: OffloadOptimizer(step_during_backward=True): host steps during backward; breaks torch.optim's "
             "contract (parameters and state change before step())",
    "clip": "clip: the gradients clipped to a global norm (max_grad_norm or clip_grad_norm_): host steps start "
            "after the whole backward",
    "accum": "accum=N: N micro-batches accumulated per optimizer step, FSDP reducing each: resident blocks' "
             "gradients stay on the GPU, offloaded blocks' land on the host",
}


def label_kind(part: str) -> str:
    """The :data:`LABEL_LEGEND` key of one space-separated part of a label (``"keep=4"`` -> ``"keep"``)."""
    return part.partition("=")[0]


@dataclass(frozen=True)
class TrainingConfig:
    """One setting of the ``CoherentOffload`` knobs the training-level model predicts.

    Attributes:
        module_fraction (float): fraction of the blocks whose params, grads and optimizer state are
            offloaded, placed as ``block_placement`` says.
        optimizer (str | float): ``"host"``, ``"stream"``, or the fraction of offloaded groups
            stepped on the GPU (``CoherentOffload.optimizer``).
        activations (float): fraction of the blocks whose saved activations are offloaded.
        checkpointing (bool): activation checkpointing per block.
        prefetch_depth (int): groups copied ahead (0 = each copy waits for its use).
        block_placement (str): which blocks are offloaded. ``"last"``: the last
            ``round(module_fraction * n)`` in forward order (``fully_shard_with_policy(last_blocks=...)``,
            as :meth:`~torch_fsdp_offload.planner.report.Recommendation.apply` does); ``"spread"``: spread
            evenly, as ``fully_shard_with_policy(spread_fraction=module_fraction)`` places them.
        keep_unsharded (int): the last ``keep_unsharded`` blocks are not resharded after forward
            (``fully_shard_with_policy(keep_unsharded_last=...)``): the offloaded ones among them
            copy their parameters in once per step, and every one holds its unsharded parameters
            from its forward to its backward.
        cast_on (str): where the fp32 master is cast to the compute dtype for the copy-in
            (``CoherentOffload.cast_on``). ``"host"``: into a pinned mirror after each host step
            (the cast is host work; compute-dtype bytes cross the link; a streamed step brings the
            mirror back too). ``"device"``: the master's bytes cross the link and are cast on the
            GPU as they land (no cast on the host, twice the copy-in bytes, no mirror to bring back).
        step_during_backward (bool): ``OffloadOptimizer(step_during_backward=True)``: a host group
            steps as soon as its gradients landed, before ``step()`` (breaks ``torch.optim``'s
            contract). False (the default): host steps start at ``step()``, each when its gradients
            landed, and run on into the next forward. Without effect with ``clipping`` (the
            optimizer never steps early then).
        clipping (bool): the training loop clips the gradients to a global norm
            (``OffloadOptimizer(max_grad_norm=...)`` or ``clip_grad_norm_`` before ``step()``):
            ``step()`` waits for every gradient and the norm, so host steps start after backward.
        grad_accum_steps (int): micro-batches whose gradients the loop accumulates per optimizer
            step, with FSDP's default of reducing each (no ``set_requires_gradient_sync(False)``,
            which would hold every block's unsharded gradients on the GPU): the resident groups'
            sharded gradients stay on the GPU from the first micro-batch to ``step()``; the
            offloaded groups' running sums live on the host and are added to on the GPU.

    Raises:
        ValueError: a knob outside its range, naming the knob and what it accepts.

    Example::

        >>> TrainingConfig(module_fraction=0.5, cast_on="device").coherent_offload_kwargs()
        {'optimizer': 'host', 'cast_on': 'device'}
    """

    module_fraction: float = 0.0
    optimizer: str | float = "host"
    activations: float = 0.0
    checkpointing: bool = False
    prefetch_depth: int = 1
    block_placement: str = "last"
    keep_unsharded: int = 0
    cast_on: str = "host"
    step_during_backward: bool = False
    clipping: bool = False
    grad_accum_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("module_fraction", "activations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"TrainingConfig.{name} must be a fraction in [0, 1], got {value!r}")
        if not (self.optimizer in ("host", "stream") or (
            isinstance(self.optimizer, (int, float)) and not isinstance(self.optimizer, bool)
            and 0.0 <= self.optimizer <= 1.0
        )):
            raise ValueError(
                f"TrainingConfig.optimizer must be 'host', 'stream' or a GPU fraction in [0, 1], got {self.optimizer!r}"
            )
        if self.prefetch_depth < 0:
            raise ValueError(f"TrainingConfig.prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.block_placement not in ("last", "spread"):
            raise ValueError(f"TrainingConfig.block_placement must be 'last' or 'spread', got {self.block_placement!r}")
        if isinstance(self.keep_unsharded, bool) or not isinstance(self.keep_unsharded, int) or self.keep_unsharded < 0:
            raise ValueError(f"TrainingConfig.keep_unsharded must be an int >= 0, got {self.keep_unsharded!r}")
        for name in ("step_during_backward", "clipping"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainingConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.grad_accum_steps, bool) or not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ValueError(f"TrainingConfig.grad_accum_steps must be an int >= 1, got {self.grad_accum_steps!r}")
        if self.cast_on not in CAST_PLACEMENTS:
            raise ValueError(
                f"TrainingConfig.cast_on must be 'host' (the master cast into a pinned mirror on the host) or "
                f"'device' (the master copied in and cast on the GPU), got {self.cast_on!r}"
            )

    def kept_blocks(self, n_blocks: int) -> range:
        """Indices (forward order) of the blocks kept unsharded after forward, out of ``n_blocks``.

        Raises:
            ValueError: ``keep_unsharded`` above ``n_blocks``.
        """
        if self.keep_unsharded > n_blocks:
            raise ValueError(f"TrainingConfig.keep_unsharded={self.keep_unsharded} exceeds the model's {n_blocks} blocks")
        return range(n_blocks - self.keep_unsharded, n_blocks)

    def offloaded_blocks(self, n_blocks: int) -> list[int]:
        """Indices (forward order) of the blocks this setting offloads, out of ``n_blocks``."""
        if self.block_placement == "last":
            return list(range(n_blocks - round(self.module_fraction * n_blocks), n_blocks))
        return [i for i in range(n_blocks) if spread_block(i, self.module_fraction)]

    def root_placement(self, n_blocks: int, root_params: int) -> str:
        """Where the root group's state lives (its ``root_params`` parameters are those outside the
        blocks: embeddings, head, final norm). ``"resident"`` unless every block is offloaded: then
        the policy goes on the root as well (``fully_shard_with_policy`` without ``last_blocks``, as
        a recommendation applies it), and the root, first in forward order, is the first group
        ``OffloadOptimizer`` streams: ``"streamed"`` where it streams any of the ``n_blocks + 1``
        groups, else ``"host"``. A root without parameters is no FSDP group: ``"resident"``."""
        if root_params == 0 or n_blocks == 0 or len(self.offloaded_blocks(n_blocks)) != n_blocks:
            return "resident"
        return "streamed" if round(self.optimizer_gpu_fraction * (n_blocks + 1)) > 0 else "host"

    @property
    def steps_early(self) -> bool:
        """Whether host steps may start during backward, before ``step()``: ``step_during_backward``
        without ``clipping`` (the optimizer never steps early when it clips)."""
        return self.step_during_backward and not self.clipping

    @property
    def breaks_contract(self) -> bool:
        """Whether this setting changes parameters before ``step()``: host steps during backward
        (:attr:`steps_early`) on offloaded groups."""
        return self.steps_early and self.module_fraction > 0

    @property
    def optimizer_gpu_fraction(self) -> float:
        return {"host": 0.0, "stream": 1.0}.get(self.optimizer, self.optimizer)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        optimizer = self.optimizer if isinstance(self.optimizer, str) else f"split{self.optimizer:.2f}"
        parts = [f"modules={self.module_fraction:.2f}"]
        if self.module_fraction > 0:
            parts.append(f"opt={optimizer}")
        if self.activations > 0:
            parts.append(f"act={self.activations:.2f}")
        if self.checkpointing:
            parts.append("ckpt")
        if self.prefetch_depth != 1:
            parts.append(f"depth={self.prefetch_depth}")
        if self.block_placement != "last" and 0 < self.module_fraction < 1:
            parts.append(self.block_placement)
        if self.keep_unsharded:
            parts.append(f"keep={self.keep_unsharded}")
        if self.cast_on != "host" and self.module_fraction > 0:
            parts.append(f"cast={self.cast_on}")
        if self.step_during_backward and self.module_fraction > 0:
            parts.append("early")
        if self.clipping:
            parts.append("clip")
        if self.grad_accum_steps > 1:
            parts.append(f"accum={self.grad_accum_steps}")
        return " ".join(parts)

    def coherent_offload_kwargs(self) -> dict[str, Any] | None:
        """The ``CoherentOffload(...)`` keyword arguments of the policy this setting gives to its
        offloaded blocks (:meth:`offloaded_blocks`); None where it offloads no block (activations
        are offloaded by ``offload_activations``, not by the policy)."""
        if self.module_fraction == 0:
            return None
        # Explicit even for "host": CoherentOffload's default ("auto") streams half the groups on
        # a discrete GPU, which is not what this setting predicted.
        kwargs: dict[str, Any] = {"optimizer": self.optimizer}
        if self.cast_on != "host":
            kwargs["cast_on"] = self.cast_on
        if self.prefetch_depth != 1:
            kwargs["prefetch_depth"] = self.prefetch_depth
        return kwargs

    def offload_optimizer_kwargs(self) -> dict[str, Any]:
        """The ``OffloadOptimizer(...)`` timing arguments this setting was predicted with: empty for
        the library's defaults (nothing steps before ``step()``), ``step_during_backward=True`` for
        an ``early`` setting that offloads.

        Example::

            >>> TrainingConfig(module_fraction=0.5, step_during_backward=True).offload_optimizer_kwargs()
            {'step_during_backward': True}
        """
        return {"step_during_backward": True} if self.step_during_backward and self.module_fraction > 0 else {}
