"""Host steps: an offloaded group's optimizer step on the CPU, in the caller's thread or in the
host-step worker, over plain aliases of the group's local shards; and the gradients' norms, computed
as they land."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torch_fsdp_offload.optimizer.dtensor_grads import compute_norms, expect_norms, multiply_grads, take_scales
from torch_fsdp_offload.optimizer.pending_updates import PendingUpdate, stepping
from torch_fsdp_offload._helpers.tensors import local_tensor
from torch_fsdp_offload.optimizer.finishing_steps import FinishingSteps
from torch_fsdp_offload.optimizer.groups import OffloadedGroup
from torch_fsdp_offload.optimizer.inner_optimizers import InnerOptimizers
from torch_fsdp_offload.optimizer.step_worker import StepWorker

__all__ = ["HostSteps"]


class HostSteps:
    """The offloaded groups' steps on the CPU.

    A step runs in the caller's thread or in the host-step worker (:class:`StepWorker`), which
    takes the groups in the order their gradients land, during backward (``step_during_backward``)
    or after ``step()``. The worker also starts each group's gradient norms as they land, in a pool
    of threads of their own.

    Args:
        inner (InnerOptimizers): the inner optimizers; their class runs each step.
        finishing (FinishingSteps): told when a step in the worker starts and ends.
        host_threads (int): CPU threads each step runs on.

    Example::

        >>> host = HostSteps(inner, FinishingSteps(), host_threads=15)
        >>> futures = host.submit(inner.offloaded_groups())  # each runs once its gradients landed
        >>> host.take_seconds()  # (seconds stepping, of which waiting for gradients)
    """

    def __init__(self, inner: InnerOptimizers, finishing: FinishingSteps, host_threads: int) -> None:
        self._inner = inner
        self._finishing = finishing
        self._host_threads = host_threads
        #: Steps started during backward (``step_during_backward``), by group, until the step ends.
        self.during_backward: dict[OffloadedGroup, concurrent.futures.Future] = {}
        # Per group: the wrapped class over plain aliases of its local shards, the aliases, and the
        # inner optimizer it was made for (rebuilt once a parameter group is added).
        self._plain_twins: dict[OffloadedGroup, tuple[torch.optim.Optimizer, list[nn.Parameter], torch.optim.Optimizer]] = {}
        self._worker: StepWorker | None = None
        # The gradient-norm computations of this step's landings (an error is step()'s to raise).
        self._norm_tasks: list[concurrent.futures.Future] = []
        # The norms they started in the pool and not seen done: each reads its gradient's memory.
        self._norms_running: list[concurrent.futures.Future] = []
        self._norms_lock = threading.Lock()
        # The 2-norm of a CPU tensor runs on one core whatever the thread count: the norms of a
        # group's gradients run side by side in these threads (each kernel releases the GIL).
        self._norm_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Seconds stepping, and of them waiting for gradient copies, since take_seconds().
        self._seconds_lock = threading.Lock()
        self._seconds = 0.0
        self._wait_seconds = 0.0

    def step_now(self, owner: OffloadedGroup, copy_hyperparameters: bool = True) -> None:
        """Step ``owner`` here, once its gradients have landed; then refresh what the group's next
        copy-in reads."""
        inner = self._inner.optimizer(owner)
        if copy_hyperparameters:
            self._inner.take_hyperparameters(owner)
        started = time.perf_counter()
        owner.wait_grads()
        landed = time.perf_counter()
        # A clip recorded before step() (dtensor_grads), for the whole group at once where it can.
        grads = [param.grad for param in owner.params]
        scales = [take_scales(grad) for grad in grads]
        if any(scales):
            with torch.profiler.record_function(f"torch_fsdp_offload::clip_scaling:{owner.label()}"):
                multiply_grads(grads, scales, getattr(owner, "grads", None))
        with torch.profiler.record_function(f"torch_fsdp_offload::host_optimizer_step:{owner.label()}"):
            self._step_group(owner, inner)
        owner.refresh_mirror()
        with self._seconds_lock:
            self._seconds += time.perf_counter() - started
            self._wait_seconds += landed - started

    def start(self, owners: list[OffloadedGroup], in_background: bool) -> dict[OffloadedGroup, concurrent.futures.Future]:
        """Step ``owners`` and finish the steps started during backward: with ``in_background``,
        in the worker (after backward the newest submission runs first, so they are submitted in
        reverse forward order); else here, after the worker's. Returns the futures of the steps
        that may still run: those of ``in_background``, and of backward's."""
        running = dict(self.during_backward)
        if in_background:
            running.update(self.submit(sorted(owners, key=lambda owner: owner.forward_index(), reverse=True)))
            return running
        for future in running.values():
            future.result()
        for owner in owners:
            self.step_now(owner)
        return {}

    def start_during_backward(self, owner: OffloadedGroup) -> None:
        """Step ``owner`` in the worker as soon as its gradients have landed, before ``step()``."""
        self.during_backward.update(self.submit([owner]))
        # A forward before step() (another micro-batch) copies the group in after its step, as the
        # next forward after step() does (which also guards the reads of what the step changes).
        owner.update_pending = PendingUpdate(self.during_backward[owner], ())

    def submit(self, owners: list[OffloadedGroup]) -> dict[OffloadedGroup, concurrent.futures.Future]:
        """Queue the host steps of ``owners`` in the worker at once, each to run once its gradients
        have landed. Queued together, an idle worker chooses among all of them: after backward it
        takes the newest, the first the next forward needs (docs/design.md, Note: [Host step order]);
        queued one by one, it would start on the first before the rest arrive."""
        for owner in owners:
            # Take the hyperparameters (lr set by a scheduler, ...) now, on the caller's thread: the
            # worker may run this step after step() returned and a scheduler changed them.
            self._inner.take_hyperparameters(owner)
        self._finishing.started(owners)
        futures = self._thread().submit_all([(self._step_in_worker, (owner,), owner.grads_landed) for owner in owners])
        return dict(zip(owners, futures))

    def compute_norms_on_landing(self, owner: OffloadedGroup) -> None:
        """Compute ``owner``'s gradient norms once they have landed, in the worker, for
        ``clip_grad_norm_`` (the user's, or ``max_grad_norm``'s) to read."""
        expect_norms(param.grad for param in owner.params)
        self._norm_tasks.append(self._thread().submit(self._norms_in_worker, owner, landed=owner.grads_landed))

    def wait_norms(self, computed: bool = False) -> None:
        """Wait until the norms of this step's landings were started, re-raising an error; with
        ``computed``, until every norm started has been computed too (nothing of the pool's then
        reads a gradient)."""
        norm_tasks, self._norm_tasks = self._norm_tasks, []
        for task in norm_tasks:
            task.result()
        if computed:
            with self._norms_lock:
                running, self._norms_running = self._norms_running, []
            concurrent.futures.wait(running)  # a failed norm is computed by the op that reads it

    def end_cycle(self) -> None:
        """``step()`` took (or refused) the steps started during backward."""
        self.during_backward.clear()

    def take_seconds(self) -> tuple[float, float]:
        """Seconds spent stepping since the last call (waits for gradient copies included), and the
        part of them spent waiting for gradient copies."""
        with self._seconds_lock:
            seconds, self._seconds = self._seconds, 0.0
            wait_seconds, self._wait_seconds = self._wait_seconds, 0.0
        return seconds, wait_seconds

    def _step_group(self, owner: OffloadedGroup, inner: torch.optim.Optimizer) -> None:
        """Step ``owner``'s parameters with ``inner``'s class and hyperparameters on their local
        shards, as plain tensors.

        An optimizer over DTensors runs each op through DTensor's Python dispatch, which keeps the
        GIL for the whole op. The thread that launches the GPU work needs the GIL, so a host step
        running beside backward or the next forward would leave the GPU idle (measured on an H200,
        see docs/benchmarks.md). A twin optimizer over plain aliases of the local shards runs the
        same kernels with the GIL released inside each, and steps what torch's DTensor cannot
        (Rprop's in-place indexing on torch 2.13). The twin reads and updates the state's local
        tensors in place; the state it creates (a first step) is held as the class holds it over
        the parameters: parameter-shaped tensors as DTensors sharded like their parameter.
        """
        state = self._inner.state
        params = [param for group in inner.param_groups for param in group["params"]]
        if not any(isinstance(param, DTensor) for param in params):
            with stepping():
                inner.step()
            return
        twin, aliases = self._plain_twin(owner, inner, params)
        for twin_group, group in zip(twin.param_groups, inner.param_groups):
            twin_group.update((key, value) for key, value in group.items() if key != "params")
        twin_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for param, alias in zip(params, aliases):
            alias.grad = None if param.grad is None else local_tensor(param.grad)
            if state.get(param):
                twin_state[alias] = {key: local_tensor(value) for key, value in state[param].items()}
        twin.state = twin_state
        try:
            twin.step()
        finally:
            for alias in aliases:
                alias.grad = None
            twin.state = defaultdict(dict)
        for param, alias in zip(params, aliases):
            param_state = state[param] if alias in twin_state else None
            for key, value in twin_state.get(alias, {}).items():
                before = param_state.get(key)
                if before is not None and local_tensor(before) is value:
                    continue  # updated in place: the usual case
                # Rebound or new (a class that reassigns its state): hold it like the class would.
                like_param = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == alias.shape
                if isinstance(before, DTensor) or (before is None and like_param):
                    position = next(i for i, owned in enumerate(owner.params) if owned is param)
                    value = owner.as_param_dtensor(position, value)
                param_state[key] = value
        for group, twin_group in zip(inner.param_groups, twin.param_groups):
            group.update((key, value) for key, value in twin_group.items() if key != "params")

    def _plain_twin(
        self, owner: OffloadedGroup, inner: torch.optim.Optimizer, params: list[nn.Parameter]
    ) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        """``inner``'s class over plain parameters aliasing ``params``' local shards (made once per
        group and inner optimizer, again if a shard moved)."""
        cached = self._plain_twins.get(owner)
        if cached is not None and cached[2] is inner and len(cached[1]) == len(params) and all(
            alias.data_ptr() == local_tensor(param).data_ptr() and alias.shape == local_tensor(param).shape
            for alias, param in zip(cached[1], params)
        ):
            return cached[0], cached[1]
        aliases = [nn.Parameter(local_tensor(param).detach(), requires_grad=False) for param in params]
        by_param = dict(zip(params, aliases))
        groups = [{**group, "params": [by_param[param] for param in group["params"]]} for group in inner.param_groups]
        twin = self._inner.make(groups)
        self._plain_twins[owner] = (twin, aliases, inner)
        return twin, aliases

    def _step_in_worker(self, owner: OffloadedGroup) -> None:
        torch.set_num_threads(self._host_threads)
        # The hyperparameters were taken when the step was submitted (see submit). A zero_grad()
        # deferred until the step ends runs here too: outside the step, its writes would wait for
        # this very step's pending update.
        with stepping():
            self.step_now(owner, copy_hyperparameters=False)
            self._finishing.ended(owner)

    def _norms_in_worker(self, owner: OffloadedGroup) -> None:
        owner.wait_grads()
        if self._norm_pool is None:
            self._norm_pool = concurrent.futures.ThreadPoolExecutor(
                max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="torch_fsdp_offload-grad-norms"
            )
        with torch.profiler.record_function("torch_fsdp_offload::grad_norms"):
            started = compute_norms((param.grad for param in owner.params), self._norm_pool)
        with self._norms_lock:
            self._norms_running = [norm for norm in self._norms_running if not norm.done()] + started

    def _thread(self) -> StepWorker:
        if self._worker is None:
            self._worker = StepWorker("torch_fsdp_offload_host_step")
        return self._worker

