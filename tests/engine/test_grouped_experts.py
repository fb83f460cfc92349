"""The routed experts through torch's grouped GEMM (engine/device/grouped_experts.py) on the GPU: against a float64
reference that rounds where the path rounds (x, gate, up, the SwiGLU product and down to bf16), outputs poisoned;
and each token's output bit for bit the same alone as among 64 or 256 tokens (the batch invariance a verify
forward needs)."""
from __future__ import annotations

import numpy as np
import pytest

from kdspec.engine.model.safetensors_io import float32_to_bf16_bits

pytestmark = pytest.mark.gpu


def _bf16(a) -> np.ndarray:
    """float64 values rounded to bf16 (through float32, to nearest even), as float64."""
    bits = float32_to_bf16_bits(np.asarray(a, dtype=np.float32)).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


def _case(tokens, experts, top_k, hidden, inner, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    gate_up = (rng.standard_normal((experts, 2 * inner, hidden)) * hidden ** -0.5).astype(np.float32)
    down = (rng.standard_normal((experts, hidden, inner)) * inner ** -0.5).astype(np.float32)
    return x, ids, weights, gate_up, down


def _reference(x, ids, weights, gate_up, down, shared):
    inner = gate_up.shape[1] // 2
    xb, gate_up, down = _bf16(x), _bf16(gate_up), _bf16(down)
    y = shared.astype(np.float64).copy()
    for t in range(x.shape[0]):
        for slot, expert in enumerate(ids[t]):
            g = _bf16(gate_up[expert] @ xb[t])
            act = _bf16(g[:inner] / (1 + np.exp(-g[:inner])) * g[inner:])
            y[t] += weights[t, slot] * _bf16(down[expert] @ act)
    return y


def _run(ops, x, ids, weights, gate_up, down, shared):
    """The path's output: added to ``shared``, or (shared None) written over a NaN-poisoned output."""
    from numba import cuda

    from kdspec.engine.device.grouped_experts import grouped_experts
    out = cuda.to_device(np.full(x.shape, np.nan, np.float32) if shared is None else shared.copy())
    grouped_experts(ops, cuda.to_device(x), cuda.to_device(ids), cuda.to_device(weights),
                    cuda.to_device(float32_to_bf16_bits(gate_up)), cuda.to_device(float32_to_bf16_bits(down)),
                    out=out, accumulate=shared is not None)
    return out.copy_to_host()


@pytest.mark.parametrize("tokens, seed, accumulate", [(1, 0, True), (7, 1, False), (64, 2, True), (64, 4, False)])
def test_grouped_experts_match_the_float64_reference(tokens, seed, accumulate):
    pytest.importorskip("torch")
    from kdspec.engine.device.ops import TorchOps
    ops = TorchOps("bfloat16", fixed_rows=128)
    x, ids, weights, gate_up, down = _case(tokens, 8, 4, 256, 128, seed)
    shared = np.random.default_rng(seed + 10).standard_normal(x.shape).astype(np.float32) if accumulate \
        else np.zeros(x.shape, np.float32)
    got = _run(ops, x, ids, weights, gate_up, down, shared if accumulate else None)
    want = _reference(x, ids, weights, gate_up, down, shared)
    assert np.isfinite(got).all()
    # the GEMM's accumulation order is not the reference's: a bf16 rounding may land an ulp apart (2**-8)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want - shared).max())


def test_a_token_gets_the_same_bits_alone_as_among_many():
    pytest.importorskip("torch")
    from kdspec.engine.device.ops import TorchOps
    ops = TorchOps("bfloat16", fixed_rows=128)
    x, ids, weights, gate_up, down = _case(256, 32, 8, 1024, 512, 3)
    shared = np.zeros(x.shape, np.float32)
    many = _run(ops, x, ids, weights, gate_up, down, shared)
    some = _run(ops, x[:64], ids[:64], weights[:64], gate_up, down, shared[:64])
    assert np.array_equal(some.view(np.int32), many[:64].view(np.int32))
    for t in (0, 1, 17, 63, 200, 255):
        alone = _run(ops, x[t:t + 1], ids[t:t + 1], weights[t:t + 1], gate_up, down, shared[t:t + 1])
        assert np.array_equal(alone.view(np.int32), many[t:t + 1].view(np.int32)), t


def test_a_token_gets_the_same_bits_alone_as_among_more_pairs_than_one_tile_takes():
    """More than SMALL_TILE_ROWS pairs an expert on average (160 here): torch would take a larger tile for the whole
    call; the path goes through in chunks that keep the one-token tile."""
    pytest.importorskip("torch")
    from kdspec.engine.device.grouped_experts import SMALL_TILE_ROWS
    from kdspec.engine.device.ops import TorchOps
    ops = TorchOps("bfloat16", fixed_rows=128)
    experts, top_k, tokens = 4, 4, 160
    assert tokens * top_k / experts > SMALL_TILE_ROWS
    x, ids, weights, gate_up, down = _case(tokens, experts, top_k, 1024, 512, 5)
    shared = np.zeros(x.shape, np.float32)
    many = _run(ops, x, ids, weights, gate_up, down, shared)
    want = _reference(x, ids, weights, gate_up, down, shared)
    np.testing.assert_allclose(many, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    for t in (0, 63, 128, 159):
        alone = _run(ops, x[t:t + 1], ids[t:t + 1], weights[t:t + 1], gate_up, down, shared[t:t + 1])
        assert np.array_equal(alone.view(np.int32), many[t:t + 1].view(np.int32)), t
