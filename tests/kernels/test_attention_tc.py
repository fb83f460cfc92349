"""Tensor-core (3xTF32) MLA attention (numba_kernels.mla_attention_tc) against the float64 reference.

sim: toy sizes (every simulated thread is Python), outputs NaN-poisoned and checked fully written, rel 1e-5.
gpu: Kimi K2 dims (h 64, c 512, r 64) at P = 1024 / 8192 cached rows, a subset of query rows checked on the
host against float64; max error < 2e-6 of max |o|; agreement with the SIMT kernel (mla_attention).
"""
import numpy as np
import pytest
from numba import cuda

from kdspec.engine.bench.attention import random_tree_visibility
from kdspec.engine.golden.layers import mla_attention_latent
from kdspec.numba_kernels.attention import tc as tc_module
from kdspec.numba_kernels.attention.common import pack_visibility
from kdspec.numba_kernels.attention.dispatch import mla_attention
from kdspec.numba_kernels.attention.tc import AttentionTcConfig, default_value_splits, mla_attention_tc
from kdspec.numba_kernels.mma import GemmConfig

from kernel_checks import assert_close as check_close

RTOL = 1e-5


def make_inputs(rng, tokens, heads, latent, rope, prefix, spare_rows=2):
    q_lat = rng.standard_normal((tokens, heads, latent)).astype(np.float32)
    q_pe = rng.standard_normal((tokens, heads, rope)).astype(np.float32)
    cache = rng.standard_normal((prefix + tokens + spare_rows, latent + rope)).astype(np.float32)
    return q_lat, q_pe, cache


def reference(q_lat, q_pe, cache, prefix, visible, scale):
    tokens, latent = q_lat.shape[0], q_lat.shape[2]
    keys = cache[:prefix + tokens]
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)
    return mla_attention_latent(q_lat, q_pe, keys[:, :latent], keys[:, latent:], full, scale)


def assert_close(actual, expected, rtol=RTOL):
    check_close(actual, expected, rtol)


@pytest.mark.sim
@pytest.mark.parametrize("tokens, heads, latent, rope, prefix, causal, splits, fused", [
    (5, 2, 16, 4, 0, True, 1, True),      # prefill: causal mask, no prefix
    (6, 3, 13, 3, 11, False, 1, True),    # random tree over a prefix, ragged dims
    (5, 2, 16, 4, 23, False, 2, True),    # split value GEMM, partials summed
    (6, 3, 13, 3, 11, False, 1, False),   # unfused: softmax as its own pass
    (4, 2, 8, 2, 37, False, 1, True),     # 3 score column blocks: softmax partials merged across blocks
])
def test_attention_tc_matches_float64(tokens, heads, latent, rope, prefix, causal, splits, fused):
    rng = np.random.default_rng(tokens * 100 + prefix)
    q_lat, q_pe, cache = make_inputs(rng, tokens, heads, latent, rope, prefix)
    visible = np.tri(tokens, dtype=bool) if causal else random_tree_visibility(tokens, rng)
    out = cuda.to_device(np.full((tokens, heads, latent), np.nan, np.float32))
    result = mla_attention_tc(q_lat, q_pe, cache, prefix, pack_visibility(visible), 0.3, out=out,
                              config=AttentionTcConfig(value_splits=splits, fused_softmax=fused)).copy_to_host()
    assert_close(result, reference(q_lat, q_pe, cache, prefix, visible, 0.3))


@pytest.mark.sim
def test_attention_tc_strided_queries_are_copied_first():
    """q_lat / q_pe as strided device views (not C-contiguous) take the q_cat copy instead of the score GEMM's
    in-place two-part A operand; same result."""
    rng = np.random.default_rng(19)
    tokens, heads, latent, rope, prefix = 5, 2, 16, 4, 9
    q_lat, q_pe, cache = make_inputs(rng, tokens, heads, latent, rope, prefix)
    wide = np.concatenate([q_lat, q_pe, np.full((tokens, heads, 3), np.nan, np.float32)], axis=2)
    d_wide = cuda.to_device(wide)
    visible = random_tree_visibility(tokens, rng)
    out = cuda.to_device(np.full((tokens, heads, latent), np.nan, np.float32))
    mla_attention_tc(d_wide[:, :, :latent], d_wide[:, :, latent:latent + rope], cache, prefix,
                     pack_visibility(visible), 0.3, out=out)
    assert_close(out.copy_to_host(), reference(q_lat, q_pe, cache, prefix, visible, 0.3))


@pytest.mark.sim
@pytest.mark.parametrize("fused", [True, False])
def test_attention_tc_masked_keys_get_no_weight_and_blind_query_is_nan(fused):
    """A huge value in a key row a query must not see would dominate its output if the mask leaked; a
    query that sees nothing (device mask, P = 0) gets NaN, like the SIMT kernel."""
    rng = np.random.default_rng(7)
    q_lat, q_pe, cache = make_inputs(rng, 3, 2, 8, 2, 0)
    visible = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0]], bool)
    cache[1, :8] = 1e4  # row 1 is invisible to query 0
    out = mla_attention_tc(q_lat, q_pe, cache, 0, cuda.to_device(pack_visibility(visible)), 0.5,
                           config=AttentionTcConfig(fused_softmax=fused)).copy_to_host()
    want = reference(q_lat[:2], q_pe[:2], cache, 0, visible[:2, :2], 0.5)
    assert_close(out[:2], want)
    assert np.isnan(out[2]).all()


