"""Batch-invariant MLA attention: a query row's output has the same bits whatever the number of query tokens in
the launch and wherever in the in-flight rows its visible keys sit. It is what makes a tree-verify forward
equal the 1-row AR forward bit for bit (issue #19): node i at depth d of a verify tree sees the prefix and its
root -> i path at scattered in-flight rows; the AR step that decodes the same token sees the same keys as the
last d + 1 rows of a longer prefix.

Both reduce the same keys in the same order when the keys are numbered in compacted order: key t < P is
cache row t, key t >= P the (t - P)-th in-flight row the token sees (its ancestors come before it, in
increasing row order, as the tree build numbers them). ``visible_keys`` turns the visibility bitmask into
that table (key_rows int32 [s, s]: in-flight indices j, cache row P + j; key_counts int32 [s]), which does not
depend on P; ``mla_attention_invariant`` runs the decode kernel (attention/decode.py) in compact_keys mode over
it, with

- one token per block (HEADS divides h): the block's key order is its token's;
- key ranges of a fixed KEYS_PER_SPLIT compacted keys, so a row's split boundaries depend only on its own key
  count (rows with fewer keys than the launch's longest get empty splits, merged away exactly: an empty
  split's weight is exp(-inf) = 0, and a lone split's is exp(0) = 1);
- no tensor-core path and no split count chosen from the grid size;
- a launch shape chosen by the token count (invariant_config) among those that keep a row's arithmetic
  (ROW_ARITHMETIC_FIELDS): blocks of fewer heads for an AR step, so that its 64 rows make more blocks.

P may also be given as an int32 [1] device array (the cache length the device keeps: a captured CUDA graph
then serves every step of a token count); the grid then holds the splits of the whole cache, those past a
row's keys empty.

The fp32 arithmetic is the decode kernel's, so against the float64 reference it holds the same tolerance.
Shapes: q_lat float32 [s, h, c], q_pe float32 [s, h, r], cache_layer float32 [t, c + r] (C-contiguous),
visibility uint32 [s, >= ceil(s/32)], out float32 [s, h, c].
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.attention.common import checked_inputs
from kdspec.numba_kernels.attention.decode import DEFAULT_CONFIG, DecodeConfig, launch_decode
from kdspec.numba_kernels.host_arrays import as_device_array, is_device_scalar
from kdspec.numba_kernels.launch import launch
from kdspec.numba_kernels.runtime import ON_SIMULATOR, row_blocks

SPLIT_CHUNKS = 8  # compacted keys per split, in the decode kernel's chunks (8 x 64 = 512 on a GPU)
KEYS_PER_SPLIT = SPLIT_CHUNKS * DEFAULT_CONFIG.keys
TABLE_THREADS = 8 if ON_SIMULATOR else 128


class VisibleKeys(NamedTuple):
    """Each query token's visible in-flight keys, in compacted order (see the module docstring)."""
    rows: object    # int32 [s, s]: the in-flight rows j the token sees (cache rows P + j), ascending
    counts: object  # int32 [s]


@kernel_cache.jit
def _visible_key_rows(visibility, tokens, key_rows, key_counts):
    """key_rows[i, :n] = j for each in-flight row j query i sees (ascending), key_counts[i] = n.
    Grid row_blocks(s) x TABLE_THREADS, one thread per query token (grid-stride)."""
    start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    for token in range(start, tokens, cuda.gridDim.x * cuda.blockDim.x):
        count = 0
        for j in range(tokens):
            if (visibility[token, j >> 5] >> uint32(j & 31)) & uint32(1) != uint32(0):
                key_rows[token, count] = j
                count += 1
        key_counts[token] = count


