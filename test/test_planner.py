"""Tests of the offload planner: the talk's worked example, scenario validation, the unified and
DRAM-bound verdicts, the analytic breakdown of a real model, and the FSDP2 step model."""

import contextlib
import copy
import dataclasses
import gc
import importlib.util
import io
import json
import os
import tempfile
import time
import unittest
from functools import reduce
from unittest import mock

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_fsdp_offload.__main__ import main
from torch_fsdp_offload.models import build_model
from torch_fsdp_offload.platform import PlatformKind
from torch_fsdp_offload.planner import (
    get_profile,
    load_scenario,
    plan,
    predict_per_gpu,
    predict_step,
    ScenarioError,
    TrainingConfig,
)
from torch_fsdp_offload.planner.library_facts import DEFAULT_MAX_INFLIGHT_BYTES, STREAM_RUN_BYTES, STREAM_RUNS_IN_FLIGHT
from torch_fsdp_offload.planner.memory_breakdown import model_breakdown
from torch_fsdp_offload.planner.peak_memory import phase_peaks
from torch_fsdp_offload.planner.report import Recommendation, TECHNIQUE_LEGEND
from torch_fsdp_offload.planner.scenario_cost import TECHNIQUES
from torch_fsdp_offload.planner.search import choose, default_training_configs, search_training
from torch_fsdp_offload.planner.training_config import label_kind, LABEL_LEGEND
from torch_fsdp_offload.planner.traffic import (
    HOST_NORM_GBPS,
    copy_in_bytes_per_param,
    host_step_bytes_per_param,
    host_step_seconds_per_param,
    shared_dram_host_seconds,
)
from torch_fsdp_offload.planner.training_profile import training_profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TALK = os.path.join(REPO, "docs", "examples", "talk_gh200.json")


def talk_data():
    with open(TALK, encoding="utf-8") as handle:
        return json.load(handle)


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


class TestTalkExample(TestCase):
    def test_cli_json_reproduces_the_talk(self):
        code, out, _ = run_cli("--scenario", TALK, "--json")
        self.assertEqual(code, 0)
        result = json.loads(out)
        # (72 + 2 x 15) GB / 0.1 s: "about a terabyte per second".
        self.assertAlmostEqual(result["model_dram_bandwidth_GBps"], 1020.0, delta=1.0)
        # 2 x 72 GB / 0.1 s: "something like 1,500 GB per second".
        self.assertAlmostEqual(result["naive_offload_bandwidth_GBps"], 1500.0, delta=0.05 * 1500)
        # The same bytes over twice the time at 4x the micro-batch: "750".
        self.assertAlmostEqual(result["scaled_offload_bandwidth_GBps"], 750.0, delta=0.05 * 750)
        recommended = result["recommended"]
        self.assertAlmostEqual(recommended["weights_offload_fraction"], 1 / 3, delta=0.03)
        self.assertAlmostEqual(recommended["throughput_gain"], 0.40, delta=0.01)
        self.assertEqual(recommended["microbatch_factor"], 2.0)
        self.assertEqual(
            recommended["coherent_offload"],
            "policy = CoherentOffload() on 0.35 of the blocks, spread evenly: "
            "fully_shard_with_policy(model, blocks, policy, spread_fraction=0.35)",
        )

    def test_human_report(self):
        self.assertExpectedInline(
            plan(scenario=TALK).report(),
            """\
Offload plan: talk: Grace Hopper offload example (Jouanneaux, NVIDIA)
Platform: gh200 (coherent); per GPU: 96.0 GB memory, 4000 GB/s DRAM, 450 GB/s link
Every figure is per GPU (one GPU, nothing sharded).

1. Memory breakdown per GPU (budget 96.0 GB = 89.4 GiB)
   weights             72.0 GB   75.0%
   activations         21.0 GB   21.9%  (15.0 GB reach DRAM)
   unused               3.0 GB    3.1%
2. Iteration time: 0.100 s per step (today's run)
3. Model DRAM bandwidth per GPU: (72.0 + 2 x 15.0) GB / 0.100 s = 1020 GB/s, 26% of the 4000 GB/s peak: room for offload traffic
4. Naive offload per GPU (all weights): (2 x 72.0) GB / 0.100 s = 1440 GB/s vs a 450 GB/s link: 3.2x more than it carries
5. What can be gained (micro-batch scaling):
   micro-batch   time   throughput   GB per GPU without offload
            1x   1.00x         +0%      93.0 GB (fits)
            2x   1.43x        +40%     114.0 GB (does not fit)
            4x   2.00x       +100%     156.0 GB (does not fit)
   At 4x (the largest that fits with all weights offloaded) the naive offload needs (2 x 72.0) GB / 0.200 s = 720 GB/s
6. Partial offload and checkpointing, per GPU (plans that fit):
   technique                       batch  weights  activ.  GB/GPU  link GB/s     gain
   none                              1x       0%      0%    93.0          0      +0%
   offload_weights                   2x      35%      0%    88.8        353     +40%  <- recommended
   offload_weights                   4x      83%      0%    96.0        600     +50%  link-bound
   offload_activations               2x       0%     60%    88.8        353     +40%
   offload_activations               4x       0%     71%    96.0        600     +50%  link-bound
   legend: Nx: N times today's micro-batch; link GB/s: what the copies need to stay hidden; gain: throughput over today's run
   none: nothing offloaded
   offload_weights: the `weights` share of the weights offloaded, with their grads and optimizer state
   offload_activations: the `activ.` share of the activations offloaded
   link-bound: its copies need more than the link carries while compute runs: listed, never recommended
7. Recommendation: offload 35% of the weights and run 2x the micro-batch: +40% throughput over today's run; the link stays hidden at 78% (353 of 450 GB/s).
   Note: offload_weights at 4x predicts +7% over the recommendation but is link-bound (needs 600 GB/s to hide): it pays only if the link really delivers 450 GB/s, so it is not recommended
   policy = CoherentOffload() on 0.35 of the blocks, spread evenly: fully_shard_with_policy(model, blocks, policy, spread_fraction=0.35)
""",
        )

    def test_recommended_policy_is_constructible(self):
        recommended = plan(scenario=TALK).recommended
        policy = recommended.policy
        self.assertEqual(type(policy).__name__, "CoherentOffload")
        self.assertEqual(recommended.spread_fraction, 0.35)
        self.assertEqual(policy.activations, False)
        # apply() gives it to 0.35 of the blocks, spread evenly, and none to the root.
        model = build_model("tiny")
        with mock.patch("torch_fsdp_offload.policy.fully_shard_with_policy") as shard:
            recommended.apply(model)
        (sharded, blocks, given), kwargs = shard.call_args
        self.assertEqual((sharded, list(blocks), kwargs["spread_fraction"]), (model, list(model.blocks), 0.35))
        self.assertEqual(given.cast_on, "auto")

    def test_link_bound_plan_is_listed_not_recommended(self):
        result = plan(scenario=TALK)
        bound = [c for c in result.search.candidates if c.link_bound]
        self.assertTrue(bound)
        self.assertGreater(max(c.throughput_gain for c in bound), result.recommended.throughput_gain)
        self.assertFalse(any(c.link_bound for c in [result.search.recommended]))

    def test_unified_platform_says_offload_cannot_add_capacity(self):
        result = plan(scenario=TALK, platform="dgx-spark")
        self.assertIsNone(result.recommended.kwargs)
        self.assertIsNone(result.recommended.policy)
        self.assertEqual(result.recommended.throughput_gain, 0.0)
        self.assertIn("one physical memory", result.report())
        self.assertIn("cannot add capacity", result.report())
        self.assertIn("duplicates", result.to_dict()["offload_blocked_reason"])

    def test_dram_bound_model_is_not_offloaded(self):
        data = talk_data()
        # 3.8 TB/s of the 4 TB/s peak: no DRAM bandwidth left for offload traffic.
        data["model_dram_GBps"] = 3800
        result = plan(scenario=data)
        self.assertIsNone(result.recommended.kwargs)
        self.assertIn("95% of the GPU's peak DRAM bandwidth", result.recommended.reason)

    def test_checkpointing_is_compared(self):
        data = talk_data()
        data["checkpointing"] = {"recompute_time_fraction": 0.33, "activation_memory_fraction": 0.5}
        result = plan(scenario=data)
        techniques = {c.technique for c in result.search.candidates}
        self.assertIn("checkpointing+offload_weights", techniques)
        # Checkpointing at 2x: 72 + 21 = 93 GB fits without offload, at 1.43 x 1.33 the time.
        ckpt = [c for c in result.search.candidates if c.technique == "checkpointing" and c.microbatch_factor == 2]
        self.assertEqual(len(ckpt), 1)
        self.assertAlmostEqual(ckpt[0].throughput_gain, 2 / (1.4286 * 1.33) - 1, places=3)

    def test_plot_writes_png_or_names_the_missing_extra(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "plan.png")
            code, _, err = run_cli("--scenario", TALK, "--plot", path)
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                self.assertEqual(code, 2)
                self.assertIn("pip install", err)
            else:
                self.assertEqual(code, 0)
                with open(path, "rb") as handle:
                    self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")


