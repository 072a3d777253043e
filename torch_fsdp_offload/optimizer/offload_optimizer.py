"""``OffloadOptimizer``: a ``torch.optim.Optimizer`` that steps each offloaded FSDP parameter group
where and when it pays.

FSDP hands a standard ``torch.optim`` optimizer sharded parameters whose data lives in host
memory; stepping them all after backward leaves the GPU idle for the whole host step (the main
cost of stock CPU offload). ``OffloadOptimizer`` wraps any ``torch.optim`` optimizer class and
keeps one inner optimizer per offloaded FSDP parameter group, so each group's host step starts as
soon as that group's gradients have landed, overlapping the rest of backward, and refreshes the
group's compute-dtype mirror right after (``CoherentOffload(cast_on="host")``), ready for the next
forward's copy-in. This module holds the wrapper (construction, ``step``, ``zero_grad``, state
dicts); it owns its parts, each in a module of this package: the inner optimizers, the host steps,
the streamed steps, the learned overlap, and the steps that finish after ``step()`` returned.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from torch.distributed.tensor import DTensor

from torch_fsdp_offload.optimizer.dtensor_grads import apply_scales, NORM_READS
from torch_fsdp_offload.optimizer.pending_updates import in_step
from torch_fsdp_offload.optimizer.arguments import (
    check_arguments,
    check_loadable,
    check_lr,
    check_optimizer_class,
    check_optimizer_kwargs,
    check_plain_tensor_arguments,
    class_defaults,
    implementation_kwargs,
    parameters_of,
    reclasses_user_tensors,
)
from torch_fsdp_offload.optimizer.finishing_steps import changed_by_step, FinishingSteps, zero_grads
from torch_fsdp_offload.optimizer.groups import attach_optimizer, managed_group, OffloadedGroup
from torch_fsdp_offload.optimizer.host_steps import HostSteps
from torch_fsdp_offload.optimizer.inner_optimizers import InnerOptimizers
from torch_fsdp_offload.optimizer.overlap import (
    CHANGED_AFTER_STEP,
    HYPERPARAMETERS_CHANGED,
    LearnedOverlap,
    OverlapState,
    SECOND_GRADIENT,
)
from torch_fsdp_offload.optimizer.streamed_steps import StreamedSteps

__all__ = ["OffloadOptimizer"]


class OffloadOptimizer(torch.optim.Optimizer):
    """Runs any ``torch.optim`` optimizer over a model sharded with ``CoherentOffload`` (FSDP2's
    ``fully_shard``, or the FSDP1 front door, whose handles it steps alike), stepping each
    offloaded parameter group on the host off the training loop's critical path.

    It is a ``torch.optim.Optimizer``: learning-rate schedulers, ``zero_grad``, ``state_dict`` /
    ``load_state_dict`` and ``torch.distributed.checkpoint.state_dict.get_state_dict`` work as
    with the wrapped class, and the state is keyed and shaped exactly as the wrapped class would
    keep it (a checkpoint can be loaded into either).

    By default it keeps ``torch.optim``'s contract exactly: nothing changes before ``step()``.
    Between ``backward()`` and ``step()`` the parameters, their gradients and ``state_dict()`` are
    what the wrapped class over plain FSDP2 shows, so ``clip_grad_norm_`` (or any change of the
    gradients) there is exact. ``step()`` clips (``max_grad_norm``), checks the norm
    (``skip_nonfinite``) and starts the host steps, then returns; they run under the next forward,
    each group's copy-in waiting for its own step (``overlap_next_forward``). Every read of a
    parameter or of its state before its step finished waits for it, so code after ``step()``
    sees the stepped values, as with ``torch.optim``.

    ``step_during_backward=True`` also steps a group during backward, as soon as its gradients
    landed: faster where the host steps outlast the next forward, but the parameters and the
    state then change before ``step()``. That is learned, never assumed: the first ``step()``
    runs every group after backward and watches how gradients arrive; it turns on only if each
    offloaded group received exactly one gradient per step and nothing modified the gradients
    between their arrival and ``step()``. If the pattern later changes, the step raises instead of
    applying a gradient twice or unclipped. Every in-place change of a gradient (foreach ops
    included) and every new ``.grad`` tensor is seen; a write through ``.grad.data`` is not.

    Args:
        params (nn.Module or iterable): the FSDP-sharded model, or its parameters / parameter
            groups as for any ``torch.optim`` optimizer.
        optimizer_class (type): the optimizer to run, e.g. ``torch.optim.AdamW``: any class
            whose step is elementwise (LBFGS, and over FSDP2's parameters SparseAdam, Adafactor
            and Muon, are refused). Host steps run it over plain aliases of the local shards,
            streamed ones over the GPU's copies. Adam and AdamW run with ``fused=True`` where
            neither ``fused``, ``foreach`` nor ``differentiable`` is given: the fused CPU kernel
            steps several times faster than the per-tensor loop (pass ``fused=False`` for that
            loop's rounding), and runs on DTensors too. SGD's and Adagrad's fused kernels do not:
            they run their default, as over plain FSDP2, unless ``fused=True`` is given.
        step_during_backward (bool): step groups during backward once it is known to be safe;
            breaks the contract above (parameters change before ``step()``). Needs the watched
            (re-classed) gradients of a torch without FSDP2's offload hooks. Default False.
        max_grad_norm (float or None): clip the global gradient norm to this value before
            stepping, exactly as ``clip_grad_norm_`` does. Default None.
        skip_nonfinite (bool): skip the whole step, and count it in :attr:`skipped_steps`, when
            the global gradient norm is inf or NaN (as AMP's ``GradScaler`` does); the gradients
            are left as they are for ``zero_grad()``. Default False.
        host_threads (int or None): CPU threads for host steps. Default: torch's intra-op
            thread count minus one, leaving a core to the thread that launches GPU work.
        overlap_next_forward (bool or None): let ``step()`` return while host steps, and the
            streamed groups' pipeline (in a thread and on a CUDA stream of its own), still run,
            each group's step finishing before the next forward copies that group in (groups whose
            gradients have landed are stepped newest first, which after backward is forward
            order). Reads of a parameter or of its optimizer state wait for its step, and so do
            ``zero_grad()``, ``state_dict()`` and ``load_state_dict()``: the parameters and
            their state are re-classed to a subclass until then. False: ``step()`` returns once every
            step has finished. Default None: True, except where FSDP2 runs the policy through
            its offload hooks (a torch with the RFC's patch), which keeps parameters and
            gradients plain DTensors, so no read could wait.
        **optimizer_kwargs: passed to ``optimizer_class``.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass (or is an
            instance, or ``OffloadOptimizer``), or one it cannot run (above); ``lr`` (also a
            parameter group's) is not a real number or a one-element tensor; ``max_grad_norm`` is
            not a real number or None; ``host_threads`` is not an int or None;
            ``step_during_backward`` or ``skip_nonfinite`` is not a bool, or
            ``overlap_next_forward`` not a bool or None; a tuple argument of the class is no tuple
            (``betas=0.9``); ``optimizer_class`` rejects the type of an ``optimizer_kwargs``
            value (the error names the argument).
        ValueError: ``step_during_backward=True`` or ``overlap_next_forward=True`` where FSDP2
            runs the policy through its offload hooks (both need re-classed tensors);
            ``lr`` is negative or not finite; ``max_grad_norm`` is not finite and
            positive; ``host_threads`` is below 1; ``skip_nonfinite`` with
            ``step_during_backward``; a tuple argument of another length than the class's default
            (``betas=(0.9,)``); ``fused=True`` for a class whose fused kernel does not run on the
            DTensors it would step (SGD, Adagrad over parameters no group offloads);
            ``optimizer_class`` rejects a value of ``optimizer_kwargs``. All are checked before
            anything is built.
        ValueError: at ``load_state_dict()``, for the state of another optimizer class or of
            another model (other parameter groups, or a state tensor of another shape).
        RuntimeError: at ``step()``, with ``step_during_backward``, when a group received a
            second gradient before ``step()``, or its gradients or the hyperparameters (lr, ...)
            were modified after it had stepped during backward: once, stepping nothing more;
            after ``zero_grad()`` training goes on. Schedulers that change the lr after ``step()``
            are fine: each group's step uses the values of the moment it was started.

    Example::

        >>> policy = CoherentOffload()
        >>> for block in model.blocks:
        ...     fully_shard(block, offload_policy=policy)
        >>> fully_shard(model, offload_policy=policy)
        >>> optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True)
        >>> scheduler = torch.optim.lr_scheduler.LinearLR(optim, 0.1, 1.0, total_iters=100)
        >>> for batch in loader:
        ...     model(batch).sum().backward()
        ...     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # exact
        ...     optim.step()
        ...     optim.zero_grad()
        ...     scheduler.step()
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        step_during_backward: bool = False,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        host_threads: int | None = None,
        overlap_next_forward: bool | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        check_arguments(
            OffloadOptimizer,
            optimizer_class,
            step_during_backward,
            max_grad_norm,
            host_threads,
            overlap_next_forward,
            skip_nonfinite,
        )
        if "lr" in optimizer_kwargs:
            check_lr(optimizer_kwargs["lr"], "lr")
        model = params if isinstance(params, nn.Module) else None
        params, tensors = parameters_of(model.parameters() if model is not None else params)
        # On FSDP2's offload hooks the parameters and gradients stay plain DTensors: nothing that
        # needs them re-classed (read guards, watched gradients) runs there.
        reclasses = reclasses_user_tensors(tensors)
        if not reclasses:
            check_plain_tensor_arguments(step_during_backward, overlap_next_forward)
        if overlap_next_forward is None:
            overlap_next_forward = reclasses
        check_optimizer_class(optimizer_class, tensors)
        check_optimizer_kwargs(optimizer_class, optimizer_kwargs)
        # A throwaway instance validates the kwargs as given (an error names only the caller's), and
        # yields the defaults; the implementation added to them (fused=True) is recorded as given.
        signature = inspect.signature(OffloadOptimizer.__init__).parameters.values()
        own_arguments = [argument.name for argument in signature if argument.kind is argument.KEYWORD_ONLY]
        defaults = class_defaults(optimizer_class, optimizer_kwargs, own_arguments)
        given, optimizer_kwargs = optimizer_kwargs, implementation_kwargs(optimizer_class, optimizer_kwargs, tensors)
        defaults.update({name: value for name, value in optimizer_kwargs.items() if name not in given})
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.host_threads = host_threads or max(1, torch.get_num_threads() - 1)
        # The parts, before the base class adds the parameter groups (add_param_group resets them).
        self._inner = InnerOptimizers(optimizer_class, optimizer_kwargs)
        self._finishing_steps = FinishingSteps()
        self._host_steps = HostSteps(self._inner, self._finishing_steps, self.host_threads)
        self._streamed_steps = StreamedSteps(self._inner, self._host_steps, self._finishing_steps)
        self._overlap = LearnedOverlap(watch_grads=reclasses)
        super().__init__(params, defaults)
        # The state a class creates at construction (Adagrad's), as over plain FSDP2.
        self.state.update(self._inner.initial_state(self.param_groups))
        # Where the policy was applied but offloads nothing (a unified-memory or GPU-less
        # platform), that is its decision for this machine, and the same script runs on
        # every machine: no warning then.
        if not any(managed_group(param) for group in self.param_groups for param in group["params"]):
            warnings.warn(
                "OffloadOptimizer: none of its parameters was sharded with CoherentOffload (the model was "
                "not sharded with fully_shard(..., offload_policy=CoherentOffload()) before this optimizer "
                f"was built), so it steps them as {optimizer_class.__name__} alone would. Use "
                f"{optimizer_class.__name__} itself, or shard the model with CoherentOffload before building "
                "this optimizer to offload it.",
                stacklevel=2,
            )
        # The parameters' names (by position, as state_dict() numbers them) for error messages.
        names = {id(param): name for name, param in model.named_parameters()} if model is not None else {}
        self._param_names = [names.get(id(p)) for group in self.param_groups for p in group["params"]]
        self.step_during_backward = step_during_backward
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        #: Steps skipped because the global gradient norm was inf or NaN (``skip_nonfinite``).
        self.skipped_steps = 0
        self.overlap_next_forward = overlap_next_forward
        if model is not None and overlap_next_forward:
            # Reading or replacing the model's parameters must see every step finished.
            optimizer_ref = weakref.ref(self)

            def synchronize_hook(*unused: Any) -> None:
                optimizer = optimizer_ref()
                if optimizer is not None:
                    optimizer.synchronize()

            model.register_state_dict_pre_hook(synchronize_hook)
            model.register_load_state_dict_pre_hook(synchronize_hook)
        #: Host seconds spent stepping offloaded groups in the last ``step()`` (waits for
        #: gradient copies included), whether they ran during backward or in ``step()``.
        self.last_host_step_seconds = 0.0
        #: The part of ``last_host_step_seconds`` spent waiting for gradient copies to land.
        self.last_host_wait_seconds = 0.0

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The optimizer state, keyed by parameter, as with the wrapped class; read outside a step
        while steps still run, it waits for them first (their state is what they change)."""
        finishing = self.__dict__.get("_finishing_steps")  # None on a copy torch.optim unpickled
        if finishing is not None and finishing.pending and not in_step():
            self.synchronize()
        return self.__dict__["state"]

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["state"] = value

    @property
    def last_stream_step_seconds(self) -> float:
        """Seconds spent in streamed (GPU) steps in the last ``step()``, copies included (with
        ``overlap_next_forward``, set by the pipeline's thread when it ends)."""
        return self._streamed_steps.last_seconds

    @property
    def norm_reads(self) -> dict[str, int]:
        """How norm ops (``clip_grad_norm_``'s) read offloaded gradients in this process so far:
        ``"served"`` from the norms computed as they landed, ``"computed"`` by the op itself (the
        gradient changed since it landed, or the op asked for another norm)."""
        return dict(NORM_READS)

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
        for owner in self._inner.owners():
            where = "device" if owner is None else "streamed" if owner in self._streamed_steps.groups else "host"
            counts[where] += self._inner.numel(owner)
        return counts

    def steps_in_flight(self) -> int:
        """How many groups' steps that ``step()`` started still run (with ``overlap_next_forward``
        they finish under the next forward; :meth:`synchronize` waits for them).

        Returns:
            int: groups whose step has not ended yet.

        Example::

            >>> optim.step()
            >>> optim.steps_in_flight()  # e.g. 12: the host steps run on
            >>> optim.synchronize(); optim.steps_in_flight()
            0
        """
        return len(self._finishing_steps.running())

    # -- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._build()
        self._wait_for_steps()
        self._host_steps.wait_norms()
        learned_safe = self._check_steps_during_backward()
        if not self._clip_or_skip():
            self._end_cycle()
            return loss
        # Taken before any step is submitted: a first step adds the state it creates meanwhile.
        offloaded = self._inner.offloaded_groups()
        guarded = {}
        if self.overlap_next_forward:
            guarded = {owner: changed_by_step(owner, self.state) for owner in offloaded}
        running = self._start_steps()
        # The gradients are plain DTensors again (a clip still to apply stays recorded).
        self._end_cycle(learned_safe)
        if self.overlap_next_forward:
            # Each group's next copy-in waits for its own step, and so does every read of its
            # parameters, their state and gradients; nothing else waits here.
            self._finishing_steps.hand_over(running, guarded)
        else:
            for future in running.values():
                future.result()
        self.last_host_step_seconds, self.last_host_wait_seconds = self._host_steps.take_seconds()
        if offloaded:
            offloaded[0].prefetch_next_forward()
        return loss

    def _check_steps_during_backward(self) -> bool:
        """Refuse the step where a group that stepped during backward did so with other
        hyperparameters or gradients than this step has; return whether the gradients arrived in
        the pattern that makes overlap safe."""
        stepped = self._host_steps.during_backward
        if stepped and self._overlap.received_twice():
            self._refuse_step(SECOND_GRADIENT)
        if any(self._inner.hyperparameters_changed(owner) for owner in stepped):
            self._refuse_step(HYPERPARAMETERS_CHANGED)
        # Reading gradient versions is safe while those groups still step in the worker.
        safe_pattern = self._overlap.pattern_is_safe(clipping=self.max_grad_norm is not None)
        if stepped and not safe_pattern:
            self._refuse_step(CHANGED_AFTER_STEP)
        return safe_pattern

    def _clip_or_skip(self) -> bool:
        """Clip the gradients to ``max_grad_norm``; return False, counting the skipped step, where
        ``skip_nonfinite`` skips it."""
        if self.max_grad_norm is None and not self.skip_nonfinite:
            return True
        total_norm = self._total_grad_norm()
        if self.skip_nonfinite and not _finite(total_norm):
            self.skipped_steps += 1
            for group in self.param_groups:
                for param in group["params"]:
                    apply_scales(param.grad)  # a clip by the user before step()
            return False
        if self.max_grad_norm is not None:
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total_norm)
        return True

    def _start_steps(self) -> dict[OffloadedGroup, concurrent.futures.Future]:
        """Step every group that did not step during backward: the host groups and the streamed
        pipeline at once (host cores step theirs while the link and the GPU step the streamed
        ones), then the parameters no group offloads. Return the futures of the steps that may
        still run."""
        todo = [owner for owner in self._inner.offloaded_groups() if owner not in self._host_steps.during_backward]
        streamed = [owner for owner in todo if owner in self._streamed_steps.groups]
        host = [owner for owner in todo if owner not in self._streamed_steps.groups]
        running = self._host_steps.start(host, in_background=bool(streamed) or self.overlap_next_forward)
        running.update(self._streamed_steps.start(streamed, in_background=self.overlap_next_forward))
        self._inner.step_resident()
        return running

    def _refuse_step(self, message: str) -> None:
        """Let the groups already stepping finish, forget this cycle, and raise ``message``."""
        for future in self._host_steps.during_backward.values():
            future.result()
        self._end_cycle()
        raise RuntimeError(message)

    def _end_cycle(self, learned_safe: bool = False) -> None:
        self._host_steps.end_cycle()
        self._overlap.end_cycle(learned_safe)

    def _total_grad_norm(self) -> torch.Tensor:
        """The global 2-norm of every gradient, as ``clip_grad_norm_`` computes it."""
        for owner in self._inner.offloaded_groups():
            owner.wait_grads()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, 2.0)

    # -- landings ----------------------------------------------------------------------------
    def _build(self) -> None:
        if not self._inner.built:
            offloaded = self._inner.build(self.param_groups, self.state)
            for owner in offloaded:
                attach_optimizer(owner, self)
            self._streamed_steps.choose(offloaded)

    def _on_grads_ready(self, owner: OffloadedGroup, is_last_backward: bool) -> None:
        """``owner``'s gradient copy to the host was issued (:func:`notify_grads_ready`)."""
        if is_last_backward or owner in self._host_steps.during_backward:
            # A backward the user marked as not the last (set_requires_gradient_sync(False) or
            # set_is_last_backward(False)) accumulates: the landing that counts is the last one's,
            # unless the group already stepped.
            self._overlap.on_landing(owner)
        if owner in self._host_steps.during_backward:
            # It stepped with its first gradient: step() refuses this one. Raising here, inside
            # FSDP's backward, would leave that backward half run and the model unusable.
            return
        if not self.step_during_backward and is_last_backward and self._overlap.watch_grads:
            # The host is idle until step(): compute the group's gradient norms as they land, for
            # clip_grad_norm_ (the user's, or max_grad_norm's) to read from the watched gradients.
            self._host_steps.compute_norms_on_landing(owner)
        overlapping = self.step_during_backward and self._overlap.state is OverlapState.ON and is_last_backward
        if not overlapping or owner in self._streamed_steps.groups:
            return
        self._build()
        self._host_steps.start_during_backward(owner)

    # -- public ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every step has finished (only host steps and the streamed groups' pipeline
        of ``overlap_next_forward`` can still run after ``step()`` returned); re-raise an error a
        step raised.

        Call it also before dropping the model and the optimizer: a step still running holds the
        optimizer's parts (its inner optimizers and their state), and through them the groups'
        memory, until it ends (and the model, whose FSDP state holds reference cycles, then waits
        for the next garbage collection); so does a gradient norm still computed in the host's
        pool, which it waits for too.

        Example::

            >>> optim.step()
            >>> optim.synchronize()
            >>> log_norms(model)  # reads the updated parameters
        """
        self._wait_for_steps()
        self._host_steps.wait_norms(computed=True)

    def _wait_for_steps(self) -> None:
        """Wait until every step has finished (what ``step()`` waits for before it starts its own:
        not the gradient norms, which it needs started only)."""
        self._finishing_steps.wait()
        self._streamed_steps.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        deferred = self._finishing_steps.defer_zero_grad(set_to_none)
        skip = {id(param) for owner in deferred for param in owner.params}
        zero_grads([p for group in self.param_groups for p in group["params"] if id(p) not in skip], set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loadable(self, state_dict, self._param_names)
        self.synchronize()
        super().load_state_dict(state_dict)
        # Loaded state is new tensors: streamed groups move it into their flat buffers again.
        self._streamed_steps.forget_state()
        self._inner.use_state(self.state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "lr" in param_group:
            check_lr(param_group["lr"], f"param_groups[{len(self.param_groups)}]['lr']")
        super().add_param_group(param_group)
        self._inner.forget()  # rebuilt with the new group at the next step


def _finite(norm: torch.Tensor) -> bool:
    """Whether a global norm (a DTensor partial norm, or a tensor) is finite on every rank."""
    return bool(torch.isfinite(norm.full_tensor() if isinstance(norm, DTensor) else norm).all())
