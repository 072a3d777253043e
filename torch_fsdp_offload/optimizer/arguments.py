"""What ``OffloadOptimizer`` refuses, checked before it builds or changes anything: its arguments,
and optimizer state of another class or another model at ``load_state_dict``."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torch_fsdp_offload.optimizer.groups import managed_group, offloaded_group


def check_arguments(
    wrapper: type,
    optimizer_class: Any,
    step_during_backward: Any,
    max_grad_norm: Any,
    host_threads: Any,
    overlap_next_forward: Any,
    skip_nonfinite: Any,
) -> None:
    """Refuse OffloadOptimizer's own arguments, naming the bad value and what is expected."""
    if isinstance(optimizer_class, torch.optim.Optimizer):
        name = type(optimizer_class).__name__
        raise TypeError(
            f"OffloadOptimizer(optimizer_class=...) got an instance of {name}: pass the class itself, not an "
            f"instance, with its arguments as keywords: OffloadOptimizer(model, {name}, lr=...)."
        )
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"OffloadOptimizer(optimizer_class={optimizer_class!r}) must be a torch.optim."
            "Optimizer subclass, e.g. torch.optim.AdamW."
        )
    if issubclass(optimizer_class, wrapper):
        raise TypeError(
            f"OffloadOptimizer(optimizer_class={optimizer_class.__name__}) cannot wrap itself: pass the "
            "optimizer to run, e.g. torch.optim.AdamW."
        )
    for name, value in (
        ("step_during_backward", step_during_backward),
        ("skip_nonfinite", skip_nonfinite),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"OffloadOptimizer({name}={value!r}) must be True or False.")
    if overlap_next_forward is not None and not isinstance(overlap_next_forward, bool):
        raise TypeError(f"OffloadOptimizer(overlap_next_forward={overlap_next_forward!r}) must be True, False or None.")
    if skip_nonfinite and step_during_backward:
        raise ValueError(
            "OffloadOptimizer(skip_nonfinite=True, step_during_backward=True): a step skipped for a non-finite "
            "gradient norm cannot be undone in groups that already stepped during backward. Keep "
            "step_during_backward=False (the default), which steps nothing before step()."
        )
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
            raise TypeError(
                f"OffloadOptimizer(max_grad_norm={max_grad_norm!r}) must be a real number > 0 or None "
                "(the global gradient norm to clip to, e.g. 1.0)."
            )
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(
                f"OffloadOptimizer(max_grad_norm={max_grad_norm!r}) must be finite and > 0, e.g. 1.0; "
                "None does not clip."
            )
    if host_threads is not None:
        is_int = isinstance(host_threads, numbers.Integral) and not isinstance(host_threads, bool)
        if not is_int or host_threads < 1:
            raise (ValueError if is_int else TypeError)(
                f"OffloadOptimizer(host_threads={host_threads!r}) must be an int >= 1 or None (CPU threads "
                "for host steps; None: torch's intra-op thread count minus one)."
            )


def parameters_of(params: Any) -> tuple[Any, list[torch.Tensor]]:
    """An optimizer's ``params`` argument readable twice (iterators read once, here), and the tensors
    it holds: parameters, parameter groups' ``params``, ``(name, tensor)`` pairs. Anything else is
    left for torch.optim to refuse."""
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        return params, []
    items = [
        {**item, "params": list(item["params"])} if isinstance(item, dict) and isinstance(item.get("params"), Iterator) else item
        for item in params
    ]
    tensors = []
    for item in items:
        group = item.get("params", ()) if isinstance(item, dict) else (item,)
        for entry in (group,) if isinstance(group, torch.Tensor) else group:
            tensor = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
            if isinstance(tensor, torch.Tensor):
                tensors.append(tensor)
    return items, tensors


def reclasses_user_tensors(tensors: list[torch.Tensor]) -> bool:
    """Whether the optimizer may re-class these parameters and their gradients: False where a group
    holding one runs through FSDP2's offload hooks (a patched torch), which keeps them plain."""
    return all(owner is None or owner.reclasses_user_tensors for owner in map(managed_group, tensors))


def check_plain_tensor_arguments(step_during_backward: bool, overlap_next_forward: bool | None) -> None:
    """Refuse, on FSDP2's offload hooks, what needs re-classed tensors: a step during backward must
    see every in-place change of a gradient, and ``step()`` returning before its host steps end
    needs every read of a parameter to wait for its step."""
    hooks = "on this torch FSDP2 runs CoherentOffload through its offload-policy hooks, which keep the "
    if step_during_backward:
        raise ValueError(
            "OffloadOptimizer(step_during_backward=True): "
            + hooks
            + "gradients plain DTensors, and a clip_grad_norm_ between backward and step() (an in-place "
            "foreach op, which bumps no version counter of a DTensor) could not be seen. Keep "
            "step_during_backward=False (the default): host steps then start at step(), exact whatever "
            "changed the gradients."
        )
    if overlap_next_forward:
        raise ValueError(
            "OffloadOptimizer(overlap_next_forward=True): "
            + hooks
            + "parameters plain DTensors, so a read of one before its host step ended could not wait for it. "
            "Leave overlap_next_forward unset (None): step() then returns once every host step ended."
        )


