"""Batched best-first DDTree build: one warp per request, bit-exact to engine.golden.ddtree.build_tree.

The build is sequential (each pop decides what is pushed next), so the warp parallelises each pop instead:
the frontier (candidates: the next sibling and the first child of every popped node) is an unsorted array in
shared memory, and a pop is a warp-wide argmax over it. A candidate's score is kept as an int32 key ordered
like the float (so one `redux.sync.max` finds the top score); each lane scans its strided slots comparing keys
only, and the exact order of the reference (higher score, then the smaller rank tuple) is applied only when
the top key is tied. The popped slot is refilled in place by the 0-2 new candidates (or the last entry), so
the array never needs sorting. After the build all lanes write the flat outputs and the visibility bitmask.
Dimension letters: b requests, L drafted depths, K drafter top-K, B budget (non-root nodes), W = ceil((B+1)/32).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from numba import cuda, float32, int32, uint32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as to_device
from kdspec.numba_kernels.intrinsics import at, at_put
from kdspec.numba_kernels.reductions import FULL_MASK, USE_SHUFFLE, WARP_SIZE
from kdspec.numba_kernels.runtime import ON_SIMULATOR, SHARED_LIMIT, device_function

MAX_BUDGET = 1024
MAX_NODES = MAX_BUDGET + 1
MAX_WORDS = (MAX_NODES + 31) // 32
SHARED_BYTES = SHARED_LIMIT - 256  # static shared memory per block, a little kept free
# A node's (or candidate's) rank and depth are both < MAX_NODES (a rank-r node needs its r elder siblings
# popped, a depth-d node its d ancestors), so they share one int32: rank << 16 | depth.
RANK_SHIFT = 16
DEPTH_MASK = 0xFFFF
# Keys of frontier slots past the end: below the key of every float score (-inf's key is -2139095041), so the
# scan reads whole chunks without bounds checks and a padding slot never ties with a candidate.
PAD_KEY = -2**31
# Rows of TreeBatch.packed (one int32 [6, b, B+1] buffer: one kernel argument instead of six).
OUTPUT_ROWS = ("tokens", "parents", "depths", "ranks", "scores", "positions")
TOKENS, PARENTS, DEPTHS, RANKS, SCORES, POSITIONS = range(6)
# One warp per request on a GPU (the warp votes assume exactly one full warp per block). The simulator has no
# warp votes and runs every thread as a Python thread, each barrier costing ~0.3 ms: one lane there by
# default (no barriers); tests also launch a few lanes, which reduce through shared memory.
BUILD_THREADS = 1 if ON_SIMULATOR else WARP_SIZE

# float_key(x) / key_float(k): the int32 key of a float32 (same order as the floats, -0.0 aside: scores are
# never -0.0) and back. warp_max(v): int32 max over the full warp (redux.sync, sm_80+).
if ON_SIMULATOR:
    def float_key(value):
        bits = int(np.float32(value).view(np.int32))
        return np.int32(bits ^ 0x7FFFFFFF if bits < 0 else bits)

    def key_float(key):
        bits = int(key)
        return np.int32(bits ^ 0x7FFFFFFF if bits < 0 else bits).view(np.float32)

    def warp_max(value):
        raise NotImplementedError("no warp reductions on the simulator")
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _bits(typingctx, value):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.int32(types.float32), codegen

    @intrinsic
    def _float(typingctx, bits):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

    @intrinsic
    def warp_max(typingctx, value):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            redux = ir.InlineAsm(fnty, "redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r", side_effect=True)
            return builder.call(redux, [args[0]])
        return types.int32(types.int32), codegen

    @device_function(inline=True)
    def float_key(value):
        bits = _bits(value)
        return int32(bits ^ int32(int32(bits >> int32(31)) & int32(0x7FFFFFFF)))

    @device_function(inline=True)
    def key_float(key):
        return _float(int32(key ^ int32(int32(key >> int32(31)) & int32(0x7FFFFFFF))))


@device_function()
def _path_less(parent_a, rd_a, parent_b, rd_b, node_parent, node_rd):
    """True when candidate a's rank tuple (path of parent_a, then a's rank) is lexicographically smaller than
    b's. A candidate is (parent node, rank << 16 | depth). Only called on exact score ties."""
    rank_a = rd_a >> RANK_SHIFT
    rank_b = rd_b >> RANK_SHIFT
    depth_a = rd_a & DEPTH_MASK
    depth_b = rd_b & DEPTH_MASK
    lifted_a = depth_a
    lifted_b = depth_b
    while lifted_a > lifted_b:  # lift a to b's depth; (parent, rank) then names a's ancestor
        rank_a = at(node_rd, parent_a) >> RANK_SHIFT
        parent_a = at(node_parent, parent_a)
        lifted_a -= 1
    while lifted_b > lifted_a:
        rank_b = at(node_rd, parent_b) >> RANK_SHIFT
        parent_b = at(node_parent, parent_b)
        lifted_b -= 1
    if parent_a == parent_b and rank_a == rank_b:
        return depth_a < depth_b  # one path is a prefix of the other: the shorter is smaller
    while parent_a != parent_b:  # climb to the common ancestor; the ranks below it decide
        rank_a = at(node_rd, parent_a) >> RANK_SHIFT
        parent_a = at(node_parent, parent_a)
        rank_b = at(node_rd, parent_b) >> RANK_SHIFT
        parent_b = at(node_parent, parent_b)
    return rank_a < rank_b


