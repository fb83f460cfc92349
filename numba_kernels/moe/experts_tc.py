"""Routed experts on the tensor cores: experts.py's grouped SwiGLU with bf16 activations and weights (bf16 compute).

The same plan, buffers and combine as experts.py (read it first); only the products differ:
    gate_up: act[row, i] = bf16(silu(gate_i . bf16(x_t)) * (up_i . bf16(x_t)))   (row: a sorted pair, t its token)
    down:    pair_out[pair, j] = down_j . act[row]
Each product is an mma.sync m16n8k16 bf16 with fp32 accumulation (mma.py's mma_bf16) with the weights as the A
operand (16 weight rows) and the tokens as B (8 tokens a tile), so one token costs an 8-token tile, not a 16-row
one. x is rounded to bf16 once (nearest even) by ``_round_to_bf16``, into pair_out's storage, which down only
writes after gate_up has read it; gate_up writes act as bf16 into the first half of act's storage.

A block of k_split warps owns 32 weight rows (gate_up: 16 gate rows and the 16 matching up rows; down: 32 output
rows). Warp q sums its own contiguous share of K's 32-column chunks, and the block adds the k_split partial sums
in warp order (through shared memory), so even a one-token launch has k_split x as many warps streaming weights.
In a chunk, lane (g, tq) (lane = 4 g + tq) loads columns 8 tq .. 8 tq + 7 (one 16-byte load) of weight rows g and
g + 8 of each m-tile and of token g of each 8-token tile; the chunk's two mma k-steps take them in a fixed
permuted order (step j: logical k 2tq, 2tq + 1 are columns 8 tq + 4 j, + 1; k 2tq + 8, 2tq + 9 are 8 tq + 4 j + 2,
+ 3; A and B alike), so no shared memory is needed for the operands. The next step's weights (chunks_per_step
chunks) are loaded while this one's mma run, and every token tile's B fragments of a chunk are loaded before any
tile's mma. Up to n_tiles token tiles share each weight load (a pass); tiles past the expert's pairs are skipped,
and an expert with more pairs takes several passes.

Two kinds of kernels run those products. The streaming kernels (TcConfig, tc_kernels) are the above: weights
straight into registers, the best when the weights are the traffic (few pairs an expert). The staged kernels
(TokenTiledConfig, token_tiled_kernels) stage a block's weight rows and its pass's tokens in shared memory by
cp.async, so a block's warps share each load, and one warp walks all of K for its tiles (many pairs an expert);
they give the mma the tokens as A (16 tokens a tile) and the weights as B, which the staged rows' 16-byte loads
feed without moving registers.
tc_config_for picks by the mean number of pairs per active expert: FEW_PAIRS_CONFIG (streaming, one tile) up to
FEW_PAIRS, MID_PAIRS_CONFIG (streaming, three tiles) up to MID_PAIRS, MORE_PAIRS_CONFIG (streaming, four tiles) up
to MORE_PAIRS, else MANY_PAIRS_CONFIG (staged) (figures: BENCHMARKS.md; sweep: python3 -m tools.sweeps.moe
--tensor-cores --graphs).

Batch invariance: a pair's result depends only on its activation row, the weights and the fixed K order and
split, not on which tile or lane it sits in nor on how many pairs the expert has (each output column of an mma
is its own token's), nor on the launch shape: every shape feeds each mma the same products in the same k order
(the staged kernels with A and B swapped, which the tensor cores sum alike) and sums K in the same K_SPLIT shares,
added in share order (a streaming block's warps through shared memory; a staged warp into
its running total), so s = 1 and s = 256 give a token the same bits whichever shape each runs.
Requirements: bf16 weights (uint16 / int16 bits), d and f multiples of 32, every array 16-byte aligned.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import device_address
from kdspec.numba_kernels.intrinsics import at2, at2_put
from kdspec.numba_kernels.moe.experts import ExpertPlan, load_u64x2, load_u64x2_flat, silu
from kdspec.numba_kernels.mma import (BF16_SCRATCH_PER_WARP, MAX_SHARED_BYTES, WARP, allow_dynamic_shared, copy16,
                                      copy_commit, copy_wait, float_bits, mma_bf16)
from kdspec.numba_kernels.runtime import (INLINE_DEVICE, ON_SIMULATOR, SHARED_LIMIT, device_function, row_blocks,
                                          static_for)

CHUNK = 32                                # K columns per step: 4 lanes x 8 columns
BLOCK_ROWS = 32                           # weight rows per block: two m-tiles of 16
CONVERT_THREADS = 32 if ON_SIMULATOR else 256
STAGE_ALIGNMENT = None if ON_SIMULATOR else 16  # 16-byte fragment loads from shared (the simulator takes none)


@dataclass(frozen=True)
class TcConfig:
    """Launch shape of the streaming kernels (tc_kernels): each warp of a block sums its own share of K with the
    weights loaded straight into registers (few pairs an expert: the weights are the traffic)."""

    k_split: int             # warps per block, each summing its own share of K (fixes the bits: see below)
    n_tiles: int             # 8-token tiles per pass (register-blocked): tokens per pass = 8 n_tiles
    chunks_per_step: int = 1  # 32-column chunks loaded together; two steps in flight
    max_registers: int = 0   # per-thread register cap for the compiler (0: none)

    def __post_init__(self):
        if not (1 <= self.k_split <= 8 and 1 <= self.n_tiles <= 8 and 1 <= self.chunks_per_step <= 4
                and self.max_registers >= 0):
            raise ValueError(f"TcConfig: k_split {self.k_split} (1..8), n_tiles {self.n_tiles} (1..8), "
                             f"chunks_per_step {self.chunks_per_step} (1..4), max_registers {self.max_registers}")

    @property
    def threads(self) -> int:
        return self.k_split * WARP

    def rows_per_block(self, gate_up: bool) -> int:
        """Intermediate rows (gate_up: their gate and up rows) or output rows (down) a block computes."""
        return 16 if gate_up else BLOCK_ROWS

    def kernels(self):
        return tc_kernels(self)


@dataclass(frozen=True)
class TokenTiledConfig:
    """Launch shape of the staged kernels with the tokens as the mma's A operand (token_tiled_kernels): warps_t x
    warps_w warps, each owning token_tiles 16-token tiles x weight_tiles 8-row weight tiles (gate_up: the first
    half gate rows, the second the matching up rows). The block's weight rows and its pass's tokens reach (dynamic)
    shared memory by cp.async, one 32-column chunk at a time and ``stages`` chunks deep (stages - 1 in flight), so
    the warps of a token row share each weight load and the warps of a weight column each token load (many pairs
    an expert: the products are the work)."""

    warps_t: int
    warps_w: int
    token_tiles: int = 2
    weight_tiles: int = 4
    stages: int = 4
    max_registers: int = 0

    def __post_init__(self):
        if not (1 <= self.warps_t <= 8 and 1 <= self.warps_w <= 8 and self.warps_t * self.warps_w <= 16
                and 1 <= self.token_tiles <= 4 and self.weight_tiles in (2, 4, 6, 8) and 2 <= self.stages <= 32
                and self.max_registers >= 0):
            raise ValueError(f"TokenTiledConfig: warps_t {self.warps_t} (1..8), warps_w {self.warps_w} (1..8, at most "
                             f"16 warps), token_tiles {self.token_tiles} (1..4), weight_tiles {self.weight_tiles} "
                             f"(2, 4, 6 or 8), stages {self.stages} (2..32), max_registers {self.max_registers}")
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(f"TokenTiledConfig: {self.shared_bytes} bytes of shared memory (at most "
                             f"{MAX_SHARED_BYTES})")

    @property
    def threads(self) -> int:
        return self.warps_t * self.warps_w * WARP

    @property
    def tokens_per_pass(self) -> int:
        return 16 * self.token_tiles * self.warps_t

    @property
    def staged_rows(self) -> int:
        return 8 * self.weight_tiles * self.warps_w

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.staged_rows + self.tokens_per_pass) * CHUNK * 2

    def rows_per_block(self, gate_up: bool) -> int:
        return self.staged_rows // 2 if gate_up else self.staged_rows

    def kernels(self):
        return token_tiled_kernels(self)


CONFIG_TYPES = (TcConfig, TokenTiledConfig)

# Launch shapes by the mean number of pairs an active expert gets (tc_config_for). Every kind sums K in the same
# K_SPLIT shares (fixing the bits: see the module docstring), so a token gets the same bits whichever runs it: the
# choice may follow the token count without breaking batch invariance. The simulator runs every thread in
# Python: few warps (the K split and its sum still run). On the GPU the streaming shapes take as many 8-token
# tiles as a typical expert's pairs fill in one pass, and as many chunks a load step as the registers hold
# (figures: BENCHMARKS.md, "Launch shapes by pairs an expert").
K_SPLIT = 2 if ON_SIMULATOR else 4
FEW_PAIRS_CONFIG = TcConfig(K_SPLIT, 1, 2 if ON_SIMULATOR else 4)  # AR and small trees: one tile, 4 chunks a step
MID_PAIRS_CONFIG = TcConfig(K_SPLIT, 2 if ON_SIMULATOR else 3, 1 if ON_SIMULATOR else 2)  # 24 tokens a pass
MORE_PAIRS_CONFIG = TcConfig(K_SPLIT, 2 if ON_SIMULATOR else 4, 2)  # 32 tokens a pass
MANY_PAIRS_CONFIG = TokenTiledConfig(1, 2, 1, 2, 2) if ON_SIMULATOR else TokenTiledConfig(5, 2, 1, 4, 4)  # 80 a pass
FEW_PAIRS = 6    # mean pairs per active expert up to which FEW_PAIRS_CONFIG runs (K2 at s = 256: 5.3)
MID_PAIRS = 20   # ... MID_PAIRS_CONFIG (k2-mini at s = 64: 16)
MORE_PAIRS = 40  # ... MORE_PAIRS_CONFIG (k2-mini at s = 128: 32), else MANY_PAIRS_CONFIG (s = 256: 64)


def tc_config_for(n_pairs: int, n_experts: int) -> TcConfig | TokenTiledConfig:
    """The launch shape for n_pairs (token, expert) pairs over n_experts experts."""
    mean_pairs = n_pairs / max(1, min(n_experts, n_pairs))
    for most, config in ((FEW_PAIRS, FEW_PAIRS_CONFIG), (MID_PAIRS, MID_PAIRS_CONFIG),
                         (MORE_PAIRS, MORE_PAIRS_CONFIG)):
        if mean_pairs <= most:
            return config
    return MANY_PAIRS_CONFIG


@device_function(**INLINE_DEVICE)
def bf16_rne(x):
    """float32 x rounded to bf16 (nearest even): the 16 bits, as uint32."""
    bits = uint32(float_bits(x))
    return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16)


@kernel_cache.jit
def _round_to_bf16(x, x_bits):
    """x_bits[t, i] = bf16(x[t, 2i]) | bf16(x[t, 2i + 1]) << 16. x float32 [s, d]; x_bits uint32 [s, d/2].
    Grid (ceil(d/2 / CONVERT_THREADS), row_blocks(s))."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x_bits.shape[1]:
        t = cuda.blockIdx.y
        while t < x.shape[0]:
            at2_put(x_bits, t, i, bf16_rne(at2(x, t, 2 * i)) | (bf16_rne(at2(x, t, 2 * i + 1)) << uint32(16)))
            t += cuda.gridDim.y


