"""Tests of planning the loop a user runs: the block timed wherever the model lives (only a copy of
the block moves), the memory of the loss at the model's vocabulary, accumulated gradients and the
allocator's headroom counted by one memory model, a smaller micro-batch with more accumulation
named where nothing fits, and a report whose every line reads true."""

import contextlib
import dataclasses
import io
import json
import re
from unittest import mock

import torch
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests, TestCase

from torch_fsdp_offload.__main__ import main
from torch_fsdp_offload.models import TransformerConfig
from torch_fsdp_offload.planner import NothingFitsError, get_profile, plan, plan_and_shard, predict_step, TrainingConfig
from torch_fsdp_offload.planner.memory_breakdown import model_breakdown
from torch_fsdp_offload.planner.traffic import HOST_NORM_GBPS
from torch_fsdp_offload.planner.training_profile import training_profile

from test_planner_any_model import DIM, PlainBlocks

TALK = "docs/examples/talk_gh200.json"
# A decoder of two blocks with a 150k-token vocabulary, as Qwen's: at 4 x 2048 tokens its loss's
# logits (4.6 GiB in fp32) outweigh its blocks.
BIG_VOCAB = TransformerConfig(vocab_size=151936, dim=2048, n_layers=2, n_heads=16, n_kv_heads=2, ffn_hidden=11008,
                              max_seq_len=2048)


def state_of(model: torch.nn.Module) -> dict[str, tuple]:
    return {name: (p.device, p.dtype, p.data_ptr(), p.detach().clone(), p.grad) for name, p in model.named_parameters()}


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", *argv])
    return code, out.getvalue()


class TestMeasuredWhereTheModelIs(TestCase):
    def test_a_model_on_the_cpu_is_timed_with_its_input_on_another_device(self):
        # The GPU case: the model where from_pretrained leaves it, its input on another device. The
        # block's inputs are captured where the model is; only a copy of the block is timed.
        model = PlainBlocks()
        before = state_of(model)
        result = plan(model, example_input=torch.randn(2, 16, DIM, device="meta"), platform="h200-pcie", measure=True,
                      device="cpu", microbatch_factors=(1, 2))
        self.assertEqual((result.timing, result.timing_reason), ("measured", None))
        self.assertEqual(result.training.profiles[0][1].source, "measured block")
        after = state_of(model)
        self.assertEqual(list(after), list(before))
        for name, (device, dtype, pointer, value, grad) in before.items():
            self.assertEqual(after[name][:3], (device, dtype, pointer))
            self.assertEqual(after[name][3], value, atol=0, rtol=0)
            self.assertIsNone(after[name][4])

    def test_a_meta_model_is_built_where_it_is_timed(self):
        model = PlainBlocks().to("meta")
        result = plan(model, example_input=torch.randn(2, 16, DIM, device="meta"), platform="h200-pcie", measure=True,
                      device="cpu", microbatch_factors=(1,))
        self.assertEqual(result.timing, "measured")
        self.assertTrue(all(p.is_meta for p in model.parameters()))

    def test_why_times_are_estimated_heads_the_report(self):
        result = plan("anchor-1.6b", platform="h200-pcie", batch_size=4)
        self.assertEqual(result.timing, "estimated")
        self.assertEqual(result.timing_reason, "platform= given (a plan for h200-pcie, not this machine)")
        self.assertEqual(result.to_dict()["timing_reason"], result.timing_reason)
        self.assertTrue(result.report().splitlines()[2].startswith(
            "Times: estimated from FLOPs for h200-pcie, not measured: platform= given (a plan for h200-pcie"))
        self.assertNotIn("Note: times", result.report())


