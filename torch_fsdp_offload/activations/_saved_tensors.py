"""The bookkeeping of what one offloaded forward saved: per storage, per saved tensor, per pass.

A saved tensor is either kept on the device (:class:`KeptTensor`) or a view into an offloaded storage
(:class:`OffloadedView` of a :class:`StoredStorage`); views of one storage share its host copy. A
:class:`ForwardPass` holds what one forward saved, block by block, and how far the backwards through
its graph have come. Weak references keep every record as short-lived as the graph that saved it.
"""

from __future__ import annotations

import collections
import weakref

import torch
import torch.nn as nn
from torch.cuda import Event

from torch_fsdp_offload.memory import PinnedFreeList
from torch_fsdp_offload.transfer import Transfer

__all__ = [
    "CPU_LEAD_BLOCKS",
    "ForwardPass",
    "KeptTensor",
    "NO_BLOCK_YET",
    "OffloadedView",
    "StoredStorage",
    "param_storages",
]

# How many blocks the CPU may run ahead of the GPU while activations are offloaded. Copies land in
# GPU time but are noticed in CPU time: a CPU far ahead would see no copy landed during forward (so
# frees nothing) and, in backward, decide reloads before copies land (so skips them). Two blocks
# keep the GPU queue full while tying those decisions to GPU progress.
CPU_LEAD_BLOCKS = 2
# The block number "backward has not reached or issued any block yet" compares above.
NO_BLOCK_YET = 0x7FFFFFFF


class StoredStorage:
    """One offloaded storage: its host copy, and its device copy while one exists."""

    __slots__ = (
        "pass_",
        "block",
        "last_block",
        "dtype",
        "numel",
        "nbytes",
        "host",
        "free_list",
        "device_data",
        "is_original",
        "retained",
        "d2h_done",
        "host_read_done",
        "h2d",
        "handles",
        "unpacked",
        "unpack_task",
        "__weakref__",
    )

    def __init__(self, pass_: ForwardPass, block: int, original: torch.Tensor, free_list: PinnedFreeList) -> None:
        self.pass_ = pass_
        self.block = block
        self.last_block = block  # the last block that saved it: backward reloads it with that one
        self.dtype = original.dtype
        self.nbytes = original.untyped_storage().nbytes()
        self.numel = self.nbytes // original.element_size()
        host, self.host_read_done = free_list.take(self.nbytes)
        self.host = host.view(self.dtype)
        self.free_list = free_list
        # The whole storage as a 1-D tensor: the original until released, later a reloaded copy.
        self.device_data: torch.Tensor | None = original.detach().as_strided((self.numel,), (1,), 0)
        self.is_original = True
        self.retained = False  # the original is used by backward in place, never released on landing
        self.d2h_done: Event | None = None
        self.h2d: Transfer | None = None  # the reload that device_data came from, if any
        self.handles = 0  # saved tensors that view it
        self.unpacked = 0  # of those, unpacked by the backward identified by unpack_task
        self.unpack_task = -1

    def __del__(self) -> None:
        self.free_list.give_back(self.host.view(torch.uint8), self.host_read_done)


class KeptTensor:
    """A saved tensor left on the device, remembered only to trigger prefetch when it is unpacked."""

    __slots__ = ("tensor", "pass_", "trigger")

    def __init__(self, tensor: torch.Tensor, pass_: ForwardPass, trigger: int) -> None:
        self.tensor = tensor
        self.pass_ = pass_
        self.trigger = trigger


class OffloadedView:
    """A saved tensor whose storage is offloaded: the storage and how the tensor views it."""

    __slots__ = ("stored", "size", "stride", "offset", "trigger")

    def __init__(self, stored: StoredStorage, tensor: torch.Tensor, trigger: int) -> None:
        self.stored = stored
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.trigger = trigger


class ForwardPass:
    """The state of one forward (one entry of the offloader) and of the backwards through its graph."""

    __slots__ = (
        "block",
        "in_block",
        "block_depth",
        "offloading",
        "any_offloaded",
        "blocks",
        "storages",
        "root_param_storages",
        "block_param_storages",
        "forward_marks",
        "backward_task",
        "lowest_reached",
        "lowest_issued",
        "backward_marks",
        "__weakref__",
    )

    def __init__(self, root_param_storages: frozenset[int]) -> None:
        self.block = -1  # the block started last; -1 before the first one
        self.in_block = False
        self.block_depth = 0
        self.offloading = False  # whether the current block is offloaded
        self.any_offloaded = False
        self.blocks: list[list[weakref.ref[StoredStorage]]] = []  # offloaded storages per block
        # storage data_ptr -> weak refs to (the storage, its StoredStorage or None when kept on the
        # device); weak both: a StoredStorage refers to its pass, and must die with the graph that saved it.
        self.storages: dict[int, tuple[weakref.ref, weakref.ref[StoredStorage] | None]] = {}
        self.root_param_storages = root_param_storages
        self.block_param_storages: frozenset[int] = frozenset()
        self.forward_marks: collections.deque[Event] = collections.deque(maxlen=CPU_LEAD_BLOCKS + 1)
        self.backward_task = -1
        # The lowest block backward has reached, and the lowest whose reload is issued.
        self.lowest_reached = NO_BLOCK_YET
        self.lowest_issued = NO_BLOCK_YET
        self.backward_marks: dict[int, Event] = {}


def param_storages(module: nn.Module, recurse: bool) -> frozenset[int]:
    """The storages of ``module``'s plain parameters and buffers, by data pointer: never offloaded."""
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if type(t) in (torch.Tensor, nn.Parameter))
