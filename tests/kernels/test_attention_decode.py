"""The few-token MLA attention kernel (numba_kernels/mla_attention_decode.py) against the float64 reference.

Simulator tests (toy dims, toy configs) compare with engine.reference_layers.mla_attention_latent; outputs
are NaN-poisoned and must be fully written; cache rows past the in-flight ones are NaN (never read).
GPU tests (Kimi K2 dims) compare sampled rows with a float64 matmul / softmax written here and all rows with
numba_kernels.mla_attention.mla_attention.
"""
import numpy as np
import pytest
from numba import cuda

from kdspec.engine.bench.attention import random_tree_visibility  # the bench's masks
from kdspec.engine.golden.layers import mla_attention_latent
from kdspec.numba_kernels.attention.common import MAX_LATENT, pack_visibility
from kdspec.numba_kernels.attention.decode import (
    DEFAULT_CONFIG,
    MAX_TOKENS,
    DecodeConfig,
    decode_num_splits,
    mla_attention_decode,
)
from kdspec.numba_kernels.attention.dispatch import mla_attention
from kdspec.numba_kernels.runtime import ON_SIMULATOR

from kernel_checks import assert_close as check_close
from kernel_checks import normal, poisoned

RTOL = 1e-5


def assert_close(actual, expected, rtol=RTOL):
    check_close(actual, expected, rtol)


def run_decode(rng, tokens, heads, latent, rope, prefix, visible, num_splits=None, config=None, spare_rows=3):
    """(kernel output, float64 reference) for random inputs; rows past the in-flight ones are NaN."""
    q_lat, q_pe = normal(rng, tokens, heads, latent), normal(rng, tokens, heads, rope)
    cache = normal(rng, prefix + tokens + spare_rows, latent + rope)
    cache[prefix + tokens:] = np.nan
    scale = 0.37
    out = mla_attention_decode(q_lat, q_pe, cache, prefix, pack_visibility(visible), scale,
                               out=poisoned((tokens, heads, latent)), num_splits=num_splits,
                               config=config).copy_to_host()
    keys = cache[:prefix + tokens]
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)
    return out, mla_attention_latent(q_lat, q_pe, keys[:, :latent], keys[:, latent:], full, scale)


# ------------------------------------------------------------------------------- simulator (toy sizes)
# other shapes than the default: 4 warps of 8 lanes for one head (softmax warps without a head), value
# loads 3 rows at a time in 16-key chunks (the last step past the chunk), 4 heads x 2 keys = 8 partials
OTHER_CONFIGS = [DecodeConfig(heads=1, keys=8, key_group=2, value_unroll=2, threads=32, lanes=8, min_keys_per_split=8),
                 DecodeConfig(heads=4, keys=16, key_group=2, value_unroll=3, threads=16, lanes=8, min_keys_per_split=8)]
sim_only = pytest.mark.skipif(not ON_SIMULATOR, reason="toy configs sized for the simulator's lanes and MAX_LATENT")


@pytest.mark.sim
@pytest.mark.parametrize("tokens, heads, latent, rope, prefix, splits", [
    (1, 2, 16, 4, 0, None),     # AR decode of the first token: one key
    (1, 3, 16, 4, 29, None),    # AR decode, odd heads (a half-empty row group), default splits
    (1, 3, 16, 4, 29, 3),       # ... three splits (the last one partial)
    (5, 2, 16, 4, 0, 1),        # tree without prefix
    (5, 3, 13, 2, 21, 2),       # c + r not a multiple of the lanes, partial chunks and splits
    (4, 1, 32, 8, 11, 2),       # the largest c, r the simulator build allows
    (32, 1, 8, 2, 3, 2),        # MAX_TOKENS: every bit of the mask word
])
def test_decode_matches_reference(tokens, heads, latent, rope, prefix, splits):
    rng = np.random.default_rng(tokens * 100 + prefix + heads)
    visible = random_tree_visibility(tokens, rng)
    out, expected = run_decode(rng, tokens, heads, latent, rope, prefix, visible, num_splits=splits)
    assert_close(out, expected)


