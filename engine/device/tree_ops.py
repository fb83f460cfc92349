"""DeviceTreeOps: token choice, tree build and accept of a DDTree step on the device kernels."""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.device.logits import DeviceLogits
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.numba_kernels import sampling
from kdspec.numba_kernels.tree import accept as tree_accept
from kdspec.numba_kernels.tree import build as tree_build
from kdspec.traces.schema import TARGET_TOPK


class _Buffers:
    """Device buffers of one budget's steps, allocated once: the built tree, the build's root / prefix length
    inputs, the target's choice per node and the accept walk's outputs."""

    def __init__(self, budget: int):
        nodes = budget + 1
        self.tree = tree_build.TreeBatch.allocate(1, budget)
        self.scalars = cuda.device_array((2, 1), np.int32)            # root token, prefix length
        self.root_tokens, self.prefix_lens = self.scalars[0], self.scalars[1]
        self.choice = cuda.device_array((1, nodes), np.int32)
        self.accepted = (cuda.device_array((1, nodes), np.int32), cuda.device_array(1, np.int32),
                         cuda.device_array(1, np.int32))


class DeviceTreeOps:
    """Token choice, tree build and accept on the device kernels (one request per launch here).

    A step's build and accept reuse one budget's device buffers, and accept walks the tree this object built
    last from its device copy (only the target's choice goes up): the host uploads and allocations were most of
    those stages' host time (BENCHMARKS.md, "Where that host time goes"). Steps must not interleave: one decode
    at a time per object."""

    def __init__(self):
        self._buffers: dict[int, _Buffers] = {}
        self._built = None   # (tokens, parents) of the last tree built, and its _Buffers

    def _buffers_for(self, budget: int) -> _Buffers:
        if budget not in self._buffers:
            self._buffers[budget] = _Buffers(budget)
        return self._buffers[budget]

    @staticmethod
    def choose_tokens(logits, temperature: float, seed: int, positions: np.ndarray) -> np.ndarray:
        """logits: DeviceLogits (chosen where they are) or a host array [s, V] (uploaded)."""
        kept = logits if isinstance(logits, DeviceLogits) else None
        logits = (logits.device if kept is not None
                  else cuda.to_device(np.ascontiguousarray(logits, dtype=np.float32)))
        if temperature == 0 and kept is not None and logits.shape[1] >= TARGET_TOPK:
            # Greedy choice = the first of the top-k (same tie rule); the step record then reuses the top-k
            # instead of another pass over the vocabulary.
            top_ids, top_values, margins = sampling.topk_rows(logits, TARGET_TOPK)
            host_ids = top_ids.copy_to_host()
            kept._topk = (TARGET_TOPK, host_ids, top_values, margins)  # ids already here: one copy fewer
            ids = host_ids[:, 0]
        elif temperature == 0:
            ids = sampling.argmax_rows(logits)
        else:
            ids = sampling.sample_rows(logits, float(temperature), int(seed), np.asarray(positions, dtype=np.int64))
        ids = ids.copy_to_host() if hasattr(ids, "copy_to_host") else np.asarray(ids)
        return ids.astype(np.int64)

    def build_tree(self, draft_logprobs, draft_ids, root_token: int, budget: int, prefix_len: int) -> ddtree_ref.Tree:
        """The tree on the host for accept and the record; its visibility is the build kernel's packed bitmask
        uint32 [N+1, W] left on the device (valid until the next build at this budget), which the verify
        forward hands to attention as it is."""
        ddtree_ref.check_draft(draft_logprobs, draft_ids, budget)
        buffers = self._buffers_for(budget)
        buffers.scalars.copy_to_device(np.array([[root_token], [prefix_len]], np.int32))
        batch = tree_build.build_trees(np.ascontiguousarray(draft_logprobs[None], dtype=np.float32),
                                       np.ascontiguousarray(draft_ids[None], dtype=np.int32),
                                       buffers.root_tokens, buffers.prefix_lens, budget, out=buffers.tree)
        packed = batch.packed.copy_to_host()  # two device reads in all: the node arrays and the count
        count = int(batch.num_nodes.copy_to_host()[0])
        built = {name: packed[row, 0, :count] for row, name in enumerate(tree_build.OUTPUT_ROWS)}
        tree = ddtree_ref.Tree(tokens=built["tokens"].astype(np.int64), parents=built["parents"],
                               depths=built["depths"], ranks=built["ranks"],
                               scores=built["scores"].view(np.float32), positions=built["positions"].astype(np.int64),
                               visibility=batch.visibility[0, :count])
        self._built = (tree.tokens, tree.parents, buffers)
        return tree

    def accept(self, parents, tokens, target_choice) -> tuple[np.ndarray, int]:
        count = len(parents)
        built = self._built
        if built is not None and tokens is built[0] and parents is built[1]:
            # the tree built last: its nodes and count are on the device; only the choice goes up
            buffers = built[2]
            width = buffers.choice.shape[1]
            choice = np.full((1, width), -1, np.int32)
            choice[0, :count] = target_choice
            buffers.choice.copy_to_device(choice)
            tree = buffers.tree
            accepted, tau, bonus = tree_accept.accept_trees(tree.parents, tree.tokens, buffers.choice,
                                                            tree.num_nodes, width - 1, out=buffers.accepted)
        else:
            accepted, tau, bonus = tree_accept.accept_trees(np.asarray(parents, np.int32)[None],
                                                            np.asarray(tokens, np.int32)[None],
                                                            np.asarray(target_choice, np.int32)[None],
                                                            np.array([count], np.int32), count)
        host = lambda a: a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)  # noqa: E731
        tau = int(host(tau)[0])
        return host(accepted)[0, :tau].astype(np.int32), int(host(bonus)[0])
