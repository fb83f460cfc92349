"""Batched greedy accept walk over verified trees, bit-exact to engine.golden.ddtree.accept.

One block per request; at each step the block scans the nodes for the lowest-index child of the current
node whose token equals the target's choice there (a block-wide min), and moves to it.
Dimension letters: b requests, N+1 tree nodes (padded to the array width), L drafted depths.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.host_arrays import as_device_array as to_device
from kdspec.numba_kernels.reductions import INT32_MAX, block_max
from kdspec.numba_kernels.runtime import ON_SIMULATOR

ACCEPT_THREADS = 4 if ON_SIMULATOR else 128


@kernel_cache.jit
def accept_trees_kernel(parents, tokens, target_choice, num_nodes, accepted, tau, bonus):
    """parents, tokens, target_choice int [b, N+1] (node 0 the root, parents before children);
    num_nodes int [b]. Writes accepted int32 [b, L+1] (the path from node 0, padded -1), tau int32 [b]
    (path length, counting the root), bonus int32 [b] (target_choice at the last accepted node).
    The walk stops at L+1 nodes (a tree of depth <= L never reaches that bound)."""
    request = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    scratch = cuda.shared.array(ACCEPT_THREADS, int32)
    count = num_nodes[request]
    width = accepted.shape[1]
    current = 0
    length = 1
    if tid == 0:
        accepted[request, 0] = 0
    while length < width:
        wanted = target_choice[request, current]
        # lowest matching child: children come after their parent, so scan current+1 .. count-1
        lowest = INT32_MAX
        j = current + 1 + tid
        while j < count:
            if parents[request, j] == current and tokens[request, j] == wanted:
                lowest = j
                break  # this thread scans increasing j: its first hit is its lowest
            j += cuda.blockDim.x
        lowest = -block_max(int32(-lowest), scratch)  # block-wide min, same for every thread
        if lowest == INT32_MAX:
            break
        current = lowest
        if tid == 0:
            accepted[request, length] = current
        length += 1
    for j in range(length + tid, width, cuda.blockDim.x):
        accepted[request, j] = -1
    if tid == 0:
        tau[request] = length
        bonus[request] = target_choice[request, current]


def accept_trees(parents, tokens, target_choice, num_nodes, depth_limit: int, threads: int = ACCEPT_THREADS,
                 out=None, stream=0):
    """Accept walks for b requests in one launch -> (accepted int32 [b, L+1], tau int32 [b], bonus int32 [b]),
    device arrays. Inputs numpy or device arrays (see accept_trees_kernel; target_choice may be a strided view,
    e.g. the first column of a top-k); ``out``: (accepted, tau, bonus) device buffers of those shapes to write
    instead of new ones; with device inputs and ``out``, nothing but the launch on ``stream`` (graph capture)."""
    if len(parents.shape) != 2 or not tuple(parents.shape) == tuple(tokens.shape) == tuple(target_choice.shape):
        raise ValueError(f"parents {parents.shape}, tokens {tokens.shape}, target_choice {target_choice.shape} "
                         "must all be [b, N+1]")
    batch, nodes = parents.shape
    if tuple(num_nodes.shape) != (batch,):
        raise ValueError(f"num_nodes {num_nodes.shape} must be [b={batch}]")
    if batch == 0 or nodes == 0:
        raise ValueError("need at least one request and one node")
    if depth_limit < 0:
        raise ValueError(f"depth_limit must be >= 0, got {depth_limit}")
    if threads != ACCEPT_THREADS:
        raise ValueError(f"threads must be ACCEPT_THREADS={ACCEPT_THREADS} (the shared scratch size)")
    if out is None:
        out = (cuda.device_array((batch, depth_limit + 1), np.int32, stream=stream),
               cuda.device_array(batch, np.int32, stream=stream), cuda.device_array(batch, np.int32, stream=stream))
    accepted, tau, bonus = out
    shapes = tuple(tuple(a.shape) for a in out)
    if shapes != ((batch, depth_limit + 1), (batch,), (batch,)) or any(a.dtype != np.int32 for a in out):
        raise ValueError(f"out holds int32 arrays of shapes {shapes}, need ({batch}, {depth_limit + 1}), "
                         f"({batch},), ({batch},)")
    accept_trees_kernel[batch, threads, stream](to_device(parents), to_device(tokens), to_device(target_choice),
                                                to_device(num_nodes), accepted, tau, bonus)
    return accepted, tau, bonus
