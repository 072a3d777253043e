"""The host optimizer step measured on this machine: fused AdamW plus the compute-dtype cast, per
parameter, alone and while the CPU-GPU link copies both ways (the link's DMA shares host DRAM)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from torch_fsdp_offload.memory import pinned_empty

__all__ = [
    "HOST_BYTES_PER_LINK_BUSY_PARAM",
    "HostStepRates",
    "LinkBusy",
    "host_GBps_from_link_busy",
    "measure_host_step",
]

#: Host DRAM bytes per host-stepped parameter that, over the host step's time measured with the
#: link busy both ways (:func:`host_GBps_from_link_busy`), give the step model's host bandwidth.
#: It lies between the host step's own bytes (38) and those plus the DMA's while the step is
#: measured (about 90), because in a training step the link is busy for part of the host step
#: only; the value reproduces host-bound steps measured on an H200 (see docs/planner.md,
#: "Calibration").
HOST_BYTES_PER_LINK_BUSY_PARAM = 64.0


class LinkBusy:
    """Context manager: a thread copies pinned buffers host-to-device and device-to-host at once,
    back to back, until exit, as the copies of an offloaded training step do. It is entered once:
    its device buffers are given back to the device at exit.

    Args:
        nbytes (int): bytes of each direction's buffer.

    Attributes:
        gbps (float): after exit, what the thread moved (both directions) per second.

    Raises:
        RuntimeError: no CUDA device.

    Example::

        >>> with LinkBusy() as link:
        ...     optimizer.step()   # host work while the DMA takes its share of host DRAM
        >>> link.gbps
    """

    def __init__(self, nbytes: int = 256 << 20) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("LinkBusy copies over the CPU-GPU link and needs a CUDA device; none is available")
        self.source = pinned_empty((nbytes,), torch.uint8)
        self.destination = pinned_empty((nbytes,), torch.uint8)
        self.device_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.device_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stop = threading.Event()
        self.moved = 0
        self.gbps = 0.0

    def _copy_until_stopped(self) -> None:
        h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
        while not self.stop.is_set():
            with torch.cuda.stream(h2d):
                self.device_in.copy_(self.source, non_blocking=True)
            with torch.cuda.stream(d2h):
                self.destination.copy_(self.device_out, non_blocking=True)
            h2d.synchronize()
            d2h.synchronize()
            self.moved += 2 * self.source.numel()

    def __enter__(self) -> "LinkBusy":
        self.thread = threading.Thread(target=self._copy_until_stopped, daemon=True)
        self.started = time.perf_counter()
        self.thread.start()
        time.sleep(0.2)  # both directions running before the caller's work starts
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.gbps = self.moved / (time.perf_counter() - self.started) / 1e9
        # Its device buffers go back to the GPU rather than stay cached beside training's memory.
        del self.device_in, self.device_out
        torch.cuda.empty_cache()


def host_GBps_from_link_busy(seconds_per_param: float) -> float:
    """The step model's host DRAM bandwidth (``PlatformProfile.host_GBps``) from the host step's
    time per parameter measured while the link copies both ways (:class:`LinkBusy`).

    In a training step the host step shares host DRAM with the link's DMA only part of the time,
    and :func:`~torch_fsdp_offload.planner.step_time.predict_step` charges the DMA's bytes
    separately, so the model's bandwidth is :data:`HOST_BYTES_PER_LINK_BUSY_PARAM` over that time.

    Args:
        seconds_per_param (float): fused AdamW plus the compute-dtype cast, per parameter, with the
            link busy.

    Returns:
        float: GB/s.

    Raises:
        ValueError: ``seconds_per_param`` not positive.

    Example::

        >>> host_GBps_from_link_busy(0.57e-9)
        112.28...
    """
    if not seconds_per_param > 0:
        raise ValueError(f"seconds_per_param must be positive, got {seconds_per_param}")
    return HOST_BYTES_PER_LINK_BUSY_PARAM / seconds_per_param / 1e9


@dataclass(frozen=True)
class HostStepRates:
    """How fast the host optimizer step runs on this machine, per parameter (fused AdamW plus the
    cast of the master into the compute-dtype mirror), alone and beside the link's DMA.

    Attributes:
        alone_s_per_param (float): seconds per parameter with nothing else running.
        link_busy_s_per_param (float | None): the same while :class:`LinkBusy` copies both ways
            (None where there is no CUDA device).
        link_GBps_meanwhile (float | None): what the link moved meanwhile, both ways together.
        alone_cast_s_per_param (float | None): the cast's part of ``alone_s_per_param`` (the rest
            is the AdamW step; stock FSDP2 offload casts on the GPU and pays only that rest).
        link_busy_cast_s_per_param (float | None): the cast's part of ``link_busy_s_per_param``.
    """

    alone_s_per_param: float
    link_busy_s_per_param: float | None = None
    link_GBps_meanwhile: float | None = None
    alone_cast_s_per_param: float | None = None
    link_busy_cast_s_per_param: float | None = None


def measure_host_step(
    numel: int = 1 << 25, *, threads: int | None = None, repeats: int = 3, link_busy: bool | None = None
) -> HostStepRates:
    """Time CoherentOffload's host step on this machine, alone and (``link_busy``) beside the DMA.

    Steps ``numel`` fp32 parameters (512 MiB of parameter, gradient and moments by default) with
    fused AdamW, then casts the master into a bf16 mirror; the step and the cast each the fastest of
    ``repeats``. With ``link_busy`` (the default where CUDA is available) it times the same again
    while :class:`LinkBusy` copies both ways: host DRAM serves the DMA and the step at once, and how
    much the DMA slows the step differs between hosts and even between runs on one host, so it is
    measured rather than assumed.

    Args:
        numel (int): parameters to step; large enough that they do not fit in the CPU caches.
        threads (int | None): intra-op threads during the measurement (default: torch's count minus
            one when a GPU is present, as ``OffloadOptimizer`` leaves a core to the GPU's thread).
        repeats (int): timed steps after one warm-up step.
        link_busy (bool | None): also time it with the link copying both ways (default: where CUDA
            is available).

    Returns:
        HostStepRates: seconds per parameter alone and with the link busy (each with the cast's part
            on its own), and the link's rate then.

    Raises:
        ValueError: ``numel``, ``threads`` or ``repeats`` below 1, or ``link_busy=True`` without a
            CUDA device.

    Example::

        >>> measure_host_step()  # HostStepRates(alone_s_per_param=3.2e-10, link_busy_s_per_param=5.5e-10, ...)
    """
    if numel < 1 or repeats < 1 or (threads is not None and threads < 1):
        raise ValueError(f"numel, repeats and threads must be >= 1, got {numel}, {repeats}, {threads}")
    if link_busy is None:
        link_busy = torch.cuda.is_available()
    if link_busy and not torch.cuda.is_available():
        raise ValueError("link_busy=True copies over the CPU-GPU link and needs a CUDA device; pass link_busy=False")
    if threads is None:
        threads = max(1, torch.get_num_threads() - (1 if torch.cuda.is_available() else 0))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        param = torch.zeros(numel, requires_grad=True)
        param.grad = torch.full((numel,), 1e-3)
        mirror = torch.empty(numel, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)

        def fastest_step() -> tuple[float, float]:
            """Seconds per parameter of the step with its cast, and of the cast: each the fastest."""
            step_s, cast_s = float("inf"), float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                optimizer.step()
                stepped = time.perf_counter()
                with torch.no_grad():
                    mirror.copy_(param)
                step_s = min(step_s, stepped - start)
                cast_s = min(cast_s, time.perf_counter() - stepped)
            return (step_s + cast_s) / numel, cast_s / numel

        optimizer.step()  # the first step allocates the moments
        alone, alone_cast = fastest_step()
        if not link_busy:
            return HostStepRates(alone, alone_cast_s_per_param=alone_cast)
        with LinkBusy() as link:
            busy, busy_cast = fastest_step()
    finally:
        torch.set_num_threads(previous)
    return HostStepRates(alone, busy, link.gbps, alone_cast, busy_cast)
