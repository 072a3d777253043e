"""What one parameter moves per step: the host optimizer step's host DRAM bytes, a copy-in's link
bytes, and the host step's time when the link's DMA shares host DRAM with it."""

from __future__ import annotations

from torch_fsdp_offload.planner.training_profile import TrainingProfile

__all__ = [
    "HOST_NORM_GBPS",
    "clip_scaling_seconds_per_param",
    "copy_in_bytes_per_param",
    "host_cast_bytes_per_param",
    "host_step_bytes_per_param",
    "host_step_seconds_per_param",
    "shared_dram_host_seconds",
]


#: A CPU 2-norm of one gradient runs on one core: about 10 GB/s (the H200's host, and the design
#: note on clipping). ``clip_grad_norm_`` waits for the norm of the gradient that lands last.
HOST_NORM_GBPS = 10.0


def _adamw_bytes(profile: TrainingProfile) -> int:
    # Fused AdamW reads the parameter, gradient and both moments and writes parameter and moments.
    return 2 * profile.param_bytes + profile.grad_bytes + 2 * profile.optimizer_state_bytes


def host_cast_bytes_per_param(profile: TrainingProfile, cast_on: str) -> int:
    # The cast into the compute-dtype mirror reads the master and writes the mirror; there is none
    # with cast_on="device", nor when the compute dtype is the master's.
    if cast_on != "host" or profile.compute_bytes == profile.param_bytes:
        return 0
    return profile.param_bytes + profile.compute_bytes


def host_step_bytes_per_param(profile: TrainingProfile, cast_on: str = "host", clipping: bool = False) -> int:
    """Host DRAM bytes one host-stepped parameter moves per step.

    Fused AdamW reads the parameter, gradient and both moments and writes the parameter and
    moments; with ``cast_on="host"`` the compute-dtype mirror the next copy-in reads is cast from
    the fp32 master (read the master, write the mirror); and the gradient's D2H copy writes into
    host DRAM during the same window. 38 bytes for fp32 master, fp32 gradient, bf16 compute, AdamW;
    32 with ``cast_on="device"`` (the copy-in's DMA then reads the 4-byte master instead of the
    2-byte mirror: link bytes, counted with the link's, see :func:`copy_in_bytes_per_param`).
    With ``clipping`` the clip's scaling reads and writes the gradient once more (8 bytes).

    Example::

        >>> host_step_bytes_per_param(profile), host_step_bytes_per_param(profile, cast_on="device")
        (38, 32)
        >>> host_step_bytes_per_param(profile, clipping=True)
        46
    """
    scaling = 2 * profile.grad_bytes if clipping else 0
    return _adamw_bytes(profile) + host_cast_bytes_per_param(profile, cast_on) + profile.grad_bytes + scaling


def clip_scaling_seconds_per_param(profile: TrainingProfile, host_seconds_per_param: float) -> float:
    """The clip's scaling pass over one host gradient (it reads and writes it once before the
    group's step: Note: [Exact clipping at full overlap] in docs/design.md), priced at the rate of
    the host step ``host_seconds_per_param`` moves its bytes: both are bound by host DRAM.

    Example::

        >>> round(clip_scaling_seconds_per_param(profile, 0.28e-9) * 1e9, 3)  # 8 of AdamW's 28 bytes
        0.08
    """
    return host_seconds_per_param * 2 * profile.grad_bytes / _adamw_bytes(profile)


def copy_in_bytes_per_param(profile: TrainingProfile, cast_on: str = "host") -> int:
    """Bytes one offloaded parameter moves over the link per copy-in (forward, backward re-gather):
    the compute dtype's with ``cast_on="host"`` (the host's mirror), the master's with ``"device"``
    (cast on the GPU as it lands).

    Example::

        >>> copy_in_bytes_per_param(profile), copy_in_bytes_per_param(profile, cast_on="device")
        (2, 4)
    """
    return profile.param_bytes if cast_on == "device" else profile.compute_bytes


def host_step_seconds_per_param(profile: TrainingProfile, cast_on: str = "host") -> tuple[float | None, float | None]:
    """The measured host step per host-stepped parameter, ``(alone, link busy)``, as the step model
    uses it for ``cast_on``: ``profile.host_alone_s_per_param`` and ``profile.host_step_s_per_param``
    (AdamW plus the compute-dtype cast), less the cast's part with ``cast_on="device"``.

    The cast's part is ``profile.host_alone_cast_s_per_param`` /
    ``host_link_busy_cast_s_per_param`` where known (measured, or the platform profile's); else
    (profiles and JSON without the cast's figures) the cast's share of the host step's bytes (6 of
    34 for fp32 AdamW with a bf16 mirror), which understates it: the cast's share of the step's
    time is larger than its share of the bytes (see docs/planner.md, "Calibration").

    Returns:
        tuple: seconds per parameter alone and with the link busy, each None where not measured.

    Example::

        >>> host_step_seconds_per_param(dataclasses.replace(profile, host_alone_s_per_param=0.31e-9,
        ...     host_step_s_per_param=0.59e-9, host_alone_cast_s_per_param=0.08e-9,
        ...     host_link_busy_cast_s_per_param=0.22e-9), cast_on="device")  # (0.23e-9, 0.37e-9)
    """
    alone, busy = profile.host_alone_s_per_param, profile.host_step_s_per_param
    cast_bytes = host_cast_bytes_per_param(profile, "host")
    if cast_on == "host" or not cast_bytes:
        return alone, busy
    share = cast_bytes / (_adamw_bytes(profile) + cast_bytes)

    def without_cast(rate: float | None, cast: float | None) -> float | None:
        if rate is None:
            return None
        return max(0.0, rate - (rate * share if cast is None else cast))

    return (without_cast(alone, profile.host_alone_cast_s_per_param),
            without_cast(busy, profile.host_link_busy_cast_s_per_param))


def shared_dram_host_seconds(alone_s: float, busy_s: float, dma_s: float) -> float:
    """Host optimizer work that takes ``alone_s`` with nothing beside it and ``busy_s`` while the
    link copies both ways, when the link's DMA keeps host DRAM busy for ``dma_s`` meanwhile:
    every second of DMA beside the host step costs it ``1 - alone_s / busy_s`` seconds of work, up
    to the whole step running at the busy rate.

        alone_s + min(dma_s, busy_s) * (1 - alone_s / busy_s)

    A ``busy_s`` below ``alone_s`` (noise) counts as ``alone_s``.

    Example::

        >>> round(shared_dram_host_seconds(0.30, 0.50, 0.10), 3)  # 0.30 + 0.10 * 0.4
        0.34
    """
    busy_s = max(alone_s, busy_s)
    if busy_s <= 0:
        return alone_s
    return alone_s + min(dma_s, busy_s) * (1 - alone_s / busy_s)
