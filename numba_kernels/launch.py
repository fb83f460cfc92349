"""Launch a kernel compiled for one signature without Numba's per-call argument processing.

Numba's dispatcher types every argument and wraps every array in a strided memory view on each launch: 63 us
of host time for the 18-argument tensor-core GEMM on the H200's host, against 20 us for cuda.core's launch
with the parameters built here (measured 2026-11-29). A call whose first kernel waits for that host time pays
it in full: one tree-verify attention call at P=8192, s=64 took 2.06 ms with Numba's launches, 1.78 ms with
these.

The parameters follow Numba's kernel ABI for the types the kernel was compiled for: an array is (meminfo,
parent, nitems, itemsize, data pointer, shape..., strides in bytes...) with meminfo and parent 0, as Numba's
own launch passes them; integers and float32 scalars as ctypes values. A C-contiguous array of any rank may
be given for a 1-D C-contiguous parameter (it is passed as its flat data, no reshaped view needed). Under the
simulator the launch goes through Numba as usual.

    launcher = Launcher(kernel)   # kernel = cuda.jit(signature)(fn): exactly one compiled overload
    launcher(grid, block, stream, shared_bytes, *args)
"""
from __future__ import annotations

import ctypes

from numba_kernels.warp import ON_SIMULATOR

_LAUNCHERS: dict = {}  # id(kernel) -> Launcher
_CORE_STREAMS: dict = {}  # CUDA stream handle -> cuda.core stream (a wrapper of the handle, nothing owned)


def stream_key(stream) -> int:
    """The CUDA stream a Numba stream (or 0 / None: the default stream) wraps, as an int (under the simulator,
    whose streams wrap nothing, the stream object's id)."""
    if stream is None or (isinstance(stream, int) and stream == 0):
        return 0
    handle = getattr(stream, "handle", None)
    if handle is None:
        return id(stream)
    handle = getattr(handle, "value", handle)  # a ctypes pointer (None for NULL) or a CUstream
    return int(handle) if handle is not None else 0


def _core_stream(stream):
    """The cuda.core stream of a Numba stream, cached by handle (it wraps the handle, owning nothing)."""
    key = stream_key(stream)
    core = _CORE_STREAMS.get(key)
    if core is None:
        from numba.cuda.cudadrv import driver
        core = _CORE_STREAMS[key] = driver._to_core_stream(stream if key else 0)
    return core


class Launcher:
    """Launches of one compiled kernel; see the module docstring."""

    def __init__(self, kernel):
        self.kernel = kernel
        if ON_SIMULATOR:
            return
        if len(kernel.overloads) != 1:
            raise ValueError(f"Launcher needs a kernel compiled for one signature, got {len(kernel.overloads)}")
        import numpy as np
        from cuda.core import LaunchConfig, launch
        from numba.cuda import types
        self._launch, self._config = launch, LaunchConfig
        overload = next(iter(kernel.overloads.values()))
        self._function = overload._codelibrary.get_cufunc().kernel
        self._kinds = []  # per parameter: ("array", ndim, numpy dtype) / ("int", ctype) / ("float32",)
        for ty in overload.argument_types:
            if isinstance(ty, types.Array):
                if ty.ndim == 1 and ty.layout != "C":
                    raise TypeError(f"Launcher: 1-D parameters must be C-contiguous, got {ty}")
                self._kinds.append(("array", ty.ndim, np.dtype(str(ty.dtype))))  # compared as objects: str() costs us
            elif isinstance(ty, types.Integer):
                self._kinds.append(("int", getattr(ctypes, f"c_{'u' if not ty.signed else ''}int{ty.bitwidth}")))
            elif ty == types.float32:
                self._kinds.append(("float32",))
            else:
                raise TypeError(f"Launcher: unsupported parameter type {ty}")

    def __call__(self, grid, block, stream, shared_bytes: int, *args) -> None:
        if ON_SIMULATOR:
            self.kernel[grid, block, stream, shared_bytes](*args)
            return
        if len(args) != len(self._kinds):
            raise TypeError(f"kernel takes {len(self._kinds)} arguments, got {len(args)}")
        params = []
        for kind, value in zip(self._kinds, args):
            if kind[0] == "array":
                if value.dtype != kind[2]:
                    raise TypeError(f"Launcher: {kind[2]} array expected, got {value.dtype}")
                size, itemsize = value.size, value.dtype.itemsize
                params += (0, 0, size, itemsize, value.device_ctypes_pointer.value or 0)
                if kind[1] == len(value.shape):
                    params += value.shape
                    params += value.strides
                elif kind[1] == 1 and value.is_c_contiguous():  # a C-contiguous array as its flat data
                    params += (size, itemsize)
                else:
                    raise TypeError(f"Launcher: {kind[1]}-D array expected, got shape {value.shape}")
            elif kind[0] == "int":
                params.append(kind[1](value))
            else:
                params.append(ctypes.c_float(value))
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        self._launch(_core_stream(stream), self._config(grid=grid, block=block, shmem_size=shared_bytes),
                     self._function, *params)


def launcher_for(kernel) -> Launcher:
    """The cached Launcher of a kernel (one per kernel object)."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return launcher

