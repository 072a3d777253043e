"""Analytic scenarios: the planner's input for a machine or model we cannot measure here.

A scenario is a JSON object holding what the talk's decision framework needs: the GPU memory
breakdown, the iteration time, how the iteration time grows with the micro-batch, and the two
bandwidths (GPU DRAM and CPU-GPU link). ``docs/planner.md`` documents every key; the worked
example of the talk is ``docs/examples/talk_gh200.json``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch_fsdp_offload.planner.profiles import PLATFORM_PROFILES, PlatformProfile, get_profile

__all__ = ["Checkpointing", "Scenario", "ScenarioError", "load_scenario"]

_MEMORY_KEYS = ("weights", "grads", "optimizer_state", "activations", "other", "unused", "capacity")
_TOP_KEYS = (
    "name",
    "note",
    "platform",
    "memory_GB",
    "activations_to_dram_GB",
    "iteration_time_s",
    "microbatch_scaling",
    "bandwidth_GBps",
    "model_dram_GBps",
    "checkpointing",
    "crossings_per_iteration",
    "n_blocks",
)
_REQUIRED = ("memory_GB", "iteration_time_s", "microbatch_scaling")
_CROSSING_KEYS = ("weights", "grads", "optimizer_state", "activations")
# How many times each offloaded byte crosses the link per iteration: a weight comes in and goes
# back out (the talk's "in and out"), a gradient only goes down, optimizer state is streamed up
# and back, a saved activation goes down in forward and up in backward.
_DEFAULT_CROSSINGS = {"weights": 2.0, "grads": 1.0, "optimizer_state": 2.0, "activations": 2.0}


class ScenarioError(ValueError):
    """A scenario (JSON file or dict) is malformed; the message names the key and the fix."""


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing as the scenario models it.

    Attributes:
        recompute_time_fraction (float): extra iteration time spent recomputing, as a fraction of
            the iteration time (a full forward in a forward+backward step is about 1/3).
        activation_memory_fraction (float): fraction of the activation memory still held.
    """

    recompute_time_fraction: float
    activation_memory_fraction: float


