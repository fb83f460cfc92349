"""Batched best-first DDTree build: one warp per request, bit-exact to engine.ddtree_ref.build_tree.

The build is sequential (each pop decides what is pushed next), so the warp parallelises each pop instead:
the frontier (candidates: the next sibling and the first child of every popped node) is an unsorted array in
shared memory, and a pop is a warp-wide argmax over it (each lane scans its strided slots, then the lanes
reduce with shuffles). The popped slot is refilled in place by the 0-2 new candidates (or the last entry), so
the array never needs sorting. After the build all lanes write the flat outputs and the visibility bitmask.
Dimension letters: b requests, L drafted depths, K drafter top-K, B budget (non-root nodes), W = ceil((B+1)/32).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int16, int32, uint32

from numba_kernels.warp import FULL_MASK, ON_SIMULATOR, USE_SHUFFLE, WARP_SIZE, to_device

MAX_BUDGET = 1024
MAX_NODES = MAX_BUDGET + 1
MAX_WORDS = (MAX_NODES + 31) // 32
# Frontier arrays: at most B candidates at once; after the build one of them stages WARP_SIZE bitmask rows.
# A candidate's depth is kept with it (int16: all shared arrays stay under 48 KB) so a pop reads its depth
# together with its score, parent and rank instead of after them.
FRONT_SLOTS = max(MAX_NODES, WARP_SIZE * MAX_WORDS)
# Log-probs staged in shared memory when L*K fits (16 KB; node + frontier arrays take 31 KB: 47.6 KB in all,
# under the 48 KB static limit), so each pop's dependent log-prob loads hit shared memory.
LP_CACHE = 4096
# One warp per request on a GPU (the shuffles assume exactly one full warp per block). The simulator has no
# shuffles and runs every thread as a Python thread, each barrier costing ~0.3 ms: one lane there by
# default (no barriers); tests also launch a few lanes, which reduce through shared memory.
BUILD_THREADS = 1 if ON_SIMULATOR else WARP_SIZE


@cuda.jit(device=True)
def _path_less(parent_a, rank_a, parent_b, rank_b, node_parent, node_depth, node_rank):
    """True when candidate a's rank tuple (path of parent_a, then rank_a) is lexicographically smaller than b's.

    Only called on exact score ties, so walking the parents is cheap enough.
    """
    depth_a = node_depth[parent_a] + 1
    depth_b = node_depth[parent_b] + 1
    lifted_a = depth_a
    lifted_b = depth_b
    while lifted_a > lifted_b:  # lift a to b's depth; (parent, rank) then names a's ancestor
        rank_a = node_rank[parent_a]
        parent_a = node_parent[parent_a]
        lifted_a -= 1
    while lifted_b > lifted_a:
        rank_b = node_rank[parent_b]
        parent_b = node_parent[parent_b]
        lifted_b -= 1
    if parent_a == parent_b and rank_a == rank_b:
        return depth_a < depth_b  # one path is a prefix of the other: the shorter is smaller
    while parent_a != parent_b:  # climb to the common ancestor; the ranks below it decide
        rank_a = node_rank[parent_a]
        parent_a = node_parent[parent_a]
        rank_b = node_rank[parent_b]
        parent_b = node_parent[parent_b]
    return rank_a < rank_b


@cuda.jit(device=True)
def _pops_before(score_a, slot_a, score_b, slot_b, front_parent, front_rank, node_parent, node_depth, node_rank):
    """Frontier slot a pops before slot b (a slot < 0 is "none"): higher score, then the smaller rank tuple.

    A strict total order on distinct candidates, so any scan or reduction order finds the same winner.
    """
    if slot_b < 0:
        return slot_a >= 0
    if slot_a < 0:
        return False
    if score_a != score_b:
        return score_a > score_b
    return _path_less(front_parent[slot_a], front_rank[slot_a], front_parent[slot_b], front_rank[slot_b],
                      node_parent, node_depth, node_rank)


@cuda.jit(device=True, inline=True)
def _lanes_sync():
    """Barrier of the lanes of one request: the warp on a GPU, the (one-request) block on the simulator."""
    if USE_SHUFFLE:
        cuda.syncwarp()
    elif cuda.blockDim.x > 1:  # a simulator barrier costs ~0.3 ms even for one thread
        cuda.syncthreads()


@functools.lru_cache(maxsize=None)
def make_build_kernel(stage_logprobs: bool = True, coalesce_mask: bool = True, scan_unroll: int = 4,
                      ballot_reduce: bool = False):
    """The build kernel for one launch configuration (cached; the GPU benchmark sweeps these).

    stage_logprobs: copy the request's L*K log-probs to shared memory when they fit (else read global / L1).
    coalesce_mask: bitmask rows of 32 nodes assembled in shared memory, then written with consecutive words
        per lane (else each lane stores its own row's words: strided stores).
    scan_unroll: frontier slots each lane loads before comparing them (independent loads overlap).
    ballot_reduce: (GPU) reduce the score alone with max-shuffles and ballot the lanes holding it; the full
        (score, slot) comparison reduction only on a tie between lanes. Else always the full reduction.
    """

    @cuda.jit(device=True)
    def frontier_best(lane, lanes, size, front_score, front_parent, front_rank, node_parent, node_depth,
                      node_rank, front_depth, red_score, red_slot, red_parent, red_rank, red_depth):
        """(slot, score, parent, rank, depth) of the candidate that pops next, returned to every lane (size > 0)."""
        best_score = float32(-math.inf)
        best_slot = int32(-1)
        loaded = cuda.local.array(scan_unroll, float32)
        base = lane
        while base < size:
            for u in range(scan_unroll):  # all loads first: they do not wait on each other
                slot = base + u * lanes
                loaded[u] = front_score[slot] if slot < size else float32(-math.inf)
            for u in range(scan_unroll):
                slot = base + u * lanes
                # _pops_before spelled out: the simulator pays a lot per device-function call
                if slot < size and (best_slot < 0 or loaded[u] > best_score or (loaded[u] == best_score and _path_less(
                        front_parent[slot], front_rank[slot], front_parent[best_slot], front_rank[best_slot],
                        node_parent, node_depth, node_rank))):
                    best_score = loaded[u]
                    best_slot = slot
            base += scan_unroll * lanes
        if USE_SHUFFLE:
            reduce = True
            if ballot_reduce:
                top = best_score
                offset = WARP_SIZE // 2
                while offset > 0:
                    top = max(top, cuda.shfl_xor_sync(FULL_MASK, top, offset))
                    offset //= 2
                holders = cuda.ballot_sync(FULL_MASK, best_slot >= 0 and best_score == top)
                if cuda.popc(holders) == 1:  # the usual case: one lane holds the top score
                    best_slot = cuda.shfl_sync(FULL_MASK, best_slot, 31 - cuda.clz(holders))
                    best_score = top
                    reduce = False
                elif best_score != top:  # a tie across lanes: only the holders take part in the full reduction
                    best_slot = int32(-1)
            if reduce:
                offset = WARP_SIZE // 2
                while offset > 0:  # xor butterfly: every lane ends with the winner
                    other_score = cuda.shfl_xor_sync(FULL_MASK, best_score, offset)
                    other_slot = cuda.shfl_xor_sync(FULL_MASK, best_slot, offset)
                    if _pops_before(other_score, other_slot, best_score, best_slot, front_parent, front_rank,
                                    node_parent, node_depth, node_rank):
                        best_score = other_score
                        best_slot = other_slot
                    offset //= 2
            return best_slot, best_score, front_parent[best_slot], front_rank[best_slot], int32(front_depth[best_slot])
        # Simulator: the partials go through shared memory with the winner's parent and rank, so after this one
        # barrier no lane reads the frontier again and lane 0 may change it at once.
        best_parent = front_parent[best_slot] if best_slot >= 0 else int32(-1)
        best_rank = front_rank[best_slot] if best_slot >= 0 else int32(-1)
        best_depth = int32(front_depth[best_slot]) if best_slot >= 0 else int32(-1)
        red_score[lane] = best_score
        red_slot[lane] = best_slot
        red_parent[lane] = best_parent
        red_rank[lane] = best_rank
        red_depth[lane] = best_depth
        _lanes_sync()  # every lane's candidate is in the scratch
        for other in range(lanes):  # each lane reduces the few partials itself: no second barrier
            if red_slot[other] >= 0 and (best_slot < 0 or red_score[other] > best_score or (
                    red_score[other] == best_score and _path_less(red_parent[other], red_rank[other], best_parent,
                                                                  best_rank, node_parent, node_depth, node_rank))):
                best_score = red_score[other]
                best_slot = red_slot[other]
                best_parent = red_parent[other]
                best_rank = red_rank[other]
                best_depth = red_depth[other]
        return best_slot, best_score, best_parent, best_rank, best_depth

    @cuda.jit
    def kernel(draft_logprobs, draft_ids, root_tokens, prefix_lens, budget, tokens, parents, depths, ranks,
               scores, positions, num_nodes, visibility):
        """One block (one warp on a GPU) per request: best-first build of at most B+1 nodes, then the outputs.

        draft_logprobs float32 [b, L, K] (sorted descending per row); draft_ids int [b, L, K]; root_tokens
        int [b]; prefix_lens int [b]; budget B <= MAX_BUDGET.
        Writes tokens, parents, depths, ranks int32 [b, B+1]; scores float32 [b, B+1]; positions int32 [b, B+1];
        num_nodes int32 [b]; visibility uint32 [b, B+1, W]. Slots past num_nodes: ints -1, score -inf, mask 0.
        """
        request = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        lanes = cuda.blockDim.x
        # one declaration per line: the simulator tells shared arrays apart by source line
        node_parent = cuda.shared.array(MAX_NODES, int32)
        node_depth = cuda.shared.array(MAX_NODES, int32)
        node_rank = cuda.shared.array(MAX_NODES, int32)
        node_score = cuda.shared.array(MAX_NODES, float32)
        front_score = cuda.shared.array(FRONT_SLOTS, float32)
        front_parent = cuda.shared.array(FRONT_SLOTS, int32)
        front_rank = cuda.shared.array(FRONT_SLOTS, int32)
        front_depth = cuda.shared.array(FRONT_SLOTS, int16)
        lp_cache = cuda.shared.array(LP_CACHE, float32)
        red_score = cuda.shared.array(WARP_SIZE, float32)
        red_slot = cuda.shared.array(WARP_SIZE, int32)
        red_parent = cuda.shared.array(WARP_SIZE, int32)
        red_rank = cuda.shared.array(WARP_SIZE, int32)
        red_depth = cuda.shared.array(WARP_SIZE, int32)
        depth_limit = draft_logprobs.shape[1]
        top_k = draft_logprobs.shape[2]
        cached = stage_logprobs and depth_limit * top_k <= LP_CACHE
        if cached:  # row by row: no 64-bit division per element
            for row in range(depth_limit):
                for col in range(lane, top_k, lanes):
                    lp_cache[row * top_k + col] = draft_logprobs[request, row, col]

        if lane == 0:
            node_parent[0] = -1
            node_depth[0] = 0
            node_rank[0] = 0
            node_score[0] = float32(0.0)
        count = 1  # nodes so far and frontier size: the same in every lane
        size = 0
        if depth_limit > 0 and top_k > 0 and budget > 0:
            if lane == 0:
                front_score[0] = float32(0.0) + draft_logprobs[request, 0, 0]
                front_parent[0] = 0
                front_rank[0] = 0
                front_depth[0] = 1
            size = 1
        _lanes_sync()  # staged log-probs, root and first candidate visible to all lanes

        while size > 0 and count <= budget:
            slot, score, parent, rank, depth = frontier_best(
                lane, lanes, size, front_score, front_parent, front_rank, node_parent, node_depth, node_rank,
                front_depth, red_score, red_slot, red_parent, red_rank, red_depth)
            node = count
            count += 1
            has_sibling = rank + 1 < top_k
            has_child = depth < depth_limit
            sibling = float32(0.0)
            child = float32(0.0)
            if count <= budget:  # more pops follow: compute the new candidates (the reads overlap the barrier)
                if has_sibling:  # next sibling, scored from the parent (not score - lp + lp')
                    lp = lp_cache[(depth - 1) * top_k + rank + 1] if cached else \
                        draft_logprobs[request, depth - 1, rank + 1]
                    sibling = node_score[parent] + lp
                if has_child:  # first child
                    lp = lp_cache[depth * top_k] if cached else draft_logprobs[request, depth, 0]
                    child = score + lp
            if USE_SHUFFLE:  # (the simulator's reduction ends with a barrier after the last frontier read)
                cuda.syncwarp()  # every lane has read the frontier (scan and popped slot) before it changes
            if lane == 0:
                node_parent[node] = parent
                node_depth[node] = depth
                node_rank[node] = rank
                node_score[node] = score
            if count > budget:
                break  # budget reached: no more pops, so no pushes needed
            # The popped slot takes the sibling, else the child, else the last entry; a second candidate appends.
            if lane == 0:
                if has_sibling:
                    front_score[slot] = sibling
                    front_parent[slot] = parent
                    front_rank[slot] = rank + 1
                    front_depth[slot] = depth
                elif has_child:
                    front_score[slot] = child
                    front_parent[slot] = node
                    front_rank[slot] = 0
                    front_depth[slot] = depth + 1
                else:
                    front_score[slot] = front_score[size - 1]
                    front_parent[slot] = front_parent[size - 1]
                    front_rank[slot] = front_rank[size - 1]
                    front_depth[slot] = front_depth[size - 1]
            if has_sibling and has_child and lane == lanes - 1:
                front_score[size] = child
                front_parent[size] = node
                front_rank[size] = 0
                front_depth[size] = depth + 1
            size += int32(has_sibling) + int32(has_child) - 1
            _lanes_sync()  # frontier and node arrays updated before the next scan reads them
        _lanes_sync()  # the last node written before the lanes read the node arrays

        prefix = prefix_lens[request]
        for i in range(lane, budget + 1, lanes):
            if i < count:
                depth = node_depth[i]
                tokens[request, i] = root_tokens[request] if i == 0 else draft_ids[request, depth - 1, node_rank[i]]
                parents[request, i] = node_parent[i]
                depths[request, i] = depth
                ranks[request, i] = node_rank[i]
                scores[request, i] = node_score[i]
                positions[request, i] = prefix + depth
            else:
                tokens[request, i] = -1
                parents[request, i] = -1
                depths[request, i] = -1
                ranks[request, i] = -1
                scores[request, i] = -math.inf
                positions[request, i] = -1
        if lane == 0:
            num_nodes[request] = count

        # Visibility: row i holds the bits of i's ancestors-or-self. A lane walks i's ancestors once, from i up
        # (indices decrease), filling the words from the last down: no per-row buffer.
        words = visibility.shape[2]
        row_step = lanes // words
        word_step = lanes % words
        for first_row in range(0, budget + 1, lanes):
            i = first_row + lane
            j = i if i < count else -1
            for w in range(words - 1, -1, -1):
                word = uint32(0)
                while j >= 32 * w:
                    word |= uint32(1) << uint32(j - 32 * w)
                    j = node_parent[j]
                if not coalesce_mask:
                    if i <= budget:
                        visibility[request, i, w] = word
                else:  # the frontier's parent array is free now: it holds this chunk's rows [lanes, W]
                    front_parent[lane * words + w] = int32(word)
            if coalesce_mask:
                _lanes_sync()  # the chunk's rows assembled before the lanes copy them out
                rows = min(lanes, budget + 1 - first_row)
                row = first_row + lane // words  # (row, word) of flat index lane + k * lanes, stepped without
                w = lane % words                 # a 64-bit division per word
                for flat in range(lane, rows * words, lanes):  # consecutive words in consecutive lanes
                    visibility[request, row, w] = uint32(front_parent[flat])
                    row += row_step
                    w += word_step
                    if w >= words:
                        w -= words
                        row += 1
                _lanes_sync()  # the chunk copied out before the next one overwrites it

    return kernel


build_trees_kernel = make_build_kernel()


@dataclass
class TreeBatch:
    """Device arrays of b built trees (see make_build_kernel's kernel for shapes, dtypes and padding)."""

    tokens: object
    parents: object
    depths: object
    ranks: object
    scores: object
    positions: object
    num_nodes: object
    visibility: object

    def to_host(self) -> dict:
        return {name: getattr(self, name).copy_to_host() for name in self.__dataclass_fields__}

    @classmethod
    def allocate(cls, batch: int, budget: int) -> "TreeBatch":
        """Output buffers for b requests at budget B (reusable across launches of that shape)."""
        nodes = budget + 1
        words = (nodes + 31) // 32
        return cls(tokens=cuda.device_array((batch, nodes), np.int32),
                   parents=cuda.device_array((batch, nodes), np.int32),
                   depths=cuda.device_array((batch, nodes), np.int32),
                   ranks=cuda.device_array((batch, nodes), np.int32),
                   scores=cuda.device_array((batch, nodes), np.float32),
                   positions=cuda.device_array((batch, nodes), np.int32),
                   num_nodes=cuda.device_array(batch, np.int32),
                   visibility=cuda.device_array((batch, nodes, words), np.uint32))

    def fits(self, batch: int, budget: int) -> bool:
        return tuple(self.tokens.shape) == (batch, budget + 1)


def build_trees(draft_logprobs, draft_ids, root_tokens, prefix_lens, budget: int,
                out: TreeBatch | None = None, kernel=None) -> TreeBatch:
    """Build b trees in one launch (one block of BUILD_THREADS per request). Inputs numpy or device arrays
    (see make_build_kernel); ``out``: buffers from TreeBatch.allocate(b, budget) to reuse (every slot is
    rewritten); ``kernel``: a make_build_kernel(...) variant (default build_trees_kernel)."""
    if len(draft_logprobs.shape) != 3 or tuple(draft_ids.shape) != tuple(draft_logprobs.shape):
        raise ValueError(f"draft_logprobs {draft_logprobs.shape} and draft_ids {draft_ids.shape} must both be [b, L, K]")
    if draft_logprobs.dtype != np.float32:
        raise ValueError(f"draft_logprobs must be float32, got {draft_logprobs.dtype}")
    if not np.issubdtype(draft_ids.dtype, np.integer):
        raise ValueError(f"draft_ids must be integers, got {draft_ids.dtype}")
    batch = draft_logprobs.shape[0]
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
    (kernel or build_trees_kernel)[batch, BUILD_THREADS](
        to_device(draft_logprobs), to_device(draft_ids), to_device(root_tokens), to_device(prefix_lens), budget,
        out.tokens, out.parents, out.depths, out.ranks, out.scores, out.positions, out.num_nodes, out.visibility)
    return out
