"""Norm, RoPE, embedding, KV-write and MLA attention kernels against the float64 reference (toy sizes).

Every kernel output is poisoned with NaN before the run and checked fully written; float results must
match engine.reference to rel 1e-5, integer/bit results exactly.
"""
import math

import numpy as np
import pytest
from numba import cuda

from kdspec.engine.bench.attention import random_tree_visibility  # the bench's masks
from kdspec.engine.golden import layers
from kdspec.engine.golden import model as ref
from kdspec.engine.model.config import PRESETS
from kdspec.numba_kernels.attention.common import MAX_LATENT, causal_visibility, pack_visibility
from kdspec.numba_kernels.attention.dispatch import attention_path, mla_attention
from kdspec.numba_kernels.attention.simt import DEFAULT_CONFIG, MIN_KEYS_PER_SPLIT, TileConfig, default_num_splits
from kdspec.numba_kernels.embedding import embed_tokens
from kdspec.numba_kernels.kv_write import write_kv_rows
from kdspec.numba_kernels import rmsnorm
from kdspec.numba_kernels.rmsnorm import add_rms_norm, rms_norm
from kdspec.numba_kernels.rope import apply_rope
from kdspec.numba_kernels.runtime import ON_SIMULATOR

from kernel_checks import assert_close as check_close
from kernel_checks import normal, poisoned, rope_table

pytestmark = pytest.mark.sim
RTOL = 1e-5


def assert_close(actual, expected, rtol=RTOL):
    check_close(actual, expected, rtol)
MAX_O_COLS = 8  # any o_cols: default_num_splits only reads rows and blocks_per_sm


# ------------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("tokens, width", [(1, 1), (3, 13), (2, 64)])
def test_rms_norm_matches_reference(tokens, width):
    rng = np.random.default_rng(width)
    x, w = normal(rng, tokens, width, scale=3.0), normal(rng, width)
    out = rms_norm(x, w, 1e-6, out=poisoned((tokens, width))).copy_to_host()
    assert_close(out, ref.rms_norm(x, w, 1e-6))


def test_rms_norm_in_place_and_eps_dominated_row():
    rng = np.random.default_rng(1)
    x = normal(rng, 2, 9)
    x[1] = 1e-4  # sum of squares far below eps: the eps term must be used, not dropped
    w = normal(rng, 9)
    x_dev = cuda.to_device(x)
    out = rms_norm(x_dev, w, 1e-2, out=x_dev).copy_to_host()
    assert_close(out, ref.rms_norm(x, w, 1e-2))


def test_add_rms_norm_updates_residual_and_norms_the_sum():
    rng = np.random.default_rng(2)
    x, residual, w = normal(rng, 4, 11), normal(rng, 4, 11), normal(rng, 11)
    residual_dev = cuda.to_device(residual)
    out = add_rms_norm(x, residual_dev, w, 1e-5, out=poisoned((4, 11))).copy_to_host()
    new_residual = residual_dev.copy_to_host()
    np.testing.assert_array_equal(new_residual, residual + x)  # one fp32 add: bit-exact
    assert_close(out, ref.rms_norm(residual.astype(np.float64) + x, w, 1e-5))


@pytest.mark.parametrize("width", [40, 36])  # past the simulator's 32 columns in registers; quads of 4
def test_norm_kernels_quads_in_one_access_or_element_by_element_give_the_same_bits(width):
    rng = np.random.default_rng(width)
    x, residual, w = normal(rng, 3, width), normal(rng, 3, width), normal(rng, 1, width)
    outputs = []
    for vectorized in (True, False):
        plain, add = rmsnorm.norm_kernels(vectorized)
        out, added, residual_dev = poisoned(x.shape), poisoned(x.shape), cuda.to_device(residual)
        plain[1, rmsnorm.NORM_THREADS](cuda.to_device(x), cuda.to_device(w), np.float32(1e-6), out)
        add[1, rmsnorm.NORM_THREADS](cuda.to_device(x), residual_dev, cuda.to_device(w), np.float32(1e-6), added)
        outputs.append([a.copy_to_host().view(np.uint32) for a in (out, added, residual_dev)])
    for vector_output, element_output in zip(*outputs):
        np.testing.assert_array_equal(vector_output, element_output)
    assert_close(outputs[0][0].view(np.float32), ref.rms_norm(x, w[0], 1e-6))


