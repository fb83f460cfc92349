"""DeviceCache: the MLA KV cache on the device, one array [layers, capacity, c + r] float32, and its length."""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.model.config import ModelConfig
from kdspec.numba_kernels.host_arrays import upload


class DeviceCache:
    """The MLA cache on the device: kv [layers, capacity, c + r] float32, rows [normed latent | roped k_pe];
    hidden [n, capacity, d] the kept hidden states (see engine/golden/model.py ReferenceCache).

    ``length`` (rows committed) is the host's; a step that runs on the device (engine/device/step.py) reads and
    advances a device copy, int32 [1]: ``device_length()`` uploads the host's value when the host changed it, and
    ``advanced_on_device(n)`` records that the device advanced both by n. ``storage``: the device arrays of a
    released cache of the same shape to reuse (DeviceModel.new_cache: captured step graphs name their addresses)."""

    def __init__(self, cfg: ModelConfig, capacity: int, hidden_layers: tuple[int, ...] = (), storage=None):
        self.hidden_layers = tuple(hidden_layers)
        if storage is None:
            storage = (cuda.device_array((cfg.num_hidden_layers, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                         dtype=np.float32),
                       # The residual stream at hidden_layers of every row [n, capacity, d] (a block drafter's
                       # context); moved with the rows by compaction.
                       cuda.device_array((len(self.hidden_layers), capacity, cfg.hidden_size), dtype=np.float32),
                       cuda.device_array(1, np.int32))
        self.storage = storage
        self.kv, self.hidden, self._length_cell = storage
        self.latent = cfg.kv_lora_rank
        self.length = 0
        self._device_value = None  # the length the device cell holds (None: unknown)
        self._host_cell = np.zeros(1, np.int32)

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]

    def device_length(self):
        """The device's int32 [1] copy of ``length``, uploaded first when the host changed the length."""
        if self._device_value != self.length:
            self._host_cell[0] = self.length
            upload(self._length_cell, self._host_cell)
            self._device_value = self.length
        return self._length_cell

    @property
    def length_cell(self):
        """The device length cell as it is (captured graphs name it; nothing uploaded)."""
        return self._length_cell

    def advanced_on_device(self, rows: int) -> None:
        """The device advanced its length by ``rows`` (a step's kernels did): the host follows."""
        self.length += int(rows)
        self._device_value = self.length

    @property
    def c(self):
        """Per layer latent rows [capacity, c] (device views), as the golden cache names them."""
        return [self.kv[layer, :, :self.latent] for layer in range(self.kv.shape[0])]

    @property
    def k_pe(self):
        return [self.kv[layer, :, self.latent:] for layer in range(self.kv.shape[0])]