@device_function()
def _slot_less(slot_a, slot_b, front_parent, front_rd, node_parent, node_rd):
    """Frontier slot a pops before slot b, both >= 0 with the same score: the smaller rank tuple."""
    return _path_less(at(front_parent, slot_a), at(front_rd, slot_a), at(front_parent, slot_b),
                      at(front_rd, slot_b), node_parent, node_rd)


@device_function()
def _lane_exact(lane, lanes, size, top, front_key, front_parent, front_rd, node_parent, node_rd):
    """The first in pop order of this lane's slots holding key `top` (-1 if none): the tie path."""
    best = int32(-1)
    slot = int32(lane)
    while slot < size:
        if at(front_key, slot) == top and (best < 0 or _slot_less(slot, best, front_parent, front_rd, node_parent,
                                                              node_rd)):
            best = slot
        slot += lanes
    return best


@device_function(inline=True)
def _lanes_sync():
    """Barrier of the lanes of one request: the warp on a GPU, the (one-request) block on the simulator."""
    if USE_SHUFFLE:
        cuda.syncwarp()
    elif cuda.blockDim.x > 1:  # a simulator barrier costs ~0.3 ms even for one thread
        cuda.syncthreads()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def shared_layout(scan_unroll: int) -> tuple[int, int]:
    """(frontier slots, log-prob cache floats) of a kernel variant: the frontier holds MAX_NODES candidates
    (after the build, WARP_SIZE bitmask rows of MAX_WORDS words) padded to whole scan chunks; the log-prob
    cache takes the rest of the static shared memory (4 frontier + 3 node arrays of 4 bytes, 3 x 32 scratch)."""
    slots = _round_up(max(MAX_NODES, WARP_SIZE * MAX_WORDS), WARP_SIZE * scan_unroll)
    free = SHARED_BYTES - 4 * (4 * slots + 3 * MAX_NODES + 3 * WARP_SIZE)
    return slots, free // 4 // WARP_SIZE * WARP_SIZE


