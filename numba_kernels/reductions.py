"""Block-wide reductions for 1-D thread blocks: max, sum, argmax (ties -> lowest index), and the inclusive
prefix sums of two integers (block_inclusive_sums).

On a GPU each warp reduces with shuffles, then warp 0 reduces the per-warp partials. The CUDA simulator
has no warp shuffles, so there (and for blocks narrower than a warp) a shared-memory tree reduction
runs instead. Every thread of the block must call the helper (it contains ``syncthreads``), and every
thread gets the result.

Contract for all helpers:
- the block is 1-D and ``blockDim.x`` is a power of two (<= 1024);
- ``scratch`` arrays are ``cuda.shared.array`` of length >= ``blockDim.x``, of the value's dtype
  (``scratch_ids``: int32), declared by the calling kernel (one declaration per line, which the
  simulator needs to tell arrays apart);
- the helper ends with a ``syncthreads`` so the caller may reuse the scratch right away.

max and argmax are exact whatever the reduction order; a float sum is not: the GPU (shuffle) and the
simulator (tree) orders round differently, so compare sums with a tolerance.
"""
from numba import cuda

from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function

# Shuffles only exist on a real GPU; the constant is frozen when a kernel compiles.
USE_SHUFFLE = not ON_SIMULATOR
FULL_MASK = 0xFFFFFFFF
WARP_SIZE = 32
INT32_MAX = 2147483647


@device_function(inline=True)
def _better(value, index, best_value, best_index):
    """True when (value, index) beats (best_value, best_index): larger value, then lower index."""
    return value > best_value or (value == best_value and index < best_index)


@device_function(inline=True)
def _warp_max(value):
    offset = WARP_SIZE // 2
    while offset > 0:
        other = cuda.shfl_down_sync(FULL_MASK, value, offset)
        if other > value:
            value = other
        offset //= 2
    return cuda.shfl_sync(FULL_MASK, value, 0)


@device_function(inline=True)
def _warp_sum(value):
    offset = WARP_SIZE // 2
    while offset > 0:
        value += cuda.shfl_down_sync(FULL_MASK, value, offset)
        offset //= 2
    return cuda.shfl_sync(FULL_MASK, value, 0)


@device_function(inline=True)
def _warp_argmax(value, index):
    offset = WARP_SIZE // 2
    while offset > 0:
        other_value = cuda.shfl_down_sync(FULL_MASK, value, offset)
        other_index = cuda.shfl_down_sync(FULL_MASK, index, offset)
        if _better(other_value, other_index, value, index):
            value = other_value
            index = other_index
        offset //= 2
    return cuda.shfl_sync(FULL_MASK, value, 0), cuda.shfl_sync(FULL_MASK, index, 0)