def check_lr(lr: Any, name: str) -> None:
    """Refuse a learning rate torch.optim would take and fail on (or train with) later."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"OffloadOptimizer({name}={lr!r}) must be a one-element tensor or a real number, e.g. 1e-4.")
        value = lr.item()
    elif isinstance(lr, numbers.Real) and not isinstance(lr, bool):
        value = lr
    else:
        raise TypeError(f"OffloadOptimizer({name}={lr!r}) must be a real number or a one-element tensor, e.g. 1e-4.")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"OffloadOptimizer({name}={lr!r}) must be finite and >= 0, e.g. 1e-4.")


def check_loadable(optimizer: Any, state_dict: dict[str, Any], param_names: list[str | None]) -> None:
    """Refuse, naming the mismatch, ``state_dict`` for ``optimizer`` (an ``OffloadOptimizer``) when it
    is the state of another optimizer class or another model: torch.optim would load a state tensor
    of another shape and fail, or step wrongly, later. ``param_names``: by position, as the state
    numbers the parameters (None where unknown)."""
    where = "OffloadOptimizer.load_state_dict"
    same_model = "Load the state saved from this model, built with the same configuration and parameter groups."
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{where}: the state holds {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(optimizer.param_groups)}. {same_model}"
        )
    name = optimizer.optimizer_class.__name__
    probe = optimizer.optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer.optimizer_kwargs)
    for index, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{where}: saved parameter group {index} holds {len(saved['params'])} parameters, "
                f"this optimizer's holds {len(group['params'])}. {same_model}"
            )
        # What the class itself fills in for a state of an older release is not missing.
        probe.__setstate__({"state": {}, "param_groups": [{**saved, "params": probe.param_groups[0]["params"]}]})
        missing = sorted(set(optimizer.defaults) - set(probe.param_groups[0]))
        if missing:
            extra = sorted(set(saved) - set(optimizer.defaults) - {"params", "initial_lr"})  # initial_lr: schedulers'
            raise ValueError(
                f"{where}: the state was saved by another optimizer class than {name}: its parameter groups "
                f"lack {', '.join(missing)} (and have {', '.join(extra) or 'nothing else'}). Load a checkpoint "
                f"of {name}, or build OffloadOptimizer(model, <the class that saved it>, ...) to load this one."
            )
    params = [param for group in optimizer.param_groups for param in group["params"]]
    position = {saved_id: index for index, saved_id in enumerate(i for g in saved_groups for i in g["params"])}
    for saved_id, saved_state in state_dict["state"].items():
        index = position.get(saved_id)
        if index is None:
            continue
        for key, value in saved_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                param_name = param_names[index] if index < len(param_names) else None
                label = f"'{param_name}' (index {index})" if param_name else f"{index}"
                raise ValueError(
                    f"{where}: parameter {label}: the saved state '{key}' has shape {tuple(value.shape)}, "
                    f"this parameter has shape {tuple(params[index].shape)}. The state is of another "
                    f"model: load one saved from this model, built with the same model configuration."
                )


# The classes whose fused kernels run on every tensor OffloadOptimizer steps: plain shards on the
# host and the GPU, and FSDP2's DTensor parameters (those no group offloads; plain FSDP2's, which
# the contract compares with). torch registers DTensor sharding strategies for the fused Adam and
# AdamW kernels only: SGD's and Adagrad's fused kernels fail on a DTensor.
_FUSED_ON_DTENSORS = (torch.optim.Adam, torch.optim.AdamW)
# Devices with fused Adam and AdamW kernels: the host steps on the CPU, the streamed ones on CUDA.
_FUSED_DEVICES = ("cpu", "cuda")
# Classes whose step is not elementwise (Adafactor's row and column means, Muon's orthogonalization):
# stepped shard by shard, as OffloadOptimizer steps FSDP2's parameters, they would not take their step.
_NOT_ELEMENTWISE = (torch.optim.Adafactor, torch.optim.Muon)


def check_optimizer_class(optimizer_class: type, params: list[torch.Tensor]) -> None:
    """Refuse a ``torch.optim`` class OffloadOptimizer cannot run over ``params``."""
    name = optimizer_class.__name__
    if issubclass(optimizer_class, torch.optim.LBFGS):
        raise TypeError(
            f"OffloadOptimizer(optimizer_class={name}) cannot run it: LBFGS re-evaluates the model through "
            "its closure several times in one step over all parameters at once, while OffloadOptimizer "
            "steps each offloaded group on its own. Use torch.optim.LBFGS itself over the model's "
            "parameters, or a first-order optimizer such as torch.optim.AdamW."
        )
    if not any(isinstance(param, DTensor) for param in params):
        return
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        raise TypeError(
            f"OffloadOptimizer(optimizer_class={name}) cannot step FSDP2's sharded parameters: it steps "
            "sparse gradients only, and FSDP2 reduces every gradient to a dense DTensor. Use "
            "torch.optim.Adam (or AdamW) for a sharded model."
        )
    if issubclass(optimizer_class, _NOT_ELEMENTWISE):
        raise TypeError(
            f"OffloadOptimizer(optimizer_class={name}) cannot step FSDP2's sharded parameters: {name}'s "
            "step is not elementwise (an element's update reads others of its parameter), and "
            "OffloadOptimizer steps each rank's shard of a parameter on its own. Use an elementwise "
            "optimizer such as torch.optim.AdamW."
        )


def check_optimizer_kwargs(optimizer_class: type, optimizer_kwargs: dict[str, Any]) -> None:
    """Refuse, naming the argument, a tuple-valued argument whose length is not the class's default's
    (``betas=(0.9,)``): torch.optim reads it by position and fails deep inside, or at the first step."""
    try:
        signature = inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: the class checks its arguments itself
        return
    for name, value in optimizer_kwargs.items():
        default = signature[name].default if name in signature else None
        if isinstance(default, tuple) and not (isinstance(value, (tuple, list)) and len(value) == len(default)):
            raise (ValueError if isinstance(value, (tuple, list)) else TypeError)(
                f"OffloadOptimizer: {optimizer_class.__name__}({name}={value!r}) must be a tuple of "
                f"{len(default)} values, like its default {name}={default!r}."
            )


def class_defaults(optimizer_class: type, optimizer_kwargs: dict[str, Any], own_arguments: Iterable[str]) -> dict[str, Any]:
    """The defaults of ``optimizer_class`` built with ``optimizer_kwargs`` over a placeholder
    parameter; where it refuses them, an error naming the arguments it refuses (those without which
    it takes the rest, else all). ``own_arguments``: OffloadOptimizer's, named where the class got a
    keyword it does not take."""

    def build(kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        return optimizer_class([torch.zeros(1, requires_grad=True)], **kwargs)

    try:
        return build(optimizer_kwargs).defaults
    except Exception as error:  # noqa: BLE001 - whatever the class raises, it refused the arguments
        refused = []
        for name in optimizer_kwargs:
            try:
                build({key: value for key, value in optimizer_kwargs.items() if key != name})
            except Exception:  # noqa: BLE001 - another argument is refused too
                continue
            refused.append(name)
        given = ", ".join(f"{name}={optimizer_kwargs[name]!r}" for name in refused or optimizer_kwargs)
        name = optimizer_class.__name__
        hint = f"Pass the keyword arguments {name} takes, with valid values"
        if isinstance(error, TypeError) and "unexpected keyword" in str(error):
            hint += f"; OffloadOptimizer's own arguments are {', '.join(own_arguments)}"
        raise (TypeError if isinstance(error, TypeError) else ValueError)(
            f"OffloadOptimizer: {name}({given}) refused the optimizer arguments: {error}. {hint}."
        ) from error


def implementation_kwargs(optimizer_class: type, optimizer_kwargs: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """``optimizer_kwargs`` with ``fused=True`` added where ``optimizer_class``'s fused kernel runs on
    every tensor it will step, and on plain FSDP2's (:data:`_FUSED_ON_DTENSORS`, real floating-point
    parameters on the CPU or CUDA), and the caller chose no implementation (``fused``, ``foreach``)
    and no ``differentiable`` step, which the fused kernels refuse. An explicit ``fused=True`` the
    class cannot run on the DTensors it would step (parameters no group offloads) is refused here:
    it would fail at the first ``step()``."""
    name = optimizer_class.__name__
    stepped_as_dtensors = [p for p in params if isinstance(p, DTensor) and offloaded_group(p) is None]
    if optimizer_kwargs.get("fused") and stepped_as_dtensors and not issubclass(optimizer_class, _FUSED_ON_DTENSORS):
        raise ValueError(
            f"OffloadOptimizer({name}, fused=True): {name}'s fused kernel does not run on DTensors (torch has "
            f"fused DTensor kernels for Adam and AdamW only), and {len(stepped_as_dtensors)} of these FSDP2 "
            "parameters would step as DTensors: no offloaded group holds them (sharded without "
            f"CoherentOffload, or on a platform that copies nothing). Drop fused=True ({name} then runs its "
            "default implementation, as over plain FSDP2), or use torch.optim.AdamW or Adam."
        )
    if any(key in optimizer_kwargs for key in ("fused", "foreach")) or optimizer_kwargs.get("differentiable"):
        return optimizer_kwargs
    try:
        takes_fused = "fused" in inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: leave the arguments as given
        return optimizer_kwargs
    runs_fused = takes_fused and issubclass(optimizer_class, _FUSED_ON_DTENSORS) and all(
        torch.is_floating_point(param) and param.device.type in _FUSED_DEVICES for param in params
    )
    return {**optimizer_kwargs, "fused": True} if runs_fused else optimizer_kwargs