class TestTheLoopIsPlanned(TestCase):
    def test_the_loss_at_the_vocabulary_and_the_allocators_headroom_count(self):
        # Resident, its loss's logits (fp32 copy, gradients, and a free block for the fp32 output)
        # take more than the budget leaves: every part of the report says so, and names what fits.
        result = plan(BIG_VOCAB, platform="h200-pcie", batch_size=4, seq_len=2048, gpu_memory_GiB=20)
        breakdown = model_breakdown(BIG_VOCAB, batch_size=4, seq_len=2048)
        _, today = result.training.today()
        self.assertEqual(today.peak_parts["loss"], breakdown.loss_transient_bytes)
        fp32_logits = 4 * 4 * 2048 * 151936
        self.assertEqual(today.allocation_slack_bytes, int(1.25 * fp32_logits))
        self.assertFalse(today.fits(20 * 2**30))
        # Under 40 GiB, a 4.64 GiB logits block failed with 5.47 GiB free in pieces beside the peak:
        # a peak that leaves that much does not fit.
        failed = dataclasses.replace(today, peak_gpu_bytes=40 * 2**30 - int(5.47 * 2**30))
        self.assertFalse(failed.fits(40 * 2**30))
        report = result.report()
        self.assertRegex(report, r"loss +9\.3 GiB .*\(the loss on 151,936 logits a token")
        self.assertRegex(report, r"headroom +5\.8 GiB .*1\.25x its size")
        self.assertRegex(report, r"\n +1x +1\.00x +\+0% +32\.1 GiB \(does not fit\)\n")
        self.assertFalse(result.recommended.fits)
        self.assertIn("a micro-batch of 2 with 2 accumulated per step fits (batch_size=2, grad_accum_steps=2", report)
        smaller = plan(BIG_VOCAB, platform="h200-pcie", batch_size=2, seq_len=2048, gpu_memory_GiB=20, grad_accum_steps=2)
        self.assertTrue(smaller.recommended.fits)
        self.assertLessEqual(smaller.training.needed_GiB(smaller.training.best), 20)

    def test_the_root_goes_with_every_block_and_its_gathered_copy_stays(self):
        # Where every block is offloaded, the policy goes on the root too: its master and moments
        # leave the GPU, it is streamed first, and its bytes cross the link. Offloaded or not, the
        # root's compute-dtype parameters stay gathered from forward to backward (FSDP2 keeps the
        # root unsharded): on a 151,936-token vocabulary, 0.58 GiB that the 40 GiB rows measured.
        platform = get_profile("h200-pcie")
        profile = training_profile(model_breakdown(BIG_VOCAB, batch_size=4, seq_len=2048), platform)
        root = profile.other_params
        gathered = (2 * profile.block_params + root) * profile.compute_bytes
        every = predict_step(profile, TrainingConfig(module_fraction=1.0, checkpointing=True), platform)
        some = predict_step(profile, TrainingConfig(module_fraction=0.5, checkpointing=True), platform)
        self.assertNotIn("weights", every.peak_parts)
        self.assertNotIn("optimizer_state", every.peak_parts)
        self.assertGreaterEqual(every.peak_parts["unsharded"], gathered)
        resident = root + (profile.n_blocks - round(0.5 * profile.n_blocks)) * profile.block_params
        self.assertEqual(some.peak_parts["weights"], resident * profile.param_bytes)
        self.assertGreaterEqual(some.peak_parts["unsharded"], gathered)
        # The root's bytes: copied in once (it stays gathered for backward), its gradients down.
        blocks = profile.n_blocks * profile.block_params
        self.assertEqual(every.h2d_bytes, (2 * blocks + root) * profile.compute_bytes)
        self.assertEqual(every.d2h_bytes, (blocks + root) * profile.grad_bytes)
        # Streamed first: with one of the 3 groups streamed, it is the root.
        one = predict_step(profile, TrainingConfig(module_fraction=1.0, optimizer=1 / 3, checkpointing=True), platform)
        per_param_up = profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes
        self.assertEqual(one.h2d_bytes - every.h2d_bytes, root * per_param_up)

    def test_clipping_waits_for_the_norm_of_the_root_landing_last(self):
        # clip_grad_norm_ needs every gradient's norm; an offloaded root's (a 151,936-token tied
        # embedding here) lands last and its CPU norm runs on one core after backward.
        platform = get_profile("h200-pcie")
        profile = training_profile(model_breakdown(BIG_VOCAB, batch_size=4, seq_len=2048), platform)
        wait = profile.other_params * profile.grad_bytes / (HOST_NORM_GBPS * 1e9)
        self.assertGreater(wait, 0.1)
        for fraction, root_offloaded in ((1.0, True), (0.5, False)):
            knobs = dict(module_fraction=fraction, checkpointing=True, cast_on="device", optimizer="stream")
            plain = predict_step(profile, TrainingConfig(**knobs), platform)
            clipped = predict_step(profile, TrainingConfig(clipping=True, **knobs), platform)
            # Streamed steps scale on the GPU: the wait is all the clip adds.
            self.assertAlmostEqual(clipped.step_s - plain.step_s, wait if root_offloaded else 0.0)

    def test_accumulated_gradients_stay_on_the_gpu_for_resident_blocks_only(self):
        platform = get_profile("h200-pcie")
        profile = training_profile(model_breakdown("anchor-1.6b", batch_size=4, seq_len=2048), platform)
        for fraction in (0.0, 0.5, 1.0):
            one = predict_step(profile, TrainingConfig(module_fraction=fraction), platform)
            four = predict_step(profile, TrainingConfig(module_fraction=fraction, grad_accum_steps=4), platform)
            # Where every block is offloaded, the root is too.
            resident = profile.total_params - round(fraction * profile.n_blocks) * profile.block_params - (
                profile.other_params if fraction == 1.0 else 0)
            # From the second micro-batch on, every resident gradient is live in forward; in
            # backward one fresh shard beside them, and an offloaded group's shard on its way down
            # with its running sum brought up to it.
            fresh = 1 + (2 if fraction > 0 else 0)
            self.assertEqual(four.peak_parts.get("grads", 0), resident * profile.grad_bytes + (
                0 if four.peak_phase == "forward" else fresh * profile.block_params * profile.grad_bytes))
            self.assertGreater(four.peak_gpu_bytes, one.peak_gpu_bytes)
            # Four forwards and backwards, their copies four times, one optimizer step; in the three
            # later backwards the offloaded groups' running sums come up too, to be added to on the
            # device (their gradients' bytes: what goes down).
            sums_up = one.d2h_bytes
            self.assertEqual((four.h2d_bytes, four.d2h_bytes), (4 * one.h2d_bytes + 3 * sums_up, 4 * one.d2h_bytes))
            later = (four.backward_s - one.backward_s) / 3
            self.assertGreaterEqual(later, one.backward_s)
            self.assertAlmostEqual(four.step_s, 4 * one.forward_s + one.backward_s + 3 * later + one.optimizer_s)
            # On a slow link the sums' copies bind the later backwards where anything is offloaded.
            slow = dataclasses.replace(platform, h2d_GBps=platform.h2d_GBps / 20, d2h_GBps=platform.d2h_GBps / 20)
            slow_one = predict_step(profile, TrainingConfig(module_fraction=fraction), slow)
            slow_four = predict_step(profile, TrainingConfig(module_fraction=fraction, grad_accum_steps=4), slow)
            self.assertEqual(slow_four.backward_s > 4 * slow_one.backward_s, fraction > 0)
            eight = predict_step(profile, TrainingConfig(module_fraction=fraction, grad_accum_steps=8), platform)
            self.assertAlmostEqual(eight.backward_s - one.backward_s, 7 * later)

    def test_a_plan_for_accumulation_and_clipping(self):
        result = plan("anchor-1.6b", platform="h200-pcie", batch_size=4, gpu_memory_GiB=14, grad_accum_steps=4,
                      clipping=True)
        # A larger micro-batch keeps the 16 sequences per step: 2x with 2 accumulated, 4x alone.
        steps = {f: {p.config.grad_accum_steps for g, p in result.training.predictions if g == f}
                 for f, _ in result.training.profiles}
        self.assertEqual(steps, {1.0: {4}})  # estimated: today's micro-batch only
        self.assertTrue(all(p.config.clipping for _, p in result.training.predictions))
        recommended = result.recommended
        self.assertTrue(recommended.fits)
        self.assertEqual(recommended.micro_batch_size * recommended.grad_accum_steps, 16)
        self.assertLessEqual(result.training.needed_GiB(result.training.best), 14)
        self.assertIn("clip accum=4", result.report())
        self.assertIn("accumulate 4 micro-batches of 4 per optimizer step", recommended.code())
        code, out = run_cli("--model", "anchor-1.6b", "--batch-size", "4", "--platform", "h200-pcie",
                            "--gpu-memory-GiB", "14", "--grad-accum-steps", "4", "--clipping", "--json")
        self.assertEqual(code, 0)
        self.assertEqual(json.loads(out)["recommended"]["coherent_offload"], recommended.code())
        for bad in (0, 1.5, True):
            with self.assertRaisesRegex(ValueError, "grad_accum_steps must be an int >= 1"):
                plan("anchor-1.6b", platform="h200-pcie", grad_accum_steps=bad)
        with self.assertRaisesRegex(ValueError, "grad_accum_steps only apply to a model"):
            plan(scenario=TALK, grad_accum_steps=4)

    def test_under_a_cap_the_budget_is_the_whole_cap(self):
        # set_per_process_memory_fraction bounds the caching allocator alone, and every prediction
        # counts the allocator's headroom: a capped process budgets all of its cap, an uncapped one
        # 90% of the GPU (the rest for the CUDA context and NCCL), a plan for another machine too.
        model, example = PlainBlocks(), torch.randn(2, 16, DIM)
        uncapped = plan(model, example_input=example, microbatch_factors=(1,)).training.capacity_bytes
        with mock.patch("torch_fsdp_offload.planner.api.process_memory_fraction", return_value=0.5):
            capped = plan(model, example_input=example, microbatch_factors=(1,)).training.capacity_bytes
            other = plan(model, example_input=example, microbatch_factors=(1,), platform="h200-pcie").training
        self.assertAlmostEqual(capped / uncapped, 1 / 0.9, places=3)  # host_only: the memory available now
        self.assertAlmostEqual(other.capacity_bytes, get_profile("h200-pcie").gpu_memory_GB * 1e9 * 0.9, delta=1)

    def test_where_nothing_fits_the_error_says_what_would(self):
        model = PlainBlocks().to("meta")
        with self.assertRaises(NothingFitsError) as raised:
            plan_and_shard(model, example_input=torch.randn(4, 16, DIM), platform="h200-pcie",
                           gpu_memory_GiB=1e-7, grad_accum_steps=2)
        self.assertIn("What would fit: no smaller micro-batch of whole sequences fits with more accumulation either",
                      str(raised.exception))
        self.assertIn(raised.exception.result.training.what_would_fit, raised.exception.result.report())
        result = plan(BIG_VOCAB, platform="h200-pcie", batch_size=4, seq_len=2048, gpu_memory_GiB=20, grad_accum_steps=4)
        self.assertIn("a micro-batch of 2 with 8 accumulated per step fits (batch_size=2, grad_accum_steps=8: the same "
                      "16 sequences per step)", result.recommended.reason)
        with self.assertRaisesRegex(ValueError, "this plan has nothing to apply: nothing fits"):
            result.recommended.apply(torch.nn.Linear(2, 2))