@dataclass(frozen=True)
class Scenario:
    """Validated planner input; build it with :func:`load_scenario`.

    Attributes:
        name (str): label used in reports.
        weights_GB, grads_GB, optimizer_state_GB, activations_GB, other_GB (float): GPU memory
            breakdown at micro-batch factor 1 (1 GB = 1e9 bytes).
        capacity_GB (float): GPU memory capacity.
        activations_to_dram_GB (float): the part of the activations that reaches GPU DRAM rather
            than staying in L2 (defaults to all of them).
        iteration_time_s (float): measured time of one iteration at micro-batch factor 1.
        microbatch_scaling (tuple): ``(factor, time_factor)`` pairs, factor 1 first: the iteration
            takes ``time_factor`` times longer at ``factor`` times the micro-batch.
        gpu_dram_GBps (float): peak GPU DRAM bandwidth.
        link_GBps (float): CPU-GPU link bandwidth all offload traffic is budgeted against.
        model_dram_GBps (float | None): the model's own DRAM bandwidth if measured (else estimated).
        host_GBps (float | None): host optimizer bandwidth (``bandwidth_GBps.host``; default: the
            platform profile's, 113 GB/s on h200-pcie, measured in CoherentOffload's host step).
        checkpointing (Checkpointing | None): activation checkpointing figures, if known.
        crossings (dict): link crossings per offloaded byte and iteration, per memory kind.
        n_blocks (int | None): number of offloadable blocks (fractions are rounded to whole blocks).
        platform (PlatformProfile | None): the profile named by the scenario, if any.
        note (str): free text carried into reports.
    """

    name: str
    weights_GB: float
    grads_GB: float
    optimizer_state_GB: float
    activations_GB: float
    other_GB: float
    capacity_GB: float
    activations_to_dram_GB: float
    iteration_time_s: float
    microbatch_scaling: tuple[tuple[float, float], ...]
    gpu_dram_GBps: float
    link_GBps: float
    model_dram_GBps: float | None = None
    host_GBps: float | None = None
    checkpointing: Checkpointing | None = None
    crossings: Mapping[str, float] = field(default_factory=lambda: dict(_DEFAULT_CROSSINGS))
    n_blocks: int | None = None
    platform: PlatformProfile | None = None
    note: str = ""

    @property
    def kind(self) -> str:
        """The platform class (``"unified"``, ``"coherent"``, ``"discrete"``); ``"unknown"`` without a profile."""
        return self.platform.kind if self.platform is not None else "unknown"

    @property
    def unused_GB(self) -> float:
        return self.capacity_GB - self.resident_GB

    @property
    def resident_GB(self) -> float:
        return (
            self.weights_GB + self.grads_GB + self.optimizer_state_GB + self.activations_GB + self.other_GB
        )

    def to_dict(self) -> dict[str, Any]:
        """The scenario as JSON-ready data (``load_scenario(s.to_dict())`` gives it back)."""
        data: dict[str, Any] = {
            "name": self.name,
            "memory_GB": {
                "weights": self.weights_GB,
                "grads": self.grads_GB,
                "optimizer_state": self.optimizer_state_GB,
                "activations": self.activations_GB,
                "other": self.other_GB,
                "capacity": self.capacity_GB,
            },
            "activations_to_dram_GB": self.activations_to_dram_GB,
            "iteration_time_s": self.iteration_time_s,
            "microbatch_scaling": [list(point) for point in self.microbatch_scaling],
            "bandwidth_GBps": {"gpu_dram": self.gpu_dram_GBps, "link": self.link_GBps}
            | ({"host": self.host_GBps} if self.host_GBps is not None else {}),
            "crossings_per_iteration": dict(self.crossings),
        }
        if self.platform is not None and self.platform.name in PLATFORM_PROFILES:
            data["platform"] = self.platform.name
        if self.model_dram_GBps is not None:
            data["model_dram_GBps"] = self.model_dram_GBps
        if self.checkpointing is not None:
            data["checkpointing"] = {
                "recompute_time_fraction": self.checkpointing.recompute_time_fraction,
                "activation_memory_fraction": self.checkpointing.activation_memory_fraction,
            }
        if self.n_blocks is not None:
            data["n_blocks"] = self.n_blocks
        if self.note:
            data["note"] = self.note
        return data


