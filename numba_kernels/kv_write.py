"""Cache write of s new tokens, fused with kv_a_layernorm and RoPE on k_pe: one block per token
(grid-stride over tokens: the simulator runs one block, numba_kernels.runtime.row_blocks).

kv_a = kv_a_proj_with_mqa(x) is [s, c + r] = [latent | k_pe]. Row i of the result goes to cache row
cache_start + i of one layer: [rms_norm(latent) * kv_norm_weight | rope(k_pe, positions[i])]. cache_start is a
launch scalar, or an int32 [1] device array the kernel reads (the cache length the device keeps, so that a
captured CUDA graph serves every step).
The cache is ONE device array per model, float32 [layers, capacity, c + r].
Dimension letters: s tokens, c kv_lora_rank, r qk_rope_head_dim, t cache rows (capacity).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, is_device_array, is_device_scalar
from kdspec.numba_kernels.intrinsics import at, at2, at2_put
from kdspec.numba_kernels.launch import launch
from kdspec.numba_kernels.reductions import block_sum
from kdspec.numba_kernels.rmsnorm import inverse_rms
from kdspec.numba_kernels.rope import RopeTable, check_positions, rotate_pair
from kdspec.numba_kernels.runtime import ON_SIMULATOR, row_blocks, scalar_reader

KV_THREADS = 4 if ON_SIMULATOR else 256  # power of two (block_sum)


def _write_kernel(start_on_device: bool):
    """The cache-write kernel for a launch-scalar cache_start, or for one read from an int32 [1] device array."""
    first_row = scalar_reader(start_on_device)

    @kernel_cache.jit
    def write_kv_rows_kernel(kv_a, kv_norm_weight, eps, cos_table, sin_table, positions, cache, layer, start_arg):
        """kv_a float32 [s, c+r]; kv_norm_weight float32 [c]; positions int64 [s]; start_arg: cache_start (an
        integer, or int32 [1] holding it); cache float32 [layers, t, c+r]: rows cache_start .. cache_start+s-1
        of `layer` written. Grid (row_blocks(s),), grid-stride over tokens."""
        scratch = cuda.shared.array(KV_THREADS, float32)
        cache_start = first_row(start_arg)
        latent = kv_norm_weight.shape[0]
        pairs = (kv_a.shape[1] - latent) // 2
        rows = cache[layer]
        token = cuda.blockIdx.x
        while token < kv_a.shape[0]:  # block-uniform: block_sum syncs
            row = cache_start + token
            partial = float32(0.0)
            j = cuda.threadIdx.x
            while j < latent:
                value = at2(kv_a, token, j)
                partial += value * value
                j += cuda.blockDim.x
            inv = inverse_rms(block_sum(partial, scratch), latent, eps)
            j = cuda.threadIdx.x
            while j < latent:
                at2_put(rows, row, j, at2(kv_a, token, j) * inv * at(kv_norm_weight, j))
                j += cuda.blockDim.x
            position = positions[token]
            in_table = position >= 0 and position < cos_table.shape[0]
            pair = cuda.threadIdx.x
            while pair < pairs:
                column = latent + 2 * pair
                if in_table:
                    even, odd = rotate_pair(at2(kv_a, token, column), at2(kv_a, token, column + 1),
                                            at2(cos_table, position, pair), at2(sin_table, position, pair))
                else:
                    even, odd = float32(math.nan), float32(math.nan)
                at2_put(rows, row, column, even)
                at2_put(rows, row, column + 1, odd)
                pair += cuda.blockDim.x
            token += cuda.gridDim.x

    return write_kv_rows_kernel


write_kv_rows_kernel = _write_kernel(False)
write_kv_rows_at_kernel = _write_kernel(True)


def write_kv_rows(cache, layer: int, cache_start, kv_a, kv_norm_weight, eps: float, table: RopeTable,
                  positions, stream=0):
    """Write s tokens' [kv_norm(latent) | rope(k_pe)] into cache[layer, cache_start:cache_start+s] (device,
    float32 [layers, t, c+r], in place). kv_a float32 [s, c+r]; kv_norm_weight float32 [c]; positions int64 [s];
    cache_start an integer, or an int32 [1] device array holding it (then the caller vouches that the rows fit).
    Returns the cache."""
    if not is_device_array(cache):
        raise ValueError("cache must be a device array (it is written in place)")
    cache, kv_a, kv_norm_weight = as_device_array(cache), as_device_array(kv_a), as_device_array(kv_norm_weight)
    if cache.dtype != np.float32 or len(cache.shape) != 3:
        raise ValueError(f"cache must be float32 [layers, t, c+r], got {cache.dtype} {tuple(cache.shape)}")
    layers, capacity, width = cache.shape
    latent = width - 2 * table.pairs
    if kv_a.dtype != np.float32 or len(kv_a.shape) != 2 or kv_a.shape[1] != width:
        raise ValueError(f"kv_a must be float32 [s, {width}], got {kv_a.dtype} {tuple(kv_a.shape)}")
    if kv_norm_weight.dtype != np.float32 or tuple(kv_norm_weight.shape) != (latent,) or \
            not kv_norm_weight.is_c_contiguous():
        raise ValueError(f"kv_norm_weight must be contiguous float32 [{latent}], got {kv_norm_weight.dtype} "
                         f"{tuple(kv_norm_weight.shape)}")
    tokens = kv_a.shape[0]
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} outside 0..{layers - 1}")
    on_device = is_device_scalar(cache_start, "cache_start")
    if not on_device and (cache_start < 0 or cache_start + tokens > capacity):
        raise ValueError(f"rows {cache_start}..{cache_start + tokens - 1} do not fit the cache of {capacity} rows")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    positions = check_positions(positions, tokens, table)
    if tokens:
        launch(write_kv_rows_at_kernel if on_device else write_kv_rows_kernel, row_blocks(tokens), KV_THREADS, stream,
               kv_a, kv_norm_weight, np.float32(eps), table.cos, table.sin, positions, cache, layer, cache_start)
    return cache
