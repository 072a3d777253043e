"""Rows measured in several rounds: the order of each round and one row from its rounds.

Used by ``benchmarks/activations.py`` and ``benchmarks/fsdp_offload.py`` (``--repeats N``). A row's
step time moves by a few percent from one build of it to the next on the GPU machine, as much as
two close rows differ; measuring every row N times, every other round in reverse order (so that a
drift over the run favours no row), gives each row a median and a spread (``step_s_rounds``), from
which ``planner_validate.py`` tells a measured ordering from a tie.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def round_order(rows: Sequence[str], round_index: int) -> list[str]:
    """The rows in the order round ``round_index`` (from 0) runs them: reversed every other round."""
    return list(rows) if round_index % 2 == 0 else list(rows)[::-1]


def median_of_rounds(rounds: list[dict], time_keys: Sequence[str], peak_keys: Sequence[str]) -> dict:
    """One row measured in several rounds: the median of its ``time_keys``, the highest of its
    ``peak_keys``, its step times as ``step_s_rounds``; the other keys from the last round."""
    row = dict(rounds[-1])
    if len(rounds) > 1:
        for key in time_keys:
            row[key] = statistics.median(measured[key] for measured in rounds)
        row["step_s_rounds"] = [measured["step_s"] for measured in rounds]
        for key in peak_keys:
            row[key] = max(measured[key] for measured in rounds)
    return row
