"""Routed experts on the tensor cores: experts.py's grouped SwiGLU with bf16 activations and weights (bf16 compute).

The same plan, buffers and combine as experts.py (read it first); only the products differ:
    gate_up: act[row, i] = bf16(silu(gate_i . bf16(x_t)) * (up_i . bf16(x_t)))   (row: a sorted pair, t its token)
    down:    pair_out[pair, j] = down_j . act[row]
Each product is an mma.sync m16n8k16 bf16 with fp32 accumulation (mma.py's mma_bf16) with the weights as the A
operand (16 weight rows, a "weight tile") and the tokens as B (8 tokens, a "token tile"), so one token costs an
8-token tile, not a 16-row one. x is rounded to bf16 once (nearest even) by ``_round_to_bf16``, into pair_out's
storage, which down only writes after gate_up has read it; gate_up writes act as bf16 into the first half of act's
storage.

The K order. K runs in 32-column chunks of two mma k-steps each. Lane (g, tq) (lane = 4 g + tq) gives step j the
columns 8 tq + 4 j .. 8 tq + 4 j + 3 (logical k 2tq, 2tq + 1 are the first two, k 2tq + 8, 2tq + 9 the last two):
a token's 16-byte load of its columns 8 tq .. 8 tq + 7 is its B fragments of both steps as they are, without moving
a register. The weights are stored in the matching order (``fragment_layout``, done once when they are loaded):
per 16-row tile and chunk, 1 KB = step 0's then step 1's A fragments, lane by lane, 16 bytes each, so a lane's
16-byte load is one step's whole A fragment, and a warp's load reads 512 contiguous bytes.

Two kinds of kernels run those products. The streaming kernels (TcConfig, tc_kernels) load the weights straight
into registers, the best when the weights are the traffic (few pairs an expert): a block of k_split warps owns two
weight tiles (gate_up: 16 gate rows and the 16 matching up rows; down: 32 output rows); warp q sums its own
contiguous share of K's chunks, and the block adds the k_split partial sums in warp order (through shared memory),
so even a one-token launch has k_split x as many warps streaming weights. The next step's weights (chunks_per_step
chunks) are loaded while this one's mma run, and every token tile's B fragments of a chunk before any tile's mma.
Up to n_tiles token tiles share each weight load (a pass); tiles past the expert's pairs are skipped, and an expert
with more pairs takes several passes. The staged kernels (StagedConfig, staged_kernels) copy a block's weight
tiles and its pass's tokens into shared memory by cp.async, so a block's warps share each load, and one warp walks
all of K for its tiles (many pairs an expert); each pass is a block of its own. Their lanes load the same fragments
from shared memory as the streaming lanes do from global memory.
experts_wgmma.py runs the staged kernels' work on Hopper's asynchronous wgmma (WgmmaConfig), with the same bits.
tc_config_for picks by the mean number of pairs per active expert: FEW_PAIRS_CONFIG (streaming, one tile) up to
FEW_PAIRS, MID_PAIRS_CONFIG (streaming, three tiles) up to MID_PAIRS, MANY_PAIRS_CONFIG (staged, 64 tokens a pass)
up to MANY_PAIRS, else MOST_PAIRS_CONFIG (staged, 128 tokens a pass) (figures: BENCHMARKS.md; probe under k2-mini's
own routing: python3 tools/experts_probe.py --model-routing 255 --time ...).

Batch invariance: a pair's result depends only on its activation row, the weights and the fixed K order and
split, not on which tile or lane it sits in nor on how many pairs the expert has (each output column of an mma
is its own token's), nor on the launch shape: every shape feeds each mma the same products in the same k-steps
and sums K in the same K_SPLIT shares, added in share order (a streaming block's warps through shared memory; a
staged warp into its running total), so s = 1 and s = 256 give a token the same bits whichever shape each runs.
Requirements: bf16 weights (uint16 / int16 bits) in fragment_layout, d and f multiples of 32, every array 16-byte
aligned.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import device_address
from kdspec.numba_kernels.intrinsics import at2, at2_put
from kdspec.numba_kernels.moe.experts import ExpertPlan, load_u64x2, load_u64x2_flat, silu
from kdspec.numba_kernels.mma import (BF16_SCRATCH_PER_WARP, MAX_SHARED_BYTES, WARP, address_units, copy16_at,
                                      copy_commit, copy_wait, float_bits, global_address, mma_bf16, opt_in_shared,
                                      shared_address)
from kdspec.numba_kernels.runtime import (INLINE_DEVICE, ON_SIMULATOR, device_function, row_blocks,
                                          static_for)

CHUNK = 32                                # K columns a chunk: two mma k-steps, 4 lanes x 8 columns
TILE_ROWS = 16                            # weight rows of a tile: the mma's M
TILE_WORDS = TILE_ROWS * CHUNK * 2 // 8   # uint64 of one tile's chunk in fragment_layout (1 KB)
STEP_WORDS = TILE_WORDS // 2              # uint64 of one k-step's A fragments (32 lanes x 16 bytes)
CONVERT_THREADS = 32 if ON_SIMULATOR else 256
STAGE_ALIGNMENT = None if ON_SIMULATOR else 16  # 16-byte fragment loads from shared (the simulator takes none)


def fragment_layout(w):
    """The weights in the order the kernels load them: w bf16 bits [..., rows, cols] (a numpy array, or a torch
    tensor on the GPU; rows a multiple of 16, cols of 32) -> a new array of the same shape and type whose memory
    holds, for each 16-row tile (rows 16 t ..) and 32-column chunk (columns 32 c ..) in turn, 1 KB: for k-step j =
    0, 1, for lane = 4 g + tq = 0 .. 31, the 4 words of its A fragment, each word a pair of adjacent columns:
        word 0: row g,     columns 32 c + 8 tq + 4 j, + 1      word 1: row g + 8, the same columns
        word 2: row g,     columns 32 c + 8 tq + 4 j + 2, + 3  word 3: row g + 8, the same columns
    (row 16 t + 8 h + g, column 32 c + 8 tq + 4 j + 2 q + b goes to [t, c, j, g, tq, q, h, b])."""
    *lead, rows, cols = w.shape
    if rows % TILE_ROWS or cols % CHUNK:
        raise ValueError(f"fragment_layout: rows ({rows}) must be a multiple of {TILE_ROWS} and columns ({cols}) of "
                         f"{CHUNK}")
    split = w.reshape(*lead, rows // TILE_ROWS, 2, 8, cols // CHUNK, 4, 2, 2, 2)  # t, h, g, c, tq, j, q, b
    axes = tuple(range(len(lead))) + tuple(len(lead) + axis for axis in (0, 3, 5, 2, 4, 6, 1, 7))
    moved = split.permute(*axes) if hasattr(split, "permute") else split.transpose(axes)  # torch or numpy
    return moved.reshape(w.shape)


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

    @property
    def tokens_per_pass(self) -> int:
        return 8 * self.n_tiles

    def rows_per_block(self, gate_up: bool) -> int:
        """Intermediate rows (gate_up: their gate and up rows) or output rows (down) a block computes."""
        return TILE_ROWS if gate_up else 2 * TILE_ROWS

    def kernels(self):
        return tc_kernels(self)


def whole_stages(n_chunks: int, chunks_per_stage: int) -> bool:
    """Whether a K of n_chunks chunks and its K_SPLIT shares are whole stages of chunks_per_stage chunks (else the
    launcher runs a staged config with one chunk a stage: the same bits)."""
    share = -(-n_chunks // K_SPLIT)
    return n_chunks % chunks_per_stage == 0 and share % chunks_per_stage == 0


@dataclass(frozen=True)
class StagedConfig:
    """Launch shape of the staged kernels (staged_kernels): warps_t x warps_w warps, each owning token_tiles
    8-token tiles x weight_tiles 16-row weight tiles (gate_up: the first half gate tiles, the second the matching
    up tiles). The block's weight tiles and its pass's tokens reach (dynamic) shared memory by cp.async,
    chunks_per_stage 32-column chunks at a time (one barrier a stage) and ``stages`` stages deep (stages - 1 in
    flight), so the warps of a token row share each weight load and the warps of a weight column each token load
    (many pairs an expert: the products are the work)."""

    warps_t: int
    warps_w: int
    token_tiles: int = 2
    weight_tiles: int = 2
    stages: int = 4
    chunks_per_stage: int = 1
    max_registers: int = 0

    def __post_init__(self):
        if not (1 <= self.warps_t <= 8 and 1 <= self.warps_w <= 8 and self.warps_t * self.warps_w <= 16
                and 1 <= self.token_tiles <= 8 and self.weight_tiles in (2, 4, 6, 8) and 2 <= self.stages <= 32
                and 1 <= self.chunks_per_stage <= 8 and self.max_registers >= 0):
            raise ValueError(f"StagedConfig: warps_t {self.warps_t} (1..8), warps_w {self.warps_w} (1..8, at most "
                             f"16 warps), token_tiles {self.token_tiles} (1..8), weight_tiles {self.weight_tiles} "
                             f"(2, 4, 6 or 8), stages {self.stages} (2..32), chunks_per_stage "
                             f"{self.chunks_per_stage} (1..8), max_registers {self.max_registers}")
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(f"StagedConfig: {self.shared_bytes} bytes of shared memory (at most "
                             f"{MAX_SHARED_BYTES})")

    @property
    def threads(self) -> int:
        return self.warps_t * self.warps_w * WARP

    @property
    def tokens_per_pass(self) -> int:
        return 8 * self.token_tiles * self.warps_t

    @property
    def staged_tiles(self) -> int:
        return self.weight_tiles * self.warps_w

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.chunks_per_stage * (self.staged_tiles * TILE_ROWS + self.tokens_per_pass) * CHUNK * 2

    def stage_fits(self, n_chunks: int) -> bool:
        return whole_stages(n_chunks, self.chunks_per_stage)

    def rows_per_block(self, gate_up: bool) -> int:
        return TILE_ROWS * self.staged_tiles // (2 if gate_up else 1)

    def kernels(self):
        return staged_kernels(self)


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch shape of the wgmma kernels (experts_wgmma.py, sm_90a): one warpgroup a block, its 4 warps each owning
    two 16-row weight tiles (gate_up: a gate tile and its up tile, 64 intermediate rows a block; down: 32 adjacent
    output rows, 128 a block) against a pass of ``tokens`` tokens, staged into shared memory as StagedConfig's
    are, chunks_per_stage chunks at a time, ``stages`` deep. Runs where a caller passes it (grouped_swiglu_tc's
    ``config``), not by tc_config_for's choice: on an H100 and an H200 it gave the staged kernels' bits and no more
    speed; neither kernel is bound by L2, DRAM or the tensor pipe, both by their own latencies (BENCHMARKS.md,
    "The H200 bench at 1f73c61")."""

    tokens: int = 64
    stages: int = 4
    chunks_per_stage: int = 2
    # the K split's running totals in shared memory, not in registers: half the accumulator registers, so that a
    # pass can hold more tokens (fewer L2 bytes a FLOP); the same sums in the same order
    shared_totals: bool = False
    # a stage's wgmma runs on while the next stage's copies are waited for and its fragments load (into a second
    # set of registers): the slot refilled is the one read two stages back, so stages - 2 are copied ahead
    overlap: bool = False

    def __post_init__(self):
        if not (self.tokens % 8 == 0 and 8 <= self.tokens <= 128 and 2 + self.overlap <= self.stages <= 16
                and 1 <= self.chunks_per_stage <= 4 and self.shared_totals in (False, True)
                and self.overlap in (False, True)):
            raise ValueError(f"WgmmaConfig: tokens {self.tokens} (a multiple of 8 in 8..128), stages {self.stages} "
                             f"(2..16, with overlap 3..16), chunks_per_stage {self.chunks_per_stage} (1..4), "
                             f"shared_totals {self.shared_totals} and overlap {self.overlap} (bools)")
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(f"WgmmaConfig: {self.shared_bytes} bytes of shared memory (at most {MAX_SHARED_BYTES})")

    threads = 4 * WARP
    staged_tiles = 8  # 16-row weight tiles a block stages: two a warp

    @property
    def tokens_per_pass(self) -> int:
        return self.tokens

    @property
    def slot_bytes(self) -> int:
        """A stage's slot: its weight tiles, then its tokens (bf16)."""
        return self.chunks_per_stage * (self.staged_tiles * TILE_ROWS + self.tokens) * CHUNK * 2

    @property
    def shared_bytes(self) -> int:
        totals = self.threads * self.tokens * 4 if self.shared_totals else 0  # fp32, a thread's 2 tiles x N / 2
        return self.stages * self.slot_bytes + totals

    def stage_fits(self, n_chunks: int) -> bool:
        return whole_stages(n_chunks, self.chunks_per_stage)

    def rows_per_block(self, gate_up: bool) -> int:
        return TILE_ROWS * self.staged_tiles // (2 if gate_up else 1)

    def kernels(self):
        from kdspec.numba_kernels.moe.experts_wgmma import wgmma_kernels  # (it imports this module's helpers)
        return wgmma_kernels(self)


