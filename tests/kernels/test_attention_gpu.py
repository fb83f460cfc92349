"""Norm, RoPE, embedding, KV-write and MLA attention kernels at Kimi K2 sizes on a real GPU.

References are float64 numpy (the attention one a plain matmul/softmax written here, so it is fast at
8k context); rel tol 1e-4 (fp32 with long sums). Outputs are NaN-poisoned before each run.
"""
import numpy as np
import pytest
from numba import cuda

from kdspec.engine.bench.attention import random_tree_visibility  # the bench's masks
from kdspec.engine.golden import layers
from kdspec.engine.golden import model as ref
from kdspec.engine.model.config import PRESETS
from kdspec.numba_kernels.attention.common import pack_visibility
from kdspec.numba_kernels.attention.dispatch import mla_attention
from kdspec.numba_kernels.attention.simt import TileConfig
from kdspec.numba_kernels.embedding import embed_tokens
from kdspec.numba_kernels.kv_write import write_kv_rows
from kdspec.numba_kernels import rmsnorm
from kdspec.numba_kernels.rmsnorm import add_rms_norm, rms_norm
from kdspec.numba_kernels.rope import apply_rope

from kernel_checks import assert_close as check_close
from kernel_checks import normal, poisoned, rope_table

pytestmark = pytest.mark.gpu
RTOL = 1e-4


K2 = PRESETS["k2-mini"]  # Kimi K2 attention dims: h 64, c 512, r 64, nope 128, YaRN factor 32


def assert_close(actual, expected, rtol=RTOL):
    check_close(actual, expected, rtol)


@pytest.fixture(scope="module")
def k2_table():
    return rope_table(K2)


@pytest.mark.parametrize("width", [K2.kv_lora_rank, K2.hidden_size, 9000])  # 9000: past the registers' 8192
def test_norms_at_hidden_size(width):
    rng = np.random.default_rng(width)
    x, residual, w = normal(rng, 64, width), normal(rng, 64, width), normal(rng, width)
    out = rms_norm(x, w, K2.rms_norm_eps, out=poisoned(x.shape)).copy_to_host()
    assert_close(out, ref.rms_norm(x, w, K2.rms_norm_eps))
    alone = rms_norm(x[5:6], w, K2.rms_norm_eps, out=poisoned((1, width))).copy_to_host()
    assert np.array_equal(alone.view(np.uint32), out[5:6].view(np.uint32))  # a row's bits: any row count
    residual_dev = cuda.to_device(residual)
    out = add_rms_norm(x, residual_dev, w, K2.rms_norm_eps, out=poisoned(x.shape)).copy_to_host()
    np.testing.assert_array_equal(residual_dev.copy_to_host(), residual + x)
    assert_close(out, ref.rms_norm(residual.astype(np.float64) + x, w, K2.rms_norm_eps))
    element = poisoned(x.shape)  # the element-by-element kernel (rows not 16-byte aligned) gives the same bits
    rmsnorm.norm_kernels(False)[0][x.shape[0], rmsnorm.NORM_THREADS](
        cuda.to_device(x), cuda.to_device(w[None]), np.float32(K2.rms_norm_eps), element)
    vector = rms_norm(x, w, K2.rms_norm_eps, out=poisoned(x.shape)).copy_to_host()
    assert np.array_equal(element.copy_to_host().view(np.uint32), vector.view(np.uint32))


def test_rope_on_q_view_and_k_pe(k2_table):
    rng = np.random.default_rng(1)
    tokens, heads, nope, rope = 64, K2.num_attention_heads, K2.qk_nope_head_dim, K2.qk_rope_head_dim
    q = normal(rng, tokens, heads, nope + rope)
    positions = rng.integers(0, K2.max_position_embeddings, tokens).astype(np.int64)
    q_dev = cuda.to_device(q)
    apply_rope(q_dev[:, :, nope:], k2_table, positions)
    result = q_dev.copy_to_host()
    np.testing.assert_array_equal(result[:, :, :nope], q[:, :, :nope])
    cos, sin = ref.rope_cos_sin(K2, positions)
    assert_close(result[:, :, nope:], layers.apply_rope(q[:, :, nope:], cos, sin))
    k_pe = normal(rng, tokens, rope)
    assert_close(apply_rope(cuda.to_device(k_pe), k2_table, positions).copy_to_host(),
                 layers.apply_rope(k_pe, cos, sin))


def test_embedding_bf16_rows():
    rng = np.random.default_rng(2)
    values = normal(rng, 1000, K2.hidden_size)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    truncated = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    ids = rng.integers(0, 1000, 300).astype(np.int64)
    out = embed_tokens(bits, ids, out=poisoned((300, K2.hidden_size))).copy_to_host()
    np.testing.assert_array_equal(out.view(np.uint32), truncated[ids].view(np.uint32))


