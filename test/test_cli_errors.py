"""Refused inputs of the command lines (``train``, ``plan``): each is refused when it is given, with a
message naming the flag or the mismatch and the fix. Every CLI runs in-process through its ``main``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import tempfile
import unittest
import warnings
from unittest import mock

import torch
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests, TestCase

from torch_fsdp_offload.__main__ import main as dispatch
from torch_fsdp_offload.models import HF_CONFIGS, MODEL_CONFIGS
from torch_fsdp_offload.planner import plan, PLATFORM_PROFILES
from torch_fsdp_offload.planner.cli import cli_spelling
from torch_fsdp_offload.train import _check_checkpoint_fits, main as train_main, parse_args

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TALK = os.path.join(REPO_ROOT, "docs", "examples", "talk_gh200.json")
# One quick step of the tiny model in this process (gloo, world size 1).
QUICK = ["--seq-len", "16", "--batch-size", "2", "--device", "cpu", "--steps", "1"]


class CLITestCase(TestCase):
    def setUp(self) -> None:
        super().setUp()
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCH_FSDP_OFFLOAD_PLATFORM"):
            os.environ.pop(name, None)
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)

    def assertRefused(self, parse, argv: list[str], message: str) -> None:
        """``parse(argv)`` exits with argparse's status 2 and ``message`` on stderr."""
        stderr = io.StringIO()
        with self.assertRaises(SystemExit) as raised, contextlib.redirect_stderr(stderr):
            parse(argv)
        self.assertEqual(raised.exception.code, 2, argv)
        self.assertIn(message, stderr.getvalue(), argv)


class TestPlanArguments(CLITestCase):
    def test_scenario_refuses_model_only_flags(self) -> None:
        # The scenario file carries its own micro-batch and timings: these flags were ignored.
        self.assertRefused(
            dispatch, ["plan", "--scenario", TALK, "--batch-size", "4", "--world-size", "2"],
            f"error: --batch-size, --world-size only apply to --model; --scenario {TALK} takes the micro-batch, "
            "sequence and timings from the file",
        )
        for flag, value in (("--seq-len", "512"), ("--microbatch-factors", "1,2")):
            self.assertRefused(dispatch, ["plan", "--scenario", TALK, flag, value], f"drop {flag}, or plan with --model")
        self.assertRefused(dispatch, ["plan", "--scenario", TALK, "--clipping"], "drop --clipping, or plan with --model")