@pytest.mark.sim
def test_decode_splits_that_see_nothing_are_merged_away():
    # P = 0, causal, 2 splits of one chunk: queries 0..7 see nothing in the second split
    rng = np.random.default_rng(5)
    visible = np.tri(12, dtype=bool)
    out, expected = run_decode(rng, 12, 1, 8, 2, 0, visible, num_splits=2, config=DEFAULT_CONFIG)
    assert_close(out, expected)


@pytest.mark.sim
@sim_only
@pytest.mark.parametrize("config", OTHER_CONFIGS, ids=["one-head-4-warps", "4-heads-unroll-3"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_other_configs(config, splits):
    rng = np.random.default_rng(7 + splits)
    visible = random_tree_visibility(5, rng)
    out, expected = run_decode(rng, 5, 3, 15, 4, 27, visible, num_splits=splits, config=config)
    assert_close(out, expected)


@pytest.mark.sim
def test_decode_query_seeing_nothing_is_nan():
    # a device mask skips the host check: query 1 (P = 0, empty row) must come out NaN, query 0 finite
    rng = np.random.default_rng(6)
    q_lat, q_pe, cache = normal(rng, 2, 1, 8), normal(rng, 2, 1, 2), normal(rng, 2, 10)
    mask = cuda.to_device(np.array([[1], [0]], np.uint32))
    out = mla_attention_decode(q_lat, q_pe, cache, 0, mask, 1.0, out=poisoned((2, 1, 8))).copy_to_host()
    assert np.isnan(out[1]).all()
    np.testing.assert_allclose(out[0, 0], cache[0, :8])  # one visible key: its value row exactly (p = 1)


@pytest.mark.sim
def test_decode_num_splits_rule():
    config = DecodeConfig(heads=8, keys=64, min_keys_per_split=64, blocks_per_sm=2, lanes=32, threads=256,
                          key_group=4)
    assert decode_num_splits(8, 101, config, sms=132) == 1            # AR at P ~ 100: one split
    assert decode_num_splits(8, 1025, config, sms=132) == 16          # 1025 // 64
    assert decode_num_splits(8, 8193, config, sms=132) == 33          # 264 slots / 8 row groups: one full wave
    assert decode_num_splits(64, 8200, config, sms=132) == 4          # s = 8: 256 of 264 slots (5: 320, 2 waves)
    assert decode_num_splits(8, 8193, config._replace(blocks_per_sm=1), sms=132) == 16  # 128 of 132 (17: 2 waves)
    assert decode_num_splits(400, 8200, config, sms=132) == 1


@pytest.mark.sim
def test_decode_config_rules():
    with pytest.raises(ValueError, match="power of two"):
        DecodeConfig(heads=3, key_group=4).check()
    with pytest.raises(ValueError, match="keys %"):
        DecodeConfig(heads=8, keys=48, key_group=4, threads=256, lanes=32).check()
    with pytest.raises(ValueError, match="48 KB"):
        DecodeConfig(heads=32, keys=1024, key_group=1, threads=1024, lanes=32).check()


@pytest.mark.sim
def test_decode_rejects_bad_inputs():
    q_lat, q_pe = np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 2), np.float32)
    cache = np.zeros((5, 10), np.float32)
    causal = pack_visibility(np.tri(2, dtype=bool))
    with pytest.raises(ValueError, match="sees no key row"):
        mla_attention_decode(q_lat, q_pe, cache, 0, np.array([[1], [0]], np.uint32), 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        mla_attention_decode(q_lat, q_pe, cache, 4, causal, 1.0)
    with pytest.raises(ValueError, match="cache_layer must be float32"):
        mla_attention_decode(q_lat, q_pe, np.zeros((5, 11), np.float32), 0, causal, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        mla_attention_decode(q_lat, q_pe, cuda.to_device(np.zeros((5, 20), np.float32))[:, :10], 0, causal, 1.0)
    with pytest.raises(ValueError, match="visibility must be uint32"):
        mla_attention_decode(q_lat, q_pe, cache, 0, np.tri(2, dtype=bool), 1.0)
    with pytest.raises(ValueError, match="q_pe must be"):
        mla_attention_decode(q_lat, q_pe[:1], cache, 0, causal, 1.0)
    with pytest.raises(ValueError, match="MAX_LATENT"):
        mla_attention_decode(np.zeros((1, 1, MAX_LATENT + 1), np.float32), q_pe[:1],
                             np.zeros((2, MAX_LATENT + 3), np.float32), 0, pack_visibility(np.ones((1, 1), bool)), 1.0)
    with pytest.raises(ValueError, match=f"at most {MAX_TOKENS}"):
        many = MAX_TOKENS + 1
        mla_attention_decode(np.zeros((many, 1, 8), np.float32), np.zeros((many, 1, 2), np.float32),
                             np.zeros((many, 10), np.float32), 0, pack_visibility(np.tri(many, dtype=bool)), 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        mla_attention_decode(q_lat, q_pe, cache, 0, causal, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="out must be float32"):
        mla_attention_decode(q_lat, q_pe, cache, 0, causal, 1.0, out=poisoned((2, 1, 7)))


# ------------------------------------------------------------------------------------ GPU (K2 dims)
HEADS, LATENT, ROPE = 64, 512, 64
SCALE = (128 + ROPE) ** -0.5
GPU_RTOL = 1e-5


def reference_rows(q_lat, q_pe, cache, prefix, visible, rows):
    """o float64 [len(rows), c] for flat (token * h + head) rows: a plain float64 matmul / softmax."""
    keys = cache[:prefix + visible.shape[0]].astype(np.float64)
    result = []
    for row in rows:
        token, head = divmod(int(row), q_lat.shape[1])
        query = np.concatenate([q_lat[token, head], q_pe[token, head]]).astype(np.float64)
        scores = keys @ query * SCALE
        scores[~np.concatenate([np.ones(prefix, bool), visible[token]])] = -np.inf
        weights = np.exp(scores - scores.max())
        result.append(weights @ keys[:, :q_lat.shape[2]] / weights.sum())
    return np.array(result)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("prefix", [64, 1024, 8192])
def test_decode_k2_dims_vs_float64_and_gemm_kernel(prefix, tokens):
    rng = np.random.default_rng(prefix + tokens)
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe = normal(rng, tokens, HEADS, LATENT), normal(rng, tokens, HEADS, ROPE)
    cache = normal(rng, prefix + tokens + 16, LATENT + ROPE)
    cache[prefix + tokens:] = np.nan
    mask = pack_visibility(visible)
    got = mla_attention_decode(q_lat, q_pe, cache, prefix, mask, SCALE,
                               out=poisoned((tokens, HEADS, LATENT))).copy_to_host()
    assert np.isfinite(got).all(), "output not fully written"
    flat = got.reshape(tokens * HEADS, LATENT)
    rows = np.unique(np.concatenate([rng.choice(tokens * HEADS, 24, replace=False), [0, tokens * HEADS - 1]]))
    assert_close(flat[rows], reference_rows(q_lat, q_pe, cache, prefix, visible, rows), rtol=GPU_RTOL)
    gemm = mla_attention(q_lat, q_pe, cache, prefix, mask, SCALE).copy_to_host()
    assert_close(got, gemm, rtol=GPU_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 40])
def test_decode_k2_dims_forced_splits(splits):
    rng = np.random.default_rng(splits)
    tokens, prefix = 8, 700
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe = normal(rng, tokens, HEADS, LATENT), normal(rng, tokens, HEADS, ROPE)
    cache = normal(rng, prefix + tokens, LATENT + ROPE)
    got = mla_attention_decode(q_lat, q_pe, cache, prefix, pack_visibility(visible), SCALE, num_splits=splits,
                               out=poisoned((tokens, HEADS, LATENT))).copy_to_host()
    rows = np.arange(0, tokens * HEADS, 37)
    assert_close(got.reshape(-1, LATENT)[rows], reference_rows(q_lat, q_pe, cache, prefix, visible, rows),
                 rtol=GPU_RTOL)
