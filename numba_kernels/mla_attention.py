"""Absorbed MLA attention over the compressed cache, with a visibility bitmask for the in-flight rows.

For query token i, head h (a "row" ρ = i*h_count + h of the s*h query-head pairs):
    score[ρ, t] = (q_lat[i, h] . cache[t, :c] + q_pe[i, h] . cache[t, c:]) * scale
    o_lat[i, h] = softmax_t(score[ρ, t] over visible t) @ cache[t, :c]
Row t < P (prefix_len) is visible to all; in-flight row P + j is visible to query i when bit j of
visibility[i] is set (word j // 32, bit j % 32). Causal prefill is the lower-triangular mask, AR decode s = 1.

Split-K (flash-decoding): block (row tile, split) runs an online softmax over its range of key rows and
writes either o_lat directly (one split) or a normalised partial plus its log-sum-exp; a merge kernel
combines the partials. Inside a block, per tile of KEY_TILE key rows:
  A. the key rows [KEY_TILE, c+r] go to shared memory once (coalesced, padded rows: no bank conflicts);
     q chunks [ROW_TILE, Q_CHUNK] stream through shared memory; each thread accumulates a register tile
     of A_ROWS x A_KEYS scores;
  B. one thread per row updates the running max / sum (fp32, max subtraction) and turns scores into p;
  C. each thread owns a register tile of C_ROWS rows x C_COLS latent columns of o and adds p @ keys[:, :c]
     from the same shared key rows (columns strided by the warp width: conflict-free, coalesced stores).
Dimension letters: s query tokens, h heads, c kv_lora_rank, r qk_rope_head_dim, t key rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from numba_kernels.rmsnorm import as_device_array, is_device_array
from numba_kernels.warp import ON_SIMULATOR, row_blocks

if ON_SIMULATOR:  # toy shapes: every simulated thread is a Python thread
    THREADS, ROW_TILE, KEY_TILE, Q_CHUNK = 8, 8, 4, 4
    MAX_LATENT, MAX_ROPE, C_COL_GROUPS = 32, 8, 4
else:  # shared memory: keys 16*577*4 + q 64*17*4 + p 64*17*4 + 3*64*4 = 46.6 KB (< 48 KB static)
    THREADS, ROW_TILE, KEY_TILE, Q_CHUNK = 256, 64, 16, 16
    MAX_LATENT, MAX_ROPE, C_COL_GROUPS = 512, 64, 32
MAX_WIDTH = MAX_LATENT + MAX_ROPE
KEY_STRIDE = MAX_WIDTH + 1      # +1: row n starts in bank n, so threads reading different keys never collide
Q_STRIDE = Q_CHUNK + 1
P_STRIDE = KEY_TILE + 1
A_KEYS = 2                                  # phase A register tile: A_ROWS rows x A_KEYS keys per thread
A_KEY_GROUPS = KEY_TILE // A_KEYS
A_ROW_GROUPS = THREADS // A_KEY_GROUPS
A_ROWS = ROW_TILE // A_ROW_GROUPS
C_ROW_GROUPS = THREADS // C_COL_GROUPS      # phase C register tile: C_ROWS rows x C_COLS columns per thread
C_ROWS = ROW_TILE // C_ROW_GROUPS
C_COLS = MAX_LATENT // C_COL_GROUPS
A_TILE = A_ROWS * A_KEYS                    # array sizes must be plain constants for Numba
C_TILE = C_ROWS * C_COLS
Q_LOADS = ROW_TILE * Q_CHUNK // THREADS     # q chunk elements each thread loads
assert A_ROWS * A_ROW_GROUPS == ROW_TILE and C_ROWS * C_ROW_GROUPS == ROW_TILE and MAX_WIDTH % Q_CHUNK == 0
assert Q_LOADS * THREADS == ROW_TILE * Q_CHUNK
MERGE_THREADS = 8 if ON_SIMULATOR else 128
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q reloads, merge) outweighs the parallelism


@cuda.jit(device=True, inline=True)
def key_visible(token, key, prefix_len, visibility):
    """Key row `key` visible to query `token`: in the prefix, or its in-flight bit is set."""
    if key < prefix_len:
        return True
    j = key - prefix_len
    return (visibility[token, j >> 5] >> uint32(j & 31)) & uint32(1) != uint32(0)


@cuda.jit(device=True, inline=True)
def load_q(q_lat, q_pe, row0, d0, index):
    """Element `index` of the q chunk [ROW_TILE, Q_CHUNK] at rows row0.., dimensions d0.. of [q_lat | q_pe];
    0 past the last row or dimension."""
    heads, latent = q_lat.shape[1], q_lat.shape[2]
    m = index // Q_CHUNK
    d = d0 + index - m * Q_CHUNK
    row = row0 + m
    if row >= q_lat.shape[0] * heads or d >= latent + q_pe.shape[2]:
        return float32(0.0)
    token = row // heads
    head = row - token * heads
    return q_lat[token, head, d] if d < latent else q_pe[token, head, d - latent]


@cuda.jit
def mla_attention_split_kernel(q_lat, q_pe, cache, prefix_len, visibility, scale, keys_per_split, direct,
                               out, o_part, lse_part):
    """q_lat float32 [s, h, c]; q_pe float32 [s, h, r]; cache float32 [t, c+r] (one layer, rows < P + s used);
    visibility uint32 [s, ceil(s/32)]; scale float32. Grid (row_blocks(ceil(s*h / ROW_TILE)), splits), THREADS
    threads; grid-stride over the row tiles.
    direct: write out [s, h, c] (one split); else o_part [splits, s, h, c] (normalised) and lse_part
    [splits, s, h] (-inf and zeros for a split where the row sees nothing)."""
    tid = cuda.threadIdx.x
    split = cuda.blockIdx.y
    tokens, heads, latent = q_lat.shape[0], q_lat.shape[1], q_lat.shape[2]
    width = latent + q_pe.shape[2]
    padded_width = (width + Q_CHUNK - 1) // Q_CHUNK * Q_CHUNK
    rows = tokens * heads
    key_begin = split * keys_per_split
    key_end = min(prefix_len + tokens, key_begin + keys_per_split)

    keys_s = cuda.shared.array((KEY_TILE, KEY_STRIDE), float32)
    q_s = cuda.shared.array((ROW_TILE, Q_STRIDE), float32)
    p_s = cuda.shared.array((ROW_TILE, P_STRIDE), float32)
    row_max = cuda.shared.array(ROW_TILE, float32)
    row_sum = cuda.shared.array(ROW_TILE, float32)
    row_alpha = cuda.shared.array(ROW_TILE, float32)
    acc_s = cuda.local.array(A_TILE, float32)
    acc_o = cuda.local.array(C_TILE, float32)
    q_next = cuda.local.array(Q_LOADS, float32)

    a_key_group = tid % A_KEY_GROUPS
    a_row_group = tid // A_KEY_GROUPS
    c_col_group = tid % C_COL_GROUPS
    c_row_group = tid // C_COL_GROUPS
    for row0 in range(cuda.blockIdx.x * ROW_TILE, rows, cuda.gridDim.x * ROW_TILE):  # block-uniform
        cuda.syncthreads()  # the previous row tile's write-out has read row_sum / row_max
        if tid < ROW_TILE:
            row_max[tid] = -math.inf
            row_sum[tid] = 0.0
        for k in range(C_ROWS * C_COLS):
            acc_o[k] = 0.0

        for tile_begin in range(key_begin, key_end, KEY_TILE):
            cuda.syncthreads()  # the previous tile's phase C is done with keys_s / p_s; row state initialised
            for index in range(tid, KEY_TILE * padded_width, THREADS):
                n = index // padded_width
                column = index - n * padded_width
                key = tile_begin + n
                keys_s[n, column] = cache[key, column] if key < key_end and column < width else 0.0
            for k in range(A_ROWS * A_KEYS):
                acc_s[k] = 0.0
            # ---- A: scores of the tile; q streams through q_s in chunks of Q_CHUNK dimensions, the next chunk
            # prefetched into registers while this one is used (hides the global-load latency)
            for k in range(Q_LOADS):
                q_next[k] = load_q(q_lat, q_pe, row0, 0, tid + THREADS * k)
            for d0 in range(0, padded_width, Q_CHUNK):
                for k in range(Q_LOADS):
                    index = tid + THREADS * k
                    q_s[index // Q_CHUNK, index % Q_CHUNK] = q_next[k]
                cuda.syncthreads()  # q chunk (and, on the first chunk, the key tile) stored
                if d0 + Q_CHUNK < padded_width:
                    for k in range(Q_LOADS):
                        q_next[k] = load_q(q_lat, q_pe, row0, d0 + Q_CHUNK, tid + THREADS * k)
                for dd in range(Q_CHUNK):
                    for i in range(A_ROWS):
                        q = q_s[a_row_group + A_ROW_GROUPS * i, dd]
                        for j in range(A_KEYS):
                            acc_s[i * A_KEYS + j] += q * keys_s[a_key_group + A_KEY_GROUPS * j, d0 + dd]
                cuda.syncthreads()  # all threads done with this q chunk before the next overwrites it
            for i in range(A_ROWS):
                m = a_row_group + A_ROW_GROUPS * i
                row = row0 + m
                token = row // heads
                for j in range(A_KEYS):
                    n = a_key_group + A_KEY_GROUPS * j
                    key = tile_begin + n
                    visible = row < rows and key < key_end and key_visible(token, key, prefix_len, visibility)
                    p_s[m, n] = acc_s[i * A_KEYS + j] * scale if visible else -math.inf
            cuda.syncthreads()  # scores stored before the row softmax reads them
            # ---- B: online softmax, one thread per row
            if tid < ROW_TILE:
                old_max = row_max[tid]
                new_max = old_max
                for n in range(KEY_TILE):
                    new_max = max(new_max, p_s[tid, n])
                total = float32(0.0)
                if new_max == -math.inf:  # nothing visible yet: exp(-inf - -inf) would be NaN
                    alpha = float32(1.0)
                    for n in range(KEY_TILE):
                        p_s[tid, n] = 0.0
                else:
                    alpha = math.exp(old_max - new_max)  # 0 when old_max is -inf
                    for n in range(KEY_TILE):
                        p = math.exp(p_s[tid, n] - new_max)
                        p_s[tid, n] = p
                        total += p
                row_max[tid] = new_max
                row_sum[tid] = row_sum[tid] * alpha + total
                row_alpha[tid] = alpha
            cuda.syncthreads()  # probabilities and rescale factors ready
            # ---- C: o = o * alpha + p @ keys[:, :c]
            for i in range(C_ROWS):
                alpha = row_alpha[c_row_group + C_ROW_GROUPS * i]
                for k in range(C_COLS):
                    acc_o[i * C_COLS + k] *= alpha
            for n in range(KEY_TILE):
                for i in range(C_ROWS):
                    p = p_s[c_row_group + C_ROW_GROUPS * i, n]
                    for k in range(C_COLS):
                        acc_o[i * C_COLS + k] += p * keys_s[n, c_col_group + C_COL_GROUPS * k]
        cuda.syncthreads()  # row state final (also when this split had no key tile)

        for i in range(C_ROWS):
            m = c_row_group + C_ROW_GROUPS * i
            row = row0 + m
            if row >= rows:
                continue
            token = row // heads
            head = row - token * heads
            total = row_sum[m]
            if direct:
                inv = float32(1.0) / total if total > 0 else float32(math.nan)  # NaN: the query saw no key
                for k in range(C_COLS):
                    column = c_col_group + C_COL_GROUPS * k
                    if column < latent:
                        out[token, head, column] = acc_o[i * C_COLS + k] * inv
            else:
                inv = float32(1.0) / total if total > 0 else float32(0.0)
                for k in range(C_COLS):
                    column = c_col_group + C_COL_GROUPS * k
                    if column < latent:
                        o_part[split, token, head, column] = acc_o[i * C_COLS + k] * inv
                if c_col_group == 0:
                    lse_part[split, token, head] = row_max[m] + math.log(total) if total > 0 else -math.inf


@cuda.jit
def merge_splits_kernel(o_part, lse_part, splits, out):
    """out[i, h] = sum_j exp(lse_j - lse_max) o_part[j, i, h] / sum_j exp(lse_j - lse_max).
    Grid (row_blocks(s*h),), grid-stride over the s*h rows."""
    heads, latent = out.shape[1], out.shape[2]
    for row in range(cuda.blockIdx.x, out.shape[0] * heads, cuda.gridDim.x):
        token = row // heads
        head = row - token * heads
        best = float32(-math.inf)
        for j in range(splits):
            best = max(best, lse_part[j, token, head])
        total = float32(0.0)
        for j in range(splits):
            total += math.exp(lse_part[j, token, head] - best) if best != -math.inf else float32(0.0)
        inv = float32(1.0) / total if total > 0 else float32(math.nan)  # NaN: the query saw no key
        for column in range(cuda.threadIdx.x, latent, cuda.blockDim.x):
            acc = float32(0.0)
            for j in range(splits):
                lse = lse_part[j, token, head]
                if lse != -math.inf:
                    acc += math.exp(lse - best) * o_part[j, token, head, column]
            out[token, head, column] = acc * inv


# ------------------------------------------------------------------------------------------- host side
def pack_visibility(visible: np.ndarray) -> np.ndarray:
    """bool [s, s] -> uint32 [s, ceil(s/32)] bitmask (bit j % 32 of word j // 32: query i sees row j)."""
    visible = np.asarray(visible, dtype=bool)
    if visible.ndim != 2 or visible.shape[0] != visible.shape[1]:
        raise ValueError(f"visible must be bool [s, s], got shape {visible.shape}")
    tokens = visible.shape[0]
    words = max(1, (tokens + 31) // 32)
    padded = np.zeros((tokens, words * 32), dtype=np.uint64)
    padded[:, :tokens] = visible
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    return (padded.reshape(tokens, words, 32) * weights).sum(axis=2).astype(np.uint32)


def causal_visibility(tokens: int) -> np.ndarray:
    """The prefill mask: query i sees in-flight rows j <= i. uint32 [s, ceil(s/32)]."""
    return pack_visibility(np.tri(tokens, dtype=bool))


def default_num_splits(rows: int, total_keys: int) -> int:
    """Enough (row tile, split) blocks for two waves over the SMs, at least MIN_KEYS_PER_SPLIT keys each."""
    row_tiles = (rows + ROW_TILE - 1) // ROW_TILE
    sms = 1 if ON_SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
    wanted = (2 * sms + row_tiles - 1) // row_tiles
    return max(1, min(wanted, total_keys // MIN_KEYS_PER_SPLIT))


def _check_float32(name, array, shape):
    if array.dtype != np.float32 or tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must be float32 {list(shape)}, got {array.dtype} {list(array.shape)}")


def mla_attention(q_lat, q_pe, cache_layer, prefix_len: int, visibility, scale: float, out=None,
                  num_splits: int | None = None, stream=0):
    """o_lat float32 [s, h, c] (device) of the absorbed MLA core.

    q_lat float32 [s, h, c] (q_nope @ W_UK); q_pe float32 [s, h, r] (roped; strided views are fine);
    cache_layer float32 [t, c+r] (rows [normed latent | roped k_pe]; the s in-flight rows at P..P+s-1);
    prefix_len P; visibility uint32 [s, ceil(s/32)] (pack_visibility / causal_visibility); scale: softmax
    scale. num_splits: key-range splits (None: default_num_splits). A numpy mask is checked for queries
    that see no row; on the device such a query's output is NaN.
    """
    q_lat, q_pe, cache_layer = as_device_array(q_lat), as_device_array(q_pe), as_device_array(cache_layer)
    if len(q_lat.shape) != 3:
        raise ValueError(f"q_lat must be float32 [s, h, c], got shape {list(q_lat.shape)}")
    tokens, heads, latent = q_lat.shape
    _check_float32("q_lat", q_lat, q_lat.shape)
    if len(q_pe.shape) != 3 or tuple(q_pe.shape[:2]) != (tokens, heads):
        raise ValueError(f"q_pe must be float32 [{tokens}, {heads}, r], got shape {list(q_pe.shape)}")
    rope = q_pe.shape[2]
    _check_float32("q_pe", q_pe, q_pe.shape)
    if latent > MAX_LATENT or rope > MAX_ROPE:
        raise ValueError(f"c={latent}, r={rope} exceed the kernel's MAX_LATENT={MAX_LATENT}, MAX_ROPE={MAX_ROPE}")
    if len(cache_layer.shape) != 2 or cache_layer.shape[1] != latent + rope or cache_layer.dtype != np.float32:
        raise ValueError(f"cache_layer must be float32 [t, {latent + rope}], got {cache_layer.dtype} "
                         f"{list(cache_layer.shape)}")
    total_keys = prefix_len + tokens
    if prefix_len < 0 or total_keys > cache_layer.shape[0]:
        raise ValueError(f"prefix_len {prefix_len} + {tokens} in-flight rows do not fit the cache of "
                         f"{cache_layer.shape[0]} rows")
    words = max(1, (tokens + 31) // 32)
    if not is_device_array(visibility):
        visibility = np.asarray(visibility)
        if visibility.dtype == np.uint32 and visibility.shape == (tokens, words) and prefix_len == 0:
            in_flight = (visibility[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
            sees = in_flight.reshape(tokens, -1)[:, :tokens].any(axis=1)
            if not sees.all():
                raise ValueError(f"query {int(np.flatnonzero(~sees)[0])} sees no key row (P = 0, empty mask row)")
    visibility = as_device_array(visibility)
    if visibility.dtype != np.uint32 or tuple(visibility.shape) != (tokens, words):
        raise ValueError(f"visibility must be uint32 [{tokens}, {words}], got {visibility.dtype} "
                         f"{list(visibility.shape)}")
    if out is None:
        out = cuda.device_array((tokens, heads, latent), dtype=np.float32, stream=stream)
    out = as_device_array(out)
    _check_float32("out", out, (tokens, heads, latent))
    rows = tokens * heads
    if rows == 0 or latent == 0:
        return out
    splits = default_num_splits(rows, total_keys) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    keys_per_split = -(-total_keys // splits)
    keys_per_split = -(-keys_per_split // KEY_TILE) * KEY_TILE
    splits = -(-total_keys // keys_per_split)  # rounding to whole key tiles may leave fewer splits
    grid = (row_blocks((rows + ROW_TILE - 1) // ROW_TILE), splits)
    if splits == 1:
        dummy = cuda.device_array((1, 1, 1, 1), dtype=np.float32, stream=stream)
        mla_attention_split_kernel[grid, THREADS, stream](q_lat, q_pe, cache_layer, prefix_len, visibility,
                                                          np.float32(scale), keys_per_split, True, out, dummy,
                                                          dummy[0])
        return out
    o_part = cuda.device_array((splits, tokens, heads, latent), dtype=np.float32, stream=stream)
    lse_part = cuda.device_array((splits, tokens, heads), dtype=np.float32, stream=stream)
    mla_attention_split_kernel[grid, THREADS, stream](q_lat, q_pe, cache_layer, prefix_len, visibility,
                                                      np.float32(scale), keys_per_split, False, out, o_part,
                                                      lse_part)
    merge_splits_kernel[row_blocks(rows), MERGE_THREADS, stream](o_part, lse_part, splits, out)
    return out