@instantiate_parametrized_tests
class TestPlanErrorsSpellFlags(CLITestCase):
    """The plan command's errors name its flags (``--platform``), not plan()'s keywords (``platform=``)."""

    @parametrize(
        "argv, message",
        [
            (["--world-size", "0"], "error: --world-size must be >= 1, got 0"),
            (["--batch-size", "0"], "error: --batch-size, --seq-len and --microbatch-factors must be >= 1, got 0, 64"),
            (["--microbatch-factors", "0,1"], "error: --batch-size, --seq-len and --microbatch-factors must be >= 1"),
            (["--gpu-memory-GiB", "-1"], "error: --gpu-memory-GiB must be a positive number of GiB, got -1.0"),
        ],
        name_fn=lambda argv, message: argv[0].lstrip("-").replace("-", "_"),
    )
    def test_refused_value(self, argv, message) -> None:
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            code = dispatch(["plan", "--model", "tiny", "--seq-len", "64", "--platform", "h200-pcie", *argv])
        self.assertEqual(code, 2)
        self.assertIn(message, stderr.getvalue())
        self.assertNotRegex(stderr.getvalue(), r"\b(?:world_size|batch_size|seq_len|microbatch_factors|gpu_memory_GiB)\b")

    def test_gpu_memory_that_is_no_finite_budget(self) -> None:
        for value in ("inf", "nan"):
            stderr = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
                code = dispatch(["plan", "--model", "tiny", "--seq-len", "64", "--platform", "h200-pcie",
                                 "--gpu-memory-GiB", value])
            self.assertEqual(code, 2)
            self.assertIn(f"error: --gpu-memory-GiB must be a positive number of GiB, got {value}: pass the finite "
                          "memory the step's peak must fit in", stderr.getvalue())

    def test_no_gpu_and_no_platform_plans_this_machine(self) -> None:
        # Without an accelerator and without --platform, the plan is for this machine: nothing to
        # offload, and it says how to plan for a GPU machine instead.
        stdout = io.StringIO()
        with mock.patch.object(torch.cuda, "is_available", return_value=False), contextlib.redirect_stdout(stdout):
            self.assertEqual(dispatch(["plan", "--model", "tiny", "--seq-len", "64"]), 0)
        self.assertIn("Platform: measured (host_only)", stdout.getvalue())
        self.assertIn("do not offload: this machine has no accelerator", stdout.getvalue())
        self.assertIn("(to plan for a GPU machine, pass --platform)", stdout.getvalue())
        with mock.patch.object(torch.cuda, "is_available", return_value=False):
            recommended = plan("tiny", seq_len=64).recommended
        self.assertIsNone(recommended.kwargs)
        self.assertIn("(to plan for a GPU machine, pass platform=)", recommended.reason)

    def test_sequence_longer_than_the_model_takes(self) -> None:
        # plan()'s default sequence (2048 tokens) is longer than the tiny model's: refused before tracing.
        self.assertRefused(
            dispatch, ["plan", "--model", "tiny", "--platform", "h200-pcie"],
            "error: --seq-len 2048 (the default) exceeds the 256 tokens of --model tiny: pass --seq-len 256 or less",
        )
        self.assertRefused(
            dispatch, ["plan", "--model", "small", "--seq-len", "4096", "--platform", "h200-pcie"],
            "error: --seq-len 4096 exceeds the 1024 tokens of --model small: pass --seq-len 1024 or less",
        )

    def test_help_lists_every_model_and_platform(self) -> None:
        stdout = io.StringIO()
        with self.assertRaises(SystemExit), contextlib.redirect_stdout(stdout):
            dispatch(["plan", "--help"])
        text = " ".join(stdout.getvalue().split())
        for name in [*MODEL_CONFIGS, *HF_CONFIGS, *PLATFORM_PROFILES, "hf:<config path or hub id>"]:
            self.assertIn(name, text)

    def test_cli_spelling(self) -> None:
        self.assertEqual(
            cli_spelling("pass platform= one of x; world_size=2 and gpu_memory_GiB; a unified platform"),
            "pass --platform one of x; --world-size=2 and --gpu-memory-GiB; a unified platform",
        )


