"""numba_kernels.launch.Launcher: the same kernel launched through it and through Numba writes the same
output, for every parameter kind it packs (1-D, 2-D and flattened arrays, int32 / uint32 / int64, float32)."""
import numpy as np
import pytest
from numba import cuda, types

from kdspec.numba_kernels.launch import Launcher, launch, launcher_for
from kdspec.numba_kernels.runtime import ON_SIMULATOR

SIGNATURE = types.void(types.Array(types.float32, 1, "C"), types.Array(types.int32, 2, "C"), types.int32,
                       types.uint32, types.int64, types.float32, types.Array(types.float32, 1, "C"))


def _kernel_body(src, table, i32, u32, i64, f32, out):
    e = cuda.grid(1)
    if e < out.shape[0]:
        out[e] = (src[e % src.shape[0]] * f32 + table[e % table.shape[0], e % table.shape[1]] + i32 + u32 % 1000
                  + i64 // (1 << 40) + table.strides[0] // 4)


def _arguments(rng):
    src = cuda.to_device(rng.standard_normal(37).astype(np.float32))
    table = cuda.to_device(rng.integers(-50, 50, (5, 7)).astype(np.int32))
    out = cuda.to_device(np.full(300, np.nan, np.float32))
    return src, table, np.int32(-3), np.uint32(4_000_000_123), np.int64(3 << 40), np.float32(0.5), out


@pytest.mark.sim
def test_launcher_matches_numba_launch():
    kernel = cuda.jit(_kernel_body) if ON_SIMULATOR else cuda.jit(SIGNATURE)(_kernel_body)
    rng = np.random.default_rng(0)
    src, table, *scalars, out = _arguments(rng)
    kernel[3, 128](src, table, *scalars, out)
    want = out.copy_to_host()
    assert np.isfinite(want).all()
    out.copy_to_device(np.full(300, np.nan, np.float32))
    stream = cuda.stream()
    launcher_for(kernel)((3,), (128,), stream, 0, src, table, *scalars, out)
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), want)


@pytest.mark.gpu
def test_launcher_takes_a_flat_view_of_any_c_contiguous_array_and_rejects_bad_arguments():
    kernel = cuda.jit(SIGNATURE)(_kernel_body)
    launcher = Launcher(kernel)
    rng = np.random.default_rng(1)
    src, table, *scalars, out = _arguments(rng)
    src2d = cuda.to_device(src.copy_to_host()[:36].reshape(4, 9))
    kernel[3, 128](src2d.reshape(36), table, *scalars, out)
    cuda.synchronize()
    want = out.copy_to_host()
    out.copy_to_device(np.full(300, np.nan, np.float32))
    launcher(3, 128, 0, 0, src2d, table, *scalars, out)  # [4, 9] for the 1-D parameter: its flat data
    cuda.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), want)
    with pytest.raises(TypeError, match="float32 array expected"):
        launcher(3, 128, 0, 0, table, table, *scalars, out)
    with pytest.raises(TypeError, match="does not fit"):
        launcher(3, 128, 0, 0, src, table, np.int64(1 << 40), *scalars[1:], out)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        launcher(3, 128, 0, 0, src, table, out)
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed"):
        launcher(3, 4096, 0, 0, src, table, *scalars, out)  # more threads a block than any GPU has


def _scaled_rows_body(src, factor, flag, out):
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = src[i, j] * factor + (1.0 if flag else 0.0)


@pytest.mark.sim
def test_launch_specializes_per_layout_and_matches_numba():
    """launch() of a lazily compiled kernel: contiguous and strided (layout "A") views of one array, a float64
    and a bool scalar; each launch writes what Numba's own launch writes."""
    kernel = cuda.jit(_scaled_rows_body)
    rng = np.random.default_rng(2)
    host = rng.standard_normal((20, 34)).astype(np.float32)
    whole = cuda.to_device(host)
    for src, flag in ((whole[:, :17], True), (whole[:, ::2], False), (whole[:10], True)):  # A, A, C
        shape = tuple(src.shape)
        out = cuda.to_device(np.full(shape, np.nan, np.float32))
        kernel[(2, 3), (16, 16)](src, 1.5, flag, out)
        cuda.synchronize()
        want = out.copy_to_host()
        np.testing.assert_allclose(want, src.copy_to_host() * 1.5 + flag, rtol=1e-6, atol=1e-6)  # (FMA on a GPU)
        out.copy_to_device(np.full(shape, np.nan, np.float32))
        launch(kernel, (2, 3), (16, 16), 0, src, 1.5, flag, out)
        cuda.synchronize()
        np.testing.assert_array_equal(out.copy_to_host(), want)
