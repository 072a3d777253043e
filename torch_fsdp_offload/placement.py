"""Where an offloaded group's optimizer step and its compute-dtype cast run on a machine whose
parameters cross a link: derived from this machine's host-step and link rates, measured once per
process (see Note: [Placement from measured rates] in docs/design.md).

- **Optimizer.** Host steps and streamed steps run at once, so a step of P parameters takes about
  ``max((1 - f) * P * host, f * P * stream)`` with ``f`` the streamed share: shortest where the two
  are equal, ``f = host / (host + stream)``. ``host`` is the fused host AdamW (plus the cast when
  the host casts) per parameter; ``stream`` the link time of a streamed parameter's bytes.
- **Cast.** Casting on the host costs host time per parameter after every step (and a pinned
  compute-dtype mirror); casting on the device costs the difference between the master's and the
  compute dtype's bytes on every copy-in. The cheaper per parameter wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_fsdp_offload.host_step import measure_host_step
from torch_fsdp_offload.platform_bandwidth import measure_bandwidth

__all__ = ["LinkRates", "cast_placement", "measured_rates", "streamed_fraction"]

# A streamed step moves its fp32 master, gradient and two Adam moments up, and the master and
# moments back (OffloadOptimizer's streamed steps); with the cast on the host, the compute-dtype
# mirror comes back too.
STREAMED_UP_BYTES = 16
STREAMED_DOWN_BYTES = 12
# fp32 master and a 16-bit compute dtype.
MASTER_BYTES = 4
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
        LinkRates: what :func:`streamed_fraction` and :func:`cast_placement` decide from.

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


def streamed_fraction(rates: LinkRates, cast_on: str) -> float:
    """The share of the offloaded groups to stream through the GPU: where host and streamed steps
    take as long (the module docstring), to 0.05.

    Args:
        rates (LinkRates): the machine's rates.
        cast_on (str): ``"host"`` or ``"device"``: where the cast runs, which the host step and a
            streamed step's bytes down include or not.

    Returns:
        float: in [0, 1].

    Example::

        >>> streamed_fraction(LinkRates(0.46e-9, 0.17e-9, 55.0, 55.0, 100.0), "device")
        0.6
    """
    host = rates.adamw_s_per_param + (rates.cast_s_per_param if cast_on == "host" else 0.0)
    down = STREAMED_DOWN_BYTES + (COMPUTE_BYTES if cast_on == "host" else 0)
    stream = max(STREAMED_UP_BYTES / rates.h2d_GBps, down / rates.d2h_GBps, (STREAMED_UP_BYTES + down) / rates.both_GBps) / 1e9
    return round(round(host / (host + stream) / 0.05) * 0.05, 2)


def cast_placement(rates: LinkRates) -> str:
    """Where to cast the master to the compute dtype: ``"device"`` where the extra bytes of
    copying the master in cost less link time than the host cast costs host time, else ``"host"``.

    Args:
        rates (LinkRates): the machine's rates.

    Returns:
        str: ``"host"`` or ``"device"``.

    Example::

        >>> cast_placement(LinkRates(0.46e-9, 0.17e-9, 55.0, 55.0, 100.0))
        'device'
    """
    extra_link_s = COPY_INS_PER_STEP * (MASTER_BYTES - COMPUTE_BYTES) / rates.h2d_GBps / 1e9
    return "device" if extra_link_s < rates.cast_s_per_param else "host"