@device_function(**INLINE_DEVICE)
def _split_words(first, second, out, at):
    """out[at .. at + 3] = the 16 bytes first, second as 4 uint32 (bf16 pairs), lower address first."""
    out[at] = uint32(first & uint64(0xFFFFFFFF))
    out[at + 1] = uint32(first >> uint64(32))
    out[at + 2] = uint32(second & uint64(0xFFFFFFFF))
    out[at + 3] = uint32(second >> uint64(32))


@device_function(**INLINE_DEVICE)
def load_words(a, i, row, word, valid, out, at):
    """out[at .. at + 3] = the 8 bf16 of a[i, row, columns 8 word .. 8 word + 7] as 4 uint32 pairs (zeros when
    not valid). a: bf16 viewed as uint64 [n, rows, cols / 4]."""
    first, second = load_u64x2(a, i, row, word) if valid else (uint64(0), uint64(0))
    _split_words(first, second, out, at)


@device_function(**INLINE_DEVICE)
def load_staged(stage, index, out, at):
    """out[at .. at + 3] = 8 staged bf16: stage[index], stage[index + 1] (uint64 1-D, index even)."""
    first, second = load_u64x2_flat(stage, index)
    _split_words(first, second, out, at)


@device_function(**INLINE_DEVICE)
def load_weight_chunk(w, expert, row_a, row_b, word, valid, out, at):
    """out[at + 8 m + 4 h + i]: m-tile m's weight row (row_a or row_b, + 8 h), bf16 pairs i of the lane's
    columns."""
    load_words(w, expert, row_a, word, valid, out, at)
    load_words(w, expert, row_a + 8, word, valid, out, at + 4)
    load_words(w, expert, row_b, word, valid, out, at + 8)
    load_words(w, expert, row_b + 8, word, valid, out, at + 12)


