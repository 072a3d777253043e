"""Where the optimizer step of offloaded parameters runs: ``OffloadOptimizer``.

FSDP hands a standard ``torch.optim`` optimizer sharded parameters whose data lives in host
memory; stepping them all after backward leaves the GPU idle for the whole host step (the main
cost of stock CPU offload). ``OffloadOptimizer`` wraps any ``torch.optim`` optimizer class and
keeps one inner optimizer per offloaded FSDP parameter group, so each group's host step starts as
soon as that group's gradients have landed, overlapping the rest of backward, and refreshes the
group's compute-dtype mirror right after (``CoherentOffload(cast_on="host")``), ready for the next
forward's copy-in.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
import warnings
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torch_fsdp_offload._optim_checks import check_arguments, check_loadable, check_lr
from torch_fsdp_offload.memory import pinned_empty
from torch_fsdp_offload.transfer import Transfer

logger = logging.getLogger(__name__)


class OffloadedGroup(Protocol):
    """What the FSDP integration exposes of one offloaded parameter group."""

    offloaded: bool
    # Set by OffloadOptimizer(overlap_next_forward=True): the group's host step still running;
    # its copy-in waits for it.
    update_pending: "concurrent.futures.Future | None"

    @property
    def params(self) -> list[nn.Parameter]: ...

    def wait_grads(self) -> None: ...

    def grads_landed(self) -> bool: ...

    def refresh_mirror(self) -> None: ...

    def prefetch_next_forward(self) -> None: ...

    # For steps streamed through the GPU:
    master: torch.Tensor
    grads: torch.Tensor | None
    numel: int
    device: torch.device
    engine: Any
    plan: Any

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]: ...

    def param_ranges(self) -> list[tuple[int, int]]: ...

    def as_param_dtensor(self, index: int, local: torch.Tensor) -> torch.Tensor: ...

    def forward_index(self) -> int: ...

    def write_back(self, master_on_device: torch.Tensor, start: int = 0) -> list: ...


# Set on each parameter a group manages (parameters compare elementwise, so no dict keys).
_GROUP_ATTRIBUTE = "_torch_fsdp_offload_group"
# Weak both ways: a strong value would keep its key alive (the optimizer holds its groups), and
# with them every pinned buffer of a model the user dropped.
_optimizer_by_group: "weakref.WeakKeyDictionary[OffloadedGroup, weakref.ref[OffloadOptimizer]]" = (
    weakref.WeakKeyDictionary()
)


def register_offloaded_group(group: OffloadedGroup) -> None:
    """Called by the FSDP integration for every parameter group CoherentOffload manages."""
    for param in group.params:
        setattr(param, _GROUP_ATTRIBUTE, weakref.ref(group))


def notify_grads_ready(group: OffloadedGroup, *, is_last_backward: bool) -> None:
    """Called by the FSDP integration once a group's gradient copy to the host was issued."""
    optimizer_ref = _optimizer_by_group.get(group)
    optimizer = optimizer_ref() if optimizer_ref is not None else None
    if optimizer is not None:
        optimizer._on_grads_ready(group, is_last_backward)


