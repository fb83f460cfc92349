"""Per-head products of absorbed MLA (numba_kernels/heads_matmul.py) against float64, and batch invariance.

- fp32 and bf16 weights against a float64 einsum (rel 1e-5 of max |ref|), outputs NaN-poisoned, x a strided view;
- a row's bits are the same computed alone (one row a block) and among many (MANY_ROWS rows a block), with one
  K group and with several;
- bad shapes are refused with a message.
Simulator tests at toy sizes; the GPU test at Kimi K2's W_UK [64, 128, 512] and W_UV^T [64, 512, 128].
"""
import numpy as np
import pytest

from kdspec.engine.model.safetensors_io import bf16_bits_to_float32, float32_to_bf16_bits
from kdspec.numba_kernels.heads_matmul import MANY_ROWS, THREADS, heads_matmul, k_groups

from kernel_checks import assert_close, normal, poisoned


def reference(x, w):
    return np.einsum("sha,hab->shb", x.astype(np.float64), w.astype(np.float64))


def run(x, w, bf16):
    device_w = float32_to_bf16_bits(w) if bf16 else w
    return heads_matmul(x, device_w, out=poisoned((x.shape[0], w.shape[0], w.shape[2]))).copy_to_host()


def check(rng, tokens, heads, width_in, width_out, bf16):
    wide = normal(rng, tokens, heads, width_in + 3)
    x = wide[:, :, 1:width_in + 1]  # a strided view, as q[:, :, :nope] is
    w = normal(rng, heads, width_in, width_out)
    w_used = bf16_bits_to_float32(float32_to_bf16_bits(w)) if bf16 else w
    together = run(x, w, bf16)
    assert_close(together, reference(x, w_used), 1e-5)
    for row in {0, tokens // 2, tokens - 1}:
        alone = run(np.ascontiguousarray(x[row:row + 1]), w, bf16)
        assert np.array_equal(alone.view(np.uint32), together[row:row + 1].view(np.uint32)), row


@pytest.mark.sim
@pytest.mark.parametrize("tokens, width_in, width_out", [
    (5, 7, 2 * THREADS),     # one K group: every thread a column pair
    (MANY_ROWS + 1, 9, 4),   # several K groups (a short last range), a partial row tile
    (1, 3, 6),
])
@pytest.mark.parametrize("bf16", [False, True])
def test_matches_float64_and_rows_keep_their_bits(tokens, width_in, width_out, bf16):
    check(np.random.default_rng(tokens * 10 + width_in), tokens, 2, width_in, width_out, bf16)


@pytest.mark.sim
def test_k_groups_fill_the_block_from_the_weight_shape():
    assert k_groups(512, 128) == max(1, min(THREADS // 64, 512))
    assert k_groups(3, 2) == min(THREADS, 3)
    assert k_groups(128, 2 * THREADS) == 1


@pytest.mark.sim
def test_rejects_bad_shapes():
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="w must be"):
        heads_matmul(x, np.zeros((3, 5, 6), np.float32))
    with pytest.raises(ValueError, match="B even"):
        heads_matmul(x, np.zeros((3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        heads_matmul(x.astype(np.float64), np.zeros((3, 4, 6), np.float32))
    with pytest.raises(ValueError, match="at most"):
        heads_matmul(x, np.zeros((3, 4, 2 * THREADS + 2), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("width_in, width_out", [(128, 512), (512, 128)])  # W_UK, W_UV^T
def test_k2_dims(width_in, width_out):
    rng = np.random.default_rng(width_in)
    check(rng, 256, 64, width_in, width_out, bf16=True)
    check(rng, 8, 64, width_in, width_out, bf16=True)