def visible_keys(visibility, tokens: int, out: VisibleKeys | None = None, stream=0) -> VisibleKeys:
    """The compacted key table of s = ``tokens`` query tokens from their visibility bitmask uint32 [s, >= ceil(s/32)]
    (device or host). ``out``: a VisibleKeys of [s, s] / [s] to fill instead of new arrays."""
    visibility = as_device_array(visibility)
    if visibility.dtype != np.uint32 or len(visibility.shape) != 2 or visibility.shape[0] != tokens \
            or visibility.shape[1] < max(1, -(-tokens // 32)):
        raise ValueError(f"visibility must be uint32 [{tokens}, >= {max(1, -(-tokens // 32))}], got "
                         f"{visibility.dtype} {list(visibility.shape)}")
    if out is None:
        out = VisibleKeys(cuda.device_array((tokens, tokens), np.int32, stream=stream),
                          cuda.device_array(tokens, np.int32, stream=stream))
    elif tuple(out.rows.shape) != (tokens, tokens) or tuple(out.counts.shape) != (tokens,):
        raise ValueError(f"out: a table for {tokens} tokens needs rows [{tokens}, {tokens}] and counts [{tokens}]")
    if tokens:
        launch(_visible_key_rows, row_blocks(-(-tokens // TABLE_THREADS)), TABLE_THREADS, stream, visibility, tokens,
               out.rows, out.counts)
    return out


# The DecodeConfig fields that set a row's arithmetic (keys per chunk: the online softmax's rescaling points and
# its per-lane sums; lanes: the warp sums' tree; fastmath); the others (heads, key_group, value_unroll, threads,
# blocks_per_sm) only say which thread computes which head's products and when its loads are issued, so every
# launch shape that keeps these gives a row the same bits.
ROW_ARITHMETIC_FIELDS = ("keys", "lanes", "fastmath")
# Launch shapes by query tokens (invariant_config): (fewer tokens than this, shape), the first that fits. An AR
# step's 64 rows make more blocks with fewer heads a block; a verify's many rows fill the GPU anyway and run
# best in small blocks, several an SM (sweep: python3 -m tools.sweeps.attention_invariant; BENCHMARKS.md).
if ON_SIMULATOR:  # three shapes that differ the same ways, at the simulator's sizes
    LAUNCH_SHAPES = ((4, DEFAULT_CONFIG._replace(heads=1, value_unroll=3)), (32, DEFAULT_CONFIG),
                     (None, DEFAULT_CONFIG._replace(threads=DEFAULT_CONFIG.lanes, value_unroll=1)))
else:
    LAUNCH_SHAPES = (
        (4, DEFAULT_CONFIG._replace(heads=2, value_unroll=8, threads=512)),
        (32, DEFAULT_CONFIG._replace(heads=4, value_unroll=8)),
        (None, DEFAULT_CONFIG._replace(heads=4, value_unroll=8, threads=128, blocks_per_sm=3)),
    )


def launch_shape(tokens: int) -> DecodeConfig:
    """The launch shape of LAUNCH_SHAPES for ``tokens`` query tokens."""
    return next(shape for bound, shape in LAUNCH_SHAPES if bound is None or tokens < bound)


def invariant_config(heads: int, tokens: int = 1, prefix_on_device: bool = False,
                     shape: DecodeConfig | None = None) -> DecodeConfig:
    """The decode kernel's config in compact_keys mode for ``tokens`` query tokens: ``shape`` (None: the launch
    shape for that many tokens, launch_shape) with HEADS the largest power of two dividing
    h (at most the shape's): a block never spans two tokens. ValueError if ``shape`` changes a row's arithmetic
    (ROW_ARITHMETIC_FIELDS differ from DEFAULT_CONFIG's)."""
    if shape is None:
        shape = launch_shape(tokens)
    changed = [name for name in ROW_ARITHMETIC_FIELDS if getattr(shape, name) != getattr(DEFAULT_CONFIG, name)]
    if changed:
        raise ValueError(f"a batch-invariant launch shape must keep DEFAULT_CONFIG's {', '.join(changed)}")
    block_heads = shape.heads
    while heads % block_heads:
        block_heads //= 2
    key_group = min(shape.key_group, shape.lanes // block_heads)  # heads * key_group <= lanes
    return shape._replace(heads=block_heads, key_group=key_group, compact_keys=True,
                          prefix_on_device=prefix_on_device)


def invariant_inputs(q_lat, q_pe, cache_layer, prefix_len, visibility, out, stream):
    """The batch-invariant kernels' argument checks (common.checked_inputs with a contiguous cache), prefix_len an
    int or an int32 [1] device array: (on_device, total_keys, the checked (q_lat, q_pe, cache_layer, visibility,
    out)); total_keys is the key rows a launch may read (the whole cache when the prefix length is on the device)."""
    on_device = is_device_scalar(prefix_len, "prefix_len")
    q_lat, q_pe, cache_layer, visibility, out = checked_inputs(q_lat, q_pe, cache_layer, 0 if on_device else prefix_len,
                                                               visibility, out, stream, latent_limits=True,
                                                               contiguous_cache=True)
    total_keys = cache_layer.shape[0] if on_device else prefix_len + q_lat.shape[0]
    return on_device, total_keys, (q_lat, q_pe, cache_layer, visibility, out)


def mla_attention_invariant(q_lat, q_pe, cache_layer, prefix_len, visibility, scale: float, keys=None,
                            out=None, stream=0, shape: DecodeConfig | None = None):
    """o_lat float32 [s, h, c] (device), batch-invariant (module docstring). Arguments as
    mla_attention.mla_attention, but prefix_len may be an int32 [1] device array (read by the kernel; the
    caller vouches that P + s rows fit the cache); ``keys``: the VisibleKeys of this visibility (visible_keys),
    computed here when None (a forward computes it once for all its layers); ``shape``: a launch shape for
    invariant_config (None: the one for this many tokens; any shape gives the same bits)."""
    on_device, total_keys, (q_lat, q_pe, cache_layer, visibility, out) = invariant_inputs(
        q_lat, q_pe, cache_layer, prefix_len, visibility, out, stream)
    tokens, heads, latent = q_lat.shape
    if tokens * heads == 0 or latent == 0:
        return out
    if keys is None:
        keys = visible_keys(visibility, tokens, stream=stream)
    config = invariant_config(heads, tokens, on_device, shape)
    return launch_decode(config, q_lat, q_pe, cache_layer, prefix_len, visibility, keys.rows, keys.counts, scale,
                         KEYS_PER_SPLIT, total_keys, out, stream)