def load_scenario(source: str | os.PathLike | Mapping[str, Any]) -> Scenario:
    """Read and validate a scenario.

    Args:
        source: a path to a JSON file, or the already-parsed mapping.

    Returns:
        Scenario: validated, with defaults filled in (bandwidths from the named ``platform``
        profile where the scenario gives none).

    Raises:
        ScenarioError: unreadable file, missing or unknown key, a value that is not a number, a
            negative amount, a fraction outside [0, 1], or an inconsistent breakdown. The message
            names the key and how to fix it.

    Example::

        >>> scenario = load_scenario("docs/examples/talk_gh200.json")
        >>> scenario.weights_GB
        72.0
    """
    if isinstance(source, Mapping):
        data, where = source, "scenario"
    else:
        where = f"scenario {os.fspath(source)!r}"
        try:
            with open(source, encoding="utf-8") as handle:
                data = json.load(handle)
        except OSError as exc:
            raise ScenarioError(f"{where}: cannot read it ({exc.strerror})") from exc
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{where}: expected a JSON object at the top level, got {type(data).__name__}")
    _check_keys(data, _TOP_KEYS, where)
    for key in _REQUIRED:
        if key not in data:
            raise ScenarioError(f"{where}: missing required key {key!r} ({_HELP[key]})")

    profile = None
    if "platform" in data:
        try:
            profile = get_profile(data["platform"])
        except ValueError as exc:
            raise ScenarioError(f"{where}: {exc}") from None

    memory = data["memory_GB"]
    if not isinstance(memory, Mapping):
        raise ScenarioError(f"{where}: 'memory_GB' must be an object like {{\"weights\": 72, \"activations\": 21}}")
    _check_keys(memory, _MEMORY_KEYS, f"{where}: memory_GB")
    for key in ("weights", "activations"):
        if key not in memory:
            raise ScenarioError(f"{where}: missing required key 'memory_GB.{key}' (GB on the GPU)")
    amounts = {key: _number(memory, key, f"{where}: memory_GB", minimum=0.0) for key in memory}
    resident = sum(amounts.get(k, 0.0) for k in ("weights", "grads", "optimizer_state", "activations", "other"))
    if "capacity" in amounts and "unused" in amounts:
        raise ScenarioError(
            f"{where}: give either memory_GB.capacity or memory_GB.unused, not both "
            "(unused = capacity - everything else)"
        )
    if "capacity" in amounts:
        capacity = amounts["capacity"]
    elif "unused" in amounts:
        capacity = resident + amounts["unused"]
    elif profile is not None:
        capacity = profile.gpu_memory_GB
    else:
        raise ScenarioError(
            f"{where}: cannot tell the GPU capacity; add memory_GB.unused or memory_GB.capacity, "
            "or name a 'platform' profile"
        )
    if resident > capacity * (1 + 1e-9):
        raise ScenarioError(
            f"{where}: the breakdown ({resident:g} GB) exceeds the GPU capacity ({capacity:g} GB); "
            "fix memory_GB (the breakdown is the run that fits today)"
        )

    activations = amounts["activations"]
    to_dram = _number(data, "activations_to_dram_GB", where, minimum=0.0) if "activations_to_dram_GB" in data else activations
    if to_dram > activations:
        raise ScenarioError(
            f"{where}: activations_to_dram_GB ({to_dram:g}) exceeds memory_GB.activations "
            f"({activations:g}); it is the part of the activations that reaches DRAM"
        )

    iteration_time = _number(data, "iteration_time_s", where, minimum=0.0, strict=True)
    scaling = _scaling(data["microbatch_scaling"], where)

    bandwidth = data.get("bandwidth_GBps", {})
    if not isinstance(bandwidth, Mapping):
        raise ScenarioError(f"{where}: 'bandwidth_GBps' must be an object like {{\"gpu_dram\": 4000, \"link\": 450}}")
    _check_keys(bandwidth, ("gpu_dram", "link", "host"), f"{where}: bandwidth_GBps")
    resolved_bandwidth = {}
    for key, profile_field in (("gpu_dram", "gpu_dram_GBps"), ("link", "link_GBps")):
        if key in bandwidth:
            resolved_bandwidth[key] = _number(bandwidth, key, f"{where}: bandwidth_GBps", minimum=0.0, strict=True)
        elif profile is not None:
            resolved_bandwidth[key] = getattr(profile, profile_field)
        else:
            raise ScenarioError(
                f"{where}: missing 'bandwidth_GBps.{key}' (GB/s); give it or name a 'platform' profile "
                "that provides it"
            )

    host = profile.host_GBps if profile is not None else None
    if "host" in bandwidth:
        host = _number(bandwidth, "host", f"{where}: bandwidth_GBps", minimum=0.0, strict=True)

    model_dram = None
    if "model_dram_GBps" in data:
        model_dram = _number(data, "model_dram_GBps", where, minimum=0.0, strict=True)

    checkpointing = None
    if "checkpointing" in data:
        block = data["checkpointing"]
        if not isinstance(block, Mapping):
            raise ScenarioError(f"{where}: 'checkpointing' must be an object")
        context = f"{where}: checkpointing"
        _check_keys(block, ("recompute_time_fraction", "activation_memory_fraction", "note"), context)
        for key in ("recompute_time_fraction", "activation_memory_fraction"):
            if key not in block:
                raise ScenarioError(f"{context}: missing required key {key!r} (a fraction in [0, 1])")
        checkpointing = Checkpointing(
            recompute_time_fraction=_fraction(block, "recompute_time_fraction", context),
            activation_memory_fraction=_fraction(block, "activation_memory_fraction", context),
        )

    crossings = dict(_DEFAULT_CROSSINGS)
    if "crossings_per_iteration" in data:
        block = data["crossings_per_iteration"]
        if not isinstance(block, Mapping):
            raise ScenarioError(f"{where}: 'crossings_per_iteration' must be an object")
        _check_keys(block, _CROSSING_KEYS, f"{where}: crossings_per_iteration")
        for key in block:
            crossings[key] = _number(block, key, f"{where}: crossings_per_iteration", minimum=0.0)

    n_blocks = None
    if "n_blocks" in data:
        n_blocks = data["n_blocks"]
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
            raise ScenarioError(f"{where}: 'n_blocks' must be a positive integer, got {n_blocks!r}")

    name = data.get("name", "scenario" if isinstance(source, Mapping) else os.path.basename(os.fspath(source)))
    return Scenario(
        name=str(name),
        weights_GB=amounts["weights"],
        grads_GB=amounts.get("grads", 0.0),
        optimizer_state_GB=amounts.get("optimizer_state", 0.0),
        activations_GB=activations,
        other_GB=amounts.get("other", 0.0),
        capacity_GB=capacity,
        activations_to_dram_GB=to_dram,
        iteration_time_s=iteration_time,
        microbatch_scaling=scaling,
        gpu_dram_GBps=resolved_bandwidth["gpu_dram"],
        link_GBps=resolved_bandwidth["link"],
        model_dram_GBps=model_dram,
        host_GBps=host,
        checkpointing=checkpointing,
        crossings=crossings,
        n_blocks=n_blocks,
        platform=profile,
        note=str(data.get("note", "")),
    )


