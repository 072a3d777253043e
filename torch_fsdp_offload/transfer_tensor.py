"""``TransferTensor``: a tensor in host memory that GPU operations take directly.

PyTorch refuses an operation that mixes a CPU tensor with CUDA tensors, so host data must first be
copied explicitly (``t.pin_memory().cuda(non_blocking=True)``). On machines whose GPU reads host
memory directly (DGX Spark, GH200/GB200) that copy only duplicates memory. A ``TransferTensor``
keeps its bytes in pinned or managed host memory and, through ``__torch_function__``, hands an
operation that runs on the GPU either a zero-copy device alias of those bytes (UNIFIED, COHERENT)
or a copy made by the transfer engine on its H2D stream (DISCRETE). Operations on the CPU use the
host bytes in place.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Sequence, Union

import torch

from torch_fsdp_offload._helpers.tensors import (
    disable_torch_function_subclass,
    make_subclass,
    parse_to_device,
    pytree,
    tensor_str,
)
from torch_fsdp_offload.device_memory import device_view, managed_empty
from torch_fsdp_offload.memory import pinned_empty
from torch_fsdp_offload.platform import detect_platform, Platform, PlatformKind
from torch_fsdp_offload.transfer import get_transfer_engine

__all__ = ["TransferTensor"]

_MEMORY_KINDS = ("auto", "pinned", "managed")

PlatformLike = Union[Platform, PlatformKind, str, None]

# These must see the TransferTensor itself: autograd has to reach the leaf, not a device copy of
# it, and ``copy_`` across devices is an explicit copy PyTorch already does in one step.
_NATIVE_FUNCTIONS = frozenset(
    {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward, torch.Tensor.copy_}
)
_DESCRIPTOR_NAMES = frozenset({"__get__", "__set__", "__delete__"})
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)


def _resolve_platform(platform: PlatformLike) -> Platform:
    if isinstance(platform, Platform):
        return platform
    if platform is None:
        return detect_platform()
    return detect_platform(kind=platform)


def _checked_shape(size: Any) -> tuple[int, ...]:
    """``size`` as a shape tuple; a clear error, naming the entry, for anything that is not one."""
    expected = "an int or a sequence of ints >= 0, e.g. 1024 or (4, 1024)"
    if isinstance(size, (str, bytes, bool)) or not (_is_index(size) or isinstance(size, Sequence)):
        raise TypeError(f"TransferTensor.empty(size=...) takes {expected}, got {type(size).__name__} {size!r}")
    dims = (size,) if _is_index(size) else tuple(size)
    for dim in dims:
        if isinstance(dim, bool) or not _is_index(dim):
            raise TypeError(
                f"TransferTensor.empty(size={size!r}) takes {expected}; entry {dim!r} is a "
                f"{type(dim).__name__}"
            )
        if operator.index(dim) < 0:
            raise ValueError(f"TransferTensor.empty(size={size!r}) takes {expected}; entry {dim} is negative")
    return tuple(operator.index(dim) for dim in dims)


def _is_index(value: Any) -> bool:
    # An integer as Python's indexing sees it: int, NumPy integers, 0-d integer tensors.
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _normalize_device(device: torch.device) -> torch.device:
    # Tensors always report an index; a platform may say just "cuda".
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _host_alias(transfer_tensor: "TransferTensor") -> torch.Tensor:
    """A plain ``torch.Tensor`` over the same host bytes that stays in the autograd graph."""
    with disable_torch_function_subclass():
        return transfer_tensor.as_subclass(torch.Tensor)


@dataclasses.dataclass(eq=False)
class _HostBytes:
    """What every TransferTensor over one host allocation (the tensor and its detached aliases)
    shares."""

    memory: str
    platform: Platform
    # Keeps a managed allocation (and its device pointer) alive; None for pinned memory.
    managed_buffer: Any
    # The last H2D copy or GPU operation reading the bytes (anything with synchronize()).
    pending_device_read: Any = None


class _HostToDevice(torch.autograd.Function):
    """Hands a TransferTensor's bytes to the device; backward moves the gradient to the host."""

    @staticmethod
    def forward(ctx, host: torch.Tensor, to_device: Callable[[], torch.Tensor], platform: Platform):
        ctx.platform = platform
        return to_device()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        device = ctx.platform.device
        engine = get_transfer_engine(device)
        # Pinned, so the copy down runs at link speed and the host gradient can go up again fast.
        pin_device = device if device.type == "cuda" else None
        host_grad = pinned_empty(grad.shape, grad.dtype, device=pin_device)
        # The autograd engine reads the host gradient right after backward returns.
        engine.d2h(grad.contiguous(), host_grad, label="transfer_tensor_grad").synchronize()
        return host_grad, None, None