def test_rms_norm_rejects_bad_inputs():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, np.ones(5, np.float32), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        rms_norm(x.astype(np.float64), np.ones(4, np.float32), 1e-6)
    with pytest.raises(ValueError, match="device array"):
        add_rms_norm(x, x.copy(), np.ones(4, np.float32), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x, cuda.to_device(np.ones(8, np.float32))[::2], 1e-6)


# --------------------------------------------------------------------------------------------- RoPE
@pytest.fixture(scope="module")
def tiny():
    return PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_table(tiny):
    return rope_table(tiny)


def test_rope_on_a_strided_view_of_q_touches_only_the_rope_columns(tiny, tiny_table):
    rng = np.random.default_rng(3)
    tokens, heads, nope, rope = 5, 2, 3, tiny.qk_rope_head_dim
    q = normal(rng, tokens, heads, nope + rope)
    positions = rng.integers(0, tiny.max_position_embeddings, tokens).astype(np.int64)
    positions[0] = tiny.max_position_embeddings - 1  # last table row
    q_dev = cuda.to_device(q)
    apply_rope(q_dev[:, :, nope:], tiny_table, positions)
    result = q_dev.copy_to_host()
    np.testing.assert_array_equal(result[:, :, :nope], q[:, :, :nope])
    assert_close(result[:, :, nope:], layers.apply_rope(q[:, :, nope:], *ref.rope_cos_sin(tiny, positions)))


def test_rope_on_rows_of_k_pe(tiny, tiny_table):
    rng = np.random.default_rng(4)
    k_pe = normal(rng, 6, tiny.qk_rope_head_dim)
    positions = np.array([0, 1, 7, 64, 100, 255], dtype=np.int64)
    rotated = apply_rope(cuda.to_device(k_pe), tiny_table, positions).copy_to_host()
    assert_close(rotated, layers.apply_rope(k_pe, *ref.rope_cos_sin(tiny, positions)))


def test_rope_position_checks(tiny, tiny_table):
    x = cuda.to_device(np.ones((2, tiny.qk_rope_head_dim), np.float32))
    with pytest.raises(ValueError, match="positions must be in"):
        apply_rope(x, tiny_table, np.array([0, tiny.max_position_embeddings], np.int64))
    with pytest.raises(ValueError, match="int64"):
        apply_rope(x, tiny_table, np.array([0, 1], np.int32))
    # device positions are not checked on the host: the out-of-table row becomes NaN, the other is rotated
    bad = cuda.to_device(np.array([1, -1], np.int64))
    result = apply_rope(x, tiny_table, bad).copy_to_host()
    assert np.isfinite(result[0]).all() and np.isnan(result[1]).all()


# ---------------------------------------------------------------------------------------- embedding
def test_embedding_float32_gathers_exact_rows():
    rng = np.random.default_rng(5)
    table = normal(rng, 20, 11)
    ids = np.array([3, 0, 19, 3, 7], dtype=np.int64)
    out = embed_tokens(table, ids, out=poisoned((5, 11))).copy_to_host()
    np.testing.assert_array_equal(out, table[ids])


@pytest.mark.parametrize("bits_dtype", [np.int16, np.uint16])
def test_embedding_bf16_widens_bit_exactly(bits_dtype):
    rng = np.random.default_rng(6)
    values = normal(rng, 16, 10, scale=5.0)
    values[0, :3] = [-0.0, -1e-30, -3.5]  # negative patterns sign-extend if widened carelessly
    bits = (values.view(np.uint32) >> 16).astype(np.uint16).view(bits_dtype)
    truncated = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bf16 by truncation
    ids = np.array([0, 15, 4], dtype=np.int32)
    out = embed_tokens(bits, ids, out=poisoned((3, 10))).copy_to_host()
    np.testing.assert_array_equal(out.view(np.uint32), truncated[ids].view(np.uint32))


