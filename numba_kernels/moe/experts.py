"""Routed experts of a MoE layer as one grouped launch: y[s, d] = sum_i w_i * down_e(silu(gate_e x) * up_e x).

Four small kernels, no Python loop over experts, nothing copied back to the host:
1. ``_plan_pairs`` (one block): counting sort of the s*k (token, slot) pairs by expert -> expert_offsets [e+1],
   sorted_pairs [P] (pair p = token*k + slot, ascending within each expert: each pair's place is its rank among
   its expert's pairs), active_experts (ascending).
2. ``gate_up`` (grid: f row tiles x active experts): act[row, f] = silu(gate x) * up x for every pair of the
   expert, so each expert's gate/up rows are read once per launch for all its tokens (up to tokens_per_pass).
3. ``down`` (grid: d row tiles x active experts): per-pair outputs pair_out[P, d] = down_e(act[row]).
4. ``combine_kernel(k)``: y[t] = (y[t] if accumulate) + sum over slots, in slot order, of w[t, slot] * pair_out.
   No float atomics: the result does not depend on scheduling.

Each warp owns a few weight rows. Its lanes stride over the row one "word" at a time: VEC consecutive columns
read by one load (fp32: 1; bf16: 2 as uint32, 4 as uint64, 8 as one 16-byte load of two uint64), UNROLL words
per loop trip, all loads of a trip issued before the FMAs so many bytes are in flight per lane. Partial sums
for up to tokens_per_pass tokens stay in registers (tokens past the expert's count are skipped, not padded)
and are reduced across the warp (shuffles on a GPU, shared memory under the simulator, which has none).
The widest word the weights allow is used: bf16 with columns % 8 == 0 and 16-byte aligned data (d = 7168,
f = 2048 are), else % 4 and 8-byte aligned, else uint32 pairs. Activations are read the same width.

Weights: fp32, or bf16 stored as uint16/int16 bit patterns, widened in the kernel (bits << 16 as fp32).
Stacked layouts: w_gate_up [e, 2f, d] (f gate rows, then f up rows, per expert), w_down [e, d, f].
Every launcher takes numba device arrays, __cuda_array_interface__ objects (torch tensors; bf16 ones viewed
as int16), or numpy arrays (copied; what the simulator tests use). Launch shapes are an ExpertsConfig
(default_config picks one; kernels are built and cached per config, so a benchmark can
sweep them).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as as_device
from kdspec.numba_kernels.host_arrays import check_array, device_address, output, weight_view
from kdspec.numba_kernels.intrinsics import at, at2, at2_put
from kdspec.numba_kernels.reductions import USE_SHUFFLE, WARP_SIZE, block_inclusive_sums
from kdspec.numba_kernels.runtime import ON_SIMULATOR, device_function, row_blocks

# A "warp" of LANES threads shares each weight row. The simulator has no shuffles (the reduction goes through
# shared memory), runs every thread in Python and pays a fixed cost per block (it polls its threads), so there
# a narrower group with many rows per group means few, small blocks; on a GPU LANES is the hardware warp.
LANES = 4 if ON_SIMULATOR else WARP_SIZE
PLAN_THREADS = 8 if ON_SIMULATOR else 1024
COMBINE_THREADS = 32 if ON_SIMULATOR else 256
WIDEST_WORD = 8  # bf16 columns per load at most (16 bytes)
TOKEN_GROUP = 4  # tokens per unrolled step of the FMA loop (see _make_dot_pass)
MAX_UNROLL = 4
MAX_TOKENS_PER_PASS = 4 * TOKEN_GROUP


@dataclass(frozen=True)
class ExpertsConfig:
    """Launch shape of the gate_up and down kernels (each config compiles its own kernels)."""

    warps_per_block: int
    gate_rows_per_warp: int   # intermediate rows per warp (each a gate row and an up row)
    down_rows_per_warp: int   # output rows per warp
    unroll: int               # words per lane per loop trip (loads issued together)
    tokens_per_pass: int      # tokens sharing one read of a weight row (register-blocked)
    max_word: int = WIDEST_WORD  # widest bf16 word to use: 8 (16-byte loads), 4 (uint64) or 2 (uint32)
    max_registers: int = 0    # per-thread register cap for the compiler (0: none), for more blocks per SM
    streaming: bool = False   # 16-byte weight loads marked evict-first (ld.global.cs)

    def __post_init__(self):
        if not 1 <= self.unroll <= MAX_UNROLL or not 1 <= self.tokens_per_pass <= MAX_TOKENS_PER_PASS:
            raise ValueError(f"ExpertsConfig: unroll {self.unroll} (1..{MAX_UNROLL}), tokens_per_pass "
                             f"{self.tokens_per_pass} (1..{MAX_TOKENS_PER_PASS})")
        if self.max_word not in (2, 4, 8) or min(self.warps_per_block, self.gate_rows_per_warp,
                                                 self.down_rows_per_warp) < 1:
            raise ValueError(f"ExpertsConfig: bad launch shape {self}")


# The simulator runs every thread as Python: one small warp per block, many rows per warp, one token a pass.
# On the GPU: the fastest shape of tools/sweeps/moe.py on the H200 at every token count it measured (K2's 384
# experts, top-8; figures in docs/benchmarks-history.md). Evict-first weight loads keep the activations
# (re-read by every warp) in the caches; more tokens a pass (8, for s = 256) was slower at every s.
DEFAULT_CONFIG = (ExpertsConfig(1, 32, 64, 1, 1) if ON_SIMULATOR else
                  ExpertsConfig(warps_per_block=8, gate_rows_per_warp=2, down_rows_per_warp=4, unroll=2,
                                tokens_per_pass=4, streaming=True))


def default_config(n_pairs: int, n_experts: int) -> ExpertsConfig:
    """The launch shape for n_pairs (token, expert) pairs over n_experts experts (one shape won the sweep at
    every size; the hook stays for shapes that will differ)."""
    return DEFAULT_CONFIG


SCRATCH_THREADS_PER_WARP = LANES if ON_SIMULATOR else 1  # warp-sum scratch: only the simulator needs it


# ------------------------------------------------------------------------------------ device helpers
# Small helpers are inlined into the kernels so their local arrays can live in registers (the simulator's
# jit has no such option).
INLINE_DEVICE = {} if ON_SIMULATOR else dict(forceinline=True)

if ON_SIMULATOR:
    def _bits_as_float(bits):
        return np.array([int(bits) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]
else:
    from numba.cuda import libdevice

    @device_function(**INLINE_DEVICE)
    def _bits_as_float(bits):
        return libdevice.int_as_float(int32(bits))


@device_function(**INLINE_DEVICE)
def load_pair_f32(w, expert, row, word):
    """Columns 2*word and 2*word+1 of row ``row`` of expert ``expert``; w float32 [e, rows, cols]."""
    return w[expert, row, 2 * word], w[expert, row, 2 * word + 1]


@device_function(**INLINE_DEVICE)
def load_pair_bf16(w, expert, row, word):
    """The same two columns from bf16 bits packed in pairs; w uint32 [e, rows, cols/2] (low half first)."""
    bits = w[expert, row, word]
    return _bits_as_float(bits << 16), _bits_as_float(bits & 0xFFFF0000)


@device_function(**INLINE_DEVICE)
def silu(v):
    return v / (float32(1.0) + math.exp(-v))


# 16-byte loads: numba has no 128-bit type, so an intrinsic loads <2 x i64> (ld.v2.u64) and returns a pair.
# The streaming variant (ld.global.cs: evict first) is for weights, read once per launch, so that they pass
# through the caches without pushing out the activations, which every warp re-reads.
if ON_SIMULATOR:
    def load_u64x2(a, i, j, word):
        """(a[i, j, 2*word], a[i, j, 2*word + 1]); a uint64 3-D."""
        return a[i, j, 2 * word], a[i, j, 2 * word + 1]

    load_u64x2_streaming = load_u64x2

    def load_u64x2_flat(a, index):
        """(a[index], a[index + 1]); a uint64 1-D."""
        return a[index], a[index + 1]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _make_load_u64x2(streaming: bool):
        @intrinsic
        def load(typingctx, a, i, j, word):
            """(a[i, j, 2*word], a[i, j, 2*word + 1]) in one 16-byte load; a uint64 3-D, C-contiguous, whose
            element [i, j, 2*word] is 16-byte aligned (the launcher checks the base pointer and row length)."""
            signature = types.UniTuple(types.uint64, 2)(a, i, j, word)

            def codegen(context, builder, sig, args):
                array_type = sig.args[0]
                array = context.make_array(array_type)(context, builder, value=args[0])
                i, j, word = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:]))
                index = [i, j, builder.mul(word, context.get_constant(types.intp, 2))]
                pointer = cgutils.get_item_pointer(context, builder, array_type, array, index)
                u64 = ir.IntType(64)
                if streaming:  # device allocations are global memory: the generic address is the global one
                    pair = ir.LiteralStructType([u64, u64])
                    asm = ir.InlineAsm(ir.FunctionType(pair, [pointer.type]),
                                       "ld.global.cs.v2.u64 {$0, $1}, [$2];", "=l,=l,l")
                    loaded = builder.call(asm, [pointer])
                    values = [builder.extract_value(loaded, n) for n in range(2)]
                else:
                    vector = builder.load(builder.bitcast(pointer, ir.VectorType(u64, 2).as_pointer()), align=16)
                    values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), n)) for n in range(2)]
                return context.make_tuple(builder, sig.return_type, values)

            return signature, codegen
        return load

    load_u64x2 = _make_load_u64x2(streaming=False)
    load_u64x2_streaming = _make_load_u64x2(streaming=True)

    @intrinsic
    def load_u64x2_flat(typingctx, a, index):
        """(a[index], a[index + 1]) in one 16-byte load; a uint64 1-D (shared or global), a[index] 16-byte
        aligned."""
        signature = types.UniTuple(types.uint64, 2)(a, index)

        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, value=args[0])
            offset = context.cast(builder, args[1], sig.args[1], types.intp)
            pointer = builder.gep(array.data, [offset], inbounds=True)
            u64 = ir.IntType(64)
            vector = builder.load(builder.bitcast(pointer, ir.VectorType(u64, 2).as_pointer()), align=16)
            values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), n)) for n in range(2)]
            return context.make_tuple(builder, sig.return_type, values)

        return signature, codegen


@device_function(**INLINE_DEVICE)
def bf16x4(bits):
    """The four bf16 values packed in a uint64 (lowest 16 bits first) as fp32."""
    return (_bits_as_float(bits << uint64(16)), _bits_as_float(bits & uint64(0xFFFF0000)),
            _bits_as_float((bits >> uint64(16)) & uint64(0xFFFF0000)),
            _bits_as_float((bits >> uint64(32)) & uint64(0xFFFF0000)))


@device_function(**INLINE_DEVICE)
def f32x2(bits):
    """The two fp32 values packed in a uint64 (lower address first)."""
    return _bits_as_float(bits & uint64(0xFFFFFFFF)), _bits_as_float(bits >> uint64(32))


@device_function(**INLINE_DEVICE)
def bf16x2(bits):
    """The two bf16 values packed in a uint32 (low half first) as fp32."""
    return _bits_as_float(bits << 16), _bits_as_float(bits & 0xFFFF0000)


@device_function(**INLINE_DEVICE)
def same(value):
    return (value,)


# Word loaders. A "word" is the VEC columns one lane reads from a weight row with one load, kept as RAW raw
# values (fp32, uint32 or uint64 bf16 bits) until used, so the loads of a loop trip cost few registers;
# ``unpack`` turns one raw value into PER = VEC / RAW fp32 values. The activations (x or act, fp32 [1, rows,
# cols] or viewed as uint64 [1, rows, cols/2]) are read the same VEC columns at a time.
@device_function(**INLINE_DEVICE)
def w_raw_one(w, expert, row, word):
    return (w[expert, row, word],)


@device_function(**INLINE_DEVICE)
def w_raw_u64x2(w, expert, row, word):
    return load_u64x2(w, expert, row, word)


@device_function(**INLINE_DEVICE)
def w_raw_u64x2_streaming(w, expert, row, word):
    return load_u64x2_streaming(w, expert, row, word)


@device_function(**INLINE_DEVICE)
def a_word_f32(a, row, word):
    return (a[0, row, word],)


@device_function(**INLINE_DEVICE)
def a_word_x2(a, row, word):
    return a[0, row, 2 * word], a[0, row, 2 * word + 1]


@device_function(**INLINE_DEVICE)
def a_word_x4(a, row, word):
    v0, v1 = f32x2(a[0, row, 2 * word])
    v2, v3 = f32x2(a[0, row, 2 * word + 1])
    return v0, v1, v2, v3


@device_function(**INLINE_DEVICE)
def a_word_x8(a, row, word):
    first = load_u64x2(a, 0, row, 2 * word)
    second = load_u64x2(a, 0, row, 2 * word + 1)
    v0, v1 = f32x2(first[0])
    v2, v3 = f32x2(first[1])
    v4, v5 = f32x2(second[0])
    v6, v7 = f32x2(second[1])
    return v0, v1, v2, v3, v4, v5, v6, v7


@dataclass(frozen=True)
class WordFormat:
    """How a kernel reads VEC columns of a weight row and of an activation row."""

    vec: int            # columns per word
    raw_count: int      # raw values per word (RAW)
    raw_type: object    # their numba type
    load_raw: object    # (w [e, rows, ...], expert, row, word) -> RAW raw values
    unpack: object      # raw value -> VEC / RAW fp32 values
    load_a: object      # (a [1, rows, ...], row, word) -> VEC fp32 values
    a_dtype: object     # numpy dtype the activations are viewed as


WORD_FORMATS = {
    1: WordFormat(1, 1, float32, w_raw_one, same, a_word_f32, np.float32),        # fp32 weights
    2: WordFormat(2, 1, uint32, w_raw_one, bf16x2, a_word_x2, np.float32),        # bf16, 4-byte loads
    4: WordFormat(4, 1, uint64, w_raw_one, bf16x4, a_word_x4, np.uint64),         # bf16, 8-byte loads
    8: WordFormat(8, 2, uint64, w_raw_u64x2, bf16x4, a_word_x8, np.uint64),       # bf16, 16-byte loads
}
STREAMING_FORMATS = {8: dataclasses.replace(WORD_FORMATS[8], load_raw=w_raw_u64x2_streaming)}


@device_function(**INLINE_DEVICE)
def reduce_tokens(acc, n_tokens, scratch):
    """acc[i, t] <- its sum over the warp for t < n_tokens (warp-uniform), valid in lane 0 (other lanes:
    unspecified). acc: local float32 [I, T]. Every thread of the block must call it: the simulator path (no
    shuffles) synchronises the block through scratch, shared float32 [I, T, blockDim.x] (unused on a GPU)."""
    if USE_SHUFFLE:
        for i in range(acc.shape[0]):
            for t in range(acc.shape[1]):
                if t < n_tokens:  # uniform over the warp: the shuffles stay converged
                    value = acc[i, t]
                    offset = WARP_SIZE // 2
                    while offset > 0:
                        value += cuda.shfl_down_sync(0xFFFFFFFF, value, offset)
                        offset //= 2
                    acc[i, t] = value
        return
    tid = cuda.threadIdx.x
    for i in range(acc.shape[0]):
        for t in range(acc.shape[1]):
            scratch[i, t, tid] = acc[i, t]
    cuda.syncthreads()  # every lane's partials are stored
    if tid % LANES == 0:
        for i in range(acc.shape[0]):
            for t in range(acc.shape[1]):
                total = float32(0.0)
                for lane in range(LANES):
                    total += scratch[i, t, tid + lane]
                acc[i, t] = total
    cuda.syncthreads()  # lane 0 has read them before scratch is reused


# --------------------------------------------------------------------------------------- kernels
@kernel_cache.jit
def _plan_pairs(expert_ids, n_experts, expert_counts, expert_offsets, placed_pairs, sorted_pairs, active_experts,
                n_active):
    """Counting sort of the pairs by expert; one block. expert_ids int32 [s, k] -> expert_offsets [e+1],
    sorted_pairs [P] (ascending within an expert), active_experts [min(e, P)] ascending, n_active [1].
    expert_counts [e] and placed_pairs [P] are scratch (the placement cursors; each expert's pairs in the order
    the atomics placed them). Out-of-range ids are left out."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    n_pairs = expert_ids.shape[0] * expert_ids.shape[1]  # pair p is flat element p of expert_ids (C-contiguous)
    scan_pairs = cuda.shared.array(PLAN_THREADS, int32)
    scan_active = cuda.shared.array(PLAN_THREADS, int32)
    j = tid
    while j < n_experts:
        expert_counts[j] = 0
        j += width
    cuda.syncthreads()  # counts zeroed before any pair adds to them
    p = tid
    while p < n_pairs:
        expert = at(expert_ids, p)
        if 0 <= expert < n_experts:
            cuda.atomic.add(expert_counts, expert, 1)
        p += width
    cuda.syncthreads()  # every count is final
    # Each thread owns a contiguous chunk of experts; a scan over the threads' chunk totals gives offsets.
    chunk = (n_experts + width - 1) // width
    first = tid * chunk
    last = min(first + chunk, n_experts)
    own_pairs = int32(0)
    own_active = int32(0)
    for j in range(first, last):
        own_pairs += expert_counts[j]
        own_active += 1 if expert_counts[j] > 0 else 0
    pairs_through, active_through = block_inclusive_sums(own_pairs, own_active, scan_pairs, scan_active)
    offset = pairs_through - own_pairs
    active = active_through - own_active
    for j in range(first, last):
        count = expert_counts[j]
        expert_offsets[j] = offset
        expert_counts[j] = offset  # from here on: the next free slot of expert j
        if count > 0:
            active_experts[active] = j
            active += 1
        offset += count
    if tid == width - 1:
        expert_offsets[n_experts] = pairs_through
        n_active[0] = active_through
    cuda.syncthreads()  # cursors set before placement (and the total pairs, expert_offsets[n_experts])
    p = tid
    while p < n_pairs:
        expert = at(expert_ids, p)
        if 0 <= expert < n_experts:
            placed_pairs[cuda.atomic.add(expert_counts, expert, 1)] = p
        p += width
    cuda.syncthreads()  # all pairs placed before their ranks are counted
    # Atomics placed them in any order; a pair's rank among its expert's pairs is its place in the fixed layout.
    # One thread per pair, each reading its expert's segment (an insertion sort per expert, one thread each,
    # took ~1 ms at 64 pairs an expert).
    i = tid
    while i < expert_offsets[n_experts]:
        pair = placed_pairs[i]
        expert = at(expert_ids, pair)
        begin = expert_offsets[expert]
        rank = 0
        for j in range(begin, expert_offsets[expert + 1]):
            rank += 1 if placed_pairs[j] < pair else 0
        sorted_pairs[begin + rank] = pair
        i += width


