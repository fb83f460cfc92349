"""DeviceCache: the MLA KV cache on the device, one array [layers, capacity, c + r] float32."""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.model.config import ModelConfig


class DeviceCache:
    """The MLA cache on the device: kv [layers, capacity, c + r] float32, rows [normed latent | roped k_pe];
    hidden [n, capacity, d] the kept hidden states (see engine/golden/model.py ReferenceCache)."""

    def __init__(self, cfg: ModelConfig, capacity: int, hidden_layers: tuple[int, ...] = ()):
        self.kv = cuda.device_array((cfg.num_hidden_layers, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                    dtype=np.float32)
        self.latent = cfg.kv_lora_rank
        self.length = 0
        # The residual stream at hidden_layers of every row [n, capacity, d] (a block drafter's context); moved
        # with the rows by compaction.
        self.hidden_layers = tuple(hidden_layers)
        self.hidden = cuda.device_array((len(self.hidden_layers), capacity, cfg.hidden_size), dtype=np.float32)

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]

    @property
    def c(self):
        """Per layer latent rows [capacity, c] (device views), as the golden cache names them."""
        return [self.kv[layer, :, :self.latent] for layer in range(self.kv.shape[0])]

    @property
    def k_pe(self):
        return [self.kv[layer, :, self.latent:] for layer in range(self.kv.shape[0])]
