"""The runtime every kernel module shares: simulator detection and its patches, the device-helper decorator,
static unrolling, and the launch-size helper for grid-stride row loops.

Importing this module under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) makes the simulator's shared arrays
thread-safe and shortens the interpreter's switch interval (both explained below); on a GPU it changes nothing.
"""
import sys
import threading

import numpy as np
from numba import cuda
from numba.cuda import config

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


# Device helpers are inlined into the kernel (LLVM alwaysinline on a GPU; the simulator has no such option).
SHARED_LIMIT = 48 * 1024  # shared memory a block may take without opting in (all static shared memory)
INLINE_DEVICE = {} if ON_SIMULATOR else dict(forceinline=True)


def static_for(count: int, body, start: int = 0):
    """Device function run(args) = body(start, args); ...; body(start + count - 1, args) as straight-line calls.

    A register array (cuda.local.array) stays in registers only if every index is a constant after
    unrolling, and LLVM leaves loops with large bodies rolled (the array then lives in local memory). Calls
    with constant first arguments give the constant indices whatever the body's size. args: one tuple.
    Built as halves of halves, so that typing nests log2(count) device functions deep, not count."""
    if count == 1:
        @device_function(**INLINE_DEVICE)
        def run_one(args):
            body(start, args)
        return run_one
    half = count // 2
    first, second = static_for(half, body, start), static_for(count - half, body, start + half)

    @device_function(**INLINE_DEVICE)
    def run(args):
        first(args)
        second(args)
    return run


def row_blocks(rows: int) -> int:
    """Blocks to launch for a grid-stride loop over ``rows`` rows (kernels: ``for row in
    range(cuda.blockIdx.x, rows, cuda.gridDim.x)``, block-uniform so syncthreads stays legal)."""
    return max(1, min(rows, MAX_ROW_BLOCKS))


def scalar_reader(on_device: bool):
    """A device helper read(arg) -> the value of a kernel's scalar argument given either as the launch scalar
    itself or, with ``on_device``, as an int32 [1] device array holding it (the cache length a captured CUDA
    graph reads at every replay). Chosen when the kernel is built: a kernel is typed for one kind of argument."""
    if on_device:
        @device_function(inline=True)
        def read(arg):
            return arg[0]
    else:
        @device_function(inline=True)
        def read(arg):
            return arg
    return read
