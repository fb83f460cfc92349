"""Test setup: without a visible NVIDIA GPU, Numba kernels run under the CUDA simulator.

The simulator must be chosen before numba.cuda is first imported, hence at conftest import time.
Markers: `sim` tests run everywhere (simulated in CI, for real on a GPU); `gpu` tests need a real GPU.
"""
import os
import shutil

import pytest


def _gpu_visible() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _gpu_visible():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

ON_SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture(scope="session")
def device_backend() -> str:
    """The `sim` tests' device backend: the simulator here, the GPU itself where there is one."""
    return "sim" if ON_SIMULATOR else "cuda"


def pytest_collection_modifyitems(config, items):
    if not ON_SIMULATOR:
        return
    skip_gpu = pytest.mark.skip(reason="needs a real CUDA GPU (running under the CUDA simulator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