def test_embedding_rejects_bad_ids_and_tables():
    table = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="token ids must be in"):
        embed_tokens(table, np.array([4], np.int64))
    with pytest.raises(ValueError, match="table"):
        embed_tokens(table.astype(np.float64), np.array([0], np.int64))
    out = embed_tokens(table, cuda.to_device(np.array([0, 9], np.int64))).copy_to_host()
    assert (out[0] == 0).all() and np.isnan(out[1]).all()


# ------------------------------------------------------------------------------------------ KV write
def test_write_kv_rows_norms_ropes_and_writes_only_its_rows(tiny, tiny_table):
    rng = np.random.default_rng(7)
    num_layers, capacity, latent, rope = 3, 12, tiny.kv_lora_rank, tiny.qk_rope_head_dim
    tokens, layer, start = 4, 1, 5
    kv_a = normal(rng, tokens, latent + rope, scale=2.0)
    weight = normal(rng, latent)
    positions = np.array([5, 6, 9, 200], dtype=np.int64)
    cache = poisoned((num_layers, capacity, latent + rope))
    write_kv_rows(cache, layer, start, kv_a, weight, tiny.rms_norm_eps, tiny_table, positions)
    result = cache.copy_to_host()
    rows = result[layer, start:start + tokens]
    assert_close(rows[:, :latent], ref.rms_norm(kv_a[:, :latent], weight, tiny.rms_norm_eps))
    assert_close(rows[:, latent:], layers.apply_rope(kv_a[:, latent:], *ref.rope_cos_sin(tiny, positions)))
    untouched = np.ones(result.shape, bool)
    untouched[layer, start:start + tokens] = False
    assert np.isnan(result[untouched]).all()


def test_write_kv_rows_rejects_rows_past_capacity(tiny, tiny_table):
    cache = poisoned((1, 4, tiny.kv_lora_rank + tiny.qk_rope_head_dim))
    kv_a = np.zeros((2, tiny.kv_lora_rank + tiny.qk_rope_head_dim), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        write_kv_rows(cache, 0, 3, kv_a, np.ones(tiny.kv_lora_rank, np.float32), 1e-6, tiny_table,
                      np.array([0, 1], np.int64))


# ------------------------------------------------------------------------------------- MLA attention
def run_attention(rng, tokens, heads, latent, rope, prefix, visible, num_splits, spare_rows=3,
                  config=DEFAULT_CONFIG):
    q_lat = normal(rng, tokens, heads, latent)
    q_pe = normal(rng, tokens, heads, rope)
    cache = normal(rng, prefix + tokens + spare_rows, latent + rope)
    cache[prefix + tokens:] = np.nan  # rows past the in-flight ones must never be read
    scale = 0.37
    out = mla_attention(q_lat, q_pe, cache, prefix, pack_visibility(visible), scale,
                        out=poisoned((tokens, heads, latent)), num_splits=num_splits, config=config).copy_to_host()
    keys = cache[:prefix + tokens]
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)
    expected = layers.mla_attention_latent(q_lat, q_pe, keys[:, :latent], keys[:, latent:], full, scale)
    return out, expected


@pytest.mark.parametrize("tokens, heads, latent, rope, prefix", [
    (1, 2, 16, 4, 0),     # AR decode of the first token: one key
    (1, 2, 16, 4, 29),    # AR decode
    (6, 2, 16, 4, 0),     # tree without prefix
    (6, 2, 13, 2, 21),    # c + r not a multiple of the q chunk
    (5, 1, 32, 8, 34),    # the largest c, r the simulator build allows
])
def test_attention_tree_masks_match_reference(tokens, heads, latent, rope, prefix):
    rng = np.random.default_rng(tokens * 100 + prefix)
    visible = random_tree_visibility(tokens, rng)
    out, expected = run_attention(rng, tokens, heads, latent, rope, prefix, visible, num_splits=1)
    assert_close(out, expected)


def test_attention_causal_prefill_helper():
    rng = np.random.default_rng(8)
    np.testing.assert_array_equal(causal_visibility(6), pack_visibility(np.tri(6, dtype=bool)))
    out, expected = run_attention(rng, 6, 2, 8, 2, 0, np.tri(6, dtype=bool), num_splits=1)
    assert_close(out, expected)


