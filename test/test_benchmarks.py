"""The benchmarks' own arithmetic (row names, lower bounds, the memory-at-peak breakdown): CPU only.

The benchmarks run on a GPU; what they compute from their measurements is checked here.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import weakref

import torch
from torch.testing._internal.common_utils import run_tests, TestCase

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import activations  # noqa: E402
import fsdp_offload  # noqa: E402
import planner_validate  # noqa: E402
from memory_snapshot import peak_breakdown  # noqa: E402
from torch_fsdp_offload.models import build_model, causal_lm_loss, TransformerConfig  # noqa: E402


def _event(action: str, addr: int, size: int, filename: str = "x.py", line: int = 1) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": [{"filename": filename, "line": line, "name": "f"}]}


class TestMemorySnapshot(TestCase):
    def test_peak_breakdown_replays_the_trace(self):
        ours = "/repo/torch_fsdp_offload/transfer.py"
        trace = [
            _event("alloc", 1, 100, ours, 10),
            _event("alloc", 2, 300, "/site-packages/torch/autograd.py", 5),
            _event("alloc", 3, 50, ours, 10),
            _event("free_requested", 2, 300),  # the peak (450) was before this
            _event("alloc", 4, 200, ours, 20),  # 350 now: below the peak
        ]
        result = peak_breakdown({"device_traces": [trace]})
        self.assertEqual(result["peak_above_start_GiB"], round(450 / (1 << 30), 3))
        self.assertEqual(
            [(site["site"], site["count"]) for site in result["sites"]],
            [("autograd.py:5:f", 1), ("transfer.py:10:f", 2)],
        )

    def test_empty_trace(self):
        self.assertEqual(peak_breakdown({"device_traces": [[]]}), {"peak_above_start_GiB": 0.0, "sites": []})


class TestActivationsBenchmark(TestCase):
    def test_counting_saved_bytes_keeps_nothing_alive(self):
        # The count runs a forward that is never backwarded; whatever it saved must be freed, or
        # every row measured after it carries those bytes in its peak.
        model = build_model(TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16))
        outputs: list[weakref.ref] = []
        handles = [
            module.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
            for module in model.modules()
        ]
        tokens = torch.zeros(2, 16, dtype=torch.long)
        distinct, every_save = activations._count_saved_bytes(model, tokens)
        for handle in handles:
            handle.remove()
        self.assertGreater(len(outputs), 5)
        self.assertEqual(sum(ref() is not None for ref in outputs), 0)
        # The same counts from a forward whose graph keeps its tensors (then backwarded to free them).
        storages, saves = {}, []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saves.append(tensor.numel() * tensor.element_size())
            if not isinstance(tensor, torch.nn.Parameter) and not isinstance(tensor._base, torch.nn.Parameter):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()
        self.assertEqual((distinct, every_save), (sum(storages.values()), sum(saves)))


class TestPlannerValidate(TestCase):
    def test_rows_after_a_leftover_are_flagged(self):
        # Recorded teardown leftovers decide where present; before they were, a next-fwd row with
        # GPU-resident groups is taken to have left its state allocated.
        recorded = [{"name": "resident", "allocated_after_teardown_GiB": 0.0},
                    {"name": "coherent(host;next-fwd;modules=0.5)", "allocated_after_teardown_GiB": 9.07},
                    {"name": "coherent(stream)", "allocated_after_teardown_GiB": 0.01},
                    {"name": "coherent(host)"}]
        flags = [planner_validate.leftover_before(recorded, i, "fsdp_offload") for i in range(4)]
        self.assertEqual([flag is not None for flag in flags], [False, False, True, False])
        older = [{"name": "coherent(host;next-fwd;modules=0.5)"}, {"name": "coherent(stream)"},
                 {"name": "coherent(host;next-fwd)"}, {"name": "resident"}]
        flags = [planner_validate.leftover_before(older, i, "fsdp_offload") for i in range(4)]
        self.assertEqual([flag is not None for flag in flags], [False, True, False, False])
        self.assertIsNone(planner_validate.leftover_before(older, 1, "activations"))


class TestFsdpOffloadBenchmark(TestCase):
    def test_row_names(self):
        self.assertTrue(fsdp_offload.checkpointed("resident;ac"))
        self.assertTrue(fsdp_offload.checkpointed("coherent(split=0.25;next-fwd;modules=0.625;ac;depth=1)"))
        self.assertFalse(fsdp_offload.checkpointed("coherent(host;next-fwd;modules=0.625;act=0.5)"))
        self.assertEqual(
            fsdp_offload.optimizer_kwargs("coherent(host;next-fwd;threads=12)"),
            {"lr": 1e-4, "fused": True, "overlap_next_forward": True, "host_threads": 12},
        )
        for name in fsdp_offload.COHERENT_ROWS:
            self.assertTrue(name.startswith("coherent(") and name.endswith(")"), name)
        for name in fsdp_offload.DEFAULT_ROWS:
            self.assertTrue(fsdp_offload.known_row(name), name)
        self.assertFalse(fsdp_offload.known_row("coherent(host;typo)"))
        # A misspelt row is refused before anything runs.
        with self.assertRaises(SystemExit):
            with contextlib.redirect_stderr(io.StringIO()):
                fsdp_offload.main(["--rows", "resident,coherent(host;typo)"])

    def test_lower_bound_terms(self):
        resident = {"fwd_s": 0.05, "bwd_s": 0.1}
        bandwidth = {"h2d_GBps": 50.0, "d2h_GBps": 50.0, "both_GBps": 100.0}
        host = {"adamw_s_per_Gparam": 0.2, "cast_s_per_Gparam": 0.1}
        row = {"name": "coherent(host;next-fwd)", "h2d_GB": 10.0, "d2h_GB": 5.0, "host_stepped_params": 2e9, "n_blocks": 8}
        # next-fwd: the whole host work (0.6 s) may hide; it is the largest term.
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.6)
        # Without next-fwd only the backward of all but one group hides host work.
        row["name"] = "coherent(host)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.15 + 0.6 - 0.1 * 8 / 9)
        # Nothing on the host: the link (10 GB at 50 GB/s) is the bound.
        row["host_stepped_params"] = 0
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.2)


if __name__ == "__main__":
    run_tests()
