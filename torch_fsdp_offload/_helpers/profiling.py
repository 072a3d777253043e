"""The profiler option that records every thread: torch's private ``_ExperimentalConfig``."""

from __future__ import annotations

import torch


def all_threads_config():
    """An experimental config that records ``record_function`` ranges on every thread (the host
    optimizer's workers, not only the thread that started the profiler), or None where this torch
    build does not offer it."""
    config_type = getattr(torch.profiler, "_ExperimentalConfig", None)
    if config_type is None:
        return None
    try:
        return config_type(profile_all_threads=True)
    except TypeError:
        return None