@pytest.mark.parametrize("splits", [2, 3, 10])
def test_attention_split_k_matches_one_split_and_reference(splits):
    rng = np.random.default_rng(splits)
    visible = random_tree_visibility(5, rng)
    state = rng.bit_generator.state
    one, expected = run_attention(rng, 5, 2, 16, 4, 31, visible, num_splits=1)
    rng.bit_generator.state = state  # same inputs again
    several, expected_again = run_attention(rng, 5, 2, 16, 4, 31, visible, num_splits=splits)
    np.testing.assert_array_equal(expected, expected_again)
    assert_close(several, expected)
    assert_close(several, one)


def test_attention_split_seeing_nothing_is_merged_away():
    # P = 0 and 9 splits of one key tile each: most splits hold no row a given query sees
    rng = np.random.default_rng(9)
    visible = random_tree_visibility(6, rng) & ~np.triu(np.ones((6, 6), bool), 1)
    out, expected = run_attention(rng, 6, 1, 8, 2, 0, visible, num_splits=6)
    assert_close(out, expected)


def test_attention_more_than_32_in_flight_rows():
    rng = np.random.default_rng(10)
    visible = random_tree_visibility(34, rng)
    visible[33, :] = True  # a query seeing rows in both mask words (and a non-tree row pattern)
    out, expected = run_attention(rng, 34, 1, 8, 2, 3, visible, num_splits=2, spare_rows=0)
    assert_close(out, expected)


# tile shapes other than the default: wide key tiles of one-dimension chunks, tall row tiles of 1 x 4 score tiles
OTHER_CONFIGS = [TileConfig(rows=4, keys=8, d_chunk=2, v_chunk=4, s_rows=2, s_keys=2, o_cols=4, threads=8),
                 TileConfig(rows=8, keys=4, d_chunk=2, v_chunk=1, s_rows=1, s_keys=4, o_cols=4, threads=8)]


@pytest.mark.skipif(not ON_SIMULATOR, reason="toy tiles sized for the simulator's MAX_LATENT; "
                    "tests/kernels/test_attention_gpu.py runs real ones")
@pytest.mark.parametrize("config", OTHER_CONFIGS, ids=["wide-keys", "tall-rows"])
@pytest.mark.parametrize("splits", [1, 2])
def test_attention_other_tile_configs(config, splits):
    # 5 tokens x 3 heads: partial row tiles; P = 19: partial key tiles and splits; c + r = 19: partial chunks
    rng = np.random.default_rng(12 + splits)
    visible = random_tree_visibility(5, rng)
    out, expected = run_attention(rng, 5, 3, 15, 4, 19, visible, num_splits=splits, config=config)
    assert_close(out, expected)


def test_tile_config_rules():
    with pytest.raises(ValueError, match=r"threads == \(rows / s_rows\)"):
        TileConfig(rows=8, keys=4, d_chunk=4, v_chunk=2, s_rows=2, s_keys=1, o_cols=8, threads=8).check()
    with pytest.raises(ValueError, match="keys % v_chunk"):
        TileConfig(rows=8, keys=4, d_chunk=4, v_chunk=3, s_rows=2, s_keys=2, o_cols=MAX_LATENT // 8,
                   threads=8).check()
    with pytest.raises(ValueError, match="48 KB"):
        TileConfig(rows=32, keys=512, d_chunk=4, v_chunk=2, s_rows=4, s_keys=64, o_cols=MAX_LATENT // 32,
                   threads=64).check()