_HELP = {
    "memory_GB": 'the GPU memory breakdown in GB, e.g. {"weights": 72, "activations": 21, "unused": 3}',
    "iteration_time_s": "the measured seconds per iteration at today's micro-batch, e.g. 0.1",
    "microbatch_scaling": "[[factor, time_factor], ...] measured on one block, e.g. [[1, 1.0], [4, 2.0]]",
}


def _check_keys(mapping: Mapping, allowed: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(allowed)}"
            raise ScenarioError(f"{where}: unknown key {key!r}{hint}")


def _number(mapping: Mapping, key: str, where: str, *, minimum: float, strict: bool = False) -> float:
    value = mapping[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScenarioError(f"{where}: {key!r} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ScenarioError(f"{where}: {key!r} must be {bound}, got {value!r}")
    return float(value)


def _fraction(mapping: Mapping, key: str, where: str) -> float:
    value = _number(mapping, key, where, minimum=0.0)
    if value > 1.0:
        raise ScenarioError(f"{where}: {key!r} is a fraction and must lie in [0, 1], got {value!r}")
    return value


def _scaling(points: Any, where: str) -> tuple[tuple[float, float], ...]:
    context = f"{where}: microbatch_scaling"
    if not isinstance(points, (list, tuple)) or not points:
        raise ScenarioError(f"{context} must be a non-empty list of [factor, time_factor] pairs")
    parsed = {}
    for index, point in enumerate(points):
        if not isinstance(point, (list, tuple)) or len(point) != 2:
            raise ScenarioError(f"{context}[{index}] must be a [factor, time_factor] pair, got {point!r}")
        pair = {"factor": point[0], "time_factor": point[1]}
        factor = _number(pair, "factor", f"{context}[{index}]", minimum=0.0, strict=True)
        time_factor = _number(pair, "time_factor", f"{context}[{index}]", minimum=0.0, strict=True)
        if factor < 1.0:
            raise ScenarioError(f"{context}[{index}]: factors are relative to today's micro-batch and must be >= 1, got {factor:g}")
        if factor in parsed:
            raise ScenarioError(f"{context}: factor {factor:g} appears twice")
        parsed[factor] = time_factor
    if parsed.setdefault(1.0, 1.0) != 1.0:
        raise ScenarioError(f"{context}: the time factor at factor 1 must be 1 (it is today's run), got {parsed[1.0]:g}")
    ordered = tuple(sorted(parsed.items()))
    for (f0, t0), (f1, t1) in zip(ordered, ordered[1:]):
        if t1 < t0:
            raise ScenarioError(
                f"{context}: time factor falls from {t0:g} at {f0:g}x to {t1:g} at {f1:g}x; "
                "a larger micro-batch cannot take less time"
            )
    return ordered
