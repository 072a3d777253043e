"""``python -m torch_fsdp_offload platform``: report this machine's CPU-GPU memory platform.

Prints the class, why it was chosen, every attribute read (known or unknown) and the capacities;
``--bandwidth`` adds the measured link table and the GPU-DRAM : link ratio; ``--attributes FILE``
classifies a given attribute set (another machine's) instead of this one; ``--json`` prints one
JSON object whose ``kind`` field is the class.
"""

from __future__ import annotations

import argparse
import json
import sys

from torch_fsdp_offload.platform import (
    CUDA_DEVICE_ATTRIBUTES,
    BandwidthReport,
    Platform,
    PlatformKind,
    detect_platform,
    platform_from_attributes,
)

_CUDA_ATTRIBUTE_PREFIX = "cudaDevAttr"
_GiB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``platform`` sub-command's flags to ``parser``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object (its 'kind' is the class)")
    parser.add_argument(
        "--bandwidth",
        action="store_true",
        help="also measure the CPU-GPU link and GPU DRAM (a few seconds) and print the "
        "GPU-DRAM : link ratio with its meaning",
    )
    parser.add_argument(
        "--attributes",
        metavar="FILE.json",
        help="classify the attribute set in FILE (a JSON object of name -> int or null, or this "
        "command's --json output) instead of this machine",
    )
    parser.add_argument("--device", help="the CUDA device to inspect (cuda:N, N or cpu); default: current")
    parser.add_argument(
        "--kind",
        choices=[kind.value for kind in PlatformKind] + ["auto"],
        help="force the class, as TORCH_FSDP_OFFLOAD_PLATFORM does (this flag wins)",
    )


def load_attributes(path: str) -> dict[str, int | None]:
    """Read an attribute set from a JSON file for :func:`~torch_fsdp_offload.platform.classify`.

    The file holds a JSON object of attribute name to int or null (unknown), or an object with
    such a mapping under ``"attributes"`` (the ``--json`` output of this command). Names may carry
    the ``cudaDevAttr`` prefix; booleans count as 0/1.

    Args:
        path: the JSON file.

    Returns:
        dict: attribute name (without prefix) to value.

    Raises:
        ValueError: if the file cannot be read or parsed, or holds a value that is not an int,
            bool or null.

    Example::

        >>> load_attributes("gh200.json")["PageableMemoryAccessUsesHostPageTables"]
        1
    """
    try:
        with open(path, encoding="utf-8") as attribute_file:
            content = json.load(attribute_file)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read attributes from {path}: {exc}") from exc
    if isinstance(content, dict) and isinstance(content.get("attributes"), dict):
        content = content["attributes"]
    if not isinstance(content, dict):
        raise ValueError(
            f"{path} must hold a JSON object of attribute name -> int or null, e.g. "
            '{"Integrated": 0, "PageableMemoryAccessUsesHostPageTables": 1}'
        )
    attributes: dict[str, int | None] = {}
    for name, value in content.items():
        if value is not None and not isinstance(value, int):  # bool is an int
            raise ValueError(
                f"{path}: attribute {name!r} is {value!r}; values must be integers, or null for unknown"
            )
        key = name.removeprefix(_CUDA_ATTRIBUTE_PREFIX)
        attributes[key] = None if value is None else int(value)
    return attributes


def _format_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "unknown"
    if nbytes < _GiB:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / _GiB:.1f} GiB"


def _format_chunk(nbytes: int) -> str:
    if nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    if nbytes % (1 << 10) == 0:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} B"


def _attribute_label(name: str) -> str:
    attribute_id = CUDA_DEVICE_ATTRIBUTES.get(name)
    return name if attribute_id is None else f"{name} ({attribute_id})"


def _attributes_origin(platform: Platform) -> str:
    if platform.attribute_reader is not None:
        return f"read with {platform.attribute_reader}"
    if set(platform.attributes) <= {"DeviceCount"}:
        return "no GPU to read"
    return "no reader worked: neither cuda.bindings nor libcuda.so.1 could be used"


