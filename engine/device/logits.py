"""DeviceLogits: a forward's logits [s, V] float32 left on the device, copied to the host only when read."""
from __future__ import annotations

import numpy as np

from kdspec.numba_kernels import sampling


class DeviceLogits:
    """Logits [s, V] float32 left on the device: token choice runs there; ``np.asarray`` copies them to the
    host once, only when something (a step record) reads them."""

    def __init__(self, device, to_host, topk=None):
        self.device, self._to_host, self._host = device, to_host, None
        self._topk = topk  # (k, ids, values, margins: device or host arrays) when token choice ran the top-k

    def keep_topk(self, k: int, ids, values, margins) -> None:
        """Keep a top-k the token choice computed over these logits (``topk`` then reads it, not the logits)."""
        self._topk = (k, ids, values, margins)

    @property
    def shape(self):
        return tuple(self.device.shape)

    def __len__(self) -> int:
        return self.device.shape[0]

    def __getitem__(self, key) -> "DeviceLogits":
        return DeviceLogits(self.device[key], self._to_host)

    def rows(self, indices) -> np.ndarray:
        """Host copy of the rows ``indices`` only (e.g. the accepted nodes): float32 [len(indices), V]."""
        if self._host is not None:
            return self._host[np.asarray(indices)]
        return np.stack([self._to_host(self.device[int(i):int(i) + 1])[0] for i in indices])

    def topk(self, k: int):
        """Per row on the device: (ids int32 [s, k], values float32 [s, k], top1 - top2 margin float32 [s]);
        past V padded with -1 / NaN, ties -> lower id (as engine.records.target_topk)."""
        s, vocab = self.shape
        width = min(k, vocab)
        if self._topk is not None and self._topk[0] == width:
            found = self._topk[1:]
        else:
            found = sampling.topk_rows(self.device, width)
        ids, values, margins = (a if isinstance(a, np.ndarray) else self._to_host(a) for a in found)
        if width < k:
            ids = np.concatenate([ids, np.full((s, k - width), -1, np.int32)], axis=1)
            values = np.concatenate([values, np.full((s, k - width), np.nan, np.float32)], axis=1)
        return ids, values, margins

    def __array__(self, dtype=None, copy=None):
        if self._host is None:
            self._host = self._to_host(self.device)
        return self._host if dtype is None else self._host.astype(dtype)