class TestTrainArguments(CLITestCase):
    def test_refused_before_the_process_group(self) -> None:
        # Each of these used to be accepted here and fail (or train silently wrong) only after the
        # process group and the model were built.
        cases = {
            ("--offload-activations", "2"): "--offload-activations is the fraction of blocks whose activations are "
            "offloaded: a number in [0, 1], got 2.0",
            ("--offload-activations", "nan"): "a number in [0, 1], got nan",
            ("--lr", "inf"): "--lr must be a finite number > 0, got inf",
            ("--clip-grad-norm", "inf"): "--clip-grad-norm must be a finite number > 0, got inf (leave it out to not clip)",
            ("--json-log", os.path.join(self.tmp, "missing", "log.jsonl")): (
                f"the folder {os.path.join(self.tmp, 'missing')} does not exist; create it or log elsewhere"
            ),
            ("--checkpoint-dir", TALK): f"--checkpoint-dir {TALK} is a file, not a folder",
            # Managed memory is not a placement the policy has: the flag is gone.
            ("--memory", "managed", "--platform", "discrete"): "unrecognized arguments: --memory managed",
        }
        for flags, message in cases.items():
            self.assertRefused(parse_args, list(flags), message)

    @unittest.skipIf(importlib.util.find_spec("transformers") is None, "needs transformers")
    def test_hf_config_that_gives_no_config(self) -> None:
        # Each is a usage error (exit 2) raised before the process group is built.
        import huggingface_hub.constants

        missing = os.path.join(self.tmp, "config.json")
        cases = {
            "{'model_type': 'llama'}": "error: --hf-config: the JSON config is not valid JSON: Expecting property name "
            "enclosed in double quotes: line 1 column 2 (char 1); pass a JSON object such as",
            "[1, 2]": "error: --hf-config: the JSON config holds a JSON list, not an object with 'model_type'",
            '{"model_type": "lama"}': "has no model_type 'lama' (Unrecognized model identifier: lama); use one it "
            "knows, such as 'llama' or 'qwen2'",
            '{"num_hidden_layers": 2}': "needs 'model_type' (e.g. 'llama'); got keys ['num_hidden_layers']",
            missing: f"error: --hf-config: {missing}: no such file; pass the path of an existing config.json",
            "nobody/no-such-model": "error: --hf-config: 'nobody/no-such-model' is no name of HF_CONFIGS (llama-tiny, "
            "qwen2-tiny), no JSON object and no config.json path, and no config could be fetched for it as a hub id: ",
        }
        with open(os.path.join(self.tmp, "list.json"), "w", encoding="utf-8") as config_file:
            config_file.write("[1]")
        cases[config_file.name] = f"error: --hf-config: {config_file.name} holds a JSON list"
        # Offline, a hub id fails at once; this machine may have no network at all.
        with mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True):
            for config, message in cases.items():
                self.assertRefused(parse_args, ["--hf-config", config], message)

    def test_latest_names_a_deleted_step(self) -> None:
        os.makedirs(os.path.join(self.tmp, "step_00000002"))
        with open(os.path.join(self.tmp, "latest"), "w", encoding="utf-8") as latest:
            latest.write("step_00000004")
        self.assertRefused(
            parse_args, ["--checkpoint-dir", self.tmp, "--resume"],
            f"{os.path.join(self.tmp, 'latest')} names the checkpoint 'step_00000004', but "
            f"{os.path.join(self.tmp, 'step_00000004')} does not exist (deleted?); the step folders there: "
            "step_00000002. Write the name of an existing one into latest, or delete latest to train from scratch",
        )

    def test_resume_without_checkpoint_warns(self) -> None:
        message = f"--resume: no checkpoint found in {self.tmp} (no 'latest' file there): training starts from scratch"
        with self.assertWarnsRegex(UserWarning, re.escape(message)):
            args = parse_args(["--checkpoint-dir", self.tmp, "--resume"])
        self.assertIsNone(args.resume_from)
        # Only rank 0 says it, once for the job.
        os.environ["RANK"] = "1"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parse_args(["--checkpoint-dir", self.tmp, "--resume"])
        self.assertEqual(caught, [])


class TestResume(CLITestCase):
    def test_checkpoint_of_another_model(self) -> None:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout):
            self.assertEqual(train_main(["--model", "tiny", *QUICK, "--checkpoint-dir", self.tmp]), 0)
            # A usage error (exit 2, one line), like every other refused argument.
            with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as raised:
                train_main(["--model", "small", *QUICK, "--steps", "2", "--checkpoint-dir", self.tmp, "--resume"])
        self.assertEqual(raised.exception.code, 2)
        message = stderr.getvalue()
        self.assertIn("error: --resume: the checkpoint", message)
        checkpoint = os.path.join(self.tmp, "step_00000001")
        self.assertIn(
            f"the checkpoint {checkpoint} was written by another model: 21 shape(s) differ: tok_embeddings.weight "
            "(checkpoint [256, 64], this model [8192, 512]), blocks.0.attention_norm.weight", message,
        )
        self.assertIn("and 17 more; 36 of this model's entries are missing from it: blocks.2.", message)
        self.assertIn(
            "Resume with the --model or --hf-config that wrote it, or give this model another --checkpoint-dir "
            "(or drop --resume) to train it from scratch", message,
        )
        # Entries only the checkpoint has are named too; a folder without DCP metadata is no checkpoint.
        with self.assertRaisesRegex(
            ValueError, re.escape("1 of this model's entries are missing from it: head.bias; 21 of its entries are "
                                  "not in this model: tok_embeddings.weight, ")
        ):
            _check_checkpoint_fits(checkpoint, {"model": {"head.bias": torch.zeros(256)}})
        with self.assertRaisesRegex(FileNotFoundError, re.escape(f"{self.tmp} holds no checkpoint (no DCP metadata)")):
            _check_checkpoint_fits(self.tmp, {})


if __name__ == "__main__":
    run_tests()