def format_report(
    platform: Platform, *, attributes_origin: str | None = None, this_machine: bool = True
) -> str:
    """The human-readable report of ``platform``: class, why, attributes, capacities.

    Args:
        platform: what :func:`~torch_fsdp_offload.platform.detect_platform` (or
            ``platform_from_attributes``) returned.
        attributes_origin: where the attributes came from, when not read from this machine.
        this_machine: False when ``platform`` describes another machine: capacities are skipped.

    Returns:
        str: the report, lines joined by newlines.

    Example::

        >>> print(format_report(detect_platform()))
    """
    device = str(platform.device)
    if platform.device_name:
        device += f" ({platform.device_name})"
    known = sum(value is not None for value in platform.attributes.values())
    lines = [
        f"platform: {platform.kind.value}",
        f"device: {device}",
        f"why: {platform.reason}",
        f"source: {platform.source}",
        f"what the library does: {platform.strategy}",
        f"derived: copies_needed={platform.copies_needed}, "
        f"supports_managed_memory={platform.supports_managed_memory}, "
        f"preferred_memory={platform.preferred_memory}",
        "",
        f"attributes ({attributes_origin or _attributes_origin(platform)}; "
        f"{known} of {len(platform.attributes)} known):",
    ]
    width = max((len(_attribute_label(name)) for name in platform.attributes), default=0)
    for name, value in platform.attributes.items():
        shown = "unknown" if value is None else str(value)
        lines.append(f"  {_attribute_label(name):<{width}}  {shown:>7}")
    lines.append("")
    if not this_machine:
        lines.append("capacities: not read (the attributes describe another machine)")
        return "\n".join(lines)
    if platform.gpu_total_bytes is None and not platform.has_accelerator:
        gpu_memory = "none (no accelerator)"
    else:
        gpu_memory = (
            f"{_format_bytes(platform.gpu_total_bytes)} total, "
            f"{_format_bytes(platform.gpu_free_bytes)} free"
        )
    locked = platform.locked_memory_limit_bytes
    lines += [
        "capacities:",
        f"  GPU memory           {gpu_memory}",
        f"  host MemAvailable    {_format_bytes(platform.host_available_bytes)}",
        f"  locked-memory limit  {'unlimited' if locked is None else _format_bytes(locked)} (ulimit -l)",
    ]
    return "\n".join(lines)


def format_bandwidth(report: BandwidthReport) -> str:
    """The measured bandwidth table, the GPU-DRAM : link ratio and what it means.

    Args:
        report: what :func:`~torch_fsdp_offload.platform.measure_bandwidth` returned.

    Returns:
        str: the table, lines joined by newlines.

    Example::

        >>> print(format_bandwidth(measure_bandwidth()))
    """
    columns = ("H2D pinned", "D2H pinned", "both pinned", "H2D pageable", "D2H pageable")
    lines = [
        f"bandwidth on {report.device} ({report.device_name}), GB/s = 1e9 bytes/s, median of "
        f"{report.repeats} passes over {_format_chunk(report.buffer_bytes)} in chunks of:",
        "  " + f"{'chunk':<8}" + "".join(f"{column:>14}" for column in columns),
    ]
    for row in report.rows:
        values = (
            row.h2d_pinned_gbps,
            row.d2h_pinned_gbps,
            row.bidirectional_pinned_gbps,
            row.h2d_pageable_gbps,
            row.d2h_pageable_gbps,
        )
        lines.append("  " + f"{_format_chunk(row.chunk_bytes):<8}" + "".join(f"{v:>14.1f}" for v in values))
    lines += [
        "  ('both pinned' counts the bytes of both ways, copied at once on two streams)",
        f"GPU device-to-device copy: {report.device_copy_gbps:.1f} GB/s (read + write)",
        f"link, best one-way pinned: {report.link_gbps:.1f} GB/s "
        f"(H2D {report.h2d_gbps:.1f}, D2H {report.d2h_gbps:.1f}, both at once {report.bidirectional_gbps:.1f})",
        f"GPU-DRAM : link ratio: {report.dram_to_link_ratio:.0f} -> {report.ratio_meaning}",
    ]
    return "\n".join(lines)


def _parse_device(device: str | None) -> str | int | None:
    if device is not None and device.isdigit():
        return int(device)
    return device


def run(args: argparse.Namespace) -> int:
    """Run the ``platform`` sub-command; returns the exit status (2 on bad input)."""
    try:
        if args.attributes is not None:
            if args.bandwidth:
                raise ValueError(
                    "--bandwidth measures this machine; it cannot be combined with --attributes"
                )
            attributes = load_attributes(args.attributes)
            try:
                platform = platform_from_attributes(attributes, kind=args.kind)
            except ValueError as exc:
                raise ValueError(f"{args.attributes}: {exc}") from exc
            origin: str | None = f"from {args.attributes}"
        else:
            platform = detect_platform(
                _parse_device(args.device), kind=args.kind, bandwidth=args.bandwidth
            )
            origin = None
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(platform.to_dict(), indent=2))
        return 0
    print(format_report(platform, attributes_origin=origin, this_machine=origin is None))
    if args.bandwidth:
        print()
        if platform.bandwidth is not None:
            print(format_bandwidth(platform.bandwidth))
        else:
            print(
                f"bandwidth: not measured: no accelerator on device {platform.device}, so there is "
                "no CPU-GPU link to measure"
            )
    return 0
