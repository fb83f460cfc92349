"""What the three attention paths share: the visibility contract, argument checks, the split merge.

For query token i, head h (a "row" ρ = i*h_count + h of the s*h query-head pairs):
    score[ρ, t] = (q_lat[i, h] . cache[t, :c] + q_pe[i, h] . cache[t, c:]) * scale
    o_lat[i, h] = softmax_t(score[ρ, t] over visible t) @ cache[t, :c]
Row t < P (prefix_len) is visible to all; in-flight row P + j is visible to query i when bit j of
visibility[i] is set (word j // 32, bit j % 32; visibility uint32 [s, W], W >= ceil(s/32)). Causal prefill is the lower-triangular mask, AR decode s = 1.
A split-K path writes per-split normalised partials and log-sum-exps; merge_splits_kernel combines them.
Dimension letters: s query tokens, h heads, c kv_lora_rank, r qk_rope_head_dim, t key rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array, is_device_array
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function

MAX_LATENT, MAX_ROPE = (32, 8) if ON_SIMULATOR else (512, 64)  # toy shapes on the simulator
MAX_WIDTH = MAX_LATENT + MAX_ROPE
MERGE_THREADS = 8 if ON_SIMULATOR else 128
FEW_TOKENS = 16  # below this many query tokens: the decode kernel, or the SIMT kernel's few-token tiles


@device_function(inline=True)
def key_visible(token, key, prefix_len, visibility):
    """Key row `key` visible to query `token`: in the prefix, or its in-flight bit is set."""
    if key < prefix_len:
        return True
    j = key - prefix_len
    return (visibility[token, j >> 5] >> uint32(j & 31)) & uint32(1) != uint32(0)


@kernel_cache.jit
def merge_splits_kernel(o_part, lse_part, splits, out):
    """out[i, h] = sum_j exp(lse_j - lse_max) o_part[j, i, h] / sum_j exp(lse_j - lse_max).
    Grid (row_blocks(s*h),), grid-stride over the s*h rows."""
    heads, latent = out.shape[1], out.shape[2]
    for row in range(cuda.blockIdx.x, out.shape[0] * heads, cuda.gridDim.x):
        token = row // heads
        head = row - token * heads
        best = float32(-math.inf)
        for j in range(splits):
            best = max(best, lse_part[j, token, head])
        total = float32(0.0)
        for j in range(splits):
            total += math.exp(lse_part[j, token, head] - best) if best != -math.inf else float32(0.0)
        inv = float32(1.0) / total if total > 0 else float32(math.nan)  # NaN: the query saw no key
        for column in range(cuda.threadIdx.x, latent, cuda.blockDim.x):
            acc = float32(0.0)
            for j in range(splits):
                lse = lse_part[j, token, head]
                if lse != -math.inf:
                    acc += math.exp(lse - best) * o_part[j, token, head, column]
            out[token, head, column] = acc * inv


# ------------------------------------------------------------------------------------------- host side
def pack_visibility(visible: np.ndarray) -> np.ndarray:
    """bool [s, s] -> uint32 [s, ceil(s/32)] bitmask (bit j % 32 of word j // 32: query i sees row j)."""
    visible = np.asarray(visible, dtype=bool)
    if visible.ndim != 2 or visible.shape[0] != visible.shape[1]:
        raise ValueError(f"visible must be bool [s, s], got shape {visible.shape}")
    tokens = visible.shape[0]
    words = max(1, (tokens + 31) // 32)
    padded = np.zeros((tokens, words * 32), dtype=np.uint64)
    padded[:, :tokens] = visible
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
    return (padded.reshape(tokens, words, 32) * weights).sum(axis=2).astype(np.uint32)


def causal_visibility(tokens: int) -> np.ndarray:
    """The prefill mask: query i sees in-flight rows j <= i. uint32 [s, ceil(s/32)]."""
    return pack_visibility(np.tri(tokens, dtype=bool))


def _check_float32(name, array, shape):
    if array.dtype != np.float32 or tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must be float32 {list(shape)}, got {array.dtype} {list(array.shape)}")


def checked_inputs(q_lat, q_pe, cache_layer, prefix_len: int, visibility, out, stream, *, latent_limits: bool,
                   contiguous_cache: bool):
    """The argument rules every attention path shares; returns device (q_lat, q_pe, cache_layer, visibility,
    out), out allocated when None. latent_limits: c <= MAX_LATENT and r <= MAX_ROPE (register tiles);
    contiguous_cache: the path reads the cache as a flat array. A numpy mask is checked for queries that see
    no row (P = 0); a device mask is not (such a query's output is NaN)."""
    q_lat, q_pe, cache_layer = as_device_array(q_lat), as_device_array(q_pe), as_device_array(cache_layer)
    if len(q_lat.shape) != 3:
        raise ValueError(f"q_lat must be float32 [s, h, c], got shape {list(q_lat.shape)}")
    tokens, heads, latent = q_lat.shape
    _check_float32("q_lat", q_lat, q_lat.shape)
    if len(q_pe.shape) != 3 or tuple(q_pe.shape[:2]) != (tokens, heads):
        raise ValueError(f"q_pe must be float32 [{tokens}, {heads}, r], got shape {list(q_pe.shape)}")
    rope = q_pe.shape[2]
    _check_float32("q_pe", q_pe, q_pe.shape)
    if latent_limits and (latent > MAX_LATENT or rope > MAX_ROPE):
        raise ValueError(f"c={latent}, r={rope} exceed the kernel's MAX_LATENT={MAX_LATENT}, MAX_ROPE={MAX_ROPE}")
    if len(cache_layer.shape) != 2 or cache_layer.shape[1] != latent + rope or cache_layer.dtype != np.float32:
        raise ValueError(f"cache_layer must be float32 [t, {latent + rope}], got {cache_layer.dtype} "
                         f"{list(cache_layer.shape)}")
    if contiguous_cache and not cache_layer.is_c_contiguous():
        raise ValueError("cache_layer must be C-contiguous (the kernel reads it as a flat array)")
    if prefix_len < 0 or prefix_len + tokens > cache_layer.shape[0]:
        raise ValueError(f"prefix_len {prefix_len} + {tokens} in-flight rows do not fit the cache of "
                         f"{cache_layer.shape[0]} rows")
    words = max(1, (tokens + 31) // 32)
    if not is_device_array(visibility):
        visibility = np.asarray(visibility)
        if visibility.dtype == np.uint32 and visibility.shape == (tokens, words) and prefix_len == 0:
            in_flight = (visibility[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
            sees = in_flight.reshape(tokens, -1)[:, :tokens].any(axis=1)
            if not sees.all():
                raise ValueError(f"query {int(np.flatnonzero(~sees)[0])} sees no key row (P = 0, empty mask row)")
    visibility = as_device_array(visibility)
    # Wider rows are allowed (words past ceil(s/32) are never read): the tree build's bitmask, sized for the
    # whole budget, goes to attention as it is, without a host round trip.
    if (visibility.dtype != np.uint32 or len(visibility.shape) != 2 or visibility.shape[0] != tokens
            or visibility.shape[1] < words):
        raise ValueError(f"visibility must be uint32 [{tokens}, >= {words}], got {visibility.dtype} "
                         f"{list(visibility.shape)}")
    if out is None:
        out = cuda.device_array((tokens, heads, latent), dtype=np.float32, stream=stream)
    out = as_device_array(out)
    _check_float32("out", out, (tokens, heads, latent))
    if not out.is_c_contiguous():
        raise ValueError("out must be C-contiguous (the kernel writes it as a flat array)")
    return q_lat, q_pe, cache_layer, visibility, out
