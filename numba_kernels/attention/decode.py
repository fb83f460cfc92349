"""Absorbed MLA attention for few query tokens (AR decode s = 1, small verify trees): latency first.

Same math, masks and arguments as attention/common.py and simt.py (read them first):
    score[ρ, t] = (q_lat[i, h] . cache[t, :c] + q_pe[i, h] . cache[t, c:]) * scale   over visible t
    o_lat[i, h] = softmax_t(score[ρ, t]) @ cache[t, :c]
for the s*h query rows ρ = i*h + h. The GEMM kernel there walks 64-row key tiles through ~50 shared-memory
stages each (a syncthreads and a dependent global load per stage): with one token's 64 rows that is all
latency. Here a block owns HEADS consecutive query rows over one key range (split) and walks it in chunks of
KEYS key rows with two syncthreads per chunk:
  scores: warp w takes key groups of KEY_GROUP rows; each lane reads dimensions lane + 32 j of those rows
     straight from global memory (coalesced, all loads of a group in flight together), dots them with the
     block's q (staged once in shared memory) for every head, and the warp sums the HEADS x KEY_GROUP
     partials in one transposing shuffle reduction (31 shuffles for 32 sums) -> scores [HEADS, KEYS] in shared;
  softmax: warp w owns heads w, w + WARPS, ...: masks, scales, updates its running max / sum (registers)
     and writes p [KEYS, HEADS] and the rescale factor alpha [HEADS] to shared;
  values: thread t owns latent columns t + THREADS k for all HEADS rows (registers) and adds p @ cache rows
     (the rows the score phase just read: L1 / L2 hits), VALUE_UNROLL rows' loads in flight at a time.
One key row read serves HEADS query rows (all heads share it: multi-query attention). Splits write a
normalised partial o and its log-sum-exp, combined by mla_attention.merge_splits_kernel.
With ``compact_keys`` (attention/invariant.py, the batch-invariant path) the block's rows are one token's and
its keys are numbered in compacted order: key t < P is cache row t, key t >= P the (t - P)-th in-flight row
the token sees (key_rows[token, t - P], key_counts[token] of them); the visibility mask is not read. A row's
chunks then hold the same keys at the same slots however many tokens share the launch and wherever its
in-flight rows sit, so its result does not depend on either.
Under the CUDA simulator (no shuffles) the warp sums go through shared memory, and "warps" are LANES wide.
Dimension letters: s query tokens, h heads, c kv_lora_rank, r qk_rope_head_dim, t key rows.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.attention.common import (
    MAX_LATENT,
    MAX_WIDTH,
    MERGE_THREADS,
    checked_inputs,
    key_visible,
    merge_splits_kernel,
)
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.launch import launch
from kdspec.numba_kernels.reductions import FULL_MASK
from kdspec.numba_kernels.runtime import (INLINE_DEVICE, ON_SIMULATOR, SHARED_LIMIT, device_function, row_blocks,
                                          scalar_reader, static_for)

MAX_TOKENS = 32  # query tokens per call (one visibility word); more: simt.py / tc.py
P_ALIGN = None if ON_SIMULATOR else 16  # p [KEYS, HEADS] in shared: 16-byte rows for load4

if ON_SIMULATOR:
    def load4(array, index):
        """(array[index], .., array[index + 3]) of a 1-D array."""
        return array[index], array[index + 1], array[index + 2], array[index + 3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load4(typingctx, array, index):
        """(array[index], .., array[index + 3]) of a 1-D float32 array in one 16-byte load (ld.shared.v4 for a
        broadcast: one shared-memory wavefront instead of four). index * 4 bytes must be 16-byte aligned."""
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            offset = context.cast(builder, args[1], sig.args[1], types.intp)
            address = builder.gep(data, [offset], inbounds=True)
            vector_type = ir.VectorType(ir.FloatType(), 4)
            vector = builder.load(builder.bitcast(address, vector_type.as_pointer(address.type.addrspace)), align=16)
            values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)
        return types.UniTuple(types.float32, 4)(array, index), codegen


class DecodeConfig(NamedTuple):
    """Launch shape of the decode kernel (see the module docstring)."""
    heads: int = 8               # query rows (token, head pairs) per block
    keys: int = 64               # key rows per chunk (two syncthreads each)
    key_group: int = 4           # key rows a warp scores at once (heads * key_group partial sums per lane)
    value_unroll: int = 4        # key rows whose value loads are in flight together
    threads: int = 256
    lanes: int = 32              # warp width (32 on a GPU; narrower under the simulator to stay quick)
    min_keys_per_split: int = 64
    blocks_per_sm: int = 2       # blocks an SM runs at once: the register cap (launch bound) and the split count
    fastmath: bool = False
    compact_keys: bool = False   # keys in compacted order through key_rows / key_counts (module docstring)
    prefix_on_device: bool = False  # prefix_len is an int32 [1] device array (read by the kernel: graph capture)

    @property
    def warps(self) -> int:
        return self.threads // self.lanes

    def shared_floats(self) -> int:
        dims_per_lane = -(-MAX_WIDTH // self.lanes)
        scratch = self.threads * self.heads * self.key_group if ON_SIMULATOR else 0
        return self.heads * dims_per_lane * self.lanes + 2 * self.heads * self.keys + 3 * self.heads + scratch

    def check(self) -> None:
        """ValueError naming the first broken rule."""
        sums = self.heads * self.key_group
        rules = [
            (self.lanes == 32 or ON_SIMULATOR, "lanes == 32 on a GPU"),
            (self.threads % self.lanes == 0 and self.threads <= 1024, "threads a multiple of lanes, <= 1024"),
            (sums & (sums - 1) == 0 and 2 <= sums <= self.lanes, "heads * key_group a power of two in 2..lanes"),
            (self.keys % (self.warps * self.key_group) == 0, "keys % (warps * key_group) == 0"),
            (self.keys % self.lanes == 0, "keys % lanes == 0 (softmax: keys per lane)"),
            (self.min_keys_per_split >= 1 and self.value_unroll >= 1, "min_keys_per_split, value_unroll >= 1"),
            (4 * self.shared_floats() <= SHARED_LIMIT, "shared memory <= 48 KB"),
        ]
        for ok, rule in rules:
            if not ok:
                raise ValueError(f"bad DecodeConfig {self}: needs {rule}")


if ON_SIMULATOR:  # every simulated thread is a Python thread: 2 warps of 8 lanes
    DEFAULT_CONFIG = DecodeConfig(heads=2, keys=8, key_group=2, value_unroll=2, threads=16, lanes=8,
                                  min_keys_per_split=8)
else:
    DEFAULT_CONFIG = DecodeConfig(blocks_per_sm=1)  # 209 registers, no spills (2 per SM: 128, spills)


@functools.lru_cache(maxsize=None)
def decode_kernel(config: DecodeConfig = DEFAULT_CONFIG):
    """The split-K decode attention kernel for one DecodeConfig (built once per config)."""
    config.check()
    HB, KC, KG, VU, T, L = (config.heads, config.keys, config.key_group, config.value_unroll, config.threads,
                            config.lanes)
    W = T // L                                  # warps
    DJ = -(-MAX_WIDTH // L)                     # score phase: dimensions per lane (lane + L j)
    QW = DJ * L                                 # q row stride in shared (zero-padded past c + r)
    VC = -(-MAX_LATENT // T)                    # value phase: latent columns per thread (tid + T k)
    N = HB * KG                                 # partial sums per lane per key group: index hb * KG + g
    LOG_N = N.bit_length() - 1
    SHIFT = (L.bit_length() - 1) - LOG_N        # after the reduction lane l holds sum l >> SHIFT
    GROUPS = KC // (W * KG)                     # key groups per warp per chunk
    KPL = KC // L                               # softmax: keys per lane
    HPW = -(-HB // W)                           # softmax: heads per warp
    SCRATCH = T * N if ON_SIMULATOR else 1
    Q_SIZE, SCORE_SIZE = HB * QW, HB * KC       # shared / local sizes must be plain constants
    VALUE_REGS, KEY_REGS, V_REGS = HB * VC, KG * DJ, VU * VC
    Q_LOADS = -(-Q_SIZE // T)                   # q staging: loads per thread
    VECTOR_P = HB % 4 == 0                      # values: p of 4 heads per shared load
    COMPACT = config.compact_keys
    compile_options = {} if ON_SIMULATOR else dict(launch_bounds=(T, config.blocks_per_sm))

    @device_function(inline=True)
    def cache_row(key, prefix_len, token, key_rows):
        """The cache row holding key number ``key`` (compacted order: the token's visible in-flight rows)."""
        if COMPACT and key >= prefix_len:
            return prefix_len + key_rows[token, key - prefix_len]
        return key

    read_prefix = scalar_reader(config.prefix_on_device)

    @device_function(**INLINE_DEVICE)
    def halve_partials(step, args):
        """Butterfly step `step` (a constant: the loop unrolls, part stays in registers): N >> step live
        partials -> N >> (step + 1), lanes with bit `offset` clear keep the lower half and send the upper one."""
        part, lane = args
        half = N >> (step + 1)
        offset = (L // 2) >> step
        lower = (lane & offset) == 0
        for i in range(half):
            send = part[i + half] if lower else part[i]
            keep = part[i] if lower else part[i + half]
            part[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, offset)

    halve_all = static_for(LOG_N, halve_partials)

    @device_function(**INLINE_DEVICE)
    def load_q(k, args):
        """q_pre[k] = element tid + T k of the block's q rows [HEADS, QW] (k a constant: q_pre in registers)."""
        q_lat, q_pe, row0, q_pre = args
        tokens, heads, latent = q_lat.shape[0], q_lat.shape[1], q_lat.shape[2]
        e = cuda.threadIdx.x + T * k
        hb = e // QW
        d = e - hb * QW
        row = row0 + hb
        value = float32(0.0)
        if e < Q_SIZE and row < tokens * heads and d < latent + q_pe.shape[2]:
            token = row // heads
            head = row - token * heads
            value = q_lat[token, head, d] if d < latent else q_pe[token, head, d - latent]
        q_pre[k] = value

    load_q_all = static_for(Q_LOADS, load_q)

    @device_function(**INLINE_DEVICE)
    def dot_dim(j, args):
        """part[hb * KG + g] += q[hb, lane + L j] * key g's dimension lane + L j, for all heads and keys of the
        group. j a constant (straight-line calls): key_val stays in registers."""
        part, key_val, q_s, lane = args
        for hb in range(HB):
            q = at(q_s, hb * QW + lane + L * j)
            for g in range(KG):
                part[hb * KG + g] += q * key_val[g * DJ + j]

    dot_all_dims = static_for(DJ, dot_dim)

    @device_function(inline=True)
    def sum_partials(part, scratch):
        """Warp-sum each of the N partials part[i] over the L lanes; returns the sum number lane >> SHIFT (the
        lanes with lane % 2**SHIFT == 0 own it). GPU: transposing butterfly (at the step with offset o, lanes
        with bit o clear keep the lower half of the live partials and send the upper one). Simulator: shared
        memory (every thread of the block must call it)."""
        tid = cuda.threadIdx.x
        lane = tid % L
        if ON_SIMULATOR:
            base = (tid - lane) * N
            for i in range(N):
                scratch[base + i * L + lane] = part[i]
            cuda.syncthreads()  # every lane's partials stored
            index = lane >> SHIFT
            total = float32(0.0)
            for k in range(L):
                total += scratch[base + index * L + k]
            cuda.syncthreads()  # all read before the scratch is reused
            return total
        halve_all((part, lane))
        offset = (L // 2) >> LOG_N
        total = part[0]
        while offset > 0:  # N < L: the lanes holding the same sum finish it with a plain butterfly
            total += cuda.shfl_xor_sync(FULL_MASK, total, offset)
            offset //= 2
        return total

    @device_function(inline=True)
    def warp_max_sum(value, is_sum, scratch):
        """Max (is_sum False) or sum of value over the warp, to every lane (simulator: shared memory; every
        thread of the block must call it)."""
        tid = cuda.threadIdx.x
        if ON_SIMULATOR:
            lane = tid % L
            scratch[tid] = value
            cuda.syncthreads()  # the warp's values stored
            result = scratch[tid - lane]
            for k in range(1, L):
                other = scratch[tid - lane + k]
                result = result + other if is_sum else max(result, other)
            cuda.syncthreads()  # all read before the scratch is reused
            return result
        offset = L // 2
        while offset > 0:
            other = cuda.shfl_xor_sync(FULL_MASK, value, offset)
            value = value + other if is_sum else max(value, other)
            offset //= 2
        return value

    @kernel_cache.jit(fastmath=config.fastmath, **compile_options)
    def mla_attention_decode_kernel(q_lat, q_pe, cache, prefix_arg, visibility, key_rows, key_counts, scale,
                                    keys_per_split, direct, out, o_part, lse_part):
        """q_lat float32 [s, h, c]; q_pe float32 [s, h, r]; cache float32 [t, c+r] C-contiguous (rows < P + s
        read); prefix_arg: P (prefix_on_device: int32 [1] holding P); visibility uint32 [s, ceil(s/32)];
        compact_keys only: key_rows int32 [s, >= s] (in-flight indices j: cache row P + j) and key_counts int32
        [s] (otherwise not read); scale float32. Grid (ceil(s*h / HEADS), splits), THREADS.
        direct: write out (flat [s*h*c]); else o_part (flat [splits*s*h*c], normalised) and lse_part (flat
        [splits*s*h]; -inf and zeros where the row sees nothing in the split)."""
        tid = cuda.threadIdx.x
        lane, warp = tid % L, tid // L
        split = cuda.blockIdx.y
        prefix_len = read_prefix(prefix_arg)
        tokens, heads, latent = q_lat.shape[0], q_lat.shape[1], q_lat.shape[2]
        rope = q_pe.shape[2]
        width = latent + rope
        rows = tokens * heads
        row0 = cuda.blockIdx.x * HB
        key_begin = split * keys_per_split
        block_token = row0 // heads  # compact_keys: every row of the block is this token's
        keys = prefix_len + (key_counts[block_token] if COMPACT else tokens)
        key_end = min(keys, key_begin + keys_per_split)
        n_chunks = (max(key_end - key_begin, 0) + KC - 1) // KC

        q_s = cuda.shared.array(Q_SIZE, float32)         # q rows [HEADS, QW]
        score_s = cuda.shared.array(SCORE_SIZE, float32)     # raw scores [HEADS, KEYS]
        p_s = cuda.shared.array(SCORE_SIZE, float32, alignment=P_ALIGN)  # probabilities [KEYS, HEADS]
        alpha_s = cuda.shared.array(HB, float32)
        max_s = cuda.shared.array(HB, float32)
        sum_s = cuda.shared.array(HB, float32)
        scratch = cuda.shared.array(SCRATCH, float32)     # simulator warp sums
        part = cuda.local.array(N, float32)
        key_val = cuda.local.array(KEY_REGS, float32)
        acc = cuda.local.array(VALUE_REGS, float32)
        v_val = cuda.local.array(V_REGS, float32)
        run_max = cuda.local.array(HPW, float32)
        run_sum = cuda.local.array(HPW, float32)
        q_pre = cuda.local.array(Q_LOADS, float32)

        # q rows (zeros past c + r and past the last row): all loads in flight, then the stores (a load-store
        # loop would wait for each load in turn)
        load_q_all((q_lat, q_pe, row0, q_pre))
        for k in range(Q_LOADS):
            if tid + T * k < Q_SIZE:
                at_put(q_s, tid + T * k, q_pre[k])
        for i in range(HB * VC):
            acc[i] = 0.0
        for j in range(HPW):
            run_max[j] = -math.inf
            run_sum[j] = 0.0
        cuda.syncthreads()  # q staged

        for chunk in range(n_chunks):
            chunk_begin = key_begin + chunk * KC
            # ---- scores [HEADS, KEYS] of this chunk
            for group in range(GROUPS):
                n0 = (group * W + warp) * KG
                for g in range(KG):
                    key = chunk_begin + n0 + g
                    row_of_key = cache_row(key, prefix_len, block_token, key_rows) if key < key_end else 0
                    for j in range(DJ):
                        d = lane + L * j
                        key_val[g * DJ + j] = at(cache, row_of_key * width + d) if key < key_end and d < width \
                            else float32(0.0)
                for i in range(N):
                    part[i] = 0.0
                dot_all_dims((part, key_val, q_s, lane))
                total = sum_partials(part, scratch)
                if lane & ((1 << SHIFT) - 1) == 0:
                    index = lane >> SHIFT
                    hb = index // KG
                    at_put(score_s, hb * KC + n0 + index - hb * KG, total)
            cuda.syncthreads()  # scores stored; the previous chunk's values phase done with p_s / alpha_s
            # ---- online softmax: warp w owns heads w + WARPS j (running max / sum in its registers)
            for j in range(HPW):
                hb = warp + W * j
                row = row0 + hb
                token = row // heads
                live = hb < HB and row < rows
                local_max = float32(-math.inf)
                for m in range(KPL):
                    n = lane + L * m
                    key = chunk_begin + n
                    if live and key < key_end and (COMPACT or key_visible(token, key, prefix_len, visibility)):
                        local_max = max(local_max, at(score_s, hb * KC + n) * scale)
                new_max = max(run_max[j], warp_max_sum(local_max, False, scratch))
                local_sum = float32(0.0)
                for m in range(KPL):
                    n = lane + L * m
                    key = chunk_begin + n
                    p = float32(0.0)
                    if live and key < key_end and (COMPACT or key_visible(token, key, prefix_len, visibility)):
                        p = math.exp(at(score_s, hb * KC + n) * scale - new_max)
                    local_sum += p
                    if hb < HB:
                        at_put(p_s, n * HB + hb, p)
                # nothing visible yet: alpha 1 (exp(-inf - -inf) would be NaN); 0 when the first keys arrive
                alpha = math.exp(run_max[j] - new_max) if new_max != -math.inf else float32(1.0)
                run_sum[j] = run_sum[j] * alpha + warp_max_sum(local_sum, True, scratch)
                run_max[j] = new_max
                if lane == 0 and hb < HB:
                    alpha_s[hb] = alpha
            cuda.syncthreads()  # p and alpha stored
            # ---- values: acc [HEADS, VC] = acc * alpha + p @ cache[chunk, :c]
            for hb in range(HB):
                alpha = alpha_s[hb]
                for k in range(VC):
                    acc[hb * VC + k] *= alpha
            chunk_keys = min(KC, key_end - chunk_begin)
            for n0 in range(0, chunk_keys, VU):
                for u in range(VU):
                    key = chunk_begin + n0 + u
                    row_of_key = cache_row(key, prefix_len, block_token, key_rows) if n0 + u < chunk_keys else 0
                    for k in range(VC):
                        column = tid + T * k
                        v_val[u * VC + k] = at(cache, row_of_key * width + column) \
                            if n0 + u < chunk_keys and column < latent else float32(0.0)
                for u in range(VU):
                    n = min(n0 + u, KC - 1)  # p is 0 past chunk_keys (the values too)
                    if VECTOR_P:  # one broadcast load for 4 heads' p
                        for h4 in range(HB // 4):
                            p0, p1, p2, p3 = load4(p_s, n * HB + 4 * h4)
                            for k in range(VC):
                                v = v_val[u * VC + k]
                                acc[(4 * h4) * VC + k] += p0 * v
                                acc[(4 * h4 + 1) * VC + k] += p1 * v
                                acc[(4 * h4 + 2) * VC + k] += p2 * v
                                acc[(4 * h4 + 3) * VC + k] += p3 * v
                    else:
                        for hb in range(HB):
                            p = at(p_s, n * HB + hb)
                            for k in range(VC):
                                acc[hb * VC + k] += p * v_val[u * VC + k]

        # ---- write-out: the softmax owners publish max / sum, every thread divides its columns
        for j in range(HPW):
            hb = warp + W * j
            if lane == 0 and hb < HB:
                max_s[hb] = run_max[j]
                sum_s[hb] = run_sum[j]
        cuda.syncthreads()  # row max / sum visible to all
        for hb in range(HB):
            row = row0 + hb
            if row < rows:
                total = sum_s[hb]
                # no visible key: NaN when final (the query saw nothing), 0 in a partial (merged away)
                inv = float32(1.0) / total if total > 0 else (float32(math.nan) if direct else float32(0.0))
                base = row * latent if direct else (split * rows + row) * latent
                for k in range(VC):
                    column = tid + T * k
                    if column < latent:
                        if direct:
                            at_put(out, base + column, acc[hb * VC + k] * inv)
                        else:
                            at_put(o_part, base + column, acc[hb * VC + k] * inv)
        if not direct and tid < HB and row0 + tid < rows:
            total = sum_s[tid]
            at_put(lse_part, split * rows + row0 + tid,
                   max_s[tid] + math.log(total) if total > 0 else float32(-math.inf))

    return mla_attention_decode_kernel


# ------------------------------------------------------------------------------------------- host side
def decode_num_splits(row_groups: int, total_keys: int, config: DecodeConfig = DEFAULT_CONFIG,
                      sms: int | None = None) -> int:
    """Splits whose row_groups x splits blocks fill the SMs' slots (blocks_per_sm each) best: the fewest splits
    within 2% of the best wave efficiency, up to one wave, min_keys_per_split key rows each. sms: SM count
    (None: this device)."""
    if sms is None:
        sms = 1 if ON_SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT
    slots = sms * config.blocks_per_sm
    most = max(1, min(-(-slots // row_groups), total_keys // config.min_keys_per_split))

    def efficiency(splits):
        blocks = row_groups * splits
        return blocks / (-(-blocks // slots) * slots)

    best = max(efficiency(splits) for splits in range(1, most + 1))
    return next(splits for splits in range(1, most + 1) if efficiency(splits) >= 0.98 * best)


def mla_attention_decode(q_lat, q_pe, cache_layer, prefix_len: int, visibility, scale: float, out=None,
                         num_splits: int | None = None, stream=0, config: DecodeConfig | None = None):
    """o_lat float32 [s, h, c] (device) of the absorbed MLA core for s <= MAX_TOKENS query tokens.

    Arguments as mla_attention.mla_attention: q_lat float32 [s, h, c]; q_pe float32 [s, h, r] (strided views
    are fine); cache_layer float32 [t, c+r] C-contiguous (the s in-flight rows at P..P+s-1); prefix_len P;
    visibility uint32 [s, 1] (pack_visibility); scale. num_splits: key-range splits (None:
    decode_num_splits); config: DecodeConfig (None: DEFAULT_CONFIG). A query that sees no key row gets NaN.
    """
    config = DEFAULT_CONFIG if config is None else config
    if len(getattr(q_lat, "shape", ())) == 3 and q_lat.shape[0] > MAX_TOKENS:
        raise ValueError(f"{q_lat.shape[0]} query tokens: the decode kernel takes at most {MAX_TOKENS} "
                         "(use mla_attention.mla_attention)")
    q_lat, q_pe, cache_layer, visibility, out = checked_inputs(q_lat, q_pe, cache_layer, prefix_len, visibility,
                                                               out, stream, latent_limits=True,
                                                               contiguous_cache=True)
    tokens, heads, latent = q_lat.shape
    rows = tokens * heads
    if rows == 0 or latent == 0:
        return out
    total_keys = prefix_len + tokens
    row_groups = -(-rows // config.heads)
    splits = decode_num_splits(row_groups, total_keys, config) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    keys_per_split = -(-total_keys // splits)
    keys_per_split = -(-keys_per_split // config.keys) * config.keys  # whole chunks
    # Not read without compact_keys: any int32 arrays of the kernel's ranks will do, so none is allocated.
    unused_rows = visibility.view(np.int32)
    return launch_decode(config, q_lat, q_pe, cache_layer, prefix_len, visibility, unused_rows,
                         unused_rows.reshape(-1), scale, keys_per_split, total_keys, out, stream)


def launch_decode(config: DecodeConfig, q_lat, q_pe, cache_layer, prefix_len, visibility, key_rows,
                  key_counts, scale: float, keys_per_split: int, total_keys: int, out, stream):
    """Launch the decode kernel of ``config`` on checked device arguments (see the kernel's docstring), key
    ranges of keys_per_split keys (a multiple of config.keys) up to total_keys (with prefix_on_device, a bound:
    splits past a row's keys are empty and merged away exactly), and merge the splits into ``out`` when there
    are several. prefix_len: P, or with config.prefix_on_device an int32 [1] device array holding it. Returns
    out."""
    tokens, heads, latent = q_lat.shape
    rows = tokens * heads
    splits = -(-total_keys // keys_per_split)
    kernel = decode_kernel(config)
    grid = (-(-rows // config.heads), splits)
    if splits == 1:
        flat_out = out.reshape(-1)  # also stands in for the partials (not written when direct)
        launch(kernel, grid, config.threads, stream, q_lat, q_pe, cache_layer, prefix_len, visibility, key_rows,
               key_counts, np.float32(scale), keys_per_split, True, flat_out, flat_out, flat_out)
        return out
    o_part = cuda.device_array((splits, tokens, heads, latent), dtype=np.float32, stream=stream)
    lse_part = cuda.device_array((splits, tokens, heads), dtype=np.float32, stream=stream)
    launch(kernel, grid, config.threads, stream, q_lat, q_pe, cache_layer, prefix_len, visibility, key_rows,
           key_counts, np.float32(scale), keys_per_split, False, out.reshape(-1), o_part.reshape(-1),
           lse_part.reshape(-1))
    launch(merge_splits_kernel, row_blocks(rows), MERGE_THREADS, stream, o_part, lse_part, splits, out)
    return out