class TransferTensor(torch.Tensor):
    """A CPU tensor whose bytes live in pinned or managed host memory, and which operations on the
    GPU accept directly.

    It is a real CPU tensor (``device`` is ``cpu``): operations whose other tensors are on the CPU
    run on the CPU against the host bytes, so ``torch.add(a, b, out=t)`` writes into host memory.
    An operation that mixes it with tensors on the platform's GPU runs on the GPU and sees:

    - on UNIFIED and COHERENT platforms, a zero-copy device alias of the host bytes (pinned memory
      through :func:`~torch_fsdp_offload.memory.device_view`, managed memory through the managed
      allocation's device pointer); nothing is copied;
    - on DISCRETE platforms, a copy issued by the transfer engine on its H2D stream; the
      operation's stream waits on the copy's event, not on the whole H2D stream.

    Autograd flows through the move: a leaf ``TransferTensor`` with ``requires_grad=True``
    receives its ``.grad`` on the host (pinned), brought down by the transfer engine.

    Ordering with the host: a GPU operation that writes into a ``TransferTensor`` (``out=``,
    in-place) returns once the result is in host memory, and an operation that writes into it
    (on the CPU or the GPU) first waits until earlier GPU operations have finished reading it;
    writes through a plain alias of the bytes (``.cpu()``, ``.data``, a view) bypass that wait. On
    UNIFIED and COHERENT platforms autograd may keep the device alias for backward: do not write
    into the tensor between a forward that reads it and that backward (PyTorch cannot see the
    write there and would not raise, unlike for an ordinary tensor).

    Results of operations are plain tensors. ``.cpu()``, ``.to(...)`` and ``.cuda()`` also return
    plain tensors: ``.cpu()`` and ``.to(dtype)`` alias or convert the host bytes, ``.cuda()`` and
    ``.to("cuda")`` give the same device tensor an operation would see, so on UNIFIED and COHERENT
    platforms they alias host memory (pass ``copy=True`` to ``.to`` for a private copy).

    ``torch.save`` stores the data; ``torch.load`` (also with ``weights_only=True`` once this module
    is imported) gives back a ``TransferTensor`` in pinned memory on the platform detected at load
    time (plain host memory where the machine has no accelerator), whatever kind it was saved from.

    Create one with :meth:`empty` or :meth:`from_tensor`; the constructor is not public.

    Raises:
        RuntimeError: an operation mixes it with tensors on a GPU other than its platform's, or
            with tensors on two GPUs; or a GPU operation writes into one that requires grad while
            grad mode is on. Raised before anything is copied.
        TypeError: ``TransferTensor(...)`` is called directly.

    Example::

        >>> x, y = torch.randn(1 << 20), torch.randn(1 << 20)
        >>> t = TransferTensor.empty(1 << 20)           # pinned host memory
        >>> torch.add(x, y, out=t)                      # runs on the CPU, writes host memory
        >>> z = torch.randn(1 << 20, device="cuda")
        >>> out = torch.add(t, z)                       # runs on the GPU, out is a CUDA tensor
    """

    _host_bytes: _HostBytes

    def __new__(cls, *args, **kwargs):
        raise TypeError(
            "TransferTensor cannot be constructed directly; use TransferTensor.empty(shape, ...) "
            "or TransferTensor.from_tensor(tensor, ...)"
        )

    @classmethod
    def empty(
        cls,
        size: Union[int, Sequence[int]],
        dtype: torch.dtype | None = None,
        *,
        memory: str = "auto",
        platform: PlatformLike = None,
        requires_grad: bool = False,
    ) -> "TransferTensor":
        """Allocate an uninitialized ``TransferTensor`` in host memory of the given kind.

        Args:
            size (int or sequence of int): the shape.
            dtype (torch.dtype, optional): defaults to ``torch.get_default_dtype()``.
            memory (str): ``"pinned"`` (page-locked, exact size; the fast DMA source on DISCRETE
                and the better choice for streaming access on UNIFIED, where it bypasses the GPU
                L2 coherence protocol), ``"managed"`` (``cudaMallocManaged``; cached in GPU L2 on
                UNIFIED machines, choose it when L2 reuse matters), or ``"auto"`` (pinned, the
                recommended starting point everywhere). Default: ``"auto"``.
            platform (Platform, PlatformKind or str, optional): the platform whose GPU the
                tensor serves; a kind (``"discrete"``, ...) is passed to
                :func:`~torch_fsdp_offload.platform.detect_platform` as an override. Default:
                the detected platform.
            requires_grad (bool): make it an autograd leaf. Default: ``False``.

        Raises:
            TypeError: ``size`` is not an int or a sequence of ints (a float, a string or a bool
                is refused), ``dtype`` not a ``torch.dtype``, or ``requires_grad`` not a bool.
            ValueError: a negative entry of ``size``; ``memory`` is not one of ``"auto"``,
                ``"pinned"``, ``"managed"``, or ``"managed"`` is asked on a platform without
                managed memory. Raised before anything is allocated.
            HostMemoryError: not enough (lockable) host memory for the allocation.

        Example::

            >>> t = TransferTensor.empty((4, 1024), torch.bfloat16, memory="pinned")
            >>> t.memory
            'pinned'
        """
        shape = _checked_shape(size)
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"TransferTensor.empty(dtype=...) takes a torch.dtype (e.g. torch.float32), got {dtype!r}")
        if not isinstance(requires_grad, bool):
            raise TypeError(f"TransferTensor requires_grad takes True or False, got {requires_grad!r}")
        resolved_memory, resolved_platform = cls._check_memory(memory, platform)
        managed_buffer = None
        if resolved_memory == "managed":
            managed_buffer = managed_empty(shape, dtype, resolved_platform.device)
            host = managed_buffer.host_view
        else:
            device = resolved_platform.device if resolved_platform.device.type != "cpu" else None
            host = pinned_empty(shape, dtype, device=device)
        host_bytes = _HostBytes(resolved_memory, resolved_platform, managed_buffer)
        return cls._wrap(host, host_bytes, requires_grad)

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        *,
        memory: str = "auto",
        platform: PlatformLike = None,
        requires_grad: bool = False,
    ) -> "TransferTensor":
        """Copy ``tensor`` (on any device) into a new ``TransferTensor``.

        Args:
            tensor (torch.Tensor): the data; its shape and dtype are kept. The copy is detached
                from ``tensor``'s autograd graph.
            memory (str): as in :meth:`empty`. Default: ``"auto"``.
            platform (Platform, PlatformKind or str, optional): as in :meth:`empty`.
            requires_grad (bool): make the result an autograd leaf. Default: ``False``.

        Raises:
            TypeError: ``tensor`` is not a ``torch.Tensor``, or ``requires_grad`` not a bool.
            ValueError: as in :meth:`empty`, before anything is allocated.
            HostMemoryError: not enough (lockable) host memory for the allocation.

        Example::

            >>> w = TransferTensor.from_tensor(torch.randn(1024, 1024), requires_grad=True)
            >>> loss = (w @ torch.randn(1024, device="cuda")).sum()
            >>> loss.backward()       # w.grad is a CPU tensor
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"TransferTensor.from_tensor(tensor=...) copies a torch.Tensor, got "
                f"{type(tensor).__name__} {tensor!r:.80}; convert it first, e.g. "
                "TransferTensor.from_tensor(torch.as_tensor(data))"
            )
        if not isinstance(requires_grad, bool):
            raise TypeError(f"TransferTensor requires_grad takes True or False, got {requires_grad!r}")
        result = cls.empty(
            tensor.shape, tensor.dtype, memory=memory, platform=platform, requires_grad=False
        )
        with torch.no_grad(), disable_torch_function_subclass():
            result.copy_(tensor.detach())
        return result.requires_grad_(requires_grad)

    @staticmethod
    def _check_memory(memory: str, platform: PlatformLike) -> tuple[str, Platform]:
        if memory not in _MEMORY_KINDS:
            raise ValueError(
                f"unknown memory kind {memory!r} for TransferTensor; use one of "
                f"{', '.join(repr(kind) for kind in _MEMORY_KINDS)}"
            )
        resolved_platform = _resolve_platform(platform)
        # Pinned is the talk's recommended default on every platform; managed only pays where
        # GPU L2 reuse of host-resident data matters, which only the caller knows.
        resolved_memory = "pinned" if memory == "auto" else memory
        if resolved_memory == "managed" and not resolved_platform.supports_managed_memory:
            raise ValueError(
                f"memory='managed' needs a GPU with managed memory, but this platform is "
                f"{resolved_platform.kind.value} on {resolved_platform.device} "
                f"({resolved_platform.reason}); use memory='pinned' or memory='auto'"
            )
        return resolved_memory, resolved_platform

    @classmethod
    def _wrap(cls, host: torch.Tensor, host_bytes: _HostBytes, requires_grad: bool) -> "TransferTensor":
        result = make_subclass(cls, host, requires_grad)
        result._host_bytes = host_bytes
        return result

    @property
    def memory(self) -> str:
        """The host memory kind: ``"pinned"`` or ``"managed"``."""
        return self._host_bytes.memory

    @property
    def platform(self) -> Platform:
        """The platform whose GPU this tensor's bytes are handed to."""
        return self._host_bytes.platform

    @property
    def home_device(self) -> torch.device:
        """The device that operations mixing this tensor with device tensors run on."""
        return _normalize_device(self._host_bytes.platform.device)

    @property
    def zero_copy(self) -> bool:
        """Whether the device reads the host bytes in place (everything but DISCRETE)."""
        return self._host_bytes.platform.kind is not PlatformKind.DISCRETE

    def _device_data(self, device: torch.device, *, need_data: bool = True) -> torch.Tensor:
        """The bytes as the device sees them, outside autograd: an alias or an engine copy."""
        with disable_torch_function_subclass():
            host = self.detach()
        if self.zero_copy:
            if device.type == "cpu":
                return host
            if self._host_bytes.managed_buffer is not None:
                return self._host_bytes.managed_buffer.device_tensor.detach()
            return device_view(host, device)
        if not need_data:
            return torch.empty(host.shape, dtype=host.dtype, device=device)
        transfer = get_transfer_engine(device).h2d(host, label="transfer_tensor")
        self._host_bytes.pending_device_read = transfer
        return transfer.wait()

    def _read_form(self, device: torch.device) -> torch.Tensor:
        """The bytes on ``device`` as an operation reads them, inside autograd."""
        if self.zero_copy and device.type == "cpu":
            return _host_alias(self)
        return _HostToDevice.apply(
            _host_alias(self), lambda: self._device_data(device), self._host_bytes.platform
        )

    def _write_form(self, device: torch.device, reads_old_data: bool) -> torch.Tensor:
        if torch.is_grad_enabled() and self.requires_grad:
            raise RuntimeError(
                "a TransferTensor that requires grad cannot be written by an operation on "
                f"{device} (out= or in-place); run the operation under torch.no_grad()"
            )
        return self._device_data(device, need_data=reads_old_data)

    def _wait_for_device_reads(self) -> None:
        """Blocks until no queued GPU work reads the host bytes any more, before they change."""
        host_bytes = self._host_bytes
        if host_bytes.pending_device_read is not None:
            host_bytes.pending_device_read.synchronize()
            host_bytes.pending_device_read = None

    def _write_back(self, written: torch.Tensor) -> None:
        """Makes a device result written for this tensor visible in host memory."""
        if self.zero_copy:
            if written.device.type != "cpu":
                # The device wrote the host bytes in place; the host may read them once it is done.
                torch.cuda.current_stream(written.device).synchronize()
            return
        with disable_torch_function_subclass():
            host = self.detach()
        engine = get_transfer_engine(written.device)
        engine.d2h(written, host, label="transfer_tensor_write").synchronize()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs if kwargs is not None else {}
        written = _written_transfer_tensors(func, args, kwargs)
        for transfer_tensor in written:
            transfer_tensor._wait_for_device_reads()
        if func in _NATIVE_FUNCTIONS or getattr(func, "__name__", None) in _DESCRIPTOR_NAMES:
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return cls._move(func, args, kwargs)
        if func is torch.Tensor.detach:
            # Still the same host bytes, so still a TransferTensor: this is also what lets
            # nn.Parameter wrap one (Parameter checks that detach() keeps the type).
            with disable_torch_function_subclass():
                detached = func(*args, **kwargs)
            return cls._wrap(detached, args[0]._host_bytes, requires_grad=False)
        flat_args, spec = pytree.tree_flatten((args, kwargs))
        device = _compute_device(flat_args)
        if device is None:
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        return cls._run_on_device(func, args, kwargs, flat_args, spec, device, written)

    @classmethod
    def _move(cls, func, args, kwargs):
        self, rest = args[0], args[1:]
        if func is torch.Tensor.cpu:
            target = torch.device("cpu")
        elif func is torch.Tensor.cuda:
            index = kwargs.get("device", rest[0] if rest else None)
            if isinstance(index, int):
                target = torch.device("cuda", index)
            else:
                target = torch.device(index or "cuda")
        else:
            parse_kwargs = {key: value for key, value in kwargs.items() if key != "copy"}
            target = parse_to_device(*rest, **parse_kwargs)
        home = self.home_device
        # Only a move to the home device takes the zero-copy / engine path; a move to the host or
        # to another GPU is an ordinary conversion or copy of the host bytes.
        to_home = target is not None and target.type == home.type != "cpu"
        if to_home and _normalize_device(target) == home:
            source = self._read_form(home)
        else:
            source = _host_alias(self)
        with disable_torch_function_subclass():
            return func(source, *rest, **kwargs)

    @classmethod
    def _run_on_device(cls, func, args, kwargs, flat_args, spec, device, written):
        written_ids = {id(transfer_tensor) for transfer_tensor in written}
        inputs = (args, {key: value for key, value in kwargs.items() if key != "out"})
        read_ids = {id(arg) for arg in pytree.tree_leaves(inputs)}
        forms: dict[int, torch.Tensor] = {}
        writes: list[tuple[TransferTensor, torch.Tensor]] = []
        zero_copy_reads: list[TransferTensor] = []
        for arg in flat_args:
            if not isinstance(arg, TransferTensor) or id(arg) in forms:
                continue
            if arg.home_device != device:
                # A CPU op may use a TransferTensor of a GPU platform in place.
                continue
            if id(arg) in written_ids:
                form = arg._write_form(device, reads_old_data=id(arg) in read_ids)
                writes.append((arg, form))
            else:
                form = arg._read_form(device)
                if arg.zero_copy and device.type == "cuda":
                    zero_copy_reads.append(arg)
            forms[id(arg)] = form
        moved_args, moved_kwargs = pytree.tree_unflatten(
            [forms.get(id(arg), arg) for arg in flat_args], spec
        )
        with disable_torch_function_subclass():
            result = func(*moved_args, **moved_kwargs)
        for transfer_tensor in zero_copy_reads:
            read_done = torch.cuda.current_stream(device).record_event()
            transfer_tensor._host_bytes.pending_device_read = read_done
        for transfer_tensor, form in writes:
            transfer_tensor._write_back(form)
        # An in-place or out= operation returns what it wrote: give back the TransferTensor.
        written_for_form = {id(form): transfer_tensor for transfer_tensor, form in writes}
        return pytree.tree_map(lambda out: written_for_form.get(id(out), out), result)

    def __repr__(self, *, tensor_contents=None) -> str:
        with disable_torch_function_subclass():
            body = tensor_str(self.detach(), tensor_contents=tensor_contents)
        prefix = "TransferTensor("
        body = body[len("tensor(") : -1].replace("\n", "\n" + " " * (len(prefix) - len("tensor(")))
        grad = ", requires_grad=True" if self.requires_grad else ""
        platform = self.platform.kind.value
        return f"{prefix}{body}{grad}, memory={self.memory!r}, platform={platform!r})"

    def __reduce_ex__(self, protocol):
        with disable_torch_function_subclass():
            data = self.detach()
        return (_rebuild_transfer_tensor, (data, self.requires_grad))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        result = TransferTensor.from_tensor(
            self, memory=self.memory, platform=self.platform, requires_grad=self.requires_grad
        )
        if isinstance(self, torch.nn.Parameter):
            # copy.deepcopy(module) must keep its parameters parameters.
            result = torch.nn.Parameter(result, requires_grad=self.requires_grad)
        memo[id(self)] = result
        return result