def _make_dot_pass(fmt: WordFormat, n_rows: int, unroll: int, tokens_per_pass: int):
    """Device function: this lane's partial dot products of n_rows weight rows with up to tokens_per_pass
    activation rows, words read per ``fmt``, ``unroll`` words per lane per loop trip.

    Register arrays need constant indices, which LLVM gives only to loops it fully unrolls, and it leaves
    large loop bodies rolled (the array then goes to local memory). So the big steps are written as calls
    with constant arguments instead of loops: one call per word of a trip, one per group of TOKEN_GROUP
    tokens; each call's own loops are small enough to unroll."""
    load_raw, unpack, load_a = fmt.load_raw, fmt.unpack, fmt.load_a
    vec, raw_count, raw_type = fmt.vec, fmt.raw_count, fmt.raw_type
    per_raw = vec // raw_count

    @device_function(**INLINE_DEVICE)
    def fma_tokens(acc, weights, a, a_rows, n_tokens, word, inside, first):
        """acc[r, first + t] += weights[r] . a[0, a_rows[first + t]] (word ``word``; zeros unless inside) for
        t < TOKEN_GROUP while first + t < n_tokens (block-uniform: no FMAs for padding)."""
        for t in range(TOKEN_GROUP):
            token = first + t
            if token < tokens_per_pass and token < n_tokens:
                xs = load_a(a, a_rows[token], word)
                for c in range(vec):
                    xc = xs[c] if inside else float32(0.0)
                    for r in range(n_rows):
                        acc[r, token] += weights[r, c] * xc

    @device_function(**INLINE_DEVICE)
    def consume_word(raw, u, acc, a, a_rows, n_tokens, n_words, base):
        """Unpack word u of the trip starting at ``base`` and add its products to acc."""
        inside = base + u * LANES < n_words
        word = min(base + u * LANES, n_words - 1)  # past the row: the loads read a valid word, this adds 0
        weights = cuda.local.array((n_rows, vec), float32)
        for r in range(n_rows):
            for q in range(raw_count):
                values = unpack(raw[r, u, q])
                for c in range(per_raw):
                    weights[r, q * per_raw + c] = values[c]
        fma_tokens(acc, weights, a, a_rows, n_tokens, word, inside, 0)
        if tokens_per_pass > TOKEN_GROUP:
            fma_tokens(acc, weights, a, a_rows, n_tokens, word, inside, TOKEN_GROUP)
        if tokens_per_pass > 2 * TOKEN_GROUP:
            fma_tokens(acc, weights, a, a_rows, n_tokens, word, inside, 2 * TOKEN_GROUP)
        if tokens_per_pass > 3 * TOKEN_GROUP:
            fma_tokens(acc, weights, a, a_rows, n_tokens, word, inside, 3 * TOKEN_GROUP)

    @device_function(**INLINE_DEVICE)
    def dot_pass(w, expert, rows, a, a_rows, n_tokens, n_words, acc):
        """acc[r, t] = sum over this lane's words of w[expert, rows[r]] . a[0, a_rows[t]] for t < n_tokens
        (n_tokens block-uniform; later t: 0). w [e, rows, n_words words]; a [1, rows, ...]; rows int32
        [n_rows], a_rows int32 [tokens_per_pass], acc float32 [n_rows, tokens_per_pass] (local arrays)."""
        lane = cuda.threadIdx.x % LANES
        raw = cuda.local.array((n_rows, unroll, raw_count), raw_type)
        for r in range(n_rows):
            for t in range(tokens_per_pass):
                acc[r, t] = 0.0
        for base in range(lane, n_words, LANES * unroll):
            for u in range(unroll):  # every weight load of the trip first: they are in flight together
                word = min(base + u * LANES, n_words - 1)
                for r in range(n_rows):
                    values = load_raw(w, expert, rows[r], word)
                    for q in range(raw_count):
                        raw[r, u, q] = values[q]
            consume_word(raw, 0, acc, a, a_rows, n_tokens, n_words, base)
            if unroll > 1:
                consume_word(raw, 1, acc, a, a_rows, n_tokens, n_words, base)
            if unroll > 2:
                consume_word(raw, 2, acc, a, a_rows, n_tokens, n_words, base)
            if unroll > 3:
                consume_word(raw, 3, acc, a, a_rows, n_tokens, n_words, base)
    return dot_pass


