"""Host-side array helpers shared by the kernel launchers: turn what a caller passes into something a kernel
takes, and check shapes and dtypes with one-line errors."""
import numpy as np
from numba import cuda

from kdspec.numba_kernels.runtime import ON_SIMULATOR


def as_device_array(array, name: str = "array"):
    """A numba device array as is; a ``__cuda_array_interface__`` object (torch) wrapped without a copy;
    numpy (or a list) copied to the device. Anything else: ValueError naming ``name``."""
    if hasattr(array, "copy_to_host"):
        return array
    if hasattr(array, "__cuda_array_interface__"):
        return cuda.as_cuda_array(array)
    host = np.ascontiguousarray(array)
    if host.dtype == object:
        raise ValueError(f"{name}: expected a device array or numpy array, got {type(array).__name__}")
    return cuda.to_device(host)


def device_address(array) -> int:
    """The device address of an array's first element (0 under the simulator, where alignment does not matter)."""
    return 0 if ON_SIMULATOR else (array.device_ctypes_pointer.value or 0)


def is_device_array(array) -> bool:
    """True for arrays already on the device (outputs written in place must be)."""
    return hasattr(array, "copy_to_host") or hasattr(array, "__cuda_array_interface__")


def is_device_scalar(value, name: str) -> bool:
    """Whether a kernel's scalar argument ``value`` is given on the device, as an int32 [1] device array (the
    cache length a captured CUDA graph reads at every replay: runtime.scalar_reader), rather than as a Python or
    numpy integer. ValueError naming ``name`` for anything else."""
    if isinstance(value, (int, np.integer)):
        return False
    if not is_device_array(value) or tuple(value.shape) != (1,) or value.dtype != np.int32:
        raise ValueError(f"{name} must be an integer or an int32 [1] device array")
    return True


def check_array(array, name, shape, dtypes):
    """Raise a one-line ValueError unless ``array`` has ``shape`` (None = any size) and one of ``dtypes``."""
    dtype = np.dtype(array.dtype)
    if dtype not in [np.dtype(t) for t in dtypes]:
        allowed = "/".join(np.dtype(t).name for t in dtypes)
        raise ValueError(f"{name}: dtype {dtype.name}, expected {allowed}")
    if len(array.shape) != len(shape) or any(w is not None and a != w for a, w in zip(array.shape, shape)):
        raise ValueError(f"{name}: shape {tuple(array.shape)}, expected {tuple('?' if w is None else w for w in shape)}")


def weight_view(w, name):
    """(kernel view, is_bf16) of a 3-D weight: fp32 as is; uint16/int16 bf16 bits viewed as uint32 pairs."""
    dtype = np.dtype(w.dtype)
    if dtype == np.float32:
        return w, False
    if dtype in (np.dtype(np.uint16), np.dtype(np.int16)):
        return w.view(np.uint32), True
    raise ValueError(f"{name}: dtype {dtype.name}, expected float32 or bf16 bits as uint16/int16")


def output(out, name, shape, stream):
    """The caller's ``out`` checked (float32, ``shape``), or a new device array."""
    if out is None:
        return cuda.device_array(shape, dtype=np.float32, stream=stream)
    out = as_device_array(out, name)
    check_array(out, name, shape, [np.float32])
    return out


def _check_copy(host, device, what):
    if not (host.flags["C_CONTIGUOUS"] and host.nbytes == device.nbytes and host.dtype == device.dtype):
        raise ValueError(f"{what}: host {host.shape} {host.dtype} and device {tuple(device.shape)} {device.dtype} "
                         f"must match (C-contiguous)")


def upload(device, host, stream=0) -> None:
    """device[...] = host: one raw copy, the same as ``device.copy_to_device(host)`` but without numba's per-call
    contiguity checks, which walk an array numba flags non-contiguous element by element (milliseconds per
    DDTree step for a [1, 7, 255] draft). device: a C-contiguous numba device array. With a ``stream`` the copy
    is queued on it (``host`` must then be pinned and left alone until the copy has run; inside a CUDA graph
    capture it becomes the graph's copy of whatever ``host`` holds at each replay); without, it is done on
    return."""
    _check_copy(host, device, "upload")
    if ON_SIMULATOR:
        device.copy_to_device(host)
        return
    from numba.cuda.cudadrv import driver
    driver.host_to_device(device, host, host.nbytes, stream=stream)


def download(host, device) -> None:
    """host[...] = device, the same way (waits for the device's work queued before it)."""
    _check_copy(host, device, "download")
    if ON_SIMULATOR:
        host[...] = device.copy_to_host()
        return
    from numba.cuda.cudadrv import driver
    driver.device_to_host(host, device, host.nbytes)
