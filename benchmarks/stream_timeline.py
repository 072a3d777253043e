"""Draw one lane per CUDA stream and per host-optimizer CPU thread from a chrome trace.

The trace is a ``torch.profiler`` chrome trace of one training step, e.g. from
``python -m torch_fsdp_offload.train --profile DIR`` or ``benchmarks/fsdp_offload.py --profile DIR``.
Events are coloured by kind: compute kernels, H2D copies, D2H copies, host optimizer steps
(``torch_fsdp_offload.timeline``). The events per lane and kind are printed.

Usage:
    python benchmarks/stream_timeline.py TRACE.json --out timeline.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_fsdp_offload.timeline import draw_timeline, KINDS, lane_counts, load_trace, timeline_lanes  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="chrome trace JSON written by torch.profiler")
    parser.add_argument("--out", default=None, help="PNG to write (default: the trace's name with .png)")
    args = parser.parse_args(argv)
    lanes = timeline_lanes(load_trace(args.trace))
    if not lanes:
        print(f"{args.trace}: no CUDA kernels, copies or host optimizer events", file=sys.stderr)
        return 2
    print(f"{'lane':28s} " + " ".join(f"{kind:>14s}" for kind in KINDS))
    for lane, counts in lane_counts(lanes).items():
        print(f"{lane:28s} " + " ".join(f"{counts[kind]:14d}" for kind in KINDS))
    out = args.out or os.path.splitext(args.trace)[0].removesuffix(".trace") + ".png"
    draw_timeline(lanes, out, title=os.path.basename(args.trace))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
