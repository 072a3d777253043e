"""Reading a machine: the device argument, the CUDA and NVML attributes, and the capacities.

What cannot be read is recorded as unknown (None), never as 0: :func:`read_device_attributes` and the
capacity readers do not raise when a driver, ``cuda.bindings`` or NVML is missing, so such a machine
is still classified, by :func:`~torch_fsdp_offload.platform.kinds.classify`, which takes unknown as
no evidence.
"""

from __future__ import annotations

import ctypes

import torch

from torch_fsdp_offload.platform.kinds import (
    CUDA_DEVICE_ATTRIBUTES,
    DEVICE_COUNT,
    NVML_ADDRESSING_MODE,
    NVML_ATTRIBUTES,
    NVML_C2C_ENABLED,
    TORCH_IS_INTEGRATED,
)

__all__ = [
    "read_device_attributes",
    "read_gpu_memory",
    "read_host_available_bytes",
    "read_locked_memory_limit_bytes",
    "resolve_device",
]


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """The device a ``device`` argument of this library names, checked against this machine.

    Args:
        device: a ``torch.device``, ``"cuda:N"``, a CUDA index ``N``, ``"cpu"``, or None for the
            current CUDA device (the CPU on a machine without one).

    Returns:
        torch.device: ``cuda:N`` with an explicit index, or ``cpu``.

    Raises:
        ValueError: if ``device`` is not a device (e.g. ``"banana"``), not a CPU or CUDA device, or a
            CUDA device this machine does not have; the message says what to pass instead.

    Example::

        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a device: pass a CUDA device as cuda:N or its index N (N >= 0), "
            "or 'cpu'"
        ) from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(
            f"device {str(resolved)!r} is not supported: pass a CUDA device (cuda:N) or 'cpu'"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(resolved)!r} was asked for, but torch.cuda.is_available() is False; "
            "pass device=None (or 'cpu') on a machine without a GPU"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device cuda:{index} does not exist: {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


def read_host_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None where it cannot be read.

    Example::

        >>> read_host_available_bytes() > 0
        True
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_locked_memory_limit_bytes() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` (``ulimit -l``) in bytes; None when unlimited.

    Example::

        >>> limit = read_locked_memory_limit_bytes()  # None under `ulimit -l unlimited`
    """
    try:
        import resource
    except ImportError:  # not POSIX: there is no such limit to respect
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _read_attributes_cuda_bindings(index: int) -> dict[str, int | None]:
    from cuda.bindings import runtime as rt

    values: dict[str, int | None] = {}
    for name, attribute_id in CUDA_DEVICE_ATTRIBUTES.items():
        try:
            attribute = rt.cudaDeviceAttr(attribute_id)
        except ValueError:  # bindings older than the attribute
            values[name] = None
            continue
        err, value = rt.cudaDeviceGetAttribute(attribute, index)
        values[name] = int(value) if err == rt.cudaError_t.cudaSuccess else None
    return values


def _read_attributes_libcuda(index: int) -> dict[str, int | None]:
    libcuda = ctypes.CDLL("libcuda.so.1")
    result = libcuda.cuInit(0)
    if result != 0:
        raise OSError(f"cuInit failed with CUresult {result}")
    cu_device = ctypes.c_int()
    result = libcuda.cuDeviceGet(ctypes.byref(cu_device), ctypes.c_int(index))
    if result != 0:
        raise OSError(f"cuDeviceGet({index}) failed with CUresult {result}")
    values: dict[str, int | None] = {}
    for name, attribute_id in CUDA_DEVICE_ATTRIBUTES.items():
        value = ctypes.c_int()
        result = libcuda.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(attribute_id), cu_device)
        # An id the driver does not know (an old driver) fails: unknown, never 0.
        values[name] = value.value if result == 0 else None
    return values


def _read_cuda_attributes(index: int) -> tuple[dict[str, int | None], str | None]:
    """The CUDA attributes and the reader that got them; all None when no reader works."""
    for reader_name, reader in (
        ("cuda.bindings", _read_attributes_cuda_bindings),
        ("libcuda", _read_attributes_libcuda),
    ):
        try:
            values = reader(index)
        except Exception:  # a missing module or library, or a broken driver: try the next
            continue
        if any(value is not None for value in values.values()):
            return values, reader_name
    return dict.fromkeys(CUDA_DEVICE_ATTRIBUTES), None


def _read_nvml_attributes(index: int) -> dict[str, int | None]:
    values: dict[str, int | None] = dict.fromkeys(NVML_ATTRIBUTES)
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return values
    try:
        # NVML ignores CUDA_VISIBLE_DEVICES; the PCI bus id names the same GPU in both.
        props = torch.cuda.get_device_properties(index)
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        try:
            values[NVML_C2C_ENABLED] = int(pynvml.nvmlDeviceGetC2cModeInfoV(handle).isC2cEnabled)
        except Exception:
            pass
        try:
            mode = pynvml.nvmlDeviceGetAddressingMode(handle)
            values[NVML_ADDRESSING_MODE] = int(getattr(mode, "value", mode))
        except Exception:
            pass
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return values


def read_device_attributes(index: int) -> tuple[dict[str, int | None], str | None, str | None]:
    """(attributes, attribute reader, device name) of CUDA device ``index``; never raises."""
    attributes: dict[str, int | None] = {DEVICE_COUNT: torch.cuda.device_count()}
    cuda_attributes, reader = _read_cuda_attributes(index)
    attributes.update(cuda_attributes)
    try:
        props = torch.cuda.get_device_properties(index)
        attributes[TORCH_IS_INTEGRATED] = int(props.is_integrated)
        name: str | None = props.name
    except Exception:
        attributes[TORCH_IS_INTEGRATED] = None
        name = None
    attributes.update(_read_nvml_attributes(index))
    return attributes, reader, name


def read_gpu_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(free, total) bytes of ``device``, or (None, None) where they cannot be read."""
    if device.type != "cuda":
        return None, None
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:
        return None, None
    return int(free), int(total)
