"""DDTree reference algorithms in plain Python + numpy: build the draft tree, accept, compact the cache.

The ground truth the Numba kernels are tested against (docs/ddtree.md; liranringel/ddtree).
Dimension letters: L drafted depths, K drafter top-K, B node budget (non-root nodes), N+1 tree nodes
(node 0 the root), P committed prefix length.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kdspec.engine.golden.arrays import namespace


@dataclass
class Tree:
    """A draft tree in flat arrays, nodes in pop order (node 0 the root, every parent before its child).

    tokens int64 [N+1]; parents int32 [N+1] (root -1); depths int32 [N+1] (root 0); ranks int32 [N+1]
    (drafter rank of the node's token at its depth, root 0); scores float32 [N+1] (path log-prob, root 0);
    positions int64 [N+1] = P + depth; visibility bool [N+1, N+1], [i, j] when j is an ancestor of i or i (from
    the device build: the same relation packed, uint32 [N+1, W] on the device, bit j % 32 of word j // 32).
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    scores: np.ndarray
    positions: np.ndarray
    visibility: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


def check_draft(draft_logprobs: np.ndarray, draft_ids: np.ndarray, budget: int) -> None:
    """Raise ValueError (one line) unless the drafter output can be built into a tree."""
    if draft_logprobs.ndim != 2 or draft_logprobs.shape != draft_ids.shape:
        raise ValueError(f"draft_logprobs {draft_logprobs.shape} and draft_ids {draft_ids.shape} must both be [L, K]")
    if draft_logprobs.dtype != np.float32:
        raise ValueError(f"draft_logprobs must be float32, got {draft_logprobs.dtype}")
    if draft_ids.dtype.kind not in "iu":
        raise ValueError(f"draft_ids must be integers, got {draft_ids.dtype}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    # One comparison for the common case (it is false at a NaN too); the cause is told apart only on failure.
    ordered = (draft_logprobs[:, :-1] >= draft_logprobs[:, 1:]).all() if draft_logprobs.shape[1] > 1 else True
    if not ordered or draft_logprobs.shape[1] == 1:
        if np.isnan(draft_logprobs).any():
            raise ValueError("draft_logprobs contain NaN")
        if not ordered:
            raise ValueError("draft_logprobs must be sorted descending along K in every row")


def build_tree(draft_logprobs: np.ndarray, draft_ids: np.ndarray, root_token: int, budget: int,
               prefix_len: int) -> Tree:
    """Best-first tree of the (at most) B most probable prefixes under the factorised draft distribution.

    Args:
        draft_logprobs: float32 [L, K], row d-1 the top-K log-probs at depth d, sorted descending.
        draft_ids: int [L, K], the matching token ids.
        root_token: the bonus token b (node 0, at position P).
        budget: B, the number of non-root nodes wanted; fewer when the L x K space runs out.
        prefix_len: P, committed tokens before the root.
    Returns:
        Tree with N+1 <= B+1 nodes. A popped prefix's node index is its pop order. Scores are
        score(parent) + lp[depth-1, rank] in float32. Ties pop the lexicographically smaller rank tuple
        first (the heap tuples are (-score, ranks)).
    """
    draft_logprobs = np.asarray(draft_logprobs)
    draft_ids = np.asarray(draft_ids)
    check_draft(draft_logprobs, draft_ids, budget)
    depth_limit, top_k = draft_logprobs.shape
    tokens, parents, depths, ranks, scores = [int(root_token)], [-1], [0], [0], [np.float32(0.0)]
    # heap entry: (-score, rank tuple, parent node, depth, rank, score); the rank tuple breaks ties and
    # is unique, so the later fields are never compared.
    heap = []
    if depth_limit > 0 and top_k > 0 and budget > 0:
        first = np.float32(0.0) + draft_logprobs[0, 0]
        heap.append((-float(first), (0,), 0, 1, 0, first))
    while heap and len(tokens) <= budget:
        _, path, parent, depth, rank, score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(draft_ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(score)
        if rank + 1 < top_k:  # next sibling: same parent, next rank
            sibling = scores[parent] + draft_logprobs[depth - 1, rank + 1]
            heapq.heappush(heap, (-float(sibling), path[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < depth_limit:  # first child: next depth, rank 0
            child = score + draft_logprobs[depth, 0]
            heapq.heappush(heap, (-float(child), path + (0,), node, depth + 1, 0, child))
    parents_arr = np.asarray(parents, dtype=np.int32)
    depths_arr = np.asarray(depths, dtype=np.int32)
    return Tree(
        tokens=np.asarray(tokens, dtype=np.int64),
        parents=parents_arr,
        depths=depths_arr,
        ranks=np.asarray(ranks, dtype=np.int32),
        scores=np.asarray(scores, dtype=np.float32),
        positions=prefix_len + depths_arr.astype(np.int64),
        visibility=visibility_from_parents(parents_arr),
    )


def visibility_from_parents(parents: np.ndarray) -> np.ndarray:
    """bool [N+1, N+1]: row i = row parent(i) plus i itself (parents precede children)."""
    n = len(parents)
    visibility = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if parents[i] >= 0:
            visibility[i] = visibility[parents[i]]
        visibility[i, i] = True
    return visibility


def accept(parents: np.ndarray, tokens: np.ndarray, target_choice: np.ndarray) -> tuple[np.ndarray, int]:
    """Greedy walk of the verified tree.

    Args:
        parents: int [N+1] (root -1); tokens: int [N+1]; target_choice: int [N+1], the target's next
        token after each node's path.
    Returns:
        (accepted nodes int32 [tau] starting with 0, bonus token = target_choice at the last one).
        At a node, the first child (lowest index) whose token matches is taken; tokens of siblings are
        distinct for a real drafter, so this is unique.
    """
    parents = np.asarray(parents)
    tokens = np.asarray(tokens)
    target_choice = np.asarray(target_choice)
    if not (parents.shape == tokens.shape == target_choice.shape and parents.ndim == 1):
        raise ValueError(f"parents {parents.shape}, tokens {tokens.shape}, target_choice {target_choice.shape} "
                         "must all be [N+1]")
    children: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(int(parents[node]), []).append(node)
    accepted = [0]
    current = 0
    while True:
        match = next((c for c in children.get(current, []) if tokens[c] == target_choice[current]), None)
        if match is None:
            break
        accepted.append(match)
        current = match
    return np.asarray(accepted, dtype=np.int32), int(target_choice[current])


def compaction_moves(prefix_len: int, accepted) -> tuple[np.ndarray, np.ndarray]:
    """The cache row moves of a step's compaction: (src, dst) int32 [tau], src = P+accepted[j], dst = P+j.

    The one definition: the golden model's compact applies them, the decode loop records them.
    """
    accepted = np.asarray(accepted)
    src = (prefix_len + accepted).astype(np.int32)
    dst = (prefix_len + np.arange(len(accepted))).astype(np.int32)
    return src, dst


def move_rows(rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """rows[dst[j]] = rows[src[j]] for every j, in place, every source read before any destination is written."""
    if len(src) and (src.max() >= rows.shape[0] or src.min() < 0):
        raise ValueError(f"compaction source rows {src.min()}..{src.max()} outside the cache of {rows.shape[0]} rows")
    rows[dst] = namespace(rows).copy(rows[src])  # the copy: all sources read before any destination is written


def compact_rows(rows: np.ndarray, prefix_len: int, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Move cache row P+accepted[j] to P+j for every j, in place, reading every source before writing.

    Args:
        rows: any array whose axis 0 is the cache row ([t, ...]).
        prefix_len: P.
        accepted: int [tau], accepted node indices (starting with 0, increasing).
    Returns:
        (src, dst) int32 [tau]: the row moves (``compaction_moves``).
    """
    src, dst = compaction_moves(prefix_len, accepted)
    move_rows(rows, src, dst)
    return src, dst