@pytest.mark.sim
def test_attention_tc_workspace_reused_across_shapes_and_kept_per_stream():
    """The scratch buffer is reused and grown between calls: a small call after a large one, the large one
    again (its carved views cached), and a split call each match float64; another stream gets its own buffer,
    and release_workspace frees them all."""
    tc_module.release_workspace()
    rng = np.random.default_rng(11)
    calls = [(4, 2, 8, 2, 9, 1), (2, 1, 8, 2, 3, 1), (4, 2, 8, 2, 9, 1), (5, 2, 8, 2, 17, 2)]
    for tokens, heads, latent, rope, prefix, splits in calls:
        q_lat, q_pe, cache = make_inputs(rng, tokens, heads, latent, rope, prefix)
        visible = random_tree_visibility(tokens, rng)
        out = cuda.to_device(np.full((tokens, heads, latent), np.nan, np.float32))
        mla_attention_tc(q_lat, q_pe, cache, prefix, pack_visibility(visible), 0.4, out=out,
                         config=AttentionTcConfig(value_splits=splits))
        assert_close(out.copy_to_host(), reference(q_lat, q_pe, cache, prefix, visible, 0.4))
    assert list(tc_module._WORKSPACE) == [0]  # the default stream's buffer only
    stream = cuda.stream()
    q_lat, q_pe, cache = make_inputs(rng, 3, 2, 8, 2, 5)
    visible = random_tree_visibility(3, rng)
    result = mla_attention_tc(q_lat, q_pe, cache, 5, pack_visibility(visible), 0.4, stream=stream)
    stream.synchronize()
    assert_close(result.copy_to_host(), reference(q_lat, q_pe, cache, 5, visible, 0.4))
    assert len(tc_module._WORKSPACE) == 2
    tc_module.release_workspace()
    assert not tc_module._WORKSPACE


@pytest.mark.sim
def test_attention_tc_rejects_bad_inputs():
    rng = np.random.default_rng(8)
    q_lat, q_pe, cache = make_inputs(rng, 2, 1, 8, 2, 0)
    mask = pack_visibility(np.tri(2, dtype=bool))
    with pytest.raises(ValueError, match="sees no key"):
        mla_attention_tc(q_lat, q_pe, cache, 0, pack_visibility(np.eye(2, dtype=bool) & False), 0.5)
    with pytest.raises(ValueError, match="do not fit"):
        mla_attention_tc(q_lat, q_pe, cache, 3, mask, 0.5)
    with pytest.raises(ValueError, match="cache_layer"):
        mla_attention_tc(q_lat, q_pe, cache[:, :9], 0, mask, 0.5)
    with pytest.raises(ValueError, match="C-contiguous"):
        mla_attention_tc(q_lat, q_pe, cuda.to_device(np.zeros((4, 20), np.float32))[:, :10], 0, mask, 0.5)
    with pytest.raises(ValueError, match="q_pe"):
        mla_attention_tc(q_lat, q_pe[:, :, :1].astype(np.float64), cache[:, :9].copy(), 0, mask, 0.5)


def test_default_value_splits_fill_the_sms():
    config = GemmConfig()
    assert default_value_splits(64 * 64, 8256, 512, config, sms=132) == 1   # 128 tiles: one wave already
    assert default_value_splits(16 * 64, 8208, 512, config, sms=132) == 4   # 32 tiles -> 128 blocks
    assert default_value_splits(16 * 64, 300, 512, config, sms=132) == 1    # too few keys to split


# ----------------------------------------------------------------------------------------- GPU, K2 dims
@pytest.mark.gpu
@pytest.mark.parametrize("prefix, tokens", [(1024, 16), (1024, 256), (8192, 64)])
def test_attention_tc_k2_dims(prefix, tokens):
    heads, latent, rope = 64, 512, 64
    rng = np.random.default_rng(prefix + tokens)
    q_lat, q_pe, cache = make_inputs(rng, tokens, heads, latent, rope, prefix)
    visible = random_tree_visibility(tokens, rng)
    mask = cuda.to_device(pack_visibility(visible))
    scale = 192 ** -0.5
    q_lat_d, q_pe_d, cache_d = cuda.to_device(q_lat), cuda.to_device(q_pe), cuda.to_device(cache)
    out = cuda.to_device(np.full((tokens, heads, latent), np.nan, np.float32))
    result = mla_attention_tc(q_lat_d, q_pe_d, cache_d, prefix, mask, scale, out=out).copy_to_host()
    assert np.isfinite(result).all(), "output not fully written"
    check = np.unique(np.r_[0, tokens - 1, rng.choice(tokens, min(tokens, 6), replace=False)])
    # float64 for the checked queries only (the engine reference would take minutes at 8k x 64 x 64)
    keys = cache[:prefix + tokens].astype(np.float64)
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)[check]
    scores = (np.einsum("shc,tc->sht", q_lat[check].astype(np.float64), keys[:, :latent])
              + np.einsum("shr,tr->sht", q_pe[check].astype(np.float64), keys[:, latent:])) * scale
    scores = np.where(full[:, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    want = np.einsum("sht,tc->shc", weights / weights.sum(axis=2, keepdims=True), keys[:, :latent])
    error = np.abs(result[check] - want).max() / np.abs(want).max()
    assert error < 2e-6, error  # fresh fragments per k group: the mma's truncating sums stay short
    simt = mla_attention(q_lat_d, q_pe_d, cache_d, prefix, mask, scale).copy_to_host()
    assert np.abs(simt - result).max() < 2e-5 * np.abs(simt).max()