CONFIG_TYPES = (TcConfig, StagedConfig, WgmmaConfig)
STAGED_TYPES = (StagedConfig, WgmmaConfig)  # shared-memory stages: dynamic shared memory, passes as work items

# Launch shapes by the mean number of pairs an active expert gets (tc_config_for). Every kind sums K in the same
# K_SPLIT shares (fixing the bits: see the module docstring), so a token gets the same bits whichever runs it: the
# choice may follow the token count without breaking batch invariance. The simulator runs every thread in
# Python: few warps (the K split and its sum still run). On the GPU the streaming shapes take as many 8-token
# tiles as a typical expert's pairs fill in one pass, and as many chunks a load step as the registers hold
# (figures: BENCHMARKS.md, "Launch shapes by pairs an expert").
K_SPLIT = 2 if ON_SIMULATOR else 4
FEW_PAIRS_CONFIG = TcConfig(K_SPLIT, 1, 2 if ON_SIMULATOR else 4)  # AR and small trees: one tile, 4 chunks a step
MID_PAIRS_CONFIG = TcConfig(K_SPLIT, 2 if ON_SIMULATOR else 3, 1 if ON_SIMULATOR else 2)  # 24 tokens a pass
# 64 tokens x 192 weight rows a block: the tokens a block re-reads through L2 each K chunk cost as much as its
# weights at 64 rows a block; two chunks a stage halve the barriers and the copies' address work per mma
MANY_PAIRS_CONFIG = StagedConfig(1, 2, 2, 2, 2) if ON_SIMULATOR else StagedConfig(4, 2, 2, 6, 4, 2)
# 128 tokens x 128 rows: k2-mini's router gives its busiest experts 100-250 pairs at s = 256, which then stream
# their weights in half as many passes
MOST_PAIRS_CONFIG = StagedConfig(1, 2, 4, 2, 2) if ON_SIMULATOR else StagedConfig(4, 2, 4, 4, 4, 2)
FEW_PAIRS = 6    # mean pairs per active expert up to which FEW_PAIRS_CONFIG runs (K2 at s = 256: 5.3)
MID_PAIRS = 12   # ... MID_PAIRS_CONFIG (k2-mini at s = 64: 16; s = 128: 32; s = 256: 64)
MANY_PAIRS = 24  # ... MANY_PAIRS_CONFIG, else MOST_PAIRS_CONFIG


