"""Alias of :mod:`torch_fsdp_offload.cpu_copy_stream` for code that imports it under this name
(``test/conftest.py`` and ``test/common_offload.py`` import :data:`misuses_detected` from here)."""

from torch_fsdp_offload.cpu_copy_stream import (
    ENV_CPU_ASYNC_COPIES,
    CpuAsyncCopies,
    cpu_async_copies,
    misuses_detected,
    parse_cpu_async_copies,
)

__all__ = [
    "ENV_CPU_ASYNC_COPIES",
    "CpuAsyncCopies",
    "cpu_async_copies",
    "misuses_detected",
    "parse_cpu_async_copies",
]
