"""Token choice over the vocabulary, one block per row: argmax, top-k with margin, Gumbel-max sampling, and the
log-softmax of a block drafter's logits (grid-stride over rows: the simulator runs one block,
numba_kernels.runtime.row_blocks). Top-k of k > MAX_TOPK runs numba_kernels.topk_select (radix select).

Large vocabularies (V > SPLIT_MIN_VOCAB, e.g. K2's 163840) are split: a first launch gives each (row, vocabulary
chunk) its own block and keeps the chunk's best candidates, a second merges a row's candidates in one block. One
block per row would leave all but s of the GPU's 132 SMs idle (a k2-mini AR step: 0.5 ms of top-k on one SM).

Bit-exact to engine.sampling_ref (ties -> lowest id; the same splitmix64 noise keyed by seed and absolute
position; float64 log may differ from numpy's by an ulp, which matters only at exact float64 ties).
Dimension letters: s rows (query tokens / tree nodes), V vocabulary.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as to_device
from kdspec.numba_kernels.reductions import INT32_MAX, block_argmax, block_max, block_sum
from kdspec.numba_kernels.runtime import MAX_ROW_BLOCKS, ON_SIMULATOR, device_function, row_blocks
from kdspec.numba_kernels.topk_select import topk_select_rows

ROW_THREADS = 8 if ON_SIMULATOR else 256
MAX_TOPK = 16
SPLIT_MIN_VOCAB = 8192     # above this, argmax / top-k run over vocabulary chunks, then merge per row
SPLIT_CHUNK = 4096         # vocabulary entries per block of the first launch (16 per thread), at least
SPLIT_BLOCKS = 512         # (row, chunk) blocks past which a launch takes longer chunks (split_chunk_for)
MAX_SPLIT_CHUNK = 8 * SPLIT_CHUNK
PREFETCH = 8               # logits a thread loads before ranking them (_keep_best)
GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_MUL_2 = np.uint64(0x94D049BB133111EB)
SHIFT_30 = np.uint64(30)
SHIFT_27 = np.uint64(27)
SHIFT_31 = np.uint64(31)
SHIFT_11 = np.uint64(11)
ONE = np.uint64(1)
TWO_POW_MINUS_53 = 2.0 ** -53


@device_function()
def mix64(z):
    """splitmix64 finaliser on uint64 (wrapping multiply), as engine.sampling_ref.mix64."""
    z = (z ^ (z >> SHIFT_30)) * MIX_MUL_1
    z = (z ^ (z >> SHIFT_27)) * MIX_MUL_2
    return z ^ (z >> SHIFT_31)


@device_function()
def gumbel(key, token):
    """float64 Gumbel noise of one token given its row key (engine.sampling_ref.uniform / gumbel_noise)."""
    bits = mix64(key + (uint64(token) + ONE) * GOLDEN_GAMMA)
    u = (float64(bits >> SHIFT_11) + 0.5) * TWO_POW_MINUS_53
    return -math.log(-math.log(u))


@kernel_cache.jit
def argmax_rows_kernel(logits, ids):
    """logits float32 [s, V] -> ids int32 [s]: argmax per row, ties -> lowest id. Grid-stride over rows."""
    scratch = cuda.shared.array(ROW_THREADS, float32)
    scratch_ids = cuda.shared.array(ROW_THREADS, int32)
    for row in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):  # block-uniform: block_argmax syncs
        best = float32(-math.inf)
        best_id = INT32_MAX
        for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
            value = logits[row, v]
            if value > best or best_id == INT32_MAX:  # strict: this thread's ids increase, keep the first
                best = value
                best_id = v
        best, best_id = block_argmax(best, int32(best_id), scratch, scratch_ids)
        if cuda.threadIdx.x == 0:
            ids[row] = best_id


@kernel_cache.jit
def sample_rows_kernel(logits, temperature, seed, positions, ids):
    """logits float32 [s, V], positions int [s] -> ids int32 [s]: argmax(logits / T + gumbel(seed, position)),
    in float64, ties -> lowest id. Grid-stride over rows."""
    scratch = cuda.shared.array(ROW_THREADS, float64)
    scratch_ids = cuda.shared.array(ROW_THREADS, int32)
    for row in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):  # block-uniform: block_argmax syncs
        key = mix64(mix64(uint64(seed)) + uint64(positions[row]) * GOLDEN_GAMMA)
        best = -math.inf
        best_id = INT32_MAX
        for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
            value = float64(logits[row, v]) / temperature + gumbel(key, v)
            if value > best or best_id == INT32_MAX:
                best = value
                best_id = v
        best, best_id = block_argmax(best, int32(best_id), scratch, scratch_ids)
        if cuda.threadIdx.x == 0:
            ids[row] = best_id


@kernel_cache.jit
def log_softmax_rows_kernel(logits, out):
    """out[row] = (logits[row] - max) - log(sum(exp(logits[row] - max))) in float32; logits, out float32 [s, V]
    (out may be logits itself). Grid-stride over rows."""
    scratch = cuda.shared.array(ROW_THREADS, float32)
    for row in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):  # block-uniform: the reductions sync
        best = float32(-math.inf)
        for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
            best = max(best, logits[row, v])
        best = block_max(best, scratch)
        total = float32(0.0)
        for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
            total += math.exp(logits[row, v] - best)
        log_total = math.log(block_sum(total, scratch))  # block_sum syncs: the row read before out (= logits) written
        for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
            out[row, v] = (logits[row, v] - best) - log_total


@device_function(inline=True)
def _ranks_before(value, index, other_value, other_index):
    """(value, index) comes first in top-k order: larger value, ties -> lower id."""
    return value > other_value or (value == other_value and index < other_index)


@device_function(inline=True)
def _insert_ranked(value, index, held, rounds, mine, mine_ids):
    """(value, index) into the sorted list mine / mine_ids of ``held`` <= ``rounds`` entries (top-k order), the
    worst dropped when full; returns the new count."""
    if held == rounds and not _ranks_before(value, index, mine[rounds - 1], mine_ids[rounds - 1]):
        return held  # not better than the worst kept
    slot = held if held < rounds else rounds - 1
    while slot > 0 and _ranks_before(value, index, mine[slot - 1], mine_ids[slot - 1]):
        mine[slot] = mine[slot - 1]
        mine_ids[slot] = mine_ids[slot - 1]
        slot -= 1
    mine[slot] = value
    mine_ids[slot] = index
    return held + 1 if held < rounds else held


@device_function()
def _keep_best(logits, row, first, stop, rounds, mine, mine_ids):
    """This thread's best ``rounds`` entries of logits[row, first:stop:blockDim.x], sorted (value descending,
    ties -> lower id) into mine / mine_ids (local arrays); returns how many it holds (<= rounds).

    The entries are read PREFETCH at a time before any is ranked, so that a thread's loads are in flight together
    rather than one latency each (a verify's chunks are 128 entries a thread: split_chunk_for)."""
    held = 0
    stride = cuda.blockDim.x
    batch = cuda.local.array(PREFETCH, float32)
    for base in range(first, stop, stride * PREFETCH):
        for u in range(PREFETCH):
            v = base + u * stride
            batch[u] = logits[row, v] if v < stop else float32(0.0)
        for u in range(PREFETCH):
            v = base + u * stride
            if v >= stop:
                break
            held = _insert_ranked(batch[u], v, held, rounds, mine, mine_ids)
    return held


@kernel_cache.jit
def topk_rows_kernel(logits, top_ids, top_values, margins):
    """logits float32 [s, V] -> top_ids int32 [s, k], top_values float32 [s, k] (ties -> lower id),
    margins float32 [s] = top1 - top2 (+inf when V == 1). k <= MAX_TOPK.

    Each thread keeps a sorted top-k list of its strided slice; then k rounds of block argmax over the
    threads' list heads, the winner advancing its head. Grid-stride over rows."""
    tid = cuda.threadIdx.x
    scratch = cuda.shared.array(ROW_THREADS, float32)
    scratch_ids = cuda.shared.array(ROW_THREADS, int32)
    k = top_ids.shape[1]
    rounds = max(k, 2)
    mine = cuda.local.array(MAX_TOPK, float32)
    mine_ids = cuda.local.array(MAX_TOPK, int32)
    for row in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):  # block-uniform: block_argmax syncs
        held = _keep_best(logits, row, tid, logits.shape[1], rounds, mine, mine_ids)
        head = 0
        first = float32(0.0)
        for r in range(rounds):
            value = mine[head] if head < held else float32(-math.inf)
            index = mine_ids[head] if head < held else INT32_MAX
            best, best_id = block_argmax(value, int32(index), scratch, scratch_ids)
            if head < held and mine_ids[head] == best_id:
                head += 1
            if tid == 0:
                if r < k:
                    top_ids[row, r] = best_id
                    top_values[row, r] = best
                if r == 0:
                    first = best
                elif r == 1:
                    margins[row] = first - best if best_id != INT32_MAX else float32(math.inf)

