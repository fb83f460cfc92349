"""3xTF32 primitives and GEMM (numba_kernels.mma) against independent float64 / integer references.

Under the simulator the mma is the module's Python model of the fragment maps; on a GPU the same tests run
the inline PTX (cvt.rna.tf32.f32, mma.sync m16n8k8), so both are held to the PTX ISA's fragment layout.
"""
import numpy as np
import pytest
from numba import cuda, float32

from kdspec.numba_kernels.mma import (
    DEFAULT_GEMM,
    SIM_SCRATCH_PER_WARP,
    GemmConfig,
    ScaledFusion,
    ScoresFusion,
    gemm_tf32x3,
    mma_tf32,
    tf32_round,
    tf32_split,
)

pytestmark = pytest.mark.sim


def rna_tf32(x):
    """float64 reference: x rounded to 11 significant bits (tf32), nearest with ties away from zero."""
    x = np.asarray(x, dtype=np.float64)
    mantissa, exponent = np.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    scaled = np.abs(mantissa) * 2.0 ** 11
    return np.sign(x) * np.floor(scaled + 0.5) * 2.0 ** (exponent - 11)


@cuda.jit
def split_kernel(x, rounded, hi, lo):
    i = cuda.grid(1)
    if i < x.shape[0]:
        rounded[i] = tf32_round(x[i])
        hi[i], lo[i] = tf32_split(x[i])


def test_tf32_round_and_split_match_float64_rounding():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200) * 10.0 ** rng.integers(-20, 20, 200)).astype(np.float32)
    one = np.float32(1.0).view(np.uint32)
    ties = (np.array([one + 0x1000, one + 0x3000, one + 0x1FFF, one + 0x0FFF], np.uint32)).view(np.float32)
    x = np.concatenate([x, ties, -ties, np.float32([0.0, 1.0, -3.5, 65504.0])])
    out = [cuda.to_device(np.full(x.size, 0xDEADBEEF, np.uint32)) for _ in range(3)]
    split_kernel[1, 256](x, *out)
    rounded, hi, lo = (o.copy_to_host() for o in out)
    expected = rna_tf32(x)
    np.testing.assert_array_equal(rounded.view(np.float32).astype(np.float64), expected)
    assert (rounded & 0x1FFF == 0).all()  # a tf32 keeps 10 mantissa bits
    np.testing.assert_array_equal(hi, rounded)
    assert (lo & 0x1FFF == 0).all()  # lo is an exact tf32 too: nothing left for the mma to drop or read
    lo_value = lo.view(np.float32).astype(np.float64)
    np.testing.assert_array_equal(lo_value, rna_tf32(x.astype(np.float64) - expected))
    error = np.abs(x.astype(np.float64) - expected - lo_value)
    assert (error <= 2.0 ** -22 * np.abs(x)).all()
    assert rounded[200] == one + 0x2000 and rounded[204] == (one + 0x2000) | 0x80000000  # ties: away from zero


@cuda.jit
def one_warp_mma_kernel(a, b, c, d, passes):
    """d [16, 8] = a [16, 8] @ b [8, 8] + c from the documented fragment maps; passes 1: tf32(a) tf32(b);
    3: the 3xTF32 sum. One warp."""
    scratch = cuda.shared.array(SIM_SCRATCH_PER_WARP, float32)
    lane = cuda.threadIdx.x
    g, tq = lane >> 2, lane & 3
    a_hi0, a_lo0 = tf32_split(a[g, tq])
    a_hi1, a_lo1 = tf32_split(a[g + 8, tq])
    a_hi2, a_lo2 = tf32_split(a[g, tq + 4])
    a_hi3, a_lo3 = tf32_split(a[g + 8, tq + 4])
    b_hi0, b_lo0 = tf32_split(b[tq, g])
    b_hi1, b_lo1 = tf32_split(b[tq + 4, g])
    d0, d1, d2, d3 = c[g, 2 * tq], c[g, 2 * tq + 1], c[g + 8, 2 * tq], c[g + 8, 2 * tq + 1]
    if passes == 3:
        d0, d1, d2, d3 = mma_tf32(a_lo0, a_lo1, a_lo2, a_lo3, b_hi0, b_hi1, d0, d1, d2, d3, scratch)
        d0, d1, d2, d3 = mma_tf32(a_hi0, a_hi1, a_hi2, a_hi3, b_lo0, b_lo1, d0, d1, d2, d3, scratch)
    d0, d1, d2, d3 = mma_tf32(a_hi0, a_hi1, a_hi2, a_hi3, b_hi0, b_hi1, d0, d1, d2, d3, scratch)
    d[g, 2 * tq], d[g, 2 * tq + 1], d[g + 8, 2 * tq], d[g + 8, 2 * tq + 1] = d0, d1, d2, d3


