"""The prefetch schedule: a root's offloaded groups in forward order, learned in the first forward,
and the copy-ins it issues ``prefetch_depth`` groups ahead of the computing one, in both passes."""

from __future__ import annotations

from typing import Any

from torch_fsdp_offload.data_path.group_offload import GroupOffload

__all__ = ["RootSchedule"]

# The attribute of a root's communication context that holds its schedule.
_ATTRIBUTE = "coherent_schedule"


class RootSchedule:
    """Forward order of a root's offloaded groups, learned in the first forward, for prefetch."""

    def __init__(self) -> None:
        self.order: list[GroupOffload] = []
        self.learning = True

    @staticmethod
    def find(comm_ctx: Any) -> "RootSchedule | None":
        """The schedule of the root whose FSDP communication context is ``comm_ctx`` (one per root,
        shared by its groups), None before :meth:`of_root` made it."""
        return getattr(comm_ctx, _ATTRIBUTE, None)

    @staticmethod
    def of_root(comm_ctx: Any) -> "RootSchedule":
        """The schedule of the root whose communication context is ``comm_ctx``, made on first use
        and kept on that context (it lives as long as the root)."""
        schedule = RootSchedule.find(comm_ctx)
        if schedule is None:
            schedule = RootSchedule()
            setattr(comm_ctx, _ATTRIBUTE, schedule)
        return schedule

    def on_compute(self, offload: GroupOffload, backward: bool, depth: int) -> None:
        """``offload``'s group is about to compute: start the copy-ins of the ``depth`` groups that
        compute after it. The window is anchored at the computing group, not at each unshard:
        FSDP's backward prefetch unshards the next group early, and a window moved by that
        unshard stages one group more than ``depth`` (one group ahead with ``depth=0``)."""
        if backward:
            self.learning = False
        elif self.learning and offload not in self.order:
            self.order.append(offload)
        if offload not in self.order or depth == 0:
            return
        index = self.order.index(offload)
        ahead = (
            self.order[max(0, index - depth) : index][::-1]
            if backward
            else self.order[index + 1 : index + 1 + depth]
        )
        for neighbour in ahead:
            if neighbour.active and neighbour.needs_copy_in(backward):
                neighbour.issue_h2d(block=False)

    def prefetch_first(self, depth: int) -> None:
        """Start the next forward's first copies (called after the optimizer step)."""
        for offload in self.order[: max(depth, 1)]:
            if offload.active:
                offload.issue_h2d(block=False)