@kernel_cache.jit
def chunk_candidates_kernel(logits, chunk, cand_ids, cand_values):
    """First launch of the split top-k / argmax: block (row, c) keeps the best R = cand_ids.shape[2] entries of
    logits[row, c*chunk : (c+1)*chunk] in top-k order -> cand_ids int32 [s, C, R], cand_values float32
    [s, C, R] (fewer than R entries: padded with INT32_MAX / -inf). Grid (C, rows), rows grid-stride."""
    tid = cuda.threadIdx.x
    scratch = cuda.shared.array(ROW_THREADS, float32)
    scratch_ids = cuda.shared.array(ROW_THREADS, int32)
    mine = cuda.local.array(MAX_TOPK, float32)
    mine_ids = cuda.local.array(MAX_TOPK, int32)
    rounds = cand_ids.shape[2]
    c = cuda.blockIdx.x
    start = c * chunk
    stop = min(start + chunk, logits.shape[1])
    for row in range(cuda.blockIdx.y, logits.shape[0], cuda.gridDim.y):  # block-uniform: block_argmax syncs
        held = _keep_best(logits, row, start + tid, stop, rounds, mine, mine_ids)
        head = 0
        for r in range(rounds):
            value = mine[head] if head < held else float32(-math.inf)
            index = mine_ids[head] if head < held else INT32_MAX
            best, best_id = block_argmax(value, int32(index), scratch, scratch_ids)
            if head < held and mine_ids[head] == best_id:
                head += 1
            if tid == 0:
                cand_ids[row, c, r] = best_id
                cand_values[row, c, r] = best


