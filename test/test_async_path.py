"""The asynchronous data path as behaviour, not only as final numbers.

Parity tests pass whether a copy was prefetched or issued on demand, whether a group's host step
overlapped backward or ran in ``step()``, and whether a group moved in one copy or one per
parameter. These tests record the order of events in a training step instead (copies issued,
each block's forward and backward compute starting, host optimizer steps starting) and count
the copies per step. They run with the CPU copy engine's asynchronous mode (set by conftest.py):
copies land late on worker threads, as they do on a GPU's copy streams.
"""

from __future__ import annotations

import threading
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests

from common_offload import GlooMultiProcessTestCase, HostStepGate
from torch_fsdp_offload import CoherentOffload, fully_shard_with_policy, OffloadOptimizer
from torch_fsdp_offload.optimizer import dtensor_grads
from torch_fsdp_offload.optimizer import host_steps
from torch_fsdp_offload.transfer import get_transfer_engine, TransferEngine

DIM = 8
BLOCKS = 4
# A deadlock guard for the wait below, never reached when the behaviour holds.
_HOST_STEP_TIMEOUT_S = 30.0

# ("issue", group), ("forward", group), ("backward", group), ("host_step", None), in the order
# they happened in this process; appended from several threads (list.append is atomic).
_events: list[tuple[str, str | None]] = []
_on_backward_of_first_layer: list = []


class _Mark(torch.autograd.Function):
    """Identity whose backward records that backward reached this point of the model."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: str) -> torch.Tensor:
        ctx.where = where
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _events.append(("backward", ctx.where))
        for hook in _on_backward_of_first_layer if ctx.where == "first" else ():
            hook()
        return grad, None


class _Block(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The block's compute starts here (after FSDP's pre-forward unshard) and its backward
        # compute starts at the mark on its output (after FSDP's pre-backward unshard).
        _events.append(("forward", self.name))
        return _Mark.apply(torch.relu(self.linear(x)), self.name)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(_Block(f"blocks.{index}") for index in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Mark.apply(self.first(x), "first")
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


class _Marked(nn.Module):
    """A linear whose input mark records, in backward, that this group's backward is done."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(_Mark.apply(x, self.name)))