def _jit_options(config: ExpertsConfig) -> dict:
    return dict(max_registers=config.max_registers) if config.max_registers and not ON_SIMULATOR else {}


def _make_gate_up(fmt: WordFormat, config: ExpertsConfig):
    """gate_up kernel reading words per ``fmt``, launch shape ``config``."""
    warps, rows_per_warp = config.warps_per_block, config.gate_rows_per_warp
    acc_rows, tokens_per_pass = 2 * rows_per_warp, config.tokens_per_pass
    scratch_threads = warps * SCRATCH_THREADS_PER_WARP
    dot_pass = _make_dot_pass(fmt, acc_rows, config.unroll, tokens_per_pass)

    @kernel_cache.jit(**_jit_options(config))
    def gate_up(x, w_gate_up, n_words, f, k, expert_offsets, sorted_pairs, active_experts, n_active, act):
        """act[row, i] = silu(gate_i . x_t) * (up_i . x_t) for sorted row ``row`` (pair sorted_pairs[row],
        token t = pair // k). x: fp32 [s, d] as the word format reads it ([1, s, d] or uint64 [1, s, d/2]);
        w_gate_up [e, 2f, d] as the word format reads it (n_words words a row); act float32 [P, f].
        Grid: (ceil(f / rows per block), row_blocks(max active experts)), grid-stride over active experts."""
        scratch = cuda.shared.array((acc_rows, tokens_per_pass, scratch_threads), float32)
        lane = cuda.threadIdx.x % LANES
        first_row = (cuda.blockIdx.x * warps + cuda.threadIdx.x // LANES) * rows_per_warp
        # weight rows of this warp: its gate rows, then the matching up rows (f further down)
        rows = cuda.local.array(acc_rows, int32)
        for r in range(rows_per_warp):
            row = min(first_row + r, f - 1)  # past f: recompute the last row, never store it
            rows[r] = row
            rows[rows_per_warp + r] = f + row
        tokens = cuda.local.array(tokens_per_pass, int32)
        acc = cuda.local.array((acc_rows, tokens_per_pass), float32)
        for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform (syncs inside)
            expert = active_experts[active]
            begin = expert_offsets[expert]
            end = expert_offsets[expert + 1]
            for chunk in range(begin, end, tokens_per_pass):
                n_tokens = min(tokens_per_pass, end - chunk)
                for t in range(tokens_per_pass):
                    tokens[t] = sorted_pairs[chunk + min(t, n_tokens - 1)] // k
                dot_pass(w_gate_up, expert, rows, x, tokens, n_tokens, n_words, acc)
                reduce_tokens(acc, n_tokens, scratch)
                if lane == 0:
                    for t in range(tokens_per_pass):  # constant trip counts keep acc in registers
                        for r in range(rows_per_warp):
                            if t < n_tokens and first_row + r < f:
                                act[chunk + t, first_row + r] = silu(acc[r, t]) * acc[rows_per_warp + r, t]
    return gate_up


def _make_down(fmt: WordFormat, config: ExpertsConfig):
    """down kernel reading words per ``fmt``, launch shape ``config``."""
    warps, rows_per_warp, tokens_per_pass = config.warps_per_block, config.down_rows_per_warp, config.tokens_per_pass
    scratch_threads = warps * SCRATCH_THREADS_PER_WARP
    dot_pass = _make_dot_pass(fmt, rows_per_warp, config.unroll, tokens_per_pass)

    @kernel_cache.jit(**_jit_options(config))
    def down(act, w_down, n_words, expert_offsets, sorted_pairs, active_experts, n_active, pair_out):
        """pair_out[pair, j] = down_j . act[row] for sorted row ``row`` (pair = sorted_pairs[row]).
        act: fp32 [P, f] as the word format reads it; w_down [e, d, f] as the word format reads it (n_words
        words a row); pair_out float32 [P, d].
        Grid: (ceil(d / rows per block), row_blocks(max active experts)), grid-stride over active experts."""
        scratch = cuda.shared.array((rows_per_warp, tokens_per_pass, scratch_threads), float32)
        d = pair_out.shape[1]
        lane = cuda.threadIdx.x % LANES
        first_row = (cuda.blockIdx.x * warps + cuda.threadIdx.x // LANES) * rows_per_warp
        rows = cuda.local.array(rows_per_warp, int32)
        for r in range(rows_per_warp):
            rows[r] = min(first_row + r, d - 1)  # past d: recompute the last row, never store it
        act_rows = cuda.local.array(tokens_per_pass, int32)
        acc = cuda.local.array((rows_per_warp, tokens_per_pass), float32)
        for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform (syncs inside)
            expert = active_experts[active]
            begin = expert_offsets[expert]
            end = expert_offsets[expert + 1]
            for chunk in range(begin, end, tokens_per_pass):
                n_tokens = min(tokens_per_pass, end - chunk)
                for t in range(tokens_per_pass):
                    act_rows[t] = chunk + min(t, n_tokens - 1)
                dot_pass(w_down, expert, rows, act, act_rows, n_tokens, n_words, acc)
                reduce_tokens(acc, n_tokens, scratch)
                if lane == 0:
                    for t in range(tokens_per_pass):  # constant trip counts keep acc in registers
                        if t < n_tokens:
                            pair = sorted_pairs[act_rows[t]]
                            for r in range(rows_per_warp):
                                if first_row + r < d:
                                    pair_out[pair, first_row + r] = acc[r, t]
    return down


_KERNELS = {}


def expert_kernels(vec: int, config: ExpertsConfig):
    """(gate_up, down) kernels for weights read ``vec`` columns per load (1: fp32; 2, 4, 8: bf16), built once
    per (vec, config)."""
    key = (vec, config)
    if key not in _KERNELS:
        fmt = STREAMING_FORMATS.get(vec, WORD_FORMATS[vec]) if config.streaming else WORD_FORMATS[vec]
        _KERNELS[key] = (_make_gate_up(fmt, config), _make_down(fmt, config))
    return _KERNELS[key]


@functools.lru_cache(maxsize=None)
def combine_kernel(k: int):
    """The combine kernel for k slots a token, unrolled: every slot's loads are issued before the sum (a loop over
    a run-time k waited one load latency a slot, behind each slot's range check)."""
    @kernel_cache.jit
    def combine_slots(pair_out, expert_ids, expert_weights, n_experts, accumulate, y):
        """y[t, j] = (y[t, j] if accumulate else 0) + sum_slot w[t, slot] * pair_out[t*k + slot, j], slots in
        order; slots with an out-of-range expert id add nothing. expert_ids int32 [s, k], expert_weights float32
        [s, k], pair_out float32 [s*k, d], y float32 [s, d]. Grid: (ceil(d / threads), row_blocks(s)),
        grid-stride over tokens."""
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if j >= y.shape[1]:
            return
        t = cuda.blockIdx.y
        while t < y.shape[0]:
            total = float32(0.0)
            for slot in range(k):  # constant trip count: unrolled
                expert = at2(expert_ids, t, slot)
                product = at2(expert_weights, t, slot) * at2(pair_out, t * k + slot, j)  # read whatever the id
                total = total + product if 0 <= expert < n_experts else total
            if accumulate:
                total = at2(y, t, j) + total
            at2_put(y, t, j, total)
            t += cuda.gridDim.y
    return combine_slots


# ---------------------------------------------------------------------------------------- launchers
@dataclass
class ExpertPlan:
    """Device buffers of one grouped launch (pairs sorted by expert); reusable across calls of one s*k."""

    expert_counts: object     # int32 [e]
    expert_offsets: object    # int32 [e+1]
    placed_pairs: object      # int32 [P] (scratch)
    sorted_pairs: object      # int32 [P]
    active_experts: object    # int32 [min(e, P)]
    n_active: object          # int32 [1]

    @classmethod
    def allocate(cls, n_experts: int, n_pairs: int, stream=0) -> "ExpertPlan":
        alloc = lambda n: cuda.device_array(n, dtype=np.int32, stream=stream)  # noqa: E731
        return cls(alloc(n_experts), alloc(n_experts + 1), alloc(n_pairs), alloc(n_pairs),
                   alloc(min(n_experts, n_pairs)), alloc(1))


def plan_pairs(expert_ids, n_experts: int, plan: ExpertPlan | None = None, stream=0) -> ExpertPlan:
    """Sort the (token, slot) pairs of expert_ids int32 [s, k] by expert, on the device."""
    expert_ids = as_device(expert_ids, "expert_ids")
    check_array(expert_ids, "expert_ids", (None, None), [np.int32])
    if not expert_ids.is_c_contiguous():
        raise ValueError("expert_ids must be C-contiguous")
    n_pairs = expert_ids.shape[0] * expert_ids.shape[1]
    if plan is None:
        plan = ExpertPlan.allocate(n_experts, n_pairs, stream)
    elif plan.sorted_pairs.shape[0] != n_pairs or plan.expert_counts.shape[0] != n_experts:
        raise ValueError(f"plan: sized for {plan.sorted_pairs.shape[0]} pairs of {plan.expert_counts.shape[0]} "
                         f"experts, need {n_pairs} of {n_experts}")
    _plan_pairs[1, PLAN_THREADS, stream](expert_ids, n_experts, plan.expert_counts, plan.expert_offsets,
                                         plan.placed_pairs, plan.sorted_pairs, plan.active_experts, plan.n_active)
    return plan




def word_width(weights, activation, config: ExpertsConfig) -> int:
    """Columns per load for a weight view from weight_view (fp32: 1; bf16: 8, 4 or 2, the widest that the
    column count, the alignment of the weights and of the fp32 activation [rows, cols], and config allow)."""
    view, is_bf16 = weights
    if not is_bf16:
        return 1
    cols = 2 * view.shape[2]
    for vec in (8, 4):  # weights: one 2*vec-byte load; activations: 16-byte (vec 8) or 8-byte (vec 4) loads
        if (vec <= config.max_word and cols % vec == 0 and device_address(view) % (2 * vec) == 0
                and device_address(activation) % (2 * vec) == 0):
            return vec
    return 2


def _launch_views(weights, activation, vec):
    """(weights as the vec loader reads them [e, rows, words], number of words per row, activation [1, rows,
    ...] as the activation loader reads it)."""
    view, _ = weights
    rows, cols = activation.shape
    loaded = activation.reshape(1, rows, cols)
    if vec >= 4:
        view = view.view(np.uint64)
        loaded = activation.view(WORD_FORMATS[vec].a_dtype).reshape(1, rows, cols // 2)
    return view, cols // vec, loaded


def grouped_swiglu(x, k, plan: ExpertPlan, w_gate_up, w_down, act, pair_out, stream=0, config=None):
    """pair_out[p] = down_e(silu(gate_e x_t) * up_e x_t) for every planned pair p = t*k + slot of expert e.
    Arguments already checked: x float32 [s, d] and act float32 [P, f], both C-contiguous; weight views from
    weight_view; pair_out float32 [P, d]. ``config``: an ExpertsConfig (default: default_config)."""
    f = act.shape[1]
    config = config or default_config(act.shape[0], w_gate_up[0].shape[0])
    d = x.shape[1]
    max_active = plan.active_experts.shape[0]
    if max_active == 0:
        return
    threads = config.warps_per_block * LANES
    vec = word_width(w_gate_up, x, config)
    weights, n_words, x_loaded = _launch_views(w_gate_up, x, vec)
    rows_per_block = config.warps_per_block * config.gate_rows_per_warp
    expert_kernels(vec, config)[0][(math.ceil(f / rows_per_block), row_blocks(max_active)), threads, stream](
        x_loaded, weights, n_words, f, k, plan.expert_offsets, plan.sorted_pairs, plan.active_experts,
        plan.n_active, act)
    vec = word_width(w_down, act, config)
    weights, n_words, act_loaded = _launch_views(w_down, act, vec)
    rows_per_block = config.warps_per_block * config.down_rows_per_warp
    expert_kernels(vec, config)[1][(math.ceil(d / rows_per_block), row_blocks(max_active)), threads, stream](
        act_loaded, weights, n_words, plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active,
        pair_out)


# Buffers of moe_experts calls on the default stream, reused while the sizes stay the same: allocating them
# (cudaMalloc, and numba's deferred frees, which synchronise) costs more than the whole launch at s = 1.
# Safe because every use is ordered on that one stream.
_WORKSPACES: dict = {}
MAX_WORKSPACES = 4


def _workspace(n_experts, n_pairs, d, f, stream):
    """(plan, act float32 [P, f], pair_out float32 [P, d]) for one launch; cached for stream 0 only."""
    key = (n_experts, n_pairs, d, f)
    if stream != 0 or key not in _WORKSPACES:
        buffers = (ExpertPlan.allocate(n_experts, n_pairs, stream),
                   cuda.device_array((n_pairs, f), dtype=np.float32, stream=stream),
                   cuda.device_array((n_pairs, d), dtype=np.float32, stream=stream))
        if stream != 0:
            return buffers
        while len(_WORKSPACES) >= MAX_WORKSPACES:
            del _WORKSPACES[next(iter(_WORKSPACES))]  # the oldest
        _WORKSPACES[key] = buffers
    return _WORKSPACES[key]


def moe_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, out=None, accumulate=False,
                plan=None, stream=0, config=None, tensor_cores=False):
    """Routed-expert FFN of a MoE layer, one grouped launch over all (token, expert) pairs.

    x float32 [s, d] (C-contiguous); expert_ids int32 [s, k]; expert_weights float32 [s, k];
    w_gate_up [e, 2f, d] and w_down [e, d, f], float32 or bf16 bits (uint16/int16); d and f even.
    Returns y float32 [s, d] = sum_i w_i * down_e(silu(gate_e x) * up_e x); with accumulate=True the sum is
    added to ``out`` (e.g. holding the shared expert's output). ``plan``: an ExpertPlan to reuse;
    ``config``: an ExpertsConfig (launch shape; default: default_config(s * k, e)). ``tensor_cores``: the
    products in bf16 on the tensor cores (experts_tc.py: bf16 weights, d and f multiples of 32); ``config`` is
    then a TcConfig, StagedConfig or WgmmaConfig (default: experts_tc.tc_config_for), and the weights must be in
    experts_tc.fragment_layout.
    """
    x = as_device(x, "x")
    check_array(x, "x", (None, None), [np.float32])
    if not x.is_c_contiguous():
        raise ValueError("x: must be C-contiguous (it is read in words of several columns)")
    s, d = x.shape
    expert_ids = as_device(expert_ids, "expert_ids")
    check_array(expert_ids, "expert_ids", (s, None), [np.int32])
    k = expert_ids.shape[1]
    expert_weights = as_device(expert_weights, "expert_weights")
    check_array(expert_weights, "expert_weights", (s, k), [np.float32])
    w_gate_up = as_device(w_gate_up, "w_gate_up")
    if len(w_gate_up.shape) != 3 or w_gate_up.shape[2] != d or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up: shape {tuple(w_gate_up.shape)}, expected [e, 2f, d={d}]")
    e, f = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    w_down = as_device(w_down, "w_down")
    check_array(w_down, "w_down", (e, d, f), [np.float32, np.uint16, np.int16])
    if d % 2 or f % 2:
        raise ValueError(f"moe_experts: d ({d}) and f ({f}) must be even (weights are read in column pairs)")
    if accumulate and out is None:
        raise ValueError("moe_experts: accumulate=True needs out= (the tensor to add to)")
    y = output(out, "out", (s, d), stream)
    if s == 0:
        return y
    gate_view = weight_view(w_gate_up, "w_gate_up")
    down_view = weight_view(w_down, "w_down")
    cached_plan, act, pair_out = _workspace(e, s * k, d, f, stream)
    plan = plan_pairs(expert_ids, e, plan or cached_plan, stream)
    if tensor_cores:
        from kdspec.numba_kernels.moe.experts_tc import grouped_swiglu_tc  # it builds on this module
        grouped_swiglu_tc(x, k, plan, gate_view, down_view, act, pair_out, stream, config)
    else:
        grouped_swiglu(x, k, plan, gate_view, down_view, act, pair_out, stream, config)
    combine_kernel(k)[(math.ceil(d / COMBINE_THREADS), row_blocks(s)), COMBINE_THREADS, stream](
        pair_out, expert_ids, expert_weights, e, accumulate, y)
    return y