@device_function(**INLINE_DEVICE)
def _mma_step(acc, o, weights, w, b0, b1, scratch):
    """acc[o .. o + 3] += one k-step: A = weights[w], [w + 4], [w + 1], [w + 5] (rows g, g + 8), B = b0, b1."""
    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_bf16(
        weights[w], weights[w + 4], weights[w + 1], weights[w + 5], b0, b1, acc[o], acc[o + 1], acc[o + 2],
        acc[o + 3], scratch)


@device_function(**INLINE_DEVICE)
def tile_products(acc, n, n_tiles, weights, at, b, scratch):
    """Token tile n's two k-steps of both m-tiles: A = the chunk's weights at weights[at ..] (load_weight_chunk's
    layout), B = the tile's 4 bf16 pairs at b[4 n ..], into acc[4 n ..] (first m-tile) and acc[4 (n_tiles + n) ..]."""
    _mma_step(acc, 4 * n, weights, at, b[4 * n], b[4 * n + 1], scratch)
    _mma_step(acc, 4 * n, weights, at + 2, b[4 * n + 2], b[4 * n + 3], scratch)
    _mma_step(acc, 4 * (n_tiles + n), weights, at + 8, b[4 * n], b[4 * n + 1], scratch)
    _mma_step(acc, 4 * (n_tiles + n), weights, at + 10, b[4 * n + 2], b[4 * n + 3], scratch)


@device_function(**INLINE_DEVICE)
def _zero(o, acc):
    acc[o] = float32(0.0)


@functools.lru_cache(maxsize=None)
def store_functions(n_tiles: int):
    """(store_act_all, store_down_all) for a warp's 2 m-tiles x n_tiles token tiles of C fragments in acc:
    store_act_all((acc, act_bits, base, end, first_row, f)): act = bf16(silu(gate) * up) of pair rows base + ..
    and columns first_row + .. (the gate m-tile's rows); store_down_all((acc, pair_out, sorted_pairs, base, end,
    first_row)): pair_out rows of the sorted pairs base + .., columns first_row + .. (both m-tiles)."""
    acc_size = 2 * n_tiles * 4

    def store_act(o, args):
        """act for C-fragment entry o of the gate m-tile (o < 4 n_tiles)."""
        acc, act_bits, base, end, first_row, f = args
        lane = cuda.threadIdx.x % WARP
        g, tq = lane >> 2, lane & 3
        n, c = o // 4, o % 4
        row = base + 8 * n + 2 * tq + (c & 1)
        column = first_row + g + 8 * (c >> 1)
        if row < end and column < f:
            act_bits[row, column] = uint16(bf16_rne(silu(acc[o]) * acc[o + 4 * n_tiles]))

    def store_down(o, args):
        """pair_out[pair, j] for C-fragment entry o."""
        acc, pair_out, sorted_pairs, base, end, first_row = args
        lane = cuda.threadIdx.x % WARP
        g, tq = lane >> 2, lane & 3
        m, n, c = o // (4 * n_tiles), (o // 4) % n_tiles, o % 4
        row = base + 8 * n + 2 * tq + (c & 1)
        column = first_row + 16 * m + g + 8 * (c >> 1)
        if row < end and column < pair_out.shape[1]:
            pair_out[sorted_pairs[row], column] = acc[o]

    return (static_for(4 * n_tiles, device_function(**INLINE_DEVICE)(store_act)),
            static_for(acc_size, device_function(**INLINE_DEVICE)(store_down)))