def test_default_num_splits_fills_the_sms():
    config = TileConfig(rows=64, keys=64, s_rows=4, s_keys=4, o_cols=MAX_O_COLS, threads=256)
    # 64 row tiles on 132 SMs: 2 splits fill 97% of one wave (4 would fill two waves no better)
    assert default_num_splits(64 * 64, 8256, config, sms=132) == 2
    # AR decode: one row tile, as many splits as the keys allow (>= MIN_KEYS_PER_SPLIT each), up to a wave
    assert default_num_splits(64, 1025, config, sms=132) == 1025 // MIN_KEYS_PER_SPLIT
    splits = default_num_splits(64, 8256, config, sms=132)  # 129 allowed: the fewest within 2% of 129/132
    assert splits == math.ceil(0.98 * min(132, 8256 // MIN_KEYS_PER_SPLIT)) and splits * MIN_KEYS_PER_SPLIT <= 8256
    assert default_num_splits(64, MIN_KEYS_PER_SPLIT + 1, config, sms=132) == 1
    # 256 row tiles already fill two waves at 97%
    assert default_num_splits(256 * 64, 8448, config, sms=132) == 1
    # two blocks per SM: twice the slots
    assert default_num_splits(64 * 64, 8256, config._replace(blocks_per_sm=2), sms=132) == 4


def test_pack_visibility_bits():
    rng = np.random.default_rng(11)
    visible = rng.random((40, 40)) < 0.5
    packed = pack_visibility(visible)
    assert packed.shape == (40, 2) and packed.dtype == np.uint32
    for i in range(40):
        for j in range(40):
            assert bool((int(packed[i, j // 32]) >> (j % 32)) & 1) == visible[i, j]
    assert (packed[:, 1] >> 8 == 0).all()  # bits past s stay clear


def test_attention_rejects_bad_inputs():
    q_lat, q_pe = np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 2), np.float32)
    cache = np.zeros((5, 10), np.float32)
    with pytest.raises(ValueError, match="sees no key row"):
        mla_attention(q_lat, q_pe, cache, 0, np.array([[1], [0]], np.uint32), 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        mla_attention(q_lat, q_pe, cache, 4, causal_visibility(2), 1.0)
    with pytest.raises(ValueError, match="cache_layer"):
        mla_attention(q_lat, q_pe, np.zeros((5, 11), np.float32), 0, causal_visibility(2), 1.0)
    with pytest.raises(ValueError, match="visibility"):
        mla_attention(q_lat, q_pe, cache, 0, np.tri(2, dtype=bool), 1.0)
    with pytest.raises(ValueError, match="MAX_LATENT"):
        mla_attention(np.zeros((1, 1, 4096), np.float32), q_pe[:1], np.zeros((2, 4098), np.float32), 0,
                      causal_visibility(1), 1.0)


def test_attention_path_by_token_count():
    assert attention_path(1, 64) == attention_path(15, 64) == "decode"
    expected = "simt" if ON_SIMULATOR else "tensor_cores"  # the simulator keeps its fastest path (H200: sm_90)
    assert attention_path(16, 64) == attention_path(300, 2) == expected


@pytest.mark.parametrize("tokens, prefix", [(3, 17), (18, 5)])
def test_mla_attention_without_config_runs_its_path_and_matches_reference(tokens, prefix):
    # the public entry point as the engine calls it (no config, no splits): the kernel attention_path picks
    rng = np.random.default_rng(30 + tokens)
    visible = random_tree_visibility(tokens, rng)
    out, expected = run_attention(rng, tokens, 2, 16, 4, prefix, visible, num_splits=None, config=None)
    assert_close(out, expected)


@pytest.mark.parametrize("tokens", [3, 18])
def test_visibility_rows_wider_than_needed_give_the_same_output(tokens):
    # the tree build's bitmask is sized for the whole budget (more words than ceil(s/32)); attention takes it
    # as it is, and the extra words (poisoned with all bits set) are never read
    rng = np.random.default_rng(40 + tokens)
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe = normal(rng, tokens, 2, 16), normal(rng, tokens, 2, 4)
    cache = normal(rng, 7 + tokens, 20)
    packed = pack_visibility(visible)
    wide = np.full((tokens, packed.shape[1] + 2), 0xFFFFFFFF, np.uint32)
    wide[:, :packed.shape[1]] = packed
    exact = mla_attention(q_lat, q_pe, cache, 7, packed, 0.37).copy_to_host()
    widened = mla_attention(q_lat, q_pe, cache, 7, cuda.to_device(wide), 0.37).copy_to_host()
    np.testing.assert_array_equal(widened, exact)
    with pytest.raises(ValueError, match="visibility must be uint32"):
        mla_attention(q_lat, q_pe, cache, 7, packed[:-1], 0.37)