# name -> plan(...) arguments: plans where today's run fits, does not fit, where nothing fits;
# with accumulation and without; a scenario over its budget.
_PLANS = {
    "fits": dict(model="anchor-1.6b", batch_size=4),
    "offload_fits": dict(model="anchor-1.6b", batch_size=4, gpu_memory_GiB=14),
    "nothing_fits": dict(model="anchor-1.6b", batch_size=4, gpu_memory_GiB=2),
    "fits_accumulating": dict(model="anchor-1.6b", batch_size=4, grad_accum_steps=4, clipping=True),
    "offload_fits_accumulating": dict(model="anchor-1.6b", batch_size=4, gpu_memory_GiB=14, grad_accum_steps=4),
    "checkpointed_baseline": dict(model="anchor-1.6b", batch_size=8, world_size=2, gpu_memory_GiB=16),
    "big_vocabulary_accumulating": dict(model=BIG_VOCAB, batch_size=4, seq_len=2048, gpu_memory_GiB=24, grad_accum_steps=4),
    "big_vocabulary_smaller": dict(model=BIG_VOCAB, batch_size=2, seq_len=2048, gpu_memory_GiB=24, grad_accum_steps=8),
    "scenario_over_budget": dict(scenario=TALK, gpu_memory_GiB=60),
    "scenario": dict(scenario=TALK),
}


