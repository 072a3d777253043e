"""Tests for the FSDP1 front door ``torch_fsdp_offload.fsdp1.FullyShardedDataParallel``.

CPU tests run two gloo ranks and compare, bit for bit, against stock FSDP1 without offload. A
``CoherentOffload(platform="discrete")`` on the CPU drives the real copy path (every H2D and D2H goes
through the transfer engine and is counted; the "device" is the CPU). ``TestFSDP1GPU`` needs one GPU,
``TestFSDP1MultiGPU`` two (NCCL, world size 2).
"""

from __future__ import annotations

import contextlib
import os
import threading
import unittest
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from common_offload import fsdp1_host_bytes, GlooMultiProcessTestCase, HostStepGate, NcclMultiProcessTestCase, NVLINK_MULTICAST_OFF
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullStateDictConfig,
    FullyShardedDataParallel as StockFSDP,
    MixedPrecision,
    OffloadPolicy,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_offload._integration.fsdp1_handle_plan import planned_shards
from torch_fsdp_offload._integration.fsdp1_handles import HandleOffload
from torch_fsdp_offload.fsdp1 import FullyShardedDataParallel
from torch_fsdp_offload.memory import ENV_HOST_MEMORY, HostMemoryError
from torch_fsdp_offload.models import TransformerBlock, build_model, causal_lm_loss
from torch_fsdp_offload.optim import OffloadOptimizer
from torch_fsdp_offload.policy import CoherentOffload
from torch_fsdp_offload.transfer import get_transfer_engine

STEPS = 5

# Before any process group exists, in this process and the workers spawned from it.
for _name, _value in NVLINK_MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)


def _wrap(fsdp_class, device: torch.device, **kwargs):
    return fsdp_class(
        build_model("tiny"),
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        device_id=device,
        **kwargs,
    )


def _train(model, steps: int, rank: int, *, clip: float | None = None, device=torch.device("cpu"), optimizer=None):
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 16), generator=generator).to(device)
        loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()
        if clip is not None:
            norms.append(model.clip_grad_norm_(clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, optimizer


def _full_state(model) -> dict[str, torch.Tensor]:
    # offload_to_cpu=True breaks FSDP1 when the compute device is the CPU (FlatParamHandle.to_cpu
    # frees the storage it has just "moved"), with or without parameter offload.
    config = FullStateDictConfig(offload_to_cpu=model.compute_device.type == "cuda", rank0_only=False)
    with StockFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _h2d_order(model) -> list[str]:
    """The handles (root, block0, block1) in the order one forward issues their H2D copies."""
    names = {id(state._handle._torch_fsdp_offload.mirror): name
             for name, state in zip(("root", "block0", "block1"), StockFSDP.fsdp_modules(model))}
    engine = get_transfer_engine(torch.device("cpu"))
    issued = []
    h2d = engine.h2d

    def recording_h2d(src, *args, **kwargs):
        issued.append(names[id(src)])
        return h2d(src, *args, **kwargs)

    engine.h2d = recording_h2d
    try:
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long))
    finally:
        del engine.h2d
    return issued


