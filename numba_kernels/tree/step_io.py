"""The DDTree step's glue kernels, for a step that stays on the device: the verify forward's inputs taken from
the built tree, and the step's results gathered into one buffer so that the host reads them in one copy.

- ``tree_inputs``: the first s nodes' tokens and positions (int32 rows of the build's packed output) widened to
  the int64 arrays the forward reads.
- ``choice_column``: the target's choice per node (column 0 of the top-k ids) as the [1, s] row accept reads.
- ``gather_results``: one request's tree rows, node count, the target's choice per node (column 0 of the
  top-k ids), the accepted path, tau and the bonus token into one int32 buffer laid out by ``ResultLayout``,
  the one definition of where each field sits (the host reads fields back through it).
Dimension letters: s tree nodes (N+1), k target top-k, L drafted depths.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from kdspec.numba_kernels import kernel_cache
from kdspec.numba_kernels.runtime import ON_SIMULATOR
from kdspec.numba_kernels.tree.build import OUTPUT_ROWS, POSITIONS, TOKENS

IO_THREADS = 8 if ON_SIMULATOR else 256
TREE_ROWS = len(OUTPUT_ROWS)


class ResultLayout(NamedTuple):
    """Offsets in the int32 result buffer of a step over s nodes whose accepted path is padded to ``width``."""
    nodes: int
    width: int

    @property
    def tree(self) -> int:        # [TREE_ROWS, s]: build.OUTPUT_ROWS (scores as float32 bits)
        return 0

    @property
    def count(self) -> int:       # the build's node count
        return TREE_ROWS * self.nodes

    @property
    def choice(self) -> int:      # [s]: the target's choice per node
        return self.count + 1

    @property
    def accepted(self) -> int:    # [width]: the accepted nodes, padded -1
        return self.choice + self.nodes

    @property
    def tau(self) -> int:
        return self.accepted + self.width

    @property
    def bonus(self) -> int:
        return self.tau + 1

    @property
    def size(self) -> int:
        return self.bonus + 1


@kernel_cache.jit
def tree_inputs_kernel(packed, tokens, positions):
    """packed int32 [6, b, B+1] (the build's output; request 0 read) -> tokens, positions int64 [s] (s <= B+1).
    Grid (1,), IO_THREADS, grid-stride over nodes."""
    for node in range(cuda.threadIdx.x, tokens.shape[0], cuda.blockDim.x):
        tokens[node] = packed[TOKENS, 0, node]
        positions[node] = packed[POSITIONS, 0, node]


@kernel_cache.jit
def choice_column_kernel(top_ids, choice):
    """choice int32 [1, s] = top_ids int32 [s, k] column 0. Grid (1,), IO_THREADS, grid-stride over nodes."""
    for node in range(cuda.threadIdx.x, choice.shape[1], cuda.blockDim.x):
        choice[0, node] = top_ids[node, 0]


@kernel_cache.jit
def gather_results_kernel(packed, num_nodes, top_ids, accepted, tau, bonus, out):
    """Request 0's results into out int32 [ResultLayout(s, width).size]: packed int32 [6, b, >= s], num_nodes
    int32 [b], top_ids int32 [s, k] (column 0 is the choice), accepted int32 [b, width], tau and bonus int32
    [b]. Grid (1,), IO_THREADS, grid-stride over the buffer (the layout's offsets computed as ResultLayout's)."""
    nodes, width = top_ids.shape[0], accepted.shape[1]
    count_at = TREE_ROWS * nodes
    choice_at = count_at + 1
    accepted_at = choice_at + nodes
    tau_at = accepted_at + width
    for i in range(cuda.threadIdx.x, tau_at + 2, cuda.blockDim.x):
        if i < count_at:
            row = i // nodes
            out[i] = packed[row, 0, i - row * nodes]
        elif i == count_at:
            out[i] = num_nodes[0]
        elif i < accepted_at:
            out[i] = top_ids[i - choice_at, 0]
        elif i < tau_at:
            out[i] = accepted[0, i - accepted_at]
        elif i == tau_at:
            out[i] = tau[0]
        else:
            out[i] = bonus[0]


def tree_inputs(packed, tokens, positions, stream=0) -> None:
    """tokens, positions (device int64 [s]) = the first s nodes of request 0 of the build's packed output."""
    s = tokens.shape[0]
    if tuple(positions.shape) != (s,) or tokens.dtype != np.int64 or positions.dtype != np.int64:
        raise ValueError(f"tokens and positions must be int64 [s], got {tokens.dtype} {tuple(tokens.shape)}, "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if len(packed.shape) != 3 or packed.shape[0] != TREE_ROWS or packed.shape[2] < s:
        raise ValueError(f"packed must be int32 [{TREE_ROWS}, b, >= {s}], got {tuple(packed.shape)}")
    tree_inputs_kernel[1, IO_THREADS, stream](packed, tokens, positions)


def choice_column(top_ids, choice, stream=0) -> None:
    """choice (device int32 [1, s]) = column 0 of top_ids (device int32 [s, k])."""
    if tuple(choice.shape) != (1, top_ids.shape[0]) or choice.dtype != np.int32 or top_ids.dtype != np.int32:
        raise ValueError(f"choice must be int32 [1, {top_ids.shape[0]}], got {choice.dtype} {tuple(choice.shape)}")
    choice_column_kernel[1, IO_THREADS, stream](top_ids, choice)


def gather_results(packed, num_nodes, top_ids, accepted, tau, bonus, out, stream=0) -> ResultLayout:
    """Fill ``out`` (device int32 [layout.size]) with request 0's step results (see gather_results_kernel);
    returns the layout to read it with."""
    nodes, width = top_ids.shape[0], accepted.shape[1]
    layout = ResultLayout(nodes, width)
    if tuple(out.shape) != (layout.size,) or out.dtype != np.int32:
        raise ValueError(f"out must be int32 [{layout.size}], got {out.dtype} {tuple(out.shape)}")
    if packed.shape[2] < nodes:
        raise ValueError(f"packed holds {packed.shape[2]} nodes, the top-k {nodes}")
    gather_results_kernel[1, IO_THREADS, stream](packed, num_nodes, top_ids, accepted, tau, bonus, out)
    return layout
