"""Where an offloaded group's optimizer step and its compute-dtype cast run on a machine whose
parameters cross a link: derived from this machine's host-step and link rates, measured once per
process (see Note: [Placement from measured rates] in docs/design.md).

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

__all__ = ["LinkRates", "choose_placements", "measured_rates", "step_seconds_per_param"]

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
# Buffer of the link measurement: our copy chunk size (CoherentOffload's chunk_bytes default).
_MEASURED_CHUNK = 64 << 20


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


_measured: dict[str, LinkRates] = {}


def measured_rates(device: torch.device) -> LinkRates:
    """The rates of ``device``'s host and link, measured at the first call for it (about a
    second, with 1.5 GiB of host and 0.5 GiB of pinned memory held meanwhile), then cached for
    the process.

    Args:
        device (torch.device): a CUDA device.

    Returns:
        LinkRates: what :func:`choose_placements` decides from.

    Raises:
        ValueError: ``device`` is not a CUDA device.

    Example::

        >>> measured_rates(torch.device("cuda", 0)).describe()
        'host AdamW 0.46 s/Gparam, cast 0.17 s/Gparam, link 55/55 GB/s (both 100)'
    """
    if device.type != "cuda":
        raise ValueError(f"measured_rates needs a CUDA device, got {device}: there is no link to measure")
    key = str(torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device()))
    if key not in _measured:
        with torch.cuda.device(torch.device(key)):
            host = measure_host_step(1 << 24, repeats=2, link_busy=True)
        link = measure_bandwidth(key, sizes=(_MEASURED_CHUNK,), repeats=3)
        cast = host.link_busy_cast_s_per_param or 0.0
        _measured[key] = LinkRates(
            host.link_busy_s_per_param - cast, cast, link.h2d_gbps, link.d2h_gbps, link.bidirectional_gbps
        )
    return _measured[key]


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
