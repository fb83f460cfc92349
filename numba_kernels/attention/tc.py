"""Absorbed MLA attention for many query rows on the tensor cores (3xTF32: fp32-level accuracy).

Same math and arguments as numba_kernels.mla_attention.mla_attention (see there): rows ρ = i*h + head of the
s*h query-head pairs share one key/value row per cached token, so attention is two GEMMs around a masked
softmax (key row t < P visible to all; in-flight row P + j to query i iff bit j of visibility[i]; a query
that sees no key gets a NaN output):
  1. A [R, c+r] = [q_lat | q_pe] (R = s*h rows): read in place by the score GEMM (its two-part A operand)
     when both are C-contiguous, else copied to q_cat first;
  2. weights [R, t] = exp(w - M_p) with w = scale * q_cat @ cache[:t]^T (3xTF32 GEMM, "NT":
     numba_kernels.mma) and M_p the max of w over part p (one warp's 32 keys) of the row; masked entries get
     0; the epilogue writes each part's (M_p, sum of its weights);
  3. merge_partials_kernel: per row and part, scale_p = exp(M_p - m) / sum with m the row's max and sum the
     row's sum of exp(w - m), so that scale_p * weight = softmax probability;
  4. o_lat [R, c] = probabilities @ cache[:t, :c]: the value GEMM ("NN", "scaled") multiplies each staged
     chunk's sum (one part's keys) by its scale_p (optionally split over key ranges, partials summed in a
     fixed order).
fused_softmax=False runs the unfused order instead (plain score GEMM, masked_softmax_kernel in place, plain
value GEMM).
Scratch: R * (t' + 3 * parts) (+ splits * R * c, + R * (c + r) for q_cat) floats (t' = t rounded up to 4:
16-byte aligned rows), views of one grow-only buffer per stream (workspace: no allocation, and no cuMemFree synchronizing the
device, once a call of that size has run).
Dimension letters: s query tokens, h heads, c kv_lora_rank, r qk_rope_head_dim, t = P + s key rows.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np
from numba import cuda, float32, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.attention.common import checked_inputs, key_visible
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.launch import launch, stream_key
from kdspec.numba_kernels.mma import (
    DEFAULT_GEMM,
    GemmConfig,
    ScaledFusion,
    ScoresFusion,
    gemm_tf32x3,
    softmax_parts,
)
from kdspec.numba_kernels.reductions import block_max, block_sum
from kdspec.numba_kernels.runtime import ON_SIMULATOR, row_blocks

ROW_THREADS = 8 if ON_SIMULATOR else 256  # copy / softmax / sum blocks (power of two: block_max / block_sum)
MIN_KEYS_PER_SPLIT = 256


class AttentionTcConfig(NamedTuple):
    """GEMM tiles of the score and value products; value_splits: key-range splits of the value GEMM
    (None: default_value_splits); fused_softmax: softmax folded into the GEMMs (else its own pass)."""
    score: GemmConfig = DEFAULT_GEMM
    value: GemmConfig = DEFAULT_GEMM
    value_splits: Optional[int] = None
    fused_softmax: bool = True


DEFAULT_CONFIG = AttentionTcConfig()


@kernel_cache.jit
def concat_queries_kernel(q_lat, q_pe, q_cat):
    """q_cat float32 [s*h, c+r] = [q_lat | q_pe] per row; q_lat [s, h, c], q_pe [s, h, r] (strided views fine).
    Grid (row_blocks(s*h),), rows grid-stride, columns block-stride."""
    heads, latent, width = q_lat.shape[1], q_lat.shape[2], q_cat.shape[1]
    for row in range(cuda.blockIdx.x, q_cat.shape[0], cuda.gridDim.x):
        token = row // heads
        head = row - token * heads
        for d in range(cuda.threadIdx.x, width, cuda.blockDim.x):
            q_cat[row, d] = q_lat[token, head, d] if d < latent else q_pe[token, head, d - latent]


@kernel_cache.jit
def masked_softmax_kernel(scores, rows, keys, stride, heads, prefix_len, visibility):
    """scores float32 flat [R * stride] (row ρ = i*h + head: its t = keys scores at ρ * stride, already scaled)
    -> softmax over the keys query i sees (0 elsewhere; a NaN row where it sees none). visibility uint32
    [s, ceil(s/32)].
    Grid (row_blocks(R),), ROW_THREADS threads; two passes: an online (max, sum), then the write."""
    scratch = cuda.shared.array(ROW_THREADS, float32)
    tid, width = cuda.threadIdx.x, cuda.blockDim.x
    for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):  # block-uniform: the reductions sync
        token = row // heads
        base = row * stride
        local_max = float32(-math.inf)
        local_sum = float32(0.0)
        for j in range(tid, keys, width):
            if key_visible(token, j, prefix_len, visibility):
                score = at(scores, base + j)
                if score > local_max:  # rescale the running sum to the new max
                    local_sum = local_sum * math.exp(local_max - score) + float32(1.0)
                    local_max = score
                else:
                    local_sum += math.exp(score - local_max)
        row_max = block_max(local_max, scratch)
        part = local_sum * math.exp(local_max - row_max) if local_sum > 0 else float32(0.0)
        total = block_sum(part, scratch)
        inv = float32(1.0) / total if total > 0 else float32(math.nan)  # NaN: the query sees no key
        for j in range(tid, keys, width):
            if total > 0 and not key_visible(token, j, prefix_len, visibility):
                at_put(scores, base + j, float32(0.0))
            else:
                at_put(scores, base + j, math.exp(at(scores, base + j) - row_max) * inv)


@kernel_cache.jit
def merge_partials_kernel(partials, rows, parts, scales):
    """scales float32 flat [R * parts]: exp(M_p - m) / sum for each row's part p, from partials flat
    [R * parts * 2] of (M_p, sum of exp(score - M_p)) over the part's keys, m the row's max and sum the row's
    sum of exp(score - m): the factor that turns the part's exp(score - M_p) into probabilities (0 for a part
    with no visible key; every part 0 for a row with none). One block per row (grid-stride), ROW_THREADS
    threads over the parts."""
    scratch = cuda.shared.array(ROW_THREADS, float32)
    tid, width = cuda.threadIdx.x, cuda.blockDim.x
    for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):  # block-uniform: the reductions sync
        base = row * parts
        local_max = float32(-math.inf)
        for part in range(tid, parts, width):
            if at(partials, 2 * (base + part) + 1) > 0:  # an all-masked part carries no max
                local_max = max(local_max, at(partials, 2 * (base + part)))
        row_max = block_max(local_max, scratch)
        local_sum = float32(0.0)
        for part in range(tid, parts, width):
            part_sum = at(partials, 2 * (base + part) + 1)
            if part_sum > 0:
                local_sum += part_sum * math.exp(at(partials, 2 * (base + part)) - row_max)
        total = block_sum(local_sum, scratch)
        inv = float32(1.0) / total if total > 0 else float32(0.0)
        for part in range(tid, parts, width):
            part_sum = at(partials, 2 * (base + part) + 1)
            at_put(scales, base + part, math.exp(at(partials, 2 * (base + part)) - row_max) * inv if part_sum > 0
                   else float32(0.0))


@kernel_cache.jit
def sum_splits_kernel(parts, splits, size, out):
    """out flat [size] = sum over z (in order) of parts flat [splits * size]. Grid-stride, 1-D."""
    for e in range(cuda.grid(1), size, cuda.gridsize(1)):
        total = float32(0.0)
        for z in range(splits):
            total += at(parts, z * size + e)
        at_put(out, e, total)


@kernel_cache.jit
def nan_blind_queries_kernel(visibility, tokens, out):
    """out float32 [s, h, c]: NaN for every query token whose visibility row sees none of the s in-flight rows
    (only possible when P = 0). The GEMMs cannot be trusted to carry a NaN row through (the H200's mma gave
    0 for NaN operands), so the "sees nothing" result is written explicitly. Grid (row_blocks(s),)."""
    heads, latent = out.shape[1], out.shape[2]
    for token in range(cuda.blockIdx.x, tokens, cuda.gridDim.x):
        sees = False
        for j in range(tokens):
            if (visibility[token, j >> 5] >> uint32(j & 31)) & uint32(1) != uint32(0):
                sees = True
        if not sees:
            for e in range(cuda.threadIdx.x, heads * latent, cuda.blockDim.x):
                out[token, e // latent, e % latent] = float32(math.nan)


_WORKSPACE: dict = {}  # stream key -> (flat float32 buffer, {shape key: views})
VIEW_ALIGN = 64  # floats: each view starts 256-byte aligned (the GEMMs' 16-byte copies)
_VIEW_SETS = 8  # carved view sets kept per stream (the engine's verify calls repeat a few shapes per step)


def workspace_views(stream, shapes: tuple) -> list:
    """Float32 device views of the given shapes, laid out back to back in this stream's scratch buffer (grown
    by at least 25% when too small; calls on one stream run in order, so they may share it)."""
    key = stream_key(stream)
    buffer, views = _WORKSPACE.get(key, (None, {}))
    if shapes in views:
        return views[shapes]
    sizes = [int(np.prod(shape)) for shape in shapes]
    needed = sum(-(-size // VIEW_ALIGN) * VIEW_ALIGN for size in sizes)
    if buffer is None or buffer.shape[0] < needed:
        grown = max(needed, (5 * buffer.shape[0]) // 4 if buffer is not None else 0)
        _WORKSPACE.pop(key, None)  # the old buffer goes first: peak memory is the new one only
        buffer, views = cuda.device_array(grown, dtype=np.float32, stream=stream), {}
    carved, offset = [], 0
    for shape, size in zip(shapes, sizes):
        carved.append(buffer[offset:offset + size].reshape(shape))
        offset += -(-size // VIEW_ALIGN) * VIEW_ALIGN
    if len(views) >= _VIEW_SETS:
        views.pop(next(iter(views)))
    views[shapes] = carved
    _WORKSPACE[key] = (buffer, views)
    return carved


def release_workspace() -> None:
    """Free every stream's scratch buffer (the next call allocates again)."""
    _WORKSPACE.clear()


