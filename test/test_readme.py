"""README's usage example runs as written (on this machine's device: the CPU in CI)."""

import os
import re
import socket
import subprocess
import sys

import torch

from torch.testing._internal.common_utils import run_tests, TestCase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def _usage_example() -> str:
    return _python_blocks(_readme().split("## Usage", 1)[1])[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TestReadme(TestCase):
    def test_usage_example_runs_as_written(self):
        # Only the rendezvous port changes, so that parallel runs of the suite do not collide.
        code = _usage_example().replace("tcp://127.0.0.1:29512", f"tcp://127.0.0.1:{_free_port()}")
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        losses = re.findall(r"step (\d): loss ([0-9.]+)", done.stdout)
        self.assertEqual([int(step) for step, _ in losses], list(range(5)))
        # The plan's reason comes first: without an accelerator, that there is nothing to offload.
        reason = done.stdout.splitlines()[0]
        self.assertRegex(reason, "no accelerator" if not torch.cuda.is_available() else r"(offload|do not)")
        # Where the plan offloads nothing (here: no accelerator) the same script stays quiet.
        self.assertNotIn("OffloadOptimizer:", done.stderr)

    def test_every_python_block_compiles(self):
        blocks = _python_blocks(_readme())
        self.assertGreaterEqual(len(blocks), 2)
        for block in blocks:
            compile(block, "README.md", "exec")


if __name__ == "__main__":
    run_tests()