class TestFSDP1Parity(GlooMultiProcessTestCase):
    def _check_parity(self, policy, mixed_precision=None, **kwargs) -> None:
        device = torch.device("cpu")
        reference = _wrap(StockFSDP, device, mixed_precision=mixed_precision, **kwargs)
        ref_losses, ref_norms, _ = _train(reference, STEPS, self.rank, clip=0.5)
        engine = get_transfer_engine(device)
        engine.stats.reset()
        model = _wrap(FullyShardedDataParallel, device, mixed_precision=mixed_precision,
                      offload_policy=policy, **kwargs)
        losses, norms, _ = _train(model, STEPS, self.rank, clip=0.5)
        self.assertEqual(losses, ref_losses, atol=0, rtol=0)
        self.assertEqual(norms, ref_norms, atol=0, rtol=0)
        self.assertGreater(ref_norms[0], 0.5)  # clipping is active
        for (name, expected), (other, actual) in zip(_full_state(reference).items(), _full_state(model).items()):
            self.assertEqual(name, other)
            self.assertEqual(actual, expected, atol=0, rtol=0)
        # Every handle of the tree, including the auto-wrapped children built by the base class,
        # carries the policy and keeps its sharded parameters on the host.
        states = StockFSDP.fsdp_modules(model)
        self.assertEqual(len(states), 3)  # root + 2 blocks
        for state in states:
            self.assertTrue(state._handle._offload_params)
            self.assertTrue(hasattr(state._handle, "_torch_fsdp_offload"))
        return model, engine.stats

    def test_coherent_offload_matches_fsdp1(self) -> None:
        # use_orig_params=True: stock FSDP1 CPU offload re-exposes the stale _cpu_grad after
        # zero_grad(set_to_none=True) and, on a CPU compute device, accumulates it into the next
        # gradient (diverging from the third loss on); the front door keeps the gradients None.
        self.init_gloo()
        model, stats = self._check_parity(CoherentOffload(platform="discrete"), use_orig_params=True)
        # Without mixed precision the CPU "device" needs no H2D; each handle's gradient went down
        # through the engine once per step.
        self.assertEqual(stats.d2h_copies, 3 * STEPS)
        self.assertGreater(stats.d2h_bytes, 0)
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
        loss = causal_lm_loss(model(tokens), tokens)
        self.assertTrue(all(param.grad is None for param in model.parameters()))
        loss.backward()
        self.assertTrue(any(param.grad is not None for param in model.parameters()))

    def test_coherent_offload_mixed_precision_casts_before_copy(self) -> None:
        self.init_gloo()
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model, stats = self._check_parity(CoherentOffload(platform="discrete"), mixed_precision)
        self.assertGreater(stats.h2d_copies, 0)
        # One forward unshards each of the 3 handles once: exactly 2 bytes (bf16) per shard element
        # cross the link, not FSDP1's 4 (fp32, cast afterwards).
        stats.reset()
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long))
        shard_numel = sum(state._handle.flat_param._local_shard.numel() for state in StockFSDP.fsdp_modules(model))
        self.assertEqual((stats.h2d_copies, stats.h2d_bytes), (3, 2 * shard_numel))
        # cast_on="device": the fp32 shard crosses (4 bytes an element) and is cast on arrival,
        # bit for bit as the host's cast; no mirror is made.
        on_device, stats = self._check_parity(CoherentOffload(platform="discrete", cast_on="device"), mixed_precision)
        stats.reset()
        with torch.no_grad():
            on_device(torch.zeros(1, 8, dtype=torch.long))
        self.assertEqual((stats.h2d_copies, stats.h2d_bytes), (3, 4 * shard_numel))
        self.assertTrue(all(state._handle._torch_fsdp_offload.mirror is None for state in StockFSDP.fsdp_modules(on_device)))

        # prefetch_depth sets FSDP1's prefetch limit: FSDP1 prefetches the handle that many places
        # ahead, so with depth 2 the root's unshard issues block 1's H2D before block 0 asks.
        deeper = _wrap(FullyShardedDataParallel, torch.device("cpu"), mixed_precision=mixed_precision,
                       offload_policy=CoherentOffload(platform="discrete", prefetch_depth=2))
        self.assertEqual(deeper._exec_order_data._forward_prefetch_limit, 2)
        self.assertEqual(deeper._exec_order_data._backward_prefetch_limit, 2)
        _train(deeper, 1, self.rank)  # FSDP1 records the execution order in the first step
        self.assertEqual(_h2d_order(model), ["root", "block0", "block1"])
        self.assertEqual(_h2d_order(deeper), ["root", "block1", "block0"])

    def test_stock_cpu_offload_policy_unpinned(self) -> None:
        # FSDP1's own CPUOffload pins unconditionally (impossible on CPU-only builds); the front door
        # honours CPUOffloadPolicy(pin_memory=False) instead.
        self.init_gloo()
        self._check_parity(CPUOffloadPolicy(pin_memory=False), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                           use_orig_params=True)

    def test_every_sharding_strategy_offloads_like_fsdp1(self) -> None:
        # NO_SHARD and both hybrid strategies (on a 1 x 2 mesh: the two ranks shard, one replica)
        # train bit for bit as FSDP1 without offload. The host-capacity check at construction
        # counts, to the byte, what the handles allocate at the first forward (each parameter
        # padded to 16 bytes of bf16, the total to the shard group's size, a bf16 mirror).
        self.init_gloo()
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (1, self.world_size))
        policy = CoherentOffload(platform="discrete")
        for strategy, device_mesh in (
            (ShardingStrategy.NO_SHARD, None),
            (ShardingStrategy.HYBRID_SHARD, mesh),
            (ShardingStrategy._HYBRID_SHARD_ZERO2, mesh),
        ):
            kwargs = dict(mixed_precision=mixed_precision, sharding_strategy=strategy, device_mesh=device_mesh,
                          use_orig_params=True)
            model, _ = self._check_parity(policy, **kwargs)
            needed = fsdp1_host_bytes(model)
            with mock.patch.dict(os.environ, {ENV_HOST_MEMORY: str(needed - 1)}):
                with self.assertRaisesRegex(HostMemoryError, "Cannot allocate", msg=str(strategy)):
                    _wrap(FullyShardedDataParallel, torch.device("cpu"), offload_policy=policy, **kwargs)
            with mock.patch.dict(os.environ, {ENV_HOST_MEMORY: str(needed)}):
                fits = _wrap(FullyShardedDataParallel, torch.device("cpu"), offload_policy=policy, **kwargs)
                with torch.no_grad():
                    fits(torch.zeros(1, 8, dtype=torch.long))
            self.assertEqual(fsdp1_host_bytes(fits), needed)
        # The shards the check counts, for odd sizes (where FSDP1 pads the flat parameter to a
        # multiple of the group's size) and every way of giving a hybrid strategy its groups.
        alone = [dist.new_group([rank]) for rank in range(self.world_size)][self.rank]
        for strategy, groups in (
            (ShardingStrategy.NO_SHARD, {}),
            (ShardingStrategy.FULL_SHARD, {}),
            (ShardingStrategy.FULL_SHARD, dict(process_group=alone)),
            (ShardingStrategy.SHARD_GRAD_OP, dict(device_mesh=init_device_mesh("cpu", (self.world_size,)))),
            (ShardingStrategy.HYBRID_SHARD, dict(device_mesh=mesh)),
            (ShardingStrategy.HYBRID_SHARD, dict(process_group=(dist.group.WORLD, alone))),
            (ShardingStrategy.HYBRID_SHARD, {}),  # FSDP1 makes groups of one node's devices
        ):
            for use_orig_params in (False, True):
                call = {"process_group": None, "device_mesh": None, **groups, "sharding_strategy": strategy,
                        "cpu_offload": CPUOffload(True), "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
                        "mixed_precision": None, "ignored_modules": None, "use_orig_params": use_orig_params,
                        "ignored_states": None}
                odd = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
                planned = planned_shards(odd, call, torch.device("cpu"))
                del call["cpu_offload"]
                odd = FullyShardedDataParallel(odd, device_id=torch.device("cpu"),
                                               offload_policy=CPUOffloadPolicy(pin_memory=False), **call)
                built = [state._handle.flat_param.numel() for state in StockFSDP.fsdp_modules(odd) if state._handle]
                self.assertEqual(sorted(built), sorted(shard.numel for shard in planned), msg=f"{strategy} {groups}")
        dist.barrier()

    def test_state_dicts_no_sync_summon(self) -> None:
        self.init_gloo()
        device = torch.device("cpu")
        model = _wrap(FullyShardedDataParallel, device, offload_policy=CoherentOffload(platform="discrete"))
        _, _, optimizer = _train(model, 2, self.rank)
        full = _full_state(model)

        # Full state dict round trip into a freshly wrapped model.
        fresh = _wrap(FullyShardedDataParallel, device, offload_policy=CoherentOffload(platform="discrete"))
        with StockFSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(full)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
        self.assertEqual(fresh(tokens), model(tokens), atol=0, rtol=0)

        # Sharded state dict round trip (ShardedTensor values), and the optimizer's state dict.
        with StockFSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = model.state_dict()
            optim_state = StockFSDP.optim_state_dict(model, optimizer)
        fresh = _wrap(FullyShardedDataParallel, device, offload_policy=CoherentOffload(platform="discrete"))
        with StockFSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            fresh.load_state_dict(sharded)
        self.assertEqual(fresh(tokens), model(tokens), atol=0, rtol=0)
        self.assertIn("state", optim_state)
        self.assertTrue(any(name.startswith("blocks.0.") for name in optim_state["state"]))

        # summon_full_params exposes the full, unflattened parameters.
        with StockFSDP.summon_full_params(model):
            self.assertEqual(model.output.weight, full["output.weight"], atol=0, rtol=0)

        # no_sync accumulates locally; the next synced backward reduces the sum.
        with model.no_sync():
            causal_lm_loss(model(tokens), tokens).backward()
        causal_lm_loss(model(tokens), tokens).backward()
        self.assertTrue(all(p.grad is not None for p in model.parameters()))
        dist.barrier()