def tc_config_for(n_pairs: int, n_experts: int) -> TcConfig | StagedConfig:
    """The launch shape for n_pairs (token, expert) pairs over n_experts experts."""
    mean_pairs = n_pairs / max(1, min(n_experts, n_pairs))
    for most, config in ((FEW_PAIRS, FEW_PAIRS_CONFIG), (MID_PAIRS, MID_PAIRS_CONFIG),
                         (MANY_PAIRS, MANY_PAIRS_CONFIG)):
        if mean_pairs <= most:
            return config
    return MOST_PAIRS_CONFIG


@device_function(**INLINE_DEVICE)
def bf16_rne(x):
    """float32 x rounded to bf16 (nearest even): the 16 bits, as uint32."""
    bits = uint32(float_bits(x))
    return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16)


@device_function(**INLINE_DEVICE)
def transposed_word(word):
    """Where bf16 pair ``word`` of a row goes in the wgmma kernels' token layout: inside each 32-column chunk (16
    words), word 4 a + b goes to 4 b + a. Then the chunk's 16-byte quarter 2 j + h holds the columns that k-step j
    of the K order (module docstring) gives lanes tq = 0..3 as their B words h (k 2tq, 2tq + 1; then 2tq + 8, 2tq
    + 9): one row of a wgmma core matrix, so a token's quarter is copied whole (experts_wgmma.py). Its own inverse."""
    within = word % 16
    return word - within + 4 * (within % 4) + within // 4


@kernel_cache.jit
def _round_to_bf16(x, x_bits, transposed):
    """x_bits[t, i] = bf16(x[t, 2i]) | bf16(x[t, 2i + 1]) << 16, at word transposed_word(i) when transposed. x
    float32 [s, d]; x_bits uint32 [s, d/2]. Grid (ceil(d/2 / CONVERT_THREADS), row_blocks(s))."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x_bits.shape[1]:
        to = transposed_word(i) if transposed else i
        t = cuda.blockIdx.y
        while t < x.shape[0]:
            at2_put(x_bits, t, to, bf16_rne(at2(x, t, 2 * i)) | (bf16_rne(at2(x, t, 2 * i + 1)) << uint32(16)))
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
    """out[at .. at + 3] = the 8 bf16 of a[i, row, columns 8 word .. 8 word + 7] as 4 uint32 pairs when valid; else
    as load_fragment. a: bf16 viewed as uint64 [n, rows, cols / 4]."""
    if valid:
        first, second = load_u64x2(a, i, row, word)
        _split_words(first, second, out, at)
    elif ON_SIMULATOR:
        _split_words(uint64(0), uint64(0), out, at)


@device_function(**INLINE_DEVICE)
def load_fragment(w, index, valid, out, at):
    """out[at .. at + 3] = the 16 bytes at w[index], w[index + 1] as 4 uint32 (w uint64 1-D, shared or global,
    index even) when valid; else zeros under the simulator (whose mma every warp runs) and nothing on the GPU
    (whose kernels skip that mma): one lane's A fragment of one k-step (fragment_layout), or a token's 8 columns
    of the lane (both k-steps' B fragments)."""
    if valid:
        first, second = load_u64x2_flat(w, index)
        _split_words(first, second, out, at)
    elif ON_SIMULATOR:
        _split_words(uint64(0), uint64(0), out, at)


@device_function(**INLINE_DEVICE)
def load_weight_chunk(w, at_a, at_b, chunk, valid, out, at):
    """out[at + 8 m + 4 j ..]: weight tile m's (at_a's, then at_b's) A fragment of k-step j of chunk ``chunk``
    (load_fragment's when not valid). w: fragment_layout bf16 as uint64 1-D; at_*: the tile's chunk 0 plus 2
    lane."""
    offset = int64(TILE_WORDS) * chunk
    load_fragment(w, at_a + offset, valid, out, at)
    load_fragment(w, at_a + offset + STEP_WORDS, valid, out, at + 4)
    load_fragment(w, at_b + offset, valid, out, at + 8)
    load_fragment(w, at_b + offset + STEP_WORDS, valid, out, at + 12)


@device_function(**INLINE_DEVICE)
def _mma_step(acc, o, a, at, b0, b1, scratch):
    """acc[o .. o + 3] += one k-step: A = a[at .. at + 3] (one lane's fragment), B = b0, b1."""
    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_bf16(
        a[at], a[at + 1], a[at + 2], a[at + 3], b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3], scratch)