@instantiate_parametrized_tests
class TestTheReportReadsTrue(TestCase):
    @parametrize("name", list(_PLANS))
    def test_no_negative_memory_no_contradiction_every_gain_over_a_run_that_fits(self, name):
        kwargs = dict(_PLANS[name])
        model = kwargs.pop("model", None)
        result = plan(model, **({} if "scenario" in kwargs else {"platform": "h200-pcie"}), **kwargs)
        report, recommended = result.report(), result.recommended
        lines = report.splitlines()
        for line in lines:
            self.assertNotRegex(line, r"-\s*\d[\d.,]*\s*(GB|GiB)\b|(GB|GiB)\s+-\d", f"negative memory: {line}")
        section_1 = lines[lines.index("") + 1: next(i for i, line in enumerate(lines) if line.startswith("2. "))]
        self.assertFalse(any(re.search(r"-\d+(\.\d+)?%", line) for line in section_1), section_1)
        # A recommendation that fits is never beside "nothing fits", and one that does not is no
        # row marked recommended.
        verdicts = [line for line in lines if re.search(r"nothing fits|no setting .*fits in GPU memory", line)]
        marked = [line for line in lines if "<- recommended" in line]
        if recommended.fits:
            self.assertEqual(verdicts, [])
            self.assertTrue(marked)
            for line in marked:
                self.assertNotIn("does not fit", line)
                self.assertNotRegex(line, r"\bno\s+<- recommended")
        else:
            self.assertTrue(verdicts)
            self.assertEqual(marked, [])
            self.assertIsNone(recommended.throughput_gain)
        # Every gain is over one named run, and that run fits.
        allowed = tuple(name for name in (recommended.baseline, "the recommendation") if name is not None)
        for gain in re.finditer(r"([+-]\d+% (?:throughput )?|gain: throughput )over ", report):
            self.assertTrue(report[gain.end():].startswith(allowed), report[gain.start():gain.end() + 60])
        if recommended.baseline is None:
            self.assertNotIn("over today's run", report)
        elif result.training is not None:
            mark = "today's run" if recommended.baseline.startswith("today's run") else "baseline"
            row = next(line for line in lines if re.search(rf"\s(yes|no)\s+{mark}\b", line))
            self.assertRegex(row, rf"\syes\s+{mark}\b")
        else:
            self.assertTrue(result.search.baseline().fits)
        if result.training is not None and recommended.fits:
            # One memory model: step 6's recommended row is step 7's, at the memory step 7 checks.
            six = next(line for line in lines[lines.index(next(line for line in lines if line.startswith("6. "))):]
                       if "<- recommended" in line)
            best = result.training.best
            self.assertEqual(re.split(r"\s{2,}", six.strip())[2:4], [
                f"{best[1].config.module_fraction:.0%}", f"{best[1].config.activations:.0%}"])
            self.assertIn(f"  {result.training.needed_GiB(best):.1f}  ", six)
        if result.training is not None:
            # What step 1 and step 5 say of today's run is step 7's verdict.
            fits_today = result.training.fits(result.training.today())
            self.assertIn("fits," if fits_today else "does not fit,", section_1[-1])
            self.assertIn("(fits)" if fits_today else "(does not fit)",
                          next(line for line in lines if line.lstrip().startswith("1x   1.00x")))


if __name__ == "__main__":
    run_tests()
