"""Routed experts of a MoE layer as one grouped launch: y[s, d] = sum_i w_i * down_e(silu(gate_e x) * up_e x).

Four small kernels, no Python loop over experts, nothing copied back to the host:
1. ``_plan_pairs`` (one block): counting sort of the s*k (token, slot) pairs by expert -> expert_offsets [e+1],
   sorted_pairs [P] (pair p = token*k + slot, ascending within each expert), active_experts (ascending).
2. ``gate_up`` (grid: f row tiles x active experts): act[row, f] = silu(gate x) * up x for every pair of the
   expert, so each expert's gate/up rows are read once per launch for all its tokens.
3. ``down`` (grid: d row tiles x active experts): per-pair outputs pair_out[P, d] = down_e(act[row]).
4. ``_combine_slots``: y[t] = (y[t] if accumulate) + sum over slots, in slot order, of w[t, slot] * pair_out.
   No float atomics: the result does not depend on scheduling.

Each warp owns a few weight rows; its lanes stride over the row two columns at a time (one 32-bit word of
bf16 weights), hold partial sums for a chunk of TOKENS_PER_PASS tokens, and reduce them across the warp
(shuffles on a GPU, shared memory under the simulator, which has no shuffles).

Weights: fp32, or bf16 stored as uint16/int16 bit patterns, widened in the kernel (bits << 16 as fp32).
Stacked layouts: w_gate_up [e, 2f, d] (f gate rows, then f up rows, per expert), w_down [e, d, f].
Every launcher takes numba device arrays, __cuda_array_interface__ objects (torch tensors; bf16 ones viewed
as int16), or numpy arrays (copied; what the simulator tests use).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32

from .device_arrays import as_device_array as as_device
from .warp import ON_SIMULATOR, USE_SHUFFLE, WARP_SIZE, _warp_sum, row_blocks

# Launch shapes. The simulator runs every thread as Python: fewer warps per block keeps it quick.
WARPS_PER_BLOCK = 1 if ON_SIMULATOR else 8
# A "warp" of LANES threads shares each weight row. The simulator has no shuffles (the reduction goes through
# shared memory), runs every thread in Python and pays a fixed cost per block (it polls its threads), so there
# a narrower group with many rows per group means few, small blocks; on a GPU LANES is the hardware warp.
LANES = 4 if ON_SIMULATOR else WARP_SIZE
FFN_THREADS = WARPS_PER_BLOCK * LANES
GATE_ROWS_PER_WARP = 32 if ON_SIMULATOR else 2   # intermediate rows per warp (each a gate row and an up row)
DOWN_ROWS_PER_WARP = 64 if ON_SIMULATOR else 4   # output rows per warp
TOKENS_PER_PASS = 1 if ON_SIMULATOR else 4  # tokens sharing one read of a weight row (register-blocked;
#                                             the simulator pays for every padded token in Python)
GATE_ACC = 2 * GATE_ROWS_PER_WARP
SCRATCH_THREADS = FFN_THREADS if ON_SIMULATOR else 1  # warp-sum scratch: only the simulator needs it
PLAN_THREADS = 8 if ON_SIMULATOR else 1024
COMBINE_THREADS = 32 if ON_SIMULATOR else 256


# ------------------------------------------------------------------------------------ device helpers
# Small helpers are inlined into the kernels so their local arrays can live in registers (the simulator's
# jit has no such option).
INLINE_DEVICE = dict(device=True) if ON_SIMULATOR else dict(device=True, forceinline=True)

if ON_SIMULATOR:
    def _bits_as_float(bits):
        return np.array([int(bits) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]
else:
    from numba.cuda import libdevice

    @cuda.jit(**INLINE_DEVICE)
    def _bits_as_float(bits):
        return libdevice.int_as_float(int32(bits))


@cuda.jit(**INLINE_DEVICE)
def load_pair_f32(w, expert, row, word):
    """Columns 2*word and 2*word+1 of row ``row`` of expert ``expert``; w float32 [e, rows, cols]."""
    return w[expert, row, 2 * word], w[expert, row, 2 * word + 1]


@cuda.jit(**INLINE_DEVICE)
def load_pair_bf16(w, expert, row, word):
    """The same two columns from bf16 bits packed in pairs; w uint32 [e, rows, cols/2] (low half first)."""
    bits = w[expert, row, word]
    return _bits_as_float(bits << 16), _bits_as_float(bits & 0xFFFF0000)


@cuda.jit(**INLINE_DEVICE)
def silu(v):
    return v / (float32(1.0) + math.exp(-v))


@cuda.jit(**INLINE_DEVICE)
def reduce_to_lane0(acc, scratch):
    """acc[i, t] <- its sum over the warp, valid in lane 0 (other lanes: unspecified). acc: local float32
    [I, T]. Every thread of the block must call it: the simulator path (no shuffles) synchronises the block
    through scratch, shared float32 [I, T, blockDim.x] (on a GPU it is unused and may be [I, T, 1])."""
    if USE_SHUFFLE:
        for i in range(acc.shape[0]):
            for t in range(acc.shape[1]):
                acc[i, t] = _warp_sum(acc[i, t])
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


# ----------------------------------------------------------------------------------- host helpers
def check_array(array, name, shape, dtypes):
    """Raise a one-line ValueError unless ``array`` has ``shape`` (None = any size) and one of ``dtypes``."""
    dtype = np.dtype(array.dtype)
    if dtype not in [np.dtype(t) for t in dtypes]:
        allowed = "/".join(np.dtype(t).name for t in dtypes)
        raise ValueError(f"{name}: dtype {dtype.name}, expected {allowed}")
    if len(array.shape) != len(shape) or any(w is not None and a != w for a, w in zip(array.shape, shape)):
        raise ValueError(f"{name}: shape {tuple(array.shape)}, expected {tuple('?' if w is None else w for w in shape)}")


def weight_view(w, name):
    """(kernel view, is_bf16) of a 3-D weight: fp32 as is; uint16/int16 bf16 bits viewed as uint32 pairs."""
    dtype = np.dtype(w.dtype)
    if dtype == np.float32:
        return w, False
    if dtype in (np.dtype(np.uint16), np.dtype(np.int16)):
        return w.view(np.uint32), True
    raise ValueError(f"{name}: dtype {dtype.name}, expected float32 or bf16 bits as uint16/int16")


def output(out, name, shape, stream):
    """The caller's ``out`` checked (float32, ``shape``), or a new device array."""
    if out is None:
        return cuda.device_array(shape, dtype=np.float32, stream=stream)
    out = as_device(out, name)
    check_array(out, name, shape, [np.float32])
    return out


