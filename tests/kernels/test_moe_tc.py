"""The routed experts on the tensor cores (numba_kernels/moe/experts_tc.py, bf16 compute).

Against a float64 reference that rounds the activations to bf16 as the kernels do (x before gate_up, act before
down); outputs NaN-poisoned; and batch invariance: each token run alone gives the bits it gets among all s.
Simulator: toy sizes (d = 64 and 160, f = 32, 5 experts, one expert holding every token so it takes several passes;
every launch shape against the few-pairs one, bit for bit; stages of two chunks; the fragment layout element by
element);
GPU: Kimi K2's d = 7168, f = 2048 with 8 experts, s = 1, 8, 32 and 256, and two staged candidates against the
few-pairs bits; the fragment layout of a torch tensor.
"""
import numpy as np
import pytest
from numba import cuda

from kdspec.engine.model.safetensors_io import float32_to_bf16_bits
from kdspec.numba_kernels.moe.experts import moe_experts
from kdspec.numba_kernels.moe.experts_tc import (FEW_PAIRS_CONFIG, K_SPLIT, MANY_PAIRS_CONFIG, MID_PAIRS_CONFIG,
                                                 MOST_PAIRS_CONFIG, StagedConfig, TcConfig, WgmmaConfig,
                                                 fragment_layout, supports, runs_wgmma, tc_config_for,
                                                 transposed_word)

from kernel_checks import assert_close, poisoned


def skip_without_wgmma(config):
    if isinstance(config, WgmmaConfig) and not runs_wgmma():
        pytest.skip("the wgmma experts need a Hopper GPU")


def bf16(a):
    """float32 -> the nearest bf16 (ties to even), as float64."""
    return (float32_to_bf16_bits(np.asarray(a, np.float32)).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def random_case(rng, s, d, f, e, k, one_expert_for_all=False):
    x = rng.standard_normal((s, d)).astype(np.float32)
    gate_up = float32_to_bf16_bits(rng.standard_normal((e, 2 * f, d)).astype(np.float32) * d ** -0.5)
    down = float32_to_bf16_bits(rng.standard_normal((e, d, f)).astype(np.float32) * f ** -0.5)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(s)]).astype(np.int32)
    if one_expert_for_all:
        ids[:, 0] = 0
        ids[:, 1:] = np.where(ids[:, 1:] == 0, e - 1, ids[:, 1:])
    weights = rng.random((s, k)).astype(np.float32)
    return x, ids, weights, gate_up, down