def _accumulated_grads(model, device=torch.device("cpu"), rank: int = 0, steps: int = 2):
    """Two backward passes per step outside no_sync(), then a step; returns the gradients each step
    stepped with and the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(200 + rank)
    grads, losses = [], []
    for _ in range(steps):
        for _ in range(2):
            tokens = torch.randint(0, 256, (2, 16), generator=generator).to(device)
            loss = causal_lm_loss(model(tokens), tokens)
            loss.backward()
            losses.append(loss.item())
        grads.append([None if param.grad is None else param.grad.detach().cpu().clone() for param in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads, losses


def _train_no_root_params(model, steps: int, rank: int) -> list[float]:
    """Train a model whose parameters all live in wrapped children (the root has no handle)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(300 + rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _no_root_params_model(fsdp_class, **kwargs):
    torch.manual_seed(0)
    return fsdp_class(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=torch.device("cpu"),
        **kwargs,
    )


class TestFSDP1OffloadOptimizer(GlooMultiProcessTestCase):
    def test_host_steps_finish_under_the_next_forward_exactly(self) -> None:
        # OffloadOptimizer over the front door: step() returns while the handles' host steps are
        # held at a gate, which opens a moment later. Every other step the parameters are read
        # at once (each read waits for its step); the others, the next forward comes first (each
        # handle's unshard waits for its step). Clipped, mixed precision, bit for bit against
        # stock FSDP1 with fused AdamW.
        self.init_gloo()
        device = torch.device("cpu")
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for use_orig_params in (False, True):
            reference = _wrap(StockFSDP, device, mixed_precision=mixed, use_orig_params=use_orig_params)
            model = _wrap(FullyShardedDataParallel, device, mixed_precision=mixed, use_orig_params=use_orig_params,
                          offload_policy=CoherentOffload(platform="discrete"))
            gate = HostStepGate()
            reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
            optim = OffloadOptimizer(model, gate.optimizer_class(torch.optim.AdamW), lr=1e-2)
            self.assertTrue(optim.overlap_next_forward)
            generator = torch.Generator().manual_seed(100 + self.rank)
            opener = None
            for step in range(STEPS):
                tokens = torch.randint(0, 256, (2, 16), generator=generator)
                losses = []
                for m in (reference, model):
                    loss = causal_lm_loss(m(tokens), tokens)
                    loss.backward()
                    losses.append(loss.item())
                    m.clip_grad_norm_(0.5)
                self.assertEqual(losses[1], losses[0], atol=0, rtol=0, msg=f"step {step}")
                if opener is not None:
                    opener.join()
                reference_optim.step()
                gate.close()
                optim.step()
                self.assertTrue(gate.holds_a_step(), f"step {step}: step() returned after every host step")
                opener = threading.Timer(0.1, gate.open)
                opener.start()
                if step % 2 == 0:
                    for (name, ref), actual in zip(reference.named_parameters(), model.parameters()):
                        self.assertEqual(actual, ref, atol=0, rtol=0, msg=f"step {step}: {name}")
                for o in (reference_optim, optim):
                    o.zero_grad()
            opener.join()
            optim.synchronize()
            self.assertGreater(optim.stepped_numel["host"], 0)
            self.assertEqual(optim.stepped_numel["device"], 0)
            # Accumulating: the first micro-batch under no_sync(), the second outside it.
            for step in range(2):
                for micro in range(2):
                    tokens = torch.randint(0, 256, (2, 16), generator=generator)
                    for m in (reference, model):
                        with m.no_sync() if micro == 0 else contextlib.nullcontext():
                            causal_lm_loss(m(tokens), tokens).backward()
                for o in (reference_optim, optim):
                    o.step()
                    o.zero_grad()
            for (name, expected), (_, actual) in zip(_full_state(reference).items(), _full_state(model).items()):
                self.assertEqual(actual, expected, atol=0, rtol=0, msg=name)


    def test_mirror_cast_once_a_step_and_after_other_writes(self) -> None:
        # The compute-dtype mirror a handle copies in is cast once a step, by the host step (its
        # unshard in the next forward and in backward finds it current). A write of the user's to
        # the parameters between steps, and another optimizer's fused step (which moves no
        # version counter), are cast again before the next forward reads them.
        self.init_gloo()
        device = torch.device("cpu")
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        generator = torch.Generator().manual_seed(100 + self.rank)

        def train_step(m, o):
            tokens = torch.randint(0, 256, (2, 16), generator=generator)
            loss = causal_lm_loss(m(tokens), tokens)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss.item()

        for use_orig_params, offload_optimizer in ((False, True), (True, True), (False, False), (True, False)):
            reference = _wrap(StockFSDP, device, mixed_precision=mixed, use_orig_params=use_orig_params)
            model = _wrap(FullyShardedDataParallel, device, mixed_precision=mixed, use_orig_params=use_orig_params,
                          offload_policy=CoherentOffload(platform="discrete"))
            reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
            if offload_optimizer:
                optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
            else:
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            case = f"use_orig_params={use_orig_params}, OffloadOptimizer: {offload_optimizer}"

            def train_both():
                state = generator.get_state()
                expected = train_step(reference, reference_optim)
                generator.set_state(state)
                self.assertEqual(train_step(model, optim), expected, atol=0, rtol=0, msg=case)

            train_both()  # the first forward casts as it builds the mirrors
            if not offload_optimizer:
                train_both()
                train_both()
                continue
            optim.synchronize()
            handles = len(model._all_handles)
            casts = []
            original_cast = HandleOffload.cast

            def cast(offload, local_shard):
                casts.append(threading.current_thread() is threading.main_thread())
                original_cast(offload, local_shard)

            with mock.patch.object(HandleOffload, "cast", cast):
                train_both()
                train_both()
                optim.synchronize()
            # Each handle's mirror is cast once a step, in the optimizer's worker.
            self.assertEqual(casts, [False] * (2 * handles), case)
            with torch.no_grad():
                for m in (reference, model):
                    for param in m.parameters():
                        param.mul_(0.5)
            tokens = torch.randint(0, 256, (2, 16), generator=generator)
            self.assertEqual(causal_lm_loss(model(tokens), tokens), causal_lm_loss(reference(tokens), tokens),
                             atol=0, rtol=0, msg=case)


class TestFSDP1NoAccelerator(GlooMultiProcessTestCase):
    def test_host_only_trains_like_fsdp1_without_offload(self) -> None:
        # Without an accelerator the compute device is the host: nothing is offloaded, and the
        # front door with CoherentOffload() is FSDP1 without offload, bit for bit, including a
        # model whose root owns no parameters (FSDP1's own CPU offload would synchronise a CPU
        # stream there, which torch.cpu.Stream cannot).
        self.init_gloo()
        device = torch.device("cpu")
        torch.manual_seed(0)
        reference = _wrap(StockFSDP, device, use_orig_params=True)
        ref_losses, ref_norms, _ = _train(reference, STEPS, self.rank, clip=0.5)
        ref_no_root = _train_no_root_params(_no_root_params_model(StockFSDP), STEPS, self.rank)
        for policy in (CoherentOffload(), CoherentOffload(platform="host_only")):
            torch.manual_seed(0)
            model = _wrap(FullyShardedDataParallel, device, use_orig_params=True, offload_policy=policy)
            losses, norms, _ = _train(model, STEPS, self.rank, clip=0.5)
            self.assertEqual(losses, ref_losses, atol=0, rtol=0)
            self.assertEqual(norms, ref_norms, atol=0, rtol=0)
            no_root = _no_root_params_model(FullyShardedDataParallel, offload_policy=policy)
            self.assertIsNone(no_root._handle)
            self.assertEqual(_train_no_root_params(no_root, STEPS, self.rank), ref_no_root, atol=0, rtol=0)
        # Forced HOST_ONLY: no handle is offloaded, and FSDP1's prefetch arguments are as given.
        for state in StockFSDP.fsdp_modules(model):
            self.assertFalse(state._handle._offload_params)
            self.assertFalse(hasattr(state._handle, "_torch_fsdp_offload"))
        self.assertFalse(model.forward_prefetch)
        dist.barrier()

    def test_forced_copies_with_no_root_parameters(self) -> None:
        # The forced copy path (every gradient goes down through the engine) on a model whose root
        # owns no parameters finishes its backward and matches FSDP1 without offload.
        self.init_gloo()
        reference = _train_no_root_params(_no_root_params_model(StockFSDP), STEPS, self.rank)
        engine = get_transfer_engine(torch.device("cpu"))
        engine.stats.reset()
        model = _no_root_params_model(FullyShardedDataParallel, offload_policy=CoherentOffload(platform="discrete"))
        self.assertEqual(_train_no_root_params(model, STEPS, self.rank), reference, atol=0, rtol=0)
        self.assertEqual(engine.stats.d2h_copies, 2 * STEPS)  # each Linear's gradient, each step
        dist.barrier()


class TestFSDP1Refusal(GlooMultiProcessTestCase):
    def test_refusal_changes_nothing(self) -> None:
        # Each knob FSDP1 would not honour is refused before anything is wrapped; the same module
        # then trains under FSDP1 without the policy exactly like a fresh one.
        self.init_gloo()
        device = torch.device("cpu")
        torch.manual_seed(0)
        module = build_model("tiny")
        before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
        parameters = list(module.parameters())
        refused = [
            (dict(offload_policy=CoherentOffload(optimizer="host")),
             r"optimizer='host'.*steps with your own optimizer.*OffloadOptimizer"),
            (dict(offload_policy=CoherentOffload(optimizer=0.5, platform="discrete")), r"optimizer=0\.5"),
            (dict(offload_policy=CoherentOffload(activations=True)), r"activations=True.*offload_activations\(model\)"),
            (dict(offload_policy=CoherentOffload(prefetch_depth=0), forward_prefetch=True),
             r"prefetch_depth=0 .*forward_prefetch=True"),
            (dict(offload_policy=CoherentOffload(prefetch_depth=0), backward_prefetch=BackwardPrefetch.BACKWARD_POST),
             r"prefetch_depth=0 .*BACKWARD_POST"),
            (dict(offload_policy=CoherentOffload(prefetch_depth=2), backward_prefetch=None),
             r"prefetch_depth=2 .*backward_prefetch=None"),
        ]
        for kwargs, message in refused:
            with self.assertRaisesRegex(ValueError, message, msg=str(kwargs)):
                FullyShardedDataParallel(
                    module, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=device, **kwargs
                )
            self.assertEqual(list(module.parameters()), parameters)
            self.assertTrue(all(type(param) is nn.Parameter for param in module.parameters()))
            self.assertEqual(StockFSDP.fsdp_modules(module), [])
            self.assertEqual(module.state_dict(), before, atol=0, rtol=0)
        torch.manual_seed(0)
        losses, norms, _ = _train(_wrap(StockFSDP, device), STEPS, self.rank, clip=0.5)
        after_refusals = StockFSDP(module, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=device)
        self.assertEqual(_train(after_refusals, STEPS, self.rank, clip=0.5)[:2], (losses, norms), atol=0, rtol=0)
        dist.barrier()


class TestFSDP1Accumulation(GlooMultiProcessTestCase):
    def test_accumulation_outside_no_sync(self) -> None:
        # Two backwards without no_sync() add their gradients, as in FSDP1 without offload. On a
        # CPU compute device FSDP1 itself accumulates (the gradient is not "offloaded" in its
        # sense); on a GPU it would drop the first one, which the front door prevents
        # (test_gpu_accumulation_outside_no_sync). Forced DISCRETE runs the engine copy path.
        self.init_gloo()
        device = torch.device("cpu")
        for use_orig_params in (False, True):
            torch.manual_seed(0)
            reference = _wrap(StockFSDP, device, use_orig_params=use_orig_params)
            ref_grads, ref_losses = _accumulated_grads(reference, rank=self.rank)
            model = _wrap(FullyShardedDataParallel, device, use_orig_params=use_orig_params,
                          offload_policy=CoherentOffload(platform="discrete"))
            grads, losses = _accumulated_grads(model, rank=self.rank)
            self.assertEqual(losses, ref_losses, atol=0, rtol=0)
            # FSDP1 without offload accumulates: equal gradients are the sums, not the last ones.
            self.assertEqual(grads, ref_grads, atol=0, rtol=0)
            # The handles hold nothing on the side between backwards (the CPU path patches nothing).
            for state in StockFSDP.fsdp_modules(model):
                self.assertIsNone(state._handle._torch_fsdp_offload.previous_grad)
        dist.barrier()


class TestFSDP1Errors(TestCase):
    # The checks run before FSDP1's constructor, so no process group is needed.
    def test_errors(self) -> None:
        module = build_model("tiny")
        cases = [
            (dict(cpu_offload=CPUOffload(True), offload_policy=CoherentOffload()), ValueError,
             "both cpu_offload= and offload_policy="),
            (dict(offload_policy=CoherentOffload(activations=0.5)), ValueError, "activations=0.5"),
            (dict(offload_policy="cpu"), TypeError, "takes an OffloadPolicy"),
        ]
        for kwargs, error, message in cases:
            with self.assertRaisesRegex(error, message):
                FullyShardedDataParallel(module, **kwargs)

    def test_no_offload_policy_is_plain_fsdp1_arguments(self) -> None:
        from torch_fsdp_offload.fsdp1 import _plan

        self.assertEqual(_plan(None, None, None), (None, None))
        self.assertEqual(_plan(OffloadPolicy(), CPUOffload(False), None), (None, CPUOffload(False)))
        plan, cpu_offload = _plan(CPUOffloadPolicy(pin_memory=False), None, None)
        self.assertFalse(plan.pinned)  # plain host memory
        self.assertFalse(plan.engine)
        self.assertEqual(cpu_offload, CPUOffload(offload_params=True))
        # On a unified-memory machine nothing is offloaded: the GPU's memory is the host's; without
        # an accelerator the shards already live where compute runs.
        self.assertEqual(_plan(CoherentOffload(platform="unified"), None, torch.device("cpu")), (None, None))
        self.assertEqual(_plan(CoherentOffload(platform="host_only"), None, torch.device("cpu")), (None, None))


    @unittest.skipIf(not torch.accelerator.is_available(), "pinning needs an accelerator")
    def test_pinned_stock_offload_is_fsdp1_arguments(self) -> None:
        from torch_fsdp_offload.fsdp1 import _plan

        self.assertEqual(_plan(OffloadPolicy(), CPUOffload(True), None), (None, CPUOffload(True)))
        plan, cpu_offload = _plan(CPUOffloadPolicy(pin_memory=True), None, None)
        self.assertIsNone(plan.pinned)  # stock FSDP1 pins itself
        self.assertFalse(plan.engine)
        self.assertEqual(cpu_offload, CPUOffload(offload_params=True))


@unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
class TestFSDP1GPU(TestCase):
    def setUp(self) -> None:
        super().setUp()
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def tearDown(self) -> None:
        dist.destroy_process_group()
        super().tearDown()

    def test_gpu_parity_and_half_the_bytes(self) -> None:
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(0)
        reference = _wrap(StockFSDP, self.device, mixed_precision=mixed_precision,
                          cpu_offload=CPUOffload(offload_params=True))
        ref_losses, _, _ = _train(reference, 3, 0, device=self.device)
        engine = get_transfer_engine(self.device)
        engine.stats.reset()
        # cast_on="host" (the default "auto" picks by this machine's measured rates).
        model = _wrap(FullyShardedDataParallel, self.device, mixed_precision=mixed_precision,
                      offload_policy=CoherentOffload(platform="discrete", cast_on="host"))
        losses, _, _ = _train(model, 3, 0, device=self.device)
        self.assertEqual(losses, ref_losses, atol=0, rtol=0)
        states = StockFSDP.fsdp_modules(model)
        self.assertTrue(all(state._handle.flat_param._local_shard.is_pinned() for state in states))
        self.assertGreater(engine.stats.d2h_bytes, 0)
        # Cast before copy: one forward moves 2 bytes (bf16) per shard element, not 4.
        engine.stats.reset()
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long, device=self.device))
        torch.cuda.synchronize()
        numel = sum(state._handle.flat_param._local_shard.numel() for state in states)
        self.assertEqual(engine.stats.h2d_bytes, 2 * numel)
        # cast_on="device": the fp32 shard crosses and is cast on the GPU, as stock FSDP1 does.
        model = _wrap(FullyShardedDataParallel, self.device, mixed_precision=mixed_precision,
                      offload_policy=CoherentOffload(platform="discrete", cast_on="device"))
        losses, _, _ = _train(model, 3, 0, device=self.device)
        self.assertEqual(losses, ref_losses, atol=0, rtol=0)
        engine.stats.reset()
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long, device=self.device))
        torch.cuda.synchronize()
        self.assertEqual(engine.stats.h2d_bytes, 4 * numel)

    def test_gpu_offload_optimizer_matches_stock(self) -> None:
        # The handles stepped by OffloadOptimizer on the host, each step finishing under the next
        # forward (its unshard waits for it), against stock FSDP1 CPU offload with the same fused
        # CPU AdamW, clipped: bit for bit.
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        runs = {}
        for name, fsdp_class, kwargs in (
            ("stock", StockFSDP, dict(cpu_offload=CPUOffload(offload_params=True))),
            ("coherent", FullyShardedDataParallel, dict(offload_policy=CoherentOffload(platform="discrete"))),
        ):
            torch.manual_seed(0)
            model = _wrap(fsdp_class, self.device, mixed_precision=mixed_precision, **kwargs)
            if fsdp_class is StockFSDP:
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            else:
                optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
            runs[name] = _train(model, STEPS, 0, clip=0.5, device=self.device, optimizer=optimizer)[:2]
        self.assertGreater(optimizer.stepped_numel["host"], 0)
        self.assertEqual(runs["coherent"], runs["stock"], atol=0, rtol=0)

    def test_gpu_use_orig_params_matches_stock(self) -> None:
        # The front door against stock FSDP1 in the same use_orig_params mode; both step with
        # the same CPU AdamW, so to 1e-6. (On the H200 the two modes themselves differ by up to
        # 7.5e-5 relative in loss by step 5 with bf16 compute, stock and front door alike.)
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        runs = {}
        for name, fsdp_class, kwargs in (
            ("stock_orig", StockFSDP, dict(cpu_offload=CPUOffload(True), use_orig_params=True)),
            ("coherent_orig", FullyShardedDataParallel,
             dict(offload_policy=CoherentOffload(platform="discrete"), use_orig_params=True)),
        ):
            torch.manual_seed(0)
            model = _wrap(fsdp_class, self.device, mixed_precision=mixed_precision, **kwargs)
            runs[name] = _train(model, STEPS, 0, clip=0.5, device=self.device)[:2]
        self.assertEqual(runs["coherent_orig"], runs["stock_orig"], atol=0, rtol=1e-6)
        model.zero_grad(set_to_none=True)
        model(torch.zeros(1, 8, dtype=torch.long, device=self.device))
        self.assertTrue(all(param.grad is None for param in model.parameters()))

    def test_gpu_accumulation_outside_no_sync(self) -> None:
        # Stock FSDP1 with CPU offload drops the first backward's gradient here (its TODO in
        # prepare_gradient_for_backward); the front door must match FSDP1 without offload. fp32
        # and world size 1 (FSDP1 runs NO_SHARD): the offloaded run steps on the host, so 1e-5.
        runs = {}
        for name, fsdp_class, kwargs in (
            ("no_offload", StockFSDP, {}),
            ("no_offload_orig", StockFSDP, dict(use_orig_params=True)),
            ("coherent", FullyShardedDataParallel, dict(offload_policy=CoherentOffload(platform="discrete"))),
            ("coherent_orig", FullyShardedDataParallel,
             dict(offload_policy=CoherentOffload(platform="discrete"), use_orig_params=True)),
            ("stock_policy", FullyShardedDataParallel, dict(offload_policy=CPUOffloadPolicy())),
        ):
            torch.manual_seed(0)
            model = _wrap(fsdp_class, self.device, **kwargs)
            runs[name] = _accumulated_grads(model, self.device)
        # Each against FSDP1 without offload in the same use_orig_params mode (flat parameters
        # or the original ones: different gradient lists).
        for name, reference in (
            ("coherent", "no_offload"), ("coherent_orig", "no_offload_orig"), ("stock_policy", "no_offload")
        ):
            self.assertEqual(runs[name], runs[reference], atol=1e-5, rtol=1e-5, msg=name)