@device_function(**INLINE_DEVICE)
def tile_products(acc, n, n_tiles, weights, at, b, scratch):
    """Token tile n's two k-steps of both weight tiles: A = the chunk's fragments at weights[at ..]
    (load_weight_chunk's layout), B = the tile's 4 bf16 pairs at b[4 n ..], into acc[4 n ..] (first weight tile)
    and acc[4 (n_tiles + n) ..]."""
    _mma_step(acc, 4 * n, weights, at, b[4 * n], b[4 * n + 1], scratch)
    _mma_step(acc, 4 * n, weights, at + 4, b[4 * n + 2], b[4 * n + 3], scratch)
    _mma_step(acc, 4 * (n_tiles + n), weights, at + 8, b[4 * n], b[4 * n + 1], scratch)
    _mma_step(acc, 4 * (n_tiles + n), weights, at + 12, b[4 * n + 2], b[4 * n + 3], scratch)


@device_function(**INLINE_DEVICE)
def zero_accumulator(o, acc):
    acc[o] = float32(0.0)


@device_function(**INLINE_DEVICE)
def fold_share(o, args):
    """The staged kernels' K split: total[o] = the first share's sum acc[o], then total[o] + each later share's, in
    share order (the order in which tc_kernels adds its warps' partial sums); acc[o] zeroed. args: (acc, total,
    first)."""
    acc, total, first = args
    total[o] = acc[o] if first else total[o] + acc[o]
    acc[o] = float32(0.0)


