"""Host steps: an offloaded group's optimizer step on the CPU, in the caller's thread or in the
host-step worker, over plain aliases of the group's local shards."""

from __future__ import annotations

import concurrent.futures
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torch_fsdp_offload.optimizer.dtensor_grads import apply_scales
from torch_fsdp_offload.optimizer.pending_updates import stepping
from torch_fsdp_offload._helpers.tensors import local_tensor
from torch_fsdp_offload.optimizer.groups import mark_internal, OffloadedGroup
from torch_fsdp_offload.optimizer import hyperparameters
from torch_fsdp_offload.optimizer.step_worker import start_worker, StepWorker

__all__ = ["HostSteps"]


class HostSteps:
    """``OffloadOptimizer``'s host steps (a mixin of it).

    It uses the optimizer's ``state``, ``optimizer_class``, ``optimizer_kwargs``, ``host_threads``,
    its inner optimizers ``_inner`` (key: group, value: ``(inner optimizer, group pairs)``), the
    seconds counters under ``_seconds_lock``, ``_finish_lock``, ``_finished`` and
    ``_finish_group``, and keeps per group a twin optimizer over plain aliases (``_plain_twins``)
    and the host-step worker (``_executor``).
    """

    def _step_inner(self, owner: OffloadedGroup | None, copy_hyperparameters: bool = True) -> None:
        """Step ``owner``'s inner optimizer (None: the parameters no group offloads) here, once
        its gradients have landed; then refresh what the group's next copy-in reads."""
        inner, pairs = self._inner[owner]
        if copy_hyperparameters:
            hyperparameters.copy_hyperparameters(pairs)
        if owner is None:
            inner.step()
            return
        started = time.perf_counter()
        owner.wait_grads()
        landed = time.perf_counter()
        for param in owner.params:
            apply_scales(param.grad)  # a clip recorded before step() (dtensor_grads)
        with torch.profiler.record_function(f"torch_fsdp_offload::host_optimizer_step:{owner.label()}"):
            self._host_step(owner, inner)
        owner.refresh_mirror()
        with self._seconds_lock:
            self._host_seconds += time.perf_counter() - started
            self._host_wait_seconds += landed - started

    def _host_step(self, owner: OffloadedGroup, inner: torch.optim.Optimizer) -> None:
        """Step ``owner``'s parameters with ``inner``'s class and hyperparameters on their local
        shards, as plain tensors.

        An optimizer over DTensors runs each op through DTensor's Python dispatch, which keeps the
        GIL for the whole op. The thread that launches the GPU work needs the GIL, so a host step
        running beside backward or the next forward would leave the GPU idle (measured on an H200,
        see docs/benchmarks.md). A twin optimizer over plain aliases of the local shards runs the
        same kernels with the GIL released inside each. The first step (which creates the state)
        runs on the parameters themselves, so the state is made, shaped and placed as the class
        makes it; the twin then reads and updates that state's local tensors in place.
        """
        params = [param for group in inner.param_groups for param in group["params"]]
        stepped = [param for param in params if param.grad is not None]
        if not any(isinstance(param, DTensor) for param in params) or not all(self.state.get(p) for p in stepped):
            with stepping():
                inner.step()
            return
        twin, aliases = self._plain_twin(owner, inner, params)
        for twin_group, group in zip(twin.param_groups, inner.param_groups):
            twin_group.update((key, value) for key, value in group.items() if key != "params")
        twin_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for param, alias in zip(params, aliases):
            alias.grad = None if param.grad is None else local_tensor(param.grad)
            if self.state.get(param):
                twin_state[alias] = {key: local_tensor(value) for key, value in self.state[param].items()}
        twin.state = twin_state
        try:
            twin.step()
        finally:
            for alias in aliases:
                alias.grad = None
            twin.state = defaultdict(dict)
        for param, alias in zip(params, aliases):
            state = self.state[param] if alias in twin_state else None
            for key, value in twin_state.get(alias, {}).items():
                before = state.get(key)
                if before is not None and local_tensor(before) is value:
                    continue  # updated in place: the usual case
                # Rebound or new (a class that reassigns its state): hold it like the class would.
                like_param = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == alias.shape
                if isinstance(before, DTensor) or (before is None and like_param):
                    position = next(i for i, owned in enumerate(owner.params) if owned is param)
                    value = owner.as_param_dtensor(position, value)
                state[key] = value
        for group, twin_group in zip(inner.param_groups, twin.param_groups):
            group.update((key, value) for key, value in twin_group.items() if key != "params")

    def _plain_twin(
        self, owner: OffloadedGroup, inner: torch.optim.Optimizer, params: list[nn.Parameter]
    ) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        """``inner``'s class over plain parameters aliasing ``params``' local shards (made once per
        group, again if a shard moved)."""
        cached = self._plain_twins.get(owner)
        if cached is not None and len(cached[1]) == len(params) and all(
            alias.data_ptr() == local_tensor(param).data_ptr() and alias.shape == local_tensor(param).shape
            for alias, param in zip(cached[1], params)
        ):
            return cached
        aliases = [nn.Parameter(local_tensor(param).detach(), requires_grad=False) for param in params]
        by_param = dict(zip(params, aliases))
        groups = [{**group, "params": [by_param[param] for param in group["params"]]} for group in inner.param_groups]
        twin = self.optimizer_class(groups, **self.optimizer_kwargs)
        mark_internal(twin)
        self._plain_twins[owner] = (twin, aliases)
        return twin, aliases

    def _submit_host_steps(self, owners: list[OffloadedGroup]) -> dict[OffloadedGroup, concurrent.futures.Future]:
        """Queue the host steps of ``owners`` in the worker at once, each to run once its gradients
        have landed. Queued together, an idle worker chooses among all of them: after backward it
        takes the newest, the first the next forward needs (docs/design.md, Note: [Host step order]);
        queued one by one, it would start on the first before the rest arrive."""
        for owner in owners:
            # Take the hyperparameters (lr set by a scheduler, ...) now, on the caller's thread: the
            # worker may run this step after step() returned and a scheduler changed them.
            hyperparameters.copy_hyperparameters(self._inner[owner][1])
        with self._finish_lock:
            self._finished.difference_update(owners)
        futures = self._worker().submit_all([(self._host_step_in_worker, (owner,), owner.grads_landed) for owner in owners])
        return dict(zip(owners, futures))

    def _host_step_in_worker(self, owner: OffloadedGroup) -> None:
        torch.set_num_threads(self.host_threads)
        # The hyperparameters were taken when the step was submitted (see _submit_host_steps).
        # A zero_grad() deferred until the step ends runs here too: outside the step, its writes
        # would wait for this very step's pending update.
        with stepping():
            self._step_inner(owner, copy_hyperparameters=False)
            self._finish_group(owner)

    def _worker(self) -> StepWorker:
        if self._executor is None:
            self._executor = start_worker(self, "torch_fsdp_offload_host_step")
        return self._executor
