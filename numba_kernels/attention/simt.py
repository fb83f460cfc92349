"""Absorbed MLA attention over the compressed cache, with a visibility bitmask for the in-flight rows.

For query token i, head h (a "row" ρ = i*h_count + h of the s*h query-head pairs):
    score[ρ, t] = (q_lat[i, h] . cache[t, :c] + q_pe[i, h] . cache[t, c:]) * scale
    o_lat[i, h] = softmax_t(score[ρ, t] over visible t) @ cache[t, :c]
Row t < P (prefix_len) is visible to all; in-flight row P + j is visible to query i when bit j of
visibility[i] is set (word j // 32, bit j % 32). Causal prefill is the lower-triangular mask, AR decode s = 1.

attention/dispatch.py's mla_attention() is the entry point of all attention kernels; this kernel runs on
older GPUs, under the simulator, or when a TileConfig / split count is given.

All heads share one key/value row per cached token (multi-query attention), so this is a flash-attention
forward of two fp32 GEMMs, S = Q[ρ, c+r] K[t, c+r]^T and O = softmax(S) K[t, :c], in SIMT registers.
Split-K (flash-decoding): block (row tile, split) runs an online softmax over its range of key rows and
writes either o_lat directly (one split) or a normalised partial plus its log-sum-exp; a merge kernel
combines the partials. A block owns `rows` query rows and walks its keys in tiles of `keys` rows; each tile
runs as a sequence of stages, each staged through one shared buffer while the next stage's global loads are
already in flight (register prefetch):
  S stages: chunks of `d_chunk` dimensions of q [rows, d] and k [keys, d], stored transposed (padded:
     conflict-free); each thread accumulates an s_rows x s_keys register tile of scores;
  softmax: mask, scale, per-row max and sum through small shared partials; probabilities p to shared;
  V stages: chunks of `v_chunk` key rows [v_chunk, c]; each thread owns an o_rows x o_cols register tile of
     o (columns strided by the column-group count: coalesced, conflict-free) and adds p @ v.
Tile sizes are a TileConfig; attention_kernel(config) builds and caches the kernel for one.
Dimension letters: s query tokens, h heads, c kv_lora_rank, r qk_rope_head_dim, t key rows.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.attention.common import (
    FEW_TOKENS,
    MAX_LATENT,
    MERGE_THREADS,
    checked_inputs,
    key_visible,
    merge_splits_kernel,
)
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.runtime import (INLINE_DEVICE, ON_SIMULATOR, SHARED_LIMIT, device_function, row_blocks,
                                          static_for)

MIN_KEYS_PER_SPLIT = 64  # one key tile: at s = 1 and 8 the H200 run was fastest with splits this short


class TileConfig(NamedTuple):
    """Launch shape of the attention kernel. threads = (rows / s_rows) * (keys / s_keys) score tiles =
    (rows / o_rows) * (MAX_LATENT / o_cols) o tiles; blocks_per_sm: how many fit an SM (for the split count)."""
    rows: int = 64           # query rows (token, head pairs) per block
    keys: int = 64           # key rows per tile
    d_chunk: int = 32        # score stage: dimensions of c + r staged at a time
    v_chunk: int = 8         # value stage: key rows staged at a time
    s_rows: int = 4          # score register tile per thread
    s_keys: int = 4
    o_cols: int = 16         # o register tile per thread: o_rows (derived) x o_cols
    threads: int = 256
    blocks_per_sm: int = 1
    fastmath: bool = False
    max_registers: Optional[int] = None

    @property
    def o_rows(self) -> int:
        return self.rows * (MAX_LATENT // self.o_cols) // self.threads

    def shared_floats(self) -> tuple[int, int]:
        """(stage buffer, probability tile) sizes in floats."""
        stage = max(self.d_chunk * (self.rows + 1 + self.keys + 1), self.v_chunk * MAX_LATENT,
                    2 * self.threads)  # softmax: a max and a sum partial per thread
        return stage, self.rows * (self.keys + 1)

    def check(self) -> None:
        """ValueError naming the first broken divisibility or size rule."""
        t, bm, bn = self.threads, self.rows, self.keys
        rules = [
            ((bm // self.s_rows) * (bn // self.s_keys) == t and bm % self.s_rows == 0 and bn % self.s_keys == 0,
             "threads == (rows / s_rows) * (keys / s_keys)"),
            (MAX_LATENT % self.o_cols == 0 and t % (MAX_LATENT // self.o_cols) == 0
             and self.o_rows * t == bm * (MAX_LATENT // self.o_cols), "o tile: rows * MAX_LATENT == threads * o tile"),
            ((bm * self.d_chunk) % t == 0 and (bn * self.d_chunk) % t == 0 and t % self.d_chunk == 0,
             "(rows, keys) * d_chunk divisible by threads, threads by d_chunk"),
            ((self.v_chunk * MAX_LATENT) % t == 0 and bn % self.v_chunk == 0, "v_chunk * MAX_LATENT % threads, keys % v_chunk"),
            (t % bm == 0 and bn % (t // bm) == 0, "threads % rows, keys % (threads / rows) (softmax: threads per row)"),
            (4 * (sum(self.shared_floats()) + 3 * bm) <= SHARED_LIMIT, "shared memory <= 48 KB"),
        ]
        for ok, rule in rules:
            if not ok:
                raise ValueError(f"bad TileConfig {self}: needs {rule}")


if ON_SIMULATOR:  # every simulated thread is a Python thread: 8 threads; key tiles of 16, as each tile costs
    # a dozen block barriers of ~1 ms there (4-key tiles made `kdtree demo`'s attention 1.9x slower)
    DEFAULT_CONFIG = TileConfig(rows=8, keys=16, d_chunk=4, v_chunk=2, s_rows=2, s_keys=8, o_cols=8, threads=8)
    FEW_TOKENS_CONFIG = DEFAULT_CONFIG
else:  # the fastest shapes of tools/sweeps/attention.py on the H200 (docs/benchmarks-history.md): 64 x 128
    #    tiles on 512 threads (o 8 x 8) from s = 16 tokens up; 32 x 64 tiles on 256 threads for AR and small trees
    DEFAULT_CONFIG = TileConfig(rows=64, keys=128, d_chunk=16, v_chunk=4, s_rows=4, s_keys=4, o_cols=8, threads=512)
    FEW_TOKENS_CONFIG = TileConfig(rows=32, keys=64, d_chunk=16, v_chunk=4, s_rows=2, s_keys=4, o_cols=8)


@functools.lru_cache(maxsize=None)
def attention_kernel(config: TileConfig = DEFAULT_CONFIG):
    """The split-K attention kernel for one TileConfig (built once per config)."""
    config.check()
    T, BM, BN, DK, NK = config.threads, config.rows, config.keys, config.d_chunk, config.v_chunk
    SR, SK, OC, OR = config.s_rows, config.s_keys, config.o_cols, config.o_rows
    RG, KG = BM // SR, BN // SK                 # score tile: thread (rg, kg) owns rows rg + RG*i, keys kg + KG*j
    OCG = MAX_LATENT // OC                      # o tile: thread (org, ocg) owns rows org + ORG*i, cols ocg + OCG*k
    ORG = T // OCG
    Q_STRIDE, K_STRIDE, P_STRIDE = BM + 1, BN + 1, BN + 1  # +1: transposed stores and column reads hit distinct banks
    K_OFFSET = DK * Q_STRIDE                   # stage buffer: q chunk [DK, BM+1] then k chunk [DK, BN+1]
    STAGE_SIZE, P_SIZE = config.shared_floats()
    Q_STEPS = BM * DK // T                     # prefetch registers: Q_STEPS q elements, then k elements
    Q_ROW_STEP = T // DK                       # q element k of a thread: row tid // DK + Q_ROW_STEP * k
    QK_LOADS = (BM + BN) * DK // T
    V_LOADS = NK * MAX_LATENT // T
    LOADS = max(QK_LOADS, V_LOADS)
    S_TILE, O_TILE = SR * SK, OR * OC
    RQ = T // BM                               # softmax: RQ threads per row, KEYS_PER_PART keys each
    KEYS_PER_PART = BN // RQ
    compile_options = {} if ON_SIMULATOR else dict(launch_bounds=(T, config.blocks_per_sm))
    if config.max_registers is not None and not ON_SIMULATOR:
        compile_options["max_registers"] = config.max_registers

    @device_function(inline=True)
    def load_qk(q_lat, q_pe, cache, token0, head0, key0, key_end, d0, pre):
        """Prefetch the S stage at dimension d0: q [BM, DK] (this thread's first row is (token0, head0), the
        next ones Q_ROW_STEP rows further) and k [BN, DK] of keys key0.."""
        tid = cuda.threadIdx.x
        tokens, heads, latent = q_lat.shape[0], q_lat.shape[1], q_lat.shape[2]
        width = latent + q_pe.shape[2]
        token, head = token0, head0
        d = d0 + tid % DK
        for k in range(QK_LOADS):
            if k < Q_STEPS:
                if k > 0:  # step to the next row without a 64-bit division
                    head += Q_ROW_STEP
                    while head >= heads:
                        head -= heads
                        token += 1
                value = float32(0.0)
                if token < tokens and d < width:
                    value = q_lat[token, head, d] if d < latent else q_pe[token, head, d - latent]
                pre[k] = value
            else:
                e = tid + T * k - BM * DK
                n = e // DK
                key = key0 + n
                pre[k] = cache[key, d0 + e - n * DK] if key < key_end and d0 + e - n * DK < width else float32(0.0)

    @device_function(inline=True)
    def store_qk(pre, stage):
        tid = cuda.threadIdx.x
        for k in range(QK_LOADS):
            e = tid + T * k
            if k < Q_STEPS:
                m = e // DK
                at_put(stage, (e - m * DK) * Q_STRIDE + m, pre[k])
            else:
                e -= BM * DK
                n = e // DK
                at_put(stage, K_OFFSET + (e - n * DK) * K_STRIDE + n, pre[k])

    @device_function(inline=True)
    def load_v(cache, latent, key0, key_end, pre):
        """Prefetch the V stage of keys key0..key0+NK: [NK, MAX_LATENT] (zeros past c and past key_end)."""
        tid = cuda.threadIdx.x
        for k in range(V_LOADS):
            e = tid + T * k
            n = e // MAX_LATENT
            column = e - n * MAX_LATENT
            key = key0 + n
            pre[k] = cache[key, column] if key < key_end and column < latent else float32(0.0)

    @device_function(inline=True)
    def store_v(pre, stage):
        tid = cuda.threadIdx.x
        for k in range(V_LOADS):
            at_put(stage, tid + T * k, pre[k])

    @device_function(inline=True)
    def online_softmax(acc_s, acc_o, p_s, stage, row_max, row_sum, row_alpha, row0, rows, heads, tile_begin,
                       tile_keys, prefix_len, visibility, scale):
        """Scores of the tile (acc_s) -> probabilities p_s [BM, BN+1]; row max / sum / alpha updated, acc_o
        rescaled. RQ threads per row walk KEYS_PER_PART keys each (shared memory only: the register tiles
        are touched in constant-index loops); stage holds the row partials. Every thread must call it."""
        tid = cuda.threadIdx.x
        rg, kg = tid // KG, tid % KG
        for i in range(SR):
            for j in range(SK):
                at_put(p_s, (rg + RG * i) * P_STRIDE + kg + KG * j, acc_s[i * SK + j])
        cuda.syncthreads()  # raw scores stored
        m, part = tid // RQ, tid % RQ
        row = row0 + m
        token = row // heads
        first = m * P_STRIDE + part * KEYS_PER_PART
        local_max = float32(-math.inf)
        for j in range(KEYS_PER_PART):
            n = part * KEYS_PER_PART + j
            visible = row < rows and n < tile_keys and key_visible(token, tile_begin + n, prefix_len, visibility)
            score = p_s[first + j] * scale if visible else float32(-math.inf)
            p_s[first + j] = score
            local_max = max(local_max, score)
        stage[tid] = local_max
        cuda.syncthreads()  # partial maxima stored
        old_max = row_max[m]
        new_max = old_max
        for k in range(RQ):
            new_max = max(new_max, stage[m * RQ + k])
        local_sum = float32(0.0)
        for j in range(KEYS_PER_PART):
            p = math.exp(p_s[first + j] - new_max) if new_max != -math.inf else float32(0.0)
            p_s[first + j] = p
            local_sum += p
        stage[T + tid] = local_sum
        cuda.syncthreads()  # probabilities and partial sums stored; every thread has read row_max
        if part == 0:
            # nothing visible yet: alpha 1 (exp(-inf - -inf) would be NaN); 0 when the first keys arrive
            alpha = math.exp(old_max - new_max) if new_max != -math.inf else float32(1.0)
            total = float32(0.0)
            for k in range(RQ):
                total += stage[T + m * RQ + k]
            row_sum[m] = row_sum[m] * alpha + total
            row_max[m] = new_max
            row_alpha[m] = alpha
        cuda.syncthreads()  # row state updated; partials read before the next stage overwrites them
        org = tid // OCG
        for i in range(OR):
            alpha = row_alpha[org + ORG * i]
            for k in range(OC):
                acc_o[i * OC + k] *= alpha

    @device_function(**INLINE_DEVICE)
    def store_o_row(i, args):
        """Row i of this thread's o tile (already divided by the row sum) to destination[first + row * c + column]
        (flat out or o_part)."""
        acc_o, row0, rows, latent, destination, first = args
        row = row0 + cuda.threadIdx.x // OCG + ORG * i
        if row < rows:
            ocg = cuda.threadIdx.x % OCG
            base = first + row * latent + ocg  # flat index: no per-store index arithmetic to keep live
            for k in range(OC):
                if ocg + OCG * k < latent:
                    at_put(destination, base + OCG * k, acc_o[i * OC + k])

    store_o_rows = static_for(OR, store_o_row)

    @kernel_cache.jit(fastmath=config.fastmath, **compile_options)
    def mla_attention_split_kernel(q_lat, q_pe, cache, prefix_len, visibility, scale, keys_per_split, direct,
                                   out, o_part, lse_part):
        """q_lat float32 [s, h, c]; q_pe float32 [s, h, r]; cache float32 [t, c+r] (one layer, rows < P + s
        used); visibility uint32 [s, ceil(s/32)]; scale float32. Grid (row_blocks(ceil(s*h / BM)), splits),
        T threads; grid-stride over the row tiles.
        direct: write out (flat [s*h*c]) (one split); else o_part (flat [splits*s*h*c], normalised) and lse_part
        [splits, s, h] (-inf and zeros for a split where the row sees nothing)."""
        tid = cuda.threadIdx.x
        split = cuda.blockIdx.y
        tokens, heads, latent = q_lat.shape[0], q_lat.shape[1], q_lat.shape[2]
        width = latent + q_pe.shape[2]
        s_stages = (width + DK - 1) // DK
        rows = tokens * heads
        key_begin = split * keys_per_split
        key_end = min(prefix_len + tokens, key_begin + keys_per_split)
        n_tiles = (max(key_end - key_begin, 0) + BN - 1) // BN

        stage = cuda.shared.array(STAGE_SIZE, float32)
        p_s = cuda.shared.array(P_SIZE, float32)          # probabilities [BM, BN+1]
        row_max = cuda.shared.array(BM, float32)
        row_sum = cuda.shared.array(BM, float32)
        row_alpha = cuda.shared.array(BM, float32)
        acc_s = cuda.local.array(S_TILE, float32)
        acc_o = cuda.local.array(O_TILE, float32)
        pre = cuda.local.array(LOADS, float32)
        q_val = cuda.local.array(SR, float32)
        k_val = cuda.local.array(SK, float32)
        p_val = cuda.local.array(OR, float32)

        rg, kg = tid // KG, tid % KG
        org, ocg = tid // OCG, tid % OCG
        for row0 in range(cuda.blockIdx.x * BM, rows, cuda.gridDim.x * BM):  # block-uniform
            cuda.syncthreads()  # the previous row tile's write-out has read row_sum / row_max
            if tid < BM:
                row_max[tid] = -math.inf
                row_sum[tid] = 0.0
            for k in range(O_TILE):
                acc_o[k] = 0.0
            token0 = (row0 + tid // DK) // heads  # this thread's first q row in the S stages
            head0 = row0 + tid // DK - token0 * heads
            if n_tiles > 0:
                load_qk(q_lat, q_pe, cache, token0, head0, key_begin, key_end, 0, pre)
            for tile in range(n_tiles):
                tile_begin = key_begin + tile * BN
                tile_keys = min(BN, key_end - tile_begin)
                v_stages = (tile_keys + NK - 1) // NK
                for k in range(S_TILE):
                    acc_s[k] = 0.0
                for step in range(s_stages + v_stages):
                    v_step = step - s_stages
                    if v_step < 0:
                        store_qk(pre, stage)
                    else:
                        store_v(pre, stage)
                    cuda.syncthreads()  # stage stored (and, before the first, the row state initialised)
                    if step + 1 < s_stages:  # next stage's global loads in flight during this one's FMAs
                        load_qk(q_lat, q_pe, cache, token0, head0, tile_begin, key_end, (step + 1) * DK, pre)
                    elif step + 1 < s_stages + v_stages:
                        load_v(cache, latent, tile_begin + (v_step + 1) * NK, key_end, pre)
                    elif tile + 1 < n_tiles:
                        load_qk(q_lat, q_pe, cache, token0, head0, tile_begin + BN, key_end, 0, pre)
                    if v_step < 0:  # ---- S: scores += q chunk . k chunk
                        for dd in range(DK):
                            for i in range(SR):
                                q_val[i] = at(stage, dd * Q_STRIDE + rg + RG * i)
                            for j in range(SK):
                                k_val[j] = at(stage, K_OFFSET + dd * K_STRIDE + kg + KG * j)
                            for i in range(SR):
                                for j in range(SK):
                                    acc_s[i * SK + j] += q_val[i] * k_val[j]
                    else:  # ---- V: o += p @ v chunk
                        n0 = v_step * NK
                        for n in range(NK):
                            for i in range(OR):
                                p_val[i] = at(p_s, (org + ORG * i) * P_STRIDE + n0 + n)
                            for k in range(OC):
                                v = at(stage, n * MAX_LATENT + ocg + OCG * k)
                                for i in range(OR):
                                    acc_o[i * OC + k] += p_val[i] * v
                    cuda.syncthreads()  # all threads done with this stage before the next is stored
                    if step == s_stages - 1:  # ---- softmax of the tile
                        online_softmax(acc_s, acc_o, p_s, stage, row_max, row_sum, row_alpha, row0, rows, heads,
                                       tile_begin, tile_keys, prefix_len, visibility, scale)
            cuda.syncthreads()  # row state final (also when this split had no key tile)

            # ---- write-out: o / row sum, then stores (two small loops: register indices stay constant)
            for i in range(OR):
                total = row_sum[org + ORG * i]
                # no visible key: NaN when final (the query saw nothing), 0 in a partial (merged away)
                inv = float32(1.0) / total if total > 0 else (float32(math.nan) if direct else float32(0.0))
                for k in range(OC):
                    acc_o[i * OC + k] *= inv
            if direct:
                store_o_rows((acc_o, row0, rows, latent, out, 0))
            else:
                store_o_rows((acc_o, row0, rows, latent, o_part, split * rows * latent))
            if not direct and tid < BM and row0 + tid < rows:
                token = (row0 + tid) // heads
                total = row_sum[tid]
                lse_part[split, token, row0 + tid - token * heads] = (row_max[tid] + math.log(total) if total > 0
                                                                      else float32(-math.inf))

    return mla_attention_split_kernel


def default_num_splits(rows: int, total_keys: int, config: TileConfig = DEFAULT_CONFIG,
                       sms: int | None = None) -> int:
    """Split count whose (row tile, split) blocks fill the SMs' block slots best (the fewest splits within 2%
    of the best wave efficiency), at least MIN_KEYS_PER_SPLIT keys each. sms: SM count (None: this device)."""
    row_tiles = (rows + config.rows - 1) // config.rows
    if sms is None:
        sms = 1 if ON_SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
    slots = sms * config.blocks_per_sm
    most = max(1, min(-(-slots // row_tiles), total_keys // MIN_KEYS_PER_SPLIT))

    def efficiency(splits):
        blocks = row_tiles * splits
        return blocks / (-(-blocks // slots) * slots)

    best = max(efficiency(splits) for splits in range(1, most + 1))
    return next(splits for splits in range(1, most + 1) if efficiency(splits) >= 0.98 * best)


def mla_attention_simt(q_lat, q_pe, cache_layer, prefix_len: int, visibility, scale: float, out=None,
                  num_splits: int | None = None, stream=0, config: TileConfig | None = None):
    """o_lat float32 [s, h, c] (device) of the absorbed MLA core.

    q_lat float32 [s, h, c] (q_nope @ W_UK); q_pe float32 [s, h, r] (roped; strided views are fine);
    cache_layer float32 [t, c+r] (rows [normed latent | roped k_pe]; the s in-flight rows at P..P+s-1);
    prefix_len P; visibility uint32 [s, ceil(s/32)] (pack_visibility / causal_visibility); scale: softmax
    scale. Without num_splits and config the kernel is attention_path's choice; with either, this module's
    SIMT kernel (num_splits: key-range splits, None: default_num_splits; config: tile sizes, None:
    DEFAULT_CONFIG, or FEW_TOKENS_CONFIG below FEW_TOKENS query tokens). A numpy mask is checked for queries
    that see no row; on the device such a query's output is NaN.
    """
    q_lat, q_pe, cache_layer, visibility, out = checked_inputs(q_lat, q_pe, cache_layer, prefix_len, visibility,
                                                               out, stream, latent_limits=True,
                                                               contiguous_cache=False)
    tokens, heads, latent = q_lat.shape
    if config is None:
        config = FEW_TOKENS_CONFIG if tokens < FEW_TOKENS else DEFAULT_CONFIG
    total_keys = prefix_len + tokens
    rows = tokens * heads
    if rows == 0 or latent == 0:
        return out
    splits = default_num_splits(rows, total_keys, config) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    keys_per_split = -(-total_keys // splits)
    keys_per_split = -(-keys_per_split // config.keys) * config.keys
    splits = -(-total_keys // keys_per_split)  # rounding to whole key tiles may leave fewer splits
    grid = (row_blocks((rows + config.rows - 1) // config.rows), splits)
    kernel, threads = attention_kernel(config), config.threads
    if splits == 1:
        dummy = cuda.device_array((1, 1, 1), dtype=np.float32, stream=stream)
        kernel[grid, threads, stream](q_lat, q_pe, cache_layer, prefix_len, visibility, np.float32(scale),
                                      keys_per_split, True, out.reshape(-1), dummy.reshape(-1), dummy)
        return out
    o_part = cuda.device_array((splits, tokens, heads, latent), dtype=np.float32, stream=stream)
    lse_part = cuda.device_array((splits, tokens, heads), dtype=np.float32, stream=stream)
    kernel[grid, threads, stream](q_lat, q_pe, cache_layer, prefix_len, visibility, np.float32(scale),
                                  keys_per_split, False, out.reshape(-1), o_part.reshape(-1), lse_part)
    merge_splits_kernel[row_blocks(rows), MERGE_THREADS, stream](o_part, lse_part, splits, out)
    return out