# --------------------------------------------------------------------------------------- kernels
@cuda.jit
def _plan_pairs(expert_ids, n_experts, expert_counts, expert_offsets, sorted_pairs, active_experts, n_active):
    """Counting sort of the pairs by expert; one block. expert_ids int32 [s, k] -> expert_offsets [e+1],
    sorted_pairs [P] (ascending within an expert), active_experts [min(e, P)] ascending, n_active [1].
    expert_counts [e] is scratch (ends as the placement cursors). Out-of-range ids are left out."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    k = expert_ids.shape[1]
    n_pairs = expert_ids.shape[0] * k
    scan_pairs = cuda.shared.array(PLAN_THREADS, int32)
    scan_active = cuda.shared.array(PLAN_THREADS, int32)
    for j in range(tid, n_experts, width):
        expert_counts[j] = 0
    cuda.syncthreads()  # counts zeroed before any pair adds to them
    for p in range(tid, n_pairs, width):
        expert = expert_ids[p // k, p % k]
        if 0 <= expert < n_experts:
            cuda.atomic.add(expert_counts, expert, 1)
    cuda.syncthreads()  # every count is final
    # Each thread owns a contiguous chunk of experts; a scan over the threads' chunk totals gives offsets.
    chunk = (n_experts + width - 1) // width
    first = tid * chunk
    last = min(first + chunk, n_experts)
    own_pairs = 0
    own_active = 0
    for j in range(first, last):
        own_pairs += expert_counts[j]
        own_active += 1 if expert_counts[j] > 0 else 0
    scan_pairs[tid] = own_pairs
    scan_active[tid] = own_active
    cuda.syncthreads()  # chunk totals stored before the scan reads them
    stride = 1
    while stride < width:  # Hillis-Steele inclusive scan
        add_pairs = scan_pairs[tid - stride] if tid >= stride else 0
        add_active = scan_active[tid - stride] if tid >= stride else 0
        cuda.syncthreads()  # all reads of this level done before the writes
        scan_pairs[tid] += add_pairs
        scan_active[tid] += add_active
        cuda.syncthreads()  # this level's sums visible to the next
        stride *= 2
    offset = scan_pairs[tid] - own_pairs
    active = scan_active[tid] - own_active
    for j in range(first, last):
        count = expert_counts[j]
        expert_offsets[j] = offset
        expert_counts[j] = offset  # from here on: the next free slot of expert j
        if count > 0:
            active_experts[active] = j
            active += 1
        offset += count
    if tid == width - 1:
        expert_offsets[n_experts] = scan_pairs[tid]
        n_active[0] = scan_active[tid]
    cuda.syncthreads()  # cursors set before placement
    for p in range(tid, n_pairs, width):
        expert = expert_ids[p // k, p % k]
        if 0 <= expert < n_experts:
            sorted_pairs[cuda.atomic.add(expert_counts, expert, 1)] = p
    cuda.syncthreads()  # all pairs placed before the per-expert sorts read them
    # Atomics placed them in any order: insertion-sort each expert's (short) segment for a fixed layout.
    for a in range(tid, scan_active[width - 1], width):
        expert = active_experts[a]
        begin = expert_offsets[expert]
        for i in range(begin + 1, expert_offsets[expert + 1]):
            pair = sorted_pairs[i]
            j = i - 1
            while j >= begin and sorted_pairs[j] > pair:
                sorted_pairs[j + 1] = sorted_pairs[j]
                j -= 1
            sorted_pairs[j + 1] = pair


def _make_gate_up(load_pair):
    @cuda.jit
    def gate_up(x, w_gate_up, n_words, f, k, expert_offsets, sorted_pairs, active_experts, n_active, act):
        """act[row, i] = silu(gate_i . x_t) * (up_i . x_t) for sorted row ``row`` (pair sorted_pairs[row],
        token t = pair // k). x float32 [s, d]; w_gate_up [e, 2f, d] (see load_pair); act float32 [P, f].
        Grid: (ceil(f / rows per block), row_blocks(max active experts)), grid-stride over active experts."""
        scratch = cuda.shared.array((GATE_ACC, TOKENS_PER_PASS, SCRATCH_THREADS), float32)
        lane = cuda.threadIdx.x % LANES
        first_row = (cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // LANES) * GATE_ROWS_PER_WARP
        # weight rows of this warp: its gate rows, then the matching up rows (f further down)
        rows = cuda.local.array(GATE_ACC, int32)
        for r in range(GATE_ROWS_PER_WARP):
            row = min(first_row + r, f - 1)  # past f: recompute the last row, never store it
            rows[r] = row
            rows[GATE_ROWS_PER_WARP + r] = f + row
        tokens = cuda.local.array(TOKENS_PER_PASS, int32)
        acc = cuda.local.array((GATE_ACC, TOKENS_PER_PASS), float32)
        w_lo = cuda.local.array(GATE_ACC, float32)
        w_hi = cuda.local.array(GATE_ACC, float32)
        for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform (syncs inside)
            expert = active_experts[active]
            begin = expert_offsets[expert]
            end = expert_offsets[expert + 1]
            for chunk in range(begin, end, TOKENS_PER_PASS):
                n_tokens = min(TOKENS_PER_PASS, end - chunk)
                for t in range(TOKENS_PER_PASS):  # short chunks repeat their last token: no divergent loops
                    tokens[t] = sorted_pairs[chunk + min(t, n_tokens - 1)] // k
                    for r in range(GATE_ACC):
                        acc[r, t] = 0.0
                for word in range(lane, n_words, LANES):
                    for r in range(GATE_ACC):
                        w_lo[r], w_hi[r] = load_pair(w_gate_up, expert, rows[r], word)
                    for t in range(TOKENS_PER_PASS):
                        x_lo = x[tokens[t], 2 * word]
                        x_hi = x[tokens[t], 2 * word + 1]
                        for r in range(GATE_ACC):
                            acc[r, t] += w_lo[r] * x_lo + w_hi[r] * x_hi
                reduce_to_lane0(acc, scratch)
                if lane == 0:
                    for t in range(TOKENS_PER_PASS):  # constant trip counts keep acc in registers
                        for r in range(GATE_ROWS_PER_WARP):
                            if t < n_tokens and first_row + r < f:
                                up = acc[GATE_ROWS_PER_WARP + r, t]
                                act[chunk + t, first_row + r] = silu(acc[r, t]) * up
    return gate_up


def _make_down(load_pair):
    @cuda.jit
    def down(act, w_down, n_words, expert_offsets, sorted_pairs, active_experts, n_active, pair_out):
        """pair_out[pair, j] = down_j . act[row] for sorted row ``row`` (pair = sorted_pairs[row]).
        act float32 [P, f]; w_down [e, d, f] (see load_pair); pair_out float32 [P, d].
        Grid: (ceil(d / rows per block), row_blocks(max active experts)), grid-stride over active experts."""
        scratch = cuda.shared.array((DOWN_ROWS_PER_WARP, TOKENS_PER_PASS, SCRATCH_THREADS), float32)
        d = pair_out.shape[1]
        lane = cuda.threadIdx.x % LANES
        first_row = (cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // LANES) * DOWN_ROWS_PER_WARP
        rows = cuda.local.array(DOWN_ROWS_PER_WARP, int32)
        for r in range(DOWN_ROWS_PER_WARP):
            rows[r] = min(first_row + r, d - 1)  # past d: recompute the last row, never store it
        act_rows = cuda.local.array(TOKENS_PER_PASS, int32)
        acc = cuda.local.array((DOWN_ROWS_PER_WARP, TOKENS_PER_PASS), float32)
        w_lo = cuda.local.array(DOWN_ROWS_PER_WARP, float32)
        w_hi = cuda.local.array(DOWN_ROWS_PER_WARP, float32)
        for active in range(cuda.blockIdx.y, n_active[0], cuda.gridDim.y):  # block-uniform (syncs inside)
            expert = active_experts[active]
            begin = expert_offsets[expert]
            end = expert_offsets[expert + 1]
            for chunk in range(begin, end, TOKENS_PER_PASS):
                n_tokens = min(TOKENS_PER_PASS, end - chunk)
                for t in range(TOKENS_PER_PASS):
                    act_rows[t] = chunk + min(t, n_tokens - 1)
                    for r in range(DOWN_ROWS_PER_WARP):
                        acc[r, t] = 0.0
                for word in range(lane, n_words, LANES):
                    for r in range(DOWN_ROWS_PER_WARP):
                        w_lo[r], w_hi[r] = load_pair(w_down, expert, rows[r], word)
                    for t in range(TOKENS_PER_PASS):
                        a_lo = act[act_rows[t], 2 * word]
                        a_hi = act[act_rows[t], 2 * word + 1]
                        for r in range(DOWN_ROWS_PER_WARP):
                            acc[r, t] += w_lo[r] * a_lo + w_hi[r] * a_hi
                reduce_to_lane0(acc, scratch)
                if lane == 0:
                    for t in range(TOKENS_PER_PASS):  # constant trip counts keep acc in registers
                        pair = sorted_pairs[act_rows[t]]
                        for r in range(DOWN_ROWS_PER_WARP):
                            if t < n_tokens and first_row + r < d:
                                pair_out[pair, first_row + r] = acc[r, t]
    return down


gate_up_f32 = _make_gate_up(load_pair_f32)
gate_up_bf16 = _make_gate_up(load_pair_bf16)
down_f32 = _make_down(load_pair_f32)
down_bf16 = _make_down(load_pair_bf16)


@cuda.jit
def _combine_slots(pair_out, expert_ids, expert_weights, n_experts, accumulate, y):
    """y[t, j] = (y[t, j] if accumulate else 0) + sum_slot w[t, slot] * pair_out[t*k + slot, j], slots in
    order; slots with an out-of-range expert id add nothing. Grid: (ceil(d / threads), row_blocks(s)),
    grid-stride over tokens."""
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j >= y.shape[1]:
        return
    k = expert_ids.shape[1]
    for t in range(cuda.blockIdx.y, y.shape[0], cuda.gridDim.y):
        total = float32(0.0)
        for slot in range(k):
            expert = expert_ids[t, slot]
            if 0 <= expert < n_experts:
                total += expert_weights[t, slot] * pair_out[t * k + slot, j]
        if accumulate:
            total = y[t, j] + total
        y[t, j] = total


# ---------------------------------------------------------------------------------------- launchers
@dataclass
class ExpertPlan:
    """Device buffers of one grouped launch (pairs sorted by expert); reusable across calls of one s*k."""

    expert_counts: object     # int32 [e]
    expert_offsets: object    # int32 [e+1]
    sorted_pairs: object      # int32 [P]
    active_experts: object    # int32 [min(e, P)]
    n_active: object          # int32 [1]

    @classmethod
    def allocate(cls, n_experts: int, n_pairs: int, stream=0) -> "ExpertPlan":
        alloc = lambda n: cuda.device_array(n, dtype=np.int32, stream=stream)  # noqa: E731
        return cls(alloc(n_experts), alloc(n_experts + 1), alloc(n_pairs), alloc(min(n_experts, n_pairs)),
                   alloc(1))


def plan_pairs(expert_ids, n_experts: int, plan: ExpertPlan | None = None, stream=0) -> ExpertPlan:
    """Sort the (token, slot) pairs of expert_ids int32 [s, k] by expert, on the device."""
    expert_ids = as_device(expert_ids, "expert_ids")
    check_array(expert_ids, "expert_ids", (None, None), [np.int32])
    n_pairs = expert_ids.shape[0] * expert_ids.shape[1]
    if plan is None:
        plan = ExpertPlan.allocate(n_experts, n_pairs, stream)
    elif plan.sorted_pairs.shape[0] != n_pairs or plan.expert_counts.shape[0] != n_experts:
        raise ValueError(f"plan: sized for {plan.sorted_pairs.shape[0]} pairs of {plan.expert_counts.shape[0]} "
                         f"experts, need {n_pairs} of {n_experts}")
    _plan_pairs[1, PLAN_THREADS, stream](expert_ids, n_experts, plan.expert_counts, plan.expert_offsets,
                                         plan.sorted_pairs, plan.active_experts, plan.n_active)
    return plan


def grouped_swiglu(x, k, plan: ExpertPlan, w_gate_up, w_down, act, pair_out, stream=0):
    """pair_out[p] = down_e(silu(gate_e x_t) * up_e x_t) for every planned pair p = t*k + slot of expert e.
    Arguments already checked: x float32 [s, d]; weight views from weight_view; act float32 [P, f];
    pair_out float32 [P, d]."""
    w_gate_up, gate_is_bf16 = w_gate_up
    w_down, down_is_bf16 = w_down
    f = act.shape[1]
    d = x.shape[1]
    max_active = plan.active_experts.shape[0]
    if max_active == 0:
        return
    rows_per_block = WARPS_PER_BLOCK * GATE_ROWS_PER_WARP
    gate_up = gate_up_bf16 if gate_is_bf16 else gate_up_f32
    gate_up[(math.ceil(f / rows_per_block), row_blocks(max_active)), FFN_THREADS, stream](
        x, w_gate_up, d // 2, f, k, plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active,
        act)
    rows_per_block = WARPS_PER_BLOCK * DOWN_ROWS_PER_WARP
    down = down_bf16 if down_is_bf16 else down_f32
    down[(math.ceil(d / rows_per_block), row_blocks(max_active)), FFN_THREADS, stream](
        act, w_down, f // 2, plan.expert_offsets, plan.sorted_pairs, plan.active_experts, plan.n_active,
        pair_out)


def moe_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, out=None, accumulate=False,
                plan=None, stream=0):
    """Routed-expert FFN of a MoE layer, one grouped launch over all (token, expert) pairs.

    x float32 [s, d]; expert_ids int32 [s, k]; expert_weights float32 [s, k];
    w_gate_up [e, 2f, d] and w_down [e, d, f], float32 or bf16 bits (uint16/int16); d and f even.
    Returns y float32 [s, d] = sum_i w_i * down_e(silu(gate_e x) * up_e x); with accumulate=True the sum is
    added to ``out`` (e.g. holding the shared expert's output). ``plan``: an ExpertPlan to reuse.
    """
    x = as_device(x, "x")
    check_array(x, "x", (None, None), [np.float32])
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
    plan = plan_pairs(expert_ids, e, plan, stream)
    act = cuda.device_array((s * k, f), dtype=np.float32, stream=stream)
    pair_out = cuda.device_array((s * k, d), dtype=np.float32, stream=stream)
    grouped_swiglu(x, k, plan, gate_view, down_view, act, pair_out, stream)
    _combine_slots[(math.ceil(d / COMBINE_THREADS), row_blocks(s)), COMBINE_THREADS, stream](
        pair_out, expert_ids, expert_weights, e, accumulate, y)
    return y