class OffloadOptimizer(torch.optim.Optimizer):
    """Runs any ``torch.optim`` optimizer over a model sharded with ``CoherentOffload``, stepping
    each offloaded parameter group on the host as soon as its gradients landed.

    It is a ``torch.optim.Optimizer``: learning-rate schedulers, ``zero_grad``, ``state_dict`` /
    ``load_state_dict`` and ``torch.distributed.checkpoint.state_dict.get_state_dict`` work as
    with the wrapped class, and the state is keyed and shaped exactly as the wrapped class would
    keep it (a checkpoint can be loaded into either).

    Overlap with backward is learned, never assumed: the first ``step()`` runs every group after
    backward and watches how gradients arrive. Overlap turns on only if each offloaded group
    received exactly one gradient per step and nothing modified the gradients between their
    arrival and ``step()`` (as ``clip_grad_norm_`` or a gradient scaler would; clip with
    ``max_grad_norm=`` here instead, which is applied before any group steps, at the cost of the
    overlap). Gradient accumulation with ``set_requires_gradient_sync(False)`` or
    ``set_is_last_backward(False)`` keeps the overlap. If the pattern later changes while overlap
    is on, the step raises instead of applying a gradient twice or unclipped. Every in-place
    change of a gradient (foreach ops included) and every new ``.grad`` tensor is seen; a write
    through ``.grad.data`` is not, as autograd's own version checks do not see it.

    Args:
        params (nn.Module or iterable): the FSDP-sharded model, or its parameters / parameter
            groups as for any ``torch.optim`` optimizer.
        optimizer_class (type): the optimizer to run, e.g. ``torch.optim.AdamW``. For host
            steps pass ``fused=True`` where the class supports it (AdamW, Adam, SGD): the fused
            CPU kernel is several times faster than the default per-tensor loop.
        overlap (bool): allow stepping groups during backward once it is known to be safe.
            Default True.
        max_grad_norm (float or None): clip the global gradient norm to this value before
            stepping (disables overlap). Default None.
        host_threads (int or None): CPU threads for host steps. Default: torch's intra-op
            thread count minus one, leaving a core to the thread that launches GPU work.
        overlap_next_forward (bool): let ``step()`` return while host steps, and the streamed
            groups' pipeline (in a thread and on a CUDA stream of its own), still run, each
            group's step finishing before the next forward copies that group in (groups whose
            gradients have landed are stepped newest first, which after backward is forward
            order). The host and streamed work then overlaps the next forward as well as
            backward. Until a group's step finished its parameters hold the previous values:
            ``zero_grad()``, ``state_dict()`` and ``load_state_dict()`` of this optimizer and of
            the model it was built from wait as needed; other reads of the parameters between
            ``step()`` and the next forward must call :meth:`synchronize` first. Default False.
        **optimizer_kwargs: passed to ``optimizer_class``.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass (or is an
            instance, or ``OffloadOptimizer``); ``lr`` (also a parameter group's) is not a real
            number or a one-element tensor; ``max_grad_norm`` is not a real number or None;
            ``host_threads`` is not an int or None; ``overlap`` or ``overlap_next_forward`` is
            not a bool; ``optimizer_class`` rejects the type of an ``optimizer_kwargs`` value.
        ValueError: ``lr`` is negative or not finite; ``max_grad_norm`` is not finite and
            positive; ``host_threads`` is below 1; ``optimizer_class`` rejects a value of
            ``optimizer_kwargs``. All are checked before anything is built.
        ValueError: at ``load_state_dict()``, for the state of another optimizer class or of
            another model (other parameter groups, or a state tensor of another shape).
        RuntimeError: at ``step()``, when overlap was on and a group received a second
            gradient before ``step()``, or its gradients or the hyperparameters (lr, ...) were
            modified after it had stepped during backward. Schedulers that change the lr after
            ``step()`` are fine: each group's step uses the values of the moment it was started.

    Example::

        >>> policy = CoherentOffload()
        >>> for block in model.blocks:
        ...     fully_shard(block, offload_policy=policy)
        >>> fully_shard(model, offload_policy=policy)
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
        >>> scheduler = torch.optim.lr_scheduler.LinearLR(optim, 0.1, 1.0, total_iters=100)
        >>> for batch in loader:
        ...     model(batch).sum().backward()
        ...     optim.step()
        ...     optim.zero_grad()
        ...     scheduler.step()
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        overlap: bool = True,
        max_grad_norm: float | None = None,
        host_threads: int | None = None,
        overlap_next_forward: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        check_arguments(OffloadOptimizer, optimizer_class, overlap, max_grad_norm, host_threads, overlap_next_forward)
        if "lr" in optimizer_kwargs:
            check_lr(optimizer_kwargs["lr"], "lr")
        model = params if isinstance(params, nn.Module) else None
        if model is not None:
            params = model.parameters()
        # A throwaway instance validates the kwargs and yields the class's defaults.
        try:
            defaults = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs).defaults
        except (TypeError, ValueError) as error:
            given = ", ".join(f"{key}={value!r}" for key, value in optimizer_kwargs.items())
            raise type(error)(
                f"OffloadOptimizer: {optimizer_class.__name__}({given}) refused the optimizer arguments: "
                f"{error}. Pass the keyword arguments {optimizer_class.__name__} takes, with valid values."
            ) from error
        super().__init__(params, defaults)
        if not any(_offloaded_group(param) for group in self.param_groups for param in group["params"]):
            warnings.warn(
                "OffloadOptimizer: none of its parameters is in a parameter group that CoherentOffload "
                "offloads (the model was not sharded with fully_shard(..., offload_policy=CoherentOffload()) "
                "before this optimizer was built, or the policy offloads nothing here: module_fraction=0, "
                "or a unified-memory or GPU-less platform), so it steps them as "
                f"{optimizer_class.__name__} alone would. Use {optimizer_class.__name__} itself, or shard "
                "the model with CoherentOffload before building this optimizer to offload it.",
                stacklevel=2,
            )
        # The parameters' names (by position, as state_dict() numbers them) for error messages.
        names = {id(param): name for name, param in model.named_parameters()} if model is not None else {}
        self._param_names = [names.get(id(p)) for group in self.param_groups for p in group["params"]]
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.overlap = overlap
        self.max_grad_norm = max_grad_norm
        self.host_threads = host_threads or max(1, torch.get_num_threads() - 1)
        self.overlap_next_forward = overlap_next_forward
        # Host steps still running after step() returned (overlap_next_forward), and the
        # zero_grad() calls deferred until they finish: key group, value set_to_none.
        self._finishing: dict[OffloadedGroup, concurrent.futures.Future] = {}
        self._finished: set[OffloadedGroup] = set()
        self._zero_after: dict[OffloadedGroup, bool] = {}
        self._finish_lock = threading.Lock()
        if model is not None and overlap_next_forward:
            # Reading or replacing the model's parameters must see every step finished.
            optimizer_ref = weakref.ref(self)

            def synchronize_hook(*unused: Any) -> None:
                optimizer = optimizer_ref()
                if optimizer is not None:
                    optimizer.synchronize()

            model.register_state_dict_pre_hook(synchronize_hook)
            model.register_load_state_dict_pre_hook(synchronize_hook)
        # key: an offloaded group, or None for every other parameter (GPU-resident ones).
        self._inner: dict[OffloadedGroup | None, tuple[torch.optim.Optimizer, list]] | None = None
        self._executor: _StepWorker | None = None
        # Streamed steps that outlive step() (overlap_next_forward) run in a thread of their own,
        # on a stream of their own per device.
        self._stream_executor: _StepWorker | None = None
        self._optimizer_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stream_task: concurrent.futures.Future | None = None
        self._pending: dict[OffloadedGroup, concurrent.futures.Future] = {}
        self._landings: dict[OffloadedGroup, int] = defaultdict(int)
        # Per group: each parameter's gradient as it landed, with its versions (see _watch_grads).
        self._landed_grads: dict[OffloadedGroup, list[tuple[torch.Tensor | None, int, int]]] = {}
        self._overlap_learned = False
        self._host_seconds = 0.0
        self._host_wait_seconds = 0.0
        self._streamed: set[OffloadedGroup] = set()
        # Per host-stepped group: the optimizer class over plain aliases of its local shards
        # (see _host_step).
        self._plain_twins: dict[OffloadedGroup, tuple[torch.optim.Optimizer, list[nn.Parameter]]] = {}
        # Per streamed group: its optimizer state moved into flat pinned buffers (one per state
        # key, laid out like the master), and a same-class optimizer over device proxies.
        self._flat_state: dict[OffloadedGroup, dict[str, torch.Tensor]] = {}
        self._device_inner: dict[OffloadedGroup, tuple[torch.optim.Optimizer, list[nn.Parameter]]] = {}
        # Per streamed group and parameter: the state that is not parameter-shaped (step
        # counters), kept on the device between steps so a pipelined step never waits on a
        # host-to-device copy of a scalar; mirrored into the host state after each step.
        self._device_scalars: dict[OffloadedGroup, list[dict[str, Any]]] = {}
        self._seconds_lock = threading.Lock()
        #: Host seconds spent stepping offloaded groups in the last ``step()`` (waits for
        #: gradient copies included), whether they ran during backward or in ``step()``.
        self.last_host_step_seconds = 0.0
        #: The part of ``last_host_step_seconds`` spent waiting for gradient copies to land.
        self.last_host_wait_seconds = 0.0
        #: Seconds spent in streamed (GPU) steps in the last ``step()``, copies included (with
        #: ``overlap_next_forward``, set by the pipeline's thread when it ends).
        self.last_stream_step_seconds = 0.0

    @property
    def stepped_numel(self) -> dict[str, int]:
        """This rank's parameter elements by where their optimizer step runs: ``"host"`` (offloaded
        groups stepped on the CPU), ``"streamed"`` (offloaded groups stepped on the GPU in runs:
        whole groups, the first ``round(fraction * offloaded groups)`` in forward order) and
        ``"device"`` (groups that stay on the GPU). Streamed groups are chosen from the forward
        order, so read this after the first forward.

        Example::

            >>> loss.backward(); optim.step()
            >>> optim.stepped_numel
            {'host': 805306368, 'streamed': 201326592, 'device': 604246016}
        """
        self._build()
        counts = {"host": 0, "streamed": 0, "device": 0}
        for owner, (inner, _) in self._inner.items():
            where = "device" if owner is None else "streamed" if owner in self._streamed else "host"
            counts[where] += sum(_local(param).numel() for group in inner.param_groups for param in group["params"])
        return counts

    # -- inner optimizers --------------------------------------------------------------
    def _build(self) -> None:
        if self._inner is not None:
            return
        owners: dict[OffloadedGroup | None, dict[int, list[nn.Parameter]]] = {}
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                owners.setdefault(_offloaded_group(param), {}).setdefault(index, []).append(param)
        self._inner = {}
        for owner, by_outer in owners.items():
            inner_groups = [
                {**self.param_groups[index], "params": params} for index, params in by_outer.items()
            ]
            inner = self.optimizer_class(inner_groups, **self.optimizer_kwargs)
            inner.state = self.state  # one state, keyed by parameter, shared by all inners
            pairs = list(zip(inner.param_groups, (self.param_groups[i] for i in by_outer)))
            self._inner[owner] = (inner, pairs)
            if owner is not None:
                _optimizer_by_group[owner] = weakref.ref(self)
        offloaded = sorted((o for o in self._inner if o is not None), key=lambda o: o.forward_index())
        if offloaded:
            # Stream the groups that run first in forward: their gradients land last, so a host
            # step could not overlap backward anyway, and the next forward needs them first.
            fraction = offloaded[0].plan.optimizer_gpu_fraction
            self._streamed = set(offloaded[: round(fraction * len(offloaded))])

    def _step_inner(self, owner: OffloadedGroup | None, copy_hyperparameters: bool = True) -> None:
        inner, pairs = self._inner[owner]
        if copy_hyperparameters:
            _copy_hyperparameters(pairs)
        if owner is None:
            inner.step()
            return
        started = time.perf_counter()
        owner.wait_grads()
        landed = time.perf_counter()
        with torch.profiler.record_function("torch_fsdp_offload::host_optimizer_step"):
            self._host_step(owner, inner)
        owner.refresh_mirror()
        with self._seconds_lock:
            self._host_seconds += time.perf_counter() - started
            self._host_wait_seconds += landed - started

    def _host_step(self, owner: OffloadedGroup, inner: torch.optim.Optimizer) -> None:
        """Step ``owner``'s parameters with ``inner``'s class and hyperparameters on their local
        shards, as plain tensors.

        An optimizer over DTensors runs each op through DTensor's Python dispatch, which keeps the
        GIL for the whole op (a fused host AdamW over one group: tens of milliseconds). The thread
        that launches the GPU work needs the GIL, so a host step running beside backward or the
        next forward would leave the GPU idle (measured: ~45 ms per step at the end of backward on
        our H200). A twin optimizer over plain aliases of the local shards runs the same kernels
        with the GIL released inside each. The first step (which creates the state) runs on the
        parameters themselves, so the state is made, shaped and placed as the class makes it; the
        twin then reads and updates that state's local tensors in place.
        """
        params = [param for group in inner.param_groups for param in group["params"]]
        stepped = [param for param in params if param.grad is not None]
        if not any(hasattr(param, "_local_tensor") for param in params) or not all(self.state.get(p) for p in stepped):
            # Fused kernels declare the gradients they read as written: not a change of them.
            _own_step.active = True
            try:
                inner.step()
            finally:
                _own_step.active = False
            return
        twin, aliases = self._plain_twin(owner, inner, params)
        for twin_group, group in zip(twin.param_groups, inner.param_groups):
            twin_group.update((key, value) for key, value in group.items() if key != "params")
        twin_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for param, alias in zip(params, aliases):
            alias.grad = None if param.grad is None else _local(param.grad)
            if self.state.get(param):
                twin_state[alias] = {key: _local(value) for key, value in self.state[param].items()}
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
                if before is not None and _local(before) is value:
                    continue  # updated in place: the usual case
                # Rebound or new (a class that reassigns its state): hold it like the class would.
                like_param = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == alias.shape
                if hasattr(before, "_local_tensor") or (before is None and like_param):
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
            alias.data_ptr() == _local(param).data_ptr() and alias.shape == _local(param).shape
            for alias, param in zip(cached[1], params)
        ):
            return cached
        aliases = [nn.Parameter(_local(param).detach(), requires_grad=False) for param in params]
        by_param = dict(zip(params, aliases))
        groups = [{**group, "params": [by_param[param] for param in group["params"]]} for group in inner.param_groups]
        twin = self.optimizer_class(groups, **self.optimizer_kwargs)
        self._plain_twins[owner] = (twin, aliases)
        return twin, aliases

    def _host_step_in_worker(self, owner: OffloadedGroup) -> None:
        torch.set_num_threads(self.host_threads)
        # The hyperparameters were taken when the step was submitted (see _submit_host_step).
        self._step_inner(owner, copy_hyperparameters=False)
        self._finish_group(owner)

    def _finish_group(self, owner: OffloadedGroup) -> None:
        """A group's step that may have outlived ``step()`` (overlap_next_forward) has finished."""
        with self._finish_lock:
            set_to_none = self._zero_after.pop(owner, None)
            self._finished.add(owner)
        if set_to_none is not None:
            # zero_grad() came while this group was stepping.
            _zero_grads(owner.params, set_to_none)

    # -- overlap ------------------------------------------------------------------------
    def _on_grads_ready(self, owner: OffloadedGroup, is_last_backward: bool) -> None:
        self._landings[owner] += 1
        self._landed_grads[owner] = _watch_grads(owner)
        if owner in self._pending:
            raise RuntimeError(
                "OffloadOptimizer: a parameter group received a second gradient before step(), "
                "after it had already stepped during backward. With overlap on, accumulate "
                "gradients with model.set_requires_gradient_sync(False) (or "
                "set_is_last_backward(False)) on all but the last micro-batch, or construct "
                "OffloadOptimizer(..., overlap=False)."
            )
        if not (self.overlap and self._overlap_learned and is_last_backward) or owner in self._streamed:
            return
        self._build()
        self._pending[owner] = self._submit_host_step(owner)

    def _submit_host_step(self, owner: OffloadedGroup) -> concurrent.futures.Future:
        # Take the hyperparameters (lr set by a scheduler, ...) now, on the caller's thread: the
        # worker may run this step after step() returned and a scheduler changed them.
        _copy_hyperparameters(self._inner[owner][1])
        with self._finish_lock:
            self._finished.discard(owner)
        return self._worker().submit(self._host_step_in_worker, owner, landed=owner.grads_landed)

    def _worker(self) -> "_StepWorker":
        if self._executor is None:
            self._executor = self._new_worker("torch_fsdp_offload_host_step")
        return self._executor

    def _stream_worker(self) -> "_StepWorker":
        if self._stream_executor is None:
            self._stream_executor = self._new_worker("torch_fsdp_offload_streamed_step")
        return self._stream_executor

    def _new_worker(self, name: str) -> "_StepWorker":
        worker = _StepWorker(name)
        # The thread ends with the optimizer (a process building several models must get their
        # pinned buffers back); the callback holds the worker, not the optimizer.
        weakref.finalize(self, worker.shutdown)
        return worker

    # -- steps streamed through the GPU -------------------------------------------------
    def _adopt_state(self, owner: OffloadedGroup) -> dict[str, torch.Tensor] | None:
        """Move the group's parameter-shaped state into flat pinned buffers (once), so each
        streamed step copies one buffer per state key. The state stays keyed and shaped as the
        optimizer class keeps it (DTensors like their parameters), so checkpoints are unchanged.
        Returns None while the group has no state yet."""
        if owner in self._flat_state:
            return self._flat_state[owner]
        params = owner.params
        states = [self.state.get(param) for param in params]
        sample_index = next((i for i, state in enumerate(states) if state), None)
        if sample_index is None:
            return None
        sample_param = _local(params[sample_index])
        keys = [
            key
            for key, value in states[sample_index].items()
            if isinstance(value, torch.Tensor) and _local(value).shape == sample_param.shape and value.dim() > 0
        ]
        flats = {key: pinned_empty((owner.numel,), _local(states[sample_index][key]).dtype) for key in keys}
        views = {key: owner.views(flat) for key, flat in flats.items()}
        with torch.no_grad():
            for index, state in enumerate(states):
                if not state:
                    continue
                for key in keys:
                    views[key][index].copy_(_local(state[key]))
                    state[key] = owner.as_param_dtensor(index, views[key][index])
        self._flat_state[owner] = flats
        return flats

    def _device_optimizer(self, owner: OffloadedGroup) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        if owner not in self._device_inner:
            inner, _ = self._inner[owner]
            proxies = [nn.Parameter(torch.empty(0, device=owner.device)) for _ in owner.params]
            proxy_of = {id(param): proxy for param, proxy in zip(owner.params, proxies)}
            groups = [
                {**group, "params": [proxy_of[id(param)] for param in group["params"]]}
                for group in inner.param_groups
            ]
            self._device_inner[owner] = (self.optimizer_class(groups, **self.optimizer_kwargs), proxies)
        return self._device_inner[owner]

    @torch.no_grad()
    def _stream_step(self, owner: OffloadedGroup) -> None:
        """Step one group on the GPU: copy its fp32 parameters, gradients and state up, run the
        same optimizer class there, copy parameters (and their compute-dtype cast) and state back.
        The group's first step creates its state on the GPU too, so a streamed group's numerics
        are those of the optimizer class on the GPU from the first step on."""
        if owner.master is None or owner.grads is None:
            # Before the first forward (e.g. torch.distributed.checkpoint creating the state
            # with zero gradients) the shards are not in their host buffers yet.
            self._step_inner(owner)
            return
        inner, pairs = self._inner[owner]
        _copy_hyperparameters(pairs)
        owner.wait_grads()
        flat_state = self._adopt_state(owner)
        engine = owner.engine
        with torch.profiler.record_function("torch_fsdp_offload::streamed_optimizer_step"):
            uploads = [
                engine.h2d(owner.master, label="optimizer_h2d_params"),
                engine.h2d(owner.grads, label="optimizer_h2d_grads"),
                *(engine.h2d(flat, label=f"optimizer_h2d_{key}") for key, flat in (flat_state or {}).items()),
            ]
            master, grads, *state_flats = (upload.wait() for upload in uploads)
            state_views = {key: owner.views(flat) for key, flat in zip(flat_state or {}, state_flats)}
            device_optimizer, proxies = self._device_optimizer(owner)
            _copy_hyperparameters(list(zip(device_optimizer.param_groups, inner.param_groups)))
            scalars_on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
            for index, (param, proxy, view, grad) in enumerate(
                zip(owner.params, proxies, owner.views(master), owner.views(grads))
            ):
                proxy.data = view
                proxy.grad = grad if param.grad is not None else None
                state = self.state.get(param)
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
                        host_value = self.state[param][key]
                        if key not in state_views and isinstance(value, torch.Tensor) and value is not host_value:
                            host_value.copy_(value)
            for download in downloads:
                download.synchronize()
            for proxy in proxies:
                device_optimizer.state.pop(proxy, None)
                proxy.data = torch.empty(0, device=owner.device)
                proxy.grad = None

    def _state_from_device(self, owner: OffloadedGroup, device_optimizer, proxies) -> list:
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
                        flats[key] = pinned_empty((owner.numel,), value.dtype)
                    slot = owner.views(flats[key])[index]
                    downloads.append(owner.engine.d2h(value, slot, label=f"optimizer_d2h_{key}"))
                    host_state[key] = owner.as_param_dtensor(index, slot)
                elif isinstance(value, torch.Tensor):
                    host_state[key] = value.to("cpu")
                else:
                    host_state[key] = value
            self.state[param] = host_state
        self._flat_state[owner] = flats
        return downloads

    @torch.no_grad()
    def _stream_steps(self, owners: list[OffloadedGroup]) -> None:
        """Step the streamed groups through the GPU as one pipeline over runs of parameters:
        the upload of the next run (on the H2D stream) overlaps the step of this one and the
        download of the previous (on the D2H stream), so both link directions stay busy, and at
        most :data:`_STREAM_RUNS_IN_FLIGHT` runs hold device memory at once.

        A group's first streamed step (which creates its state) goes through
        :meth:`_stream_step`; so does a group with a parameter that has a gradient but no
        state yet."""
        self._run_stream_pipeline(self._prepare_stream_runs(owners), self._scalars_to_host)

    def _prepare_stream_runs(self, owners: list[OffloadedGroup]) -> list[tuple[OffloadedGroup, tuple[int, int, int, int]]]:
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
            inner, pairs = self._inner[owner]
            _copy_hyperparameters(pairs)
            owner.wait_grads()
            device_optimizer, _ = self._device_optimizer(owner)
            _copy_hyperparameters(list(zip(device_optimizer.param_groups, inner.param_groups)))
        return runs

    def _run_stream_pipeline(
        self, runs: list[tuple[OffloadedGroup, tuple[int, int, int, int]]], group_done: Callable[[OffloadedGroup], None]
    ) -> None:
        """Run the pipeline over ``runs``; ``group_done(owner)`` once every run of ``owner`` is
        back in host memory."""
        if not runs:
            return
        with torch.profiler.record_function("torch_fsdp_offload::streamed_optimizer_step"):
            # Downloads of each stepped run, oldest first. The host issues copies far faster than
            # the link moves them: without this window it would queue every run's upload at
            # once and hold the whole optimizer state on the device.
            in_flight: collections.deque[tuple[OffloadedGroup, bool, list[Transfer]]] = collections.deque()
            upload = self._upload_run(*runs[0])
            for position, (owner, run) in enumerate(runs):
                while len(in_flight) > _STREAM_RUNS_IN_FLIGHT - 2:
                    _drain_run(*in_flight.popleft(), group_done)
                next_upload = self._upload_run(*runs[position + 1]) if position + 1 < len(runs) else None
                last_of_group = position + 1 == len(runs) or runs[position + 1][0] is not owner
                in_flight.append((owner, last_of_group, self._step_run(owner, run, upload)))
                upload = next_upload
            while in_flight:
                _drain_run(*in_flight.popleft(), group_done)

    def _submit_stream_steps(self, owners: list[OffloadedGroup]) -> dict[OffloadedGroup, concurrent.futures.Future]:
        """Run the streamed groups' pipeline in its own thread (``overlap_next_forward``): the
        next forward starts meanwhile, and each group's next copy-in waits for its own future,
        set once the group's parameters, state (and compute-dtype mirror) are back in host memory.
        Every group must be ready for the pipeline (:meth:`_pipeline_ready`)."""
        runs = self._prepare_stream_runs(owners)
        if not runs:
            return {}
        futures = {owner: concurrent.futures.Future() for owner in dict.fromkeys(owner for owner, _ in runs)}
        with self._finish_lock:
            self._finished.difference_update(futures)
        device = runs[0][0].device
        if device.type == "cuda" and device not in self._optimizer_streams:
            self._optimizer_streams[device] = torch.cuda.Stream(device)
        self._stream_task = self._stream_worker().submit(
            self._stream_steps_in_worker, runs, futures, self._optimizer_streams.get(device)
        )
        return futures

    def _stream_steps_in_worker(
        self,
        runs: list[tuple[OffloadedGroup, tuple[int, int, int, int]]],
        futures: dict[OffloadedGroup, concurrent.futures.Future],
        stream: torch.cuda.Stream | None,
    ) -> None:
        def group_done(owner: OffloadedGroup) -> None:
            self._scalars_to_host(owner)
            self._finish_group(owner)
            futures[owner].set_result(None)

        started = time.perf_counter()
        try:
            # Its own stream: on the device's default stream the steps would queue among the next
            # forward's kernels, which would then wait for the uploads.
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._run_stream_pipeline(runs, group_done)
        except BaseException as error:  # handed to whoever waits on a group's future
            for future in futures.values():
                if not future.done():
                    future.set_exception(error)
            return
        self.last_stream_step_seconds = time.perf_counter() - started

    def _pipeline_ready(self, owner: OffloadedGroup) -> bool:
        if owner.master is None or owner.grads is None or owner not in self._flat_state:
            return False
        states = [self.state.get(param) for param in owner.params]
        return all(state or param.grad is None for param, state in zip(owner.params, states))

    def _upload_run(self, owner: OffloadedGroup, run: tuple[int, int, int, int]) -> dict[str, Any]:
        _, _, start, stop = run
        engine = owner.engine
        sources = {"master": owner.master, "grads": owner.grads, **self._flat_state[owner]}
        return {
            name: engine.h2d(flat[start:stop], label=f"optimizer_h2d_{name}", chunk_bytes=owner.plan.chunk_bytes)
            for name, flat in sources.items()
        }

    def _step_run(self, owner: OffloadedGroup, run: tuple[int, int, int, int], upload: dict[str, Any]) -> list:
        """Step parameters ``first:last`` of ``owner`` from their uploaded run; return downloads."""
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
            shape = _local(param).shape
            numel = shape.numel()

            def view(flat: torch.Tensor) -> torch.Tensor:
                return flat[offset : offset + numel].view(shape)

            proxy.data = view(on_device["master"])
            proxy.grad = view(on_device["grads"])
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

    def _device_scalars_of(self, owner: OffloadedGroup) -> list[dict[str, Any]]:
        if owner not in self._device_scalars:
            inner, _ = self._inner[owner]
            on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
            self._device_scalars[owner] = [
                {
                    key: value.to(owner.device) if isinstance(value, torch.Tensor) and on_device else value
                    for key, value in (self.state.get(param) or {}).items()
                    if key not in self._flat_state[owner]
                }
                for param in owner.params
            ]
        return self._device_scalars[owner]

    def _scalars_to_host(self, owner: OffloadedGroup) -> None:
        for param, scalars in zip(owner.params, self._device_scalars.get(owner, ())):
            state = self.state.get(param)
            for key, value in scalars.items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    state[key].copy_(value)
                else:
                    state[key] = value

    def _check_overlap_pattern(self) -> bool:
        """Whether this step's gradients arrived in the pattern that makes overlap safe."""
        if self.max_grad_norm is not None or not self._landings:
            return False
        for owner, landings in self._landings.items():
            if landings != 1 or not _grads_unchanged(owner, self._landed_grads[owner]):
                return False
        return True

    # -- public ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._build()
        self.synchronize()
        stepped = set(self._pending)
        changed = [owner for owner in stepped if _hyperparameters_changed(self._inner[owner][1])]
        if changed:
            self._refuse_step(
                "OffloadOptimizer: learning rate or another hyperparameter changed between "
                "backward and step(), after some groups had already stepped during backward with "
                "the old values. Change hyperparameters before backward (or after step(), as LR "
                "schedulers do), or construct OffloadOptimizer(..., overlap=False)."
            )
        # Reading gradient versions is safe while those groups still step in the worker.
        safe_pattern = self._check_overlap_pattern()
        if stepped and not safe_pattern:
            self._refuse_step(
                "OffloadOptimizer: gradients changed after some parameter groups had already "
                "stepped during backward (an in-place change such as clip_grad_norm_, "
                "clip_grad_value_ or a gradient scaler's unscale_, or a new .grad tensor): those "
                "groups stepped with the gradients as they landed, and this step() steps no other. "
                "To clip, pass OffloadOptimizer(..., max_grad_norm=...), applied before any group "
                "steps, instead of calling clip_grad_norm_; for any other change of the gradients "
                "between backward and step(), construct OffloadOptimizer(..., overlap=False)."
            )
        if self.max_grad_norm is not None:
            self._clip_grad_norm(self.max_grad_norm)
        todo = [owner for owner in self._inner if owner is not None and owner not in stepped]
        host_todo = [owner for owner in todo if owner not in self._streamed]
        streamed_todo = [owner for owner in todo if owner in self._streamed]
        host_futures = dict(self._pending)
        if streamed_todo or self.overlap_next_forward:
            # Host cores step their groups (some may still be stepping since backward) while
            # the link and the GPU step the streamed ones; of the groups whose gradients have
            # landed the worker runs the newest submission first, so submit in reverse forward
            # order.
            for owner in sorted(host_todo, key=lambda o: o.forward_index(), reverse=True):
                host_futures[owner] = self._submit_host_step(owner)
        else:
            for future in host_futures.values():
                future.result()
            host_futures = {}
            for owner in host_todo:
                self._step_inner(owner)
        if self.overlap_next_forward and streamed_todo and all(self._pipeline_ready(o) for o in streamed_todo):
            # The streamed groups' pipeline also runs on while the next forward starts (the
            # groups before them in forward order need none of it); like a host step, each
            # group's next copy-in waits for its own.
            host_futures.update(self._submit_stream_steps(streamed_todo))
        else:
            started = time.perf_counter()
            self._stream_steps(streamed_todo)
            self.last_stream_step_seconds = time.perf_counter() - started
        if self.overlap_next_forward:
            # Each group's next copy-in waits for its own step; nothing else waits here.
            for owner, future in host_futures.items():
                owner.update_pending = future
            self._finishing = host_futures
        else:
            for future in host_futures.values():
                future.result()
        if None in self._inner:
            self._step_inner(None)
        self._overlap_learned = self._overlap_learned or safe_pattern
        self._reset_cycle()
        with self._seconds_lock:
            self.last_host_step_seconds, self._host_seconds = self._host_seconds, 0.0
            self.last_host_wait_seconds, self._host_wait_seconds = self._host_wait_seconds, 0.0
        for owner in self._inner:
            if owner is not None:
                owner.prefetch_next_forward()
                break
        return loss

    def synchronize(self) -> None:
        """Wait until every step has finished (only host steps and the streamed groups' pipeline
        of ``overlap_next_forward`` can still run after ``step()`` returned); re-raise an error a
        step raised.

        Call it also before dropping the model and the optimizer: a step still running holds the
        optimizer, and through it the groups' memory, until it ends (and the model, whose FSDP
        state holds reference cycles, then waits for the next garbage collection).

        Example::

            >>> optim.step()
            >>> optim.synchronize()
            >>> log_norms(model)  # reads the updated parameters
        """
        finishing, self._finishing = self._finishing, {}
        for owner, future in finishing.items():
            future.result()
            owner.update_pending = None
        # The pipeline's thread sets a group's future before it returns: wait for the return too.
        task, self._stream_task = self._stream_task, None
        if task is not None:
            task.result()

    def zero_grad(self, set_to_none: bool = True) -> None:
        deferred = set()
        with self._finish_lock:
            for owner in self._finishing:
                if owner not in self._finished:
                    self._zero_after[owner] = set_to_none
                    deferred.add(owner)
        skip = {id(param) for owner in deferred for param in owner.params}
        _zero_grads(
            [p for group in self.param_groups for p in group["params"] if id(p) not in skip], set_to_none
        )

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def _refuse_step(self, message: str) -> None:
        """Let the groups already stepping finish, forget this cycle, and raise ``message``."""
        for future in self._pending.values():
            future.result()
        self._reset_cycle()
        raise RuntimeError(message)

    def _reset_cycle(self) -> None:
        self._pending.clear()
        self._landings.clear()
        for landed in self._landed_grads.values():
            for grad, _, _ in landed:
                if type(grad) is _WatchedGrad:
                    grad.__class__ = DTensor
        self._landed_grads.clear()

    def _clip_grad_norm(self, max_norm: float) -> None:
        for owner in self._inner:
            if owner is not None:
                owner.wait_grads()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loadable(self, state_dict, self._param_names)
        self.synchronize()
        super().load_state_dict(state_dict)
        # Loaded state is new tensors: streamed groups move it into their flat buffers again.
        self._flat_state.clear()
        self._device_scalars.clear()
        if self._inner is not None:
            for inner, _ in self._inner.values():
                inner.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "lr" in param_group:
            check_lr(param_group["lr"], f"param_groups[{len(self.param_groups)}]['lr']")
        super().add_param_group(param_group)
        self._inner = None  # rebuilt with the new group at the next step
        self._plain_twins = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for transient in ("_inner", "_executor", "_pending", "_seconds_lock", "_finish_lock", "_finishing", "_device_inner", "_flat_state", "_streamed", "_device_scalars", "_plain_twins"):
            state.pop(transient, None)
        return state