def run_one_warp(a, b, c, passes):
    d = cuda.to_device(np.full((16, 8), np.nan, np.float32))
    one_warp_mma_kernel[1, 32](a, b, c, d, passes)
    out = d.copy_to_host()
    assert np.isfinite(out).all(), "d not fully written"
    return out


def test_one_mma_is_exact_on_small_integers():
    """Integer operands: every product and sum is exact, so any fragment-map error shows as a mismatch."""
    rng = np.random.default_rng(1)
    a = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    b = rng.integers(-8, 9, (8, 8)).astype(np.float32)
    c = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    want = a.astype(np.int64) @ b.astype(np.int64) + c.astype(np.int64)
    np.testing.assert_array_equal(run_one_warp(a, b, c, 1), want)
    np.testing.assert_array_equal(run_one_warp(a, b, c, 3), want)  # lo parts are 0: same result


def test_three_tf32_passes_reach_fp32_accuracy_one_does_not():
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal(shape).astype(np.float32) for shape in ((16, 8), (8, 8), (16, 8)))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    scale = np.abs(want).max()
    error3 = np.abs(run_one_warp(a, b, c, 3) - want).max() / scale
    error1 = np.abs(run_one_warp(a, b, c, 1) - want).max() / scale
    assert error3 < 2e-6, error3
    assert error1 > 1e-4, error1  # plain tf32 would fail the engine's tolerance