class _CheckpointedBlock(nn.Module):
    """A block of two FSDP groups whose forward is recomputed in backward (activation checkpointing)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.first = _Marked(f"{name}.first")
        self.second = _Marked(f"{name}.second")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda y: self.second(self.first(y)), x, use_reentrant=False)


class _CheckpointedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_CheckpointedBlock(f"blocks.{index}") for index in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


class _RecordingAdamW(torch.optim.AdamW):
    """AdamW that records when a step starts (OffloadOptimizer makes one per group, and a twin)."""

    started = threading.Event()

    def step(self, closure=None):
        _events.append(("host_step", None))
        _RecordingAdamW.started.set()
        return super().step(closure)


def _issue_label(label: str) -> str | None:
    prefix = "params_h2d:"
    return label[len(prefix) :] if label.startswith(prefix) else None


class AsyncPathTest(GlooMultiProcessTestCase):
    WORLD_SIZE = 2

    def _build(
        self, policy: CoherentOffload, optimizer_class: type = _RecordingAdamW, **optimizer_kwargs
    ) -> tuple[nn.Module, OffloadOptimizer]:
        torch.manual_seed(0)
        model = _Net()
        fully_shard_with_policy(model, model.blocks, policy, mesh=init_device_mesh("cpu", (self.world_size,)))
        return model, OffloadOptimizer(model, optimizer_class, lr=1e-2, **optimizer_kwargs)

    def _step(self, model: nn.Module, optim: OffloadOptimizer, step: int) -> None:
        generator = torch.Generator().manual_seed(100 * step + self.rank)
        model(torch.randn(3, DIM, generator=generator)).backward()
        optim.step()
        optim.zero_grad()

    def _record_issues(self):
        """Record each copy-in of a group's parameters as it is issued."""
        h2d = TransferEngine.h2d

        def recording_h2d(engine, src, *args, label="h2d", **kwargs):
            group = _issue_label(label)
            if group is not None:
                _events.append(("issue", group))
            return h2d(engine, src, *args, label=label, **kwargs)

        return mock.patch.object(TransferEngine, "h2d", recording_h2d)

    @parametrize("prefetch_depth", [1, 2])
    def test_next_groups_copy_is_issued_before_the_current_groups_compute(self, prefetch_depth):
        self.init_gloo()
        model, optim = self._build(CoherentOffload(platform="discrete", optimizer="host", prefetch_depth=prefetch_depth))
        with self._record_issues():
            for step in range(2):  # the first forward learns the order
                self._step(model, optim, step)
            _events.clear()
            self._step(model, optim, 2)
        optim.synchronize()
        names = [f"blocks.{index}" for index in range(BLOCKS)]

        def position(kind: str, group: str, after: int = -1) -> int:
            # -1: issued before recording started (by the previous step's prefetch), i.e. earlier.
            found = [index for index, event in enumerate(_events) if event == (kind, group) and index > after]
            return found[0] if found else -1

        forward_end = position("forward", names[-1])
        for index in range(BLOCKS):
            computed = position("forward", names[index])
            for ahead in names[index + 1 : index + 1 + prefetch_depth]:
                with self.subTest(forward=names[index], copy=ahead):
                    self.assertLess(position("issue", ahead), computed, _events)
        # Backward: FSDP2 itself unshards the next block in backward order before a block's
        # backward, so our prefetch shows from the second block ahead on.
        if prefetch_depth >= 2:
            for index in range(BLOCKS - 1, 1, -1):
                computed = position("backward", names[index], after=forward_end)
                ahead = names[index - 2]
                with self.subTest(backward=names[index], copy=ahead):
                    issued = position("issue", ahead, after=forward_end)
                    self.assertGreater(issued, forward_end, _events)
                    self.assertLess(issued, computed, _events)

    def test_checkpoint_recompute_prefetches_in_backward_order(self):
        # A checkpointed block's forward runs again inside backward, where FSDP sees a forward:
        # the prefetch window must still look in backward order, never at a group whose backward
        # is done (that copy would be held until the next forward).
        self.init_gloo()
        torch.manual_seed(0)
        model = _CheckpointedNet()
        groups = [module for block in model.blocks for module in (block.first, block.second)]
        policy = CoherentOffload(platform="discrete", optimizer="host", prefetch_depth=2)
        fully_shard_with_policy(model, groups, policy, mesh=init_device_mesh("cpu", (self.world_size,)))
        optim = OffloadOptimizer(model, _RecordingAdamW, lr=1e-2)
        with self._record_issues():
            for step in range(3):  # the first forward learns the order
                _events.clear()
                generator = torch.Generator().manual_seed(100 * step + self.rank)
                model(torch.randn(3, DIM, generator=generator)).backward()
                backward_events = list(_events)
                optim.step()
                optim.zero_grad()
        optim.synchronize()
        done = set()
        late = []
        for kind, group in backward_events:
            if kind == "backward":
                done.add(group)
            elif kind == "issue" and group in done:
                late.append(group)
        self.assertEqual(late, [], backward_events)
        self.assertTrue(done, backward_events)

    def test_gradient_norms_computed_before_backward_ends(self):
        # By default nothing steps before step(), but the host computes each group's gradient
        # norms (for clip_grad_norm_) as they land: the first starts while backward still runs.
        self.init_gloo()
        model, optim = self._build(CoherentOffload(platform="discrete", optimizer="host"))
        self._step(model, optim, 0)  # the first step() attaches the optimizer to the groups
        optim.synchronize()
        _RecordingAdamW.started.clear()
        started = threading.Event()
        compute_norms = dtensor_grads.compute_norms

        def recording_compute_norms(grads, pool):
            started.set()
            return compute_norms(grads, pool)

        started_in_backward = []
        _on_backward_of_first_layer.append(
            lambda: started_in_backward.append((started.wait(_HOST_STEP_TIMEOUT_S), _RecordingAdamW.started.is_set()))
        )
        try:
            with mock.patch.object(host_steps, "compute_norms", recording_compute_norms):
                self._step(model, optim, 1)
        finally:
            _on_backward_of_first_layer.clear()
        optim.synchronize()
        # The norms started while backward ran; no group stepped before step().
        self.assertEqual(started_in_backward, [(True, False)])

    def test_accumulated_gradients_are_summed_where_they_were_reduced(self):
        # A micro-batch whose gradients add to earlier ones brings each offloaded group's running
        # sums up, adds its reduced shards to them on the device and sends the sums down: the host
        # adds nothing (Note: [Post-accumulate-grad hooks and accumulation]).
        self.init_gloo()
        model, optim = self._build(CoherentOffload(platform="discrete", optimizer="host"))
        labels = []
        h2d = TransferEngine.h2d

        def recording_h2d(engine, src, *args, **kwargs):
            labels.append(kwargs.get("label", "").split(":")[0])
            return h2d(engine, src, *args, **kwargs)

        generator = torch.Generator().manual_seed(self.rank)
        with mock.patch.object(TransferEngine, "h2d", recording_h2d), mock.patch.object(
            torch.Tensor, "add_", side_effect=AssertionError("a host add")
        ):
            for micro in range(3):
                model.set_requires_gradient_sync(micro == 2)
                model(torch.randn(3, DIM, generator=generator)).backward()
        optim.step()
        optim.synchronize()
        groups = len(optim._inner.offloaded_groups())
        self.assertGreater(groups, 0)
        # Every offloaded group, in each of the two micro-batches after the first.
        self.assertEqual(labels.count("grads_sum_h2d"), 2 * groups)

    def test_host_step_starts_before_backward_ends(self):
        self.init_gloo()
        model, optim = self._build(CoherentOffload(platform="discrete", optimizer="host"), step_during_backward=True)
        for step in range(2):  # overlap starts once a step showed the gradients' pattern
            self._step(model, optim, step)
        # The last step's host steps run on under the next forward: let them end, so that only a
        # step started in this backward can set the flag.
        optim.synchronize()
        _events.clear()
        _RecordingAdamW.started.clear()
        started_in_backward = []
        # Backward reached the model's first layer (every block's gradients were reduced and went
        # down before): hold it there until a block's host step started, as it does beside a long
        # backward. Without the overlap no host step starts before step().
        _on_backward_of_first_layer.append(
            lambda: started_in_backward.append(_RecordingAdamW.started.wait(_HOST_STEP_TIMEOUT_S))
        )
        try:
            self._step(model, optim, 2)
        finally:
            _on_backward_of_first_layer.clear()
        optim.synchronize()
        self.assertEqual(started_in_backward, [True], _events)
        self.assertLess(_events.index(("host_step", None)), _events.index(("backward", "first")))

    def test_next_forward_computes_while_a_later_groups_host_step_runs(self):
        # step() returns while the host steps run, and each group's copy-in waits for its own step
        # only: the next forward computes the first blocks while the last block's step is held,
        # and the last block's copy-in (prefetched by the block before it) waits for that step.
        self.init_gloo()
        gate = HostStepGate()
        policy = CoherentOffload(platform="discrete", optimizer="host", prefetch_depth=1)
        model, optim = self._build(policy, gate.optimizer_class(_RecordingAdamW))
        for step in range(2):  # the first forward learns the order
            self._step(model, optim, step)
        optim.synchronize()
        last = model.blocks[-1]
        gate.close(only=[param.to_local() for param in last.parameters()])
        generator = torch.Generator().manual_seed(200 + self.rank)
        model(torch.randn(3, DIM, generator=generator)).backward()
        optim.step()
        self.assertTrue(gate.holds_a_step())
        optim.zero_grad()
        _events.clear()

        def open_gate(module, args):
            _events.append(("open", None))
            gate.open()

        # Before FSDP's pre-forward unshard of the last block, which waits for its step.
        hook = last.register_forward_pre_hook(open_gate, prepend=True)
        try:
            with self._record_issues():
                model(torch.randn(3, DIM, generator=generator)).backward()
        finally:
            hook.remove()
            gate.open()
        optim.synchronize()
        held = _events[: _events.index(("open", None))]
        computed = [group for kind, group in held if kind == "forward"]
        self.assertEqual(computed, [f"blocks.{index}" for index in range(BLOCKS - 1)], _events)
        self.assertNotIn(("issue", last.name), held, _events)
        self.assertIn(("issue", last.name), _events)

    def test_host_steps_after_step_run_in_forward_order(self):
        # By default the host steps start in step(), all gradients landed; the next forward needs
        # the groups in forward order, so the worker steps them in that order.
        self.init_gloo()
        model, optim = self._build(CoherentOffload(platform="discrete", optimizer="host"))
        for step in range(2):  # the first forward learns the order
            self._step(model, optim, step)
        optim.synchronize()
        stepped = []
        step_group = host_steps.HostSteps._step_group

        def recording_step_group(self_, owner, inner):
            stepped.append(owner.label())
            return step_group(self_, owner, inner)

        generator = torch.Generator().manual_seed(200 + self.rank)
        model(torch.randn(3, DIM, generator=generator)).backward()
        groups = sorted(optim._inner.offloaded_groups(), key=lambda owner: owner.forward_index())
        for owner in groups:
            owner.wait_grads()
        with mock.patch.object(host_steps.HostSteps, "_step_group", recording_step_group):
            optim.step()
            optim.synchronize()
        optim.zero_grad()
        self.assertEqual(stepped, [owner.label() for owner in groups])
        self.assertEqual(len(stepped), BLOCKS + 1)  # the blocks and the root

    def test_one_copy_per_group_each_way(self):
        self.init_gloo()
        # step() returns once every step finished: its prefetch of the next forward's first group
        # is then always issued, before the count starts.
        model, optim = self._build(CoherentOffload(platform="discrete", optimizer="host"), overlap_next_forward=False)
        groups = BLOCKS + 1  # the blocks and the root, each with a weight and a bias
        engine = get_transfer_engine("cpu")
        for step in range(2):
            self._step(model, optim, step)
        optim.synchronize()
        engine.stats.reset()  # from one step's end (its prefetch issued) to the next's
        with self._record_issues():
            _events.clear()
            self._step(model, optim, 2)
        optim.synchronize()
        # Each block copies in for its forward and again for its backward; the root stays
        # unsharded from forward to backward. Gradients go down once per group.
        self.assertEqual(engine.stats.h2d_copies, 2 * BLOCKS + 1)
        self.assertEqual(engine.stats.d2h_copies, groups)
        issued = [group for kind, group in _events if kind == "issue"]
        self.assertEqual(sorted(set(issued)), sorted(["root", *(f"blocks.{index}" for index in range(BLOCKS))]))
        self.assertEqual(len(issued), 2 * BLOCKS + 1)


instantiate_parametrized_tests(AsyncPathTest)


if __name__ == "__main__":
    run_tests()
