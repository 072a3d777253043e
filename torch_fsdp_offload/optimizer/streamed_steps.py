"""Streamed steps: an offloaded group's optimizer step run on the GPU, its flat host buffers
copied up and back in a pipeline over runs of parameters (``CoherentOffload(optimizer=...)`` picks
the groups)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_fsdp_offload.optimizer.dtensor_grads import apply_scales, multiply_grads, take_scales
from torch_fsdp_offload.optimizer.pending_updates import stepping
from torch_fsdp_offload._helpers.tensors import local_tensor
from torch_fsdp_offload.memory import pinned_empty
from torch_fsdp_offload.optimizer.finishing_steps import FinishingSteps
from torch_fsdp_offload.optimizer.groups import OffloadedGroup, StreamedGroup
from torch_fsdp_offload.optimizer.host_steps import HostSteps
from torch_fsdp_offload.optimizer.hyperparameters import copy_hyperparameters
from torch_fsdp_offload.optimizer.inner_optimizers import InnerOptimizers
from torch_fsdp_offload.optimizer.step_worker import StepWorker
from torch_fsdp_offload.transfer import Transfer

__all__ = ["STREAM_RUNS_IN_FLIGHT", "STREAM_RUN_BYTES", "StreamedSteps"]

# Bytes of device memory one pipelined run of a streamed step may take (its uploads); a single
# larger parameter makes a run of its own.
STREAM_RUN_BYTES = 1 << 30
# Runs holding device memory at once: one downloading, one stepping, one uploading.
STREAM_RUNS_IN_FLIGHT = 3

# A run of consecutive parameters: ``(first, last, start, stop)``, parameters ``first:last``
# occupying elements ``start:stop`` of every flat buffer.
_Run = tuple[int, int, int, int]


class StreamedSteps:
    """The streamed groups' steps: the first ``optimizer_gpu_fraction`` of the offloaded groups in
    forward order step on the GPU, in one pipeline over runs of parameters (docs/design.md, Note:
    [Streamed step pipeline]).

    It keeps per streamed group the state moved into flat pinned buffers (one per state key, laid
    out like the master), a same-class optimizer over device proxies, and the state that is not
    parameter-shaped (step counters), kept on the device between steps so a pipelined step never
    waits on a host-to-device copy of a scalar; and the pipeline's worker (``overlap_next_forward``)
    with a CUDA stream of its own per device.

    Args:
        inner (InnerOptimizers): the inner optimizers; their class steps on the device too, and
            their state is the host state.
        host_steps (HostSteps): steps a group whose host buffers do not exist yet (before the first
            forward).
        finishing (FinishingSteps): told when a pipelined group's step starts and ends.

    Example::

        >>> streamed = StreamedSteps(inner, host_steps, finishing)
        >>> streamed.choose(inner.offloaded_groups())  # after the first forward
        >>> futures = streamed.start([g for g in groups if g in streamed.groups], in_background=True)
    """

    def __init__(self, inner: InnerOptimizers, host_steps: HostSteps, finishing: FinishingSteps) -> None:
        self._inner = inner
        self._host_steps = host_steps
        self._finishing = finishing
        #: The streamed groups (:meth:`choose`).
        self.groups: set[OffloadedGroup] = set()
        #: Seconds the last ``step()``'s streamed steps took, copies included (with
        #: ``overlap_next_forward``, set by the pipeline's thread when it ends).
        self.last_seconds = 0.0
        #: Parameters whose clip was applied on the device: their host gradients then scaled too
        #: (they may be read after ``step()``), or left (``zero_grad()`` had come).
        self.scaled_on_device = {"host_scaled": 0, "host_skipped": 0}
        self._flat_state: dict[StreamedGroup, dict[str, torch.Tensor]] = {}
        self._device_inner: dict[StreamedGroup, tuple[torch.optim.Optimizer, list[nn.Parameter]]] = {}
        self._device_scalars: dict[StreamedGroup, list[dict[str, Any]]] = {}
        self._worker: StepWorker | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # The pipeline's task in the worker, until waited for.
        self._task: concurrent.futures.Future | None = None

    def choose(self, offloaded: list[OffloadedGroup]) -> None:
        """Stream the groups of ``offloaded`` that run first in forward: their gradients land last,
        so a host step could not overlap backward anyway, and the next forward needs them first."""
        offloaded = sorted(offloaded, key=lambda owner: owner.forward_index())
        if offloaded:
            fraction = offloaded[0].plan.optimizer_gpu_fraction
            self.groups = set(offloaded[: round(fraction * len(offloaded))])

    def start(self, owners: list[StreamedGroup], in_background: bool) -> dict[StreamedGroup, concurrent.futures.Future]:
        """Step ``owners``: with ``in_background``, once every one is ready for the pipeline, in the
        worker (the groups before them in forward order need none of it; like a host step, each
        group's next copy-in waits for its own); else here. Returns the futures of the steps that
        may still run."""
        if in_background and owners and all(self._pipeline_ready(owner) for owner in owners):
            return self._submit_stream_steps(owners)
        started = time.perf_counter()
        self._stream_steps(owners)
        self.last_seconds = time.perf_counter() - started
        return {}

    def wait(self) -> None:
        """Wait until the pipeline's thread has returned: it sets a group's future before."""
        task, self._task = self._task, None
        if task is not None:
            task.result()

    def forget_state(self) -> None:
        """The state was loaded anew: move it into flat buffers again at the next step."""
        self._flat_state.clear()
        self._device_scalars.clear()

    def _stream_worker(self) -> StepWorker:
        if self._worker is None:
            self._worker = StepWorker("torch_fsdp_offload_streamed_step")
        return self._worker

    def _adopt_state(self, owner: StreamedGroup) -> dict[str, torch.Tensor] | None:
        """Move the group's parameter-shaped state into flat pinned buffers (once), so each
        streamed step copies one buffer per state key. The state stays keyed and shaped as the
        optimizer class keeps it (DTensors like their parameters), so checkpoints are unchanged.
        Returns None while the group has no state yet."""
        if owner in self._flat_state:
            return self._flat_state[owner]
        params = owner.params
        states = [self._inner.state.get(param) for param in params]
        sample_index = next((i for i, state in enumerate(states) if state), None)
        if sample_index is None:
            return None
        sample_param = local_tensor(params[sample_index])
        keys = [
            key
            for key, value in states[sample_index].items()
            if isinstance(value, torch.Tensor) and local_tensor(value).shape == sample_param.shape and value.dim() > 0
        ]
        flats = {key: pinned_empty((owner.master.numel(),), local_tensor(states[sample_index][key]).dtype) for key in keys}
        views = {key: _shard_views(owner, flat) for key, flat in flats.items()}
        with torch.no_grad():
            for index, state in enumerate(states):
                if not state:
                    continue
                for key in keys:
                    views[key][index].copy_(local_tensor(state[key]))
                    state[key] = owner.as_param_dtensor(index, views[key][index])
        self._flat_state[owner] = flats
        return flats

    def _device_optimizer(self, owner: StreamedGroup) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        if owner not in self._device_inner:
            inner = self._inner.optimizer(owner)
            proxies = [nn.Parameter(torch.empty(0, device=owner.device)) for _ in owner.params]
            proxy_of = {id(param): proxy for param, proxy in zip(owner.params, proxies)}
            groups = [
                {**group, "params": [proxy_of[id(param)] for param in group["params"]]}
                for group in inner.param_groups
            ]
            self._device_inner[owner] = (self._inner.make(groups), proxies)
        return self._device_inner[owner]

    @torch.no_grad()
    def _stream_step(self, owner: StreamedGroup) -> None:
        """Step one group on the GPU: copy its fp32 parameters, gradients and state up, run the
        same optimizer class there, copy parameters (and their compute-dtype cast) and state back.
        The group's first step creates its state on the GPU too, so a streamed group's numerics
        are those of the optimizer class on the GPU from the first step on."""
        if owner.master is None or owner.grads is None:
            # Before the first forward (e.g. torch.distributed.checkpoint creating the state
            # with zero gradients) the shards are not in their host buffers yet.
            self._host_steps.step_now(owner)
            return
        inner = self._inner.optimizer(owner)
        self._inner.take_hyperparameters(owner)
        owner.wait_grads()
        for param in owner.params:
            apply_scales(param.grad)  # a clip recorded before step() (dtensor_grads)
        flat_state = self._adopt_state(owner)
        engine = owner.engine
        with torch.profiler.record_function("torch_fsdp_offload::streamed_optimizer_step"):
            uploads = [
                engine.h2d(owner.master, label="optimizer_h2d_params"),
                engine.h2d(owner.grads, label="optimizer_h2d_grads"),
                *(engine.h2d(flat, label=f"optimizer_h2d_{key}") for key, flat in (flat_state or {}).items()),
            ]
            master, grads, *state_flats = (upload.wait() for upload in uploads)
            state_views = {key: _shard_views(owner, flat) for key, flat in zip(flat_state or {}, state_flats)}
            device_optimizer, proxies = self._device_optimizer(owner)
            copy_hyperparameters(list(zip(device_optimizer.param_groups, inner.param_groups)))
            scalars_on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
            for index, (param, proxy, view, grad) in enumerate(
                zip(owner.params, proxies, _shard_views(owner, master), _shard_views(owner, grads))
            ):
                proxy.data = view
                proxy.grad = grad if param.grad is not None else None
                state = self._inner.state.get(param)
                if state:
                    device_optimizer.state[proxy] = {
                        key: state_views[key][index]
                        if key in state_views
                        else (value.to(owner.device) if isinstance(value, torch.Tensor) and scalars_on_device else value)
                        for key, value in state.items()
                    }
            device_optimizer.step()
            downloads = owner.write_back(master)
            if flat_state is None:
                downloads += self._state_from_device(owner, device_optimizer, proxies)
            else:
                downloads += [
                    engine.d2h(device_flat, flat, label=f"optimizer_d2h_{key}")
                    for (key, flat), device_flat in zip(flat_state.items(), state_flats)
                ]
                for param, proxy in zip(owner.params, proxies):
                    for key, value in device_optimizer.state.get(proxy, {}).items():
                        host_value = self._inner.state[param][key]
                        if key not in state_views and isinstance(value, torch.Tensor) and value is not host_value:
                            host_value.copy_(value)
            for download in downloads:
                download.synchronize()
            for proxy in proxies:
                device_optimizer.state.pop(proxy, None)
                proxy.data = torch.empty(0, device=owner.device)
                proxy.grad = None

    def _state_from_device(self, owner: StreamedGroup, device_optimizer, proxies) -> list:
        """The state a group's first streamed step created on the GPU, moved into flat pinned
        buffers and registered as the host state (DTensors shaped like their parameters)."""
        flats: dict[str, torch.Tensor] = {}
        downloads = []
        for index, (param, proxy) in enumerate(zip(owner.params, proxies)):
            device_state = device_optimizer.state.get(proxy)
            if not device_state:
                continue
            host_state = {}
            for key, value in device_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == proxy.shape:
                    if key not in flats:
                        flats[key] = pinned_empty((owner.master.numel(),), value.dtype)
                    slot = _shard_views(owner, flats[key])[index]
                    downloads.append(owner.engine.d2h(value, slot, label=f"optimizer_d2h_{key}"))
                    host_state[key] = owner.as_param_dtensor(index, slot)
                elif isinstance(value, torch.Tensor):
                    host_state[key] = value.to("cpu")
                else:
                    host_state[key] = value
            self._inner.state[param] = host_state
        self._flat_state[owner] = flats
        return downloads

    @torch.no_grad()
    def _stream_steps(self, owners: list[StreamedGroup]) -> None:
        """Step the streamed groups through the GPU as one pipeline over runs of parameters:
        the upload of the next run (on the H2D stream) overlaps the step of this one and the
        download of the previous (on the D2H stream), so both link directions stay busy, and at
        most :data:`STREAM_RUNS_IN_FLIGHT` runs hold device memory at once.

        A group's first streamed step (which creates its state) goes through
        :meth:`_stream_step`; so does a group with a parameter that has a gradient but no
        state yet."""
        self._run_stream_pipeline(self._prepare_stream_runs(owners), self._scalars_to_host)

    def _prepare_stream_runs(self, owners: list[StreamedGroup]) -> list[tuple[StreamedGroup, _Run]]:
        """The pipeline's runs, in forward order of their groups, on the caller's thread: the
        hyperparameters are taken here (a scheduler may change them once ``step()`` returned) and
        the gradients waited for. Groups not ready for the pipeline step here, one at a time."""
        runs = []
        for owner in owners:
            if self._pipeline_ready(owner):
                runs.extend((owner, run) for run in _param_runs(owner, self._flat_state[owner]))
            else:
                self._stream_step(owner)
        for owner in dict.fromkeys(owner for owner, _ in runs):
            inner = self._inner.optimizer(owner)
            self._inner.take_hyperparameters(owner)
            owner.wait_grads()
            device_optimizer, _ = self._device_optimizer(owner)
            copy_hyperparameters(list(zip(device_optimizer.param_groups, inner.param_groups)))
        return runs

    def _run_stream_pipeline(
        self, runs: list[tuple[StreamedGroup, _Run]], group_done: Callable[[StreamedGroup], None]
    ) -> None:
        """Run the pipeline over ``runs``; ``group_done(owner)`` once every run of ``owner`` is
        back in host memory."""
        if not runs:
            return
        # A clip recorded before step() (dtensor_grads) scales each run's uploaded gradients on
        # the device (a float multiply gives the same bits there), and the host's copy once the
        # group is back, unless zero_grad() came meanwhile and nobody can read it.
        # Taken once per group: a group of several runs appears in ``runs`` once per run.
        scales = {owner: [take_scales(param.grad) for param in owner.params] for owner in dict.fromkeys(o for o, _ in runs)}

        def scaled_group_done(owner: StreamedGroup) -> None:
            self._scale_host_grads(owner, scales[owner])
            group_done(owner)

        with torch.profiler.record_function("torch_fsdp_offload::streamed_optimizer_step"):
            # Downloads of each stepped run, oldest first. The host issues copies far faster than
            # the link moves them: without this window it would queue every run's upload at
            # once and hold the whole optimizer state on the device.
            in_flight: collections.deque[tuple[StreamedGroup, bool, list[Transfer]]] = collections.deque()
            upload = self._upload_run(*runs[0])
            for position, (owner, run) in enumerate(runs):
                while len(in_flight) > STREAM_RUNS_IN_FLIGHT - 2:
                    _drain_run(*in_flight.popleft(), scaled_group_done)
                next_upload = self._upload_run(*runs[position + 1]) if position + 1 < len(runs) else None
                last_of_group = position + 1 == len(runs) or runs[position + 1][0] is not owner
                in_flight.append((owner, last_of_group, self._step_run(owner, run, upload, scales[owner])))
                upload = next_upload
            while in_flight:
                _drain_run(*in_flight.popleft(), scaled_group_done)

    def _submit_stream_steps(self, owners: list[StreamedGroup]) -> dict[StreamedGroup, concurrent.futures.Future]:
        """Run the streamed groups' pipeline in its own thread (``overlap_next_forward``): the
        next forward starts meanwhile, and each group's next copy-in waits for its own future,
        set once the group's parameters, state (and compute-dtype mirror) are back in host memory.
        Every group must be ready for the pipeline (:meth:`_pipeline_ready`)."""
        runs = self._prepare_stream_runs(owners)
        if not runs:
            return {}
        futures = {owner: concurrent.futures.Future() for owner in dict.fromkeys(owner for owner, _ in runs)}
        self._finishing.started(futures)
        device = runs[0][0].device
        if device.type == "cuda" and device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        self._task = self._stream_worker().submit(
            self._stream_steps_in_worker, runs, futures, self._streams.get(device)
        )
        return futures

    def _stream_steps_in_worker(
        self,
        runs: list[tuple[StreamedGroup, _Run]],
        futures: dict[StreamedGroup, concurrent.futures.Future],
        stream: torch.cuda.Stream | None,
    ) -> None:
        def group_done(owner: StreamedGroup) -> None:
            self._scalars_to_host(owner)
            self._finishing.ended(owner)
            futures[owner].set_result(None)

        started = time.perf_counter()
        try:
            # Its own stream: on the device's default stream the steps would queue among the next
            # forward's kernels, which would then wait for the uploads.
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), stepping():
                self._run_stream_pipeline(runs, group_done)
        except BaseException as error:  # handed to whoever waits on a group's future
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)
            return
        self.last_seconds = time.perf_counter() - started

    def _pipeline_ready(self, owner: StreamedGroup) -> bool:
        if owner.master is None or owner.grads is None or owner not in self._flat_state:
            return False
        states = [self._inner.state.get(param) for param in owner.params]
        return all(state or param.grad is None for param, state in zip(owner.params, states))

    def _upload_run(self, owner: StreamedGroup, run: _Run) -> dict[str, Any]:
        _, _, start, stop = run
        engine = owner.engine
        sources = {"master": owner.master, "grads": owner.grads, **self._flat_state[owner]}
        return {
            name: engine.h2d(flat[start:stop], label=f"optimizer_h2d_{name}")
            for name, flat in sources.items()
        }

    def _scale_host_grads(self, owner: StreamedGroup, scales: list[list[torch.Tensor]]) -> None:
        """Scale the host gradients of a group whose streamed step scaled their uploads, unless
        ``zero_grad()`` already came for it (it waits for the step): nothing reads them then."""
        unread = self._finishing.zero_grad_came(owner)
        self.scaled_on_device["host_skipped" if unread else "host_scaled"] += sum(1 for factors in scales if factors)
        if not unread:
            multiply_grads([param.grad for param in owner.params], scales, owner.grads)

    def _step_run(self, owner: StreamedGroup, run: _Run, upload: dict[str, Any], scales: list[list[torch.Tensor]]) -> list:
        """Step parameters ``first:last`` of ``owner`` from their uploaded run, each gradient
        multiplied by its ``scales`` first; return downloads."""
        first, last, start, _ = run
        device_optimizer, proxies = self._device_optimizer(owner)
        on_device = {name: transfer.wait() for name, transfer in upload.items()}
        ranges = owner.param_ranges()
        scalars = self._device_scalars_of(owner)
        params = owner.params
        for proxy in proxies:
            proxy.grad = None  # optimizers skip parameters without a gradient: only this run steps
        for index in range(first, last):
            param, proxy = params[index], proxies[index]
            if param.grad is None:
                continue
            offset = ranges[index][0] - start
            shape = local_tensor(param).shape
            numel = shape.numel()

            def view(flat: torch.Tensor) -> torch.Tensor:
                return flat[offset : offset + numel].view(shape)

            proxy.data = view(on_device["master"])
            proxy.grad = view(on_device["grads"])
            for factor in scales[index]:
                proxy.grad.mul_(factor.item())  # an fp32 scalar, exactly as clip_grad_norm_'s
            device_optimizer.state[proxy] = {
                **scalars[index],
                **{key: view(on_device[key]) for key in self._flat_state[owner]},
            }
        device_optimizer.step()
        downloads = owner.write_back(on_device["master"], start)
        downloads += [
            owner.engine.d2h(on_device[key], flat[start : start + on_device[key].numel()], label=f"optimizer_d2h_{key}")
            for key, flat in self._flat_state[owner].items()
        ]
        for index in range(first, last):
            proxy = proxies[index]
            state = device_optimizer.state.pop(proxy, None)
            if state:
                scalars[index] = {key: value for key, value in state.items() if key not in self._flat_state[owner]}
            proxy.data = torch.empty(0, device=owner.device)
            proxy.grad = None
        return downloads

    def _device_scalars_of(self, owner: StreamedGroup) -> list[dict[str, Any]]:
        if owner not in self._device_scalars:
            inner = self._inner.optimizer(owner)
            on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
            self._device_scalars[owner] = [
                {
                    key: value.to(owner.device) if isinstance(value, torch.Tensor) and on_device else value
                    for key, value in (self._inner.state.get(param) or {}).items()
                    if key not in self._flat_state[owner]
                }
                for param in owner.params
            ]
        return self._device_scalars[owner]

    def _scalars_to_host(self, owner: StreamedGroup) -> None:
        for param, scalars in zip(owner.params, self._device_scalars.get(owner, ())):
            state = self._inner.state.get(param)
            for key, value in scalars.items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    state[key].copy_(value)
                else:
                    state[key] = value


def _drain_run(
    owner: StreamedGroup, last_of_group: bool, downloads: list[Transfer], group_done: Callable[[StreamedGroup], None]
) -> None:
    for download in downloads:
        download.synchronize()
    if last_of_group:
        group_done(owner)


def _param_runs(owner: StreamedGroup, flat_state: dict[str, torch.Tensor]) -> list[_Run]:
    """Consecutive parameters of ``owner`` in runs of about :data:`STREAM_RUN_BYTES`:
    ``(first, last, start, stop)``, parameters ``first:last`` occupying elements
    ``start:stop`` of every flat buffer (master, gradients, state)."""
    bytes_per_element = owner.master.element_size() + owner.grads.element_size()
    bytes_per_element += sum(flat.element_size() for flat in flat_state.values())
    ranges = owner.param_ranges()
    runs = []
    first = 0
    for index, (offset, numel) in enumerate(ranges):
        start = ranges[first][0]
        if index > first and (offset + numel - start) * bytes_per_element > STREAM_RUN_BYTES:
            runs.append((first, index, start, offset))
            first = index
    if ranges:
        runs.append((first, len(ranges), ranges[first][0], ranges[-1][0] + ranges[-1][1]))
    return runs


def _shard_views(owner: StreamedGroup, flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's (unpadded) shard inside ``flat``, a buffer laid out like the master."""
    views = []
    for (offset, _), param in zip(owner.param_ranges(), owner.params):
        shape = local_tensor(param).shape
        views.append(flat[offset : offset + shape.numel()].view(shape))
    return views