@functools.lru_cache(maxsize=None)
def make_build_kernel(scan_unroll: int = 4, stage_logprobs: bool = True, redux: bool = True):
    """The build kernel for one launch configuration (cached; the GPU benchmark sweeps these).

    scan_unroll: frontier keys each lane loads before comparing them (independent loads overlap).
    stage_logprobs: copy the request's log-probs to shared memory (each row's first L*K/LP_CACHE columns when
        the whole L x K does not fit; later columns are read from global / L1).
    redux: (GPU) the warp's top key by one redux.sync.max; else a 5-step shuffle butterfly.
    """
    if scan_unroll not in (1, 2, 4, 8):
        raise ValueError(f"scan_unroll must be 1, 2, 4 or 8, got {scan_unroll}")
    front_slots, lp_cache_size = shared_layout(scan_unroll)

    @device_function(inline=True)
    def lane_scan(lane, lanes, size, front_key):
        """(best key, its first slot, tied) over this lane's slots lane, lane + lanes, ... (< size, rounded up
        to a whole chunk: padding slots hold PAD_KEY); tied: an equal key was seen at a later slot."""
        best_key = int32(PAD_KEY)
        best_slot = int32(lane)
        tied = False
        loaded = cuda.local.array(scan_unroll, int32)
        step = int32(lanes * scan_unroll)
        base = int32(lane)
        while base < size:
            for u in range(scan_unroll):  # all loads first: they do not wait on each other
                loaded[u] = at(front_key, int32(base + u * lanes))
            for u in range(scan_unroll):  # strictly greater keeps the first slot of a key
                key = loaded[u]
                tied = key == best_key or (tied and key < best_key)
                if key > best_key:
                    best_key = key
                    best_slot = int32(base + u * lanes)
            base = int32(base + step)
        return best_key, best_slot, tied

    @device_function()
    def frontier_pick(lane, lanes, size, front_key, front_parent, front_rd, node_parent, node_rd, red_key,
                      red_slot, red_tied):
        """(slot, key) of the candidate that pops next, returned to every lane (size > 0)."""
        best_key, best_slot, tied = lane_scan(lane, lanes, size, front_key)
        if USE_SHUFFLE:
            if redux:
                top = warp_max(best_key)
            else:
                top = best_key
                offset = WARP_SIZE // 2
                while offset > 0:
                    top = max(top, cuda.shfl_xor_sync(FULL_MASK, top, offset))
                    offset //= 2
            mine = best_key == top
            holders = cuda.ballot_sync(FULL_MASK, mine)
            if cuda.popc(holders) == 1 and not cuda.any_sync(FULL_MASK, mine and tied):
                return cuda.shfl_sync(FULL_MASK, best_slot, 31 - cuda.clz(holders)), top  # the usual case
            # The top key is tied: the first in pop order among the slots holding it, exactly.
            slot = _lane_exact(lane, lanes, size, top, front_key, front_parent, front_rd, node_parent, node_rd)
            offset = WARP_SIZE // 2
            while offset > 0:  # xor butterfly: every lane ends with the winner (a strict total order)
                other = cuda.shfl_xor_sync(FULL_MASK, slot, offset)
                if other >= 0 and (slot < 0 or _slot_less(other, slot, front_parent, front_rd, node_parent,
                                                          node_rd)):
                    slot = other
                offset //= 2
            return slot, top
        # Simulator: the partials go through shared memory; every lane reduces them itself (same result).
        red_key[lane] = best_key
        red_slot[lane] = best_slot
        red_tied[lane] = int32(tied)
        _lanes_sync()  # every lane's partial is in the scratch
        top = red_key[0]
        for other in range(1, lanes):
            top = max(top, red_key[other])
        holders = 0
        holder_tied = False
        slot = int32(-1)
        for other in range(lanes):
            if red_key[other] == top:
                holders += 1
                holder_tied = holder_tied or red_tied[other] != 0
                slot = red_slot[other]
        if holders == 1 and not holder_tied:
            return slot, top
        slot = _lane_exact(lane, lanes, size, top, front_key, front_parent, front_rd, node_parent, node_rd)
        _lanes_sync()  # every lane has read the partials before they are overwritten
        red_slot[lane] = slot
        _lanes_sync()  # every lane's exact candidate is in the scratch
        for other in range(lanes):
            candidate = red_slot[other]
            if candidate >= 0 and (slot < 0 or _slot_less(candidate, slot, front_parent, front_rd, node_parent,
                                                          node_rd)):
                slot = candidate
        return slot, top

    @kernel_cache.jit
    def kernel(draft_logprobs, draft_ids, root_tokens, prefix_lens, budget, trees, num_nodes, visibility):
        """One block (one warp on a GPU) per request: best-first build of at most B+1 nodes, then the outputs.

        draft_logprobs float32 [b, L, K] (C-contiguous, sorted descending per row); draft_ids int [b, L, K];
        root_tokens int [b]; prefix_lens int [b]; budget B <= MAX_BUDGET.
        Writes trees int32 [6, b, B+1] (C-contiguous; rows OUTPUT_ROWS: tokens, parents, depths, ranks, scores
        as float32 bits, positions); num_nodes int32 [b]; visibility uint32 [b, B+1, W] (C-contiguous).
        Slots past num_nodes: ints -1, score -inf, mask 0.
        """
        request = cuda.blockIdx.x
        lane = int32(cuda.threadIdx.x)
        lanes = int32(cuda.blockDim.x)
        # one declaration per line: the simulator tells shared arrays apart by source line
        node_parent = cuda.shared.array(MAX_NODES, int32)
        node_rd = cuda.shared.array(MAX_NODES, int32)
        node_score = cuda.shared.array(MAX_NODES, float32)
        front_key = cuda.shared.array(front_slots, int32)
        front_parent = cuda.shared.array(front_slots, int32)
        front_rd = cuda.shared.array(front_slots, int32)
        front_base = cuda.shared.array(front_slots, float32)  # the parent's score: the next sibling's base
        lp_cache = cuda.shared.array(lp_cache_size, float32)
        red_key = cuda.shared.array(WARP_SIZE, int32)
        red_slot = cuda.shared.array(WARP_SIZE, int32)
        red_tied = cuda.shared.array(WARP_SIZE, int32)
        budget = int32(budget)
        depth_limit = int32(draft_logprobs.shape[1])
        top_k = int32(draft_logprobs.shape[2])
        lp_base = request * draft_logprobs.shape[1] * draft_logprobs.shape[2]  # 64-bit: b * L * K may be large
        # Log-prob (d, r) = lp_cache[d * cached_cols + r] for r < cached_cols, else global memory.
        cached_cols = int32(0)
        if stage_logprobs:
            cached_cols = min(top_k, int32(lp_cache_size // max(depth_limit, 1)))
        if cached_cols == top_k:  # the whole L x K, one flat copy, 4 loads in flight per lane
            total = int32(depth_limit * top_k)
            values = cuda.local.array(4, float32)
            i = lane
            while i < total:
                for u in range(4):
                    j = int32(i + u * lanes)
                    values[u] = at(draft_logprobs, lp_base + j) if j < total else float32(0.0)
                for u in range(4):
                    j = int32(i + u * lanes)
                    if j < total:
                        at_put(lp_cache, j, values[u])
                i = int32(i + 4 * lanes)
        elif cached_cols > 0:  # each row's first columns
            for row in range(depth_limit):
                col = lane
                while col < cached_cols:
                    at_put(lp_cache, int32(row * cached_cols + col), at(draft_logprobs, lp_base + row * top_k + col))
                    col += lanes
        # Frontier padding: every slot a scan may read (the budget's nodes, rounded up to whole chunks).
        chunk = int32(lanes * scan_unroll)
        padded = min(int32(front_slots), int32((budget + 1 + chunk - 1) // chunk * chunk))
        slot = lane
        while slot < padded:
            at_put(front_key, slot, int32(PAD_KEY))
            slot += lanes

        if lane == 0:  # (lane 0 padded slot 0 above: the first candidate's key overwrites it)
            node_parent[0] = -1
            node_rd[0] = 0
            node_score[0] = float32(0.0)
        count = int32(1)  # nodes so far and frontier size: the same in every lane
        size = int32(0)
        if depth_limit > 0 and top_k > 0 and budget > 0:
            if lane == 0:
                front_key[0] = float_key(float32(0.0) + draft_logprobs[request, 0, 0])
                front_parent[0] = 0
                front_rd[0] = 1  # rank 0, depth 1
                front_base[0] = float32(0.0)
            size = int32(1)
        _lanes_sync()  # staged log-probs, padding, root and first candidate visible to all lanes

        while size > 0 and count <= budget:
            slot, key = frontier_pick(lane, lanes, size, front_key, front_parent, front_rd, node_parent, node_rd,
                                      red_key, red_slot, red_tied)
            parent = at(front_parent, slot)
            rd = at(front_rd, slot)
            base = at(front_base, slot)
            score = key_float(key)
            rank = int32(rd >> RANK_SHIFT)
            depth = int32(rd & DEPTH_MASK)
            node = count
            count = int32(count + 1)
            more = count <= budget  # more pops follow: the new candidates are needed
            has_sibling = more and int32(rank + 1) < top_k
            has_child = more and depth < depth_limit
            sibling = float32(0.0)
            child = float32(0.0)
            if has_sibling:  # next sibling, scored from the parent (not score - lp + lp')
                col = int32(rank + 1)
                lp = at(lp_cache, int32((depth - 1) * cached_cols + col)) if col < cached_cols else \
                    at(draft_logprobs, lp_base + int32((depth - 1) * top_k + col))
                sibling = base + lp
            if has_child:  # first child
                lp = at(lp_cache, int32(depth * cached_cols)) if cached_cols > 0 else \
                    at(draft_logprobs, lp_base + int32(depth * top_k))
                child = score + lp
            _lanes_sync()  # every lane has read the frontier (scan and popped slot) before it changes
            if lane == 0:
                at_put(node_parent, node, parent)
                at_put(node_rd, node, rd)
                at_put(node_score, node, score)
            if not more:
                break  # budget reached: no more pops, so no pushes needed
            # The popped slot takes the sibling, else the child, else the last entry; a second candidate appends.
            last = int32(size - 1)
            if lane == 0:
                if has_sibling:
                    at_put(front_key, slot, float_key(sibling))
                    at_put(front_rd, slot, rd + (1 << RANK_SHIFT))  # same parent and base
                elif has_child:
                    at_put(front_key, slot, float_key(child))
                    at_put(front_parent, slot, node)
                    at_put(front_rd, slot, int32(depth + 1))
                    at_put(front_base, slot, score)
                else:  # the last entry moves here; its old slot (maybe this one) becomes padding
                    moved_key = at(front_key, last)
                    moved_parent = at(front_parent, last)
                    moved_rd = at(front_rd, last)
                    moved_base = at(front_base, last)
                    at_put(front_key, slot, moved_key)
                    at_put(front_parent, slot, moved_parent)
                    at_put(front_rd, slot, moved_rd)
                    at_put(front_base, slot, moved_base)
                    at_put(front_key, last, int32(PAD_KEY))
            if has_sibling and has_child and lane == lanes - 1:
                at_put(front_key, size, float_key(child))
                at_put(front_parent, size, node)
                at_put(front_rd, size, int32(depth + 1))
                at_put(front_base, size, score)
            size = int32(size + int32(has_sibling) + int32(has_child) - 1)
            _lanes_sync()  # frontier and node arrays updated before the next scan reads them
        _lanes_sync()  # the last node written before the lanes read the node arrays

        nodes = int32(budget + 1)
        plane = num_nodes.shape[0] * nodes  # one output row of all requests (64-bit)
        out = request * nodes
        prefix = prefix_lens[request]
        i = lane
        while i < nodes:
            if i < count:
                rd = at(node_rd, i)
                depth = int32(rd & DEPTH_MASK)
                rank = int32(rd >> RANK_SHIFT)
                token = root_tokens[request] if i == 0 else draft_ids[request, depth - 1, rank]
                at_put(trees, TOKENS * plane + out + i, token)
                at_put(trees, PARENTS * plane + out + i, at(node_parent, i))
                at_put(trees, DEPTHS * plane + out + i, depth)
                at_put(trees, RANKS * plane + out + i, rank)
                at_put(trees, SCORES * plane + out + i, _score_bits(at(node_score, i)))
                at_put(trees, POSITIONS * plane + out + i, prefix + depth)
            else:
                at_put(trees, TOKENS * plane + out + i, -1)
                at_put(trees, PARENTS * plane + out + i, -1)
                at_put(trees, DEPTHS * plane + out + i, -1)
                at_put(trees, RANKS * plane + out + i, -1)
                at_put(trees, SCORES * plane + out + i, _score_bits(float32(-math.inf)))
                at_put(trees, POSITIONS * plane + out + i, -1)
            i += lanes
        if lane == 0:
            num_nodes[request] = count

        # Visibility: row i holds the bits of i's ancestors-or-self. A lane walks i's ancestors once, from i up
        # (indices decrease), filling the words from the last down. Each chunk of `lanes` rows is assembled in
        # the frontier's parent array (free now), then copied out as consecutive words by consecutive lanes.
        words = int32(visibility.shape[2])
        out = request * nodes * words
        first_row = int32(0)
        while first_row < nodes:
            i = int32(first_row + lane)
            j = i if i < count else int32(-1)
            w = int32(words - 1)
            while w >= 0:
                word = uint32(0)
                while j >= 32 * w:
                    word |= uint32(1) << uint32(j - 32 * w)
                    j = at(node_parent, j)
                at_put(front_parent, int32(lane * words + w), int32(word))
                w -= 1
            _lanes_sync()  # the chunk's rows assembled before the lanes copy them out
            chunk_words = int32(min(lanes, nodes - first_row) * words)
            flat = lane
            while flat < chunk_words:
                at_put(visibility, out + first_row * words + flat, uint32(at(front_parent, flat)))
                flat += lanes
            _lanes_sync()  # the chunk copied out before the next one overwrites it
            first_row = int32(first_row + lanes)

    return kernel


if ON_SIMULATOR:
    def _score_bits(value):
        return np.float32(value).view(np.int32)
else:
    _score_bits = _bits

build_trees_kernel = make_build_kernel()


@dataclass
class TreeBatch:
    """Device arrays of b built trees (see make_build_kernel's kernel for shapes, dtypes and padding).

    packed int32 [6, b, B+1] holds tokens, parents, depths, ranks, scores (float32 bits) and positions; the
    attributes of those names are views of its rows (scores viewed as float32).
    """

    packed: object
    num_nodes: object
    visibility: object
    tokens: object = field(init=False, repr=False)
    parents: object = field(init=False, repr=False)
    depths: object = field(init=False, repr=False)
    ranks: object = field(init=False, repr=False)
    scores: object = field(init=False, repr=False)
    positions: object = field(init=False, repr=False)

    def __post_init__(self):
        for row, name in enumerate(OUTPUT_ROWS):
            setattr(self, name, self.packed[row].view(np.float32) if row == SCORES else self.packed[row])

    def to_host(self) -> dict:
        """{tokens, parents, depths, ranks, scores, positions, num_nodes, visibility}: numpy arrays."""
        packed = self.packed.copy_to_host()
        host = {name: packed[row] for row, name in enumerate(OUTPUT_ROWS)}
        host["scores"] = host["scores"].view(np.float32)
        host["num_nodes"] = self.num_nodes.copy_to_host()
        host["visibility"] = self.visibility.copy_to_host()
        return host

    @classmethod
    def allocate(cls, batch: int, budget: int) -> "TreeBatch":
        """Output buffers for b requests at budget B (reusable across launches of that shape)."""
        nodes = budget + 1
        words = (nodes + 31) // 32
        return cls(packed=cuda.device_array((len(OUTPUT_ROWS), batch, nodes), np.int32),
                   num_nodes=cuda.device_array(batch, np.int32),
                   visibility=cuda.device_array((batch, nodes, words), np.uint32))

    def fits(self, batch: int, budget: int) -> bool:
        return tuple(self.packed.shape) == (len(OUTPUT_ROWS), batch, budget + 1)


def _configured(kernel, batch: int, stream=0):
    """kernel[b, BUILD_THREADS, stream], made once per (kernel, b, stream) on a GPU: launches skip building the
    launch configuration. The simulator's kernel[...] sets the grid on the kernel itself and returns it, so a
    kept one would launch with whatever grid was configured last: it is configured at every launch there."""
    return kernel[batch, BUILD_THREADS, stream] if ON_SIMULATOR else _configured_on_gpu(kernel, batch, stream)


@functools.lru_cache(maxsize=64)
def _configured_on_gpu(kernel, batch: int, stream):
    return kernel[batch, BUILD_THREADS, stream]


def build_trees(draft_logprobs, draft_ids, root_tokens, prefix_lens, budget: int,
                out: TreeBatch | None = None, kernel=None, stream=0) -> TreeBatch:
    """Build b trees in one launch (one block of BUILD_THREADS per request). Inputs numpy or device arrays
    (see make_build_kernel; device log-probs C-contiguous); ``out``: buffers from TreeBatch.allocate(b, budget)
    to reuse (every slot is rewritten); ``kernel``: a make_build_kernel(...) variant (default build_trees_kernel);
    with device inputs and ``out``, nothing but the launch on ``stream`` (a CUDA graph can capture it)."""
    shape = tuple(draft_logprobs.shape)
    if len(shape) != 3 or tuple(draft_ids.shape) != shape:
        raise ValueError(f"draft_logprobs {shape} and draft_ids {tuple(draft_ids.shape)} must both be [b, L, K]")
    if draft_logprobs.dtype != np.float32:
        raise ValueError(f"draft_logprobs must be float32, got {draft_logprobs.dtype}")
    if np.dtype(draft_ids.dtype).kind not in "iu":
        raise ValueError(f"draft_ids must be integers, got {draft_ids.dtype}")
    batch = shape[0]
    if tuple(root_tokens.shape) != (batch,) or tuple(prefix_lens.shape) != (batch,):
        raise ValueError(f"root_tokens {root_tokens.shape} and prefix_lens {prefix_lens.shape} must be [b={batch}]")
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in 0..{MAX_BUDGET}, got {budget}")
    if batch == 0:
        raise ValueError("need at least one request")
    if out is None:
        out = TreeBatch.allocate(batch, budget)
    elif not out.fits(batch, budget):
        raise ValueError(f"out holds trees of shape {tuple(out.tokens.shape)}, need ({batch}, {budget + 1})")
    if isinstance(draft_logprobs, np.ndarray):  # a fresh copy: numpy calls x[None] contiguous, Numba does not
        draft_logprobs = np.array(draft_logprobs, dtype=np.float32, order="C")  # (its new axis has stride 0)
    draft_logprobs = to_device(draft_logprobs)
    if not draft_logprobs.is_c_contiguous():  # the kernel indexes its flat data
        raise ValueError("draft_logprobs must be C-contiguous")
    _configured(kernel or build_trees_kernel, batch, stream)(
        draft_logprobs, to_device(draft_ids), to_device(root_tokens), to_device(prefix_lens), budget,
        out.packed, out.num_nodes, out.visibility)
    return out