@functools.lru_cache(maxsize=1)
def _multiprocessors() -> int:
    """SMs of the current device, asked once (a driver query on every call costs host time before the GEMMs)."""
    return 1 if ON_SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def default_value_splits(rows: int, keys: int, latent: int, config: GemmConfig, sms: int | None = None) -> int:
    """Key-range splits of the value GEMM whose blocks fill the SMs best (the fewest within 2% of the best
    wave efficiency, up to two waves), at least MIN_KEYS_PER_SPLIT keys each."""
    tiles = -(-rows // config.block_m) * -(-latent // config.block_n)
    if sms is None:
        sms = _multiprocessors()
    slots = sms * config.blocks_per_sm
    most = max(1, min(-(-2 * slots // tiles), keys // MIN_KEYS_PER_SPLIT))

    def efficiency(splits):
        blocks = tiles * splits
        return blocks / (-(-blocks // slots) * slots)

    best = max(efficiency(splits) for splits in range(1, most + 1))
    return next(splits for splits in range(1, most + 1) if efficiency(splits) >= 0.98 * best)


def mla_attention_tc(q_lat, q_pe, cache_layer, prefix_len: int, visibility, scale: float, out=None, stream=0,
                     config: AttentionTcConfig | None = None):
    """o_lat float32 [s, h, c] (device) of the absorbed MLA core, on the tensor cores (3xTF32).

    q_lat float32 [s, h, c]; q_pe float32 [s, h, r] (strided views are fine); cache_layer float32 [>= P+s, c+r]
    C-contiguous (rows [normed latent | roped k_pe], the s in-flight rows at P..P+s-1); prefix_len P;
    visibility uint32 [s, ceil(s/32)] (mla_attention.pack_visibility / causal_visibility); scale: softmax
    scale. A numpy mask is checked for queries that see no row; on the device such a query's output is NaN.
    """
    q_lat, q_pe, cache, visibility, out = checked_inputs(q_lat, q_pe, cache_layer, prefix_len, visibility, out,
                                                         stream, latent_limits=False, contiguous_cache=True)
    config = DEFAULT_CONFIG if config is None else config
    tokens, heads, latent = q_lat.shape
    width, rows, keys = latent + q_pe.shape[2], tokens * heads, prefix_len + tokens
    if rows == 0 or latent == 0:
        return out
    splits = config.value_splits or default_value_splits(rows, keys, latent, config.value)
    parts = softmax_parts(config.score, keys)
    padded_keys = -(-keys // 4) * 4  # score rows 16-byte aligned: the value GEMM copies 16 bytes at a time
    # contiguous q_lat / q_pe are the score GEMM's A as they are ([q_lat | q_pe] row by row); else a copy
    in_place = q_lat.is_c_contiguous() and q_pe.is_c_contiguous()
    q_cat, scores, partials, scales, value_parts = workspace_views(
        stream, ((0 if in_place else rows, width), (1, rows, padded_keys), (rows, parts, 2), (rows, parts),
                 (splits if splits > 1 else 0, rows, latent)))
    if in_place:
        score_a = dict(a=q_lat, a2=q_pe)  # [s, h, c] / [s, h, r]: the GEMM takes m = s * h rows as they are
    else:
        launch(concat_queries_kernel, row_blocks(rows), ROW_THREADS, stream, q_lat, q_pe, q_cat)
        score_a = dict(a=q_cat)
    score_gemm = dict(b=cache, c=scores, n=keys, k=width, alpha=scale, b_k_contiguous=True, config=config.score,
                      stream=stream, **score_a)
    value_gemm = dict(b_k_contiguous=False, config=config.value, stream=stream)
    if config.fused_softmax:
        gemm_tf32x3(**score_gemm, fusion=ScoresFusion(partials, visibility, heads, prefix_len, key_visible))
        launch(merge_partials_kernel, row_blocks(rows), ROW_THREADS, stream, partials.reshape(-1), rows, parts,
               scales.reshape(-1))
        value_gemm.update(fusion=ScaledFusion(scales, width=config.score.block_n // config.score.warps_n))
    else:
        gemm_tf32x3(**score_gemm)
        launch(masked_softmax_kernel, row_blocks(rows), ROW_THREADS, stream, scores.reshape(-1), rows, keys,
               padded_keys, heads, prefix_len, visibility)
    if splits == 1:
        gemm_tf32x3(scores.reshape(rows, padded_keys), cache, out.reshape(1, rows, latent), latent, keys,
                    **value_gemm)
    else:
        gemm_tf32x3(scores.reshape(rows, padded_keys), cache, value_parts, latent, keys, splits=splits,
                    **value_gemm)
        size = rows * latent
        launch(sum_splits_kernel, min(-(-size // ROW_THREADS), 4 * 1024) if not ON_SIMULATOR else 1, ROW_THREADS,
               stream, value_parts.reshape(-1), splits, size, out.reshape(-1))
    if prefix_len == 0:  # only then can a query see no key row
        launch(nan_blind_queries_kernel, row_blocks(tokens), ROW_THREADS, stream, visibility, tokens, out)
    return out
