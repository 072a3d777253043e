"""Shared test scaffolding: multi-process gloo test cases that exit cleanly on torch 2.13 CPU.

Multi-process gloo runs on torch 2.13 CPU can abort with SIGABRT at interpreter exit after the test
passed (see fsdp-internals.md, section 3). Each worker therefore ends with ``os._exit`` once the test
method and ``destroy_process_group`` have run, carrying the exit code MultiProcessTestCase expects.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import FILE_SCHEMA


class GlooMultiProcessTestCase(MultiProcessTestCase):
    """A MultiProcessTestCase on the CPU with gloo; subclasses set ``WORLD_SIZE``."""

    WORLD_SIZE = 2

    @property
    def world_size(self) -> int:
        return self.WORLD_SIZE

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe, **kwargs) -> None:
        exit_code = 0
        try:
            super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
        except SystemExit as exc:
            exit_code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        # Skip interpreter teardown: gloo's threads can abort it on torch 2.13 CPU.
        os._exit(exit_code)

    def init_gloo(self) -> None:
        """Join this rank's gloo process group (call first in each test method)."""
        torch.manual_seed(0)
        dist.init_process_group(
            "gloo",
            init_method=f"{FILE_SCHEMA}{self.file_name}",
            rank=self.rank,
            world_size=self.world_size,
        )
