"""Top-k of any k <= V per row by radix select, then rank by counting: what sampling.topk_rows runs for
k > sampling.MAX_TOPK (its per-thread sorted lists live in registers and stop there). A block drafter's
K candidates per depth go up to the tree budget (K = min(B, V), B up to 1024).

Order: value descending, ties -> lower id (as sampling.topk_rows). Entry v of a row is ranked by the pair
(order_key(value), V - 1 - v), compared lexicographically: order_key maps the float32's bits to a uint32 whose
unsigned order is the float order, so the pairs of a row are distinct and the k-th one splits it exactly.
One block per row (grid-stride over rows):
  select: DIGIT_BITS-bit digits from the top of the pair, KEY_DIGITS passes over the value's key, then
     id_digits(V) passes over the id part. Each pass histograms, in shared memory, the next digit of the
     entries matching the prefix found so far; thread 0 walks the histogram down from the top digit to the one
     where the count reaches the entries still to place, and appends that digit to the prefix;
  gather: the k entries at or above the k-th pair, in any order (a shared atomic counter) -> cand_ids;
  rank: a candidate's rank is the number of candidates ranked before it; it is written at that slot.
Cost per row: (KEY_DIGITS + id_digits) passes over V and k^2 comparisons (fine for k up to a few hundred).
NaN ranks where its bits put it (above +inf when positive): the callers' values are finite.
Dimension letters: s rows, V vocabulary, k entries kept.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, check_array
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function, row_blocks

SELECT_THREADS = 8 if ON_SIMULATOR else 256
DIGIT_BITS = 8
RADIX = 1 << DIGIT_BITS
KEY_DIGITS = 32 // DIGIT_BITS
SIGN_BIT = 0x80000000
ALL_BITS = 0xFFFFFFFF


def id_digits(vocab: int) -> int:
    """DIGIT_BITS-bit digits needed for ids 0..vocab-1 (at least one)."""
    return max(1, -(-int(vocab - 1).bit_length() // DIGIT_BITS))


@device_function(inline=True)
def order_key(bits):
    """uint32 whose unsigned order is the float order of the float32 with these bits (-0.0 keyed as +0.0)."""
    if bits == uint32(SIGN_BIT):
        return uint32(SIGN_BIT)
    if bits & uint32(SIGN_BIT):
        return bits ^ uint32(ALL_BITS)
    return bits | uint32(SIGN_BIT)


@kernel_cache.jit
def select_topk_kernel(values, bits, digits, top_ids, top_values, margins, cand_ids):
    """values float32 [s, V], bits its uint32 view; digits = id_digits(V) -> top_ids int32 [s, k],
    top_values float32 [s, k] (2 <= k = top_ids.shape[1] <= V; ties -> lower id), margins float32 [s] =
    top1 - top2. cand_ids int32 [s, k]: scratch. Grid (row_blocks(s),), SELECT_THREADS, grid-stride over rows."""
    tid, step = cuda.threadIdx.x, cuda.blockDim.x
    hist = cuda.shared.array(RADIX, int32)
    prefix = cuda.shared.array(4, uint32)  # value key prefix, its mask, id prefix, its mask
    left = cuda.shared.array(1, int32)     # entries still to place at or below the prefix
    count = cuda.shared.array(1, int32)    # candidates gathered
    vocab, k = values.shape[1], top_ids.shape[1]
    last = vocab - 1
    for row in range(cuda.blockIdx.x, values.shape[0], cuda.gridDim.x):
        if tid == 0:
            for i in range(4):
                prefix[i] = uint32(0)
            left[0] = k
            count[0] = 0
        for p in range(KEY_DIGITS + digits):
            on_key = p < KEY_DIGITS
            shift = DIGIT_BITS * (KEY_DIGITS - 1 - p if on_key else digits - 1 - (p - KEY_DIGITS))
            for d in range(tid, RADIX, step):
                hist[d] = 0
            cuda.syncthreads()  # histogram cleared, and the prefix of the pass before written, before counting
            key_prefix, key_mask, id_prefix, id_mask = prefix[0], prefix[1], prefix[2], prefix[3]
            for v in range(tid, vocab, step):
                key = order_key(bits[row, v])
                rid = uint32(last - v)
                if (key & key_mask) == key_prefix and (rid & id_mask) == id_prefix:
                    part = key if on_key else rid
                    cuda.atomic.add(hist, (part >> shift) & (RADIX - 1), 1)
            cuda.syncthreads()  # every matching entry counted before thread 0 reads the histogram
            if tid == 0:
                remaining = left[0]
                digit = RADIX - 1
                while hist[digit] < remaining:  # some digit holds the remaining-th entry from the top
                    remaining -= hist[digit]
                    digit -= 1
                left[0] = remaining
                slot = 0 if on_key else 2
                prefix[slot] = prefix[slot] | uint32(digit << shift)
                prefix[slot + 1] = prefix[slot + 1] | uint32((RADIX - 1) << shift)
            cuda.syncthreads()  # the prefix thread 0 extended is read by the next pass (or the gather)
        key_kth, id_kth = prefix[0], prefix[2]  # the k-th pair: exactly k entries are at or above it
        for v in range(tid, vocab, step):
            key = order_key(bits[row, v])
            rid = uint32(last - v)
            if key > key_kth or (key == key_kth and rid >= id_kth):
                cand_ids[row, cuda.atomic.add(count, 0, 1)] = v
        cuda.syncthreads()  # all k candidates written (global memory: visible to the block past the barrier)
        for i in range(tid, k, step):
            v = cand_ids[row, i]
            key = order_key(bits[row, v])
            rank = 0
            for j in range(k):
                other = order_key(bits[row, cand_ids[row, j]])
                if other > key or (other == key and cand_ids[row, j] < v):
                    rank += 1
            top_ids[row, rank] = v
            top_values[row, rank] = values[row, v]
        cuda.syncthreads()  # every slot written before thread 0 reads slots 0 and 1 and resets the shared state
        if tid == 0:
            margins[row] = top_values[row, 0] - top_values[row, 1]


def topk_select_rows(values, k: int):
    """(ids int32 [s, k], values float32 [s, k], margins float32 [s]) device arrays of float32 values [s, V]
    (device or numpy), 2 <= k <= V; ties -> lower id. For any k; sampling.topk_rows is quicker for k <= 16."""
    values = as_device_array(values, "values")
    check_array(values, "values", (None, None), [np.float32])
    rows, vocab = values.shape
    if not 2 <= k <= vocab:
        raise ValueError(f"k must be in 2..V={vocab}, got {k}")
    top_ids = cuda.device_array((rows, k), np.int32)
    top_values = cuda.device_array((rows, k), np.float32)
    margins = cuda.device_array(rows, np.float32)
    if rows:
        cand_ids = cuda.device_array((rows, k), np.int32)
        select_topk_kernel[row_blocks(rows), SELECT_THREADS](values, values.view(np.uint32), id_digits(vocab),
                                                              top_ids, top_values, margins, cand_ids)
    return top_ids, top_values, margins

