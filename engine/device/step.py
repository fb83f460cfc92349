"""DeviceSteps: a whole AR or DDTree step on the device, captured as one CUDA graph per shape.

A DDTree step queued by ``ddtree`` is, with no host read in between:

    build (the draft uploaded) -> the tree's tokens and positions into the forward's inputs -> the forward
    (cache rows written and attention from the cache length the device keeps) -> top-k of the logits (the
    target's greedy choice is its column 0) -> accept -> compaction, skipping rows in place, and the length
    advanced by tau -> the results gathered into one buffer

and ``finish`` reads that buffer in one copy (``finish_path``: the tree's tokens, the accepted path and the bonus
alone, for a run that builds no records). An AR step is the forward of the one token the host uploads, its
top-k and the length advanced by one. On cuda the second step of a shape (budget and node count; the cache's
arrays) is captured and every later one replays the graph: one launch a step. The uploads are the graph's first
nodes, copies of the pinned buffers the host fills before each replay, so a step costs the host one graph launch
and one read. The first step of a shape runs the same launches eagerly (it compiles every kernel and warms
cuBLAS); under the simulator every step does. The results are the ones the step-by-step path (DeviceTreeOps
and DeviceModel.forward) computes, bit for bit: the same kernels on the same inputs
(tests/engine/test_device_steps.py).

With ``stamps`` set (numba_kernels/clock.py), each step's launches begin and end with a stamp of the GPU's clock:
a benchmark reads the GPU's busy time per step from them, in the same run as the wall time (the graphs of such
steps are their own shapes).

What it needs (``DeviceSteps.supports``): the batch-invariant device model (its attention reads the prefix
length on the device), no kept hidden states (a block drafter's), greedy choice (T = 0).
The logits and top-k a step returns live in the graph's buffers: valid until the next step of that shape
(the decode loop reads what a record needs before the next step).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.device.logits import DeviceLogits
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.numba_kernels import sampling
from kdspec.numba_kernels.attention.common import causal_visibility
from kdspec.numba_kernels.attention.invariant import VisibleKeys
from kdspec.numba_kernels.host_arrays import download, upload
from kdspec.numba_kernels.tree import accept as tree_accept
from kdspec.numba_kernels.tree import build as tree_build
from kdspec.numba_kernels.tree import compact as tree_compact
from kdspec.numba_kernels.tree import step_io
from kdspec.traces.schema import TARGET_TOPK

MAX_SHAPES = 16  # captured step graphs kept for one cache (AR, one per budget and tree shape; oldest dropped)


def tree_size(depths: int, width: int, budget: int) -> int:
    """Nodes of the best-first tree (the root included) over ``depths`` x ``width`` candidates at ``budget``:
    min(B, sum of K^d for d = 1..L) + 1 (the build pops until the budget or the candidates run out)."""
    total, level = 0, 1
    for _ in range(depths):
        level *= width
        total += level
        if total >= budget:
            return budget + 1
    return min(total, budget) + 1


def _stamp(stamps, end: bool, stream) -> None:
    """The GPU's clock at a step's first (end False) or last launch, where a benchmark asked for stamps."""
    if stamps is not None:
        stamps.stamp(end, stream)


class _Shape:
    """The device buffers of one step shape, allocated once: the forward's state, its key table, the top-k, and
    (DDTree) the tree, its inputs, the accept walk's outputs, the results and their pinned host copy."""

    def __init__(self, model, cache, nodes: int, budget: int | None, draft_shape: tuple[int, int] | None):
        self.nodes, self.storage = nodes, cache.storage  # the graphs name these arrays: kept alive with them
        self.state = model.new_step_state(nodes)
        self.keys = VisibleKeys(cuda.device_array((nodes, nodes), np.int32), cuda.device_array(nodes, np.int32))
        self.graph, self.runs = None, 0
        if budget is None:  # AR: one causal row, its token and position uploaded by the host
            self.ids_host = cuda.pinned_array((2, nodes), np.int64)
            self.mask = cuda.to_device(causal_visibility(nodes))
            self.one = cuda.to_device(np.ones(1, np.int32))
            self.choice_host = cuda.pinned_array((1, 1), np.int32)
            return
        depth, width = draft_shape
        self.draft = cuda.device_array((2, 1, depth, width), np.int32)  # log-prob bits, then ids: one upload
        self.draft_host = cuda.pinned_array((2, 1, depth, width), np.int32)
        self.scalars = cuda.device_array((2, 1), np.int32)               # root token, prefix length
        self.scalars_host = cuda.pinned_array((2, 1), np.int32)
        self.tree = tree_build.TreeBatch.allocate(1, budget)
        self.mask = self.tree.visibility[0, :nodes]
        self.choice = cuda.device_array((1, nodes), np.int32)
        self.accepted = (cuda.device_array((1, nodes), np.int32), cuda.device_array(1, np.int32),
                         cuda.device_array(1, np.int32))
        self.layout = step_io.ResultLayout(nodes, nodes)
        self.results = cuda.device_array(self.layout.size, np.int32)
        self.results_host = cuda.pinned_array(self.layout.size, np.int32)