class _StepWorker:
    """One thread running submitted steps: of those whose gradients have landed, the most
    recently submitted first; when none has, the oldest, whose gradients land first. One worker
    runs the host steps; another the streamed groups' pipeline, one task per ``step()``.

    In backward, the host submits a group's step when it issues the group's gradient copy, and the
    CPU runs ahead of the GPU: the newest submission is then the group whose gradients land last,
    so the worker takes the oldest and steps groups as they land. After backward every gradient
    has landed and the newest group is the first the next forward needs: newest-first steps the
    backlog in forward order."""

    def __init__(self, name: str) -> None:
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, landed: Callable[[], bool] | None = None) -> concurrent.futures.Future:
        """Queue ``fn(*args)``; ``landed`` says whether its gradients have landed (default: yes)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            self._queue.append((future, fn, args, landed))
            self._ready.notify()
        return future

    def shutdown(self) -> None:
        """End the thread once the steps already submitted have run."""
        with self._ready:
            self._queue.appendleft(None)  # taken only when no step is left
            self._ready.notify()

    def _take(self) -> Any:
        steps = [index for index, task in enumerate(self._queue) if task is not None]
        if not steps:
            return self._queue.pop()
        landed = [index for index in steps if self._queue[index][3] is None or self._queue[index][3]()]
        index = landed[-1] if landed else steps[0]
        task = self._queue[index]
        del self._queue[index]
        return task

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                task = self._take()
            if task is None:
                return
            future, fn, args, landed = task
            # Nothing of a finished step stays referenced while the thread waits for the next:
            # the step's bound method would keep its optimizer (and pinned buffers) alive, the
            # landed check its group.
            del task, landed
            if future.set_running_or_notify_cancel():
                # The step's references go before its future is set: whoever waits on it may drop
                # the optimizer right away.
                try:
                    result = fn(*args)
                except BaseException as error:  # handed to whoever waits on the future
                    del fn, args
                    future.set_exception(error)
                else:
                    del fn, args
                    future.set_result(result)
                    del result
            else:
                del fn, args
            del future


def _drain_run(
    owner: OffloadedGroup, last_of_group: bool, downloads: list[Transfer], group_done: Callable[[OffloadedGroup], None]
) -> None:
    for download in downloads:
        download.synchronize()
    if last_of_group:
        group_done(owner)


def _zero_grads(params: Iterable[nn.Parameter], set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def _hyperparameters_changed(pairs: list) -> bool:
    """Whether an outer group's hyperparameters differ from what its inner group last used."""
    for inner_group, outer_group in pairs:
        for key, value in outer_group.items():
            if key == "params":
                continue
            used = inner_group.get(key)
            if isinstance(value, torch.Tensor) or isinstance(used, torch.Tensor):
                if not (isinstance(value, torch.Tensor) and isinstance(used, torch.Tensor) and torch.equal(value, used)):
                    return True
            elif used != value:
                return True
    return False


