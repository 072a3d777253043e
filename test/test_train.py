"""End-to-end tests of ``python -m torch_fsdp_offload.train``: one process, torchrun, two "nodes"
with an HSDP mesh, checkpoint/resume, and recovery from a killed rank under ``--max-restarts``.

Every run is a subprocess (as users run it), on the CPU with gloo, with the tiny model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed.fake_pg import FakeStore

from torch_fsdp_offload.models import build_model
from torch_fsdp_offload.policy import CoherentOffload, fully_shard_with_policy
from torch_fsdp_offload import materialize_sharded
from torch_fsdp_offload.optimizer.groups import offloaded_group
from torch_fsdp_offload.train import parse_args

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 180
# Small enough for 2 cores, long enough that the loss visibly moves.
BASE_ARGS = ["--model", "tiny", "--seq-len", "32", "--lr", "1e-2", "--device", "cpu", "--batch-size", "4"]
# Multi-process runs also accumulate gradients over two micro-batches.
MULTI_ARGS = BASE_ARGS + ["--grad-accum", "2"]
STEPS = 6


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCH_FSDP_OFFLOAD_PLATFORM"):
        env.pop(name, None)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _torchrun(nproc: int, *, port: int, extra: list[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", *extra,
        "-m", "torch_fsdp_offload.train",
    ]


def _run(command: list[str]) -> str:
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n{output[-6000:]}")
    return output


def _records(log_path: str) -> list[dict]:
    with open(log_path, encoding="utf-8") as log:
        return [json.loads(line) for line in log]


def _losses(log_path: str) -> dict[int, float]:
    # The last record of each step wins: a restarted job logs the steps after its checkpoint again.
    return {record["step"]: record["loss"] for record in _records(log_path)}


@functools.cache
def _two_rank_reference(tmp: str) -> dict[int, float]:
    """Losses of an uninterrupted 2-rank FSDP run (shared by the tests that compare to it)."""
    log = os.path.join(tmp, "reference.jsonl")
    _run(_torchrun(2, port=_free_port()) + MULTI_ARGS + ["--steps", str(STEPS), "--json-log", log])
    return _losses(log)


class TestTrain(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._tmp = tempfile.TemporaryDirectory()
        cls.tmp = cls._tmp.name

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()
        super().tearDownClass()

    def _path(self, name: str) -> str:
        return os.path.join(self.tmp, f"{self.id().rsplit('.', 1)[-1]}-{name}")

    def test_single_process_offload_checkpoint_resume(self) -> None:
        # Forcing DISCRETE on the CPU runs the real copy path (copies counted, device = cpu), which
        # must train exactly like FSDP2 without offload; gradient clipping is active (the first
        # norm is about 0.8) and must be applied identically by OffloadOptimizer. Host steps: a
        # streamed step's copies run on under the next step, on either side of its byte count.
        plain = [sys.executable, "-m", "torch_fsdp_offload.train", *BASE_ARGS, "--clip-grad-norm", "0.5"]
        train = plain + ["--offload-optimizer", "host"]
        off, on, checkpoints = self._path("off.jsonl"), self._path("on.jsonl"), self._path("ckpt")
        _run(plain + ["--offload", "off", "--steps", "4", "--json-log", off])
        output = _run(train + ["--platform", "discrete", "--steps", "4", "--json-log", on,
                               "--checkpoint-dir", checkpoints, "--checkpoint-every", "2"])
        # The platform report first, then one line per step: loss, throughput, memory, bytes each way.
        self.assertIn("platform: discrete", output)
        self.assertLess(output.index("platform: discrete"), output.index("step 1/4 | loss "))
        self.assertIn("strategy: ", output)
        self.assertRegex(output, r"step 4/4 \| loss [0-9.]+ \| [0-9,]+ tok/s \| host rss [0-9.]+ GiB \| "
                         r"h2d [0-9.]+ MiB \| d2h [0-9.]+ MiB")
        off_records, on_records = _records(off), _records(on)
        self.assertEqual([r["step"] for r in on_records], [1, 2, 3, 4])
        self.assertEqual([r["loss"] for r in on_records], [r["loss"] for r in off_records])
        self.assertGreater(off_records[0]["grad_norm"], 0.5)
        self.assertLess(on_records[-1]["loss"], on_records[0]["loss"])
        self.assertTrue(all(r["h2d_bytes"] > 0 and r["d2h_bytes"] > 0 for r in on_records))
        self.assertTrue(all(r["h2d_bytes"] == 0 and r["d2h_bytes"] == 0 for r in off_records))

        # As if the job had stopped after step 2: point "latest" back there and resume. Model,
        # optimizer state, step and data position come back, so steps 3 and 4 repeat exactly.
        with open(os.path.join(checkpoints, "latest"), "w") as latest:
            latest.write("step_00000002")
        resumed = self._path("resumed.jsonl")
        output = _run(train + ["--platform", "discrete", "--steps", "4", "--json-log", resumed,
                               "--checkpoint-dir", checkpoints, "--resume"])
        self.assertIn("step 2, data position 8", output)
        def trace(records):
            return [(r["step"], r["loss"], r["data_position"]) for r in records]

        self.assertEqual(trace(_records(resumed)), trace(on_records[2:]))
        # Bytes are counted per step, and the first group's copy-in that step() prefetches falls
        # in this step or the next as its host step ends: compare totals, within that copy.
        def total(records, key="h2d_bytes"):
            return sum(r[key] for r in records)

        self.assertAlmostEqual(total(_records(resumed)), total(on_records[2:]), delta=0.2 * total(on_records[2:]))

        # --module-fraction 0.5 gives the policy to every second block only, the others and the
        # root stay resident: the same training bit for bit, with fewer bytes copied (the resident
        # groups' shards are materialised on the device).
        half = self._path("half.jsonl")
        _run(train + ["--platform", "discrete", "--module-fraction", "0.5", "--steps", "4", "--json-log", half])
        half_records = _records(half)
        self.assertEqual([r["loss"] for r in half_records], [r["loss"] for r in on_records])
        for key in ("h2d_bytes", "d2h_bytes"):
            self.assertTrue(0 < total(half_records, key) < total(on_records, key), msg=key)

        # --cast-on device with bf16 compute: the same training as the host's cast, the fp32
        # master copied in (the bytes of the fp32 run above, more than the bf16 mirror's).
        runs = {}
        for cast_on in ("host", "device"):
            runs[cast_on] = self._path(f"cast_{cast_on}.jsonl")
            _run(train + ["--platform", "discrete", "--mixed-precision", "bf16", "--offload-optimizer", "host",
                          "--cast-on", cast_on, "--steps", "2", "--json-log", runs[cast_on]])
        host_records, device_records = _records(runs["host"]), _records(runs["device"])
        self.assertEqual([r["loss"] for r in device_records], [r["loss"] for r in host_records])
        fp32 = total(on_records[:2])
        self.assertAlmostEqual(total(device_records), fp32, delta=0.2 * fp32)
        self.assertLess(total(host_records), 0.65 * total(device_records))

    def test_materialize_sharded_places_groups(self) -> None:
        # materialize_sharded's own example: "meta" stands in for the GPU. Offloaded groups must
        # land on the host, resident groups and the (unsharded) buffers on the compute device.
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        try:
            model = build_model("tiny", device="meta")
            fully_shard_with_policy(model, model.blocks, CoherentOffload(platform="discrete"), spread_fraction=0.5)
            materialize_sharded(model, "meta")
            groups = {
                name: module._get_fsdp_state()._fsdp_param_group
                for name, module in (("root", model), ("blocks.0", model.blocks[0]), ("blocks.1", model.blocks[1]))
            }
            offloaded = {name for name, group in groups.items() if group._offload is not None and group._offload.offloaded}
            # As the example says: block 1 offloaded, block 0 and the root on the compute device.
            self.assertEqual(offloaded, {"blocks.1"})
            for name, param in model.named_parameters():
                prefix = next((group for group in ("blocks.0", "blocks.1") if name.startswith(group)), "root")
                self.assertEqual(param.to_local().device.type, "cpu" if prefix in offloaded else "meta", msg=name)
            self.assertTrue(all(buffer.is_meta for buffer in model.buffers()))
            # The materialised parameters are new objects: still known as their groups', so an
            # optimizer built now steps the offloaded ones off the training loop's thread.
            for name, param in model.named_parameters():
                prefix = next((group for group in ("blocks.0", "blocks.1") if name.startswith(group)), "root")
                self.assertIs(offloaded_group(param), groups[prefix]._offload if prefix in offloaded else None, msg=name)
            with self.assertRaisesRegex(ValueError, "call fully_shard"):
                materialize_sharded(build_model("tiny", device="meta"), "meta")
        finally:
            dist.destroy_process_group()

    def test_profile_writes_one_steps_trace_and_timeline(self) -> None:
        profile = self._path("profile")
        output = _run([sys.executable, "-m", "torch_fsdp_offload.train", *BASE_ARGS, "--platform", "discrete",
                       "--steps", "3", "--profile", profile])
        self.assertIn(f"profile of step 2: {os.path.join(profile, 'trace_rank0.json')}", output)
        with open(os.path.join(profile, "trace_rank0.json"), encoding="utf-8") as handle:
            names = [event.get("name", "") for event in json.load(handle)["traceEvents"]]
        # The step's copies are in it: each block's parameters in and its gradients out.
        self.assertGreaterEqual(names.count("torch_fsdp_offload::grads_d2h:blocks.0"), 1)
        self.assertGreaterEqual(names.count("torch_fsdp_offload::params_h2d:blocks.0"), 1)
        # The timeline is drawn where the step has something to draw (on the CPU, at most the host
        # optimizer steps that ran inside the profiled step).
        png = os.path.join(profile, "timeline.png")
        self.assertTrue(os.path.isfile(png) if f"{png} (" in output else "(no timeline: " in output, output[-2000:])
        with self.assertRaises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            parse_args(["--profile", os.path.join(profile, "trace_rank0.json")])

    @unittest.skipIf(not torch.cuda.is_available(), "needs a GPU")
    def test_gpu_partial_module_offload(self) -> None:
        # Resident groups (--module-fraction < 1) must be materialised on the GPU, offloaded ones on
        # the host; before, every shard went to the host and FSDP computed with CPU parameters.
        log = self._path("gpu_half.jsonl")
        _run([sys.executable, "-m", "torch_fsdp_offload.train", "--device", "cuda", "--platform", "discrete", "--module-fraction", "0.5",
              "--steps", "3", "--json-log", log])
        records = _records(log)
        self.assertEqual([r["step"] for r in records], [1, 2, 3])
        self.assertTrue(all(math.isfinite(r["loss"]) for r in records))
        self.assertTrue(all(r["h2d_bytes"] > 0 for r in records))

    def test_torchrun_two_ranks(self) -> None:
        losses = _two_rank_reference(self.tmp)
        self.assertEqual(sorted(losses), list(range(1, STEPS + 1)))
        self.assertLess(losses[STEPS], losses[1])

    def test_two_nodes_hsdp(self) -> None:
        # Two agents on one machine acting as two nodes; --hsdp 2 replicates across the "nodes".
        port, log = _free_port(), self._path("hsdp.jsonl")
        agents = [
            subprocess.Popen(
                _torchrun(1, port=port, extra=["--nnodes", "2", "--node-rank", str(node)])
                + MULTI_ARGS + ["--steps", str(STEPS), "--hsdp", "2", "--json-log", log],
                cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for node in (0, 1)
        ]
        outputs = [agent.communicate(timeout=TIMEOUT_S)[0] for agent in agents]
        for agent, output in zip(agents, outputs):
            self.assertEqual(agent.returncode, 0, output[-6000:])
        self.assertIn("mesh (2, 1)", "".join(outputs))
        # Same samples per rank and the same global batch as the 2-rank FSDP run: the same training.
        self.assertEqual(_losses(log), _two_rank_reference(self.tmp), atol=1e-5, rtol=1e-5)

    def test_killed_rank_restarts_from_checkpoint(self) -> None:
        # Rank 1 dies at the start of step index 3 on the first attempt; the last checkpoint is at
        # step 2. torchrun restarts both ranks, which resume from it and finish the job.
        checkpoints, log = self._path("ckpt"), self._path("restart.jsonl")
        output = _run(
            _torchrun(2, port=_free_port(), extra=["--max-restarts", "1"]) + MULTI_ARGS
            + ["--steps", str(STEPS), "--checkpoint-dir", checkpoints, "--checkpoint-every", "2",
               "--resume", "--fail-at-step", "3", "--json-log", log]
        )
        self.assertIn("--fail-at-step 3: exiting", output)
        self.assertIn("resumed from", output)
        steps_logged = [record["step"] for record in _records(log)]
        # First attempt: 1, 2, 3; second attempt resumes after step 2: 3, 4, 5, 6.
        self.assertEqual(steps_logged, [1, 2, 3, 3, 4, 5, 6])
        self.assertEqual(_losses(log), _two_rank_reference(self.tmp), atol=0, rtol=0)

    @unittest.skipIf(importlib.util.find_spec("transformers") is None, "needs transformers")
    def test_hf_causal_lm(self) -> None:
        log = self._path("hf.jsonl")
        output = _run([sys.executable, "-m", "torch_fsdp_offload.train", "--model", "llama-tiny",
                       "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--platform", "discrete",
                       "--steps", "3", "--json-log", log])
        self.assertIn("model: llama-tiny", output)
        records = _records(log)
        self.assertEqual(len(records), 3)
        self.assertTrue(all(r["h2d_bytes"] > 0 for r in records))

    def test_model_names_a_transformers_config(self) -> None:
        # A transformers config name given to --model builds that causal LM (no download).
        args = parse_args(["--model", "llama-tiny"])
        self.assertEqual((args.model, args.hf_config), (None, "llama-tiny"))
        self.assertEqual(parse_args([]).model, "tiny")

    def test_bad_arguments(self) -> None:
        cases = {
            ("--hsdp", "3"): "--hsdp 3 must divide the world size",
            ("--resume",): "--resume need --checkpoint-dir",
            ("--offload", "off", "--prefetch-depth", "2"): "--prefetch-depth configure offloading",
            ("--offload", "off", "--cast-on", "device"): "--cast-on configure offloading",
            ("--cast-on", "gpu"): "invalid choice: 'gpu'",
            ("--seq-len", "4096"): "exceeds tiny's max_seq_len 256",
            ("--offload-optimizer", "gpu"): "'gpu' is not host, stream, auto or a fraction",
            ("--module-fraction", "2"): "--module-fraction is the fraction of the blocks offloaded",
            ("--model", "llama-tiny", "--hf-config", "qwen2-tiny"): "--model and --hf-config are alternatives",
            ("--model", "gpt5"): "invalid choice: 'gpt5'",
        }
        for flags, message in cases.items():
            stderr = io.StringIO()
            with self.assertRaises(SystemExit) as raised, contextlib.redirect_stderr(stderr):
                parse_args(list(flags))
            self.assertEqual(raised.exception.code, 2)
            self.assertIn(message, stderr.getvalue())

if __name__ == "__main__":
    run_tests()