class TestFSDP1MultiGPU(NcclMultiProcessTestCase):
    """World size 2 on two GPUs (NCCL): the front door against stock FSDP1."""

    MAX_WORLD_SIZE = 2

    def test_parity_with_stock_offload(self) -> None:
        # Both step with the same CPU AdamW on the same host shards: 1e-6 relative.
        self.init_nccl()
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        stock, runs = {}, {}
        for use_orig_params in (False, True):
            torch.manual_seed(0)
            reference = _wrap(StockFSDP, self.device, mixed_precision=mixed_precision,
                              cpu_offload=CPUOffload(True), use_orig_params=use_orig_params)
            stock[use_orig_params] = _train(reference, STEPS, self.rank, clip=0.5, device=self.device)[:2]
            torch.manual_seed(0)
            model = _wrap(FullyShardedDataParallel, self.device, mixed_precision=mixed_precision,
                          offload_policy=CoherentOffload(platform="discrete"), use_orig_params=use_orig_params)
            runs[use_orig_params] = _train(model, STEPS, self.rank, clip=0.5, device=self.device)[:2]
            self.assertTrue(all(state._handle.flat_param._local_shard.is_pinned()
                                for state in StockFSDP.fsdp_modules(model)))
        # Each mode against stock FSDP1 in the same mode (the two modes differ by up to 7.5e-5
        # relative by step 5 on the H200 with bf16 compute, in stock FSDP1 too).
        for use_orig_params in (False, True):
            self.assertEqual(runs[use_orig_params], stock[use_orig_params], atol=0, rtol=1e-6)
        dist.barrier()
        dist.destroy_process_group()

    def test_parity_with_no_offload(self) -> None:
        # Without offload the AdamW step runs on the GPU, with offload on the host: the two kernels
        # round differently (the FSDP2 GPU runs measured 7e-5 relative in loss after 10 steps), so
        # fp32, 5 steps, and 1e-4 relative; everything else (forward, NCCL reduce-scatter) is shared.
        self.init_nccl()
        torch.manual_seed(0)
        reference = _wrap(StockFSDP, self.device)
        ref_losses, ref_norms, _ = _train(reference, STEPS, self.rank, clip=0.5, device=self.device)
        torch.manual_seed(0)
        model = _wrap(FullyShardedDataParallel, self.device, offload_policy=CoherentOffload(platform="discrete"),
                      use_orig_params=True)
        losses, norms, _ = _train(model, STEPS, self.rank, clip=0.5, device=self.device)
        self.assertEqual(losses[0], ref_losses[0], atol=0, rtol=1e-6)  # before any step: same forward
        self.assertEqual(losses, ref_losses, atol=1e-5, rtol=1e-4)
        self.assertEqual(norms, ref_norms, atol=1e-5, rtol=1e-4)
        dist.barrier()
        dist.destroy_process_group()

    def test_state_dict_round_trip(self) -> None:
        self.init_nccl()
        policy = CoherentOffload(platform="discrete")
        model = _wrap(FullyShardedDataParallel, self.device, offload_policy=policy)
        _, _, optimizer = _train(model, 2, self.rank, device=self.device)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7)).to(self.device)
        with torch.no_grad():
            expected = model(tokens)

        fresh = _wrap(FullyShardedDataParallel, self.device, offload_policy=policy)
        with StockFSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(_full_state(model))
        with torch.no_grad():
            self.assertEqual(fresh(tokens), expected, atol=0, rtol=0)

        with StockFSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = model.state_dict()
            optim_state = StockFSDP.optim_state_dict(model, optimizer)
        fresh = _wrap(FullyShardedDataParallel, self.device, offload_policy=policy)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        with StockFSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            fresh.load_state_dict(sharded)
            fresh_optimizer.load_state_dict(StockFSDP.optim_state_dict_to_load(fresh, fresh_optimizer, optim_state))
        with torch.no_grad():
            self.assertEqual(fresh(tokens), expected, atol=0, rtol=0)
        # Training on from the loaded model and optimizer state equals training on the original.
        self.assertEqual(_train(fresh, 2, self.rank, device=self.device, optimizer=fresh_optimizer)[0],
                         _train(model, 2, self.rank, device=self.device, optimizer=optimizer)[0], atol=0, rtol=1e-6)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run_tests()
