"""What ``OffloadOptimizer`` refuses, checked before it builds or changes anything: its arguments,
and optimizer state of another class or another model at ``load_state_dict``."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import torch


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
        ("overlap_next_forward", overlap_next_forward),
        ("skip_nonfinite", skip_nonfinite),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"OffloadOptimizer({name}={value!r}) must be True or False.")
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


def fused_by_default(optimizer_class: type, optimizer_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_kwargs`` with ``fused=True`` added where ``optimizer_class`` takes ``fused`` and
    the caller chose no implementation (``fused``, ``foreach``) and no ``differentiable`` step,
    which the fused kernels refuse."""
    if any(key in optimizer_kwargs for key in ("fused", "foreach")) or optimizer_kwargs.get("differentiable"):
        return optimizer_kwargs
    try:
        takes_fused = "fused" in inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: leave the arguments as given
        return optimizer_kwargs
    return {**optimizer_kwargs, "fused": True} if takes_fused else optimizer_kwargs
