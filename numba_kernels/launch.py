"""Launch Numba kernels without Numba's per-call argument processing.

Numba's dispatcher types every argument and wraps every array in a strided memory view on each launch, tens
of microseconds of host time for the 21-argument tensor-core GEMM; a call whose first kernel waits for that
host time pays it in full. Here the parameters are packed into one reused buffer and handed to cuLaunchKernel,
cheaper than both Numba's launch and cuda.core's (the figures: docs/benchmarks-history.md, sessions 5 and 6).

The parameters follow Numba's kernel ABI for the types the kernel was compiled for: an array is (meminfo,
parent, nitems, itemsize, data pointer, shape..., strides in bytes...) with meminfo and parent 0, as Numba's
own launch passes them; integers (32 / 64 bits), float32 / float64 and booleans as themselves. A
C-contiguous array of any rank may be given for a 1-D C-contiguous parameter (it is passed as its flat data,
no reshaped view needed). Under the simulator the launch goes through Numba as usual.

    launcher = Launcher(kernel)   # kernel = cuda.jit(signature)(fn): exactly one compiled overload
    launcher(grid, block, stream, shared_bytes, *args)
    launch(kernel, grid, block, stream, *args)   # a lazily compiled kernel: a Launcher per argument types
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

from kdspec.numba_kernels.runtime import ON_SIMULATOR

_LAUNCHERS: dict = {}  # id(kernel) -> Launcher


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


class Launcher:
    """Launches of one compiled kernel; see the module docstring."""

    def __init__(self, kernel, overload=None):
        """``overload``: the compiled kernel to launch (``kernel.compile(signature)``); omitted, the kernel's
        one compiled overload."""
        self.kernel = kernel
        if ON_SIMULATOR:
            return
        if overload is None:
            if len(kernel.overloads) != 1:
                raise ValueError(f"Launcher needs a kernel compiled for one signature, got {len(kernel.overloads)}")
            overload = next(iter(kernel.overloads.values()))
        from cuda.bindings import driver
        from numba.cuda import types
        self._driver = driver
        self._handle = overload._codelibrary.get_cufunc().handle  # a CUkernel: cuLaunchKernel takes it as is
        self._kinds = []  # per parameter: ("array", ndim, numpy dtype, needs C order) / ("int",) / ("scalar",)
        formats = []  # struct format of each 8-byte parameter slot
        for ty in overload.argument_types:
            if isinstance(ty, types.Array):
                # dtype compared as an object (str() costs us); a "C" parameter needs a C-contiguous array
                self._kinds.append(("array", ty.ndim, np.dtype(str(ty.dtype)), ty.layout == "C"))
                # meminfo, parent, nitems, itemsize, data pointer, shape, strides
                formats += ["q", "q", "q", "q", "Q"] + ["q"] * (2 * ty.ndim)
            elif isinstance(ty, types.Integer) and ty.bitwidth in (32, 64):
                self._kinds.append(("int",))
                formats.append({(32, True): "i4x", (32, False): "I4x", (64, True): "q", (64, False): "Q"}[
                    (ty.bitwidth, ty.signed)])
            elif ty in (types.float32, types.float64, types.boolean):
                self._kinds.append(("scalar",))
                formats.append({types.float32: "f4x", types.float64: "d", types.boolean: "?7x"}[ty])
            else:
                raise TypeError(f"Launcher: unsupported parameter type {ty}")
        # every parameter in its own 8-byte slot of one buffer, packed per launch; the driver copies the values
        # during cuLaunchKernel, so the buffer is reused (under a lock: launches from two threads would race)
        self._packer = struct.Struct("<" + "".join(formats))
        self._buffer = ctypes.create_string_buffer(max(self._packer.size, 8))
        base = ctypes.addressof(self._buffer)
        self._slots = (ctypes.c_void_p * len(formats))(*[base + 8 * i for i in range(len(formats))])
        self._lock = threading.Lock()

    def __call__(self, grid, block, stream, shared_bytes: int, *args) -> None:
        if ON_SIMULATOR:
            self.kernel[grid, block, stream, shared_bytes](*args)
            return
        if len(args) != len(self._kinds):
            raise TypeError(f"kernel takes {len(self._kinds)} arguments, got {len(args)}")
        values = []
        for kind, value in zip(self._kinds, args):
            if kind[0] == "array":
                if value.dtype != kind[2]:
                    raise TypeError(f"Launcher: {kind[2]} array expected, got {value.dtype}")
                size, itemsize = value.size, value.dtype.itemsize
                values += (0, 0, size, itemsize, value.device_ctypes_pointer.value or 0)
                if kind[1] == len(value.shape):
                    if kind[3] and not value.is_c_contiguous():
                        raise TypeError(f"Launcher: C-contiguous {kind[1]}-D array expected")
                    values += value.shape
                    values += value.strides
                elif kind[1] == 1 and value.is_c_contiguous():  # a C-contiguous array as its flat data
                    values += (size, itemsize)
                else:
                    raise TypeError(f"Launcher: {kind[1]}-D array expected, got shape {value.shape}")
            else:
                values.append(value)
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        gx, gy, gz = grid + (1,) * (3 - len(grid))
        bx, by, bz = block + (1,) * (3 - len(block))
        with self._lock:
            try:
                self._packer.pack_into(self._buffer, 0, *values)
            except struct.error as error:
                raise TypeError(f"Launcher: an argument does not fit its parameter type ({error})") from None
            result, = self._driver.cuLaunchKernel(self._handle, gx, gy, gz, bx, by, bz, shared_bytes,
                                                  stream_key(stream), ctypes.addressof(self._slots), 0)
        if result != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {result.name} (grid {grid}, block {block}, "
                               f"{shared_bytes} bytes of shared memory)")


def launcher_for(kernel) -> Launcher:
    """The cached Launcher of a kernel (one per kernel object)."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return launcher


_SPECIALIZED: dict = {}  # (id(kernel), argument type keys) -> (kernel, Launcher of its overload for those types)


def type_key(value):
    """What Numba's typing of a launch argument depends on: (dtype, ndim, layout) of a device array, the type
    of a scalar; None for anything else (a host array: Numba copies it, the launcher cannot)."""
    if hasattr(value, "is_c_contiguous"):
        layout = "C" if value.is_c_contiguous() else "F" if value.is_f_contiguous() else "A"
        return value.dtype, len(value.shape), layout
    if isinstance(value, (int, float, bool, np.integer, np.floating, np.bool_)):
        return type(value)
    return None


def launch(kernel, grid, block, stream, *args, shared_bytes: int = 0) -> None:
    """kernel[grid, block, stream, shared_bytes](*args) for a lazily compiled Numba kernel, through a Launcher
    of the overload the kernel compiles for these argument types (once per type combination): 2-3x less host
    time a launch. Host arrays among the arguments (or the simulator) take Numba's launch.

    The overload is compiled by the kernel itself, not by ``kernel.specialize``: a specialization is a new
    dispatcher without the kernel's disk cache (kernel_cache), so it would compile in every process."""
    if not ON_SIMULATOR:
        keys = tuple(type_key(value) for value in args)
        if None not in keys:
            entry = _SPECIALIZED.get((id(kernel),) + keys)
            if entry is None or entry[0] is not kernel:
                overload = kernel.compile(tuple(kernel.typeof_pyval(value) for value in args))
                entry = _SPECIALIZED[(id(kernel),) + keys] = (kernel, Launcher(kernel, overload))
            entry[1](grid, block, stream, shared_bytes, *args)
            return
    kernel[grid, block, stream, shared_bytes](*args)