def _compute_device(flat_args: list) -> torch.device | None:
    """The device a mixed operation runs on, or None when it runs on the host bytes as they are.

    It is the device of the operation's plain non-CPU tensors (beside which PyTorch accepts CPU
    scalars), else the CPU; the operation is moved only when some TransferTensor's home device is
    that device, and a GPU operation refuses TransferTensors of another GPU. On a machine without a
    GPU a forced platform kind has home device ``cpu``, which makes plain CPU tensors device
    tensors: that is how the copy and zero-copy paths run on the CPU.
    """
    plain_devices = set()
    homes = set()
    for arg in flat_args:
        if isinstance(arg, TransferTensor):
            homes.add(arg.home_device)
        elif isinstance(arg, torch.Tensor):
            plain_devices.add(arg.device)
    accelerators = {device for device in plain_devices if device.type != "cpu"}
    if len(accelerators) > 1:
        raise RuntimeError(
            f"an operation mixes TransferTensors with tensors on several devices "
            f"({', '.join(sorted(str(d) for d in accelerators))}); move them to one device first"
        )
    if accelerators:
        (device,) = accelerators
        foreign = {str(home) for home in homes if home != device}
        if foreign:
            raise RuntimeError(
                f"an operation on {device} got a TransferTensor that serves "
                f"{', '.join(sorted(foreign))}; create it with "
                f"platform=detect_platform({str(device)!r}) or move the other tensors to "
                f"{', '.join(sorted(foreign))}"
            )
        return device
    cpu = torch.device("cpu")
    if plain_devices and cpu in homes:
        return cpu
    return None


def _written_transfer_tensors(func, args, kwargs) -> list[TransferTensor]:
    """The TransferTensors an operation writes: ``out=`` targets and in-place targets."""
    outs = pytree.tree_leaves(kwargs.get("out"))
    written = [out for out in outs if isinstance(out, TransferTensor)]
    name = getattr(func, "__name__", "")
    inplace = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
    if inplace and args:
        # ``torch._foreach_*_`` (optimizers) write every tensor of their first list in place.
        targets = args[0] if isinstance(args[0], (list, tuple)) else (args[0],)
        written.extend(target for target in targets if isinstance(target, TransferTensor))
    return written


def _rebuild_transfer_tensor(data: torch.Tensor, requires_grad: bool) -> TransferTensor:
    """Unpickles a TransferTensor into pinned memory of the platform found at load time."""
    return TransferTensor.from_tensor(data, memory="pinned", requires_grad=requires_grad)


# Lets torch.load(weights_only=True) rebuild TransferTensors, as torchao does for its subclasses.
torch.serialization.add_safe_globals([_rebuild_transfer_tensor])