def _copy_hyperparameters(pairs: list) -> None:
    """Hyperparameters (lr set by a scheduler, ...) flow from the outer groups to the inners;
    tensors are copied, so a step taken later still sees the values of this moment."""
    for inner_group, outer_group in pairs:
        for key, value in outer_group.items():
            if key != "params":
                inner_group[key] = value.clone() if isinstance(value, torch.Tensor) else value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _offloaded_group(param: nn.Parameter) -> OffloadedGroup | None:
    """The offloaded group that manages ``param``, None if none does."""
    owner_ref = getattr(param, _GROUP_ATTRIBUTE, None)
    owner = owner_ref() if owner_ref is not None else None
    return owner if owner is not None and owner.offloaded else None


# Set while this thread runs an optimizer step of ours: its ops on gradients are no change.
_own_step = threading.local()


class _WatchedGrad(DTensor):
    """A gradient DTensor whose in-place changes bump its version counter.

    In-place foreach ops on a tensor subclass (``clip_grad_norm_``, ``clip_grad_value_`` and a
    gradient scaler's ``unscale_`` use them) bump neither the DTensor's version counter nor its
    local tensor's, so a version read alone misses them. A group that steps during backward must
    know whether its gradients changed after it stepped: its gradients are of this class from
    their landing until ``step()``, and plain DTensors again after.
    """

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if func._schema.is_mutable and not getattr(_own_step, "active", False):
            kwargs = kwargs or {}
            for position, argument in enumerate(func._schema.arguments):
                if argument.is_write:
                    value = args[position] if position < len(args) else kwargs.get(argument.name)
                    for tensor in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(tensor, _WatchedGrad):
                            torch.autograd.graph.increment_version(tensor)
        return result