class DeviceSteps:
    """AR and DDTree steps of one DeviceModel, each one launch sequence (one CUDA graph replay on cuda); see the
    module docstring. One decode at a time per object."""

    def __init__(self, model):
        self.model = model
        self._shapes: dict = {}
        self._pending = None
        self.stamps = None  # numba_kernels.clock.Stamps: each step's first and last GPU work stamped (benchmarks)

    @staticmethod
    def supports(model, cache, temperature: float) -> bool:
        check = getattr(model, "supports_device_steps", None)
        return temperature == 0 and check is not None and check(cache)

    # -- shapes and graphs ---------------------------------------------------------------------------
    def _shape(self, cache, key, make) -> _Shape:
        """The buffers (and graph) of step shape ``key`` over ``cache``'s arrays. Only one cache's shapes are
        kept: a decode over other arrays drops them (their graphs and buffers) and captures anew."""
        if self._shapes and next(iter(self._shapes.values())).storage is not cache.storage:
            self._shapes.clear()
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.pop(next(iter(self._shapes)))
            shape = self._shapes[key] = make()
        return shape

    def _run(self, shape: _Shape, body) -> None:
        """body(stream) eagerly the first time (compiles, warms cuBLAS) and on the simulator; captured the second
        time on cuda, then replayed."""
        ops = self.model.ops
        shape.runs += 1
        if not self.model.use_graphs or shape.runs < 2:
            body(0)
            return
        if shape.graph is None:
            shape.graph = ops.segment_graphs(ops.torch, lambda _k, _state, stream: body(stream), 1, shape.state)
        shape.graph.replay(0)

    @staticmethod
    def _top(shape: _Shape, topk: int, stream):
        logits = shape.state["logits"]
        shape.state["top"] = sampling.topk_rows(logits, min(topk, logits.shape[1]), stream=stream)
        return shape.state["top"]

    def _logits(self, shape: _Shape) -> DeviceLogits:
        ids, values, margins = shape.state["top"]
        return DeviceLogits(shape.state["logits"], self.model.ops.to_host, topk=(ids.shape[1], ids, values, margins))

    # -- AR ----------------------------------------------------------------------------------------------
    def ar(self, cache, root: int, topk: int = TARGET_TOPK) -> None:
        """Queue the AR step of ``root`` at position cache.length (its row committed on the device too) with the
        top-``topk`` of its logits (1: the greedy choice alone; a record reads TARGET_TOPK); ``finish_ar`` reads
        it."""
        model = self.model
        prefix = cache.length
        if prefix + 1 > cache.capacity or prefix >= model.cfg.max_position_embeddings:
            raise ValueError(f"one new row after {prefix} exceeds the cache capacity {cache.capacity}")
        stamps = self.stamps
        shape = self._shape(cache, ("ar", topk, stamps), lambda: _Shape(model, cache, 1, None, None))
        shape.ids_host[:, 0] = (root, prefix)
        length = cache.device_length()

        def body(stream):
            _stamp(stamps, False, stream)
            upload(shape.state["ids"], shape.ids_host, stream)  # in the graph: its first node reads ids_host
            model.forward_on_device(shape.state, cache, shape.mask, shape.keys, stream)
            self._top(shape, topk, stream)
            tree_compact.advance_lengths_kernel[1, 1, stream](length, shape.one)
            _stamp(stamps, True, stream)

        self._run(shape, body)
        self._pending = (cache, shape, prefix)

    def finish_ar(self, logits: bool = True) -> tuple[DeviceLogits | None, np.ndarray]:
        """The queued AR step's logits [1, V] (None unless ``logits``: a record reads them) and greedy choice
        int64 [1] (one copy read); the cache's length advanced by one on the host too."""
        cache, shape, _ = self._pending
        self._pending = None
        download(shape.choice_host, shape.state["top"][0][:, :1])  # [1, 1]: the greedy choice alone
        cache.advanced_on_device(1)
        return self._logits(shape) if logits else None, shape.choice_host[0].astype(np.int64)

    # -- DDTree --------------------------------------------------------------------------------------
    def ddtree(self, cache, draft_logprobs: np.ndarray, draft_ids: np.ndarray, root: int, budget: int,
               topk: int = TARGET_TOPK) -> None:
        """Queue a whole DDTree step (module docstring) over the draft [L, K] at budget B, with the top-``topk``
        of every node's logits (as ``ar``); ``finish`` reads it."""
        ddtree_ref.check_draft(draft_logprobs, draft_ids, budget)
        model, prefix = self.model, cache.length
        depth, width = draft_ids.shape
        nodes = tree_size(depth, width, budget)
        if prefix + nodes > cache.capacity or prefix + depth >= model.cfg.max_position_embeddings:
            raise ValueError(f"a tree of {nodes} nodes after {prefix} rows does not fit the cache of "
                             f"{cache.capacity} rows or the positions")
        stamps = self.stamps
        shape = self._shape(cache, ("ddtree", budget, nodes, depth, width, topk, stamps),
                            lambda: _Shape(model, cache, nodes, budget, (depth, width)))
        shape.draft_host[0, 0] = draft_logprobs.view(np.int32)
        shape.draft_host[1, 0] = draft_ids
        shape.scalars_host[:, 0] = (root, prefix)
        length = cache.device_length()
        tree, (accepted, tau, bonus) = shape.tree, shape.accepted

        def body(stream):
            _stamp(stamps, False, stream)
            upload(shape.draft, shape.draft_host, stream)  # in the graph: copies of the pinned buffers as they
            upload(shape.scalars, shape.scalars_host, stream)  # are at each replay, no driver call of their own
            tree_build.build_trees(shape.draft[0].view(np.float32), shape.draft[1], shape.scalars[0],
                                   shape.scalars[1], budget, out=tree, stream=stream)
            step_io.tree_inputs(tree.packed, shape.state["tokens"], shape.state["positions"], stream=stream)
            model.forward_on_device(shape.state, cache, shape.mask, shape.keys, stream)
            top_ids = self._top(shape, topk, stream)[0]
            step_io.choice_column(top_ids, shape.choice, stream=stream)
            tree_accept.accept_trees(tree.parents[:, :nodes], tree.tokens[:, :nodes], shape.choice,
                                     tree.num_nodes, nodes - 1, out=shape.accepted, stream=stream)
            tree_compact.compact_on_device([cache.kv], length, accepted, tau, stream=stream)
            step_io.gather_results(tree.packed, tree.num_nodes, top_ids, accepted, tau, bonus, shape.results,
                                   stream=stream)
            _stamp(stamps, True, stream)

        self._run(shape, body)
        self._pending = (cache, shape, prefix)

    def finish(self) -> tuple[ddtree_ref.Tree, DeviceLogits, np.ndarray, np.ndarray, int]:
        """The queued step's (tree, logits, choice int64 [N+1], accepted int32 [tau], bonus), read in one copy;
        the cache's length advanced by tau on the device and the host."""
        cache, shape, found = self._read()
        layout, nodes = shape.layout, shape.nodes
        rows = found[layout.tree:layout.tree + step_io.TREE_ROWS * nodes].reshape(step_io.TREE_ROWS, nodes).copy()
        built = {name: rows[row] for row, name in enumerate(tree_build.OUTPUT_ROWS)}
        tree = ddtree_ref.Tree(tokens=built["tokens"].astype(np.int64), parents=built["parents"],
                               depths=built["depths"], ranks=built["ranks"], scores=built["scores"].view(np.float32),
                               positions=built["positions"].astype(np.int64), visibility=shape.mask)
        accepted, bonus = self._path(cache, shape, found)
        choice = found[layout.choice:layout.choice + nodes].astype(np.int64)
        return tree, self._logits(shape), choice, accepted, bonus

    def finish_path(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The queued step's (tree tokens int32 [N+1], accepted int32 [tau], bonus) alone, read in one copy (the
        rest of ``finish`` is for records); the cache's length advanced by tau on the device and the host."""
        cache, shape, found = self._read()
        start = shape.layout.tree + tree_build.TOKENS * shape.nodes
        accepted, bonus = self._path(cache, shape, found)
        return found[start:start + shape.nodes].copy(), accepted, bonus

    def _read(self):
        """(cache, shape, the pinned results) of the queued step, which is no longer queued: read back and
        checked."""
        cache, shape, _ = self._pending
        self._pending = None
        download(shape.results_host, shape.results)
        found = shape.results_host
        if found[shape.layout.count] != shape.nodes:
            raise RuntimeError(f"the tree build gave {found[shape.layout.count]} nodes, the step was shaped for "
                               f"{shape.nodes}")
        return cache, shape, found

    @staticmethod
    def _path(cache, shape: _Shape, found: np.ndarray) -> tuple[np.ndarray, int]:
        """(accepted int32 [tau], bonus) from the results; the cache's length advanced by tau on the host too."""
        layout = shape.layout
        tau = int(found[layout.tau])
        accepted = found[layout.accepted:layout.accepted + tau].copy()
        cache.advanced_on_device(tau)
        return accepted, int(found[layout.bonus])
