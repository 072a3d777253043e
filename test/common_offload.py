"""Shared test scaffolding: multi-process test cases (gloo on CPU, NCCL on GPUs) that exit cleanly.

Multi-process gloo runs on torch 2.13 CPU can abort with SIGABRT at interpreter exit after the test
passed: gloo's threads outlive the interpreter's teardown. Each worker therefore ends with ``os._exit`` once the test
method and ``destroy_process_group`` have run, carrying the exit code MultiProcessTestCase expects.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import FILE_SCHEMA, TestCase

from torch_fsdp_offload._integration import fsdp2_shards_on_host
from torch_fsdp_offload.cpu_copy_stream import misuses_detected


class SingleRankGlooTestCase(TestCase):
    """A one-rank gloo process group in this process, around each test."""

    def setUp(self) -> None:
        super().setUp()
        self._store = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{self._store}", rank=0, world_size=1)

    def tearDown(self) -> None:
        dist.destroy_process_group()
        # gloo's FileStore deletes its file once no process group or mesh holds it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._store)
        super().tearDown()


class Blocks(nn.Module):
    """Two linear blocks in an ``nn.ModuleList`` and a head: the smallest model every entry point
    (``fully_shard_with_policy``, the planner, the FSDP1 front door) shards by its blocks."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


class ResidualMLPBlocks(nn.Module):
    """Three residual MLP blocks (``up``, ``down``: the pair tensor parallelism splits column- and
    row-wise), and with ``head`` a linear head in the root group."""

    def __init__(self, width: int = 16, head: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualMLP(width) for _ in range(3))
        self.head = nn.Linear(width, 4) if head else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def fsdp1_host_bytes(model: nn.Module) -> int:
    """Bytes of the host shard, gradient buffer and compute-dtype mirror of every handle of an FSDP1
    front-door model, as allocated at its first forward."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    total = 0
    for handle in (state._handle for state in FSDP1.fsdp_modules(model) if state._handle is not None):
        flat_param, offload = handle.flat_param, handle._torch_fsdp_offload
        for tensor in (flat_param._local_shard, flat_param._cpu_grad, offload.mirror):
            total += 0 if tensor is None else tensor.numel() * tensor.itemsize
    return total


class RefusalTestCase(SingleRankGlooTestCase):
    """Refusals that must leave the model as it was: after the error, the model is sharded with
    plain ``fully_shard`` and trains exactly like a copy that was never refused."""

    @staticmethod
    def train_step(model: nn.Module) -> list[torch.Tensor]:
        """One AdamW step on a fixed batch; the parameters after it, as plain tensors."""
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        width = next(model.parameters()).shape[-1]
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        optim.step()
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]

    def assertRefusalLeavesModelTrainable(
        self,
        refuse: Callable[[nn.Module], object],
        error: type[BaseException],
        message: str,
        make_model: Callable[[], nn.Module] = Blocks,
    ) -> None:
        """``refuse(model)`` raises ``error`` matching ``message``; the model's modules keep their
        classes, hooks and parameters; plain ``fully_shard`` of each block and the root then
        trains it exactly like a never-refused copy."""
        torch.manual_seed(0)
        model = make_model()
        reference = copy.deepcopy(model)
        with self.assertRaisesRegex(error, message):
            refuse(model)
        for (name, module), original in zip(model.named_modules(), reference.modules()):
            self.assertIs(type(module), type(original), f"{name or 'the root'} changed class")
            self.assertEqual(len(module._forward_pre_hooks), len(original._forward_pre_hooks), name)
            self.assertEqual(len(module._forward_hooks), len(original._forward_hooks), name)
            self.assertEqual("forward" in vars(module), "forward" in vars(original), f"{name}'s forward was replaced")
        for (name, param), original in zip(model.named_parameters(), reference.parameters()):
            self.assertNotIsInstance(param, DTensor, name)
            self.assertEqual(param, original, msg=name, atol=0, rtol=0)
        plain = copy.deepcopy(reference)
        for target in (model, plain):
            for block in getattr(target, "blocks", ()):
                fully_shard(block)
            fully_shard(target)
        self.assertEqual(self.train_step(model), self.train_step(plain), atol=0, rtol=0)


def set_gradient_sync(model: nn.Module, reference: nn.Module, sync: bool) -> None:
    """``model.set_requires_gradient_sync(sync)``, as a user's accumulation loop calls it, and on
    ``reference`` (the same model sharded by plain FSDP2) what the policy makes of it: a group the
    policy offloads reduces every backward whatever it is told, every other group as told."""
    model.set_requires_gradient_sync(sync)
    modules = dict(model.named_modules())
    for name, module in reference.named_modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync or fsdp2_shards_on_host(modules[name]), recurse=False)


# What every rank imports, imported once by the server the ranks fork from.
_RANK_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.testing._internal.common_distributed",
    "torch_fsdp_offload",
    "common_offload",
)


class GlooMultiProcessTestCase(MultiProcessTestCase):
    """A MultiProcessTestCase on the CPU with gloo; subclasses set ``WORLD_SIZE``."""

    WORLD_SIZE = 2

    @property
    def world_size(self) -> int:
        return self.WORLD_SIZE

    # Ranks fork from one server process that imported torch and the library once (a spawned rank
    # imports them again, seconds each); the server runs none of the tests' threads, and its
    # environment is the one the test modules set up at import.
    START_METHOD = "forkserver"

    def setUp(self) -> None:
        super().setUp()
        if self.START_METHOD == "spawn":
            self._spawn_processes()
            return
        context = multiprocessing.get_context(self.START_METHOD)
        context.set_forkserver_preload(list(_RANK_PRELOAD))
        self._start_processes(context.Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe, **kwargs) -> None:
        exit_code = 0
        try:
            super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
        except SystemExit as exc:
            exit_code = exc.code if isinstance(exc.code, int) else 1
        finally:
            if misuses_detected:
                # An asynchronous CPU copy found a buffer misused, even if nobody waited on it.
                print(f"rank {rank}: asynchronous CPU copies found misuses: {misuses_detected}", file=sys.stderr)
                exit_code = exit_code or 1
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


class HostStepGate:
    """Holds the optimizer steps that run off the main thread at their start while closed, so a test
    sees, with no timing, that ``OffloadOptimizer.step()`` returned while a host step still ran.

    ``OffloadOptimizer`` runs its host steps (and its streamed groups' pipeline) in threads of its
    own, with the class it was given: pass it :meth:`optimizer_class`. Steps on the main thread
    (the parameters no group offloads) never wait at the gate. Around one ``step()``::

        gate.close()
        optim.step()
        self.assertTrue(gate.holds_a_step())  # step() returned before that host step ended
        gate.open()

    A step held for ``timeout_s`` raises in its thread, and whatever waited for it (``step()``, a
    copy-in, a read) raises that error: only code that waits for a held step before the test opens
    the gate gets there.
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._open = threading.Event()
        self._open.set()
        self._held = threading.Event()
        # The data pointers of the tensors whose steps close(only=...) holds; None: every step.
        self._only: set[int] | None = None

    def optimizer_class(self, base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
        """``base`` whose steps off the main thread wait at this gate while it is closed."""
        gate = self

        class Gated(base):
            def step(self, closure=None):
                gate._wait(p for group in self.param_groups for p in group["params"])
                return super().step(closure)

        return Gated

    def close(self, only: Iterable[torch.Tensor] | None = None) -> None:
        """Hold every step that starts off the main thread from now on, until :meth:`open`; with
        ``only`` (local shards), only the steps of parameters that alias one of them."""
        self._only = None if only is None else {tensor.data_ptr() for tensor in only}
        self._held.clear()
        self._open.clear()

    def open(self) -> None:
        """Let the held steps, and every later one, run."""
        self._open.set()

    def holds_a_step(self) -> bool:
        """Whether a step reached the closed gate (waiting up to ``timeout_s`` for one to): it
        started, and cannot end before :meth:`open`."""
        return self._held.wait(self.timeout_s)

    def _wait(self, params: Iterable[torch.Tensor]) -> None:
        if threading.current_thread() is threading.main_thread() or self._open.is_set():
            return
        if self._only is not None:
            # A DTensor's local shard (a first step, on the parameters themselves), or its alias.
            local = (param.to_local() if isinstance(param, DTensor) else param for param in params)
            if not any(tensor.data_ptr() in self._only for tensor in local):
                return
        self._held.set()
        if not self._open.wait(self.timeout_s):
            raise AssertionError(
                f"a host step was held at the closed gate for {self.timeout_s} s: something waited for it "
                "before the test opened the gate (step() returning only once its host steps ended, or a "
                "copy-in or a read waiting for a step other than its own)"
            )


# NVLink multicast (NVLS) objects are refused on some lent multi-GPU VMs and hang NCCL's init there;
# every process of a multi-GPU test starts with multicast off. Spawned workers inherit os.environ.
NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class NcclMultiProcessTestCase(GlooMultiProcessTestCase):
    """A MultiProcessTestCase with one GPU per rank and NCCL (CPU collectives on gloo).

    The world size is ``min(torch.cuda.device_count(), MAX_WORLD_SIZE)``; the test is skipped, before
    any process starts, when fewer than ``MIN_WORLD_SIZE`` GPUs are visible. NVLink multicast is
    turned off (:data:`NVLINK_MULTICAST_OFF`, values already set in the environment win).
    """

    MIN_WORLD_SIZE = 2
    MAX_WORLD_SIZE = 4
    # Each rank starts from this process's environment as the test left it (multicast off).
    START_METHOD = "spawn"

    @property
    def world_size(self) -> int:
        return min(torch.cuda.device_count(), self.MAX_WORLD_SIZE)

    def setUp(self) -> None:
        if torch.cuda.device_count() < self.MIN_WORLD_SIZE:
            self.skipTest(f"needs {self.MIN_WORLD_SIZE} GPUs, {torch.cuda.device_count()} visible")
        for name, value in NVLINK_MULTICAST_OFF.items():
            os.environ.setdefault(name, value)
        super().setUp()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.rank)

    def init_nccl(self) -> None:
        """Join this rank's ``cpu:gloo,cuda:nccl`` process group on GPU ``rank`` (call first)."""
        torch.manual_seed(0)
        torch.cuda.set_device(self.device)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"{FILE_SCHEMA}{self.file_name}",
            rank=self.rank,
            world_size=self.world_size,
            device_id=self.device,
        )


def checkpoint_and_resume(model, optim, build, train):
    """Save ``(model, optim)`` with DCP, keep training them, and train a fresh pair loaded from it.

    ``train(model, optim)`` runs the steps after the checkpoint and returns their losses; ``build()``
    returns a fresh ``(model, optimizer)`` pair like the saved one. Every rank calls this together.

    Returns:
        tuple: the uninterrupted losses, the resumed losses and the resumed model.
    """
    with tempfile.TemporaryDirectory() as scratch:
        directory = [scratch]
        dist.broadcast_object_list(directory, src=0)
        model_state, optim_state = get_state_dict(model, optim)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory[0])
        uninterrupted = train(model, optim)

        resumed_model, resumed_optim = build()
        model_state, optim_state = get_state_dict(resumed_model, resumed_optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory[0])
        set_state_dict(resumed_model, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        dist.barrier()
    return uninterrupted, train(resumed_model, resumed_optim), resumed_model