def test_write_kv_rows_k2(k2_table):
    rng = np.random.default_rng(3)
    latent, rope, tokens, start = K2.kv_lora_rank, K2.qk_rope_head_dim, 64, 1000
    kv_a = normal(rng, tokens, latent + rope, scale=3.0)
    weight = normal(rng, latent)
    positions = np.arange(start, start + tokens, dtype=np.int64)
    cache = poisoned((2, 2048, latent + rope))
    write_kv_rows(cache, 1, start, kv_a, weight, K2.rms_norm_eps, k2_table, positions)
    result = cache.copy_to_host()
    rows = result[1, start:start + tokens]
    assert_close(rows[:, :latent], ref.rms_norm(kv_a[:, :latent], weight, K2.rms_norm_eps))
    assert_close(rows[:, latent:], layers.apply_rope(kv_a[:, latent:], *ref.rope_cos_sin(K2, positions)))
    assert np.isnan(result[0]).all() and np.isnan(result[1, :start]).all() and np.isnan(result[1, start + tokens:]).all()


# ------------------------------------------------------------------------------------- MLA attention
def latent_attention_float64(q_lat, q_pe, keys, visible, scale):
    """o [s, h, c] float64: softmax over visible key rows of [q_lat | q_pe] . keys * scale, times keys[:, :c]."""
    tokens, heads, latent = q_lat.shape
    queries = np.concatenate([q_lat, q_pe], axis=-1).astype(np.float64).reshape(tokens * heads, -1)
    keys = keys.astype(np.float64)
    scores = (queries @ keys.T * scale).reshape(tokens, heads, -1)
    scores[~np.broadcast_to(visible[:, None, :], scores.shape)] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights.reshape(tokens * heads, -1) @ keys[:, :latent]).reshape(tokens, heads, latent)


def attention_case(seed, tokens, prefix, num_splits=None, **config):
    rng = np.random.default_rng(seed)
    heads, latent, rope = K2.num_attention_heads, K2.kv_lora_rank, K2.qk_rope_head_dim
    q_lat, q_pe = normal(rng, tokens, heads, latent), normal(rng, tokens, heads, rope)
    cache = normal(rng, prefix + tokens + 16, latent + rope)
    cache[prefix + tokens:] = np.nan  # rows past the in-flight ones must never be read
    visible = random_tree_visibility(tokens, rng)
    out = mla_attention(q_lat, q_pe, cache, prefix, pack_visibility(visible), K2.softmax_scale,
                        out=poisoned((tokens, heads, latent)), num_splits=num_splits, **config).copy_to_host()
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)
    return out, latent_attention_float64(q_lat, q_pe, cache[:prefix + tokens], full, K2.softmax_scale)


@pytest.mark.parametrize("prefix", [1, 1000, 8192])
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_attention_k2_tree_masks(tokens, prefix):
    out, expected = attention_case(tokens * 10007 + prefix, tokens, prefix)
    assert_close(out, expected)


@pytest.mark.parametrize("splits", [1, 7, 64])
def test_attention_k2_split_counts(splits):
    out, expected = attention_case(splits, 64, 8192, num_splits=splits)
    assert_close(out, expected)


# the other tile shapes .prof sweeps (the default is TileConfig()): wide key tiles, two blocks per SM
@pytest.mark.parametrize("config", [
    TileConfig(fastmath=True),
    TileConfig(rows=64, keys=128, d_chunk=16, v_chunk=4, s_rows=8, s_keys=4),
    TileConfig(rows=32, keys=128, d_chunk=32, v_chunk=8, s_rows=4, s_keys=4, blocks_per_sm=2),
    TileConfig(rows=32, keys=64, d_chunk=32, v_chunk=8, s_rows=2, s_keys=4, blocks_per_sm=2),
    TileConfig(rows=32, keys=64, d_chunk=16, v_chunk=4, s_rows=2, s_keys=4, o_cols=8),
    TileConfig(rows=64, keys=128, d_chunk=16, v_chunk=4, s_rows=4, s_keys=4, o_cols=8, threads=512),
], ids=["fastmath", "64x128", "32x128", "32x64", "32x64-o8x8", "64x128-t512"])
@pytest.mark.parametrize("tokens, prefix", [(1, 8192), (64, 1000)])
def test_attention_k2_tile_configs(config, tokens, prefix):
    out, expected = attention_case(tokens * 31 + prefix, tokens, prefix, config=config)
    assert_close(out, expected)
