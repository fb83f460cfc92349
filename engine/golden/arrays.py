"""The array namespace of the golden's layers: numpy itself for numpy arrays, ``TorchNumpy`` for torch tensors.

One definition of the reference math runs on two array libraries: each function of layers.py and model.py asks
``namespace(x, ...)`` for the module it computes with and calls numpy's names on it (``xp.einsum``,
``xp.argsort(..., kind="stable")``). For numpy arrays that module is numpy, so the numpy golden is the code it
always was. For torch tensors it is ``TorchNumpy``: the few numpy functions the layers use, with numpy's
signatures and semantics, on torch (float64 on a torch device: the golden on a GPU). Stable sorts and first-index
argmax break ties as numpy does. torch is imported only when a tensor is met.
"""
from __future__ import annotations

import warnings
from typing import ClassVar

import numpy as np


def is_tensor(a) -> bool:
    """Whether ``a`` is a torch tensor (without importing torch)."""
    return type(a).__module__.startswith("torch") and type(a).__name__ in ("Tensor", "Parameter")


def namespace(*arrays):
    """numpy, or the TorchNumpy of the first torch tensor's device when any argument is one."""
    for a in arrays:
        if is_tensor(a):
            return TorchNumpy.of(a.device)
    return np


def to_host(a) -> np.ndarray:
    """A numpy array of ``a`` (a torch tensor is copied to the host; numpy arrays are returned as they are)."""
    return a.detach().cpu().numpy() if is_tensor(a) else np.asarray(a)


class TorchNumpy:
    """numpy's names over torch on one device (only what engine/golden's layers and model use)."""

    _by_device: ClassVar[dict] = {}

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.float64, self.int64, self.bool_ = torch.float64, torch.int64, torch.bool
        self.inf = float("inf")

    @classmethod
    def of(cls, device) -> TorchNumpy:
        key = str(device)
        if key not in cls._by_device:
            cls._by_device[key] = cls(device)
        return cls._by_device[key]

    # -- creation and conversion ------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """A tensor on this device (numpy arrays are copied over; float32 weights cross at 4 bytes and widen
        there, not on the host)."""
        if not is_tensor(a):
            with warnings.catch_warnings():  # read-only memory-mapped weights: never written through the tensor
                warnings.simplefilter("ignore", UserWarning)
                a = self.torch.as_tensor(np.asarray(a))
        a = a.to(device=self.device)
        return a if dtype is None else a.to(dtype=dtype)

    def zeros(self, shape, dtype=None):
        return self.torch.zeros(shape, dtype=dtype or self.float64, device=self.device)

    def ones(self, shape, dtype=None):
        return self.torch.ones(shape, dtype=dtype or self.float64, device=self.device)

    def empty(self, shape, dtype=None):
        return self.torch.empty(shape, dtype=dtype or self.float64, device=self.device)

    def empty_like(self, a):
        return self.torch.empty_like(a)

    def zeros_like(self, a):
        return self.torch.zeros_like(a)

    def copy(self, a):
        return a.clone()

    # -- elementwise and reductions ---------------------------------------------------------------------
    def sqrt(self, a):
        return self.torch.sqrt(a)

    def exp(self, a):
        return self.torch.exp(a)

    def where(self, condition, a, b):
        return self.torch.where(condition, a, b)

    def mean(self, a, axis=None, keepdims=False):
        return self.torch.mean(a, dim=axis, keepdim=keepdims)

    def sum(self, a, axis=None, keepdims=False):
        return self.torch.sum(a, dim=axis, keepdim=keepdims)

    def max(self, a, axis=None, keepdims=False):
        return self.torch.amax(a, dim=axis, keepdim=keepdims)

    def any(self, a, axis=None):
        return self.torch.any(a, dim=axis)

    # -- shapes and products ----------------------------------------------------------------------------
    def einsum(self, subscripts, *operands):
        return self.torch.einsum(subscripts, *operands)

    def concatenate(self, arrays, axis=0):
        return self.torch.cat(list(arrays), dim=axis)

    def broadcast_to(self, a, shape):
        return self.torch.broadcast_to(a, shape)

    def repeat(self, a, repeats, axis):
        return self.torch.repeat_interleave(a, repeats, dim=axis)

    # -- ordering and selection (ties as numpy: stable sorts keep the lower index first) ----------------
    def sort(self, a, axis=-1):
        return self.torch.sort(a, dim=axis, stable=True).values

    def argsort(self, a, axis=-1, kind="stable"):
        if kind != "stable":
            raise ValueError(f"TorchNumpy.argsort: only kind='stable' ties as numpy does, got {kind!r}")
        return self.torch.argsort(a, dim=axis, stable=True)

    def take_along_axis(self, a, indices, axis):
        return self.torch.gather(a, axis, indices)

    def put_along_axis(self, a, indices, values, axis) -> None:
        a.scatter_(axis, indices, values)

    def unique(self, a):
        return self.torch.unique(a, sorted=True)

    def nonzero(self, a):
        return self.torch.nonzero(a, as_tuple=True)

    def flatnonzero(self, a):
        return self.torch.nonzero(a.reshape(-1)).reshape(-1)
