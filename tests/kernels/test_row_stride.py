"""Grid-stride row loops: every per-row kernel gives the reference result whatever the number of row blocks.

The simulator launches one block over all rows (runtime.MAX_ROW_BLOCKS = 1), a GPU one block per row. Here the
limit is patched to 1 (simulator shape), 2 (blocks that loop over an uneven share of the rows) and 64 (more
than the rows: the GPU shape), with row counts that 2 does not divide. Outputs are poisoned before each run;
references are engine.reference / engine.sampling_ref (float64 numpy), integer results compared exactly.
"""
import dataclasses

import numpy as np
import pytest
from numba import cuda

from kdspec.engine.golden import layers
from kdspec.engine.golden import model as ref
from kdspec.engine.golden import sampling as sampling_ref
from kdspec.engine.model.config import PRESETS
from kdspec.numba_kernels import runtime, sampling
from kdspec.numba_kernels.attention.common import pack_visibility
from kdspec.numba_kernels.attention.dispatch import mla_attention
from kdspec.numba_kernels.attention import simt
from kdspec.numba_kernels.embedding import embed_tokens
from kdspec.numba_kernels.kv_write import write_kv_rows
from kdspec.numba_kernels.moe.experts import moe_experts
from kdspec.numba_kernels.moe.router import route_experts, route_experts_from_hidden, router_options
from kdspec.numba_kernels.moe.swiglu import silu_mul, swiglu_gemv
from kdspec.numba_kernels.rmsnorm import add_rms_norm, rms_norm

from kernel_checks import rope_table

pytestmark = pytest.mark.sim
ROWS = 5  # odd: with 2 blocks, block 0 loops over 3 rows and block 1 over 2


@pytest.fixture(params=[1, 2, 64], ids=lambda n: f"blocks{n}")
def row_block_limit(request, monkeypatch):
    monkeypatch.setattr(runtime, "MAX_ROW_BLOCKS", request.param)
    return request.param


def poisoned(shape, dtype=np.float32, value=np.nan):
    return cuda.to_device(np.full(shape, value, dtype=dtype))


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(actual, expected, rtol=1e-5):
    assert np.isfinite(actual).all(), "output not fully written (poison left) or non-finite"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(float(np.abs(expected).max()), 1e-30))


def test_row_blocks_caps_the_grid(row_block_limit):
    assert runtime.row_blocks(0) == 1  # launchers skip empty launches; a grid is never 0
    assert runtime.row_blocks(ROWS) == min(ROWS, row_block_limit)


def test_norms_kv_write_and_embedding(row_block_limit):
    rng = np.random.default_rng(1)
    tiny = PRESETS["tiny"]
    x, residual, w = normal(rng, ROWS, 11, scale=3.0), normal(rng, ROWS, 11), normal(rng, 11)
    assert_close(rms_norm(x, w, 1e-6, out=poisoned((ROWS, 11))).copy_to_host(), ref.rms_norm(x, w, 1e-6))
    residual_dev = cuda.to_device(residual)
    out = add_rms_norm(x, residual_dev, w, 1e-5, out=poisoned((ROWS, 11))).copy_to_host()
    np.testing.assert_array_equal(residual_dev.copy_to_host(), residual + x)
    assert_close(out, ref.rms_norm(residual.astype(np.float64) + x, w, 1e-5))

    latent, rope = tiny.kv_lora_rank, tiny.qk_rope_head_dim
    kv_a, kv_weight = normal(rng, ROWS, latent + rope, scale=2.0), normal(rng, latent)
    positions = np.array([3, 0, 7, 7, 40], np.int64)
    cache = poisoned((2, ROWS + 4, latent + rope))
    write_kv_rows(cache, 1, 2, kv_a, kv_weight, tiny.rms_norm_eps, rope_table(tiny), positions)
    result = cache.copy_to_host()
    assert_close(result[1, 2:2 + ROWS, :latent], ref.rms_norm(kv_a[:, :latent], kv_weight, tiny.rms_norm_eps))
    assert_close(result[1, 2:2 + ROWS, latent:], layers.apply_rope(kv_a[:, latent:], *ref.rope_cos_sin(tiny, positions)))
    untouched = np.ones(result.shape, bool)
    untouched[1, 2:2 + ROWS] = False
    assert np.isnan(result[untouched]).all()

    table = normal(rng, 9, 11)
    ids = np.array([4, 0, 8, 4, 2], np.int64)
    np.testing.assert_array_equal(embed_tokens(table, ids, out=poisoned((ROWS, 11))).copy_to_host(), table[ids])
    bits = rng.integers(0, 2 ** 16, size=(9, 10)).astype(np.uint16)
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    got = embed_tokens(bits, ids, out=poisoned((ROWS, 10))).copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint32), widened[ids].view(np.uint32))