def test_fragment_layout_puts_each_lane_fragment_where_its_load_reads_it():
    """Element by element from the mma's A fragment (mma.py's docstring): lane (g, tq)'s 16 bytes for k-step j of
    a tile's chunk are rows g, g + 8 of columns 8 tq + 4 j .. + 3, in the register order a0 .. a3."""
    rng = np.random.default_rng(3)
    e, rows, cols = 2, 48, 96
    w = rng.integers(0, 2 ** 16, size=(e, rows, cols), dtype=np.uint16)
    laid = fragment_layout(w)
    assert laid.shape == w.shape and laid.dtype == w.dtype and laid.flags.c_contiguous
    words = laid.reshape(e, rows // 16, cols // 32, 2, 32, 4, 2)  # expert, tile, chunk, k-step, lane, word, half
    for expert, tile, chunk, j, lane in np.ndindex(e, rows // 16, cols // 32, 2, 32):
        g, tq = lane // 4, lane % 4
        column = 32 * chunk + 8 * tq + 4 * j
        row = 16 * tile + g
        want = [w[expert, row, column:column + 2], w[expert, row + 8, column:column + 2],
                w[expert, row, column + 2:column + 4], w[expert, row + 8, column + 2:column + 4]]
        assert np.array_equal(words[expert, tile, chunk, j, lane], np.stack(want))


@pytest.mark.gpu
def test_fragment_layout_of_a_torch_tensor_on_the_gpu_is_the_numpy_one():
    """The device model lays drawn weights out with torch on the GPU, host weights with numpy."""
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(4).integers(-2 ** 15, 2 ** 15, size=(3, 32, 64), dtype=np.int16)
    laid = fragment_layout(torch.as_tensor(w, device="cuda"))
    assert laid.is_contiguous() and laid.shape == w.shape
    assert np.array_equal(laid.cpu().numpy(), fragment_layout(w))


def reference(x, ids, weights, gate_up, down, tokens):
    """float64 y[tokens] with bf16-rounded activations (bf16 weights are exact as they are)."""
    f = down.shape[2]
    as_float = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    y = np.zeros((len(tokens), x.shape[1]))
    for out_row, t in enumerate(tokens):
        xt = bf16(x[t])
        for slot, expert in enumerate(ids[t]):
            w = as_float(gate_up[expert])
            h = (xt @ w[:f].T) / (1 + np.exp(-(xt @ w[:f].T))) * (xt @ w[f:].T)
            y[out_row] += weights[t, slot] * (bf16(h) @ as_float(down[expert]).T)
    return y


def on_device(gate_up, down):
    """The weights as the tensor-core kernels take them: in fragment_layout, on the device."""
    return cuda.to_device(fragment_layout(gate_up)), cuda.to_device(fragment_layout(down))


def run(x, ids, weights, gate_up, down, config=None):
    gate_up_d, down_d = on_device(gate_up, down)
    return moe_experts(x, ids, weights, gate_up_d, down_d, out=poisoned(x.shape), tensor_cores=True,
                       config=config).copy_to_host()


def assert_tokens_alone_equal(x, ids, weights, gate_up, down, together, tokens):
    gate_up_d, down_d = on_device(gate_up, down)
    for t in tokens:
        alone = moe_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], gate_up_d, down_d,
                            out=poisoned((1, x.shape[1])), tensor_cores=True).copy_to_host()[0]
        assert np.array_equal(alone.view(np.uint32), together[t].view(np.uint32)), (
            f"token {t}: max |diff| {np.abs(alone - together[t]).max():.3g}")