# ------------------------------------------------------------------------------------------------ GEMM
@pytest.mark.parametrize("b_k_contiguous, splits", [(True, 1), (False, 1), (False, 3)])
def test_gemm_matches_float64_with_ragged_sizes(b_k_contiguous, splits):
    rng = np.random.default_rng(3 + splits)
    m, n, k, ldc = 19, 21, 29, 24  # none a multiple of the tile; ldc > n: columns n.. must stay untouched
    config = DEFAULT_GEMM
    a = rng.standard_normal((m, k + 3)).astype(np.float32)       # lda > k: columns k.. never read
    a[:, k:] = np.nan
    b_shape = (n + 2, k + 1) if b_k_contiguous else (k + 2, n + 5)
    b = rng.standard_normal(b_shape).astype(np.float32)
    b[(slice(n, None) if b_k_contiguous else slice(k, None)), :] = np.nan  # rows past n (NT) / k (NN)
    b[:, (k if b_k_contiguous else n):] = np.nan
    c = cuda.to_device(np.full((splits, m, ldc), np.nan, np.float32))
    gemm_tf32x3(cuda.to_device(a), cuda.to_device(b), c, n, k, alpha=0.75, b_k_contiguous=b_k_contiguous,
                splits=splits, config=config)
    out = c.copy_to_host()
    assert np.isfinite(out[:, :, :n]).all(), "c not fully written (or NaN padding read)"
    assert np.isnan(out[:, :, n:]).all(), "columns past n written"
    b_matrix = b[:n, :k].T if b_k_contiguous else b[:k, :n]
    want = 0.75 * a[:, :k].astype(np.float64) @ b_matrix.astype(np.float64)
    np.testing.assert_allclose(out[:, :, :n].astype(np.float64).sum(axis=0), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    if splits > 1:  # split z holds the k chunks of its own range only
        k_per_split = -(-(-(-k // splits)) // config.block_k) * config.block_k
        k_first = min(k_per_split, k)  # a GPU-sized block_k may give split 0 all of K
        first = 0.75 * a[:, :k_first].astype(np.float64) @ b_matrix[:k_first].astype(np.float64)
        np.testing.assert_allclose(out[0, :, :n], first, rtol=1e-5, atol=1e-5 * np.abs(first).max())


@pytest.mark.parametrize("b_k_contiguous", [True, False])
def test_gemm_warp_tiles_of_several_fragments(b_k_contiguous):
    """2 x 2 fragments a warp (the default simulator config has one): each fragment's shared offsets and
    its accumulator slot, for both B layouts."""
    rng = np.random.default_rng(11)
    m, n, k = 45, 50, 27
    config = GemmConfig(block_m=32, block_n=32, block_k=8, warps_m=1, warps_n=2, sum_every=1)
    assert config.fragments == (2, 2)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if b_k_contiguous else (k, n)).astype(np.float32)
    c = cuda.to_device(np.full((1, m, n), np.nan, np.float32))
    gemm_tf32x3(cuda.to_device(a), cuda.to_device(b), c, n, k, b_k_contiguous=b_k_contiguous, config=config)
    want = a.astype(np.float64) @ (b.T if b_k_contiguous else b).astype(np.float64)
    np.testing.assert_allclose(c.copy_to_host()[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("b_k_contiguous, stages", [(True, 2), (False, 3)])
def test_gemm_16_byte_copies_zero_fill_partial_chunks(b_k_contiguous, stages):
    """lda, ldb multiples of 4 take the 16-byte cp.async path (the ragged test above takes the 4-byte one):
    k = 30 ends inside a 16-byte chunk, n = 22 too (NN); the bytes past them are zero-filled, not read."""
    rng = np.random.default_rng(21 + stages)
    m, n, k = 21, 22, 30
    config = DEFAULT_GEMM._replace(stages=stages)
    a = rng.standard_normal((m, 32)).astype(np.float32)
    a[:, k:] = np.nan
    b = rng.standard_normal((n, 32) if b_k_contiguous else (k + 2, 24)).astype(np.float32)
    if b_k_contiguous:
        b[:, k:] = np.nan
    else:
        b[k:], b[:, n:] = np.nan, np.nan
    c = cuda.to_device(np.full((1, m, n), np.nan, np.float32))
    gemm_tf32x3(cuda.to_device(a), cuda.to_device(b), c, n, k, b_k_contiguous=b_k_contiguous, config=config)
    want = a[:, :k].astype(np.float64) @ (b[:n, :k].T if b_k_contiguous else b[:k, :n]).astype(np.float64)
    got = c.copy_to_host()[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("split_at, rest", [(16, 12), (13, 6)])
def test_gemm_two_part_a_operand(split_at, rest):
    """A = [a | a2] column-wise (attention's q_lat | q_pe read in place): 16-byte copies when both row lengths
    are multiples of 4 (16 + 12), 4-byte ones that switch source mid-chunk otherwise (13 + 6)."""
    rng = np.random.default_rng(split_at)
    m, n = 19, 21
    a, a2 = rng.standard_normal((m, split_at)).astype(np.float32), rng.standard_normal((m, rest)).astype(np.float32)
    b = rng.standard_normal((n, split_at + rest)).astype(np.float32)
    c = cuda.to_device(np.full((1, m, n), np.nan, np.float32))
    gemm_tf32x3(cuda.to_device(a), cuda.to_device(b), c, n, split_at + rest, a2=cuda.to_device(a2))
    want = np.concatenate([a, a2], axis=1).astype(np.float64) @ b.T.astype(np.float64)
    got = c.copy_to_host()[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def scaled_gemm_vs_float64(m, n, k, width, seed):
    """(got, float64 want) of a "scaled" GEMM on random data: row i's chunk sums times scale[i, k0 // width]."""
    rng = np.random.default_rng(seed)
    a = rng.random((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    scale = rng.random((m, -(-k // width))).astype(np.float32)
    c = cuda.to_device(np.full((1, m, n), np.nan, np.float32))
    gemm_tf32x3(cuda.to_device(a), cuda.to_device(b), c, n, k, b_k_contiguous=False,
                fusion=ScaledFusion(cuda.to_device(scale), width))
    want = (a.astype(np.float64) * np.repeat(scale.astype(np.float64), width, axis=1)[:, :k]) @ b.astype(np.float64)
    return c.copy_to_host()[0], want


def test_gemm_scaled_fusion_scales_each_chunk_per_row():
    """"scaled": each staged chunk's partial sum of row i is multiplied by scale[i, k0 // scale_width]
    before it is added (attention's per-part softmax factors), here against float64 on a ragged k."""
    got, want = scaled_gemm_vs_float64(18, 20, 45, 2 * DEFAULT_GEMM.block_k, seed=13)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_gemm_sums_k_groups_in_fresh_fragments_against_truncation():
    """The tensor core's fp32 accumulation truncates (the simulator models it): accumulating all of K in the
    mma registers lets a bias toward zero grow with K (the H200 showed 5e-5 at K = 8192); fresh fragments
    per group of k-steps, added with round-to-nearest FADD, bound it. All-positive data: the bias adds up."""
    rng = np.random.default_rng(9)
    m, n, k = 16, 16, 256
    a, b = rng.random((m, k)).astype(np.float32), rng.random((k, n)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    errors = {}
    for sum_every in (0, 1):
        c = cuda.to_device(np.full((1, m, n), np.nan, np.float32))
        gemm_tf32x3(cuda.to_device(a), cuda.to_device(b), c, n, k, b_k_contiguous=False,
                    config=DEFAULT_GEMM._replace(sum_every=sum_every))
        got = c.copy_to_host()[0]
        assert np.isfinite(got).all()
        errors[sum_every] = np.abs(got - want).max() / np.abs(want).max()
    assert errors[1] < 1e-6, errors
    assert errors[0] > 1.5e-6, errors  # the model shows the problem the fresh fragments fix


def test_gemm_rejects_bad_shapes_and_configs():
    a = cuda.to_device(np.zeros((4, 8), np.float32))
    b = cuda.to_device(np.zeros((5, 8), np.float32))
    with pytest.raises(ValueError, match="c must be"):
        gemm_tf32x3(a, b, cuda.to_device(np.zeros((1, 4, 3), np.float32)), 5, 8)
    with pytest.raises(ValueError, match="too small"):
        gemm_tf32x3(a, b, cuda.to_device(np.zeros((1, 4, 6), np.float32)), 6, 8)
    with pytest.raises(ValueError, match="float32"):
        gemm_tf32x3(cuda.to_device(np.zeros((4, 8))), b, cuda.to_device(np.zeros((1, 4, 5), np.float32)), 5, 8)
    with pytest.raises(ValueError, match="block_m"):
        GemmConfig(block_m=24, block_n=16, block_k=8, warps_m=1, warps_n=2).check()
    with pytest.raises(ValueError, match="sum_every"):
        GemmConfig(block_k=24, sum_every=2).check()
    with pytest.raises(ValueError, match="stages >= 2"):
        GemmConfig(stages=1).check()
    with pytest.raises(ValueError, match="227 KB"):
        GemmConfig(block_m=256, block_n=256, block_k=32, warps_m=2, warps_n=4, stages=4).check()
    with pytest.raises(ValueError, match="'scaled' needs scale"):
        gemm_tf32x3(a, b, cuda.to_device(np.zeros((1, 4, 5), np.float32)), 5, 8,
                    fusion=ScaledFusion(cuda.to_device(np.zeros((4, 1), np.float32)), DEFAULT_GEMM.block_k + 1))
    with pytest.raises(ValueError, match="'scores' needs splits 1"):
        gemm_tf32x3(a, b, cuda.to_device(np.zeros((2, 4, 5), np.float32)), 5, 8, splits=2,
                    fusion=ScoresFusion(cuda.to_device(np.zeros((4, 1, 2), np.float32)), None, 1, 0, None))
    with pytest.raises(ValueError, match="fusion must be"):
        gemm_tf32x3(a, b, cuda.to_device(np.zeros((1, 4, 5), np.float32)), 5, 8, fusion="scaled")


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_gemm_default_tiles_on_gpu(offset):
    """The H200 tile shape (128 x 128, 8 warps) on sizes with partial tiles, both layouts, split-K, 3 stages;
    offset 1: a starts 4 bytes past a 16-byte boundary, so the 4-byte cp.async path runs."""
    rng = np.random.default_rng(5 + offset)
    m, n, k = 300, 260, 1000
    a = rng.standard_normal((m, k)).astype(np.float32)
    d_a = cuda.to_device(np.concatenate([np.zeros(offset, np.float32), a.ravel()]))[offset:].reshape(m, k)
    for b_k_contiguous, splits, stages in ((True, 1, 2), (False, 3, 2), (False, 1, 3)):
        b = rng.standard_normal((n, k) if b_k_contiguous else (k, n)).astype(np.float32)
        c = cuda.to_device(np.full((splits, m, n), np.nan, np.float32))
        gemm_tf32x3(d_a, cuda.to_device(b), c, n, k, b_k_contiguous=b_k_contiguous, splits=splits,
                    config=DEFAULT_GEMM._replace(stages=stages))
        got = c.copy_to_host().astype(np.float64).sum(axis=0)
        want = a.astype(np.float64) @ (b.T if b_k_contiguous else b).astype(np.float64)
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() < 2e-6 * np.abs(want).max()


@pytest.mark.gpu
def test_gemm_scaled_fusion_on_gpu():
    got, want = scaled_gemm_vs_float64(300, 512, 1000, 32, seed=17)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 2e-6 * np.abs(want).max()
