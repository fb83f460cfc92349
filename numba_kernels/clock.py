"""Device timestamps: the GPU's global nanosecond timer (%globaltimer) written by a one-thread kernel, so that a
captured CUDA graph can mark on the GPU's own clock when its work began and ended (its first and last node), and
a benchmark can tell, in the same unprofiled run, the GPU's busy time from the time it waited for the host.

    stamp_kernel[1, 1, stream](stamps, counter, end)   stamps int64 [n, 2]; counter int32 [1]; end 0 or 1

writes the timer into stamps[counter[0], end] and, at the end stamp (end = 1), advances counter[0]; once the
counter reaches n, stamps are dropped. ``Stamps`` holds the two arrays and launches it. Under the simulator the
timer is the host's perf_counter_ns.
"""
from __future__ import annotations

import time

import numpy as np
from numba import cuda

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.runtime import ON_SIMULATOR

if ON_SIMULATOR:
    def global_timer():
        return np.int64(time.perf_counter_ns())
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _global_timer(typingctx):
        def codegen(context, builder, sig, args):
            timer = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l",
                                 side_effect=True)  # volatile: each read is its own
            return builder.call(timer, [])
        return types.int64(), codegen

    @cuda.jit(device=True, inline=True)
    def global_timer():
        return _global_timer()


@kernel_cache.jit
def stamp_kernel(stamps, counter, end):
    """stamps int64 [n, 2]: the timer at stamps[counter[0], end]; end = 1 then advances counter int32 [1];
    one thread."""
    if cuda.grid(1) == 0:
        slot = counter[0]
        if slot < stamps.shape[0]:
            stamps[slot, end] = global_timer()
            if end == 1:
                counter[0] = slot + 1


class Stamps:
    """Begin and end stamps of up to ``capacity`` spans (a decode's steps) on the device; ``spans()`` reads them
    back as seconds [k, 2] (k spans completed) and ``clear()`` starts over."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.stamps = cuda.to_device(np.zeros((capacity, 2), np.int64))
        self.counter = cuda.to_device(np.zeros(1, np.int32))

    def stamp(self, end: bool, stream=0) -> None:
        stamp_kernel[1, 1, stream](self.stamps, self.counter, 1 if end else 0)

    def clear(self) -> None:
        self.counter.copy_to_device(np.zeros(1, np.int32))

    def spans(self) -> np.ndarray:
        """float64 [k, 2]: (begin, end) seconds of each completed span, on the GPU's clock."""
        count = int(self.counter.copy_to_host()[0])
        return self.stamps.copy_to_host()[:count] * 1e-9