@pytest.mark.sim
@pytest.mark.parametrize("d", [64, 160])  # 2 and 5 chunks of K: each warp's share, odd and even, and a warp idle
def test_tensor_core_experts_match_the_bf16_reference_and_are_batch_invariant(d):
    rng = np.random.default_rng(11)
    s = 2 * MANY_PAIRS_CONFIG.tokens_per_pass + 3  # expert 0 holds every token: three passes
    x, ids, weights, gate_up, down = random_case(rng, s, d, 32, 5, 2, one_expert_for_all=True)
    # all tokens run MANY_PAIRS_CONFIG, each token alone FEW_PAIRS_CONFIG: the bits must not depend on it
    assert tc_config_for(2, 5) == FEW_PAIRS_CONFIG and tc_config_for(5 * 12, 5) == MID_PAIRS_CONFIG
    assert tc_config_for(5 * 13, 5) == tc_config_for(5 * 24, 5) == MANY_PAIRS_CONFIG
    assert tc_config_for(5 * 25, 5) == MOST_PAIRS_CONFIG
    together = run(x, ids, weights, gate_up, down, MANY_PAIRS_CONFIG)
    tokens = [0, 1, s // 2, s - 1]
    assert_close(together[tokens], reference(x, ids, weights, gate_up, down, tokens), 1e-5)  # seen: 1e-7
    assert_tokens_alone_equal(x, ids, weights, gate_up, down, together, tokens)


@pytest.mark.sim
@pytest.mark.parametrize("config", [TcConfig(K_SPLIT, 2, 1), TcConfig(K_SPLIT, 3, 2), TcConfig(K_SPLIT, 1, 4),
                                    StagedConfig(1, 2, 2, 2, 3), StagedConfig(2, 1, 3, 2, 2),
                                    StagedConfig(1, 1, 1, 6, 2), MOST_PAIRS_CONFIG], ids=str)
def test_every_launch_shape_gives_the_few_pairs_bits(config):
    """Streaming with two tiles a pass, and staged with two warps along the weights (d = 96: the last down block
    half past d) and three stages, two along the tokens and two stages (three tiles a warp: the first warp's last
    tile partly past the expert's 21 pairs, the second warp's all past them), or one warp of three gate tiles (f =
    160: the last gate_up block's last two tiles past f), or MOST_PAIRS_CONFIG (four tiles a warp, the 21 pairs
    ending inside the third): the same bits as FEW_PAIRS_CONFIG for every token. down's K (f = 160: 5 chunks, a
    padded share) shows the order of the sums in pair_out's fp32; gate_up's would mostly hide in act's bf16
    rounding."""
    rng = np.random.default_rng(5)
    s, d = 21, 96
    x, ids, weights, gate_up, down = random_case(rng, s, d, 160, 5, 2, one_expert_for_all=True)
    gate_up_d, down_d = on_device(gate_up, down)
    few, other = (moe_experts(x, ids, weights, gate_up_d, down_d, out=poisoned((s, d)), tensor_cores=True,
                              config=c).copy_to_host() for c in (FEW_PAIRS_CONFIG, config))
    assert not np.isnan(other).any()
    assert np.array_equal(few.view(np.uint32), other.view(np.uint32)), f"max |diff| {np.abs(few - other).max():.3g}"


@pytest.mark.sim
def test_stages_of_two_chunks_give_the_few_pairs_bits():
    """A staged config of two chunks a stage where K's chunks and the share are whole stages (d = f = 128: 4
    chunks, the simulator's 2 shares of 2), and where they are not (d = 96: 3 chunks; f = 160: a share of 3),
    which the launcher runs one chunk a stage."""
    config = StagedConfig(1, 2, 2, 2, 2, 2)
    assert config.stage_fits(4) and not config.stage_fits(3) and not config.stage_fits(5)
    rng = np.random.default_rng(8)
    for d, f in ((128, 128), (96, 160)):
        x, ids, weights, gate_up, down = random_case(rng, 19, d, f, 4, 2, one_expert_for_all=True)
        gate_up_d, down_d = on_device(gate_up, down)
        few, other = (moe_experts(x, ids, weights, gate_up_d, down_d, out=poisoned((19, d)), tensor_cores=True,
                                  config=c).copy_to_host() for c in (FEW_PAIRS_CONFIG, config))
        assert not np.isnan(other).any()
        assert np.array_equal(few.view(np.uint32), other.view(np.uint32)), f"d={d} f={f}"


@pytest.mark.sim
def test_transposed_word_swaps_a_chunks_quarter_and_word_and_is_its_own_inverse():
    word_at = getattr(transposed_word, "py_func", transposed_word)  # (a device function on a GPU)
    words = np.arange(48)
    moved = np.array([word_at(w) for w in words])
    assert sorted(moved) == list(words) and all(word_at(m) == w for w, m in zip(words, moved))
    # quarter 2 j + h of a chunk: the pairs lanes tq = 0..3 give k-step j as B word h (columns 8 tq + 4 j + 2 h)
    for chunk, j, h in ((0, 0, 0), (0, 1, 1), (2, 0, 1)):
        quarter = [w for w in words if moved[w] // 4 == 4 * chunk + 2 * j + h]
        assert [2 * (w % 16) for w in sorted(quarter, key=lambda w: moved[w])] == [8 * tq + 4 * j + 2 * h
                                                                                  for tq in range(4)]


@pytest.mark.sim
@pytest.mark.parametrize("d, f, shared_totals, overlap", [(96, 160, False, False), (128, 64, False, False),
                                                           (96, 160, True, False), (128, 64, True, True),
                                                           (96, 160, False, True)])
def test_wgmma_kernels_give_the_few_pairs_bits(d, f, shared_totals, overlap):
    """The wgmma kernels (one warpgroup a block, the simulator's wgmma: mma_bf16 over the tokens in shared memory)
    at 16 tokens a pass, one expert holding all 37 tokens (three passes, the last partly empty): d = 96, f = 160
    (K's chunks not whole stages: one chunk a stage; gate_up's third block and down's block partly past f and d),
    and d = 128, f = 64 (gate_up two chunks a stage); the K split's totals in registers or in shared memory (each
    pass overwrites the last pass's); a stage's wgmma running on under the next stage's fragment loads (overlap:
    three stages, the slot refilled two stages back): FEW_PAIRS_CONFIG's bits for every token."""
    skip_without_wgmma(WgmmaConfig())
    rng = np.random.default_rng(21)
    s = 37
    x, ids, weights, gate_up, down = random_case(rng, s, d, f, 4, 2, one_expert_for_all=True)
    gate_up_d, down_d = on_device(gate_up, down)
    wgmma = WgmmaConfig(16, 2 + overlap, 2, shared_totals, overlap)
    few, other = (moe_experts(x, ids, weights, gate_up_d, down_d, out=poisoned((s, d)), tensor_cores=True,
                              config=c).copy_to_host() for c in (FEW_PAIRS_CONFIG, wgmma))
    assert not np.isnan(other).any()
    assert np.array_equal(few.view(np.uint32), other.view(np.uint32)), f"max |diff| {np.abs(few - other).max():.3g}"


@pytest.mark.sim
@pytest.mark.parametrize("per_stage", [1, 2, 4])
def test_wgmma_token_copies_fill_each_place_once_by_whole_sectors(per_stage):
    """The wgmma kernels' token copies at every pass size: piece p lands at quarter * n + token (the layout the
    descriptors read), every place of the slot once; pieces 2m and 2m + 1 are one token's 32-byte sector (quarters
    2q, 2q + 1); each warp's 32 stores of 16 bytes cover every 16-byte bank group 4 times (4 wavefronts, no more)."""
    from kdspec.numba_kernels.moe.experts_wgmma import token_piece, token_piece_offset
    threads = WgmmaConfig.threads
    for n in range(8, 129, 8):
        pieces = 4 * per_stage * n
        places = []
        for tid in range(threads):
            for i in range(-(-pieces // threads)):
                piece = tid + i * threads
                if piece < pieces:
                    token, quarter = token_piece(piece, n)
                    assert 0 <= token < n and 0 <= quarter < 4 * per_stage
                    assert tid + token_piece_offset(tid, i, n, threads) == quarter * n + token, (n, tid, i)
                    places.append(quarter * n + token)
        assert sorted(places) == list(range(pieces)), n
        for piece in range(0, pieces, 2):
            (token, quarter), (next_token, next_quarter) = token_piece(piece, n), token_piece(piece + 1, n)
            assert next_token == token and quarter % 2 == 0 and next_quarter == quarter + 1
        for warp_first in range(0, pieces, 32):
            groups = [(quarter * n + token) % 8
                      for token, quarter in (token_piece(p, n) for p in range(warp_first, warp_first + 32))]
            assert sorted(groups) == sorted(list(range(8)) * 4), (n, warp_first)


@pytest.mark.sim
def test_launch_shapes_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="warps_t"):
        StagedConfig(0, 4, 2)
    with pytest.raises(ValueError, match="k_split"):
        TcConfig(9, 1)
    with pytest.raises(ValueError, match="weight_tiles"):
        StagedConfig(2, 2, 2, 3)  # gate_up splits a warp's weight tiles into gate and up halves
    with pytest.raises(ValueError, match="shared memory"):
        StagedConfig(4, 4, 8, 8, 16)  # 16 stages of 512 weight rows and 256 tokens: 768 KB
    with pytest.raises(ValueError, match="chunks_per_stage"):
        StagedConfig(2, 2, 2, 2, 4, 0)
    with pytest.raises(ValueError, match="tokens"):
        WgmmaConfig(12)  # a wgmma's N: a multiple of 8
    with pytest.raises(ValueError, match="shared memory"):
        WgmmaConfig(128, 16, 4)
    with pytest.raises(ValueError, match="shared memory"):
        WgmmaConfig(128, 6, 2, True)  # 192 KB of stages fit alone; 64 KB of totals after them do not
    with pytest.raises(ValueError, match="shared_totals"):
        WgmmaConfig(64, 4, 2, 2)
    with pytest.raises(ValueError, match="with overlap 3"):
        WgmmaConfig(64, 2, 2, False, True)  # a slot being read, one in flight and one filling
    with pytest.raises(ValueError, match="multiple of 16"):
        fragment_layout(np.zeros((2, 24, 64), np.uint16))


@pytest.mark.sim
def test_tensor_core_experts_reject_what_they_cannot_run():
    rng = np.random.default_rng(0)
    x, ids, weights, gate_up, down = random_case(rng, 2, 48, 32, 3, 2)  # d = 48: not whole 32-column chunks
    assert not supports(48, 32) and supports(64, 32)
    with pytest.raises(ValueError, match="multiples of 32"):  # (fragment_layout refuses such weights too)
        moe_experts(x, ids, weights, cuda.to_device(gate_up), cuda.to_device(down), tensor_cores=True)
    with pytest.raises(ValueError, match="bf16 weights"):
        fp32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
        x, ids, weights, gate_up, down = random_case(rng, 2, 64, 32, 3, 2)
        moe_experts(x, ids, weights, fp32(gate_up), fp32(down), tensor_cores=True)


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 8, 16, 32, 256])  # every expert gets s pairs: each launch shape of tc_config_for
def test_k2_dims_tensor_core_experts(s):
    rng = np.random.default_rng(s)
    x, ids, weights, gate_up, down = random_case(rng, s, 7168, 2048, 8, 8 if s > 1 else 4)
    together = run(x, ids, weights, gate_up, down)
    tokens = sorted({0, s // 2, s - 1})
    # K = 7168 summed in the mma's fp32 and a rare act rounded to the other bf16 neighbour: 2e-3 of max |y|
    assert_close(together[tokens], reference(x, ids, weights, gate_up, down, tokens), 2e-3)
    assert_tokens_alone_equal(x, ids, weights, gate_up, down, together, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [StagedConfig(5, 2, 2, 2, 3, 2), StagedConfig(4, 2, 4, 4, 3),
                                    StagedConfig(4, 3, 2, 4, 4, 2), StagedConfig(4, 4, 2, 2, 4, 2), WgmmaConfig(),
                                    WgmmaConfig(64, 4, 2, True, True)], ids=str)
def test_k2_dims_other_staged_shapes_give_the_few_pairs_bits(config):
    """Candidates for MANY_PAIRS_CONFIG (two chunks a stage; warps of 32 tokens x 64 rows; 12 and 16 warps a block;
    the wgmma kernels, also with shared totals and overlap)
    compiled for the GPU at Kimi K2's d and f (224 and 64 chunks: whole stages), 64 tokens on 8 experts:
    FEW_PAIRS_CONFIG's bits."""
    skip_without_wgmma(config)
    rng = np.random.default_rng(64)
    x, ids, weights, gate_up, down = random_case(rng, 64, 7168, 2048, 8, 8)
    assert config.stage_fits(7168 // 32) and config.stage_fits(2048 // 32)
    gate_up_d, down_d = on_device(gate_up, down)
    few, other = (moe_experts(x, ids, weights, gate_up_d, down_d, out=poisoned(x.shape), tensor_cores=True,
                              config=c).copy_to_host() for c in (FEW_PAIRS_CONFIG, config))
    assert not np.isnan(other).any()
    assert np.array_equal(few.view(np.uint32), other.view(np.uint32)), f"max |diff| {np.abs(few - other).max():.3g}"