@kernel_cache.jit
def merge_candidates_kernel(cand_ids, cand_values, top_ids, top_values, margins):
    """Second launch: per row, the best k of the C*R candidates -> top_ids int32 [s, k], top_values float32
    [s, k], margins float32 [s] (top1 - top2; +inf without a second entry). k = top_ids.shape[1] <= R;
    top_values / margins may be zero-size arrays (argmax: only ids wanted). One block per row."""
    tid = cuda.threadIdx.x
    scratch = cuda.shared.array(ROW_THREADS, float32)
    scratch_ids = cuda.shared.array(ROW_THREADS, int32)
    mine = cuda.local.array(MAX_TOPK, float32)
    mine_ids = cuda.local.array(MAX_TOPK, int32)
    k = top_ids.shape[1]
    rounds = max(k, 2) if margins.shape[0] > 0 else k
    candidates = cand_ids.shape[1] * cand_ids.shape[2]
    for row in range(cuda.blockIdx.x, cand_ids.shape[0], cuda.gridDim.x):
        held = 0
        for j in range(tid, candidates, cuda.blockDim.x):
            index = cand_ids[row, j // cand_ids.shape[2], j % cand_ids.shape[2]]
            value = cand_values[row, j // cand_ids.shape[2], j % cand_ids.shape[2]]
            if index != INT32_MAX:  # not padding
                held = _insert_ranked(value, index, held, rounds, mine, mine_ids)
        head = 0
        first = float32(0.0)
        for r in range(rounds):
            value = mine[head] if head < held else float32(-math.inf)
            index = mine_ids[head] if head < held else INT32_MAX
            best, best_id = block_argmax(value, int32(index), scratch, scratch_ids)
            if head < held and mine_ids[head] == best_id:
                head += 1
            if tid == 0:
                if r < k:
                    top_ids[row, r] = best_id
                    if top_values.shape[0] > 0:
                        top_values[row, r] = best
                if margins.shape[0] > 0:
                    if r == 0:
                        first = best
                    elif r == 1:
                        margins[row] = first - best if best_id != INT32_MAX else float32(math.inf)


def _split_topk(logits, k: int, rounds: int, top_ids, top_values, margins, chunk: int, stream=0):
    """The two launches of a split top-k (see chunk_candidates_kernel / merge_candidates_kernel)."""
    rows, vocab = logits.shape
    chunks = (vocab + chunk - 1) // chunk
    cand_ids = cuda.device_array((rows, chunks, rounds), np.int32, stream=stream)
    cand_values = cuda.device_array((rows, chunks, rounds), np.float32, stream=stream)
    chunk_candidates_kernel[(chunks, min(rows, MAX_ROW_BLOCKS)), ROW_THREADS, stream](to_device(logits), chunk,
                                                                                    cand_ids, cand_values)
    merge_candidates_kernel[row_blocks(rows), ROW_THREADS, stream](cand_ids, cand_values, top_ids, top_values,
                                                                   margins)



def split_chunk_for(rows: int, vocab: int) -> int:
    """Vocabulary entries per block of the split top-k's first launch over ``rows`` rows: SPLIT_CHUNK, doubled
    (up to MAX_SPLIT_CHUNK) while the launch would still have more than SPLIT_BLOCKS blocks. Many short blocks
    cost more than their reads: each ends in a block-wide reduction per kept entry, and a verify's 256 rows
    would give 10240 blocks of 16 reads a thread. A launch shape only: the chunk never changes the result."""
    chunk = SPLIT_CHUNK
    while chunk < MAX_SPLIT_CHUNK and rows * -(-vocab // chunk) > SPLIT_BLOCKS:
        chunk *= 2
    return chunk


def _check_logits(logits):
    if len(logits.shape) != 2 or logits.dtype != np.float32 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"logits must be float32 [s, V] with s, V > 0, got {logits.dtype} {logits.shape}")
    if logits.shape[1] >= INT32_MAX:
        raise ValueError(f"vocabulary {logits.shape[1]} too large for int32 ids")


def argmax_rows(logits, split_chunk: int | None = None):
    """Device int32 [s]: greedy token per row of float32 logits [s, V] (numpy or device). V > SPLIT_MIN_VOCAB
    (or ``split_chunk`` given): over vocabulary chunks (split_chunk_for, or ``split_chunk`` entries), then merged."""
    _check_logits(logits)
    ids = cuda.device_array(logits.shape[0], np.int32)
    if split_chunk or logits.shape[1] > SPLIT_MIN_VOCAB:
        none = cuda.device_array(0, np.float32)
        _split_topk(logits, 1, 1, ids.reshape(logits.shape[0], 1), cuda.device_array((0, 1), np.float32), none,
                    split_chunk or split_chunk_for(*logits.shape))
        return ids
    argmax_rows_kernel[row_blocks(logits.shape[0]), ROW_THREADS](to_device(logits), ids)
    return ids


def sample_rows(logits, temperature: float, seed: int, positions):
    """Device int32 [s]: Gumbel-max sample per row at absolute positions [s]; argmax when temperature == 0."""
    _check_logits(logits)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if tuple(positions.shape) != (logits.shape[0],):
        raise ValueError(f"positions {positions.shape} must be [s={logits.shape[0]}]")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
    if temperature == 0:
        return argmax_rows(logits)
    ids = cuda.device_array(logits.shape[0], np.int32)
    sample_rows_kernel[row_blocks(logits.shape[0]), ROW_THREADS](to_device(logits), float(temperature), np.uint64(seed),
                                                     to_device(positions), ids)
    return ids


def topk_rows(logits, k: int, split_chunk: int | None = None, stream=0):
    """(ids int32 [s, k], values float32 [s, k], margins float32 [s]) device arrays, ties -> lower id.
    V > SPLIT_MIN_VOCAB (or ``split_chunk`` given): over vocabulary chunks, then merged per row; k > MAX_TOPK:
    by radix select (numba_kernels.topk_select; not on ``stream``). Device logits on ``stream`` allocate and
    launch nothing else (a CUDA graph can capture it)."""
    _check_logits(logits)
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in 1..V={logits.shape[1]}, got {k}")
    if k > MAX_TOPK:
        return topk_select_rows(logits, k)
    rows = logits.shape[0]
    top_ids = cuda.device_array((rows, k), np.int32, stream=stream)
    top_values = cuda.device_array((rows, k), np.float32, stream=stream)
    margins = cuda.device_array(rows, np.float32, stream=stream)
    if split_chunk or logits.shape[1] > SPLIT_MIN_VOCAB:
        chunk = split_chunk or split_chunk_for(rows, logits.shape[1])
        _split_topk(logits, k, max(k, 2), top_ids, top_values, margins, chunk, stream)
        return top_ids, top_values, margins
    topk_rows_kernel[row_blocks(rows), ROW_THREADS, stream](to_device(logits), top_ids, top_values, margins)
    return top_ids, top_values, margins


def log_softmax_rows(logits, out=None):
    """Device float32 [s, V]: the row-wise log-softmax of float32 logits [s, V] (numpy or device), in float32;
    ``out`` may be the logits themselves (in place)."""
    _check_logits(logits)
    logits = to_device(logits)
    out = cuda.device_array(logits.shape, np.float32) if out is None else to_device(out)
    if out.dtype != np.float32 or tuple(out.shape) != tuple(logits.shape):
        raise ValueError(f"out must be float32 {list(logits.shape)}, got {out.dtype} {list(out.shape)}")
    log_softmax_rows_kernel[row_blocks(logits.shape[0]), ROW_THREADS](logits, out)
    return out