@instantiate_parametrized_tests
class TestScenarioValidation(TestCase):
    @parametrize(
        "name, mutate, message",
        [
            ("missing_iteration_time", lambda d: d.pop("iteration_time_s"), "missing required key 'iteration_time_s'"),
            ("missing_scaling", lambda d: d.pop("microbatch_scaling"), "missing required key 'microbatch_scaling'"),
            ("missing_weights", lambda d: d["memory_GB"].pop("weights"), "missing required key 'memory_GB.weights'"),
            ("negative_weights", lambda d: d["memory_GB"].update(weights=-1), "'weights' must be >= 0, got -1"),
            ("zero_iteration_time", lambda d: d.update(iteration_time_s=0), "'iteration_time_s' must be > 0"),
            ("negative_link", lambda d: d["bandwidth_GBps"].update(link=-450), "'link' must be > 0"),
            ("typo_key", lambda d: d.update(iteration_time="0.1"), "unknown key 'iteration_time'; did you mean 'iteration_time_s'?"),
            ("dram_above_activations", lambda d: d.update(activations_to_dram_GB=30), "activations_to_dram_GB (30) exceeds memory_GB.activations"),
            (
                "recompute_above_one",
                lambda d: d.update(checkpointing={"recompute_time_fraction": 1.5, "activation_memory_fraction": 0.1}),
                "'recompute_time_fraction' is a fraction and must lie in [0, 1], got 1.5",
            ),
            (
                "negative_memory_fraction",
                lambda d: d.update(checkpointing={"recompute_time_fraction": 0.3, "activation_memory_fraction": -0.1}),
                "'activation_memory_fraction' must be >= 0",
            ),
            ("falling_time", lambda d: d.update(microbatch_scaling=[[1, 1.0], [2, 0.9]]), "a larger micro-batch cannot take less time"),
            ("factor_below_one", lambda d: d.update(microbatch_scaling=[[0.5, 1.0]]), "must be >= 1"),
            ("negative_unused", lambda d: d["memory_GB"].update(unused=-3), "'unused' must be >= 0"),
            ("capacity_and_unused", lambda d: d["memory_GB"].update(capacity=50), "give either memory_GB.capacity or memory_GB.unused"),
            ("unknown_platform", lambda d: d.update(platform="h300"), "unknown platform profile 'h300'"),
        ],
        name_fn=lambda name, mutate, message: name,
    )
    def test_bad_scenario_is_rejected(self, name, mutate, message):
        data = copy.deepcopy(talk_data())
        mutate(data)
        with self.assertRaises(ScenarioError) as context:
            load_scenario(data)
        self.assertIn(message, str(context.exception))

    def test_breakdown_larger_than_capacity(self):
        data = talk_data()
        del data["memory_GB"]["unused"]
        data["memory_GB"]["capacity"] = 80
        with self.assertRaisesRegex(ScenarioError, "exceeds the GPU capacity"):
            load_scenario(data)

    def test_cli_reports_bad_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bad.json")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write("{not json")
            code, _, err = run_cli("--scenario", path)
        self.assertEqual(code, 2)
        self.assertIn("not valid JSON", err)

    def test_capacity_from_platform_profile(self):
        data = talk_data()
        del data["memory_GB"]["unused"]
        del data["bandwidth_GBps"]
        scenario = load_scenario(data)
        self.assertEqual(scenario.capacity_GB, get_profile("gh200").gpu_memory_GB)
        self.assertEqual(scenario.link_GBps, 450.0)


class RelaidTransformer(nn.Module):
    """A built-in transformer with its blocks at ``path`` instead of ``.blocks``: ``"transformer.h"``
    is GPT-2's layout in transformers, ``"decoder"`` a list under a name no finder looks for."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__()
        model = build_model(name, device="meta")
        self.config = model.config
        self.tok_embeddings, self.norm, self.output = model.tok_embeddings, model.norm, model.output
        self.path = path
        *parents, leaf = path.split(".")
        owner: nn.Module = self
        for part in parents:
            owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.add_module(leaf, model.blocks)

    @property
    def moved_blocks(self) -> nn.ModuleList:
        return reduce(getattr, self.path.split("."), self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.moved_blocks:
            h = block(h)
        return self.output(self.norm(h))


@instantiate_parametrized_tests
class TestRealModel(TestCase):
    @parametrize("path", ["transformer.h", "decoder"])
    def test_apply_shards_the_blocks_the_plan_planned(self, path):
        # The plan and Recommendation.apply find a model's blocks the same way, wherever they are.
        result = plan(lambda: RelaidTransformer("anchor-1.6b", path), platform="h200-pcie", batch_size=4,
                      gpu_memory_GiB=14)
        recommended = result.recommended
        self.assertEqual(recommended.last_blocks[1], 8)
        model = RelaidTransformer("anchor-1.6b", path)
        with mock.patch("torch_fsdp_offload.policy.fully_shard_with_policy") as shard, mock.patch(
            "torch_fsdp_offload.activations.offload_activations"
        ):
            recommended.apply(model)
        (sharded, blocks, policy), kwargs = shard.call_args
        self.assertIs(sharded, model)
        self.assertEqual(len(blocks), 8)
        for block, expected in zip(blocks, model.moved_blocks):
            self.assertIs(block, expected)
        self.assertEqual(kwargs["last_blocks"], recommended.last_blocks[0])

    def test_tiny_breakdown_on_cpu(self):
        model = build_model("tiny")
        breakdown = model_breakdown("tiny", batch_size=2, seq_len=64, compute_dtype=torch.float32)
        self.assertEqual(breakdown.n_blocks, len(model.blocks))
        self.assertEqual(breakdown.block_params, sum(p.numel() for p in model.blocks[0].parameters()))
        self.assertEqual(breakdown.total_params, model.param_count())
        # A checkpointed block keeps only its input: batch x seq x dim in the compute dtype.
        self.assertEqual(breakdown.block_checkpoint_bytes, 2 * 64 * 64 * 4)
        self.assertGreater(breakdown.block_activation_bytes, 8 * breakdown.block_checkpoint_bytes)
        doubled = model_breakdown("tiny", batch_size=4, seq_len=64, compute_dtype=torch.float32)
        self.assertEqual(doubled.block_activation_bytes, 2 * breakdown.block_activation_bytes)

    def test_checkpointing_recompute_is_counted_per_block(self):
        # Non-reentrant checkpointing stops recomputing at the last tensor backward needs: the
        # anchor block's MLP down projection (4 of its 13 forward FLOP units at 2048 tokens: 4 d^2
        # of 12 d^2 per token, plus attention) is not rerun. The head of llama-1b (128k vocab) is
        # forward work outside the blocks, which checkpointing the blocks never reruns.
        anchor = model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048)
        self.assertAlmostEqual(anchor.block_recompute_fraction, 9 / 13, places=3)
        self.assertGreater(anchor.block_forward_share, 0.999)
        llama = model_breakdown("llama-1b", batch_size=1, seq_len=2048)
        self.assertLess(llama.block_forward_share, 0.9)
        self.assertGreater(llama.block_forward_share, 0.7)
        profile = training_profile(llama, get_profile("h200-pcie"))
        self.assertAlmostEqual(profile.recompute_fraction, llama.block_forward_share * llama.block_recompute_fraction)

    @unittest.skipIf(importlib.util.find_spec("transformers") is None, "needs transformers")
    def test_checkpointing_recompute_of_a_transformers_block(self):
        # A transformers decoder layer takes keyword arguments (position embeddings as a pair, a KV
        # cache): the count runs it, instead of falling back to a whole forward.
        breakdown = model_breakdown("llama-tiny", batch_size=1, seq_len=64)
        self.assertLess(breakdown.block_recompute_fraction, 1.0)
        self.assertLess(breakdown.block_forward_share, 1.0)

    def test_attention_is_counted_as_a_fused_kernel_keeps_it(self):
        # Quadrupling the sequence grows a block's activations about 4-fold, not 16-fold as the
        # seq^2 score matrix of the math path traced on meta would.
        short = model_breakdown("tiny", batch_size=1, seq_len=64)
        long = model_breakdown("tiny", batch_size=1, seq_len=256)
        self.assertGreaterEqual(long.block_activation_bytes, 4 * short.block_activation_bytes)
        self.assertLess(long.block_activation_bytes, 4.5 * short.block_activation_bytes)

    def test_plan_without_gpu_is_for_this_machine(self):
        # No accelerator and no platform=: the plan is this machine's, which has nothing to offload.
        with mock.patch.object(torch.cuda, "is_available", return_value=False):
            result = plan("tiny", batch_size=2, seq_len=64)
        self.assertEqual(result.scenario.platform.kind, "host_only")
        self.assertIsNone(result.recommended.kwargs)
        self.assertIn("no accelerator", result.recommended.reason)

    def test_measured_memory_is_what_this_process_may_use(self):
        # A cap from torch.cuda.set_per_process_memory_fraction is the planner's GPU memory.
        from torch_fsdp_offload.planner.profiles import measured_profile
        from torch_fsdp_offload.platform import detect_platform

        platform = dataclasses.replace(detect_platform(), kind=PlatformKind.DISCRETE, device=torch.device("cuda", 0),
                                       gpu_total_bytes=100 * 10**9)
        with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "get_per_process_memory_fraction", create=True, return_value=0.25):
            profile = measured_profile(platform)
        self.assertAlmostEqual(profile.gpu_memory_GB, 25.0)
        self.assertIn("25% of the GPU's memory (this process's cap)", profile.source)
        with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "get_per_process_memory_fraction", create=True, return_value=1.0):
            self.assertAlmostEqual(measured_profile(platform).gpu_memory_GB, 100.0)

    def test_process_memory_fraction_of_a_device_without_an_index(self):
        # torch's reader takes a device index; "cuda" alone (the planner's timing device) is the
        # current one.
        from torch_fsdp_offload.planner.profiles import process_memory_fraction

        def reader(index):
            if not isinstance(index, int):
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{index}")
            return {0: 1.0, 1: 0.25}[index]

        with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "get_per_process_memory_fraction", create=True, side_effect=reader), \
                mock.patch.object(torch.cuda, "current_device", return_value=1):
            self.assertEqual(process_memory_fraction(torch.device("cuda")), 0.25)
            self.assertEqual(process_memory_fraction("cuda:0"), 1.0)
        self.assertEqual(process_memory_fraction("cpu"), 1.0)

    def test_plan_for_a_profile(self):
        result = plan("tiny", platform="h200-pcie", batch_size=2, seq_len=64)
        self.assertEqual(str(result), result.report())  # print(result) shows the report
        data = result.to_dict()
        self.assertIn("training", data)
        self.assertIn("FSDP2 step model", result.report())
        # A tiny model fits: offloading only costs time.
        self.assertIsNone(result.recommended.kwargs)
        # Checkpointing is compared in the talk's table too: less memory for its recompute.
        by_technique = {c.technique: c for c in result.search.candidates if c.microbatch_factor == 1}
        self.assertLess(by_technique["checkpointing"].gpu_memory_GB, by_technique["none"].gpu_memory_GB)
        self.assertLess(by_technique["checkpointing"].throughput_gain, 0.0)

    def test_model_that_does_not_fit_gets_a_plan_that_fits(self):
        # llama-1b at 12 x 2048: about 24 GB of state and 59 GB of activations, over 90% of 80 GB.
        result = plan("llama-1b", platform="h100-pcie", batch_size=12, seq_len=2048)
        resident = [p for f, p in result.training.predictions if p.config.label == "modules=0.00"][0]
        self.assertGreater(resident.peak_gpu_bytes, result.training.capacity_bytes)
        recommended = result.recommended
        self.assertTrue(recommended.checkpointing or recommended.kwargs is not None)
        self.assertLessEqual(recommended.predicted_peak_gpu_GiB * 2**30, result.training.capacity_bytes)

    def test_memory_budget(self):
        # anchor-1.6b at bs 4 fits an H200 resident (no offload), but not half of its resident
        # peak: with that budget the plan offloads and its predicted peak stays inside it.
        unconstrained = plan("anchor-1.6b", platform="h200-pcie", batch_size=4)
        self.assertIsNone(unconstrained.recommended.kwargs)
        budget = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=14)
        self.assertEqual(budget.training.capacity_bytes, 14 * 2**30)
        self.assertIsNotNone(budget.recommended.kwargs)
        # Part of the blocks offloaded: the policy goes on the last ones (the placement the step
        # model predicts).
        offloaded, n_blocks = budget.recommended.last_blocks
        self.assertEqual((offloaded / n_blocks, n_blocks), (budget.recommended.weights_offload_fraction, 8))
        self.assertIsNone(budget.recommended.spread_fraction)
        self.assertIn(f"on the last {offloaded} of the 8 blocks", budget.recommended.code())
        self.assertIn(f"blocks[{8 - offloaded}:]", budget.recommended.code())
        self.assertLessEqual(budget.recommended.predicted_peak_gpu_GiB, 14)
        self.assertIn("budget 14.0 GiB", budget.report())
        # The scenario path takes the budget as its capacity.
        talk = plan(scenario=TALK, gpu_memory_GiB=50)
        self.assertAlmostEqual(talk.scenario.capacity_GB, 50 * 2**30 / 1e9)
        for bad in (0, -1.0, float("nan")):
            with self.assertRaisesRegex(ValueError, "gpu_memory_GiB must be a positive number"):
                plan("tiny", platform="h200-pcie", gpu_memory_GiB=bad)

    def test_cli_memory_budget(self):
        code, out, _ = run_cli("--model", "anchor-1.6b", "--batch-size", "4", "--platform", "h200-pcie", "--gpu-memory-GiB", "14", "--json")
        self.assertEqual(code, 0)
        self.assertIsNotNone(json.loads(out)["recommended"]["kwargs"])
        code, _, err = run_cli("--model", "tiny", "--seq-len", "64", "--platform", "h200-pcie", "--gpu-memory-GiB", "0")
        self.assertEqual(code, 2)
        self.assertIn("--gpu-memory-GiB must be a positive number", err)

    @unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
    def test_plan_measures_on_gpu(self):
        # What earlier tests left cached in segments they still hold part of cannot be freed: count
        # from what stays cached after emptying the cache now.
        gc.collect()
        torch.cuda.empty_cache()
        cached_before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        result = plan("small", batch_size=2, seq_len=512, microbatch_factors=(1, 2))
        # The measurement leaves nothing cached (what stays reserved is allocated, as the matmul
        # library's workspaces): under a cap, training would allocate around a cache.
        self.assertLess(torch.cuda.memory_reserved() - torch.cuda.memory_allocated() - cached_before, 2 << 20)
        self.assertEqual(result.training.profiles[0][1].source, "measured block")
        self.assertEqual([f for f, _ in result.scenario.microbatch_scaling], [1.0, 2.0])

    def test_host_bandwidth_from_the_step_with_the_link_busy(self):
        from torch_fsdp_offload.host_step import (
            HOST_BYTES_PER_LINK_BUSY_PARAM, host_GBps_from_link_busy, measure_host_step,
        )

        # 0.57 ns per parameter with the link busy gives the h200-pcie profile's host bandwidth.
        self.assertAlmostEqual(host_GBps_from_link_busy(0.57e-9), HOST_BYTES_PER_LINK_BUSY_PARAM / 0.57)
        self.assertAlmostEqual(host_GBps_from_link_busy(0.57e-9), get_profile("h200-pcie").host_GBps, delta=2)
        with self.assertRaisesRegex(ValueError, "seconds_per_param must be positive"):
            host_GBps_from_link_busy(0.0)
        self.assertGreater(measure_host_step(1 << 16, threads=1, repeats=1, link_busy=False).alone_s_per_param, 0)
        if not torch.cuda.is_available():
            with self.assertRaisesRegex(ValueError, "needs a CUDA device; pass link_busy=False"):
                measure_host_step(1 << 16, link_busy=True)

    def test_host_step_rates_into_the_profile(self):
        from torch_fsdp_offload.host_step import HostStepRates, measure_host_step

        rates = measure_host_step(1 << 16, threads=1, repeats=1, link_busy=False)
        self.assertGreater(rates.alone_s_per_param, 0)
        # The cast into the mirror is timed on its own too (the benchmark's stock rows skip it).
        self.assertTrue(0 < rates.alone_cast_s_per_param < rates.alone_s_per_param)
        self.assertIsNone(rates.link_busy_s_per_param)
        breakdown = model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048)
        # Without the link-busy figure the profile keeps the bandwidth model.
        self.assertIsNone(training_profile(breakdown, get_profile("h200-pcie"), host_rates=rates).host_alone_s_per_param)
        measured = HostStepRates(0.3e-9, 0.6e-9, 90.0)
        profile = training_profile(breakdown, get_profile("h200-pcie"), host_rates=measured)
        self.assertEqual(
            (profile.host_alone_s_per_param, profile.host_step_s_per_param, profile.host_busy_link_GBps), (0.3e-9, 0.6e-9, 90.0)
        )
        with self.assertRaisesRegex(ValueError, "must be >= 1"):
            measure_host_step(0)

    @unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
    def test_host_bandwidth_measured_with_the_link_busy_on_gpu(self):
        from torch_fsdp_offload.host_step import host_GBps_from_link_busy, LinkBusy, measure_host_step

        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        with LinkBusy(64 << 20) as link:
            time.sleep(0.2)
        self.assertGreater(link.gbps, 1.0)  # both directions copied meanwhile
        self.assertLessEqual(torch.cuda.memory_reserved(), reserved)  # its device buffers given back
        rates = measure_host_step(1 << 24)  # link_busy is the default with a GPU
        self.assertGreater(rates.link_busy_s_per_param, 0)
        self.assertGreater(rates.link_GBps_meanwhile, 1.0)
        busy = host_GBps_from_link_busy(rates.link_busy_s_per_param)
        self.assertTrue(10 < busy < 1000, busy)


class TestStepModel(TestCase):
    def setUp(self):
        super().setUp()
        self.platform = get_profile("h200-pcie")
        breakdown = model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048)
        self.profile = training_profile(breakdown, self.platform)

    def predict(self, platform=None, **knobs):
        return predict_step(self.profile, TrainingConfig(**knobs), platform or self.platform)

    def test_spread_placement_exposes_the_first_host_group(self):
        # Spread (fully_shard_with_policy(spread_fraction=0.5)) offloads blocks 1, 3, 5, 7:
        # block 1's gradients land last and the next forward needs it almost at once, so more of
        # the host step is exposed than with the same blocks' worth offloaded last.
        spread = TrainingConfig(module_fraction=0.5, block_placement="spread")
        last = TrainingConfig(module_fraction=0.5)
        self.assertEqual(spread.offloaded_blocks(8), [1, 3, 5, 7])
        self.assertEqual(last.offloaded_blocks(8), [4, 5, 6, 7])
        slow_host = dataclasses.replace(self.profile, host_step_s_per_param=0.5e-9)
        spread_step = predict_step(slow_host, spread, self.platform)
        last_step = predict_step(slow_host, last, self.platform)
        self.assertGreater(spread_step.optimizer_s, last_step.optimizer_s)
        self.assertEqual((spread_step.h2d_bytes, spread_step.peak_gpu_bytes), (last_step.h2d_bytes, last_step.peak_gpu_bytes))
        with self.assertRaisesRegex(ValueError, "block_placement must be 'last' or 'spread'"):
            TrainingConfig(module_fraction=0.5, block_placement="middle")

    def test_checkpointing_adds_the_recompute_to_backward(self):
        plain, checkpointed = self.predict(), self.predict(checkpointing=True)
        self.assertLess(self.profile.recompute_fraction, 1.0)
        self.assertAlmostEqual(
            checkpointed.backward_s - plain.backward_s, self.profile.forward_s * self.profile.recompute_fraction
        )

    def test_offloading_more_needs_less_gpu_memory(self):
        peaks = [self.predict(module_fraction=f).peak_gpu_bytes for f in (0.0, 0.5, 1.0)]
        self.assertEqual(peaks, sorted(peaks, reverse=True))
        activations = [self.predict(activations=f).peak_gpu_bytes for f in (0.0, 0.5, 1.0)]
        self.assertEqual(activations, sorted(activations, reverse=True))

    def test_link_traffic(self):
        full = self.predict(module_fraction=1.0, optimizer="host")
        params = self.profile.n_blocks * self.profile.block_params
        root = self.profile.other_params  # offloaded too where every block is
        # bf16 weights up twice (forward, backward re-gather), the root's once (FSDP2 keeps the
        # root unsharded from forward to backward); fp32 grads down once.
        self.assertEqual(full.h2d_bytes, 2 * params * 2 + root * 2)
        self.assertEqual(full.d2h_bytes, (params + root) * 4)
        # Streamed: the gradient goes down in backward, then fp32 param, grad and moments up and
        # param, moments and the bf16 mirror down (the measured 20 and 18 bytes per parameter).
        streamed = self.predict(module_fraction=1.0, optimizer="stream")
        self.assertEqual(streamed.h2d_bytes, params * 20 + root * 18)
        self.assertEqual(streamed.d2h_bytes, (params + root) * 18)

    def test_streamed_pipeline_takes_both_directions_added(self):
        # Measured on the H200: the pipeline's uploads and downloads overlap little, so it takes
        # the up bytes' time plus the down bytes' time.
        streamed = self.predict(module_fraction=1.0, optimizer="stream")
        params = self.profile.total_params
        up, down = params * 16, params * 14
        both = up / (self.platform.h2d_GBps * 1e9) + down / (self.platform.d2h_GBps * 1e9)
        self.assertGreater(both, self.profile.gpu_optimizer_s)
        self.assertGreaterEqual(streamed.optimizer_s, both)
        self.assertAlmostEqual(streamed.optimizer_s, both, delta=0.01 * both)

    def test_blocks_kept_unsharded_copy_in_once_and_hold_their_parameters(self):
        # keep_unsharded (fully_shard_with_policy(keep_unsharded_last=...)): the offloaded blocks
        # among the kept ones are not copied in again for backward; every kept block holds its
        # unsharded parameters from its forward to its backward.
        params = self.profile.n_blocks * self.profile.block_params
        block = self.profile.block_params * self.profile.compute_bytes
        plain = self.predict(module_fraction=0.5, optimizer="host")
        kept = self.predict(module_fraction=0.5, optimizer="host", keep_unsharded=4)
        kept_one = self.predict(module_fraction=0.5, optimizer="host", keep_unsharded=1)
        self.assertEqual(plain.h2d_bytes - kept.h2d_bytes, params / 2 * self.profile.compute_bytes)
        self.assertEqual(plain.h2d_bytes - kept_one.h2d_bytes, params / 8 * self.profile.compute_bytes)
        self.assertEqual(kept.d2h_bytes, plain.d2h_bytes)
        self.assertLessEqual(kept.step_s, plain.step_s)
        self.assertGreaterEqual(kept.peak_gpu_bytes, plain.peak_gpu_bytes)
        # Kept resident blocks copy nothing in either way, but hold their parameters too.
        resident = self.predict()
        all_kept = self.predict(keep_unsharded=8)
        self.assertEqual(all_kept.h2d_bytes, 0)
        live_groups = 1 + max(1, TrainingConfig().prefetch_depth)
        peaks = [phase_peaks(self.profile, TrainingConfig(keep_unsharded=k), offloaded_blocks=0, streamed_blocks=0,
                             activation_blocks=0)["forward"] for k in (0, 8)]
        self.assertEqual(peaks[1] - peaks[0], (8 - live_groups) * block)
        self.assertGreater(all_kept.peak_gpu_bytes, resident.peak_gpu_bytes)
        self.assertIn("keep=4", kept.config.label)
        # The search tries the offloaded blocks kept, and the recommendation carries it.
        configs = default_training_configs(8)
        self.assertIn(TrainingConfig(module_fraction=0.5, keep_unsharded=4), configs)
        self.assertNotIn(TrainingConfig(module_fraction=0.5, keep_unsharded=1), configs)
        self.assertFalse(any(c.keep_unsharded for c in configs if c.module_fraction == 0))
        for bad in (-1, True, 0.5):
            with self.assertRaisesRegex(ValueError, "keep_unsharded must be an int >= 0"):
                TrainingConfig(keep_unsharded=bad)
        with self.assertRaisesRegex(ValueError, "keep_unsharded=9 exceeds the model's 8 blocks"):
            self.predict(keep_unsharded=9)
        self.assertEqual(list(TrainingConfig(keep_unsharded=3).kept_blocks(8)), [5, 6, 7])

    def test_host_step_is_host_dram_bound(self):
        # AdamW 28 bytes, the bf16 mirror cast 6, the gradient landing 4.
        self.assertEqual(host_step_bytes_per_param(self.profile), 38)
        full = self.predict(module_fraction=1.0, optimizer="host")
        params = self.profile.n_blocks * self.profile.block_params
        # Host DRAM also serves the link's DMA: the bf16 parameters read for forward and backward
        # (the root's for forward only: it stays unsharded for backward), and the root steps too.
        root = self.profile.other_params
        self.assertAlmostEqual(full.host_optimizer_s, (params * (38 + 2 * 2) + root * (38 + 2)) / (self.platform.host_GBps * 1e9))
        self.assertTrue(full.host_bound)
        # The host step overlaps backward: the step is shorter than forward + backward + host step.
        self.assertLess(full.step_s, full.forward_s + full.backward_s + full.host_optimizer_s)
        faster_host = dataclasses.replace(self.profile, host_GBps=4 * self.platform.host_GBps)
        self.assertLess(predict_step(faster_host, TrainingConfig(module_fraction=1.0), self.platform).step_s, full.step_s)

    def test_cast_on_device_moves_the_master_and_takes_the_cast_off_the_host(self):
        # CoherentOffload(cast_on="device"): copy-ins move the fp32 master (4 bytes, not the bf16
        # mirror's 2), a streamed step brings back no mirror, and the host step is AdamW alone.
        params = self.profile.n_blocks * self.profile.block_params
        self.assertEqual((copy_in_bytes_per_param(self.profile), copy_in_bytes_per_param(self.profile, "device")), (2, 4))
        self.assertEqual(host_step_bytes_per_param(self.profile, cast_on="device"), 38 - 6)
        host, device = self.predict(module_fraction=1.0), self.predict(module_fraction=1.0, cast_on="device")
        copied_in = 2 * params + self.profile.other_params  # the root's once
        self.assertEqual((host.h2d_bytes, device.h2d_bytes), (copied_in * 2, copied_in * 4))
        self.assertEqual(device.d2h_bytes, host.d2h_bytes)
        # The host DRAM bandwidth model: the cast's 6 bytes leave the host step, the copy-ins' DMA
        # reads 2 more bytes per parameter, twice: 38 + 2 * 2 against 32 + 2 * 4 bytes (the root's
        # once).
        root = self.profile.other_params
        self.assertAlmostEqual(device.host_optimizer_s, (params * (32 + 2 * 4) + root * (32 + 4)) / (self.platform.host_GBps * 1e9))
        self.assertLess(device.host_optimizer_s, host.host_optimizer_s)
        streamed = self.predict(module_fraction=1.0, optimizer="stream", cast_on="device")
        self.assertEqual((streamed.h2d_bytes, streamed.d2h_bytes),
                         (params * (2 * 4 + 16) + root * (4 + 16), (params + root) * (4 + 12)))
        # The staging buffers hold the compute dtype either way (the master lands chunk by chunk).
        self.assertEqual(device.peak_gpu_bytes, host.peak_gpu_bytes)
        self.assertEqual(device.config.label, "modules=1.00 opt=host cast=device")

        # Measured rates: the cast's own part comes off each host-stepped parameter, alone and link-busy.
        alone, busy, link, cast_alone, cast_busy = 0.311e-9, 0.592e-9, 93.2, 0.0763e-9, 0.2248e-9
        measured = dataclasses.replace(self.profile, host_alone_s_per_param=alone, host_step_s_per_param=busy,
                                       host_busy_link_GBps=link, host_alone_cast_s_per_param=cast_alone,
                                       host_link_busy_cast_s_per_param=cast_busy)
        self.assertEqual(host_step_seconds_per_param(measured), (alone, busy))
        self.assertEqual(host_step_seconds_per_param(measured, "device"), (alone - cast_alone, busy - cast_busy))
        config = TrainingConfig(module_fraction=0.5, checkpointing=True, cast_on="device")
        prediction = predict_step(measured, config, self.platform)
        host_params = 4 * self.profile.block_params
        dma = (prediction.h2d_bytes + prediction.d2h_bytes) / (link * 1e9)
        self.assertAlmostEqual(prediction.host_optimizer_s, shared_dram_host_seconds(
            host_params * (alone - cast_alone), host_params * (busy - cast_busy), dma))
        host_cast = predict_step(measured, dataclasses.replace(config, cast_on="host"), self.platform)
        self.assertLess(prediction.step_s, host_cast.step_s)
        # A profile without the cast timed on its own (older JSON) takes its share of the bytes, 6 of 34.
        older = dataclasses.replace(measured, host_alone_cast_s_per_param=None, host_link_busy_cast_s_per_param=None)
        for rate, without in zip((alone, busy), host_step_seconds_per_param(older, "device")):
            self.assertAlmostEqual(without, rate * 28 / 34)
        # Nothing to cast when the compute dtype is the master's (a plain bf16 module).
        plain_bf16 = dataclasses.replace(measured, param_bytes=2, reduce_bytes=2, optimizer_state_bytes=4)
        self.assertEqual(host_step_seconds_per_param(plain_bf16, "device"), (alone, busy))

    def test_profile_carries_the_cast_share(self):
        from torch_fsdp_offload.host_step import HostStepRates

        breakdown = model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048)
        # Measured: measure_host_step's cast figures fill the profile.
        rates = HostStepRates(0.3e-9, 0.6e-9, 90.0, 0.08e-9, 0.2e-9)
        profile = training_profile(breakdown, self.platform, host_rates=rates)
        self.assertEqual((profile.host_alone_cast_s_per_param, profile.host_link_busy_cast_s_per_param), (0.08e-9, 0.2e-9))
        # Not measured: the platform profile's, as its host step is.
        profile = training_profile(breakdown, self.platform)
        self.assertEqual((profile.host_alone_cast_s_per_param, profile.host_link_busy_cast_s_per_param),
                         (0.0763e-9, 0.2248e-9))
        # This machine's step measured without its cast apart: unknown (another host's cast
        # figures would not fit this host's step), so the model splits the step by bytes.
        profile = training_profile(breakdown, self.platform, host_rates=HostStepRates(0.3e-9, 0.6e-9, 90.0))
        self.assertEqual((profile.host_alone_cast_s_per_param, profile.host_link_busy_cast_s_per_param), (None, None))
        # A platform profile written before the field: unknown, the model splits by bytes.
        custom = dataclasses.replace(self.platform, host_alone_cast_s_per_param=None, host_link_busy_cast_s_per_param=None)
        self.assertIsNone(training_profile(breakdown, custom).host_alone_cast_s_per_param)

    def test_search_casts_on_the_device_where_the_host_binds(self):
        # Every setting with host-stepped groups is tried with either cast; nothing else is.
        configs = default_training_configs(8)
        self.assertIn(TrainingConfig(module_fraction=0.5, cast_on="device"), configs)
        self.assertIn(TrainingConfig(module_fraction=0.5, optimizer=0.5, cast_on="device"), configs)
        self.assertFalse(any(c.cast_on == "device" for c in configs if c.module_fraction == 0))
        # Host-bound (the H200 host's rates, the link measured in the same run): casting on the
        # GPU wins; the same plan over a link a tenth as fast keeps the cast on the host.
        measured = dataclasses.replace(self.profile, host_alone_s_per_param=0.311e-9, host_step_s_per_param=0.592e-9,
                                       host_busy_link_GBps=93.2, host_alone_cast_s_per_param=0.0763e-9,
                                       host_link_busy_cast_s_per_param=0.2248e-9)
        budget = 14 * 2**30
        _, (_, best) = search_training([(1, measured)], self.platform, budget)
        self.assertEqual(best.config.cast_on, "device")
        self.assertTrue(predict_step(measured, dataclasses.replace(best.config, cast_on="host"), self.platform).host_bound)
        slow_link = dataclasses.replace(self.platform, h2d_GBps=5.0, d2h_GBps=5.0, bidirectional_GBps=9.0)
        half = [TrainingConfig(module_fraction=0.5, checkpointing=True, cast_on=cast) for cast in ("host", "device")]
        _, (_, best) = search_training([(1, measured)], slow_link, budget, half)
        self.assertEqual(best.config.cast_on, "host")

    def test_recommendation_carries_cast_on(self):
        # anchor-1.6b at bs 4 in 13.7 GiB on h200-pcie: half the blocks offloaded and kept, host
        # steps, cast on the GPU (the host step binds, and casting on the GPU takes the cast off it).
        recommended = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=13.7).recommended
        self.assertEqual(recommended.kwargs, {"optimizer": "host", "cast_on": "device"})
        self.assertEqual(recommended.policy.cast_on, "device")
        self.assertIn("cast_on='device': the host step binds this plan", recommended.reason)
        self.assertExpectedInline(recommended.code(), """\
policy = CoherentOffload(optimizer='host', cast_on='device') on the last 4 of the 8 blocks: fully_shard(block, offload_policy=policy) for block in blocks[4:], no offload_policy for the other blocks and the root; reshard_after_forward=False for the last 4 blocks; activation checkpointing per block""")
        self.assertEqual(TrainingConfig(module_fraction=0.5).coherent_offload_kwargs(), {"optimizer": "host"})
        self.assertIsNone(TrainingConfig(activations=1.0).coherent_offload_kwargs())

    def test_clipping_starts_host_steps_after_backward(self):
        # Every block stepped on the host: with clipping step() waits for the last gradients (block
        # 0's, at the end of backward) and steps the groups in forward order; each group's step
        # outlasts its block's forward, so the step is the backward, the last gradients' copy, the
        # norm of the (offloaded) root's gradients, landing last, every host step, and the last
        # block's forward after its group's step.
        knobs = dict(module_fraction=1.0, optimizer="host")
        clipped, plain = self.predict(clipping=True, **knobs), self.predict(**knobs)
        n_blocks = self.profile.n_blocks
        grad_copy = self.profile.block_params * self.profile.reduce_bytes / (self.platform.d2h_GBps * 1e9)
        root_norm = self.profile.other_params * self.profile.grad_bytes / (HOST_NORM_GBPS * 1e9)
        self.assertGreater(clipped.host_optimizer_s / n_blocks, clipped.forward_s / n_blocks)
        self.assertAlmostEqual(
            clipped.step_s,
            clipped.backward_s + grad_copy + root_norm + clipped.host_optimizer_s + clipped.forward_s / n_blocks,
            places=9,
        )
        self.assertGreater(clipped.step_s, plain.step_s)
        self.assertEqual((clipped.forward_s, clipped.backward_s), (plain.forward_s, plain.backward_s))

    def test_clipping_adds_a_scaling_pass_over_the_host_gradients(self):
        # The clip reads and writes every host gradient once more before its group steps: 8 more
        # host DRAM bytes a parameter, and, on measured rates, AdamW's time for its 8 of 28 bytes.
        knobs = dict(module_fraction=1.0, optimizer="host")
        params = self.profile.n_blocks * self.profile.block_params
        self.assertEqual(host_step_bytes_per_param(self.profile, clipping=True), 38 + 8)
        root = self.profile.other_params  # stepped on the host too, copied in once
        self.assertAlmostEqual(self.predict(clipping=True, **knobs).host_optimizer_s,
                               (params * (46 + 2 * 2) + root * (46 + 2)) / (self.platform.host_GBps * 1e9))
        alone = 0.28e-9
        measured = dataclasses.replace(self.profile, host_alone_s_per_param=alone, host_step_s_per_param=alone,
                                       host_alone_cast_s_per_param=0.0, host_link_busy_cast_s_per_param=0.0)
        clipped = predict_step(measured, TrainingConfig(clipping=True, **knobs), self.platform)
        plain = predict_step(measured, TrainingConfig(**knobs), self.platform)
        self.assertAlmostEqual(clipped.host_optimizer_s, plain.host_optimizer_s * 36 / 28)

    def test_fits_leaves_a_free_block_for_the_losss_fp32_output(self):
        # A language model's loss holds 8 bytes a logit in bf16, 4 of them the fp32 copy: near a
        # cap that block must find free memory of its size beside the peak, and the allocator's
        # free memory lies in pieces (FRAGMENTATION_FACTOR).
        profile = dataclasses.replace(self.profile, loss_transient_bytes=8 * 2**30, loss_fp32_output_bytes=4 * 2**30)
        prediction = predict_step(profile, TrainingConfig(), self.platform)
        self.assertEqual(prediction.allocation_slack_bytes, 5 * 2**30)
        self.assertTrue(prediction.fits(prediction.peak_gpu_bytes + 5 * 2**30))
        self.assertFalse(prediction.fits(prediction.peak_gpu_bytes + 5 * 2**30 - 1))
        _, best = search_training([(1, profile)], self.platform, prediction.peak_gpu_bytes + 2**30, [TrainingConfig()])
        self.assertIsNone(best)

    def test_default_host_steps_start_at_step_early_ones_as_gradients_land(self):
        # By default nothing steps before step(), which the loop reaches as backward ends: the host
        # steps run after backward, in forward order, and on into the next forward. With
        # step_during_backward they start as gradients land, under the rest of backward; with
        # clipping the optimizer never steps early.
        knobs = dict(module_fraction=0.5, optimizer="host")
        default = self.predict(**knobs)
        early = self.predict(step_during_backward=True, **knobs)
        self.assertTrue(early.config.breaks_contract)
        self.assertLess(early.step_s, default.step_s)
        # The default: the host steps of the 4 offloaded (last) blocks from the end of backward,
        # the next forward waiting for the last of them before the last block's forward.
        n_blocks = self.profile.n_blocks
        self.assertAlmostEqual(default.optimizer_s, default.host_optimizer_s - default.forward_s * (n_blocks - 1) / n_blocks, places=9)
        clipped = self.predict(clipping=True, **knobs)
        self.assertEqual(self.predict(step_during_backward=True, clipping=True, **knobs).step_s, clipped.step_s)
        self.assertFalse(TrainingConfig(step_during_backward=True, clipping=True, **knobs).breaks_contract)
        self.assertEqual(TrainingConfig(module_fraction=0.5, step_during_backward=True).offload_optimizer_kwargs(),
                         {"step_during_backward": True})
        self.assertEqual(TrainingConfig(module_fraction=0.5).offload_optimizer_kwargs(), {})
        self.assertEqual(TrainingConfig(module_fraction=0.5, step_during_backward=True, clipping=True).label,
                         "modules=0.50 opt=host early clip")
        for name in ("step_during_backward", "clipping"):
            with self.assertRaisesRegex(ValueError, f"TrainingConfig.{name} must be a bool"):
                TrainingConfig(**{name: 1})

    def test_breaking_the_contract_must_beat_keeping_it_by_the_margin(self):
        def pick(candidates):
            return choose(candidates, throughput=lambda c: c[0], bytes_moved=lambda c: 0,
                          checkpointing=lambda c: False, breaks_contract=lambda c: c[1])

        self.assertEqual(pick([(1.0, False), (1.05, True)]), (1.0, False))
        self.assertEqual(pick([(1.0, False), (1.2, True)]), (1.2, True))
        # search_training: an early twin is picked only where it beats keeping the contract by the
        # margin: not where the host work is too short to matter, but where backward hides it.
        configs = [TrainingConfig(module_fraction=0.5, step_during_backward=early) for early in (True, False)]
        fast_host = dataclasses.replace(self.profile, host_step_s_per_param=1e-12)
        for profile, early in ((fast_host, False), (self.profile, True)):
            _, (_, best) = search_training([(1, profile)], self.platform, 140e9, configs)
            self.assertEqual(best.config.step_during_backward, early)

    def test_plan_with_clipping_prices_clipped_settings(self):
        result = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=13.7, clipping=True)
        self.assertTrue(all(p.config.clipping for _, p in result.training.predictions))
        self.assertEqual(result.recommended.optimizer_kwargs, {})
        unclipped = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=13.7)
        self.assertGreater(result.recommended.predicted_step_s, unclipped.recommended.predicted_step_s)
        # Today's run is still the table's first row (its label carries clip).
        self.assertIn("modules=0.00 clip", report_section(result, 7).splitlines()[2])
        self.assertIn("today's run", report_section(result, 7).splitlines()[2])

    def test_recommendation_code_and_optimizer_carry_step_during_backward(self):
        recommendation = Recommendation(
            technique="fsdp2_step_model", microbatch_factor=1, weights_offload_fraction=1.0,
            activations_offload_fraction=0.0, checkpointing=False, throughput_gain=0.0,
            kwargs={"optimizer": "host"}, reason="", optimizer_kwargs={"step_during_backward": True},
        )
        self.assertExpectedInline(recommendation.code(), """\
CoherentOffload(optimizer='host'); OffloadOptimizer(model, torch.optim.AdamW, step_during_backward=True, ...): breaks torch.optim's contract (parameters and optimizer state change before step())""")
        with self.assertWarns(UserWarning):  # the module is not sharded with CoherentOffload
            optimizer = recommendation.optimizer(nn.Linear(2, 2), lr=0.1)
        self.assertTrue(optimizer.step_during_backward)
        self.assertFalse(dataclasses.replace(recommendation, optimizer_kwargs={}).optimizer(nn.Linear(2, 2)).step_during_backward)
        self.assertNotIn("OffloadOptimizer", dataclasses.replace(recommendation, optimizer_kwargs={}).code())

    def test_activation_copies_bound_the_forward_over_pcie(self):
        # The offloader waits rather than let more than DEFAULT_MAX_INFLIGHT_BYTES pile up: over
        # PCIe the forward takes as long as its copies down, every block but the last (used in
        # place) is reloaded, and all but the in-flight window leaves GPU memory.
        plain, offloaded = self.predict(), self.predict(activations=1.0)
        per_block = self.profile.block_activation_bytes
        n_blocks = self.profile.n_blocks
        self.assertGreater(offloaded.forward_s, plain.forward_s)
        self.assertGreaterEqual(offloaded.forward_s, (n_blocks * per_block - DEFAULT_MAX_INFLIGHT_BYTES) / (self.platform.d2h_GBps * 1e9))
        self.assertAlmostEqual(offloaded.h2d_bytes, (n_blocks - 1) * per_block, delta=1)
        self.assertAlmostEqual(offloaded.d2h_bytes, n_blocks * per_block, delta=1)
        released = n_blocks * per_block - min(n_blocks * per_block, DEFAULT_MAX_INFLIGHT_BYTES)
        self.assertLess(offloaded.peak_gpu_bytes, plain.peak_gpu_bytes)
        self.assertGreaterEqual(offloaded.peak_gpu_bytes, plain.peak_gpu_bytes - released - 1)
        # Over NVLink-C2C the copies keep up with the forward.
        c2c_plain = self.predict(platform=get_profile("gh200"))
        c2c = self.predict(platform=get_profile("gh200"), activations=1.0)
        self.assertLess(c2c.step_s - c2c_plain.step_s, offloaded.step_s - plain.step_s)

    def test_host_step_shares_host_dram_with_the_link(self):
        # Streamed groups' copies cross host DRAM too: the host half of a split takes longer than
        # the same host work with the link idle would.
        split = self.predict(module_fraction=1.0, optimizer=0.5)
        # Of the 9 offloaded groups round(4.5) = 4 stream, the first in forward order: the root
        # and blocks 0-2. Blocks 3-7 step on the host.
        host_params = 5 * self.profile.block_params
        alone = host_params * host_step_bytes_per_param(self.profile) / (self.platform.host_GBps * 1e9)
        self.assertGreater(split.host_optimizer_s, alone)
        self.assertAlmostEqual(split.host_optimizer_s - alone,
                               (split.h2d_bytes + split.d2h_bytes - host_params * 4) / (self.platform.host_GBps * 1e9))

    def test_activation_offload_peak_is_in_backward_with_gradients(self):
        # With every block's activations offloaded, the backward peak is not at its start: it
        # comes where the reload window (the block in use and the one prefetched) meets the
        # gradients already accumulated.
        config = TrainingConfig(activations=1.0)
        peaks = phase_peaks(self.profile, config, offloaded_blocks=0, streamed_blocks=0, activation_blocks=8)
        per_block, grad = self.profile.block_activation_bytes, self.profile.block_params * self.profile.reduce_bytes
        window = 1 + 1
        resident = phase_peaks(self.profile, TrainingConfig(), offloaded_blocks=0, streamed_blocks=0, activation_blocks=0)
        # Block window-1 is the lowest with a full window: every later block's gradient is live.
        expected = window * per_block + (8 - window) * grad
        # Resident, the peak is backward's start: every block saved, beside the loss gradient.
        self.assertAlmostEqual(resident["backward"] - peaks["backward"],
                               8 * per_block + self.profile.loss_transient_bytes - expected, delta=1)
        self.assertEqual(self.predict(activations=1.0).peak_phase, "backward")

    def test_the_loss_transient_beside_every_activation(self):
        # A language model's logits: the loss holds them (forward) or their gradient (backward) in
        # fp32 and twice in bf16 while every block's activations are still saved.
        breakdown = model_breakdown("tiny", batch_size=2, seq_len=64)
        vocab = build_model("tiny", device="meta").config.vocab_size
        self.assertEqual(breakdown.loss_transient_bytes, 2 * 64 * vocab * (4 + 2 * 2))
        self.assertEqual(breakdown.loss_fp32_output_bytes, 2 * 64 * vocab * 4)
        profile = dataclasses.replace(self.profile, loss_transient_bytes=10**9)
        without = phase_peaks(self.profile, TrainingConfig(), offloaded_blocks=0, streamed_blocks=0, activation_blocks=0)
        peaks = phase_peaks(profile, TrainingConfig(), offloaded_blocks=0, streamed_blocks=0, activation_blocks=0)
        self.assertAlmostEqual(peaks["backward"] - without["backward"], 10**9 - self.profile.loss_transient_bytes, delta=1)
        # Forward ends with the same transient (the output beside its fp32 upcast).
        self.assertAlmostEqual(peaks["forward"] - without["forward"], 10**9 - self.profile.loss_transient_bytes, delta=1)

    def test_checkpointing_peak_at_the_end_of_backward(self):
        # Checkpointed: inputs of the blocks not yet reached, one block recomputed, and all
        # gradients but the first block's: larger at the last backward block than at the first.
        peaks = phase_peaks(self.profile, TrainingConfig(checkpointing=True), offloaded_blocks=0, streamed_blocks=0,
                            activation_blocks=0)
        resident = phase_peaks(self.profile, TrainingConfig(), offloaded_blocks=0, streamed_blocks=0, activation_blocks=0)
        grad = self.profile.block_params * self.profile.reduce_bytes
        expected = self.profile.block_checkpoint_bytes + self.profile.block_activation_bytes + 7 * grad
        self.assertAlmostEqual(resident["backward"] - peaks["backward"],
                               8 * self.profile.block_activation_bytes + self.profile.loss_transient_bytes - expected, delta=1)

    def test_streamed_state_in_transit_is_bounded(self):
        # At most STREAM_RUNS_IN_FLIGHT runs on the GPU at once, whatever is streamed, of which the
        # one copying down is freed (held by the allocator, not counted as allocated); the streamed
        # gradients went down in backward (FSDP's reduce output) and come up with their run.
        peaks = phase_peaks(self.profile, TrainingConfig(module_fraction=1.0, optimizer="stream"),
                            offloaded_blocks=8, streamed_blocks=8, activation_blocks=0)
        # Every block offloaded: the root is too, so nothing stays resident.
        self.assertAlmostEqual(peaks["optimizer"], (STREAM_RUNS_IN_FLIGHT - 1) * STREAM_RUN_BYTES, delta=1)

    def test_streamed_groups_are_whole_groups_and_their_gradients_go_down(self):
        # OffloadOptimizer streams round(split * offloaded) whole groups: split=0.25 of 5 offloaded
        # groups streams one group and steps four on the host (not 1.25 and 3.75).
        quarter = self.predict(module_fraction=0.625, optimizer=0.25)
        one_group = self.predict(module_fraction=0.625, optimizer=0.2)
        self.assertEqual(quarter.host_optimizer_s, one_group.host_optimizer_s)
        self.assertEqual(quarter.h2d_bytes, one_group.h2d_bytes)
        # In backward a streamed group's gradient leaves the GPU like a host group's.
        config = TrainingConfig(module_fraction=1.0, optimizer=0.5)
        streamed = phase_peaks(self.profile, config, offloaded_blocks=8, streamed_blocks=4, activation_blocks=0)
        hosted = phase_peaks(self.profile, config, offloaded_blocks=8, streamed_blocks=0, activation_blocks=0)
        self.assertEqual(streamed["backward"], hosted["backward"])

    def test_offload_must_beat_a_fitting_resident_plan_by_the_margin(self):
        from torch_fsdp_offload.planner.search import OFFLOAD_MARGIN, search_training

        resident, offloaded = TrainingConfig(), TrainingConfig(module_fraction=0.5)
        outcomes = set()
        # A slower GPU optimizer makes resident slower than half offloaded (its host step is free
        # here): from a little to a lot.
        for gpu_optimizer_s in (0.002 * 1.2**k for k in range(40)):
            profile = dataclasses.replace(self.profile, host_GBps=1e6, gpu_optimizer_s=gpu_optimizer_s)
            speedup = predict_step(profile, resident, self.platform).step_s / predict_step(profile, offloaded, self.platform).step_s
            _, (_, best) = search_training([(1, profile)], self.platform, 1e15, [resident, offloaded])
            self.assertEqual(best.config, offloaded if speedup >= 1 + OFFLOAD_MARGIN else resident)
            outcomes.add((speedup > 1, best.config == offloaded))
        # Offload faster but within the margin (resident kept) and beyond it (offload picked).
        self.assertTrue({(True, False), (True, True)} <= outcomes, outcomes)

    def test_measured_host_step_rate_replaces_bandwidth_model(self):
        # A measured seconds-per-parameter host step (fsdp_offload.py's link-busy figure) sets the
        # host time: host-stepped parameters times the rate, whatever the host bandwidth says.
        rate = 0.5e-9
        profile = dataclasses.replace(self.profile, host_step_s_per_param=rate)
        full = predict_step(profile, TrainingConfig(module_fraction=1.0), self.platform)
        self.assertAlmostEqual(full.host_optimizer_s, (8 * self.profile.block_params + self.profile.other_params) * rate)
        slow_host = dataclasses.replace(profile, host_GBps=1.0)
        self.assertEqual(predict_step(slow_host, TrainingConfig(module_fraction=1.0), self.platform).host_optimizer_s,
                         full.host_optimizer_s)

    def test_shared_dram_host_model(self):
        # Timed alone and beside a busy link, the host step pays 1 - alone/busy seconds per second
        # of the step's own DMA, never more than running all at the busy rate.
        alone, busy, link = 0.3e-9, 0.6e-9, 90.0
        profile = dataclasses.replace(
            self.profile, host_alone_s_per_param=alone, host_step_s_per_param=busy, host_busy_link_GBps=link
        )
        config = TrainingConfig(module_fraction=0.625, optimizer=0.4, checkpointing=True)
        prediction = predict_step(profile, config, self.platform)
        params = 3 * self.profile.block_params  # 5 blocks offloaded, 2 of them streamed
        dma = (prediction.h2d_bytes + prediction.d2h_bytes) / (link * 1e9)
        self.assertAlmostEqual(prediction.host_optimizer_s, params * alone + min(dma, params * busy) * (1 - alone / busy))
        self.assertLess(params * alone, prediction.host_optimizer_s)
        self.assertLess(prediction.host_optimizer_s, params * busy)
        # Streaming more groups moves host work to the link: less host time, though each streamed
        # byte still slows the rest.
        more_streamed = predict_step(profile, dataclasses.replace(config, optimizer=0.6), self.platform)
        self.assertLess(more_streamed.host_optimizer_s, prediction.host_optimizer_s)
        # A link that slows nothing leaves the alone rate.
        unshared = dataclasses.replace(profile, host_step_s_per_param=alone)
        self.assertAlmostEqual(predict_step(unshared, config, self.platform).host_optimizer_s, params * alone)
        # The formula alone (the benchmark's LBs uses it too): no DMA, DMA throughout, noise.
        self.assertEqual(shared_dram_host_seconds(0.3, 0.6, 0.0), 0.3)
        self.assertAlmostEqual(shared_dram_host_seconds(0.3, 0.6, 5.0), 0.6)
        self.assertEqual(shared_dram_host_seconds(0.3, 0.2, 1.0), 0.3)

    def test_world_size_shards_state_and_adds_collectives(self):
        one = self.predict()
        two = predict_step(self.profile, TrainingConfig(), self.platform, world_size=2)
        params = self.profile.total_params
        # Half the fp32 parameters and AdamW moments (12 bytes per parameter) per GPU.
        self.assertAlmostEqual(one.peak_gpu_bytes - two.peak_gpu_bytes, params * 12 / 2, delta=1e3)
        # Over a slow GPU-GPU path the collectives, not compute, set the step.
        slow = dataclasses.replace(self.platform, gpu_interconnect_GBps=1.0)
        self.assertGreater(predict_step(self.profile, TrainingConfig(), slow, world_size=2).step_s, one.step_s)
        with self.assertRaisesRegex(ValueError, "world_size must be >= 1"):
            predict_step(self.profile, TrainingConfig(), self.platform, world_size=0)

    def test_unified_moves_nothing(self):
        spark = self.predict(platform=get_profile("dgx-spark"), module_fraction=1.0, activations=1.0)
        self.assertEqual((spark.h2d_bytes, spark.d2h_bytes), (0, 0))
        self.assertFalse(spark.link_bound)

    def test_overlap_beats_serial_copies(self):
        overlapped = self.predict(module_fraction=1.0, prefetch_depth=1)
        serial = self.predict(module_fraction=1.0, prefetch_depth=0)
        self.assertLess(overlapped.step_s, serial.step_s)

    def test_checkpointing_trades_time_for_memory(self):
        plain, ckpt = self.predict(), self.predict(checkpointing=True)
        self.assertLess(ckpt.peak_gpu_bytes, plain.peak_gpu_bytes)
        self.assertGreater(ckpt.step_s, plain.step_s)

    def test_predict_per_gpu(self):
        resident = predict_per_gpu("anchor-1.6b", world_size=2, batch_size=4, platform="h200-pcie")
        offloaded = predict_per_gpu("anchor-1.6b", world_size=2, batch_size=4, offload=True, platform="h200-pcie")
        self.assertLess(offloaded["peak_gpu_GiB"], resident["peak_gpu_GiB"])
        self.assertTrue(offloaded["host_bound"])
        self.assertAlmostEqual(resident["tokens_per_s_per_gpu"], 4 * 2048 / resident["step_s"])
        self.assertEqual((resident["world_size"], offloaded["config"]), (2, "modules=1.00 opt=host depth=2"))
        with self.assertRaisesRegex(TypeError, "offload must be a bool, a module fraction or a TrainingConfig"):
            predict_per_gpu("anchor-1.6b", offload="all", platform="h200-pcie")
        for bad, message in (
            ({"batch_size": "4"}, "batch_size must be an int >= 1, got '4'"),
            ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
            ({"seq_len": 2048.0}, "seq_len must be an int >= 1, got 2048.0"),
            ({"host_GBps": -1}, r"host_GBps must be a finite number above 0 \(the host optimizer's bandwidth"),
            ({"gpu_memory_GiB": float("inf")}, "gpu_memory_GiB must be a finite number above 0 .* got inf"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                predict_per_gpu("anchor-1.6b", platform="h200-pcie", **bad)

    def test_scenario_host_bandwidth(self):
        data = load_scenario(os.path.join(REPO, "docs", "examples", "talk_gh200.json")).to_dict()
        self.assertEqual(load_scenario(data).host_GBps, get_profile("gh200").host_GBps)
        data["bandwidth_GBps"]["host"] = 80
        self.assertEqual(load_scenario(data).host_GBps, 80.0)
        data["bandwidth_GBps"]["host"] = 0
        with self.assertRaisesRegex(ScenarioError, "'host' must be > 0"):
            load_scenario(data)

    def test_bad_config(self):
        with self.assertRaisesRegex(ValueError, "module_fraction must be a fraction in \\[0, 1\\]"):
            TrainingConfig(module_fraction=1.5)
        with self.assertRaisesRegex(ValueError, "optimizer must be 'host', 'stream'"):
            TrainingConfig(optimizer="gpu")
        with self.assertRaisesRegex(ValueError, "cast_on must be 'host' .* or 'device' .*, got 'gpu'"):
            TrainingConfig(module_fraction=1.0, cast_on="gpu")


def report_section(result, number):
    """The lines of step ``number`` of ``result.report()``, up to the next step."""
    lines = result.report().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{number}. "))
    end = next((i for i, line in enumerate(lines) if line.startswith(f"{number + 1}. ")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


class TestReport(TestCase):
    """The report reads on its own: every figure per GPU, the recommended row a row of its table,
    every row label in a legend, and the decision rule printed when it chose another row than the
    fastest."""

    def test_world_size_figures_are_per_gpu(self):
        one = plan("anchor-1.6b", platform="h200-pcie", batch_size=4)
        two = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, world_size=2)
        # FSDP shards the state over the GPUs; each GPU holds its own micro-batch's activations.
        for key in ("weights_GB", "grads_GB", "optimizer_state_GB"):
            self.assertAlmostEqual(getattr(two.scenario, key), getattr(one.scenario, key) / 2)
        self.assertEqual((two.scenario.activations_GB, two.scenario.other_GB), (one.scenario.activations_GB, one.scenario.other_GB))
        # An iteration is today's row of the step model, at either world size: one figure in 2. and 7.
        for result in (one, two):
            today = [p for f, p in result.training.predictions if f == 1 and p.config == TrainingConfig()][0]
            self.assertEqual(result.scenario.iteration_time_s, today.step_s)
        self.assertExpectedInline(report_section(two, 1), """\
1. Memory per GPU of today's run (modules=0.00) at its forward peak (budget 125.8 GiB = 135.1 GB)
   weights               3.0 GiB    2.4%  (fp32 masters on the GPU)
   optimizer state       6.0 GiB    4.8%  (AdamW moments on the GPU)
   unsharded params      0.8 GiB    0.6%  (gathered groups in the compute dtype)
   activations           8.1 GiB    6.5%  (saved for backward)
   loss                  0.0 GiB    0.0%  (the loss on 32 logits a token: fp32 copy, gradients)
   headroom              0.0 GiB    0.0%  (the allocator's: free memory for the loss's fp32 output, 1.25x its size)
   total                17.9 GiB   14.2%: fits, 107.9 GiB unused
""")
        self.assertIn("Every figure is per GPU: FSDP over 2 GPUs of one host", two.report())
        self.assertIn("2. Iteration time: 0.170 s per step (today's run)", two.report())
        today_row = [line for line in report_section(two, 7).splitlines() if "today's run" in line][0]
        self.assertEqual(" ".join(today_row.split()), "1x modules=0.00 0.170 17.9 48065 yes today's run, <- recommended")

    def test_recommended_row_legend_and_offload_margin(self):
        # Over 2 GPUs within 16 GiB each, the recommendation (checkpointing, nothing offloaded) is
        # slower than settings that fit: it is a row all the same, and the margin that chose it
        # is printed with the faster row it passed over.
        result = plan("anchor-1.6b", platform="h200-pcie", batch_size=8, world_size=2, gpu_memory_GiB=16)
        self.assertExpectedInline(report_section(result, 7), """\
7. FSDP2 step model, per GPU (budget 16.0 GiB; analytic (FLOPs at 65% of h200-pcie peak)):
   batch  setting                                             step s  peak GiB/GPU  tokens/s/GPU  fits
      1x  modules=0.00                                         0.322          26.0         50818  no    today's run
      1x  modules=0.12 opt=host ckpt                           0.390          13.4         41985  yes
      1x  modules=0.12 opt=host ckpt cast=device               0.390          13.4         41985  yes
      1x  modules=0.12 opt=host ckpt keep=1                    0.390          13.4         41985  yes
      1x  modules=0.12 opt=host ckpt keep=1 cast=device        0.390          13.4         41985  yes
      1x  modules=0.12 opt=split0.25 ckpt                      0.390          13.4         41985  yes
      1x  modules=0.12 opt=split0.25 ckpt cast=device          0.390          13.4         41985  yes
      1x  modules=0.12 opt=split0.25 ckpt keep=1               0.390          13.4         41985  yes
      1x  modules=0.12 opt=split0.25 ckpt keep=1 cast=device   0.390          13.4         41985  yes
      1x  modules=0.00 ckpt                                    0.393          14.8         41738  yes   baseline, <- recommended
   legend: Nx: N times today's micro-batch; fits: the peak, and the allocator's headroom (free memory for the loss's fp32 output, 1.25x its size), within the budget; baseline: the run gains are quoted over
   modules=F: fraction F of the blocks offloaded (params, grads, optimizer state), the last in forward order
   opt=: where the offloaded blocks' optimizer steps: host; splitF: fraction F of them streamed through the GPU; stream: all
   ckpt: activation checkpointing per block (its forward recomputed in backward)
   keep=N: the last N blocks stay unsharded from forward to backward (one copy-in per step instead of two)
   cast=device: the fp32 master copied in and cast on the GPU (no cast on the host, twice the copy-in bytes)
   recommended: the fastest row that fits; a row that moves bytes over the link must beat the fastest moving none by 10%
   (the step model's error against measured steps), and within 2% of the fastest the row moving the fewest bytes wins
   (then: the one without ckpt). Here modules=0.12 opt=host ckpt at 1x is +0.6% faster than modules=0.00 ckpt at 1x,
   less than the 10% margin, so the recommendation moves no bytes.
""")

    def test_tie_rule_is_printed_when_it_decides(self):
        result = plan("anchor-1.6b", platform="h200-pcie", batch_size=16, gpu_memory_GiB=12)
        section = report_section(result, 7)
        self.assertExpectedInline(section[section.index("   recommended: "):], """\
   recommended: the fastest row that fits; a row that moves bytes over the link must beat the fastest moving none by 10%
   (the step model's error against measured steps), and within 2% of the fastest the row moving the fewest bytes wins
   (then: the one without ckpt). Here modules=0.88 opt=host ckpt keep=7 cast=device at 1x is within 2% of modules=0.75
   opt=split0.25 act=0.50 ckpt cast=device at 1x (-0.2%) and moves 11.3 GB per step, not 27.9 GB.
""")

    def test_no_rule_when_the_fastest_row_is_recommended(self):
        result = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=13.7)
        section = report_section(result, 7)
        self.assertIn(f"{result.recommended.predicted_step_s:.3f}", section.splitlines()[3])
        self.assertIn("<- recommended", section.splitlines()[3])
        self.assertNotIn("recommended: ", section)

    def test_every_label_kind_has_a_legend_line(self):
        configs = default_training_configs(8) + [
            TrainingConfig(module_fraction=0.5, optimizer="stream", prefetch_depth=2, block_placement="spread"),
            TrainingConfig(module_fraction=0.5, step_during_backward=True, clipping=True, grad_accum_steps=4),
        ]
        kinds = {label_kind(part) for config in configs for part in config.label.split()}
        self.assertEqual(kinds, set(LABEL_LEGEND))
        self.assertEqual(set(TECHNIQUES) | {"link-bound"}, set(TECHNIQUE_LEGEND))
        # Only the kinds a table uses are explained under it.
        section = report_section(plan("anchor-1.6b", platform="h200-pcie", batch_size=4), 7)
        self.assertNotIn(LABEL_LEGEND["spread"], section)
        self.assertIn(LABEL_LEGEND["modules"], section)

    def test_h100_sxm_profile(self):
        sxm, pcie = get_profile("h100-sxm"), get_profile("h100-pcie")
        self.assertEqual(
            (sxm.kind, sxm.gpu_memory_GB, sxm.gpu_dram_GBps, sxm.gpu_bf16_TFLOPS, sxm.link_GBps),
            ("discrete", 80.0, 3350.0, 989.0, 55.0),
        )
        # The same PCIe Gen5 host link as the PCIe card; NVLink between the GPUs of the board.
        self.assertEqual((sxm.h2d_GBps, sxm.d2h_GBps, sxm.host_GBps), (pcie.h2d_GBps, pcie.d2h_GBps, pcie.host_GBps))
        self.assertGreater(sxm.gpu_interconnect_GBps, pcie.gpu_interconnect_GBps)
        code, out, _ = run_cli("--model", "anchor-1.6b", "--batch-size", "4", "--platform", "h100-sxm")
        self.assertEqual(code, 0)
        self.assertIn("Platform: h100-sxm (discrete); per GPU: 80.0 GB memory, 3350 GB/s DRAM, 55 GB/s link", out)


class TestValidationScript(TestCase):
    def test_reads_benchmark_rows_defensively(self):
        spec = importlib.util.spec_from_file_location("planner_validate", os.path.join(REPO, "benchmarks", "planner_validate.py"))
        validate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(validate)
        rows = [
            {"name": "resident", "batch_size": 4, "step_s": 0.183, "fwd_s": 0.045, "bwd_s": 0.101, "opt_s": 0.038, "peak_gpu_GiB": 30.2},
            {"name": "stock_cpu_offload+fused_cpu_adamw", "batch_size": 4, "step_s": 0.79, "peak_gpu_GiB": 27.1},
            {"name": "coherent(depth=2,fraction=0.5)", "batch_size": 4, "step_s": 0.2, "peak_gpu_GiB": 20.0},
            {"name": "coherent(depth=1)", "batch_size": 4, "error": "OOM"},
            {"name": "coherent(host;modules=0.5)", "batch_size": 4, "step_s": 0.36, "peak_gpu_GiB": 20.3},
        ]
        self.assertEqual(
            validate.row_config(rows[4], "host", default_depth=2),
            TrainingConfig(module_fraction=0.5, optimizer="host", prefetch_depth=2, block_placement="spread"),
        )
        self.assertEqual(
            validate.row_config({"name": "coherent(split=0.5)"}, "host", default_depth=2),
            TrainingConfig(module_fraction=1.0, optimizer=0.5, prefetch_depth=2),
        )
        self.assertEqual(
            validate.row_config(rows[2], "host"),
            TrainingConfig(module_fraction=0.5, prefetch_depth=2),
        )
        self.assertIsNone(validate.row_config(rows[1], "host"))
        # fsdp_offload.py's ";ac" suffix: every block checkpointed.
        self.assertEqual(
            validate.row_config({"name": "coherent(split=0.25;next-fwd;modules=0.625;ac)"}, "host", default_depth=2),
            TrainingConfig(module_fraction=0.625, optimizer=0.25, checkpointing=True, prefetch_depth=2, block_placement="spread"),
        )
        self.assertEqual(validate.row_config({"name": "resident;ac"}, "host"), TrainingConfig(checkpointing=True))
        # fsdp_offload.py's "cast=device" item: CoherentOffload(cast_on="device").
        self.assertEqual(
            validate.row_config({"name": "coherent(host;next-fwd;last=0.5;keep=1;ac;depth=1;units=2;cast=device)"}, "host",
                                default_depth=2),
            TrainingConfig(module_fraction=0.5, optimizer="host", checkpointing=True, prefetch_depth=1, keep_unsharded=1,
                           cast_on="device"),
        )
        self.assertEqual(validate.row_config({"name": "coherent(host;cast=host)"}, "host"),
                         TrainingConfig(module_fraction=1.0, optimizer="host"))
        with self.assertRaisesRegex(ValueError, "cast_on must be 'host'"):
            validate.row_config({"name": "coherent(host;cast=gpu)"}, "host")
        # The run's cast figures reach the profile: cast=device rows step AdamW alone on the host.
        rates = validate.host_step_rates({"host_optimizer_measured": {
            "adamw_s_per_Gparam": 0.2345, "cast_s_per_Gparam": 0.0763,
            "link_busy": {"adamw_s_per_Gparam": 0.3668, "cast_s_per_Gparam": 0.2248, "link_GBps_meanwhile": 93.2}}})
        self.assertAlmostEqual(rates.alone_s_per_param - rates.alone_cast_s_per_param, 0.2345e-9)
        self.assertAlmostEqual(rates.link_busy_s_per_param - rates.link_busy_cast_s_per_param, 0.3668e-9)
        # depth=1 overrides the file's default of 2, and the printed config shows it.
        shallow = validate.row_config({"name": "coherent(split=0.25;next-fwd;modules=0.625;ac;depth=1)"}, "host",
                                      default_depth=2)
        self.assertEqual((shallow.prefetch_depth, shallow.label), (1, "modules=0.62 opt=split0.25 ckpt spread"))
        self.assertEqual(TrainingConfig(module_fraction=0.625, prefetch_depth=2).label, "modules=0.62 opt=host depth=2")
        with tempfile.TemporaryDirectory() as tmp:
            results, out = os.path.join(tmp, "fsdp_offload.json"), os.path.join(tmp, "validate.json")
            with open(results, "w", encoding="utf-8") as handle:
                json.dump({"model": "anchor-1.6b", "seq_len": 2048, "rows": rows}, handle)
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(validate.main(["--offline", "--from-json", results, "--out", out]), 0)
            with open(out, encoding="utf-8") as handle:
                written = json.load(handle)
        by_name = {r["name"]: r for r in written["files"][0]["rows"]}
        self.assertTrue(by_name["resident"]["calibration"])
        self.assertAlmostEqual(by_name["resident"]["peak_error"], 0.0, places=2)
        self.assertIn("skipped", by_name["stock_cpu_offload+fused_cpu_adamw"])
        self.assertIn("OOM", by_name["coherent(depth=1)"]["skipped"])
        self.assertEqual(written["summary"]["rows_predicted"], 2)


if __name__ == "__main__":
    run_tests()
