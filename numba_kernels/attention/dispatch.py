"""mla_attention(): the entry point of the three attention kernels, and attention_path(), the choice among them.

decode.py runs few query tokens (AR steps, small trees), tc.py many rows on sm_80+ (3xTF32 tensor-core GEMMs),
simt.py everything else (older GPUs, the simulator) and any call that names a TileConfig or split count.
Shapes and the visibility contract: common.py.
"""
from __future__ import annotations

import functools

from numba import cuda

from kdspec.numba_kernels.attention.common import FEW_TOKENS
from kdspec.numba_kernels.attention.decode import mla_attention_decode
from kdspec.numba_kernels.attention.simt import TileConfig, mla_attention_simt
from kdspec.numba_kernels.attention.tc import mla_attention_tc
from kdspec.numba_kernels.runtime import ON_SIMULATOR


def attention_path(tokens: int, heads: int) -> str:
    """Which kernel mla_attention runs for s query tokens of h heads: "decode" (few tokens: decode.py),
    "tensor_cores" (many rows on sm_80+: 3xTF32 GEMMs, tc.py) or "simt" (simt.py: older GPUs, the simulator)."""
    if tokens < FEW_TOKENS:
        return "decode"
    # The simulator runs the tensor-core path's mma model as Python threads: ~3x slower than the SIMT kernel
    # there (`kdtree demo` on a CPU), so it is tested directly (tests/kernels/test_attention_tc.py) instead.
    if not ON_SIMULATOR and _has_tf32_mma():
        return "tensor_cores"
    return "simt"


@functools.lru_cache(maxsize=None)
def _has_tf32_mma() -> bool:
    """The current device runs mma.sync tf32 (sm_80+); asked once, not on every layer's call."""
    return cuda.get_current_device().compute_capability >= (8, 0)


def mla_attention(q_lat, q_pe, cache_layer, prefix_len: int, visibility, scale: float, out=None,
                  num_splits: int | None = None, stream=0, config: TileConfig | None = None):
    """o_lat float32 [s, h, c] (device) of the absorbed MLA core.

    q_lat float32 [s, h, c] (q_nope @ W_UK); q_pe float32 [s, h, r] (roped; strided views are fine);
    cache_layer float32 [t, c+r] (rows [normed latent | roped k_pe]; the s in-flight rows at P..P+s-1);
    prefix_len P; visibility uint32 [s, ceil(s/32)] (common.pack_visibility / causal_visibility); scale: softmax
    scale. Without num_splits and config the kernel is attention_path's choice; with either, the SIMT kernel
    (num_splits: key-range splits, None: simt.default_num_splits; config: tile sizes, None: simt.DEFAULT_CONFIG,
    or FEW_TOKENS_CONFIG below FEW_TOKENS query tokens). A numpy mask is checked for queries that see no row;
    on the device such a query's output is NaN.
    """
    if num_splits is None and config is None and len(getattr(q_lat, "shape", ())) == 3:
        path = attention_path(q_lat.shape[0], q_lat.shape[1])
        if path == "decode":
            return mla_attention_decode(q_lat, q_pe, cache_layer, prefix_len, visibility, scale, out=out,
                                        stream=stream)
        if path == "tensor_cores":
            return mla_attention_tc(q_lat, q_pe, cache_layer, prefix_len, visibility, scale, out=out, stream=stream)
    return mla_attention_simt(q_lat, q_pe, cache_layer, prefix_len, visibility, scale, out=out,
                              num_splits=num_splits, stream=stream, config=config)
