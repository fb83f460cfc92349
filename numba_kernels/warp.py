"""Block-wide reductions for 1-D thread blocks: max, sum, argmax (ties -> lowest index).

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
import sys
import threading

import numpy as np
from numba import cuda
from numba.cuda import config

from .device_arrays import as_device_array

ON_SIMULATOR = bool(config.ENABLE_CUDASIM)
# Kernels with one block per token row (or per expert) loop over rows grid-stride and launch
# row_blocks(rows) blocks. On a GPU that is one block per row (65535: the largest grid y extent; only
# longer launches reuse blocks). The simulator pays a fixed cost per block (it starts a Python thread per
# CUDA thread, then polls them), so there one block loops over all the rows.
MAX_ROW_BLOCKS = 1 if ON_SIMULATOR else 65535


def _thread_safe_simulator_shared_arrays():
    """Make the simulator's cuda.shared.array allocation atomic.

    The simulator keys a launch's shared arrays by the calling (file, line) and creates one on first use
    with an unlocked get-then-set: two threads interleaving there get different arrays, and the kernel
    silently computes garbage (seen as rare wrong tokens once threads switch often). Same keying, under a
    lock; the frame lookup also replaces the simulator's much slower traceback.extract_stack."""
    from numba.cuda.simulator import kernelapi

    simulator_array = kernelapi.FakeCUDAShared.array
    if getattr(simulator_array, "thread_safe", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # an error, or the dynamic buffer: no allocation to race on
            return simulator_array(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            allocation = self._allocations.get(caller)
            if allocation is None:
                allocation = self._allocations[caller] = np.empty(shape, dtype)
        return allocation

    array.thread_safe = True
    kernelapi.FakeCUDAShared.array = array


if ON_SIMULATOR:
    # The simulator's block manager busy-polls its threads while holding the GIL; a thread woken from
    # syncthreads waits for the interpreter's switch interval (5 ms by default) to run again, so every
    # syncthreads costs milliseconds. Switching every 50 us makes simulated kernels ~5x faster; it only
    # changes how often Python threads trade the GIL.
    sys.setswitchinterval(5e-5)
    _thread_safe_simulator_shared_arrays()


def device_function(**options):
    """``cuda.jit(device=True, **options)``, the decorator for device helpers.

    Under the simulator a helper that never names the ``cuda`` module stays a plain Python function: the
    simulator runs every device-function call inside a lock and a swap of the module's globals (~10 us), and
    per-element helpers (weight loads, FMAs) run ~10^5 times a launch there. The GPU build is unchanged."""
    def decorate(fn):
        if ON_SIMULATOR and not _names_cuda(fn):
            return fn
        return cuda.jit(device=True, **options)(fn)
    return decorate


def _names_cuda(fn) -> bool:
    """Whether ``fn`` reads the ``cuda`` module (the global the simulator swaps for its fake one)."""
    names = fn.__code__.co_names
    return "cuda" in names or any(fn.__globals__.get(name) is cuda for name in names)


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


def row_blocks(rows: int) -> int:
    """Blocks to launch for a grid-stride loop over ``rows`` rows (kernels: ``for row in
    range(cuda.blockIdx.x, rows, cuda.gridDim.x)``, block-uniform so syncthreads stays legal)."""
    return max(1, min(rows, MAX_ROW_BLOCKS))


to_device = as_device_array  # launcher helper (numba_kernels/device_arrays.py)
