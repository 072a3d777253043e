"""The states of one offloaded FSDP2 parameter group (``GroupOffload``), as enums with asserted
transitions, in the manner of FSDP2's ``TrainingState`` and ``ShardedState``.

Three orthogonal states, each changed by one method of ``GroupOffload``:

* :class:`GroupPlacement`, where the group's shards live: ``RESIDENT`` (not offloaded: every group on
  unified or host-only machines, where nothing is copied), ``ON_HOST`` (FSDP placed the shards on the host; not yet moved into our
  buffer, i.e. before lazy init), ``HOMED`` (in the group's exact-size host buffer). Changed by
  ``GroupOffload.home()`` only, ``ON_HOST`` to ``HOMED``.
* :class:`SourceFreshness`, whether the copy-in source (the master, or its compute-dtype mirror)
  and any copy in flight may be older than the parameters: ``STALE`` once gradients land (an
  optimizer step may follow) or the shards are reset or loaded (``GroupOffload.mark_stale()``),
  ``CURRENT`` once refreshed (``GroupOffload.mark_current()``). Version counters cannot tell:
  fused optimizer kernels on DTensors update parameters without bumping them.
* :class:`GradCapture`, whether FSDP's ``post_backward`` is handing the group its reduced
  gradients: ``IDLE`` or ``CAPTURING`` (``GroupOffload.begin_grad_capture()`` and
  ``end_grad_capture()``).
"""

from __future__ import annotations

import enum


class GroupPlacement(enum.Enum):
    RESIDENT = enum.auto()
    ON_HOST = enum.auto()
    HOMED = enum.auto()


class SourceFreshness(enum.Enum):
    STALE = enum.auto()
    CURRENT = enum.auto()


class GradCapture(enum.Enum):
    IDLE = enum.auto()
    CAPTURING = enum.auto()


def assert_in_states(current: enum.Enum, *states: enum.Enum) -> None:
    """Raise AssertionError unless ``current`` is one of ``states`` (a transition out of order is
    a bug of this package, never of the caller)."""
    if current not in states:
        raise AssertionError(f"Expected to be in one of {[s.name for s in states]}, but got {current.name}")
