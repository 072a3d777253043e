"""The benchmarks' own arithmetic (row names, lower bounds, the memory-at-peak breakdown): CPU only.

The benchmarks run on a GPU; what they compute from their measurements is checked here, on result
files the tests write themselves (the committed results are data, not fixtures).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import weakref
from unittest import mock

import torch
from torch.testing._internal.common_utils import run_tests, TestCase

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import activations  # noqa: E402
import fsdp_offload  # noqa: E402
import shadow_copy  # noqa: E402
import models as models_benchmark  # noqa: E402
import multi_gpu  # noqa: E402
import peers  # noqa: E402
import peers_capacity  # noqa: E402
import planner_validate  # noqa: E402
import row_grammar  # noqa: E402
import stream_timeline  # noqa: E402
import transfer  # noqa: E402
import user_loop  # noqa: E402
from memory_snapshot import peak_breakdown  # noqa: E402
from common_offload import GlooMultiProcessTestCase  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch_fsdp_offload import CoherentOffload, OffloadOptimizer  # noqa: E402
from torch_fsdp_offload.models import build_model, causal_lm_loss, TransformerConfig  # noqa: E402
from torch_fsdp_offload.planner import TrainingConfig  # noqa: E402


def _fsdp_offload_result() -> dict:
    """A small ``benchmarks/fsdp_offload.py`` result: the resident row, stock offload and one
    CoherentOffload row of anchor-1.6b at bs 4, with the link and host rates measured beside them."""
    host = {"adamw_s_per_Gparam": 0.25, "cast_s_per_Gparam": 0.08, "threads": 2,
            "link_busy": {"adamw_s_per_Gparam": 0.4, "cast_s_per_Gparam": 0.15, "link_GBps_meanwhile": 90.0}}

    def row(name: str, step_s: float, peak: float, **measured) -> dict:
        return {"name": name, "batch_size": 4, "params_M": 1611.0, "step_s": step_s, "fwd_s": 0.045, "bwd_s": 0.1,
                "opt_s": 0.013, "host_optimizer_s": 0.0, "peak_gpu_GiB": peak, "h2d_GB": 0.0, "d2h_GB": 0.0,
                "n_blocks": 8, "allocated_after_teardown_GiB": 0.06, **measured}

    offloaded = {"h2d_GB": 6.4, "d2h_GB": 6.4, "host_stepped_params": 1611014144, "offloaded_params": 1611014144}
    rows = [row("resident", 0.158, 27.4),
            row("stock_cpu_offload+fused_cpu_adamw", 0.8, 8.9, **{**offloaded, "h2d_GB": 12.9}),
            row("coherent(early;host;next-fwd)", 0.69, 10.0, host_optimizer_s=0.68, **offloaded)]
    return {"benchmark": "fsdp_offload", "torch": torch.__version__, "gpu": "NVIDIA H200", "model": "anchor-1.6b",
            "seq_len": 2048, "link_GBps": {"h2d_GBps": 55.0, "d2h_GBps": 55.0, "both_GBps": 97.0},
            "host_optimizer_measured": host, "rows": rows}


def _write_json(directory: str, name: str, content) -> str:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(content, handle)
    return path


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

    def test_repeated_rows_report_median_times_and_highest_peak(self):
        def measured(step_s: float, peak_gib: float) -> dict:
            return {"row": "checkpoint", "step_s": step_s, "forward_s": step_s / 4, "backward_s": step_s / 2,
                    "optimizer_s": 0.01, "peak_gib": peak_gib, "reserved_peak_gib": peak_gib + 1, "d2h_bytes": 7}

        row = activations._median_of_rounds([measured(0.30, 9.0), measured(0.20, 9.5), measured(0.25, 9.2)])
        self.assertEqual(row["step_s"], 0.25)
        self.assertEqual(row["forward_s"], 0.0625)
        self.assertEqual(row["step_s_rounds"], [0.30, 0.20, 0.25])
        self.assertEqual((row["peak_gib"], row["reserved_peak_gib"], row["d2h_bytes"]), (9.5, 10.5, 7))
        # One round: the row as measured, no rounds list.
        self.assertEqual(activations._median_of_rounds([measured(0.3, 9.0)]), measured(0.3, 9.0))

    def test_rounds_alternate_the_row_order(self):
        order: list[str] = []

        def run_row(name, model, optimizer, tokens, *, args, save_on_cpu_bytes, profile_path):
            order.append(name)
            return {"row": name, "step_s": float(len(order)), "forward_s": 0.0, "backward_s": 0.0,
                    "optimizer_s": 0.0, "peak_gib": 1.0, "reserved_peak_gib": 1.0}

        args = argparse.Namespace(repeats=3, profile=False, profiled=False, fraction=0.5, out="unused.json")
        with mock.patch.object(activations, "run_row", run_row), contextlib.redirect_stdout(io.StringIO()):
            rows = activations._measure_rows(["resident", "checkpoint"], lambda name: (None, None), None, args, 0, "c")
        self.assertEqual(order, ["resident", "checkpoint", "checkpoint", "resident", "resident", "checkpoint"])
        self.assertEqual([(row["row"], row["step_s_rounds"]) for row in rows],
                         [("resident", [1.0, 4.0, 5.0]), ("checkpoint", [2.0, 3.0, 6.0])])


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

    def test_decision_rule_makes_offload_pay(self):
        # The rule the planner recommends by, applied to either predicted or measured steps: a row
        # that moves bytes wins only if it beats the fastest row that moves nothing by the margin.
        from torch_fsdp_offload.planner.search import OFFLOAD_MARGIN as margin

        checkpoint = {"name": "checkpoint", "moved_bytes": 0, "step": 0.346}
        offload = {"name": "checkpoint+offload", "moved_bytes": 8e9, "step": 0.344}
        self.assertIs(planner_validate.decide([checkpoint, offload], "step"), checkpoint)
        offload["step"] = 0.346 / (1 + margin) - 1e-6
        self.assertIs(planner_validate.decide([checkpoint, offload], "step"), offload)
        # With nothing that stays, the fastest mover; within 2% of it, the one that moves fewer bytes.
        other = {"name": "offload(all)", "moved_bytes": 16e9, "step": 0.6}
        self.assertIs(planner_validate.decide([other, offload], "step"), offload)
        fewer = {"name": "last=0.5", "moved_bytes": 6e9, "step": offload["step"] * 1.015}
        self.assertIs(planner_validate.decide([other, offload, fewer], "step"), fewer)
        fewer["step"] = offload["step"] * 1.03
        self.assertIs(planner_validate.decide([other, offload, fewer], "step"), offload)

    def test_budget_scope_ranks_by_tokens_per_second(self):
        # Rows of several micro-batches compete by tokens per second, not step time.
        def row(name, batch, predicted, measured):
            return {"name": name, "batch_size": batch, "tokens": batch * 2048, "predicted_step_s": predicted,
                    "measured_step_s": measured, "moved_bytes": 8e9}

        small, large = row("split", 4, 0.42, 0.384), row("host", 16, 0.69, 0.771)
        result = planner_validate.agreement("f.json", "any micro-batch", None, "budget 13.7 GiB", [small, large], [small, large])
        self.assertEqual((result["planner_pick"], result["measured_best"], result["agree"]), ("host (bs 16)", "host (bs 16)", True))
        self.assertEqual(result["pick_over_best"], 1.0)

    def test_rounds_that_overlap_are_a_tie(self):
        best = {"measured_step_s_rounds": [0.342, 0.344, 0.345]}
        self.assertTrue(planner_validate.measured_tie({"measured_step_s_rounds": [0.345, 0.346, 0.347]}, best))
        self.assertFalse(planner_validate.measured_tie({"measured_step_s_rounds": [0.3451, 0.346, 0.347]}, best))
        # One step time per row (no --repeats) orders the rows as measured.
        self.assertFalse(planner_validate.measured_tie({"measured_step_s_rounds": None}, best))

    def test_host_step_measured_here_for_every_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = _write_json(tmp, "fsdp_offload.json", _fsdp_offload_result())
            out = os.path.join(tmp, "v.json")
            with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
                planner_validate.main([path, "--measure-host", "--host-GBps", "100", "--out", out])
            self.assertIn("pick one", err.getvalue())
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(planner_validate.main([path, "--measure-host", "--out", out]), 0)
            with open(out, encoding="utf-8") as handle:
                validated = json.load(handle)
        measured = validated["host_step_measured_here"]
        self.assertGreater(measured["alone_s_per_param"], 0)
        if not torch.cuda.is_available():
            # No link to keep busy: the files fall back to the bandwidth model, not to their own rates.
            self.assertIsNone(measured["link_busy_s_per_param"])
            self.assertIsNone(validated["files"][0]["host_step_ns_per_param"])

    def test_offline_validation_of_a_result_file(self):
        # The resident row calibrates, stock offload is skipped, the CoherentOffload row is predicted.
        with tempfile.TemporaryDirectory() as tmp:
            path = _write_json(tmp, "fsdp_offload.json", _fsdp_offload_result())
            out = os.path.join(tmp, "v.json")
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(planner_validate.main([path, "--offline", "--out", out]), 0)
            with open(out, encoding="utf-8") as handle:
                validated = json.load(handle)
        self.assertEqual(validated["summary"]["rows_predicted"], 1)
        self.assertEqual(len(validated["files"]), 1)

    def test_contract_rows_are_predicted_and_picked_per_clipping_mode(self):
        # Rows that step nothing before step() and clipped rows are predicted; a clipping loop's
        # pick is among clipped rows only, and clip / user-clip of one setting are not a choice.
        results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
        paths = [os.path.join(results, f"fsdp_offload_contract_bs{bs}.json") for bs in (4, 16)]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "v.json")
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(planner_validate.main([*paths, "--offline", "--out", out]), 0)
            with open(out, encoding="utf-8") as handle:
                validated = json.load(handle)
        bs4, bs16 = sorted(validated["files"], key=lambda f: "bs16" in f["file"])
        self.assertEqual([a["scope"] for a in bs16["agreements"]], ["all rows", "without resident", "all rows, clipped"])
        rows = {r["name"]: r for r in bs4["rows"]}
        split = "coherent(split=0.55;next-fwd;depth=1;cast=device"
        self.assertEqual(rows[f"{split};clip)"]["config"], "modules=1.00 opt=split0.55 cast=device clip")
        self.assertTrue(rows[f"{split};user-clip)"]["clipping"])
        self.assertFalse(rows[f"{split})"]["clipping"])
        self.assertIn("skipped", rows[f"{split};accum=4)"])  # four micro-batches a step
        for entry in bs4["agreements"]:
            picked = entry["planner_pick"].split(" (bs")[0]
            self.assertEqual(rows[picked]["clipping"], "clipped" in entry["scope"])
        self.assertIn("all rows, clipped", [a["scope"] for a in bs4["agreements"]])

    def test_a_file_that_is_not_a_result_object_is_skipped(self):
        # The default run reads every JSON under benchmarks/results; one that is not an object
        # (a bare list of rows) is named and skipped, the others validated.
        with tempfile.TemporaryDirectory() as tmp:
            listed = _write_json(tmp, "rows.json", [{"name": "resident", "step_s": 0.1}])
            good = _write_json(tmp, "fsdp_offload.json", _fsdp_offload_result())
            out = os.path.join(tmp, "v.json")
            argv = [listed, good, "--offline", "--out", out]
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(planner_validate.main(argv), 0)
            self.assertIn("rows.json: cannot validate (ValueError: a JSON list, not a benchmark's result object)", err.getvalue())
            with open(out, encoding="utf-8") as handle:
                self.assertEqual(len(json.load(handle)["files"]), 1)

    def test_plot_of_a_result_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            argv = [_write_json(tmp, "fsdp_offload.json", _fsdp_offload_result()), "--offline",
                    "--out", os.path.join(tmp, "v.json"), "--plot", os.path.join(tmp, "v.png")]
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
                    planner_validate.main(argv)
                self.assertIn("pip install", err.getvalue())
                self.assertFalse(os.path.exists(os.path.join(tmp, "v.json")))  # refused before anything ran
            else:
                with contextlib.redirect_stdout(io.StringIO()):
                    self.assertEqual(planner_validate.main(argv), 0)
                with open(os.path.join(tmp, "v.png"), "rb") as handle:
                    self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")


class TestFsdpOffloadSharding(GlooMultiProcessTestCase):
    WORLD_SIZE = 1

    def test_units_shard_attention_and_feed_forward_inside_the_checkpoint(self):
        # units=2: the groups are each block's attention and feed-forward, inside the checkpoint
        # wrapper; last=F and keep=N count blocks, so the policy and reshard_after_forward=False
        # go to both groups of the blocks they name.
        self.init_gloo()
        model = build_model("tiny", device="cpu")
        fsdp_offload._shard(model, CoherentOffload(platform="discrete", optimizer="host"), True, 0.5, 1, 2)
        units = [unit for block in model.blocks for unit in (block.attention, block.feed_forward)]
        self.assertFalse(any(isinstance(block, FSDPModule) for block in model.blocks))
        groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
        self.assertEqual([isinstance(group.offload_policy, CoherentOffload) for group in groups], [False, False, True, True])
        self.assertEqual([group.post_forward_mesh_info is None for group in groups], [False, False, True, True])
        optim = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        tokens = torch.randint(0, model.config.vocab_size, (2, 9))
        causal_lm_loss(model(tokens), tokens).backward()
        optim.step()
        self.assertEqual(optim.stepped_numel["host"], sum(p.numel() for p in (*units[2].parameters(), *units[3].parameters())))


class TestFsdpOffloadBenchmark(TestCase):
    def test_rederive_skips_files_it_cannot_recompute(self):
        # A file without the host rates cannot have its bounds recomputed, and another benchmark's
        # file is no fsdp_offload result: each is named and skipped, the others printed.
        data = _fsdp_offload_result()
        with tempfile.TemporaryDirectory() as tmp:
            good = _write_json(tmp, "good.json", data)
            other = _write_json(tmp, "other.json", [data["rows"][0]])
            older = _write_json(tmp, "older.json", {k: v for k, v in data.items() if k != "host_optimizer_measured"})
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(fsdp_offload.main(["--rederive", older, other, good]), 2)
        self.assertIn("older.json: no host_optimizer_measured to recompute from; skipped", err.getvalue())
        self.assertIn("other.json: not a benchmarks/fsdp_offload.py result; skipped", err.getvalue())
        self.assertIn(f"== {good}", out.getvalue())
        self.assertIn("coherent(early;host;next-fwd)", out.getvalue())

    def test_host_rates_from_the_planners_measurement(self):
        # The benchmark's host rates are measure_host_step's (one timing of the host step in the
        # library), at the thread count that ran fastest alone, then with the link busy at that
        # count, in the per-Gparam layout its files and --rederive read.
        from torch_fsdp_offload.host_step import HostStepRates

        calls = []

        def measured(numel, *, threads, repeats, link_busy):
            calls.append((threads, link_busy))
            alone = {1: 0.5e-9, 2: 0.3e-9}[threads]
            if link_busy:
                return HostStepRates(alone, 2 * alone, 90.04, alone / 4, alone / 2)
            return HostStepRates(alone, alone_cast_s_per_param=alone / 4)

        with mock.patch.object(torch, "get_num_threads", return_value=2), mock.patch.object(
            fsdp_offload, "measure_host_step", measured
        ):
            host = fsdp_offload.measure_host_optimizer(1 << 10, repeats=1)
        self.assertEqual(calls, [(1, False), (2, False), (2, True)])
        self.assertEqual(host["threads"], 2)
        self.assertEqual((host["adamw_s_per_Gparam"], host["cast_s_per_Gparam"]), (0.225, 0.075))
        self.assertEqual(host["by_threads"][1], {"adamw_s_per_Gparam": 0.375, "cast_s_per_Gparam": 0.125})
        self.assertEqual(host["link_busy"], {"adamw_s_per_Gparam": 0.45, "cast_s_per_Gparam": 0.15, "link_GBps_meanwhile": 90.0})

    def test_row_names(self):
        self.assertTrue(row_grammar.checkpointed("resident;ac"))
        self.assertTrue(row_grammar.checkpointed("coherent(split=0.25;next-fwd;modules=0.625;ac;depth=1)"))
        self.assertFalse(row_grammar.checkpointed("coherent(host;next-fwd;modules=0.625;act=0.5)"))
        self.assertEqual(
            row_grammar.optimizer_kwargs("coherent(host;next-fwd;threads=12)"),
            {"lr": 1e-4, "fused": True, "overlap_next_forward": True, "step_during_backward": False, "host_threads": 12},
        )
        self.assertEqual(
            row_grammar.optimizer_kwargs("coherent(host;early;clip)"),
            {"lr": 1e-4, "fused": True, "max_grad_norm": 1.0, "overlap_next_forward": False, "step_during_backward": True},
        )
        # default: CoherentOffload() and OffloadOptimizer's own defaults, clipping by either way.
        self.assertEqual(row_grammar.coherent_row_config("coherent(default;user-clip)"), {})
        self.assertEqual(row_grammar.optimizer_kwargs("coherent(default;clip)"), {"lr": 1e-4, "fused": True, "max_grad_norm": 1.0})
        self.assertTrue(row_grammar.user_clips("coherent(default;user-clip)"))
        self.assertTrue(row_grammar.user_clips("stock_cpu_offload+fused_cpu_adamw;user-clip"))
        self.assertFalse(row_grammar.user_clips("coherent(default;clip)"))
        self.assertTrue(row_grammar.known_row("stock_cpu_offload+fused_cpu_adamw;user-clip"))
        self.assertFalse(row_grammar.known_row("coherent(default;host)"))
        # accum=N: N micro-batches a step, on any row.
        self.assertEqual(row_grammar.coherent_row_config("coherent(default;accum=4)"), {})
        self.assertEqual(row_grammar.accumulated_micro_batches("resident;accum=4"), 4)
        self.assertEqual(row_grammar.accumulated_micro_batches("coherent(default)"), 1)
        self.assertTrue(row_grammar.known_row("resident;accum=4"))
        for name in row_grammar.DEFAULT_ROWS:
            self.assertTrue(row_grammar.known_row(name), name)
        self.assertEqual(
            row_grammar.coherent_row_config("coherent(split=0.25;next-fwd;modules=0.625;ac;depth=1)"),
            {"optimizer": 0.25, "prefetch_depth": 1},
        )
        self.assertEqual(row_grammar.coherent_row_config("coherent(host;next-fwd;last=0.5;act=0.5)"),
                         {"optimizer": "host", "prefetch_depth": 2, "activations": 0.5})
        for bad, reason in (
            ("coherent(host;typo)", "unknown item 'typo'"),
            ("coherent(next-fwd)", "no optimizer placement"),
            ("coherent(host;split=0.5)", "two optimizer placements"),
            ("coherent(host;modules=0.5;last=0.5)", "both modules= and last="),
            ("resident(host)", "not a CoherentOffload row"),
            ("coherent(stream;chunk=256)", "unknown item 'chunk=256'"),
            ("coherent(host;modules=1.5)", "modules=1.5 is not a fraction of the blocks"),
            ("coherent(split=1.5)", "optimizer=1.5) is not a placement"),
            ("coherent(host;units=3)", "units=3 is not 1 or 2"),
            ("coherent(host;cast=gpu)", "unknown item 'cast=gpu'"),
        ):
            with self.assertRaisesRegex(ValueError, re.escape(reason)):
                row_grammar.coherent_row_config(bad)
            self.assertFalse(row_grammar.known_row(bad))
        self.assertEqual(row_grammar.coherent_row_config("coherent(host;cast=device)"),
                         {"optimizer": "host", "prefetch_depth": 2, "cast_on": "device"})
        # "last=F": the policy per module on the last F of the blocks, "modules=F" on F of them
        # spread evenly; the step model reads them as module_fraction F placed last in forward
        # order, or spread.
        self.assertEqual(row_grammar.last_blocks_fraction("coherent(host;next-fwd;last=0.5)"), 0.5)
        self.assertIsNone(row_grammar.last_blocks_fraction("coherent(host;next-fwd;modules=0.5)"))
        self.assertEqual(row_grammar.spread_blocks_fraction("coherent(host;next-fwd;modules=0.5)"), 0.5)
        self.assertIsNone(row_grammar.spread_blocks_fraction("coherent(host;next-fwd;last=0.5)"))
        # "units=2": each block sharded as its attention and feed-forward groups, a sharding knob.
        units = "coherent(host;next-fwd;last=0.5;keep=1;ac;units=2)"
        self.assertEqual(row_grammar.units_per_block(units), 2)
        self.assertEqual(row_grammar.units_per_block(units.replace(";units=2", "")), 1)
        self.assertEqual(row_grammar.coherent_row_config(units), {"optimizer": "host", "prefetch_depth": 2})
        # "keep=N": the last N blocks not resharded after forward, a sharding knob, not a policy one.
        kept = "coherent(host;next-fwd;last=0.625;keep=5;ac)"
        self.assertEqual(row_grammar.kept_unsharded_blocks(kept), 5)
        self.assertEqual(row_grammar.kept_unsharded_blocks("coherent(host;last=0.625)"), 0)
        self.assertEqual(row_grammar.coherent_row_config(kept), {"optimizer": "host", "prefetch_depth": 2})
        self.assertEqual(planner_validate.row_config({"name": kept.replace("(", "(early;")}, "host").keep_unsharded, 5)
        config = planner_validate.row_config({"name": "coherent(early;split=0.25;next-fwd;last=0.625;ac;depth=1)"}, "host")
        self.assertEqual((config.module_fraction, config.optimizer, config.checkpointing, config.prefetch_depth),
                         (0.625, 0.25, True, 1))
        self.assertEqual(config.block_placement, "last")
        spread = planner_validate.row_config({"name": "coherent(early;host;next-fwd;modules=0.625)"}, "host")
        self.assertTrue(spread.step_during_backward)
        self.assertEqual(spread.offloaded_blocks(8), [1, 3, 4, 6, 7])
        # Rows that step nothing before step() are predicted in that mode, clipped rows as clipping.
        contract = planner_validate.row_config({"name": "coherent(host;next-fwd;modules=0.625)"}, "host")
        self.assertEqual((contract.module_fraction, contract.step_during_backward, contract.clipping), (0.625, False, False))
        for clipped in ("coherent(host;next-fwd;last=0.5;clip)", "coherent(host;next-fwd;last=0.5;user-clip)"):
            self.assertTrue(planner_validate.row_config({"name": clipped}, "host").clipping)
        # default rows: CoherentOffload()'s defaults (every group, optimizer="auto", prefetch_depth=1).
        default = planner_validate.row_config({"name": "coherent(default;clip)"}, 0.5, 2)
        self.assertEqual((default.module_fraction, default.optimizer, default.prefetch_depth, default.clipping),
                         (1.0, 0.5, 1, True))
        # optimizer="auto" streams half the groups on a discrete GPU.
        self.assertEqual(planner_validate.auto_optimizer("discrete"), 0.5)
        # A misspelt row is refused before anything runs.
        with self.assertRaises(SystemExit):
            with contextlib.redirect_stderr(io.StringIO()):
                fsdp_offload.main(["--rows", "resident,coherent(host;typo)"])
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
            fsdp_offload.main(["--rows", "resident", "--switch-interval", "0"])
        self.assertIn("--switch-interval must be > 0", err.getvalue())

    def test_lower_bound_terms(self):
        resident = {"fwd_s": 0.05, "bwd_s": 0.1}
        bandwidth = {"h2d_GBps": 50.0, "d2h_GBps": 50.0, "both_GBps": 100.0}
        host = {"adamw_s_per_Gparam": 0.2, "cast_s_per_Gparam": 0.1}
        row = {"name": "coherent(host;next-fwd;early)", "h2d_GB": 10.0, "d2h_GB": 5.0, "host_stepped_params": 2e9, "n_blocks": 8}
        # early and next-fwd: the whole host work (0.6 s) may hide; it is the largest term.
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.6)
        # early without next-fwd: only the backward of all but one group hides host work.
        row["name"] = "coherent(host;early)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.15 + 0.6 - 0.1 * 8 / 9)
        # Nothing before step() (the default): host steps start after backward and may hide under
        # the next forward only; without next-fwd, under nothing.
        row["name"] = "coherent(host;next-fwd)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.1 + 0.6)
        row["name"] = "coherent(default)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.1 + 0.6)
        row["name"] = "coherent(host)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.15 + 0.6)
        # cast=device: the host only steps (0.4 s); the cast runs on the GPU.
        row["name"] = "coherent(host;next-fwd;early;cast=device)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.4)
        # Nothing on the host: the link (10 GB at 50 GB/s) is the bound.
        row["host_stepped_params"] = 0
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.2)

    def test_shared_dram_lower_bound(self):
        # LBs: the host work (0.6 s alone, 1.2 s beside a link busy at 75 GB/s) pays half a second
        # per second of the row's own DMA (15 GB: 0.2 s).
        resident = {"fwd_s": 0.05, "bwd_s": 0.1}
        bandwidth = {"h2d_GBps": 50.0, "d2h_GBps": 50.0, "both_GBps": 100.0}
        host = {"adamw_s_per_Gparam": 0.2, "cast_s_per_Gparam": 0.1,
                "link_busy": {"adamw_s_per_Gparam": 0.4, "cast_s_per_Gparam": 0.2, "link_GBps_meanwhile": 75.0}}
        row = {"name": "coherent(host;next-fwd;early)", "h2d_GB": 10.0, "d2h_GB": 5.0, "host_stepped_params": 2e9, "n_blocks": 8}
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.6)
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host, shared_dram=True), 0.6 + 0.2 * 0.5)
        # Never more than the whole host work at the busy rate.
        self.assertAlmostEqual(
            fsdp_offload.host_work_s(2e9, 200.0, host, cast=True, shared_dram=True), 0.6 + 1.2 * 0.5
        )
        # Stock offload casts on the GPU: its host work is the AdamW step alone.
        self.assertAlmostEqual(fsdp_offload.host_work_s(2e9, 0.0, host, cast=False, shared_dram=False), 0.4)

    def test_lower_bound_with_the_dependency_chain(self):
        # LBd: a next-fwd row's host waits while the GPU runs the forward over the host-stepped
        # parameters' share (half of 0.05 s) and one group's backward (0.1 s over 8 * 2 + 1 groups).
        resident = {"fwd_s": 0.05, "bwd_s": 0.1}
        bandwidth = {"h2d_GBps": 50.0, "d2h_GBps": 50.0, "both_GBps": 100.0}
        host = {"adamw_s_per_Gparam": 0.2, "cast_s_per_Gparam": 0.1,
                "link_busy": {"adamw_s_per_Gparam": 0.4, "cast_s_per_Gparam": 0.2, "link_GBps_meanwhile": 75.0}}
        row = {"name": "coherent(host;next-fwd;early;last=0.5;keep=1;ac;units=2)", "h2d_GB": 10.0, "d2h_GB": 5.0,
               "host_stepped_params": 1e9, "params_M": 2000.0, "n_blocks": 8}
        chain = 0.05 * 0.5 + 0.1 / 17
        self.assertAlmostEqual(fsdp_offload.dependency_chain_s(row, resident), chain)
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host), 0.3)
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host, chain=True), 0.3 + chain)
        # LBsd: the same chain after the host work slowed by the row's own DMA.
        shared = fsdp_offload.lower_bound(row, resident, bandwidth, host, shared_dram=True)
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host, shared_dram=True, chain=True),
                               shared + chain)
        # Without next-fwd the host term already waits for the last group: the chain adds nothing.
        row["name"] = "coherent(host;early;last=0.5)"
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host, chain=True),
                               fsdp_offload.lower_bound(row, resident, bandwidth, host))
        # Nothing stepped on the host: no chain; the link bounds the row.
        row.update(name="coherent(stream;next-fwd)", host_stepped_params=0)
        self.assertAlmostEqual(fsdp_offload.lower_bound(row, resident, bandwidth, host, chain=True), 0.2)

    def test_derived_columns_of_the_rows_measured_so_far(self):
        # The results are written after every row: the columns must come out right whichever rows
        # of a batch size have been measured when a run stops.
        bandwidth = {"h2d_GBps": 50.0, "d2h_GBps": 50.0, "both_GBps": 100.0}
        host = {"adamw_s_per_Gparam": 0.2, "cast_s_per_Gparam": 0.1,
                "link_busy": {"adamw_s_per_Gparam": 0.4, "cast_s_per_Gparam": 0.2, "link_GBps_meanwhile": 90.0}}

        def row(name: str, step_s: float, peak: float, batch_size: int = 4) -> dict:
            return {"name": name, "batch_size": batch_size, "step_s": step_s, "fwd_s": 0.05, "bwd_s": 0.1,
                    "peak_gpu_GiB": peak, "h2d_GB": 0.0, "d2h_GB": 0.0, "n_blocks": 8}

        rows = [row("stock_cpu_offload+fused_cpu_adamw", 0.8, 9.0)]
        fsdp_offload.add_derived_columns(rows, 4, bandwidth, host)
        self.assertNotIn("step_over_lb", rows[0])  # no resident row yet: nothing to compare with
        rows += [row("resident", 0.16, 27.0), row("resident", 0.3, 35.0, batch_size=8), {"name": "x", "batch_size": 4, "error": "OOM"}]
        fsdp_offload.add_derived_columns(rows, 4, bandwidth, host)
        self.assertEqual(rows[0]["speedup_vs_stock"], 1.0)
        self.assertEqual(rows[0]["peak_vs_resident"], 0.33)
        self.assertEqual(rows[1]["speedup_vs_stock"], 5.0)
        self.assertEqual(rows[1]["step_over_lb"], round(0.16 / 0.15, 2))
        # Rows that step nothing on the host have no chain: LBd and LBsd are LB and LBs.
        self.assertEqual((rows[1]["step_over_lb_chain"], rows[1]["step_over_lb_shared_dram_chain"]),
                         (rows[1]["step_over_lb"], rows[1]["step_over_lb_shared_dram"]))
        self.assertNotIn("speedup_vs_stock", rows[2])  # another batch size
        self.assertNotIn("step_over_lb", rows[3])
        # Accumulating 4 micro-batches: 4x the GPU work, and the host step (0.2 s/Gparam x 1.5
        # Gparam, cast 0.1 s/Gparam) starts after the last backward, behind 3 micro-batches.
        accumulating = {**row("coherent(default;accum=4)", 1.0, 9.0), "micro_batches": 4, "host_stepped_params": 1.5e9, "params_M": 1500.0}
        self.assertAlmostEqual(fsdp_offload.lower_bound(accumulating, rows[1], bandwidth, host), 0.1 + 0.45 + 3 * 0.15)


class TestShadowCopyBenchmark(TestCase):
    def test_counts_the_step_and_the_shadow_copy(self):
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()) as printed:
            out = os.path.join(tmp, "shadow_copy.json")
            shadow_copy.main(["--params", "8192", "--tensors", "2", "--threads", "1", "--repeats", "1", "--out", out])
            with open(out) as f:
                result = json.load(f)
        self.assertIn("the shadow copy costs", printed.getvalue())
        self.assertEqual(result["threads"], 1)
        rows = result["rows"]
        for name in ("step", "copy", "step_and_copy"):
            self.assertGreater(rows[name]["G_params_per_s"], 0)
        self.assertGreater(rows["step_and_copy"]["seconds"], 0)


class TestUserLoopBenchmark(TestCase):
    def test_row_names(self):
        self.assertEqual(user_loop.parse_row("plan;cap=24;mb=2;accum=8;clip"),
                         {"system": "plan", "cap": 24.0, "accum": 8, "clip": True, "micro_batch": 2})
        self.assertTrue(user_loop.parse_row("plan;cap=24;early")["early"])
        self.assertTrue(user_loop.parse_row("fsdp1;cap=24;offload_optimizer")["offload_optimizer"])
        self.assertTrue(user_loop.parse_row("every;cap=24;compile")["compile"])
        row = user_loop.parse_row("every;memory=managed;platform=coherent")
        self.assertEqual((row["memory"], row["platform"]), ("managed", "coherent"))
        for bad in ("planned", "plan;cap", "plan;clip=1", "plan;depth=2", "plan;compile", "fsdp1;compile",
                    "every;memory=device", "every;platform=gh200", "plan;memory=managed"):
            with self.assertRaises(ValueError):
                user_loop.parse_row(bad)

    def test_contract_bound_leaves_one_forward_beside_the_host_steps(self):
        # Resident: 1.0 s a step, forwards of 0.3, 0.2 and 0.4 s (median 0.3). 2e9 host-stepped
        # parameters at 4e9 a second: 0.5 s of host steps, which only the next forward can hide.
        phases = [{"forward": {"gpu_s": f}, "backward": {"gpu_s": 0.6}} for f in (0.3, 0.2, 0.4)]
        resident = {"name": "resident", "system": "resident", "batch_size": 4, "accum": 1, "step_s": 1.0,
                    "tokens_per_s": 8000, "phases": phases}
        offload = {"name": "plan;cap=24", "system": "plan", "batch_size": 4, "accum": 1, "step_s": 1.5,
                   "tokens_per_s": 5000, "host_stepped_params": 2e9, "h2d_GB": 27.0, "d2h_GB": 13.5}
        early = {**offload, "name": "plan;cap=24;early", "early": True}
        user_loop.add_bounds([resident, offload, early], {"host_adamw_params_per_s": 4e9, "link_GBps": {"h2d": 54.0, "d2h": 54.0}})
        self.assertEqual(offload["bound_terms_s"], {"gpu": 1.0, "host": 0.5, "after_step": 1.2, "h2d": 0.5, "d2h": 0.25})
        self.assertEqual((offload["bound_s"], offload["of_bound"]), (1.2, 0.8))
        self.assertNotIn("after_step", early["bound_terms_s"])
        self.assertEqual(early["bound_s"], 1.0)

    def test_tiny_run_on_the_cpu_writes_rows_with_their_bounds(self):
        rows = "resident;mb=1;accum=2,plan;cap=24;mb=1;accum=2;clip,plan;depth=2"
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            with self.assertRaises(SystemExit):  # a bad row name, before anything runs
                user_loop.main(["--tiny", "--rows", rows, "--out", os.path.join(tmp, "out.json")])
            out = os.path.join(tmp, "out.json")
            self.assertEqual(user_loop.main(["--tiny", "--rows", rows.rsplit(",", 1)[0], "--steps", "2", "--warmup", "1",
                                             "--model-dir", os.path.join(tmp, "model"), "--out", out]), 0)
            with open(out, encoding="utf-8") as handle:
                result = json.load(handle)
        resident, planned = result["rows"]
        self.assertEqual((resident["name"], planned["name"]), ("resident;mb=1;accum=2", "plan;cap=24;mb=1;accum=2;clip"))
        self.assertEqual(planned["plan_timing"], "estimated")  # no GPU here to time a block on
        for row in (resident, planned):
            self.assertNotIn("error", row)
            self.assertEqual((row["batch_size"], row["accum"], len(row["step_s_each"]), len(row["losses"])), (1, 2, 2, 3))
            self.assertEqual(row["of_resident"], round(row["tokens_per_s"] / resident["tokens_per_s"], 3))
        self.assertEqual(resident["bound_s"], round(resident["step_s"], 3))  # its own compute is its bound


class TestModelsBenchmark(TestCase):
    def test_tiny_run_on_the_cpu_writes_every_models_rows(self):
        sweep, capped_sweep = "coherent(host;next-fwd;last=0.5;keep=1;ac;depth=1;cast=device)", "coherent(host;next-fwd;ac)"
        with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ), \
                contextlib.redirect_stdout(io.StringIO()) as printed:
            out = os.path.join(tmp, "models.json")
            self.assertEqual(models_benchmark.main([
                "--tiny", "--out", out, "--batch-sizes", "2", "--capped-batch-sizes", "2", "--cap-GiB", "0.001",
                "--seq-len", "16", "--steps", "2", "--warmup", "1", "--sweep", sweep, "--capped-sweep", capped_sweep,
            ]), 0)
            with open(out, encoding="utf-8") as handle:
                result = json.load(handle)
        self.assertEqual((result["benchmark"], result["torch"]), ("models", torch.__version__))
        expected = {None: {"default", "planned", "resident", sweep, "every-block"},
                    0.001: {"default", "planned", capped_sweep, "every-block"}}
        for model in models_benchmark.MODELS:
            for cap, names in expected.items():
                rows = [r for r in result["rows"] if r["model"] == model and r["gpu_cap_GiB"] == cap]
                self.assertEqual({r["name"] for r in rows}, names)
                if model == "llama-1b-hf" and result["transformers"] is None:
                    self.assertTrue(all("transformers is not installed" in r["error"] for r in rows))
                    continue
                self.assertEqual([r for r in rows if "error" in r], [])
                planned = next(r for r in rows if r["name"] == "planned")
                self.assertEqual(planned["plan_timing"], "measured")
                self.assertEqual(set(planned["predictions"]), names - {"default"})  # the default has its own plan's
                default = next(r for r in rows if r["name"] == "default")
                # README's call plans this machine, which has no GPU to time a block on.
                self.assertEqual(default["plan_timing"], "estimated")
                # Planned for the H200 within its profile's memory less the headroom: no cap is set on the CPU.
                self.assertEqual(planned["plan_budget_GiB"], 125.81)
                self.assertTrue(all(r["tokens_per_s"] > 0 and "prediction_error" in r for r in rows))
                self.assertTrue(all(len(r["step_s_each"]) == 2 for r in rows))
                # The host steps' seconds, beside the prediction's, where some parameters step on the host
                # (the second timed step's step() returns after all of the first's host steps ended).
                hand_placed = next(r for r in rows if r["name"] in (sweep, capped_sweep))
                self.assertGreater(hand_placed["host_stepped_params"], 0)
                self.assertGreater(hand_placed["host_optimizer_s"], 0.0)
                self.assertIn("host_optimizer_s", planned["predictions"][hand_placed["name"]])
        self.assertEqual(len(result["settings"]), 2 * len(models_benchmark.MODELS))
        self.assertIn("planned x", printed.getvalue())

    def test_a_row_predicted_as_the_placement_it_runs(self):
        with mock.patch.dict(os.environ, {"TORCH_FSDP_OFFLOAD_PLATFORM": "discrete"}):
            half = models_benchmark.row_training_config("coherent(host;next-fwd;last=0.5;keep=1;ac;depth=1;cast=device)", 8)
            spread = models_benchmark.row_training_config("coherent(split=0.25;modules=0.5;early)", 8)
        self.assertEqual(half, TrainingConfig(module_fraction=0.5, optimizer="host", checkpointing=True, prefetch_depth=1,
                                              keep_unsharded=1, cast_on="device"))
        self.assertEqual(spread, TrainingConfig(module_fraction=0.5, optimizer=0.25, prefetch_depth=2,
                                                block_placement="spread", step_during_backward=True))
        self.assertEqual(models_benchmark.row_training_config("resident", 8), TrainingConfig())
        with self.assertRaisesRegex(ValueError, "units= and user-clip"):
            models_benchmark.check_row("coherent(host;units=2)")
        predicted = {"a": {"fits": False, "step_s": 0.1}, "b": {"fits": True, "step_s": 0.5}, "c": {"fits": True, "step_s": 0.2}}
        self.assertEqual(models_benchmark.ranked(["a", "b", "x", "c"], predicted), ["c", "b", "a", "x"])

    def test_summary_names_the_best_row_and_the_ratios(self):
        def row(name, tokens_per_s, step_s, **extra):
            return {"model": "m", "batch_size": 4, "gpu_cap_GiB": None, "name": name, "tokens_per_s": tokens_per_s,
                    "step_s": step_s, **extra}

        rows = [row("default", 1000, 0.8), row("planned", 1500, 0.5, plan_label="modules=0.50", plan_timing="measured",
                                                 predicted_step_s=0.4, predictions={"default": {"step_s": 1.0}}),
                row("coherent(host)", 2000, 0.4), {**row("resident", 0, 0), "error": "OOM: CUDA out of memory"},
                row("coherent(stream)", 1200, 0.6, micro_batch_size=4)]
        summary, = models_benchmark.summarize(rows)
        self.assertEqual((summary["best_row"], summary["default_over_best"], summary["planned_over_best"]),
                         ("coherent(host)", 2.0, 1.33))
        # The default picked a larger micro-batch, out of the rows at the setting's: the plan held
        # to it is compared with those.
        rows[0]["micro_batch_size"] = 16
        rows[0]["tokens_per_s"] = 3000
        summary, = models_benchmark.summarize(rows)
        self.assertEqual((summary["best_row"], summary["best_row_at_batch"], summary["planned_over_best_at_batch"]),
                         ("default", "coherent(host)", 1.33))
        self.assertNotIn("over_best_at_batch", rows[0])
        self.assertEqual((summary["default_over_best"], rows[4]["over_best_at_batch"]), (1.0, 1.67))
        self.assertEqual((rows[0]["prediction_error"], summary["planned_prediction_error"]), (0.25, -0.2))
        self.assertEqual(summary["failed"], {"resident": "OOM: CUDA out of memory"})
        self.assertNotIn("prediction_error", rows[2])

    def test_a_child_that_dies_is_followed_by_one_for_the_rows_left(self):
        args = argparse.Namespace(sweep="coherent(host)", capped_sweep="", seq_len=16, steps=1, warmup=0,
                                  microbatch_factors="1", tiny=True, row_timeout=10.0, only="")
        runner = peers.Runner(args, deadline=float("inf"))
        done = {"model": "anchor-1.6b", "batch_size": 4, "gpu_cap_GiB": None, "tokens_per_s": 1, "step_s": 1.0}
        answers = [({"rows": [{**done, "name": "default"}], "running": "planned", "order": ["resident", "coherent(host)"]},
                    "exit -9 (killed: host memory?): "),
                   ({"rows": [{**done, "name": "coherent(host)"}, {**done, "name": "resident"}], "running": None, "order": []}, "")]
        rows = []
        with mock.patch.object(runner, "child", side_effect=answers) as child, contextlib.redirect_stdout(io.StringIO()):
            models_benchmark.run_settings(runner, args, [("anchor-1.6b", 4, None)], rows, write=lambda: None)
        self.assertEqual([r["name"] for r in rows], ["default", "planned", "coherent(host)", "resident"])
        self.assertEqual(rows[1]["error"], "exit -9 (killed: host memory?): ")
        second = child.call_args_list[1].args[0]
        self.assertEqual(second[second.index("--rows") + 1], "resident,coherent(host)")
        with mock.patch.object(models_benchmark.importlib.util, "find_spec", return_value=None), \
                mock.patch.object(runner, "child", side_effect=AssertionError("no process for a missing package")):
            rows = []
            models_benchmark.run_settings(runner, args, [("llama-1b-hf", 4, None)], rows, write=lambda: None)
        self.assertTrue(rows and all("transformers is not installed" in r["error"] for r in rows))

    def test_only_runs_the_rows_named(self):
        args = argparse.Namespace(sweep="coherent(host)", capped_sweep="coherent(host;ac)", seq_len=16, steps=1,
                                  warmup=0, microbatch_factors="1", tiny=True, row_timeout=10.0, only="default,every-block")
        runner = peers.Runner(args, deadline=float("inf"))
        answer = ({"rows": [], "running": None, "order": []}, "")
        with mock.patch.object(runner, "child", return_value=answer) as child:
            models_benchmark.run_settings(runner, args, [("anchor-1.6b", 4, None), ("anchor-1.6b", 4, 16.0)], [],
                                          write=lambda: None)
        for call in child.call_args_list:
            flags = call.args[0]
            self.assertEqual(flags[flags.index("--rows") + 1], "default,every-block")
        self.assertEqual(child.call_count, 2)
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            models_benchmark.main(["--tiny", "--only", "coherent(host;units=2)"])

    def test_a_row_that_leaves_memory_allocated_ends_its_process(self):
        # What a row left allocated after its teardown would weigh on the next row: the child
        # stops and hands the rows left to a fresh one.
        with tempfile.TemporaryDirectory() as tmp:
            args = argparse.Namespace(gpu_cap_GiB=None, rows="default,planned,resident", one_setting="anchor-1.6b",
                                      batch_size=4, share_s=1e9, row_out=os.path.join(tmp, "rows.json"))
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(peers._free_port())}
            with mock.patch.dict(os.environ, env), \
                    mock.patch.object(models_benchmark, "run_row", return_value={"tokens_per_s": 1, "step_s": 1.0}), \
                    mock.patch.object(models_benchmark, "release", side_effect=[0.0, 2.5, 0.0]):
                self.assertEqual(models_benchmark.run_setting(args), 0)
            with open(args.row_out, encoding="utf-8") as handle:
                written = json.load(handle)
        self.assertEqual([row["name"] for row in written["rows"]], ["default", "planned"])
        self.assertEqual(written["rows"][1]["allocated_after_teardown_GiB"], 2.5)
        self.assertEqual((written["running"], written["order"]), (None, ["resident"]))


class TestMultiGpuBenchmark(TestCase):
    def test_predicted_peak_extrapolates_the_measured_batches(self):
        one = {"batch_size": 2, "peak_reserved_GiB": 30.0, "peak_gpu_GiB": 28.0, "between_steps_GiB": 10.0}
        # One batch size: what the step allocated beyond the memory held between steps grows with the batch.
        self.assertAlmostEqual(multi_gpu._predicted_peak([one], 4), 30.0 + 9.0 * 2)
        # Two: the line through them.
        two = {"batch_size": 4, "peak_reserved_GiB": 50.0, "peak_gpu_GiB": 48.0, "between_steps_GiB": 10.0}
        self.assertAlmostEqual(multi_gpu._predicted_peak([one, two], 8), 90.0)

    def test_table_marks_each_rows_best_batch(self):
        def measured(batch_size: int, tokens_per_s: int) -> dict:
            return {"batch_size": batch_size, "step_s": 1.0, "tokens_per_s_per_gpu": tokens_per_s,
                    "peak_gpu_GiB": 20.0, "host_optimizer_s": 0.5}

        result = {"model": "llama-8b", "params_B": 8.03, "seq_len": 2048, "world_size": 2, "gpu": "H200",
                  "rows": {"resident": [measured(1, 6000), measured(2, 8000), {"batch_size": 4, "skipped": "does not fit"}]}}
        lines = multi_gpu.format_table(result).splitlines()
        self.assertIn("world size 2", lines[0])
        self.assertEqual([("*" in line) for line in lines[2:]], [False, True, False])
        self.assertIn("does not fit", lines[4])


class TestTransferBenchmark(TestCase):
    @unittest.skipIf(torch.cuda.is_available(), "checks a machine without a GPU")
    def test_refuses_a_machine_without_a_link(self):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            self.assertEqual(transfer.main(["--out", os.devnull]), 1)
        self.assertIn("needs a CUDA GPU", err.getvalue())


class TestPlotResults(TestCase):
    def test_plots_the_cited_result_files(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("needs matplotlib")
        import plot_results

        rows = _fsdp_offload_result()
        activation_rows = [{"row": name, "step_s": step, "peak_gib": peak}
                           for name, step, peak in (("resident", 0.15, 17.5), ("offload(all)", 0.3, 13.8))]
        with tempfile.TemporaryDirectory() as tmp:
            _write_json(tmp, "fsdp_offload_bs4_default_rows.json", rows)
            _write_json(tmp, "activations_default_rows.json",
                        {"configs": [{"batch_size": 4, "seq_len": 2048, "rows": activation_rows}] * 2})
            for plot in (plot_results.plot_fsdp_bs4, plot_results.plot_activations):
                with open(plot(tmp, tmp), "rb") as handle:
                    self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")


def _fake_capacity_runner() -> tuple:
    """A peers Runner whose rows are faked: a system trains up to 2 blocks per 8 GiB of cap
    (3.5 GiB a block at its peak), resident uncapped 10 blocks; and the list of ``(n_blocks, cap)``
    it was asked for."""
    runner = peers.Runner(argparse.Namespace(row_timeout=10.0, gpu_memory_GiB=140.0), deadline=float("inf"))
    calls = []

    def row(system, batch_size, n_blocks=8, gpu_cap_GiB=None, steps=None, warmup=None):
        calls.append((n_blocks, gpu_cap_GiB))
        fits = n_blocks <= (10 if gpu_cap_GiB is None else gpu_cap_GiB // 8 * 2)
        return ({"system": system, "n_blocks": n_blocks, "gpu_cap_GiB": gpu_cap_GiB, "params": peers_capacity.param_count(n_blocks), "tokens_per_s": 1000 // n_blocks, "step_s": 1.0,
                 "peak_gpu_GiB": 3.5 * n_blocks, "host_bytes_per_param": 18.0, "pinned_GiB": 1.0} if fits
                else {"system": system, "n_blocks": n_blocks, "gpu_cap_GiB": gpu_cap_GiB, "error": "OOM: CUDA out of memory"})

    runner.row = row
    return runner, calls


class TestPeersBenchmark(TestCase):
    def test_doubling_then_bisection_finds_the_largest_size(self):
        tried = []

        def probe(n):
            tried.append(n)
            return n <= 13

        self.assertEqual(peers_capacity.largest_fitting(probe, 40), (13, True))
        self.assertEqual(tried, [1, 2, 4, 8, 16, 12, 14, 13])
        tried.clear()
        # A smaller cap's answer is known to fit: doubling starts above it; the bound is tried last.
        self.assertEqual(peers_capacity.largest_fitting(probe, 10, known=5), (10, True))
        self.assertEqual(tried, [10])
        tried.clear()
        self.assertEqual(peers_capacity.largest_fitting(probe, 40, start=20), (13, True))
        self.assertEqual(tried, [20, 10, 15, 12, 13, 14][: len(tried)])
        self.assertEqual(peers_capacity.largest_fitting(lambda n: False, 40), (0, True))
        self.assertEqual(peers_capacity.largest_fitting(probe, 40, known=40), (40, True))

    def test_a_tolerance_stops_the_bisection_near_the_answer(self):
        tried = []

        def probe(n):
            tried.append(n)
            return n <= 13

        # Doubling to 16 (fails), then bisection until the failing size is within 25% of the answer.
        self.assertEqual(peers_capacity.largest_fitting(probe, 40, tolerance=0.25), (12, True))
        self.assertEqual(tried, [1, 2, 4, 8, 16, 12, 14])

    def test_planned_rows_plan_within_a_share_of_the_resident_peak(self):
        runner = peers.Runner(argparse.Namespace(row_timeout=100.0, seq_len=16, steps=1, warmup=0), deadline=float("inf"))
        with mock.patch.object(runner, "child", return_value=([{"system": peers.PLANNED}], "")) as child:
            runner.rows(peers.PLANNED, [4], plan_budget_GiB=13.7)
        flags = child.call_args[0][0]
        self.assertEqual(flags[flags.index("--plan-budget-GiB") + 1], "13.7")
        with mock.patch.object(runner, "child", return_value=([{"system": "resident"}], "")) as child:
            runner.rows("resident", [4])
        self.assertNotIn("--plan-budget-GiB", child.call_args[0][0])

    def test_planned_rows_under_a_cap_plan_within_the_process_memory(self):
        # Under a cap the call is given no budget: it reads the process's cap and keeps its headroom.
        class Built(Exception):
            pass

        budgets = []

        def build(system, config, batch_size, capped, plan_budget_GiB=None):
            budgets.append((capped, plan_budget_GiB))
            raise Built

        gpu = mock.Mock(total_memory=140 << 30)
        with mock.patch.object(peers, "_build", side_effect=build), \
                mock.patch.object(torch.cuda, "set_device"), \
                mock.patch.object(torch.cuda, "get_device_properties", return_value=gpu), \
                mock.patch.object(torch.cuda, "set_per_process_memory_fraction") as set_fraction:
            for cap in (16.0, None):
                with self.assertRaises(Built):
                    peers.run_one_row(peers.PLANNED, [4], 16, 1, 0, 8, gpu_cap_GiB=cap, plan_budget_GiB=13.7)
        self.assertEqual(budgets, [(True, None), (False, 13.7)])
        set_fraction.assert_called_once_with(16 / 140, 0)

    def test_out_of_time_stops_the_search_with_what_it_found(self):
        answers = iter([True, True, None])
        self.assertEqual(peers_capacity.largest_fitting(lambda n: next(answers), 40), (2, False))

    def test_host_memory_bounds_the_sizes_tried(self):
        per_block = peers_capacity.param_count(2) - peers_capacity.param_count(1)
        self.assertEqual(peers_capacity.param_count(8), 1611014144)  # anchor-1.6b itself
        gib = 1 << 30
        bound = peers_capacity.size_bound("torch_fsdp_offload", 64 * gib, 16 * gib)
        self.assertTrue(peers_capacity.host_fits("torch_fsdp_offload", peers_capacity.param_count(bound), 64 * gib))
        self.assertFalse(peers_capacity.host_fits("torch_fsdp_offload", peers_capacity.param_count(bound) + per_block, 64 * gib))
        # Resident needs 16 bytes a parameter on the GPU, whatever the host has.
        self.assertEqual(peers_capacity.size_bound("resident", 1 << 50, 16 * gib), (16 * gib // 16 - (peers_capacity.param_count(1) - per_block)) // per_block)
        self.assertEqual(peers_capacity.size_bound("deepspeed_zero3", 2 * gib, 16 * gib), 0)
        seconds, probes = peers_capacity.estimate_seconds(list(peers.SYSTEMS), [4, 16], [16.0], 64 * gib)
        self.assertGreater(probes, 0)
        self.assertGreater(seconds, 12 * 45.0)

    def test_deepspeed_configs(self):
        zero2, zero3 = (peers.deepspeed_config(s, 4) for s in ("deepspeed_zero2", "deepspeed_zero3"))
        self.assertEqual(zero2["bf16"], {"enabled": True})
        self.assertEqual(zero2["train_micro_batch_size_per_gpu"], 4)
        self.assertEqual((zero2["zero_optimization"]["stage"], zero3["zero_optimization"]["stage"]), (2, 3))
        self.assertEqual(zero2["zero_optimization"]["offload_optimizer"]["device"], "cpu")
        self.assertNotIn("offload_param", zero2["zero_optimization"])
        self.assertEqual(zero3["zero_optimization"]["offload_param"]["device"], "cpu")
        self.assertEqual(zero2["optimizer"]["params"]["lr"], peers.LR)
        with self.assertRaises(ValueError):
            peers.deepspeed_config("resident", 4)

    def test_a_missing_package_is_a_row_with_an_error(self):
        runner = peers.Runner(argparse.Namespace(row_timeout=10.0), deadline=float("inf"))
        with mock.patch.object(peers.importlib.util, "find_spec", return_value=None), \
                mock.patch.object(runner, "child", side_effect=AssertionError("no process for a missing package")):
            row = runner.row("deepspeed_zero3", 4)
            # In the capacity search that row stops the system's search, with its error.
            found = peers_capacity.capacity(runner, ["deepspeed_zero3"], [16.0], 4, 1 << 40, {}, log=lambda line: None)
        self.assertIn("deepspeed is not installed", row["error"])
        self.assertIn("deepspeed is not installed", found["results"][0]["error"])
        self.assertEqual(found["results"][0]["largest_n_blocks"], 0)
        self.assertIsNone(peers.missing_package("resident"))
        out_of_time = peers.Runner(argparse.Namespace(row_timeout=10.0), deadline=0.0).row("resident", 16)
        self.assertEqual(out_of_time["error"], "not run: --max-seconds reached")
        # A row cut short by the deadline is out of time, where one over its own limit is too slow.
        args = argparse.Namespace(row_timeout=100.0, seq_len=16, steps=1, warmup=0)
        for deadline_in, expected in ((30.0, "not run to its end: --max-seconds reached (timeout after 30 s)"),
                                      (float("inf"), "timeout after 100 s")):
            runner = peers.Runner(args, deadline=time.monotonic() + deadline_in)
            timed_out = subprocess.TimeoutExpired("child", min(deadline_in, 100.0))
            with mock.patch.object(runner, "remaining", return_value=deadline_in), \
                    mock.patch.object(peers.subprocess, "run", side_effect=timed_out):
                cut = runner.row("stock_cpu_offload", 4)
                self.assertEqual(cut["error"], expected)
                self.assertGreaterEqual(cut["elapsed_s"], 0.0)  # the child's wall time, which sizes later probes
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            peers.print_table([row, {"system": "resident", "batch_size": 4, "tokens_per_s": 52000, "step_s": 0.157,
                                     "peak_gpu_GiB": 27.4, "pinned_GiB": 0.0, "host_rss_GiB": 3.1,
                                     "host_rss_peak_GiB": 9.8, "loss_after_steps": 3.41}])
        self.assertIn("deepspeed_zero3          4 error: deepspeed is not installed", printed.getvalue())
        self.assertRegex(printed.getvalue(), r"resident +4 +52000 +0\.157 +27\.4")

    def test_capacity_search_per_cap_and_system(self):
        runner, calls = _fake_capacity_runner()
        found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0, 24.0], 4, 1 << 40, {}, log=lambda line: None)
        by_cap = {entry["gpu_cap_GiB"]: entry for entry in found["results"]}
        self.assertEqual((by_cap[16.0]["largest_n_blocks"], by_cap[24.0]["largest_n_blocks"]), (4, 6))
        self.assertTrue(all(entry["search_complete"] for entry in found["results"]))
        self.assertEqual(by_cap[24.0]["host_bytes_per_param"], 18.0)
        self.assertEqual(by_cap[16.0]["resident_uncapped_tokens_per_s"], 250)
        # From 1, the next size read off the peak's line (at most double), then the one above it;
        # the 24 GiB search starts where the line of every size so far says; then resident,
        # uncapped, at each answer.
        self.assertEqual(calls, [(1, 16.0), (2, 16.0), (4, 16.0), (5, 16.0), (6, 24.0), (7, 24.0), (4, None), (6, None)])
        # A smaller cap's answer that is also this cap's is timed under this cap.
        runner, calls = _fake_capacity_runner()
        found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0, 20.0], 4, 1 << 40, {}, log=lambda line: None)
        self.assertEqual(calls[4:6], [(5, 20.0), (4, 20.0)])
        self.assertEqual(found["results"][1]["largest_n_blocks"], 4)
        self.assertEqual(found["results"][1]["tokens_per_s"], 250)

    def test_the_next_size_is_read_off_the_peaks_line(self):
        # 1 GiB a block over 2 GiB fixed: 15.5 GiB usable of 16 holds 13 blocks.
        self.assertEqual(peers_capacity.largest_by_peak([(8, 10.0), (4, 6.0)], 16.0), 13)
        self.assertEqual(peers_capacity.largest_by_peak([(4, 14.0)], 16.0), 4)  # one size: through the origin
        self.assertIsNone(peers_capacity.largest_by_peak([], 16.0))
        self.assertIsNone(peers_capacity.largest_by_peak([(4, 9.0), (8, 9.0)], 16.0))  # no rising line
        tried = []

        def probe(n):
            tried.append(n)
            return n <= 13

        self.assertEqual(peers_capacity.largest_fitting(probe, 40, start=4, grow=lambda n: 13), (13, True))
        self.assertEqual(tried, [4, 13, 14])

    def test_a_resumed_search_keeps_what_was_complete(self):
        # The 16 GiB search was complete; the 24 GiB one had found 5 blocks and 8 not fitting:
        # only that one is searched again, between the two; resident runs only where it has not
        # run uncapped; a system not searched now keeps its entry.
        runner, calls = _fake_capacity_runner()
        sixteen = {"system": "torch_fsdp_offload", "gpu_cap_GiB": 16.0, "largest_n_blocks": 4, "search_complete": True,
                   "tokens_per_s": 250, "resident_uncapped_tokens_per_s_estimated": 240}
        previous = {
            "results": [sixteen, {"system": "torch_fsdp_offload", "gpu_cap_GiB": 24.0, "largest_n_blocks": 5,
                                  "smallest_not_fitting_n_blocks": 8, "search_complete": False},
                        {"system": "deepspeed_zero3", "gpu_cap_GiB": 16.0, "largest_n_blocks": 3}],
            "probes": [{"n_blocks": 4}],
            "resident_uncapped": {"4": {"tokens_per_s": 250}},
        }
        found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0, 24.0], 4, 1 << 40, {},
                               log=lambda line: None, previous=previous)
        by_cap = {(entry["system"], entry["gpu_cap_GiB"]): entry for entry in found["results"]}
        self.assertIs(by_cap[("torch_fsdp_offload", 16.0)], sixteen)
        # Resident measured at its size replaces an earlier run's estimate.
        self.assertEqual(sixteen["resident_uncapped_tokens_per_s"], 250)
        self.assertNotIn("resident_uncapped_tokens_per_s_estimated", sixteen)
        self.assertEqual(by_cap[("torch_fsdp_offload", 24.0)]["largest_n_blocks"], 6)
        self.assertEqual(by_cap[("deepspeed_zero3", 16.0)]["largest_n_blocks"], 3)  # not searched now: kept
        self.assertEqual(calls, [(6, 24.0), (7, 24.0), (6, None), (3, None)])
        # Resumed again with the answer known and timed by the run before: nothing is probed again.
        calls.clear()
        again = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0, 24.0], 4, 1 << 40, {},
                               log=lambda line: None, previous=dict(found, results=[
                                   sixteen, {"system": "torch_fsdp_offload", "gpu_cap_GiB": 24.0, "largest_n_blocks": 6,
                                             "smallest_not_fitting_n_blocks": 7, "search_complete": False}]))
        self.assertEqual(calls, [])
        self.assertEqual(again["results"][1]["tokens_per_s"], 1000 // 6)
        self.assertEqual(found["probes"][0], {"n_blocks": 4})
        self.assertEqual(found["resident_uncapped"]["4"], {"tokens_per_s": 250})

    def test_a_run_cut_short_resumes_from_its_checkpoint_without_probing_again(self):
        runner, calls = _fake_capacity_runner()
        saved = []
        full = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0, 24.0], 4, 1 << 40, {}, log=lambda line: None,
                                       checkpoint=lambda partial: saved.append(copy.deepcopy(partial)))
        every = list(calls)
        self.assertEqual(len(saved), len(every))  # one checkpoint per probe, resident's included
        # Killed after its third probe: resumed from that checkpoint, the search replays the sizes
        # already answered and probes only the rest, to the same result.
        calls.clear()
        again = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0, 24.0], 4, 1 << 40, {},
                                        log=lambda line: None, previous=saved[2])
        self.assertEqual(calls, every[3:])
        self.assertEqual(again["results"], full["results"])
        self.assertEqual(again["resident_uncapped"], full["resident_uncapped"])
        self.assertEqual([e["largest_n_blocks"] for e in saved[-1]["results"]], [4, 6])

    def test_a_resumed_run_keeps_the_versions_of_peers_it_lacks(self):
        # The resumed file's probes ran with DeepSpeed 0.19.8; this run, which lacks it, adds only
        # resident rows: the written file still names the version its DeepSpeed probes ran with.
        machine = {"gpu": "H200", "gpu_memory_GiB": 140.0}
        with tempfile.TemporaryDirectory() as tmp:
            resumed, out = os.path.join(tmp, "resumed.json"), os.path.join(tmp, "out.json")
            with open(resumed, "w") as handle:
                json.dump({"versions": {"torch": "2.11.0", "deepspeed": "0.19.8", "torchao": None},
                           "capacity": {"results": [], "probes": [], "resident_uncapped": {}}}, handle)
            with mock.patch.object(peers.Runner, "child", return_value=(machine, "")), \
                    mock.patch.object(peers, "versions", return_value={"torch": "2.13.0", "deepspeed": None, "torchao": None}), \
                    mock.patch.object(peers, "capacity", return_value={"results": [], "probes": [], "resident_uncapped": {}}), \
                    contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(peers.main(["--batch-sizes", "none", "--capacity", "--caps", "16", "--capacity-systems",
                                             "resident", "--resume-from", resumed, "--out", out]), 0)
            with open(out) as handle:
                self.assertEqual(json.load(handle)["versions"], {"torch": "2.13.0", "deepspeed": "0.19.8", "torchao": None})

    def test_a_probe_that_cannot_finish_in_time_is_not_started(self):
        # Earlier probes took 10 s a block (the quickest per block counts). With 65 s left, 6 blocks
        # (the peaks' line's answer under 24 GiB) may start and 7 may not: the search stops there,
        # incomplete, for a resumed run to finish.
        earlier = [{"system": "torch_fsdp_offload", "n_blocks": 2, "elapsed_s": 20.0, "peak_gpu_GiB": 7.0},
                   {"system": "torch_fsdp_offload", "n_blocks": 4, "setup_s": 45.0, "peak_gpu_GiB": 14.0},
                   {"system": "resident", "n_blocks": 1, "elapsed_s": 1.0}]
        self.assertEqual(peers_capacity.probe_seconds(earlier, "torch_fsdp_offload", 9), 90.0)
        self.assertEqual(peers_capacity.probe_seconds(earlier, "stock_cpu_offload", 9), 0.0)
        runner, calls = _fake_capacity_runner()
        previous = {"results": [], "probes": earlier, "resident_uncapped": {}}
        with mock.patch.object(runner, "remaining", return_value=65.0):
            found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [24.0], 4, 1 << 40, {},
                                            log=lambda line: None, previous=previous)
        self.assertEqual(calls, [(6, 24.0)])
        entry = found["results"][0]
        self.assertEqual((entry["largest_n_blocks"], entry["search_complete"]), (6, False))
        # Resumed with 65 s left, under 24 and 32 GiB: 7 blocks (70 s) may start under neither. Under
        # 32 GiB the 6 blocks found under 24 GiB are known to fit but not timed there, as a resumed
        # search may still grow past them.
        calls.clear()
        with mock.patch.object(runner, "remaining", return_value=65.0):
            found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [24.0, 32.0], 4, 1 << 40, {},
                                            log=lambda line: None, previous=found)
        self.assertEqual(calls, [])
        entry = next(e for e in found["results"] if e["gpu_cap_GiB"] == 32.0)
        self.assertEqual((entry["largest_n_blocks"], entry["search_complete"]), (6, False))
        self.assertNotIn("tokens_per_s", entry)
        # Where an earlier run did time those 6 blocks under 32 GiB, that row is the answer's.
        timed = {"system": "torch_fsdp_offload", "n_blocks": 6, "gpu_cap_GiB": 32.0, "params": 6, "tokens_per_s": 77,
                 "step_s": 1.0, "peak_gpu_GiB": 21.0, "host_bytes_per_param": 16.0, "pinned_GiB": 1.0}
        with mock.patch.object(runner, "remaining", return_value=65.0):
            found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [24.0, 32.0], 4, 1 << 40, {},
                                            log=lambda line: None, previous=dict(found, probes=found["probes"] + [timed]))
        self.assertEqual(calls, [])
        entry = next(e for e in found["results"] if e["gpu_cap_GiB"] == 32.0)
        self.assertEqual((entry["largest_n_blocks"], entry["search_complete"], entry["tokens_per_s"]), (6, False, 77))

    def test_a_failure_other_than_memory_stops_the_search(self):
        runner = peers.Runner(argparse.Namespace(row_timeout=10.0, gpu_memory_GiB=140.0), deadline=float("inf"))
        failure = {"error": "RuntimeError: Ninja is required to load C++ extensions"}
        with mock.patch.object(runner, "row", return_value=failure) as row:
            found = peers_capacity.capacity(runner, ["torch_fsdp_offload"], [16.0], 4, 1 << 40, {}, log=lambda line: None)
        self.assertEqual(row.call_count, 1)
        self.assertEqual(found["results"][0]["error"], failure["error"])
        self.assertFalse(found["results"][0]["search_complete"])
        self.assertTrue(peers_capacity.does_not_fit("OOM: CUDA out of memory. Tried to allocate 2.00 GiB"))
        self.assertTrue(peers_capacity.does_not_fit("exit -9 (killed: host memory?): "))
        self.assertFalse(peers_capacity.does_not_fit(failure["error"]))
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            peers_capacity.print_capacity(found)
        self.assertIn("error: RuntimeError: Ninja", printed.getvalue())

    def test_meminfo_in_bytes(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "meminfo")
            with open(path, "w") as handle:
                handle.write("MemTotal:       131072 kB\nMemAvailable:    65536 kB\nHugePages_Total:       0\n")
            self.assertEqual(peers_capacity.read_meminfo(path), {"MemTotal": 128 << 20, "MemAvailable": 64 << 20, "HugePages_Total": 0})
        self.assertEqual(peers_capacity.read_meminfo(os.path.join(os.sep, "nonexistent", "meminfo")), {})

    @unittest.skipIf(torch.cuda.is_available(), "checks a machine without a GPU")
    def test_refuses_a_machine_without_a_gpu(self):
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()) as err:
            self.assertEqual(peers.main(["--out", os.path.join(tmp, "peers.json")]), 2)
        self.assertIn("needs a GPU", err.getvalue())


def _synthetic_trace() -> dict:
    """A step's chrome trace in torch.profiler's layout: kernels and copies on two CUDA streams, host
    optimizer steps on a worker thread, and events no lane shows."""
    def gpu(cat, name, ts, stream):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": 10,
                "args": {"device": 0, "stream": stream}}

    def cpu(name, ts, tid):
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": 50}

    events = [
        gpu("kernel", "ampere_bf16_gemm", 100, 7), gpu("kernel", "vectorized_elementwise", 130, 7),
        gpu("kernel", "ncclDevKernel_AllReduce", 150, 7),
        gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 90, 20),
        gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 140, 20),
        gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 110, 20),
        cpu("torch_fsdp_offload::host_optimizer_step", 160, 555), cpu("torch_fsdp_offload::grad_norms", 120, 555),
        cpu("torch_fsdp_offload::params_h2d:blocks.0", 80, 1),  # the training thread: no lane
        cpu("aten::mm", 95, 1),
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
    ]
    return {"traceEvents": events}


class TestStreamTimeline(TestCase):
    def test_lanes_per_stream_and_host_optimizer_thread(self):
        from torch_fsdp_offload.timeline import lane_counts, timeline_lanes

        lanes = timeline_lanes(_synthetic_trace())
        self.assertEqual(list(lanes), ["GPU 0 stream 20", "GPU 0 stream 7", "CPU thread 555"])
        counts = lane_counts(lanes)
        self.assertEqual(counts["GPU 0 stream 7"], {"compute": 2, "h2d": 0, "d2h": 0, "host_optimizer": 0, "other": 1})
        self.assertEqual(counts["GPU 0 stream 20"], {"compute": 0, "h2d": 2, "d2h": 1, "host_optimizer": 0, "other": 0})
        self.assertEqual(counts["CPU thread 555"]["host_optimizer"], 2)
        self.assertEqual([e.start_us for e in lanes["GPU 0 stream 20"]], [90.0, 110.0, 140.0])  # in time order
        self.assertEqual(timeline_lanes({"traceEvents": []}), {})

    def test_script_prints_the_lanes_and_writes_the_png(self):
        with tempfile.TemporaryDirectory() as tmp:
            trace = _write_json(tmp, "step.trace.json", _synthetic_trace()["traceEvents"])  # a bare list too
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                self.skipTest("needs matplotlib")
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                self.assertEqual(stream_timeline.main([trace]), 0)
            self.assertRegex(printed.getvalue(), r"CPU thread 555 +0 +0 +0 +2 +0")
            with open(os.path.join(tmp, "step.png"), "rb") as handle:
                self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")
            empty = _write_json(tmp, "empty.json", {"traceEvents": []})
            with contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(stream_timeline.main([empty, "--out", os.path.join(tmp, "empty.png")]), 2)
            self.assertIn("no CUDA kernels", err.getvalue())


if __name__ == "__main__":
    run_tests()