def test_router_experts_and_swiglu(row_block_limit):
    rng = np.random.default_rng(2)
    e, k, d, f = 8, 3, 10, 6
    cfg = dataclasses.replace(PRESETS["small"], hidden_size=d, moe_intermediate_size=f, n_routed_experts=e,
                              num_experts_per_tok=k, n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    x = normal(rng, ROWS, d)
    gate = normal(rng, e, d, scale=1 / np.sqrt(d))
    bias = normal(rng, e, scale=0.5)
    want_ids, want_weights = layers.moe_gate(cfg, x, gate, bias)
    for route in (lambda **kw: route_experts(x @ gate.T, bias, **kw),
                  lambda **kw: route_experts_from_hidden(x, gate, bias, **kw)):
        ids, weights = route(**router_options(cfg), out_ids=poisoned((ROWS, k), np.int32, -7),
                             out_weights=poisoned((ROWS, k)))
        np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
        np.testing.assert_allclose(weights.copy_to_host(), want_weights, rtol=1e-5, atol=0)

    # 5 tokens x 3 slots over 7 active experts: with 2 blocks each loops over several experts
    ids = np.stack([rng.permutation(e)[:k] for _ in range(ROWS)]).astype(np.int32)
    ids[ids == 5] = 6
    weights = rng.random((ROWS, k)).astype(np.float32)
    w_gate_up = normal(rng, e, 2 * f, d, scale=1 / np.sqrt(d))
    w_down = normal(rng, e, d, f, scale=1 / np.sqrt(f))
    y = moe_experts(x, ids, weights, w_gate_up, w_down, out=poisoned((ROWS, d))).copy_to_host()
    want = np.zeros((ROWS, d))
    for t in range(ROWS):
        for slot in range(k):
            j = ids[t, slot]
            want[t] += weights[t, slot] * layers.swiglu(x[t:t + 1], w_gate_up[j, :f], w_gate_up[j, f:], w_down[j])[0]
    assert_close(y, want)

    y = swiglu_gemv(x, w_gate_up[2], w_down[2], out=poisoned((ROWS, d))).copy_to_host()
    assert_close(y, layers.swiglu(x, w_gate_up[2, :f], w_gate_up[2, f:], w_down[2]))
    gate_up = normal(rng, ROWS, 2 * f, scale=3.0)
    g, u = gate_up[:, :f].astype(np.float64), gate_up[:, f:].astype(np.float64)
    assert_close(silu_mul(gate_up, out=poisoned((ROWS, f))).copy_to_host(), g / (1 + np.exp(-g)) * u, rtol=1e-6)


def test_sampling_rows(row_block_limit):
    rng = np.random.default_rng(3)
    logits = rng.integers(-3, 3, size=(ROWS, 37)).astype(np.float32)  # many ties: lowest id must win
    assert sampling.argmax_rows(logits).copy_to_host().tolist() == [sampling_ref.choose_token(r, 0.0, 0, 0)
                                                                    for r in logits]
    top_ids, top_values, margins = (a.copy_to_host() for a in sampling.topk_rows(logits, 4))
    for r in range(ROWS):
        want_ids, want_values, want_margin = sampling_ref.topk_with_margin(logits[r], 4)
        assert top_ids[r].tolist() == want_ids.tolist()
        assert top_values[r].tobytes() == want_values.tobytes()
        assert margins[r].tobytes() == np.float32(want_margin).tobytes()
    positions = np.array([9, 2, 2, 500, 31], np.int64)
    got = sampling.sample_rows(logits, 0.7, 12345, positions).copy_to_host().tolist()
    assert got == [sampling_ref.choose_token(logits[r], 0.7, 12345, int(positions[r])) for r in range(ROWS)]


@pytest.mark.skipif(not runtime.ON_SIMULATOR, reason="sized for the simulator's 8-row tiles (a GPU tile holds 64 rows)")
@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_row_tiles_and_merge(row_block_limit, num_splits):
    rng = np.random.default_rng(4 + num_splits)
    tokens, heads, latent, rope, prefix = 6, 3, 16, 4, 5
    assert tokens * heads > 2 * simt.DEFAULT_CONFIG.rows  # 3 row tiles: with 2 blocks, block 0 loops over tiles 0 and 2
    visible = np.zeros((tokens, tokens), bool)
    for i in range(tokens):  # a random tree: ancestors and self
        if i:
            visible[i] = visible[rng.integers(0, i)]
        visible[i, i] = True
    q_lat, q_pe = normal(rng, tokens, heads, latent), normal(rng, tokens, heads, rope)
    cache = normal(rng, prefix + tokens + 2, latent + rope)
    cache[prefix + tokens:] = np.nan  # rows past the in-flight ones must never be read
    out = mla_attention(q_lat, q_pe, cache, prefix, pack_visibility(visible), 0.37,
                        out=poisoned((tokens, heads, latent)), num_splits=num_splits).copy_to_host()
    keys = cache[:prefix + tokens]
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)
    assert_close(out, layers.mla_attention_latent(q_lat, q_pe, keys[:, :latent], keys[:, latent:], full, 0.37))