@device_function()
def block_max(value, scratch):
    """Max of ``value`` over the block; returned to every thread."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    if USE_SHUFFLE and width >= WARP_SIZE:
        value = _warp_max(value)
        if tid % WARP_SIZE == 0:
            scratch[tid // WARP_SIZE] = value
        cuda.syncthreads()  # every warp's partial is in scratch
        if tid < WARP_SIZE:
            # max is idempotent: lanes past the warp count re-read partial 0
            partial = scratch[tid] if tid < width // WARP_SIZE else scratch[0]
            partial = _warp_max(partial)
            if tid == 0:
                scratch[0] = partial
    else:
        scratch[tid] = value
        cuda.syncthreads()  # all values stored before the tree reads them
        stride = width // 2
        while stride > 0:
            if tid < stride and scratch[tid + stride] > scratch[tid]:
                scratch[tid] = scratch[tid + stride]
            cuda.syncthreads()  # this level finished before the next reads it
            stride //= 2
    cuda.syncthreads()  # result in scratch[0] visible to all
    result = scratch[0]
    cuda.syncthreads()  # everyone read scratch[0] before the caller reuses scratch
    return result


@device_function()
def block_sum(value, scratch):
    """Sum of ``value`` over the block; returned to every thread (order differs GPU vs simulator)."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    if USE_SHUFFLE and width >= WARP_SIZE:
        value = _warp_sum(value)
        if tid % WARP_SIZE == 0:
            scratch[tid // WARP_SIZE] = value
        cuda.syncthreads()  # every warp's partial is in scratch
        if tid < WARP_SIZE:
            partial = scratch[tid] if tid < width // WARP_SIZE else scratch[0] * 0
            partial = _warp_sum(partial)
            if tid == 0:
                scratch[0] = partial
    else:
        scratch[tid] = value
        cuda.syncthreads()  # all values stored before the tree reads them
        stride = width // 2
        while stride > 0:
            if tid < stride:
                scratch[tid] += scratch[tid + stride]
            cuda.syncthreads()  # this level finished before the next reads it
            stride //= 2
    cuda.syncthreads()  # result in scratch[0] visible to all
    result = scratch[0]
    cuda.syncthreads()  # everyone read scratch[0] before the caller reuses scratch
    return result


@device_function()
def block_argmax(value, index, scratch, scratch_ids):
    """(max value, its index) over the block, ties -> lowest index; returned to every thread.

    Threads with nothing to offer pass (-inf, INT32_MAX): they lose every tie against a real index.
    """
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    if USE_SHUFFLE and width >= WARP_SIZE:
        value, index = _warp_argmax(value, index)
        if tid % WARP_SIZE == 0:
            scratch[tid // WARP_SIZE] = value
            scratch_ids[tid // WARP_SIZE] = index
        cuda.syncthreads()  # every warp's partial is in scratch
        if tid < WARP_SIZE:
            slot = tid if tid < width // WARP_SIZE else 0  # re-reading partial 0 changes nothing
            value, index = _warp_argmax(scratch[slot], scratch_ids[slot])
            if tid == 0:
                scratch[0] = value
                scratch_ids[0] = index
    else:
        scratch[tid] = value
        scratch_ids[tid] = index
        cuda.syncthreads()  # all pairs stored before the tree reads them
        stride = width // 2
        while stride > 0:
            if tid < stride and _better(scratch[tid + stride], scratch_ids[tid + stride],
                                        scratch[tid], scratch_ids[tid]):
                scratch[tid] = scratch[tid + stride]
                scratch_ids[tid] = scratch_ids[tid + stride]
            cuda.syncthreads()  # this level finished before the next reads it
            stride //= 2
    cuda.syncthreads()  # result in slot 0 visible to all
    best_value = scratch[0]
    best_index = scratch_ids[0]
    cuda.syncthreads()  # everyone read slot 0 before the caller reuses scratch
    return best_value, best_index


@device_function(inline=True)
def _warp_inclusive_sums(a, b, lane):
    """Inclusive prefix sums of a and b over the warp's lanes (lane: this thread's)."""
    offset = 1
    while offset < WARP_SIZE:
        other_a = cuda.shfl_up_sync(FULL_MASK, a, offset)
        other_b = cuda.shfl_up_sync(FULL_MASK, b, offset)
        if lane >= offset:
            a += other_a
            b += other_b
        offset *= 2
    return a, b


@device_function()
def block_inclusive_sums(a, b, scratch_a, scratch_b):
    """Inclusive prefix sums over the block's threads (in thread order) of the integers a and b, both at once:
    (a_0 + .. + a_tid, b_0 + .. + b_tid) to thread tid. Exact, so the GPU's warp-shuffle scan (two barriers)
    and the simulator's shared-memory Hillis-Steele scan (two a level) give the same result."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    if USE_SHUFFLE and width >= WARP_SIZE:
        lane, warp = tid % WARP_SIZE, tid // WARP_SIZE
        a, b = _warp_inclusive_sums(a, b, lane)
        if lane == WARP_SIZE - 1:
            scratch_a[warp] = a
            scratch_b[warp] = b
        cuda.syncthreads()  # every warp's total is in scratch
        if warp == 0:
            total_a = scratch_a[lane] if lane < width // WARP_SIZE else a * 0
            total_b = scratch_b[lane] if lane < width // WARP_SIZE else b * 0
            total_a, total_b = _warp_inclusive_sums(total_a, total_b, lane)
            scratch_a[lane] = total_a  # warps 0 .. lane's totals
            scratch_b[lane] = total_b
        cuda.syncthreads()  # the warps' running totals are in scratch
        if warp > 0:
            a += scratch_a[warp - 1]
            b += scratch_b[warp - 1]
    else:
        scratch_a[tid] = a
        scratch_b[tid] = b
        cuda.syncthreads()  # all values stored before the scan reads them
        stride = 1
        while stride < width:  # Hillis-Steele
            add_a = scratch_a[tid - stride] if tid >= stride else a * 0
            add_b = scratch_b[tid - stride] if tid >= stride else b * 0
            cuda.syncthreads()  # all reads of this level done before the writes
            scratch_a[tid] += add_a
            scratch_b[tid] += add_b
            cuda.syncthreads()  # this level's sums visible to the next
            stride *= 2
        a = scratch_a[tid]
        b = scratch_b[tid]
    cuda.syncthreads()  # every thread read scratch before the caller reuses it
    return a, b
