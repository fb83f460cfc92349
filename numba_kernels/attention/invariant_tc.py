"""Batch-invariant MLA attention on the tensor cores (tf32 mma.sync, fp32 accumulation): invariant.py's contract
(read it first: compacted key order, fixed key ranges a split, empty splits merged away) with the score and value
products as m16n8k8 tf32 mma instead of fp32 FMA, for the bf16 model (issue #19: the FMA kernel's 64 heads x
keys x 1088 products a token bound the verify at large budgets).

A block owns one query token, a head tile of 16 heads (mma rows; heads past h are zero rows, never written) and
one key range (split) of KEYS_PER_SPLIT compacted keys, which it walks in chunks of CHUNK keys. Its warps number
W = WARPS * key_groups (a launch shape field): warp w has score share q = w % WARPS and key group w // WARPS.
  copy:   the chunk's key rows [CHUNK, c + r] go to shared memory by cp.async as they are (fp32 bits; the mma reads
          them as tf32), STAGES chunks in flight; keys past the token's count are zero-filled;
  scores: warp w sums the products of share q's WARPS-th of the K dimensions (k-steps q * KSW .. q * KSW + KSW - 1,
          its q fragments in registers, rounded to tf32 once) for its key group's 1 / key_groups of the chunk's
          keys, accumulating inside the mma; the WARPS partial sums of a score are added in share order (through
          shared memory);
  softmax: an online softmax over the chunk's keys (warp w owns rows w, w + W, ...; lane = key; warp max and sum);
          p rounded to tf32;
  values: warp w owns the latent columns of n-tiles w, w + W, ...: acc = acc * alpha + p @ V, the chunk's k-steps
          accumulated inside the mma in key order.
A row's arithmetic is therefore fixed by WARPS, CHUNK and KEYS_PER_SPLIT (and the mma's own sum): which blocks run,
how many tokens share the launch, which warp computes a score's share or a value column (key_groups) and STAGES
(when the copies land) do not change a bit of it, so s = 1 and s = 257 give a token the same output. Within an
mma k-step lane (g, tq) holds dimensions 2 tq, 2 tq + 1 of the k-step's 8 (logical k tq and tq + 4), in q and
keys alike: one 8-byte shared load is a lane's whole key fragment.
Shared memory: key rows at a stride of KEY_STRIDE words (= 8 mod 32: a warp's fragment loads hit distinct banks
in both products).
Precision: tf32 operands (q and p rounded to nearest; keys as stored, fp32 words the mma takes as tf32: how many
mantissa bits it reads is the hardware's, the simulator's model keeps 10), fp32 sums; against the float64 reference
about 1e-3 of the largest output, the bf16 model's own level (tests/kernels/test_attention_invariant.py).
Shapes: q_lat float32 [s, h, c], q_pe float32 [s, h, r], cache_layer float32 [t, c + r] (C-contiguous, c + r a
multiple of 4), visibility uint32 [s, >= ceil(s/32)], out float32 [s, h, c].
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint32, uint64

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.attention.common import MAX_LATENT, MAX_WIDTH, MERGE_THREADS, merge_splits_kernel
from kdspec.numba_kernels.attention.invariant import invariant_inputs, visible_keys
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.launch import launch
from kdspec.numba_kernels.mma import (MAX_SHARED_BYTES, SIM_SCRATCH_PER_WARP, WARP, copy16, copy_commit, copy_wait,
                                      mma_tf32, opt_in_shared, tf32_bits)
from kdspec.numba_kernels.reductions import FULL_MASK
from kdspec.numba_kernels.runtime import INLINE_DEVICE, ON_SIMULATOR, device_function, row_blocks, scalar_reader, \
    static_for

# The row arithmetic (module docstring): changing any of these changes a row's bits.
WARPS = 2 if ON_SIMULATOR else 4  # the score's K dimensions in WARPS shares, added in share order
CHUNK = 16 if ON_SIMULATOR else 32  # keys a chunk: the online softmax's rescaling points (<= 32: lane = key)
KEYS_PER_SPLIT = 2 * CHUNK if ON_SIMULATOR else 16 * CHUNK  # keys a split (512: bench e2e's B=255 cache in one)
HEAD_TILE = 16  # heads a block (the mma's rows)
K_STEPS = -(-MAX_WIDTH // 8)  # the score's k-steps (8 dimensions each), at most
KSW = -(-K_STEPS // WARPS)  # score k-steps a share
K_DIMS = 8 * KSW * WARPS  # dimensions the score products cover (zeros past c + r)
NT_KEYS = CHUNK // 8  # the score's n-tiles: 8 keys each
KEY_STRIDE = 32 * -(-MAX_WIDTH // 32) + 8  # words a key row in shared memory (= 8 mod 32)
SHARED_ALIGNMENT = None if ON_SIMULATOR else 16  # cp.async's 16-byte copies (the simulator takes no alignment)
ROW_STRIDE = CHUNK + 4  # words a head row of the scores and of p in shared memory (= 4 mod 32 on a GPU)


class TcAttentionConfig(NamedTuple):
    """A launch shape: stages, the chunks in flight (1: a block's copies wait for its products, 2: the next chunk
    lands while this one computes; more shared memory a block), blocks an SM (the register cap) and key groups (the
    warps a score share: 2 halves each warp's work a chunk, for the few blocks of an AR step). It does not change a
    row's bits. The default, one stage, two blocks an SM and one key group, was the fastest at s = 64 and 256 and
    level at s = 1 and 8 (tools/sweeps/attention_invariant.py; BENCHMARKS.md)."""
    stages: int = 1
    blocks_per_sm: int = 2
    key_groups: int = 1

    @property
    def warps(self) -> int:
        return WARPS * self.key_groups

    @property
    def threads(self) -> int:
        return self.warps * WARP

    @property
    def shared_words(self) -> int:
        keys = self.stages * CHUNK * KEY_STRIDE
        return keys + WARPS * HEAD_TILE * ROW_STRIDE + HEAD_TILE * ROW_STRIDE + 3 * HEAD_TILE

    @property
    def shared_bytes(self) -> int:
        return 4 * self.shared_words

    def check(self) -> None:
        """ValueError naming the first broken rule."""
        if self.stages < 1 or self.blocks_per_sm < 1:
            raise ValueError(f"bad TcAttentionConfig {self}: stages and blocks_per_sm >= 1")
        if self.key_groups not in KEY_GROUPS:
            raise ValueError(f"bad TcAttentionConfig {self}: key_groups one of {KEY_GROUPS} (whole n-tiles of a "
                             f"chunk's keys and whole softmax rows a warp)")
        if self.shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(f"bad TcAttentionConfig {self}: {self.shared_bytes} bytes of shared memory a block, "
                             f"more than the {MAX_SHARED_BYTES} an sm_90 block may have")


KEY_GROUPS = tuple(n for n in (1, 2, 4) if NT_KEYS % n == 0 and HEAD_TILE % (WARPS * n) == 0)
DEFAULT_CONFIG = TcAttentionConfig()
# An AR step or a small tree has a few blocks (16 heads each), each walking its chunks one after another: two warps
# a score share halve a warp's work a chunk (at s = 64 and 256 the default is faster; BENCHMARKS.md)
FEW_TOKENS = 8
FEW_TOKENS_CONFIG = TcAttentionConfig(stages=1, blocks_per_sm=1, key_groups=2)


def config_for(tokens: int) -> TcAttentionConfig:
    """The launch shape for a launch of ``tokens`` query tokens (any shape gives a row the same bits)."""
    return FEW_TOKENS_CONFIG if tokens <= FEW_TOKENS else DEFAULT_CONFIG


def supports(latent: int, rope: int) -> bool:
    """Whether the kernel takes c = ``latent``, r = ``rope``: c + r a multiple of 4 (16-byte copies of a key row),
    within MAX_LATENT and MAX_WIDTH."""
    return 0 < latent <= MAX_LATENT and latent + rope <= MAX_WIDTH and (latent + rope) % 4 == 0


@functools.lru_cache(maxsize=None)
def invariant_tc_kernel(config: TcAttentionConfig = DEFAULT_CONFIG, prefix_on_device: bool = False):
    """The kernel for one launch shape and kind of prefix argument (built once each)."""
    STAGES = config.stages
    STAGE_WORDS = CHUNK * KEY_STRIDE
    PART = STAGES * STAGE_WORDS  # partial scores [WARPS, HEAD_TILE, ROW_STRIDE] (float32)
    P_WORDS = PART + WARPS * HEAD_TILE * ROW_STRIDE  # p [HEAD_TILE, ROW_STRIDE] (tf32 bits)
    STATS = P_WORDS + HEAD_TILE * ROW_STRIDE  # alpha, running max, running sum [HEAD_TILE] each (float32)
    ALL_WARPS, THREADS = config.warps, config.threads
    ROWS_A_WARP = HEAD_TILE // ALL_WARPS  # softmax rows a warp
    NT_GROUP = NT_KEYS // config.key_groups  # the score's n-tiles a warp (its key group's)
    NT_VALUE = -(-MAX_LATENT // (8 * ALL_WARPS))  # the value's n-tiles a warp (8 latent columns each)
    SCRATCH = ALL_WARPS * SIM_SCRATCH_PER_WARP if ON_SIMULATOR else 1
    REDUCE = THREADS if ON_SIMULATOR else 1
    Q_REGS, SCORE_REGS, ACC_REGS = 4 * KSW, 4 * NT_GROUP, 4 * NT_VALUE  # register arrays: plain constants
    compile_options = {} if ON_SIMULATOR else dict(launch_bounds=(THREADS, config.blocks_per_sm))
    read_prefix = scalar_reader(prefix_on_device)
    wait_for_chunk = copy_wait(STAGES - 1)  # at most the chunks after this one in flight

    @device_function(inline=True)
    def warp_reduce_rows(values, is_sum, reduce_s):
        """values[j] = the max (is_sum False) or sum of values[j] over the warp, to every lane, for each of the
        warp's ROWS_A_WARP softmax rows: the xor butterfly on a GPU, the rows' shuffles interleaved (independent
        chains); shared memory on the simulator (every thread of the block calls it there)."""
        if ON_SIMULATOR:
            tid = cuda.threadIdx.x
            first = tid - tid % WARP
            for j in range(ROWS_A_WARP):
                reduce_s[tid] = values[j]
                cuda.syncthreads()
                result = reduce_s[first]
                for k in range(1, WARP):
                    other = reduce_s[first + k]
                    result = result + other if is_sum else max(result, other)
                cuda.syncthreads()
                values[j] = result
            return
        for step in range(5):  # offsets 16, 8, 4, 2, 1
            for j in range(ROWS_A_WARP):
                other = cuda.shfl_xor_sync(FULL_MASK, values[j], 16 >> step)
                values[j] = values[j] + other if is_sum else max(values[j], other)

    @device_function(**INLINE_DEVICE)
    def load_q_step(i, args):
        """q_frag[4 i ..] = the tf32 A fragment of this warp's share's k-step i (rows g, g + 8; dimensions 2 tq,
        2 tq + 1)."""
        q_lat, q_pe, token, head0, share, g, tq, q_frag = args
        heads, latent = q_lat.shape[1], q_lat.shape[2]
        width = latent + q_pe.shape[2]
        d = 8 * (share * KSW + i) + 2 * tq
        for half in range(2):
            head = head0 + g + 8 * half
            for u in range(2):
                value = float32(0.0)
                if head < heads and d + u < width:
                    value = q_lat[token, head, d + u] if d + u < latent else q_pe[token, head, d + u - latent]
                q_frag[4 * i + half + 2 * u] = tf32_bits(value)  # a0 (g, 2tq), a1 (g+8, 2tq), a2, a3: + 1

    load_q = static_for(KSW, load_q_step)

    @device_function(**INLINE_DEVICE)
    def score_step(i, args):
        """score[n] += this warp's share's k-step i for its key group's NT_GROUP key tiles (i a constant: q_frag
        stays in registers). key_pairs: the lane's first key pair of the stage (key g of the group's first tile,
        dimensions 2 tq, 2 tq + 1 of the share's first k-step), in 8-byte words."""
        keys64, key_pairs, q_frag, score, scratch = args
        for n in range(NT_GROUP):
            pair = at(keys64, key_pairs + 4 * n * KEY_STRIDE + 4 * i)  # (constants: an immediate offset)
            score[4 * n], score[4 * n + 1], score[4 * n + 2], score[4 * n + 3] = mma_tf32(
                q_frag[4 * i], q_frag[4 * i + 1], q_frag[4 * i + 2], q_frag[4 * i + 3],
                uint32(pair & uint64(0xFFFFFFFF)), uint32(pair >> uint64(32)),
                score[4 * n], score[4 * n + 1], score[4 * n + 2], score[4 * n + 3], scratch)

    score_steps = static_for(KSW, score_step)

    @device_function(**INLINE_DEVICE)
    def value_tile(j, args):
        """acc tile j (latent columns 8 (j W + warp) ..: past c they are rope or pad columns, computed and never
        written) += p @ V over the chunk's k-step whose first V word for this lane is ``values`` (key tq, column g
        of the warp's first tile)."""
        words, values, p_frag, acc, scratch = args
        acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3] = mma_tf32(
            p_frag[0], p_frag[1], p_frag[2], p_frag[3],
            at(words, values + 8 * ALL_WARPS * j), at(words, values + 4 * KEY_STRIDE + 8 * ALL_WARPS * j),
            acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3], scratch)

    value_tiles = static_for(NT_VALUE, value_tile)

    @device_function(**INLINE_DEVICE)
    def value_step(kk, args):
        """The chunk's k-step kk (keys 8 kk ..) of the value product: p's A fragment (a0 (g, tq), a1 (g + 8, tq),
        a2 (g, tq + 4), a3 (g + 8, tq + 4) from the lane's first p word ``p_at``), then every tile of the warp."""
        words, values, p_at, p_frag, acc, scratch = args
        p_frag[0] = at(words, p_at + 8 * kk)
        p_frag[1] = at(words, p_at + 8 * ROW_STRIDE + 8 * kk)
        p_frag[2] = at(words, p_at + 8 * kk + 4)
        p_frag[3] = at(words, p_at + 8 * ROW_STRIDE + 8 * kk + 4)
        value_tiles((words, values + 8 * kk * KEY_STRIDE, p_frag, acc, scratch))

    value_steps = static_for(NT_KEYS, value_step)

    @device_function(**INLINE_DEVICE)
    def rescale_tile(j, args):
        """acc tile j's rows g times alpha_g, rows g + 8 times alpha_g8 (straight-line: acc stays in registers)."""
        acc, alpha_g, alpha_g8 = args
        acc[4 * j] *= alpha_g
        acc[4 * j + 1] *= alpha_g
        acc[4 * j + 2] *= alpha_g8
        acc[4 * j + 3] *= alpha_g8

    rescale_tiles = static_for(NT_VALUE, rescale_tile)

    @device_function(**INLINE_DEVICE)
    def zero_tile(j, args):
        acc, = args
        for e in range(4):
            acc[4 * j + e] = float32(0.0)

    zero_tiles = static_for(NT_VALUE, zero_tile)

    @device_function(**INLINE_DEVICE)
    def store_tile(j, args):
        """target[first + 8 W j + u] = acc tile j's (row, column 2 tq + u) * inv for the lane's columns below c
        (``left``: c minus the lane's first column)."""
        target, first, acc, row, inv, left = args
        for u in range(2):
            if 8 * ALL_WARPS * j + u < left:
                target[first + 8 * ALL_WARPS * j + u] = acc[4 * j + row + u] * inv

    store_tiles = static_for(NT_VALUE, store_tile)

    @device_function(**INLINE_DEVICE)
    def copy_chunk(keys_f, stage, cache, chunk_begin, key_end, prefix_len, token, key_rows, width, warp, lane):
        """Issue the cp.async copies of the chunk's key rows into stage (zero rows past key_end)."""
        for slot in range(warp, CHUNK, ALL_WARPS):
            key = chunk_begin + slot
            row = key
            if key >= key_end:
                row = 0
            elif key >= prefix_len:
                row = prefix_len + key_rows[token, key - prefix_len]
            nbytes = 16 if key < key_end else 0
            for v in range(lane, width // 4, WARP):
                copy16(keys_f, stage + slot * KEY_STRIDE + 4 * v, cache, row * width + 4 * v, nbytes)

    @kernel_cache.jit(fastmath=False, **compile_options)
    def attention_invariant_tc(q_lat, q_pe, cache, prefix_arg, key_rows, key_counts, scale, direct, out, o_part,
                               lse_part):
        """q_lat float32 [s, h, c]; q_pe float32 [s, h, r]; cache float32 flat [t * (c + r)] (rows < P + s read);
        prefix_arg: P (prefix_on_device: int32 [1] holding P); key_rows int32 [s, >= s], key_counts int32 [s]
        (invariant.visible_keys); scale float32. Grid (s * ceil(h / HEAD_TILE), splits), config.threads threads,
        config.shared_bytes of dynamic shared memory. direct: write out (flat [s*h*c]); else o_part (flat
        [splits*s*h*c], normalised; rows seeing nothing in the split not written) and lse_part (flat
        [splits*s*h]: -inf where the row sees nothing in the split)."""
        keys_f = cuda.shared.array(0, float32, alignment=SHARED_ALIGNMENT)  # one dynamic buffer, three views
        words = cuda.shared.array(0, uint32, alignment=SHARED_ALIGNMENT)
        keys64 = cuda.shared.array(0, uint64, alignment=SHARED_ALIGNMENT)
        scratch = cuda.shared.array(SCRATCH, float32)  # the simulator's mma model
        reduce_s = cuda.shared.array(REDUCE, float32)  # the simulator's warp reductions
        q_frag = cuda.local.array(Q_REGS, uint32)
        score = cuda.local.array(SCORE_REGS, float32)
        p_frag = cuda.local.array(4, uint32)
        acc = cuda.local.array(ACC_REGS, float32)
        run_max = cuda.local.array(ROWS_A_WARP, float32)
        run_sum = cuda.local.array(ROWS_A_WARP, float32)
        score_x = cuda.local.array(ROWS_A_WARP, float32)  # this chunk's: the lane's score of each row
        reduced = cuda.local.array(ROWS_A_WARP, float32)  # the rows' warp max, then sum
        alpha_x = cuda.local.array(ROWS_A_WARP, float32)  # each row's rescale factor

        tid = cuda.threadIdx.x
        lane, warp = tid % WARP, tid // WARP
        share, key_group = warp % WARPS, warp // WARPS
        g, tq = lane >> 2, lane & 3
        tokens, heads, latent = q_lat.shape[0], q_lat.shape[1], q_lat.shape[2]
        width = latent + q_pe.shape[2]
        rows = tokens * heads
        head_tiles = (heads + HEAD_TILE - 1) // HEAD_TILE
        token = cuda.blockIdx.x // head_tiles
        head0 = (cuda.blockIdx.x - token * head_tiles) * HEAD_TILE
        split = cuda.blockIdx.y
        prefix_len = read_prefix(prefix_arg)
        key_begin = split * KEYS_PER_SPLIT
        key_end = min(prefix_len + key_counts[token], key_begin + KEYS_PER_SPLIT)
        n_chunks = (max(key_end - key_begin, 0) + CHUNK - 1) // CHUNK
        if n_chunks == 0 and not direct:  # a split past the token's keys (block-uniform): -inf, merged away
            if tid < HEAD_TILE and head0 + tid < heads:
                lse_part[split * rows + token * heads + head0 + tid] = float32(-math.inf)
            return
        first_key = 8 * NT_GROUP * key_group  # the key group's first key of a chunk
        score_lane = (first_key + g) * KEY_STRIDE + 8 * KSW * share + 2 * tq  # (even) its first key word in a stage
        value_lane = tq * KEY_STRIDE + 8 * warp + g  # its first V word
        part_lane = PART + (share * HEAD_TILE + g) * ROW_STRIDE + first_key + 2 * tq  # its first partial score

        # dimensions past c + r up to the warps' whole k-steps: zeros, never copied over (the products of q's zeros
        # with them must be 0, not NaN)
        for e in range(tid, STAGES * CHUNK, THREADS):
            for d in range(width, K_DIMS):
                at_put(words, e * KEY_STRIDE + d, uint32(0))
        load_q((q_lat, q_pe, token, head0, share, g, tq, q_frag))
        zero_tiles((acc,))
        for j in range(ROWS_A_WARP):
            run_max[j] = -math.inf
            run_sum[j] = float32(0.0)
        for s in range(STAGES - 1):  # prologue: the first STAGES - 1 chunks in flight
            if s < n_chunks:
                copy_chunk(keys_f, s * STAGE_WORDS, cache, key_begin + s * CHUNK, key_end, prefix_len, token,
                           key_rows, width, warp, lane)
            copy_commit()

        for chunk in range(n_chunks):
            ahead = chunk + STAGES - 1
            if ahead < n_chunks:
                copy_chunk(keys_f, (ahead % STAGES) * STAGE_WORDS, cache, key_begin + ahead * CHUNK, key_end,
                           prefix_len, token, key_rows, width, warp, lane)
            copy_commit()
            wait_for_chunk()  # this thread's copies of this chunk landed
            cuda.syncthreads()  # everyone's landed
            stage = (chunk % STAGES) * STAGE_WORDS
            chunk_begin = key_begin + chunk * CHUNK
            # ---- scores: this warp's K share for its key group's keys
            for e in range(4 * NT_GROUP):
                score[e] = float32(0.0)
            score_steps((keys64, (stage + score_lane) >> 1, q_frag, score, scratch))
            for n in range(NT_GROUP):  # c0 (g, 2tq), c1 (g, 2tq + 1), c2 (g + 8, 2tq), c3 (g + 8, 2tq + 1)
                for e in range(4):
                    at_put(keys_f, part_lane + 8 * ROW_STRIDE * (e // 2) + 8 * n + e % 2, score[4 * n + e])
            cuda.syncthreads()  # partial scores stored
            # ---- online softmax: warp w owns rows w + W j, lane = key
            live_key = lane < CHUNK and chunk_begin + lane < key_end
            for j in range(ROWS_A_WARP):  # the scores: the shares' partial sums added in share order
                row = warp + ALL_WARPS * j
                x = float32(-math.inf)
                if live_key:
                    total = at(keys_f, PART + row * ROW_STRIDE + lane)
                    for w in range(1, WARPS):
                        total += at(keys_f, PART + (w * HEAD_TILE + row) * ROW_STRIDE + lane)
                    x = total * scale
                score_x[j] = x
                reduced[j] = x
            warp_reduce_rows(reduced, False, reduce_s)  # the chunk's max of each row
            for j in range(ROWS_A_WARP):
                new_max = max(run_max[j], reduced[j])
                p = math.exp(score_x[j] - new_max) if score_x[j] != -math.inf else float32(0.0)
                # nothing visible yet: alpha 1 (exp(-inf - -inf) would be NaN); 0 when the first keys arrive
                alpha_x[j] = math.exp(run_max[j] - new_max) if new_max != -math.inf else float32(1.0)
                run_max[j] = new_max
                reduced[j] = p
                row = warp + ALL_WARPS * j
                if lane < CHUNK:
                    at_put(words, P_WORDS + row * ROW_STRIDE + lane, tf32_bits(p))
                if lane == 0:
                    at_put(keys_f, STATS + row, alpha_x[j])
            warp_reduce_rows(reduced, True, reduce_s)  # the chunk's sum of each row's p
            for j in range(ROWS_A_WARP):
                run_sum[j] = run_sum[j] * alpha_x[j] + reduced[j]
            cuda.syncthreads()  # p and alpha stored
            # ---- values: acc = acc * alpha + p @ V (rows g, g + 8)
            rescale_tiles((acc, at(keys_f, STATS + g), at(keys_f, STATS + g + 8)))
            value_steps((words, stage + value_lane, P_WORDS + g * ROW_STRIDE + tq, p_frag, acc, scratch))
            cuda.syncthreads()  # done with this stage, p and alpha before they are refilled

        # ---- write-out: the softmax owners publish max / sum, each warp divides its columns
        for j in range(ROWS_A_WARP):
            if lane == 0:
                at_put(keys_f, STATS + HEAD_TILE + warp + ALL_WARPS * j, run_max[j])
                at_put(keys_f, STATS + 2 * HEAD_TILE + warp + ALL_WARPS * j, run_sum[j])
        cuda.syncthreads()
        for half in range(2):
            head = head0 + g + 8 * half
            total = at(keys_f, STATS + 2 * HEAD_TILE + g + 8 * half)
            if head < heads and (direct or total > 0):
                # no visible key: NaN when final (the query saw nothing)
                inv = float32(1.0) / total if total > 0 else float32(math.nan)
                row_index = token * heads + head
                base = row_index * latent if direct else (split * rows + row_index) * latent
                first = base + 8 * warp + 2 * tq
                if direct:
                    store_tiles((out, first, acc, 2 * half, inv, latent - 8 * warp - 2 * tq))
                else:
                    store_tiles((o_part, first, acc, 2 * half, inv, latent - 8 * warp - 2 * tq))
        if not direct and tid < HEAD_TILE and head0 + tid < heads:
            total = at(keys_f, STATS + 2 * HEAD_TILE + tid)
            lse_part[split * rows + token * heads + head0 + tid] = \
                at(keys_f, STATS + HEAD_TILE + tid) + math.log(total) if total > 0 else float32(-math.inf)

    return attention_invariant_tc


def mla_attention_invariant_tc(q_lat, q_pe, cache_layer, prefix_len, visibility, scale: float, keys=None, out=None,
                               stream=0, config: TcAttentionConfig | None = None):
    """o_lat float32 [s, h, c] (device), batch-invariant on the tensor cores (module docstring). Arguments as
    invariant.mla_attention_invariant (prefix_len an int or an int32 [1] device array; ``keys``: the VisibleKeys
    of this visibility, computed here when None); ``config``: a launch shape (None: config_for the token count;
    any shape gives the same bits)."""
    if config is not None:
        config.check()
    on_device, total_keys, (q_lat, q_pe, cache_layer, visibility, out) = invariant_inputs(
        q_lat, q_pe, cache_layer, prefix_len, visibility, out, stream)
    tokens, heads, latent = q_lat.shape
    config = config_for(tokens) if config is None else config
    if tokens * heads == 0 or latent == 0:
        return out
    if not supports(latent, q_pe.shape[2]):
        raise ValueError(f"c + r = {latent + q_pe.shape[2]}: the tensor-core attention copies key rows in 16-byte "
                         "pieces (c + r a multiple of 4)")
    if keys is None:
        keys = visible_keys(visibility, tokens, stream=stream)
    splits = -(-total_keys // KEYS_PER_SPLIT)
    kernel = invariant_tc_kernel(config, on_device)
    grid = (tokens * -(-heads // HEAD_TILE), splits)
    cache_flat = cache_layer.reshape(cache_layer.size)
    flat_out = out.reshape(out.size)
    if splits == 1:  # the output stands in for the unused partials
        args = (q_lat, q_pe, cache_flat, prefix_len, keys.rows, keys.counts, np.float32(scale), True, flat_out,
                flat_out, flat_out)
    else:
        o_part = cuda.device_array((splits, tokens, heads, latent), dtype=np.float32, stream=stream)
        lse_part = cuda.device_array((splits, tokens, heads), dtype=np.float32, stream=stream)
        args = (q_lat, q_pe, cache_flat, prefix_len, keys.rows, keys.counts, np.float32(scale), False, flat_out,
                o_part.reshape(o_part.size), lse_part.reshape(lse_part.size))
    opt_in_shared(kernel, args, config.shared_bytes)
    launch(kernel, grid, config.threads, stream, *args, shared_bytes=config.shared_bytes)
    if splits > 1:
        launch(merge_splits_kernel, row_blocks(tokens * heads), MERGE_THREADS, stream, o_part, lse_part, splits, out)
    return out