@functools.lru_cache(maxsize=None)
def tc_kernels(config: TcConfig):
    """(gate_up, down) kernels for one launch shape. Accumulators per lane: 2 m-tiles x n_tiles x 4."""
    k_split, n_tiles, per_step = config.k_split, config.n_tiles, config.chunks_per_step
    acc_size = 2 * n_tiles * 4
    weight_words = 16 * per_step  # uint32 per lane per buffer: 2 m-tiles x rows g, g + 8 x 4 bf16 pairs a chunk
    tile_words = 4 * n_tiles      # uint32 per lane: each token tile's 4 bf16 pairs of a chunk
    scratch_size = k_split * BF16_SCRATCH_PER_WARP if ON_SIMULATOR else 1
    partials_size = max(1, (k_split - 1) * acc_size * WARP)  # warps 1 .. k_split - 1's partial sums
    jit_options = dict(max_registers=config.max_registers) if config.max_registers and not ON_SIMULATOR else {}

    def load_tile(n, args):
        """Token tile n's B fragment of one chunk into tiles[4 n ..] (zeros past the pass's tiles)."""
        tokens, source_rows, word, valid, n_used, tiles = args
        load_words(tokens, 0, source_rows[n], word, valid and n < n_used and source_rows[n] >= 0, tiles, 4 * n)

    def tile_mma(n, args):
        """Token tile n's two k-steps of both m-tiles, the chunk's weights at weights[at ..]."""
        acc, weights, at, n_used, tiles, scratch = args
        if n < n_used:  # warp-uniform: the mma needs the whole warp
            tile_products(acc, n, n_tiles, weights, at, tiles, scratch)

    # every tile's loads before any tile's mma: loads behind a branch would wait one latency per tile
    load_tiles = static_for(n_tiles, device_function(**INLINE_DEVICE)(load_tile))
    tiles_mma = static_for(n_tiles, device_function(**INLINE_DEVICE)(tile_mma))

    @device_function(**INLINE_DEVICE)
    def chunk_mma(args):
        """One chunk (weights[at ..]) against every token tile of the pass."""
        acc, weights, at, tokens, source_rows, word, valid, n_used, tiles, scratch = args
        load_tiles((tokens, source_rows, word, valid, n_used, tiles))
        tiles_mma((acc, weights, at, n_used, tiles, scratch))

    zero_all = static_for(acc_size, _zero)

    def load_chunk(i, args):
        """Chunk chunk + i of a step into weights[16 i ..] (zeros past the warp's share of K)."""
        w, expert, row_a, row_b, chunk, end, weights = args
        tq = cuda.threadIdx.x & 3
        load_weight_chunk(w, expert, row_a, row_b, 4 * (chunk + i) + tq, chunk + i < end, weights, 16 * i)

    def mma_chunk(i, args):
        """The mma of chunk chunk + i of a step, in chunk order."""
        acc, weights, tokens, source_rows, chunk, end, n_used, b, scratch = args
        tq = cuda.threadIdx.x & 3
        chunk_mma((acc, weights, 16 * i, tokens, source_rows, 4 * (chunk + i) + tq, chunk + i < end, n_used, b,
                   scratch))

    load_step = static_for(per_step, device_function(**INLINE_DEVICE)(load_chunk))
    mma_step = static_for(per_step, device_function(**INLINE_DEVICE)(mma_chunk))

    @device_function(**INLINE_DEVICE)
    def products(acc, w, expert, row_a, row_b, n_chunks, tokens, source_rows, n_used, weights_a, weights_b, b,
                 scratch):
        """acc = this warp's share of K of both m-tiles x the pass's token tiles (module docstring's order), the
        next step's weights loaded under this step's mma. Warp q's share is chunks q * share .. (q + 1) * share
        - 1 whatever chunks_per_step is, so configs with one k_split give the same bits. Every warp runs the
        same number of steps (the simulator's mma syncs the block); chunks past the share add zeros."""
        warp = cuda.threadIdx.x // WARP
        share = (n_chunks + k_split - 1) // k_split
        first = warp * share
        end = min(first + share, n_chunks)
        steps = (share + per_step - 1) // per_step
        zero_all(acc)
        load_step((w, expert, row_a, row_b, first, end, weights_a))
        for step in range(0, steps, 2):
            chunk = first + step * per_step
            if step + 1 < steps:
                load_step((w, expert, row_a, row_b, chunk + per_step, end, weights_b))
            mma_step((acc, weights_a, tokens, source_rows, chunk, end, n_used, b, scratch))
            if step + 1 < steps:
                if step + 2 < steps:
                    load_step((w, expert, row_a, row_b, chunk + 2 * per_step, end, weights_a))
                mma_step((acc, weights_b, tokens, source_rows, chunk + per_step, end, n_used, b, scratch))

    def share(o, args):
        """Warps 1 .. k_split - 1: accumulator o of this lane into shared memory."""
        acc, partials, at = args
        partials[at + o * WARP] = acc[o]

    def gather(o, args):
        """Warp 0: accumulator o plus the other warps' partial sums, in warp order."""
        acc, partials, lane = args
        total = acc[o]
        for q in range(k_split - 1):
            total += partials[(q * acc_size + o) * WARP + lane]
        acc[o] = total

    share_all = static_for(acc_size, device_function(**INLINE_DEVICE)(share))
    gather_all = static_for(acc_size, device_function(**INLINE_DEVICE)(gather))

    @device_function(**INLINE_DEVICE)
    def add_partials(acc, partials):
        """Warp 0's acc += the other warps' (fixed order); the block syncs before and after."""
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        if warp > 0:
            share_all((acc, partials, (warp - 1) * acc_size * WARP + lane))
        cuda.syncthreads()
        if warp == 0:
            gather_all((acc, partials, lane))

    def pass_row(n, args):
        """source_rows[n] = the row that token tile n of the pass loads for this lane: its token's row of x if
        by_token, else its sorted row of act; -1 past the expert's pairs."""
        source_rows, base, end, sorted_pairs, k, by_token = args
        row = base + 8 * n + ((cuda.threadIdx.x % WARP) >> 2)
        source = -1
        if row < end:
            source = sorted_pairs[row] // k if by_token else row
        source_rows[n] = source

    pass_rows = static_for(n_tiles, device_function(**INLINE_DEVICE)(pass_row))

    store_act_all, store_down_all = store_functions(n_tiles)
    tokens_per_pass = 8 * n_tiles

    def make_kernel(gate_up: bool):
        """gate_up (act = silu(gate) * up, 16 intermediate rows a block) or down (pair_out, 32 output rows a
        block): the same passes, the kernel's kind a compile-time constant."""
        rows_per_block = 16 if gate_up else BLOCK_ROWS

        @kernel_cache.jit(**jit_options)
        def kernel(tokens, w, n_chunks, f, k, expert_offsets, sorted_pairs, active_experts, n_active, out):
            """Every sorted row of every active expert. gate_up: tokens = bf16 x [s, d] viewed as uint64
            [1, s, d/4]; w = bf16 w_gate_up [e, 2f, d] viewed as uint64 [e, 2f, d/4]; n_chunks = d / 32; out = act
            bits uint16 [P, >= f]; grid (f / 16, row_blocks(max active)). down: tokens = bf16 act viewed as uint64
            [1, P, >= f/4]; w = bf16 w_down [e, d, f] as uint64 [e, d, f/4]; n_chunks = f / 32; f, k unused; out =
            pair_out float32 [P, d]; grid (d / 32, row_blocks(max active)). k_split * 32 threads."""
            scratch = cuda.shared.array(scratch_size, float32)
            partials = cuda.shared.array(partials_size, float32)
            acc = cuda.local.array(acc_size, float32)
            weights_a = cuda.local.array(weight_words, uint32)
            weights_b = cuda.local.array(weight_words, uint32)
            b = cuda.local.array(tile_words, uint32)  # the pass's B fragments of one chunk
            source_rows = cuda.local.array(n_tiles, int32)
            first_row = cuda.blockIdx.x * rows_per_block
            row_a = first_row + ((cuda.threadIdx.x % WARP) >> 2)  # rows are whole 16s: g and g + 8 exist
            row_b = f + row_a if gate_up else row_a + 16         # gate_up: the matching up rows
            for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform: the block syncs
                expert = active_experts[active]
                begin = expert_offsets[expert]
                end = expert_offsets[expert + 1]
                for base in range(begin, end, tokens_per_pass):
                    pass_rows((source_rows, base, end, sorted_pairs, k, gate_up))
                    n_used = min(n_tiles, (end - base + 7) // 8)
                    products(acc, w, expert, row_a, row_b, n_chunks, tokens, source_rows, n_used, weights_a,
                             weights_b, b, scratch)
                    add_partials(acc, partials)
                    if cuda.threadIdx.x < WARP:
                        if gate_up:
                            store_act_all((acc, out, base, end, first_row, f))
                        else:
                            store_down_all((acc, out, sorted_pairs, base, end, first_row))
                    cuda.syncthreads()  # partials are reused by the next pass
        return kernel

    gate_up_tc, down_tc = make_kernel(True), make_kernel(False)
    return gate_up_tc, down_tc


@functools.lru_cache(maxsize=None)
def token_tiled_kernels(config: TokenTiledConfig):
    """(gate_up, down) staged kernels for one TokenTiledConfig: the same products, in the same K order, as
    tc_kernels, with the operands' roles swapped. The mma computes D[token, weight row] = A (16 tokens) x B (8
    weight rows): an output element sums the same products in the same k order as tc_kernels' (weights as A), and
    the tensor cores give it the same bits either way (measured on the H200: BENCHMARKS.md, "Staged experts with
    the tokens as A").

    A block stages, per 32-column chunk, its weight rows (rows 0 .. staged_rows - 1 of a shared slot; gate_up: its
    staged_rows / 2 gate rows, then the matching up rows) and the pass's tokens (the rows after: token t of the
    pass, zeros past the expert's pairs and past K). One warp walks all of K for its tiles: it sums each of the
    K_SPLIT shares in fresh accumulators and adds share q's sum into the total after share q - 1's, the order in
    which tc_kernels adds its warps' partial sums; shares padded past K run their zero chunks as the streaming
    warps do. Lane (g, tq)'s 16-byte load of a staged
    row holds its columns 8 tq .. 8 tq + 7, that is both k-steps' words in tc_kernels' permuted order: a weight
    tile's B fragments (row g: words 2j, 2j + 1 for step j) are the loaded registers as they are; a token tile's
    A fragments take rows g and g + 8 (words 2j and 2j + 1 of each). C fragments: entry c of (token tile m,
    weight tile n) is token 16 m + g + 8 (c >> 1), weight row 8 n + 2 tq + (c & 1)."""
    token_tiles, weight_tiles, stages = config.token_tiles, config.weight_tiles, config.stages
    warps_w, threads = config.warps_w, config.threads
    staged_rows, tokens_per_pass = config.staged_rows, config.tokens_per_pass
    half_tiles = weight_tiles // 2
    slot_words = 8 * (staged_rows + tokens_per_pass)  # uint64 of a slot: 64 bytes a row
    acc_size = token_tiles * weight_tiles * 4
    a_words, b_words = 8 * token_tiles, 4 * weight_tiles  # uint32 per lane: A fragments (rows g, g + 8), B
    weight_copies = -(-4 * staged_rows // threads)  # 16-byte copies per thread per chunk: 4 a row
    token_copies = -(-4 * tokens_per_pass // threads)
    scratch_size = threads // WARP * BF16_SCRATCH_PER_WARP if ON_SIMULATOR else 1
    jit_options = dict(max_registers=config.max_registers) if config.max_registers and not ON_SIMULATOR else {}
    wait_for_chunk = copy_wait(stages - 2)
    zero_all = static_for(acc_size, _zero)

    def copy_piece(i, args):
        """Copy i of this thread's chunk pieces (a weight row's or a token row's 16 bytes): piece_at[i] is where in
        a slot it lands (-1: none for this thread), piece_from[i] the flat uint64 index of its row's first chunk
        and piece_bytes[i] 16 (or 0: zeros past the expert's pairs); the kernel sets piece_at once and the others
        once an expert (weights) or a pass (tokens), so that a chunk's copies cost one address each."""
        stage, at, source, piece_at, piece_from, piece_bytes, offset, in_k = args
        if piece_at[i] >= 0:
            copy16(stage, at + piece_at[i], source, piece_from[i] + offset, piece_bytes[i] if in_k else 0)

    copy_weight_pieces = static_for(weight_copies, device_function(**INLINE_DEVICE)(copy_piece))
    copy_token_pieces = static_for(token_copies, device_function(**INLINE_DEVICE)(copy_piece))

    @device_function(**INLINE_DEVICE)
    def copy_chunk(stage, slot, chunk, w, weight_at, weight_from, weight_bytes, tokens, token_at, token_from,
                   token_bytes, n_chunks):
        """Chunk ``chunk`` of the block's weight rows and the pass's tokens into slot ``slot`` (zeros past K)."""
        in_k = chunk < n_chunks
        offset = int64(8 * chunk) if in_k else int64(0)
        at = int32(slot * slot_words)
        copy_weight_pieces((stage, at, w, weight_at, weight_from, weight_bytes, offset, in_k))
        copy_token_pieces((stage, at, tokens, token_at, token_from, token_bytes, offset, in_k))

    def load_token_tile(m, args):
        """Token tile m's rows g and g + 8 into a[8 m ..] and a[8 m + 4 ..]."""
        stage, at, first_token, a = args
        g = (cuda.threadIdx.x % WARP) >> 2
        load_staged(stage, at + (staged_rows + first_token + 16 * m + g) * 8, a, 8 * m)
        load_staged(stage, at + (staged_rows + first_token + 16 * m + 8 + g) * 8, a, 8 * m + 4)

    def load_weight_tile(n, args):
        """Weight tile n's row g into b[4 n ..]."""
        stage, at, weight_rows, b = args
        load_staged(stage, at + weight_rows[n] * 8, b, 4 * n)

    def tile_mma(i, args):
        """k-step j = i / (token_tiles weight_tiles) of token tile m x weight tile n (every tile's step 0 before any
        step 1: the two steps of one accumulator are the only dependent mma)."""
        acc, a, b, m_used, scratch = args
        j, m, n = i // (token_tiles * weight_tiles), (i // weight_tiles) % token_tiles, i % weight_tiles
        if ON_SIMULATOR or m < m_used:  # warp-uniform; the simulator's mma syncs the block: every warp runs it
            o = 4 * (m * weight_tiles + n)
            acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_bf16(
                a[8 * m + 2 * j], a[8 * m + 4 + 2 * j], a[8 * m + 2 * j + 1], a[8 * m + 5 + 2 * j], b[4 * n + 2 * j],
                b[4 * n + 2 * j + 1], acc[o], acc[o + 1], acc[o + 2], acc[o + 3], scratch)

    load_token_tiles = static_for(token_tiles, device_function(**INLINE_DEVICE)(load_token_tile))
    load_weight_tiles = static_for(weight_tiles, device_function(**INLINE_DEVICE)(load_weight_tile))
    chunk_mma = static_for(2 * token_tiles * weight_tiles, device_function(**INLINE_DEVICE)(tile_mma))

    def fold(o, args):
        """total = the first share's sum, then total + each later share's, in share order; acc zeroed."""
        acc, total, first = args
        total[o] = acc[o] if first else total[o] + acc[o]
        acc[o] = float32(0.0)

    fold_all = static_for(acc_size, device_function(**INLINE_DEVICE)(fold))

    def store_act(o, args):
        """act = bf16(silu(gate) * up) for gate accumulator o (token tile m, gate tile n < half_tiles) and its up
        tile n + half_tiles."""
        acc, act_bits, base, end, warp_column, f = args
        lane = cuda.threadIdx.x % WARP
        g, tq = lane >> 2, lane & 3
        m, n, c = o // (4 * half_tiles), (o // 4) % half_tiles, o % 4
        gate = 4 * (m * weight_tiles + n) + c
        row = base + 16 * m + g + 8 * (c >> 1)
        column = warp_column + 8 * n + 2 * tq + (c & 1)
        if row < end and column < f:
            act_bits[row, column] = uint16(bf16_rne(silu(acc[gate]) * acc[gate + 4 * half_tiles]))

    def store_down(o, args):
        acc, pair_out, sorted_pairs, base, end, warp_row = args
        lane = cuda.threadIdx.x % WARP
        g, tq = lane >> 2, lane & 3
        m, n, c = o // (4 * weight_tiles), (o // 4) % weight_tiles, o % 4
        row = base + 16 * m + g + 8 * (c >> 1)
        column = warp_row + 8 * n + 2 * tq + (c & 1)
        if row < end and column < pair_out.shape[1]:
            pair_out[sorted_pairs[row], column] = acc[o]

    store_act_all = static_for(token_tiles * half_tiles * 4, device_function(**INLINE_DEVICE)(store_act))
    store_down_all = static_for(acc_size, device_function(**INLINE_DEVICE)(store_down))

    def make_kernel(gate_up: bool):
        rows_per_block = config.rows_per_block(gate_up)

        @kernel_cache.jit(**jit_options)
        def kernel(tokens, w, n_chunks, f, k, expert_offsets, sorted_pairs, active_experts, n_active, out):
            """Arguments and output as tc_kernels' kernels; grid (ceil(f / rows_per_block(True)) (gate_up) or
            ceil(d / rows_per_block(False)) (down), row_blocks(max active)); config.threads threads."""
            stage = cuda.shared.array(0, uint64, alignment=STAGE_ALIGNMENT)  # [stages, slot rows, 8], dynamic
            scratch = cuda.shared.array(scratch_size, float32)
            acc = cuda.local.array(acc_size, float32)
            total = cuda.local.array(acc_size, float32)
            a = cuda.local.array(a_words, uint32)
            b = cuda.local.array(b_words, uint32)
            weight_rows = cuda.local.array(weight_tiles, int32)  # staged row of each weight tile's lane row g
            weight_at = cuda.local.array(weight_copies, int32)  # copy_piece's three per copy (weights, tokens)
            weight_from = cuda.local.array(weight_copies, int64)
            weight_bytes = cuda.local.array(weight_copies, int32)
            token_at = cuda.local.array(token_copies, int32)
            token_from = cuda.local.array(token_copies, int64)
            token_bytes = cuda.local.array(token_copies, int32)
            warp = cuda.threadIdx.x // WARP
            ww, wt = warp % warps_w, warp // warps_w
            g, tq = (cuda.threadIdx.x % WARP) >> 2, cuda.threadIdx.x & 3
            first_row = cuda.blockIdx.x * rows_per_block
            w_rows, row_words, token_words = w.shape[1], w.shape[2], tokens.shape[2]
            for n in range(weight_tiles):
                if gate_up:  # gate tiles, then the matching up tiles staged_rows / 2 rows on
                    weight_rows[n] = (4 * weight_tiles * ww + 8 * (n % half_tiles) + g
                                      + (staged_rows // 2 if n >= half_tiles else 0))
                else:
                    weight_rows[n] = 8 * weight_tiles * ww + 8 * n + g
            warp_row = first_row + (4 if gate_up else 8) * weight_tiles * ww  # its first output column / row
            first_token = 16 * token_tiles * wt
            share = int32((n_chunks + K_SPLIT - 1) // K_SPLIT)
            chunks = int32(share * K_SPLIT)
            for i in range(weight_copies):  # where this thread's pieces land in a slot: the same for every pass
                piece = cuda.threadIdx.x + i * threads
                weight_at[i] = int32(2 * piece) if piece < 4 * staged_rows else int32(-1)
            for i in range(token_copies):
                piece = cuda.threadIdx.x + i * threads
                token_at[i] = int32(8 * staged_rows + 2 * piece) if piece < 4 * tokens_per_pass else int32(-1)
            active = cuda.blockIdx.y
            while active < n_active[0]:  # block-uniform: the block syncs
                expert = active_experts[active]
                begin = expert_offsets[expert]
                end = expert_offsets[expert + 1]
                for i in range(weight_copies):
                    piece = cuda.threadIdx.x + i * threads
                    row = piece >> 2  # staged row
                    if gate_up:
                        column = first_row + row % (staged_rows // 2)  # its intermediate row
                        source = column + (f if row >= staged_rows // 2 else 0)
                        valid = column < f
                    else:
                        source = first_row + row
                        valid = source < w_rows
                    weight_from[i] = (expert * w_rows + source) * row_words + 2 * (piece & 3) if valid else 0
                    weight_bytes[i] = int32(16) if valid else int32(0)
                for base in range(begin, end, tokens_per_pass):
                    for i in range(token_copies):
                        piece = cuda.threadIdx.x + i * threads
                        pair = base + (piece >> 2)
                        token_from[i] = 0
                        token_bytes[i] = int32(0)
                        if pair < end:
                            token_from[i] = ((sorted_pairs[pair] // k if gate_up else pair) * token_words
                                             + 2 * (piece & 3))
                            token_bytes[i] = int32(16)
                    m_used = min(token_tiles, max(0, (end - base - first_token + 15) // 16))
                    for chunk in range(stages - 1):  # prologue: stages - 1 chunks in flight
                        if chunk < chunks:
                            copy_chunk(stage, chunk, chunk, w, weight_at, weight_from, weight_bytes, tokens, token_at,
                                       token_from, token_bytes, n_chunks)
                        copy_commit()  # (an empty group keeps the count uniform)
                    zero_all(acc)
                    # 32-bit counters: the chunk loop is issue-bound, and 64-bit ones cost two instructions a step
                    slot, fill_slot, share_left, first_share = int32(0), int32(stages - 1), int32(share), True
                    chunk = int32(0)
                    while chunk < chunks:
                        wait_for_chunk()
                        cuda.syncthreads()  # every thread's copies landed; the slot refilled next is read
                        if chunk + stages - 1 < chunks:
                            copy_chunk(stage, fill_slot, chunk + stages - 1, w, weight_at, weight_from, weight_bytes,
                                       tokens, token_at, token_from, token_bytes, n_chunks)
                        copy_commit()
                        fill_slot = int32(0) if fill_slot == stages - 1 else int32(fill_slot + 1)
                        at = int32(slot * slot_words + 2 * tq)
                        load_token_tiles((stage, at, first_token, a))
                        load_weight_tiles((stage, at, weight_rows, b))
                        chunk_mma((acc, a, b, m_used, scratch))
                        slot = int32(0) if slot == stages - 1 else int32(slot + 1)
                        share_left = int32(share_left - 1)
                        if share_left == 0:
                            fold_all((acc, total, first_share))
                            first_share, share_left = False, int32(share)
                        chunk = int32(chunk + 1)
                    if gate_up:
                        store_act_all((total, out, base + first_token, end, warp_row, f))
                    else:
                        store_down_all((total, out, sorted_pairs, base + first_token, end, warp_row))
                    cuda.syncthreads()  # the next pass's prologue refills the slots
                active += cuda.gridDim.y
        return kernel

    return make_kernel(True), make_kernel(False)


def supports(d: int, f: int) -> bool:
    """Whether the tensor-core kernels take these dimensions (whole 32-column chunks of both products)."""
    return d % CHUNK == 0 and f % CHUNK == 0


def grouped_swiglu_tc(x, k, plan: ExpertPlan, w_gate_up, w_down, act, pair_out, stream=0, config=None):
    """experts.grouped_swiglu on the tensor cores. Arguments already checked as there, plus: bf16 weight views
    (weight_view) and d, f multiples of 32; x, act, pair_out and the weights 16-byte aligned; act and pair_out
    C-contiguous (their storage also holds bf16 act and bf16 x). ``config``: a TcConfig (default: tc_config_for)."""
    (gate_view, gate_bf16), (down_view, down_bf16) = w_gate_up, w_down
    s, d = x.shape
    n_pairs, f = act.shape
    if not (gate_bf16 and down_bf16) or not supports(d, f):
        raise ValueError(f"tensor-core experts need bf16 weights and d, f multiples of {CHUNK} (d={d}, f={f})")
    for name, array in (("x", x), ("act", act), ("pair_out", pair_out), ("w_gate_up", gate_view),
                        ("w_down", down_view)):
        if device_address(array) % 16:
            raise ValueError(f"tensor-core experts: {name} must be 16-byte aligned")
    max_active = plan.active_experts.shape[0]
    if max_active == 0:
        return
    x_bits = pair_out.reshape(n_pairs * d).view(np.uint32)[:s * d // 2].reshape(s, d // 2)
    _round_to_bf16[(math.ceil(d // 2 / CONVERT_THREADS), row_blocks(s)), CONVERT_THREADS, stream](x, x_bits)
    config = config or tc_config_for(plan.sorted_pairs.shape[0], plan.expert_counts.shape[0])
    gate_up_tc, down_tc = config.kernels()
    act_bits = act.view(np.uint16)  # [P, 2f]: bf16 act in the first f columns
    _launch(config, gate_up_tc, -(-f // config.rows_per_block(True)), max_active, stream,
            x_bits.view(np.uint64).reshape(1, s, d // 4), gate_view.view(np.uint64), d // CHUNK, f, k,
            plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active, act_bits)
    _launch(config, down_tc, -(-d // config.rows_per_block(False)), max_active, stream,
            act.view(np.uint64).reshape(1, n_pairs, f // 2), down_view.view(np.uint64), f // CHUNK, 0, 1,
            plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active, pair_out)


_OPTED_IN = set()  # (kernel id, argument types) whose compiled kernel may take its config's shared memory


def _launch(config, kernel, row_blocks_x: int, max_active: int, stream, *args) -> None:
    """kernel over (row_blocks_x, row_blocks(max_active)) blocks of config.threads, with a staged config's dynamic
    shared memory (above 48 KB the compiled kernel must opt in first: compiled here for these arguments)."""
    shared = config.shared_bytes if isinstance(config, TokenTiledConfig) else 0
    if shared > SHARED_LIMIT and not ON_SIMULATOR:  # (else no signature to work out per launch)
        signature = tuple(kernel.typeof_pyval(arg) for arg in args)
        if (id(kernel), signature) not in _OPTED_IN:
            kernel.compile(signature)
            allow_dynamic_shared(kernel, shared)
            _OPTED_IN.add((id(kernel), signature))
    kernel[(row_blocks_x, row_blocks(max_active)), config.threads, stream, shared](*args)
