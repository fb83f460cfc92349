"""Batched best-first DDTree build: one thread block per request, bit-exact to engine.ddtree_ref.build_tree.

Thread 0 of each block runs the binary heap in shared memory (the build is inherently sequential: each pop
decides what is pushed next); then the whole block writes the flat outputs and the visibility bitmask.
Dimension letters: b requests, L drafted depths, K drafter top-K, B budget (non-root nodes), W = ceil((B+1)/32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32

from numba_kernels.warp import ON_SIMULATOR, to_device

MAX_BUDGET = 1024
MAX_NODES = MAX_BUDGET + 1
MAX_WORDS = (MAX_NODES + 31) // 32
# The serial heap loop reads a log-prob per push; staged in shared memory when L*K fits (7 node/heap arrays
# take 28.7 KB, this 16 KB: under the 48 KB static limit), so the loop's dependent loads hit shared memory.
LP_CACHE = 4096
# The simulator runs every thread as a Python thread: keep its blocks tiny.
BUILD_THREADS = 4 if ON_SIMULATOR else 128


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
def _heap_better(i, j, heap_score, heap_parent, heap_rank, node_parent, node_depth, node_rank):
    """Heap slot i pops before slot j: higher score, then the smaller rank tuple."""
    if heap_score[i] != heap_score[j]:
        return heap_score[i] > heap_score[j]
    return _path_less(heap_parent[i], heap_rank[i], heap_parent[j], heap_rank[j], node_parent, node_depth,
                      node_rank)


@cuda.jit(device=True)
def _heap_swap(i, j, heap_score, heap_parent, heap_rank):
    heap_score[i], heap_score[j] = heap_score[j], heap_score[i]
    heap_parent[i], heap_parent[j] = heap_parent[j], heap_parent[i]
    heap_rank[i], heap_rank[j] = heap_rank[j], heap_rank[i]


@cuda.jit(device=True)
def _heap_push(size, score, parent, rank, heap_score, heap_parent, heap_rank, node_parent, node_depth, node_rank):
    """Append (score, parent, rank) and sift it up; returns the new size."""
    slot = size
    heap_score[slot] = score
    heap_parent[slot] = parent
    heap_rank[slot] = rank
    while slot > 0:
        up = (slot - 1) // 2
        if not _heap_better(slot, up, heap_score, heap_parent, heap_rank, node_parent, node_depth, node_rank):
            break
        _heap_swap(slot, up, heap_score, heap_parent, heap_rank)
        slot = up
    return size + 1


@cuda.jit(device=True)
def _heap_pop_root(size, heap_score, heap_parent, heap_rank, node_parent, node_depth, node_rank):
    """Drop slot 0 (already read by the caller): move the last entry there and sift it down; returns the new size."""
    size -= 1
    heap_score[0] = heap_score[size]
    heap_parent[0] = heap_parent[size]
    heap_rank[0] = heap_rank[size]
    slot = 0
    while True:
        best = slot
        left = 2 * slot + 1
        if left < size and _heap_better(left, best, heap_score, heap_parent, heap_rank, node_parent, node_depth,
                                        node_rank):
            best = left
        if left + 1 < size and _heap_better(left + 1, best, heap_score, heap_parent, heap_rank, node_parent,
                                            node_depth, node_rank):
            best = left + 1
        if best == slot:
            return size
        _heap_swap(slot, best, heap_score, heap_parent, heap_rank)
        slot = best


@cuda.jit
def build_trees_kernel(draft_logprobs, draft_ids, root_tokens, prefix_lens, budget, tokens, parents, depths, ranks,
                       scores, positions, num_nodes, visibility):
    """One block per request: best-first build of at most B+1 nodes, then outputs and bitmask.

    draft_logprobs float32 [b, L, K] (sorted descending per row); draft_ids int [b, L, K]; root_tokens int [b];
    prefix_lens int [b]; budget B <= MAX_BUDGET.
    Writes tokens, parents, depths, ranks int32 [b, B+1]; scores float32 [b, B+1]; positions int32 [b, B+1];
    num_nodes int32 [b]; visibility uint32 [b, B+1, W]. Slots past num_nodes: ints -1, score -inf, mask 0.
    """
    request = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    # one declaration per line: the simulator tells shared arrays apart by source line
    node_parent = cuda.shared.array(MAX_NODES, int32)
    node_depth = cuda.shared.array(MAX_NODES, int32)
    node_rank = cuda.shared.array(MAX_NODES, int32)
    node_score = cuda.shared.array(MAX_NODES, float32)
    heap_score = cuda.shared.array(MAX_NODES, float32)
    heap_parent = cuda.shared.array(MAX_NODES, int32)
    heap_rank = cuda.shared.array(MAX_NODES, int32)
    node_count = cuda.shared.array(1, int32)
    lp_cache = cuda.shared.array(LP_CACHE, float32)
    depth_limit = draft_logprobs.shape[1]
    top_k = draft_logprobs.shape[2]
    cached = depth_limit * top_k <= LP_CACHE
    if cached:
        for idx in range(tid, depth_limit * top_k, cuda.blockDim.x):
            lp_cache[idx] = draft_logprobs[request, idx // top_k, idx % top_k]
    cuda.syncthreads()  # the staged log-probs are complete before thread 0 reads them

    if tid == 0:
        node_parent[0] = -1
        node_depth[0] = 0
        node_rank[0] = 0
        node_score[0] = float32(0.0)
        count = 1
        size = 0
        if depth_limit > 0 and top_k > 0 and budget > 0:
            first = lp_cache[0] if cached else draft_logprobs[request, 0, 0]
            size = _heap_push(size, float32(0.0) + first, 0, 0, heap_score, heap_parent,
                              heap_rank, node_parent, node_depth, node_rank)
        while size > 0 and count <= budget:
            score = heap_score[0]
            parent = heap_parent[0]
            rank = heap_rank[0]
            size = _heap_pop_root(size, heap_score, heap_parent, heap_rank, node_parent, node_depth, node_rank)
            depth = node_depth[parent] + 1
            node = count
            node_parent[node] = parent
            node_depth[node] = depth
            node_rank[node] = rank
            node_score[node] = score
            count += 1
            if count > budget:
                break  # budget reached: no more pops, so no pushes needed
            if rank + 1 < top_k:  # next sibling, scored from the parent (not score - lp + lp')
                lp = lp_cache[(depth - 1) * top_k + rank + 1] if cached else draft_logprobs[request, depth - 1, rank + 1]
                sibling = node_score[parent] + lp
                size = _heap_push(size, sibling, parent, rank + 1, heap_score, heap_parent, heap_rank, node_parent,
                                  node_depth, node_rank)
            if depth < depth_limit:  # first child
                lp = lp_cache[depth * top_k] if cached else draft_logprobs[request, depth, 0]
                child = score + lp
                size = _heap_push(size, child, node, 0, heap_score, heap_parent, heap_rank, node_parent,
                                  node_depth, node_rank)
        node_count[0] = count
    cuda.syncthreads()  # node arrays and node_count complete before the block reads them

    count = node_count[0]
    words = visibility.shape[2]
    prefix = prefix_lens[request]
    for i in range(tid, budget + 1, cuda.blockDim.x):
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
        row = cuda.local.array(MAX_WORDS, uint32)
        for w in range(words):
            row[w] = uint32(0)
        if i < count:
            j = i
            while j >= 0:  # ancestor-or-self
                row[j // 32] |= uint32(1) << uint32(j % 32)
                j = node_parent[j]
        for w in range(words):
            visibility[request, i, w] = row[w]
    if tid == 0:
        num_nodes[request] = count


@dataclass
class TreeBatch:
    """Device arrays of b built trees (see build_trees_kernel for shapes, dtypes and padding)."""

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


def build_trees(draft_logprobs, draft_ids, root_tokens, prefix_lens, budget: int, threads: int = BUILD_THREADS,
                out: TreeBatch | None = None) -> TreeBatch:
    """Build b trees in one launch. Inputs numpy or device arrays (see build_trees_kernel); ``out``: buffers
    from TreeBatch.allocate(b, budget) to reuse (every slot is rewritten)."""
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
    build_trees_kernel[batch, threads](to_device(draft_logprobs), to_device(draft_ids), to_device(root_tokens),
                                       to_device(prefix_lens), budget, out.tokens, out.parents, out.depths, out.ranks,
                                       out.scores, out.positions, out.num_nodes, out.visibility)
    return out
