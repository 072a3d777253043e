import inspect
import os
import re
import sys

import pytest

# Tests import their shared scaffolding (common_offload) by module name, in pytest and in the
# processes MultiProcessTestCase starts.
sys.path.insert(0, os.path.dirname(__file__))

# The forced-copy CPU tests run their copies asynchronously: one worker thread per direction,
# each copy up to 2 ms late, destinations poisoned until they land (see
# torch_fsdp_offload/cpu_copy_stream.py). Set before anything is imported, so that the ranks
# inherit it. A value already in the environment wins ("off": synchronous copies).
os.environ.setdefault("TORCH_FSDP_OFFLOAD_CPU_ASYNC_COPIES", "2:0")

from torch_fsdp_offload.cpu_copy_stream import misuses_detected  # noqa: E402


@pytest.fixture(autouse=True)
def _no_copy_misuse():
    """Fail a test in which an asynchronous CPU copy found its source changed or its destination
    written while in flight, even where nobody waited on that copy."""
    before = len(misuses_detected)
    yield
    found = misuses_detected[before:]
    del misuses_detected[before:]
    assert not found, f"asynchronous CPU copies found misuses: {found}"


_GPU_IN_ID = re.compile(r"cuda|gpu", re.IGNORECASE)
_GPU_IN_CODE = re.compile(r"cuda")


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-suite",
        action="store_true",
        help="run only the tests that touch a GPU: those whose id names CUDA or a GPU, or whose code names CUDA",
    )


def pytest_collection_modifyitems(config, items):
    # The GPU machine's time is scarce: there, the tests a CPU machine already ran the same way
    # (CI runs every test) are left out.
    if not config.getoption("--gpu-suite"):
        return

    def touches_gpu(item) -> bool:
        if _GPU_IN_ID.search(item.nodeid):
            return True
        try:
            return bool(_GPU_IN_CODE.search(inspect.getsource(item.function)))
        except (OSError, TypeError):
            return False

    deselected = [item for item in items if not touches_gpu(item)]
    items[:] = [item for item in items if touches_gpu(item)]
    config.hook.pytest_deselected(items=deselected)