@device_function(**INLINE_DEVICE)
def locate_item(item, actives, expert_offsets, active_experts, tokens_per_pass, passes, found):
    """The staged kernels' work item ``item``: (its expert's index among the actives, the items of the experts
    before it), or (actives, all items) past the last. A work item is one pass of tokens_per_pass of an expert's
    sorted pairs, items in active-expert order, so that a launch's blocks (grid y, work_items) run an expert's
    passes side by side, not one after another in one block. The block's threads read the experts' pair counts
    side by side (a serial scan's dependent loads would cost a block microseconds) into ``passes`` (int32 shared,
    one a thread), thread 0 sums them into ``found`` (int32 shared [2]). Every thread calls it (it syncs)."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    first = 0
    items_before = 0
    while first < actives:  # block-uniform
        if first + tid < actives:
            expert = active_experts[first + tid]
            passes[tid] = (expert_offsets[expert + 1] - expert_offsets[expert] + tokens_per_pass - 1) // tokens_per_pass
        cuda.syncthreads()  # every count in passes
        if tid == 0:
            hit, before, j = -1, items_before, 0
            while j < min(width, actives - first):
                if item < before + passes[j]:
                    hit = j
                    break
                before += passes[j]
                j += 1
            found[0], found[1] = hit, before
        cuda.syncthreads()  # found written
        hit, items_before = found[0], found[1]
        cuda.syncthreads()  # found and passes read before the next round (or the next item) writes them
        if hit >= 0:
            return first + hit, items_before
        first += width
    return actives, items_before


@device_function(**INLINE_DEVICE)
def locate_pass(item, actives, expert_offsets, active_experts, tokens_per_pass, passes, found):
    """Work item ``item``'s pass (locate_item's arguments; every thread calls it): (its expert, its first sorted pair,
    the expert's end), expert -1 past the last item."""
    active, items_before = locate_item(item, actives, expert_offsets, active_experts, tokens_per_pass, passes, found)
    if active >= actives:
        return int32(-1), int32(0), int32(0)
    expert = active_experts[active]
    return (int32(expert), int32(expert_offsets[expert] + (item - items_before) * tokens_per_pass),
            int32(expert_offsets[expert + 1]))


@device_function(**INLINE_DEVICE)
def share_stages(n_chunks, per_stage):
    """A staged kernel's walk over K's n_chunks chunks, per_stage a stage: (stages inside K, stages a K_SPLIT share,
    stages walked: K_SPLIT shares, the last padded past K as the streaming kernels' last warp is), int32 (64-bit
    counters cost two instructions each in an issue-bound loop)."""
    share = int32((n_chunks + K_SPLIT - 1) // K_SPLIT // per_stage)
    return int32(n_chunks // per_stage), share, int32(share * K_SPLIT)


def work_items(config, max_active: int, n_pairs: int) -> int:
    """Grid rows (y) of a launch: a streaming block loops over the active experts; a staged launch has at most
    one row a work item (locate_item): each of n active experts has a pair, so its ceil(p / T) passes are at most
    1 + (p - 1) // T; summed, n + (n_pairs - n) // T, which grows with n."""
    if isinstance(config, STAGED_TYPES):
        return max_active + (n_pairs - max_active) // config.tokens_per_pass
    return max_active


@functools.lru_cache(maxsize=None)
def store_functions(weight_tiles: int, token_tiles: int, transposed: bool = False):
    """(store_act_all, store_down_all) for a warp's weight_tiles x token_tiles C fragments, accumulator 4 (n
    token_tiles + m) + c holding entry c of weight tile n x token tile m (c: weight row g + 8 (c >> 1), token 2 tq
    + (c & 1)). store_act_all((acc, act_bits, base, end, first_column, f)): act = bf16(silu(gate) * up) of pair rows
    base + .. and intermediate columns first_column + .. (the first weight_tiles / 2 tiles are gate rows, the rest
    the matching up rows; act column c at 2 transposed_word(c / 2) + c % 2 when transposed: the wgmma down kernel's
    layout); store_down_all((acc, pair_out, sorted_pairs, base, end, first_column)): pair_out rows of the sorted
    pairs base + .., columns first_column + .. ."""
    up_offset = 4 * (weight_tiles // 2) * token_tiles

    def store_act(o, args):
        """act for gate accumulator o (o < up_offset) and its up accumulator o + up_offset."""
        acc, act_bits, base, end, first_column, f = args
        lane = cuda.threadIdx.x % WARP
        g, tq = lane >> 2, lane & 3
        n, m, c = o // (4 * token_tiles), (o // 4) % token_tiles, o % 4
        row = base + 8 * m + 2 * tq + (c & 1)
        column = first_column + TILE_ROWS * n + g + 8 * (c >> 1)
        if row < end and column < f:
            if transposed:
                column = 2 * transposed_word(column >> 1) + (column & 1)
            act_bits[row, column] = uint16(bf16_rne(silu(acc[o]) * acc[o + up_offset]))

    def store_down(o, args):
        """pair_out[pair, j] for accumulator o."""
        acc, pair_out, sorted_pairs, base, end, first_column = args
        lane = cuda.threadIdx.x % WARP
        g, tq = lane >> 2, lane & 3
        n, m, c = o // (4 * token_tiles), (o // 4) % token_tiles, o % 4
        row = base + 8 * m + 2 * tq + (c & 1)
        column = first_column + TILE_ROWS * n + g + 8 * (c >> 1)
        if row < end and column < pair_out.shape[1]:
            pair_out[sorted_pairs[row], column] = acc[o]

    return (static_for(up_offset, device_function(**INLINE_DEVICE)(store_act)),
            static_for(4 * weight_tiles * token_tiles, device_function(**INLINE_DEVICE)(store_down)))


@functools.lru_cache(maxsize=None)
def tc_kernels(config: TcConfig):
    """(gate_up, down) kernels for one launch shape. Accumulators per lane: 2 weight tiles x n_tiles x 4."""
    k_split, n_tiles, per_step = config.k_split, config.n_tiles, config.chunks_per_step
    acc_size = 2 * n_tiles * 4
    weight_words = 16 * per_step  # uint32 per lane per buffer: 2 weight tiles x 2 k-steps x a 4-word A fragment
    tile_words = 4 * n_tiles      # uint32 per lane: each token tile's 4 bf16 pairs of a chunk
    scratch_size = k_split * BF16_SCRATCH_PER_WARP if ON_SIMULATOR else 1
    partials_size = max(1, (k_split - 1) * acc_size * WARP)  # warps 1 .. k_split - 1's partial sums
    jit_options = dict(max_registers=config.max_registers) if config.max_registers and not ON_SIMULATOR else {}

    def load_tile(n, args):
        """Token tile n's B fragment of one chunk into tiles[4 n ..]; past the pass's pairs load_words loads nothing
        on the GPU: those columns reach only outputs never stored (each output of an mma is its own token's)."""
        tokens, source_rows, word, valid, n_used, tiles = args
        load_words(tokens, 0, source_rows[n], word, valid and n < n_used and source_rows[n] >= 0, tiles, 4 * n)

    def tile_mma(n, args):
        """Token tile n's two k-steps of both weight tiles, the chunk's weights at weights[at ..]."""
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

    zero_all = static_for(acc_size, zero_accumulator)

    def load_chunk(i, args):
        """Chunk chunk + i of a step into weights[16 i ..] (zeros past the warp's share of K)."""
        w, at_a, at_b, chunk, end, weights = args
        this = int32(chunk + i)  # (numba widens int32 sums to int64: the loop is issue-bound)
        load_weight_chunk(w, at_a, at_b, this, this < end, weights, 16 * i)

    def mma_chunk(i, args):
        """The mma of chunk chunk + i of a step, in chunk order; none past the warp's share of K (warp-uniform),
        but under the simulator, whose mma syncs the block: there every warp runs it, on zeros."""
        acc, weights, tokens, source_rows, chunk, end, n_used, b, scratch = args
        this = int32(chunk + i)
        if ON_SIMULATOR or this < end:
            chunk_mma((acc, weights, 16 * i, tokens, source_rows, int32(4 * this + (cuda.threadIdx.x & 3)), this < end,
                       n_used, b, scratch))

    load_step = static_for(per_step, device_function(**INLINE_DEVICE)(load_chunk))
    mma_step = static_for(per_step, device_function(**INLINE_DEVICE)(mma_chunk))

    @device_function(**INLINE_DEVICE)
    def products(acc, w, at_a, at_b, n_chunks, tokens, source_rows, n_used, weights_a, weights_b, b, scratch):
        """acc = this warp's share of K of both weight tiles x the pass's token tiles (module docstring's order), the
        next step's weights loaded under this step's mma. Warp q's share is chunks q * share .. (q + 1) * share
        - 1 whatever chunks_per_step is, so configs with one k_split give the same bits. Every warp runs the
        same number of steps; a step's chunks past the share (or past K) are skipped (under the simulator, whose
        mma syncs the block, they add zeros: the same sums)."""
        # 32-bit counters: numba's int64 ones cost two instructions each in an issue-bound loop
        k_chunks = int32(n_chunks)
        share = int32((k_chunks + k_split - 1) // k_split)
        first = int32(cuda.threadIdx.x // WARP * share)
        end = int32(min(first + share, k_chunks))
        steps = int32((share + per_step - 1) // per_step)
        zero_all(acc)
        load_step((w, at_a, at_b, first, end, weights_a))
        step = int32(0)
        while step < steps:
            chunk = int32(first + step * per_step)
            if step + 1 < steps:
                load_step((w, at_a, at_b, int32(chunk + per_step), end, weights_b))
            mma_step((acc, weights_a, tokens, source_rows, chunk, end, n_used, b, scratch))
            if step + 1 < steps:
                if step + 2 < steps:
                    load_step((w, at_a, at_b, int32(chunk + 2 * per_step), end, weights_a))
                mma_step((acc, weights_b, tokens, source_rows, int32(chunk + per_step), end, n_used, b, scratch))
            step = int32(step + 2)

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

    store_act_all, store_down_all = store_functions(2, n_tiles)
    tokens_per_pass = config.tokens_per_pass

    def make_kernel(gate_up: bool):
        """gate_up (act = silu(gate) * up, 16 intermediate rows a block) or down (pair_out, 32 output rows a
        block): the same passes, the kernel's kind a compile-time constant."""
        rows_per_block = config.rows_per_block(gate_up)

        @kernel_cache.jit(**jit_options)
        def kernel(tokens, w, w_tiles, n_chunks, f, k, expert_offsets, sorted_pairs, active_experts, n_active,
                   out):
            """Every sorted row of every active expert. gate_up: tokens = bf16 x [s, d] viewed as uint64
            [1, s, d/4]; w = bf16 w_gate_up [e, 2f, d] in fragment_layout as uint64 1-D; w_tiles = 2f / 16 (tiles
            an expert); n_chunks = d / 32; out = act bits uint16 [P, >= f]; grid (f / 16, row_blocks(max active)).
            down: tokens = bf16 act viewed as uint64 [1, P, >= f/4]; w = bf16 w_down [e, d, f] in fragment_layout
            as uint64 1-D; w_tiles = d / 16; n_chunks = f / 32; f, k unused; out = pair_out float32 [P, d]; grid
            (d / 32, row_blocks(max active)). k_split * 32 threads."""
            scratch = cuda.shared.array(scratch_size, float32)
            partials = cuda.shared.array(partials_size, float32)
            acc = cuda.local.array(acc_size, float32)
            weights_a = cuda.local.array(weight_words, uint32)
            weights_b = cuda.local.array(weight_words, uint32)
            b = cuda.local.array(tile_words, uint32)  # the pass's B fragments of one chunk
            source_rows = cuda.local.array(n_tiles, int32)
            first_row = cuda.blockIdx.x * rows_per_block
            tile_a = first_row // TILE_ROWS
            tile_b = (f + first_row) // TILE_ROWS if gate_up else tile_a + 1  # gate_up: the matching up rows
            lane_word = 2 * (cuda.threadIdx.x % WARP)
            for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform: the block syncs
                expert = active_experts[active]
                begin = expert_offsets[expert]
                end = expert_offsets[expert + 1]
                at_a = (int64(expert) * w_tiles + tile_a) * n_chunks * TILE_WORDS + lane_word
                at_b = (int64(expert) * w_tiles + tile_b) * n_chunks * TILE_WORDS + lane_word
                for base in range(begin, end, tokens_per_pass):
                    pass_rows((source_rows, base, end, sorted_pairs, k, gate_up))
                    n_used = min(n_tiles, (end - base + 7) // 8)
                    products(acc, w, at_a, at_b, n_chunks, tokens, source_rows, n_used, weights_a, weights_b, b,
                             scratch)
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
def staged_kernels(config: StagedConfig):
    """(gate_up, down) staged kernels for one StagedConfig: the same products, in the same K order, as tc_kernels.

    A block copies, per stage of chunks_per_stage 32-column chunks, its weight tiles' 1 KB a chunk each
    (fragment_layout, where a tile's chunks follow one another; gate_up: its staged_tiles / 2 gate tiles, then the
    matching up tiles) and then the pass's tokens (64 bytes a chunk each) into one slot of shared memory. Lane (g,
    tq) loads each of its weight tiles' A fragments (16 bytes a k-step, at 16 lane) and each of its token tiles' B
    fragments (token g's columns 8 tq .. 8 tq + 7: both k-steps), every load whole 16 bytes and every word where
    the mma takes it. One warp walks all of K for its tiles: it sums each of the K_SPLIT shares in fresh
    accumulators and adds share q's sum into the total after share q - 1's, the order in which tc_kernels adds
    its warps' partial sums; a share padded past K skips its chunks there, as the streaming warps do. The launcher
    runs a config whose chunks_per_stage does not divide K's chunks and the share as one chunk a stage (stage_fits),
    so that a stage is all in one share and all inside K or all past it. A block runs one pass a work item (grid y,
    work_items, locate_item): the passes of an expert with many pairs are blocks of their own, side by side."""
    token_tiles, weight_tiles, stages = config.token_tiles, config.weight_tiles, config.stages
    warps_w, threads, per_stage = config.warps_w, config.threads, config.chunks_per_stage
    staged_tiles, tokens_per_pass = config.staged_tiles, config.tokens_per_pass
    half_tiles = weight_tiles // 2
    tile_words = TILE_WORDS * per_stage  # uint64 of one weight tile's stage; a token's is 8 per_stage
    weight_words = tile_words * staged_tiles  # uint64 of a slot's weight tiles; its tokens follow
    slot_words = weight_words + 8 * per_stage * tokens_per_pass
    acc_size = 4 * weight_tiles * token_tiles
    a_words, b_words = 8 * weight_tiles, 4 * token_tiles  # uint32 per lane: A fragments (2 k-steps a tile), B
    tile_pieces, token_pieces = tile_words // 2, 4 * per_stage  # 16-byte copies of a tile's / a token's stage
    weight_copies = -(-tile_pieces * staged_tiles // threads)  # 16-byte copies per thread per stage
    token_copies = -(-token_pieces * tokens_per_pass // threads)
    scratch_size = threads // WARP * BF16_SCRATCH_PER_WARP if ON_SIMULATOR else 1
    jit_options = dict(max_registers=config.max_registers) if config.max_registers and not ON_SIMULATOR else {}
    wait_for_stage = copy_wait(stages - 2)
    zero_all = static_for(acc_size, zero_accumulator)

    word = address_units(8)  # a uint64's step in a copy16_at address
    piece_step = 2 * word * threads  # from this thread's copy i to its copy i + 1: threads 16-byte pieces on
    weight_pieces = tile_pieces * staged_tiles

    def copy_weight_piece(i, args):
        """This thread's weight copy i of a stage: piece tid + i threads of the slot's weight tiles (the slot's
        16-byte pieces in order), weight_from[i] the address of its stage 0."""
        slots, slot_at, w, weight_from, stage_offset = args
        if (i + 1) * threads <= weight_pieces or cuda.threadIdx.x + i * threads < weight_pieces:
            copy16_at(slots, slot_at + i * piece_step, w, weight_from[i] + stage_offset)

    def copy_token_piece(i, args):
        """This thread's token copy i of a stage (the pieces after the weight tiles'), none past the pass's pairs
        (valid_pieces: the pass's pairs' pieces): the slot's earlier bytes there reach only outputs never stored,
        as each output of an mma is its own token's."""
        slots, slot_at, tokens, token_from, stage_offset, valid_pieces = args
        if cuda.threadIdx.x + i * threads < valid_pieces:
            copy16_at(slots, slot_at + i * piece_step, tokens, token_from[i] + stage_offset)

    copy_weight_pieces = static_for(weight_copies, device_function(**INLINE_DEVICE)(copy_weight_piece))
    copy_token_pieces = static_for(token_copies, device_function(**INLINE_DEVICE)(copy_token_piece))

    @device_function(**INLINE_DEVICE)
    def copy_stage(slots, slot_at, stage, w, weight_from, tokens, token_from, valid_token_pieces):
        """Stage ``stage`` (inside K) of the block's weight tiles and the pass's tokens into the slot whose first
        piece of this thread is at slot_at. Every address is a register plus an offset: the loop is bound by its
        instructions and latencies, and an array index costs the array's base each copy (mma.global_address)."""
        copy_weight_pieces((slots, slot_at, w, weight_from, int64(stage) * (tile_words * word)))
        copy_token_pieces((slots, slot_at + weight_words * word, tokens, token_from,
                           int64(stage) * (8 * per_stage * word), valid_token_pieces))

    def load_weight_tile(n, args):
        """Weight tile n's A fragments of both k-steps of the chunk at ``at`` into a[8 n ..] (step j at 8 n + 4 j)."""
        slots, at, tile_at, a = args
        load_fragment(slots, at + tile_at[n], True, a, 8 * n)
        load_fragment(slots, at + tile_at[n] + STEP_WORDS, True, a, 8 * n + 4)

    def load_token_tile(m, args):
        """Token tile m's B fragments of both k-steps (token 8 m + g's 8 columns of the lane) into b[4 m ..]."""
        slots, at, b = args
        load_fragment(slots, at + 64 * per_stage * m, True, b, 4 * m)

    def tile_mma(i, args):
        """k-step j = i / (weight_tiles token_tiles) of weight tile n x token tile m (every tile's step 0 before any
        step 1: the two steps of one accumulator are the only dependent mma)."""
        acc, a, b, scratch = args
        j, n, m = i // (weight_tiles * token_tiles), (i // token_tiles) % weight_tiles, i % token_tiles
        o = 4 * (n * token_tiles + m)
        acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_bf16(
            a[8 * n + 4 * j], a[8 * n + 4 * j + 1], a[8 * n + 4 * j + 2], a[8 * n + 4 * j + 3], b[4 * m + 2 * j],
            b[4 * m + 2 * j + 1], acc[o], acc[o + 1], acc[o + 2], acc[o + 3], scratch)

    load_weight_tiles = static_for(weight_tiles, device_function(**INLINE_DEVICE)(load_weight_tile))
    load_token_tiles = static_for(token_tiles, device_function(**INLINE_DEVICE)(load_token_tile))
    chunk_mma = static_for(2 * weight_tiles * token_tiles, device_function(**INLINE_DEVICE)(tile_mma))

    def chunk_products(u, args):
        """Chunk u of the stage in slot words ``at``: its fragments, then its mma."""
        slots, at, tile_at, token_lane_at, acc, a, b, scratch = args
        load_weight_tiles((slots, at + TILE_WORDS * u, tile_at, a))
        load_token_tiles((slots, at + token_lane_at + 8 * u, b))
        chunk_mma((acc, a, b, scratch))

    stage_products = static_for(per_stage, device_function(**INLINE_DEVICE)(chunk_products))

    fold_all = static_for(acc_size, fold_share)
    store_act_all, store_down_all = store_functions(weight_tiles, token_tiles)

    def make_kernel(gate_up: bool):
        rows_per_block = config.rows_per_block(gate_up)
        tiles_per_block = rows_per_block // TILE_ROWS  # gate_up: gate tiles (each with its up tile)

        @kernel_cache.jit(**jit_options)
        def kernel(tokens, w, w_tiles, n_chunks, f, k, expert_offsets, sorted_pairs, active_experts, n_active,
                   out):
            """Arguments and output as tc_kernels' kernels (n_chunks and the share whole stages: stage_fits);
            grid (ceil(f / rows_per_block(True)) (gate_up) or ceil(d / rows_per_block(False)) (down),
            row_blocks(work_items(...))); config.threads threads."""
            slots = cuda.shared.array(0, uint64, alignment=STAGE_ALIGNMENT)  # [stages, slot_words], dynamic
            scratch = cuda.shared.array(scratch_size, float32)
            item_passes = cuda.shared.array(threads, int32)
            item_found = cuda.shared.array(2, int32)
            acc = cuda.local.array(acc_size, float32)
            total = cuda.local.array(acc_size, float32)
            a = cuda.local.array(a_words, uint32)
            b = cuda.local.array(b_words, uint32)
            tile_at = cuda.local.array(weight_tiles, int32)  # where in a slot each weight tile's lane fragment is
            weight_from = cuda.local.array(weight_copies, int64)  # the stage-0 address of each copy (copy_stage)
            token_from = cuda.local.array(token_copies, int64)
            first_slot_at = shared_address(slots, 2 * cuda.threadIdx.x)  # this thread's first piece of slot 0
            warp = cuda.threadIdx.x // WARP
            ww, wt = warp % warps_w, warp // warps_w
            lane = cuda.threadIdx.x % WARP
            first_row = cuda.blockIdx.x * rows_per_block
            first_tile = cuda.blockIdx.x * tiles_per_block
            for n in range(weight_tiles):
                if gate_up:  # gate tiles, then the matching up tiles staged_tiles / 2 tiles on
                    staged = half_tiles * ww + n % half_tiles + (staged_tiles // 2 if n >= half_tiles else 0)
                else:
                    staged = weight_tiles * ww + n
                tile_at[n] = int32(tile_words * staged + 2 * lane)
            warp_column = first_row + TILE_ROWS * (half_tiles if gate_up else weight_tiles) * ww
            first_token = 8 * token_tiles * wt
            token_lane_at = int32(weight_words + 8 * per_stage * (first_token + (lane >> 2)) + 2 * (lane & 3))
            token_words = tokens.shape[2]
            k_stages, share, n_stages = share_stages(n_chunks, per_stage)
            # one pass a work item (locate_item): the passes of an expert with many pairs run side by side in blocks
            # of their own, not one after another in one block (the launch's tail; the weights read again)
            item = cuda.blockIdx.y
            actives = n_active[0]
            while True:  # block-uniform: the block syncs
                expert, base, end = locate_pass(item, actives, expert_offsets, active_experts, tokens_per_pass,
                                                item_passes, item_found)
                if expert < 0:
                    break
                for i in range(weight_copies):
                    piece = cuda.threadIdx.x + i * threads
                    staged = piece // tile_pieces  # the slot's weight tile
                    if gate_up:
                        tile = first_tile + staged % tiles_per_block  # its gate tile
                        valid = tile < f // TILE_ROWS
                        source = tile + (f // TILE_ROWS if staged >= tiles_per_block else 0)
                    else:
                        source = first_tile + staged
                        valid = source < w_tiles
                    if not valid:
                        # a tile past f or d copies the block's first tile again (from L2, not memory): its rows
                        # reach only outputs never stored, as each output of an mma is its own row's
                        source = first_tile
                    weight_from[i] = global_address(w, (int64(expert) * w_tiles + source) * n_chunks * TILE_WORDS
                                                    + 2 * (piece % tile_pieces))
                for i in range(token_copies):
                    piece = cuda.threadIdx.x + i * threads
                    pair = min(base + piece // token_pieces, end - 1)  # (copied only inside the pass's pairs)
                    token_from[i] = global_address(tokens, (sorted_pairs[pair] // k if gate_up else pair) * token_words
                                                   + 2 * (piece % token_pieces))
                valid_token_pieces = int32(min(end - base, tokens_per_pass) * token_pieces)
                has_tokens = base + first_token < end
                for stage in range(stages - 1):  # prologue: stages - 1 stages in flight
                    if stage < k_stages:
                        copy_stage(slots, first_slot_at + stage * (slot_words * word), int32(stage), w, weight_from,
                                   tokens, token_from, valid_token_pieces)
                    copy_commit()  # (an empty group keeps the count uniform)
                zero_all(acc)
                slot, fill_slot, share_left, first_share = int32(0), int32(stages - 1), int32(share), True
                stage = int32(0)
                while stage < n_stages:
                    wait_for_stage()
                    cuda.syncthreads()  # every thread's copies landed; the slot refilled next is read
                    if int32(stage + stages - 1) < k_stages:  # (numba widens int32 sums to int64)
                        copy_stage(slots, first_slot_at + fill_slot * (slot_words * word), int32(stage + stages - 1),
                                   w, weight_from, tokens, token_from, valid_token_pieces)
                    copy_commit()
                    fill_slot = int32(0) if fill_slot == stages - 1 else int32(fill_slot + 1)
                    # a share padded past K skips its stages there, as the streaming warps do; a warp past the
                    # pass's pairs skips them all (warp-uniform; the simulator's mma syncs the block)
                    if stage < k_stages and (ON_SIMULATOR or has_tokens):
                        stage_products((slots, int32(slot * slot_words), tile_at, token_lane_at, acc, a, b,
                                        scratch))
                    slot = int32(0) if slot == stages - 1 else int32(slot + 1)
                    share_left = int32(share_left - 1)
                    if share_left == 0:
                        fold_all((acc, total, first_share))
                        first_share, share_left = False, int32(share)
                    stage = int32(stage + 1)
                if gate_up:
                    store_act_all((total, out, base + first_token, end, warp_column, f))
                else:
                    store_down_all((total, out, sorted_pairs, base + first_token, end, warp_column))
                cuda.syncthreads()  # the next pass's prologue refills the slots
                item += cuda.gridDim.y
        return kernel

    return make_kernel(True), make_kernel(False)


def supports(d: int, f: int) -> bool:
    """Whether the tensor-core kernels take these dimensions (whole 32-column chunks of both products)."""
    return d % CHUNK == 0 and f % CHUNK == 0


@functools.lru_cache(maxsize=None)
def runs_wgmma() -> bool:
    """Whether the wgmma kernels run here: on Hopper (compute capability 9.x), or as their model under the
    simulator (asked once: the launcher checks it every launch of a WgmmaConfig)."""
    return ON_SIMULATOR or cuda.get_current_device().compute_capability[0] == 9


def grouped_swiglu_tc(x, k, plan: ExpertPlan, w_gate_up, w_down, act, pair_out, stream=0, config=None):
    """experts.grouped_swiglu on the tensor cores. Arguments already checked as there, plus: bf16 weight views
    (weight_view) of weights in fragment_layout, C-contiguous; d and f multiples of 32; x, act, pair_out and the
    weights 16-byte aligned; act and pair_out C-contiguous (their storage also holds bf16 act and bf16 x).
    ``config``: a TcConfig, StagedConfig or (on Hopper, sm_90) WgmmaConfig (default: tc_config_for)."""
    if isinstance(config, WgmmaConfig) and not runs_wgmma():
        raise ValueError(f"the wgmma experts need a Hopper GPU (compute capability 9.x), not "
                         f"{'.'.join(map(str, cuda.get_current_device().compute_capability))}")
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
    config = config or tc_config_for(plan.sorted_pairs.shape[0], plan.expert_counts.shape[0])
    _round_to_bf16[(math.ceil(d // 2 / CONVERT_THREADS), row_blocks(s)), CONVERT_THREADS, stream](
        x, x_bits, isinstance(config, WgmmaConfig))
    gate_up_config, down_config = (_staged_fit(config, d // CHUNK), _staged_fit(config, f // CHUNK))
    gate_up_tc, down_tc = gate_up_config.kernels()[0], down_config.kernels()[1]
    act_bits = act.view(np.uint16)  # [P, 2f]: bf16 act in the first f columns
    _launch(gate_up_config, gate_up_tc, -(-f // config.rows_per_block(True)), work_items(config, max_active, n_pairs),
            stream,
            x_bits.view(np.uint64).reshape(1, s, d // 4), _flat_words(gate_view), 2 * f // TILE_ROWS, d // CHUNK, f, k,
            plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active, act_bits)
    _launch(down_config, down_tc, -(-d // config.rows_per_block(False)), work_items(config, max_active, n_pairs),
            stream,
            act.view(np.uint64).reshape(1, n_pairs, f // 2), _flat_words(down_view), d // TILE_ROWS, f // CHUNK, 0, 1,
            plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active, pair_out)


def _staged_fit(config, n_chunks: int):
    """config for a product of n_chunks chunks: a StagedConfig whose stages do not fit them takes one chunk a stage."""
    if isinstance(config, STAGED_TYPES) and not config.stage_fits(n_chunks):
        return replace(config, chunks_per_stage=1)
    return config


def _flat_words(view):
    """A C-contiguous bf16 weight view [e, rows, cols] as uint64 1-D (the kernels index fragment_layout's tiles)."""
    if not view.is_c_contiguous():
        raise ValueError("tensor-core experts: the weights must be C-contiguous")
    words = view.view(np.uint64)
    return words.reshape(words.size)


def _launch(config, kernel, row_blocks_x: int, items: int, stream, *args) -> None:
    """kernel over (row_blocks_x, row_blocks(items)) blocks of config.threads, with a staged config's dynamic
    shared memory (above 48 KB the compiled kernel must opt in first: opt_in_shared)."""
    shared = config.shared_bytes if isinstance(config, STAGED_TYPES) else 0
    opt_in_shared(kernel, args, shared)
    kernel[(row_blocks_x, row_blocks(items)), config.threads, stream, shared](*args)
