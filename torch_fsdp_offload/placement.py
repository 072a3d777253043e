"""Where an offloaded group's optimizer step and its compute-dtype cast should run on a machine whose
parameters cross a link, from this machine's host-step and link rates, measured when
:func:`measure_placement` is called and never otherwise (see Note: [Placement from measured rates]
in docs/design.md). ``CoherentOffload``'s ``auto`` is decided from the platform class alone.

Host steps and streamed steps run at once, each beside the link's copies, so per parameter a step
takes about the longer of the host's work, ``(1 - f) * (AdamW + cast if the host casts)``, and the
link's: the copy-ins (the compute dtype's bytes, or the master's when the device casts, twice a
step), the gradients down, and a streamed parameter's state up and back for the streamed share
``f``. The placements are those that make it shortest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_fsdp_offload.host_step import measure_host_step
from torch_fsdp_offload.platform.bandwidth import measure_bandwidth
from torch_fsdp_offload.platform.readers import resolve_device
from torch_fsdp_offload.transfer import DEFAULT_CHUNK_BYTES

__all__ = ["LinkRates", "PlacementAdvice", "choose_placements", "measure_placement", "step_seconds_per_param"]

# A streamed step moves its fp32 master, gradient and two Adam moments up, and the master and
# moments back (OffloadOptimizer's streamed steps); with the cast on the host, the compute-dtype
# mirror comes back too.
STREAMED_UP_BYTES = 16
STREAMED_DOWN_BYTES = 12
# fp32 master and a 16-bit compute dtype; gradients come down reduced in fp32.
MASTER_BYTES = 4
GRADIENT_BYTES = 4
COMPUTE_BYTES = 2
# Copy-ins of a group per step: forward, and the re-gather for backward.
COPY_INS_PER_STEP = 2


@dataclass(frozen=True)
class LinkRates:
    """This machine's rates that decide the placements, per parameter and per byte.

    The host rates are timed with the link copying both ways: in a training step the host steps
    run beside the DMA of streamed steps and copy-ins, which shares host DRAM with them.

    Attributes:
        adamw_s_per_param (float): fused host AdamW.
        cast_s_per_param (float): the host cast of the master into the compute-dtype mirror.
        h2d_GBps (float), d2h_GBps (float), both_GBps (float): the pinned link one way each, and
            both ways at once.
    """

    adamw_s_per_param: float
    cast_s_per_param: float
    h2d_GBps: float
    d2h_GBps: float
    both_GBps: float

    def describe(self) -> str:
        return (f"host AdamW {self.adamw_s_per_param * 1e9:.2f} s/Gparam, cast {self.cast_s_per_param * 1e9:.2f} s/Gparam, "
                f"link {self.h2d_GBps:.0f}/{self.d2h_GBps:.0f} GB/s (both {self.both_GBps:.0f})")


@dataclass(frozen=True)
class PlacementAdvice:
    """The placements :func:`measure_placement` advises for this machine, and the rates behind them.

    Attributes:
        optimizer (float): the share of the offloaded groups whose step to stream through the GPU,
            for ``CoherentOffload(optimizer=...)``.
        cast_on (str): ``"host"`` or ``"device"``, for ``CoherentOffload(cast_on=...)``.
        rates (LinkRates): what was measured.
    """

    optimizer: float
    cast_on: str
    rates: LinkRates

    def policy_kwargs(self) -> dict[str, float | str]:
        """The advice as ``CoherentOffload`` keyword arguments."""
        return {"optimizer": self.optimizer, "cast_on": self.cast_on}

    def describe(self) -> str:
        return f"optimizer={self.optimizer:.2f} streamed, cast on the {self.cast_on}, from {self.rates.describe()}"


def measure_placement(device: torch.device | str | int | None = None) -> PlacementAdvice:
    """Measure this machine's host step and link, and advise where ``CoherentOffload`` should place
    the optimizer step and the cast (:func:`choose_placements`).

    It times the fused host AdamW and the bf16 cast with the link busy both ways, as they run in a
    training step, and the pinned link: about a second, holding 1.5 GiB of host and 0.5 GiB of
    pinned memory meanwhile. Timings vary between runs and hosts, so call it once, on one rank,
    and pass the same advice to every rank's policy; nothing in the library calls it.

    Args:
        device (torch.device | str | int | None): the CUDA device whose link to measure; None for
            the current one.

    Returns:
        PlacementAdvice: the streamed share and cast placement, and the rates measured.

    Raises:
        ValueError: ``device`` is not a CUDA device (without a GPU there is no link to measure).

    Example::

        >>> advice = measure_placement("cuda:0")
        >>> advice.describe()
        'optimizer=0.45 streamed, cast on the device, from host AdamW 0.52 s/Gparam, ...'
        >>> policy = CoherentOffload(**advice.policy_kwargs())
    """
    device = resolve_device(device)
    if device.type != "cuda":
        raise ValueError(
            f"measure_placement needs a CUDA device, got {device}: there is no link to measure; "
            "CoherentOffload's 'auto' placements need no measurement"
        )
    with torch.cuda.device(device):
        host = measure_host_step(1 << 24, repeats=2, link_busy=True)
    link = measure_bandwidth(device, sizes=(DEFAULT_CHUNK_BYTES,), repeats=3)
    cast = host.link_busy_cast_s_per_param or 0.0
    rates = LinkRates(host.link_busy_s_per_param - cast, cast, link.h2d_gbps, link.d2h_gbps, link.bidirectional_gbps)
    cast_on, fraction = choose_placements(rates)
    return PlacementAdvice(fraction, cast_on, rates)


def step_seconds_per_param(rates: LinkRates, cast_on: str, fraction: float) -> float:
    """The longer of the host's and the link's work per parameter of a step that streams
    ``fraction`` of the offloaded parameters and casts on ``cast_on`` (the module docstring).

    Args:
        rates (LinkRates): the machine's rates.
        cast_on (str): ``"host"`` or ``"device"``.
        fraction (float): the streamed share, in [0, 1].

    Returns:
        float: seconds per parameter.

    Example::

        >>> step_seconds_per_param(LinkRates(0.46e-9, 0.17e-9, 55.0, 55.0, 100.0), "host", 0.5)
        3.15e-10
    """
    host_cast = cast_on == "host"
    host = (1 - fraction) * (rates.adamw_s_per_param + (rates.cast_s_per_param if host_cast else 0.0))
    h2d = COPY_INS_PER_STEP * (COMPUTE_BYTES if host_cast else MASTER_BYTES) + fraction * STREAMED_UP_BYTES
    d2h = GRADIENT_BYTES + fraction * (STREAMED_DOWN_BYTES + (COMPUTE_BYTES if host_cast else 0))
    link = max(h2d / rates.h2d_GBps, d2h / rates.d2h_GBps, (h2d + d2h) / rates.both_GBps) / 1e9
    return max(host, link)


def choose_placements(rates: LinkRates, cast_on: str = "auto", fraction: float | None = None) -> tuple[str, float]:
    """The cast placement and streamed share (to 0.05) whose step takes the least host and link
    time per parameter (:func:`step_seconds_per_param`); a given one is kept, the other chosen for
    it. Within 3% the device cast wins: it keeps no compute-dtype mirror in host memory.

    Args:
        rates (LinkRates): the machine's rates.
        cast_on (str): ``"auto"``, or the ``"host"`` / ``"device"`` to keep.
        fraction (float | None): None to choose, or the streamed share to keep.

    Returns:
        tuple[str, float]: the cast placement and the streamed share.

    Example::

        >>> choose_placements(LinkRates(0.52e-9, 0.28e-9, 54.0, 54.0, 97.0))
        ('device', 0.45)
    """
    casts = ("device", "host") if cast_on == "auto" else (cast_on,)
    fractions = [step / 20 for step in range(21)] if fraction is None else [fraction]
    # (seconds, fraction) of each cast's best share; the lowest share among equals.
    best = {cast: min((step_seconds_per_param(rates, cast, f), f) for f in fractions) for cast in casts}
    fastest = min(seconds for seconds, _ in best.values())
    cast = "device" if "device" in best and best["device"][0] <= 1.03 * fastest else min(best, key=best.get)
    return cast, best[cast][1]