def _grad_versions(grad: torch.Tensor | None) -> tuple[int, int]:
    """The versions of ``grad`` and of its local tensor (``p.grad._local_tensor.mul_()`` bumps
    only the latter)."""
    return (-1, -1) if grad is None else (grad._version, _local(grad)._version)


def _watch_grads(owner: OffloadedGroup) -> list[tuple[torch.Tensor | None, int, int]]:
    """Each of ``owner``'s gradients as it is now, with its versions; in-place changes of it
    are seen from now on (:class:`_WatchedGrad`)."""
    landed = []
    for param in owner.params:
        grad = param.grad
        if type(grad) is DTensor:
            grad.__class__ = _WatchedGrad
        landed.append((grad, *_grad_versions(grad)))
    return landed


def _grads_unchanged(owner: OffloadedGroup, landed: list[tuple[torch.Tensor | None, int, int]]) -> bool:
    """Whether ``owner``'s gradients are the tensors that landed, unchanged in place since."""
    return all(
        param.grad is grad and _grad_versions(grad) == (version, local_version)
        for param, (grad, version, local_version) in zip(owner.params, landed)
    )


# Bytes of device memory one pipelined run of a streamed step may take (its uploads); a single
# larger parameter makes a run of its own.
_STREAM_RUN_BYTES = 1 << 30
# Runs holding device memory at once: one downloading, one stepping, one uploading.
_STREAM_RUNS_IN_FLIGHT = 3


def _param_runs(owner: OffloadedGroup, flat_state: dict[str, torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """Consecutive parameters of ``owner`` in runs of about :data:`_STREAM_RUN_BYTES`:
    ``(first, last, start, stop)``, parameters ``first:last`` occupying elements
    ``start:stop`` of every flat buffer (master, gradients, state)."""
    bytes_per_element = owner.master.element_size() + owner.grads.element_size()
    bytes_per_element += sum(flat.element_size() for flat in flat_state.values())
    ranges = owner.param_ranges()
    runs = []
    first = 0
    for index, (offset, numel) in enumerate(ranges):
        start = ranges[first][0]
        if index > first and (offset + numel - start) * bytes_per_element > _STREAM_RUN_BYTES:
            runs.append((first, index, start, offset))
            first = index
    if ranges:
        runs.append((first, len(ranges), ranges[first][0], ranges[-1][0] + ranges[-1][1]))
    return runs

