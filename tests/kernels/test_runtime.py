"""numba_kernels.runtime.device_function: under the simulator a helper that never names ``cuda`` is the plain
Python function (no per-call globals swap), one that does stays a device function; inside a kernel both
give the same values as on the GPU, where every helper is a Numba device function."""
import numpy as np
import pytest
from numba import cuda

from kdspec.numba_kernels import runtime
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function

cuda_module = cuda  # an alias the simulator would swap too


def _scaled(x, k):
    return x * k + 1.0


def _lane():
    return cuda.threadIdx.x


def _lane_through_alias():
    return cuda_module.threadIdx.x


plain_scaled = device_function(forceinline=True)(_scaled)
lane = device_function()(_lane)
lane_through_alias = device_function()(_lane_through_alias)


@cuda.jit
def _probe(values, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = plain_scaled(values[i], 2.0) + lane() * 100.0 + lane_through_alias() * 10000.0


def test_which_helpers_stay_plain():
    assert runtime._names_cuda(_lane) and runtime._names_cuda(_lane_through_alias)
    assert not runtime._names_cuda(_scaled)
    if ON_SIMULATOR:
        assert plain_scaled is _scaled
    else:
        assert plain_scaled is not _scaled  # a Numba device function
    assert lane is not _lane and lane_through_alias is not _lane_through_alias


@pytest.mark.sim
def test_plain_and_device_helpers_inside_a_kernel():
    values = np.random.default_rng(7).standard_normal(12).astype(np.float32)
    out = cuda.to_device(np.full(12, np.nan, np.float32))
    _probe[3, 4](cuda.to_device(values), out)
    lanes = np.arange(12) % 4
    expected = values * 2.0 + 1.0 + lanes * 100.0 + lanes * 10000.0
    np.testing.assert_allclose(out.copy_to_host(), expected.astype(np.float32), rtol=1e-6)
