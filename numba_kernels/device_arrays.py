"""Launcher helper shared by every kernel module: turn what a caller passes into something a kernel takes."""
import numpy as np
from numba import cuda


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


def is_device_array(array) -> bool:
    """True for arrays already on the device (outputs written in place must be)."""
    return hasattr(array, "copy_to_host") or hasattr(array, "__cuda_array_interface__")
